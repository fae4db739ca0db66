//! Issue 21 through the real binary, in daemon and in direct mode: a
//! configuration change that would give one address two owners is refused
//! and changes nothing, and STATUS fails whenever ADD must.

use crate::common;

use common::Plugin;
use common::node::{NetConf, Node, Outcome, Request, held_twice};
use common::upstream::Upstream;

/// The code of a STATUS that must fail, after checking its message names
/// `what`.
fn status_fails(node: &Node, conf: &NetConf, what: &str) -> u64 {
    match node.status(conf) {
        Err((code, msg)) if msg.contains(what) => code,
        other => panic!("STATUS should fail naming {what:?}: {other:?}"),
    }
}

/// A node (its daemon started when `daemon`) and three configurations over
/// one /28: network Y, network X isolated, and X without `isolated`.
fn over_one_block(name: &str, daemon: bool) -> (Node, [NetConf; 3]) {
    let node = Node::served(name, "1m", daemon);
    let y = NetConf::new("net-y", &["198.18.70.0/28"]);
    let x = NetConf {
        isolated: true,
        ..NetConf::new("net-x", &["198.18.70.0/28"])
    };
    let plain_x = NetConf {
        isolated: false,
        ..x.clone()
    };
    (node, [y, x, plain_x])
}

/// Network Y holds a /28; an isolated network X reuses it; X's conflist
/// then drops `isolated`: X's ADD is refused with code 7 naming Y and the
/// way out, X stays isolated, and Y never gets an address X holds.
#[test]
fn isolation_turned_off_over_a_live_overlap_is_refused() {
    for daemon in [true, false] {
        let (mut node, [y, x, plain_x]) = over_one_block("writers-isolation", daemon);
        assert!(matches!(node.add(&y, "y1", Request::None), Outcome::Ok(_)));
        assert!(matches!(node.add(&x, "x1", Request::None), Outcome::Ok(_)));
        let before = node.holdings();
        match node.add(&plain_x, "x2", Request::None) {
            Outcome::Error { code: 7, msg } => {
                assert!(msg.contains("net-y") && msg.contains("isolated"), "{msg}");
            }
            other => panic!("daemon {daemon}: expected code 7, got {other:?}"),
        }
        assert_eq!(
            node.holdings(),
            before,
            "daemon {daemon}: the refusal changed rows"
        );
        // Y goes on serving addresses only Y holds; X keeps its own space.
        for pod in ["y2", "y3"] {
            assert!(matches!(node.add(&y, pod, Request::None), Outcome::Ok(_)));
        }
        assert!(matches!(node.add(&x, "x3", Request::None), Outcome::Ok(_)));
        let twice = held_twice(&node.holdings(), |h| h.network != "net-x");
        assert!(twice.is_empty(), "daemon {daemon}: {twice:#?}");
        // A restart finds nothing to quarantine: isolation was never lost.
        if daemon {
            node.stop();
            node.start(&[]);
        }
        assert!(matches!(node.add(&y, "y4", Request::None), Outcome::Ok(_)));
        assert!(
            !node.log().contains("block quarantined"),
            "daemon {daemon}: {}",
            node.log()
        );
    }
}

/// STATUS exits 50 whenever an ADD of that configuration cannot succeed:
/// a range over another network's block (ADD: code 7 every time), turning
/// isolation off over it, bounds that leave no address; and it says ready
/// again once the ADD could.
#[test]
fn status_fails_whenever_add_must() {
    for daemon in [true, false] {
        let (node, [y, x, plain_x]) = over_one_block("writers-status", daemon);
        assert!(matches!(node.add(&y, "y1", Request::None), Outcome::Ok(_)));
        assert_eq!(node.status(&y), Ok(()));
        // X over Y's block, not isolated: ADD is refused, and STATUS too.
        assert_eq!(
            status_fails(&node, &plain_x, "net-y"),
            50,
            "daemon {daemon}"
        );
        assert_eq!(node.add(&plain_x, "x1", Request::None).code(), Some(7));
        // Isolated it may; turning isolation off is refused again.
        assert_eq!(node.status(&x), Ok(()));
        assert!(matches!(node.add(&x, "x1", Request::None), Outcome::Ok(_)));
        assert_eq!(status_fails(&node, &plain_x, "isolated"), 50);
        assert_eq!(node.add(&plain_x, "x2", Request::None).code(), Some(7));
        // Bounds whose one address is the gateway.
        let z = NetConf {
            bounds: Some(("198.18.72.1", "198.18.72.1")),
            ..NetConf::new("net-z", &["198.18.72.0/29"])
        };
        assert_eq!(status_fails(&node, &z, "leaves no address"), 50);
        assert!(node.add(&z, "z1", Request::None).code().is_some());
        assert_eq!(status_fails(&node, &z, "leaves no address"), 50);
        let roomy = NetConf {
            bounds: Some(("198.18.72.2", "198.18.72.6")),
            ..z.clone()
        };
        assert_eq!(node.status(&roomy), Ok(()));
        assert!(matches!(
            node.add(&roomy, "z1", Request::None),
            Outcome::Ok(_)
        ));
    }
}

/// Two conflists of one network on one /29: "pods-b" names gateway .5,
/// "pods-a" the computed .1 and hands .5 out as an ordinary address. Once
/// the network's last free address is .5, which a live result of
/// "pods-b" names as its gateway, "pods-a"'s ADD is refused with code 11
/// naming it, and its STATUS fails naming it too (it said ready before),
/// in daemon and in direct mode; after that pod's DEL both succeed.
#[test]
fn status_fails_when_the_last_free_address_is_a_live_results_gateway() {
    for daemon in [true, false] {
        let mut node = Node::served("writers-named-gateway", "0s", daemon);
        let a = NetConf {
            network: Some("pods"),
            ..NetConf::new("pods-a", &["198.18.79.0/29"])
        };
        let b = NetConf {
            bounds: Some(("198.18.79.2", "198.18.79.6")),
            gateway: Some("198.18.79.5"),
            ..NetConf::new("pods-b", &["198.18.79.0/29"])
        };
        let b = NetConf {
            network: Some("pods"),
            ..b
        };
        for (conf, pod) in [(&a, "a1"), (&b, "b1"), (&a, "a2"), (&a, "a3")] {
            match node.add(conf, pod, Request::None) {
                Outcome::Ok(_) => {}
                other => panic!("daemon {daemon}: ADD {pod}: {other:?}"),
            }
        }
        let named = "gateway of the result container";
        match node.add(&a, "a4", Request::None) {
            Outcome::Error { code: 11, msg } => {
                assert!(msg.contains(named) && msg.contains("198.18.79.5"), "{msg}")
            }
            other => panic!("daemon {daemon}: expected code 11, got {other:?}"),
        }
        assert_eq!(status_fails(&node, &a, named), 50, "daemon {daemon}");
        assert!(matches!(node.del(&b, "b1"), Outcome::Ok(_)));
        assert_eq!(node.status(&a), Ok(()), "daemon {daemon}");
        assert!(matches!(node.add(&a, "a4", Request::None), Outcome::Ok(_)));
        if daemon {
            node.stop();
        }
    }
}

/// Every block of a network quarantined (an upstream database with a /29
/// held in two networks): ADD answers code 11 naming the quarantine, and
/// STATUS fails naming it, under the daemon and in direct mode after it.
#[test]
fn a_quarantined_network_says_so_in_add_and_status() {
    let mut node = Node::new("writers-quarantine", "1m");
    let upstream = Upstream::create(&node.db_path());
    let a = upstream.block("198.18.74.0/29", "default", true);
    upstream.hold(a, "198.18.74.2", "pod-a", "eth0");
    let b = upstream.block("198.18.74.0/29", "other", true);
    upstream.hold(b, "198.18.74.3", "pod-b", "eth0");
    drop(upstream);
    let conf = NetConf {
        network: Some("default"),
        ..NetConf::new("k8s-pod-network", &["198.18.74.0/29"])
    };
    node.start(&[]);
    for daemon in [true, false] {
        match node.add(&conf, "pod-c", Request::None) {
            Outcome::Error { code: 11, msg } => {
                assert!(
                    msg.contains("quarantined") && msg.contains("198.18.74.0/29"),
                    "{msg}"
                );
            }
            other => panic!("daemon {daemon}: expected code 11, got {other:?}"),
        }
        assert_eq!(
            status_fails(&node, &conf, "quarantined"),
            50,
            "daemon {daemon}"
        );
        node.stop();
    }
    assert_eq!(
        node.held_by("default", "pod-a"),
        ["198.18.74.2".parse::<std::net::IpAddr>().unwrap()]
    );
}

/// `ipam.network` renamed under a pod: DEL under the new name releases
/// the old network's allocation for that container and interface (and
/// logs it), in daemon and in direct mode; other pods keep theirs.
#[test]
fn del_under_a_renamed_network_strands_nothing() {
    for daemon in [true, false] {
        let node = Node::served("writers-rename", "1m", daemon);
        let before = NetConf::new("pods-a", &["198.18.76.0/29"]);
        let after = NetConf::new("pods-b", &["198.18.77.0/29"]);
        assert!(matches!(
            node.add(&before, "pod-1", Request::None),
            Outcome::Ok(_)
        ));
        assert!(matches!(
            node.add(&before, "pod-2", Request::None),
            Outcome::Ok(_)
        ));
        assert!(matches!(
            node.add(&after, "pod-3", Request::None),
            Outcome::Ok(_)
        ));
        let kept = node.held_by("pods-a", "pod-2");
        assert_eq!(node.del(&after, "pod-1"), Outcome::Ok(Vec::new()));
        assert!(
            node.held_by("pods-a", "pod-1").is_empty(),
            "daemon {daemon}: stranded"
        );
        assert_eq!(node.held_by("pods-a", "pod-2"), kept);
        assert_eq!(node.held_by("pods-b", "pod-3").len(), 1);
        let log = match daemon {
            true => node.log(),
            false => std::fs::read_to_string(node.dir.join("cni.log")).unwrap_or_default(),
        };
        assert!(
            log.contains("another network held"),
            "daemon {daemon}: {log}"
        );
        assert!(log.contains("pods-a"), "{log}");
    }
}

/// `metis admin check --db-path` vets a node before the upgrade: on a
/// database only upstream has written it reports, exits 0, and writes
/// nothing (the file's bytes and mtime, and no file beside it).
#[test]
fn admin_check_vets_an_upstream_only_database_without_writing() {
    let dir = common::TestDir::new("writers-vet");
    let path = dir.join("metis.sqlite");
    let upstream = Upstream::create(&path);
    let id = upstream.block("198.18.78.0/28", "default", true);
    upstream.hold(id, "198.18.78.2", "old-pod", "eth0");
    drop(upstream);
    let bytes = std::fs::read(&path).unwrap();
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let beside = |dir: &common::TestDir| {
        let mut names: Vec<_> = std::fs::read_dir(dir.join(""))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let files = beside(&dir);
    let output = common::admin_check(&path);
    assert!(output.status.success(), "{output:?}");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(report.contains("ok") || report.contains("OK"), "{report}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "the file was written");
    assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), mtime);
    assert_eq!(beside(&dir), files, "a file was created beside it");
}

/// CNI GC (1.1.0) of conflist `conf` listing `live` (on `eth0`) as its
/// valid attachments, with no grace period.
fn gc(node: &Node, conf: &NetConf, live: &[&str]) -> std::process::Output {
    let mut config: serde_json::Value =
        serde_json::from_str(&conf.render(&node.dir, &[], None)).unwrap();
    config["cniVersion"] = "1.1.0".into();
    config["ipam"]["gcGracePeriod"] = "0s".into();
    config["cni.dev/valid-attachments"] = live
        .iter()
        .map(|pod| serde_json::json!({"containerID": pod, "ifname": "eth0"}))
        .collect();
    Plugin::new("GC", "").run(&config.to_string())
}

/// `ipam.network` renamed under conflist "pods" (from "pods-a" to
/// "pods-b"): its GC releases what the old network holds for an attachment
/// it does not list (a pod whose DEL never came), keeps what it lists in
/// either network, and leaves alone a network another conflist served
/// last; in daemon and in direct mode, and logs the release.
#[test]
fn gc_under_a_renamed_network_strands_nothing() {
    for daemon in [true, false] {
        let node = Node::served("writers-gc-rename", "1m", daemon);
        let before = NetConf {
            network: Some("pods-a"),
            ..NetConf::new("pods", &["198.18.80.0/29"])
        };
        let after = NetConf {
            network: Some("pods-b"),
            ..NetConf::new("pods", &["198.18.81.0/29"])
        };
        let elsewhere = NetConf::new("other", &["198.18.82.0/29"]);
        for (conf, pod) in [
            (&before, "stranded"),
            (&before, "live"),
            (&after, "new"),
            (&elsewhere, "theirs"),
        ] {
            let added = node.add(conf, pod, Request::None);
            assert!(matches!(added, Outcome::Ok(_)), "{pod}: {added:?}");
        }
        let output = gc(&node, &after, &["live", "new"]);
        assert!(output.status.success(), "daemon {daemon}: {output:?}");
        assert!(output.stdout.is_empty(), "{output:?}");
        assert!(
            node.held_by("pods-a", "stranded").is_empty(),
            "daemon {daemon}: stranded"
        );
        assert_eq!(node.held_by("pods-a", "live").len(), 1);
        assert_eq!(node.held_by("pods-b", "new").len(), 1);
        assert_eq!(node.held_by("other", "theirs").len(), 1);
        let log = match daemon {
            true => node.log(),
            false => std::fs::read_to_string(node.dir.join("cni.log")).unwrap_or_default(),
        };
        assert!(
            log.contains("served last by this conflist") && log.contains("pods-a"),
            "daemon {daemon}: {log}"
        );
        // The other conflist's GC, listing nothing, takes only its own.
        assert!(gc(&node, &elsewhere, &[]).status.success());
        assert!(node.held_by("other", "theirs").is_empty());
        assert_eq!(node.held_by("pods-a", "live").len(), 1);
        assert_eq!(node.held_by("pods-b", "new").len(), 1);
    }
}
