//! The metrics page: counters and histograms as they were kept, gauges of
//! current state read from the platform now.

use space_api::SandboxState;

use crate::metrics::SandboxLabels;
use crate::platform::Platform;

impl Platform {
    /// The metrics in Prometheus's text format, gauges read now.
    pub fn metrics_text(&self) -> String {
        let metrics = &self.metrics;
        metrics.sandboxes.clear();
        for record in self.store.node().sandboxes().unwrap_or_default() {
            if record.sandbox.state == SandboxState::Deleted {
                continue;
            }
            let labels = SandboxLabels {
                state: record.sandbox.state.as_str().into(),
                engine: record.sandbox.engine.clone(),
                template: record.sandbox.template.clone(),
            };
            metrics.sandboxes.get_or_create(&labels).inc();
        }
        metrics.warm_members.set(self.warm.count() as i64);
        metrics.hot_members.set(self.warm.hot_count() as i64);
        let dozing = self.dozing.lock().unwrap_or_else(|e| e.into_inner());
        metrics.dozing.set(dozing.values().filter(|d| **d == crate::platform::Doze::Dozing).count() as i64);
        drop(dozing);
        metrics.capacity_promised.set(self.reserved_mib() as i64);
        metrics.capacity_total.set(self.capacity_mib as i64);
        let mut text = String::new();
        if let Err(err) = prometheus_client::encoding::text::encode(&mut text, &metrics.registry) {
            tracing::error!("encoding the metrics: {err}");
        }
        text
    }
}
