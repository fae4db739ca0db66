//! The daemon's group commit: savepoints per request, one commit.

use super::*;

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
