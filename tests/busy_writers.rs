//! Issue 21: no transient "database is busy" (code 11) where the database
//! is busy only for a moment. Plugins in direct mode open a fresh node's
//! database together with a daemon that is starting, while the file is
//! still being made: whoever reads the empty file must take the write lock
//! to turn WAL on, and SQLite answers that upgrade busy at once, without
//! waiting (before the fix: code 11 "database is locked" in every round).
//! Here the test holds that first write lock, as a slow first opener on a
//! loaded node does, until an opener has met it. Then the daemon is
//! SIGKILLed and a new one starts under another burst (the next opener
//! recovers the WAL). Every call must succeed, and every container hold
//! one address of its own. Real binary, parallel processes.
//!
//! `METIS_BUSY_ROUNDS` sets the number of fresh nodes (default 4; `make
//! soak` runs 100).

use std::collections::BTreeSet;
use std::sync::Barrier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::common;

use common::node::{NetConf, Outcome, holdings};
use common::{Plugin, TestDaemon, TestDir};

/// Plugin processes of each burst, each running [`CALLS`].
const PLUGINS: usize = 8;
/// What each plugin of a burst runs, in order: it ends holding one address.
const CALLS: [&str; 3] = ["ADD", "DEL", "ADD"];

/// How long a daemon may take to listen on a loaded machine.
const START_PATIENCE: Duration = Duration::from_secs(120);

/// Runs one burst: the plugins start together with `during` (run on this
/// thread once they are released, given the count of calls answered);
/// returns every call that did not succeed.
fn burst(conf: &str, tag: &str, during: impl FnOnce(&AtomicUsize)) -> Vec<String> {
    let barrier = Barrier::new(PLUGINS + 1);
    let failures = std::sync::Mutex::new(Vec::new());
    let answered = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for plugin in 0..PLUGINS {
            let (barrier, failures, answered) = (&barrier, &failures, &answered);
            scope.spawn(move || {
                let container = format!("{tag}-{plugin}");
                barrier.wait();
                for verb in CALLS {
                    let output = Plugin::new(verb, &container).run(conf);
                    match Outcome::of(&output) {
                        Outcome::Ok(_) => {}
                        other => failures
                            .lock()
                            .unwrap()
                            .push(format!("{verb} {container}: {other:?}")),
                    }
                    answered.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        barrier.wait();
        during(&answered);
    });
    failures.into_inner().unwrap()
}

/// One fresh node: a burst while the first daemon starts, a SIGKILL, and a
/// burst while the next one starts on the WAL the killed one left. Returns the failed calls.
fn round(round: u64) -> Vec<String> {
    let dir = TestDir::new("busy-writers");
    let conf = NetConf::new("busy", &["198.18.170.0/24"]).render(&dir, &[], None);
    let args = ["--release-cooldown", "0s"];
    let db = dir.join("metis.sqlite");
    // The file as its first opener leaves it while it turns WAL on: empty,
    // under that opener's write lock (rollback journal, as every new
    // SQLite file starts).
    std::fs::File::create(&db).unwrap();
    let maker = rusqlite::Connection::open(&db).unwrap();
    maker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let mut daemon = None;
    let mut failures = burst(&conf, &format!("r{round}a"), |answered| {
        daemon = Some(TestDaemon::spawn(&dir, &args, "daemon.log"));
        // Until an opener met the lock (it says so, or failed) or the
        // calls ended without meeting it.
        common::wait_for("an opener to meet the lock", START_PATIENCE, || {
            let logs = read(&dir, "cni.log") + &read(&dir, "daemon.log");
            logs.contains("database busy; trying again") || answered.load(Ordering::SeqCst) > 0
        });
        maker.execute_batch("COMMIT").unwrap();
    });
    let mut first = daemon.take().unwrap();
    first.wait_for_log("listening", START_PATIENCE);
    // Killed between calls: a call it had taken could have no answer.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    failures.extend(burst(&conf, &format!("r{round}b"), |_| {
        daemon = Some(TestDaemon::spawn(&dir, &args, "daemon-2.log"));
    }));
    let mut second = daemon.take().unwrap();
    second.wait_for_log("listening", START_PATIENCE);
    drop(second);
    // Each container holds one address, and no address has two owners.
    let held = holdings(&db);
    let containers: BTreeSet<&str> = held.iter().map(|h| h.container.as_str()).collect();
    let addresses: BTreeSet<_> = held.iter().map(|h| h.address).collect();
    if failures.is_empty() && (containers.len(), addresses.len()) != (2 * PLUGINS, held.len()) {
        failures.push(format!("round {round}: holdings {held:?}"));
    }
    failures
}

fn read(dir: &TestDir, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_default()
}

#[test]
fn plugins_beside_a_starting_or_killed_daemon_are_never_told_busy() {
    let rounds = std::env::var("METIS_BUSY_ROUNDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(4);
    let failures: Vec<String> = (0..rounds).flat_map(round).collect();
    assert!(
        failures.is_empty(),
        "{} of {} calls failed: {failures:#?}",
        failures.len(),
        rounds * 2 * (PLUGINS * CALLS.len()) as u64
    );
}
