//! The engine's host across the helper's socket: [`serve`] answers
//! `space_privsep`'s requests by calling the [`EngineHost`] method of the
//! same name (a [`LocalHost`](crate::gvisor::LocalHost) in the root
//! helper), and [`HelperHost`] is an [`EngineHost`] that sends them, so the
//! gVisor engine runs the same way whichever side of the socket its host
//! is on.
//!
//! A start is answered twice on its connection: `Started` with the agent's
//! listener as soon as runsc runs (the agent may dial while `runsc run
//! --detach` still works), then `Done` or a refusal when runsc returned —
//! what [`Launched::finished`](crate::host::Launched) waits for.

mod client;
mod serve;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub use client::HelperHost;
pub use serve::{serve, serve_all, serve_engines, serve_with_templates, Engines};
use space_privsep::layout::Layout;
use space_privsep::peer::{HelperListener, PeerError};
use space_privsep::proto::{StartStep, StepTook};

use crate::firecracker::{FirecrackerConfig, FirecrackerHost};
use crate::gvisor::{GvisorConfig, LocalConfig, LocalHost};
use crate::templates::LocalTemplates;
use crate::volumes::LocalVolumes;
use crate::Steps;

/// The root helper's work: the gVisor engine's host, the templates' and
/// the volumes' in this process (which must be root; image archives are
/// parsed, and volumes' files served, by `importer_bin`'s confined
/// children), served at `socket` to processes of
/// `allowed_uid` alone, until accepting fails.
pub async fn serve_gvisor(
    config: GvisorConfig,
    importer_bin: &Path,
    socket: &Path,
    allowed_uid: u32,
) -> Result<(), PeerError> {
    serve_helper(config, None, None, importer_bin, socket, allowed_uid).await
}

/// [`serve_gvisor`], and Firecracker microVMs' root work too when
/// `firecracker` is given; volumes kept as images in the shared store at
/// `shared_volumes` when it is given.
pub async fn serve_helper(
    config: GvisorConfig,
    firecracker: Option<FirecrackerConfig>,
    shared_volumes: Option<&Path>,
    importer_bin: &Path,
    socket: &Path,
    allowed_uid: u32,
) -> Result<(), PeerError> {
    let listener = HelperListener::bind(socket, allowed_uid)?;
    let layout = Layout::new(crate::gvisor::data_dir_of(&config.state_dir));
    let templates = LocalTemplates::new(layout.clone(), config.agent_bin.clone()).with_importer(importer_bin);
    // The same binary serves a volume's files from its confined child.
    let volumes = LocalVolumes::new(layout.clone(), importer_bin);
    let volumes = match shared_volumes {
        Some(dir) => volumes.with_shared(crate::volumes::SharedStore::open(dir).map_err(|e| PeerError::Io {
            context: "opening the shared volume store",
            source: std::io::Error::other(e.to_string()),
        })?),
        None => volumes,
    };
    let host = LocalHost::new(LocalConfig {
        runsc: config.runsc,
        agent_bin: config.agent_bin,
        state_dir: config.state_dir,
        layout,
    });
    let engines = Engines {
        gvisor: Some(Arc::new(host)),
        firecracker: firecracker
            .map(|config| Arc::new(FirecrackerHost::new(config)) as Arc<dyn crate::host::EngineHost>),
    };
    serve_all(listener, engines, Some(Arc::new(templates)), Some(Arc::new(volumes))).await
}

/// The start steps the helper does, by the names the engine reports them
/// under (the same with either host).
const START_STEPS: [(StartStep, &str); 3] = [
    (StartStep::RootSnapshot, "root snapshot (btrfs)"),
    (StartStep::DiskLimit, "disk limit (btrfs qgroup)"),
    (StartStep::BundleAndSocket, "bundle and agent socket"),
];

/// A start's steps as a reply names them; one without a name there is
/// left out (and logged).
fn steps_to_wire(steps: &Steps) -> Vec<StepTook> {
    steps
        .iter()
        .filter_map(|(name, took)| match START_STEPS.iter().find(|(_, known)| known == name) {
            Some((step, _)) => Some(StepTook { step: *step, micros: took.as_micros() as u64 }),
            None => {
                tracing::warn!(step = name, "a start step the request set does not name");
                None
            }
        })
        .collect()
}

fn steps_from_wire(steps: &[StepTook]) -> Steps {
    steps
        .iter()
        .filter_map(|took| {
            let name = START_STEPS.iter().find(|(step, _)| *step == took.step)?.1;
            Some((name, Duration::from_micros(took.micros)))
        })
        .collect()
}
