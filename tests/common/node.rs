//! A node whose configuration moves under it, for the reconciliation
//! tests (issue 10): network configurations with chosen names, ranges and
//! requested addresses; a daemon restarted with changing `--cidr` flags,
//! SIGKILLed or left down (direct mode); and read-only views of what the
//! database holds, which every test crate shares.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::process::Output;

use serde_json::{Value, json};

use super::{Plugin, TestDaemon, TestDir, admin_check, db, metis};

/// A CIDR as the tests reason about it: addresses as numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub base: u128,
    pub prefix: u8,
    pub v6: bool,
}

impl Block {
    pub fn parse(text: &str) -> Block {
        let (addr, prefix) = text.split_once('/').unwrap();
        let ip: IpAddr = addr.parse().unwrap();
        let prefix: u8 = prefix.parse().unwrap();
        Block {
            base: number(ip),
            prefix,
            v6: ip.is_ipv6(),
        }
    }

    fn bits(self) -> u8 {
        if self.v6 { 128 } else { 32 }
    }

    pub fn size(self) -> u128 {
        1u128 << (self.bits() - self.prefix)
    }

    pub fn contains(self, ip: IpAddr) -> bool {
        ip.is_ipv6() == self.v6 && number(ip) >= self.base && number(ip) - self.base < self.size()
    }

    pub fn overlaps(self, other: Block) -> bool {
        self.v6 == other.v6
            && self.base < other.base + other.size()
            && other.base < self.base + self.size()
    }

    pub fn nth(self, offset: u128) -> IpAddr {
        address(self.base + offset, self.v6)
    }

    /// Offsets Metis keeps out of allocation in a block of this size under
    /// the default reservation mode (network, gateway and, for IPv4,
    /// broadcast), for blocks of at least 4 addresses.
    pub fn reserves(self, ip: IpAddr) -> bool {
        if !self.contains(ip) || self.size() < 4 {
            return false;
        }
        let offset = number(ip) - self.base;
        offset < 2 || (!self.v6 && offset == self.size() - 1)
    }
}

impl fmt::Display for Block {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", address(self.base, self.v6), self.prefix)
    }
}

pub fn number(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn address(n: u128, v6: bool) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::from(n))
    } else {
        IpAddr::V4(Ipv4Addr::from(u32::try_from(n).unwrap()))
    }
}

/// The address part of `198.18.0.2/24`.
pub fn strip_prefix(text: &str) -> IpAddr {
    text.split('/').next().unwrap().parse().unwrap()
}

/// One network configuration of the pool a test draws from.
#[derive(Debug, Clone)]
pub struct NetConf {
    /// Top-level `name`.
    pub name: &'static str,
    /// `ipam.network`, when set.
    pub network: Option<&'static str>,
    /// Subnets: one range set per family, in this order.
    pub ranges: Vec<&'static str>,
    /// `ipam.isolated`: the opt-in of issue 10 for networks that may reuse
    /// addresses of other networks.
    pub isolated: bool,
    /// host-local's `rangeStart` and `rangeEnd` of the range of their
    /// family, when set.
    pub bounds: Option<(&'static str, &'static str)>,
    /// host-local's `gateway` of the range of its family, when set.
    pub gateway: Option<&'static str>,
}

impl NetConf {
    pub fn new(name: &'static str, ranges: &[&'static str]) -> NetConf {
        NetConf {
            name,
            network: None,
            ranges: ranges.to_vec(),
            isolated: false,
            bounds: None,
            gateway: None,
        }
    }

    /// Whether `ip` lies inside the bounds of its family's range (always,
    /// without bounds of that family).
    pub fn in_bounds(&self, ip: IpAddr) -> bool {
        match self.bounds {
            Some((start, end)) => {
                let (start, end): (IpAddr, IpAddr) = (start.parse().unwrap(), end.parse().unwrap());
                start.is_ipv6() != ip.is_ipv6()
                    || (number(start)..=number(end)).contains(&number(ip))
            }
            None => true,
        }
    }

    /// The network allocations are scoped by.
    pub fn network(&self) -> &'static str {
        self.network.unwrap_or(self.name)
    }

    pub fn blocks(&self) -> Vec<Block> {
        self.ranges.iter().map(|r| Block::parse(r)).collect()
    }

    /// Whether the configuration has a range of this family.
    pub fn has_family(&self, v6: bool) -> bool {
        self.blocks().iter().any(|b| b.v6 == v6)
    }

    /// The configuration as the runtime sends it on stdin, with
    /// `runtimeConfig.ips` and `prevResult` when given.
    pub fn render(&self, dir: &TestDir, runtime_ips: &[IpAddr], prev: Option<&Value>) -> String {
        let set = |v6: bool| -> Vec<Value> {
            self.blocks()
                .iter()
                .filter(|b| b.v6 == v6)
                .map(|b| {
                    let mut range = json!({"subnet": b.to_string()});
                    let of_family = |ip: &str| ip.parse::<IpAddr>().unwrap().is_ipv6() == b.v6;
                    if let Some((start, end)) = self.bounds.filter(|(start, _)| of_family(start)) {
                        range["rangeStart"] = json!(start);
                        range["rangeEnd"] = json!(end);
                    }
                    if let Some(gateway) = self.gateway.filter(|g| of_family(g)) {
                        range["gateway"] = json!(gateway);
                    }
                    range
                })
                .collect()
        };
        let ranges: Vec<Value> = [set(false), set(true)]
            .into_iter()
            .filter(|s| !s.is_empty())
            .map(Value::Array)
            .collect();
        let mut ipam = json!({
            "type": "metis",
            "ranges": ranges,
            "daemonSocket": dir.join("metis.sock"),
            "dbPath": dir.join("metis.sqlite"),
            "logFile": dir.join("cni.log"),
        });
        if let Some(network) = self.network {
            ipam["network"] = json!(network);
        }
        if self.isolated {
            ipam["isolated"] = json!(true);
        }
        let mut conf = json!({
            "cniVersion": "1.0.0",
            "name": self.name,
            "type": "metis",
            "ipam": ipam,
        });
        if !runtime_ips.is_empty() {
            let ips: Vec<String> = runtime_ips.iter().map(ToString::to_string).collect();
            conf["runtimeConfig"] = json!({"ips": ips});
        }
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        conf.to_string()
    }
}

/// How a requested address is passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    None,
    /// `runtimeConfig.ips`.
    RuntimeConfig(IpAddr),
    /// `CNI_ARGS` `IP=`.
    CniArgs(IpAddr),
}

impl Request {
    pub fn address(self) -> Option<IpAddr> {
        match self {
            Request::None => None,
            Request::RuntimeConfig(ip) | Request::CniArgs(ip) => Some(ip),
        }
    }
}

/// What a plugin call answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0; for ADD the `ips[].address` values (with prefix).
    Ok(Vec<String>),
    /// Exit 1 with a CNI error object.
    Error { code: u64, msg: String },
    /// Anything else (a crash, garbage on stdout).
    Broken(String),
}

impl Outcome {
    pub fn of(output: &Output) -> Outcome {
        let text = || {
            format!(
                "status {:?}, stdout {}, stderr {}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            )
        };
        let parsed: Option<Value> = serde_json::from_slice(&output.stdout).ok();
        match (output.status.code(), parsed) {
            (Some(0), _) if output.stdout.is_empty() => Outcome::Ok(Vec::new()),
            (Some(0), Some(result)) => Outcome::Ok(
                result["ips"]
                    .as_array()
                    .map(|ips| {
                        ips.iter()
                            .filter_map(|ip| ip["address"].as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default(),
            ),
            (Some(1), Some(error)) if error["code"].is_u64() => Outcome::Error {
                code: error["code"].as_u64().unwrap(),
                msg: format!("{} {}", error["msg"], error["details"]),
            },
            _ => Outcome::Broken(text()),
        }
    }

    /// The addresses of a successful ADD, without prefixes.
    pub fn addresses(&self) -> Vec<IpAddr> {
        match self {
            Outcome::Ok(ips) => ips.iter().map(|ip| strip_prefix(ip)).collect(),
            _ => Vec::new(),
        }
    }

    pub fn code(&self) -> Option<u64> {
        match self {
            Outcome::Error { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// The `ips[].gateway` values of a successful ADD's output.
pub fn gateways(output: &Output) -> Vec<IpAddr> {
    let parsed: Value = serde_json::from_slice(&output.stdout).unwrap_or_default();
    parsed["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|ip| ip["gateway"].as_str()?.parse().ok())
        .collect()
}

/// An allocated row of the database: who holds which address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Holding {
    pub network: String,
    pub container: String,
    pub ifname: String,
    pub address: IpAddr,
}

/// A `cidr_blocks` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRow {
    pub network: String,
    pub block: Block,
    pub state: String,
}

/// One node: a private directory with the database and the socket, and
/// the daemon when it runs. Dropping it kills the daemon and removes the
/// directory, also when a test fails.
pub struct Node {
    // Declared first so the daemon dies before its directory goes.
    daemon: Option<TestDaemon>,
    pub dir: TestDir,
    /// `--release-cooldown` of every daemon start.
    pub cooldown: &'static str,
    /// Surge updates so far (each new daemon logs to a file of its own).
    surges: u32,
}

/// How long a surge's daemons may take to hand over (the machine running
/// the tests may be loaded).
const HANDOVER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(120);

impl Node {
    pub fn new(name: &str, cooldown: &'static str) -> Node {
        Node {
            daemon: None,
            dir: TestDir::new(name),
            cooldown,
            surges: 0,
        }
    }

    /// A node served by its daemon when `daemon`, else in direct mode: the
    /// two set-ups every "in daemon and in direct mode" test loops over.
    pub fn served(name: &str, cooldown: &'static str, daemon: bool) -> Node {
        let mut node = Node::new(name, cooldown);
        if daemon {
            node.start(&[]);
        }
        node
    }

    pub fn db_path(&self) -> std::path::PathBuf {
        self.dir.join("metis.sqlite")
    }

    pub fn daemon_up(&self) -> bool {
        self.daemon.is_some()
    }

    /// Starts the daemon with one `--cidr` flag per entry of `cidrs`
    /// (`NETWORK=CIDR`) and waits until it listens; panics with its log if
    /// it exits instead.
    pub fn start(&mut self, cidrs: &[String]) {
        assert!(self.daemon.is_none(), "daemon already running");
        self.daemon = Some(TestDaemon::start(&self.dir, &self.daemon_args(cidrs)));
    }

    fn daemon_args<'a>(&'a self, cidrs: &'a [String]) -> Vec<&'a str> {
        let mut args = vec!["--release-cooldown", self.cooldown];
        for cidr in cidrs {
            args.extend(["--cidr", cidr.as_str()]);
        }
        args
    }

    /// A DaemonSet surge update: a second daemon starts beside the running
    /// one (it waits for the database's lock), the old one gets SIGTERM and
    /// hands the socket over; returns once the new one serves. Starts one
    /// when none runs.
    pub fn surge(&mut self, cidrs: &[String]) {
        let Some(mut old) = self.daemon.take() else {
            return self.start(cidrs);
        };
        self.surges += 1;
        let log = format!("daemon-surge-{}.log", self.surges);
        let mut new = TestDaemon::spawn(&self.dir, &self.daemon_args(cidrs), &log);
        new.wait_for_log("waiting for it to stop", HANDOVER_PATIENCE);
        old.terminate();
        let status = old.wait_exit(HANDOVER_PATIENCE);
        assert!(status.success(), "old daemon: {status}: {}", old.log());
        new.wait_for_log("listening", HANDOVER_PATIENCE);
        self.daemon = Some(new);
    }

    /// SIGTERM, waiting for the exit.
    pub fn stop(&mut self) {
        if let Some(daemon) = self.daemon.take() {
            daemon.stop();
        }
    }

    /// SIGKILL, waiting for the exit.
    pub fn kill(&mut self) {
        if let Some(mut daemon) = self.daemon.take() {
            daemon.child.kill().unwrap();
            daemon.child.wait().unwrap();
        }
    }

    /// The daemons' logs so far, the first's and then each surge's (empty
    /// when none ever ran).
    pub fn log(&self) -> String {
        let mut log = std::fs::read_to_string(self.dir.join("daemon.log")).unwrap_or_default();
        for surge in 1..=self.surges {
            let name = format!("daemon-surge-{surge}.log");
            log += &std::fs::read_to_string(self.dir.join(&name)).unwrap_or_default();
        }
        log
    }

    /// `metis health` against the node's socket.
    pub fn health(&self) -> Output {
        let socket = self.dir.join("metis.sock");
        metis(&["health", "--socket-path", socket.to_str().unwrap()])
    }

    /// `metis admin check` on the node's database.
    pub fn admin_check(&self) -> Output {
        admin_check(&self.db_path())
    }

    /// Runs the plugin: `verb` for `container`/`ifname` with `conf`.
    pub fn call(
        &self,
        verb: &str,
        conf: &NetConf,
        container: &str,
        ifname: &str,
        request: Request,
        prev: Option<&Value>,
    ) -> Outcome {
        let runtime: Vec<IpAddr> = match request {
            Request::RuntimeConfig(ip) => vec![ip],
            _ => Vec::new(),
        };
        let args = match request {
            Request::CniArgs(ip) => format!("K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod;IP={ip}"),
            _ => "K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod".to_string(),
        };
        let plugin = Plugin {
            ifname,
            args: &args,
            ..Plugin::new(verb, container)
        };
        Outcome::of(&plugin.run(&conf.render(&self.dir, &runtime, prev)))
    }

    /// CNI STATUS of `conf` (as CNI 1.1.0): the exit status and, on
    /// failure, the error's code and message.
    pub fn status(&self, conf: &NetConf) -> Result<(), (u64, String)> {
        let mut config: Value = serde_json::from_str(&conf.render(&self.dir, &[], None)).unwrap();
        config["cniVersion"] = "1.1.0".into();
        let output = Plugin::new("STATUS", "").run(&config.to_string());
        if output.status.success() {
            assert!(output.stdout.is_empty(), "{output:?}");
            return Ok(());
        }
        let error: Value = serde_json::from_slice(&output.stdout).unwrap();
        Err((error["code"].as_u64().unwrap(), error["msg"].to_string()))
    }

    pub fn add(&self, conf: &NetConf, container: &str, request: Request) -> Outcome {
        self.call("ADD", conf, container, "eth0", request, None)
    }

    pub fn del(&self, conf: &NetConf, container: &str) -> Outcome {
        self.call("DEL", conf, container, "eth0", Request::None, None)
    }

    /// Every allocated row that has an owner (reservations excluded).
    pub fn holdings(&self) -> Vec<Holding> {
        holdings(&self.db_path())
    }

    /// The addresses `container` holds on `eth0` in `network`.
    pub fn held_by(&self, network: &str, container: &str) -> Vec<IpAddr> {
        self.holdings()
            .into_iter()
            .filter(|h| h.network == network && h.container == container && h.ifname == "eth0")
            .map(|h| h.address)
            .collect()
    }

    /// Every `cidr_blocks` row.
    pub fn blocks(&self) -> Vec<BlockRow> {
        blocks(&self.db_path())
    }
}

/// Every allocated row that has an owner (reservations excluded) of the
/// database at `path`, in row order; none when there is no database yet.
pub fn holdings(path: &Path) -> Vec<Holding> {
    if !path.exists() {
        return Vec::new();
    }
    let conn = db(path);
    let mut stmt = conn
        .prepare(
            "SELECT b.network, a.container_id, COALESCE(a.interface_name, ''), a.address \
             FROM ip_addresses a JOIN cidr_blocks b ON a.cidr_block_id = b.id \
             WHERE a.is_allocated = 1 AND COALESCE(a.container_id, '') != '' \
             ORDER BY a.id",
        )
        .unwrap();
    stmt.query_map([], |r| {
        Ok(Holding {
            network: r.get(0)?,
            container: r.get(1)?,
            ifname: r.get(2)?,
            address: r.get::<_, String>(3)?.parse().unwrap(),
        })
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// The addresses `container` holds (any network and interface) in the
/// database at `path`, as text, in row order.
pub fn held(path: &Path, container: &str) -> Vec<String> {
    holdings(path)
        .into_iter()
        .filter(|h| h.container == container)
        .map(|h| h.address.to_string())
        .collect()
}

/// Every `cidr_blocks` row of the database at `path`; none when there is
/// no database yet.
pub fn blocks(path: &Path) -> Vec<BlockRow> {
    if !path.exists() {
        return Vec::new();
    }
    let conn = db(path);
    let mut stmt = conn
        .prepare("SELECT network, cidr, state FROM cidr_blocks ORDER BY id")
        .unwrap();
    stmt.query_map([], |r| {
        Ok(BlockRow {
            network: r.get(0)?,
            block: Block::parse(&r.get::<_, String>(1)?),
            state: r.get(2)?,
        })
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// Whether the database's allocated rows are exactly what a model
/// expects; else what differs, both ways.
pub fn holdings_match(
    actual: Vec<Holding>,
    expected: impl IntoIterator<Item = Holding>,
) -> Result<(), String> {
    let actual: std::collections::BTreeSet<Holding> = actual.into_iter().collect();
    let expected: std::collections::BTreeSet<Holding> = expected.into_iter().collect();
    if actual == expected {
        return Ok(());
    }
    Err(format!(
        "database and model disagree:\n  only in the database: {:?}\n  only in the model: {:?}",
        actual.difference(&expected).collect::<Vec<_>>(),
        expected.difference(&actual).collect::<Vec<_>>()
    ))
}

/// Addresses held by more than one owner, among rows `counts` selects.
pub fn held_twice(
    holdings: &[Holding],
    counts: impl Fn(&Holding) -> bool,
) -> Vec<(IpAddr, Vec<Holding>)> {
    let mut by_address: std::collections::BTreeMap<IpAddr, Vec<Holding>> = Default::default();
    for holding in holdings.iter().filter(|h| counts(h)) {
        by_address
            .entry(holding.address)
            .or_default()
            .push(holding.clone());
    }
    by_address
        .into_iter()
        .filter(|(_, owners)| owners.len() > 1)
        .collect()
}

/// Whether `metis health` answered that the daemon serves (healthy, or
/// degraded with quarantined blocks: both mean it starts pods).
pub fn serving(health: &Output) -> bool {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&health.stdout),
        String::from_utf8_lossy(&health.stderr)
    )
    .to_lowercase();
    health.status.success() || text.contains("degraded")
}

/// Whether `metis admin check` found the database sound: exit 0, or exit 1
/// where every problem line names a quarantined block (the fixed Metis
/// lists quarantined blocks; they are isolated, not harmful).
pub fn check_passes(check: &Output) -> bool {
    if check.status.success() {
        return true;
    }
    let text = String::from_utf8_lossy(&check.stdout).to_lowercase();
    let problems: Vec<&str> = text
        .lines()
        .filter(|line| line.trim_start().starts_with("- "))
        .collect();
    check.status.code() == Some(1)
        && !problems.is_empty()
        && problems.iter().all(|line| line.contains("quarantin"))
}
