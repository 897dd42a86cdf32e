//! Prometheus metrics, served at `GET /metrics` in the text exposition
//! format (the `prometheus-client` crate). Counters and histograms are
//! updated where things happen (the API edge, operations, commands, the
//! warm pool); gauges of current state (sandboxes by state, the pool,
//! capacity) are read from the platform at scrape time. No label is
//! unbounded: routes are templates, never ids.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use space_api::{Operation, OperationKind, OperationState};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    pub route: String,
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub method: String,
    pub route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub kind: String,
    pub engine: String,
    pub outcome: String,
    /// For creates: `hot` or `warm` (from the pools) or `cold`; else empty.
    pub start: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SandboxLabels {
    pub state: String,
    pub engine: String,
    pub template: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamLabels {
    pub stream: String,
}

fn latency_histogram() -> Histogram {
    // 1 ms .. ~33 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

fn operation_histogram() -> Histogram {
    // 5 ms .. ~160 s.
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

/// Everything counted, and the registry that encodes it.
pub struct Metrics {
    pub(crate) registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub request_seconds: Family<RouteLabels, Histogram, fn() -> Histogram>,
    pub operation_seconds: Family<OperationLabels, Histogram, fn() -> Histogram>,
    pub sandboxes: Family<SandboxLabels, Gauge>,
    pub warm_members: Gauge,
    pub hot_members: Gauge,
    pub dozing: Gauge,
    pub warm_hits: Counter,
    pub warm_misses: Counter,
    pub capacity_promised: Gauge,
    pub capacity_total: Gauge,
    pub command_starts: Counter,
    pub command_exits: Family<OutcomeLabels, Counter>,
    pub output_bytes: Family<StreamLabels, Counter>,
    /// Creates served by a pool member, and which kind, until their operation ends.
    pool_creates: Mutex<HashMap<String, &'static str>>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("space");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register("http_requests", "API requests by route template, method and status", requests.clone());
        let request_seconds =
            Family::<RouteLabels, Histogram, fn() -> Histogram>::new_with_constructor(latency_histogram);
        registry.register(
            "http_request_duration_seconds",
            "API request latency by route template",
            request_seconds.clone(),
        );
        let operation_seconds =
            Family::<OperationLabels, Histogram, fn() -> Histogram>::new_with_constructor(operation_histogram);
        registry.register(
            "operation_duration_seconds",
            "Operations from acceptance to their end, by kind, engine, outcome and (creates) warm or cold start",
            operation_seconds.clone(),
        );
        let sandboxes = Family::<SandboxLabels, Gauge>::default();
        registry.register("sandboxes", "Sandboxes by state, engine and template", sandboxes.clone());
        let warm_members = Gauge::default();
        registry.register(
            "warm_pool_members",
            "Warm (pre-started, paused) sandboxes ready to hand out",
            warm_members.clone(),
        );
        let hot_members = Gauge::default();
        registry.register(
            "hot_pool_members",
            "Of the pools' members, those waiting running (handed out without a thaw)",
            hot_members.clone(),
        );
        let dozing = Gauge::default();
        registry.register(
            "sandboxes_dozing",
            "Running sandboxes told idle (their engine's timers coarsened); hot pool members not counted",
            dozing.clone(),
        );
        let warm_hits = Counter::default();
        registry.register("warm_pool_hits", "Creates served from the warm pool", warm_hits.clone());
        let warm_misses = Counter::default();
        registry.register("warm_pool_misses", "Creates that started a sandbox cold", warm_misses.clone());
        let capacity_promised = Gauge::default();
        registry.register(
            "capacity_promised_mib",
            "Memory promised to sandboxes and warm members",
            capacity_promised.clone(),
        );
        let capacity_total = Gauge::default();
        registry.register("capacity_mib", "Memory the host can promise to sandboxes", capacity_total.clone());
        let command_starts = Counter::default();
        registry.register("command_starts", "Commands started", command_starts.clone());
        let command_exits = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "command_exits",
            "Commands ended, by outcome (exit_zero, exit_nonzero, signal, timeout, oom, lost)",
            command_exits.clone(),
        );
        let output_bytes = Family::<StreamLabels, Counter>::default();
        registry.register("command_output_bytes", "Bytes commands wrote, by stream", output_bytes.clone());
        Metrics {
            registry,
            requests,
            request_seconds,
            operation_seconds,
            sandboxes,
            warm_members,
            hot_members,
            dozing,
            warm_hits,
            warm_misses,
            capacity_promised,
            capacity_total,
            command_starts,
            command_exits,
            output_bytes,
            pool_creates: Mutex::default(),
        }
    }

    /// A create is served from the pool (a `hot` or `warm` member) or
    /// started cold (`None`).
    pub(crate) fn create_started(&self, operation_id: &str, member: Option<&'static str>) {
        match member {
            Some(start) => {
                self.warm_hits.inc();
                self.pool_creates.lock().unwrap_or_else(|e| e.into_inner()).insert(operation_id.to_string(), start);
            }
            None => {
                self.warm_misses.inc();
            }
        }
    }

    /// An operation ended: its duration from acceptance.
    pub(crate) fn operation_ended(&self, operation: &Operation, engine: &str) {
        let member = self.pool_creates.lock().unwrap_or_else(|e| e.into_inner()).remove(&operation.id);
        let start = match operation.kind {
            OperationKind::Create => member.unwrap_or("cold"),
            _ => "",
        };
        let outcome = match operation.state {
            OperationState::Succeeded => "succeeded",
            OperationState::Failed => "failed",
            OperationState::Cancelled => "cancelled",
            OperationState::Pending | OperationState::Running => return,
        };
        let Some(to) = operation.finished_at else {
            return;
        };
        let seconds = to.system_time().duration_since(operation.created_at.system_time()).unwrap_or(Duration::ZERO);
        let seconds = seconds.as_secs_f64();
        let kind = serde_json::to_value(operation.kind).ok().and_then(|v| v.as_str().map(str::to_string));
        let labels = OperationLabels {
            kind: kind.unwrap_or_default(),
            engine: engine.to_string(),
            outcome: outcome.into(),
            start: start.into(),
        };
        self.operation_seconds.get_or_create(&labels).observe(seconds);
    }

    /// A command ended: how, and what it wrote.
    pub(crate) fn command_ended(&self, result: &space_api::ProcessResult) {
        let outcome = match (result.exit_code, &result.signal) {
            _ if result.timed_out => "timeout",
            _ if result.oom_killed => "oom",
            (Some(0), _) => "exit_zero",
            (Some(_), _) => "exit_nonzero",
            (None, Some(_)) => "signal",
            (None, None) => "lost",
        };
        self.command_exits.get_or_create(&OutcomeLabels { outcome: outcome.into() }).inc();
        self.output_bytes.get_or_create(&StreamLabels { stream: "stdout".into() }).inc_by(result.stdout_bytes);
        self.output_bytes.get_or_create(&StreamLabels { stream: "stderr".into() }).inc_by(result.stderr_bytes);
    }
}
