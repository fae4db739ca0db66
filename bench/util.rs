//! Shared pieces of the bench: temporary directories, a daemon child, running
//! a CNI plugin, peak-RSS probes and latency statistics. Every process and
//! directory is owned by a value whose `Drop` ends or removes it, so a failed
//! measurement (a panic) still cleans up.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use metis::wire::client::Client;
use metis::wire::{Code, Request, Response, ipam, request, response};

pub use crate::common::METIS;
pub const HOST_LOCAL: &str = "/usr/lib/cni/host-local";

/// The IPv4 range every measurement allocates from (RFC 2544 benchmarking).
pub const RANGE_V4: &str = "198.18.0.0/16";
pub const RANGE_V4_SECOND: &str = "198.19.0.0/16";
/// The IPv6 range (RFC 3849 documentation prefix).
pub const RANGE_V6: &str = "2001:db8::/64";

pub use crate::common::{TestDaemon as Daemon, TestDir as TempDir};

/// The two builds of Metis every per-build figure is taken for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    /// Default features: the Kubernetes client included.
    Full,
    /// `--no-default-features`: no HTTP client, TLS or YAML.
    Edge,
}

/// A build of Metis under measurement: which one, its binary as `make`
/// built it, and the copy the bench runs ([`Installed`]).
#[derive(Debug, Clone)]
pub struct Build {
    pub flavour: Flavour,
    pub built: PathBuf,
    pub binary: PathBuf,
}

/// Every program the bench runs, copied once into a directory of its own
/// as `metis install` copies the plugin onto a node (the DaemonSet does at
/// every start). How a file's page cache was filled (written, or read
/// ahead) sets how much of it one page fault maps, and so an exec's cost:
/// copied, every program starts alike, whoever wrote it first (the linker,
/// dpkg). The figures: bench/history.md, "the binary as the linker left it".
pub struct Installed {
    dir: TempDir,
}

impl Installed {
    pub fn new() -> Installed {
        Installed {
            dir: TempDir::new("installed"),
        }
    }

    /// `program` copied to `name` in the directory, mode and all.
    pub fn copy(&self, program: &Path, name: &str) -> PathBuf {
        let to = self.dir.join(name);
        std::fs::copy(program, &to)
            .unwrap_or_else(|e| panic!("copy {} to {}: {e}", program.display(), to.display()));
        to
    }
}

impl Build {
    pub fn name(&self) -> &'static str {
        match self.flavour {
            Flavour::Full => "full",
            Flavour::Edge => "edge",
        }
    }

    pub fn features(&self) -> &'static str {
        match self.flavour {
            Flavour::Full => "default features (kube), statically linked by `make build`",
            Flavour::Edge => "--no-default-features, statically linked by `make edge`",
        }
    }

    /// Starts this build's daemon on `dir`.
    pub fn daemon(&self, dir: &TempDir, extra: &[&str]) -> Daemon {
        Daemon::start_from(&self.binary, dir, extra)
    }
}

/// A client connection to `daemon`.
pub fn client(daemon: &Daemon) -> Client {
    Client::connect(
        &daemon.socket,
        Duration::from_secs(5),
        Duration::from_secs(30),
    )
    .unwrap()
}

/// `VmHWM` (peak resident set) of the daemon in KiB.
pub fn daemon_peak_rss_kib(daemon: &Daemon) -> u64 {
    status_kib(daemon.child.id(), "VmHWM:")
}

/// A field of `/proc/PID/status` in KiB.
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// What one plugin invocation gets: program, environment and stdin.
pub struct Invocation<'a> {
    pub program: &'a Path,
    pub command: &'a str,
    pub container_id: &'a str,
    pub stdin: &'a str,
}

impl Invocation<'_> {
    pub fn command(&self) -> Command {
        self.command_under(&[])
    }

    /// The invocation run by `wrapper` (a program and its arguments, the
    /// plugin appended), or directly when `wrapper` is empty.
    fn command_under(&self, wrapper: &[String]) -> Command {
        let mut command = match wrapper.split_first() {
            None => Command::new(self.program),
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(self.program);
                command
            }
        };
        command
            .env_clear()
            .env("CNI_COMMAND", self.command)
            .env("CNI_CONTAINERID", self.container_id)
            .env("CNI_NETNS", "/var/run/netns/bench")
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", "/usr/lib/cni")
            .env(
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod",
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    }

    /// Runs once; returns stdout and the time from spawn to exit. Panics
    /// with the output when the plugin fails.
    pub fn run(&self) -> (String, Duration) {
        self.run_under(&[])
    }

    /// Like [`Invocation::run`], the plugin run by `wrapper` (valgrind).
    pub fn run_under(&self, wrapper: &[String]) -> (String, Duration) {
        let start = Instant::now();
        let mut child = self.command_under(wrapper).spawn().unwrap();
        // Configurations are far below a pipe's capacity: no deadlock.
        child
            .stdin
            .take()
            .unwrap()
            .write_all(self.stdin.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        let took = start.elapsed();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "{} {} {} failed ({}): {stdout} {}",
            self.program.display(),
            self.command,
            self.container_id,
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        (stdout, took)
    }
}

/// The network configuration Metis gets, on `range`, in `dir`.
pub fn metis_conf(dir: &TempDir, range: &str) -> String {
    format!(
        r#"{{"cniVersion":"1.0.0","name":"bench","type":"metis","ipam":{{"type":"metis","ranges":[[{{"subnet":"{range}"}}]],"routes":[{{"dst":"0.0.0.0/0"}}],"daemonSocket":"{}","dbPath":"{}","logFile":"{}"}}}}"#,
        dir.join("metis.sock").display(),
        dir.join("metis.sqlite").display(),
        dir.join("cni.log").display(),
    )
}

/// The same network for Debian's host-local, its data in `dir`.
pub fn host_local_conf(dir: &TempDir, range: &str) -> String {
    format!(
        r#"{{"cniVersion":"1.0.0","name":"bench","type":"host-local","ipam":{{"type":"host-local","ranges":[[{{"subnet":"{range}"}}]],"routes":[{{"dst":"0.0.0.0/0"}}],"dataDir":"{}"}}}}"#,
        dir.join("host-local").display(),
    )
}

/// `conf` with the ADD result as `prevResult`, as runtimes send DEL.
pub fn with_prev_result(conf: &str, result: &str) -> String {
    let body = conf.strip_suffix('}').unwrap();
    format!(r#"{body},"prevResult":{}}}"#, result.trim())
}

/// The first address of a CNI result, without its prefix length.
pub fn result_address(result: &str) -> String {
    let value: serde_json::Value = serde_json::from_str(result).unwrap();
    let address = value["ips"][0]["address"].as_str().unwrap();
    address.split('/').next().unwrap().to_string()
}

/// Peak RSS (`VmHWM`, KiB) of one run of `invocation`. The child is
/// seized with ptrace while it still waits for its stdin and stopped at its
/// exit, where `/proc/PID/status` still describes its memory. (The usual
/// `getrusage(RUSAGE_CHILDREN)` is no good here: a child spawned with
/// vfork semantics inherits its parent's high-water mark at exec.)
pub fn peak_rss_kib(invocation: &Invocation) -> u64 {
    use nix::sys::ptrace;
    use nix::sys::wait::{WaitStatus, waitpid};
    use nix::unistd::Pid;

    let mut child = invocation.command().spawn().unwrap();
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
    ptrace::seize(pid, ptrace::Options::PTRACE_O_TRACEEXIT).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(invocation.stdin.as_bytes()).unwrap();
    drop(stdin);
    let peak = loop {
        match waitpid(pid, None).unwrap() {
            WaitStatus::PtraceEvent(_, _, event)
                if event == ptrace::Event::PTRACE_EVENT_EXIT as i32 =>
            {
                break status_kib(child.id(), "VmHWM:");
            }
            WaitStatus::PtraceEvent(..) => ptrace::cont(pid, None).unwrap(),
            // Signals for the child (Go's runtime uses some) go through.
            WaitStatus::Stopped(_, signal) => ptrace::cont(pid, Some(signal)).unwrap(),
            other => panic!(
                "{} ended before its exit stop: {other:?}",
                invocation.program.display()
            ),
        }
    };
    ptrace::detach(pid, None).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{} failed under the RSS probe: {}",
        invocation.program.display(),
        String::from_utf8_lossy(&output.stdout)
    );
    peak
}

/// An allocation request in network `bench` for `container_id`, whose
/// blocks are `ranges` (all of one family).
pub fn allocate_request(container_id: &str, ranges: &[&str]) -> Request {
    let config = ipam::IpConfig {
        interface_name: "eth0".into(),
        container_id: container_id.into(),
        initial_pod_cidr: ranges[0].into(),
        additional_pod_cidrs: ranges[1..].iter().map(|r| r.to_string()).collect(),
        requested_ip: String::new(),
        bounds: Vec::new(),
    };
    let v6 = ranges[0].contains(':');
    Request {
        kind: Some(request::Kind::Allocate(ipam::AllocatePodIpRequest {
            network: "bench".into(),
            ipv4_config: (!v6).then(|| config.clone()),
            ipv6_config: v6.then_some(config),
            pod_name: "pod".into(),
            pod_namespace: "bench".into(),
            isolated: false,
            conf_name: String::new(),
        })),
    }
}

/// A wire request as the daemon reads it, for the engine run in-process.
pub fn typed(request: Request) -> metis::engine::request::Command {
    metis::decode::decode(request).expect("the bench's requests are well formed")
}

pub fn release_request(container_id: &str) -> Request {
    Request {
        kind: Some(request::Kind::Deallocate(ipam::DeallocatePodIpRequest {
            network: "bench".into(),
            interface_name: "eth0".into(),
            container_id: container_id.into(),
            pod_name: "pod".into(),
            pod_namespace: "bench".into(),
        })),
    }
}

/// The address an allocation response carries; panics on an error status.
pub fn allocated(response: &Response) -> String {
    assert_eq!(response.code(), Code::Ok, "{response:?}");
    match &response.kind {
        Some(response::Kind::Allocate(reply)) => reply
            .ipv4
            .as_ref()
            .or(reply.ipv6.as_ref())
            .unwrap()
            .ip_address
            .clone(),
        other => panic!("unexpected reply {other:?}"),
    }
}

/// Panics unless a release response is OK and released one address.
pub fn released(response: &Response) {
    assert_eq!(response.code(), Code::Ok, "{response:?}");
    match &response.kind {
        Some(response::Kind::Deallocate(reply)) => assert_eq!(reply.released.len(), 1),
        other => panic!("unexpected reply {other:?}"),
    }
}

/// Median, p99 and count of a set of latencies.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub median: Duration,
    pub p99: Duration,
    pub count: usize,
}

impl Summary {
    pub fn of(samples: &[Duration]) -> Summary {
        assert!(!samples.is_empty(), "no samples");
        let mut sorted = samples.to_vec();
        sorted.sort();
        let at = |q: f64| {
            // Nearest-rank percentile.
            let rank = (q * sorted.len() as f64).ceil() as usize;
            sorted[rank.clamp(1, sorted.len()) - 1]
        };
        Summary {
            median: at(0.5),
            p99: at(0.99),
            count: sorted.len(),
        }
    }
}

/// Microseconds with one decimal.
pub fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

/// Milliseconds with two decimals.
pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// `a / b` of two durations.
pub fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}
