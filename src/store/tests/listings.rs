//! The admin listings: filters honoured, values bound.

use super::*;

/// The listings' fixture: blocks 1 (default, v4, c1 holds .2), 2 (blue,
/// v4, Draining, c2 holds .2) and 3 (default, v6).
fn listing_store() -> (TempDir, Store) {
    let (dir, mut store) = store_with(&[
        ("default", "198.18.1.0/30"),
        ("blue", "198.18.2.0/30"),
        ("default", "2001:db8::/126"),
    ]);
    alloc(&mut store, "default", "c1", Family::V4, NOW);
    alloc(&mut store, "blue", "c2", Family::V4, NOW);
    store.drain_block(2, NOW).unwrap();
    (dir, store)
}

/// A filter value that would match everything if pasted into SQL.
const HOSTILE: &str = "x' OR '1'='1";

#[test]
fn block_listings_honour_filters_and_bind_values() {
    let (_dir, store) = listing_store();
    let all = store.list_blocks(&BlockFilter::default()).unwrap();
    assert_eq!(
        all.headers,
        vec![
            "id",
            "cidr",
            "network",
            "ip_family",
            "total_ips",
            "allocated_ips",
            "state",
            "created_at",
            "updated_at",
            "note"
        ]
    );
    assert_eq!(all.rows.len(), 3);
    assert_eq!(
        &all.rows[0][..7],
        &["1", "198.18.1.0/30", "default", "ipv4", "4", "4", "Ready"]
    );
    let ids = |t: &Table| t.rows.iter().map(|r| r[0].clone()).collect::<Vec<_>>();
    let f = |n: Option<&str>, s: Option<BlockState>, fam: Option<Family>| BlockFilter {
        network: n.map(str::to_string),
        state: s,
        family: fam,
    };
    let block_cases = [
        ("network", f(Some("default"), None, None), vec!["1", "3"]),
        (
            "state",
            f(None, Some(BlockState::Draining), None),
            vec!["2"],
        ),
        ("family", f(None, None, Some(Family::V6)), vec!["3"]),
        (
            "all three",
            f(Some("default"), Some(BlockState::Ready), Some(Family::V4)),
            vec!["1"],
        ),
    ];
    for (case, filter, want) in block_cases {
        assert_eq!(ids(&store.list_blocks(&filter).unwrap()), want, "{case}");
    }
    assert!(
        store
            .list_blocks(&f(Some(HOSTILE), None, None))
            .unwrap()
            .rows
            .is_empty()
    );
    assert!(
        store
            .blocks(&f(Some(HOSTILE), None, None))
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store.blocks(&f(Some("blue"), None, None)).unwrap()[0].state,
        BlockState::Draining
    );
}

#[test]
fn address_listings_honour_filters_and_bind_values() {
    let (_dir, store) = listing_store();
    let addrs = store.list_addresses(&AddressFilter::default()).unwrap();
    assert_eq!(
        addrs.headers,
        vec![
            "id",
            "address",
            "cidr_block_id",
            "container_id",
            "pod_name",
            "pod_namespace",
            "interface_name",
            "is_allocated",
            "release_at",
            "allocated_at",
            "updated_at"
        ]
    );
    assert_eq!(addrs.rows.len(), 12);
    let c1 = store
        .list_addresses(&AddressFilter {
            container_id: Some("c1".into()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(c1.rows.len(), 1);
    assert_eq!(
        &c1.rows[0][1..],
        &[
            "198.18.1.2",
            "1",
            "c1",
            "pod",
            "ns",
            "eth0",
            "1",
            "NULL",
            &NOW.to_string(),
            &c1.rows[0][10]
        ]
    );
    let address_cases = [
        (
            "allocated",
            AddressFilter {
                allocated: Some(true),
                ..Default::default()
            },
            10,
        ),
        (
            "free",
            AddressFilter {
                allocated: Some(false),
                ..Default::default()
            },
            2,
        ),
        (
            "network",
            AddressFilter {
                network: Some("blue".into()),
                ..Default::default()
            },
            4,
        ),
        (
            "block state",
            AddressFilter {
                state: Some(BlockState::Draining),
                ..Default::default()
            },
            4,
        ),
        (
            "family",
            AddressFilter {
                family: Some(Family::V6),
                ..Default::default()
            },
            4,
        ),
        (
            "network, family and free",
            AddressFilter {
                network: Some("default".into()),
                family: Some(Family::V6),
                allocated: Some(false),
                ..Default::default()
            },
            2,
        ),
        (
            "hostile container id",
            AddressFilter {
                container_id: Some(HOSTILE.into()),
                ..Default::default()
            },
            0,
        ),
        (
            "hostile network",
            AddressFilter {
                network: Some(HOSTILE.into()),
                ..Default::default()
            },
            0,
        ),
    ];
    for (case, filter, want) in address_cases {
        assert_eq!(
            store.list_addresses(&filter).unwrap().rows.len(),
            want,
            "{case}"
        );
    }
}
