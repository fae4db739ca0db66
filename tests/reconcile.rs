//! Regression tests for issue 10 ("one node, one address space"), one per
//! numbered case, through the real binary: they assert the behaviour the
//! issue asks for — no address held twice, configuration changes
//! reconciled, a failed ADD leaving the owner's allocation intact, the last
//! owner reclaiming its cooling address, and a daemon that starts on any
//! database it can read.

use crate::common;

use std::net::IpAddr;

use common::node::{NetConf, Node, Outcome, Request, check_passes, held_twice, serving};
use common::upstream::Upstream;

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// The addresses of a successful ADD; panics with the outcome otherwise.
fn added(outcome: &Outcome) -> Vec<IpAddr> {
    assert!(matches!(outcome, Outcome::Ok(_)), "ADD failed: {outcome:?}");
    outcome.addresses()
}

/// No address is held by two owners, and `metis admin check` passes.
fn assert_sound(node: &Node) {
    let twice = held_twice(&node.holdings(), |_| true);
    assert!(twice.is_empty(), "addresses held twice: {twice:#?}");
    let check = node.admin_check();
    assert!(
        check_passes(&check),
        "metis admin check: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
}

/// Stops the daemon and starts it again with `cidrs`; it must serve.
fn restart(node: &mut Node, cidrs: &[String]) {
    node.stop();
    node.start(cidrs);
    let health = node.health();
    assert!(
        serving(&health),
        "daemon does not serve after a restart: {health:?}\n{}",
        node.log()
    );
}

/// Case 1: widening a range under the same network name (/30 -> /29)
/// grows the block in place; the pod keeps its address and nobody else
/// gets it, through the daemon and in direct mode.
#[test]
fn case1_widening_a_range_keeps_the_holder_and_hands_its_address_to_nobody() {
    let mut node = Node::new("reconcile-1", "1m");
    node.start(&[]);
    let narrow = NetConf::new("pods", &["198.18.10.0/30"]);
    let wide = NetConf::new("pods", &["198.18.10.0/29"]);
    let a = added(&node.add(&narrow, "pod-a", Request::None));
    assert_eq!(a, [ip("198.18.10.2")]);

    let b = added(&node.add(&wide, "pod-b", Request::None));
    assert_ne!(b, a, "pod-b was given pod-a's address");
    assert_eq!(node.held_by("pods", "pod-a"), a);
    assert_sound(&node);
    restart(&mut node, &[]);

    // Direct mode must keep the same promise.
    node.stop();
    let c = added(&node.add(&wide, "pod-c", Request::None));
    assert!(c != a && c != b, "pod-c was given {c:?}");
    assert_eq!(node.held_by("pods", "pod-a"), a);
    assert_sound(&node);
    node.start(&[]);
    assert!(serving(&node.health()), "{}", node.log());
}

/// Case 2: a `--cidr` block beside an overlapping CNI range of the same
/// network never hands out an address twice, and overlapping `--cidr`
/// flags either keep that promise or are refused.
#[test]
fn case2_cidr_flag_beside_an_overlapping_cni_range_hands_out_each_address_once() {
    let mut node = Node::new("reconcile-2", "1m");
    node.start(&["pods=198.18.11.0/29".to_string()]);
    let conf = NetConf::new("pods", &["198.18.11.0/28"]);
    let mut got = Vec::new();
    for i in 0..20 {
        match node.add(&conf, &format!("pod-{i}"), Request::None) {
            Outcome::Ok(ips) => got.extend(ips),
            Outcome::Error { code: 11, .. } => break,
            other => panic!("pod-{i}: {other:?}"),
        }
    }
    assert!(got.len() >= 5, "only {got:?}");
    let mut unique = got.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), got.len(), "handed out twice: {got:?}");
    assert_sound(&node);

    // Two overlapping flags for one network: whatever the daemon makes of
    // them, no address is held twice and the database stays sound.
    node.stop();
    let flags = [
        "pods=198.18.11.0/29".to_string(),
        "pods=198.18.11.0/28".to_string(),
    ];
    node.start(&flags);
    for i in 20..40 {
        if node.add(&conf, &format!("pod-{i}"), Request::None).code() == Some(11) {
            break;
        }
    }
    assert_sound(&node);
}

/// Case 3: a second network name over the subnet of the first (rename,
/// upgrade from upstream's `default`) is refused with code 7 naming the
/// other network, until the config names the old network; an isolated
/// network may reuse the subnet.
#[test]
fn case3_two_network_names_over_one_subnet_are_refused_naming_the_other() {
    let mut node = Node::new("reconcile-3", "1m");
    let upstream = Upstream::create(&node.db_path());
    let id = upstream.block("198.18.12.0/29", "default", true);
    upstream.hold(id, "198.18.12.2", "old-pod", "eth0");
    drop(upstream);
    node.start(&[]);

    let renamed = NetConf::new("k8s-pod-network", &["198.18.12.0/29"]);
    match node.add(&renamed, "new-pod", Request::None) {
        Outcome::Error { code: 7, msg } => {
            assert!(msg.contains("default"), "does not name the network: {msg}");
        }
        other => panic!("expected code 7 naming network default, got {other:?}"),
    }
    assert!(node.held_by("k8s-pod-network", "new-pod").is_empty());

    // The way out the message names: the old network.
    let pinned = NetConf {
        network: Some("default"),
        ..renamed.clone()
    };
    let got = added(&node.add(&pinned, "new-pod", Request::None));
    assert_ne!(got, [ip("198.18.12.2")]);
    assert_eq!(node.held_by("default", "old-pod"), [ip("198.18.12.2")]);

    // A plain rename between two Metis configs is refused the same way.
    let first = NetConf::new("pods-a", &["198.18.13.0/29"]);
    let second = NetConf::new("pods-b", &["198.18.13.0/28"]);
    added(&node.add(&first, "a-pod", Request::None));
    match node.add(&second, "b-pod", Request::None) {
        Outcome::Error { code: 7, msg } => assert!(msg.contains("pods-a"), "{msg}"),
        other => panic!("expected code 7 naming pods-a, got {other:?}"),
    }

    // The opt-in: an isolated network may reuse the addresses.
    let isolated = NetConf {
        isolated: true,
        ..NetConf::new("iso", &["198.18.12.0/29"])
    };
    added(&node.add(&isolated, "iso-pod", Request::None));
    let twice = held_twice(&node.holdings(), |h| h.network != "iso");
    assert!(twice.is_empty(), "{twice:#?}");
    let check = node.admin_check();
    assert!(check_passes(&check), "{check:?}");
}

/// Case 4: a range moved away drains the old block: no new address from
/// it, the pod there keeps its address; moving back undrains it.
#[test]
fn case4_a_moved_range_drains_the_old_block() {
    let mut node = Node::new("reconcile-4", "1m");
    node.start(&[]);
    let old = NetConf::new("pods", &["198.18.12.0/24"]);
    let new = NetConf::new("pods", &["198.18.13.0/24"]);
    let a = added(&node.add(&old, "pod-a", Request::None));
    for i in 0..3 {
        let got = added(&node.add(&new, &format!("pod-{i}"), Request::None));
        assert!(
            got.iter().all(|g| new.blocks()[0].contains(*g)),
            "pod-{i} was given {got:?}, outside 198.18.13.0/24"
        );
    }
    assert_eq!(node.held_by("pods", "pod-a"), a);
    let old_block = node
        .blocks()
        .into_iter()
        .find(|b| b.block.to_string() == "198.18.12.0/24")
        .expect("the old block is kept while pod-a holds an address in it");
    assert_eq!(old_block.state, "Withheld", "{old_block:?}");
    assert_sound(&node);

    // Back again: the block serves new pods.
    let back = added(&node.add(&old, "pod-back", Request::None));
    assert!(old.blocks()[0].contains(back[0]) && back != a, "{back:?}");
    let state: Vec<String> = node
        .blocks()
        .into_iter()
        .filter(|b| b.block.to_string() == "198.18.12.0/24")
        .map(|b| b.state)
        .collect();
    assert_eq!(state, ["Ready"]);
    assert_sound(&node);
}

/// Case 5: a repeat ADD that asks for an unavailable address fails (or
/// returns the existing allocation) and leaves both addresses held.
#[test]
fn case5_a_failed_repeat_add_keeps_the_live_allocation() {
    let mut node = Node::new("reconcile-5", "1m");
    node.start(&[]);
    let conf = NetConf::new("pods", &["198.18.14.0/24", "2001:db8:14::/120"]);
    let a = added(&node.add(&conf, "pod-a", Request::None));
    let b = added(&node.add(&conf, "pod-b", Request::None));
    let taken_v6 = b.iter().copied().find(IpAddr::is_ipv6).unwrap();

    match node.add(&conf, "pod-a", Request::RuntimeConfig(taken_v6)) {
        Outcome::Ok(_) => {}
        Outcome::Error { code: 100, .. } => {}
        other => panic!("repeat ADD: {other:?}"),
    }
    let mut held = node.held_by("pods", "pod-a");
    held.sort();
    let mut want = a.clone();
    want.sort();
    assert_eq!(held, want, "pod-a's allocation changed");

    let c = added(&node.add(&conf, "pod-c", Request::None));
    assert!(
        c.iter().all(|ip| !a.contains(ip)),
        "pod-c was given one of pod-a's addresses: {c:?} / {a:?}"
    );
    assert_sound(&node);
}

/// Case 6: DEL then ADD asking for the released address (Podman's
/// `network reload`, a container re-created with a static IP) gives it
/// back to its last owner, by `runtimeConfig.ips` and by `CNI_ARGS IP=`;
/// another container, or the same one on another interface, still waits
/// out the cooldown (code 100).
#[test]
fn case6_the_last_owner_reclaims_its_cooling_address() {
    let mut node = Node::new("reconcile-6", "1h");
    node.start(&[]);
    let conf = NetConf::new("pods", &["198.18.16.0/24"]);
    let cases = [
        ("rc", Request::RuntimeConfig(ip("198.18.16.5"))),
        ("args", Request::CniArgs(ip("198.18.16.6"))),
    ];
    for (name, request) in cases {
        let owner = format!("owner-{name}");
        let wanted = request.address().unwrap();
        assert_eq!(added(&node.add(&conf, &owner, request)), [wanted]);
        assert_eq!(node.del(&conf, &owner), Outcome::Ok(Vec::new()));

        let other = node.add(&conf, &format!("other-{name}"), request);
        assert_eq!(other.code(), Some(100), "another container: {other:?}");
        let other_if = node.call("ADD", &conf, &owner, "net1", request, None);
        assert_eq!(
            other_if.code(),
            Some(100),
            "another interface: {other_if:?}"
        );

        let back = node.add(&conf, &owner, request);
        assert_eq!(back, Outcome::Ok(vec![format!("{wanted}/24")]), "{name}");
        assert_eq!(node.held_by("pods", &owner), [wanted]);
    }
    assert_sound(&node);
}

/// Case 7: an upstream database with an IPv6 /127 block that handed out
/// `::2`, and a /128 block: the daemon and direct mode start and serve;
/// the bad blocks are repaired or quarantined (then listed by admin check).
#[test]
fn case7_an_upstream_database_with_a_127_block_is_served() {
    let mut node = Node::new("reconcile-7", "1m");
    let upstream = Upstream::create(&node.db_path());
    let v4 = upstream.block("198.18.17.0/29", "default", true);
    upstream.hold(v4, "198.18.17.2", "old-pod", "eth0");
    let v6 = upstream.block("2001:db8:17::/127", "default", false);
    upstream.hold(v6, "2001:db8:17::2", "old-pod", "eth0");
    upstream.block("2001:db8:17::10/128", "default", false);
    drop(upstream);

    node.start(&[]);
    let health = node.health();
    assert!(serving(&health), "{health:?}\n{}", node.log());
    let conf = NetConf::new("default", &["198.18.17.0/29"]);
    let got = added(&node.add(&conf, "new-pod", Request::None));
    assert_ne!(got, [ip("198.18.17.2")]);
    assert!(
        node.held_by("default", "old-pod")
            .contains(&ip("198.18.17.2")),
        "the upstream pod lost its IPv4 address"
    );
    let check = node.admin_check();
    let report = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() || (check_passes(&check) && report.contains("2001:db8:17::/127")),
        "{report}"
    );

    // Direct mode applies the same rule.
    node.stop();
    added(&node.add(&conf, "direct-pod", Request::None));
    restart(&mut node, &[]);
    assert_sound(&node);
}
