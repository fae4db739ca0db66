//! `metis controller` at cluster scale (full build only): 1,000 and 5,000
//! simulated nodes, demand changes at 20/s and then at 100/s for 60 s
//! each, 20 % of them releases; per (nodes, rate) the grant latency, the
//! changes never answered, what the controller wrote (request bodies per
//! change, the largest body), its CPU and peak RSS, and what its watches
//! were sent — beside the targets (issue 32).
//!
//! Nodes are simulated by the bench, no daemons: Nodes and NNCs are
//! written straight into the tests' loopback API server
//! (tests/common/kube_api.rs, shared through the harness module), and a
//! node only writes what a daemon writes of its NNC (`spec.allocations`,
//! `spec.releasableCIDRs`, the `metis.x-k8s.io/serving` annotation) and
//! reads `status.podCIDRs`. So the figures are the controller's, whatever
//! its design (a pool ledger or one object per block).

use crate::Bench;
use crate::report::Report;

/// Cluster sizes, and the smoke run's.
const NODE_COUNTS: [usize; 2] = [1_000, 5_000];
const SMOKE_NODES: usize = 200;
/// Demand changes per second, one window each, in this order.
const RATES: [u32; 2] = [20, 100];
/// Every fifth change is a release: 20 %.
const RELEASE_EVERY: u64 = 5;

pub fn report(bench: &Bench, report: &mut Report) {
    #[cfg(feature = "kube")]
    scale::measure(bench, report);
    #[cfg(not(feature = "kube"))]
    let _ = (
        bench,
        report,
        NODE_COUNTS,
        SMOKE_NODES,
        RATES,
        RELEASE_EVERY,
    );
}

#[cfg(feature = "kube")]
mod scale {
    use std::collections::BTreeMap;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use serde_json::{Value, json};

    use super::{NODE_COUNTS, RATES, RELEASE_EVERY, SMOKE_NODES};
    use crate::Bench;
    use crate::common::kube_api::{Key, KubeApi, LEASES, NNCS, NODES, POOLS, State};
    use crate::common::rng::Rng;
    use crate::common::scrape::{http_get, series};
    use crate::report::{Report, Row, mib};
    use crate::util::{Build, Flavour, Summary, TempDir, ms, status_kib};

    /// The pool's blocks: /29s of 198.18.0.0/15 (16,384 of 8 addresses),
    /// at most 8 per node (room for the 80 % that grow), each starting
    /// with one.
    const BLOCK_PREFIX: u32 = 29;
    const MAX_BLOCKS: u32 = 8;
    const FIRST_BLOCKS: u32 = 1;
    const CLIENT: &str = "controller";
    const SERVING: &str = "metis.x-k8s.io/serving";

    /// What one (nodes, rate) window measured.
    struct Window {
        nodes: usize,
        rate: u32,
        latencies: Vec<Duration>,
        changes: u64,
        unanswered: u64,
        body_bytes: u64,
        largest: Option<(u64, String, String)>,
        cpu_cores: f64,
        /// The bench process's: the loopback API server and the nodes.
        server_cores: f64,
        peak_rss: u64,
        watch_bytes: u64,
        writes: String,
        /// Passes decided, and the time deciding them took (the
        /// controller's own metrics).
        passes: u64,
        deciding: f64,
        /// How long the window's changes took.
        seconds: f64,
    }

    /// How long each window issues changes, and how long past its end an
    /// unanswered change may still be answered.
    struct Timing {
        window: Duration,
        grace: Duration,
        setup: Duration,
    }

    pub fn measure(bench: &Bench, report: &mut Report) {
        let build = bench
            .builds
            .iter()
            .find(|b| b.flavour == Flavour::Full)
            .unwrap();
        let dir = TempDir::new("controller");
        let (counts, timing): (Vec<usize>, Timing) = match bench.plan.smoke {
            true => (
                vec![SMOKE_NODES],
                Timing {
                    window: Duration::from_secs(1),
                    grace: Duration::from_secs(30),
                    setup: Duration::from_secs(120),
                },
            ),
            false => (
                NODE_COUNTS.to_vec(),
                Timing {
                    window: Duration::from_secs(60),
                    grace: Duration::from_secs(10),
                    setup: Duration::from_secs(900),
                },
            ),
        };
        let floor = floor_rss(build, &dir);
        let mut windows = Vec::new();
        for nodes in counts {
            windows.extend(cluster(build, &dir, nodes, &timing));
        }
        if bench.plan.smoke {
            check_sane(&windows, &timing);
        }
        rows(&windows, build.name(), report);
        report.rows.push(Row::plain(
            "controller: peak RSS leading, no NNC (its floor)",
            build.name(),
            mib(floor),
        ));
        notes(&windows, &timing, report);
    }

    /// A loopback API server holding the pool, `nodes` Nodes and their
    /// empty NNCs, and the controller leading it.
    fn start(build: &Build, dir: &TempDir, nodes: usize) -> (KubeApi, Controller) {
        let api = KubeApi::start();
        let kubeconfig = dir.join(&format!("kubeconfig-{nodes}"));
        api.kubeconfig_as(&kubeconfig, CLIENT);
        api.with_state(|s| {
            s.create(
                POOLS,
                "",
                &json!({"metadata": {"name": "bench"},
                "spec": {"network": "default",
                         "ipv4": {"cidrs": ["198.18.0.0/15"], "blockPrefixLength": BLOCK_PREFIX},
                         "maxBlocksPerNode": MAX_BLOCKS, "reclaimDelay": "5m"}}),
            )
            .unwrap();
            for i in 0..nodes {
                s.create(
                    NODES,
                    "",
                    &json!({"metadata": {"name": name(i)}, "spec": {}}),
                )
                .unwrap();
                s.create(
                    NNCS,
                    "",
                    &json!({"metadata": {"name": name(i)}, "spec": {}}),
                )
                .unwrap();
            }
        });
        let log_path = dir.join(&format!("controller-{nodes}.log"));
        let log = std::fs::File::create(&log_path).unwrap();
        let child = Command::new(&build.binary)
            .arg("controller")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--identity", "bench", "--metrics-address", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let lease = Key::new(LEASES, "kube-system", "metis-controller");
        api.wait_until("the controller to lead", Duration::from_secs(60), |s| {
            s.get(&lease)
                .is_some_and(|l| l["spec"]["holderIdentity"] == "bench")
        });
        let metrics = std::fs::read_to_string(&log_path)
            .unwrap()
            .lines()
            .find(|l| l.contains("serving metrics"))
            .and_then(|l| l.rsplit("address=").next())
            .map(|a| a.trim().to_string())
            .expect("the controller's metrics address in its log");
        (api, Controller { child, metrics })
    }

    /// The controller's process and the address of its metrics.
    struct Controller {
        child: Child,
        metrics: String,
    }

    impl Controller {
        /// (passes decided, seconds spent deciding) so far.
        fn passes(&self) -> (u64, f64) {
            let (_, body) = http_get(&self.metrics, "/metrics");
            let passes = series(&body, "metis_controller_passes_total");
            (
                passes as u64,
                series(&body, "metis_controller_pass_seconds_total"),
            )
        }
    }

    /// Peak RSS of the controller leading a cluster with the pool and no
    /// NNC, once it wrote the pool's status.
    fn floor_rss(build: &Build, dir: &TempDir) -> u64 {
        let (api, Controller { mut child, .. }) = start(build, dir, 0);
        api.wait_until("the pool's status", Duration::from_secs(60), |s| {
            s.get(&Key::cluster(POOLS, "bench"))
                .is_some_and(|p| p["status"].is_object())
        });
        let floor = status_kib(child.id(), "VmHWM:") * 1024;
        let _ = child.kill();
        let _ = child.wait();
        floor
    }

    /// One cluster of `nodes`: every node granted its first block, then
    /// one window per rate.
    fn cluster(build: &Build, dir: &TempDir, nodes: usize, timing: &Timing) -> Vec<Window> {
        eprintln!("  controller: {nodes} nodes, first blocks");
        let (api, mut controller) = start(build, dir, nodes);
        let mut sim = Sim::new(nodes);
        sim.first_demands(&api);
        let deadline = Instant::now() + timing.setup;
        while sim.waiting() > 0 {
            assert!(
                Instant::now() < deadline,
                "{} of {nodes} nodes never got their first block",
                sim.waiting()
            );
            std::thread::sleep(Duration::from_millis(20));
            sim.observe(&api);
        }
        let windows = RATES
            .iter()
            .map(|rate| {
                eprintln!("  controller: {nodes} nodes, {rate} changes/s");
                sim.window(&api, &controller, *rate, timing)
            })
            .collect();
        let _ = controller.child.kill();
        let _ = controller.child.wait();
        windows
    }

    fn name(i: usize) -> String {
        format!("bench-node-{i:05}")
    }

    /// Pods that need exactly `blocks` blocks.
    fn pods_for(blocks: u32) -> u64 {
        (u64::from(blocks) * block_size(BLOCK_PREFIX)).saturating_sub(2)
    }

    fn block_size(prefix: u32) -> u64 {
        1u64 << (32 - prefix.min(32))
    }

    /// The CIDRs of an NNC's `status.podCIDRs`.
    fn status_cidrs(nnc: &Value) -> Vec<String> {
        nnc["status"]["podCIDRs"]
            .as_array()
            .map(|list| {
                list.iter()
                    .filter_map(|e| e["cidr"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Addresses in `cidrs` (IPv4).
    fn capacity(cidrs: &[String]) -> u64 {
        cidrs
            .iter()
            .filter_map(|c| c.split_once('/')?.1.parse::<u32>().ok())
            .map(block_size)
            .sum()
    }

    /// One change a node waits to see answered.
    struct Waiting {
        asked: Instant,
        pods: u64,
        /// The block it released, which must leave its status.
        releasing: Option<String>,
    }

    /// A simulated node: what it asks for, what its status gave it.
    #[derive(Default)]
    struct Node {
        blocks: u32,
        status: Vec<String>,
        waiting: Option<Waiting>,
    }

    /// The nodes, and where they are in the server's history.
    struct Sim {
        nodes: Vec<Node>,
        index: BTreeMap<String, usize>,
        cursor: usize,
        rng: Rng,
        answered: Vec<Duration>,
    }

    impl Sim {
        fn new(nodes: usize) -> Sim {
            Sim {
                nodes: (0..nodes).map(|_| Node::default()).collect(),
                index: (0..nodes).map(|i| (name(i), i)).collect(),
                cursor: 0,
                rng: Rng::new(0x006d_6574_6973_3332),
                answered: Vec::new(),
            }
        }

        fn waiting(&self) -> usize {
            self.nodes.iter().filter(|n| n.waiting.is_some()).count()
        }

        /// Every node asks for its first blocks at once (not timed).
        fn first_demands(&mut self, api: &KubeApi) {
            for i in 0..self.nodes.len() {
                self.nodes[i].blocks = FIRST_BLOCKS;
                self.ask(api, i, None);
            }
            self.answered.clear();
        }

        /// Writes node `i`'s spec for its demand (and `release`), as its
        /// daemon's one PATCH would; it then waits for the answer.
        fn ask(&mut self, api: &KubeApi, i: usize, release: Option<String>) {
            let node = &mut self.nodes[i];
            let pods = pods_for(node.blocks);
            let serving: Vec<&String> = node
                .status
                .iter()
                .filter(|c| Some(*c) != release.as_ref())
                .collect();
            let serving = serving
                .iter()
                .map(|c| c.as_str())
                .collect::<Vec<_>>()
                .join(",");
            let releasable: Vec<Value> = release.iter().map(|c| json!({"cidr": c})).collect();
            let key = Key::cluster(NNCS, &name(i));
            let asked = api.with_state(|s| {
                s.edit(&key, |n| {
                    n["spec"]["allocations"] = json!([{"network": "default", "pods": pods}]);
                    n["spec"]["releasableCIDRs"] = json!(releasable);
                    match serving.is_empty() {
                        true => {
                            if let Some(notes) = n["metadata"]["annotations"].as_object_mut() {
                                notes.remove(SERVING);
                            }
                        }
                        false => n["metadata"]["annotations"][SERVING] = json!(serving),
                    }
                });
                Instant::now()
            });
            node.waiting = Some(Waiting {
                asked,
                pods,
                releasing: release,
            });
        }

        /// Reads the server's new changes: each NNC's status, and the
        /// changes it answers.
        fn observe(&mut self, api: &KubeApi) {
            let state = api.state();
            for change in &state.changes[self.cursor.min(state.changes.len())..] {
                if change.key.resource != NNCS {
                    continue;
                }
                let Some(&i) = self.index.get(&change.key.name) else {
                    continue;
                };
                let node = &mut self.nodes[i];
                node.status = status_cidrs(&change.object);
                let answered = node.waiting.as_ref().is_some_and(|w| {
                    capacity(&node.status) >= w.pods
                        && w.releasing
                            .as_ref()
                            .is_none_or(|r| !node.status.contains(r))
                });
                if answered && let Some(waiting) = node.waiting.take() {
                    self.answered.push(change.at.duration_since(waiting.asked));
                }
            }
            self.cursor = state.changes.len();
        }

        /// The next change: a release of one of its blocks by a node that
        /// holds one, else one more block for a node below the maximum;
        /// `None` when no idle node fits after many tries.
        fn pick(&mut self, release: bool) -> Option<usize> {
            (0..10_000)
                .map(|_| self.rng.index(self.nodes.len()))
                .find(|&i| {
                    let node = &self.nodes[i];
                    node.waiting.is_none()
                        && match release {
                            true => node.blocks > 0 && !node.status.is_empty(),
                            false => node.blocks < MAX_BLOCKS,
                        }
                })
        }

        /// One change, numbered `k` in its window.
        fn change(&mut self, api: &KubeApi, k: u64) -> bool {
            let release = k % RELEASE_EVERY == RELEASE_EVERY - 1;
            let Some(i) = self.pick(release) else {
                return false;
            };
            let node = &mut self.nodes[i];
            let released = match release {
                true => {
                    node.blocks -= 1;
                    node.status.last().cloned()
                }
                false => {
                    node.blocks += 1;
                    None
                }
            };
            self.ask(api, i, released);
            true
        }
    }

    /// The controller's CPU time so far (utime + stime).
    fn cpu_time(pid: u32) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // After the command name (in parentheses): state is field 0,
        // utime 11 and stime 12, in clock ticks (USER_HZ, 100 on Linux).
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        Duration::from_millis(ticks * 10)
    }

    /// The controller's figures so far: request body bytes, requests by
    /// (verb, resource), watch bytes.
    fn written(state: &State) -> (u64, BTreeMap<(String, String), u64>, u64) {
        let bytes = state.body_bytes_of(CLIENT).values().sum();
        (bytes, state.counts_of(CLIENT), state.watch_bytes_of(CLIENT))
    }

    impl Sim {
        /// Changes at `rate` for the window, then the grace; what the
        /// controller did meanwhile.
        fn window(
            &mut self,
            api: &KubeApi,
            controller: &Controller,
            rate: u32,
            timing: &Timing,
        ) -> Window {
            let pid = controller.child.id();
            self.observe(api);
            self.answered.clear();
            let before = api.with_state(|s| {
                s.largest_body.remove(CLIENT);
                written(s)
            });
            let passes_before = controller.passes();
            let cpu_before = cpu_time(pid);
            let server_before = cpu_time(std::process::id());
            let total = u64::from(rate) * timing.window.as_secs().max(1);
            let started = Instant::now();
            let (mut k, mut skipped) = (0u64, 0u64);
            while k < total {
                let due = started + timing.window.mul_f64(k as f64 / total as f64);
                match due.checked_duration_since(Instant::now()) {
                    Some(wait) => std::thread::sleep(wait.min(Duration::from_millis(5))),
                    None => {
                        skipped += u64::from(!self.change(api, k));
                        k += 1;
                    }
                }
                self.observe(api);
            }
            let cpu = cpu_time(pid).saturating_sub(cpu_before);
            let passes_after = controller.passes();
            let server = cpu_time(std::process::id()).saturating_sub(server_before);
            let ended = Instant::now();
            let elapsed = ended.duration_since(started).as_secs_f64();
            while self.waiting() > 0 && ended.elapsed() < timing.grace {
                std::thread::sleep(Duration::from_millis(10));
                self.observe(api);
            }
            let unanswered = self
                .nodes
                .iter_mut()
                .filter_map(|n| n.waiting.take())
                .count() as u64;
            let (after, largest) = api.with_state(|s| (written(s), s.largest_body_of(CLIENT)));
            Window {
                nodes: self.nodes.len(),
                rate,
                latencies: std::mem::take(&mut self.answered),
                changes: total - skipped,
                unanswered,
                body_bytes: after.0 - before.0,
                largest,
                cpu_cores: cpu.as_secs_f64() / elapsed,
                server_cores: server.as_secs_f64() / elapsed,
                peak_rss: status_kib(pid, "VmHWM:") * 1024,
                watch_bytes: after.2 - before.2,
                writes: writes_between(&before.1, &after.1),
                passes: passes_after.0 - passes_before.0,
                deciding: passes_after.1 - passes_before.1,
                seconds: elapsed,
            }
        }
    }

    /// The controller's writes between two counts, as "N verb resource".
    fn writes_between(
        before: &BTreeMap<(String, String), u64>,
        after: &BTreeMap<(String, String), u64>,
    ) -> String {
        after
            .iter()
            .filter(|((verb, _), _)| !matches!(verb.as_str(), "watch" | "list" | "get"))
            .map(|(key, n)| (key, n - before.get(key).unwrap_or(&0)))
            .filter(|(_, n)| *n > 0)
            .map(|((verb, resource), n)| format!("{n} {verb} {resource}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The smoke run's checks: counts, never timings.
    fn check_sane(windows: &[Window], timing: &Timing) {
        for w in windows {
            let planned = u64::from(w.rate) * timing.window.as_secs();
            assert_eq!(w.changes, planned, "every change issued");
            assert_eq!(
                w.latencies.len() as u64 + w.unanswered,
                w.changes,
                "each change answered or counted unanswered"
            );
            assert!(!w.latencies.is_empty(), "no change answered");
            assert!(w.body_bytes > 0 && w.largest.is_some(), "nothing written");
            assert!(w.watch_bytes > 0 && w.peak_rss > 0);
        }
    }

    /// One figure of a window, and its target at 5,000 nodes (at most).
    struct Figure {
        what: &'static str,
        value: f64,
        text: String,
        limit: Option<(f64, String)>,
    }

    fn figures(w: &Window) -> Vec<Figure> {
        let (p50, p99) = match w.latencies.is_empty() {
            true => (f64::INFINITY, f64::INFINITY),
            false => {
                let summary = Summary::of(&w.latencies);
                (summary.median.as_secs_f64(), summary.p99.as_secs_f64())
            }
        };
        let seconds = |v: f64| match v.is_finite() {
            true => ms(Duration::from_secs_f64(v)),
            false => "none answered".to_string(),
        };
        let per_change = w.body_bytes as f64 / w.changes.max(1) as f64;
        let largest = w.largest.as_ref().map_or(0, |l| l.0) as f64;
        let p99_limit = if w.rate <= 20 { 1.0 } else { 2.0 };
        let per_pass = w.deciding / w.passes.max(1) as f64;
        let figure = |what, value: f64, text: String, limit: Option<(f64, &str)>| Figure {
            what,
            value,
            text,
            limit: limit.map(|(v, t)| (v, t.to_string())),
        };
        vec![
            figure("grant p50", p50, seconds(p50), None),
            figure(
                "grant p99",
                p99,
                seconds(p99),
                Some((p99_limit, if w.rate <= 20 { "≤ 1 s" } else { "≤ 2 s" })),
            ),
            figure(
                "changes never answered",
                w.unanswered as f64,
                format!("{} of {}", w.unanswered, w.changes),
                Some((0.0, "0")),
            ),
            figure(
                "bytes written per change",
                per_change,
                format!("{:.0} B", per_change),
                Some((8192.0, "≤ 8 KiB")),
            ),
            figure(
                "largest request body",
                largest,
                format!("{largest:.0} B"),
                Some((65536.0, "≤ 64 KiB")),
            ),
            figure(
                "CPU",
                w.cpu_cores,
                format!("{:.3} cores", w.cpu_cores),
                (w.rate <= 20).then_some((0.25, "≤ 0.25 core")),
            ),
            figure(
                "peak RSS",
                w.peak_rss as f64,
                mib(w.peak_rss),
                Some((64.0 * 1_048_576.0, "≤ 64 MiB")),
            ),
            figure(
                "passes per second",
                w.passes as f64 / w.seconds,
                format!("{:.1}", w.passes as f64 / w.seconds),
                None,
            ),
            figure(
                "deciding, per pass",
                per_pass,
                ms(Duration::from_secs_f64(per_pass)),
                None,
            ),
            figure(
                "watch bytes sent",
                w.watch_bytes as f64,
                format!("{:.2} MB", w.watch_bytes as f64 / 1e6),
                None,
            ),
        ]
    }

    /// One row per figure and window; the 5,000-node rows are judged
    /// against the targets and against the 1,000-node figure
    /// (at most 1.5× of it).
    fn rows(windows: &[Window], build: &'static str, report: &mut Report) {
        let largest_nodes = windows.iter().map(|w| w.nodes).max().unwrap_or(0);
        for w in windows {
            let smaller = windows
                .iter()
                .find(|o| o.rate == w.rate && o.nodes < w.nodes)
                .map(figures);
            for (at, f) in figures(w).into_iter().enumerate() {
                let what = format!("controller, {} nodes, {}/s: {}", w.nodes, w.rate, f.what);
                let mut row = Row::plain(what, build, f.text);
                if w.nodes < largest_nodes || w.nodes < super::NODE_COUNTS[1] {
                    report.rows.push(row);
                    continue;
                }
                let mut met = f.limit.as_ref().is_none_or(|(limit, _)| f.value <= *limit);
                let mut target = f.limit.map(|(_, text)| text).unwrap_or_default();
                if let Some(small) = smaller.as_ref().map(|s| &s[at]) {
                    met &= f.value <= 1.5 * small.value;
                    target = [target, "≤ 1.5× at 1,000 nodes".to_string()]
                        .into_iter()
                        .filter(|t| !t.is_empty())
                        .collect::<Vec<_>>()
                        .join("; ");
                    if small.value > 0.0 && small.value.is_finite() {
                        row = row.against(small.text.clone(), f.value / small.value);
                    }
                }
                report.rows.push(row.target(target, met));
            }
        }
    }

    fn notes(windows: &[Window], timing: &Timing, report: &mut Report) {
        report.notes.push(format!(
            "controller: nodes simulated in the bench (no daemons) write their NNC spec straight into the loopback API server; \
             MetisPool 198.18.0.0/15 in /{BLOCK_PREFIX} blocks, maxBlocksPerNode {MAX_BLOCKS}, every node first granted {FIRST_BLOCKS} block (not timed); \
             then per rate {}s of changes (one in {RELEASE_EVERY} a release: a granted block listed in releasableCIDRs, demand one block lower; \
             the rest one block more), a change answered when its status covers the demand without the released block, \
             unanswered {}s after the window; p50/p99 over the answered; bytes per change: every request body of the controller (Lease, Events included) over the changes; \
             CPU over the window, RSS is VmHWM since start",
            timing.window.as_secs(),
            timing.grace.as_secs(),
        ));
        for w in windows {
            let largest = w
                .largest
                .as_ref()
                .map_or("none".to_string(), |(bytes, verb, resource)| {
                    format!("{bytes} B ({verb} {resource})")
                });
            report.notes.push(format!(
                "controller, {} nodes, {}/s: {} changes; largest body {largest}; the loopback API server and the nodes used {:.3} cores; the controller wrote {}",
                w.nodes, w.rate, w.changes, w.server_cores, w.writes
            ));
        }
    }
}
