//! Allocation order, idempotency, release, requested addresses and the
//! release cooldown.

use super::*;

/// A layout of blocks (network "default") and the order in which
/// allocations of `family` take its addresses until it is exhausted.
struct OrderCase {
    name: &'static str,
    blocks: &'static [&'static str],
    family: Family,
    /// Per block, in id order: total_ips and the reserved addresses.
    totals: &'static [i64],
    reserved: &'static [&'static [&'static str]],
    order: &'static [&'static str],
}

const ORDER_CASES: [OrderCase; 5] = [
    OrderCase {
        name: "every block: a /29 keeps network, gateway, broadcast",
        blocks: &["198.18.1.0/29"],
        family: Family::V4,
        totals: &[8],
        reserved: &[&["198.18.1.0", "198.18.1.1", "198.18.1.7"]],
        order: &[
            "198.18.1.2",
            "198.18.1.3",
            "198.18.1.4",
            "198.18.1.5",
            "198.18.1.6",
        ],
    },
    OrderCase {
        name: "tiny IPv4 blocks reserve nothing",
        blocks: &["198.18.0.0/31", "198.18.0.9/32"],
        family: Family::V4,
        totals: &[2, 1],
        reserved: &[&[], &[]],
        order: &["198.18.0.0", "198.18.0.1", "198.18.0.9"],
    },
    OrderCase {
        name: "IPv6 /126 keeps base and gateway",
        blocks: &["2001:db8::/126"],
        family: Family::V6,
        totals: &[4],
        reserved: &[&["2001:db8::", "2001:db8::1"]],
        order: &["2001:db8::2", "2001:db8::3"],
    },
    OrderCase {
        name: "IPv6 /127 stays inside its prefix",
        blocks: &["2001:db8::/127"],
        family: Family::V6,
        totals: &[2],
        reserved: &[&[]],
        order: &["2001:db8::", "2001:db8::1"],
    },
    OrderCase {
        name: "IPv6 /128 has its one address",
        blocks: &["2001:db8::10/128"],
        family: Family::V6,
        totals: &[1],
        reserved: &[&[]],
        order: &["2001:db8::10"],
    },
];

#[test]
fn allocation_order_until_exhausted() {
    for case in &ORDER_CASES {
        let name = case.name;
        let blocks: Vec<(&str, &str)> = case.blocks.iter().map(|b| ("default", *b)).collect();
        let (_dir, mut store) = store_with(&blocks);
        for (id, (total, reserved)) in (1..).zip(case.totals.iter().zip(case.reserved)) {
            assert_eq!(reserved_addrs(&store, id), *reserved, "{name}: block {id}");
            let b = block(&store, id);
            let counted = i64::try_from(reserved.len()).unwrap();
            assert_eq!(
                (b.total_ips, b.allocated_ips, b.family, b.state),
                (*total, counted, case.family, BlockState::Ready),
                "{name}: block {id}"
            );
        }
        let got: Vec<IpAddr> = (0..case.order.len())
            .map(|i| alloc(&mut store, "default", &format!("c{i}"), case.family, NOW))
            .collect();
        let want: Vec<IpAddr> = case.order.iter().map(|a| ip(a)).collect();
        assert_eq!(got, want, "{name}");
        let err = store
            .allocate(&owner("default", "one-more"), case.family, NOW)
            .unwrap_err();
        assert!(
            matches!(err, StoreError::NoAvailableIps { family, .. } if family == case.family),
            "{name}: {err}"
        );
        assert!(
            err.to_string().contains("no available IPs in store"),
            "{name}"
        );
        assert!(!err.is_transient(), "{name}");
        for (id, total) in (1..).zip(case.totals) {
            assert_eq!(
                block(&store, id).allocated_ips,
                *total,
                "{name}: block {id} full"
            );
        }
        assert_counters(&store);
    }
}

#[test]
fn adding_a_block_again_changes_nothing() {
    // Its reservations and allocation order: allocation_order_until_exhausted.
    let dir = TempDir::new();
    let mut store = dir.store();
    let id = store
        .add_cidr_block("default", &cidr("198.18.1.0/29"))
        .unwrap();
    assert_eq!(id, AddOutcome::Added(1));
    assert_eq!(rows(&store, 1).len(), 8);
    alloc(&mut store, "default", "c0", Family::V4, NOW);
    // Adding it again changes nothing.
    assert_eq!(
        store
            .add_cidr_block("default", &cidr("198.18.1.0/29"))
            .unwrap(),
        AddOutcome::Exists(1)
    );
    assert_eq!(rows(&store, 1).len(), 8);
    assert_eq!(
        store.find_block("default", &cidr("198.18.1.0/29")).unwrap(),
        Some(1)
    );
    assert_eq!(
        store.find_block("other", &cidr("198.18.1.0/29")).unwrap(),
        None
    );
    // One address, one owner on the node: the same prefix in another
    // network is refused, naming the network that has it.
    let refused = store
        .add_cidr_block("other", &cidr("198.18.1.0/29"))
        .unwrap_err();
    assert!(
        matches!(&refused, StoreError::Overlap { other_network, .. } if other_network == "default"),
        "{refused}"
    );
}

#[test]
fn fully_cooling_126_terminates() {
    let (_dir, mut store) =
        store_opts_with(&opts(None, Some(30_000)), &[("default", "2001:db8::/126")]);
    assert_eq!(rows(&store, 1).len(), 4);
    assert_eq!(
        alloc(&mut store, "default", "a", Family::V6, NOW),
        ip("2001:db8::2")
    );
    assert_eq!(
        alloc(&mut store, "default", "b", Family::V6, NOW),
        ip("2001:db8::3")
    );
    store.release("default", "a", "eth0", NOW).unwrap();
    store.release("default", "b", "eth0", NOW).unwrap();
    let err = store
        .allocate(&owner("default", "c"), Family::V6, NOW + 1)
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::NoAvailableIps {
                family: Family::V6,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(rows(&store, 1).len(), 4);
    assert_eq!(
        alloc(&mut store, "default", "c", Family::V6, NOW + 30_000),
        ip("2001:db8::2")
    );
    assert_counters(&store);
}

#[test]
fn cooldown_skips_then_reuses() {
    let (dir, mut store) =
        store_opts_with(&opts(None, Some(1000)), &[("default", "198.18.1.0/29")]);
    assert_eq!(
        alloc(&mut store, "default", "a", Family::V4, NOW),
        ip("198.18.1.2")
    );
    let released = store.release("default", "a", "eth0", NOW).unwrap();
    assert_eq!(
        released.addresses,
        vec![Allocation {
            address: ip("198.18.1.2"),
            block: cidr("198.18.1.0/29"),
            gateway: None,
        }]
    );
    let r = rows(&store, 1);
    assert_eq!(
        r[2],
        (
            "198.18.1.2".to_string(),
            false,
            "a".to_string(),
            Some(NOW + 1000)
        )
    );
    assert_eq!(store.usage("default", Family::V4, NOW).unwrap().cooldown, 1);
    assert_eq!(
        alloc(&mut store, "default", "b", Family::V4, NOW + 999),
        ip("198.18.1.3")
    );
    // Rested: free again, but the unused rows come first.
    assert_eq!(
        store
            .usage("default", Family::V4, NOW + 1000)
            .unwrap()
            .cooldown,
        0
    );
    assert_eq!(
        alloc(&mut store, "default", "c", Family::V4, NOW + 1000),
        ip("198.18.1.4")
    );
    // Cooldown 0 → release_at NULL, unused again at once (lowest id).
    let mut store = dir.store_with_cooldown(0);
    store.release("default", "b", "eth0", NOW + 2000).unwrap();
    assert_eq!(rows(&store, 1)[3].3, None);
    assert_eq!(
        alloc(&mut store, "default", "d", Family::V4, NOW + 2000),
        ip("198.18.1.3")
    );
    assert_counters(&store);
}

#[test]
fn oldest_block_first() {
    let (_dir, mut store) =
        store_with(&[("default", "198.18.2.0/28"), ("default", "198.18.1.0/28")]);
    for i in 0..3 {
        let a = store
            .allocate(&owner("default", &format!("c{i}")), Family::V4, NOW)
            .unwrap();
        assert_eq!(a.block, cidr("198.18.2.0/28"));
    }
    // A Draining block is skipped.
    store.drain_block(1, NOW).unwrap();
    let a = store
        .allocate(&owner("default", "d"), Family::V4, NOW)
        .unwrap();
    assert_eq!(a.address, ip("198.18.1.2"));
}

#[test]
fn allocate_is_idempotent_and_network_scoped() {
    let (_dir, mut store) = store_with(&[("default", "198.18.1.0/29"), ("blue", "198.18.9.0/29")]);
    let a = store
        .allocate(&owner("default", "c1"), Family::V4, NOW)
        .unwrap();
    let before = store.blocks(&BlockFilter::default()).unwrap();
    let again = store
        .allocate(&owner("default", "c1"), Family::V4, NOW + 5)
        .unwrap();
    assert_eq!(a, again);
    assert_eq!(
        store.blocks(&BlockFilter::default()).unwrap()[0].allocated_ips,
        before[0].allocated_ips
    );
    let blue = store
        .allocate(&owner("blue", "c1"), Family::V4, NOW)
        .unwrap();
    assert_eq!(blue.address, ip("198.18.9.2"));
    assert_eq!(store.check("default", "c1", "eth0").unwrap(), vec![a]);
    assert_eq!(store.check("blue", "c1", "eth0").unwrap(), vec![blue]);
    // Another interface of the same container is another owner.
    let mut o = owner("default", "c1");
    o.interface_name = "net1";
    assert_eq!(
        store.allocate(&o, Family::V4, NOW).unwrap().address,
        ip("198.18.1.3")
    );
    // Empty owner fields are refused.
    let mut bad = owner("default", "");
    assert!(matches!(
        store.allocate(&bad, Family::V4, NOW),
        Err(StoreError::EmptyOwner)
    ));
    bad.container_id = "x";
    bad.interface_name = "";
    assert!(matches!(
        store.allocate(&bad, Family::V4, NOW),
        Err(StoreError::EmptyOwner)
    ));
    assert!(matches!(
        store.release("default", "", "eth0", NOW),
        Err(StoreError::EmptyOwner)
    ));
    assert_counters(&store);
}

#[test]
fn release_is_idempotent_and_dual_stack() {
    let (_dir, mut store) = store_opts_with(
        &opts(None, Some(1000)),
        &[("default", "2001:db8::/64"), ("default", "198.18.1.0/29")],
    );
    let v6 = store
        .allocate(&owner("default", "c1"), Family::V6, NOW)
        .unwrap();
    let v4 = store
        .allocate(&owner("default", "c1"), Family::V4, NOW)
        .unwrap();
    assert_eq!(store.check("default", "c1", "eth0").unwrap(), vec![v4, v6]);
    assert!(store.check("other", "c1", "eth0").unwrap().is_empty());
    assert!(
        store
            .release("other", "c2", "eth0", NOW)
            .unwrap()
            .addresses
            .is_empty()
    );
    assert_eq!(
        store
            .release("default", "c1", "eth0", NOW)
            .unwrap()
            .addresses,
        vec![v4, v6]
    );
    let again = store.release("default", "c1", "eth0", NOW).unwrap();
    assert!(again.addresses.is_empty() && again.elsewhere.is_empty());
    assert!(store.check("default", "c1", "eth0").unwrap().is_empty());
    assert_eq!(block(&store, 1).allocated_ips, 2);
    assert_eq!(block(&store, 2).allocated_ips, 3);
    assert_counters(&store);
}

#[test]
fn counters_match_rows_after_mixed_sequence() {
    let (_dir, mut store) = store_opts_with(
        &opts(None, Some(500)),
        &[
            ("default", "198.18.1.0/28"),
            ("default", "198.18.2.0/28"),
            ("default", "2001:db8::/120"),
        ],
    );
    for i in 0..70 {
        let cid = format!("c{i}");
        if i < 20 {
            alloc(&mut store, "default", &cid, Family::V4, NOW + i);
        }
        alloc(&mut store, "default", &cid, Family::V6, NOW + i);
        if i % 3 == 0 && i % 2 == 0 {
            for family in [Family::V4, Family::V6] {
                store.roll_back("default", &cid, "eth0", family).unwrap();
            }
        } else if i % 3 == 0 {
            store.release("default", &cid, "eth0", NOW + i).unwrap();
        }
    }
    store
        .allocate_requested(&owner("default", "req"), ip("198.18.2.9"), NOW + 100)
        .unwrap();
    store
        .allocate_requested(&owner("default", "req"), ip("2001:db8::f0"), NOW + 100)
        .unwrap();
    store.drain_block(2, NOW).unwrap();
    for family in [Family::V4, Family::V6] {
        store.roll_back("default", "req", "eth0", family).unwrap();
    }
    assert_counters(&store);
    let usage = store.usage("default", Family::V6, NOW + 100).unwrap();
    assert_eq!(usage.total, 256);
    assert_eq!(
        usage.allocated + usage.reserved,
        block(&store, 3).allocated_ips
    );
}

#[test]
fn allocate_requested_cases() {
    let (_dir, mut store) = store_opts_with(
        &opts(None, Some(1000)),
        &[("default", "198.18.1.0/29"), ("default", "2001:db8::/64")],
    );
    let a = store
        .allocate_requested(&owner("default", "a"), ip("198.18.1.5"), NOW)
        .unwrap();
    assert_eq!(
        a,
        Allocation {
            address: ip("198.18.1.5"),
            block: cidr("198.18.1.0/29"),
            gateway: None,
        }
    );
    assert_eq!(
        store
            .allocate_requested(&owner("default", "a"), ip("198.18.1.5"), NOW)
            .unwrap(),
        a
    );
    let unavailable = |e: StoreError, needle: &str| match e {
        StoreError::RequestedIpUnavailable { reason, .. } => {
            assert!(
                reason.to_string().contains(needle),
                "{reason:?} lacks {needle:?}"
            )
        }
        other => panic!("unexpected {other}"),
    };
    for (container, address, needle) in [
        ("a", "198.18.1.4", "already holds 198.18.1.5"),
        ("b", "198.18.1.5", "held by container \"a\""),
        ("b", "198.18.1.1", "reserved"),
        ("b", "198.18.1.7", "reserved"),
        ("b", "2001:db8::1", "reserved"),
    ] {
        let err = store
            .allocate_requested(&owner("default", container), ip(address), NOW)
            .unwrap_err();
        unavailable(err, needle);
    }
    store.release("default", "a", "eth0", NOW).unwrap();
    unavailable(
        store
            .allocate_requested(&owner("default", "b"), ip("198.18.1.5"), NOW + 10)
            .unwrap_err(),
        "it is in release cooldown until 2023-11-14T22:13:21.000Z",
    );
    assert!(matches!(
        store.allocate_requested(&owner("default", "b"), ip("198.18.3.1"), NOW),
        Err(StoreError::RequestedIpOutsideBlocks { .. })
    ));
    assert!(matches!(
        store.allocate_requested(&owner("blue", "b"), ip("198.18.1.3"), NOW),
        Err(StoreError::RequestedIpOutsideBlocks { .. })
    ));
    assert_eq!(
        store
            .allocate_requested(&owner("default", "b"), ip("198.18.1.5"), NOW + 1000)
            .unwrap()
            .address,
        ip("198.18.1.5")
    );
    // IPv6 beyond the populated rows: just that row is added.
    let v6 = store
        .allocate_requested(&owner("default", "b"), ip("2001:db8::1:0"), NOW)
        .unwrap();
    assert_eq!(v6.block, cidr("2001:db8::/64"));
    assert_eq!(rows(&store, 2).len(), 65);
    assert_eq!(
        alloc(&mut store, "default", "c", Family::V6, NOW),
        ip("2001:db8::2")
    );
    // Draining block: unavailable, not outside.
    store.drain_block(1, NOW).unwrap();
    unavailable(
        store
            .allocate_requested(&owner("default", "d"), ip("198.18.1.3"), NOW)
            .unwrap_err(),
        "Draining",
    );
    assert_counters(&store);
}

#[test]
fn unknown_pod_names_are_stored_as_null_like_upstream() {
    let (dir, mut store) = store_with(&[("n", "198.18.0.0/28")]);
    let anonymous = Owner {
        pod_name: "",
        pod_namespace: "",
        ..owner("n", "podman1")
    };
    store.allocate(&anonymous, Family::V4, NOW).unwrap();
    store
        .allocate(&owner("n", "k8s1"), Family::V4, NOW)
        .unwrap();
    drop(store);
    let conn = Connection::open(dir.db()).unwrap();
    let rows: Vec<(String, Option<String>, Option<String>)> = conn
        .prepare("SELECT container_id, pod_name, pod_namespace FROM ip_addresses WHERE container_id != '' ORDER BY container_id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        rows,
        vec![
            ("k8s1".into(), Some("pod".into()), Some("ns".into())),
            ("podman1".into(), None, None),
        ]
    );
}

/// A network renamed under its pod (`ipam.network` changed): DEL under the
/// new name finds nothing there and releases what another network holds
/// for exactly that container and interface, naming it; another interface
/// of the container, and other containers, keep theirs.
#[test]
fn del_under_a_renamed_network_releases_the_old_networks_allocation() {
    let (_dir, mut store) = store_opts_with(
        &opts(None, Some(1000)),
        &[("old-name", "198.18.1.0/29"), ("net2", "198.18.2.0/29")],
    );
    let held = store
        .allocate(&owner("old-name", "c1"), Family::V4, NOW)
        .unwrap();
    let other_if = Owner {
        interface_name: "net1",
        ..owner("net2", "c1")
    };
    let kept = store.allocate(&other_if, Family::V4, NOW).unwrap();
    let neighbour = store
        .allocate(&owner("old-name", "c2"), Family::V4, NOW)
        .unwrap();
    let released = store.release("new-name", "c1", "eth0", NOW).unwrap();
    assert_eq!(released.addresses, vec![held]);
    assert_eq!(released.elsewhere, ["old-name"]);
    assert!(store.check("old-name", "c1", "eth0").unwrap().is_empty());
    assert_eq!(store.check("net2", "c1", "net1").unwrap(), vec![kept]);
    assert_eq!(
        store.check("old-name", "c2", "eth0").unwrap(),
        vec![neighbour]
    );
    // The address cools as after any DEL, and a repeat DEL is a no-op.
    let c3 = store
        .allocate(&owner("old-name", "c3"), Family::V4, NOW)
        .unwrap();
    assert_ne!(c3.address, held.address);
    let again = store.release("new-name", "c1", "eth0", NOW).unwrap();
    assert!(again.addresses.is_empty() && again.elsewhere.is_empty());
    assert_counters(&store);
}

#[test]
fn a_repeated_add_returns_what_the_owner_holds() {
    let dir = TempDir::new();
    let mut store = dir.store();
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "default",
                family: Family::V4,
                ranges: &[cidr("198.18.40.0/28")],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    let a = owner("default", "a");
    let first = store.allocate(&a, Family::V4, NOW).unwrap();
    assert_eq!(first.address, ip("198.18.40.2"));
    // The configuration now in force names another range: the pod keeps
    // the address it has.
    let moved = InForce {
        ranges: vec![cidr("198.18.41.0/28")],
        bounds: Vec::new(),
    };
    assert_eq!(
        store
            .allocate_under(&a, Family::V4, Some(&moved), NOW)
            .unwrap(),
        first
    );
    // A new owner under the moved configuration: the block is passed
    // over, and the exhaustion says why (before the gateway below is held,
    // which withholds the whole block first).
    let err = store
        .allocate_under(&owner("default", "c"), Family::V4, Some(&moved), NOW)
        .unwrap_err();
    assert!(
        err.to_string().contains(
            "block 198.18.40.0/28: its block lies outside the configured ranges 198.18.41.0/28"
        ),
        "{err}"
    );
    // Another writer (upstream) gave owner "b" the block's gateway: the
    // repeat returns it, and its result names a stand-in, the block's
    // highest address no pod holds.
    give_row_to(&store, "198.18.40.1", "b");
    let again = store
        .allocate(&owner("default", "b"), Family::V4, NOW)
        .unwrap();
    assert_eq!(
        (again.address, again.gateway),
        (ip("198.18.40.1"), Some(ip("198.18.40.14")))
    );
    assert_eq!(store.check("default", "b", "eth0").unwrap().len(), 1);
}

/// Two conflists of network "pods" on 198.18.40.0/28: (the range, the
/// bounds of the one with `gateway` 198.18.40.6, the one without them —
/// its results name .1 — and the one with them).
fn two_gateways() -> (Cidr, crate::cidr::Bounds, InForce, InForce) {
    let range = cidr("198.18.40.0/28");
    let gw = crate::cidr::Bounds {
        start: ip("198.18.40.1"),
        end: ip("198.18.40.14"),
        gateway: ip("198.18.40.6"),
    };
    let plain = InForce {
        ranges: vec![range],
        bounds: Vec::new(),
    };
    let with_gateway = InForce {
        ranges: vec![range],
        bounds: vec![(range, gw)],
    };
    (range, gw, plain, with_gateway)
}

/// A conflist whose explicit `gateway` a pod holds (it got the address
/// under another conflist of the network, or from upstream): no result
/// names it — neither a new address's nor the one an owner already holds:
/// they name a stand-in, the block's highest address no pod holds, which
/// no later hand-out takes while a result names it — and STATUS's question
/// says yes.
#[test]
fn a_conflists_explicit_gateway_a_pod_holds_is_never_a_results_gateway() {
    let (_dir, mut store) = store_with(&[("pods", "198.18.40.0/28")]);
    let (range, gw, plain, with_gateway) = two_gateways();
    // Under the conflist without `gateway`, .6 is an ordinary address.
    store
        .allocate_requested_under(
            &owner("pods", "holder"),
            ip("198.18.40.6"),
            Some(&plain),
            NOW,
        )
        .unwrap();
    let earlier = store
        .allocate_under(&owner("pods", "earlier"), Family::V4, Some(&plain), NOW)
        .unwrap();
    // A new ADD under the conflist with `gateway` 198.18.40.6.
    let new = store
        .allocate_under(&owner("pods", "new"), Family::V4, Some(&with_gateway), NOW)
        .unwrap();
    assert_eq!(new.gateway, Some(ip("198.18.40.14")), "{new:?}");
    // A repeated ADD of an owner that holds an address of the block.
    let again = store
        .allocate_under(
            &owner("pods", "earlier"),
            Family::V4,
            Some(&with_gateway),
            NOW,
        )
        .unwrap();
    assert_eq!(
        (again.address, again.gateway),
        (earlier.address, Some(ip("198.18.40.14")))
    );
    // The stand-in is handed to no one while those results live.
    let mut rest = Vec::new();
    while let Ok(got) = store.allocate_under(
        &owner("pods", &format!("r{}", rest.len())),
        Family::V4,
        Some(&with_gateway),
        NOW,
    ) {
        assert_eq!(got.gateway, Some(ip("198.18.40.14")), "{got:?}");
        rest.push(got.address);
    }
    assert!(!rest.contains(&ip("198.18.40.14")), "{rest:?}");
    assert!(!rest.is_empty());
    for pod in ["new", "earlier"] {
        store.release("pods", pod, "eth0", NOW).unwrap();
    }
    for pod in &rest
        .iter()
        .enumerate()
        .map(|(k, _)| format!("r{k}"))
        .collect::<Vec<_>>()
    {
        store.release("pods", pod, "eth0", NOW).unwrap();
    }
    // STATUS: an ADD of either configuration can succeed.
    for bounds in [vec![(range, gw)], Vec::new()] {
        let conf = crate::store::InForce {
            ranges: vec![range],
            bounds,
        };
        assert!(
            store
                .can_allocate("pods", Family::V4, &conf, false, NOW)
                .unwrap()
                .is_ok()
        );
    }
    let held: i64 = store
        .conn
        .query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE is_allocated = 1 AND container_id != ''",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(held, 1);
    // Once the holder's DEL gives .6 back, results name it again.
    store.release("pods", "holder", "eth0", NOW).unwrap();
    let own = store
        .allocate_under(&owner("pods", "own"), Family::V4, Some(&with_gateway), NOW)
        .unwrap();
    assert_eq!(own.gateway, None, "{own:?}");
}

/// Two conflists of one network on one subnet with different gateways
/// ("pods": computed .1; "pods-gw": `gateway` .6), their layouts
/// alternating as their ADDs do: no ADD of one hands out the gateway a live
/// result of the other names (`metis_gateways`), whichever comes first;
/// a DEL ends the record; and a conflist whose gateway a pod holds is
/// refused with code 11 naming the gateway and its holder.
#[test]
fn a_gateway_a_live_result_names_is_never_handed_out_under_another_conflist() {
    let (_dir, store) = store_with(&[("pods", "198.18.40.0/28")]);
    gateway_records_fence_hand_outs(store);
}

/// The same on a file made before `metis_gateways` was `WITHOUT ROWID`:
/// its table keeps its rowids, and every statement serves it alike.
#[test]
fn a_gateway_table_with_rowids_fences_hand_outs_alike() {
    let dir = TempDir::new();
    let old = rusqlite::Connection::open(dir.db()).unwrap();
    let rowid_shape = crate::store::db::schema::GATEWAYS.replace(" WITHOUT ROWID", "");
    old.execute_batch(&rowid_shape).unwrap();
    drop(old);
    let mut store = Store::open(&dir.db(), &opts(None, None)).unwrap();
    add_blocks(&mut store, &[("pods", "198.18.40.0/28")]);
    let without_rowid: bool = store
        .conn
        .query_row(
            "SELECT sql LIKE '%WITHOUT ROWID%' FROM sqlite_master WHERE name = 'metis_gateways'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(!without_rowid);
    gateway_records_fence_hand_outs(store);
}

fn gateway_records_fence_hand_outs(mut store: Store) {
    let (range, gw, plain, with_gateway) = two_gateways();
    // An ADD of "pods": its result names 198.18.40.1.
    let a = store
        .allocate_under(&owner("pods", "a"), Family::V4, Some(&plain), NOW)
        .unwrap();
    assert_eq!(a.address, ip("198.18.40.2"));
    // "pods-gw"'s layout frees .1 (an ordinary address under it) and
    // reserves .6; its ADDs pass .1 over.
    store
        .set_bounds("pods", Family::V4, &[(range, gw)])
        .unwrap();
    let b = store
        .allocate_under(&owner("pods", "b"), Family::V4, Some(&with_gateway), NOW)
        .unwrap();
    assert_eq!(b.address, ip("198.18.40.3"));
    let err = store
        .allocate_requested_under(
            &owner("pods", "c"),
            ip("198.18.40.1"),
            Some(&with_gateway),
            NOW,
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("it is the gateway of the result container \"a\""),
        "{err}"
    );
    // Back to "pods"' layout: .6, which b's result names, is passed over.
    store.set_bounds("pods", Family::V4, &[]).unwrap();
    for (pod, expected) in [
        ("d", "198.18.40.4"),
        ("e", "198.18.40.5"),
        ("f", "198.18.40.7"),
    ] {
        let got = store
            .allocate_under(&owner("pods", pod), Family::V4, Some(&plain), NOW)
            .unwrap();
        assert_eq!(got.address, ip(expected), "{pod}");
    }
    // Exhausted, the refusal says what was passed over and whose result
    // names it.
    for pod in ["g", "h", "i", "j", "k", "l", "m"] {
        store
            .allocate_under(&owner("pods", pod), Family::V4, Some(&plain), NOW)
            .unwrap();
    }
    let err = store
        .allocate_under(&owner("pods", "n"), Family::V4, Some(&plain), NOW)
        .unwrap_err();
    assert!(matches!(err, StoreError::NoAvailableIps { .. }), "{err}");
    assert!(
        err.to_string().contains(
            "198.18.40.6 of block 198.18.40.0/28: it is the gateway of the result container \"b\""
        ),
        "{err}"
    );
    // b's DEL ends its record: .6 is handed out again.
    store.release("pods", "b", "eth0", NOW).unwrap();
    let n = store
        .allocate_under(&owner("pods", "n"), Family::V4, Some(&plain), NOW)
        .unwrap();
    assert_eq!(n.address, ip("198.18.40.3"));
    let o = store
        .allocate_under(&owner("pods", "o"), Family::V4, Some(&plain), NOW)
        .unwrap();
    assert_eq!(o.address, ip("198.18.40.6"));
    let records: i64 = store
        .conn
        .query_row(
            "SELECT COUNT(*) FROM metis_gateways WHERE container_id = 'b'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(records, 0);
}

/// The other order: a pod of "pods-gw" holds .1, so the results of "pods"
/// (which would name .1) name a stand-in; and a record whose row another
/// writer released and reused counts for nothing.
#[test]
fn a_gateway_record_counts_only_while_its_allocation_lives() {
    let (_dir, mut store) = store_with(&[("pods", "198.18.40.0/28")]);
    let (range, gw, plain, with_gateway) = two_gateways();
    store
        .set_bounds("pods", Family::V4, &[(range, gw)])
        .unwrap();
    let first = store
        .allocate_under(
            &owner("pods", "first"),
            Family::V4,
            Some(&with_gateway),
            NOW,
        )
        .unwrap();
    assert_eq!(first.address, ip("198.18.40.1"));
    store.set_bounds("pods", Family::V4, &[]).unwrap();
    let a = store
        .allocate_under(&owner("pods", "a"), Family::V4, Some(&plain), NOW)
        .unwrap();
    assert_eq!(a.gateway, Some(ip("198.18.40.14")), "{a:?}");
    store.release("pods", "a", "eth0", NOW).unwrap();
    // first's result names .6: not handed out under "pods-gw"'s own rule,
    // nor under "pods" (were it served). Another writer (upstream after
    // a rollback) releases first's row and hands it to "u", without
    // touching Metis's record: the record counts for nothing now.
    store
        .conn
        .execute(
            "UPDATE ip_addresses SET container_id = 'u', allocated_at = allocated_at + 1 \
             WHERE address = '198.18.40.1'",
            [],
        )
        .unwrap();
    let named: Option<String> = rusqlite::OptionalExtension::optional(store.conn.query_row(
        crate::store::rows::named_gateway::NAMING_SQL,
        rusqlite::params!["198.18.40.6", "pods", false],
        |r| r.get(0),
    ))
    .unwrap();
    assert_eq!(named, None);
    // u's row still holds .1: "pods" results name the stand-in.
    let b = store
        .allocate_under(&owner("pods", "b"), Family::V4, Some(&plain), NOW)
        .unwrap();
    assert_eq!(b.gateway, Some(ip("198.18.40.14")), "{b:?}");
}

/// STATUS asks what the ADD's hand-out check would pass: when the
/// network's last free row is the gateway a live result of the other
/// conflist names, the ADD is refused (code 11 naming it) and STATUS says
/// no, naming it too; once that result's pod is gone, both say yes.
#[test]
fn status_counts_no_row_a_live_result_names_as_its_gateway() {
    let (_dir, mut store) = store_with(&[("pods", "198.18.40.0/28")]);
    let (range, gw, plain, with_gateway) = two_gateways();
    store
        .set_bounds("pods", Family::V4, &[(range, gw)])
        .unwrap();
    store
        .allocate_requested_under(
            &owner("pods", "gw-pod"),
            ip("198.18.40.5"),
            Some(&with_gateway),
            NOW,
        )
        .unwrap();
    store.set_bounds("pods", Family::V4, &[]).unwrap();
    let status = |store: &Store| {
        store
            .can_allocate(
                "pods",
                Family::V4,
                &crate::store::InForce {
                    ranges: [range].to_vec(),
                    bounds: [].to_vec(),
                },
                false,
                NOW,
            )
            .unwrap()
            .is_ok()
    };
    // .2 to .14 less .5 (gw-pod's) and .6 (its result's gateway).
    for n in 0..11 {
        assert!(status(&store), "before pod {n}");
        let got = store
            .allocate_under(
                &owner("pods", &format!("p{n}")),
                Family::V4,
                Some(&plain),
                NOW,
            )
            .unwrap();
        assert_ne!(got.address, ip("198.18.40.6"), "pod {n}");
    }
    let err = store
        .allocate_under(&owner("pods", "last"), Family::V4, Some(&plain), NOW)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("198.18.40.6 of block 198.18.40.0/28: it is the gateway of the result container \"gw-pod\""),
        "{err}"
    );
    let counts = store.take_passed_over_counts();
    assert_eq!(counts.into_keys().collect::<Vec<_>>(), ["named_gateway"]);
    assert!(!status(&store), "STATUS must say what the ADD found");
    let why = store
        .can_allocate(
            "pods",
            Family::V4,
            &crate::store::InForce {
                ranges: [range].to_vec(),
                bounds: [].to_vec(),
            },
            false,
            NOW,
        )
        .unwrap();
    assert_eq!(
        why,
        Err(vec![
            "passed over, not fitting the configuration in force: 198.18.40.6 of block 198.18.40.0/28: it is the gateway of the result container \"gw-pod\" interface \"eth0\" holds in network \"pods\"".to_string()
        ])
    );
    // The ADDs counted what they passed over; STATUS counts nothing.
    assert!(store.take_passed_over_counts().is_empty());
    // gw-pod's DEL forgets the record: .6 is room again, for both.
    store.release("pods", "gw-pod", "eth0", NOW).unwrap();
    assert!(status(&store));
    // Its own address (no cooldown here) and then the gateway it named.
    for (pod, address) in [("last", "198.18.40.5"), ("after", "198.18.40.6")] {
        let got = store
            .allocate_under(&owner("pods", pod), Family::V4, Some(&plain), NOW)
            .unwrap();
        assert_eq!(got.address, ip(address));
    }
    assert_eq!(
        store
            .can_allocate(
                "pods",
                Family::V4,
                &crate::store::InForce {
                    ranges: [range].to_vec(),
                    bounds: [].to_vec()
                },
                false,
                NOW
            )
            .unwrap(),
        Err(vec![]),
        "full now, and nothing passed over"
    );
}

/// A repeated ADD under a conflist naming another gateway records that one
/// too (its result names it now), in the transaction that returns it.
#[test]
fn a_repeated_add_under_another_gateway_records_it() {
    let (_dir, mut store) = store_with(&[("pods", "198.18.40.0/28")]);
    let (range, gw, plain, with_gateway) = two_gateways();
    let a = owner("pods", "a");
    let first = store
        .allocate_under(&a, Family::V4, Some(&plain), NOW)
        .unwrap();
    store
        .set_bounds("pods", Family::V4, &[(range, gw)])
        .unwrap();
    let again = store
        .allocate_under(&a, Family::V4, Some(&with_gateway), NOW)
        .unwrap();
    assert_eq!(again, first);
    let named: Vec<String> = store
        .conn
        .prepare("SELECT gateway FROM metis_gateways WHERE container_id = 'a' ORDER BY gateway")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(named, ["198.18.40.1", "198.18.40.6"]);
    // Back under "pods"' layout, .6 is passed over.
    store.set_bounds("pods", Family::V4, &[]).unwrap();
    for pod in ["b", "c", "d"] {
        let got = store
            .allocate_under(&owner("pods", pod), Family::V4, Some(&plain), NOW)
            .unwrap();
        assert_ne!(got.address, ip("198.18.40.6"), "{pod}");
    }
}

/// A claim takes unused rows first, lowest id first, skipping the rows
/// still cooling below them; with none left, the cooled row that rested
/// longest — also one another writer released with a cooldown of its own,
/// which Metis's index sees as it sees its own releases.
#[test]
fn unused_rows_first_then_the_longest_rested() {
    // A /27: .2 to .30 usable (the network's first block reserves .0, .1
    // and the broadcast).
    let (_dir, mut store) =
        store_opts_with(&opts(None, Some(60_000)), &[("default", "198.18.1.0/27")]);
    let low = alloc(&mut store, "default", "low", Family::V4, NOW);
    assert_eq!(low, ip("198.18.1.2"));
    for k in 0..20 {
        alloc(&mut store, "default", &format!("c{k}"), Family::V4, NOW);
    }
    // c19 (.22) first: the later rows rested longest.
    for k in (0..20).rev() {
        let at = NOW + i64::from(19 - k);
        store
            .release("default", &format!("c{k}"), "eth0", at)
            .unwrap();
    }
    // Upstream-like SQL: released with its own 10 s cooldown.
    store
        .conn
        .execute_batch(&format!(
            "UPDATE ip_addresses SET is_allocated = 0, release_at = {} WHERE container_id = 'low'; \
             UPDATE cidr_blocks SET allocated_ips = allocated_ips - 1 WHERE id = 1;",
            NOW + 10_000
        ))
        .unwrap();
    let fresh: Vec<IpAddr> = (0..8)
        .map(|k| {
            alloc(
                &mut store,
                "default",
                &format!("f{k}"),
                Family::V4,
                NOW + 10_000,
            )
        })
        .collect();
    assert_eq!(fresh.first(), Some(&ip("198.18.1.23")));
    assert_eq!(fresh.last(), Some(&ip("198.18.1.30")));
    // No unused row left: the cooled one, then nothing until 60 s.
    assert_eq!(
        alloc(&mut store, "default", "again", Family::V4, NOW + 10_000),
        low
    );
    let err = store
        .allocate(&owner("default", "early"), Family::V4, NOW + 59_999)
        .unwrap_err();
    assert!(matches!(err, StoreError::NoAvailableIps { .. }), "{err}");
    assert_eq!(
        alloc(&mut store, "default", "later", Family::V4, NOW + 60_000),
        ip("198.18.1.22")
    );
    assert_eq!(
        alloc(&mut store, "default", "last", Family::V4, NOW + 60_019),
        ip("198.18.1.21")
    );
    assert_counters(&store);
}

/// A stand-in is the block's highest address no pod holds, among its top
/// 64: when pods hold all of them as well as the gateway, the block is not
/// served (code 11 naming the gateway and its holder), and STATUS agrees.
#[test]
fn a_block_with_no_address_to_stand_in_for_its_gateway_is_not_served() {
    let (_dir, mut store) = store_with(&[("default", "198.18.50.0/24")]);
    for last in 191..=254 {
        store
            .allocate_requested(
                &owner("default", &format!("top{last}")),
                ip(&format!("198.18.50.{last}")),
                NOW,
            )
            .unwrap();
    }
    // A pod on the gateway (upstream gave it, or another conflist's rule).
    give_row_to(&store, "198.18.50.1", "x");
    let err = store
        .allocate(&owner("default", "new"), Family::V4, NOW)
        .unwrap_err();
    assert!(
        err.to_string().contains(
            "block 198.18.50.0/24 (network \"default\") is not served while its gateway \
             198.18.50.1 is held by container \"x\""
        ),
        "{err}"
    );
    let status = store
        .can_allocate(
            "default",
            Family::V4,
            &InForce {
                ranges: vec![cidr("198.18.50.0/24")],
                bounds: Vec::new(),
            },
            false,
            NOW,
        )
        .unwrap();
    assert!(status.is_err(), "{status:?}");
    // One of them goes: it stands in.
    store.release("default", "top200", "eth0", NOW).unwrap();
    let served = store
        .allocate(&owner("default", "new"), Family::V4, NOW)
        .unwrap();
    assert_eq!(served.gateway, Some(ip("198.18.50.200")), "{served:?}");
}
