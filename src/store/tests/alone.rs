//! A request served alone (direct mode, the daemon's parked retries): one
//! transaction without savepoints; a write dropped unfinished ends it, and
//! the request is served again as a batch of one, with savepoints. The
//! first write of a daemon's batch is served the same way.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rusqlite::functions::FunctionFlags;
use rusqlite::trace::{TraceEvent, TraceEventCodes};
use rusqlite::types::ValueRef;

use super::*;
use crate::engine::{Engine, Outcome, Reply};

/// Direct mode's store on `dir`: the options `call_direct` opens it with.
fn direct_store(dir: &TempDir) -> Store {
    let direct = StoreOptions {
        one_request: true,
        ..opts(None, None)
    };
    Store::open(&dir.db(), &direct).unwrap()
}

/// Whether `sql` is a transaction-control statement (a transaction's or a
/// savepoint's beginning or end).
fn is_control(sql: &str) -> bool {
    ["BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE"]
        .iter()
        .any(|word| sql.starts_with(word))
}

/// What `serve` returns, with the transaction-control statements it ran
/// on `engine`'s store in order.
fn traced<T>(engine: &mut Engine, serve: impl FnOnce(&mut Engine) -> T) -> (T, Vec<String>) {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = Arc::clone(&seen);
    let conn = &mut engine.store_mut().conn;
    conn.trace_v2(
        TraceEventCodes::SQLITE_TRACE_PROFILE,
        Some(move |event: TraceEvent<'_>| {
            if let TraceEvent::Profile(stmt, _) = event {
                let sql = stmt.sql();
                if is_control(&sql) {
                    sink.lock().unwrap().push(sql.into_owned());
                }
            }
        }),
    )
    .unwrap();
    let served = serve(engine);
    let conn = &mut engine.store_mut().conn;
    conn.trace_v2(TraceEventCodes::empty(), None::<fn(TraceEvent<'_>)>)
        .unwrap();
    let controls = std::mem::take(&mut *seen.lock().unwrap());
    (served, controls)
}

/// `request` served alone, with the transaction-control statements it ran
/// in order.
fn served_alone(engine: &mut Engine, request: &Command) -> (Outcome, Vec<String>) {
    traced(engine, |engine| engine.handle_alone(request, NOW))
}

/// Makes the claim of `container`'s row fail once, mid-write (the block's
/// rows and layout already written in the same transaction), as a failed
/// statement would. Returns how many times that claim was attempted.
fn fail_claim_once(store: &Store, container: &str) -> Arc<AtomicUsize> {
    fail_claim(store, container, |attempt| attempt == 0)
}

/// Makes every claim of `container`'s row fail, mid-write. Returns how
/// many times it was attempted.
fn fail_claim_always(store: &Store, container: &str) -> Arc<AtomicUsize> {
    fail_claim(store, container, |_| true)
}

/// Makes the claims of `container`'s row (a plain name) fail, mid-write,
/// where `fails(attempt)` (counted from 0) says so. Returns how many times
/// that claim was attempted.
fn fail_claim(
    store: &Store,
    container: &str,
    fails: impl Fn(usize) -> bool + Send + 'static,
) -> Arc<AtomicUsize> {
    let claims = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&claims);
    store
        .conn
        .create_scalar_function(
            format!("metis_test_claim_{container}").as_str(),
            0,
            FunctionFlags::SQLITE_UTF8,
            move |_| Ok(fails(count.fetch_add(1, Ordering::SeqCst))),
        )
        .unwrap();
    store
        .conn
        .execute_batch(&format!(
            "CREATE TEMP TRIGGER test_fault_{container} \
             BEFORE UPDATE OF container_id ON main.ip_addresses \
             WHEN NEW.container_id = '{container}' AND metis_test_claim_{container}() \
             BEGIN SELECT RAISE(ABORT, 'injected fault'); END"
        ))
        .unwrap();
    claims
}

/// Every table's rows as another connection sees them (what is committed),
/// as text, sorted. `created_at` and `updated_at` are left out: SQLite's
/// own clock stamps them, never the request's time.
fn committed(path: &Path) -> Vec<String> {
    let conn = Connection::open(path).unwrap();
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .unwrap()
        .query_map([], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut rows = Vec::new();
    for table in tables {
        let mut statement = conn.prepare(&format!("SELECT * FROM \"{table}\"")).unwrap();
        let columns: Vec<usize> = (0..statement.column_count())
            .filter(|&i| !matches!(statement.column_name(i), Ok("created_at" | "updated_at")))
            .collect();
        let mut cursor = statement.query([]).unwrap();
        while let Some(row) = cursor.next().unwrap() {
            let values: Vec<String> = columns
                .iter()
                .map(|&i| match row.get_ref(i).unwrap() {
                    ValueRef::Text(text) => String::from_utf8_lossy(text).into_owned(),
                    value => format!("{value:?}"),
                })
                .collect();
            rows.push(format!("{table}: {}", values.join(" | ")));
        }
    }
    rows.sort();
    rows
}

/// The IPv4 address an ADD's outcome returned.
fn address(outcome: &Outcome) -> IpAddr {
    match outcome {
        Outcome::Done(Reply::Allocated(allocated)) => allocated.ipv4.as_ref().unwrap().address,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_write_dropped_unfinished_serves_the_request_again_as_a_batch_of_one() {
    // The twin: the same requests on another database, without a fault.
    let twin_dir = TempDir::new();
    let mut twin = Engine::new(direct_store(&twin_dir));
    let (expected, controls) = served_alone(&mut twin, &add("b"));
    assert_eq!(
        controls,
        ["BEGIN IMMEDIATE", "COMMIT"],
        "no savepoint alone"
    );

    let dir = TempDir::new();
    let mut engine = Engine::new(direct_store(&dir));
    let claims = fail_claim_once(engine.store(), "b");
    let (outcome, controls) = served_alone(&mut engine, &add("b"));
    assert_eq!(
        claims.load(Ordering::SeqCst),
        2,
        "claimed, faulted, claimed again"
    );
    // The first attempt took no savepoint, so its failed write ended the
    // transaction; the second is a batch of one, savepoints and all.
    let n = controls.len();
    assert!(n >= 6, "{controls:?}");
    assert_eq!(
        controls[..2],
        ["BEGIN IMMEDIATE", "ROLLBACK"],
        "{controls:?}"
    );
    assert_eq!(
        controls[2..4],
        ["BEGIN IMMEDIATE", "SAVEPOINT request"],
        "{controls:?}"
    );
    assert_eq!(
        controls[n - 2..],
        ["RELEASE request", "COMMIT"],
        "{controls:?}"
    );
    assert!(
        controls[4..n - 2]
            .chunks(2)
            .all(|write| write == ["SAVEPOINT write", "RELEASE write"]),
        "{controls:?}"
    );
    assert_eq!(outcome, expected);
    assert_eq!(address(&outcome), address(&expected));
    // Nothing of the first attempt remains, nor any transaction: what is
    // committed is the twin's, row for row.
    assert!(engine.store().conn.is_autocommit());
    assert_counters(engine.store());
    assert_eq!(committed(&dir.db()), committed(&twin_dir.db()));

    // Later requests are served alone again, without savepoints, as the
    // twin serves them.
    for request in [add("c"), del("b")] {
        let (outcome, controls) = served_alone(&mut engine, &request);
        assert_eq!(controls, ["BEGIN IMMEDIATE", "COMMIT"]);
        assert_eq!(outcome, served_alone(&mut twin, &request).0);
        assert!(matches!(outcome, Outcome::Done(_)), "{outcome:?}");
    }
    assert_eq!(claims.load(Ordering::SeqCst), 2);
    assert_counters(engine.store());
    assert_eq!(committed(&dir.db()), committed(&twin_dir.db()));
}

/// Every row and block whose `updated_at` was stamped since
/// [`unstamp`], by table and id.
fn stamped(dir: &TempDir) -> Vec<(String, i64)> {
    let conn = Connection::open(dir.db()).unwrap();
    let mut stmt = conn
        .prepare(
            "SELECT 'ip', id FROM ip_addresses WHERE updated_at IS NOT 0 \
             UNION ALL SELECT 'block', id FROM cidr_blocks WHERE updated_at IS NOT 0 ORDER BY 1, 2",
        )
        .unwrap();
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)));
    rows.unwrap().collect::<Result<_, _>>().unwrap()
}

/// Sets every `updated_at` to 0, without upstream's triggers stamping it.
fn unstamp(dir: &TempDir) {
    let conn = Connection::open(dir.db()).unwrap();
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_TRIGGER,
        false,
    )
    .unwrap();
    conn.execute_batch(
        "UPDATE ip_addresses SET updated_at = 0; UPDATE cidr_blocks SET updated_at = 0",
    )
    .unwrap();
}

/// Boot recovery on `store` for boot `id`, as a process starts it.
fn boot(mut store: Store, id: &str) {
    store.recover_after_reboot(id, None, NOW).unwrap();
}

/// `request` served alone on `store`, as a process serves it; it must succeed.
fn served_once(store: Store, request: &Command) {
    let outcome = Engine::new(store).handle_alone(request, NOW);
    assert!(matches!(outcome, Outcome::Done(_)), "{outcome:?}");
}

/// Metis's own stamp is the expression of both of upstream's triggers.
#[test]
fn the_stamp_is_upstreams_trigger_expression() {
    let expression = stamped!().trim_start_matches("updated_at = ");
    let in_trigger = format!("SET updated_at = ({expression}) WHERE id = OLD.id");
    assert_eq!(crate::store::SCHEMA.matches(&in_trigger).count(), 2);
}

#[test]
fn metis_stamps_updated_at_where_upstreams_triggers_would() {
    // Twins: a store as Metis opens it (the triggers off, daemon and
    // direct mode alike) and one whose connection then fires them, each
    // step on a store of its own, as processes would.
    let (metis, fired) = (TempDir::new(), TempDir::new());
    drop((metis.store(), fired.store()));
    type Step = fn(Store);
    let steps: [(&str, Step); 9] = [
        ("boot", |s| boot(s, "boot-1")),
        ("ADD a", |s| served_once(s, &add("a"))),
        ("ADD b", |s| served_once(s, &add("b"))),
        ("DEL a", |s| served_once(s, &del("a"))),
        ("first-block", |s| reserve(s, ReserveMode::FirstBlock)),
        ("ADD c", |s| served_once(s, &add("c"))),
        ("every-block", |s| reserve(s, ReserveMode::EveryBlock)),
        ("new boot", |s| boot(s, "boot-2")),
        ("ADD d", |s| served_once(s, &add("d"))),
    ];
    for (what, step) in steps {
        let mut touched = Vec::new();
        for (dir, triggers) in [(&metis, false), (&fired, true)] {
            unstamp(dir);
            let store = Store::open(&dir.db(), &opts(None, None)).unwrap();
            assert!(stamped(dir).is_empty(), "{what}: the open stamped rows");
            let fire = rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_TRIGGER;
            assert!(!store.conn.db_config(fire).unwrap());
            store.conn.set_db_config(fire, triggers).unwrap();
            step(store);
            touched.push(stamped(dir));
        }
        assert_eq!(touched[0], touched[1], "{what}");
        if what.starts_with("ADD") || what.starts_with("DEL") || what == "new boot" {
            assert!(!touched[0].is_empty(), "{what}: nothing stamped");
        }
    }
}

/// The reservation mode changed to `mode` on `store` and the file healed
/// for it, as an open asked for a new mode does.
fn reserve(mut store: Store, mode: ReserveMode) {
    let (reserve, changed) = store.settle_reserve_mode(Some(mode)).unwrap();
    assert!(changed);
    store.reserve = reserve;
    store.repair().unwrap();
}

/// `requests` served as one turn of the daemon serves them (in its batch,
/// then committed), with the transaction-control statements they ran.
fn served_in_batch(engine: &mut Engine, requests: &[Command]) -> (Vec<Outcome>, Vec<String>) {
    traced(engine, |engine| {
        let outcomes = requests
            .iter()
            .map(|request| engine.handle_in_batch(request, NOW))
            .collect();
        assert_eq!(engine.commit_batch(), None);
        outcomes
    })
}

#[test]
fn a_batch_serves_its_first_write_without_savepoints_and_the_rest_with_them() {
    let twin_dir = TempDir::new();
    let mut twin = Engine::new(direct_store(&twin_dir));
    let batch = [add("a"), add("b")];
    let (expected, controls) = served_in_batch(&mut twin, &batch);
    let n = controls.len();
    assert_eq!(controls[..2], ["BEGIN IMMEDIATE", "SAVEPOINT request"]);
    assert_eq!(controls[n - 2..], ["RELEASE request", "COMMIT"]);

    // The first request's write fails once: that attempt is rolled back
    // whole and the request served again in a savepoint, as alone.
    let dir = TempDir::new();
    let mut engine = Engine::new(direct_store(&dir));
    let claims = fail_claim_once(engine.store(), "a");
    let (outcomes, controls) = served_in_batch(&mut engine, &batch);
    assert_eq!(claims.load(Ordering::SeqCst), 2);
    assert_eq!(
        controls[..4],
        [
            "BEGIN IMMEDIATE",
            "ROLLBACK",
            "BEGIN IMMEDIATE",
            "SAVEPOINT request"
        ],
        "{controls:?}"
    );
    assert_eq!(outcomes, expected);
    assert!(engine.store().conn.is_autocommit());
    assert_counters(engine.store());
    assert_eq!(committed(&dir.db()), committed(&twin_dir.db()));

    // A failed first request leaves nothing, and the batch goes on.
    let failing = fail_claim_always(engine.store(), "x");
    let (outcomes, _) = served_in_batch(&mut engine, &[add("x"), add("c")]);
    assert!(failing.load(Ordering::SeqCst) >= 1);
    assert!(!matches!(outcomes[0], Outcome::Done(_)), "{outcomes:?}");
    assert_eq!(outcomes[1], served_alone(&mut twin, &add("c")).0);
    assert_counters(engine.store());
    assert_eq!(committed(&dir.db()), committed(&twin_dir.db()));
}
