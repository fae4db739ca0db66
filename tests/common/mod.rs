//! Shared harness for the integration tests: private temp dirs, a real
//! daemon process, and the real plugin binary run with CNI env and stdin.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

#[cfg(feature = "kube")]
pub mod cloud;
#[cfg(feature = "kube")]
pub mod cluster;
pub mod host_local;
#[cfg(feature = "kube")]
pub mod http;
#[cfg(feature = "kube")]
pub mod kube_api;
pub mod node;
pub mod rng;
pub mod scrape;
#[cfg(feature = "kube")]
pub mod tls;
pub mod tmpfs;
pub mod upstream;

pub const METIS: &str = env!("CARGO_BIN_EXE_metis");

/// A private directory removed on drop.
pub struct TestDir {
    pub path: PathBuf,
}

impl TestDir {
    pub fn new(name: &str) -> TestDir {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        // Fixed-width numbers keep the path's length constant, so outputs
        // that embed it (golden files, JSON column numbers) are stable.
        let path = std::env::temp_dir().join(format!(
            "metis-{name}-{:010}-{:04}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
        TestDir { path }
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::env::var_os("METIS_KEEP_TEST_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// How often [`poll`] tries again.
const POLL_EVERY: Duration = Duration::from_millis(10);

/// The one way the tests wait for something: tries `attempt` every 10 ms
/// until it gives a value, and returns it; `None` once `timeout` has passed
/// without one (the caller then panics with what it knows, or goes on when
/// the wait was only a pause). Never a sleep taken as proof.
pub fn poll<T>(timeout: Duration, mut attempt: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = attempt() {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(POLL_EVERY);
    }
}

/// Polls `condition` until it holds; panics naming `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    poll(timeout, || condition().then_some(()))
        .unwrap_or_else(|| panic!("timed out waiting for {what}"))
}

/// A `metis daemon` child process, killed on drop.
pub struct TestDaemon {
    pub child: Child,
    pub socket: PathBuf,
    pub db: PathBuf,
    pub stderr_path: PathBuf,
}

impl TestDaemon {
    /// Starts a daemon on `dir` and waits until its socket accepts.
    pub fn start(dir: &TestDir, extra: &[&str]) -> TestDaemon {
        TestDaemon::launch(Path::new(METIS), dir, extra, &[])
    }

    /// Like [`TestDaemon::start`], with the database at `db` (on another
    /// file system, say) instead of in `dir`.
    pub fn start_on(dir: &TestDir, db: &Path) -> TestDaemon {
        TestDaemon::launch_on(Path::new(METIS), dir, db, &[], &[])
    }

    /// Like [`TestDaemon::start`], with extra environment; any cluster
    /// settings of the test's own environment are scrubbed first.
    pub fn start_with_env(dir: &TestDir, extra: &[&str], env: &[(&str, &str)]) -> TestDaemon {
        TestDaemon::launch(Path::new(METIS), dir, extra, env)
    }

    /// Like [`TestDaemon::start`], running the daemon from another copy of
    /// the binary.
    pub fn start_from(binary: &Path, dir: &TestDir, extra: &[&str]) -> TestDaemon {
        TestDaemon::launch(binary, dir, extra, &[])
    }

    fn launch(binary: &Path, dir: &TestDir, extra: &[&str], env: &[(&str, &str)]) -> TestDaemon {
        TestDaemon::launch_on(binary, dir, &dir.join("metis.sqlite"), extra, env)
    }

    fn launch_on(
        binary: &Path,
        dir: &TestDir,
        db: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> TestDaemon {
        let mut daemon = TestDaemon::spawn_logging(binary, dir, db, extra, env, "daemon.log");
        let socket = daemon.socket.clone();
        let listening = poll(Duration::from_secs(10), || {
            if let Ok(Some(status)) = daemon.child.try_wait() {
                panic!("daemon exited with {status}: {}", daemon.log());
            }
            UnixStream::connect(&socket).ok().map(drop)
        });
        if listening.is_none() {
            panic!("daemon did not listen: {}", daemon.log());
        }
        daemon
    }

    /// Starts a daemon on `dir` logging to `log_name` in it, without
    /// waiting for anything (a second daemon on the same socket and
    /// database, for instance).
    pub fn spawn(dir: &TestDir, extra: &[&str], log_name: &str) -> TestDaemon {
        let db = dir.join("metis.sqlite");
        TestDaemon::spawn_logging(Path::new(METIS), dir, &db, extra, &[], log_name)
    }

    fn spawn_logging(
        binary: &Path,
        dir: &TestDir,
        db: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
        log_name: &str,
    ) -> TestDaemon {
        let socket = dir.join("metis.sock");
        let stderr_path = dir.join(log_name);
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&stderr_path)
            .unwrap();
        let mut command = Command::new(binary);
        for name in [
            "KUBECONFIG",
            "KUBERNETES_SERVICE_HOST",
            "KUBERNETES_SERVICE_PORT",
            "NODE_NAME",
        ] {
            command.env_remove(name);
        }
        command.envs(env.iter().copied());
        let child = command
            .arg("daemon")
            .arg("--socket-path")
            .arg(&socket)
            .arg("--db-path")
            .arg(db)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap();
        TestDaemon {
            child,
            socket,
            db: db.to_path_buf(),
            stderr_path,
        }
    }

    /// The scope and the rows read of the daemon's last start check (its
    /// "database checked" log line).
    pub fn last_start_check(&self) -> (String, u64) {
        let log = self.log();
        let line = log
            .lines()
            .rev()
            .find(|line| line.contains("database checked"))
            .unwrap_or_else(|| panic!("no start check logged: {log}"))
            .to_string();
        let field = |name: &str| -> String {
            line.split_whitespace()
                .find_map(|word| word.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("{line} lacks {name}"))
                .to_string()
        };
        (field("scope"), field("rows_read").parse().unwrap())
    }

    /// Waits until the daemon's log contains `text`; panics with the log
    /// if it exits first or `timeout` passes.
    pub fn wait_for_log(&mut self, text: &str, timeout: Duration) {
        let logged = poll(timeout, || {
            if self.log().contains(text) {
                return Some(());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "daemon exited with {status} before {text:?}: {}",
                    self.log()
                );
            }
            None
        });
        if logged.is_none() {
            panic!("daemon did not log {text:?}: {}", self.log());
        }
    }

    /// Sends SIGTERM and returns at once.
    pub fn terminate(&self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    }

    /// Waits for the exit status (after [`TestDaemon::terminate`]).
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        match poll(timeout, || self.child.try_wait().unwrap()) {
            Some(status) => status,
            None => panic!("daemon did not exit: {}", self.log()),
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn stop(mut self) -> std::process::ExitStatus {
        self.terminate();
        self.wait_exit(Duration::from_secs(10))
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One plugin invocation's inputs.
pub struct Plugin<'a> {
    pub command: &'a str,
    pub container_id: &'a str,
    pub ifname: &'a str,
    pub netns: &'a str,
    pub args: &'a str,
}

impl<'a> Plugin<'a> {
    pub fn new(command: &'a str, container_id: &'a str) -> Plugin<'a> {
        Plugin {
            command,
            container_id,
            ifname: "eth0",
            netns: "/var/run/netns/test",
            args: "K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod",
        }
    }

    /// Runs the real binary with a scrubbed CNI environment.
    pub fn run(&self, stdin: &str) -> Output {
        run_with_stdin(self.command(), stdin)
    }

    /// The real binary with a scrubbed CNI environment, not yet started.
    pub fn command(&self) -> Command {
        let mut command = Command::new(METIS);
        for (key, _) in std::env::vars() {
            if key.starts_with("CNI_") {
                command.env_remove(key);
            }
        }
        command
            .env("CNI_COMMAND", self.command)
            .env("CNI_CONTAINERID", self.container_id)
            .env("CNI_IFNAME", self.ifname)
            .env("CNI_PATH", "/opt/cni/bin");
        if !self.netns.is_empty() {
            command.env("CNI_NETNS", self.netns);
        }
        if !self.args.is_empty() {
            command.env("CNI_ARGS", self.args);
        }
        command
    }
}

/// Runs `command`, feeding `stdin` from a thread so large inputs cannot
/// deadlock against a full stdout pipe.
pub fn run_with_stdin(mut command: Command, stdin: &str) -> Output {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stdin.take().unwrap();
    let input = stdin.as_bytes().to_vec();
    let writer = std::thread::spawn(move || {
        let _ = pipe.write_all(&input);
    });
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap();
    output
}

/// A network configuration with Metis as the top-level plugin.
pub fn conf(dir: &TestDir, version: &str, ranges: &str, extra: &str) -> String {
    format!(
        r#"{{"cniVersion":"{version}","name":"testnet","type":"metis","ipam":{{"type":"metis","ranges":{ranges},"routes":[{{"dst":"0.0.0.0/0"}}],"daemonSocket":"{}","dbPath":"{}","logFile":"{}"}}{extra}}}"#,
        dir.join("metis.sock").display(),
        dir.join("metis.sqlite").display(),
        dir.join("cni.log").display(),
    )
}

/// Parses stdout as JSON, failing with the whole output if it is not.
pub fn json(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|err| {
        panic!(
            "stdout is not JSON ({err}): status {:?}\nstdout: {}\nstderr: {}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// Asserts success, printing everything on failure.
pub fn assert_ok(output: &Output) {
    assert!(
        output.status.success(),
        "status {:?}\nstdout: {}\nstderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs `metis admin check` on a database.
pub fn admin_check(db: &Path) -> Output {
    Command::new(METIS)
        .args(["admin", "check", "--db-path"])
        .arg(db)
        .output()
        .unwrap()
}

/// Opens the database read-only to assert on rows.
pub fn db(path: &Path) -> rusqlite::Connection {
    rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap()
}

/// Runs one ADD per id (`pod-N`) concurrently, each in its own process;
/// asserts every one succeeded and returns the IPv4 addresses.
pub fn add_concurrently(config: &str, ids: std::ops::Range<usize>) -> Vec<String> {
    let handles: Vec<_> = ids
        .map(|i| {
            let config = config.to_string();
            std::thread::spawn(move || {
                let id = format!("pod-{i}");
                let output = Plugin::new("ADD", &id).run(&config);
                assert_ok(&output);
                json(&output)["ips"][0]["address"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Runs `metis ARGS…` with no stdin and no CNI variables.
pub fn metis(args: &[&str]) -> Output {
    let mut command = Command::new(METIS);
    for (key, _) in std::env::vars() {
        if key.starts_with("CNI_") {
            command.env_remove(key);
        }
    }
    command.args(args).stdin(Stdio::null()).output().unwrap()
}

/// stdout and stderr as text.
pub fn out_err(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A daemon ADD (wire request) of interface `eth0` of `container` in
/// `network`, IPv4 range `cidr`, as the plugin sends it.
pub fn v4_add_request(network: &str, container: &str, cidr: &str) -> metis::wire::Request {
    v4_add_requesting(network, container, cidr, "")
}

/// [`v4_add_request`] asking for address `requested` (`""`: any).
pub fn v4_add_requesting(
    network: &str,
    container: &str,
    cidr: &str,
    requested: &str,
) -> metis::wire::Request {
    use metis::wire::{ipam, request};
    metis::wire::Request {
        kind: Some(request::Kind::Allocate(ipam::AllocatePodIpRequest {
            network: network.into(),
            ipv4_config: Some(ipam::IpConfig {
                interface_name: "eth0".into(),
                container_id: container.into(),
                initial_pod_cidr: cidr.into(),
                requested_ip: requested.into(),
                ..Default::default()
            }),
            ipv6_config: None,
            pod_name: "pod".into(),
            pod_namespace: "default".into(),
            isolated: false,
            conf_name: String::new(),
        })),
    }
}

/// The IPv4 address of a successful ADD reply.
pub fn allocated_v4(response: &metis::wire::Response) -> String {
    use metis::wire::{Code, response};
    assert_eq!(response.code(), Code::Ok, "{response:?}");
    match &response.kind {
        Some(response::Kind::Allocate(reply)) => reply.ipv4.as_ref().unwrap().ip_address.clone(),
        other => panic!("unexpected reply {other:?}"),
    }
}

/// Copies the metis binary to `to` with `mode`, by a `cp` child: a copy
/// written by this multi-threaded test process could be held open for
/// writing by a child another test thread forks at that moment, and
/// running it would then fail with ETXTBSY ("Text file busy").
pub fn copy_binary(to: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    let status = Command::new("cp")
        .arg(METIS)
        .arg(to)
        .status()
        .expect("cp runs");
    assert!(status.success(), "cp {METIS} {}: {status}", to.display());
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode)).unwrap();
}
