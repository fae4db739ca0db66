//! Rolling back to upstream Metis through the real binary: `metis admin
//! downgrade` refuses beside a daemon and on files it cannot vouch for,
//! then readies the file so that upstream's allocation finds every usable
//! address of the conflist's ranges and nothing else; a daemon started on
//! a file upstream wrote after Metis heals it and says so (log, metric,
//! `admin check`), and never names a pod's address as a result's gateway.

use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;

use crate::common;

use common::node::{NetConf, Node, Outcome, Request, held_twice};
use common::scrape::{http_get, metrics_addr, series};
use common::upstream::{Upstream, allocate_like_upstream};
use common::{TestDaemon, TestDir, metis, out_err};

fn downgrade(db: &std::path::Path) -> (i32, String, String) {
    let output = metis(&["admin", "downgrade", "--db-path", db.to_str().unwrap()]);
    let (out, err) = out_err(&output);
    (output.status.code().unwrap(), out, err)
}

/// Writes a file a case starts from.
type Make = dyn Fn(&std::path::Path);

fn bytes(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn downgrade_refuses_beside_a_daemon_then_readies_the_file_for_upstream() {
    let mut node = Node::new("rollback-downgrade", "1m");
    let conf = NetConf {
        bounds: Some(("198.18.40.10", "198.18.40.100")),
        ..NetConf::new("rb", &["198.18.40.0/24"])
    };
    node.start(&[]);
    let mut ours: Vec<IpAddr> = Vec::new();
    for pod in 0..5 {
        let outcome = node.add(&conf, &format!("p{pod}"), Request::None);
        assert!(matches!(outcome, Outcome::Ok(_)), "{outcome:?}");
        ours.extend(outcome.addresses());
    }
    let db = node.db_path();
    let before = node.holdings();
    let (code, _, err) = downgrade(&db);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("a daemon holds this database"), "{err}");
    assert!(err.contains("nothing was changed"), "{err}");
    assert_eq!(node.holdings(), before);
    node.stop();

    let (code, out, err) = downgrade(&db);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("wrote") && out.contains("ready for upstream Metis"),
        "{out}"
    );
    let (code, out, _) = downgrade(&db);
    assert_eq!(code, 0);
    assert!(
        out.contains("already ready for upstream Metis; nothing to do"),
        "{out}"
    );
    let check = node.admin_check();
    assert!(check.status.success(), "{:?}", out_err(&check));

    // Upstream's allocation from here on: the rest of rangeStart..rangeEnd,
    // nothing outside it, nothing a pod holds.
    let mut theirs: Vec<IpAddr> = Vec::new();
    while let Some(a) = allocate_like_upstream(&db, "rb", "ipv4", &format!("u{}", theirs.len())) {
        theirs.push(a.parse().unwrap());
    }
    assert_eq!(theirs.len(), 91 - ours.len(), "{theirs:?}");
    assert!(theirs.iter().all(|a| conf.in_bounds(*a)), "{theirs:?}");
    assert!(theirs.iter().all(|a| !ours.contains(a)));
    assert!(held_twice(&node.holdings(), |_| true).is_empty());
}

#[test]
fn downgrade_refuses_what_it_cannot_vouch_for_and_changes_nothing() {
    let dir = TestDir::new("rollback-bad-input");
    // Missing: nothing is created, not even the lock.
    let missing = dir.join("none.sqlite");
    let (code, _, err) = downgrade(&missing);
    assert_eq!(code, 1);
    assert!(err.contains("no database at this path"), "{err}");
    assert!(!missing.exists() && !dir.join("none.sqlite.lock").exists());

    let cases: [(&str, &Make, &str); 4] = [
        (
            "garbage.sqlite",
            &|p| std::fs::write(p, b"this is not a database, not even close.....").unwrap(),
            "not an SQLite database",
        ),
        (
            "newer.sqlite",
            &|p| {
                let conn = rusqlite::Connection::open(p).unwrap();
                conn.execute_batch("CREATE TABLE t (x); PRAGMA user_version = 2;")
                    .unwrap();
            },
            "schema version 2 is newer than this release understands",
        ),
        (
            "empty.sqlite",
            &|p| {
                rusqlite::Connection::open(p)
                    .unwrap()
                    .execute_batch("CREATE TABLE t (x)")
                    .unwrap();
            },
            "not a Metis or upstream Metis database",
        ),
        (
            "readonly.sqlite",
            &|p| {
                let upstream = Upstream::create(p);
                upstream.block("198.18.41.0/28", "default", true);
                drop(upstream);
                rusqlite::Connection::open(p)
                    .unwrap()
                    .execute_batch(
                        "CREATE TABLE metis_settings (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
                    )
                    .unwrap();
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o400)).unwrap();
            },
            "the file is read-only",
        ),
    ];
    for (name, make, says) in cases {
        let path = dir.join(name);
        make(&path);
        let (before, mode) = (
            bytes(&path),
            std::fs::metadata(&path).unwrap().permissions().mode(),
        );
        let (code, _, err) = downgrade(&path);
        assert_eq!(code, 1, "{name}: {err}");
        assert!(err.contains(says), "{name}: {err}");
        assert_eq!(bytes(&path), before, "{name} changed");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode(), mode);
        assert!(!dir.join(&format!("{name}.lock")).exists(), "{name}");
    }

    // Only upstream wrote it: already upstream's; nothing is changed.
    let path = dir.join("upstream.sqlite");
    Upstream::create(&path).block("198.18.42.0/28", "default", true);
    let before = bytes(&path);
    let (code, out, err) = downgrade(&path);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("only upstream has written this database; nothing to do"),
        "{out}"
    );
    assert_eq!(bytes(&path), before);

    let bad = metis(&["admin", "downgrade", "--no-such-flag"]);
    assert_eq!(bad.status.code(), Some(2), "{:?}", out_err(&bad));
}

/// An ADD through the real plugin: the addresses and the gateways its
/// result names, or the failure.
fn add_with_gateways(
    node: &Node,
    conf: &NetConf,
    container: &str,
) -> Result<(Vec<IpAddr>, Vec<IpAddr>), Outcome> {
    let output = common::Plugin::new("ADD", container).run(&conf.render(&node.dir, &[], None));
    match Outcome::of(&output) {
        ok @ Outcome::Ok(_) => Ok((ok.addresses(), common::node::gateways(&output))),
        other => Err(other),
    }
}

/// A node upgraded from upstream: a pod holds the second block's gateway.
/// The daemon says so at start, counts it, `admin check` names it, and the
/// block is served: its results name a stand-in — its highest address no
/// pod holds, .14 — never pod-x's address, and no pod is given the
/// stand-in; pod-x's own repeated ADD returns its address, naming it too,
/// as does pod-y's, on the block's network address. Once pod-x is deleted,
/// results name .9 again.
#[test]
fn a_gateway_held_by_a_pod_is_reported_and_never_advertised() {
    let node = Node::new("rollback-gateway", "0s");
    let upstream = Upstream::create(&node.db_path());
    upstream.block("198.18.43.0/29", "default", true);
    let second = upstream.block("198.18.43.8/29", "default", false);
    upstream.hold(second, "198.18.43.9", "pod-x", "eth0");
    upstream.hold(second, "198.18.43.8", "pod-y", "eth0");
    drop(upstream);
    let check = node.admin_check();
    let (out, _) = out_err(&check);
    // Named as a note (no invariant is broken); the check fails for the
    // reservations upstream left, which the first open repairs.
    assert!(!check.status.success());
    assert!(
        out.contains("note: block 198.18.43.8/29 (network \"default\"): its gateway 198.18.43.9 is held by container \"pod-x\""),
        "{out}"
    );
    let daemon = started_saying(&node.dir, "its gateway 198.18.43.9 is held by container");
    let (_, body) = http_get(&metrics_addr(&daemon), "/metrics");
    assert_eq!(
        series(&body, "metis_local_store_gateway_held_block_total"),
        1.0
    );
    let conf = NetConf {
        network: Some("default"),
        ..NetConf::new("k8s-pod-network", &["198.18.43.0/29", "198.18.43.8/29"])
    };
    let ip = |last: u8| -> IpAddr { format!("198.18.43.{last}").parse().unwrap() };
    let mut got = Vec::new();
    let refused = loop {
        match add_with_gateways(&node, &conf, &format!("c{}", got.len())) {
            Ok((addresses, gateways)) => got.push((addresses[0], gateways[0])),
            Err(other) => break other,
        }
    };
    let want: Vec<(IpAddr, IpAddr)> = (2..7)
        .map(|i| (ip(i), ip(1)))
        .chain((10..14).map(|i| (ip(i), ip(14))))
        .collect();
    assert_eq!(got, want);
    assert_eq!(refused.code(), Some(11), "{refused:?}");
    // pod-x's repeated ADD: its own address, the stand-in as gateway; the
    // same for pod-y, on the block's network address.
    assert_eq!(
        add_with_gateways(&node, &conf, "pod-x").unwrap(),
        (vec![ip(9)], vec![ip(14)])
    );
    assert_eq!(
        add_with_gateways(&node, &conf, "pod-y").unwrap(),
        (vec![ip(8)], vec![ip(14)])
    );
    // pod-x's DEL gives the gateway back to the reservation: results name
    // it again.
    assert!(matches!(node.del(&conf, "pod-x"), Outcome::Ok(_)));
    assert!(matches!(node.del(&conf, "c5"), Outcome::Ok(_)));
    assert_eq!(
        add_with_gateways(&node, &conf, "after").unwrap(),
        (vec![ip(10)], vec![ip(9)])
    );
    drop(daemon);
}

/// A dual-stack node upgraded from upstream with two pods, as upstream
/// allocated them: no reservation in the IPv6 block, so the second pod
/// holds `::1`, the gateway Metis advertises. Both pods' repeated ADDs
/// return exactly what they hold, new dual-stack ADDs are served, and no
/// result names a pod's address as its gateway.
#[test]
fn an_upstream_dual_stack_node_keeps_serving_its_pods_and_new_ones() {
    let node = Node::new("rollback-dual", "0s");
    let mut upstream = Upstream::create(&node.db_path());
    upstream.add_cidr("default", "198.18.45.0/28").unwrap();
    upstream.add_cidr("default", "2001:db8:45::/120").unwrap();
    let now_ms = 1_700_000_000_000;
    for pod in ["up-a", "up-b"] {
        for v6 in [false, true] {
            upstream
                .allocate("default", v6, pod, "eth0", now_ms)
                .unwrap();
        }
    }
    drop(upstream);
    let held_by = |pod: &str| -> Vec<IpAddr> {
        let mut held = node.held_by("default", pod);
        held.sort();
        held
    };
    let ip = |text: &str| -> IpAddr { text.parse().unwrap() };
    assert_eq!(held_by("up-b"), [ip("198.18.45.3"), ip("2001:db8:45::1")]);
    let _daemon = started_saying(&node.dir, "its gateway 2001:db8:45::1 is held by container");
    let conf = NetConf {
        network: Some("default"),
        ..NetConf::new("k8s-pod-network", &["198.18.45.0/28", "2001:db8:45::/120"])
    };
    let mut pods: Vec<(String, Vec<IpAddr>)> = Vec::new();
    for pod in ["up-a", "up-b"] {
        let (addresses, gateways) = add_with_gateways(&node, &conf, pod).unwrap();
        let mut sorted = addresses.clone();
        sorted.sort();
        assert_eq!(sorted, held_by(pod), "{pod}'s repeated ADD");
        pods.push((pod.to_string(), gateways));
    }
    for n in 0..4 {
        let pod = format!("new{n}");
        let (addresses, gateways) = add_with_gateways(&node, &conf, &pod).unwrap();
        assert_eq!(addresses.len(), 2, "{pod}: {addresses:?}");
        pods.push((pod, gateways));
    }
    // No result names an address a pod holds.
    let holdings = node.holdings();
    for (pod, gateways) in &pods {
        for gateway in gateways {
            assert!(
                !holdings.iter().any(|h| h.address == *gateway),
                "{pod}'s result names {gateway}, a pod's address: {holdings:?}"
            );
        }
    }
    assert!(held_twice(&holdings, |_| true).is_empty(), "{holdings:?}");
}

/// The pre-upgrade vet through the real binary: on a file only upstream
/// wrote, whose two networks overlap with a pod in each (upstream's
/// `AddCIDR` checks nothing) and whose first pods got the same address,
/// `metis admin check` fails naming the address, both networks and what the
/// start will do, and the first start quarantines exactly those blocks.
#[test]
fn the_pre_upgrade_check_names_the_overlap_the_start_quarantines() {
    let node = Node::new("upgrade-vet", "0s");
    let mut upstream = Upstream::create(&node.db_path());
    upstream.add_cidr("default", "198.18.47.0/28").unwrap();
    upstream.add_cidr("other", "198.18.47.0/28").unwrap();
    let now_ms = 1_700_000_000_000;
    upstream
        .allocate("default", false, "pod-a", "eth0", now_ms)
        .unwrap();
    upstream
        .allocate("other", false, "pod-b", "eth0", now_ms)
        .unwrap();
    drop(upstream);
    let check = node.admin_check();
    let (out, _) = out_err(&check);
    assert!(!check.status.success(), "{out}");
    // Upstream gave each network's first pod .2: one address, two owners.
    let line = "network \"default\", \"other\": address 198.18.47.2 is allocated 2 times; \
                the daemon quarantines the block(s) at start";
    assert!(out.contains(line), "{out}");
    let daemon = started_saying(&node.dir, "block quarantined");
    let quarantined = daemon
        .log()
        .lines()
        .filter(|l| l.contains("block quarantined") && l.contains("cidr=198.18.47.0/28"))
        .count();
    assert_eq!(quarantined, 2, "{}", daemon.log());
}

/// Addresses requested with `IP=` in an IPv6 block without bounds, the last
/// one the block's highest row id but not its highest address: `admin
/// downgrade` writes the rows below the highest address and gives that one
/// the highest id, so upstream's expansion (after the highest-id row, 64
/// rows, no bounds check) never meets an existing row — every one of 150
/// upstream allocations succeeds, and no address is held twice.
#[test]
fn downgrade_lets_upstreams_expansion_pass_requested_ipv6_addresses() {
    let mut node = Node::new("rollback-requested", "0s");
    let conf = NetConf::new("req", &["198.18.48.0/24", "2001:db8:48::/120"]);
    node.start(&[]);
    for (n, wanted) in ["2001:db8:48::50", "2001:db8:48::c8", "2001:db8:48::41"]
        .iter()
        .enumerate()
    {
        let ip: IpAddr = wanted.parse().unwrap();
        let outcome = node.add(&conf, &format!("r{n}"), Request::CniArgs(ip));
        assert!(outcome.addresses().contains(&ip), "{outcome:?}");
    }
    node.stop();
    let (code, out, err) = downgrade(&node.db_path());
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("2001:db8:48::c8 (its highest address)"),
        "{out}"
    );
    let mut handed = Vec::new();
    for n in 0..150 {
        match allocate_like_upstream(&node.db_path(), "req", "ipv6", &format!("u{n}")) {
            Some(address) => handed.push(address),
            None => panic!("upstream's allocation {n} failed after {handed:?}"),
        }
    }
    let holdings = node.holdings();
    assert!(held_twice(&holdings, |_| true).is_empty(), "{holdings:?}");
}

/// Two conflists of one network and subnet with different gateways (.9,
/// .10): each names as its results' gateway an address the other hands
/// out. `admin check` names the rollback's hazard, `admin downgrade`
/// reserves the gateway Metis kept out by its record alone (and says so,
/// never "nothing to do"), and upstream's allocation then hands out every
/// other address of the subnet, never a gateway a live result names.
#[test]
fn downgrade_reserves_the_gateways_live_results_name() {
    let mut node = Node::new("rollback-named", "0s");
    let gateway = |name, gateway| NetConf {
        network: Some("shared"),
        gateway: Some(gateway),
        ..NetConf::new(name, &["198.18.44.0/28"])
    };
    let (nine, ten) = (
        gateway("nine", "198.18.44.9"),
        gateway("ten", "198.18.44.10"),
    );
    node.start(&[]);
    for (conf, pod) in [(&nine, "a"), (&ten, "b"), (&nine, "c"), (&ten, "d")] {
        let outcome = node.add(conf, pod, Request::None);
        assert!(matches!(outcome, Outcome::Ok(_)), "{outcome:?}");
    }
    node.stop();
    let check = node.admin_check();
    let (out, err) = out_err(&check);
    assert!(check.status.success(), "{out}{err}");
    assert!(out.contains("before a rollback: 198.18.44."), "{out}");
    let db = node.db_path();
    let (code, out, err) = downgrade(&db);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("live result(s) name: reserved, so that upstream never hands it out"),
        "{out}"
    );
    assert!(!out.contains("nothing to do"), "{out}");
    let check = node.admin_check();
    let (out, err) = out_err(&check);
    assert!(check.status.success(), "{out}{err}");
    assert!(out.contains("reserved by `metis admin downgrade`"), "{out}");
    let mut handed = Vec::new();
    while let Some(address) =
        allocate_like_upstream(&db, "shared", "ipv4", &format!("u{}", handed.len()))
    {
        handed.push(address);
    }
    // 16 less the network, broadcast, both gateways and the 4 pods.
    assert_eq!(handed.len(), 8, "{handed:?}");
    assert!(
        !handed
            .iter()
            .any(|a| a == "198.18.44.9" || a == "198.18.44.10"),
        "{handed:?}"
    );
    let holdings = node.holdings();
    assert!(held_twice(&holdings, |_| true).is_empty(), "{holdings:?}");
}

/// A retired block upstream's undrain made Ready again (a file from before
/// Metis withheld retired blocks): the daemon's start retires it again,
/// logs and counts it; the pod upstream left there keeps its address.
#[test]
fn a_start_after_upstream_withholds_a_revived_block_again() {
    let mut node = Node::new("rollback-revived", "0s");
    let old = NetConf::new("rv", &["198.18.44.0/28"]);
    let new = NetConf::new("rv", &["198.18.45.0/28"]);
    node.start(&[]);
    assert!(matches!(
        node.add(&old, "kept", Request::None),
        Outcome::Ok(_)
    ));
    assert!(matches!(
        node.add(&new, "n1", Request::None),
        Outcome::Ok(_)
    ));
    node.stop();
    let db = node.db_path();
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute(
            "UPDATE cidr_blocks SET state = 'Ready' WHERE cidr = '198.18.44.0/28'",
            [],
        )
        .unwrap();
    let up = allocate_like_upstream(&db, "rv", "ipv4", "up-pod").unwrap();
    assert!(up.starts_with("198.18.44."), "{up}");
    let daemon = started_saying(&node.dir, "was retired by Metis but is Ready again");
    let (_, body) = http_get(&metrics_addr(&daemon), "/metrics");
    assert_eq!(
        series(
            &body,
            "metis_daemon_rollback_repairs_total{kind=\"revived_block\"}"
        ),
        1.0
    );
    for pod in 0..20 {
        match node.add(&new, &format!("m{pod}"), Request::None) {
            ok @ Outcome::Ok(_) => {
                assert!(
                    ok.addresses()
                        .iter()
                        .all(|a| a.to_string().starts_with("198.18.45.")),
                    "{ok:?}"
                )
            }
            Outcome::Error { code: 11, .. } => break,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        node.held_by("rv", "up-pod"),
        [up.parse::<IpAddr>().unwrap()]
    );
    // Nor does upstream's allocation reach it any more.
    let next = allocate_like_upstream(&db, "rv", "ipv4", "up2");
    assert!(
        next.as_deref().is_none_or(|a| !a.starts_with("198.18.44.")),
        "{next:?}"
    );
    drop(daemon);
}

/// A daemon started on `dir` (no cooldown, metrics on), whose start-up
/// log says `says`.
fn started_saying(dir: &TestDir, says: &str) -> TestDaemon {
    let daemon = TestDaemon::start(
        dir,
        &["--release-cooldown", "0s", "--metrics-addr", "127.0.0.1:0"],
    );
    assert!(daemon.log().contains(says), "{}", daemon.log());
    daemon
}
