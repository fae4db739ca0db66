//! What SQL one CNI ADD and one DEL run through the engine, listed with
//! `sqlite3_trace_v2` and each statement's VDBE steps: the per-request
//! budget the daemon and direct mode share.

use std::sync::{Arc, Mutex};

use rusqlite::trace::{TraceEvent, TraceEventCodes};

use crate::engine::request::Command;
use crate::engine::{Engine, Outcome};

use super::*;

/// The statements (SQL, VDBE steps) `request` runs, served as the
/// daemon serves it: in a batch, then committed.
fn traced(engine: &mut Engine, request: &Command) -> Vec<(String, i32)> {
    let seen: Arc<Mutex<Vec<(String, i32)>>> = Arc::default();
    let sink = Arc::clone(&seen);
    engine
        .store_mut()
        .conn
        .trace_v2(
            TraceEventCodes::SQLITE_TRACE_PROFILE,
            Some(move |event: TraceEvent<'_>| {
                if let TraceEvent::Profile(stmt, _) = event {
                    let steps = stmt.get_status(rusqlite::StatementStatus::VmStep);
                    sink.lock().unwrap().push((stmt.sql().into_owned(), steps));
                }
            }),
        )
        .unwrap();
    let outcome = engine.handle_in_batch(request, NOW);
    assert!(matches!(outcome, Outcome::Done(_)), "{outcome:?}");
    assert!(engine.commit_batch().is_none());
    engine
        .store_mut()
        .conn
        .trace_v2(TraceEventCodes::empty(), None::<fn(TraceEvent<'_>)>)
        .unwrap();
    std::mem::take(&mut *seen.lock().unwrap())
}

#[test]
fn an_add_and_a_del_run_within_their_statement_budget() {
    let dir = TempDir::new();
    let mut engine = Engine::new(dir.store_with_cooldown(0));
    for k in 0..4 {
        let container = format!("warm{k}");
        traced(&mut engine, &add(&container));
        traced(&mut engine, &del(&container));
    }
    let adds = traced(&mut engine, &add("c"));
    let dels = traced(&mut engine, &del("c"));
    // What each runs today (`--nocapture` lists it): a new statement on
    // this path is a cost every request pays, so it is a decision.
    // DEL 13: the owner's block read by its key, where a join cost more
    // to prepare (direct mode prepares every statement it runs).
    for (what, list, budget) in [("ADD", &adds, 25), ("DEL", &dels, 13)] {
        let steps: i32 = list.iter().map(|(_, s)| s).sum();
        eprintln!("{what}: {} statements, {steps} VDBE steps", list.len());
        for (sql, steps) in list.iter() {
            eprintln!("  {steps:>5}  {sql}");
        }
        assert!(
            list.len() <= budget,
            "{what} runs {} statements",
            list.len()
        );
        for (sql, _) in list.iter() {
            // The schema is known on the write path; rusqlite's own
            // savepoints are parsed again at every use.
            assert!(!sql.contains("sqlite_master"), "{what}: {sql}");
            assert!(!sql.contains("_rusqlite_sp"), "{what}: {sql}");
        }
    }
    let owner_lookups = |list: &[(String, i32)]| {
        list.iter()
            .filter(|(sql, _)| {
                sql.starts_with("SELECT id, cidr_block_id, address FROM ip_addresses")
            })
            .count()
    };
    assert_eq!((owner_lookups(&adds), owner_lookups(&dels)), (1, 1));
    let registration = |list: &[(String, i32)]| {
        list.iter()
            .filter(|(sql, _)| sql.contains("host_local_dir_identity FROM metis_networks"))
            .count()
    };
    assert_eq!((registration(&adds), registration(&dels)), (1, 1));
    // The network's isolation (the layout, the hand-out check) and the
    // conflist that served it: one statement, prepared once.
    let network_row = |list: &[(String, i32)]| {
        list.iter()
            .filter(|(sql, _)| sql == crate::store::db::NETWORK_ROW_SQL)
            .count()
    };
    assert_eq!((network_row(&adds), network_row(&dels)), (3, 0));
}

/// The VDBE steps an ADD spends finding its row do not grow with the rows
/// still cooling: 20 or 200 released an hour ago cost the same.
#[test]
fn an_add_does_not_walk_the_rows_cooling() {
    let dir = TempDir::new();
    let mut engine = Engine::new(dir.store_with_cooldown(3_600_000));
    // A cached statement's count runs on over its executions.
    let claim_steps = |list: &[(String, i32)]| -> i32 {
        list.iter()
            .filter(|(sql, _)| sql.starts_with("SELECT id, address FROM ip_addresses"))
            .map(|(_, steps)| steps)
            .sum()
    };
    let mut counts = Vec::new();
    for k in 0..200 {
        let container = format!("c{k}");
        let adds = traced(&mut engine, &add(&container));
        traced(&mut engine, &del(&container));
        if [19, 20, 198, 199].contains(&k) {
            counts.push(claim_steps(&adds));
        }
    }
    let (with_20, with_200) = (counts[1] - counts[0], counts[3] - counts[2]);
    assert!(with_20 > 0, "{counts:?}");
    assert_eq!(with_20, with_200, "steps with 20 and 200 rows cooling");
}
