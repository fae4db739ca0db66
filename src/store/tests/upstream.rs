//! A database upstream Metis wrote is repaired and served.

use super::*;

/// Upstream's schema as upstream ships it (a hand copy, apart from
/// Metis's own, so a change to Metis's copy cannot hide here).
const UPSTREAM_SCHEMA: &str = include_str!("../../../testdata/upstream-schema-v1.sql");

/// A file with upstream's schema and its first block as upstream writes
/// it: 198.18.1.0/29 of network default, every row, .0 .1 .7 reserved.
fn upstream_with_first_block(path: &Path) -> Connection {
    let conn = Connection::open(path).unwrap();
    conn.execute_batch(UPSTREAM_SCHEMA).unwrap();
    conn.execute(
        "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips) VALUES ('198.18.1.0/29', 'default', 'ipv4', 8, 3)",
        [],
    )
    .unwrap();
    for i in 0..8 {
        let reserved = i == 0 || i == 1 || i == 7;
        conn.execute(
            "INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) VALUES (?1, 1, '', '', ?2)",
            rusqlite::params![format!("198.18.1.{i}"), reserved],
        )
        .unwrap();
    }
    conn
}

#[test]
fn upstream_database_is_repaired_and_served() {
    let dir = TempDir::new();
    let path = dir.db();
    let upstream_tables: Vec<String>;
    {
        let conn = upstream_with_first_block(&path);
        // Block 2: unreserved; .1 held by a pod.
        conn.execute(
            "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips) VALUES ('198.18.2.0/29', 'default', 'ipv4', 8, 1)",
            [],
        )
        .unwrap();
        for i in 0..8 {
            let (cid, ifname, allocated) = if i == 1 {
                ("pod-x", "eth0", true)
            } else {
                ("", "", false)
            };
            conn.execute(
                "INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated, allocated_at) VALUES (?1, 2, ?2, ?3, ?4, ?5)",
                rusqlite::params![format!("198.18.2.{i}"), cid, ifname, allocated, NOW],
            )
            .unwrap();
        }
        // Block 3: upstream's /127 with a full batch of 64 rows (62 out of prefix).
        conn.execute(
            "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips) VALUES ('2001:db8::/127', 'default', 'ipv6', 2, 0)",
            [],
        )
        .unwrap();
        for i in 0..64u32 {
            conn.execute(
                "INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) VALUES (?1, 3, '', '', 0)",
                [std::net::Ipv6Addr::from(0x2001_0db8_u128 << 96 | u128::from(i)).to_string()],
            )
            .unwrap();
        }
        upstream_tables = conn
            .prepare("SELECT sql FROM sqlite_master WHERE name IN ('cidr_blocks', 'ip_addresses') ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
    }

    let mut store = dir.store_with_cooldown(30_000);
    assert_eq!(store.reserve_mode(), ReserveMode::EveryBlock);
    assert_eq!(
        reserved_addrs(&store, 1),
        vec!["198.18.1.0", "198.18.1.1", "198.18.1.7"]
    );
    assert_eq!(reserved_addrs(&store, 2), vec!["198.18.2.0", "198.18.2.7"]);
    let held = &rows(&store, 2)[1];
    assert_eq!(
        (held.0.as_str(), held.1, held.2.as_str()),
        ("198.18.2.1", true, "pod-x")
    );
    assert_eq!(block(&store, 2).allocated_ips, 3);
    // Loudly: the pod left at a reserved position, and upstream's rows of
    // the /127 outside its prefix, deleted.
    assert_eq!(
        store.open_warnings().len(),
        2,
        "{:?}",
        store.open_warnings()
    );
    assert!(store.open_warnings()[0].contains("198.18.2.1"));
    assert!(store.open_warnings()[0].contains("pod-x"));
    assert!(
        store.open_warnings()[1]
            .contains("62 free row(s) outside the prefix (upstream's rows of a /127 or /128), from 2001:db8::2; deleted"),
        "{:?}",
        store.open_warnings()
    );
    assert_eq!(store.rollback_repairs().rows_outside_prefix, 62);
    assert_eq!(
        rows(&store, 3)
            .iter()
            .map(|r| r.0.clone())
            .collect::<Vec<_>>(),
        vec!["2001:db8::", "2001:db8::1"]
    );
    assert_counters(&store);
    let tables_after: Vec<String> = store
        .conn
        .prepare("SELECT sql FROM sqlite_master WHERE name IN ('cidr_blocks', 'ip_addresses') ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(tables_after, upstream_tables);

    // Served: the held pod is recognised, new pods get non-reserved
    // addresses, first block first; the second block's results name a
    // stand-in (its highest address, .6) while pod-x holds its gateway.
    assert_eq!(
        store.check("default", "pod-x", "eth0").unwrap()[0].address,
        ip("198.18.2.1")
    );
    let held = store.held_gateways().unwrap();
    assert_eq!(held.len(), 1);
    assert_eq!(
        (held[0].block_id, held[0].container_id.as_str()),
        (2, "pod-x")
    );
    let got: Vec<IpAddr> = (0..5)
        .map(|i| alloc(&mut store, "default", &format!("c{i}"), Family::V4, NOW))
        .collect();
    let want: Vec<IpAddr> = [
        "198.18.1.2",
        "198.18.1.3",
        "198.18.1.4",
        "198.18.1.5",
        "198.18.1.6",
    ]
    .iter()
    .map(|s| ip(s))
    .collect();
    assert_eq!(got, want);
    let c5 = store
        .allocate(&owner("default", "c5"), Family::V4, NOW)
        .unwrap();
    assert_eq!(
        (c5.address, c5.gateway),
        (ip("198.18.2.2"), Some(ip("198.18.2.6")))
    );
    // pod-x's repeated ADD returns its address, naming the stand-in too.
    let x = store
        .allocate(&owner("default", "pod-x"), Family::V4, NOW)
        .unwrap();
    assert_eq!(
        (x.address, x.gateway),
        (ip("198.18.2.1"), Some(ip("198.18.2.6")))
    );
    assert_eq!(
        alloc(&mut store, "default", "v6", Family::V6, NOW),
        ip("2001:db8::")
    );
    // Releasing the held reserved position returns it to the reservation;
    // results name the block's own gateway again, and the stand-in stays
    // out while c5's result names it.
    let released = store.release("default", "pod-x", "eth0", NOW).unwrap();
    assert_eq!(released.addresses[0].address, ip("198.18.2.1"));
    assert_eq!(
        reserved_addrs(&store, 2),
        vec!["198.18.2.0", "198.18.2.1", "198.18.2.7"]
    );
    assert!(store.held_gateways().unwrap().is_empty());
    let got: Vec<Allocation> = (6..9)
        .map(|i| {
            store
                .allocate(&owner("default", &format!("c{i}")), Family::V4, NOW)
                .unwrap()
        })
        .collect();
    let want: Vec<Allocation> = (3..6)
        .map(|i| Allocation {
            address: ip(&format!("198.18.2.{i}")),
            block: cidr("198.18.2.0/29"),
            gateway: None,
        })
        .collect();
    assert_eq!(got, want);
    assert!(
        store
            .allocate(&owner("default", "more"), Family::V4, NOW + 60_000)
            .is_err()
    );
    assert_counters(&store);
    drop(store);
    // Reopening finds nothing left to do.
    let store = dir.store();
    assert!(store.open_warnings().is_empty());
}

/// Direct mode (no cooldown asked for) on a database only upstream has
/// written keeps upstream's 1-minute cooldown and records it; a database
/// Metis creates, or a cooldown asked for, is as before. A read-only look
/// at such a file reads Metis's tables as empty and writes nothing.
#[test]
fn an_upstream_only_database_keeps_upstreams_cooldown_in_direct_mode() {
    let dir = TempDir::new();
    let path = dir.db();
    let conn = upstream_with_first_block(&path);
    drop(conn);
    let bytes = std::fs::read(&path).unwrap();
    let read_only = Store::open_read_only(&path).unwrap().unwrap();
    assert!(read_only.quarantined().unwrap().is_empty());
    assert!(!read_only.is_isolated("default").unwrap());
    let range = [cidr("198.18.1.0/29")];
    assert!(
        read_only
            .can_allocate(
                "default",
                Family::V4,
                &crate::store::InForce {
                    ranges: range.to_vec(),
                    bounds: [].to_vec()
                },
                false,
                NOW
            )
            .unwrap()
            .is_ok()
    );
    drop(read_only);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        bytes,
        "a read-only look wrote"
    );

    let store = dir.store();
    assert_eq!(store.release_cooldown(), 60_000);
    drop(store);
    assert_eq!(dir.store().release_cooldown(), 60_000, "recorded");
    assert_eq!(dir.store_with_cooldown(5_000).release_cooldown(), 5_000);

    let fresh = TempDir::new();
    assert_eq!(fresh.store().release_cooldown(), 0, "Metis's own file");
}

/// Upstream's `AddCIDR` (after a rollback) adds a block of network
/// "other" over network "pods"' block, every row free, as upstream writes
/// it; no open since, so no repair has run.
pub(super) fn upstream_overlapping_block(store: &Store) -> i64 {
    store
        .conn
        .execute(
            "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips, state) \
             VALUES ('198.18.40.0/29', 'other', 'ipv4', 8, 0, 'Ready')",
            [],
        )
        .unwrap();
    let id = store.conn.last_insert_rowid();
    for i in 0..8 {
        store
            .conn
            .execute(
                "INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) VALUES (?1, ?2, '', '', 0)",
                rusqlite::params![format!("198.18.40.{i}"), id],
            )
            .unwrap();
    }
    id
}

#[test]
fn an_address_another_networks_overlapping_block_holds_is_passed_over() {
    let (_dir, mut store) = store_with(&[("pods", "198.18.40.0/28")]);
    assert_eq!(
        alloc(&mut store, "pods", "p1", Family::V4, NOW),
        ip("198.18.40.2")
    );
    let other = upstream_overlapping_block(&store);
    // .0, .1 and .7 are the upstream block's reserved positions; .2 is p1's
    // in "pods": "other" is handed .3, not .2.
    assert_eq!(
        alloc(&mut store, "other", "o1", Family::V4, NOW),
        ip("198.18.40.3")
    );
    // And the other way: "pods" passes over .3, which "other" now holds.
    assert_eq!(
        alloc(&mut store, "pods", "p2", Family::V4, NOW),
        ip("198.18.40.4")
    );
    // A static request for an address the other network holds is refused,
    // naming the holder.
    let err = store
        .allocate_requested(&owner("other", "o2"), ip("198.18.40.2"), NOW)
        .unwrap_err();
    match err {
        StoreError::RequestedIpUnavailable {
            reason: Unavailable::Held { container_id },
            ..
        } => assert_eq!(container_id, "p1"),
        other => panic!("expected held by p1, got {other:?}"),
    }
    // Every address is held once on the node.
    let mut held: Vec<String> = store
        .conn
        .prepare("SELECT address FROM ip_addresses WHERE is_allocated = 1 AND container_id != ''")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let all = held.len();
    held.sort();
    held.dedup();
    assert_eq!(held.len(), all, "an address held twice: {held:?}");
    assert!(
        rows(&store, other)
            .iter()
            .any(|r| r.0 == "198.18.40.3" && r.2 == "o1")
    );
}

#[test]
fn an_isolated_networks_holdings_do_not_block_another_network() {
    let (_dir, mut store) = store_with(&[("pods", "198.18.40.0/28")]);
    store
        .conn
        .execute(
            "INSERT INTO metis_networks (network, isolated) VALUES ('pods', 1) \
             ON CONFLICT(network) DO UPDATE SET isolated = 1",
            [],
        )
        .unwrap();
    assert_eq!(
        alloc(&mut store, "pods", "p1", Family::V4, NOW),
        ip("198.18.40.2")
    );
    upstream_overlapping_block(&store);
    // "pods" is an address space of its own: .2 is "other"'s to hand out.
    assert_eq!(
        alloc(&mut store, "other", "o1", Family::V4, NOW),
        ip("198.18.40.2")
    );
}

/// The pre-upgrade vet: on a file only upstream wrote whose two networks
/// overlap, `metis admin check` names what the first start will do, in the
/// start's words: quarantine both blocks when both hold pods, delete the
/// side no pod uses.
#[test]
fn the_check_of_an_upstream_file_foresees_what_the_start_does_about_overlaps() {
    let dir = TempDir::new();
    let path = dir.db();
    {
        let conn = upstream_with_first_block(&path);
        // Network "other" over "default"'s 198.18.1.0/29; a pod in each
        // (.3 in default's block, .4 in other's), so both hold pods.
        conn.execute_batch(
            "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips) \
             VALUES ('198.18.1.0/29', 'other', 'ipv4', 8, 1); \
             UPDATE ip_addresses SET is_allocated = 1, container_id = 'pod-a', interface_name = 'eth0' \
             WHERE cidr_block_id = 1 AND address = '198.18.1.3'; \
             UPDATE cidr_blocks SET allocated_ips = 4 WHERE id = 1; \
             INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips) \
             VALUES ('198.18.9.0/29', 'default', 'ipv4', 8, 0); \
             INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips) \
             VALUES ('198.18.9.0/30', 'spare', 'ipv4', 4, 0);",
        )
        .unwrap();
        conn.execute(
            "INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) \
             VALUES ('198.18.1.4', 2, 'pod-b', 'eth0', 1)",
            [],
        )
        .unwrap();
    }
    let report = check_file(&path, Depth::Full).unwrap();
    let quarantines: Vec<&String> = report
        .problems
        .iter()
        .filter(|p| p.contains("both hold pods"))
        .collect();
    assert_eq!(
        quarantines,
        [
            "block 198.18.1.0/29 of network \"default\": it overlaps block 198.18.1.0/29 of network \"other\" and both hold pods; the daemon quarantines the block(s) at start",
            "block 198.18.1.0/29 of network \"other\": it overlaps block 198.18.1.0/29 of network \"default\" and both hold pods; the daemon quarantines the block(s) at start",
        ],
        "{report:?}"
    );
    let deletion = "deleted block 198.18.9.0/29 of network \"default\": it overlapped another block and no pod held an address in it";
    assert!(
        report.notes.iter().any(|n| n.ends_with(deletion)),
        "{report:?}"
    );
    assert!(!report.is_ok());

    // The start does exactly that.
    let mut store = Store::open(&path, &StoreOptions::default()).unwrap();
    let isolation = store
        .isolate_problems(&store.verify(Depth::Full).unwrap(), NOW)
        .unwrap();
    assert_eq!(isolation.deleted, [deletion]);
    let mut quarantined: Vec<(String, String)> = isolation
        .quarantined
        .iter()
        .map(|q| (q.cidr.to_string(), q.network.clone()))
        .collect();
    quarantined.sort();
    assert_eq!(
        quarantined,
        [
            ("198.18.1.0/29".to_string(), "default".to_string()),
            ("198.18.1.0/29".to_string(), "other".to_string())
        ]
    );
}
