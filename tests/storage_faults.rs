//! Storage faults, created for real: a full disk (a small tmpfs), a
//! read-only file system, a database file deleted under the daemon, a
//! database locked by another process beyond the busy timeout, and a
//! corrupt database (bytes overwritten in a copy). Each yields a clear
//! error — CNI code 11 (try again later) or 104 (store unusable) naming the
//! reason — never a panic, and never loses an allocation that existed.
//! Mounting needs root, as these tests run.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::node::held;
use common::tmpfs::Tmpfs;
use common::{Plugin, TestDaemon, TestDir, admin_check, assert_ok, json, wait_for};

/// A configuration on `dir` for network `network` with `range`.
fn config(dir: &TestDir, network: &str, range: &str) -> String {
    config_at(dir, &dir.join("metis.sqlite"), network, range)
}

fn config_at(dir: &TestDir, db: &Path, network: &str, range: &str) -> String {
    format!(
        r#"{{"cniVersion":"1.0.0","name":"{network}","type":"metis","ipam":{{"type":"metis","ranges":[[{{"subnet":"{range}"}}]],"daemonSocket":"{}","dbPath":"{}","logFile":"/dev/null"}}}}"#,
        dir.join("metis.sock").display(),
        db.display(),
    )
}

/// Asserts a CNI error with `code` whose text mentions `reason`.
fn assert_error(output: &Output, code: u64, reason: &str) {
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let error = json(output);
    assert_eq!(error["code"], code, "{error}");
    let text = format!("{} {}", error["msg"], error["details"]).to_lowercase();
    assert!(text.contains(reason), "{error} does not mention {reason:?}");
    assert!(
        !String::from_utf8_lossy(&output.stderr).contains("panicked"),
        "{output:?}"
    );
}

/// Runs a daemon on `db` to completion (it should refuse to start).
fn daemon_output(socket: &Path, db: &Path) -> Output {
    Command::new(common::METIS)
        .args(["daemon", "--socket-path"])
        .arg(socket)
        .arg("--db-path")
        .arg(db)
        .output()
        .unwrap()
}

#[test]
fn a_full_disk_is_try_again_later_and_loses_nothing() {
    let fs = Tmpfs::mount("fault-full", "3m");
    let dir = &fs.dir;
    let db = dir.join("metis.sqlite");
    let daemon = TestDaemon::start(dir, &[]);
    assert_ok(&Plugin::new("ADD", "keep").run(&config(dir, "small", "198.18.0.0/24")));
    let kept = held(&db, "keep");
    let filler = fs.fill("filler");

    // A new network of 4096 addresses needs pages the disk does not have.
    let big = config(dir, "big", "198.18.16.0/20");
    let through_daemon = Plugin::new("ADD", "new").run(&big);
    assert_error(&through_daemon, 11, "full");
    assert!(!daemon.log().contains("panicked"), "{}", daemon.log());
    let status = daemon.stop();
    assert!(status.success(), "daemon exit {status:?}");

    // Direct mode, with the disk still full (the daemon's stop may have
    // freed the pages of its WAL).
    let more = fs.fill("filler-2");
    let direct = Plugin::new("ADD", "new").run(&big);
    assert_error(&direct, 11, "full");

    // Space again: nothing was lost, and everything works.
    std::fs::remove_file(filler).unwrap();
    std::fs::remove_file(more).unwrap();
    assert_eq!(held(&db, "keep"), kept);
    assert!(held(&db, "new").is_empty());
    assert_ok(&admin_check(&db));
    assert_ok(&Plugin::new("ADD", "new").run(&big));
}

#[test]
fn a_read_only_database_is_an_error_naming_it() {
    let fs = Tmpfs::mount("fault-ro", "8m");
    let dir = &fs.dir;
    let db = dir.join("metis.sqlite");
    let conf = config(dir, "pods", "198.18.0.0/24");
    let daemon = TestDaemon::start(dir, &[]);
    assert_ok(&Plugin::new("ADD", "keep").run(&conf));
    let kept = held(&db, "keep");
    assert!(daemon.stop().success());
    fs.remount("ro");

    // The daemon refuses to start on it, naming the database.
    let output = daemon_output(&dir.join("metis.sock"), &db);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(db.to_str().unwrap()), "{stderr}");

    // Direct mode: ADD and DEL are "try again later", with the reason.
    let add = Plugin::new("ADD", "new").run(&conf);
    assert_error(&add, 11, "database");
    let del = Plugin::new("DEL", "keep").run(&conf);
    assert_error(&del, 11, "database");

    fs.remount("rw");
    assert_eq!(held(&db, "keep"), kept);
    assert_ok(&admin_check(&db));
}

/// Every row of every table, in order, as text: what a restore must keep.
fn dump(db: &Path) -> Vec<String> {
    // Closed before returning: a connection left open on a file deleted
    // later would be one more writer of its WAL.
    let conn = common::db(db);
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut rows = Vec::new();
    for table in tables {
        let mut stmt = conn
            .prepare(&format!("SELECT * FROM \"{table}\" ORDER BY 1"))
            .unwrap();
        let columns = stmt.column_count();
        let mut query = stmt.query([]).unwrap();
        while let Some(row) = query.next().unwrap() {
            let values: Vec<String> = (0..columns)
                .map(|i| format!("{:?}", row.get::<_, rusqlite::types::Value>(i).unwrap()))
                .collect();
            rows.push(format!("{table}: {}", values.join(", ")));
        }
    }
    // The healing's record of the file as it last left it (not an
    // allocation): the open of a restored file heals and records it anew.
    rows.retain(|row| !row.starts_with("metis_settings: Text(\"healed_state\")"));
    rows
}

/// Addresses held by pods (reservations excluded).
fn live_addresses(db: &Path) -> Vec<String> {
    let conn = common::db(db);
    let mut stmt = conn
        .prepare(
            "SELECT address FROM ip_addresses WHERE is_allocated = 1 \
             AND COALESCE(container_id, '') != '' ORDER BY address",
        )
        .unwrap();
    stmt.query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// A daemon on `dir` with pods `p0`..`p11`, `p3` and `p7` deleted again.
fn daemon_with_pods(dir: &TestDir, conf: &str) -> TestDaemon {
    let daemon = TestDaemon::start(dir, &[]);
    for pod in 0..12 {
        assert_ok(&Plugin::new("ADD", &format!("p{pod}")).run(conf));
    }
    for pod in [3, 7] {
        assert_ok(&Plugin::new("DEL", &format!("p{pod}")).run(conf));
    }
    daemon
}

/// Waits for the daemon to say it restored the database, without sending
/// it anything: it notices by itself.
fn wait_for_restore(daemon: &TestDaemon) {
    wait_for(
        "the database to be restored",
        Duration::from_secs(30),
        || daemon.log().contains("database restored at its path"),
    );
}

#[test]
fn a_database_deleted_under_the_daemon_is_restored_with_every_allocation() {
    let dir = TestDir::new("fault-deleted");
    let db = dir.join("metis.sqlite");
    let conf = config(&dir, "pods", "198.18.0.0/24");
    let mut daemon = daemon_with_pods(&dir, &conf);
    let before = dump(&db);
    let live = live_addresses(&db);
    assert_eq!(live.len(), 10);
    for suffix in ["", "-wal", "-shm"] {
        std::fs::remove_file(format!("{}{suffix}", db.display())).unwrap();
    }
    wait_for_restore(&daemon);
    assert!(
        daemon
            .log()
            .contains("deleted or replaced under the daemon")
    );
    assert_eq!(dump(&db), before, "the restored database differs");
    let health = common::metis(&[
        "health",
        "--socket-path",
        dir.join("metis.sock").to_str().unwrap(),
    ]);
    assert!(health.status.success(), "{health:?}");

    // Served from the restored file: nothing live is handed out again.
    let add = Plugin::new("ADD", "new").run(&conf);
    assert_ok(&add);
    let address = json(&add)["ips"][0]["address"]
        .as_str()
        .unwrap()
        .to_string();
    let address = address.split('/').next().unwrap().to_string();
    assert!(!live.contains(&address), "{address} is live: {live:?}");
    assert_eq!(live_addresses(&db).len(), 11);
    assert_ok(&Plugin::new("DEL", "p0").run(&conf));
    assert_ok(&admin_check(&db));
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "{}",
        daemon.log()
    );

    // What a restart finds is the same file.
    assert!(daemon.stop().success());
    let held_after = live_addresses(&db);
    let restarted = TestDaemon::start(&dir, &[]);
    assert_eq!(live_addresses(&db), held_after);
    assert!(restarted.stop().success());
    let left: Vec<String> = std::fs::read_dir(&dir.path)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains("restoring") || name.contains("stand-in"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

#[test]
fn a_database_replaced_under_the_daemon_is_put_back_and_the_other_file_kept() {
    let dir = TestDir::new("fault-replaced");
    let db = dir.join("metis.sqlite");
    let conf = config(&dir, "pods", "198.18.0.0/24");
    let daemon = daemon_with_pods(&dir, &conf);
    let before = dump(&db);
    // Another (empty) database moved over the path.
    let other = dir.join("other.sqlite");
    rusqlite::Connection::open(&other)
        .unwrap()
        .execute_batch("CREATE TABLE mine (x); INSERT INTO mine VALUES (42);")
        .unwrap();
    std::fs::rename(&other, &db).unwrap();
    wait_for_restore(&daemon);
    assert_eq!(dump(&db), before);
    let kept: Vec<PathBuf> = std::fs::read_dir(&dir.path)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.to_string_lossy().contains("metis.sqlite.replaced-"))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let x: i64 = common::db(&kept[0])
        .query_row("SELECT x FROM mine", [], |r| r.get(0))
        .unwrap();
    assert_eq!(x, 42);
    assert_ok(&Plugin::new("ADD", "new").run(&conf));
    assert_ok(&admin_check(&db));
}

#[test]
fn a_restore_cut_short_is_finished_at_the_next_start() {
    let dir = TestDir::new("fault-interrupted");
    let db = dir.join("metis.sqlite");
    let conf = config(&dir, "pods", "198.18.0.0/24");
    let daemon = daemon_with_pods(&dir, &conf);
    assert!(daemon.stop().success());
    // The clean-stop mark is the next start's to consume.
    let kept = |rows: Vec<String>| -> Vec<String> {
        rows.into_iter()
            .filter(|row| !row.contains("clean_stop"))
            .collect()
    };
    let before = kept(dump(&db));
    // What a daemon leaves when it stops between writing its copy of a
    // deleted database and putting it in place.
    std::fs::rename(&db, dir.join("metis.sqlite.restoring")).unwrap();
    // Direct mode does not make an empty database instead.
    let refused = Plugin::new("ADD", "early").run(&conf);
    assert_error(&refused, 11, "restore of it was interrupted");
    assert!(!db.exists());
    let daemon = TestDaemon::start(&dir, &[]);
    assert!(
        daemon
            .log()
            .contains("put back the copy an interrupted restore made")
    );
    assert_eq!(dump(&db), before);
    assert!(!dir.join("metis.sqlite.restoring").exists());
    let add = Plugin::new("ADD", "new").run(&conf);
    assert_ok(&add);
    assert_eq!(json(&add)["ips"][0]["address"], "198.18.0.14/24");
    assert!(daemon.stop().success());
}

#[test]
fn direct_mode_creates_no_database_while_a_daemon_owns_it() {
    let dir = TestDir::new("fault-owned");
    let db = dir.join("metis.sqlite");
    let conf = config(&dir, "pods", "198.18.0.0/24");
    // What a running daemon holds: the lock beside its database. No socket,
    // so the plugin goes to direct mode and finds no database.
    let lock = std::fs::File::create(dir.join("metis.sqlite.lock")).unwrap();
    lock.lock().unwrap();
    let refused = Plugin::new("ADD", "pod").run(&conf);
    assert_error(&refused, 11, "missing while its daemon runs");
    assert!(!db.exists());
    // No daemon: a missing database is a new node's.
    drop(lock);
    assert_ok(&Plugin::new("ADD", "pod").run(&conf));
    assert_eq!(held(&db, "pod").len(), 1);
}

/// The daemon's loop gives up after the busy timeout (code 11); a plugin in
/// direct mode, which blocks no one else, makes its request again as a whole
/// and is served once the lock is gone.
#[test]
fn a_database_locked_beyond_the_busy_timeout_is_try_again_later() {
    let dir = TestDir::new("fault-locked");
    let db = dir.join("metis.sqlite");
    let log = dir.join("cni.log");
    let conf = config(&dir, "pods", "198.18.0.0/24").replace("/dev/null", log.to_str().unwrap());
    let daemon = TestDaemon::start(&dir, &[]);
    assert_ok(&Plugin::new("ADD", "keep").run(&conf));

    // Another process's writer holds the lock for longer than 5 s.
    let locker = rusqlite::Connection::open(&db).unwrap();
    locker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let started = std::time::Instant::now();
    let through_daemon = Plugin::new("ADD", "new").run(&conf);
    assert_error(&through_daemon, 11, "busy (sqlite_busy at begin immediate)");
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "gave up before the busy timeout"
    );
    assert!(daemon.stop().success());
    let direct = std::thread::scope(|scope| {
        let direct = scope.spawn(|| Plugin::new("DEL", "keep").run(&conf));
        // Past one busy timeout: the request is made again.
        wait_for("direct mode to try again", Duration::from_secs(60), || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("database busy; trying again")
        });
        locker.execute_batch("ROLLBACK").unwrap();
        direct.join().unwrap()
    });
    drop(locker);
    assert_ok(&direct);
    assert!(held(&db, "keep").is_empty());
    assert!(held(&db, "new").is_empty());
    assert_ok(&Plugin::new("ADD", "new").run(&conf));
}

#[test]
fn a_corrupt_database_is_refused_and_named() {
    let dir = TestDir::new("fault-corrupt");
    let db = dir.join("metis.sqlite");
    let daemon = TestDaemon::start(&dir, &[]);
    assert_ok(&Plugin::new("ADD", "keep").run(&config(&dir, "pods", "198.18.0.0/24")));
    assert!(daemon.stop().success()); // checkpoints the WAL into the file

    let copy = dir.join("corrupt.sqlite");
    let mut bytes = std::fs::read(&db).unwrap();
    assert!(bytes.len() > 3 * 4096);
    for byte in bytes.iter_mut().skip(4096).take(512) {
        *byte = 0xa5;
    }
    std::fs::write(&copy, &bytes).unwrap();

    // admin check names it; the daemon refuses it, naming the problem.
    let check = admin_check(&copy);
    assert_eq!(check.status.code(), Some(1));
    let output = daemon_output(&dir.join("other.sock"), &copy);
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("malformed") || stderr.contains("quick_check"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // Direct mode on the copy: the store is unusable (104), with the reason.
    let direct = Plugin::new("ADD", "new").run(&config_at(&dir, &copy, "pods", "198.18.0.0/24"));
    assert_error(&direct, 104, "malformed");

    // The original is untouched and still holds its allocation.
    assert_ok(&admin_check(&db));
    assert_eq!(held(&db, "keep"), vec!["198.18.0.2".to_string()]);
}
