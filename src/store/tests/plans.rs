//! Query plans of the allocation path: no scan, no re-preparing.

use super::*;

/// The plan of `sql` with every parameter NULL, one step per line.
fn plan_of(store: &Store, sql: &str) -> Vec<String> {
    let mut stmt = store
        .conn
        .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
        .unwrap();
    let nulls = std::iter::repeat_n(rusqlite::types::Null, stmt.parameter_count());
    stmt.query_map(rusqlite::params_from_iter(nulls), |r| r.get::<_, String>(3))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// Both tiers of a claim read Metis's index of free rows: no cooling row
/// is stepped over.
#[test]
fn claims_read_the_free_rows_index() {
    let dir = TempDir::new();
    let store = dir.store();
    for sql in [
        crate::store::alloc::allocate::CLAIM_SQL,
        crate::store::alloc::allocate::COOLED_SQL,
    ] {
        let plan = plan_of(&store, sql);
        assert!(
            plan.iter().any(|p| p.contains("metis_free_addresses")),
            "{sql}\n{plan:?}"
        );
        assert!(
            !plan.iter().any(|p| p.contains("TEMP B-TREE")),
            "{sql}\n{plan:?}"
        );
    }
}

#[test]
fn cached_statements_are_not_reprepared() {
    let (_dir, mut store) =
        store_with(&[("default", "198.18.90.0/24"), ("default", "198.18.91.0/24")]);
    for i in 0..5 {
        let cid = format!("c{i}");
        alloc(&mut store, "default", &cid, Family::V4, 1000 + i);
        store.release("default", &cid, "eth0", 1000 + i).unwrap();
    }
    let claim = store
        .conn
        .prepare_cached(crate::store::alloc::allocate::CLAIM_SQL)
        .unwrap();
    assert_eq!(claim.get_status(rusqlite::StatementStatus::RePrepare), 0);
}

#[test]
fn allocation_path_never_scans_the_address_table() {
    let dir = TempDir::new();
    let store = dir.store();
    for sql in crate::store::alloc::allocate::ALLOCATION_PATH {
        let plan = plan_of(&store, sql);
        // `a` is ip_addresses in the joins, `g` metis_gateways (a row per
        // live allocation); cidr_blocks has one row per block and
        // upstream's schema gives it no index by network.
        let scans_addresses = plan.iter().any(|step| {
            step.starts_with("SCAN ip_addresses")
                || step.starts_with("SCAN metis_gateways")
                || ["SCAN a", "SCAN g"]
                    .iter()
                    .any(|scan| step == scan || step.starts_with(&format!("{scan} ")))
        });
        assert!(!scans_addresses, "{sql}\n{plan:?}");
    }
}
