//! Opening a database: the schema, durability, settings settled at open,
//! errors that must not panic, and concurrent writers.

use super::*;

#[test]
fn schema_objects_are_exact() {
    let dir = TempDir::new();
    let path = dir.0.join("nested/dir/metis.sqlite");
    let store = Store::open(&path, &StoreOptions::default()).unwrap();
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
        ("index", "metis_free_addresses"),
        ("index", "metis_gateways_by_gateway"),
        ("table", "cidr_blocks"),
        ("table", "ip_addresses"),
        ("table", "metis_blocks"),
        ("table", "metis_bounds"),
        ("table", "metis_gateways"),
        ("table", "metis_networks"),
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
        let mut store = dir.store();
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
        let mut store = dir.store();
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
fn two_stores_allocate_concurrently() {
    let dir = TempDir::new();
    {
        let mut store = dir.store();
        add_blocks(&mut store, &[("default", "198.18.100.0/24")]);
    }
    let handles: Vec<_> = (0..2)
        .map(|t| {
            let path = dir.db();
            std::thread::spawn(move || {
                let mut store = Store::open(&path, &StoreOptions::default()).unwrap();
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
    let store = dir.store();
    assert_eq!(block(&store, 1).allocated_ips, 203);
    assert_counters(&store);
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
    // Trust no row: the unreadable row is passed over, and the exhaustion
    // says so.
    let err = store
        .allocate(&owner("default", "a"), Family::V4, NOW)
        .unwrap_err();
    assert!(matches!(err, StoreError::NoAvailableIps { .. }), "{err}");
    assert!(err.to_string().contains("\"garbage\""), "{err}");
    assert!(err.to_string().contains("not an address"), "{err}");
    store
        .conn
        .execute("UPDATE cidr_blocks SET state = 'Weird'", [])
        .unwrap();
    assert!(matches!(
        store.blocks(&BlockFilter::default()),
        Err(StoreError::Corrupt(_))
    ));
    drop(store);
    let mut store = dir.store();
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
    let store = dir.store();
    assert!(store.open_warnings().iter().any(|w| w.contains("nope")));
}

#[test]
fn busy_errors_are_transient() {
    let busy =
        rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY), None);
    let err = StoreError::from(busy);
    assert!(matches!(err, StoreError::Busy { .. }));
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

#[test]
fn release_cooldown_is_settled_at_open() {
    let dir = TempDir::new();
    assert_eq!(dir.store().release_cooldown(), 0, "nothing recorded");
    // The daemon's cooldown is recorded; direct mode (None) then uses it.
    assert_eq!(dir.store_with_cooldown(45_000).release_cooldown(), 45_000);
    assert_eq!(dir.store().release_cooldown(), 45_000);
    assert_eq!(
        Store::open_read_only(&dir.db())
            .unwrap()
            .unwrap()
            .release_cooldown(),
        45_000
    );
    let store = dir.store_with_cooldown(0);
    assert_eq!(
        store
            .setting(db::schema::KEY_RELEASE_COOLDOWN)
            .unwrap()
            .as_deref(),
        Some("0")
    );
    drop(store);
    assert_eq!(dir.store().release_cooldown(), 0);
}

/// The first opener of a new file reads it, then needs the write lock to
/// turn WAL on; SQLite answers that upgrade busy at once, without calling
/// the busy handler (waiting could deadlock). Plugins in direct mode and a
/// starting daemon opening a fresh node's database together met it as
/// code 11 "database is locked". One attempt says where; the open tries
/// again until the other opener is done.
#[test]
fn an_open_beside_another_opener_of_a_new_file_waits_for_it() {
    let dir = TempDir::new();
    let path = dir.db();
    std::fs::File::create(&path).unwrap();
    // The other opener, midway: its write lock on the empty file.
    let maker = Connection::open(&path).unwrap();
    maker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let opts = StoreOptions::default();
    let err = Store::open_once(&path, &opts, Vec::new()).unwrap_err();
    let text = err.to_string();
    assert!(err.is_transient(), "{text}");
    assert!(
        text.contains("database is busy (SQLITE_BUSY at open: PRAGMA journal_mode=WAL)"),
        "{text}"
    );
    let mut maker = Some(maker);
    let mut attempts = 0;
    let store = crate::store::db::busy::patiently("test", Duration::from_secs(60), || {
        attempts += 1;
        let attempt = Store::open_once(&path, &opts, Vec::new());
        // The other opener finishes once this one has met its lock.
        if let Some(maker) = maker.take() {
            maker.execute_batch("COMMIT").unwrap();
        }
        attempt
    })
    .unwrap();
    assert_eq!(attempts, 2);
    let mode: String = store
        .conn
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    assert!(store.verify(Depth::Full).unwrap().is_ok());
}
