//! Reserved addresses: which offsets each mode reserves, and the repair
//! that brings a database in line with the mode.

use super::*;

#[test]
fn reserved_offsets_rule() {
    use ReserveMode::{EveryBlock, FirstBlock};
    // (case, block, mode, first IPv4 block of its network, offsets)
    let cases: [(&str, &str, ReserveMode, bool, &[u128]); 9] = [
        ("v4 /29", "198.18.0.0/29", EveryBlock, false, &[0, 1, 7]),
        ("v4 /30", "198.18.0.0/30", EveryBlock, false, &[0, 1, 3]),
        ("v4 /31 too small", "198.18.0.0/31", EveryBlock, true, &[]),
        ("v4 /32 too small", "198.18.0.0/32", EveryBlock, true, &[]),
        (
            "first block, first",
            "198.18.0.0/29",
            FirstBlock,
            true,
            &[0, 1, 7],
        ),
        (
            "first block, later",
            "198.18.0.0/29",
            FirstBlock,
            false,
            &[],
        ),
        ("v6 /64", "2001:db8::/64", EveryBlock, false, &[0, 1]),
        (
            "v6 under first block",
            "2001:db8::/64",
            FirstBlock,
            true,
            &[],
        ),
        (
            "v6 /127 too small",
            "2001:db8::/127",
            EveryBlock,
            false,
            &[],
        ),
    ];
    for (case, block, mode, first, want) in cases {
        assert_eq!(reserved_offsets(&cidr(block), mode, first), want, "{case}");
    }
}

#[test]
fn second_block_reservation_depends_on_mode() {
    let dir = TempDir::new();
    {
        let mut store = dir.store();
        add_blocks(&mut store, &[("default", "198.18.1.0/29")]);
        add_blocks(&mut store, &[("default", "198.18.2.0/29")]);
        assert_eq!(
            reserved_addrs(&store, 2),
            vec!["198.18.2.0", "198.18.2.1", "198.18.2.7"]
        );
        assert_eq!(block(&store, 2).allocated_ips, 3);
    }
    let dir2 = TempDir::new();
    let mut store = store_mode(&dir2, ReserveMode::FirstBlock);
    assert_eq!(store.reserve_mode(), ReserveMode::FirstBlock);
    store
        .add_cidr_block("default", &cidr("2001:db8::/120"))
        .unwrap(); // v6 first: no effect on v4 rule
    add_blocks(
        &mut store,
        &[("default", "198.18.1.0/29"), ("default", "198.18.2.0/29")],
    );
    assert!(reserved_addrs(&store, 1).is_empty());
    assert_eq!(
        reserved_addrs(&store, 2),
        vec!["198.18.1.0", "198.18.1.1", "198.18.1.7"]
    );
    assert!(reserved_addrs(&store, 3).is_empty());
    assert_eq!(block(&store, 3).allocated_ips, 0);
    for i in 0..5 {
        alloc(&mut store, "default", &format!("c{i}"), Family::V4, NOW);
    }
    assert_eq!(
        alloc(&mut store, "default", "c5", Family::V4, NOW),
        ip("198.18.2.0")
    );
    assert_eq!(
        alloc(&mut store, "default", "c6", Family::V6, NOW),
        ip("2001:db8::")
    );
    drop(store);

    // The stored mode persists; switching to EveryBlock repairs the layout.
    let store = dir2.store();
    assert_eq!(store.reserve_mode(), ReserveMode::FirstBlock);
    drop(store);
    let store = store_mode(&dir2, ReserveMode::EveryBlock);
    assert_eq!(reserved_addrs(&store, 3), vec!["198.18.2.1", "198.18.2.7"]);
    assert_eq!(reserved_addrs(&store, 1), vec!["2001:db8::1"]);
    assert_eq!(
        store.open_warnings().len(),
        2,
        "{:?}",
        store.open_warnings()
    );
    assert!(
        store
            .open_warnings()
            .iter()
            .any(|w| w.contains("198.18.2.0") && w.contains("c5"))
    );
    assert!(
        store
            .open_warnings()
            .iter()
            .any(|w| w.contains("2001:db8::") && w.contains("c6"))
    );
    assert_counters(&store);
    drop(store);
    // And back: the stray reservations of the later blocks are freed.
    let mut store = store_mode(&dir2, ReserveMode::FirstBlock);
    assert!(reserved_addrs(&store, 3).is_empty());
    assert!(reserved_addrs(&store, 1).is_empty());
    assert_eq!(reserved_addrs(&store, 2).len(), 3);
    assert_counters(&store);
    // Its base and broadcast are served under first-block, never the
    // gateway a result for the block names (the hand-out check).
    assert_eq!(
        alloc(&mut store, "default", "c7", Family::V4, NOW),
        ip("198.18.2.2")
    );
}

#[test]
fn ipv6_reserves_base_and_gateway() {
    let (_dir, mut store) = store_with(&[("default", "2001:db8::/120")]);
    let b = block(&store, 1);
    assert_eq!(
        (b.family, b.total_ips, b.allocated_ips),
        (Family::V6, 256, 2)
    );
    assert_eq!(rows(&store, 1).len(), 64);
    assert_eq!(reserved_addrs(&store, 1), vec!["2001:db8::", "2001:db8::1"]);
    let a = store
        .allocate(&owner("default", "c1"), Family::V6, NOW)
        .unwrap();
    assert_eq!(a.address, ip("2001:db8::2"));
    assert_eq!(a.block, cidr("2001:db8::/120"));
}

#[test]
fn adding_a_slash16_populates_one_batch_and_its_reservations() {
    // How long growth takes is measured by `make bench`, not asserted here.
    let (dir, store) = store_with(&[("default", "198.19.0.0/16")]);
    assert_eq!(block(&store, 1).total_ips, 65536);
    assert_eq!(rows(&store, 1).len(), 65);
    assert_eq!(
        reserved_addrs(&store, 1),
        vec!["198.19.0.0", "198.19.0.1", "198.19.255.255"]
    );
    drop(store);
    let store = dir.store();
    assert!(store.open_warnings().is_empty());
}

#[test]
fn a_mode_change_reserves_the_unpopulated_end_of_a_lazy_block() {
    // Under first-block the second /16 reserves nothing; switching to
    // every-block must reserve its broadcast address, which has no row yet.
    let dir = TempDir::new();
    {
        let mut store = store_mode(&dir, ReserveMode::FirstBlock);
        add_blocks(
            &mut store,
            &[("default", "198.18.0.0/16"), ("default", "198.19.0.0/16")],
        );
        assert_eq!(block(&store, 2).allocated_ips, 0);
        assert_eq!(rows(&store, 2).len(), 64);
    }
    let store = store_mode(&dir, ReserveMode::EveryBlock);
    assert_eq!(
        reserved_addrs(&store, 2),
        vec!["198.19.0.0", "198.19.0.1", "198.19.255.255"]
    );
    assert_eq!(block(&store, 2).allocated_ips, 3);
    assert_counters(&store);
    assert!(store.verify(Depth::Full).unwrap().is_ok());
}
