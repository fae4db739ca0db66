//! Storage faults, created for real: a full disk (a small tmpfs), a
//! read-only file system, a database file deleted under the daemon, a
//! database locked by another process beyond the busy timeout, and a
//! corrupt database (bytes overwritten in a copy). Each yields a clear
//! error — CNI code 11 (try again later) or 104 (store unusable) naming the
//! reason — never a panic, and never loses an allocation that existed.
//! Mounting needs root, as these tests run.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::{Plugin, TestDaemon, TestDir, admin_check, assert_ok, json};

/// A tmpfs mounted on a fresh directory, unmounted and removed on drop.
struct Tmpfs {
    dir: TestDir,
}

impl Tmpfs {
    fn mount(name: &str, size: &str) -> Tmpfs {
        let dir = TestDir::new(name);
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(&dir.path)
            .status()
            .unwrap();
        assert!(status.success(), "mount tmpfs (these tests need root)");
        Tmpfs { dir }
    }

    fn remount(&self, option: &str) {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,{option}")])
            .arg(&self.dir.path)
            .status()
            .unwrap();
        assert!(status.success(), "remount {option}");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy, so a process still holding a file cannot keep it mounted;
        // the TestDir then removes the directory.
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.dir.path)
            .status();
    }
}

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

/// The addresses `container` holds, read from the database.
fn held(db: &Path, container: &str) -> Vec<String> {
    let conn = common::db(db);
    let mut stmt = conn
        .prepare("SELECT address FROM ip_addresses WHERE container_id = ?1 AND is_allocated = 1")
        .unwrap();
    stmt.query_map([container], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
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

/// Fills the file system holding `dir` until a write fails with ENOSPC,
/// with the file `name`.
fn fill(dir: &TestDir, name: &str) -> PathBuf {
    use std::io::Write;
    let path = dir.join(name);
    let mut file = std::fs::File::create(&path).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    loop {
        match file.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(err) => {
                assert_eq!(err.raw_os_error(), Some(28), "{err}"); // ENOSPC
                break;
            }
        }
    }
    // Byte by byte, so not even a page is left.
    while file.write(&[0]).is_ok_and(|n| n == 1) {}
    path
}

#[test]
fn a_full_disk_is_try_again_later_and_loses_nothing() {
    let fs = Tmpfs::mount("fault-full", "3m");
    let dir = &fs.dir;
    let db = dir.join("metis.sqlite");
    let daemon = TestDaemon::start(dir, &[]);
    assert_ok(&Plugin::new("ADD", "keep").run(&config(dir, "small", "198.18.0.0/24")));
    let kept = held(&db, "keep");
    let filler = fill(dir, "filler");

    // A new network of 4096 addresses needs pages the disk does not have.
    let big = config(dir, "big", "198.18.16.0/20");
    let through_daemon = Plugin::new("ADD", "new").run(&big);
    assert_error(&through_daemon, 11, "full");
    assert!(!daemon.log().contains("panicked"), "{}", daemon.log());
    let status = daemon.stop();
    assert!(status.success(), "daemon exit {status:?}");

    // Direct mode, with the disk still full (the daemon's stop may have
    // freed the pages of its WAL).
    let more = fill(dir, "filler-2");
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

#[test]
fn a_database_deleted_under_the_daemon_is_refused_not_written() {
    let dir = TestDir::new("fault-deleted");
    let db = dir.join("metis.sqlite");
    let conf = config(&dir, "pods", "198.18.0.0/24");
    let mut daemon = TestDaemon::start(&dir, &[]);
    assert_ok(&Plugin::new("ADD", "keep").run(&conf));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
    }
    for verb in ["ADD", "DEL"] {
        let output = Plugin::new(verb, "keep").run(&conf);
        assert_error(&output, 11, "deleted or replaced");
    }
    // Still running, and nothing was written to a file no one will open
    // again.
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "{}",
        daemon.log()
    );
    assert!(
        !db.exists(),
        "the daemon must not recreate the file behind its own back"
    );
}

#[test]
fn a_database_locked_beyond_the_busy_timeout_is_try_again_later() {
    let dir = TestDir::new("fault-locked");
    let db = dir.join("metis.sqlite");
    let conf = config(&dir, "pods", "198.18.0.0/24");
    let daemon = TestDaemon::start(&dir, &[]);
    assert_ok(&Plugin::new("ADD", "keep").run(&conf));
    let kept = held(&db, "keep");

    // Another process's writer holds the lock for longer than 5 s.
    let locker = rusqlite::Connection::open(&db).unwrap();
    locker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let started = std::time::Instant::now();
    let through_daemon = Plugin::new("ADD", "new").run(&conf);
    assert_error(&through_daemon, 11, "busy");
    assert!(
        started.elapsed() >= Duration::from_secs(5),
        "gave up before the busy timeout"
    );
    assert!(daemon.stop().success());
    let direct = Plugin::new("DEL", "keep").run(&conf);
    assert_error(&direct, 11, "locked");
    locker.execute_batch("ROLLBACK").unwrap();
    drop(locker);

    assert_eq!(held(&db, "keep"), kept);
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
