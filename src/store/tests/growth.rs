//! Lazy population: blocks grow in batches from their recorded frontier.

use super::*;

#[test]
fn ipv6_expands_in_batches() {
    let (_dir, mut store) = store_with(&[("default", "2001:db8::/64")]);
    assert_eq!(block(&store, 1).total_ips, i64::MAX);
    let mut seen = HashSet::new();
    for i in 0..100 {
        let a = alloc(&mut store, "default", &format!("c{i}"), Family::V6, NOW);
        assert!(cidr("2001:db8::/64").contains(a));
        assert!(seen.insert(a), "duplicate {a}");
    }
    let n = rows(&store, 1).len();
    assert!(n >= 128, "{n} rows");
    assert_eq!(n, 128);
    assert!(seen.contains(&ip("2001:db8::41")));
    assert_eq!(block(&store, 1).allocated_ips, 102);
    assert_counters(&store);
}

#[test]
fn tiny_ipv6_blocks_stay_inside_prefix() {
    let (_dir, mut store) = store_opts_with(
        &opts(None, Some(60_000)),
        &[("default", "2001:db8::/127"), ("other", "2001:db8::10/128")],
    );
    assert_eq!(
        rows(&store, 1)
            .iter()
            .map(|r| r.0.clone())
            .collect::<Vec<_>>(),
        vec!["2001:db8::", "2001:db8::1"]
    );
    assert_eq!(
        rows(&store, 2)
            .iter()
            .map(|r| r.0.clone())
            .collect::<Vec<_>>(),
        vec!["2001:db8::10"]
    );
    assert_eq!(
        alloc(&mut store, "default", "a", Family::V6, NOW),
        ip("2001:db8::")
    );
    assert_eq!(
        alloc(&mut store, "default", "b", Family::V6, NOW),
        ip("2001:db8::1")
    );
    assert!(matches!(
        store.allocate(&owner("default", "c"), Family::V6, NOW),
        Err(StoreError::NoAvailableIps { .. })
    ));
    // Released with cooldown: candidates exist but nothing can be claimed or grown.
    store.release("default", "a", "eth0", NOW).unwrap();
    assert!(matches!(
        store.allocate(&owner("default", "c"), Family::V6, NOW),
        Err(StoreError::NoAvailableIps { .. })
    ));
    assert_eq!(
        alloc(&mut store, "other", "x", Family::V6, NOW),
        ip("2001:db8::10")
    );
    assert_eq!(rows(&store, 1).len(), 2);
    assert_eq!(rows(&store, 2).len(), 1);
}

/// The frontier recorded for a block, as stored.
fn recorded_frontier(store: &Store, block_id: i64) -> Option<String> {
    store
        .conn
        .query_row(
            "SELECT frontier FROM metis_blocks WHERE block_id = ?1",
            [block_id],
            |r| r.get(0),
        )
        .unwrap()
}

#[test]
fn ipv6_growth_continues_from_the_recorded_frontier() {
    let (_dir, mut store) = store_with(&[("default", "2001:db8:6::/64")]);
    // A requested address far ahead of the populated batches.
    let ahead = store
        .allocate_requested(&owner("default", "ahead"), ip("2001:db8:6::50"), NOW)
        .unwrap();
    assert_eq!(ahead.address, ip("2001:db8:6::50"));
    let mut seen = HashSet::new();
    for i in 0..150 {
        let a = alloc(&mut store, "default", &format!("c{i}"), Family::V6, NOW);
        assert!(seen.insert(a), "duplicate {a}");
        assert_ne!(
            a,
            ip("2001:db8:6::50"),
            "a held address was handed out again"
        );
    }
    let frontier = recorded_frontier(&store, 1);
    assert_eq!(frontier.as_deref(), Some("192"));
    // 192 rows: three batches, the requested row counted once.
    assert_eq!(rows(&store, 1).len(), 192);
    assert_counters(&store);
}

#[test]
fn ipv6_block_without_frontier_resumes_after_its_highest_row() {
    let (_dir, mut store) = store_with(&[("default", "2001:db8:7::/120")]);
    for i in 0..62 {
        alloc(&mut store, "default", &format!("c{i}"), Family::V6, NOW);
    }
    // As a database populated by upstream: no frontier recorded.
    store
        .conn
        .execute(
            "UPDATE metis_blocks SET frontier = NULL WHERE block_id = 1",
            [],
        )
        .unwrap();
    let next = alloc(&mut store, "default", "next", Family::V6, NOW);
    assert_eq!(next, ip("2001:db8:7::40"));
    assert_eq!(recorded_frontier(&store, 1).as_deref(), Some("128"));
    assert_counters(&store);
}

#[test]
fn an_ipv4_block_of_any_size_is_added_in_constant_work() {
    // A /15 gets its first batch and its reserved last address, no more;
    // the rest grows from the frontier as addresses are taken.
    let dir = TempDir::new();
    let mut store = dir.store();
    let id = store
        .add_cidr_block("default", &cidr("198.18.0.0/15"))
        .unwrap()
        .id();
    let rows = |store: &Store| -> i64 {
        store
            .conn
            .query_row(
                "SELECT COUNT(*) FROM ip_addresses WHERE cidr_block_id = ?1",
                [id],
                |r| r.get(0),
            )
            .unwrap()
    };
    assert_eq!(rows(&store), 65);
    let last: String = store
        .conn
        .query_row(
            "SELECT address FROM ip_addresses WHERE cidr_block_id = ?1 AND is_allocated = 1 \
             ORDER BY id DESC LIMIT 1",
            [id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(last, "198.19.255.255");
    let block = &store.blocks(&BlockFilter::default()).unwrap()[0];
    assert_eq!((block.total_ips, block.allocated_ips), (131_072, 3));
    let mut got = Vec::new();
    for pod in 0..70 {
        let who = format!("pod{pod}");
        got.push(
            store
                .allocate(&owner("default", &who), Family::V4, 1)
                .unwrap()
                .address,
        );
    }
    assert_eq!(got[0].to_string(), "198.18.0.2");
    assert_eq!(got[69].to_string(), "198.18.0.71");
    assert_eq!(rows(&store), 129);
    assert_counters(&store);
    assert!(store.verify(Depth::Full).unwrap().is_ok());
}
