//! `metis daemon`: owns the node's address blocks in SQLite and serves the
//! plugin over a Unix socket from one single-threaded loop.

mod adaptive;
mod conn;
mod event_loop;
mod monitor;

use std::fmt;
use std::fs;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::stat::{Mode, umask};

use crate::cidr::Cidr;
use crate::engine::Engine;
use crate::flags::{self, FlagError, FlagSpec};
use crate::kube::{self, client::ApiClient, config::ApiConfig, nnc::Kind};
use crate::log;
use crate::metrics::{self, Metrics};
use crate::store::{BootRecovery, Depth, Durability, ReserveMode, Store, StoreError, StoreOptions};

use adaptive::Adaptive;
pub use adaptive::AdaptiveConfig;
pub use conn::Limits;
pub use event_loop::Admission;
pub use monitor::MonitorConfig;

/// Upstream's default socket path.
pub const DEFAULT_SOCKET_PATH: &str = "/var/lib/cni/metis/metis-adaptive-ipam.sock";
/// Upstream's default database path.
pub const DEFAULT_DB_PATH: &str = "/var/lib/cni/metis/metis.sqlite";

const FLAGS: &[FlagSpec] = &[
    FlagSpec {
        name: "--socket-path",
        value: Some("PATH"),
        repeatable: false,
        default: DEFAULT_SOCKET_PATH,
        help: "Unix socket the plugin connects to",
    },
    FlagSpec {
        name: "--db-path",
        value: Some("PATH"),
        repeatable: false,
        default: DEFAULT_DB_PATH,
        help: "SQLite database holding the node's blocks and allocations",
    },
    FlagSpec {
        name: "--release-cooldown",
        value: Some("DURATION"),
        repeatable: false,
        default: "1m",
        help: "how long a released address rests before reuse (0 = none)",
    },
    FlagSpec {
        name: "--cidr",
        value: Some("NETWORK=CIDR"),
        repeatable: true,
        default: "",
        help: "add a block to a network at start (nodes without Kubernetes)",
    },
    FlagSpec {
        name: "--reserve",
        value: Some("every-block|first-block"),
        repeatable: false,
        default: "every-block",
        help: "which blocks keep network, gateway and broadcast addresses out of allocation; \
               first-block is upstream's rule, for dataplanes that never use the IPAM gateway",
    },
    FlagSpec {
        name: "--db-synchronous",
        value: Some("normal|full"),
        repeatable: false,
        default: "normal",
        help: "SQLite synchronous mode; full also survives power loss of the last commits",
    },
    FlagSpec {
        name: "--max-connections",
        value: Some("N"),
        repeatable: false,
        default: "256",
        help: "concurrent client connections; more are refused with an error",
    },
    FlagSpec {
        name: "--idle-timeout",
        value: Some("DURATION"),
        repeatable: false,
        default: "30s",
        help: "close a client connection idle this long",
    },
    FlagSpec {
        name: "--request-timeout",
        value: Some("DURATION"),
        repeatable: false,
        default: "5s",
        help: "a started request must arrive, and its response drain, within this",
    },
    FlagSpec {
        name: "--allowed-uid",
        value: Some("UID"),
        repeatable: true,
        default: "",
        help: "another user allowed to connect (root and the daemon's user always are)",
    },
    FlagSpec {
        name: "--socket-group",
        value: Some("NAME|GID"),
        repeatable: false,
        default: "",
        help: "make the socket 0660 and owned by this group (its members still need --allowed-uid)",
    },
    FlagSpec {
        name: "--no-boot-recovery",
        value: None,
        repeatable: false,
        default: "",
        help: "keep allocations of an earlier boot instead of releasing them at start",
    },
    FlagSpec {
        name: "--cidr-source",
        value: Some("static|node|nnc"),
        repeatable: false,
        default: "nnc with a cluster, else static",
        help: "where blocks come from: static (--cidr and CNI ranges only), node (the Node's \
               spec.podCIDRs) or nnc (NodeNetworkConfig scale-up and release)",
    },
    FlagSpec {
        name: "--node-network",
        value: Some("NAME"),
        repeatable: false,
        default: "default",
        help: "network that Node podCIDRs are added to (--cidr-source node)",
    },
    FlagSpec {
        name: "--monitor-interval",
        value: Some("DURATION"),
        repeatable: false,
        default: "2s",
        help: "how often the monitor re-evaluates scale-up, drain and release",
    },
    FlagSpec {
        name: "--draining-expiration",
        value: Some("DURATION"),
        repeatable: false,
        default: "5h",
        help: "an empty Draining block untouched this long is released",
    },
    FlagSpec {
        name: "--sustained-low-utilization-duration",
        value: Some("DURATION"),
        repeatable: false,
        default: "8h",
        help: "utilisation below 50% for this long drains the newest blocks",
    },
    FlagSpec {
        name: "--scale-up-wait",
        value: Some("DURATION"),
        repeatable: false,
        default: "9s",
        help: "how long an allocation waits for new blocks before IP_POOL_EXHAUSTED \
               (keep it under the runtime's 10 s plugin timeout)",
    },
    FlagSpec {
        name: "--metrics-addr",
        value: Some("HOST:PORT"),
        repeatable: false,
        default: "off",
        help: "serve Prometheus /metrics and /healthz here, e.g. 127.0.0.1:9153",
    },
    FlagSpec {
        name: "-v",
        value: Some("N"),
        repeatable: false,
        default: "0",
        help: "log verbosity: 1 adds debug lines, 4 adds periodic no-op messages",
    },
];

/// Everything the daemon needs to start.
#[derive(Debug)]
pub struct Config {
    pub socket_path: PathBuf,
    pub db_path: PathBuf,
    pub release_cooldown_ms: i64,
    pub cidrs: Vec<(String, Cidr)>,
    pub reserve: ReserveMode,
    pub durability: Durability,
    pub max_connections: usize,
    pub limits: Limits,
    pub allowed_uids: Vec<u32>,
    /// Group given access to the socket (0660) with `--socket-group`.
    pub socket_group: Option<u32>,
    /// Release the previous boot's allocations at start.
    pub boot_recovery: bool,
    /// Where the kernel boot id is read (`METIS_BOOT_ID_FILE` overrides).
    pub boot_id_path: PathBuf,
    pub verbosity: u8,
    pub metrics_addr: Option<SocketAddr>,
    /// `None` for static blocks only.
    pub adaptive: Option<AdaptiveSettings>,
}

/// The Kubernetes side of the configuration.
#[derive(Debug)]
pub struct AdaptiveSettings {
    pub api: ApiConfig,
    pub node_name: String,
    pub adaptive: AdaptiveConfig,
}

/// A failure that stops the daemon.
#[derive(Debug)]
pub enum DaemonError {
    Usage(FlagError),
    Store(StoreError),
    Socket {
        path: PathBuf,
        reason: String,
    },
    Signals(nix::Error),
    Kube(String),
    /// The database fails its invariant check; the report names the problems.
    Unsafe(String),
    Metrics(String),
}

impl fmt::Display for DaemonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DaemonError::Usage(err) => write!(f, "{err}"),
            DaemonError::Store(err) => write!(f, "failed to initialize sqlite store: {err}"),
            DaemonError::Socket { path, reason } => {
                write!(f, "cannot listen on {}: {reason}", path.display())
            }
            DaemonError::Signals(err) => write!(f, "cannot set up signal handling: {err}"),
            DaemonError::Kube(why) => write!(f, "cannot start the Kubernetes client: {why}"),
            DaemonError::Unsafe(report) => write!(
                f,
                "refusing to serve a database that fails its checks (inspect it with \
                 `metis admin check`): {report}"
            ),
            DaemonError::Metrics(why) => write!(f, "cannot serve metrics on {why}"),
        }
    }
}

impl std::error::Error for DaemonError {}

/// Parses the daemon's flags; `lookup` reads the environment (`KUBECONFIG`,
/// `KUBERNETES_SERVICE_*`, `NODE_NAME`). `Err(FlagError::Help)` asks for the
/// usage text.
pub fn parse_config(
    args: &[String],
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, FlagError> {
    let parsed = flags::parse(FLAGS, args)?;
    let duration = |name: &'static str, default: &str| -> Result<i64, FlagError> {
        let text = parsed.get(name).unwrap_or(default);
        crate::cni::conf::parse_duration_ms(text).ok_or_else(|| {
            FlagError::BadValue(
                name,
                format!("{text:?} is not a duration like 30s, 1m or 1h30m"),
            )
        })
    };
    let cidrs = parsed
        .all("--cidr")
        .into_iter()
        .map(parse_network_cidr)
        .collect::<Result<Vec<_>, _>>()?;
    let reserve = match parsed.get("--reserve").unwrap_or("every-block") {
        "every-block" => ReserveMode::EveryBlock,
        "first-block" => ReserveMode::FirstBlock,
        other => {
            return Err(FlagError::BadValue(
                "--reserve",
                format!("{other:?} is neither every-block nor first-block"),
            ));
        }
    };
    let durability = match parsed.get("--db-synchronous").unwrap_or("normal") {
        "normal" => Durability::Normal,
        "full" => Durability::Full,
        other => {
            return Err(FlagError::BadValue(
                "--db-synchronous",
                format!("{other:?} is neither normal nor full"),
            ));
        }
    };
    let number = |name: &'static str, default: &str| -> Result<u64, FlagError> {
        let text = parsed.get(name).unwrap_or(default);
        text.parse::<u64>()
            .map_err(|_| FlagError::BadValue(name, format!("{text:?} is not a whole number")))
    };
    let max_connections = usize::try_from(number("--max-connections", "256")?)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| FlagError::BadValue("--max-connections", "must be at least 1".into()))?;
    let verbosity = u8::try_from(number("-v", "0")?)
        .map_err(|_| FlagError::BadValue("-v", "must be at most 255".into()))?;
    let allowed_uids = parsed
        .all("--allowed-uid")
        .into_iter()
        .map(|text| {
            text.parse::<u32>().map_err(|_| {
                FlagError::BadValue("--allowed-uid", format!("{text:?} is not a user id"))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let socket_group = parsed.get("--socket-group").map(parse_group).transpose()?;
    let positive = |name: &'static str, default: &str| -> Result<Duration, FlagError> {
        let ms = duration(name, default)?;
        u64::try_from(ms)
            .ok()
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis)
            .ok_or_else(|| FlagError::BadValue(name, "must be greater than zero".into()))
    };
    let adaptive = adaptive_settings(&parsed, lookup, &duration, &positive)?;
    let metrics_addr = parsed
        .get("--metrics-addr")
        .map(|text| {
            text.parse::<SocketAddr>().map_err(|_| {
                FlagError::BadValue(
                    "--metrics-addr",
                    format!("{text:?} is not HOST:PORT, e.g. 127.0.0.1:9153"),
                )
            })
        })
        .transpose()?;
    Ok(Config {
        socket_path: absolute(&parsed, "--socket-path", DEFAULT_SOCKET_PATH)?,
        db_path: absolute(&parsed, "--db-path", DEFAULT_DB_PATH)?,
        release_cooldown_ms: duration("--release-cooldown", "1m")?,
        cidrs,
        reserve,
        durability,
        max_connections,
        limits: Limits {
            idle: positive("--idle-timeout", "30s")?,
            request: positive("--request-timeout", "5s")?,
        },
        allowed_uids,
        socket_group,
        boot_recovery: !parsed.has("--no-boot-recovery"),
        boot_id_path: crate::store::boot_id_path(lookup),
        verbosity,
        metrics_addr,
        adaptive,
    })
}

/// Reads `--cidr-source` and, for a cluster source, the API server and node.
fn adaptive_settings(
    parsed: &flags::Parsed,
    lookup: &dyn Fn(&str) -> Option<String>,
    duration: &dyn Fn(&'static str, &str) -> Result<i64, FlagError>,
    positive: &dyn Fn(&'static str, &str) -> Result<Duration, FlagError>,
) -> Result<Option<AdaptiveSettings>, FlagError> {
    let api = kube::config::from_environment(lookup)
        .map_err(|err| FlagError::BadValue("--cidr-source", err.to_string()))?;
    let source = match (parsed.get("--cidr-source"), &api) {
        (Some("static"), _) | (None, None) => return Ok(None),
        (Some("node"), _) => Kind::Node,
        (Some("nnc"), _) | (None, Some(_)) => Kind::Nnc,
        (Some(other), _) => {
            return Err(FlagError::BadValue(
                "--cidr-source",
                format!("{other:?} is not static, node or nnc"),
            ));
        }
    };
    let api = api.ok_or_else(|| {
        FlagError::BadValue(
            "--cidr-source",
            "needs a cluster: set KUBECONFIG or run in a pod (KUBERNETES_SERVICE_HOST/PORT)".into(),
        )
    })?;
    let node_name = match lookup("NODE_NAME").filter(|n| !n.is_empty()) {
        Some(name) => name,
        None => nix::unistd::gethostname()
            .ok()
            .and_then(|name| name.into_string().ok())
            .unwrap_or_default(),
    };
    if !is_dns_subdomain(&node_name) {
        return Err(FlagError::BadValue(
            "--cidr-source",
            format!(
                "node name {node_name:?} (NODE_NAME or hostname) is not a valid Kubernetes name"
            ),
        ));
    }
    let node_network = parsed
        .get("--node-network")
        .unwrap_or(crate::engine::DEFAULT_NETWORK);
    if node_network.is_empty() {
        return Err(FlagError::BadValue(
            "--node-network",
            "must not be empty".into(),
        ));
    }
    Ok(Some(AdaptiveSettings {
        api,
        node_name,
        adaptive: AdaptiveConfig {
            source,
            node_network: node_network.to_string(),
            monitor: MonitorConfig {
                draining_expiration_ms: duration("--draining-expiration", "5h")?,
                sustained_low_utilization_ms: duration(
                    "--sustained-low-utilization-duration",
                    "8h",
                )?,
            },
            monitor_interval: positive("--monitor-interval", "2s")?,
            pending_timeout: positive("--scale-up-wait", "9s")?,
        },
    }))
}

/// A Kubernetes object name (RFC 1123 subdomain): it is placed in URL paths.
fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn absolute(
    parsed: &flags::Parsed,
    name: &'static str,
    default: &str,
) -> Result<PathBuf, FlagError> {
    let path = PathBuf::from(parsed.get(name).unwrap_or(default));
    if path.is_absolute() {
        Ok(path)
    } else {
        Err(FlagError::BadValue(
            name,
            format!("{} is not an absolute path", path.display()),
        ))
    }
}

/// A group name or numeric id for `--socket-group`.
fn parse_group(text: &str) -> Result<u32, FlagError> {
    if let Ok(gid) = text.parse::<u32>() {
        return Ok(gid);
    }
    match nix::unistd::Group::from_name(text) {
        Ok(Some(group)) => Ok(group.gid.as_raw()),
        Ok(None) => Err(FlagError::BadValue(
            "--socket-group",
            format!("no group named {text:?}"),
        )),
        Err(err) => Err(FlagError::BadValue(
            "--socket-group",
            format!("cannot look up group {text:?}: {err}"),
        )),
    }
}

fn parse_network_cidr(text: &str) -> Result<(String, Cidr), FlagError> {
    let (network, cidr) = text
        .split_once('=')
        .ok_or_else(|| FlagError::BadValue("--cidr", format!("{text:?} is not NETWORK=CIDR")))?;
    if network.is_empty() {
        return Err(FlagError::BadValue(
            "--cidr",
            format!("{text:?} names no network"),
        ));
    }
    let cidr = cidr
        .parse::<Cidr>()
        .map_err(|err| FlagError::BadValue("--cidr", err.to_string()))?;
    crate::store::check_block_size(&cidr)
        .map_err(|err| FlagError::BadValue("--cidr", err.to_string()))?;
    Ok((network.to_string(), cidr))
}

/// The `--help` text.
pub fn usage() -> String {
    flags::usage(
        "metis daemon",
        "Serve pod address allocations for this node over a Unix socket.",
        FLAGS,
    )
}

/// Runs the daemon until SIGTERM/SIGINT.
pub fn run(config: &Config) -> Result<(), DaemonError> {
    log::info(
        "daemon",
        "metis daemon is starting",
        &[
            ("socket", &config.socket_path.display()),
            ("db", &config.db_path.display()),
            ("release_cooldown_ms", &config.release_cooldown_ms),
        ],
    );
    // Block the signals before anything else so they queue on the fd.
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    mask.thread_block().map_err(DaemonError::Signals)?;
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(DaemonError::Signals)?;

    let mut store = Store::open(
        &config.db_path,
        &StoreOptions {
            durability: config.durability,
            reserve: Some(config.reserve),
            release_cooldown: Some(config.release_cooldown_ms),
        },
    )
    .map_err(DaemonError::Store)?;
    for warning in store.open_warnings() {
        log::warn("store", warning, &[]);
    }
    let report = store.verify(Depth::Quick).map_err(DaemonError::Store)?;
    if !report.is_ok() {
        return Err(DaemonError::Unsafe(crate::cli::check::describe(
            &config.db_path.display().to_string(),
            &report,
        )));
    }
    let recovered_at_boot = recover_after_reboot(&mut store, config)?;
    for (network, cidr) in &config.cidrs {
        let outcome = store
            .add_cidr_block(network, cidr)
            .map_err(DaemonError::Store)?;
        log::info(
            "daemon",
            "static CIDR block",
            &[
                ("network", network),
                ("cidr", cidr),
                ("outcome", &format!("{outcome:?}")),
            ],
        );
    }

    let listener = listen(&config.socket_path, config.socket_group)?;
    let engine = Engine::new(store);
    let metrics = Arc::new(Metrics::default());
    metrics.recovered_at_boot(recovered_at_boot);
    if let Some(addr) = config.metrics_addr {
        let bound = metrics::serve(addr, Arc::clone(&metrics), config.db_path.clone())
            .map_err(|err| DaemonError::Metrics(format!("{addr}: {err}")))?;
        log::info("daemon", "metrics listening", &[("addr", &bound)]);
    }
    let adaptive = match &config.adaptive {
        None => None,
        Some(settings) => {
            let client =
                ApiClient::new(&settings.api).map_err(|err| DaemonError::Kube(err.to_string()))?;
            let link =
                kube::worker::spawn(client, settings.node_name.clone(), settings.adaptive.source)
                    .map_err(|err| DaemonError::Kube(err.to_string()))?;
            log::info(
                "daemon",
                "following the cluster",
                &[
                    ("server", &settings.api.server),
                    ("node", &settings.node_name),
                    ("source", &format!("{:?}", settings.adaptive.source)),
                ],
            );
            Some(Adaptive::new(
                link,
                settings.adaptive.clone(),
                Arc::clone(&metrics),
                std::time::Instant::now(),
            ))
        }
    };
    log::info(
        "daemon",
        "listening",
        &[("socket", &config.socket_path.display())],
    );
    event_loop::EventLoop::new(
        listener,
        signals,
        engine,
        adaptive,
        metrics,
        config.limits,
        Admission {
            max_connections: config.max_connections,
            allowed_uids: config.allowed_uids.clone(),
        },
    )
    .run();
    if let Err(err) = fs::remove_file(&config.socket_path) {
        log::warn("daemon", "could not remove socket", &[("error", &err)]);
    }
    log::info("daemon", "metis daemon stopped", &[]);
    Ok(())
}

/// Releases the allocations of an earlier boot (see `store::boot`) before
/// anything is served, and returns how many were released (for metrics).
/// Without a readable boot id nothing is released.
pub fn recover_after_reboot(store: &mut Store, config: &Config) -> Result<u64, DaemonError> {
    let Some(boot_id) = crate::store::read_boot_id(&config.boot_id_path) else {
        log::warn(
            "daemon",
            "cannot read the boot id; allocations of an earlier boot are not released",
            &[("path", &config.boot_id_path.display())],
        );
        return Ok(0);
    };
    let outcome = store
        .recover_after_reboot(&boot_id, Some(config.boot_recovery), log::now_ms())
        .map_err(DaemonError::Store)?;
    match outcome {
        BootRecovery::Released(count) => log::info(
            "daemon",
            "new boot: released the allocations of the previous boot",
            &[("released", &count), ("boot_id", &boot_id)],
        ),
        BootRecovery::Disabled => log::info(
            "daemon",
            "new boot: keeping the previous boot's allocations (--no-boot-recovery)",
            &[("boot_id", &boot_id)],
        ),
        BootRecovery::FirstRecord | BootRecovery::SameBoot => {}
    }
    Ok(outcome.released())
}

/// Binds the socket safely: its directory is created 0700 if missing and
/// must not be writable by others; an existing path must be a stale socket
/// (never a symlink or another kind of file); the socket is born 0600, or
/// 0660 and owned by `group` when one is given.
fn listen(path: &Path, group: Option<u32>) -> Result<UnixListener, DaemonError> {
    let fail = |reason: String| DaemonError::Socket {
        path: path.to_path_buf(),
        reason,
    };
    let dir = path
        .parent()
        .filter(|dir| !dir.as_os_str().is_empty())
        .ok_or_else(|| fail("the socket path has no directory".into()))?;
    if !dir.exists() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|err| fail(format!("cannot create {}: {err}", dir.display())))?;
    }
    let dir_meta = fs::metadata(dir).map_err(|err| fail(format!("{}: {err}", dir.display())))?;
    if dir_meta.permissions().mode() & 0o002 != 0 {
        return Err(fail(format!(
            "directory {} is writable by others; use a private directory",
            dir.display()
        )));
    }
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(fail("the path is a symbolic link".into()));
        }
        Ok(meta) if meta.file_type().is_socket() => {
            fs::remove_file(path)
                .map_err(|err| fail(format!("cannot remove stale socket: {err}")))?;
        }
        Ok(_) => return Err(fail("the path exists and is not a socket".into())),
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(fail(err.to_string())),
    }
    // The umask makes the socket 0600 from birth: no window in which
    // another user could connect.
    let (mask, mode) = match group {
        None => (0o177, 0o600),
        Some(_) => (0o117, 0o660),
    };
    let previous = umask(Mode::from_bits_truncate(mask));
    let bound = UnixListener::bind(path);
    umask(previous);
    let listener = bound.map_err(|err| fail(err.to_string()))?;
    if let Some(gid) = group {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(|err| fail(format!("cannot give the socket to group {gid}: {err}")))?;
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|err| fail(err.to_string()))?;
    listener
        .set_nonblocking(true)
        .map_err(|err| fail(err.to_string()))?;
    Ok(listener)
}
