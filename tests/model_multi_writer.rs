//! Model-based test of issue 21's first law, "one address, one owner,
//! whoever writes", through the real binary with many writers at once.
//!
//! Each sequence draws random steps from a seed:
//!
//! - bursts of ADD and DEL by several plugin processes in parallel (the real
//!   binary; direct mode while no daemon runs), each drawing one of several
//!   conflists: two with different ranges for one `ipam.network`, one with
//!   a `gateway` a pod may hold, bounded ranges of both families, an
//!   isolated network over the same subnet and its conflist without
//!   `isolated`; now and then an ADD asks for an address of its conflist's
//!   blocks with `IP=`;
//! - during a burst or between them, the daemon restarted by SIGTERM or by
//!   SIGKILL, stopped (direct mode), started, or replaced by a second daemon
//!   started beside it (a DaemonSet surge update);
//! - the conflist most plugins use flipped;
//! - a rollback to upstream: the daemon stops, `metis admin downgrade`
//!   readies the file (half the time), and an upstream-like writer
//!   ([`common::upstream::Upstream::open`]: upstream's store as SQL on the
//!   file) allocates, releases (with upstream's 1-minute cooldown, or 1 s so
//!   that its releases come back within the sequence), adds blocks (overlapping
//!   ones, a /127 and a /128 with 64 rows) and undrains.
//!
//! A model records who holds what, and by whom it was handed out. After
//! every step:
//!
//! - the database's allocated rows are exactly the model's holdings (a
//!   failed ADD is followed by the runtime's DEL, as kubelet does);
//! - no address has two owners on the node (an isolated network is an
//!   address space of its own) unless every owner after the first got it
//!   from upstream, out of a block Metis had not quarantined or retired;
//! - every address Metis handed out lies inside the asking conflist's
//!   ranges and bounds, or inside a block upstream added (Metis has no
//!   record of its source, so it serves it as granted, as it serves the
//!   blocks of a node upgraded from upstream), and no result's gateway is a
//!   pod's address;
//! - a repeated ADD returns exactly what its owner holds, also an owner
//!   upstream served (its block's gateway held by a pod or not);
//! - no ADD fails but with code 7 or 11 (or 100 for an owner that already
//!   holds an address no result may carry), no DEL fails (while the daemon is
//!   SIGKILLed, a call it had taken may fail; the runtime retries it);
//! - after `metis admin downgrade`, upstream hands out no gateway a live
//!   result names, nothing another owner holds and nothing outside every
//!   conflist of the network, and its IPv6 expansion in a range without
//!   bounds never meets an existing row;
//! - `metis admin check` is clean, or every problem it names is something
//!   upstream made (a block it added, a row it wrote or handed out);
//! - a running daemon serves.
//!
//! Plugins run in parallel, so the interleaving is the one thing a seed
//! does not fix; the trace records each call's answer in completion order.
//! `METIS_WRITERS_SEQUENCES` (default 2) and `METIS_WRITERS_STEPS` (default
//! 12) set the size, `METIS_WRITERS_SEED` and `METIS_WRITERS_FIRST` replay.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::node::{Block, NetConf, Node, Outcome, gateways, holdings_match, strip_prefix};
use common::rng::{Rng, run_sequences};
use common::upstream::{UPSTREAM_COOLDOWN_MS, Upstream};
use common::{Plugin, wait_for};

/// The upstream-like writer takes part (a rollback to upstream and forward
/// again).
const UPSTREAM_WRITER: bool = true;

/// Upstream allocating out of a block Metis quarantined or retired counts
/// as a violation: Metis must keep such blocks out of upstream's reach.
/// Before such blocks were `Withheld` in `cidr_blocks.state`,
/// METIS_WRITERS_SEED=108588657720119 (sequence 0, 50 steps) had upstream add
/// 2001:db8:43::/127 (64 rows, most outside it), Metis quarantine it, and
/// upstream, in the next rollback, hand out 2001:db8:43::1 from it: its
/// state still said `Ready`.
const UPSTREAM_MUST_NOT_SEE_HIDDEN_BLOCKS: bool = true;

/// The conflist with a `gateway` inside the range takes part. It found a
/// pod handed 198.18.40.1 by "pods-gw" (gateway .6) while "pods" returned
/// .1 as its gateway, in both orders: across steps
/// (METIS_WRITERS_SEED=943285301328036, sequence 0; closed by refusing a
/// block whose result gateway a pod holds) and within one burst
/// (469419440393768, sequence 0, and 71230830857771, sequence 2; closed by
/// `metis_gateways`, the record of the gateways live results name, which
/// no hand-out takes).
const GATEWAY_CONFLIST: bool = true;

/// Upstream's `AddCIDR` takes part. Before every hand-out was checked
/// against the config in force, METIS_WRITERS_SEED=219593297541099 (sequence
/// 0, 20 steps) had upstream add 2001:db8:44::/128 to network "other" during
/// a rollback, and the next direct-mode ADD of conflist "other"
/// (2001:db8:41::/124) was handed 2001:db8:44:: (now served as granted: see
/// `inside`).
const UPSTREAM_ADDS_BLOCKS: bool = true;

/// Upstream's `AddCIDR` may add a block over another network's. Before the
/// hand-out check asked whether any other block of the node's address
/// space holds the address, METIS_WRITERS_SEED=331017169582590 (sequence 0,
/// 50 steps) had upstream add 198.18.40.0/29 to network "other" over
/// network "pods"' 198.18.40.0/28, where a pod held 198.18.40.2, and the
/// next direct-mode ADD of conflist "other" handed out 198.18.40.2 again;
/// METIS_WRITERS_SEED=228844890931685 (sequence 1, 50 steps) had one burst
/// hand 198.18.40.3 out of both blocks.
const UPSTREAM_ADDS_OVERLAPPING_BLOCKS: bool = true;

/// Upstream's undrain takes part. Before retired blocks were kept out of
/// upstream's reach and every hand-out was checked against the config in
/// force, METIS_WRITERS_SEED=314403337451512 (sequence 0, 20 steps) had
/// upstream undrain 198.18.40.16/28, which Metis retired when conflist
/// "pods-b" left, and the next ADD of conflist "pods-bounded"
/// (198.18.40.0/28, .4-.9) was handed 198.18.40.20.
const UPSTREAM_UNDRAINS: bool = true;

/// Plugins of one burst may use different conflists of one network. Before
/// direct mode laid out and allocated in one transaction,
/// METIS_WRITERS_SEED=537040382769179 (sequence 3, 20 steps; no upstream
/// writer) had, with no daemon running, one plugin ADD under "pods-b"
/// (198.18.40.16/28) while another ADDed under "pods-bounded"
/// (198.18.40.0/28, .4-.9), which was handed 198.18.40.18; and
/// METIS_WRITERS_SEED=43391826966582 (sequence 2, 25 steps), even with one
/// conflist per burst, failed an ADD with "UNIQUE constraint failed:
/// metis_bounds.network, metis_bounds.cidr".
const CONFLICTING_CONFLISTS_IN_ONE_BURST: bool = true;

/// Conflists of "pods" with and without IPv6 bounds alternate, so the bounds
/// narrow while pods hold addresses past the new `rangeEnd` (they keep them
/// until their DEL). Before `metis admin check` named such a row "outside
/// rangeStart..rangeEnd now in force" (a note while a pod holds it) instead
/// of blaming upstream, METIS_WRITERS_SEED=322644441218539 (sequence 3, 40
/// steps) had Metis hand 2001:db8:40::a, ::c and ::f out under conflist
/// "pods" (2001:db8:40::/124, no bounds), an ADD of "pods-bounded6"
/// (::2-::9) narrow the bounds, and `admin check` say "address
/// 2001:db8:40::a outside rangeStart..rangeEnd (upstream's IPv6 expansion)
/// is held by container \"p4-1\"", though upstream wrote none of them.
/// Off, "pods" itself has the bounds.
const V6_BOUNDS_NARROW_UNDER_PODS: bool = true;

/// Half the rollbacks run `metis admin downgrade` first, after which
/// upstream must find nothing it can hand out twice or out of range.
const DOWNGRADE: bool = true;

/// Plugin processes of one burst at most, and calls each makes at most.
const MAX_PLUGINS: u64 = 6;
const MAX_CALLS: u64 = 4;
const IFNAMES: &[&str] = &["eth0", "net1"];
const UPSTREAM_CONTAINERS: &[&str] = &["u0", "u1", "p0-0"];

/// The conflists plugins draw from.
fn conflists() -> Vec<NetConf> {
    let pods = |name, ranges: &[&'static str]| NetConf {
        network: Some("pods"),
        ..NetConf::new(name, ranges)
    };
    // Without narrowing, the one IPv6 range of "pods" is always bounded.
    let v6_bounds = (!V6_BOUNDS_NARROW_UNDER_PODS).then_some(("2001:db8:40::2", "2001:db8:40::9"));
    vec![
        NetConf {
            bounds: v6_bounds,
            ..pods("pods", &["198.18.40.0/28", "2001:db8:40::/124"])
        },
        // A second conflist for one network, another range.
        pods("pods-b", &["198.18.40.16/28"]),
        // A gateway inside the range, which a pod of another conflist may
        // hold (and whose default gateway, .1, a pod of this one may).
        NetConf {
            gateway: Some("198.18.40.6"),
            ..pods("pods-gw", &["198.18.40.0/28"])
        },
        NetConf {
            bounds: Some(("198.18.40.4", "198.18.40.9")),
            ..pods("pods-bounded", &["198.18.40.0/28"])
        },
        // A bounded IPv6 range: upstream expands past its end.
        NetConf {
            bounds: Some(("2001:db8:40::2", "2001:db8:40::9")),
            ..pods("pods-bounded6", &["198.18.40.0/28", "2001:db8:40::/124"])
        },
        NetConf {
            isolated: true,
            ..NetConf::new("iso", &["198.18.40.0/28"])
        },
        // Its conflist drops `isolated`: refused while its block overlaps.
        NetConf::new("iso", &["198.18.40.0/28"]),
        NetConf::new("other", &["198.18.41.0/29", "2001:db8:41::/124"]),
    ]
    .into_iter()
    .filter(|conf| GATEWAY_CONFLIST || conf.gateway.is_none())
    .filter(|conf| V6_BOUNDS_NARROW_UNDER_PODS || conf.name != "pods-bounded6")
    .collect()
}

/// The block upstream adds to network "other" over network "pods"'.
const OVERLAPPING: &str = "198.18.40.0/29";

/// Blocks upstream's `AddCIDR` adds: (network, cidr).
const UPSTREAM_BLOCKS: &[(&str, &str)] = &[
    // A block no conflist names.
    ("pods", "198.18.42.0/29"),
    // Over another network's block.
    ("other", OVERLAPPING),
    // 64 rows, most outside the prefix.
    ("pods", "2001:db8:43::/127"),
    ("other", "2001:db8:44::/128"),
];

/// (network, container, interface).
type Owner = (String, String, String);

/// Who handed an address out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writer {
    Metis,
    Upstream,
}

#[derive(Debug, Clone)]
struct Holding {
    address: IpAddr,
    by: Writer,
    /// When it was handed out (step number), to order owners.
    step: usize,
    /// The gateway the last result returning it named (none: no result
    /// reached the runtime, or upstream handed it out).
    gateway: Option<IpAddr>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verb {
    Add,
    Del,
}

#[derive(Debug, Clone)]
struct Call {
    verb: Verb,
    conf: usize,
    container: String,
    ifname: &'static str,
    /// An address asked for with `IP=` (ADD only).
    requested: Option<IpAddr>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DaemonEvent {
    Restart,
    Kill,
    Surge,
    Down,
    Up,
}

#[derive(Debug, Clone)]
enum UpstreamOp {
    Allocate {
        network: &'static str,
        v6: bool,
        container: &'static str,
        ifname: &'static str,
    },
    Release {
        network: &'static str,
        container: String,
        ifname: &'static str,
    },
    AddCidr(&'static str, &'static str),
    Undrain {
        network: &'static str,
        v6: bool,
    },
}

#[derive(Debug, Clone)]
enum Step {
    /// Plugins in parallel, one list of calls each; the event happens once
    /// a third of the calls have answered.
    Burst {
        plugins: Vec<Vec<Call>>,
        during: Option<DaemonEvent>,
    },
    Daemon(DaemonEvent),
    /// The conflist most calls use from now on.
    Flip(usize),
    /// The daemon stops; `metis admin downgrade` readies the file when
    /// `downgrade` (the documented rollback step); upstream's store writes
    /// it.
    Rollback {
        downgrade: bool,
        ops: Vec<UpstreamOp>,
    },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Burst { plugins, during } => {
                write!(f, "burst of {} plugins", plugins.len())?;
                if let Some(event) = during {
                    write!(f, " during {event:?}")?;
                }
                for (i, calls) in plugins.iter().enumerate() {
                    let calls: Vec<String> = calls
                        .iter()
                        .map(|c| {
                            format!("{:?} {}/{} conf {}", c.verb, c.container, c.ifname, c.conf)
                        })
                        .collect();
                    write!(f, "\n    plugin {i}: {}", calls.join(", "))?;
                }
                Ok(())
            }
            Step::Daemon(event) => write!(f, "daemon {event:?}"),
            Step::Flip(conf) => write!(f, "conflist {conf} from now on"),
            Step::Rollback { downgrade, ops } => {
                let how = if *downgrade {
                    "after metis admin downgrade"
                } else {
                    "as is"
                };
                write!(f, "rollback to upstream, {how}: {ops:?}")
            }
        }
    }
}

#[derive(Debug, Default)]
struct Stats {
    adds_ok: u64,
    refusals: BTreeMap<u64, u64>,
    dels: u64,
    bursts: u64,
    daemon_events: BTreeMap<String, u64>,
    upstream_allocations: u64,
    upstream_ops: u64,
    direct_mode_calls: u64,
}

impl Stats {
    fn add(&mut self, other: Stats) {
        self.adds_ok += other.adds_ok;
        self.dels += other.dels;
        self.bursts += other.bursts;
        self.upstream_allocations += other.upstream_allocations;
        self.upstream_ops += other.upstream_ops;
        self.direct_mode_calls += other.direct_mode_calls;
        for (code, n) in other.refusals {
            *self.refusals.entry(code).or_default() += n;
        }
        for (event, n) in other.daemon_events {
            *self.daemon_events.entry(event).or_default() += n;
        }
    }
}

/// One answered call of a burst.
struct Answer {
    plugin: usize,
    call: Call,
    outcome: Outcome,
    gateways: Vec<IpAddr>,
}

/// One sequence: the node and what the model believes it holds.
struct Sequence {
    node: Node,
    confs: Vec<NetConf>,
    current: usize,
    held: BTreeMap<Owner, Vec<Holding>>,
    /// What upstream made, as the words `metis admin check` would name it
    /// by: block ids (`block N`), prefixes, addresses it handed out or
    /// released.
    upstream_made: BTreeSet<String>,
    /// Blocks upstream's `AddCIDR` added: (network, block).
    upstream_blocks: Vec<(String, Block)>,
    step: usize,
    /// The gateways this step's ADDs returned, with the asking owner.
    gateways: Vec<(Owner, Vec<IpAddr>)>,
    /// The cooldown the upstream-like writer releases with.
    upstream_cooldown_ms: i64,
    stats: Stats,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap())
}

impl Sequence {
    fn new(rng: &mut Rng) -> Sequence {
        // "1s": released rows come back within the sequence, so every
        // writer meets rows whose cooldown ended (settled or not).
        let cooldown = ["0", "1s", "1m"][rng.index(3)];
        let upstream_cooldown_ms = [UPSTREAM_COOLDOWN_MS, 1_000][rng.index(2)];
        Sequence {
            node: Node::new("writers-model", cooldown),
            confs: conflists(),
            current: 0,
            held: BTreeMap::new(),
            upstream_made: BTreeSet::new(),
            upstream_blocks: Vec::new(),
            step: 0,
            gateways: Vec::new(),
            upstream_cooldown_ms,
            stats: Stats::default(),
        }
    }

    fn draw(&mut self, rng: &mut Rng) -> Step {
        let up = self.node.daemon_up();
        let event = |rng: &mut Rng| match rng.below(5) {
            0 => DaemonEvent::Restart,
            1 => DaemonEvent::Kill,
            2 => DaemonEvent::Surge,
            _ if up => DaemonEvent::Down,
            _ => DaemonEvent::Up,
        };
        match rng.below(100) {
            0..60 => {
                // The one conflist of network "pods" this burst uses, unless
                // they may conflict.
                let pods = (!CONFLICTING_CONFLISTS_IN_ONE_BURST).then(|| self.draw_conf(rng));
                let plugins = (0..1 + rng.below(MAX_PLUGINS))
                    .map(|plugin| {
                        (0..1 + rng.below(MAX_CALLS))
                            .map(|_| self.draw_call(rng, plugin, pods))
                            .collect()
                    })
                    .collect();
                let during = rng.chance(40).then(|| event(rng));
                Step::Burst { plugins, during }
            }
            60..75 => Step::Daemon(event(rng)),
            75..85 => Step::Flip(rng.index(self.confs.len())),
            _ if UPSTREAM_WRITER => Step::Rollback {
                downgrade: DOWNGRADE && rng.chance(50),
                ops: (0..1 + rng.below(4))
                    .map(|_| self.draw_upstream(rng))
                    .collect(),
            },
            _ => Step::Daemon(event(rng)),
        }
    }

    /// Plugin `plugin` only ever calls for its own containers, so calls of
    /// parallel plugins never share an owner.
    fn draw_call(&self, rng: &mut Rng, plugin: u64, pods: Option<usize>) -> Call {
        let mut conf = self.draw_conf(rng);
        if let Some(pods) = pods
            && self.confs[conf].network() == "pods"
        {
            conf = pods;
        }
        let verb = if rng.chance(60) { Verb::Add } else { Verb::Del };
        // Now and then an address of the conflist's blocks asked for.
        let blocks = self.confs[conf].blocks();
        let requested = (verb == Verb::Add && !blocks.is_empty() && rng.chance(15)).then(|| {
            let block = blocks[rng.index(blocks.len())];
            block.nth(u128::from(rng.next_u64()) % block.size())
        });
        Call {
            verb,
            conf,
            container: format!("p{plugin}-{}", rng.below(3)),
            ifname: IFNAMES[rng.index(IFNAMES.len())],
            requested,
        }
    }

    /// Mostly the current conflist.
    fn draw_conf(&self, rng: &mut Rng) -> usize {
        if rng.chance(60) {
            self.current
        } else {
            rng.index(self.confs.len())
        }
    }

    fn draw_upstream(&self, rng: &mut Rng) -> UpstreamOp {
        let networks = ["pods", "other", "iso"];
        let network = networks[rng.index(networks.len())];
        match rng.below(10) {
            0..5 => UpstreamOp::Allocate {
                network,
                v6: rng.chance(40),
                container: UPSTREAM_CONTAINERS[rng.index(UPSTREAM_CONTAINERS.len())],
                ifname: IFNAMES[rng.index(IFNAMES.len())],
            },
            5..7 => {
                // Anyone's: upstream's DEL of a pod Metis started, too.
                let owners: Vec<&Owner> = self.held.keys().collect();
                match owners.is_empty() {
                    true => UpstreamOp::Allocate {
                        network,
                        v6: false,
                        container: UPSTREAM_CONTAINERS[0],
                        ifname: "eth0",
                    },
                    false => {
                        let (network, container, ifname) = owners[rng.index(owners.len())];
                        UpstreamOp::Release {
                            network: networks
                                .into_iter()
                                .find(|n| n == network)
                                .unwrap_or("pods"),
                            container: container.clone(),
                            ifname: IFNAMES
                                .iter()
                                .find(|i| *i == ifname)
                                .copied()
                                .unwrap_or("eth0"),
                        }
                    }
                }
            }
            7..9 if UPSTREAM_ADDS_BLOCKS => {
                let blocks: Vec<&(&str, &str)> = UPSTREAM_BLOCKS
                    .iter()
                    .filter(|(_, cidr)| UPSTREAM_ADDS_OVERLAPPING_BLOCKS || *cidr != OVERLAPPING)
                    .collect();
                let (network, cidr) = blocks[rng.index(blocks.len())];
                UpstreamOp::AddCidr(network, cidr)
            }
            9 if UPSTREAM_UNDRAINS => UpstreamOp::Undrain {
                network,
                v6: rng.chance(20),
            },
            _ => UpstreamOp::Allocate {
                network,
                v6: rng.chance(40),
                container: UPSTREAM_CONTAINERS[rng.index(UPSTREAM_CONTAINERS.len())],
                ifname: IFNAMES[rng.index(IFNAMES.len())],
            },
        }
    }

    fn run(&mut self, step: &Step, trace: &mut Vec<String>) -> Result<(), String> {
        self.step += 1;
        self.gateways.clear();
        match step {
            Step::Burst { plugins, during } => self.burst(plugins, *during, trace),
            Step::Daemon(event) => {
                self.event(*event);
                Ok(())
            }
            Step::Flip(conf) => {
                self.current = *conf;
                Ok(())
            }
            Step::Rollback { downgrade, ops } => {
                self.node.stop();
                let readied = *downgrade && self.node.db_path().exists();
                if readied {
                    let path = self.node.db_path();
                    let output =
                        common::metis(&["admin", "downgrade", "--db-path", path.to_str().unwrap()]);
                    trace.push(format!("  metis admin downgrade: {output:?}"));
                    if !output.status.success() {
                        return Err(format!("metis admin downgrade failed: {output:?}"));
                    }
                }
                for op in ops {
                    let done = self.upstream(op, readied)?;
                    trace.push(format!("  upstream {op:?}: {done}"));
                }
                Ok(())
            }
        }
    }

    fn event(&mut self, event: DaemonEvent) {
        *self
            .stats
            .daemon_events
            .entry(format!("{event:?}"))
            .or_default() += 1;
        match event {
            DaemonEvent::Restart => {
                self.node.stop();
                self.node.start(&[]);
            }
            DaemonEvent::Kill => {
                self.node.kill();
                self.node.start(&[]);
            }
            DaemonEvent::Surge => self.node.surge(&[]),
            DaemonEvent::Down => self.node.stop(),
            DaemonEvent::Up => {
                if !self.node.daemon_up() {
                    self.node.start(&[]);
                }
            }
        }
    }

    /// Runs the plugins in parallel (and the event once a third of the
    /// calls answered), then judges every answer and does what the runtime
    /// does after a failed call: DEL after a failed ADD, DEL again after a
    /// failed DEL.
    fn burst(
        &mut self,
        plugins: &[Vec<Call>],
        during: Option<DaemonEvent>,
        trace: &mut Vec<String>,
    ) -> Result<(), String> {
        self.stats.bursts += 1;
        // Rendered up front: the threads need no part of the node.
        let inputs: Vec<Vec<(Call, String)>> = plugins
            .iter()
            .map(|calls| {
                calls
                    .iter()
                    .map(|call| (call.clone(), self.render(call)))
                    .collect()
            })
            .collect();
        let total: usize = inputs.iter().map(Vec::len).sum();
        let answered = AtomicUsize::new(0);
        let answers = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for (plugin, calls) in inputs.iter().enumerate() {
                let (answered, answers) = (&answered, &answers);
                scope.spawn(move || {
                    for (call, stdin) in calls {
                        let answer = run_call(plugin, call, stdin);
                        answers.lock().unwrap().push(answer);
                        answered.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
            if let Some(event) = during {
                wait_for("a third of the burst", Duration::from_secs(120), || {
                    answered.load(Ordering::SeqCst) * 3 >= total
                });
                self.event(event);
            }
        });
        let killed = during == Some(DaemonEvent::Kill);
        let answers = answers.into_inner().unwrap();
        let mut retries = Vec::new();
        for answer in answers {
            trace.push(format!(
                "  plugin {} {:?} {}/{} conf {}{}: {:?} gateways {:?}",
                answer.plugin,
                answer.call.verb,
                answer.call.container,
                answer.call.ifname,
                answer.call.conf,
                answer
                    .call
                    .requested
                    .map(|ip| format!(" IP={ip}"))
                    .unwrap_or_default(),
                answer.outcome,
                answer.gateways
            ));
            if let Some(retry) = self.judge(&answer, killed)? {
                retries.push(retry);
            }
        }
        for call in retries {
            // Only a SIGKILL leaves a call's outcome unknown: a refused ADD
            // must have left nothing.
            if killed {
                self.adopt_unanswered(&call, trace)?;
            }
            let answer = run_call(0, &call, &self.render(&call));
            trace.push(format!(
                "  runtime's DEL {}/{} conf {}: {:?}",
                call.container, call.ifname, call.conf, answer.outcome
            ));
            self.judge(&answer, false)?;
        }
        Ok(())
    }

    fn render(&self, call: &Call) -> String {
        self.confs[call.conf].render(&self.node.dir, &[], None)
    }

    fn owner(&self, call: &Call) -> Owner {
        (
            self.confs[call.conf].network().to_string(),
            call.container.clone(),
            call.ifname.to_string(),
        )
    }

    /// An address Metis handed out for `call` must lie inside its conflist's
    /// ranges and bounds, or inside a block upstream added: Metis has no
    /// record of its source, so it serves it as granted (as it serves the
    /// blocks of a node upgraded from upstream).
    fn inside(&self, call: &Call, ip: IpAddr) -> Result<(), String> {
        let conf = &self.confs[call.conf];
        let granted = self
            .upstream_blocks
            .iter()
            .any(|(network, b)| network == conf.network() && b.contains(ip));
        if granted || (conf.blocks().iter().any(|b| b.contains(ip)) && conf.in_bounds(ip)) {
            return Ok(());
        }
        Err(format!(
            "ADD {}/{} of conflist {} ({:?}, bounds {:?}) was handed {ip}, outside it",
            call.container, call.ifname, conf.name, conf.ranges, conf.bounds
        ))
    }

    /// A call whose answer the SIGKILLed daemon never sent may still have
    /// committed: before the runtime's DEL, the model takes what the
    /// database holds for the container and interface (a new address of the
    /// named network checked as any hand-out; one a DEL released, in any
    /// network, is gone).
    fn adopt_unanswered(&mut self, call: &Call, trace: &mut Vec<String>) -> Result<(), String> {
        let owner = self.owner(call);
        let in_database: Vec<(String, IpAddr)> = self
            .node
            .holdings()
            .into_iter()
            .filter(|h| (&h.container, &h.ifname) == (&owner.1, &owner.2))
            .map(|h| (h.network, h.address))
            .collect();
        for (who, held) in self.held.iter_mut() {
            if (&who.1, &who.2) == (&owner.1, &owner.2) {
                held.retain(|h| in_database.contains(&(who.0.clone(), h.address)));
            }
        }
        self.held.retain(|_, held| !held.is_empty());
        let unanswered: Vec<IpAddr> = in_database
            .into_iter()
            .filter(|(network, _)| *network == owner.0)
            .map(|(_, ip)| ip)
            .filter(|ip| {
                !self
                    .held
                    .get(&owner)
                    .is_some_and(|held| held.iter().any(|h| h.address == *ip))
            })
            .collect();
        for ip in unanswered {
            self.inside(call, ip)?;
            trace.push(format!("  committed though unanswered: {ip}"));
            self.held.entry(owner.clone()).or_default().push(Holding {
                address: ip,
                by: Writer::Metis,
                step: self.step,
                gateway: None,
            });
        }
        Ok(())
    }

    /// Checks one answer and applies it to the model; returns the DEL the
    /// runtime sends next when the call failed.
    fn judge(&mut self, answer: &Answer, killed: bool) -> Result<Option<Call>, String> {
        let call = &answer.call;
        let owner = self.owner(call);
        let del = Call {
            verb: Verb::Del,
            requested: None,
            ..call.clone()
        };
        match (call.verb, &answer.outcome) {
            (Verb::Add, Outcome::Ok(ips)) => {
                self.stats.adds_ok += 1;
                let before: Vec<IpAddr> = self
                    .held
                    .get(&owner)
                    .map(|h| h.iter().map(|h| h.address).collect())
                    .unwrap_or_default();
                let mut now: Vec<Holding> = Vec::new();
                for ip in ips.iter().map(|ip| strip_prefix(ip)) {
                    // A repeated ADD returns exactly what the owner holds
                    // (upstream's pods too, whatever their block's gateway).
                    let repeat = before.iter().any(|b| b.is_ipv6() == ip.is_ipv6());
                    if repeat && !before.contains(&ip) {
                        return Err(format!(
                            "a repeated ADD returned {ip}, not what {owner:?} holds: {before:?}"
                        ));
                    }
                    let asked = call.requested.filter(|r| r.is_ipv6() == ip.is_ipv6());
                    if !repeat && asked.is_some_and(|asked| asked != ip) {
                        return Err(format!("ADD asked for {asked:?} and got {ip}"));
                    }
                    if !before.contains(&ip) {
                        self.inside(call, ip)?;
                    }
                    if answer.gateways.contains(&ip) {
                        return Err(format!("ADD returned {ip} as its own gateway"));
                    }
                    // A repeat ADD keeps when and by whom it was handed out.
                    let earlier = self
                        .held
                        .get(&owner)
                        .and_then(|held| held.iter().find(|h| h.address == ip).cloned());
                    let gateway = answer
                        .gateways
                        .iter()
                        .copied()
                        .find(|g| g.is_ipv6() == ip.is_ipv6());
                    now.push(Holding {
                        gateway,
                        ..earlier.unwrap_or(Holding {
                            address: ip,
                            by: Writer::Metis,
                            step: self.step,
                            gateway: None,
                        })
                    });
                }
                // Families the conflist does not ask for stay held.
                let kept = self.held.remove(&owner).unwrap_or_default();
                let families: Vec<bool> = now.iter().map(|h| h.address.is_ipv6()).collect();
                now.extend(
                    kept.into_iter()
                        .filter(|h| !families.contains(&h.address.is_ipv6())),
                );
                self.gateways.push((owner.clone(), answer.gateways.clone()));
                self.held.insert(owner, now);
                Ok(None)
            }
            (Verb::Add, Outcome::Error { code, msg }) => {
                *self.stats.refusals.entry(*code).or_default() += 1;
                // Code 100 only for an owner that holds an address no
                // result may carry any more (its block quarantined, say).
                // And for an address asked for that is taken, reserved,
                // cooling or outside every block.
                let repeat = self.held.contains_key(&owner) || call.requested.is_some();
                let legitimate =
                    (matches!(code, 7 | 11) || (*code == 100 && repeat)) && !msg.contains("UNIQUE");
                if !legitimate && !killed {
                    return Err(format!(
                        "ADD {}/{}: code {code}: {msg}",
                        call.container, call.ifname
                    ));
                }
                Ok(Some(del))
            }
            (Verb::Del, Outcome::Ok(_)) => {
                self.stats.dels += 1;
                // Nothing in the named network: what another network holds
                // for exactly this container and interface goes instead.
                let released: Vec<Owner> = match self.held.contains_key(&owner) {
                    true => vec![owner],
                    false => self
                        .held
                        .keys()
                        .filter(|(_, c, i)| *c == call.container && i == call.ifname)
                        .cloned()
                        .collect(),
                };
                for who in released {
                    self.held.remove(&who);
                }
                Ok(None)
            }
            (verb, outcome) if killed => {
                let _ = (verb, outcome);
                Ok(Some(del))
            }
            (verb, outcome) => Err(format!(
                "{verb:?} {}/{} conf {}: {outcome:?}",
                call.container, call.ifname, call.conf
            )),
        }
    }

    /// One upstream store operation on the file; returns what it did.
    /// After `metis admin downgrade` (`readied`), upstream must find nothing
    /// it can hand out twice or out of range in the blocks Metis left.
    fn upstream(&mut self, op: &UpstreamOp, readied: bool) -> Result<String, String> {
        self.stats.upstream_ops += 1;
        if !self.node.db_path().exists() {
            return Ok("no database yet".into());
        }
        let hidden = self.hidden_blocks();
        let mut upstream = Upstream::open(&self.node.db_path());
        match op {
            UpstreamOp::Allocate {
                network,
                v6,
                container,
                ifname,
            } => match upstream.allocate(network, *v6, container, ifname, now_ms()) {
                Ok(got) if got.fresh => {
                    self.stats.upstream_allocations += 1;
                    if UPSTREAM_MUST_NOT_SEE_HIDDEN_BLOCKS && hidden.contains(&got.block_id) {
                        return Err(format!(
                            "upstream allocated {} from block {}, which Metis had quarantined or \
                             retired: it still looks Ready to upstream",
                            got.address, got.block_id
                        ));
                    }
                    if readied {
                        self.fit_for_upstream(network, got.address)?;
                    }
                    self.upstream_made.insert(got.address.to_string());
                    self.upstream_made.insert(format!("block {}", got.block_id));
                    let owner = (
                        network.to_string(),
                        container.to_string(),
                        ifname.to_string(),
                    );
                    self.held.entry(owner).or_default().push(Holding {
                        address: got.address,
                        by: Writer::Upstream,
                        step: self.step,
                        gateway: None,
                    });
                    Ok(format!("{got:?}"))
                }
                Ok(got) => Ok(format!("{got:?}")),
                // After a downgrade, IPv6 expansion in a range without
                // bounds never meets an existing row (requested addresses,
                // Metis's lazy rows): only a bounded range ends that way.
                Err(e) if readied && *v6 && e.contains("UNIQUE") && self.unbounded(network) => {
                    Err(format!(
                        "after metis admin downgrade, upstream's IPv6 allocation in network \
                         {network} failed on an existing row: {e}"
                    ))
                }
                Err(e) => Ok(e),
            },
            UpstreamOp::Release {
                network,
                container,
                ifname,
            } => {
                let released = upstream.release(
                    network,
                    container,
                    ifname,
                    self.upstream_cooldown_ms,
                    now_ms(),
                );
                let owner = (network.to_string(), container.clone(), ifname.to_string());
                self.held.remove(&owner);
                // Upstream frees a row at a position Metis reserves (a pod
                // there gives it back to the reservation on a Metis DEL).
                self.upstream_made
                    .extend(released.iter().map(ToString::to_string));
                Ok(format!("released {released:?}"))
            }
            UpstreamOp::AddCidr(network, cidr) => match upstream.add_cidr(network, cidr) {
                Ok(id) => {
                    self.upstream_blocks
                        .push((network.to_string(), Block::parse(cidr)));
                    self.upstream_made.insert(format!("block {id}"));
                    self.upstream_made.insert(cidr.to_string());
                    Ok(format!("block {id}"))
                }
                Err(e) => Ok(e),
            },
            UpstreamOp::Undrain { network, v6 } => {
                let id = upstream.undrain_one(network, *v6);
                if let Some(id) = id {
                    self.upstream_made.insert(format!("block {id}"));
                }
                Ok(format!("undrained {id:?}"))
            }
        }
    }

    /// Whether no conflist of `network` bounds its ranges or names a
    /// gateway.
    fn unbounded(&self, network: &str) -> bool {
        self.confs
            .iter()
            .filter(|conf| conf.network() == network)
            .all(|conf| conf.bounds.is_none() && conf.gateway.is_none())
    }

    /// An address upstream handed out in `network` after `metis admin
    /// downgrade` out of a block Metis left: held by no one else in its
    /// address space, and inside the ranges and bounds of some conflist of
    /// the network.
    fn fit_for_upstream(&self, network: &str, address: IpAddr) -> Result<(), String> {
        let own_block = self
            .upstream_blocks
            .iter()
            .any(|(n, b)| n == network && b.contains(address));
        if own_block {
            // What upstream does with a block it added is its own doing.
            return Ok(());
        }
        let isolated = self.isolated();
        let holder = self.held.iter().find(|(owner, held)| {
            let shared =
                owner.0 == network || (!isolated.contains(&owner.0) && !isolated.contains(network));
            shared && held.iter().any(|h| h.address == address)
        });
        if let Some((owner, _)) = holder {
            return Err(format!(
                "after metis admin downgrade, upstream handed out {address} in network {network}, \
                 which {owner:?} holds"
            ));
        }
        // Nor the gateway a live result names (the downgrade reserves it).
        let named_by = self.held.iter().find(|(owner, held)| {
            let shared =
                owner.0 == network || (!isolated.contains(&owner.0) && !isolated.contains(network));
            shared && held.iter().any(|h| h.gateway == Some(address))
        });
        if let Some((owner, _)) = named_by {
            return Err(format!(
                "after metis admin downgrade, upstream handed out {address} in network {network}, \
                 the gateway of the live result of {owner:?}"
            ));
        }
        let in_range = self.confs.iter().any(|conf| {
            conf.network() == network
                && conf.blocks().iter().any(|b| b.contains(address))
                && conf.in_bounds(address)
        });
        if !in_range {
            return Err(format!(
                "after metis admin downgrade, upstream handed out {address} in network {network}, \
                 outside every conflist of it"
            ));
        }
        Ok(())
    }

    /// Blocks Metis quarantined or retired (which upstream must not
    /// allocate from).
    fn hidden_blocks(&self) -> BTreeSet<i64> {
        let conn = common::db(&self.node.db_path());
        let Ok(mut stmt) = conn.prepare(
            "SELECT block_id FROM metis_blocks WHERE quarantine IS NOT NULL OR retired != 0",
        ) else {
            return BTreeSet::new();
        };
        stmt.query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// Networks Metis records as isolated.
    fn isolated(&self) -> BTreeSet<String> {
        if !self.node.db_path().exists() {
            return BTreeSet::new();
        }
        let conn = common::db(&self.node.db_path());
        let Ok(mut stmt) = conn.prepare("SELECT network FROM metis_networks WHERE isolated = 1")
        else {
            return BTreeSet::new();
        };
        stmt.query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// Every row of `metis_gateways` with its allocation row, for a failure.
    fn gateway_records(&self) -> Vec<String> {
        let conn = common::db(&self.node.db_path());
        let Ok(mut stmt) = conn.prepare(
            "SELECT g.row_id, g.gateway, g.container_id, g.interface_name, g.allocated_at, \
             a.address, a.is_allocated, a.container_id, a.interface_name, a.allocated_at \
             FROM metis_gateways g LEFT JOIN ip_addresses a ON a.id = g.row_id",
        ) else {
            return Vec::new();
        };
        stmt.query_map([], |r| {
            Ok((0..10)
                .map(|i| format!("{:?}", r.get_ref(i).unwrap()))
                .collect::<Vec<_>>()
                .join("|"))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect()
    }

    /// The invariants every step must leave true.
    fn verify(&self) -> Result<(), String> {
        let expected = self.held.iter().flat_map(|((n, c, i), held)| {
            held.iter().map(move |h| common::node::Holding {
                network: n.clone(),
                container: c.clone(),
                ifname: i.clone(),
                address: h.address,
            })
        });
        holdings_match(self.node.holdings(), expected)?;
        self.one_owner_each()?;
        self.gateways_are_no_pods()?;
        if self.node.db_path().exists() {
            let check = self.node.admin_check();
            let text = String::from_utf8_lossy(&check.stdout).into_owned();
            if !check.status.success() {
                let foreign: Vec<&str> = text
                    .lines()
                    .filter(|line| line.trim_start().starts_with("- "))
                    .filter(|line| !line.contains("of the kind above"))
                    .filter(|line| !self.names_upstream_made(line))
                    .collect();
                if foreign.is_empty() && text.contains("problems") {
                    // Every problem is one upstream made.
                } else {
                    return Err(format!(
                        "metis admin check names problems upstream did not make: {foreign:#?}\n{text}{}",
                        String::from_utf8_lossy(&check.stderr)
                    ));
                }
            }
        }
        if self.node.daemon_up() {
            let health = self.node.health();
            if !common::node::serving(&health) {
                return Err(format!("the daemon does not serve: {health:?}"));
            }
        }
        Ok(())
    }

    /// No address held by two owners of one address space, unless every
    /// owner after the first got it from upstream.
    fn one_owner_each(&self) -> Result<(), String> {
        let isolated = self.isolated();
        let space = |network: &str| match isolated.contains(network) {
            true => network.to_string(),
            false => String::new(),
        };
        let mut by_address: BTreeMap<(String, IpAddr), Vec<(&Owner, &Holding)>> = BTreeMap::new();
        for (owner, held) in &self.held {
            for holding in held {
                by_address
                    .entry((space(&owner.0), holding.address))
                    .or_default()
                    .push((owner, holding));
            }
        }
        for ((_, address), mut owners) in by_address {
            if owners.len() < 2 {
                continue;
            }
            owners.sort_by_key(|(_, h)| h.step);
            if owners[1..].iter().any(|(_, h)| h.by == Writer::Metis) {
                return Err(format!(
                    "Metis handed out {address}, which another owner held: {owners:?}"
                ));
            }
        }
        Ok(())
    }

    /// Whether a problem line of `admin check` names something upstream
    /// made: a block it added, undrained or allocated from, a prefix it
    /// added, an address it handed out.
    fn names_upstream_made(&self, line: &str) -> bool {
        self.upstream_made.iter().any(|word| {
            line.match_indices(word.as_str()).any(|(at, _)| {
                let next = line[at + word.len()..].chars().next();
                !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '.' || c == ':')
            })
        })
    }

    /// The step's ADD results' gateways must be no pod's address in the
    /// network's address space (results whose pod the step deleted again
    /// excepted: they are no longer in force).
    fn gateways_are_no_pods(&self) -> Result<(), String> {
        let isolated = self.isolated();
        for (asking, gateways) in &self.gateways {
            let network = &asking.0;
            let live = self.held.get(asking).is_some_and(|held| {
                held.iter()
                    .any(|h| h.gateway.is_some_and(|g| gateways.contains(&g)))
            });
            if !live {
                continue;
            }
            for gateway in gateways {
                let holder = self.held.iter().find(|(owner, held)| {
                    let shared = owner.0 == *network
                        || (!isolated.contains(&owner.0) && !isolated.contains(network));
                    shared && held.iter().any(|h| h.address == *gateway)
                });
                if let Some((owner, _)) = holder {
                    return Err(format!(
                        "an ADD of network {network} returned gateway {gateway}, which {owner:?} holds"
                    ));
                }
            }
        }
        // Every pair: no address Metis handed out is the gateway a live
        // result names (however many steps apart the two were handed out).
        let named = self.held.iter().flat_map(|(owner, held)| {
            held.iter()
                .filter_map(move |h| h.gateway.map(|gateway| (owner, gateway)))
        });
        for (named_by, gateway) in named {
            let holder = self.held.iter().find(|(owner, held)| {
                let shared = owner.0 == named_by.0
                    || (!isolated.contains(&owner.0) && !isolated.contains(&named_by.0));
                shared
                    && held
                        .iter()
                        .any(|h| h.address == gateway && h.by == Writer::Metis)
            });
            if let Some((owner, _)) = holder {
                return Err(format!(
                    "Metis handed {owner:?} {gateway}, the gateway of the live result of \
                     {named_by:?}; metis_gateways: {:?}",
                    self.gateway_records()
                ));
            }
        }
        Ok(())
    }
}

/// Runs one plugin call.
fn run_call(plugin: usize, call: &Call, stdin: &str) -> Answer {
    let verb = match call.verb {
        Verb::Add => "ADD",
        Verb::Del => "DEL",
    };
    let args = match call.requested {
        Some(ip) => format!("K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod;IP={ip}"),
        None => "K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod".to_string(),
    };
    let output = Plugin {
        ifname: call.ifname,
        args: &args,
        ..Plugin::new(verb, &call.container)
    }
    .run(stdin);
    Answer {
        plugin,
        call: call.clone(),
        outcome: Outcome::of(&output),
        gateways: gateways(&output),
    }
}

/// Runs one sequence, appending each step to `trace`.
fn run_sequence(seed: u64, steps: u64, trace: &mut Vec<String>) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let mut sequence = Sequence::new(&mut rng);
    trace.push(format!(
        "start: cooldown {}, upstream's {} ms",
        sequence.node.cooldown, sequence.upstream_cooldown_ms
    ));
    if rng.chance(70) {
        trace.push("daemon Up".into());
        sequence.event(DaemonEvent::Up);
    }
    for _ in 0..steps {
        let step = sequence.draw(&mut rng);
        trace.push(step.to_string());
        sequence.run(&step, trace)?;
        sequence.verify()?;
    }
    let log = std::fs::read_to_string(sequence.node.dir.join("cni.log")).unwrap_or_default();
    sequence.stats.direct_mode_calls = log.matches("using direct mode").count() as u64;
    Ok(std::mem::take(&mut sequence.stats))
}

#[test]
fn many_writers_never_give_one_address_two_owners() {
    let all = run_sequences(
        "METIS_WRITERS",
        "model_multi_writer::many_writers_never_give_one_address_two_owners",
        (2, 12),
        run_sequence,
    );
    let mut total = Stats::default();
    for stats in all {
        total.add(stats);
    }
    eprintln!("{total:?}");
    // The harness must have exercised what it claims to.
    assert!(total.adds_ok > 0, "no ADD ever succeeded: {total:?}");
}
