//! Model-based test of following the control plane: random sequences of
//! grants, take-backs, condition flips, honoured releases (Reusable and
//! NonReusable), re-created objects (new uid), etcd restores (versions go
//! back), opaque versions, lagging watches, foreign objects, CA rotations
//! (the server moves to a certificate of a new CA, the CA file is
//! rewritten, in either order) and daemon restarts, interleaved with ADD
//! and DEL, against the real daemon and the loopback API server over
//! HTTPS. After every step, once the daemon has followed:
//!
//! - no address handed out since lies outside the blocks granted now (plus
//!   the static ranges; after a lagging watch, also those of the versions
//!   it still delivers in order, which the daemon may not have reached —
//!   the next step's check catches a block it keeps serving);
//! - no released NonReusable block is ever used again;
//! - every pod keeps its address until its DEL, take-backs included;
//! - no address is held twice;
//! - the step cost no more requests than its budget.
//!
//! `CP_MODEL_SEED` replays a run; `CP_MODEL_STEPS` sets its length and
//! `CP_MODEL_RUNS` how many seeds one invocation runs.

// The edge build (no `kube` feature) has no Kubernetes side to test.
#![cfg(feature = "kube")]

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::cloud::{Cloud, NodeView};
use common::cluster::start_daemon;
use common::kube_api::{Backup, State};
use common::rng::Rng;
use common::tls::{Authority, TlsServer, replace_file};
use common::{TestDaemon, TestDir, db, v4_add_request};
use metis::wire::{Code, Request, ipam, request, response};
use serde_json::{Value, json};

/// The CNI range (one usable address) and the `--cidr` block: static.
const CNI: &str = "198.18.0.0/30";
const FLAG: &str = "198.18.2.0/29";
/// Blocks the model's cluster may grant: 198.19.N.0/28.
const POOL: u32 = 8;
const SYNC: Duration = Duration::from_secs(30);
/// Requests one step may cost: a relist is a list, a create, a watch; the
/// monitor's patches follow the pods; idle watches are rare.
const STEP_BUDGET: usize = 40;

fn pool_cidr(n: u32) -> String {
    format!("198.19.{n}.0/28")
}

fn in_block(address: &str, cidr: &str) -> bool {
    let (base, len) = cidr.split_once('/').unwrap();
    let to_u32 = |a: &str| u32::from(a.parse::<std::net::Ipv4Addr>().unwrap());
    let len: u32 = len.parse().unwrap();
    let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
    to_u32(address) & mask == to_u32(base) & mask
}

#[derive(Debug, Clone)]
struct Entry {
    cidr: String,
    ready: bool,
    reusable: bool,
}

impl Entry {
    fn json(&self) -> Value {
        let (status, reason) = match self.ready {
            true => ("True", "PodCIDRReady"),
            false => ("False", "Updating"),
        };
        json!({"id": self.cidr, "network": "default", "cidr": self.cidr,
               "type": if self.reusable { "Reusable" } else { "NonReusable" },
               "condition": {"type": "Ready", "status": status, "reason": reason}})
    }
}

struct Model {
    rng: Rng,
    status: Vec<Entry>,
    /// NonReusable blocks this node released and the cluster took: never again.
    never_again: BTreeSet<String>,
    /// Blocks this node released at some point (reusable ones may return).
    released_ever: BTreeSet<String>,
    /// Live pods: container → address.
    pods: BTreeMap<String, String>,
    next_pod: u64,
    /// Copies of the store kept for a restore, with the status they hold.
    backups: Vec<(Backup, Vec<Entry>)>,
    /// Entries Ready in a version between the last step's and this one's
    /// (a lagging watch delivers them after the model has moved on, in
    /// order): the daemon may serve them until it reaches the last.
    transient: Vec<Entry>,
    /// The CA bundle the daemon's kubeconfig names, and how many times the
    /// cluster's CA was rotated.
    ca_file: std::path::PathBuf,
    rotations: u32,
}

impl Model {
    fn status_json(&self) -> Value {
        Value::Array(self.status.iter().map(Entry::json).collect())
    }

    /// Blocks a new address may come from now: Ready entries, except
    /// released ones that may never return.
    fn allowed(&self, address: &str) -> bool {
        let static_ok = in_block(address, CNI) || in_block(address, FLAG);
        static_ok
            || self.status.iter().chain(&self.transient).any(|e| {
                e.ready && !self.never_again.contains(&e.cidr) && in_block(address, &e.cidr)
            })
    }
}

struct Node<'a> {
    dir: &'a TestDir,
    daemon: Option<TestDaemon>,
}

impl Node<'_> {
    fn call(&self, request: &Request) -> metis::wire::Response {
        let daemon = self.daemon.as_ref().unwrap();
        metis::wire::client::Client::connect(
            &daemon.socket,
            Duration::from_secs(5),
            Duration::from_secs(30),
        )
        .unwrap()
        .call(request)
        .unwrap()
    }

    fn add(&self, container: &str) -> Option<String> {
        let reply = self.call(&v4_add_request("default", container, CNI));
        match (&reply.kind, reply.code()) {
            (Some(response::Kind::Allocate(ok)), Code::Ok) => {
                Some(ok.ipv4.as_ref().unwrap().ip_address.clone())
            }
            // Capacity can shrink between the model's look and the ADD
            // (the daemon drains and releases idle blocks on its own).
            (_, Code::ResourceExhausted | Code::Unavailable) => None,
            other => panic!("ADD {container}: {other:?}"),
        }
    }

    fn del(&self, container: &str) {
        let reply = self.call(&Request {
            kind: Some(request::Kind::Deallocate(ipam::DeallocatePodIpRequest {
                network: "default".into(),
                interface_name: "eth0".into(),
                container_id: container.into(),
                ..Default::default()
            })),
        });
        assert_eq!(reply.code(), Code::Ok, "DEL {container}: {reply:?}");
    }

    /// (container, address) of every allocated row with an owner.
    fn holdings(&self) -> Vec<(String, String)> {
        let conn = db(&self.dir.join("metis.sqlite"));
        let mut stmt = conn
            .prepare(
                "SELECT container_id, address FROM ip_addresses \
                 WHERE is_allocated = 1 AND COALESCE(container_id, '') != '' ORDER BY address",
            )
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// (cidr, state, retired-or-taken-back) of every block.
    fn blocks(&self) -> Vec<(String, String, bool)> {
        let conn = db(&self.dir.join("metis.sqlite"));
        let mut stmt = conn
            .prepare(
                "SELECT b.cidr, b.state, COALESCE(m.retired, 0) FROM cidr_blocks b \
                 LEFT JOIN metis_blocks m ON m.block_id = b.id ORDER BY b.id",
            )
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// The blocks the daemon released and remembers releasing.
    fn release_memory(&self) -> BTreeSet<String> {
        self.cidrs("SELECT cidr FROM metis_released")
    }

    /// Blocks the daemon remembers releasing, and those it is releasing.
    fn released(&self) -> BTreeSet<String> {
        self.cidrs(
            "SELECT cidr FROM metis_released UNION SELECT cidr FROM cidr_blocks \
             WHERE state = 'Deleting'",
        )
    }

    fn cidrs(&self, sql: &str) -> BTreeSet<String> {
        let conn = db(&self.dir.join("metis.sqlite"));
        let mut stmt = conn.prepare(sql).unwrap();
        stmt.query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// Free addresses new pods can get now, as the store counts them.
    fn capacity(&self) -> i64 {
        db(&self.dir.join("metis.sqlite"))
            .query_row(
                "SELECT COALESCE(SUM(b.total_ips - b.allocated_ips), 0) FROM cidr_blocks b \
                 LEFT JOIN metis_blocks m ON m.block_id = b.id \
                 WHERE b.state != 'Deleting' AND COALESCE(m.retired, 0) = 0 \
                   AND m.quarantine IS NULL AND b.ip_family = 'ipv4'",
                [],
                |r| r.get(0),
            )
            .unwrap()
    }
}

/// Whether the daemon has followed the model's status: no block it serves
/// from the cluster is ungranted now (safety), and every granted block it
/// has no reason of its own to withhold (a release it remembers) is served.
fn followed(model: &Model, node: &Node) -> bool {
    let blocks = node.blocks();
    let serving = |state: &str, retired: bool| state != "Deleting" && !retired;
    let unwanted = blocks.iter().any(|(cidr, state, retired)| {
        cidr.starts_with("198.19.")
            && serving(state, *retired)
            && !model
                .status
                .iter()
                .any(|e| e.ready && e.cidr == *cidr && !model.never_again.contains(cidr))
    });
    // A block released before and listed again is taken again unless the
    // daemon still remembers the release: waited for like any other (a
    // step that then drops it must not find it still on its way in).
    let remembered = node.released();
    let missing = model.status.iter().any(|e| {
        e.ready
            && !remembered.contains(&e.cidr)
            && !model.never_again.contains(&e.cidr)
            && !blocks
                .iter()
                .any(|(c, state, retired)| *c == e.cidr && serving(state, *retired))
    });
    !unwanted && !missing
}

/// Waits until the daemon has followed the model; says what differs if it
/// does not in time.
fn wait_followed(model: &Model, node: &Node, api: &Cloud, step: usize, what: &str) {
    if common::poll(SYNC, || followed(model, node).then_some(())).is_none() {
        panic!(
            "step {step} ({what}) not followed in {SYNC:?}\nstatus: {:?}\nnever again: {:?}\n\
             released ever: {:?}\nblocks: {:?}\nremembered: {:?}\nserver: {}\nlog:\n{}",
            model.status,
            model.never_again,
            model.released_ever,
            node.blocks(),
            node.released(),
            api.state().nnc().cloned().unwrap_or_default(),
            node.daemon
                .as_ref()
                .map(TestDaemon::log)
                .unwrap_or_default()
        );
    }
}

/// The releases the daemon asked for: (cidr, reusable).
fn releasable(api: &Cloud) -> Vec<(String, bool)> {
    let state = api.state();
    let Some(nnc) = state.nnc() else {
        return Vec::new();
    };
    nnc["spec"]["releasableCIDRs"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|r| {
            Some((
                r["cidr"].as_str()?.to_string(),
                r["type"].as_str() != Some("NonReusable"),
            ))
        })
        .collect()
}

fn run(seed: u64, steps: usize) {
    eprintln!("CP_MODEL_SEED={seed}");
    let mut rng = Rng::new(seed);
    let dir = TestDir::new("cp-model");
    let ca_file = dir.join("ca.crt");
    let ca = Authority::new("model-0");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let tls = TlsServer::new(&ca.server(), None);
    let api = Cloud::start_tls(&[], tls, &ca_file);
    api.set_controller(false);
    api.with_state(|s| s.opaque = rng.chance(50));
    let flags: Vec<String> = vec![
        "--cidr".into(),
        format!("default={FLAG}"),
        "--sustained-low-utilization-duration".into(),
        "300ms".into(),
        "--draining-expiration".into(),
        "300ms".into(),
        "--api-max-backoff".into(),
        "200ms".into(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut node = Node {
        dir: &dir,
        daemon: Some(start_daemon(&dir, &api, "nnc", &flags)),
    };
    api.wait_until("the NodeNetworkConfig", SYNC, |s| s.nnc().is_some());
    let mut model = Model {
        rng: rng.fork(),
        status: Vec::new(),
        never_again: BTreeSet::new(),
        released_ever: BTreeSet::new(),
        pods: BTreeMap::new(),
        next_pod: 0,
        backups: Vec::new(),
        transient: Vec::new(),
        ca_file,
        rotations: 0,
    };
    let mut dearest = 0;
    for step in 0..steps {
        let requests_before = api.state().log.len();
        let action = model.rng.below(100);
        model.transient.clear();
        let what = control_step(action, &mut model, &api, &mut node, &dir, &flags);
        eprintln!("step {step}: {what}");
        // Releases the daemon asked for are taken by the cluster at once
        // (or left for a later step).
        if model.rng.chance(60) {
            honour_releases(&mut model, &api);
        }
        wait_followed(&model, &node, &api, step, &what);
        pods_step(&mut model, &node);
        check(&model, &node, step, &what);
        let cost = api.state().log.len() - requests_before;
        assert!(
            cost <= STEP_BUDGET,
            "step {step} ({what}) cost {cost} requests: {:#?}\nlog:\n{}",
            api.state().log[requests_before..]
                .iter()
                .map(|l| format!("{} {}?{} {}", l.method, l.path, l.query, l.status))
                .collect::<Vec<_>>(),
            node.daemon
                .as_ref()
                .map(TestDaemon::log)
                .unwrap_or_default()
        );
        dearest = dearest.max(cost);
    }
    eprintln!(
        "seed {seed}: {steps} steps, {} requests (at most {dearest} in a step), {} pods live, {} blocks released ({} NonReusable), {} CA rotations",
        api.state().log.len(),
        model.pods.len(),
        model.released_ever.len(),
        model.never_again.len(),
        model.rotations
    );
}

/// One change of the control plane (or the daemon); returns its name.
fn control_step(
    action: u64,
    model: &mut Model,
    api: &Cloud,
    node: &mut Node,
    dir: &TestDir,
    flags: &[&str],
) -> String {
    match action {
        0..=24 => {
            // Grant a pool block (a NonReusable one released before, too:
            // the cluster may list it again; the node must not take it).
            let n = u32::try_from(model.rng.below(u64::from(POOL))).unwrap();
            let cidr = pool_cidr(n);
            if model.status.iter().any(|e| e.cidr == cidr) {
                return "grant (already granted)".into();
            }
            let reusable = model.rng.chance(50);
            model.status.push(Entry {
                cidr: cidr.clone(),
                ready: model.rng.chance(85),
                reusable,
            });
            api.set_status(model.status_json());
            format!("grant {cidr}")
        }
        25..=39 => {
            if model.status.is_empty() {
                return "take back (nothing)".into();
            }
            let gone = model.status.remove(model.rng.index(model.status.len()));
            api.set_status(model.status_json());
            format!("take back {}", gone.cidr)
        }
        40..=49 => {
            if model.status.is_empty() {
                return "flip (nothing)".into();
            }
            let i = model.rng.index(model.status.len());
            model.status[i].ready = !model.status[i].ready;
            api.set_status(model.status_json());
            format!(
                "flip {} to ready={}",
                model.status[i].cidr, model.status[i].ready
            )
        }
        50..=55 => {
            model.status.retain(|_| model.rng.chance(50));
            api.recreate_nnc(model.status_json());
            "re-create the object (new uid)".into()
        }
        56..=63 => {
            let state = api.state();
            if state.nnc().is_some() {
                model.backups.push((state.backup(), model.status.clone()));
            }
            "take a backup".into()
        }
        64..=69 => {
            let Some((backup, status)) = model.backups.pop() else {
                return "restore (no backup)".into();
            };
            // A restore brings back what the backup listed, except blocks
            // released since (the cloud holds them no more): the cluster's
            // status controller drops those at once. Until the daemon
            // reaches that drop it may serve what the restored version
            // grants, but never a block whose release it remembers.
            let remembered = node.release_memory();
            model.transient.extend(
                (status.iter())
                    .filter(|e| !remembered.contains(&e.cidr))
                    .cloned(),
            );
            model.status = status
                .into_iter()
                .filter(|e| !model.released_ever.contains(&e.cidr))
                .collect();
            let lists = |state: &State| state.requests("GET", "nodenetworkconfigs");
            let before = api.with_state(|state| {
                state.restore(backup);
                lists(state)
            });
            // Writes resume once the API servers restarted on the restored
            // store; a node past the restored version lists first (its
            // watch is answered ResourceVersionTooLarge). Without that
            // pause the same version could name two contents on a silent
            // stream, which no client can tell apart (docs/design.md).
            // Only a list answered after the restore counts: one the node
            // began for an earlier step may carry the store as it was.
            // A pause, not a check: a node may have nothing to list again.
            let _ = common::poll(Duration::from_secs(3), || {
                (lists(&api.state()) != before).then_some(())
            });
            api.set_status(model.status_json());
            "etcd restore".into()
        }
        70..=74 => {
            // A lagging watch: several changes arrive late, in order.
            api.with_state(|s| s.hold_watches = true);
            for _ in 0..3 {
                let n = u32::try_from(model.rng.below(u64::from(POOL))).unwrap();
                let cidr = pool_cidr(n);
                match model.status.iter().position(|e| e.cidr == cidr) {
                    Some(i) => {
                        model.status.remove(i);
                    }
                    None => model.status.push(Entry {
                        cidr,
                        ready: true,
                        reusable: model.rng.chance(50),
                    }),
                }
                api.set_status(model.status_json());
                model.transient.extend(model.status.iter().cloned());
            }
            api.with_state(|s| s.hold_watches = false);
            "three changes through a lagging watch".into()
        }
        75..=79 => {
            let n = u32::try_from(model.rng.below(u64::from(POOL))).unwrap();
            let foreign = json!({
                "apiVersion": "networking.gke.io/v1", "kind": "NodeNetworkConfig",
                "metadata": {"name": "node-b", "uid": "uid-b"},
                "status": {"podCIDRs": [Entry { cidr: pool_cidr(n), ready: true, reusable: true }.json()]},
            });
            api.inject_foreign(foreign, model.rng.chance(50));
            "another node's object".into()
        }
        80..=83 => {
            api.compact();
            api.set_status(model.status_json());
            "compaction (410, relist)".into()
        }
        84..=86 => {
            node.daemon = None;
            node.daemon = Some(start_daemon(dir, api, "nnc", flags));
            "daemon restart".into()
        }
        87..=93 => {
            // The node goes idle: every pod leaves, and the node drains and
            // gives blocks back (a few seconds at most; maybe nothing to give).
            let containers: Vec<String> = model.pods.keys().cloned().collect();
            for container in containers {
                node.del(&container);
                model.pods.remove(&container);
            }
            // A pause, not a check: the node may have nothing to give back.
            let _ = common::poll(Duration::from_secs(3), || {
                (!releasable(api).is_empty()).then_some(())
            });
            "idle: every pod leaves, blocks are given back".into()
        }
        94..=96 => rotate_ca(model, api),
        _ => "pods only".into(),
    }
}

/// The cluster's CA is rotated: the API server restarts with a certificate
/// of a new CA and the node's CA file is rewritten, in either order. The
/// daemon follows without a restart: a watch is open again in time.
fn rotate_ca(model: &mut Model, api: &Cloud) -> String {
    model.rotations += 1;
    let ca = Authority::new(&format!("model-{}", model.rotations));
    let before = api.state().answered("WATCH", 200);
    let server_first = model.rng.chance(50);
    if server_first {
        api.tls().set(&ca.server(), None);
        api.cut_connections();
        replace_file(&model.ca_file, ca.pem());
    } else {
        replace_file(&model.ca_file, ca.pem());
        api.tls().set(&ca.server(), None);
        api.cut_connections();
    }
    api.wait_until("a watch through the new CA", SYNC, |s| {
        s.answered("WATCH", 200) > before
    });
    format!("CA rotation (server first: {server_first})")
}

/// The cluster takes what the node released: drops it from the status.
fn honour_releases(model: &mut Model, api: &Cloud) {
    let released = releasable(api);
    if released.is_empty() {
        return;
    }
    for (cidr, reusable) in &released {
        model.released_ever.insert(cidr.clone());
        if !reusable {
            model.never_again.insert(cidr.clone());
        }
    }
    model
        .status
        .retain(|e| !released.iter().any(|(c, _)| *c == e.cidr));
    api.set_status(model.status_json());
}

/// Some ADDs (within the free capacity) and DELs.
fn pods_step(model: &mut Model, node: &Node) {
    let dels = model.rng.below(4);
    for _ in 0..dels {
        if model.pods.is_empty() {
            break;
        }
        let i = model.rng.index(model.pods.len());
        let container = model.pods.keys().nth(i).unwrap().clone();
        node.del(&container);
        model.pods.remove(&container);
    }
    let adds = model.rng.below(6);
    for _ in 0..adds {
        if node.capacity() < 1 {
            break;
        }
        let container = format!("c{}", model.next_pod);
        model.next_pod += 1;
        if let Some(address) = node.add(&container) {
            assert!(
                model.allowed(&address),
                "ADD {container} got {address}, outside what is granted now: {:?}; never again: {:?}; \
                 transient: {:?}\nlog:\n{}",
                model.status,
                model.never_again,
                model.transient,
                node.daemon
                    .as_ref()
                    .map(TestDaemon::log)
                    .unwrap_or_default()
            );
            model.pods.insert(container, address);
        }
    }
}

fn check(model: &Model, node: &Node, step: usize, what: &str) {
    let holdings = node.holdings();
    let mut seen = BTreeSet::new();
    for (container, address) in &holdings {
        assert!(
            seen.insert(address.clone()),
            "step {step} ({what}): {address} held twice"
        );
        if !container.starts_with('c') {
            continue;
        }
        assert_eq!(
            model.pods.get(container),
            Some(address),
            "step {step} ({what}): {container} holds {address}"
        );
    }
    for (container, address) in &model.pods {
        assert!(
            holdings.iter().any(|(c, a)| c == container && a == address),
            "step {step} ({what}): {container} lost {address}"
        );
    }
}

#[test]
fn the_node_follows_random_control_planes() {
    let first = std::env::var("CP_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| Rng::from_env("CP_MODEL_CLOCK").next_u64());
    let steps = std::env::var("CP_MODEL_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let runs = std::env::var("CP_MODEL_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    for run_index in 0..runs {
        run(first.wrapping_add(run_index), steps);
    }
}
