use std::collections::HashSet;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use rusqlite::Connection;

use super::*;

const NOW: i64 = 1_700_000_000_000;

use crate::testutil::TempDir;

fn opts(reserve: Option<ReserveMode>, release_cooldown: Option<i64>) -> StoreOptions {
    StoreOptions {
        durability: Durability::Normal,
        reserve,
        release_cooldown,
    }
}

fn open(path: &Path) -> Store {
    Store::open(path, &opts(None, None)).unwrap()
}

fn open_mode(path: &Path, mode: ReserveMode) -> Store {
    Store::open(path, &opts(Some(mode), None)).unwrap()
}

/// A store whose released addresses rest for `cooldown_ms`.
fn open_cooling(path: &Path, cooldown_ms: i64) -> Store {
    Store::open(path, &opts(None, Some(cooldown_ms))).unwrap()
}

/// Adds blocks (network, cidr) in order: block ids 1, 2, … on a new store.
fn add_blocks(store: &mut Store, blocks: &[(&str, &str)]) {
    for (network, cidr) in blocks {
        store.add_cidr_block(network, &c(cidr)).unwrap();
    }
}

/// A new store (default options) holding `blocks`; keep the directory alive.
fn store_with(blocks: &[(&str, &str)]) -> (TempDir, Store) {
    store_opts_with(&opts(None, None), blocks)
}

/// A new store opened with `opts`, holding `blocks`.
fn store_opts_with(opts: &StoreOptions, blocks: &[(&str, &str)]) -> (TempDir, Store) {
    let dir = TempDir::new();
    let mut store = Store::open(&dir.db(), opts).unwrap();
    add_blocks(&mut store, blocks);
    (dir, store)
}

fn c(text: &str) -> Cidr {
    text.parse().unwrap()
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn owner<'a>(network: &'a str, container_id: &'a str) -> Owner<'a> {
    Owner {
        network,
        container_id,
        interface_name: "eth0",
        pod_name: "pod",
        pod_namespace: "ns",
    }
}

fn wall_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

fn alloc(store: &mut Store, network: &str, cid: &str, family: Family, now: i64) -> IpAddr {
    store
        .allocate(&owner(network, cid), family, now)
        .unwrap()
        .address
}

fn block(store: &Store, id: i64) -> BlockInfo {
    store
        .blocks(&BlockFilter::default())
        .unwrap()
        .into_iter()
        .find(|b| b.id == id)
        .unwrap()
}

/// (address, is_allocated, container_id, release_at) of a block's rows, id order.
fn rows(store: &Store, block_id: i64) -> Vec<(String, bool, String, Option<i64>)> {
    let mut stmt = store
        .conn
        .prepare(
            "SELECT address, is_allocated, COALESCE(container_id, ''), release_at \
             FROM ip_addresses WHERE cidr_block_id = ?1 ORDER BY id",
        )
        .unwrap();
    stmt.query_map([block_id], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

fn reserved_addrs(store: &Store, block_id: i64) -> Vec<String> {
    rows(store, block_id)
        .into_iter()
        .filter(|r| r.1 && r.2.is_empty())
        .map(|r| r.0)
        .collect()
}

fn assert_counters(store: &Store) {
    assert_eq!(store.counter_mismatches().unwrap(), Vec::new());
}

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
        assert_eq!(reserved_offsets(&c(block), mode, first), want, "{case}");
    }
}

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
fn schema_objects_are_exact() {
    let dir = TempDir::new();
    let path = dir.0.join("nested/dir/metis.sqlite");
    let store = open(&path);
    let conn = &store.conn;

    let mut objects: Vec<(String, String)> = conn
        .prepare("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_autoindex%' ORDER BY type, name")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    objects.sort();
    let expected: Vec<(String, String)> = [
        ("index", "idx_available_ips"),
        ("index", "idx_ip_idempotency"),
        ("table", "cidr_blocks"),
        ("table", "ip_addresses"),
        ("table", "metis_blocks"),
        ("table", "metis_bounds"),
        ("table", "metis_ranges"),
        ("table", "metis_released"),
        ("table", "metis_settings"),
        ("table", "metis_taken_back"),
        ("table", "sqlite_sequence"),
        ("trigger", "update_cidr_blocks_updated_at"),
        ("trigger", "update_ip_addresses_updated_at"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(objects, expected);

    let sql = |name: &str| -> String {
        conn.query_row(
            "SELECT sql FROM sqlite_master WHERE name = ?1",
            [name],
            |r| r.get(0),
        )
        .unwrap()
    };
    assert!(
        sql("idx_available_ips")
            .contains("ip_addresses(cidr_block_id, id) WHERE is_allocated = FALSE")
    );
    assert!(sql("idx_ip_idempotency").contains("ip_addresses(container_id, interface_name)"));
    assert!(sql("cidr_blocks").contains("UNIQUE(cidr, network)"));
    assert!(sql("ip_addresses").contains("UNIQUE(address, cidr_block_id)"));
    assert!(sql("ip_addresses").contains("REFERENCES cidr_blocks(id) ON DELETE CASCADE"));
    for trigger in [
        "update_cidr_blocks_updated_at",
        "update_ip_addresses_updated_at",
    ] {
        let text = sql(trigger);
        assert!(text.contains("AFTER UPDATE"), "{text}");
        assert!(text.contains("WHERE id = OLD.id"), "{text}");
        assert!(
            text.contains("CAST(unixepoch('subsec') * 1000 AS INTEGER)"),
            "{text}"
        );
    }

    let now_default = Some("CAST(unixepoch('subsec') * 1000 AS INTEGER)".to_string());
    let info = |table: &str| -> Vec<(String, String, bool, Option<String>, i64)> {
        conn.prepare(&format!("PRAGMA table_info({table})"))
            .unwrap()
            .query_map([], |r| {
                Ok((r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?))
            })
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    let col = |n: &str, t: &str, nn: bool, d: Option<&str>, pk: i64| {
        (n.to_string(), t.to_string(), nn, d.map(str::to_string), pk)
    };
    assert_eq!(
        info("cidr_blocks"),
        vec![
            col("id", "INTEGER", false, None, 1),
            col("cidr", "TEXT", true, None, 0),
            col("network", "TEXT", true, None, 0),
            col("ip_family", "TEXT", true, None, 0),
            col("total_ips", "INTEGER", true, None, 0),
            col("allocated_ips", "INTEGER", false, Some("0"), 0),
            col("state", "TEXT", true, Some("'Ready'"), 0),
            col("created_at", "INTEGER", false, now_default.as_deref(), 0),
            col("updated_at", "INTEGER", false, now_default.as_deref(), 0),
        ]
    );
    assert_eq!(
        info("ip_addresses"),
        vec![
            col("id", "INTEGER", false, None, 1),
            col("address", "TEXT", true, None, 0),
            col("cidr_block_id", "INTEGER", true, None, 0),
            col("container_id", "TEXT", false, None, 0),
            col("pod_name", "TEXT", false, None, 0),
            col("pod_namespace", "TEXT", false, None, 0),
            col("interface_name", "TEXT", false, None, 0),
            col("is_allocated", "BOOLEAN", false, Some("FALSE"), 0),
            col("release_at", "INTEGER", false, None, 0),
            col("allocated_at", "INTEGER", false, None, 0),
            col("updated_at", "INTEGER", false, now_default.as_deref(), 0),
        ]
    );
    let journal: String = conn
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .unwrap();
    assert_eq!(journal, "wal");
    // synchronous 1 is NORMAL.
    let pragmas = [
        ("user_version", 1),
        ("foreign_keys", 1),
        ("synchronous", 1),
        ("busy_timeout", 5000),
        // temp_store 2 is MEMORY: savepoint sub-journals need no temp directory.
        ("temp_store", 2),
    ];
    for (pragma, want) in pragmas {
        let value: i64 = conn.pragma_query_value(None, pragma, |r| r.get(0)).unwrap();
        assert_eq!(value, want, "{pragma}");
    }

    let file_mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(file_mode, 0o600);
    let dir_mode = std::fs::metadata(path.parent().unwrap())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(dir_mode, 0o700);
    assert_eq!(store.reserve_mode(), ReserveMode::EveryBlock);
    assert!(store.open_warnings().is_empty());
}

#[test]
fn durability_full_sets_synchronous_full() {
    let dir = TempDir::new();
    let store = Store::open(
        &dir.db(),
        &StoreOptions {
            durability: Durability::Full,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    let sync: i64 = store
        .conn
        .pragma_query_value(None, "synchronous", |r| r.get(0))
        .unwrap();
    assert_eq!(sync, 2);
}

#[test]
fn empty_path_is_rejected() {
    let err = Store::open(Path::new(""), &opts(None, None)).unwrap_err();
    assert!(matches!(err, StoreError::InvalidPath));
    assert!(err.to_string().starts_with("store: "));
}

#[test]
fn reopen_is_idempotent_and_keeps_data() {
    let dir = TempDir::new();
    let schema_before: Vec<String>;
    let a;
    {
        let mut store = open(&dir.db());
        add_blocks(&mut store, &[("default", "198.18.1.0/29")]);
        a = alloc(&mut store, "default", "c1", Family::V4, NOW);
        schema_before = store
            .conn
            .prepare("SELECT sql FROM sqlite_master ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get::<_, Option<String>>(0))
            .unwrap()
            .map(|r| r.unwrap().unwrap_or_default())
            .collect();
    }
    for _ in 0..2 {
        let mut store = open(&dir.db());
        let schema_after: Vec<String> = store
            .conn
            .prepare("SELECT sql FROM sqlite_master ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get::<_, Option<String>>(0))
            .unwrap()
            .map(|r| r.unwrap().unwrap_or_default())
            .collect();
        assert_eq!(schema_after, schema_before);
        assert!(store.open_warnings().is_empty());
        assert_eq!(alloc(&mut store, "default", "c1", Family::V4, NOW), a);
        assert_eq!(block(&store, 1).allocated_ips, 4);
        assert_counters(&store);
    }
}

#[test]
fn adding_a_block_again_changes_nothing() {
    // Its reservations and allocation order: allocation_order_until_exhausted.
    let dir = TempDir::new();
    let mut store = open(&dir.db());
    let id = store
        .add_cidr_block("default", &c("198.18.1.0/29"))
        .unwrap();
    assert_eq!(id, AddOutcome::Added(1));
    assert_eq!(rows(&store, 1).len(), 8);
    alloc(&mut store, "default", "c0", Family::V4, NOW);
    // Adding it again changes nothing.
    assert_eq!(
        store
            .add_cidr_block("default", &c("198.18.1.0/29"))
            .unwrap(),
        AddOutcome::Exists(1)
    );
    assert_eq!(rows(&store, 1).len(), 8);
    assert_eq!(
        store.find_block("default", &c("198.18.1.0/29")).unwrap(),
        Some(1)
    );
    assert_eq!(
        store.find_block("other", &c("198.18.1.0/29")).unwrap(),
        None
    );
    // One address, one owner on the node: the same prefix in another
    // network is refused, naming the network that has it.
    let refused = store
        .add_cidr_block("other", &c("198.18.1.0/29"))
        .unwrap_err();
    assert!(
        matches!(&refused, StoreError::Overlap { other_network, .. } if other_network == "default"),
        "{refused}"
    );
}

#[test]
fn second_block_reservation_depends_on_mode() {
    let dir = TempDir::new();
    {
        let mut store = open(&dir.db());
        add_blocks(&mut store, &[("default", "198.18.1.0/29")]);
        add_blocks(&mut store, &[("default", "198.18.2.0/29")]);
        assert_eq!(
            reserved_addrs(&store, 2),
            vec!["198.18.2.0", "198.18.2.1", "198.18.2.7"]
        );
        assert_eq!(block(&store, 2).allocated_ips, 3);
    }
    let dir2 = TempDir::new();
    let mut store = open_mode(&dir2.db(), ReserveMode::FirstBlock);
    assert_eq!(store.reserve_mode(), ReserveMode::FirstBlock);
    store
        .add_cidr_block("default", &c("2001:db8::/120"))
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
    let store = open(&dir2.db());
    assert_eq!(store.reserve_mode(), ReserveMode::FirstBlock);
    drop(store);
    let store = open_mode(&dir2.db(), ReserveMode::EveryBlock);
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
    let mut store = open_mode(&dir2.db(), ReserveMode::FirstBlock);
    assert!(reserved_addrs(&store, 3).is_empty());
    assert!(reserved_addrs(&store, 1).is_empty());
    assert_eq!(reserved_addrs(&store, 2).len(), 3);
    assert_counters(&store);
    assert_eq!(
        alloc(&mut store, "default", "c7", Family::V4, NOW),
        ip("198.18.2.1")
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
    assert_eq!(a.block, c("2001:db8::/120"));
}

#[test]
fn ipv6_expands_in_batches() {
    let (_dir, mut store) = store_with(&[("default", "2001:db8::/64")]);
    assert_eq!(block(&store, 1).total_ips, i64::MAX);
    let mut seen = HashSet::new();
    for i in 0..100 {
        let a = alloc(&mut store, "default", &format!("c{i}"), Family::V6, NOW);
        assert!(c("2001:db8::/64").contains(a));
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
        released,
        vec![Allocation {
            address: ip("198.18.1.2"),
            block: c("198.18.1.0/29")
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
    assert_eq!(
        alloc(&mut store, "default", "c", Family::V4, NOW + 1000),
        ip("198.18.1.2")
    );
    assert_eq!(
        store
            .usage("default", Family::V4, NOW + 1000)
            .unwrap()
            .cooldown,
        0
    );
    // Cooldown 0 → release_at NULL, immediately reusable.
    let mut store = open_cooling(&dir.db(), 0);
    store.release("default", "c", "eth0", NOW + 2000).unwrap();
    assert_eq!(rows(&store, 1)[2].3, None);
    assert_eq!(
        alloc(&mut store, "default", "d", Family::V4, NOW + 2000),
        ip("198.18.1.2")
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
        assert_eq!(a.block, c("198.18.2.0/28"));
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
            .release("other", "c1", "eth0", NOW)
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store.release("default", "c1", "eth0", NOW).unwrap(),
        vec![v4, v6]
    );
    assert!(
        store
            .release("default", "c1", "eth0", NOW)
            .unwrap()
            .is_empty()
    );
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
            block: c("198.18.1.0/29")
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
            assert!(reason.contains(needle), "{reason:?} lacks {needle:?}")
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
    assert_eq!(v6.block, c("2001:db8::/64"));
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

#[test]
fn two_stores_allocate_concurrently() {
    let dir = TempDir::new();
    {
        let mut store = open(&dir.db());
        add_blocks(&mut store, &[("default", "198.18.100.0/24")]);
    }
    let handles: Vec<_> = (0..2)
        .map(|t| {
            let path = dir.db();
            std::thread::spawn(move || {
                let mut store = open(&path);
                (0..100)
                    .map(|i| {
                        alloc(
                            &mut store,
                            "default",
                            &format!("t{t}-c{i}"),
                            Family::V4,
                            NOW,
                        )
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all = HashSet::new();
    for h in handles {
        for a in h.join().unwrap() {
            assert!(all.insert(a), "duplicate {a}");
        }
    }
    assert_eq!(all.len(), 200);
    let store = open(&dir.db());
    assert_eq!(block(&store, 1).allocated_ips, 203);
    assert_counters(&store);
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
    let store = open(&dir.db());
    assert!(store.open_warnings().is_empty());
}

#[test]
fn corrupt_rows_are_errors_not_panics() {
    let (dir, mut store) = store_with(&[("default", "198.18.1.0/30")]);
    store
        .conn
        .execute(
            "UPDATE ip_addresses SET address = 'garbage' WHERE address = '198.18.1.2'",
            [],
        )
        .unwrap();
    let err = store
        .allocate(&owner("default", "a"), Family::V4, NOW)
        .unwrap_err();
    assert!(matches!(err, StoreError::Corrupt(_)), "{err}");
    store
        .conn
        .execute("UPDATE cidr_blocks SET state = 'Weird'", [])
        .unwrap();
    assert!(matches!(
        store.blocks(&BlockFilter::default()),
        Err(StoreError::Corrupt(_))
    ));
    drop(store);
    let mut store = open(&dir.db());
    assert!(store.open_warnings().iter().any(|w| w.contains("Weird")));
    store
        .conn
        .execute("UPDATE cidr_blocks SET cidr = 'nope', state = 'Ready'", [])
        .unwrap();
    assert!(matches!(
        store.allocate(&owner("default", "a"), Family::V4, NOW),
        Err(StoreError::Corrupt(_))
    ));
    drop(store);
    let store = open(&dir.db());
    assert!(store.open_warnings().iter().any(|w| w.contains("nope")));
}

#[test]
fn busy_errors_are_transient() {
    let busy =
        rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY), None);
    let err = StoreError::from(busy);
    assert!(matches!(err, StoreError::Busy(_)));
    assert!(err.is_transient());
    assert!(std::error::Error::source(&err).is_some());
    let full = StoreError::from(rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
        None,
    ));
    assert!(matches!(full, StoreError::Sqlite(_)));
    assert!(full.is_transient());
    assert!(!StoreError::EmptyOwner.is_transient());
    assert!(!StoreError::from("1.2.3.4".parse::<Cidr>().unwrap_err()).is_transient());
}

/// Upstream's schema as upstream ships it (hand-written copy).
const UPSTREAM_SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS cidr_blocks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    cidr TEXT NOT NULL,
    network TEXT NOT NULL,
    ip_family TEXT NOT NULL,
    total_ips INTEGER NOT NULL,
    allocated_ips INTEGER DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'Ready',
    created_at INTEGER DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    updated_at INTEGER DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    UNIQUE(cidr, network)
);
CREATE TABLE IF NOT EXISTS ip_addresses (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    address TEXT NOT NULL,
    cidr_block_id INTEGER NOT NULL,
    container_id TEXT,
    pod_name TEXT,
    pod_namespace TEXT,
    interface_name TEXT,
    is_allocated BOOLEAN DEFAULT FALSE,
    release_at INTEGER,
    allocated_at INTEGER,
    updated_at INTEGER DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    UNIQUE(address, cidr_block_id),
    FOREIGN KEY (cidr_block_id) REFERENCES cidr_blocks(id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS idx_available_ips ON ip_addresses(cidr_block_id, id) WHERE is_allocated = FALSE;
CREATE INDEX IF NOT EXISTS idx_ip_idempotency ON ip_addresses(container_id, interface_name);
CREATE TRIGGER IF NOT EXISTS update_cidr_blocks_updated_at AFTER UPDATE ON cidr_blocks FOR EACH ROW
BEGIN UPDATE cidr_blocks SET updated_at = (CAST(unixepoch('subsec') * 1000 AS INTEGER)) WHERE id = OLD.id; END;
CREATE TRIGGER IF NOT EXISTS update_ip_addresses_updated_at AFTER UPDATE ON ip_addresses FOR EACH ROW
BEGIN UPDATE ip_addresses SET updated_at = (CAST(unixepoch('subsec') * 1000 AS INTEGER)) WHERE id = OLD.id; END;
PRAGMA user_version = 1;
";

#[test]
fn upstream_database_is_repaired_and_served() {
    let dir = TempDir::new();
    let path = dir.db();
    let upstream_tables: Vec<String>;
    {
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(UPSTREAM_SCHEMA).unwrap();
        // Block 1: upstream's first block, .0 .1 .7 reserved.
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

    let mut store = open_cooling(&path, 30_000);
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
    assert_eq!(store.open_warnings().len(), 1);
    assert!(store.open_warnings()[0].contains("198.18.2.1"));
    assert!(store.open_warnings()[0].contains("pod-x"));
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

    // Served: the held pod is recognised, new pods get non-reserved addresses.
    assert_eq!(
        store.check("default", "pod-x", "eth0").unwrap()[0].address,
        ip("198.18.2.1")
    );
    let got: Vec<IpAddr> = (0..10)
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
    .chain(
        [
            "198.18.2.2",
            "198.18.2.3",
            "198.18.2.4",
            "198.18.2.5",
            "198.18.2.6",
        ]
        .iter(),
    )
    .map(|s| ip(s))
    .collect();
    assert_eq!(got, want);
    assert_eq!(
        alloc(&mut store, "default", "v6", Family::V6, NOW),
        ip("2001:db8::")
    );
    // Releasing the held reserved position returns it to the reservation.
    let released = store.release("default", "pod-x", "eth0", NOW).unwrap();
    assert_eq!(released[0].address, ip("198.18.2.1"));
    assert_eq!(
        reserved_addrs(&store, 2),
        vec!["198.18.2.0", "198.18.2.1", "198.18.2.7"]
    );
    assert!(
        store
            .allocate(&owner("default", "more"), Family::V4, NOW + 60_000)
            .is_err()
    );
    assert_counters(&store);
    drop(store);
    // Reopening finds nothing left to do.
    let store = open(&path);
    assert!(store.open_warnings().is_empty());
}

#[test]
fn claim_query_uses_partial_index() {
    let dir = TempDir::new();
    let store = open(&dir.db());
    let plan: Vec<String> = store
        .conn
        .prepare(&format!("EXPLAIN QUERY PLAN {}", super::alloc::CLAIM_SQL))
        .unwrap()
        .query_map([1, 2], |r| r.get::<_, String>(3))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(
        plan.iter().any(|p| p.contains("idx_available_ips")),
        "{plan:?}"
    );
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
    let claim = store.conn.prepare_cached(super::alloc::CLAIM_SQL).unwrap();
    assert_eq!(claim.get_status(rusqlite::StatementStatus::RePrepare), 0);
}

#[test]
fn allocation_path_never_scans_the_address_table() {
    let dir = TempDir::new();
    let store = open(&dir.db());
    for sql in super::alloc::ALLOCATION_PATH {
        let mut stmt = store
            .conn
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .unwrap();
        let nulls = std::iter::repeat_n(rusqlite::types::Null, stmt.parameter_count());
        let plan: Vec<String> = stmt
            .query_map(rusqlite::params_from_iter(nulls), |r| r.get::<_, String>(3))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        // `a` is ip_addresses in the joins; cidr_blocks has one row per block
        // and upstream's schema gives it no index by network.
        let scans_addresses = plan.iter().any(|step| {
            step.starts_with("SCAN ip_addresses") || step == "SCAN a" || step.starts_with("SCAN a ")
        });
        assert!(!scans_addresses, "{sql}\n{plan:?}");
    }
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
    let frontier = store.setting("ipv6_frontier/1").unwrap();
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
    store.put_setting("ipv6_frontier/1", None).unwrap();
    let next = alloc(&mut store, "default", "next", Family::V6, NOW);
    assert_eq!(next, ip("2001:db8:7::40"));
    assert_eq!(
        store.setting("ipv6_frontier/1").unwrap().as_deref(),
        Some("128")
    );
    assert_counters(&store);
}

#[test]
fn an_ipv4_block_of_any_size_is_added_in_constant_work() {
    // A /15 gets its first batch and its reserved last address, no more;
    // the rest grows from the frontier as addresses are taken.
    let dir = TempDir::new();
    let mut store = open(&dir.db());
    let id = store
        .add_cidr_block("default", &c("198.18.0.0/15"))
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

#[test]
fn release_cooldown_is_settled_at_open() {
    let dir = TempDir::new();
    assert_eq!(open(&dir.db()).release_cooldown(), 0, "nothing recorded");
    // The daemon's cooldown is recorded; direct mode (None) then uses it.
    assert_eq!(open_cooling(&dir.db(), 45_000).release_cooldown(), 45_000);
    assert_eq!(open(&dir.db()).release_cooldown(), 45_000);
    assert_eq!(
        Store::open_read_only(&dir.db())
            .unwrap()
            .unwrap()
            .release_cooldown(),
        45_000
    );
    let store = open_cooling(&dir.db(), 0);
    assert_eq!(
        store
            .setting(schema::KEY_RELEASE_COOLDOWN)
            .unwrap()
            .as_deref(),
        Some("0")
    );
    drop(store);
    assert_eq!(open(&dir.db()).release_cooldown(), 0);
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

#[test]
fn a_mode_change_reserves_the_unpopulated_end_of_a_lazy_block() {
    // Under first-block the second /16 reserves nothing; switching to
    // every-block must reserve its broadcast address, which has no row yet.
    let dir = TempDir::new();
    {
        let mut store = open_mode(&dir.db(), ReserveMode::FirstBlock);
        add_blocks(
            &mut store,
            &[("default", "198.18.0.0/16"), ("default", "198.19.0.0/16")],
        );
        assert_eq!(block(&store, 2).allocated_ips, 0);
        assert_eq!(rows(&store, 2).len(), 64);
    }
    let store = open_mode(&dir.db(), ReserveMode::EveryBlock);
    assert_eq!(
        reserved_addrs(&store, 2),
        vec!["198.19.0.0", "198.19.0.1", "198.19.255.255"]
    );
    assert_eq!(block(&store, 2).allocated_ips, 3);
    assert_counters(&store);
    assert!(store.verify(Depth::Full).unwrap().is_ok());
}

/// The containers holding an address (reservations aside), as another
/// connection sees them: only what is committed.
fn committed_holders(path: &Path) -> Vec<String> {
    let conn = Connection::open(path).unwrap();
    let mut statement = conn
        .prepare(
            "SELECT container_id FROM ip_addresses \
             WHERE is_allocated AND container_id != '' ORDER BY container_id",
        )
        .unwrap();
    statement
        .query_map([], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[test]
fn a_batch_keeps_released_requests_drops_rolled_back_ones_and_shows_nothing_before_commit() {
    let (dir, mut store) = store_with(&[("net", "198.18.0.0/24")]);
    store.begin_request().unwrap();
    alloc(&mut store, "net", "kept", Family::V4, NOW);
    store.end_request(true).unwrap();
    store.begin_request().unwrap();
    alloc(&mut store, "net", "undone", Family::V4, NOW);
    store.end_request(false).unwrap();
    store.begin_request().unwrap();
    // Later requests of the batch see what earlier ones kept.
    assert_eq!(
        store
            .allocate_requested(&owner("net", "same-ip"), ip("198.18.0.2"), NOW)
            .unwrap_err()
            .to_string(),
        "store: requested IP 198.18.0.2 is unavailable: it is held by container \"kept\""
    );
    store.end_request(false).unwrap();
    assert!(committed_holders(&dir.db()).is_empty());

    store.commit_batch().unwrap();
    assert_eq!(committed_holders(&dir.db()), ["kept"]);
    assert_eq!(rows(&store, 1)[2].2, "kept");
    assert_counters(&store);
    // Without a batch, each write commits alone again.
    alloc(&mut store, "net", "alone", Family::V4, NOW);
    assert_eq!(committed_holders(&dir.db()), ["alone", "kept"]);
}

#[test]
fn a_failed_commit_leaves_nothing_of_its_batch() {
    let (dir, mut store) = store_with(&[("net", "198.18.0.0/24")]);
    // A deferred foreign key is checked at COMMIT only.
    store
        .conn
        .execute_batch(
            "CREATE TABLE test_parent (id INTEGER PRIMARY KEY);
             CREATE TABLE test_blocker (parent INTEGER
                 REFERENCES test_parent(id) DEFERRABLE INITIALLY DEFERRED);",
        )
        .unwrap();
    let counted = block(&store, 1).allocated_ips;
    store.begin_request().unwrap();
    alloc(&mut store, "net", "a", Family::V4, NOW);
    store.end_request(true).unwrap();
    store.begin_request().unwrap();
    store
        .conn
        .execute("INSERT INTO test_blocker VALUES (1)", [])
        .unwrap();
    store.end_request(true).unwrap();
    let err = store.commit_batch().unwrap_err();
    assert!(
        err.to_string().contains("FOREIGN KEY constraint failed"),
        "{err}"
    );
    assert!(store.conn.is_autocommit(), "the transaction was not ended");
    assert!(committed_holders(&dir.db()).is_empty());
    assert_eq!(block(&store, 1).allocated_ips, counted);
    assert_counters(&store);
    // The next batch starts clean.
    store.begin_request().unwrap();
    alloc(&mut store, "net", "b", Family::V4, NOW);
    store.end_request(true).unwrap();
    store.commit_batch().unwrap();
    assert_eq!(committed_holders(&dir.db()), ["b"]);
}

#[test]
fn nothing_is_written_after_sqlite_dropped_the_batch() {
    let (dir, mut store) = store_with(&[("net", "198.18.0.0/24")]);
    store.begin_request().unwrap();
    alloc(&mut store, "net", "a", Family::V4, NOW);
    store.end_request(true).unwrap();
    store.begin_request().unwrap();
    // What SQLite does by itself on an I/O error or a full disk.
    store.conn.execute_batch("ROLLBACK").unwrap();
    let err = store
        .allocate(&owner("net", "b"), Family::V4, NOW)
        .unwrap_err();
    assert!(matches!(err, StoreError::BatchAborted), "{err}");
    assert!(err.is_transient());
    assert!(matches!(
        store.end_request(true),
        Err(StoreError::BatchAborted)
    ));
    assert!(matches!(
        store.begin_request(),
        Err(StoreError::BatchAborted)
    ));
    assert!(matches!(
        store.commit_batch(),
        Err(StoreError::BatchAborted)
    ));
    assert!(committed_holders(&dir.db()).is_empty());
    alloc(&mut store, "net", "c", Family::V4, NOW);
    assert_eq!(committed_holders(&dir.db()), ["c"]);
}
