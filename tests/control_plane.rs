//! Regression tests for issue 24 ("the node follows what the cluster grants
//! now"), one per item, through the real daemon and the loopback API
//! server: blocks taken back drain, foreign and stale objects are ignored,
//! versions are opaque, releases are remembered, only Ready=True serves,
//! PATCH answers are applied, unsupported credentials are refused and
//! refusals are told once. Each asserts behaviour and request counts.

// The edge build (no `kube` feature) has no Kubernetes side to test.
#![cfg(feature = "kube")]

use crate::common;

use std::time::Duration;

use common::cloud::{Cloud, NodeView};
use common::cluster::{
    NODE, block_state, blocks_in_db, default_conf, health_detail, start_daemon,
    start_daemon_over_https, status_entry,
};
use common::kube_api::{Backup, EVENTS, NNCS, fail_next};
use common::scrape::{http_get, metrics_addr, series};
use common::{Plugin, TestDir, assert_ok, json, metis, wait_for};
use serde_json::{Value, json};

/// One usable address: the cluster's blocks serve the rest.
const TINY: &str = r#"[[{"subnet":"198.18.0.0/30"}]]"#;
const WAIT: Duration = Duration::from_secs(20);

/// The IPv4 address (no prefix length) an ADD got; panics with the
/// output otherwise.
fn add(config: &str, id: &str) -> String {
    let output = Plugin::new("ADD", id).run(config);
    assert_ok(&output);
    let address = json(&output)["ips"][0]["address"]
        .as_str()
        .unwrap()
        .to_string();
    address.split('/').next().unwrap().to_string()
}

fn del(config: &str, id: &str) {
    assert_ok(&Plugin::new("DEL", id).run(config));
}

/// Waits until block `cidr` is in `state` (`None`: gone).
fn wait_state(dir: &TestDir, cidr: &str, state: Option<&str>) {
    wait_for(&format!("{cidr} to be {state:?}"), WAIT, || {
        block_state(dir, cidr).as_deref() == state
    });
}

/// Requests of `method` answered on paths ending in `suffix`.
fn requests(api: &Cloud, method: &str, suffix: &str) -> usize {
    api.state().requests(method, suffix)
}

fn lists(api: &Cloud) -> usize {
    requests(api, "GET", "nodenetworkconfigs")
}

fn admin_blocks(daemon: &common::TestDaemon) -> Value {
    let socket = daemon.socket.display().to_string();
    let output = metis(&[
        "admin",
        "cidr-blocks",
        "--socket-path",
        &socket,
        "-o",
        "json",
    ]);
    assert_ok(&output);
    serde_json::from_slice(&output.stdout).unwrap()
}

/// A daemon in NNC mode whose cluster hands out blocks only as the test
/// writes them into the status.
fn quiet_cluster(name: &str, extra: &[&str]) -> (TestDir, Cloud, common::TestDaemon, String) {
    let dir = TestDir::new(name);
    let api = Cloud::start(&[]);
    api.set_controller(false);
    let daemon = start_daemon(&dir, &api, "nnc", extra);
    api.wait_until("the NodeNetworkConfig", WAIT, |s| s.nnc().is_some());
    let config = default_conf(&dir, "1.0.0", TINY);
    (dir, api, daemon, config)
}

#[test]
fn item1_a_block_taken_back_serves_no_new_pod_keeps_its_pods_and_goes_with_the_last() {
    let (dir, api, daemon, config) =
        quiet_cluster("cp-take-back", &["--metrics-addr", "127.0.0.1:0"]);
    api.set_status(json!([
        status_entry("a", "198.19.0.0/28"),
        status_entry("b", "198.19.1.0/28")
    ]));
    wait_state(&dir, "198.19.1.0/28", Some("Ready"));
    // The oldest block first: 13 pods fill 198.19.0.0/28.
    let held: Vec<String> = (0..13).map(|i| add(&config, &format!("p{i}"))).collect();
    assert!(held.iter().all(|a| a.starts_with("198.19.0.")), "{held:?}");
    let lists_before = lists(&api);

    // The controller takes the block back.
    api.set_status(json!([status_entry("b", "198.19.1.0/28")]));
    wait_state(&dir, "198.19.0.0/28", Some("Withheld"));
    let next: Vec<String> = (13..23).map(|i| add(&config, &format!("p{i}"))).collect();
    assert!(
        next.iter().all(|a| !a.starts_with("198.19.0.")),
        "new pods got addresses in a block no longer granted: {next:?}"
    );
    // Its pods keep their addresses: CHECK passes.
    assert_ok(&Plugin::new("CHECK", "p3").run(&config));
    let detail = health_detail(&daemon);
    assert!(
        detail.contains("degraded")
            && detail.contains("198.19.0.0/28")
            && detail.contains("13 pod"),
        "{detail}"
    );
    let listed = admin_blocks(&daemon);
    let row = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["cidr"] == "198.19.0.0/28")
        .unwrap();
    assert!(
        row["note"].as_str().unwrap().contains("no longer granted"),
        "{row}"
    );
    let (_, body) = http_get(&metrics_addr(&daemon), "/metrics");
    assert_eq!(
        series(&body, "metis_local_store_not_granted_block_total"),
        1.0
    );
    assert_eq!(
        series(
            &body,
            "metis_daemon_monitor_action_count{action=\"take_back\",network=\"default\"}"
        ),
        1.0
    );

    // The last pod leaves: the block goes, health is clean again.
    for i in 0..13 {
        del(&config, &format!("p{i}"));
    }
    wait_state(&dir, "198.19.0.0/28", None);
    assert!(!health_detail(&daemon).contains("degraded"));
    // Following a status costs no list; a patch in flight while the status
    // changes may conflict, once per change at most.
    assert_eq!(lists(&api), lists_before);
    assert!(api.state().answered("PATCH", 409) <= 2);

    // Emptied status, every pod gone, a restart: nothing of the cluster's stays.
    for i in 13..23 {
        del(&config, &format!("p{i}"));
    }
    api.set_status(json!([]));
    wait_state(&dir, "198.19.1.0/28", None);
    drop(daemon);
    let _daemon = start_daemon(&dir, &api, "nnc", &[]);
    assert_eq!(add(&config, "after-restart"), "198.18.0.2");
    assert_eq!(blocks_in_db(&dir), ["198.18.0.0/30"]);
}

#[test]
fn item1_node_mode_retires_an_old_pod_cidr_and_a_deleted_node_grants_nothing() {
    let dir = TestDir::new("cp-node");
    let api = Cloud::start(&["198.19.4.0/28"]);
    let daemon = start_daemon(&dir, &api, "node", &[]);
    wait_state(&dir, "198.19.4.0/28", Some("Ready"));
    let config = default_conf(&dir, "1.0.0", TINY);
    let old: Vec<String> = (0..3).map(|i| add(&config, &format!("n{i}"))).collect();
    assert!(old.iter().any(|a| a.starts_with("198.19.4.")), "{old:?}");

    // The Node created anew with another podCIDR (kube-controller-manager
    // may hand the old one to another node).
    api.delete_node();
    api.recreate_node(&["198.19.5.0/28"]);
    wait_state(&dir, "198.19.5.0/28", Some("Ready"));
    wait_state(&dir, "198.19.4.0/28", Some("Withheld"));
    for i in 3..13 {
        let address = add(&config, &format!("n{i}"));
        assert!(!address.starts_with("198.19.4."), "{address}");
    }
    assert_ok(&Plugin::new("CHECK", "n0").run(&config));

    // Deleted for good: nothing is granted, health says so while pods hold.
    api.delete_node();
    wait_state(&dir, "198.19.5.0/28", Some("Withheld"));
    let detail = health_detail(&daemon);
    assert!(detail.contains("no longer grants"), "{detail}");
    let log = daemon.log();
    assert!(
        !log.contains("re-creating"),
        "Metis never re-creates a Node: {log}"
    );
    assert!(log.contains("Node object was deleted"), "{log}");
    for i in 0..13 {
        del(&config, &format!("n{i}"));
    }
    wait_state(&dir, "198.19.5.0/28", None);
    wait_state(&dir, "198.19.4.0/28", None);
    assert!(!health_detail(&daemon).contains("degraded"));
    // Lists: the first, and one after each DELETED (after the backoff).
    api.wait_until("the list after the second delete", WAIT, |s| {
        s.requests("GET", "nodes") >= 3
    });
    assert_eq!(requests(&api, "GET", "nodes"), 3);
}

#[test]
fn node_mode_deletes_an_empty_taken_back_block_when_its_cooldown_ends() {
    let dir = TestDir::new("cp-node-cooldown");
    let api = Cloud::start(&["198.19.4.0/28"]);
    let daemon = start_daemon(&dir, &api, "node", &["--release-cooldown", "3s"]);
    wait_state(&dir, "198.19.4.0/28", Some("Ready"));
    let config = default_conf(&dir, "1.0.0", TINY);
    let pods: Vec<(String, String)> = (0..2)
        .map(|i| (format!("k{i}"), add(&config, &format!("k{i}"))))
        .collect();
    assert!(
        pods.iter().any(|(_, a)| a.starts_with("198.19.4.")),
        "{pods:?}"
    );

    // The Node comes back with another podCIDR; its list and watch settle.
    api.delete_node();
    api.recreate_node(&["198.19.5.0/28"]);
    wait_state(&dir, "198.19.4.0/28", Some("Withheld"));
    api.wait_until("the watch after the relist", WAIT, |s| {
        s.requests("GET", "nodes") == 2 && s.log.last().is_some_and(|r| r.method == "WATCH")
    });
    let requests = api.state().log.len();

    // The last pods leave: their addresses cool for 3 s, so the block
    // stays for now, no pod in it, nothing new allocated from it.
    for (id, _) in &pods {
        del(&config, id);
    }
    assert_eq!(
        block_state(&dir, "198.19.4.0/28").as_deref(),
        Some("Withheld")
    );
    let detail = health_detail(&daemon);
    assert!(!detail.contains("no longer grants"), "{detail}");
    // The cooldown ends: the daemon deletes it by itself, with no DEL, no
    // sync and no request to the API server.
    wait_state(&dir, "198.19.4.0/28", None);
    assert!(
        daemon
            .log()
            .contains("deleted a block the cluster took back: its last pod is gone"),
        "{}",
        daemon.log()
    );
    assert_eq!(api.state().log.len(), requests, "{:?}", api.state().log);
    assert_eq!(block_state(&dir, "198.19.5.0/28").as_deref(), Some("Ready"));
}

#[test]
fn item2_another_nodes_object_is_never_applied_in_watch_or_list() {
    let (dir, api, daemon, config) = quiet_cluster("cp-foreign", &[]);
    assert_eq!(add(&config, "first"), "198.18.0.2");
    // Injected into open watches only: a daemon still to list would take
    // a version past them and see the namespaced one nowhere.
    api.wait_until("the daemon's NodeNetworkConfig watch", WAIT, |s| {
        s.log.iter().any(|r| {
            r.method == "WATCH" && r.path.contains("nodenetworkconfigs") && r.status == 200
        })
    });
    let foreign = json!({
        "apiVersion": "networking.gke.io/v1",
        "kind": "NodeNetworkConfig",
        "metadata": {"name": "node-b", "uid": "uid-of-b"},
        "spec": {"allocations": [{"network": "default", "pods": 40}]},
        "status": {"podCIDRs": [status_entry("b1", "198.19.8.0/28"), status_entry("b2", "198.19.9.0/28")]},
    });
    api.inject_foreign(foreign.clone(), true);
    // The same object, namespaced: not a NodeNetworkConfig of this node either.
    let mut namespaced = foreign;
    namespaced["metadata"]["name"] = json!(NODE);
    namespaced["metadata"]["namespace"] = json!("kube-system");
    api.inject_foreign(namespaced, false);
    wait_for("the foreign objects to be skipped", WAIT, || {
        daemon
            .log()
            .matches("ignoring an object that is not this node's")
            .count()
            >= 2
    });
    // A relist (forced by a compaction) sees node-b's object in the list too.
    let before = lists(&api);
    let relist_at = api.state().log.len();
    api.compact();
    api.set_status(json!([status_entry("mine", "198.19.1.0/28")]));
    wait_for("the relist", WAIT, || lists(&api) > before);
    wait_state(&dir, "198.19.1.0/28", Some("Ready"));
    let blocks = blocks_in_db(&dir);
    assert!(
        !blocks
            .iter()
            .any(|b| b.starts_with("198.19.8.") || b.starts_with("198.19.9.")),
        "{blocks:?}"
    );
    for i in 0..10 {
        let address = add(&config, &format!("f{i}"));
        assert!(address.starts_with("198.19.1."), "{address}");
    }
    // Patches carry this node's version: only the ones in flight while the
    // status changed (the watch relisting after the compaction) conflict,
    // and one after the relist goes through. (Not necessarily the last: a
    // 409 the daemon answers by reading the object again may leave it
    // nothing more to write.)
    api.wait_until("a patch after the relist", WAIT, |s| {
        s.log[relist_at..]
            .iter()
            .any(|r| r.method == "PATCH" && r.status == 200)
    });
    assert!(
        api.state().answered("PATCH", 409) <= 3,
        "{:?}",
        api.state().log
    );
    assert!(api.state().pods("default").unwrap() < 40);
}

#[test]
fn item3_opaque_versions_follow_the_stream_and_a_late_copy_resurrects_nothing() {
    let dir = TestDir::new("cp-opaque");
    let api = Cloud::start(&[]);
    api.state().opaque = true;
    let daemon = start_daemon(
        &dir,
        &api,
        "nnc",
        &[
            "--sustained-low-utilization-duration",
            "200ms",
            "--draining-expiration",
            "200ms",
        ],
    );
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    common::add_concurrently(&config, 0..20);
    let granted = api.state().status_cidrs();
    assert!(!granted.is_empty(), "scale-up did not happen");
    let old = api.state().nnc().cloned().unwrap();
    assert!(
        old["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .contains('.'),
        "versions are not opaque: {old}"
    );
    for i in 0..20 {
        del(&config, &format!("pod-{i}"));
    }
    wait_for("released blocks to leave the database", WAIT, || {
        let blocks = blocks_in_db(&dir);
        granted.iter().all(|cidr| !blocks.contains(cidr))
    });
    let before = lists(&api);
    api.deliver_late(old);
    wait_for("the replay to be refused", WAIT, || {
        daemon
            .log()
            .contains("ignoring an older NodeNetworkConfig version")
    });
    // The stream broke the watch rules: one list, and nothing came back.
    wait_for("the relist", WAIT, || lists(&api) == before + 1);
    let blocks = blocks_in_db(&dir);
    for cidr in &granted {
        assert!(!blocks.contains(cidr), "{cidr} came back: {blocks:?}");
    }
}

/// A daemon that asked for its first 10 pods, a backup of its object as
/// it was then, and 30 more pods since (granted blocks past the backup).
fn grown_past_a_backup(name: &str) -> (TestDir, Cloud, common::TestDaemon, String, Backup) {
    let dir = TestDir::new(name);
    let api = Cloud::start(&[]);
    let daemon = start_daemon(&dir, &api, "nnc", &["--api-max-backoff", "200ms"]);
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    common::add_concurrently(&config, 0..10);
    api.wait_until("the first request", WAIT, |s| s.pods("default").is_some());
    let backup = api.state().backup();
    common::add_concurrently(&config, 10..40);
    (dir, api, daemon, config, backup)
}

#[test]
fn item3_after_an_etcd_restore_growth_resumes_without_a_restart() {
    let (dir, api, daemon, config, backup) = grown_past_a_backup("cp-restore");
    let grown = api.state().status_cidrs();
    // etcd comes back from the backup: versions go back, watches end.
    let lists_before = lists(&api);
    let restored_at = api.state().log.len();
    api.restore(backup);
    wait_for("a relist after ResourceVersionTooLarge", WAIT, || {
        lists(&api) > lists_before
    });
    // Growth goes on from the restored object: patches carry its version.
    // (Conflicts before the restore, with the server's own status writes
    // during the concurrent growth, are not the restore's.)
    common::add_concurrently(&config, 40..60);
    let state = api.state();
    let since_restore = |status: u16| {
        state.log[restored_at..]
            .iter()
            .filter(|r| r.method == "PATCH" && r.status == status)
            .count()
    };
    assert!(since_restore(200) >= 1, "{:?}", state.log);
    assert!(
        since_restore(409) <= 2,
        "patches kept conflicting: {:?}",
        state.log
    );
    assert!(state.answered("PATCH", 200) >= 2);
    drop(state);
    // The restore dropped blocks the node had used: those still holding pods
    // are kept for them and reported, none is served to new pods.
    let lost: Vec<String> = grown
        .iter()
        .filter(|c| !api.state().status_cidrs().contains(c))
        .cloned()
        .collect();
    for cidr in &lost {
        assert_ne!(block_state(&dir, cidr).as_deref(), Some("Ready"), "{cidr}");
    }
    let detail = health_detail(&daemon);
    assert!(!detail.contains("conflicts in a row"), "{detail}");
    assert!(
        lost.is_empty() || detail.contains("no longer grants"),
        "{detail}"
    );
}

/// etcd restored without `--bump-revision`, and other objects' writes
/// hand its versions out again past the node's before its watch resumes:
/// the watch resumes without an error, and the node's object is back at a
/// version the node saw before its newer copy. The read after the first
/// conflict is older than the copy the patch went from: the state went
/// back, and the node follows it at once (skipped as old, every patch
/// would go from the newer copy and conflict until the object changed).
#[test]
fn item3_after_a_restore_without_new_versions_a_conflict_read_is_the_state_going_back() {
    let (_dir, api, daemon, config, backup) = grown_past_a_backup("cp-restore-unbumped");
    let (lists_before, restored_at) = (lists(&api), api.state().log.len());
    api.with_state(|s| {
        let handed_out = s.version;
        s.restore(backup);
        let mut n = 0;
        while s.version <= handed_out {
            n += 1;
            let event = json!({"metadata": {"name": format!("other-{n}")}});
            s.create(EVENTS, "default", &event).unwrap();
        }
    });
    common::add_concurrently(&config, 40..60);
    let patches_since = |s: &common::kube_api::State, status: u16| {
        s.log[restored_at..]
            .iter()
            .filter(|r| r.method == "PATCH" && r.status == status)
            .count()
    };
    api.wait_until("a patch of the restored object", WAIT, |s| {
        patches_since(s, 200) >= 1
    });
    let conflicts = patches_since(&api.state(), 409);
    assert!(
        conflicts <= 2,
        "{conflicts} conflicts: {:?}",
        api.state().log
    );
    assert_eq!(lists(&api), lists_before, "the watch resumed: no relist");
    assert!(
        daemon.log().contains("went back to an earlier one"),
        "{}",
        daemon.log()
    );
    let detail = health_detail(&daemon);
    assert!(!detail.contains("conflicts in a row"), "{detail}");
}

#[test]
fn item4_a_released_non_reusable_block_is_never_used_again() {
    let dir = TestDir::new("cp-non-reusable");
    let api = Cloud::start(&[]);
    api.set_block_type("NonReusable");
    let daemon = start_daemon(
        &dir,
        &api,
        "nnc",
        &[
            "--sustained-low-utilization-duration",
            "200ms",
            "--draining-expiration",
            "200ms",
        ],
    );
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    common::add_concurrently(&config, 0..20);
    let granted = api.state().nnc().cloned().unwrap()["status"]["podCIDRs"].clone();
    let cidrs = api.state().status_cidrs();
    assert!(!cidrs.is_empty());
    for i in 0..20 {
        del(&config, &format!("pod-{i}"));
    }
    wait_for("released blocks to leave the database", WAIT, || {
        let blocks = blocks_in_db(&dir);
        cidrs.iter().all(|cidr| !blocks.contains(cidr))
    });
    // Every block granted for the burst is released as NonReusable (a
    // grant still in flight when the burst ended may add one more).
    let released: Vec<String> = common::db(&dir.join("metis.sqlite"))
        .prepare("SELECT cidr FROM metis_released WHERE reusable = 0")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for cidr in &cidrs {
        assert!(released.contains(cidr), "{cidr} not released: {released:?}");
    }
    // The controller lists them again, Ready: they left and came back, but
    // NonReusable ones never return.
    api.set_controller(false);
    api.set_status(granted);
    wait_for("the refusal", WAIT, || {
        daemon
            .log()
            .contains("NonReusable: it is never taken again")
    });
    let blocks = blocks_in_db(&dir);
    for cidr in &cidrs {
        assert!(!blocks.contains(cidr), "{cidr} is served again: {blocks:?}");
    }
    // Nor after a restart.
    drop(daemon);
    let _daemon = start_daemon(&dir, &api, "nnc", &[]);
    assert_ok(&Plugin::new("ADD", "again").run(&config));
    let blocks = blocks_in_db(&dir);
    assert!(
        cidrs.iter().all(|cidr| !blocks.contains(cidr)),
        "{blocks:?}"
    );
}

#[test]
fn item4_a_reusable_release_returns_only_after_it_left_the_status() {
    let (dir, api, daemon, config) = quiet_cluster("cp-reusable", &[]);
    let entry = |cidr: &str| {
        let mut entry = status_entry(cidr, cidr);
        entry["type"] = json!("Reusable");
        entry
    };
    api.set_status(json!([entry("198.19.0.0/28")]));
    wait_state(&dir, "198.19.0.0/28", Some("Ready"));
    // Released by this node (as the monitor does after a drain).
    {
        let conn = rusqlite::Connection::open(dir.join("metis.sqlite")).unwrap();
        conn.execute_batch(
            "INSERT INTO metis_released (network, cidr, reusable, released_at) VALUES ('default', '198.19.0.0/28', 1, 1);
             UPDATE cidr_blocks SET state = 'Deleting' WHERE cidr = '198.19.0.0/28';",
        )
        .unwrap();
    }
    // Still listed (the controller has not acted yet): not served again.
    api.set_status(json!([entry("198.19.0.0/28"), entry("198.19.1.0/28")]));
    wait_state(&dir, "198.19.1.0/28", Some("Ready"));
    assert_eq!(
        block_state(&dir, "198.19.0.0/28").as_deref(),
        Some("Deleting")
    );
    // It leaves the status (deleted locally), then comes back: served again.
    api.set_status(json!([entry("198.19.1.0/28")]));
    wait_state(&dir, "198.19.0.0/28", None);
    api.set_status(json!([entry("198.19.1.0/28"), entry("198.19.0.0/28")]));
    wait_state(&dir, "198.19.0.0/28", Some("Ready"));
    assert!(daemon.log().contains("came back to the status"));
    assert!(add(&config, "r0").starts_with("198.19."));
}

#[test]
fn item5_a_block_whose_condition_leaves_ready_takes_no_new_allocations() {
    let (dir, api, _daemon, config) = quiet_cluster("cp-conditions", &[]);
    let with = |status: &str, reason: &str| {
        json!([{"id": "a", "network": "default", "cidr": "198.19.0.0/28",
                "condition": {"type": "Ready", "status": status, "reason": reason}},
               {"id": "d", "network": "default", "cidr": "198.19.3.0/28",
                "condition": {"type": "Deleting", "status": "True"}},
               {"id": "n", "network": "default", "cidr": "198.19.4.0/28"}])
    };
    api.set_status(with("True", "PodCIDRReady"));
    wait_state(&dir, "198.19.0.0/28", Some("Ready"));
    // Type Deleting with status True, or no condition at all: never Ready.
    assert_eq!(block_state(&dir, "198.19.3.0/28"), None);
    assert_eq!(block_state(&dir, "198.19.4.0/28"), None);
    let a = add(&config, "c0");
    assert!(a.starts_with("198.19.0."), "{a}");
    api.set_status(with("False", "Updating"));
    wait_state(&dir, "198.19.0.0/28", Some("Withheld"));
    // The CNI range's one address, then nothing from the block.
    assert_eq!(add(&config, "c1"), "198.18.0.2");
    assert_ok(&Plugin::new("CHECK", "c0").run(&config));
    api.set_status(with("True", "PodCIDRReady"));
    wait_state(&dir, "198.19.0.0/28", Some("Ready"));
    assert!(add(&config, "c2").starts_with("198.19.0."));
    assert_ok(&Plugin::new("CHECK", "c0").run(&config));
}

#[test]
fn item6_with_a_lagging_watch_growth_follows_the_patch_answers() {
    let dir = TestDir::new("cp-patch-answer");
    let api = Cloud::start(&[]);
    let daemon = start_daemon(&dir, &api, "nnc", &[]);
    api.wait_until("a watch", WAIT, |s| s.answered("WATCH", 200) >= 1);
    // The watch delivers nothing from now on: only PATCH answers tell the
    // daemon what the cluster granted.
    api.state().hold_watches = true;
    let reads = |api: &Cloud| {
        api.state()
            .log
            .iter()
            .filter(|r| r.method == "GET" && r.path.ends_with(NODE))
            .count()
    };
    let reads_before = reads(&api);
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    for step in 0..3 {
        let ids = step * 15..(step + 1) * 15;
        let mut addresses = common::add_concurrently(&config, ids);
        addresses.sort();
        addresses.dedup();
        assert_eq!(addresses.len(), 15);
    }
    let state = api.state();
    let patches = state.answered("PATCH", 200);
    assert!(patches >= 2, "{:?}", state.log);
    // Every grant cost one PATCH: no conflict, no re-read.
    assert_eq!(state.answered("PATCH", 409), 0, "{:?}", state.log);
    drop(state);
    assert_eq!(reads(&api), reads_before);
    assert!(!health_detail(&daemon).contains("degraded"));
}

/// A self-signed CA certificate (P-256), only ever parsed.
const TEST_CA: &str = include_str!("../testdata/kube/test-ca.pem");

#[test]
fn item7_a_rotated_ca_file_is_read_again_without_a_restart() {
    let dir = TestDir::new("cp-ca-rotation");
    let api = Cloud::start(&[]);
    let ca = dir.join("ca.crt");
    std::fs::write(&ca, "-----BEGIN").unwrap();
    let daemon = start_daemon_over_https(
        &dir,
        &api,
        &format!("certificate-authority: {}", ca.display()),
        &["--api-max-backoff", "100ms"],
    );
    wait_for("the broken CA to be reported", WAIT, || {
        health_detail(&daemon).contains("client setup")
    });
    // The CA is rotated on disk: the daemon uses it at its next attempt,
    // which now gets as far as the TLS handshake (the test server speaks
    // plain HTTP, so that fails differently).
    std::fs::write(&ca, TEST_CA).unwrap();
    wait_for("the new CA to be used", WAIT, || {
        let detail = health_detail(&daemon);
        detail.contains("degraded") && !detail.contains("client setup")
    });
    assert!(daemon.log().contains("TLS material changed on disk"));
}

#[test]
fn item8_exec_and_auth_provider_users_are_refused_at_start() {
    let api = Cloud::start(&[]);
    for (user, what) in [
        (
            "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: gke-gcloud-auth-plugin",
            "exec",
        ),
        ("    auth-provider:\n      name: gcp", "auth-provider"),
    ] {
        let dir = TestDir::new("cp-exec");
        let kubeconfig = dir.join("kubeconfig");
        api.kubeconfig_with_user(&kubeconfig, user);
        let output = std::process::Command::new(common::METIS)
            .args(["daemon", "--cidr-source", "nnc", "--socket-path"])
            .arg(dir.join("s.sock"))
            .env("KUBECONFIG", &kubeconfig)
            .env("NODE_NAME", NODE)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(what) && stderr.contains("not supported"),
            "{stderr}"
        );
    }
    assert!(api.state().log.is_empty(), "nothing may be sent");
}

#[test]
fn item9_refusals_are_told_once_per_cause_and_name_the_real_owner() {
    let (dir, api, daemon, config) = quiet_cluster(
        "cp-refusals",
        &[
            "--cidr",
            "default=198.19.4.0/28",
            "--metrics-addr",
            "127.0.0.1:0",
        ],
    );
    add(&config, "first");
    let overlapping = [
        status_entry("w", "198.19.4.0/27"),
        status_entry("x", "198.19.4.0/29"),
        status_entry("y", "198.18.0.0/29"),
    ];
    for version in 0..3 {
        let mut entries = overlapping.to_vec();
        entries.push(status_entry("ok", &format!("198.19.{}.0/28", 10 + version)));
        api.set_status(Value::Array(entries));
        wait_state(
            &dir,
            &format!("198.19.{}.0/28", 10 + version),
            Some("Ready"),
        );
    }
    let log = daemon.log();
    assert_eq!(log.matches("refusing a podCIDR").count(), 3, "{log}");
    assert!(log.contains("belongs to the daemon's --cidr flag"), "{log}");
    assert!(log.contains("CNI configuration (conflist)"), "{log}");
    assert!(!log.contains("that the cluster granted"), "{log}");
    let (_, body) = http_get(&metrics_addr(&daemon), "/metrics");
    assert_eq!(
        series(&body, "metis_daemon_nnc_refused_pod_cidrs_total"),
        3.0
    );
}

/// (pods asked, blocks granted) of every version of the object the API
/// server recorded, in order, consecutive repeats dropped.
fn demand_history(api: &Cloud) -> Vec<(i64, usize)> {
    let state = api.state();
    let mut seen: Vec<(i64, usize)> = Vec::new();
    for change in &state.changes {
        if change.key.resource != NNCS {
            continue;
        }
        let object = &change.object;
        let pods = object["spec"]["allocations"][0]["pods"]
            .as_i64()
            .unwrap_or(0);
        let blocks = object["status"]["podCIDRs"].as_array().map_or(0, Vec::len);
        if seen.last() != Some(&(pods, blocks)) {
            seen.push((pods, blocks));
        }
    }
    seen
}

#[test]
fn issue32_item2_a_static_range_does_not_make_the_demand_run_away() {
    let dir = TestDir::new("cp-runaway");
    let api = Cloud::start(&[]);
    let daemon = start_daemon(&dir, &api, "nnc", &["-v", "4"]);
    // A static /24: every pod fits in it, yet the node asks the cluster
    // for its pods' need (the contract: neither side counts own ranges).
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/24"}]]"#);
    let addresses: Vec<String> = (0..10).map(|i| add(&config, &format!("p{i}"))).collect();
    assert!(addresses.iter().all(|a| a.starts_with("198.18.0.")));
    // Twenty monitor passes with nothing to change: the demand settled.
    let passes = |log: &str| log.matches("pass complete, nothing to change").count();
    wait_for("a settled demand", WAIT, || {
        api.state().pods("default").is_some() && passes(&daemon.log()) >= 1
    });
    let before = passes(&daemon.log());
    wait_for("twenty idle passes", WAIT, || {
        passes(&daemon.log()) >= before + 20
    });
    let history = demand_history(&api);
    // 10 pods: ceil(10 / 0.75) = 14 asked (less if a pass ran between
    // the ADDs), one /28 granted; its 3 reserved rows make 13 in use,
    // ceil(13 / 0.75) = 18, a second /28; then the request is what the
    // cluster holds (32). Before, each pass asked one /24 more than it was
    // given: (12,1) (40,3) (88,6) ... (328,21).
    assert_eq!(history.last(), Some(&(32, 2)), "{history:?}");
    assert!(
        history
            .iter()
            .all(|(pods, blocks)| *pods <= 32 && *blocks <= 2),
        "{history:?}"
    );
    assert_eq!(api.handed_out(), 2, "{history:?}");
}

/// Monitor passes that found nothing to change, so far.
fn idle_passes(daemon: &common::TestDaemon) -> usize {
    daemon
        .log()
        .matches("pass complete, nothing to change")
        .count()
}

#[test]
fn issue32_the_serving_annotation_lists_the_blocks_in_use_on_every_object() {
    let (dir, api, daemon, config) = quiet_cluster("cp-serving", &["-v", "4"]);
    api.set_status(json!([
        status_entry("a", "198.19.1.0/28"),
        status_entry("b", "198.19.0.0/28")
    ]));
    wait_state(&dir, "198.19.0.0/28", Some("Ready"));
    // The spec PATCH that asks for the pods carries the annotation: both
    // blocks, canonical and in address order.
    let held: Vec<String> = (0..13).map(|i| add(&config, &format!("p{i}"))).collect();
    let both = "198.19.0.0/28,198.19.1.0/28";
    api.wait_until("the annotation", WAIT, |s| {
        s.serving().as_deref() == Some(both)
    });
    // Nothing changes: no PATCH of its own.
    let patches = api.state().answered("PATCH", 200);
    let before = idle_passes(&daemon);
    wait_for("ten idle passes", WAIT, || {
        idle_passes(&daemon) >= before + 10
    });
    assert_eq!(api.state().answered("PATCH", 200), patches);
    let used = held[0]
        .rsplit_once('.')
        .map(|(net, _)| format!("{net}.0/28"));
    let used = used.unwrap();
    assert!(
        held.iter().all(|a| a.starts_with(&used[..used.len() - 4])),
        "{held:?}"
    );

    // Deleted by hand: re-created by the daemon, naming the block its pods
    // still hold (the empty one was dropped with the old object).
    api.delete_nnc();
    api.wait_until("the re-created object", WAIT, |s| s.nnc().is_some());
    assert_eq!(api.state().serving(), Some(used.clone()));
    // The Node deleted and re-created, the object with it (the garbage
    // collector): created again with the new owner and the annotation.
    api.delete_node();
    api.wait_until("the object to go with its Node", WAIT, |s| {
        s.nnc().is_none()
    });
    api.recreate_node(&[]);
    api.wait_until("the object of the new Node", WAIT, |s| s.nnc().is_some());
    {
        let state = api.state();
        let nnc = state.nnc().unwrap();
        assert_eq!(
            nnc["metadata"]["ownerReferences"][0]["uid"],
            state.node().unwrap()["metadata"]["uid"]
        );
        assert_eq!(state.serving(), Some(used.clone()));
    }
    // Re-created by someone else, without the annotation: re-asserted.
    api.recreate_nnc(json!([]));
    api.wait_until("the annotation re-asserted", WAIT, |s| {
        s.serving().as_deref() == Some(used.as_str())
    });
    // Its pods kept their addresses throughout.
    for i in 0..13 {
        assert_ok(&Plugin::new("CHECK", &format!("p{i}")).run(&config));
    }
}

/// Versions of the object whose spec differs from the version before:
/// the useful spec changes.
fn spec_changes(api: &Cloud) -> usize {
    let state = api.state();
    let specs: Vec<&Value> = state
        .changes
        .iter()
        .filter(|c| c.key.resource == NNCS && c.kind != "DELETED")
        .map(|c| &c.object["spec"])
        .collect();
    specs.windows(2).filter(|pair| pair[0] != pair[1]).count()
}

#[test]
fn issue32_item7_behind_a_lagging_watch_a_conflict_is_read_not_resent() {
    let dir = TestDir::new("cp-lagging-watch");
    let api = Cloud::start(&[]);
    let _daemon = start_daemon(&dir, &api, "nnc", &["--monitor-interval", "2s"]);
    api.wait_until("the NodeNetworkConfig", WAIT, |s| s.nnc().is_some());
    api.state().watch_lag = Some(Duration::from_secs(3));
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    let mut failed = 0usize;
    std::thread::scope(|scope| {
        // Churn: a wave of pods every 1.5 s (the rate of the load, not a
        // wait for anything); one wave meets a conflict (another writer).
        for wave in 0..12 {
            let started = std::time::Instant::now();
            if wave == 2 {
                api.state().faults.push(fail_next("patch", 1, 409));
            }
            let adds: Vec<_> = (wave * 5..(wave + 1) * 5)
                .map(|i| {
                    let config = config.clone();
                    scope.spawn(move || Plugin::new("ADD", &format!("pod-{i}")).run(&config))
                })
                .collect();
            for add in adds {
                failed += usize::from(!add.join().unwrap().status.success());
            }
            std::thread::sleep(Duration::from_millis(1500).saturating_sub(started.elapsed()));
        }
    });
    let useful = spec_changes(&api);
    let state = api.state();
    let (ok, conflicts) = (state.answered("PATCH", 200), state.answered("PATCH", 409));
    let ratio = (ok + conflicts) as f64 / useful as f64;
    eprintln!(
        "lagging watch: {} PATCHes ({ok} applied, {conflicts} conflicts) for {useful} spec changes: {ratio:.2} per change; {failed} of 60 ADDs failed",
        ok + conflicts
    );
    // No older copy replaced a newer one: the versions the patches were
    // computed from never go back.
    let bases: Vec<u64> = state
        .patch_bases()
        .iter()
        .map(|rv| state.position(rv).unwrap())
        .collect();
    assert!(bases.windows(2).all(|pair| pair[0] <= pair[1]), "{bases:?}");
    assert!(useful >= 4, "{useful} spec changes");
    assert!(ratio <= 1.3, "{ratio:.2} PATCHes per spec change");
    assert_eq!(failed, 0, "ADDs failed");
}
