//! Prometheus metrics: counters the daemon's loop bumps (a short lock, no
//! I/O), and an HTTP thread that renders them together with gauges it reads
//! through its own read-only SQLite connection — a scrape never waits on, or
//! delays, an allocation. No per-pod labels: label sets are bounded by
//! networks, methods and statuses.

use std::collections::BTreeMap;
use std::fmt::{Display, Write as _};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use crate::log;
use crate::store::Healed;
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
    /// Times the database file was put back at its path (see
    /// `daemon::restore`).
    database_restored: u64,
    /// What the open-time repair healed of a rollback to upstream.
    rollback_repairs: Healed,
    /// reason → rows and blocks the hand-out check passed over.
    handout_passed_over: BTreeMap<&'static str, u64>,
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

    pub fn database_restored(&self) {
        self.with(|c| c.database_restored += 1);
    }

    pub fn recovered_at_boot(&self, addresses: u64) {
        self.with(|c| c.recovered_at_boot += addresses);
    }

    /// Adds what the hand-out check passed over (`Store::take_passed_over_counts`).
    pub fn handout_passed_over(&self, counts: BTreeMap<&'static str, u64>) {
        if counts.is_empty() {
            return;
        }
        self.with(|c| {
            for (reason, count) in counts {
                *c.handout_passed_over.entry(reason).or_default() += count;
            }
        });
    }

    pub fn rollback_repaired(&self, healed: Healed) {
        self.with(|c| c.rollback_repairs = healed);
    }

    /// The Prometheus text exposition of the counters and of `store`'s gauges.
    pub fn render(&self, store: Option<&Store>) -> String {
        let mut out = String::new();
        BUILD_INFO.header(&mut out);
        BUILD_INFO.sample(&mut out, &[env!("CARGO_PKG_VERSION")], 1);
        if let Some(store) = store {
            render_store(&mut out, store);
        }
        self.with(|c| render_counters(&mut out, c));
        out
    }
}

/// A metric's Prometheus type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Type {
    Gauge,
    Counter,
    Histogram,
}

impl Type {
    fn as_str(self) -> &'static str {
        match self {
            Type::Gauge => "gauge",
            Type::Counter => "counter",
            Type::Histogram => "histogram",
        }
    }
}

/// One metric: the one place its name, type, labels and help are written.
/// [`METRICS`] lists them all; docs/operations.md documents each (a test
/// checks).
#[derive(Debug)]
pub struct Metric {
    pub name: &'static str,
    kind: Type,
    /// Label names, in the order samples give their values.
    pub labels: &'static [&'static str],
    help: &'static str,
}

const BUILD_INFO: Metric = Metric::new(
    "metis_build_info",
    Type::Gauge,
    &["version"],
    "Build information.",
);
const IP_TOTAL: Metric = Metric::new(
    "metis_local_store_ip_total",
    Type::Gauge,
    &["network", "ip_family", "type"],
    "Addresses in the local store by type.",
);
const BLOCK_TOTAL: Metric = Metric::new(
    "metis_local_store_cidr_block_total",
    Type::Gauge,
    &["network", "ip_family", "status"],
    "CIDR blocks in the local store by state.",
);
/// Blocks nothing new is allocated from because the database broke an
/// invariant in them (`metis admin check` lists them).
const QUARANTINED: Metric = Metric::new(
    "metis_local_store_quarantined_block_total",
    Type::Gauge,
    &[],
    "CIDR blocks quarantined: no new allocations until `metis admin check` passes.",
);
/// Blocks the cluster no longer grants, kept while pods hold addresses in
/// them (nothing new is allocated from them).
const NOT_GRANTED_BLOCKS: Metric = Metric::new(
    "metis_local_store_not_granted_block_total",
    Type::Gauge,
    &[],
    "CIDR blocks the cluster no longer grants, kept until their last pod is gone.",
);
const NOT_GRANTED_PODS: Metric = Metric::new(
    "metis_local_store_not_granted_ip_allocated",
    Type::Gauge,
    &[],
    "Pod addresses in blocks the cluster no longer grants.",
);
const PENDING: Metric = Metric::new(
    "metis_daemon_pending_dynamic_request_total",
    Type::Gauge,
    &["network"],
    "Allocations parked waiting for new blocks.",
);
const MONITOR_ACTIONS: Metric = Metric::new(
    "metis_daemon_monitor_action_count",
    Type::Counter,
    &["action", "network"],
    "Monitor actions taken.",
);
const REQUESTS: Metric = Metric::new(
    "metis_daemon_requests_handled_total",
    Type::Counter,
    &["method", "status"],
    "Requests handled by method and status.",
);
const LATENCY: Metric = Metric::new(
    "metis_daemon_request_latency_seconds",
    Type::Histogram,
    &["method"],
    "Request latency by method.",
);
const API_ERRORS: Metric = Metric::new(
    "metis_daemon_api_server_errors_total",
    Type::Counter,
    &[],
    "Failed Kubernetes API calls.",
);
const STALE_VERSIONS: Metric = Metric::new(
    "metis_daemon_nnc_stale_versions_total",
    Type::Counter,
    &[],
    "Versions a watch delivered twice, ignored (the object is listed again).",
);
const REFUSED_POD_CIDRS: Metric = Metric::new(
    "metis_daemon_nnc_refused_pod_cidrs_total",
    Type::Counter,
    &[],
    "status.podCIDRs entries refused (overlapping another block, or too large).",
);
const RECOVERED_AT_BOOT: Metric = Metric::new(
    "metis_daemon_boot_recovered_addresses_total",
    Type::Counter,
    &[],
    "Allocations of a previous boot released at start.",
);
/// Blocks whose gateway a pod holds (see `store::layout::gateway`).
const GATEWAY_HELD: Metric = Metric::new(
    "metis_local_store_gateway_held_block_total",
    Type::Gauge,
    &[],
    "CIDR blocks whose advertised gateway a pod holds; their results name a stand-in gateway.",
);
const ROLLBACK_REPAIRS: Metric = Metric::new(
    "metis_daemon_rollback_repairs_total",
    Type::Counter,
    &["kind"],
    "What the daemon's start healed of what upstream's store left: revived blocks withheld again, rows beyond bounds reserved, rows outside a prefix deleted.",
);
const HANDOUT_PASSED_OVER: Metric = Metric::new(
    "metis_daemon_handout_passed_over_total",
    Type::Counter,
    &["reason"],
    "Rows and blocks the hand-out check passed over because they do not fit the configuration in force or another allocation has them.",
);
const DATABASE_RESTORED: Metric = Metric::new(
    "metis_daemon_database_restored_total",
    Type::Counter,
    &[],
    "Times the database file, deleted or replaced under the daemon, was put back at its path.",
);

/// Every metric, in the order a scrape shows them.
pub const METRICS: [&Metric; 18] = [
    &BUILD_INFO,
    &IP_TOTAL,
    &BLOCK_TOTAL,
    &QUARANTINED,
    &NOT_GRANTED_BLOCKS,
    &NOT_GRANTED_PODS,
    &GATEWAY_HELD,
    &PENDING,
    &MONITOR_ACTIONS,
    &REQUESTS,
    &LATENCY,
    &API_ERRORS,
    &STALE_VERSIONS,
    &REFUSED_POD_CIDRS,
    &RECOVERED_AT_BOOT,
    &ROLLBACK_REPAIRS,
    &HANDOUT_PASSED_OVER,
    &DATABASE_RESTORED,
];

const CONTROLLER_LEADER: Metric = Metric::new(
    "metis_controller_leader",
    Type::Gauge,
    &[],
    "1 while this controller holds the Lease and writes, else 0.",
);
const CONTROLLER_CATCHING_UP: Metric = Metric::new(
    "metis_controller_catching_up_objects",
    Type::Gauge,
    &[],
    "Objects a controller that took the Lease still waits for its watches to deliver (read after the takeover); it decides nothing until 0.",
);
const CONTROLLER_POOL_BLOCKS: Metric = Metric::new(
    "metis_controller_pool_blocks",
    Type::Gauge,
    &["pool", "family", "state"],
    "Blocks of each MetisPool family by state (free, granted, cooling).",
);
const CONTROLLER_EXHAUSTED: Metric = Metric::new(
    "metis_controller_exhausted_total",
    Type::Counter,
    &[],
    "Times a node's demand found no block (its NodeNetworkConfig says QuotaExceeded...).",
);
const CONTROLLER_CONFLICTS: Metric = Metric::new(
    "metis_controller_conflicts_total",
    Type::Counter,
    &[],
    "Writes refused with 409 (re-read and decided again), and overlaps nobody granted.",
);
const CONTROLLER_VANISHED: Metric = Metric::new(
    "metis_controller_vanished_blocks_total",
    Type::Counter,
    &[],
    "MetisBlocks that vanished while their finalizer held them (the cluster's state went back, \
     as after an etcd restore): each cools for its node, a NonReusable one stays retired.",
);
const CONTROLLER_WENT_BACK: Metric = Metric::new(
    "metis_controller_blocks_went_back_total",
    Type::Counter,
    &[],
    "MetisBlocks a list brought back older than the copy the controller held (an etcd restore): \
     the newer copy is kept and written back.",
);
const CONTROLLER_API_REQUESTS: Metric = Metric::new(
    "metis_controller_api_requests_total",
    Type::Counter,
    &["verb", "resource"],
    "Kubernetes API requests the controller made.",
);

const CONTROLLER_WRITE_FAILURES: Metric = Metric::new(
    "metis_controller_write_failures_total",
    Type::Counter,
    &["resource", "code"],
    "Controller writes the API server refused (not 409), by resource and HTTP status (0: no answer).",
);
const CONTROLLER_PASSES: Metric = Metric::new(
    "metis_controller_passes_total",
    Type::Counter,
    &[],
    "Passes decided: one follows each batch of changes to what the controller reads, and each due time.",
);
const CONTROLLER_PASS_SECONDS: Metric = Metric::new(
    "metis_controller_pass_seconds_total",
    Type::Counter,
    &[],
    "Time spent deciding passes, without their writes: divided by the passes, what one costs.",
);

/// The controller's metrics (`metis controller --metrics-address`).
pub const CONTROLLER_METRICS: [&Metric; 12] = [
    &BUILD_INFO,
    &CONTROLLER_LEADER,
    &CONTROLLER_CATCHING_UP,
    &CONTROLLER_POOL_BLOCKS,
    &CONTROLLER_EXHAUSTED,
    &CONTROLLER_CONFLICTS,
    &CONTROLLER_VANISHED,
    &CONTROLLER_WENT_BACK,
    &CONTROLLER_API_REQUESTS,
    &CONTROLLER_WRITE_FAILURES,
    &CONTROLLER_PASSES,
    &CONTROLLER_PASS_SECONDS,
];

#[derive(Default)]
struct ControllerCounters {
    leader: bool,
    catching_up: usize,
    /// (pool, family) → (free, granted, cooling).
    pool_blocks: BTreeMap<(String, &'static str), (u64, u64, u64)>,
    exhausted: u64,
    conflicts: u64,
    vanished: u64,
    went_back: u64,
    api_requests: BTreeMap<(&'static str, &'static str), u64>,
    write_failures: BTreeMap<(&'static str, u16), u64>,
    passes: u64,
    pass_time: Duration,
}

/// Shared by the controller's threads and its metrics server.
#[derive(Default)]
pub struct ControllerMetrics {
    counters: Mutex<ControllerCounters>,
}

impl ControllerMetrics {
    fn with<T>(&self, f: impl FnOnce(&mut ControllerCounters) -> T) -> T {
        let mut guard = self.counters.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut guard)
    }

    pub fn set_leader(&self, leader: bool) {
        self.with(|c| c.leader = leader);
    }

    pub fn set_catching_up(&self, objects: usize) {
        self.with(|c| c.catching_up = objects);
    }

    /// The blocks of every pool family now (pools gone drop out).
    pub fn set_pool_blocks(&self, blocks: BTreeMap<(String, &'static str), (u64, u64, u64)>) {
        self.with(|c| c.pool_blocks = blocks);
    }

    pub fn exhausted(&self) {
        self.with(|c| c.exhausted += 1);
    }

    pub fn conflict(&self) {
        self.with(|c| c.conflicts += 1);
    }

    pub fn vanished(&self) {
        self.with(|c| c.vanished += 1);
    }

    pub fn went_back(&self) {
        self.with(|c| c.went_back += 1);
    }

    pub fn api_request(&self, verb: &'static str, resource: &'static str) {
        self.with(|c| *c.api_requests.entry((verb, resource)).or_default() += 1);
    }

    /// One pass decided, in `took`.
    pub fn pass(&self, took: Duration) {
        self.with(|c| {
            c.passes += 1;
            c.pass_time += took;
        });
    }

    pub fn write_failure(&self, resource: &'static str, code: u16) {
        self.with(|c| *c.write_failures.entry((resource, code)).or_default() += 1);
    }

    /// Requests made so far, by (verb, resource).
    pub fn api_requests(&self) -> BTreeMap<(&'static str, &'static str), u64> {
        self.with(|c| c.api_requests.clone())
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        BUILD_INFO.header(&mut out);
        BUILD_INFO.sample(&mut out, &[env!("CARGO_PKG_VERSION")], 1);
        self.with(|c| {
            CONTROLLER_LEADER.header(&mut out);
            CONTROLLER_LEADER.sample(&mut out, &[], u8::from(c.leader));
            CONTROLLER_CATCHING_UP.header(&mut out);
            CONTROLLER_CATCHING_UP.sample(&mut out, &[], c.catching_up);
            CONTROLLER_POOL_BLOCKS.header(&mut out);
            for ((pool, family), (free, granted, cooling)) in &c.pool_blocks {
                for (state, value) in [("free", free), ("granted", granted), ("cooling", cooling)] {
                    CONTROLLER_POOL_BLOCKS.sample(&mut out, &[pool, family, state], value);
                }
            }
            for (metric, value) in [
                (&CONTROLLER_EXHAUSTED, c.exhausted),
                (&CONTROLLER_CONFLICTS, c.conflicts),
                (&CONTROLLER_VANISHED, c.vanished),
                (&CONTROLLER_WENT_BACK, c.went_back),
                (&CONTROLLER_PASSES, c.passes),
            ] {
                metric.header(&mut out);
                metric.sample(&mut out, &[], value);
            }
            CONTROLLER_PASS_SECONDS.header(&mut out);
            CONTROLLER_PASS_SECONDS.sample(&mut out, &[], c.pass_time.as_secs_f64());
            CONTROLLER_API_REQUESTS.header(&mut out);
            for ((verb, resource), count) in &c.api_requests {
                CONTROLLER_API_REQUESTS.sample(&mut out, &[verb, resource], count);
            }
            CONTROLLER_WRITE_FAILURES.header(&mut out);
            for ((resource, code), count) in &c.write_failures {
                let code = code.to_string();
                CONTROLLER_WRITE_FAILURES.sample(&mut out, &[resource, &code], count);
            }
        });
        out
    }
}

impl Metric {
    const fn new(
        name: &'static str,
        kind: Type,
        labels: &'static [&'static str],
        help: &'static str,
    ) -> Metric {
        Metric {
            name,
            kind,
            labels,
            help,
        }
    }

    fn header(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP {name} {}\n# TYPE {name} {}",
            self.help,
            self.kind.as_str(),
            name = self.name
        );
    }

    /// One series: `values` for the metric's labels, in their order.
    fn sample(&self, out: &mut String, values: &[&str], value: impl Display) {
        self.series(out, "", values, None, value);
    }

    /// One series of the metric's `suffix` (`_bucket`, `_sum`), with one
    /// more label when `extra` says so (a bucket's `le`).
    fn series(
        &self,
        out: &mut String,
        suffix: &str,
        values: &[&str],
        extra: Option<(&str, &str)>,
        value: impl Display,
    ) {
        let pairs: Vec<String> = self
            .labels
            .iter()
            .zip(values)
            .map(|(name, value)| (*name, *value))
            .chain(extra)
            .map(|(name, value)| format!("{name}=\"{}\"", label(value)))
            .collect();
        let labels = if pairs.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", pairs.join(","))
        };
        let _ = writeln!(out, "{}{suffix}{labels} {value}", self.name);
    }
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
    IP_TOTAL.header(out);
    for ((network, ip_family), s) in &stats {
        let types = [
            ("available", s.available),
            ("allocated", s.allocated),
            ("cooldown", s.cooldown),
            ("draining", s.draining),
            ("deleting", s.deleting),
            ("withheld", s.withheld),
            ("total", s.total),
        ];
        for (kind, value) in types {
            IP_TOTAL.sample(out, &[network, ip_family.as_str(), kind], value);
        }
    }
    BLOCK_TOTAL.header(out);
    for ((network, ip_family), s) in &stats {
        for (state, value) in ["ready", "draining", "deleting", "withheld"]
            .iter()
            .zip(s.blocks)
        {
            BLOCK_TOTAL.sample(out, &[network, ip_family.as_str(), state], value);
        }
    }
    match store.quarantined() {
        Ok(blocks) => {
            QUARANTINED.header(out);
            QUARANTINED.sample(out, &[], blocks.len());
        }
        Err(err) => log::warn(
            "metrics",
            "reading quarantined blocks failed",
            &[("error", &err)],
        ),
    }
    match store.taken_back() {
        Ok(blocks) => {
            NOT_GRANTED_BLOCKS.header(out);
            NOT_GRANTED_BLOCKS.sample(out, &[], blocks.len());
            NOT_GRANTED_PODS.header(out);
            let pods: i64 = blocks.iter().map(|b| b.pods).sum();
            NOT_GRANTED_PODS.sample(out, &[], pods);
        }
        Err(err) => log::warn(
            "metrics",
            "reading blocks the cluster took back failed",
            &[("error", &err)],
        ),
    }
    match store.held_gateways() {
        Ok(blocks) => {
            GATEWAY_HELD.header(out);
            GATEWAY_HELD.sample(out, &[], blocks.len());
        }
        Err(err) => log::warn(
            "metrics",
            "reading blocks whose gateway a pod holds failed",
            &[("error", &err)],
        ),
    }
}

fn render_counters(out: &mut String, c: &Counters) {
    PENDING.header(out);
    for (network, count) in &c.parked {
        PENDING.sample(out, &[network], count);
    }
    MONITOR_ACTIONS.header(out);
    for ((action, network), count) in &c.monitor_actions {
        MONITOR_ACTIONS.sample(out, &[action, network], count);
    }
    REQUESTS.header(out);
    for ((method, status), count) in &c.requests {
        REQUESTS.sample(out, &[method, status], count);
    }
    LATENCY.header(out);
    for (method, histogram) in &c.latency {
        for (bound, count) in LATENCY_BUCKETS.iter().zip(histogram.buckets) {
            let le = bound.to_string();
            LATENCY.series(out, "_bucket", &[method], Some(("le", &le)), count);
        }
        let total = histogram.count;
        LATENCY.series(out, "_bucket", &[method], Some(("le", "+Inf")), total);
        LATENCY.series(out, "_sum", &[method], None, histogram.sum);
        LATENCY.series(out, "_count", &[method], None, total);
    }
    let totals = [
        (&API_ERRORS, c.api_errors),
        (&STALE_VERSIONS, c.stale_versions),
        (&REFUSED_POD_CIDRS, c.refused_pod_cidrs),
        (&RECOVERED_AT_BOOT, c.recovered_at_boot),
    ];
    for (metric, value) in totals {
        metric.header(out);
        metric.sample(out, &[], value);
    }
    ROLLBACK_REPAIRS.header(out);
    for (kind, count) in c.rollback_repairs.by_kind() {
        ROLLBACK_REPAIRS.sample(out, &[kind], count);
    }
    HANDOUT_PASSED_OVER.header(out);
    for (reason, count) in &c.handout_passed_over {
        HANDOUT_PASSED_OVER.sample(out, &[reason], count);
    }
    DATABASE_RESTORED.header(out);
    DATABASE_RESTORED.sample(out, &[], c.database_restored);
}

/// Serves `/metrics` and `/healthz` on `addr` from a thread of its own.
/// Returns the bound address (useful with port 0).
pub fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    db_path: PathBuf,
) -> std::io::Result<SocketAddr> {
    let mut store: Option<Store> = None;
    serve_text(addr, move || {
        if store.is_none() {
            store = Store::open_read_only(&db_path).ok().flatten();
        }
        metrics.render(store.as_ref())
    })
}

/// Serves `/metrics` (the text `render` makes at each scrape) and
/// `/healthz` on `addr` from a thread of its own; returns the bound address.
pub fn serve_text(
    addr: SocketAddr,
    mut render: impl FnMut() -> String + Send + 'static,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                if let Err(err) = answer(stream, &mut render) {
                    log::debug("metrics", "scrape failed", &[("error", &err)]);
                }
            }
        })?;
    Ok(bound)
}

fn answer(stream: TcpStream, render: &mut dyn FnMut() -> String) -> std::io::Result<()> {
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
        (Some("GET"), "/metrics") => ("200 OK", "text/plain; version=0.0.4", render()),
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

    /// The metrics table of docs/operations.md: (name, labels cell) per row.
    fn documented() -> Vec<(String, String)> {
        let docs = include_str!("../docs/operations.md");
        docs.lines()
            .filter_map(|line| {
                let mut cells = line.strip_prefix("| `metis_")?.split(" | ");
                let name = format!("metis_{}", cells.next()?.strip_suffix('`')?);
                Some((name, cells.next()?.to_string()))
            })
            .collect()
    }

    #[test]
    fn docs_list_every_metric_with_its_labels_and_nothing_else() {
        let documented = documented();
        for metric in METRICS.iter().chain(&CONTROLLER_METRICS) {
            let Some((_, labels)) = documented.iter().find(|(name, _)| name == metric.name) else {
                panic!("docs/operations.md does not list {}", metric.name)
            };
            for label in metric.labels {
                assert!(
                    labels.contains(&format!("`{label}`")),
                    "docs/operations.md: {} lacks label {label}",
                    metric.name
                );
            }
        }
        for (name, _) in &documented {
            assert!(
                METRICS
                    .iter()
                    .chain(&CONTROLLER_METRICS)
                    .any(|metric| metric.name == name),
                "docs/operations.md lists {name}, which no scrape shows"
            );
        }
    }

    #[test]
    fn a_scrape_shows_every_metric() {
        let dir = crate::testutil::TempDir::new();
        let store = dir.store();
        let text = Metrics::default().render(Some(&store));
        for metric in METRICS {
            assert!(
                text.contains(&format!(
                    "# TYPE {} {}\n",
                    metric.name,
                    metric.kind.as_str()
                )),
                "{} missing from:\n{text}",
                metric.name
            );
        }
        assert!(
            text.contains("metis_local_store_quarantined_block_total 0\n"),
            "{text}"
        );
    }

    #[test]
    fn a_controller_scrape_shows_every_controller_metric() {
        let metrics = ControllerMetrics::default();
        metrics.set_leader(true);
        metrics.set_catching_up(3);
        metrics.api_request("put", "nodenetworkconfigs");
        metrics.set_pool_blocks(BTreeMap::from([(("p".to_string(), "ipv4"), (3, 2, 1))]));
        metrics.exhausted();
        metrics.vanished();
        metrics.went_back();
        metrics.write_failure("nodenetworkconfigs", 422);
        metrics.pass(Duration::from_millis(1500));
        metrics.pass(Duration::from_millis(250));
        let text = metrics.render();
        for metric in CONTROLLER_METRICS {
            assert!(text.contains(&format!("# TYPE {} ", metric.name)), "{text}");
        }
        for line in [
            "metis_controller_leader 1\n",
            "metis_controller_catching_up_objects 3\n",
            "metis_controller_pool_blocks{pool=\"p\",family=\"ipv4\",state=\"cooling\"} 1\n",
            "metis_controller_exhausted_total 1\n",
            "metis_controller_conflicts_total 0\n",
            "metis_controller_vanished_blocks_total 1\n",
            "metis_controller_blocks_went_back_total 1\n",
            "metis_controller_api_requests_total{verb=\"put\",resource=\"nodenetworkconfigs\"} 1\n",
            "metis_controller_write_failures_total{resource=\"nodenetworkconfigs\",code=\"422\"} 1\n",
            "metis_controller_passes_total 2\n",
            "metis_controller_pass_seconds_total 1.75\n",
        ] {
            assert!(text.contains(line), "{line} missing from {text}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
