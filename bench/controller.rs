//! `metis controller` at cluster scale (full build only): the time from a
//! node's demand to its grant (p50/p99) with 1,000 simulated nodes, and
//! the controller's peak RSS once it answers 5,000 NodeNetworkConfigs
//! (target ≤ 32 MiB), beside its floor: the same binary leading a cluster
//! with the pool and no NodeNetworkConfig (its code, TLS, HTTP buffers,
//! thread stacks).
//! Nodes are simulated by writing NNC specs straight into the tests'
//! loopback API server (tests/common/kube_api.rs, shared through the
//! harness module): no daemons, so the figures are the controller's and
//! the server's alone. Demands arrive at 100 per second, the rate the
//! request budget of docs/controller.md is stated for.

use crate::Bench;
use crate::report::Report;

/// Simulated nodes timed, NNCs held for the RSS figure, demands per second.
const NODES: (usize, usize) = (1_000, 5_000);
const SMOKE_NODES: (usize, usize) = (20, 50);
const DEMANDS_PER_SECOND: u64 = 100;
/// Peak RSS target at 5,000 NodeNetworkConfigs.
const RSS_TARGET_MIB: u64 = 32;

pub fn report(bench: &Bench, report: &mut Report) {
    #[cfg(feature = "kube")]
    measure(bench, report);
    #[cfg(not(feature = "kube"))]
    let _ = (
        bench,
        report,
        NODES,
        SMOKE_NODES,
        DEMANDS_PER_SECOND,
        RSS_TARGET_MIB,
    );
}

#[cfg(feature = "kube")]
fn measure(bench: &Bench, report: &mut Report) {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use crate::common::kube_api::{Key, KubeApi, LEASES, NNCS, NODES as NODE_KIND, POOLS};
    use crate::report::{Row, mib};
    use crate::util::{Flavour, Summary, TempDir, ms, status_kib};
    use serde_json::json;

    let (timed, held) = if bench.plan.smoke { SMOKE_NODES } else { NODES };
    let build = bench
        .builds
        .iter()
        .find(|b| b.flavour == Flavour::Full)
        .unwrap();
    let dir = TempDir::new("controller");
    let name = |i: usize| format!("bench-node-{i:05}");
    // A cluster of `nodes` empty NNCs (and their Nodes) and one pool, and
    // the controller leading it.
    let start = |nodes: usize, run: &str| {
        let api = KubeApi::start();
        let kubeconfig = dir.join(&format!("kubeconfig-{run}"));
        api.kubeconfig_as(&kubeconfig, "controller");
        api.with_state(|s| {
            // 8,192 /28 blocks: one for every node with room to spare.
            s.create(POOLS, "", &json!({"metadata": {"name": "bench"},
                "spec": {"network": "default", "ipv4": {"cidrs": ["198.18.0.0/15"], "blockPrefixLength": 28},
                         "maxBlocksPerNode": 4, "reclaimDelay": "5m"}}))
                .unwrap();
            for i in 0..nodes {
                s.create(NODE_KIND, "", &json!({"metadata": {"name": name(i)}, "spec": {}}))
                    .unwrap();
                s.create(NNCS, "", &json!({"metadata": {"name": name(i)}, "spec": {}}))
                    .unwrap();
            }
        });
        let log = std::fs::File::create(dir.join(&format!("controller-{run}.log"))).unwrap();
        let child = Command::new(&build.binary)
            .arg("controller")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["--identity", "bench", "--retry-period", "200ms"])
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
        (api, child)
    };
    // The floor: leading, its pool's status written, no NNC to answer.
    let (floor_api, mut floor_child) = start(0, "floor");
    floor_api.wait_until("the pool's status", Duration::from_secs(60), |s| {
        s.get(&Key::cluster(POOLS, "bench"))
            .is_some_and(|p| p["status"]["conditions"].is_array())
    });
    let floor = status_kib(floor_child.id(), "VmHWM:") * 1024;
    let _ = floor_child.kill();
    let _ = floor_child.wait();
    drop(floor_api);
    let (api, mut child) = start(held, "held");
    let granted = |s: &crate::common::kube_api::State, i: usize| {
        s.get(&Key::cluster(NNCS, &name(i)))
            .and_then(|n| n["status"]["podCIDRs"].as_array().map(|a| !a.is_empty()))
            .unwrap_or(false)
    };
    let demand = |i: usize| {
        api.with_state(|s| {
            s.edit(&Key::cluster(NNCS, &name(i)), |n| {
                n["spec"]["allocations"] = json!([{"network": "default", "pods": 8}]);
            })
        });
    };
    // Its first pass over the empty NNCs may write (conditions): wait until
    // it has written nothing for a second, so the timed demands do not
    // queue behind it; those writes are reported apart.
    let writes_so_far = || -> u64 {
        api.state()
            .counts_of("controller")
            .iter()
            .filter(|((verb, resource), _)| {
                // Lease renewals go on all the time.
                !matches!(verb.as_str(), "watch" | "list" | "get") && resource != LEASES
            })
            .map(|(_, n)| n)
            .sum()
    };
    let settle_deadline = Instant::now() + Duration::from_secs(300);
    let (mut last, mut quiet_since) = (writes_so_far(), Instant::now());
    while quiet_since.elapsed() < Duration::from_secs(1) {
        assert!(
            Instant::now() < settle_deadline,
            "the controller never went quiet"
        );
        std::thread::sleep(Duration::from_millis(100));
        let now = writes_so_far();
        if now != last {
            (last, quiet_since) = (now, Instant::now());
        }
    }
    let at_start = api.state().counts_of("controller");
    // Demands of the first `timed` nodes, paced; the grant is the first
    // change that gives the NNC a block.
    let first_change = api.state().changes.len();
    let pace = Duration::from_secs(1) / u32::try_from(DEMANDS_PER_SECOND).unwrap();
    let started = Instant::now();
    for i in 0..timed {
        let due = started + pace * u32::try_from(i).unwrap();
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        demand(i);
    }
    api.wait_until(
        "every timed demand granted",
        Duration::from_secs(300),
        |s| (0..timed).all(|i| granted(s, i)),
    );
    let before = api.state().counts_of("controller");
    let latencies: Vec<Duration> = {
        let state = api.state();
        let changes = &state.changes[first_change..];
        (0..timed)
            .map(|i| {
                let key = Key::cluster(NNCS, &name(i));
                let mine = || changes.iter().filter(|c| c.key == key);
                let asked = mine()
                    .find(|c| c.object["spec"]["allocations"].is_array())
                    .unwrap()
                    .at;
                let answered = mine()
                    .find(|c| {
                        c.object["status"]["podCIDRs"]
                            .as_array()
                            .is_some_and(|a| !a.is_empty())
                    })
                    .unwrap()
                    .at;
                answered.duration_since(asked)
            })
            .collect()
    };
    // The rest of the nodes ask at once; the peak RSS is read once all
    // are answered.
    for i in timed..held {
        demand(i);
    }
    api.wait_until("every demand granted", Duration::from_secs(600), |s| {
        (0..held).all(|i| granted(s, i))
    });
    let peak = status_kib(child.id(), "VmHWM:") * 1024;
    let _ = child.kill();
    let _ = child.wait();
    // The controller's writes while the timed demands were answered, by
    // resource, and what it wrote before the first demand.
    let written = |counts: &std::collections::BTreeMap<(String, String), u64>,
                   since: &std::collections::BTreeMap<(String, String), u64>| {
        counts
            .iter()
            .filter(|((verb, _), _)| !matches!(verb.as_str(), "watch" | "list" | "get"))
            .map(|(key, n)| (key, n - since.get(key).unwrap_or(&0)))
            .filter(|(_, n)| *n > 0)
            .map(|((verb, resource), n)| format!("{n} {verb} {resource}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let idle = std::collections::BTreeMap::new();
    let startup = written(&at_start, &idle);
    let writes = written(&before, &at_start);
    let summary = Summary::of(&latencies);
    let what = format!("controller: demand → grant, {timed} nodes, {DEMANDS_PER_SECOND}/s");
    report.rows.push(Row::plain(
        format!("{what}, p50"),
        build.name(),
        ms(summary.median),
    ));
    report.rows.push(Row::plain(
        format!("{what}, p99"),
        build.name(),
        ms(summary.p99),
    ));
    report.rows.push(
        Row::plain(
            format!("controller: peak RSS answering {held} NNCs"),
            build.name(),
            mib(peak),
        )
        .target(
            format!("≤ {RSS_TARGET_MIB} MiB"),
            peak <= RSS_TARGET_MIB * 1024 * 1024,
        ),
    );
    report.rows.push(Row::plain(
        "controller: peak RSS leading, no NNC (its floor)",
        build.name(),
        mib(floor),
    ));
    report.notes.push(format!(
        "controller: nodes are NNC specs written into the loopback API server (no daemons); \
         before the first demand (taking the lease, then a first pass over {held} empty NNCs, waited out) it wrote: {startup}; \
         for the {timed} timed demands: {writes}"
    ));
    if bench.plan.smoke {
        assert_eq!(summary.count, timed);
    }
}
