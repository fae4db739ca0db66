//! The network configuration on stdin: serde structs mirroring the JSON,
//! then one pass that canonicalizes and validates them into [`NetConf`],
//! naming the key and value at fault. Unknown keys are ignored: a delegated
//! IPAM sees the main plugin's whole object.
//!
//! Codes: unreadable JSON or wrong JSON types → 6, semantically invalid → 7,
//! unsupported `cniVersion` → 1. Nothing is refused as unsupported (the
//! spec's 2): unknown keys are ignored, and a known key's bad value is 7.

use super::args::{CniArgs, parse_ip_maybe_prefix};
use super::error::CniError;
use super::version::CniVersion;
use crate::cidr::{Bounds, Cidr, Family, gateway_for};
use crate::duration::parse_duration_ms;
use crate::names;
use serde::Deserialize;
use std::net::IpAddr;
use std::path::PathBuf;

/// Where the daemon listens unless `daemonSocket` says otherwise.
pub const DEFAULT_DAEMON_SOCKET: &str = crate::defaults::DEFAULT_SOCKET_PATH;
/// The SQLite store used in direct mode unless `dbPath` says otherwise.
pub const DEFAULT_DB_PATH: &str = crate::defaults::DEFAULT_DB_PATH;
/// The plugin's log file unless `logFile` says otherwise (stdout is reserved
/// for CNI JSON).
pub const DEFAULT_LOG_FILE: &str = "/var/lib/cni/metis/metis-cni.log";
/// host-local's directory of networks unless `ipam.dataDir` says otherwise;
/// `metis import host-local` reads `<dataDir>/<name>`.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/cni/networks";
/// How long an allocation missing from GC's valid set survives: 5 minutes.
pub const DEFAULT_GC_GRACE_PERIOD_MS: i64 = 5 * 60 * 1000;

/// A route to report in the result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dst: Cidr,
    /// The configured gateway; when absent the result uses the gateway of
    /// the allocated address of the route's family.
    pub gw: Option<IpAddr>,
    /// `mtu`, `advmss`, `priority`: 1.1.0 fields; 0 is normalized to absent
    /// because Go omits a zero (`omitempty` on a plain int).
    pub mtu: Option<u32>,
    pub advmss: Option<u32>,
    pub priority: Option<u32>,
    /// `table`, `scope`: 1.1.0 fields; Go uses pointers, so 0 is kept.
    pub table: Option<u32>,
    pub scope: Option<u32>,
}

/// One entry of GC's `cni.dev/valid-attachments`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

/// The validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConf {
    /// `cniVersion`, 0.1.0 when absent or empty.
    pub cni_version: CniVersion,
    pub name: String,
    /// The top-level `type`.
    pub plugin_type: String,
    /// `ipam.type`, empty when there is no `ipam` object.
    pub ipam_type: String,
    /// True when a main plugin (e.g. bridge) delegated IPAM to Metis: the
    /// result is then the spec's abbreviated one.
    pub delegated: bool,
    /// `ipam.network` if set, else `name`: allocations are scoped by it.
    pub network: String,
    /// `ipam.isolated`: the network is a separate address space whose
    /// blocks may overlap other networks' blocks.
    pub isolated: bool,
    /// Every IPv4 subnet of `ipam.ranges`, in order.
    pub ipv4_ranges: Vec<Cidr>,
    /// Every IPv6 subnet of `ipam.ranges`, in order.
    pub ipv6_ranges: Vec<Cidr>,
    /// The subnets whose `rangeStart`/`rangeEnd`/`gateway` depart from
    /// Metis's default reservation, with host-local's canonical bounds.
    pub bounds: Vec<(Cidr, Bounds)>,
    /// `ipam.resolvConf`: a resolv.conf whose DNS settings go in the result.
    pub resolv_conf: Option<PathBuf>,
    /// `ipam.dataDir`: host-local's directory of networks.
    pub data_dir: PathBuf,
    pub routes: Vec<Route>,
    pub daemon_socket: PathBuf,
    pub db_path: PathBuf,
    pub log_file: PathBuf,
    pub log_level: Option<String>,
    /// `runtimeConfig.ips` (the `ips` capability).
    pub runtime_config_ips: Vec<IpAddr>,
    /// `args.cni.ips`; `Some` (even empty) means `CNI_ARGS` `IP` is ignored.
    pub args_ips: Option<Vec<IpAddr>>,
    pub gc_grace_period_ms: i64,
    /// `cni.dev/valid-attachments`, else the older `cni.dev/attachments`;
    /// `None` when neither was sent (cnitool: nothing is valid).
    pub valid_attachments: Option<Vec<Attachment>>,
    pub prev_result: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct RawConf {
    #[serde(rename = "cniVersion")]
    cni_version: Option<String>,
    name: Option<String>,
    #[serde(rename = "type")]
    plugin_type: Option<String>,
    ipam: Option<Object<RawIpam>>,
    #[serde(rename = "daemonSocket")]
    daemon_socket: Option<String>,
    #[serde(rename = "dbPath")]
    db_path: Option<String>,
    #[serde(rename = "logFile")]
    log_file: Option<String>,
    #[serde(rename = "runtimeConfig")]
    runtime_config: Option<RawRuntimeConfig>,
    args: Option<RawArgs>,
    #[serde(rename = "cni.dev/valid-attachments")]
    valid_attachments: Option<Vec<Attachment>>,
    #[serde(rename = "cni.dev/attachments")]
    attachments: Option<Vec<Attachment>>,
    #[serde(rename = "prevResult")]
    prev_result: Option<serde_json::Value>,
}

#[derive(Deserialize, Default)]
struct RawIpam {
    #[serde(rename = "type")]
    ipam_type: Option<String>,
    network: Option<String>,
    isolated: Option<bool>,
    ranges: Option<Vec<Vec<RawRange>>>,
    // host-local's older single-range form, directly under `ipam`.
    subnet: Option<String>,
    #[serde(rename = "rangeStart")]
    range_start: Option<String>,
    #[serde(rename = "rangeEnd")]
    range_end: Option<String>,
    gateway: Option<String>,
    routes: Option<Vec<RawRoute>>,
    #[serde(rename = "resolvConf")]
    resolv_conf: Option<String>,
    #[serde(rename = "dataDir")]
    data_dir: Option<String>,
    #[serde(rename = "daemonSocket")]
    daemon_socket: Option<String>,
    #[serde(rename = "dbPath")]
    db_path: Option<String>,
    #[serde(rename = "logFile")]
    log_file: Option<String>,
    #[serde(rename = "logLevel")]
    log_level: Option<String>,
    #[serde(rename = "gcGracePeriod")]
    gc_grace_period: Option<String>,
}

#[derive(Deserialize, Default)]
struct RawRange {
    subnet: Option<String>,
    #[serde(rename = "rangeStart")]
    range_start: Option<String>,
    #[serde(rename = "rangeEnd")]
    range_end: Option<String>,
    gateway: Option<String>,
}

#[derive(Deserialize)]
struct RawRoute {
    dst: Option<String>,
    gw: Option<String>,
    mtu: Option<u32>,
    advmss: Option<u32>,
    priority: Option<u32>,
    table: Option<u32>,
    scope: Option<u32>,
}

#[derive(Deserialize)]
struct RawRuntimeConfig {
    ips: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct RawArgs {
    cni: Option<RawArgsCni>,
}

#[derive(Deserialize)]
struct RawArgsCni {
    ips: Option<Vec<String>>,
}

/// A struct read from a JSON object only: a derived `Deserialize` also
/// takes an array of the fields in order, which no configuration is.
struct Object<T>(T);

/// The name an [`Object`]'s type error gives.
trait Named {
    const EXPECTED: &'static str;
}

impl Named for RawConf {
    const EXPECTED: &'static str = "struct RawConf";
}

impl Named for RawIpam {
    const EXPECTED: &'static str = "struct RawIpam";
}

impl<'de, T: Deserialize<'de> + Named> Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de> + Named> serde::de::Visitor<'de> for Fields<T> {
            type Value = Object<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(T::EXPECTED)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<Object<T>, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(Object)
            }
        }
        deserializer.deserialize_map(Fields(std::marker::PhantomData))
    }
}

/// Parses and validates the configuration.
pub fn parse(stdin: &[u8]) -> Result<NetConf, CniError> {
    let Object(raw): Object<RawConf> = serde_json::from_slice(stdin)
        .map_err(|e| CniError::decode(format!("failed to parse network configuration: {e}")))?;
    // libcni and host-local read a missing or empty cniVersion as 0.1.0,
    // the version before the key existed.
    let cni_version = match raw.cni_version.as_deref() {
        None | Some("") => CniVersion::LEGACY,
        Some(text) => CniVersion::parse(text)?,
    };
    let name = required(raw.name, "name")?;
    names::network(&name)
        .map_err(|err| CniError::invalid_config(format!("invalid network name {err}")))?;
    let plugin_type = raw.plugin_type.unwrap_or_default();
    // A main plugin names itself in `type` and us in `ipam.type`; when we
    // are the top-level plugin the two agree (or `ipam.type` is absent).
    let delegated = raw
        .ipam
        .as_ref()
        .and_then(|ipam| ipam.0.ipam_type.as_deref())
        .is_some_and(|ipam_type| !ipam_type.is_empty() && ipam_type != plugin_type);
    let mut ipam = raw.ipam.map(|Object(ipam)| ipam).unwrap_or_default();
    let single = RawRange {
        subnet: ipam.subnet.take(),
        range_start: ipam.range_start.take(),
        range_end: ipam.range_end.take(),
        gateway: ipam.gateway.take(),
    };
    let sets = with_single_range(ipam.ranges.take(), single);
    let (ipv4_ranges, ipv6_ranges, bounds) = parse_ranges(sets.as_deref())?;
    let network = ipam_network(ipam.network.take(), &name)?;
    let gc_grace_period_ms = gc_grace_period_ms(ipam.gc_grace_period.as_deref())?;
    Ok(NetConf {
        routes: parse_routes(ipam.routes.as_deref().unwrap_or_default())?,
        daemon_socket: path_setting(
            "daemonSocket",
            &ipam.daemon_socket,
            &raw.daemon_socket,
            DEFAULT_DAEMON_SOCKET,
        )?,
        db_path: path_setting("dbPath", &ipam.db_path, &raw.db_path, DEFAULT_DB_PATH)?,
        log_file: path_setting("logFile", &ipam.log_file, &raw.log_file, DEFAULT_LOG_FILE)?,
        resolv_conf: ipam
            .resolv_conf
            .as_ref()
            .filter(|p| !p.is_empty())
            .map(|_| path_setting("resolvConf", &ipam.resolv_conf, &None, ""))
            .transpose()?,
        data_dir: path_setting("dataDir", &ipam.data_dir, &None, DEFAULT_DATA_DIR)?,
        log_level: ipam.log_level,
        runtime_config_ips: parse_ip_strings(
            "runtimeConfig.ips",
            raw.runtime_config
                .and_then(|rc| rc.ips)
                .as_deref()
                .unwrap_or_default(),
        )?,
        args_ips: raw
            .args
            .and_then(|a| a.cni)
            .and_then(|c| c.ips)
            .map(|ips| parse_ip_strings("args.cni.ips", &ips))
            .transpose()?,
        valid_attachments: raw.valid_attachments.or(raw.attachments),
        prev_result: raw.prev_result,
        cni_version,
        name,
        plugin_type,
        ipam_type: ipam.ipam_type.unwrap_or_default(),
        delegated,
        network,
        isolated: ipam.isolated.unwrap_or(false),
        ipv4_ranges,
        ipv6_ranges,
        bounds,
        gc_grace_period_ms,
    })
}

/// `ipam.network`, the network's `name` when absent or empty.
fn ipam_network(network: Option<String>, name: &str) -> Result<String, CniError> {
    let network = network
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| name.to_string());
    names::network(&network)
        .map_err(|err| CniError::invalid_config(format!("invalid ipam.network {err}")))?;
    Ok(network)
}

fn gc_grace_period_ms(text: Option<&str>) -> Result<i64, CniError> {
    match text {
        None => Ok(DEFAULT_GC_GRACE_PERIOD_MS),
        Some(text) => parse_duration_ms(text).ok_or_else(|| {
            CniError::invalid_config(format!(
                "invalid ipam.gcGracePeriod {text:?}: expected a duration such as \"5m\" or \"1h30m\""
            ))
        }),
    }
}

fn required(value: Option<String>, key: &str) -> Result<String, CniError> {
    value
        .filter(|v| !v.is_empty())
        .ok_or_else(|| CniError::invalid_config(format!("missing required key {key:?}")))
}

fn family_name(family: Family) -> &'static str {
    match family {
        Family::V4 => "IPv4",
        Family::V6 => "IPv6",
    }
}

/// host-local's older form (`subnet`, `rangeStart`, `rangeEnd`, `gateway`
/// directly under `ipam`) is a range set of its own, before `ranges`, as
/// host-local reads it; without a `subnet` it is ignored, as there.
fn with_single_range(
    sets: Option<Vec<Vec<RawRange>>>,
    single: RawRange,
) -> Option<Vec<Vec<RawRange>>> {
    if single.subnet.as_deref().is_none_or(str::is_empty) {
        return sets;
    }
    let mut all = vec![vec![single]];
    all.extend(sets.unwrap_or_default());
    Some(all)
}

/// IPv4 subnets, IPv6 subnets, and the bounds of those that have some.
type ParsedRanges = (Vec<Cidr>, Vec<Cidr>, Vec<(Cidr, Bounds)>);

/// A parsed subnet with where it came from, for messages.
struct Placed {
    subnet: Cidr,
    bounds: Option<Bounds>,
    set: usize,
    index: usize,
}

impl Placed {
    fn key(&self) -> String {
        format!("ipam.ranges[{}][{}].subnet", self.set, self.index)
    }
}

/// Validates `ipam.ranges`: at most one range set per family (Metis gives
/// one address per family), every subnet canonical, none overlapping.
/// Absent ranges are fine here; [`NetConf::require_ranges`] enforces them
/// for the verbs that allocate.
fn parse_ranges(sets: Option<&[Vec<RawRange>]>) -> Result<ParsedRanges, CniError> {
    let Some(sets) = sets else {
        return Ok((Vec::new(), Vec::new(), Vec::new()));
    };
    if sets.is_empty() {
        return Err(CniError::invalid_config("ipam.ranges is empty"));
    }
    let mut placed = Vec::new();
    let mut set_families: Vec<(usize, Family)> = Vec::new();
    for (set, ranges) in sets.iter().enumerate() {
        let family = parse_range_set(set, ranges, &mut placed)?;
        if let Some((earlier, _)) = set_families.iter().find(|(_, f)| *f == family) {
            return Err(CniError::invalid_config(format!(
                "metis allocates one address per family; range sets {earlier} and {set} are both {}",
                family_name(family)
            )));
        }
        set_families.push((set, family));
    }
    check_overlaps(&placed)?;
    let of = |family: Family| {
        placed
            .iter()
            .filter(|p| p.subnet.family() == family)
            .map(|p| p.subnet)
            .collect()
    };
    let bounds = placed
        .iter()
        .filter_map(|p| p.bounds.map(|b| (p.subnet, b)))
        .collect();
    Ok((of(Family::V4), of(Family::V6), bounds))
}

/// Parses one range set into `placed` and returns its single family.
fn parse_range_set(
    set: usize,
    ranges: &[RawRange],
    placed: &mut Vec<Placed>,
) -> Result<Family, CniError> {
    let first = placed.len();
    for (index, range) in ranges.iter().enumerate() {
        let (subnet, bounds) = parse_range(set, index, range)?;
        placed.push(Placed {
            subnet,
            bounds,
            set,
            index,
        });
    }
    let mut families = placed.iter().skip(first).map(|p| p.subnet.family());
    let family = families.next().ok_or_else(|| {
        CniError::invalid_config(format!("ipam.ranges[{set}] is an empty range set"))
    })?;
    if families.any(|f| f != family) {
        return Err(CniError::invalid_config(format!(
            "ipam.ranges[{set}] mixes IPv4 and IPv6 subnets"
        )));
    }
    Ok(family)
}

fn parse_range(
    set: usize,
    index: usize,
    range: &RawRange,
) -> Result<(Cidr, Option<Bounds>), CniError> {
    let key = format!("ipam.ranges[{set}][{index}]");
    let text = range
        .subnet
        .as_deref()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| CniError::invalid_config(format!("{key}: missing subnet")))?;
    let subnet: Cidr = text
        .parse()
        .map_err(|e| CniError::invalid_config(format!("invalid {key}.subnet: {e}")))?;
    let ip = |field: &str, value: &Option<String>| -> Result<Option<IpAddr>, CniError> {
        match value.as_deref().filter(|v| !v.is_empty()) {
            None => Ok(None),
            Some(text) => text.parse().map(Some).map_err(|_| {
                CniError::invalid_config(format!(
                    "invalid {key}.{field} {text:?}: not an IP address"
                ))
            }),
        }
    };
    let start = ip("rangeStart", &range.range_start)?;
    let end = ip("rangeEnd", &range.range_end)?;
    let gateway = ip("gateway", &range.gateway)?;
    // Metis's own reservation already is host-local's default; a gateway
    // equal to the one Metis reports (the link-local one of a /31 too)
    // changes nothing.
    if start.is_none() && end.is_none() && gateway.is_none_or(|g| g == gateway_for(&subnet)) {
        return Ok((subnet, None));
    }
    if subnet.size() < 4 {
        return Err(CniError::invalid_config(format!(
            "invalid {key}: network {subnet} too small for rangeStart, rangeEnd or gateway"
        )));
    }
    let bounds = Bounds::new(&subnet, start, end, gateway)
        .map_err(|e| CniError::invalid_config(format!("invalid {key}: {e}")))?;
    let default = Bounds::host_local_default(&subnet);
    Ok((subnet, (bounds != default).then_some(bounds)))
}

fn check_overlaps(placed: &[Placed]) -> Result<(), CniError> {
    for (i, a) in placed.iter().enumerate() {
        if let Some(b) = placed
            .iter()
            .skip(i + 1)
            .find(|b| a.subnet.overlaps(&b.subnet))
        {
            return Err(CniError::invalid_config(format!(
                "{} {} overlaps {} {}",
                a.key(),
                a.subnet,
                b.key(),
                b.subnet
            )));
        }
    }
    Ok(())
}

fn parse_routes(raw: &[RawRoute]) -> Result<Vec<Route>, CniError> {
    raw.iter()
        .enumerate()
        .map(|(i, r)| parse_route(i, r))
        .collect()
}

fn parse_route(i: usize, raw: &RawRoute) -> Result<Route, CniError> {
    let key = format!("ipam.routes[{i}]");
    let dst_text = raw
        .dst
        .as_deref()
        .ok_or_else(|| CniError::invalid_config(format!("{key}: missing dst")))?;
    let dst: Cidr = dst_text
        .parse()
        .map_err(|e| CniError::invalid_config(format!("invalid {key}.dst: {e}")))?;
    let gw = match raw.gw.as_deref().filter(|g| !g.is_empty()) {
        None => None,
        Some(text) => Some(parse_route_gw(&key, text, &dst)?),
    };
    let nonzero = |v: Option<u32>| v.filter(|n| *n != 0);
    Ok(Route {
        dst,
        gw,
        mtu: nonzero(raw.mtu),
        advmss: nonzero(raw.advmss),
        priority: nonzero(raw.priority),
        table: raw.table,
        scope: raw.scope,
    })
}

fn parse_route_gw(key: &str, text: &str, dst: &Cidr) -> Result<IpAddr, CniError> {
    let gw: IpAddr = text.parse().map_err(|_| {
        CniError::invalid_config(format!("invalid {key}.gw {text:?}: not an IP address"))
    })?;
    if Family::of(gw) != dst.family() {
        return Err(CniError::invalid_config(format!(
            "invalid {key}.gw {text:?}: not of the same family as dst {dst}"
        )));
    }
    Ok(gw)
}

/// `ipam.<key>` wins over the top-level `<key>`; empty means unset.
fn path_setting(
    key: &str,
    ipam: &Option<String>,
    top: &Option<String>,
    default: &str,
) -> Result<PathBuf, CniError> {
    let non_empty = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    let (prefix, value) = match (non_empty(ipam), non_empty(top)) {
        (Some(v), _) => ("ipam.", v),
        (None, Some(v)) => ("", v),
        (None, None) => return Ok(PathBuf::from(default)),
    };
    let path = PathBuf::from(&value);
    if path.is_absolute() {
        Ok(path)
    } else {
        Err(CniError::invalid_config(format!(
            "invalid {prefix}{key} {value:?}: must be an absolute path"
        )))
    }
}

fn parse_ip_strings(key: &str, items: &[String]) -> Result<Vec<IpAddr>, CniError> {
    items
        .iter()
        .enumerate()
        .map(|(i, text)| {
            parse_ip_maybe_prefix(text)
                .map(|(ip, _)| ip)
                .ok_or_else(|| {
                    CniError::invalid_config(format!(
                        "invalid {key}[{i}] {text:?}: expected <ip>[/<prefix>]"
                    ))
                })
        })
        .collect()
}

impl NetConf {
    /// For ADD and STATUS, which need something to allocate from.
    pub fn require_ranges(&self) -> Result<(), CniError> {
        if self.ipv4_ranges.is_empty() && self.ipv6_ranges.is_empty() {
            Err(CniError::invalid_config(
                "no IPAM ranges specified in config",
            ))
        } else {
            Ok(())
        }
    }

    fn ranges_of(&self, family: Family) -> &[Cidr] {
        match family {
            Family::V4 => &self.ipv4_ranges,
            Family::V6 => &self.ipv6_ranges,
        }
    }

    /// The specific addresses asked for: `runtimeConfig.ips`, then
    /// `args.cni.ips` or, only when that is absent, `CNI_ARGS` `IP` (the
    /// conventions say `args` overrides `CNI_ARGS`). Duplicates are dropped;
    /// at most one per family, and only for families with a range. Whether
    /// the address is inside a block is the daemon's call.
    pub fn requested_addresses(&self, cni_args: &CniArgs) -> Result<Vec<IpAddr>, CniError> {
        let from_args = self.args_ips.as_ref().unwrap_or(&cni_args.ips);
        let mut wanted: Vec<IpAddr> = Vec::new();
        for ip in self.runtime_config_ips.iter().chain(from_args) {
            if !wanted.contains(ip) {
                wanted.push(*ip);
            }
        }
        for family in [Family::V4, Family::V6] {
            let of_family: Vec<String> = wanted
                .iter()
                .filter(|ip| Family::of(**ip) == family)
                .map(|ip| ip.to_string())
                .collect();
            if of_family.len() > 1 {
                return Err(CniError::invalid_config(format!(
                    "metis allocates one address per family; {} addresses requested: {}",
                    family_name(family),
                    of_family.join(", ")
                )));
            }
            if let Some(ip) = of_family
                .first()
                .filter(|_| self.ranges_of(family).is_empty())
            {
                return Err(CniError::invalid_config(format!(
                    "requested address {ip} is {} but no {} range is configured",
                    family_name(family),
                    family_name(family)
                )));
            }
        }
        Ok(wanted)
    }

    /// The addresses of `prevResult`: `ips[].address` (0.3.0 and later) or
    /// `ip4.ip`/`ip6.ip` (0.1.0, 0.2.0). Empty when there is no prevResult.
    pub fn prev_result_ips(&self) -> Result<Vec<IpAddr>, CniError> {
        let Some(prev) = &self.prev_result else {
            return Ok(Vec::new());
        };
        let obj = prev
            .as_object()
            .ok_or_else(|| CniError::invalid_config("invalid prevResult: not a JSON object"))?;
        let present = |key: &str| obj.get(key).filter(|v| !v.is_null());
        if let Some(ips) = present("ips") {
            let list = ips.as_array().ok_or_else(|| {
                CniError::invalid_config("invalid prevResult.ips: not a JSON array")
            })?;
            return list
                .iter()
                .enumerate()
                .map(|(i, entry)| {
                    prev_address(
                        entry.get("address"),
                        &format!("prevResult.ips[{i}].address"),
                    )
                })
                .collect();
        }
        ["ip4", "ip6"]
            .into_iter()
            .filter_map(|key| present(key).map(|v| (key, v)))
            .map(|(key, v)| prev_address(v.get("ip"), &format!("prevResult.{key}.ip")))
            .collect()
    }
}

/// A result address is `<ip>/<prefix>`.
fn prev_address(value: Option<&serde_json::Value>, key: &str) -> Result<IpAddr, CniError> {
    let text = value.and_then(|v| v.as_str());
    text.and_then(parse_ip_maybe_prefix)
        .and_then(|(ip, prefix)| prefix.map(|_| ip))
        .ok_or_else(|| {
            CniError::invalid_config(format!(
                "invalid {key} {}: expected \"<ip>/<prefix>\"",
                value.map_or_else(|| "(missing)".to_string(), |v| v.to_string())
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::error::{DECODE_FAILURE, INCOMPATIBLE_VERSION, INVALID_CONFIG};
    use crate::testutil::cidr;
    use serde_json::json;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    /// A top-level Metis config with `ipam` fields merged in.
    fn with_ipam(ipam: serde_json::Value) -> serde_json::Value {
        let mut conf = json!({
            "cniVersion": "1.0.0", "name": "metis-network", "type": "metis",
            "ipam": {"type": "metis"}
        });
        if let (Some(target), Some(extra)) = (conf["ipam"].as_object_mut(), ipam.as_object()) {
            target.extend(extra.clone());
        }
        conf
    }

    fn parse_value(value: &serde_json::Value) -> Result<NetConf, CniError> {
        parse(value.to_string().as_bytes())
    }

    fn ok(value: serde_json::Value) -> NetConf {
        parse_value(&value).unwrap_or_else(|e| panic!("{value}: {e}"))
    }

    fn err(value: serde_json::Value) -> CniError {
        match parse_value(&value) {
            Err(e) => e,
            Ok(conf) => panic!("{value} parsed: {conf:?}"),
        }
    }

    fn ranges(sets: serde_json::Value) -> serde_json::Value {
        with_ipam(json!({ "ranges": sets }))
    }

    #[test]
    fn upstream_test_config() {
        let conf = ok(json!({
            "cniVersion": "0.4.0", "name": "metis-network", "type": "metis",
            "ipam": {"type": "metis", "ranges": [[{"subnet": "198.19.0.0/24"}]],
                     "routes": [{"dst": "0.0.0.0/0"}]}
        }));
        assert_eq!(conf.cni_version, CniVersion::V0_4_0);
        assert_eq!(conf.name, "metis-network");
        assert_eq!(conf.plugin_type, "metis");
        assert_eq!(conf.ipam_type, "metis");
        assert!(!conf.delegated);
        assert_eq!(conf.network, "metis-network");
        assert_eq!(conf.ipv4_ranges, vec![cidr("198.19.0.0/24")]);
        assert!(conf.ipv6_ranges.is_empty());
        assert_eq!(
            conf.routes,
            vec![Route {
                dst: cidr("0.0.0.0/0"),
                gw: None,
                mtu: None,
                advmss: None,
                priority: None,
                table: None,
                scope: None
            }]
        );
        assert_eq!(conf.daemon_socket, PathBuf::from(DEFAULT_DAEMON_SOCKET));
        assert_eq!(conf.db_path, PathBuf::from(DEFAULT_DB_PATH));
        assert_eq!(conf.log_file, PathBuf::from(DEFAULT_LOG_FILE));
        assert_eq!(conf.log_level, None);
        assert_eq!(conf.gc_grace_period_ms, DEFAULT_GC_GRACE_PERIOD_MS);
        assert_eq!(conf.valid_attachments, None);
        assert_eq!(conf.prev_result, None);
        assert_eq!(conf.args_ips, None);
        assert!(conf.runtime_config_ips.is_empty());
        assert!(conf.require_ranges().is_ok());
    }

    #[test]
    fn delegated_dual_stack_takes_every_subnet() {
        let conf = ok(json!({
            "cniVersion": "1.1.0", "name": "k8s-pod-network", "type": "bridge", "bridge": "cni0",
            "ipam": {"type": "metis", "network": "pods",
                     "ranges": [[{"subnet": "198.19.167.0/24"}, {"subnet": "198.19.169.0/24", "gateway": "198.19.169.1"}],
                                [{"subnet": "2600:1900:4040:ae7:0:7::/112"}]],
                     "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}
        }));
        assert!(conf.delegated);
        assert_eq!(conf.network, "pods");
        assert_eq!(
            conf.ipv4_ranges,
            vec![cidr("198.19.167.0/24"), cidr("198.19.169.0/24")]
        );
        assert_eq!(conf.ipv6_ranges, vec![cidr("2600:1900:4040:ae7:0:7::/112")]);
        assert_eq!(conf.routes.len(), 2);
    }

    #[test]
    fn no_ipam_object_is_not_delegated_and_has_no_ranges() {
        let conf = ok(json!({"cniVersion": "1.1.0", "name": "n", "type": "metis"}));
        assert!(!conf.delegated);
        assert_eq!(conf.ipam_type, "");
        let e = conf.require_ranges().unwrap_err();
        assert_eq!(e.code, INVALID_CONFIG);
        assert_eq!(e.msg, "no IPAM ranges specified in config");
    }

    #[test]
    fn bad_json_is_code_6() {
        for text in [
            "",
            "{",
            "[]",
            r#"{"cniVersion": 1}"#,
            r#"{"ipam": {"ranges": {}}}"#,
            r#"{"ipam": {"routes": [{"dst": "0.0.0.0/0", "mtu": -1}]}}"#,
            r#"{"runtimeConfig": {"ips": "198.18.0.1"}}"#,
        ] {
            let e = parse(text.as_bytes()).unwrap_err();
            assert_eq!(e.code, DECODE_FAILURE, "{text}");
            assert!(
                e.msg.starts_with("failed to parse network configuration: "),
                "{}",
                e.msg
            );
        }
    }

    #[test]
    fn unknown_keys_and_nulls_are_ignored() {
        let conf = ok(json!({
            "cniVersion": "1.0.0", "name": "n", "type": "bridge", "isGateway": true,
            "ipam": {"type": "metis", "dataDir": "/x", "ranges": null, "routes": null},
            "args": {"k8s": {"x": 1}, "cni": {"labels": [{"key": "a", "value": "b"}]}},
            "runtimeConfig": {"portMappings": [{"hostPort": 80}]},
            "prevResult": null
        }));
        assert_eq!(conf.args_ips, None);
        assert_eq!(conf.prev_result, None);
    }

    #[test]
    fn missing_version_reads_as_0_1_0_and_missing_name_is_code_7() {
        for version in [json!(null), json!("")] {
            let mut value = with_ipam(json!({}));
            value["cniVersion"] = version;
            assert_eq!(ok(value).cni_version, CniVersion::LEGACY);
        }
        let e = err(json!({"cniVersion": "1.0.0"}));
        assert_eq!(
            (e.code, e.msg.as_str()),
            (INVALID_CONFIG, "missing required key \"name\"")
        );
        let e = err(json!({"cniVersion": "1.0.0", "name": ""}));
        assert_eq!(e.code, INVALID_CONFIG);
    }

    #[test]
    fn unsupported_version_is_code_1() {
        let e = err(json!({"cniVersion": "0.5.0", "name": "n"}));
        assert_eq!(e.code, INCOMPATIBLE_VERSION);
        assert!(e.msg.contains("\"0.5.0\""));
    }

    #[test]
    fn bad_name_is_code_7() {
        let e = err(json!({"cniVersion": "1.0.0", "name": "my net"}));
        assert_eq!(e.code, INVALID_CONFIG);
        assert!(
            e.msg.starts_with("invalid network name \"my net\""),
            "{}",
            e.msg
        );
    }

    #[test]
    fn subnet_with_host_bits_names_network() {
        let e = err(ranges(json!([[{"subnet": "198.19.0.1/24"}]])));
        assert_eq!(e.code, INVALID_CONFIG);
        assert_eq!(
            e.msg,
            "invalid ipam.ranges[0][0].subnet: invalid CIDR \"198.19.0.1/24\": host bits set; the network address is 198.19.0.0/24"
        );
    }

    #[test]
    fn an_ipv4_subnet_of_any_size_is_a_range() {
        // Blocks grow lazily, so size is no reason to refuse a subnet.
        let conf = ok(ranges(json!([[{"subnet": "198.18.0.0/15"}]])));
        assert_eq!(
            conf.ipv4_ranges,
            vec!["198.18.0.0/15".parse::<Cidr>().unwrap()]
        );
    }

    #[test]
    fn unparseable_or_missing_subnet() {
        let e = err(ranges(
            json!([[{"subnet": "198.19.0.0/24"}], [{"subnet": "nope"}]]),
        ));
        assert_eq!(e.code, INVALID_CONFIG);
        assert!(
            e.msg
                .starts_with("invalid ipam.ranges[1][0].subnet: invalid CIDR \"nope\""),
            "{}",
            e.msg
        );
        let e = err(ranges(json!([[{"gateway": "198.18.0.1"}]])));
        assert_eq!(
            (e.code, e.msg.as_str()),
            (INVALID_CONFIG, "ipam.ranges[0][0]: missing subnet")
        );
    }

    #[test]
    fn mixed_family_set() {
        let e = err(ranges(
            json!([[{"subnet": "198.18.0.0/24"}, {"subnet": "2001:db8::/64"}]]),
        ));
        assert_eq!(
            (e.code, e.msg.as_str()),
            (INVALID_CONFIG, "ipam.ranges[0] mixes IPv4 and IPv6 subnets")
        );
    }

    #[test]
    fn two_sets_of_one_family() {
        let e = err(ranges(json!([
            [{"subnet": "198.18.0.0/24"}], [{"subnet": "2001:db8::/64"}], [{"subnet": "198.18.100.0/24"}]
        ])));
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                INVALID_CONFIG,
                "metis allocates one address per family; range sets 0 and 2 are both IPv4"
            )
        );
    }

    #[test]
    fn overlapping_subnets_are_both_named() {
        let e = err(ranges(
            json!([[{"subnet": "198.18.0.0/16"}, {"subnet": "198.18.4.0/24"}]]),
        ));
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                INVALID_CONFIG,
                "ipam.ranges[0][0].subnet 198.18.0.0/16 overlaps ipam.ranges[0][1].subnet 198.18.4.0/24"
            )
        );
    }

    #[test]
    fn empty_ranges_or_set() {
        let e = err(ranges(json!([])));
        assert_eq!(
            (e.code, e.msg.as_str()),
            (INVALID_CONFIG, "ipam.ranges is empty")
        );
        let e = err(ranges(json!([[{"subnet": "198.18.0.0/24"}], []])));
        assert_eq!(
            (e.code, e.msg.as_str()),
            (INVALID_CONFIG, "ipam.ranges[1] is an empty range set")
        );
    }

    fn bounds(value: serde_json::Value) -> Vec<(Cidr, Bounds)> {
        ok(value).bounds
    }

    fn b(start: &str, end: &str, gateway: &str) -> Bounds {
        Bounds {
            start: ip(start),
            end: ip(end),
            gateway: ip(gateway),
        }
    }

    #[test]
    fn range_start_end_and_gateway_take_host_local_defaults() {
        let net = cidr("198.18.0.0/24");
        assert_eq!(
            bounds(ranges(
                json!([[{"subnet": "198.18.0.0/24", "rangeStart": "198.18.0.10"}]])
            )),
            vec![(net, b("198.18.0.10", "198.18.0.254", "198.18.0.1"))]
        );
        assert_eq!(
            bounds(ranges(
                json!([[{"subnet": "198.18.0.0/24", "rangeEnd": "198.18.0.20", "gateway": "198.18.0.254"}]])
            )),
            vec![(net, b("198.18.0.1", "198.18.0.20", "198.18.0.254"))]
        );
        assert_eq!(
            bounds(ranges(
                json!([[{"subnet": "2001:db8::/64", "rangeStart": "2001:db8::100"}]])
            )),
            vec![(
                cidr("2001:db8::/64"),
                b(
                    "2001:db8::100",
                    "2001:db8::ffff:ffff:ffff:ffff",
                    "2001:db8::1"
                )
            )]
        );
        // host-local's defaults spelled out, and Metis's own gateway (the
        // link-local one of a /31 too), change nothing.
        for same in [
            json!([[{"subnet": "198.18.0.0/24", "gateway": "198.18.0.1"}]]),
            json!([[{"subnet": "198.18.0.0/24", "rangeStart": "198.18.0.1", "rangeEnd": "198.18.0.254"}]]),
            json!([[{"subnet": "198.18.0.4/31", "gateway": "169.254.4.6"}]]),
        ] {
            assert!(bounds(ranges(same.clone())).is_empty(), "{same}");
        }
        // A gateway outside the subnet is advertised, as host-local does.
        assert_eq!(
            bounds(ranges(
                json!([[{"subnet": "198.18.0.0/24", "gateway": "198.19.0.1"}]])
            )),
            vec![(net, b("198.18.0.1", "198.18.0.254", "198.19.0.1"))]
        );
    }

    #[test]
    fn single_range_form_is_a_range_set_before_ranges() {
        let conf = ok(with_ipam(json!({
            "subnet": "198.18.0.0/24", "rangeStart": "198.18.0.100", "gateway": "198.18.0.254",
            "ranges": [[{"subnet": "2001:db8::/64"}]],
            "resolvConf": "/etc/resolv.conf", "dataDir": "/run/cni/networks"
        })));
        assert_eq!(conf.ipv4_ranges, vec![cidr("198.18.0.0/24")]);
        assert_eq!(conf.ipv6_ranges, vec![cidr("2001:db8::/64")]);
        assert_eq!(
            conf.bounds,
            vec![(
                cidr("198.18.0.0/24"),
                b("198.18.0.100", "198.18.0.254", "198.18.0.254")
            )]
        );
        assert_eq!(conf.resolv_conf, Some(PathBuf::from("/etc/resolv.conf")));
        assert_eq!(conf.data_dir, PathBuf::from("/run/cni/networks"));
        // Without a subnet the single-range keys are ignored, as there.
        let conf = ok(with_ipam(json!({"rangeStart": "198.18.0.100"})));
        assert!(conf.ipv4_ranges.is_empty() && conf.bounds.is_empty());
        assert_eq!(conf.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        // Two IPv4 sets (single form + ranges) is one address too many.
        let e = err(with_ipam(json!({
            "subnet": "198.18.0.0/24", "ranges": [[{"subnet": "198.18.5.0/24"}]]
        })));
        assert_eq!(
            e.msg,
            "metis allocates one address per family; range sets 0 and 1 are both IPv4"
        );
    }

    #[test]
    fn bad_bounds_are_code_7_in_host_local_words() {
        let cases = [
            (
                json!({"subnet": "198.18.0.0/24", "rangeStart": "198.18.1.20"}),
                "invalid ipam.ranges[0][0]: RangeStart 198.18.1.20 not in network 198.18.0.0/24",
            ),
            (
                json!({"subnet": "198.18.0.0/24", "rangeEnd": "2001:db8::1"}),
                "invalid ipam.ranges[0][0]: RangeEnd 2001:db8::1 not in network 198.18.0.0/24",
            ),
            (
                json!({"subnet": "198.18.0.0/24", "rangeStart": "198.18.0.20", "rangeEnd": "198.18.0.10"}),
                "invalid ipam.ranges[0][0]: RangeStart 198.18.0.20 is after RangeEnd 198.18.0.10",
            ),
            (
                json!({"subnet": "198.18.0.0/24", "gateway": "2001:db8::1"}),
                "invalid ipam.ranges[0][0]: gateway 2001:db8::1 is not of the family of 198.18.0.0/24",
            ),
            (
                json!({"subnet": "198.18.0.0/24", "gateway": "x"}),
                "invalid ipam.ranges[0][0].gateway \"x\": not an IP address",
            ),
            (
                json!({"subnet": "198.18.0.0/24", "rangeStart": "198.18.0.300"}),
                "invalid ipam.ranges[0][0].rangeStart \"198.18.0.300\": not an IP address",
            ),
            (
                json!({"subnet": "198.18.0.4/31", "rangeStart": "198.18.0.5"}),
                "invalid ipam.ranges[0][0]: network 198.18.0.4/31 too small for rangeStart, rangeEnd or gateway",
            ),
        ];
        for (range, msg) in cases {
            let e = err(ranges(json!([[range]])));
            assert_eq!((e.code, e.msg.as_str()), (INVALID_CONFIG, msg));
        }
        let e = err(with_ipam(json!({"resolvConf": "resolv.conf"})));
        assert_eq!(
            e.msg,
            "invalid ipam.resolvConf \"resolv.conf\": must be an absolute path"
        );
    }

    #[test]
    fn route_fields() {
        let conf = ok(with_ipam(json!({"routes": [
            {"dst": "198.18.0.0/15", "gw": "198.18.0.1", "mtu": 1400, "advmss": 0, "priority": 3, "table": 0, "scope": 253}
        ]})));
        assert_eq!(
            conf.routes,
            vec![Route {
                dst: cidr("198.18.0.0/15"),
                gw: Some(ip("198.18.0.1")),
                mtu: Some(1400),
                advmss: None,
                priority: Some(3),
                table: Some(0),
                scope: Some(253)
            }]
        );
    }

    #[test]
    fn bad_routes_name_the_index() {
        let cases = [
            (
                json!([{"dst": "0.0.0.0/0"}, {"dst": "198.18.0.1/15"}]),
                "invalid ipam.routes[1].dst: invalid CIDR \"198.18.0.1/15\": host bits set; the network address is 198.18.0.0/15",
            ),
            (json!([{"gw": "198.18.0.1"}]), "ipam.routes[0]: missing dst"),
            (
                json!([{"dst": "0.0.0.0/0", "gw": "bogus"}]),
                "invalid ipam.routes[0].gw \"bogus\": not an IP address",
            ),
            (
                json!([{"dst": "::/0", "gw": "198.18.0.1"}]),
                "invalid ipam.routes[0].gw \"198.18.0.1\": not of the same family as dst ::/0",
            ),
        ];
        for (routes, msg) in cases {
            let e = err(with_ipam(json!({ "routes": routes })));
            assert_eq!((e.code, e.msg.as_str()), (INVALID_CONFIG, msg));
        }
    }

    #[test]
    fn paths_ipam_wins_over_top_level() {
        let mut value = with_ipam(json!({"dbPath": "/ipam/db", "daemonSocket": ""}));
        value["dbPath"] = json!("/top/db");
        value["daemonSocket"] = json!("/top/sock");
        value["logFile"] = json!("/top/log");
        let conf = ok(value);
        assert_eq!(conf.db_path, PathBuf::from("/ipam/db"));
        assert_eq!(conf.daemon_socket, PathBuf::from("/top/sock"));
        assert_eq!(conf.log_file, PathBuf::from("/top/log"));
    }

    #[test]
    fn relative_paths_are_code_7() {
        let e = err(with_ipam(json!({"logFile": "metis.log"})));
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                INVALID_CONFIG,
                "invalid ipam.logFile \"metis.log\": must be an absolute path"
            )
        );
        let mut value = with_ipam(json!({}));
        value["daemonSocket"] = json!("run/x.sock");
        let e = err(value);
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                INVALID_CONFIG,
                "invalid daemonSocket \"run/x.sock\": must be an absolute path"
            )
        );
    }

    #[test]
    fn log_level_and_grace_period() {
        let conf = ok(with_ipam(
            json!({"logLevel": "debug", "gcGracePeriod": "1h30m"}),
        ));
        assert_eq!(conf.log_level.as_deref(), Some("debug"));
        assert_eq!(conf.gc_grace_period_ms, 90 * 60 * 1000);
        let e = err(with_ipam(json!({"gcGracePeriod": "5 minutes"})));
        assert_eq!(e.code, INVALID_CONFIG);
        assert!(
            e.msg
                .starts_with("invalid ipam.gcGracePeriod \"5 minutes\""),
            "{}",
            e.msg
        );
    }

    #[test]
    fn attachments_prefer_valid_key() {
        let mut value = with_ipam(json!({}));
        value["cni.dev/attachments"] = json!([{"containerID": "old", "ifname": "eth0"}]);
        let conf = ok(value.clone());
        assert_eq!(
            conf.valid_attachments,
            Some(vec![Attachment {
                container_id: "old".into(),
                ifname: "eth0".into()
            }])
        );
        value["cni.dev/valid-attachments"] = json!([{"containerID": "new", "ifname": "net1"}, {"containerID": "b", "ifname": "eth0"}]);
        let conf = ok(value);
        let ids: Vec<String> = conf
            .valid_attachments
            .unwrap()
            .into_iter()
            .map(|a| a.container_id)
            .collect();
        assert_eq!(ids, ["new", "b"]);
        let mut value = with_ipam(json!({}));
        value["cni.dev/valid-attachments"] = json!([]);
        assert_eq!(ok(value).valid_attachments, Some(vec![]));
    }

    #[test]
    fn requested_ips_sources() {
        let dual = json!([[{"subnet": "198.18.0.0/24"}], [{"subnet": "2001:db8::/64"}]]);
        let mut value = ranges(dual.clone());
        value["runtimeConfig"] = json!({"ips": ["198.18.0.5/24"]});
        let conf = ok(value.clone());
        let cni_args = CniArgs {
            ips: vec![ip("2001:db8::9"), ip("198.18.0.5")],
            ..CniArgs::default()
        };
        // CNI_ARGS used while args.cni.ips is absent; duplicates dropped.
        assert_eq!(
            conf.requested_addresses(&cni_args).unwrap(),
            vec![ip("198.18.0.5"), ip("2001:db8::9")]
        );
        // args.cni.ips present (even empty) → CNI_ARGS ignored.
        value["args"] = json!({"cni": {"ips": []}});
        assert_eq!(
            ok(value.clone()).requested_addresses(&cni_args).unwrap(),
            vec![ip("198.18.0.5")]
        );
        value["args"] = json!({"cni": {"ips": ["2001:db8::7/64"]}});
        let conf = ok(value);
        assert_eq!(conf.args_ips, Some(vec![ip("2001:db8::7")]));
        assert_eq!(
            conf.requested_addresses(&cni_args).unwrap(),
            vec![ip("198.18.0.5"), ip("2001:db8::7")]
        );
    }

    #[test]
    fn requested_ips_errors() {
        let mut value = ranges(json!([[{"subnet": "198.18.0.0/24"}]]));
        value["runtimeConfig"] = json!({"ips": ["198.18.0.5", "198.18.0.6"]});
        let e = ok(value.clone())
            .requested_addresses(&CniArgs::default())
            .unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                INVALID_CONFIG,
                "metis allocates one address per family; IPv4 addresses requested: 198.18.0.5, 198.18.0.6"
            )
        );
        value["runtimeConfig"] = json!({"ips": ["2001:db8::1"]});
        let e = ok(value.clone())
            .requested_addresses(&CniArgs::default())
            .unwrap_err();
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                INVALID_CONFIG,
                "requested address 2001:db8::1 is IPv6 but no IPv6 range is configured"
            )
        );
        value["runtimeConfig"] = json!({"ips": ["198.18.0.5/33"]});
        let e = err(value.clone());
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                INVALID_CONFIG,
                "invalid runtimeConfig.ips[0] \"198.18.0.5/33\": expected <ip>[/<prefix>]"
            )
        );
        value["runtimeConfig"] = json!({});
        value["args"] = json!({"cni": {"ips": ["198.18.0.5", "nope"]}});
        let e = err(value);
        assert_eq!(
            (e.code, e.msg.as_str()),
            (
                INVALID_CONFIG,
                "invalid args.cni.ips[1] \"nope\": expected <ip>[/<prefix>]"
            )
        );
    }

    #[test]
    fn prev_result_ips_v1_shape() {
        let mut value = with_ipam(json!({}));
        value["prevResult"] = json!({
            "cniVersion": "1.0.0",
            "interfaces": [{"name": "eth0", "sandbox": "/ns"}],
            "ips": [{"interface": 0, "address": "198.19.0.5/24", "gateway": "198.19.0.1"},
                    {"address": "2600:1900::5/112"}]
        });
        assert_eq!(
            ok(value).prev_result_ips().unwrap(),
            vec![ip("198.19.0.5"), ip("2600:1900::5")]
        );
    }

    #[test]
    fn prev_result_ips_v02_shape() {
        let mut value = with_ipam(json!({}));
        value["prevResult"] = json!({
            "cniVersion": "0.2.0",
            "ip4": {"ip": "198.19.0.5/24", "gateway": "198.19.0.1"},
            "ip6": {"ip": "2001:db8::5/64"}
        });
        assert_eq!(
            ok(value).prev_result_ips().unwrap(),
            vec![ip("198.19.0.5"), ip("2001:db8::5")]
        );
    }

    #[test]
    fn prev_result_absent_or_without_ips() {
        assert!(
            ok(with_ipam(json!({})))
                .prev_result_ips()
                .unwrap()
                .is_empty()
        );
        let mut value = with_ipam(json!({}));
        value["prevResult"] = json!({"cniVersion": "1.0.0", "interfaces": []});
        assert!(ok(value).prev_result_ips().unwrap().is_empty());
    }

    #[test]
    fn malformed_prev_result_is_code_7() {
        let cases = [
            (json!("x"), "invalid prevResult: not a JSON object"),
            (
                json!({"ips": {}}),
                "invalid prevResult.ips: not a JSON array",
            ),
            (
                json!({"ips": [{"address": "198.18.0.5"}]}),
                "invalid prevResult.ips[0].address \"198.18.0.5\": expected \"<ip>/<prefix>\"",
            ),
            (
                json!({"ips": [{"gateway": "198.18.0.1"}]}),
                "invalid prevResult.ips[0].address (missing): expected \"<ip>/<prefix>\"",
            ),
            (
                json!({"ip4": {"ip": 5}}),
                "invalid prevResult.ip4.ip 5: expected \"<ip>/<prefix>\"",
            ),
        ];
        for (prev, msg) in cases {
            let mut value = with_ipam(json!({}));
            value["prevResult"] = prev;
            let e = ok(value).prev_result_ips().unwrap_err();
            assert_eq!((e.code, e.msg.as_str()), (INVALID_CONFIG, msg));
        }
    }
}
