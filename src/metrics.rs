//! Prometheus metrics: counters the daemon's loop bumps (a short lock, no
//! I/O), and an HTTP thread that renders them together with gauges it reads
//! through its own read-only SQLite connection — a scrape never waits on, or
//! delays, an allocation. No per-pod labels: label sets are bounded by
//! networks, methods and statuses.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use crate::cidr::Family;
use crate::log;
use crate::store::Store;

/// Upper bounds (seconds) of the request latency histogram.
const LATENCY_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How long a scraper may take to send its request.
const SCRAPE_READ_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Histogram {
    buckets: [u64; LATENCY_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (bucket, bound) in self.buckets.iter_mut().zip(LATENCY_BUCKETS) {
            if seconds <= bound {
                *bucket += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }
}

#[derive(Default)]
struct Counters {
    /// (method, status) → requests handled.
    requests: BTreeMap<(&'static str, String), u64>,
    latency: BTreeMap<&'static str, Histogram>,
    /// (action, network) → times the monitor did it.
    monitor_actions: BTreeMap<(&'static str, String), u64>,
    /// network → requests parked right now.
    parked: BTreeMap<String, i64>,
    api_errors: u64,
    /// Versions a watch delivered twice (ignored; the object is listed again).
    stale_versions: u64,
    /// `status.podCIDRs` entries refused (overlapping, too large).
    refused_pod_cidrs: u64,
    recovered_at_boot: u64,
}

/// Shared between the loop (writer) and the HTTP thread (reader).
#[derive(Default)]
pub struct Metrics {
    counters: Mutex<Counters>,
}

impl Metrics {
    fn with<T>(&self, f: impl FnOnce(&mut Counters) -> T) -> T {
        // A poisoned lock only means a panicking reader; the data is plain
        // counters and still usable.
        let mut guard = self.counters.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut guard)
    }

    /// One handled request: its method, status name and latency.
    pub fn observe_request(&self, method: &'static str, status: &str, elapsed: Duration) {
        self.with(|c| {
            *c.requests.entry((method, status.to_string())).or_default() += 1;
            c.latency
                .entry(method)
                .or_default()
                .observe(elapsed.as_secs_f64());
        });
    }

    /// The monitor did `action` (scale_up, drain, release, delete) on a network.
    pub fn monitor_action(&self, action: &'static str, network: &str) {
        self.with(|c| {
            *c.monitor_actions
                .entry((action, network.to_string()))
                .or_default() += 1
        });
    }

    /// The current parked requests per network.
    pub fn set_parked(&self, parked: BTreeMap<String, i64>) {
        self.with(|c| {
            // Keep networks that drained to zero visible as 0.
            for value in c.parked.values_mut() {
                *value = 0;
            }
            c.parked.extend(parked);
        });
    }

    pub fn api_error(&self) {
        self.with(|c| c.api_errors += 1);
    }

    pub fn stale_version(&self) {
        self.with(|c| c.stale_versions += 1);
    }

    pub fn refused_pod_cidrs(&self, count: u64) {
        self.with(|c| c.refused_pod_cidrs += count);
    }

    pub fn recovered_at_boot(&self, addresses: u64) {
        self.with(|c| c.recovered_at_boot += addresses);
    }

    /// The Prometheus text exposition of the counters and of `store`'s gauges.
    pub fn render(&self, store: Option<&Store>) -> String {
        let mut out = String::new();
        family(&mut out, "metis_build_info", "gauge", "Build information.");
        let _ = writeln!(
            out,
            "metis_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        if let Some(store) = store {
            render_store(&mut out, store);
        }
        self.with(|c| render_counters(&mut out, c));
        out
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Escapes a label value (network names are caller-chosen text).
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn render_store(out: &mut String, store: &Store) {
    let stats = match store.stats(log::now_ms()) {
        Ok(stats) => stats,
        Err(err) => {
            log::warn("metrics", "reading store gauges failed", &[("error", &err)]);
            return;
        }
    };
    family(
        out,
        "metis_local_store_ip_total",
        "gauge",
        "Addresses in the local store by type.",
    );
    for ((network, ip_family), s) in &stats {
        let types = [
            ("available", s.available),
            ("allocated", s.allocated),
            ("cooldown", s.cooldown),
            ("draining", s.draining),
            ("deleting", s.deleting),
            ("total", s.total),
        ];
        for (kind, value) in types {
            let _ = writeln!(
                out,
                "metis_local_store_ip_total{{network=\"{}\",ip_family=\"{}\",type=\"{kind}\"}} {value}",
                label(network),
                family_label(*ip_family)
            );
        }
    }
    family(
        out,
        "metis_local_store_cidr_block_total",
        "gauge",
        "CIDR blocks in the local store by state.",
    );
    for ((network, ip_family), s) in &stats {
        for (state, value) in ["ready", "draining", "deleting"].iter().zip(s.blocks) {
            let _ = writeln!(
                out,
                "metis_local_store_cidr_block_total{{network=\"{}\",ip_family=\"{}\",status=\"{state}\"}} {value}",
                label(network),
                family_label(*ip_family)
            );
        }
    }
    render_quarantined(out, store);
    render_taken_back(out, store);
}

/// Blocks the cluster no longer grants, kept while pods hold addresses in
/// them (nothing new is allocated from them).
fn render_taken_back(out: &mut String, store: &Store) {
    let blocks = match store.taken_back() {
        Ok(blocks) => blocks,
        Err(err) => {
            log::warn(
                "metrics",
                "reading blocks the cluster took back failed",
                &[("error", &err)],
            );
            return;
        }
    };
    family(
        out,
        "metis_local_store_not_granted_block_total",
        "gauge",
        "CIDR blocks the cluster no longer grants, kept until their last pod is gone.",
    );
    let _ = writeln!(
        out,
        "metis_local_store_not_granted_block_total {}",
        blocks.len()
    );
    family(
        out,
        "metis_local_store_not_granted_ip_allocated",
        "gauge",
        "Pod addresses in blocks the cluster no longer grants.",
    );
    let pods: i64 = blocks.iter().map(|b| b.pods).sum();
    let _ = writeln!(out, "metis_local_store_not_granted_ip_allocated {pods}");
}

/// Blocks nothing new is allocated from because the database broke an
/// invariant in them (`metis admin check` lists them).
fn render_quarantined(out: &mut String, store: &Store) {
    let quarantined = match store.quarantined() {
        Ok(blocks) => blocks,
        Err(err) => {
            log::warn(
                "metrics",
                "reading quarantined blocks failed",
                &[("error", &err)],
            );
            return;
        }
    };
    family(
        out,
        "metis_local_store_quarantined_block_total",
        "gauge",
        "CIDR blocks quarantined: no new allocations until `metis admin check` passes.",
    );
    let _ = writeln!(
        out,
        "metis_local_store_quarantined_block_total {}",
        quarantined.len()
    );
}

fn family_label(family: Family) -> &'static str {
    family.as_str()
}

fn render_counters(out: &mut String, c: &Counters) {
    family(
        out,
        "metis_daemon_pending_dynamic_request_total",
        "gauge",
        "Allocations parked waiting for new blocks.",
    );
    for (network, count) in &c.parked {
        let _ = writeln!(
            out,
            "metis_daemon_pending_dynamic_request_total{{network=\"{}\"}} {count}",
            label(network)
        );
    }
    family(
        out,
        "metis_daemon_monitor_action_count",
        "counter",
        "Monitor actions taken.",
    );
    for ((action, network), count) in &c.monitor_actions {
        let _ = writeln!(
            out,
            "metis_daemon_monitor_action_count{{action=\"{action}\",network=\"{}\"}} {count}",
            label(network)
        );
    }
    family(
        out,
        "metis_daemon_requests_handled_total",
        "counter",
        "Requests handled by method and status.",
    );
    for ((method, status), count) in &c.requests {
        let _ = writeln!(
            out,
            "metis_daemon_requests_handled_total{{method=\"{method}\",status=\"{status}\"}} {count}"
        );
    }
    family(
        out,
        "metis_daemon_request_latency_seconds",
        "histogram",
        "Request latency by method.",
    );
    for (method, histogram) in &c.latency {
        for (bound, count) in LATENCY_BUCKETS.iter().zip(histogram.buckets) {
            let _ = writeln!(
                out,
                "metis_daemon_request_latency_seconds_bucket{{method=\"{method}\",le=\"{bound}\"}} {count}"
            );
        }
        let _ = writeln!(
            out,
            "metis_daemon_request_latency_seconds_bucket{{method=\"{method}\",le=\"+Inf\"}} {}\n\
             metis_daemon_request_latency_seconds_sum{{method=\"{method}\"}} {}\n\
             metis_daemon_request_latency_seconds_count{{method=\"{method}\"}} {}",
            histogram.count, histogram.sum, histogram.count
        );
    }
    family(
        out,
        "metis_daemon_api_server_errors_total",
        "counter",
        "Failed Kubernetes API calls.",
    );
    let _ = writeln!(out, "metis_daemon_api_server_errors_total {}", c.api_errors);
    family(
        out,
        "metis_daemon_nnc_stale_versions_total",
        "counter",
        "Versions a watch delivered twice, ignored (the object is listed again).",
    );
    let _ = writeln!(
        out,
        "metis_daemon_nnc_stale_versions_total {}",
        c.stale_versions
    );
    family(
        out,
        "metis_daemon_nnc_refused_pod_cidrs_total",
        "counter",
        "status.podCIDRs entries refused (overlapping another block, or too large).",
    );
    let _ = writeln!(
        out,
        "metis_daemon_nnc_refused_pod_cidrs_total {}",
        c.refused_pod_cidrs
    );
    family(
        out,
        "metis_daemon_boot_recovered_addresses_total",
        "counter",
        "Allocations of a previous boot released at start.",
    );
    let _ = writeln!(
        out,
        "metis_daemon_boot_recovered_addresses_total {}",
        c.recovered_at_boot
    );
}

/// Serves `/metrics` and `/healthz` on `addr` from a thread of its own.
/// Returns the bound address (useful with port 0).
pub fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    db_path: PathBuf,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let mut store: Option<Store> = None;
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                if store.is_none() {
                    store = Store::open_read_only(&db_path).ok().flatten();
                }
                if let Err(err) = answer(stream, &metrics, store.as_ref()) {
                    log::debug("metrics", "scrape failed", &[("error", &err)]);
                }
            }
        })?;
    Ok(bound)
}

fn answer(stream: TcpStream, metrics: &Metrics, store: Option<&Store>) -> std::io::Result<()> {
    stream.set_read_timeout(Some(SCRAPE_READ_TIMEOUT))?;
    stream.set_write_timeout(Some(SCRAPE_READ_TIMEOUT))?;
    let mut reader = BufReader::new(std::io::Read::take(stream.try_clone()?, 16 * 1024));
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Drain the headers so the client sees a clean response.
    let mut header = String::new();
    while reader.read_line(&mut header)? > 2 {
        header.clear();
    }
    let path = request_line.split_whitespace().nth(1).unwrap_or("");
    let (status, content_type, body) = match (request_line.split_whitespace().next(), path) {
        (Some("GET"), "/metrics") => ("200 OK", "text/plain; version=0.0.4", metrics.render(store)),
        (Some("GET"), "/healthz") => ("200 OK", "text/plain", "ok\n".to_string()),
        (Some("GET"), _) => ("404 Not Found", "text/plain", "not found\n".to_string()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "method not allowed\n".to_string(),
        ),
    };
    let mut stream = stream;
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_histograms() {
        let metrics = Metrics::default();
        metrics.observe_request("allocate", "OK", Duration::from_micros(700));
        metrics.observe_request("allocate", "OK", Duration::from_millis(3));
        metrics.observe_request("allocate", "RESOURCE_EXHAUSTED", Duration::from_millis(3));
        metrics.monitor_action("scale_up", "default");
        metrics.set_parked(BTreeMap::from([("default".to_string(), 2)]));
        metrics.set_parked(BTreeMap::new());
        metrics.api_error();
        let text = metrics.render(None);
        assert!(text.contains(
            "metis_daemon_requests_handled_total{method=\"allocate\",status=\"OK\"} 2\n"
        ));
        assert!(text.contains("metis_daemon_requests_handled_total{method=\"allocate\",status=\"RESOURCE_EXHAUSTED\"} 1\n"));
        assert!(text.contains(
            "metis_daemon_request_latency_seconds_bucket{method=\"allocate\",le=\"0.001\"} 1\n"
        ));
        assert!(text.contains(
            "metis_daemon_request_latency_seconds_bucket{method=\"allocate\",le=\"0.005\"} 3\n"
        ));
        assert!(
            text.contains("metis_daemon_request_latency_seconds_count{method=\"allocate\"} 3\n")
        );
        assert!(text.contains(
            "metis_daemon_monitor_action_count{action=\"scale_up\",network=\"default\"} 1\n"
        ));
        assert!(
            text.contains("metis_daemon_pending_dynamic_request_total{network=\"default\"} 0\n")
        );
        assert!(text.contains("metis_daemon_api_server_errors_total 1\n"));
        assert!(text.contains("# TYPE metis_daemon_request_latency_seconds histogram\n"));
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
