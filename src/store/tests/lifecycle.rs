//! Drain, undrain, expire and delete; usage and network queries.

use super::*;

#[test]
fn lifecycle_drain_undrain_expire_delete() {
    let (_dir, mut store) = store_with(&[
        ("default", "198.18.1.0/29"),
        ("default", "198.18.2.0/29"),
        ("default", "198.18.3.0/29"),
    ]);
    // Fill block 1 so the next lands in block 2.
    for i in 0..5 {
        alloc(&mut store, "default", &format!("f{i}"), Family::V4, NOW);
    }
    assert_eq!(
        alloc(&mut store, "default", "p", Family::V4, NOW),
        ip("198.18.2.2")
    );
    assert!(store.drain_block(2, wall_ms()).unwrap());
    assert!(store.drain_block(3, wall_ms()).unwrap());
    assert!(!store.drain_block(99, wall_ms()).unwrap());
    assert_eq!(block(&store, 2).state, BlockState::Draining);
    assert_eq!(
        store.undrain_one("default", Family::V6, wall_ms()).unwrap(),
        None
    );
    assert_eq!(
        store.undrain_one("default", Family::V4, wall_ms()).unwrap(),
        Some(2)
    );
    assert_eq!(block(&store, 2).state, BlockState::Ready);
    assert_eq!(block(&store, 3).state, BlockState::Draining);
    assert!(store.drain_block(2, wall_ms()).unwrap());

    let exp = 60_000;
    // Not yet expired.
    assert!(
        store
            .expire_draining("default", Family::V4, exp, wall_ms() + exp - 5_000)
            .unwrap()
            .is_empty()
    );
    // Block 2 still has a pod; block 3 has only reservations.
    let later = wall_ms() + exp + 5_000;
    let expired = store
        .expire_draining("default", Family::V4, exp, later)
        .unwrap();
    assert_eq!(expired.len(), 1);
    assert_eq!((expired[0].id, expired[0].state), (3, BlockState::Deleting));
    assert_eq!(expired[0].cidr, "198.18.3.0/29");
    assert_eq!(
        store.deleting_blocks("default", Family::V4).unwrap(),
        expired
    );
    // Release restarts the clock of block 2 (updated_at trigger).
    store.release("default", "p", "eth0", wall_ms()).unwrap();
    assert!(
        store
            .expire_draining("default", Family::V4, exp, wall_ms() + exp - 5_000)
            .unwrap()
            .is_empty()
    );
    let expired = store
        .expire_draining("default", Family::V4, exp, wall_ms() + exp + 5_000)
        .unwrap();
    assert_eq!(expired.iter().map(|b| b.id).collect::<Vec<_>>(), vec![2]);
    // Delete only Deleting blocks; rows cascade.
    assert!(!store.delete_block(1).unwrap());
    assert!(store.delete_block(3).unwrap());
    assert!(!store.delete_block(3).unwrap());
    let remaining: i64 = store
        .conn
        .query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE cidr_block_id = 3",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(remaining, 0);
    assert_eq!(store.blocks(&BlockFilter::default()).unwrap().len(), 2);
    assert_eq!(store.networks().unwrap(), vec!["default".to_string()]);
    assert_counters(&store);
}

#[test]
fn usage_example_from_reference() {
    let first_block = opts(Some(ReserveMode::FirstBlock), Some(30_000));
    let (_dir, mut store) = store_opts_with(
        &first_block,
        &[("default", "198.18.1.0/29"), ("default", "198.18.2.0/29")],
    );
    alloc(&mut store, "default", "active", Family::V4, NOW);
    alloc(&mut store, "default", "cooling", Family::V4, NOW);
    store.release("default", "cooling", "eth0", NOW).unwrap();
    store.drain_block(2, NOW).unwrap();
    let usage = store.usage("default", Family::V4, NOW + 1).unwrap();
    assert_eq!(
        usage,
        Usage {
            allocated: 1,
            reserved: 3,
            cooldown: 1,
            total: 16,
            addresses: 16,
            draining: 8
        }
    );
    assert_eq!(
        store.usage("default", Family::V6, NOW).unwrap(),
        Usage::default()
    );
    // Deleting blocks are excluded.
    store
        .conn
        .execute("UPDATE cidr_blocks SET state = 'Deleting' WHERE id = 2", [])
        .unwrap();
    let usage = store.usage("default", Family::V4, NOW + 1).unwrap();
    assert_eq!(
        usage,
        Usage {
            allocated: 1,
            reserved: 3,
            cooldown: 1,
            total: 8,
            addresses: 8,
            draining: 0
        }
    );
    // Saturating totals.
    add_blocks(
        &mut store,
        &[("default", "2001:db8::/64"), ("default", "2001:db8:1::/64")],
    );
    let v6 = store.usage("default", Family::V6, NOW).unwrap();
    assert_eq!(v6.total, i64::MAX, "upstream's column saturates");
    assert_eq!(v6.addresses, 2 << 64, "the real size does not");
}

#[test]
fn networks_and_ready_blocks_order() {
    let (_dir, mut store) = store_with(&[
        ("zeta", "198.18.1.0/29"),
        ("alpha", "198.18.2.0/29"),
        ("alpha", "198.18.3.0/29"),
        ("gone", "198.18.4.0/29"),
        ("alpha", "198.18.5.0/29"),
    ]);
    store
        .conn
        .execute("UPDATE cidr_blocks SET state = 'Deleting' WHERE id = 4", [])
        .unwrap();
    store.drain_block(5, NOW).unwrap();
    assert_eq!(store.networks().unwrap(), vec!["alpha", "zeta"]);
    let ids: Vec<i64> = store
        .ready_blocks_newest_first("alpha", Family::V4)
        .unwrap()
        .iter()
        .map(|b| b.id)
        .collect();
    assert_eq!(ids, vec![3, 2]);
}
