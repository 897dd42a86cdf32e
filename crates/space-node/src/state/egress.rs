//! The egress sockets a node serves, and the queue of their events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use space_egress::gateway::{Event, GatewayConfig, SandboxEgress};
use tokio::sync::mpsc;

/// Events waiting to be stored, at most.
const EVENT_QUEUE: usize = 4096;

/// The egress sockets being served, by sandbox.
pub(crate) struct EgressHub {
    pub(crate) config: Mutex<GatewayConfig>,
    /// The operator's fixed answers, when given (its lookups are counted).
    pub(crate) static_names: Mutex<Option<Arc<space_egress::gateway::StaticResolver>>>,
    pub(crate) live: Mutex<HashMap<String, Arc<SandboxEgress>>>,
    pub(crate) events: mpsc::Sender<(String, Event)>,
    pub(crate) queued: Mutex<Option<mpsc::Receiver<(String, Event)>>>,
    /// Sandboxes whose agent may hold another environment than
    /// `sandbox_env` (secrets.rs) (its network changed, or it is an
    /// agent that kept its memory: re-adopted, resumed, woken from an
    /// image), each with the count of the change: given before its next
    /// command, and forgotten only if nothing changed meanwhile.
    pub(crate) env_due: Mutex<HashMap<String, u64>>,
    pub(crate) env_changes: std::sync::atomic::AtomicU64,
}

impl EgressHub {
    pub(crate) fn new(config: GatewayConfig) -> EgressHub {
        let (events, queued) = mpsc::channel(EVENT_QUEUE);
        EgressHub {
            config: Mutex::new(config),
            static_names: Mutex::default(),
            live: Mutex::default(),
            events,
            queued: Mutex::new(Some(queued)),
            env_due: Mutex::default(),
            env_changes: Default::default(),
        }
    }
}
