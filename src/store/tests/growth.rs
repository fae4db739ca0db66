//! Lazy population: blocks grow in batches from their recorded frontier.

use super::*;
use crate::cidr::Bounds;

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

/// Every address of `network` and `family` the store hands out before it
/// reports exhaustion, in order.
fn take_all(store: &mut Store, network: &str, family: Family) -> Vec<IpAddr> {
    (0..)
        .map(|i| format!("all{i}"))
        .map_while(|id| store.allocate(&owner(network, &id), family, NOW).ok())
        .map(|a| a.address)
        .collect()
}

#[test]
fn a_narrowed_off_part_taken_back_grows_the_addresses_it_never_populated() {
    let dir = TempDir::new();
    let mut store = dir.store();
    let configure = |store: &mut Store, ranges: &[&str]| {
        let ranges: Vec<Cidr> = ranges.iter().map(|r| cidr(r)).collect();
        store
            .configure(
                &crate::store::Wish {
                    source: Source::Cni,
                    network: "pods",
                    family: Family::V4,
                    ranges: &ranges,
                    isolated: false,
                },
                NOW,
            )
            .unwrap();
    };
    // A /24 populated as far as its first batch, and a pod beyond it.
    configure(&mut store, &["198.18.12.0/24"]);
    alloc(&mut store, "pods", "a", Family::V4, NOW);
    store
        .allocate_requested(&owner("pods", "b"), ip("198.18.12.200"), NOW)
        .unwrap();
    // Narrowed to its lower half: the upper half drains (kept for its pod)
    // with no row but the pod's and its reserved ones.
    configure(&mut store, &["198.18.12.0/25"]);
    // The upper half comes back (a --cidr flag or a range naming it).
    configure(&mut store, &["198.18.12.0/25", "198.18.12.128/25"]);
    let got = take_all(&mut store, "pods", Family::V4);
    // Each /25 keeps back its network, gateway and broadcast addresses;
    // the two pods hold one each.
    assert_eq!(got.len(), 2 * (128 - 3) - 2, "{got:?}");
    assert!(got.contains(&ip("198.18.12.130")), "{got:?}");
    assert!(got.contains(&ip("198.18.12.254")), "{got:?}");
    assert_counters(&store);
    assert!(store.verify(Depth::Full).unwrap().is_ok());
}

#[test]
fn a_bounded_block_narrowed_off_and_taken_back_grows_past_its_old_range() {
    let dir = TempDir::new();
    let mut store = dir.store();
    let wide = cidr("198.18.20.0/28");
    let bounds = Bounds::new(
        &wide,
        Some(ip("198.18.20.9")),
        Some(ip("198.18.20.10")),
        None,
    )
    .unwrap();
    // Bounds recorded first, as ADD does: the block is populated only
    // inside its range.
    store
        .set_bounds("pods", Family::V4, &[(wide, bounds)])
        .unwrap();
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "pods",
                family: Family::V4,
                ranges: &[wide],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    // Rows exist only inside the range: a pod holds its first address.
    assert_eq!(
        alloc(&mut store, "pods", "a", Family::V4, NOW),
        ip("198.18.20.9")
    );
    // Narrowed to the lower half, then the upper half comes back (as a
    // `--cidr` flag naming it) without the bounds.
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "pods",
                family: Family::V4,
                ranges: &[cidr("198.18.20.0/29")],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    store.set_bounds("pods", Family::V4, &[]).unwrap();
    store
        .configure(
            &crate::store::Wish {
                source: Source::Flag,
                network: "pods",
                family: Family::V4,
                ranges: &[cidr("198.18.20.8/29")],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    // Pod "a" holds .9, the gateway the upper block advertises: its
    // results name a stand-in while that lasts, .14, which no one gets.
    let upper = |store: &mut Store| -> Vec<IpAddr> {
        take_all(store, "pods", Family::V4)
            .into_iter()
            .filter(|a| cidr("198.18.20.8/29").contains(*a))
            .collect()
    };
    let want: Vec<IpAddr> = (10..14).map(|i| ip(&format!("198.18.20.{i}"))).collect();
    assert_eq!(upper(&mut store), want);
    assert_eq!(store.held_gateways().unwrap().len(), 1);
    store.release("pods", "a", "eth0", NOW).unwrap();
    // .9 is back to the reservation; .14 stays out while the results
    // naming it live (their repeats return the same addresses), .8 and .15
    // are reserved.
    assert_eq!(upper(&mut store), want);
    assert!(store.held_gateways().unwrap().is_empty());
    assert_counters(&store);
    assert!(store.verify(Depth::Full).unwrap().is_ok());
}
