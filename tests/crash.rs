//! Crash safety: the daemon is killed with SIGKILL at random moments while
//! 8 plugin processes run a mix of ADD and DEL, then restarted; while it is
//! down the plugins fall back to direct mode and write the database
//! themselves. After every round the database must keep the IPAM's promise:
//! every ADD that succeeded is still allocated to its owner unless a later
//! DEL succeeded, no address has two owners, counters equal rows
//! (`metis admin check`), and every plugin call ended in a result or a
//! retryable error (code 11).
//!
//! `make test` runs a short version; `make soak` the full one (20 rounds of
//! 500 operations): `METIS_CRASH_ROUNDS`, `METIS_CRASH_OPS` and
//! `METIS_CRASH_SEED` override rounds, operations per round and the seed.

use crate::common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::node::holdings;
use common::rng::Rng;
use common::{Plugin, TestDaemon, TestDir, assert_ok, conf, db, json};

const V4: &str = r#"[[{"subnet":"198.18.0.0/24"}]]"#;
const WORKERS: usize = 8;
/// Containers each worker cycles through: 48 in all, far below the /24, so
/// exhaustion never masks a result.
const IDS_PER_WORKER: usize = 6;

/// What the plugin's answers say about one container's address.
#[derive(Debug, Clone, PartialEq)]
enum Expect {
    Free,
    Held(String),
    /// A call failed with code 11 after (possibly) reaching the database.
    Unknown,
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(default)
}

/// How the daemon is treated during a round.
struct Chaos {
    /// Time the daemon stays up between kills (ms, uniform).
    up_ms: (u64, u64),
    /// Time it stays down before the restart (ms, uniform).
    down_ms: (u64, u64),
    /// Down long enough that plugins must have used direct mode.
    direct: bool,
}

struct Round<'a> {
    config: &'a str,
    expect: &'a Mutex<HashMap<String, Expect>>,
    failures: &'a Mutex<Vec<String>>,
    successes: &'a AtomicU64,
    retryable: &'a AtomicU64,
}

impl Round<'_> {
    /// One worker's share of the round: ADD or DEL on its own containers,
    /// so the calls for one container are sequential and their outcomes
    /// define what the database must hold.
    fn work(&self, worker: usize, ops: usize, mut rng: Rng) {
        for _ in 0..ops {
            let id = format!("w{worker}-{}", rng.below(IDS_PER_WORKER as u64));
            let before = self.expect.lock().unwrap().get(&id).cloned();
            let before = before.unwrap_or(Expect::Free);
            let add = match before {
                Expect::Free => rng.chance(85),
                Expect::Held(_) => rng.chance(25),
                Expect::Unknown => rng.chance(50),
            };
            let verb = if add { "ADD" } else { "DEL" };
            let output = Plugin::new(verb, &id).run(self.config);
            let after = if output.status.success() {
                self.successes.fetch_add(1, Ordering::Relaxed);
                if add {
                    let address = json(&output)["ips"][0]["address"]
                        .as_str()
                        .unwrap()
                        .to_string();
                    if let Expect::Held(held) = &before
                        && *held != address
                    {
                        self.fail(format!(
                            "repeated ADD of {id} returned {address}, it holds {held}"
                        ));
                    }
                    Expect::Held(address)
                } else {
                    Expect::Free
                }
            } else {
                let code = serde_json::from_slice::<serde_json::Value>(&output.stdout)
                    .ok()
                    .and_then(|v| v["code"].as_u64());
                if code != Some(11) {
                    self.fail(format!(
                        "{verb} {id}: neither a result nor code 11: status {:?}, stdout {}, stderr {}",
                        output.status,
                        String::from_utf8_lossy(&output.stdout),
                        String::from_utf8_lossy(&output.stderr)
                    ));
                }
                self.retryable.fetch_add(1, Ordering::Relaxed);
                match (add, before) {
                    // A failed ADD never releases what the owner holds, and
                    // a failed DEL of nothing leaves nothing.
                    (true, held @ Expect::Held(_)) | (false, held @ Expect::Free) => held,
                    _ => Expect::Unknown,
                }
            };
            self.expect.lock().unwrap().insert(id, after);
        }
    }

    fn fail(&self, what: String) {
        self.failures.lock().unwrap().push(what);
    }
}

/// Kills and restarts the daemon at random until `done`; returns the kills.
fn chaos(
    dir: &TestDir,
    daemon: &Mutex<Option<TestDaemon>>,
    chaos: &Chaos,
    done: &AtomicBool,
    mut rng: Rng,
) -> u64 {
    let between =
        |rng: &mut Rng, (lo, hi): (u64, u64)| Duration::from_millis(lo + rng.below(hi - lo + 1));
    let mut kills = 0;
    while !done.load(Ordering::Relaxed) {
        // Random timing is the point here, not synchronisation.
        std::thread::sleep(between(&mut rng, chaos.up_ms));
        if let Some(mut running) = daemon.lock().unwrap().take() {
            running.child.kill().unwrap(); // SIGKILL
            running.child.wait().unwrap();
            kills += 1;
        }
        std::thread::sleep(between(&mut rng, chaos.down_ms));
        *daemon.lock().unwrap() = Some(TestDaemon::start(dir, &["--release-cooldown", "0"]));
    }
    kills
}

/// Every container's rows as the database holds them.
fn held_by_owner(dir: &TestDir) -> HashMap<String, Vec<String>> {
    let mut held: HashMap<String, Vec<String>> = HashMap::new();
    for holding in holdings(&dir.join("metis.sqlite")) {
        held.entry(holding.container)
            .or_default()
            .push(holding.address.to_string());
    }
    held
}

/// Compares the database with what the plugins were told; resolves the
/// unknown outcomes from the database for the next round.
fn verify(dir: &TestDir, expect: &mut HashMap<String, Expect>, round: usize) {
    let check = common::admin_check(&dir.join("metis.sqlite"));
    assert!(
        check.status.success(),
        "round {round}: metis admin check failed:\n{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let held = held_by_owner(dir);
    let mut owners_of: HashMap<&str, Vec<&str>> = HashMap::new();
    for (owner, addresses) in &held {
        assert!(
            addresses.len() <= 1,
            "round {round}: {owner} holds {addresses:?}"
        );
        for address in addresses {
            owners_of.entry(address).or_default().push(owner);
        }
        assert!(
            expect.contains_key(owner),
            "round {round}: {owner} holds {addresses:?} but no ADD for it was ever made"
        );
    }
    for (address, owners) in &owners_of {
        assert_eq!(
            owners.len(),
            1,
            "round {round}: {address} held by {owners:?}"
        );
    }
    for (owner, wanted) in expect.iter_mut() {
        let actual = held.get(owner).and_then(|a| a.first());
        match (&*wanted, actual) {
            (Expect::Held(address), Some(found)) => assert_eq!(
                address.split('/').next(),
                Some(found.as_str()),
                "round {round}: {owner} was given {address} but holds {found}"
            ),
            (Expect::Held(address), None) => {
                panic!("round {round}: {owner} was given {address}, which is no longer allocated")
            }
            (Expect::Free, Some(found)) => {
                panic!("round {round}: {owner} was released but still holds {found}")
            }
            (Expect::Free, None) => {}
            (Expect::Unknown, found) => {
                *wanted = match found {
                    Some(found) => Expect::Held(format!("{found}/24")),
                    None => Expect::Free,
                };
            }
        }
    }
}

fn run_rounds(name: &str, chaos_plan: &Chaos) {
    let rounds = env_number("METIS_CRASH_ROUNDS", 3);
    let ops = env_number("METIS_CRASH_OPS", 100);
    let mut rng = Rng::from_env("METIS_CRASH_SEED");
    let dir = TestDir::new(name);
    let config = conf(&dir, "1.0.0", V4, "");
    let daemon = Mutex::new(Some(TestDaemon::start(&dir, &["--release-cooldown", "0"])));
    let expect = Mutex::new(HashMap::new());
    let (mut total_kills, mut total_ok, mut total_retry) = (0, 0, 0);
    for round in 0..rounds {
        let failures = Mutex::new(Vec::new());
        let successes = AtomicU64::new(0);
        let retryable = AtomicU64::new(0);
        let done = AtomicBool::new(false);
        let work = Round {
            config: &config,
            expect: &expect,
            failures: &failures,
            successes: &successes,
            retryable: &retryable,
        };
        let kills = std::thread::scope(|scope| {
            let killer = {
                let (dir, daemon, done, rng) = (&dir, &daemon, &done, rng.fork());
                scope.spawn(move || chaos(dir, daemon, chaos_plan, done, rng))
            };
            let workers: Vec<_> = (0..WORKERS)
                .map(|worker| {
                    let (work, rng) = (&work, rng.fork());
                    let share = ops / WORKERS + usize::from(worker < ops % WORKERS);
                    scope.spawn(move || work.work(worker, share, rng))
                })
                .collect();
            for worker in workers {
                worker.join().unwrap();
            }
            done.store(true, Ordering::Relaxed);
            killer.join().unwrap()
        });
        let failures = failures.into_inner().unwrap();
        assert!(failures.is_empty(), "round {round}: {failures:#?}");
        // A killed daemon leaves the database as the crash left it.
        if let Some(mut running) = daemon.lock().unwrap().take() {
            running.child.kill().unwrap();
            running.child.wait().unwrap();
        }
        verify(&dir, &mut expect.lock().unwrap(), round);
        eprintln!(
            "round {round}: {} ok, {} retryable, {kills} kills",
            successes.load(Ordering::Relaxed),
            retryable.load(Ordering::Relaxed)
        );
        total_kills += kills;
        total_ok += successes.load(Ordering::Relaxed);
        total_retry += retryable.load(Ordering::Relaxed);
        *daemon.lock().unwrap() = Some(TestDaemon::start(&dir, &["--release-cooldown", "0"]));
    }
    // The test must have exercised what it claims to.
    assert!(total_kills >= rounds as u64, "only {total_kills} kills");
    assert!(
        total_ok > (rounds * ops / 2) as u64,
        "{total_ok} successes, {total_retry} retryable"
    );
    let log = std::fs::read_to_string(dir.join("cni.log")).unwrap_or_default();
    let direct = log.matches("using direct mode").count();
    assert!(
        direct > 0 || !chaos_plan.direct,
        "no plugin ever ran in direct mode"
    );
    eprintln!(
        "{name}: {total_ok} ok, {total_retry} retryable, {total_kills} kills, {direct} direct-mode calls"
    );
}

#[test]
fn sigkill_during_adds_and_dels_loses_and_duplicates_nothing() {
    run_rounds(
        "crash-daemon",
        &Chaos {
            up_ms: (5, 80),
            down_ms: (0, 30),
            direct: false,
        },
    );
}

#[test]
fn direct_mode_writes_while_the_daemon_restarts() {
    run_rounds(
        "crash-direct",
        &Chaos {
            up_ms: (10, 150),
            down_ms: (150, 600),
            direct: true,
        },
    );
}

/// Writes to the database behind the daemon's back.
fn write_behind(dir: &TestDir, sql: &str) {
    rusqlite::Connection::open(dir.join("metis.sqlite"))
        .unwrap()
        .execute_batch(sql)
        .unwrap();
}

/// After a crash the start check reads only the allocated rows and those
/// written since the last sound check; a row corrupted behind the daemon's
/// back while it was down is among them: its block is quarantined before
/// anything is served, and its address is never handed out.
#[test]
fn a_row_corrupted_while_the_daemon_was_down_is_quarantined_before_serving() {
    let dir = TestDir::new("crash-planted");
    let config = conf(&dir, "1.0.0", V4, "");
    let flags = ["--release-cooldown", "0"];
    let first = TestDaemon::start(&dir, &flags);
    for pod in ["a", "b"] {
        assert_ok(&Plugin::new("ADD", pod).run(&config));
    }
    drop(first); // SIGKILL
    // Every row an hour old, as rows left alone since an earlier start
    // are (the trigger that stamps updates is put back: a schema change,
    // so the next start reads every row and vouches for them).
    write_behind(
        &dir,
        "DROP TRIGGER update_ip_addresses_updated_at; \
         UPDATE ip_addresses SET updated_at = updated_at - 3600000; \
         CREATE TRIGGER update_ip_addresses_updated_at AFTER UPDATE ON ip_addresses \
         FOR EACH ROW BEGIN UPDATE ip_addresses SET updated_at = \
         (CAST(unixepoch('subsec') * 1000 AS INTEGER)) WHERE id = OLD.id; END;",
    );
    let second = TestDaemon::start(&dir, &flags);
    let count = |sql: &str| -> u64 {
        let n: i64 = db(&dir.join("metis.sqlite"))
            .query_row(sql, [], |r| r.get(0))
            .unwrap();
        u64::try_from(n).unwrap()
    };
    let rows = count("SELECT COUNT(*) FROM ip_addresses");
    assert_eq!(second.last_start_check(), ("rows".to_string(), rows));
    drop(second); // SIGKILL
    // Behind its back: the next free row is moved outside the block.
    write_behind(
        &dir,
        "UPDATE ip_addresses SET address = '198.18.9.4' WHERE address = '198.18.0.4'",
    );
    let third = TestDaemon::start(&dir, &flags);
    let (scope, read) = third.last_start_check();
    let allocated = count("SELECT COUNT(*) FROM ip_addresses WHERE is_allocated = 1");
    // The allocated rows and the one written since: not every row.
    assert_eq!((scope.as_str(), read), ("changed", allocated + 1));
    assert!(read < rows, "{read} of {rows}");
    assert!(
        third.log().contains("block quarantined") && third.log().contains("198.18.9.4"),
        "{}",
        third.log()
    );
    // The network's one block is quarantined: the ADD says so, and the
    // moved address is handed out to no one.
    let refused = Plugin::new("ADD", "c").run(&config);
    assert!(!refused.status.success());
    let answer = json(&refused);
    assert_eq!(answer["code"], 11, "{answer}");
    assert!(
        answer["msg"].as_str().unwrap_or("").contains("quarantined")
            || answer["details"]
                .as_str()
                .unwrap_or("")
                .contains("quarantined"),
        "{answer}"
    );
    let held = held_by_owner(&dir);
    assert!(
        !held
            .values()
            .flatten()
            .any(|address| address == "198.18.9.4"),
        "{held:?}"
    );
    assert_eq!(held.len(), 2, "the pods keep their addresses: {held:?}");
    // Every start now reads every row until the fault is gone.
    drop(third);
    let fourth = TestDaemon::start(&dir, &flags);
    assert_eq!(fourth.last_start_check().0, "rows");
}

/// Size of the WAL beside `db` (none: 0).
fn wal_size(db: &std::path::Path) -> u64 {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(wal).map_or(0, |meta| meta.len())
}

/// No daemon at all: every plugin serves itself (direct mode) and some are
/// SIGKILLed at a random point of their run — in the open, the request's
/// transaction, the WAL checkpoint a process makes once the WAL has passed
/// its limit (`Store::trim_wal`: syncs, copy, truncation), or the exit.
/// The process that will checkpoint is killed more often. After every
/// round: what `verify` checks (every answered ADD still held by its
/// owner, no address with two owners, `metis admin check`), SQLite's own
/// `integrity_check`; after every exec that ran to its end, a WAL below the
/// limit; and checkpoints and kills inside them must have happened (the
/// last round runs on, up to four times its length, until one has).
#[test]
fn direct_mode_plugins_killed_at_random_lose_and_duplicate_nothing() {
    use std::io::Write;
    use std::os::unix::process::ExitStatusExt;
    let rounds = env_number("METIS_CRASH_ROUNDS", 3);
    let ops = env_number("METIS_CRASH_OPS", 100);
    let mut rng = Rng::from_env("METIS_CRASH_SEED");
    let dir = TestDir::new("crash-direct-exec");
    let path = dir.join("metis.sqlite");
    let config = conf(&dir, "1.0.0", V4, "");
    // Released addresses free at once, as recorded by a daemon started once.
    assert!(
        TestDaemon::start(&dir, &["--release-cooldown", "0"])
            .stop()
            .success()
    );
    let limit = metis::store::ONE_REQUEST_WAL_LIMIT;
    // How long the last execs that ran to their end took (a debug build, a
    // loaded machine): kills are spread over the median.
    let mut recent_us: Vec<u64> = Vec::new();
    let mut expect: HashMap<String, Expect> = HashMap::new();
    let (mut kills, mut killed_checkpoints, mut checkpoints) = (0, 0, 0);
    // How long the last execs that checkpointed took: the kills aimed at a
    // checkpoint are spread from the end of a plain exec's work to there.
    let mut checkpoint_us: Vec<u64> = Vec::new();
    for round in 0..rounds {
        // The last round goes on (up to four times as long) until a kill
        // has landed at a checkpoint: where the checkpoint falls in an exec
        // moves with the machine and the build.
        let last = round + 1 == rounds;
        let mut op = 0;
        while op < ops || (last && killed_checkpoints == 0 && op < 4 * ops) {
            op += 1;
            let id = format!("d{}", rng.below(12));
            let before = expect.get(&id).cloned().unwrap_or(Expect::Free);
            let add = match before {
                Expect::Free => rng.chance(80),
                Expect::Held(_) => rng.chance(25),
                Expect::Unknown => rng.chance(50),
            };
            let verb = if add { "ADD" } else { "DEL" };
            let wal_before = wal_size(&path);
            // It will checkpoint once its own frames are written.
            let checkpoints_next = wal_before + 10 * 4120 >= limit;
            let kill = rng.chance(if checkpoints_next { 75 } else { 35 });
            let mut child = Plugin::new(verb, &id)
                .command()
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(config.as_bytes()).unwrap();
            drop(stdin);
            let median_us = |recent: &[u64]| match recent.len() {
                0 => 20_000,
                n => {
                    let mut sorted = recent.to_vec();
                    sorted.sort_unstable();
                    sorted[n / 2].max(1_000)
                }
            };
            // An exec's own work takes about what a plain one does; its
            // checkpoint comes after, until the end of a checkpointing one.
            let run_us = median_us(&recent_us);
            let checkpoint_end_us = match checkpoint_us.is_empty() {
                true => run_us * 3 / 2,
                false => median_us(&checkpoint_us).max(run_us) * 11 / 10,
            };
            let started = std::time::Instant::now();
            if kill {
                // Random timing is the point here, not synchronisation; the
                // checkpoint comes last, so that exec is killed late.
                let (from, to) = match checkpoints_next {
                    true => (run_us * 4 / 5, checkpoint_end_us),
                    false => (0, run_us * 3 / 2),
                };
                std::thread::sleep(Duration::from_micros(
                    from + rng.below(to.saturating_sub(from).max(1)),
                ));
                let _ = child.kill(); // SIGKILL; it may have exited already
            }
            let output = child.wait_with_output().unwrap();
            let after = if output.status.signal() == Some(9) {
                kills += 1;
                if wal_size(&path) >= limit && checkpoints_next {
                    killed_checkpoints += 1;
                }
                match (add, before) {
                    // An ADD never releases what the owner holds, and a DEL
                    // of nothing leaves nothing.
                    (true, held @ Expect::Held(_)) | (false, held @ Expect::Free) => held,
                    _ => Expect::Unknown,
                }
            } else {
                assert_ok(&output);
                if recent_us.len() == 16 {
                    recent_us.remove(0);
                }
                recent_us.push(u64::try_from(started.elapsed().as_micros()).unwrap());
                let wal_after = wal_size(&path);
                assert!(
                    wal_after < limit,
                    "round {round}: {verb} {id} ran to its end and left a WAL of {wal_after} bytes"
                );
                if wal_after < wal_before {
                    checkpoints += 1;
                    if checkpoint_us.len() == 16 {
                        checkpoint_us.remove(0);
                    }
                    checkpoint_us.push(*recent_us.last().unwrap());
                }
                match add {
                    true => {
                        let address = json(&output)["ips"][0]["address"]
                            .as_str()
                            .unwrap()
                            .to_string();
                        if let Expect::Held(held) = &before {
                            assert_eq!(*held, address, "repeated ADD of {id}");
                        }
                        Expect::Held(address)
                    }
                    false => Expect::Free,
                }
            };
            expect.insert(id, after);
        }
        verify(&dir, &mut expect, round);
        let integrity: String = db(&path)
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .unwrap();
        assert_eq!(integrity, "ok", "round {round}");
    }
    eprintln!(
        "{kills} kills, {killed_checkpoints} of them at a checkpoint; {checkpoints} checkpoints \
         completed (the last execs took {recent_us:?} µs)"
    );
    assert!(kills >= rounds * ops / 10, "only {kills} kills");
    assert!(checkpoints >= rounds, "only {checkpoints} checkpoints");
    assert!(killed_checkpoints >= 1, "no kill landed at a checkpoint");
}
