//! The binary's metrics: `metrics` takes one global recorder per process, so every test of a
//! binary that reads metrics reads this one, each under policy names of its own.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The Prometheus recorder of this process, installed on first use.
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).expect("no other recorder in this binary");
        handle
    })
}

/// The value of the sample whose name and labels are exactly `series`, e.g.
/// `ratelimit_allowed_total{policy="login"}`, in the Prometheus text `text`.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter_map(|line| line.rsplit_once(' '))
        .find(|(name, _)| *name == series)
        .and_then(|(_, value)| value.parse().ok())
}
