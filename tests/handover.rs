//! One daemon per database, and daemons that hand over without losing an
//! operation (issue 21): a DaemonSet surge update and graceful restarts
//! under 20 looping plugins, a second daemon that waits for the first, and
//! the lock file's bad inputs.

use crate::common;

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use common::tmpfs::Tmpfs;
use common::{Plugin, TestDaemon, TestDir, admin_check, assert_ok, conf, db, metis, wait_for};

/// Room for 20 plugins' pods with a release cooldown of zero.
const RANGE: &str = r#"[[{"subnet":"198.18.0.0/24"}]]"#;
const DAEMON_ARGS: &[&str] = &["--release-cooldown", "0"];
/// Generous: the machine running the tests may be loaded.
const PATIENCE: Duration = Duration::from_secs(120);
const WAITING: &str = "waiting for it to stop";
const DIRECT_MODE: &str = "using direct mode";

/// Plugins (the real binary) each running ADD then DEL of a fresh
/// container, in a loop, until stopped; every failed call is recorded.
struct Load {
    stop: Arc<AtomicBool>,
    ops: Arc<AtomicUsize>,
    plugins: Vec<JoinHandle<Vec<String>>>,
}

impl Load {
    fn start(config: &str, plugins: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicUsize::new(0));
        let plugins = (0..plugins)
            .map(|plugin| {
                let (stop, ops, config) = (Arc::clone(&stop), Arc::clone(&ops), config.to_string());
                std::thread::spawn(move || {
                    let mut failures = Vec::new();
                    let mut round = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let container = format!("p{plugin}-{round}");
                        for verb in ["ADD", "DEL"] {
                            let output = Plugin::new(verb, &container).run(&config);
                            if !output.status.success() {
                                failures.push(format!(
                                    "{verb} {container}: {:?} {}",
                                    output.status,
                                    String::from_utf8_lossy(&output.stdout)
                                ));
                            }
                            ops.fetch_add(1, Ordering::Relaxed);
                        }
                        round += 1;
                    }
                    failures
                })
            })
            .collect();
        Load { stop, ops, plugins }
    }

    /// Waits until `more` operations have completed from now.
    fn run_for(&self, more: usize) {
        let target = self.ops.load(Ordering::Relaxed) + more;
        wait_for("plugin operations", PATIENCE, || {
            self.ops.load(Ordering::Relaxed) >= target
        });
    }

    /// Stops the plugins; returns (operations, failures).
    fn finish(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let failures = self
            .plugins
            .into_iter()
            .flat_map(|plugin| plugin.join().unwrap())
            .collect();
        (self.ops.load(Ordering::Relaxed), failures)
    }
}

/// Connects to the socket path over and over until stopped, recording
/// every connect that fails: the socket must be served throughout.
struct Probe {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(usize, Vec<String>)>,
}

impl Probe {
    fn start(socket: &Path) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, socket) = (Arc::clone(&stop), socket.to_path_buf());
            std::thread::spawn(move || {
                let (mut connects, mut failures) = (0, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    match UnixStream::connect(&socket) {
                        Ok(_) => connects += 1,
                        Err(err) => failures.push(err.to_string()),
                    }
                    // Pacing, not synchronisation: a connect every 2 ms.
                    std::thread::sleep(Duration::from_millis(2));
                }
                (connects, failures)
            })
        };
        Probe { stop, thread }
    }

    fn finish(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// (device, inode) of a socket file, asserting it is one.
fn socket_identity(path: &Path) -> (u64, u64) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    assert!(
        meta.file_type().is_socket(),
        "{} is no socket",
        path.display()
    );
    (meta.dev(), meta.ino())
}

/// Whether process `pid` has `path` open.
fn has_open(pid: u32, path: &Path) -> bool {
    let path = path.canonicalize().unwrap();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .any(|target| target == path)
}

fn plugin_log(dir: &TestDir) -> String {
    std::fs::read_to_string(dir.join("cni.log")).unwrap_or_default()
}

/// Rows still allocated to a container (every looping pod was deleted).
fn held_rows(dir: &TestDir) -> i64 {
    db(&dir.join("metis.sqlite"))
        .query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE is_allocated = 1 \
             AND COALESCE(container_id, '') != ''",
            [],
            |row| row.get(0),
        )
        .unwrap()
}

fn health(dir: &TestDir) -> std::process::Output {
    let socket = dir.join("metis.sock");
    metis(&["health", "--socket-path", socket.to_str().unwrap()])
}

/// Three surge updates in a row.
const SURGES: usize = 3;

#[test]
fn surge_updates_under_load_lose_nothing_and_keep_the_socket_served() {
    let dir = TestDir::new("handover-surge");
    let config = conf(&dir, "1.0.0", RANGE, "");
    let socket = dir.join("metis.sock");
    let db_path = dir.join("metis.sqlite");
    let mut old = TestDaemon::start(&dir, DAEMON_ARGS);
    let load = Load::start(&config, 20);
    let probe = Probe::start(&socket);
    for surge in 0..SURGES {
        load.run_for(100);
        // The new pod's daemon starts while the old one serves: it listens
        // beside the socket and waits for the database.
        let mut new = TestDaemon::spawn(&dir, DAEMON_ARGS, &format!("new-{surge}.log"));
        new.wait_for_log(WAITING, PATIENCE);
        let successor = socket_identity(&dir.join("metis.sock.next"));
        load.run_for(100);
        // Only the old daemon writes: the new one has not even opened the
        // file.
        assert!(!has_open(new.child.id(), &db_path));
        assert!(!new.log().contains("database checked"), "{}", new.log());
        assert!(has_open(old.child.id(), &db_path));

        // The old pod is deleted.
        old.terminate();
        assert!(old.wait_exit(PATIENCE).success(), "{}", old.log());
        new.wait_for_log("listening", PATIENCE);
        // It handed its socket over and did not unlink it.
        let handed = old.log().matches("handed the socket over").count();
        assert_eq!(handed, 1, "{}", old.log());
        assert_eq!(socket_identity(&socket), successor);
        assert!(!dir.join("metis.sock.next").exists());
        old = new;
    }
    load.run_for(100);
    let (ops, failures) = load.finish();
    let (connects, refused) = probe.finish();

    assert!(
        failures.is_empty(),
        "{} of {ops} failed: {failures:#?}",
        failures.len()
    );
    assert!(refused.is_empty(), "{refused:?} of {connects} connects");
    eprintln!(
        "{SURGES} surge updates: {ops} operations, none failed; {connects} connects, none refused"
    );
    let log = plugin_log(&dir);
    assert_eq!(log.matches(DIRECT_MODE).count(), 0, "{log}");
    let answer = health(&dir);
    assert!(answer.status.success(), "{answer:?}");
    assert_eq!(held_rows(&dir), 0);
    assert_ok(&admin_check(&db_path));
    assert!(old.stop().success());
    assert!(!socket.exists());
}

#[test]
fn graceful_restarts_under_load_lose_nothing() {
    let dir = TestDir::new("handover-restarts");
    let config = conf(&dir, "1.0.0", RANGE, "");
    let mut daemon = TestDaemon::start(&dir, DAEMON_ARGS);
    let load = Load::start(&config, 20);
    for _ in 0..8 {
        load.run_for(40);
        assert!(daemon.stop().success());
        daemon = TestDaemon::start(&dir, DAEMON_ARGS);
    }
    load.run_for(40);
    let (ops, failures) = load.finish();
    assert!(
        failures.is_empty(),
        "{} of {ops} failed: {failures:#?}",
        failures.len()
    );
    eprintln!("8 graceful restarts: {ops} operations, none failed");
    let log = daemon.log();
    assert_eq!(log.matches("metis daemon stopped").count(), 8, "{log}");
    assert!(!log.contains("sent no complete request"), "{log}");
    assert_eq!(held_rows(&dir), 0);
    assert_ok(&admin_check(&dir.join("metis.sqlite")));
}

#[test]
fn a_second_daemon_takes_over_from_one_that_dies() {
    let dir = TestDir::new("handover-killed");
    let config = conf(&dir, "1.0.0", RANGE, "");
    let mut old = TestDaemon::start(&dir, DAEMON_ARGS);
    assert_ok(&Plugin::new("ADD", "before").run(&config));
    let mut new = TestDaemon::spawn(&dir, DAEMON_ARGS, "new.log");
    new.wait_for_log(WAITING, PATIENCE);
    assert!(
        new.log().contains(&format!("owner_pid={}", old.child.id())),
        "{}",
        new.log()
    );
    old.child.kill().unwrap();
    old.child.wait().unwrap();
    new.wait_for_log("listening", PATIENCE);
    let add = Plugin::new("ADD", "after").run(&config);
    assert_ok(&add);
    assert_eq!(common::json(&add)["ips"][0]["address"], "198.18.0.3/24");
    assert_eq!(plugin_log(&dir).matches(DIRECT_MODE).count(), 0);
    assert_eq!(
        std::fs::read_to_string(dir.join("metis.sqlite.lock")).unwrap(),
        format!("{}\n", new.child.id())
    );
}

#[test]
fn a_waiting_daemon_stopped_leaves_everything_as_it_was() {
    let dir = TestDir::new("handover-abandon");
    let socket = dir.join("metis.sock");
    let old = TestDaemon::start(&dir, DAEMON_ARGS);
    let serving = socket_identity(&socket);
    let mut new = TestDaemon::spawn(&dir, DAEMON_ARGS, "new.log");
    new.wait_for_log(WAITING, PATIENCE);
    new.terminate();
    assert!(new.wait_exit(PATIENCE).success(), "{}", new.log());
    assert!(
        new.log().contains("stopped before serving"),
        "{}",
        new.log()
    );
    assert!(!dir.join("metis.sock.next").exists());
    assert_eq!(socket_identity(&socket), serving);
    assert!(health(&dir).status.success());
    // With no successor left, the old daemon's stop removes its socket.
    assert!(old.stop().success());
    assert!(!socket.exists());
}

/// `metis daemon` on `dir`'s socket and `db`, to its exit.
fn daemon_exit(dir: &TestDir, db: &Path) -> std::process::Output {
    std::process::Command::new(common::METIS)
        .arg("daemon")
        .arg("--socket-path")
        .arg(dir.join("metis.sock"))
        .arg("--db-path")
        .arg(db)
        .output()
        .unwrap()
}

fn assert_refused(output: &std::process::Output, says: &[&str]) {
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    for text in says {
        assert!(stderr.contains(text), "{stderr} does not say {text:?}");
    }
}

/// Runs a daemon on `dir` with `name` a symbolic link to a file; asserts
/// it refused, naming the link, and left the file and the database alone.
fn assert_link_refused(dir: &TestDir, name: &str) {
    let target = dir.join("elsewhere");
    std::fs::write(&target, "keep").unwrap();
    let link = dir.join(name);
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let output = daemon_exit(dir, &dir.join("metis.sqlite"));
    assert_refused(&output, &[link.to_str().unwrap(), "symbolic link"]);
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    assert!(!dir.join("metis.sqlite").exists());
    assert!(!dir.join("metis.sock.next").exists());
}

#[test]
fn a_lock_file_that_is_a_symbolic_link_is_refused() {
    let dir = TestDir::new("handover-symlink");
    assert_link_refused(&dir, "metis.sqlite.lock");
    assert!(!dir.join("metis.sock").exists());
    assert!(!dir.join("metis.sock.next").exists());
}

#[test]
fn a_database_directory_the_daemon_cannot_write_is_refused() {
    let dir = TestDir::new("handover-unwritable");
    let fs = Tmpfs::mount("handover-ro", "1m");
    fs.remount("ro");
    let output = daemon_exit(&dir, &fs.dir.join("metis.sqlite"));
    let lock = fs.dir.join("metis.sqlite.lock");
    assert_refused(&output, &[lock.to_str().unwrap(), "Read-only file system"]);
    assert!(!dir.join("metis.sock").exists());
    assert!(!dir.join("metis.sock.next").exists());

    // A regular file where the database's directory should be.
    let file = dir.join("not-a-dir");
    std::fs::write(&file, "").unwrap();
    let output = daemon_exit(&dir, &file.join("metis.sqlite"));
    assert_refused(&output, &["metis.sqlite.lock", "Not a directory"]);
}

#[test]
fn a_stale_lock_file_of_a_dead_daemon_does_not_stop_a_start() {
    let dir = TestDir::new("handover-stale");
    // The pid of a process that has exited.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    std::fs::write(dir.join("metis.sqlite.lock"), format!("{dead}\n")).unwrap();
    let daemon = TestDaemon::start(&dir, DAEMON_ARGS);
    assert!(!daemon.log().contains(WAITING), "{}", daemon.log());
    assert_eq!(
        std::fs::read_to_string(dir.join("metis.sqlite.lock")).unwrap(),
        format!("{}\n", daemon.child.id())
    );
    assert!(daemon.stop().success());
}

#[test]
fn a_socket_path_that_is_a_symbolic_link_is_refused_before_any_wait() {
    let dir = TestDir::new("handover-socket-link");
    assert_link_refused(&dir, "metis.sock");
}
