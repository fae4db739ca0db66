//! The daemon against a real HTTP API server on loopback: NodeNetworkConfig
//! scale-up with parked requests, drain and release, an API server that
//! goes away, 409 races, 410 relists, and Node podCIDRs.

// The edge build (no `kube` feature) has no Kubernetes side to test.
#![cfg(feature = "kube")]

use crate::common;

use std::time::Duration;

use common::cloud::{Cloud, NodeView};
use common::cluster::{
    FAST, NODE, blocks_in_db, default_conf, health_detail, start_daemon, start_daemon_over_https,
    status_entry,
};
use common::kube_api::{fail, fail_next};
use common::{Plugin, TestDaemon, TestDir, add_concurrently, assert_ok, db, wait_for};

const INITIAL: &str = r#"[[{"subnet":"198.18.0.0/26"}]]"#;

fn block_count(dir: &TestDir, state: &str) -> i64 {
    db(&dir.join("metis.sqlite"))
        .query_row(
            "SELECT COUNT(*) FROM cidr_blocks WHERE state = ?1",
            [state],
            |r| r.get(0),
        )
        .unwrap()
}

#[test]
fn scale_up_parks_requests_until_new_blocks_arrive() {
    let dir = TestDir::new("kube-scale-up");
    let api = Cloud::start(&[]);
    let daemon = start_daemon(&dir, &api, "nnc", &[]);
    api.wait_until("the NodeNetworkConfig", Duration::from_secs(10), |s| {
        s.nnc().is_some()
    });
    {
        let state = api.state();
        let owner = &state.nnc().unwrap()["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "Node");
        assert_eq!(owner["name"], NODE);
        assert_eq!(owner["uid"], state.node().unwrap()["metadata"]["uid"]);
        assert_eq!(owner["controller"], true);
    }

    // 80 pods against a /26 (61 usable addresses): the rest must wait for
    // the cluster, and every ADD must still succeed with its own address.
    let config = default_conf(&dir, "1.0.0", INITIAL);
    let mut addresses = add_concurrently(&config, 0..80);
    addresses.sort();
    addresses.dedup();
    assert_eq!(addresses.len(), 80, "duplicate addresses");
    let dynamic = addresses
        .iter()
        .filter(|a| a.starts_with("198.19."))
        .count();
    assert!(
        dynamic >= 19,
        "only {dynamic} addresses came from new blocks"
    );

    // The request comes to cover at least the pods in the cluster's blocks
    // (the /26 is the node's own: the request need not reach 80); the
    // daemon's monitor writes it on its own time, after the last ADD.
    let dynamic = i64::try_from(dynamic).unwrap();
    api.wait_until(
        "the request covering the pods",
        Duration::from_secs(10),
        |s| s.pods("default").is_some_and(|pods| pods >= dynamic),
    );
    let state = api.state();
    assert!(state.status_cidrs().len() >= 2);
    assert!(state.answered("PATCH", 200) >= 1);
    drop(state);
    assert!(block_count(&dir, "Ready") >= 3);
    // Periodic no-op messages stay out of the default log level.
    assert!(!daemon.log().contains("TRACE"), "{}", daemon.log());
}

#[test]
fn high_verbosity_shows_periodic_no_op_messages() {
    let dir = TestDir::new("kube-verbose");
    let api = Cloud::start(&[]);
    let daemon = start_daemon(&dir, &api, "nnc", &["-v", "4"]);
    let config = default_conf(&dir, "1.0.0", INITIAL);
    assert_ok(&Plugin::new("ADD", "one").run(&config));
    wait_for(
        "a no-op monitor pass at -v 4",
        Duration::from_secs(10),
        || {
            daemon
                .log()
                .contains("TRACE monitor: pass complete, nothing to change")
        },
    );
}

#[test]
fn idle_blocks_drain_expire_and_are_released_but_never_the_oldest() {
    let dir = TestDir::new("kube-release");
    let api = Cloud::start(&[]);
    let _daemon = start_daemon(
        &dir,
        &api,
        "nnc",
        &[
            "--sustained-low-utilization-duration",
            "300ms",
            "--draining-expiration",
            "300ms",
        ],
    );
    let config = default_conf(&dir, "1.0.0", INITIAL);
    add_concurrently(&config, 0..90);
    let grown = api.state().status_cidrs().len();
    assert!(grown >= 2, "scale-up did not happen");

    for i in 0..88 {
        assert_ok(&Plugin::new("DEL", &format!("pod-{i}")).run(&config));
    }
    // Blocks drain, expire, are listed as releasable, leave the status and
    // then the database; the initial /26 stays.
    api.wait_until(
        "released blocks to leave the status",
        Duration::from_secs(30),
        |s| s.status_cidrs().len() < grown && s.releasable_cidrs().is_empty() && s.nnc().is_some(),
    );
    wait_for(
        "released blocks to leave the database",
        Duration::from_secs(30),
        || {
            let blocks: i64 = db(&dir.join("metis.sqlite"))
                .query_row("SELECT COUNT(*) FROM cidr_blocks", [], |r| r.get(0))
                .unwrap();
            usize::try_from(blocks).unwrap() <= api.state().status_cidrs().len() + 1
        },
    );
    let initial: String = db(&dir.join("metis.sqlite"))
        .query_row(
            "SELECT state FROM cidr_blocks WHERE cidr = '198.18.0.0/26'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(initial, "Ready", "the oldest block must never drain");
    // The two remaining pods kept their addresses throughout.
    for i in 88..90 {
        let check = Plugin::new("CHECK", &format!("pod-{i}")).run(&config);
        assert_ok(&check);
    }
}

#[test]
fn api_server_outage_degrades_gracefully_and_conflicts_are_retried() {
    let dir = TestDir::new("kube-outage");
    let mut api = Cloud::start(&[]);
    let daemon = start_daemon(&dir, &api, "nnc", &[]);
    api.wait_until("the NodeNetworkConfig", Duration::from_secs(10), |s| {
        s.nnc().is_some()
    });
    let config = default_conf(&dir, "1.0.0", INITIAL);

    api.stop();
    // Local blocks keep serving while the API server is gone.
    let local = add_concurrently(&config, 0..40);
    assert!(local.iter().all(|a| a.starts_with("198.18.0.")));
    let detail = health_detail(&daemon);
    assert!(detail.contains("degraded"), "{detail}");

    // Back, with one patch conflict to survive: scale-up resumes.
    api.state().faults.push(fail_next("patch", 1, 409));
    api.restart();
    let more = add_concurrently(&config, 40..80);
    assert!(more.iter().any(|a| a.starts_with("198.19.")));
    let state = api.state();
    assert!(
        state.answered("PATCH", 409) >= 1,
        "the conflict was never hit"
    );
    assert!(
        state.answered("PATCH", 200) >= 1,
        "no patch succeeded after the conflict"
    );
}

#[test]
fn stale_watch_versions_relist() {
    let dir = TestDir::new("kube-relist");
    let api = Cloud::start(&[]);
    let _daemon = start_daemon(&dir, &api, "nnc", &[]);
    api.wait_until("a watch", Duration::from_secs(10), |s| {
        s.log.iter().any(|r| r.method == "WATCH")
    });
    let lists_before = api.state().requests("GET", "nodenetworkconfigs");
    // Hand a block to the daemon directly through the status, then compact
    // under the same lock: a new version whose event no watch sends, so it
    // must be picked up after the relist that the 410 forces.
    api.set_controller(false);
    api.with_state(|state| {
        let entries = serde_json::json!([status_entry("x", "198.19.200.0/28")]);
        state.edit(&common::cloud::nnc_key(), |nnc| {
            nnc["status"]["podCIDRs"] = entries;
        });
        state.compact();
    });
    api.wait_until("a relist", Duration::from_secs(90), |s| {
        s.requests("GET", "nodenetworkconfigs") > lists_before
    });
    wait_for("the block from the relist", Duration::from_secs(10), || {
        db(&dir.join("metis.sqlite"))
            .query_row(
                "SELECT COUNT(*) FROM cidr_blocks WHERE cidr = '198.19.200.0/28'",
                [],
                |r| r.get::<_, i64>(0),
            )
            .unwrap()
            == 1
    });
}

#[test]
fn node_source_adds_pod_cidrs_as_blocks() {
    let dir = TestDir::new("kube-node");
    let api = Cloud::start(&["198.18.8.0/24", "2001:db8:8::/64"]);
    let _daemon = start_daemon(&dir, &api, "node", &[]);
    wait_for("node podCIDRs as blocks", Duration::from_secs(10), || {
        dir.join("metis.sqlite").exists()
            && db(&dir.join("metis.sqlite"))
                .query_row(
                    "SELECT COUNT(*) FROM cidr_blocks WHERE network = 'default' AND cidr IN ('198.18.8.0/24', '2001:db8:8::/64')",
                    [],
                    |r| r.get::<_, i64>(0),
                )
                .unwrap()
                == 2
    });
    assert!(
        api.state().nnc().is_none(),
        "node source must not create a NodeNetworkConfig"
    );
}

#[test]
fn cluster_source_without_cluster_is_a_usage_error() {
    let dir = TestDir::new("kube-nocluster");
    let output = std::process::Command::new(common::METIS)
        .args(["daemon", "--cidr-source", "nnc", "--socket-path"])
        .arg(dir.join("s.sock"))
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("needs a cluster"));
}

/// A daemon whose /30 is full (its cluster never adds blocks) and a second
/// ADD parked in it: the daemon, the config, and the parked plugin's thread.
fn daemon_with_a_parked_add(
    dir: &TestDir,
    api: &Cloud,
    wait: &str,
) -> (
    TestDaemon,
    String,
    std::thread::JoinHandle<std::process::Output>,
) {
    daemon_with_a_parked_add_of(dir, api, wait, r#"[[{"subnet":"198.18.0.0/30"}]]"#, &[])
}

/// [`daemon_with_a_parked_add`] with the conflist's `ranges`, after the
/// holder's ADD and the `more` ADDs (conflist, container) ran.
fn daemon_with_a_parked_add_of(
    dir: &TestDir,
    api: &Cloud,
    wait: &str,
    ranges: &str,
    more: &[(&str, &str)],
) -> (
    TestDaemon,
    String,
    std::thread::JoinHandle<std::process::Output>,
) {
    api.set_controller(false);
    let daemon = start_daemon(dir, api, "nnc", &["--scale-up-wait", wait]);
    api.wait_until("the NodeNetworkConfig", Duration::from_secs(10), |s| {
        s.nnc().is_some()
    });
    let config = default_conf(dir, "1.0.0", ranges);
    assert_ok(&Plugin::new("ADD", "holder").run(&config));
    for (other, container) in more {
        assert_ok(&Plugin::new("ADD", container).run(other));
    }
    let waiter = {
        let config = config.clone();
        std::thread::spawn(move || Plugin::new("ADD", "waiter").run(&config))
    };
    // Parked: the daemon says so when it parks a request. (The pods asked
    // for can grow before that — the full pool alone asks for more — so
    // they do not tell.)
    wait_for(
        "the waiting ADD to be parked",
        Duration::from_secs(10),
        || {
            daemon
                .log()
                .contains("Local store IP exhaustion detected, requesting scale up")
        },
    );
    // The holder and the waiter: ceil(2 / 0.75) = 3 (the /30's reserved
    // rows are the node's own, not the cluster's).
    api.wait_until("a scale-up request", Duration::from_secs(10), |s| {
        s.pods("default").unwrap_or(0) >= 3
    });
    (daemon, config, waiter)
}

#[test]
fn released_addresses_wake_waiting_requests() {
    // Upstream leaves a waiter parked until a new block arrives, even when
    // a release freed an address meanwhile.
    let dir = TestDir::new("kube-wake-on-release");
    let api = Cloud::start(&[]);
    let (_daemon, config, waiter) = daemon_with_a_parked_add(&dir, &api, "30s");
    assert_ok(&Plugin::new("DEL", "holder").run(&config));
    let output = waiter.join().unwrap();
    assert_ok(&output);
    assert_eq!(common::json(&output)["ips"][0]["address"], "198.18.0.2/30");
}

/// The allocated rows of `container` in the database of `dir`: (address, block).
fn held_by(dir: &TestDir, container: &str) -> Vec<(String, String)> {
    db(&dir.join("metis.sqlite"))
        .prepare(
            "SELECT a.address, b.cidr FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
             WHERE a.container_id = ?1 AND a.is_allocated = 1 ORDER BY a.address",
        )
        .unwrap()
        .query_map([container], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// A parked ADD is retried, once the cluster grants a block, in a write
/// transaction of its own (`Engine::handle_alone`): it gets an address of
/// the granted block that passed the hand-out check (not the block's
/// network, gateway or broadcast), held by it alone, and its result's
/// gateway is recorded as one no hand-out takes.
#[test]
fn a_parked_add_retried_after_a_grant_gets_a_valid_address() {
    let dir = TestDir::new("kube-parked-grant");
    let api = Cloud::start(&[]);
    let (_daemon, _config, waiter) = daemon_with_a_parked_add(&dir, &api, "30s");
    api.set_status(serde_json::json!([status_entry("grant", "198.19.5.0/28")]));
    let output = waiter.join().unwrap();
    assert_ok(&output);
    let result = common::json(&output);
    let address = result["ips"][0]["address"].as_str().unwrap().to_string();
    let host: u8 = address
        .strip_prefix("198.19.5.")
        .and_then(|rest| rest.strip_suffix("/28"))
        .and_then(|host| host.parse().ok())
        .unwrap_or_else(|| panic!("not an address of the grant: {result}"));
    assert!((2..=14).contains(&host), "{result}");
    assert_eq!(result["ips"][0]["gateway"], "198.19.5.1", "{result}");
    let ip = address.trim_end_matches("/28").to_string();
    assert_eq!(
        held_by(&dir, "waiter"),
        [(ip.clone(), "198.19.5.0/28".to_string())]
    );
    let owners: i64 = db(&dir.join("metis.sqlite"))
        .query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE address = ?1 AND is_allocated = 1",
            [&ip],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(owners, 1);
    let named: String = db(&dir.join("metis.sqlite"))
        .query_row(
            "SELECT gateway FROM metis_gateways WHERE container_id = 'waiter'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(named, "198.19.5.1");
}

/// A parked dual-stack ADD whose retry after the grant gets its IPv4
/// address but finds no IPv6 one fails with code 11 and leaves nothing: no
/// row of either family, no record of a gateway, the granted block empty.
#[test]
fn a_parked_add_whose_retry_fails_leaves_nothing() {
    let dir = TestDir::new("kube-parked-fails");
    let api = Cloud::start(&[]);
    // The /126 has two usable addresses: the holder takes one, a pod of an
    // IPv6-only conflist of the network the other.
    let v6_only = default_conf(&dir, "1.0.0", r#"[[{"subnet":"2001:db8:5::/126"}]]"#);
    let (_daemon, _config, waiter) = daemon_with_a_parked_add_of(
        &dir,
        &api,
        "30s",
        r#"[[{"subnet":"198.18.0.0/30"}],[{"subnet":"2001:db8:5::/126"}]]"#,
        &[(&v6_only, "v6-holder")],
    );
    api.set_status(serde_json::json!([status_entry("grant", "198.19.6.0/28")]));
    let output = waiter.join().unwrap();
    assert!(!output.status.success(), "{output:?}");
    let error = common::json(&output);
    assert_eq!(error["code"], 11, "{error}");
    assert!(error.to_string().contains("ipv6"), "{error}");
    assert_eq!(held_by(&dir, "waiter"), []);
    let conn = db(&dir.join("metis.sqlite"));
    let records: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM metis_gateways WHERE container_id = 'waiter'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(records, 0);
    let in_grant: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
             WHERE b.cidr = '198.19.6.0/28' AND a.is_allocated = 1 AND a.container_id != ''",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(in_grant, 0);
}

#[test]
fn rotated_token_files_are_read_again() {
    let dir = TestDir::new("kube-token");
    let api = Cloud::start(&[]);
    let token = dir.join("token");
    std::fs::write(&token, "first-token\n").unwrap();
    let kubeconfig = dir.join("kubeconfig");
    api.kubeconfig_with_user(&kubeconfig, &format!("    tokenFile: {}", token.display()));
    let kubeconfig = kubeconfig.display().to_string();
    let mut args = vec!["--cidr-source", "nnc"];
    args.extend_from_slice(FAST);
    let _daemon = TestDaemon::start_with_env(
        &dir,
        &args,
        &[("KUBECONFIG", &kubeconfig), ("NODE_NAME", NODE)],
    );
    api.wait_until("the first token", Duration::from_secs(10), |s| {
        s.tokens().iter().any(|t| t == "first-token")
    });
    std::fs::write(&token, "second-token\n").unwrap();
    // Force new requests: a relist follows the compaction.
    api.compact();
    api.wait_until("the rotated token", Duration::from_secs(30), |s| {
        s.tokens().iter().any(|t| t == "second-token")
    });
}

#[test]
fn tls_failures_leave_the_daemon_serving_and_degraded() {
    // The test API server speaks plain HTTP: an https client fails its
    // handshake, which must surface as a degraded daemon, never a crash.
    let dir = TestDir::new("kube-tls");
    let api = Cloud::start(&[]);
    let daemon = start_daemon_over_https(&dir, &api, "insecure-skip-tls-verify: true", &[]);
    // The plain server never answers a ClientHello: the request deadline ends it.
    wait_for("a TLS failure in the log", Duration::from_secs(30), || {
        daemon.log().contains("API watch failed")
    });
    let config = default_conf(&dir, "1.0.0", INITIAL);
    assert_ok(&Plugin::new("ADD", "local").run(&config));
    assert!(
        api.state().nnc().is_none(),
        "no plain-HTTP request may have succeeded"
    );
}

#[test]
fn shutdown_answers_waiting_requests() {
    let dir = TestDir::new("kube-shutdown");
    let api = Cloud::start(&[]);
    let (daemon, _config, waiter) = daemon_with_a_parked_add(&dir, &api, "60s");
    assert!(daemon.stop().success());
    let output = waiter.join().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let error = common::json(&output);
    assert_eq!(error["code"], 11, "{error}");
    assert!(
        error["details"]
            .as_str()
            .unwrap()
            .contains("daemon stopped while waiting"),
        "{error}"
    );
}

#[test]
fn status_sees_the_cluster_grow_an_exhausted_pool_and_reports_it_unreachable() {
    let dir = TestDir::new("kube-status");
    let mut api = Cloud::start(&[]);
    let _daemon = start_daemon(&dir, &api, "nnc", &[]);
    api.wait_until("the NodeNetworkConfig", Duration::from_secs(10), |s| {
        s.nnc().is_some()
    });
    // The cluster takes the node's demand but grants nothing, so the node
    // stays exhausted: a grant arriving before the stop below (the daemon
    // asks within a monitor pass, 100 ms — sooner than a loaded machine
    // runs the next plugins) would give it room, and STATUS would rightly
    // say ready for ever.
    api.set_controller(false);
    let config = default_conf(&dir, "1.1.0", r#"[[{"subnet":"198.18.0.0/30"}]]"#);
    assert_ok(&Plugin::new("ADD", "holder").run(&config));
    // Full, but the cluster can add blocks: ADD can be served (it waits).
    assert_ok(&Plugin::new("STATUS", "").run(&config));

    api.stop();
    let mut last = None;
    wait_for(
        "STATUS to report the unreachable API server",
        Duration::from_secs(30),
        || {
            let output = Plugin::new("STATUS", "").run(&config);
            let done = output.status.code() == Some(1);
            last = Some(output);
            done
        },
    );
    let error = common::json(last.as_ref().unwrap());
    assert_eq!(error["code"], 50, "{error}");
    assert!(
        error["msg"]
            .as_str()
            .unwrap()
            .contains("API server is unreachable"),
        "{error}"
    );
}

#[test]
fn overlapping_and_oversized_status_entries_are_skipped_one_by_one() {
    let dir = TestDir::new("kube-overlap");
    let api = Cloud::start(&[]);
    api.set_controller(false);
    let daemon = start_daemon(&dir, &api, "nnc", &[]);
    api.wait_until("the NodeNetworkConfig", Duration::from_secs(10), |s| {
        s.nnc().is_some()
    });
    let config = default_conf(&dir, "1.0.0", INITIAL);
    assert_ok(&Plugin::new("ADD", "first").run(&config));
    // Overlapping the CNI range, overlapping each other, larger than a /12
    // (refused before a row is written), and a valid entry after them all.
    api.set_status(serde_json::json!([
        status_entry("over-cni", "198.18.0.0/28"),
        status_entry("wide", "198.19.4.0/27"),
        status_entry("inside-wide", "198.19.4.0/28"),
        status_entry("huge", "198.0.0.0/11"),
        status_entry("last", "198.19.5.0/28"),
    ]));
    wait_for(
        "the entry after the bad ones",
        Duration::from_secs(10),
        || blocks_in_db(&dir).contains(&"198.19.5.0/28".to_string()),
    );
    assert_eq!(
        blocks_in_db(&dir),
        vec!["198.18.0.0/26", "198.19.4.0/27", "198.19.5.0/28"]
    );
    // Refusals are logged once the sync is committed.
    wait_for("the refusals in the log", Duration::from_secs(10), || {
        daemon.log().matches("refusing a podCIDR").count() >= 3
    });
    let log = daemon.log();
    for refused in ["198.18.0.0/28", "198.19.4.0/28", "198.0.0.0/11"] {
        assert!(
            log.contains("refusing a podCIDR") && log.contains(refused),
            "{refused} not reported: {log}"
        );
    }
    // Every usable address once (61 + 29 + 13 = 103, one already taken).
    let mut addresses = add_concurrently(&config, 0..102);
    addresses.sort();
    addresses.dedup();
    assert_eq!(addresses.len(), 102, "an address was handed out twice");
    // The node's address space is still one invariant: the daemon restarts.
    drop(daemon);
    let _daemon = start_daemon(&dir, &api, "nnc", &[]);
    assert_ok(&Plugin::new("CHECK", "pod-7").run(&config));
    assert_eq!(
        blocks_in_db(&dir),
        vec!["198.18.0.0/26", "198.19.4.0/27", "198.19.5.0/28"]
    );
}

#[test]
fn a_late_event_never_resurrects_a_released_block() {
    let dir = TestDir::new("kube-late-event");
    let api = Cloud::start(&[]);
    let daemon = start_daemon(
        &dir,
        &api,
        "nnc",
        &[
            "-v",
            "1",
            "--sustained-low-utilization-duration",
            "200ms",
            "--draining-expiration",
            "200ms",
        ],
    );
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    add_concurrently(&config, 0..20);
    let granted = api.state().status_cidrs();
    assert!(!granted.is_empty(), "scale-up did not happen");
    // The version that lists the blocks as Ready, kept for later.
    let old = api.state().nnc().cloned().unwrap();
    for i in 0..20 {
        assert_ok(&Plugin::new("DEL", &format!("pod-{i}")).run(&config));
    }
    wait_for(
        "released blocks to leave the database",
        Duration::from_secs(30),
        || {
            let blocks = blocks_in_db(&dir);
            granted.iter().all(|cidr| !blocks.contains(cidr))
        },
    );
    api.deliver_late(old);
    wait_for("the late event to be seen", Duration::from_secs(10), || {
        daemon
            .log()
            .contains("ignoring an older NodeNetworkConfig version")
    });
    let blocks = blocks_in_db(&dir);
    for cidr in &granted {
        assert!(!blocks.contains(cidr), "{cidr} came back: {blocks:?}");
    }
}

#[test]
fn a_del_cancels_its_parked_add() {
    let dir = TestDir::new("kube-del-cancels");
    let api = Cloud::start(&[]);
    let (_daemon, config, waiter) = daemon_with_a_parked_add(&dir, &api, "30s");
    assert_ok(&Plugin::new("DEL", "waiter").run(&config));
    let output = waiter.join().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let error = common::json(&output);
    assert_eq!(error["code"], 11, "{error}");
    assert!(
        error["msg"]
            .as_str()
            .unwrap()
            .contains("ADD cancelled: a DEL"),
        "{error}"
    );
    // An address frees up: nothing is allocated to the deleted container.
    assert_ok(&Plugin::new("DEL", "holder").run(&config));
    let held: i64 = db(&dir.join("metis.sqlite"))
        .query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE container_id = 'waiter'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(held, 0);
}

#[test]
fn a_recreated_object_is_not_asked_to_cover_local_leftovers() {
    let dir = TestDir::new("kube-recreated");
    let api = Cloud::start(&[]);
    let daemon = start_daemon(&dir, &api, "nnc", &["-v", "4"]);
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/28"}]]"#);
    add_concurrently(&config, 0..30);
    for i in 0..30 {
        assert_ok(&Plugin::new("DEL", &format!("pod-{i}")).run(&config));
    }
    let handed_out = api.handed_out();
    assert!(handed_out >= 2, "scale-up did not happen");
    // Someone deletes the object; the daemon re-creates it and keeps its
    // blocks, which the new status does not list.
    api.delete_nnc();
    api.wait_until(
        "the re-created object's request",
        Duration::from_secs(30),
        |s| s.pods("default").is_some(),
    );
    // Twenty monitor passes with nothing to change.
    let passes = |log: &str| log.matches("pass complete, nothing to change").count();
    let before = passes(&daemon.log());
    wait_for("twenty idle passes", Duration::from_secs(30), || {
        passes(&daemon.log()) >= before + 20
    });
    let state = api.state();
    assert_eq!(api.handed_out(), handed_out, "the cloud was asked for more");
    assert!(state.status_cidrs().is_empty());
    assert_eq!(
        state.pods("default"),
        Some(0),
        "no pod runs: nothing is needed from the cluster's blocks"
    );
}

/// Once the API server answers `method` again: one succeeds and the
/// daemon's health is no longer degraded.
fn clears_after_a_success(api: &Cloud, daemon: &TestDaemon, method: &str) {
    api.wait_until(&format!("a {method}"), Duration::from_secs(10), |s| {
        s.answered(method, 200) >= 1
    });
    wait_for("health to clear", Duration::from_secs(10), || {
        !health_detail(daemon).contains("degraded")
    });
}

/// Every gap between consecutive `times` is at least `floor`: the pacing
/// the daemon promises (load can only make gaps longer).
fn assert_gaps_at_least(times: &[std::time::Instant], floor: Duration, what: &str) {
    for pair in times.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap >= floor, "{what}: {gap:?} < {floor:?} in {times:?}");
    }
}

#[test]
fn a_failing_watch_backs_off_to_the_cap_without_relisting() {
    let dir = TestDir::new("kube-watch-storm");
    let api = Cloud::start(&[]);
    api.state().faults.push(fail("watch", 500, None));
    let daemon = start_daemon(&dir, &api, "nnc", &["--api-max-backoff", "300ms"]);
    api.wait_until("eight failed watches", Duration::from_secs(30), |s| {
        s.answered("WATCH", 500) >= 8
    });
    let state = api.state();
    // Listed (and created) once, then only watches: one request per
    // failure, each after a pause of at least the cap (500 ms first step,
    // capped at 300 ms).
    let first_watch = state.log.iter().position(|r| r.method == "WATCH").unwrap();
    assert!(
        state.log[first_watch..].iter().all(|r| r.method == "WATCH"),
        "{:?}",
        state.log
    );
    let watches = state.times("WATCH", 500);
    assert_gaps_at_least(&watches, Duration::from_millis(300), "watch retries");
    drop(state);
    let detail = health_detail(&daemon);
    assert!(
        detail.contains("degraded") && detail.contains("watch:"),
        "{detail}"
    );
    assert!(daemon.log().contains("API watch failed, retrying"));
    // Back: a watch opens and health is clean again.
    api.state().faults.clear();
    clears_after_a_success(&api, &daemon, "WATCH");
}

#[test]
fn retry_after_is_honoured() {
    let dir = TestDir::new("kube-retry-after");
    let api = Cloud::start(&[]);
    api.state().faults.push(fail("watch", 429, Some(1)));
    let _daemon = start_daemon(&dir, &api, "nnc", &["--api-max-backoff", "50ms"]);
    api.wait_until("three throttled watches", Duration::from_secs(30), |s| {
        s.answered("WATCH", 429) >= 3
    });
    let watches = api.state().times("WATCH", 429);
    assert_gaps_at_least(&watches, Duration::from_secs(1), "Retry-After: 1");
}

#[test]
fn failed_patches_back_off_and_degrade_health_until_one_succeeds() {
    let dir = TestDir::new("kube-patch-403");
    let api = Cloud::start(&[]);
    api.state().faults.push(fail("patch", 403, None));
    let daemon = start_daemon(&dir, &api, "nnc", &["--api-max-backoff", "300ms"]);
    // A first block makes the monitor ask for its pods.
    let config = default_conf(&dir, "1.0.0", INITIAL);
    assert_ok(&Plugin::new("ADD", "one").run(&config));
    api.wait_until("four refused patches", Duration::from_secs(30), |s| {
        s.answered("PATCH", 403) >= 4
    });
    let patches = api.state().times("PATCH", 403);
    // Monitor passes run every 100 ms; patches only after each pause.
    assert_gaps_at_least(&patches, Duration::from_millis(300), "patch retries");
    let detail = health_detail(&daemon);
    assert!(
        detail.contains("degraded") && detail.contains("patch:"),
        "{detail}"
    );
    assert!(detail.contains("403"), "{detail}");
    api.state().faults.clear();
    clears_after_a_success(&api, &daemon, "PATCH");
}

#[test]
fn a_conflict_storm_is_paced_and_reported() {
    let dir = TestDir::new("kube-409-storm");
    let api = Cloud::start(&[]);
    api.state().faults.push(fail_next("patch", 1_000, 409));
    let daemon = start_daemon(&dir, &api, "nnc", &["--api-max-backoff", "300ms"]);
    // A first block makes the monitor ask for its pods.
    let config = default_conf(&dir, "1.0.0", INITIAL);
    assert_ok(&Plugin::new("ADD", "one").run(&config));
    api.wait_until("six conflicts", Duration::from_secs(30), |s| {
        s.answered("PATCH", 409) >= 6
    });
    let state = api.state();
    let conflicts = state.times("PATCH", 409);
    assert_gaps_at_least(&conflicts, Duration::from_millis(300), "409 retries");
    // Each conflict costs the patch and one re-read of the object.
    let reads = state
        .log
        .iter()
        .filter(|r| r.method == "GET" && r.path.ends_with(NODE) && r.status == 200)
        .count();
    assert!(
        reads <= conflicts.len() + 1,
        "{reads} re-reads for {} conflicts",
        conflicts.len()
    );
    drop(state);
    let detail = health_detail(&daemon);
    assert!(detail.contains("conflicts in a row"), "{detail}");
    assert!(daemon.log().contains("patches keep conflicting"));
}

#[test]
fn an_idle_node_sends_one_request_per_watch() {
    let dir = TestDir::new("kube-idle");
    let api = Cloud::start(&[]);
    let _daemon = start_daemon(&dir, &api, "nnc", &["--api-watch-timeout", "1s"]);
    api.wait_until("the first watch", Duration::from_secs(10), |s| {
        s.answered("WATCH", 200) >= 1
    });
    let first = api.state().log.len() - 1;
    api.wait_until("four more watches", Duration::from_secs(30), |s| {
        s.answered("WATCH", 200) >= 5
    });
    let state = api.state();
    let since: Vec<_> = state.log[first..]
        .iter()
        .map(|r| r.method.as_str())
        .collect();
    // Idle, the only requests are watches, each lasting its timeout: with
    // the default --api-watch-timeout (5m, so 5-10 min) that is at most
    // 0.2 requests per minute.
    assert!(since.iter().all(|m| *m == "WATCH"), "{since:?}");
    let watches = state.times("WATCH", 200);
    assert_gaps_at_least(&watches, Duration::from_secs(1), "idle watches");
    for query in state.log[first..].iter().map(|r| &r.query) {
        assert!(
            query.contains("timeoutSeconds=1&") || query.contains("timeoutSeconds=2&"),
            "{query}"
        );
    }
}

#[test]
fn a_malformed_ca_degrades_like_other_tls_failures() {
    let dir = TestDir::new("kube-bad-ca");
    let api = Cloud::start(&[]);
    // "-----BEGIN" and nothing else: not a certificate bundle.
    let daemon = start_daemon_over_https(
        &dir,
        &api,
        "certificate-authority-data: LS0tLS1CRUdJTg==",
        &["--api-max-backoff", "100ms"],
    );
    let config = default_conf(&dir, "1.0.0", INITIAL);
    assert_ok(&Plugin::new("ADD", "local").run(&config));
    wait_for(
        "the daemon to report itself degraded",
        Duration::from_secs(10),
        || {
            let detail = health_detail(&daemon);
            detail.contains("degraded") && detail.contains("client setup")
        },
    );
    assert!(
        api.state().log.is_empty(),
        "nothing may be sent without a CA"
    );
}

#[test]
fn the_shipped_conflist_grows_in_nnc_mode() {
    let dir = TestDir::new("kube-deploy-conflist");
    // The cloud counts the node's /24 as capacity already there.
    let api = Cloud::start(&[]);
    let _daemon = start_daemon(&dir, &api, "nnc", &[]);
    let shipped = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy/conflists/10-metis-ptp.conflist"),
    )
    .unwrap();
    let conflist: serde_json::Value = serde_json::from_str(&shipped).unwrap();
    // What the runtime hands the ptp plugin (and it the IPAM plugin), with
    // only the paths pointed at this test's daemon.
    let mut plugin = conflist["plugins"][0].clone();
    plugin["cniVersion"] = conflist["cniVersion"].clone();
    plugin["name"] = conflist["name"].clone();
    plugin["ipam"]["daemonSocket"] = dir.join("metis.sock").display().to_string().into();
    plugin["ipam"]["dbPath"] = dir.join("metis.sqlite").display().to_string().into();
    plugin["ipam"]["logFile"] = dir.join("cni.log").display().to_string().into();
    let config = plugin.to_string();
    // 253 usable addresses in the /24, then the cloud's blocks; in batches
    // of 30 so the other tests running alongside keep their CPU.
    let mut addresses = Vec::new();
    for start in (0..270).step_by(30) {
        addresses.extend(add_concurrently(&config, start..start + 30));
    }
    addresses.sort();
    addresses.dedup();
    assert_eq!(addresses.len(), 270, "duplicate addresses");
    assert!(addresses.iter().any(|a| a.starts_with("198.19.")));
    let state = api.state();
    assert!(state.pods("default").unwrap() >= 270, "{:?}", state.nnc());
    assert!(
        state.pods("pods").is_none(),
        "capacity asked for the wrong network"
    );
}

/// The daemon's resident memory in KiB.
fn rss_kib(daemon: &TestDaemon) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.child.id())).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Writes `pod_cidrs` into the status however large, and sends the object
/// to open watches: the store of a cluster whose etcd takes larger requests
/// than its default (which the loopback server enforces on writes).
fn store_oversized_status(api: &Cloud, pod_cidrs: serde_json::Value) {
    api.with_state(|state| {
        let key = common::cloud::nnc_key();
        let mut nnc = state.get(&key).cloned().unwrap();
        nnc["status"]["podCIDRs"] = pod_cidrs;
        nnc["metadata"]["resourceVersion"] = state.rv(state.version + 1).into();
        state.objects.insert(key.clone(), nnc.clone());
        state.inject_event(key, "MODIFIED", nnc);
    });
}

#[test]
fn an_oversized_object_is_refused_and_a_long_list_is_capped() {
    let dir = TestDir::new("kube-huge");
    let api = Cloud::start(&[]);
    api.set_controller(false);
    // Passes 10 times a second (`FAST`) over 257 blocks would keep a debug
    // build's loop busy back to back, and on a loaded machine one pass
    // outlasts the health call's 5 s reply timeout; this test needs no
    // pass, only the watch.
    let daemon = start_daemon(
        &dir,
        &api,
        "nnc",
        &["--api-max-backoff", "100ms", "--monitor-interval", "10s"],
    );
    api.wait_until("a watch", Duration::from_secs(10), |s| {
        s.answered("WATCH", 200) >= 1
    });
    let config = default_conf(&dir, "1.0.0", INITIAL);
    assert_ok(&Plugin::new("ADD", "first").run(&config));
    // 300 small entries: the first 256 are read, the rest reported.
    let entries = |count: u32| {
        (0..count)
            .map(|i| {
                status_entry(
                    &format!("e{i}"),
                    &format!("198.19.{}.{}/32", i / 256, i % 256),
                )
            })
            .collect::<Vec<_>>()
    };
    api.set_status(serde_json::Value::Array(entries(300)));
    wait_for("the capped list", Duration::from_secs(60), || {
        blocks_in_db(&dir).len() == 1 + 256
    });
    assert!(daemon.log().contains("lists more entries than Metis reads"));
    // An object over the 2 MiB cap (the issue's 50,000 entries were 5 MB;
    // here 300 entries padded to 8 KB each, cheap to build in a debug
    // test): refused whole, the daemon degrades and keeps serving, and its
    // memory stays far below the DaemonSet's 256Mi.
    let padding = "x".repeat(8 * 1024);
    let padded: Vec<serde_json::Value> = entries(300)
        .into_iter()
        .map(|mut entry| {
            entry["padding"] = padding.clone().into();
            entry
        })
        .collect();
    store_oversized_status(&api, serde_json::Value::Array(padded));
    wait_for("the refusal", Duration::from_secs(60), || {
        let detail = health_detail(&daemon);
        detail.contains("degraded") && detail.contains("watch: ")
    });
    assert_ok(&Plugin::new("ADD", "second").run(&config));
    assert!(daemon.log().contains("API watch failed"));
    let rss = rss_kib(&daemon);
    assert!(rss < 64 * 1024, "daemon RSS {rss} KiB");
}

#[test]
fn a_waiter_gets_a_cooling_address_when_it_comes_free() {
    let dir = TestDir::new("kube-cooling");
    let api = Cloud::start(&[]);
    // No new blocks ever: only the cooling address can serve the waiter.
    api.set_controller(false);
    let kubeconfig = dir.join("kubeconfig");
    api.kubeconfig(&kubeconfig);
    let kubeconfig = kubeconfig.display().to_string();
    let daemon = TestDaemon::start_with_env(
        &dir,
        &[
            "-v",
            "1",
            "--cidr-source",
            "nnc",
            "--monitor-interval",
            "100ms",
            "--release-cooldown",
            "1s",
            "--scale-up-wait",
            "30s",
        ],
        &[("KUBECONFIG", &kubeconfig), ("NODE_NAME", NODE)],
    );
    let config = default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/30"}]]"#);
    assert_ok(&Plugin::new("ADD", "holder").run(&config));
    api.wait_until("the first request", Duration::from_secs(10), |s| {
        s.pods("default").is_some()
    });
    let requested = api.state().pods("default");
    let patches = api.state().answered("PATCH", 200);
    assert_ok(&Plugin::new("DEL", "holder").run(&config));
    // The only address cools for a second; the waiter parks meanwhile and
    // is served when it comes free.
    let output = Plugin::new("ADD", "waiter").run(&config);
    assert_ok(&output);
    assert!(
        daemon
            .log()
            .contains("waiters retry when a cooling address comes free"),
        "{}",
        daemon.log()
    );
    assert_eq!(common::json(&output)["ips"][0]["address"], "198.18.0.2/30");
    // The cooling address was enough: nothing more was asked for.
    let state = api.state();
    assert_eq!(state.pods("default"), requested);
    assert_eq!(state.answered("PATCH", 200), patches);
}
