//! Upstream's store writing a Metis database after Metis (a rollback),
//! and `downgrade` readying one for it: what upstream's queries (by the
//! function that runs them, see docs/design.md) can reach.

use rusqlite::{OptionalExtension, params};

use super::*;
use crate::cidr::Bounds;

/// `cidr_blocks.state` of block `id`.
fn state(store: &Store, id: i64) -> String {
    store
        .conn
        .query_row("SELECT state FROM cidr_blocks WHERE id = ?1", [id], |r| {
            r.get(0)
        })
        .unwrap()
}

fn block_id(store: &Store, network: &str, prefix: &str) -> i64 {
    store
        .conn
        .query_row(
            "SELECT id FROM cidr_blocks WHERE network = ?1 AND cidr = ?2",
            params![network, prefix],
            |r| r.get(0),
        )
        .unwrap()
}

/// Upstream's `AllocateIP`: the lowest-id free, non-cooling row of the
/// network's Ready blocks of `family` with room, oldest block first.
pub(super) fn upstream_allocate(
    conn: &Connection,
    network: &str,
    family: &str,
    pod: &str,
    now: i64,
) -> Option<String> {
    let blocks: Vec<i64> = conn
        .prepare(
            "SELECT id FROM cidr_blocks WHERE network = ?1 AND ip_family = ?2 \
             AND total_ips > allocated_ips AND state = 'Ready' ORDER BY id",
        )
        .unwrap()
        .query_map(params![network, family], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for id in blocks {
        let row: Option<(i64, String)> = conn
            .query_row(
                "SELECT id, address FROM ip_addresses WHERE cidr_block_id = ?1 AND is_allocated = FALSE \
                 AND (release_at IS NULL OR release_at <= ?2) ORDER BY id LIMIT 1",
                params![id, now],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .unwrap();
        if let Some((row, address)) = row {
            conn.execute(
                "UPDATE ip_addresses SET is_allocated = TRUE, container_id = ?2, interface_name = 'eth0' WHERE id = ?1",
                params![row, pod],
            )
            .unwrap();
            conn.execute(
                "UPDATE cidr_blocks SET allocated_ips = allocated_ips + 1 WHERE id = ?1",
                [id],
            )
            .unwrap();
            return Some(address);
        }
    }
    None
}

/// Upstream's `expandIPv6Block`: up to 64 rows from (the highest-id row's
/// address) + 1, inside the prefix, no bounds. Err: the insert failed.
pub(super) fn upstream_expand(
    conn: &Connection,
    block: i64,
    prefix: &str,
) -> Result<u32, rusqlite::Error> {
    let cidr: Cidr = prefix.parse().unwrap();
    let last: String = conn.query_row(
        "SELECT address FROM ip_addresses WHERE cidr_block_id = ?1 ORDER BY id DESC LIMIT 1",
        [block],
        |r| r.get(0),
    )?;
    let start = crate::cidr::to_u128(ip(&last)) + 1;
    let mut inserted = 0;
    for value in start..start + 64 {
        let addr = crate::cidr::from_u128(Family::V6, value);
        if !cidr.contains(addr) {
            break;
        }
        conn.execute(
            "INSERT INTO ip_addresses (cidr_block_id, address, is_allocated, container_id, interface_name) \
             VALUES (?1, ?2, FALSE, '', '')",
            params![block, addr.to_string()],
        )?;
        inserted += 1;
    }
    Ok(inserted)
}

/// Addresses held by more than one row of `network`'s blocks.
fn held_twice(conn: &Connection) -> Vec<String> {
    conn.prepare(
        "SELECT a.address FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
         WHERE a.is_allocated = 1 GROUP BY a.address, b.network HAVING COUNT(*) > 1",
    )
    .unwrap()
    .query_map([], |r| r.get(0))
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

fn v6_range(store: &mut Store, network: &str, prefix: &str, start: &str, end: &str) {
    let block = cidr(prefix);
    let bounds = Bounds::new(&block, Some(ip(start)), Some(ip(end)), None).unwrap();
    store
        .set_bounds(network, Family::V6, &[(block, bounds)])
        .unwrap();
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network,
                family: Family::V6,
                ranges: &[block],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
}

#[test]
fn a_retired_block_is_withheld_from_every_upstream_query_and_healed_when_revived() {
    let dir = TempDir::new();
    let mut store = dir.store();
    let (old, new) = (cidr("198.18.12.0/28"), cidr("198.18.13.0/28"));
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "n",
                family: Family::V4,
                ranges: &[old],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    let held = alloc(&mut store, "n", "old-pod", Family::V4, NOW);
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "n",
                family: Family::V4,
                ranges: &[new],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    let retired = block_id(&store, "n", "198.18.12.0/28");
    assert_eq!(state(&store, retired), "Withheld");
    // Upstream's queries: UndrainOneCIDRBlock, ExpireDrainingCIDRBlocks,
    // DeleteCIDRBlock, AllocateIP's candidates — none selects it.
    let conn = &store.conn;
    let undrained = conn
        .execute(
            "UPDATE cidr_blocks SET state = 'Ready' WHERE network = 'n' AND state = 'Draining'",
            [],
        )
        .unwrap();
    let expired = conn
        .execute(
            "UPDATE cidr_blocks SET state = 'Deleting' WHERE state = 'Draining' AND allocated_ips = 0",
            [],
        )
        .unwrap();
    let deleted = conn
        .execute(
            "DELETE FROM cidr_blocks WHERE id = ?1 AND state = 'Deleting'",
            [retired],
        )
        .unwrap();
    assert_eq!((undrained, expired, deleted), (0, 0, 0));
    for i in 0..20 {
        if let Some(address) = upstream_allocate(conn, "n", "ipv4", &format!("up{i}"), NOW) {
            assert!(new.contains(ip(&address)), "{address}");
        }
    }
    assert_eq!(
        store.check("n", "old-pod", "eth0").unwrap()[0].address,
        held
    );

    // A file from before `Withheld` existed, where upstream's undrain made
    // the retired block Ready: the next open withholds it again, loudly.
    let mut store = reopened_with_state(
        store,
        &dir.db(),
        retired,
        "Ready",
        "was retired by Metis but is Ready again",
    );
    assert_eq!(store.rollback_repairs().revived_blocks, 1);
    // Metis allocates nothing from it; its pod keeps its address.
    store.release("n", "up0", "eth0", NOW).unwrap();
    let mut pods = 0;
    while let Ok(a) = store.allocate(&owner("n", &format!("m{pods}")), Family::V4, NOW) {
        assert!(new.contains(a.address), "{}", a.address);
        pods += 1;
    }
    assert!(pods > 0);
    assert_eq!(
        store.check("n", "old-pod", "eth0").unwrap()[0].address,
        held
    );
    // A file of an earlier release kept a retired block Draining: moved
    // quietly (not counted as revived), and said.
    let mut store = reopened_with_state(
        store,
        &dir.db(),
        retired,
        "Draining",
        "is retired by Metis but its state is Draining",
    );
    assert_eq!(store.rollback_repairs().revived_blocks, 0);
    // Configured again: Ready again.
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "n",
                family: Family::V4,
                ranges: &[old, new],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    assert_eq!(state(&store, retired), "Ready");
    drop(store);
    assert_eq!(
        dir.store().rollback_repairs(),
        crate::store::Healed::default()
    );
}

#[test]
fn a_quarantined_block_is_withheld_until_its_quarantine_lifts() {
    let (_dir, mut store) = store_with(&[("n", "198.18.14.0/28")]);
    let mut report = Report::default();
    report.suspects.insert(1, "a test said so".into());
    store.isolate_problems(&report, NOW).unwrap();
    assert_eq!(state(&store, 1), "Withheld");
    assert_eq!(upstream_allocate(&store.conn, "n", "ipv4", "up", NOW), None);
    store.isolate_problems(&Report::default(), NOW).unwrap();
    assert_eq!(state(&store, 1), "Ready");
}

#[test]
fn rows_upstream_expanded_past_range_end_are_reserved_and_never_handed_out_again() {
    let dir = TempDir::new();
    let mut store = dir.store();
    v6_range(
        &mut store,
        "v6",
        "2001:db8:1::/64",
        "2001:db8:1::100",
        "2001:db8:1::10f",
    );
    let block = block_id(&store, "v6", "2001:db8:1::/64");
    let inside: Vec<IpAddr> = (0..16)
        .map(|i| alloc(&mut store, "v6", &format!("m{i}"), Family::V6, NOW))
        .collect();
    assert!(
        inside
            .iter()
            .all(|a| *a >= ip("2001:db8:1::100") && *a <= ip("2001:db8:1::10f"))
    );
    drop(store);
    // Upstream: the range is full, so it expands after the highest-id row
    // (no bounds) and hands out 7 of the new rows.
    {
        let conn = Connection::open(dir.db()).unwrap();
        assert_eq!(
            upstream_expand(&conn, block, "2001:db8:1::/64").unwrap(),
            64
        );
        for i in 0..7 {
            upstream_allocate(&conn, "v6", "ipv6", &format!("up{i}"), NOW).unwrap();
        }
    }
    let report = check_file(&dir.db(), Depth::Full).unwrap();
    assert!(
        report.problems.iter().any(
            |p| p.contains("57 free row(s) outside rangeStart..rangeEnd")
                && p.contains("the next open reserves them")
        ),
        "{report:?}"
    );
    let mut store = dir.store();
    assert_eq!(store.rollback_repairs().rows_beyond_bounds, 57);
    // Metis continues with nothing beyond rangeEnd.
    assert!(
        store
            .allocate(&owner("v6", "next"), Family::V6, NOW)
            .is_err()
    );
    // Upstream's pods keep theirs; released, an address goes back to the
    // reservation instead of being handed out again.
    let theirs = store.check("v6", "up0", "eth0").unwrap()[0].address;
    assert!(!inside.contains(&theirs), "{theirs}");
    store.release("v6", "up0", "eth0", NOW).unwrap();
    store.release("v6", "m3", "eth0", NOW).unwrap();
    assert_eq!(
        alloc(&mut store, "v6", "again", Family::V6, NOW),
        inside[3],
        "the range's own address comes back, never upstream's"
    );
    assert!(
        store
            .allocate(&owner("v6", "more"), Family::V6, NOW)
            .is_err()
    );
    let report = store.verify(Depth::Full).unwrap();
    let named: Vec<&String> = report
        .notes
        .iter()
        .filter(|p| {
            p.contains("outside rangeStart..rangeEnd") && p.contains("is held by container")
        })
        .collect();
    assert_eq!(named.len(), 6, "{report:?}");
    // Named, not quarantined: the range goes on serving its own addresses.
    assert!(report.suspects.is_empty(), "{report:?}");
    assert_counters(&store);
}

#[test]
fn rows_of_a_small_ipv6_block_upstream_added_later_are_removed_when_free() {
    let dir = TempDir::new();
    let mut store = dir.store();
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "v6",
                family: Family::V6,
                ranges: &[cidr("2001:db8:2::/64")],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    drop(store);
    // Upstream's AddCIDR of a /127: 64 rows from the base; it then hands
    // out an address outside the /127.
    {
        let conn = Connection::open(dir.db()).unwrap();
        conn.execute(
            "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips, state) \
             VALUES ('2001:db8:3::/127', 'small', 'ipv6', 2, 0, 'Ready')",
            [],
        )
        .unwrap();
        let id = conn.last_insert_rowid();
        for i in 0..64u128 {
            let addr =
                crate::cidr::from_u128(Family::V6, crate::cidr::to_u128(ip("2001:db8:3::")) + i);
            conn.execute(
                "INSERT INTO ip_addresses (cidr_block_id, address, is_allocated, container_id, interface_name) \
                 VALUES (?1, ?2, FALSE, '', '')",
                params![id, addr.to_string()],
            )
            .unwrap();
        }
        upstream_allocate(&conn, "small", "ipv6", "up0", NOW).unwrap();
        upstream_allocate(&conn, "small", "ipv6", "up1", NOW).unwrap();
        // up0 released with upstream's cooldown: the next lowest-id free,
        // non-cooling row lies outside the /127.
        conn.execute_batch(&format!(
            "UPDATE ip_addresses SET is_allocated = FALSE, release_at = {} WHERE container_id = 'up0'; \
             UPDATE cidr_blocks SET allocated_ips = allocated_ips - 1 WHERE network = 'small'",
            NOW + 60_000
        ))
        .unwrap();
        let outside = upstream_allocate(&conn, "small", "ipv6", "up2", NOW).unwrap();
        assert_eq!(outside, "2001:db8:3::2");
    }
    let mut store = dir.store();
    assert_eq!(store.rollback_repairs().rows_outside_prefix, 61);
    assert!(
        store
            .open_warnings()
            .iter()
            .any(|w| w.contains("2001:db8:3::2") && w.contains("up2")),
        "{:?}",
        store.open_warnings()
    );
    store.release("small", "up2", "eth0", NOW).unwrap();
    let left: i64 = store
        .conn
        .query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE address = '2001:db8:3::2'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(left, 0, "released, the out-of-prefix row is gone");
    assert_counters(&store);
    assert!(store.verify(Depth::Full).unwrap().is_ok());
}

#[test]
fn downgrade_readies_the_file_for_upstream_and_is_idempotent() {
    let dir = TempDir::new();
    let mut store = dir.store();
    // A bounded IPv4 /24 populated lazily, a pod in a block then retired,
    // a quarantined block, and a bounded IPv6 range.
    let wide = cidr("198.18.30.0/24");
    let bounds = Bounds::new(
        &wide,
        Some(ip("198.18.30.10")),
        Some(ip("198.18.30.200")),
        None,
    )
    .unwrap();
    store
        .set_bounds("v4", Family::V4, &[(wide, bounds)])
        .unwrap();
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "v4",
                family: Family::V4,
                ranges: &[wide, cidr("198.18.31.0/28")],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    for i in 0..5 {
        alloc(&mut store, "v4", &format!("m{i}"), Family::V4, NOW);
    }
    store
        .allocate_requested(&owner("v4", "old"), ip("198.18.31.5"), NOW)
        .unwrap();
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "v4",
                family: Family::V4,
                ranges: &[wide],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    store.add_cidr_block("q", &cidr("198.18.32.0/28")).unwrap();
    let mut report = Report::default();
    report.suspects.insert(
        block_id(&store, "q", "198.18.32.0/28"),
        "a test said so".into(),
    );
    store.isolate_problems(&report, NOW).unwrap();
    v6_range(
        &mut store,
        "v6",
        "2001:db8:4::/64",
        "2001:db8:4::100",
        "2001:db8:4::1ff",
    );
    alloc(&mut store, "v6", "m6", Family::V6, NOW);
    let rows_before: i64 = store
        .conn
        .query_row("SELECT COUNT(*) FROM ip_addresses", [], |r| r.get(0))
        .unwrap();
    assert!(rows_before < 256 + 16, "lazily populated: {rows_before}");

    let done = store.downgrade(NOW).unwrap();
    assert!(!done.done.is_empty(), "{done:?}");
    assert_counters(&store);
    let report = store.verify(Depth::Full).unwrap();
    assert!(
        report
            .problems
            .iter()
            .all(|p| p.contains("is quarantined: a test said so")),
        "{report:?}"
    );
    // Idempotent.
    assert_eq!(
        store.downgrade(NOW).unwrap(),
        upkeep::downgrade::Downgraded::default()
    );
    drop(store);

    // Upstream from here on: every usable address, nothing else, nothing
    // twice; no IPv6 address past rangeEnd.
    let conn = Connection::open(dir.db()).unwrap();
    let mut v4 = Vec::new();
    while let Some(a) = upstream_allocate(&conn, "v4", "ipv4", &format!("u{}", v4.len()), NOW) {
        v4.push(ip(&a));
    }
    assert_eq!(
        v4.len(),
        191 - 5,
        "every usable address of the range but the pods'"
    );
    assert!(
        v4.iter()
            .all(|a| *a >= ip("198.18.30.10") && *a <= ip("198.18.30.200"))
    );
    assert_eq!(upstream_allocate(&conn, "q", "ipv4", "uq", NOW), None);
    let mut v6 = Vec::new();
    loop {
        if let Some(a) = upstream_allocate(&conn, "v6", "ipv6", &format!("w{}", v6.len()), NOW) {
            v6.push(ip(&a));
            continue;
        }
        let block: i64 = conn
            .query_row("SELECT id FROM cidr_blocks WHERE network = 'v6'", [], |r| {
                r.get(0)
            })
            .unwrap();
        let expanded = upstream_expand(&conn, block, "2001:db8:4::/64");
        assert!(
            expanded.is_err(),
            "upstream's expansion must fail: {expanded:?}"
        );
        break;
    }
    assert_eq!(v6.len(), 255);
    assert!(
        v6.iter()
            .all(|a| *a >= ip("2001:db8:4::100") && *a <= ip("2001:db8:4::1ff"))
    );
    assert_eq!(held_twice(&conn), Vec::<String>::new());
}

#[test]
fn a_gateway_row_just_above_range_end_is_reported_as_upstreams_dead_end() {
    let dir = TempDir::new();
    let mut store = dir.store();
    let block = cidr("2001:db8:5::/64");
    let bounds = Bounds::new(
        &block,
        Some(ip("2001:db8:5::100")),
        Some(ip("2001:db8:5::103")),
        Some(ip("2001:db8:5::104")),
    )
    .unwrap();
    store
        .set_bounds("v6", Family::V6, &[(block, bounds)])
        .unwrap();
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "v6",
                family: Family::V6,
                ranges: &[block],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    let hazards = store.upstream_hazards().unwrap();
    assert_eq!(hazards.len(), 1, "{hazards:?}");
    assert!(
        hazards[0].contains("gateway row 2001:db8:5::104 sits just above rangeEnd 2001:db8:5::103")
    );
    let done = store.downgrade(NOW).unwrap();
    assert!(done.warnings.iter().any(|w| w == &hazards[0]), "{done:?}");
    // Upstream, once the range is used up: its expansion fails, nothing
    // past the range is handed out.
    let id = block_id(&store, "v6", "2001:db8:5::/64");
    let mut got = Vec::new();
    while let Some(a) =
        upstream_allocate(&store.conn, "v6", "ipv6", &format!("u{}", got.len()), NOW)
    {
        got.push(ip(&a));
    }
    assert_eq!(got.len(), 4, "{got:?}");
    assert!(upstream_expand(&store.conn, id, "2001:db8:5::/64").is_err());
    // Without bounds there is nothing to say.
    let (_dir, plain) = store_with(&[("p", "2001:db8:6::/64")]);
    assert!(plain.upstream_hazards().unwrap().is_empty());
}

/// Metis itself hands addresses out under a conflist without bounds, then
/// a conflist of the network narrows them: the pods past the new
/// `rangeEnd` keep their addresses, and `admin check` names each as a note
/// — outside the bounds now in force, blaming no one (upstream wrote
/// nothing here) — and fails on nothing.
#[test]
fn bounds_narrowed_under_pods_are_a_note_that_blames_no_one() {
    let dir = TempDir::new();
    let mut store = dir.store();
    let block = cidr("2001:db8:40::/124");
    store
        .configure(
            &crate::store::Wish {
                source: Source::Cni,
                network: "pods",
                family: Family::V6,
                ranges: &[block],
                isolated: false,
            },
            NOW,
        )
        .unwrap();
    let held: Vec<IpAddr> = (0..6)
        .map(|i| alloc(&mut store, "pods", &format!("p{i}"), Family::V6, NOW))
        .collect();
    assert!(held.contains(&ip("2001:db8:40::7")), "{held:?}");
    v6_range(
        &mut store,
        "pods",
        "2001:db8:40::/124",
        "2001:db8:40::2",
        "2001:db8:40::4",
    );
    drop(store);
    let report = check_file(&dir.db(), Depth::Full).unwrap();
    assert!(report.problems.is_empty(), "{report:?}");
    let named: Vec<&String> = report
        .notes
        .iter()
        .filter(|n| n.contains("outside rangeStart..rangeEnd now in force"))
        .collect();
    assert!(!named.is_empty(), "{report:?}");
    assert!(named.iter().all(|n| !n.contains("upstream")), "{named:?}");
}

/// Sets the retired block `id` to `block_state` behind Metis's back (as a
/// file of another release would have it), reopens, and checks that the
/// open withheld it again with a warning containing `warning`.
fn reopened_with_state(
    store: Store,
    db: &std::path::Path,
    id: i64,
    block_state: &str,
    warning: &str,
) -> Store {
    store
        .conn
        .execute(
            "UPDATE cidr_blocks SET state = ?1 WHERE id = ?2",
            params![block_state, id],
        )
        .unwrap();
    drop(store);
    let store = Store::open(db, &StoreOptions::default()).unwrap();
    assert_eq!(state(&store, id), "Withheld");
    assert!(
        store.open_warnings().iter().any(|w| w.contains(warning)),
        "{:?}",
        store.open_warnings()
    );
    store
}

/// Upstream's IPv6 expansion inserts up to 64 addresses after the
/// block's highest-id row. After requested addresses (the last one the
/// lowest), a downgrade writes the holes below the highest address and
/// gives that address the highest id: the expansion starts past every
/// row, the holes serve upstream as free rows, and a second run has
/// nothing to do.
#[test]
fn downgrade_lets_upstreams_ipv6_expansion_pass_every_requested_address() {
    let (dir, mut store) = store_with(&[("v6", "2001:db8::/120")]);
    for (i, wanted) in ["2001:db8::50", "2001:db8::c8", "2001:db8::41"]
        .iter()
        .enumerate()
    {
        store
            .allocate_requested(&owner("v6", &format!("r{i}")), ip(wanted), NOW)
            .unwrap();
    }
    let hazard = "upstream's IPv6 expansion starts after its highest-id row 2001:db8::41 and \
                  would meet the row of 2001:db8::c8";
    let report = check_file(&dir.db(), Depth::Full).unwrap();
    assert!(
        report.notes.iter().any(|n| n.contains(hazard)),
        "{report:?}"
    );
    let done = store.downgrade(NOW).unwrap();
    assert!(
        done.done
            .iter()
            .any(|l| l.contains("2001:db8::c8 (its highest address)")),
        "{done:?}"
    );
    assert_counters(&store);
    let block_id = store
        .find_block("v6", &cidr("2001:db8::/120"))
        .unwrap()
        .unwrap();
    let (top_id, top): (i64, String) = store
        .conn
        .query_row(
            "SELECT id, address FROM ip_addresses WHERE cidr_block_id = ?1 ORDER BY id DESC LIMIT 1",
            [block_id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(top, "2001:db8::c8", "row {top_id}");
    // Every address up to the highest has its row: upstream serves them.
    let below: i64 = store
        .conn
        .query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE cidr_block_id = ?1",
            [block_id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(below, 0xc8 + 1);
    // Upstream's expansion from ::c9 meets no row of the block.
    for offset in 0xc9..=0xff_u32 {
        let taken: bool = store
            .conn
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM ip_addresses WHERE address = ?1)",
                [format!("2001:db8::{offset:x}")],
                |r| r.get(0),
            )
            .unwrap();
        assert!(!taken, "2001:db8::{offset:x}");
    }
    assert_eq!(store.downgrade(NOW).unwrap().done, Vec::<String>::new());
    drop(store);
    let report = check_file(&dir.db(), Depth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert!(
        !report.notes.iter().any(|n| n.contains("before a rollback")),
        "{report:?}"
    );
}

/// A requested address deep in a /64: the rows below it are too many to
/// write, so the downgrade says so, and still gives it the highest id.
#[test]
fn downgrade_names_the_holes_it_cannot_write_below_a_deep_ipv6_address() {
    let (_dir, mut store) = store_with(&[("v6", "2001:db8:1::/64")]);
    for (i, wanted) in ["2001:db8:1::1:86a0", "2001:db8:1::50"].iter().enumerate() {
        store
            .allocate_requested(&owner("v6", &format!("r{i}")), ip(wanted), NOW)
            .unwrap();
    }
    let done = store.downgrade(NOW).unwrap();
    assert!(
        done.warnings
            .iter()
            .any(|w| w.contains("more than 65536 addresses into the block")),
        "{done:?}"
    );
    let top: String = store
        .conn
        .query_row(
            "SELECT address FROM ip_addresses ORDER BY id DESC LIMIT 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(top, "2001:db8:1::1:86a0");
    assert!(store.downgrade(NOW).unwrap().done.is_empty());
}

/// Two conflists of one subnet with different gateways (.6 recorded as the
/// block's bounds, .9 named by the other's results): .9 is an ordinary
/// free row to upstream. `admin check` names the hazard; the downgrade
/// reserves it and says so; upstream never hands it out and the check of
/// the downgraded file is clean, with a note. Metis's next open frees the
/// reservation, its record still keeping .9 out while the result lives.
#[test]
fn downgrade_reserves_the_gateways_live_results_name() {
    let (dir, mut store) = store_with(&[("pods", "198.18.40.0/28")]);
    let range = cidr("198.18.40.0/28");
    let gateway = |gw: &str| Bounds {
        start: ip("198.18.40.1"),
        end: ip("198.18.40.14"),
        gateway: ip(gw),
    };
    store
        .set_bounds("pods", Family::V4, &[(range, gateway("198.18.40.6"))])
        .unwrap();
    let other = InForce {
        ranges: vec![range],
        bounds: vec![(range, gateway("198.18.40.9"))],
    };
    let named = store
        .allocate_under(&owner("pods", "b"), Family::V4, Some(&other), NOW)
        .unwrap()
        .address;
    drop(store);
    let report = check_file(&dir.db(), Depth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert!(
        report.notes.iter().any(|n| n.starts_with(
            "before a rollback: 198.18.40.9 of block 1, the gateway 1 live result(s) name"
        )),
        "{report:?}"
    );
    let mut store = dir.store();
    let done = store.downgrade(NOW).unwrap();
    assert!(
        done.done.iter().any(|l| l
            == "block 1: 198.18.40.9, the gateway 1 live result(s) name: reserved, so that upstream \
                never hands it out (Metis's next start frees it)"),
        "{done:?}"
    );
    assert_counters(&store);
    drop(store);
    let report = check_file(&dir.db(), Depth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert!(
        report
            .notes
            .iter()
            .any(|n| n.contains("198.18.40.9") && n.contains("reserved by `metis admin downgrade`")),
        "{report:?}"
    );
    // Upstream: every address of .1 to .14 but b's and the two gateways,
    // then nothing.
    let conn = Connection::open(dir.db()).unwrap();
    let mut handed = Vec::new();
    while let Some(address) = upstream_allocate(&conn, "pods", "ipv4", "u", NOW) {
        handed.push(address);
    }
    assert_eq!(handed.len(), 14 - 3, "{handed:?}");
    assert!(
        !handed
            .iter()
            .any(|a| a == "198.18.40.9" || a == "198.18.40.6"),
        "{handed:?}"
    );
    // Upstream's pods go; Metis opens the file again.
    conn.execute(
        "UPDATE ip_addresses SET is_allocated = 0 WHERE container_id = 'u'",
        [],
    )
    .unwrap();
    conn.execute(
        "UPDATE cidr_blocks SET allocated_ips = allocated_ips - ?1 WHERE id = 1",
        [i64::try_from(handed.len()).unwrap()],
    )
    .unwrap();
    drop(conn);
    let mut store = dir.store();
    let fenced: bool = store
        .conn
        .query_row(
            "SELECT is_allocated FROM ip_addresses WHERE address = '198.18.40.9'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(!fenced, "the next open frees the reservation");
    assert_counters(&store);
    // Under the conflist of the recorded bounds (gateway .6), whose
    // results name a reserved row.
    let recorded = InForce {
        ranges: vec![range],
        bounds: vec![(range, gateway("198.18.40.6"))],
    };
    let allocate = |store: &mut Store, pod: &str| {
        store
            .allocate_under(&owner("pods", pod), Family::V4, Some(&recorded), NOW)
            .map(|a| a.address)
    };
    let mut got = Vec::new();
    while let Ok(address) = allocate(&mut store, &format!("m{}", got.len())) {
        got.push(address);
    }
    assert_eq!(got.len(), 14 - 3, "{got:?}");
    assert!(!got.contains(&ip("198.18.40.9")), "{got:?}");
    store.release("pods", "b", "eth0", NOW).unwrap();
    let after = [
        allocate(&mut store, "x").unwrap(),
        allocate(&mut store, "y").unwrap(),
    ];
    assert_eq!(after, [named, ip("198.18.40.9")]);
}

/// Pods of "other" hold addresses through a /29 upstream added inside
/// "pods"'s /28, and a pod of "pods" one the /29 covers (both networks
/// share the node's address space): downgrade reserves every free twin,
/// so upstream never hands one out, `check` says whose doing the
/// reservations are, and Metis's next open frees them.
#[test]
fn downgrade_reserves_the_free_twins_of_addresses_held_through_an_overlapping_block() {
    let (dir, mut store) = store_with(&[("pods", "198.18.40.0/28")]);
    let first = store
        .allocate(&owner("pods", "p0"), Family::V4, NOW)
        .unwrap()
        .address;
    // Upstream's AddCIDR, its network and broadcast rows reserved as
    // Metis's repair leaves them.
    let other = super::upstream::upstream_overlapping_block(&store);
    store
        .conn
        .execute(
            "UPDATE ip_addresses SET is_allocated = 1 WHERE cidr_block_id = ?1 \
             AND address IN ('198.18.40.0', '198.18.40.7')",
            [other],
        )
        .unwrap();
    store
        .conn
        .execute(
            "UPDATE cidr_blocks SET allocated_ips = 2 WHERE id = ?1",
            [other],
        )
        .unwrap();
    // Metis hands "other" the lowest addresses no row of the space holds.
    let held = ["o1", "o2"].map(|pod| {
        store
            .allocate(&owner("other", pod), Family::V4, NOW)
            .unwrap()
            .address
    });
    assert!(!held.contains(&first));
    let done = store.downgrade(NOW).unwrap();
    for address in [first, held[0], held[1]] {
        assert!(
            done.done
                .iter()
                .any(|l| l.contains(&format!(": {address}, held by container"))),
            "{address}: {done:?}"
        );
    }
    assert_counters(&store);
    drop(store);
    // The overlap itself is reported (the daemon quarantines such
    // blocks), the reservations only noted.
    let report = check_file(&dir.db(), Depth::Full).unwrap();
    let overlap = |p: &String| p.contains("overlaps block") && p.contains("both hold pods");
    assert!(report.problems.iter().all(overlap), "{report:?}");
    let fenced = |n: &&String| n.contains("held by a pod through an overlapping block");
    assert_eq!(report.notes.iter().filter(fenced).count(), 3, "{report:?}");
    // Upstream's "pods" hands out no address a pod holds.
    let conn = Connection::open(dir.db()).unwrap();
    let mut handed = Vec::new();
    while let Some(address) = upstream_allocate(&conn, "pods", "ipv4", "u", NOW) {
        handed.push(address);
    }
    let taken = [first, held[0], held[1]].map(|a| a.to_string());
    assert!(!handed.iter().any(|a| taken.contains(a)), "{handed:?}");
    // .5 to .14 (.1 its gateway, .2 p0's, .3 and .4 reserved).
    assert_eq!(handed.len(), 10, "{handed:?}");
    conn.execute(
        "UPDATE ip_addresses SET is_allocated = 0, container_id = '' WHERE container_id = 'u'",
        [],
    )
    .unwrap();
    conn.execute(
        "UPDATE cidr_blocks SET allocated_ips = \
         (SELECT COUNT(*) FROM ip_addresses WHERE cidr_block_id = cidr_blocks.id AND is_allocated = 1)",
        [],
    )
    .unwrap();
    drop(conn);
    // Metis again: the reservations go (the overlapping blocks are its
    // to quarantine).
    let store = dir.store();
    assert_counters(&store);
    let stray: i64 = store
        .conn
        .query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE is_allocated = 1 AND container_id = '' \
             AND address NOT IN ('198.18.40.0', '198.18.40.1', '198.18.40.7', '198.18.40.15')",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(stray, 0, "the next open frees the reservations");
}
