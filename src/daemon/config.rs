//! The daemon's flags: the table `--help` prints, and [`parse_config`]
//! turning a command line into a [`Config`]. Each default is written once,
//! in [`FLAGS`]; the parser reads it from there.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::Limits;
#[cfg(feature = "kube")]
use crate::adaptive::{AdaptiveConfig, MonitorConfig};
use crate::cidr::Cidr;
use crate::defaults::{DEFAULT_NETWORK, DEFAULT_SOCKET_PATH};
use crate::duration::parse_duration_ms;
use crate::flags::{self, FlagError, FlagSpec, Parsed};
#[cfg(feature = "kube")]
use crate::kube::{self, backoff::ApiTiming, config::ApiConfig, nnc::Kind};
use crate::store::{Durability, ReserveMode};

const FLAGS: &[FlagSpec] = &[
    FlagSpec {
        name: "--socket-path",
        value: Some("PATH"),
        repeatable: false,
        default: DEFAULT_SOCKET_PATH,
        help: "Unix socket the plugin connects to",
    },
    flags::db_path_flag("SQLite database holding the node's blocks and allocations"),
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
        default: DEFAULT_NETWORK,
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
        name: "--api-watch-timeout",
        value: Some("DURATION"),
        repeatable: false,
        default: "5m",
        help: "each watch of the API server lasts a random 1-2x this; an idle node sends one \
               request per watch",
    },
    FlagSpec {
        name: "--api-max-backoff",
        value: Some("DURATION"),
        repeatable: false,
        default: "60s",
        help: "longest pause between retries of failed API requests (plus up to half again \
               as jitter; a longer Retry-After is honoured up to 5m)",
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
    #[cfg(feature = "kube")]
    pub adaptive: Option<AdaptiveSettings>,
}

/// The Kubernetes side of the configuration.
#[cfg(feature = "kube")]
#[derive(Debug)]
pub struct AdaptiveSettings {
    pub api: ApiConfig,
    pub node_name: String,
    pub timing: ApiTiming,
    pub adaptive: AdaptiveConfig,
}

/// Parses the daemon's flags; `lookup` reads the environment (`KUBECONFIG`,
/// `KUBERNETES_SERVICE_*`, `NODE_NAME`). `Err(FlagError::Help)` asks for the
/// usage text.
pub fn parse_config(
    args: &[String],
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, FlagError> {
    let parsed = flags::parse(FLAGS, args)?;
    #[cfg(not(feature = "kube"))]
    refuse_cluster_source(&parsed)?;
    Ok(Config {
        socket_path: absolute(&parsed, "--socket-path")?,
        db_path: absolute(&parsed, "--db-path")?,
        release_cooldown_ms: duration(&parsed, "--release-cooldown")?,
        cidrs: parsed
            .all("--cidr")
            .into_iter()
            .map(parse_network_cidr)
            .collect::<Result<Vec<_>, _>>()?,
        reserve: either(
            &parsed,
            "--reserve",
            [
                ("every-block", ReserveMode::EveryBlock),
                ("first-block", ReserveMode::FirstBlock),
            ],
        )?,
        durability: either(
            &parsed,
            "--db-synchronous",
            [("normal", Durability::Normal), ("full", Durability::Full)],
        )?,
        max_connections: usize::try_from(number(&parsed, "--max-connections")?)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| FlagError::BadValue("--max-connections", "must be at least 1".into()))?,
        limits: Limits {
            idle: positive(&parsed, "--idle-timeout")?,
            request: positive(&parsed, "--request-timeout")?,
        },
        allowed_uids: allowed_uids(&parsed)?,
        socket_group: parsed.get("--socket-group").map(parse_group).transpose()?,
        boot_recovery: !parsed.has("--no-boot-recovery"),
        boot_id_path: crate::store::boot_id_path(lookup),
        verbosity: u8::try_from(number(&parsed, "-v")?)
            .map_err(|_| FlagError::BadValue("-v", "must be at most 255".into()))?,
        metrics_addr: metrics_addr(&parsed)?,
        #[cfg(feature = "kube")]
        adaptive: adaptive_settings(&parsed, lookup)?,
    })
}

/// The `--help` text.
pub fn usage() -> String {
    flags::usage(
        "metis daemon",
        "Serve pod address allocations for this node over a Unix socket.",
        FLAGS,
    )
}

/// A flag's value as given, else the default `--help` shows for it.
fn value<'a>(parsed: &'a Parsed, name: &'static str) -> &'a str {
    parsed.get(name).unwrap_or_else(|| {
        FLAGS
            .iter()
            .find(|spec| spec.name == name)
            .map_or("", |spec| spec.default)
    })
}

fn duration(parsed: &Parsed, name: &'static str) -> Result<i64, FlagError> {
    let text = value(parsed, name);
    parse_duration_ms(text).ok_or_else(|| {
        FlagError::BadValue(
            name,
            format!("{text:?} is not a duration like 30s, 1m or 1h30m"),
        )
    })
}

fn positive(parsed: &Parsed, name: &'static str) -> Result<Duration, FlagError> {
    let ms = duration(parsed, name)?;
    u64::try_from(ms)
        .ok()
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis)
        .ok_or_else(|| FlagError::BadValue(name, "must be greater than zero".into()))
}

fn number(parsed: &Parsed, name: &'static str) -> Result<u64, FlagError> {
    let text = value(parsed, name);
    text.parse::<u64>()
        .map_err(|_| FlagError::BadValue(name, format!("{text:?} is not a whole number")))
}

fn absolute(parsed: &Parsed, name: &'static str) -> Result<PathBuf, FlagError> {
    let path = PathBuf::from(value(parsed, name));
    if path.is_absolute() {
        Ok(path)
    } else {
        Err(FlagError::BadValue(
            name,
            format!("{} is not an absolute path", path.display()),
        ))
    }
}

/// A flag that takes one of two words.
fn either<T: Copy>(
    parsed: &Parsed,
    name: &'static str,
    [(first, a), (second, b)]: [(&str, T); 2],
) -> Result<T, FlagError> {
    match value(parsed, name) {
        text if text == first => Ok(a),
        text if text == second => Ok(b),
        other => Err(FlagError::BadValue(
            name,
            format!("{other:?} is neither {first} nor {second}"),
        )),
    }
}

fn allowed_uids(parsed: &Parsed) -> Result<Vec<u32>, FlagError> {
    parsed
        .all("--allowed-uid")
        .into_iter()
        .map(|text| {
            text.parse::<u32>().map_err(|_| {
                FlagError::BadValue("--allowed-uid", format!("{text:?} is not a user id"))
            })
        })
        .collect()
}

fn metrics_addr(parsed: &Parsed) -> Result<Option<SocketAddr>, FlagError> {
    parsed
        .get("--metrics-addr")
        .map(|text| {
            text.parse::<SocketAddr>().map_err(|_| {
                FlagError::BadValue(
                    "--metrics-addr",
                    format!("{text:?} is not HOST:PORT, e.g. 127.0.0.1:9153"),
                )
            })
        })
        .transpose()
}

/// The edge build serves static blocks only: a cluster source is a usage
/// error that says how to get a build that has one.
#[cfg(not(feature = "kube"))]
fn refuse_cluster_source(parsed: &Parsed) -> Result<(), FlagError> {
    match parsed.get("--cidr-source") {
        None | Some("static") => Ok(()),
        Some(source @ ("node" | "nnc")) => Err(FlagError::BadValue(
            "--cidr-source",
            format!(
                "{source:?} needs Kubernetes support, which this build of metis does not have \
                 (built with --no-default-features); use the full build \
                 (cargo build --release, default features) or --cidr-source static"
            ),
        )),
        Some(other) => Err(FlagError::BadValue(
            "--cidr-source",
            format!("{other:?} is not static, node or nnc"),
        )),
    }
}

/// Reads `--cidr-source` and, for a cluster source, the API server and node.
#[cfg(feature = "kube")]
fn adaptive_settings(
    parsed: &Parsed,
    lookup: &dyn Fn(&str) -> Option<String>,
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
    let node_network = value(parsed, "--node-network");
    crate::names::network(node_network)
        .map_err(|err| FlagError::BadValue("--node-network", err.to_string()))?;
    Ok(Some(AdaptiveSettings {
        api,
        node_name: node_name(lookup)?,
        timing: ApiTiming {
            watch_timeout: positive(parsed, "--api-watch-timeout")?,
            max_backoff: positive(parsed, "--api-max-backoff")?,
        },
        adaptive: AdaptiveConfig {
            source,
            node_network: node_network.to_string(),
            monitor: MonitorConfig {
                scale_up_wait_ms: duration(parsed, "--scale-up-wait")?,
                draining_expiration_ms: duration(parsed, "--draining-expiration")?,
                sustained_low_utilization_ms: duration(
                    parsed,
                    "--sustained-low-utilization-duration",
                )?,
            },
            monitor_interval: positive(parsed, "--monitor-interval")?,
            pending_timeout: positive(parsed, "--scale-up-wait")?,
        },
    }))
}

/// `NODE_NAME` (the downward API), else the hostname.
#[cfg(feature = "kube")]
fn node_name(lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, FlagError> {
    let node_name = match lookup("NODE_NAME").filter(|n| !n.is_empty()) {
        Some(name) => name,
        None => nix::unistd::gethostname()
            .ok()
            .and_then(|name| name.into_string().ok())
            .unwrap_or_default(),
    };
    if !crate::names::is_dns_subdomain(&node_name) {
        return Err(FlagError::BadValue(
            "--cidr-source",
            format!(
                "node name {node_name:?} (NODE_NAME or hostname) is not a valid Kubernetes name"
            ),
        ));
    }
    Ok(node_name)
}

/// Where `--socket-group NAME` is looked up.
const GROUP_FILE: &str = "/etc/group";

/// A group name or numeric id for `--socket-group`. Names come from
/// [`GROUP_FILE`] itself, not through NSS: the release binary is linked
/// statically, and static glibc's NSS loads the host's shared modules
/// (`group: files systemd`), which crashes it.
fn parse_group(text: &str) -> Result<u32, FlagError> {
    if let Ok(gid) = text.parse::<u32>() {
        return Ok(gid);
    }
    let groups = match std::fs::read_to_string(GROUP_FILE) {
        Ok(groups) => groups,
        // No group file (a scratch image): no group has a name.
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(err) => {
            return Err(FlagError::BadValue(
                "--socket-group",
                format!("cannot look up group {text:?} in {GROUP_FILE}: {err}"),
            ));
        }
    };
    group_id(&groups, text).ok_or_else(|| {
        FlagError::BadValue(
            "--socket-group",
            format!("no group named {text:?} in {GROUP_FILE}"),
        )
    })
}

/// The id of group `name` in `group(5)` text (`name:password:gid:members`);
/// malformed lines are skipped, as glibc's `files` module skips them.
fn group_id(groups: &str, name: &str) -> Option<u32> {
    groups.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != name {
            return None;
        }
        fields.nth(1)?.parse().ok()
    })
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
    crate::names::network(network)
        .map_err(|err| FlagError::BadValue("--cidr", format!("network name {err}")))?;
    let cidr = cidr
        .parse::<Cidr>()
        .map_err(|err| FlagError::BadValue("--cidr", err.to_string()))?;
    Ok((network.to_string(), cidr))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// No cluster in the environment, so the source defaults to static.
    fn parse(list: &[&str]) -> Result<Config, FlagError> {
        parse_config(&args(list), &|_| None)
    }

    #[test]
    fn group_names_are_read_from_the_group_file() {
        let groups = "root:x:0:\n\nbroken line\nnogid:x::a\nbig:x:99999999999:\n\
                      metis:x:4242:alice,bob\nmetis:x:7:\n";
        assert_eq!(group_id(groups, "root"), Some(0));
        assert_eq!(
            group_id(groups, "metis"),
            Some(4242),
            "the first entry wins"
        );
        for name in ["nogid", "big", "broken line", "", "x", "absent"] {
            assert_eq!(group_id(groups, name), None, "{name:?}");
        }
        assert_eq!(group_id("", "root"), None);
    }

    #[test]
    fn defaults_are_the_ones_help_shows() {
        let config = parse(&[]).unwrap();
        assert_eq!(config.socket_path, PathBuf::from(DEFAULT_SOCKET_PATH));
        assert_eq!(
            config.db_path,
            PathBuf::from(crate::defaults::DEFAULT_DB_PATH)
        );
        assert_eq!(config.release_cooldown_ms, 60_000);
        assert!(config.cidrs.is_empty());
        assert_eq!(config.reserve, ReserveMode::EveryBlock);
        assert_eq!(config.durability, Durability::Normal);
        assert_eq!(config.max_connections, 256);
        assert_eq!(config.limits.idle, Duration::from_secs(30));
        assert_eq!(config.limits.request, Duration::from_secs(5));
        assert!(config.allowed_uids.is_empty());
        assert_eq!(config.socket_group, None);
        assert!(config.boot_recovery);
        assert_eq!(config.verbosity, 0);
        assert_eq!(config.metrics_addr, None);
        #[cfg(feature = "kube")]
        assert!(config.adaptive.is_none());
        let help = usage();
        for shown in [
            "(default 1m)",
            "(default 256)",
            "(default 30s)",
            "(default 9s)",
        ] {
            assert!(help.contains(shown), "{shown}");
        }
    }

    #[test]
    fn every_flag_reaches_the_config() {
        let config = parse(&[
            "--socket-path=/run/m.sock",
            "--db-path=/run/m.db",
            "--release-cooldown=0",
            "--cidr=net=198.18.0.0/24",
            "--cidr",
            "other=2001:db8::/64",
            "--reserve=first-block",
            "--db-synchronous=full",
            "--max-connections=3",
            "--idle-timeout=1m",
            "--request-timeout=250ms",
            "--allowed-uid=1000",
            "--allowed-uid=1001",
            "--socket-group=42",
            "--no-boot-recovery",
            "--metrics-addr=127.0.0.1:9153",
            "-v=4",
        ])
        .unwrap();
        assert_eq!(config.socket_path, PathBuf::from("/run/m.sock"));
        assert_eq!(config.db_path, PathBuf::from("/run/m.db"));
        assert_eq!(config.release_cooldown_ms, 0);
        let cidrs: Vec<(&str, String)> = config
            .cidrs
            .iter()
            .map(|(network, cidr)| (network.as_str(), cidr.to_string()))
            .collect();
        assert_eq!(
            cidrs,
            vec![
                ("net", "198.18.0.0/24".to_string()),
                ("other", "2001:db8::/64".to_string())
            ]
        );
        assert_eq!(config.reserve, ReserveMode::FirstBlock);
        assert_eq!(config.durability, Durability::Full);
        assert_eq!(config.max_connections, 3);
        assert_eq!(config.limits.idle, Duration::from_secs(60));
        assert_eq!(config.limits.request, Duration::from_millis(250));
        assert_eq!(config.allowed_uids, vec![1000, 1001]);
        assert_eq!(config.socket_group, Some(42));
        assert!(!config.boot_recovery);
        assert_eq!(config.metrics_addr, Some("127.0.0.1:9153".parse().unwrap()));
        assert_eq!(config.verbosity, 4);
    }

    #[cfg(feature = "kube")]
    #[test]
    fn cluster_flags_need_a_cluster() {
        assert!(parse(&["--cidr-source=static"]).unwrap().adaptive.is_none());
        for source in ["node", "nnc"] {
            let err = parse(&["--cidr-source", source]).unwrap_err();
            assert!(
                matches!(&err, FlagError::BadValue("--cidr-source", why) if why.contains("needs a cluster")),
                "{source}: {err:?}"
            );
        }
    }

    #[test]
    fn bad_values_name_their_flag() {
        let cases: &[(&[&str], &str)] = &[
            (&["--socket-path=relative.sock"], "--socket-path"),
            (&["--db-path=db"], "--db-path"),
            (&["--release-cooldown=5"], "--release-cooldown"),
            (&["--release-cooldown=-1s"], "--release-cooldown"),
            (&["--cidr=198.18.0.0/24"], "--cidr"),
            (&["--cidr==198.18.0.0/24"], "--cidr"),
            (&["--cidr=net=198.18.0.1/24"], "--cidr"),
            (&["--cidr=my net=198.18.0.0/24"], "--cidr"),
            (&["--cidr=-net=198.18.0.0/24"], "--cidr"),
            (&["--reserve=none"], "--reserve"),
            (&["--db-synchronous=off"], "--db-synchronous"),
            (&["--max-connections=0"], "--max-connections"),
            (&["--max-connections=many"], "--max-connections"),
            (&["--idle-timeout=0"], "--idle-timeout"),
            (&["--request-timeout=soon"], "--request-timeout"),
            (&["--allowed-uid=root"], "--allowed-uid"),
            (&["--socket-group=no-such-group-metis"], "--socket-group"),
            (&["--cidr-source=cloud"], "--cidr-source"),
            (&["--metrics-addr=9153"], "--metrics-addr"),
            (&["-v=256"], "-v"),
        ];
        for (input, flag) in cases {
            match parse(input) {
                Err(FlagError::BadValue(name, _)) => assert_eq!(name, *flag, "{input:?}"),
                other => panic!("{input:?}: {other:?}"),
            }
        }
        assert_eq!(parse(&["--help"]).unwrap_err(), FlagError::Help);
        assert_eq!(
            parse(&["--nope"]).unwrap_err(),
            FlagError::Unknown("--nope".into())
        );
    }

    #[cfg(not(feature = "kube"))]
    #[test]
    fn the_edge_build_refuses_cluster_sources_as_a_usage_error() {
        assert!(parse(&["--cidr-source=static"]).is_ok());
        for source in ["node", "nnc"] {
            let err = parse(&["--cidr-source", source]).unwrap_err();
            assert!(
                matches!(&err, FlagError::BadValue("--cidr-source", why)
                    if why.contains("no Kubernetes support") || why.contains("does not have")),
                "{source}: {err:?}"
            );
        }
    }

    #[cfg(feature = "kube")]
    #[test]
    fn node_names_must_be_kubernetes_names() {
        for good in ["node-a", "a.b-c.d", "n1"] {
            assert!(crate::names::is_dns_subdomain(good), "{good}");
        }
        for bad in ["", "Node", "-a", "a-", "a..b", "a_b"] {
            assert!(!crate::names::is_dns_subdomain(bad), "{bad}");
        }
    }
}
