//! `metis controller`: its flags, and the loop that keeps the informers'
//! view, decides while this process leads and writes what changed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};

use super::cache::{Cache, Clock};
use super::clock::BootInstant;
use super::decide::{Bound, Decision, World, decide};
use super::informer::{self, Resource, Update};
use super::lease::{self, Elector, LeaseTiming};
use super::retry::Retries;
use super::short_text::ShortText;
use super::writer;
use crate::duration::parse_duration_ms;
use crate::flags::{self, FlagError, FlagSpec};
use crate::kube::backoff::ApiTiming;
use crate::kube::client::ApiClient;
use crate::kube::config::{self, ApiConfig};
use crate::log::{self, now_ms};
use crate::metrics::{self, ControllerMetrics};

/// Time-driven passes (cooling ends, grace ends) run on whole multiples
/// of this: several blocks coming free within it are one pass, and a node
/// refused until the next one is rewritten at most once per this.
const DUE_GRANULARITY_MS: i64 = 1000;
/// A pool's counts are written at most this often.
const POOL_STATUS_INTERVAL: Duration = Duration::from_secs(1);
/// Tests only: milliseconds added to this process's wall clock (a replica
/// whose clock is skewed). Only written times follow it; no delay does.
pub const WALL_OFFSET_ENV: &str = "METIS_TEST_WALL_CLOCK_OFFSET_MS";
/// Shortest pause between two passes: a burst of events is one pass.
const MIN_PASS_INTERVAL: Duration = Duration::from_millis(50);
/// The nodes whose statuses one pass writes at most (`decide::Bound`):
/// a burst (5,000 nodes asking at once) is written 500 at a time, each
/// batch decided on what the previous one's answers and echoes left.
const PASS_NODES: usize = 500;
/// A pass decides every node at least this often, changed or not: what a
/// scoped pass might leave undecided is decided again (level-triggered).
const RESYNC_INTERVAL: Duration = Duration::from_secs(300);
/// How soon a failed read after taking the Lease is tried again.
const TAKEOVER_READ_RETRY: Duration = Duration::from_secs(1);
/// How long each watch stays open (1–2× this) and the backoff's cap.
const TIMING: ApiTiming = ApiTiming {
    watch_timeout: Duration::from_secs(300),
    max_backoff: Duration::from_secs(30),
};

const ABOUT: &str = "Grant node blocks from MetisPools through the Kubernetes API (the cluster side of \
the NodeNetworkConfig protocol), leader-elected with a Lease. docs/controller.md tells how to run it.";

const SPECS: &[FlagSpec] = &[
    FlagSpec {
        name: "--kubeconfig",
        value: Some("PATH"),
        repeatable: false,
        default: "",
        help: "kubeconfig to use (else KUBECONFIG, else the in-cluster service account)",
    },
    FlagSpec {
        name: "--identity",
        value: Some("NAME"),
        repeatable: false,
        default: "the hostname",
        help: "this candidate's name in the Lease",
    },
    FlagSpec {
        name: "--lease-namespace",
        value: Some("NS"),
        repeatable: false,
        default: "kube-system",
        help: "namespace of the Lease",
    },
    FlagSpec {
        name: "--lease-name",
        value: Some("NAME"),
        repeatable: false,
        default: "metis-controller",
        help: "name of the Lease",
    },
    FlagSpec {
        name: "--lease-duration",
        value: Some("DURATION"),
        repeatable: false,
        default: "15s",
        help: "how long a silent holder keeps the Lease",
    },
    FlagSpec {
        name: "--renew-deadline",
        value: Some("DURATION"),
        repeatable: false,
        default: "10s",
        help: "a holder that has not renewed for this long stops writing",
    },
    FlagSpec {
        name: "--retry-period",
        value: Some("DURATION"),
        repeatable: false,
        default: "2s",
        help: "pause between two attempts to acquire or renew",
    },
    FlagSpec {
        name: "--node-grace",
        value: Some("DURATION"),
        repeatable: false,
        default: "5m",
        help: "how long the blocks of a deleted Node stay its own",
    },
    FlagSpec {
        name: "--metrics-address",
        value: Some("ADDR:PORT"),
        repeatable: false,
        default: "",
        help: "serve Prometheus metrics here (off when unset)",
    },
    FlagSpec {
        name: "--log-file",
        value: Some("PATH"),
        repeatable: false,
        default: "stderr",
        help: "write the log here",
    },
    FlagSpec {
        name: "-v",
        value: Some("N"),
        repeatable: false,
        default: "0",
        help: "more log detail (1 debug, 4 trace)",
    },
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub api: ApiConfig,
    pub identity: String,
    pub lease_namespace: String,
    pub lease_name: String,
    pub lease: LeaseTiming,
    pub node_grace: Duration,
    pub metrics_address: Option<SocketAddr>,
    pub log_file: Option<PathBuf>,
    pub verbosity: u8,
}

pub fn usage() -> String {
    flags::usage("metis controller", ABOUT, SPECS)
}

fn duration(
    parsed: &flags::Parsed,
    name: &'static str,
    default: &str,
) -> Result<Duration, FlagError> {
    let text = parsed.get(name).unwrap_or(default);
    let ms = parse_duration_ms(text)
        .filter(|ms| *ms > 0)
        .ok_or_else(|| {
            FlagError::BadValue(
                name,
                format!("{text:?} is not a positive duration such as \"10s\""),
            )
        })?;
    Ok(Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)))
}

/// Parses the flags; `lookup` reads the environment.
pub fn parse_config(
    args: &[String],
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, FlagError> {
    let parsed = flags::parse(SPECS, args)?;
    let lease = lease_timing(&parsed)?;
    let node_grace = duration(&parsed, "--node-grace", "5m")?;
    let api = api_config(&parsed, lookup)?;
    let identity = identity(&parsed)?;
    let name_flag = |flag: &'static str, default: &str| -> Result<String, FlagError> {
        let value = parsed.get(flag).unwrap_or(default);
        if crate::names::is_dns_subdomain(value) {
            Ok(value.to_string())
        } else {
            Err(FlagError::BadValue(
                flag,
                format!("{value:?} is not a Kubernetes name"),
            ))
        }
    };
    let metrics_address = match parsed.get("--metrics-address") {
        Some(text) => Some(text.parse().map_err(|_| {
            FlagError::BadValue("--metrics-address", format!("{text:?} is not ADDR:PORT"))
        })?),
        None => None,
    };
    let verbosity = match parsed.get("-v") {
        Some(text) => text
            .parse()
            .map_err(|_| FlagError::BadValue("-v", format!("{text:?} is not a number")))?,
        None => 0,
    };
    Ok(Config {
        api,
        identity,
        lease_namespace: name_flag("--lease-namespace", "kube-system")?,
        lease_name: name_flag("--lease-name", "metis-controller")?,
        lease,
        node_grace,
        metrics_address,
        log_file: parsed.get("--log-file").map(PathBuf::from),
        verbosity,
    })
}

fn lease_timing(parsed: &flags::Parsed) -> Result<LeaseTiming, FlagError> {
    let lease = LeaseTiming {
        duration: duration(parsed, "--lease-duration", "15s")?,
        renew_deadline: duration(parsed, "--renew-deadline", "10s")?,
        retry_period: duration(parsed, "--retry-period", "2s")?,
    };
    // The Lease carries whole seconds (leaseDurationSeconds): a fraction
    // would be obeyed here but not by the other candidates reading it.
    if lease.duration.subsec_nanos() != 0 {
        return Err(FlagError::BadValue(
            "--lease-duration",
            "must be whole seconds (the Lease's leaseDurationSeconds), such as \"2s\"".into(),
        ));
    }
    if lease.renew_deadline >= lease.duration {
        return Err(FlagError::BadValue("--renew-deadline", "must be shorter than --lease-duration, so a holder stops writing before its lease can pass on".into()));
    }
    if lease.retry_period >= lease.renew_deadline {
        return Err(FlagError::BadValue(
            "--retry-period",
            "must be shorter than --renew-deadline".into(),
        ));
    }
    Ok(lease)
}

fn api_config(
    parsed: &flags::Parsed,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<ApiConfig, FlagError> {
    match parsed.get("--kubeconfig") {
        Some(path) => config::from_kubeconfig(&PathBuf::from(path))
            .map_err(|err| FlagError::BadValue("--kubeconfig", err.to_string())),
        None => config::from_environment(lookup)
            .map_err(|err| FlagError::BadValue("--kubeconfig", err.to_string()))?
            .ok_or_else(|| {
                FlagError::BadValue(
                    "--kubeconfig",
                    "no cluster: give --kubeconfig, set KUBECONFIG or run in a pod".into(),
                )
            }),
    }
}

fn identity(parsed: &flags::Parsed) -> Result<String, FlagError> {
    let identity = match parsed.get("--identity") {
        Some(name) => name.to_string(),
        None => nix::unistd::gethostname()
            .ok()
            .and_then(|n| n.into_string().ok())
            .unwrap_or_default(),
    };
    if identity.is_empty()
        || identity.len() > 253
        || identity.chars().any(|c| c.is_control() || c == '"')
    {
        return Err(FlagError::BadValue(
            "--identity",
            format!("{identity:?} is not a usable name"),
        ));
    }
    Ok(identity)
}

/// Runs until SIGTERM or SIGINT; gives the Lease up before returning.
pub fn run(config: &Config) -> std::io::Result<()> {
    one_malloc_arena();
    // Blocked before any thread starts, so every thread inherits it and
    // only the waiter below receives them.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals.thread_block().map_err(std::io::Error::from)?;
    let metrics = Arc::new(ControllerMetrics::default());
    if let Some(address) = config.metrics_address {
        let metrics = Arc::clone(&metrics);
        // A taken port (two replicas on one host network) costs the
        // metrics, never the controller.
        match metrics::serve_text(address, move || metrics.render()) {
            Ok(bound) => log::info("controller", "serving metrics", &[("address", &bound)]),
            Err(err) => log::warn(
                "controller",
                "cannot serve metrics",
                &[("address", &address), ("error", &err)],
            ),
        }
    }
    let client = Arc::new(
        ApiClient::new(&config.api, TIMING.watch_timeout.saturating_mul(2))
            .map_err(std::io::Error::other)?,
    );
    let (updates, events) = mpsc::channel();
    wait_for_signals(signals, updates.clone())?;
    for kind in Resource::ALL {
        informer::spawn(
            Arc::clone(&client),
            kind,
            TIMING,
            updates.clone(),
            Arc::clone(&metrics),
        )?;
    }
    let elector = Elector::new(
        &config.lease_namespace,
        &config.lease_name,
        &config.identity,
        config.lease,
    );
    let leadership = Arc::clone(&elector.leadership);
    lease::spawn(elector, Arc::clone(&client), Arc::clone(&metrics), updates)?;
    log::info(
        "controller",
        "metis controller is starting",
        &[
            ("identity", &config.identity),
            (
                "lease",
                &format!("{}/{}", config.lease_namespace, config.lease_name),
            ),
        ],
    );
    let mut controller = Controller::new(config, client, metrics, leadership);
    controller.serve(&events);
    Ok(())
}

/// The loop's state: the informers' view, and when the next pass runs.
struct Controller<'c> {
    config: &'c Config,
    client: Arc<ApiClient>,
    metrics: Arc<ControllerMetrics>,
    leadership: Arc<lease::Leadership>,
    cache: Cache,
    retries: Retries,
    /// The monotonic clock's origin (the boot clock: delays count on
    /// through a suspend), and the wall clock's offset (tests only: a
    /// replica whose clock is skewed).
    origin: BootInstant,
    wall_offset_ms: i64,
    /// The earliest a pass may run (a burst of events is one pass).
    next_pass: Instant,
    /// Something arrived (or a write failed) since the last pass.
    pending: bool,
    /// When time alone changes the decision (a cooling block comes free, a
    /// missing Node's grace ends, a paused object may be written): the
    /// loop sleeps until then, no ticks.
    due: Option<Instant>,
    /// Not leading at the last pass: only an update (Leadership(true) from
    /// the lease thread, or any event) wakes the loop.
    standing_by: bool,
    /// The nodes the last pass left unsettled: the next decides them too.
    unsettled: BTreeSet<ShortText>,
    /// When each pool's counts were last written: at most once per
    /// [`POOL_STATUS_INTERVAL`].
    pools_written: BTreeMap<String, Instant>,
    /// When the next pass decides every node ([`RESYNC_INTERVAL`]).
    resync_at: Instant,
    /// The last node a bounded pass wrote: the next starts after it.
    bound_after: Option<String>,
    /// The Lease acquisitions the view was last read for: after another,
    /// no pass runs before a read and the view reaching it.
    read_for: u64,
    /// Since when the view catches up with the read after a takeover.
    catching_up: Option<Instant>,
}

impl<'c> Controller<'c> {
    fn new(
        config: &'c Config,
        client: Arc<ApiClient>,
        metrics: Arc<ControllerMetrics>,
        leadership: Arc<lease::Leadership>,
    ) -> Controller<'c> {
        let wall_offset_ms = std::env::var(WALL_OFFSET_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Controller {
            config,
            client,
            metrics,
            leadership,
            cache: Cache::with_node_grace(
                i64::try_from(config.node_grace.as_millis()).unwrap_or(i64::MAX),
            ),
            retries: Retries::new(TIMING.max_backoff),
            origin: BootInstant::now(),
            wall_offset_ms,
            next_pass: Instant::now(),
            pending: true,
            due: None,
            standing_by: false,
            unsettled: BTreeSet::new(),
            pools_written: BTreeMap::new(),
            resync_at: Instant::now() + RESYNC_INTERVAL,
            bound_after: None,
            read_for: 0,
            catching_up: None,
        }
    }

    fn clock(&self) -> Clock {
        Clock {
            now_ms: i64::try_from(self.origin.elapsed().as_millis()).unwrap_or(i64::MAX),
            wall_ms: now_ms().saturating_add(self.wall_offset_ms),
        }
    }

    /// Until Stop: takes updates in, and passes when they or time call
    /// for one.
    fn serve(&mut self, events: &Receiver<Update>) {
        loop {
            let wake = if self.standing_by {
                None
            } else if self.pending {
                Some(self.next_pass)
            } else {
                self.due.map(|at| at.max(self.next_pass))
            };
            let first = match wake {
                Some(at) => match events.recv_timeout(at.saturating_duration_since(Instant::now()))
                {
                    Ok(update) => Some(update),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                },
                None => match events.recv() {
                    Ok(update) => Some(update),
                    Err(_) => return,
                },
            };
            self.cache.at(self.clock().now_ms);
            for update in first
                .into_iter()
                .chain(std::iter::from_fn(|| events.try_recv().ok()))
            {
                if !self.take(update) {
                    return;
                }
            }
            self.report_vanished();
            self.maybe_pass();
        }
    }

    /// Takes one update in; false on Stop (after giving the Lease up).
    fn take(&mut self, update: Update) -> bool {
        self.standing_by = false;
        // An update that changes nothing the decision reads (the echo of
        // this process's own write, a Node's heartbeat) calls for no pass.
        self.pending |= match update {
            Update::Listed(kind, items) => {
                self.cache.listed(kind, items);
                true
            }
            Update::Changed(kind, item) => self.cache.put(kind, item),
            // An object goes only once its finalizers are gone (the event
            // may still show the last one): a deletion, never a vanishing.
            Update::Deleted(kind, name) => self.cache.forget(kind, &name),
            Update::Leadership(_) => {
                // A new leader trusts no earlier pass to have settled.
                self.cache.decide_all();
                true
            }
            Update::Stop => {
                log::info("controller", "stopping: giving the lease up", &[]);
                let config = self.config;
                let releaser = Elector::new(
                    &config.lease_namespace,
                    &config.lease_name,
                    &config.identity,
                    config.lease,
                );
                releaser.leadership.stop();
                self.leadership.stop();
                releaser.release(&self.client, &self.metrics);
                return false;
            }
        };
        true
    }

    /// Says loudly what the view kept as vanished, or kept over an older
    /// copy: a MetisBlock gone while its finalizer held it, or back at a
    /// version seen before, means the cluster's state went back (an etcd
    /// restore), or someone removed the finalizer by hand.
    fn report_vanished(&mut self) {
        for (block, node) in self.cache.take_vanished() {
            self.metrics.vanished();
            log::warn(
                "controller",
                "a MetisBlock vanished while its finalizer held it (an etcd restore?): \
                 its block cools for its node (a NonReusable one stays retired and its \
                 object is made again), given to no other meanwhile",
                &[("block", &block), ("node", &node)],
            );
        }
        for (block, node) in self.cache.take_went_back() {
            self.metrics.went_back();
            log::warn(
                "controller",
                "a MetisBlock came back older than the copy this controller held (an etcd \
                 restore?): the newer copy stays the block's truth and is written back",
                &[("block", &block), ("node", &node)],
            );
        }
    }

    /// Decides and writes, if something is pending or due and this
    /// process leads.
    fn maybe_pass(&mut self) {
        if !self.cache.synced() {
            return;
        }
        let clock = self.clock();
        let now = Instant::now();
        let is_due = self.due.is_some_and(|at| now >= at);
        if !(self.pending || is_due) || now < self.next_pass {
            return;
        }
        if !self.leadership.leading() {
            // What is pending and due stays so for the next update: an
            // event, or the lease thread once this candidate leads again.
            self.standing_by = true;
            self.leadership.call_back();
            return;
        }
        if !self.caught_up_since_takeover() {
            return;
        }
        self.pending = false;
        self.next_pass = now + MIN_PASS_INTERVAL;
        self.pass(clock);
    }

    /// Whether the view is at least as new as a read taken after this
    /// process last acquired the Lease (another leader may have written
    /// what a lagging watch has not delivered: a block of another size, a
    /// status); reads everything once it acquired the Lease again. While
    /// the stream catches up the loop waits for its updates; a failed read
    /// is tried again shortly.
    fn caught_up_since_takeover(&mut self) -> bool {
        let acquisitions = self.leadership.acquisitions();
        if acquisitions != self.read_for {
            let started = Instant::now();
            if let Err(err) = self.read_everything() {
                log::warn(
                    "controller",
                    "reading every object after taking the lease failed, retrying",
                    &[("error", &err)],
                );
                self.next_pass = started + TAKEOVER_READ_RETRY;
                return false;
            }
            self.read_for = acquisitions;
            self.catching_up = Some(started);
            log::info(
                "controller",
                "read every object after taking the lease; deciding once the watches deliver them",
                &[("waiting_for", &self.cache.catching_up())],
            );
        }
        self.metrics.set_catching_up(self.cache.catching_up());
        if !self.cache.caught_up() {
            self.standing_by = true;
            return false;
        }
        if let Some(since) = self.catching_up.take() {
            let waited = since.elapsed().as_millis();
            log::info(
                "controller",
                "the view reached the read",
                &[("took_ms", &waited)],
            );
        }
        true
    }

    /// Reads each kind's names and versions for the view to reach.
    fn read_everything(&mut self) -> Result<(), crate::kube::client::KubeError> {
        for kind in Resource::ALL {
            let read = informer::list_versions(&self.client, kind, &self.metrics)?;
            self.cache.reach(kind, read);
        }
        Ok(())
    }

    fn pass(&mut self, clock: Clock) {
        let started = Instant::now();
        if started >= self.resync_at {
            self.cache.decide_all();
        }
        let scope = self.cache.take_scope(std::mem::take(&mut self.unsettled));
        if scope.is_none() {
            self.resync_at = started + RESYNC_INTERVAL;
        }
        let mut decision = self.decide(clock, scope.as_ref(), started);
        self.bound(&mut decision);
        self.unsettled = std::mem::take(&mut decision.unsettled);
        self.metrics.pass(started.elapsed());
        self.cache.restart_cooling(&decision.cooling_restarts);
        let now = Instant::now();
        let due = decision.next_due_ms.map(|at| {
            let batched =
                at.saturating_add(DUE_GRANULARITY_MS - 1) / DUE_GRANULARITY_MS * DUE_GRANULARITY_MS;
            now + Duration::from_millis(
                u64::try_from(batched.saturating_sub(clock.now_ms)).unwrap_or(0),
            )
        });
        self.due = Some(due.map_or(self.resync_at, |at| at.min(self.resync_at)));
        self.metrics.set_pool_blocks(
            decision
                .gauges
                .iter()
                .map(|g| {
                    (
                        (g.pool.clone(), g.family.as_str()),
                        (g.free, g.granted, g.cooling),
                    )
                })
                .collect(),
        );
        self.coalesce_pool_writes(&mut decision, now);
        if decision.block_writes.is_empty()
            && decision.pool_writes.is_empty()
            && decision.nnc_writes.is_empty()
        {
            return;
        }
        let leadership = Arc::clone(&self.leadership);
        let ctx = writer::Context {
            client: &self.client,
            metrics: &self.metrics,
            identity: &self.config.identity,
            leading: &|| leadership.leading(),
            now,
        };
        let applied = writer::apply(&ctx, &mut self.cache, &decision, &mut self.retries);
        self.report_vanished();
        log::debug(
            "controller",
            "pass written",
            &[
                ("written", &applied.written),
                ("conflicts", &applied.conflicts),
                ("failures", &applied.failures),
                ("deferred", &applied.deferred),
            ],
        );
        for write in &decision.pool_writes {
            self.pools_written.insert(write.name.clone(), now);
        }
        // A conflict was read again: decide again at once; a paused object
        // is due when its pause ends.
        self.pending |= applied.conflicts > 0;
        let retry = self.retries.next_due(Instant::now());
        self.due = [self.due, retry].into_iter().flatten().min();
    }

    /// The decision over `scope` (every node: `None`), keeping at most
    /// [`PASS_NODES`] nodes' writes from just after the last one written.
    fn decide(
        &mut self,
        clock: Clock,
        scope: Option<&BTreeSet<ShortText>>,
        at: Instant,
    ) -> Decision {
        let pools = self.cache.pools_with_ledgers();
        let mut taken = self.cache.lend_taken();
        let ready = |name: &str| self.retries.ready(Resource::Nnc, name, at);
        let world = World {
            bound: Bound {
                nodes: PASS_NODES,
                after: self.bound_after.as_deref(),
                ready: &ready,
            },
            ..self.cache.world(&pools, clock, scope)
        };
        let decision = decide(&world, &mut taken);
        drop(pools);
        self.cache.give_back_taken(taken);
        decision
    }

    /// When `decision` kept [`PASS_NODES`] nodes' writes and left others
    /// for later, the next pass decides those, as soon as the events
    /// queued meanwhile are taken in, starting after the last one kept.
    fn bound(&mut self, decision: &mut Decision) {
        if let Some(last) = decision.bounded_after.take() {
            self.bound_after = Some(last);
            self.pending = true;
            self.next_pass = Instant::now();
        }
    }

    /// A pool's counts are written at most once per
    /// [`POOL_STATUS_INTERVAL`]: a write due sooner waits (the pass then).
    fn coalesce_pool_writes(&mut self, decision: &mut Decision, now: Instant) {
        let mut later: Option<Instant> = None;
        decision.pool_writes.retain(|write| {
            let next = self
                .pools_written
                .get(&write.name)
                .map(|at| *at + POOL_STATUS_INTERVAL);
            match next {
                Some(at) if at > now => {
                    later = Some(later.map_or(at, |l| l.min(at)));
                    false
                }
                _ => true,
            }
        });
        self.due = [self.due, later].into_iter().flatten().min();
    }
}

/// Every thread allocates from one malloc arena. The informers' threads
/// parse the objects the loop keeps: with an arena each, glibc strands
/// freed pages between kept objects in each arena. One arena lowers the
/// 5,000-node peak by a tenth for a little CPU (bench/history.md).
#[cfg(target_env = "gnu")]
#[allow(unsafe_code)]
fn one_malloc_arena() {
    // SAFETY: mallopt sets an allocator parameter, touching no memory of
    // ours; it runs before this process starts a thread.
    unsafe {
        nix::libc::mallopt(nix::libc::M_ARENA_MAX, 1);
    }
}

/// Other C libraries' allocators have no such arenas to bound.
#[cfg(not(target_env = "gnu"))]
fn one_malloc_arena() {}

/// SIGTERM and SIGINT become [`Update::Stop`].
fn wait_for_signals(signals: SigSet, updates: Sender<Update>) -> std::io::Result<()> {
    thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if signals.wait().is_ok() {
                let _ = updates.send(Update::Stop);
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn env(name: &str) -> Option<String> {
        (name == "KUBERNETES_SERVICE_HOST" || name == "KUBERNETES_SERVICE_PORT").then(String::new)
    }

    #[test]
    fn flags_are_checked() {
        let dir = crate::testutil::TempDir::new();
        let kubeconfig = dir.0.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            "current-context: c\nclusters:\n- name: k\n  cluster:\n    server: http://127.0.0.1:1\ncontexts:\n- name: c\n  context:\n    cluster: k\n",
        )
        .unwrap();
        let path = kubeconfig.display().to_string();
        let config =
            parse_config(&args(&["--kubeconfig", &path, "--identity", "c-1"]), &env).unwrap();
        assert_eq!(config.identity, "c-1");
        assert_eq!(config.lease_namespace, "kube-system");
        assert_eq!(config.lease_name, "metis-controller");
        assert_eq!(config.lease.duration, Duration::from_secs(15));
        assert_eq!(config.lease.renew_deadline, Duration::from_secs(10));
        assert_eq!(config.lease.retry_period, Duration::from_secs(2));
        assert_eq!(config.node_grace, Duration::from_secs(300));
        let whole = parse_config(
            &args(&[
                "--kubeconfig",
                &path,
                "--lease-duration",
                "2000ms",
                "--renew-deadline",
                "1500ms",
                "--retry-period",
                "500ms",
            ]),
            &env,
        )
        .unwrap();
        assert_eq!(whole.lease.duration, Duration::from_secs(2));
        assert_eq!(config.api.server, "http://127.0.0.1:1");
        let bad: &[(&[&str], &str)] = &[
            (
                &["--renew-deadline", "15s"],
                "shorter than --lease-duration",
            ),
            (&["--retry-period", "10s"], "shorter than --renew-deadline"),
            (&["--node-grace", "0"], "positive duration"),
            (&["--lease-duration", "soon"], "positive duration"),
            (&["--lease-duration", "1900ms"], "whole seconds"),
            (&["--lease-duration", "2500ms"], "whole seconds"),
            (
                &["--lease-namespace", "Kube System"],
                "not a Kubernetes name",
            ),
            (&["--metrics-address", "9090"], "ADDR:PORT"),
            (&["--identity", ""], "not a usable name"),
        ];
        for (extra, expected) in bad {
            let mut list = vec!["--kubeconfig", path.as_str()];
            list.extend_from_slice(extra);
            let err = parse_config(&args(&list), &env).unwrap_err().to_string();
            assert!(err.contains(expected), "{extra:?}: {err}");
        }
        let err = parse_config(&[], &|_| None).unwrap_err().to_string();
        assert!(err.contains("no cluster"), "{err}");
        assert_eq!(
            parse_config(&args(&["--help"]), &env).unwrap_err(),
            FlagError::Help
        );
    }
}
