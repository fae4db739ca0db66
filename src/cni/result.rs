//! The ADD success result, printed in the shape of the configuration's
//! `cniVersion` (libcni: "Plugin must return result in same version as
//! specified in netconf"). Key order and omitted fields follow Go's types so
//! the output matches what reference plugins print.

use super::conf::{NetConf, Route};
use super::dns::Dns;
use super::error::pretty_json;
use super::version::CniVersion;
use crate::cidr::{Cidr, Family, gateway_for};
use serde::Serialize;
use std::net::IpAddr;

/// An address the daemon handed out, with the block it came from (its prefix
/// length goes into the result, not the configured range's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatedIp {
    pub address: IpAddr,
    pub block: Cidr,
    /// The gateway to name instead of the block's advertised one, which a
    /// pod holds (the store's stand-in).
    pub gateway: Option<IpAddr>,
}

/// The result JSON for a successful ADD (4-space indent, no trailing
/// newline). Delegated IPAM returns the spec's abbreviated result (no
/// `interfaces`, no `ips[].interface`); as the top-level plugin Metis
/// reports `CNI_IFNAME` in `CNI_NETNS` as interface 0, only when there is at
/// least one address (upstream behaviour).
pub fn success(
    conf: &NetConf,
    netns: &str,
    ifname: &str,
    ips: &[AllocatedIp],
    dns: &Dns,
) -> String {
    let ips = v4_first(ips);
    let routes = result_routes(conf, &ips);
    match conf.cni_version {
        CniVersion::V0_1_0 | CniVersion::V0_2_0 => pretty_json(&legacy(conf, &ips, &routes, dns)),
        _ => {
            let interface = InterfaceOut {
                name: ifname,
                sandbox: netns,
            };
            pretty_json(&current(conf, interface, &ips, routes, dns))
        }
    }
}

/// The gateway a result names for an address: the store's stand-in while
/// a pod holds the advertised one, else the one advertised — the
/// configured one of its block (host-local's `gateway`), else Metis's.
fn gateway(conf: &NetConf, ip: &AllocatedIp) -> IpAddr {
    ip.gateway.unwrap_or_else(|| {
        conf.bounds
            .iter()
            .find(|(subnet, _)| *subnet == ip.block)
            .map_or_else(|| gateway_for(&ip.block), |(_, bounds)| bounds.gateway)
    })
}

/// IPv4 entries first, order otherwise kept.
fn v4_first(ips: &[AllocatedIp]) -> Vec<AllocatedIp> {
    let mut sorted = ips.to_vec();
    sorted.sort_by_key(|ip| Family::of(ip.address));
    sorted
}

#[derive(Serialize)]
struct ResultOut<'a> {
    #[serde(rename = "cniVersion")]
    cni_version: &'a str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    interfaces: Vec<InterfaceOut<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    ips: Vec<IpOut>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    routes: Vec<RouteOut>,
    #[serde(skip_serializing_if = "Dns::is_empty")]
    dns: &'a Dns,
}

#[derive(Serialize)]
struct InterfaceOut<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    sandbox: &'a str,
}

#[derive(Serialize)]
struct IpOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    version: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    interface: Option<u32>,
    address: String,
    gateway: String,
}

#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
struct RouteOut {
    dst: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    gw: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mtu: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    advmss: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    priority: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    table: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scope: Option<u32>,
    /// Kept for the 0.1.0/0.2.0 split by family; never printed.
    #[serde(skip)]
    family: Option<Family>,
}

/// The 0.3.0-and-later shape: 0.3.x and 0.4.0 give each address its
/// `version`, 1.x does not.
fn current<'a>(
    conf: &'a NetConf,
    interface: InterfaceOut<'a>,
    ips: &[AllocatedIp],
    routes: Vec<RouteOut>,
    dns: &'a Dns,
) -> ResultOut<'a> {
    let with_version = conf.cni_version < CniVersion::V1_0_0;
    let top_level = !conf.delegated && !ips.is_empty();
    let interfaces = match top_level {
        true => vec![interface],
        false => Vec::new(),
    };
    let ips = ips
        .iter()
        .map(|ip| IpOut {
            version: with_version.then_some(match Family::of(ip.address) {
                Family::V4 => "4",
                Family::V6 => "6",
            }),
            interface: top_level.then_some(0),
            address: address_with_prefix(ip),
            gateway: gateway(conf, ip).to_string(),
        })
        .collect();
    ResultOut {
        cni_version: conf.cni_version.as_str(),
        interfaces,
        ips,
        routes,
        dns,
    }
}

fn address_with_prefix(ip: &AllocatedIp) -> String {
    format!("{}/{}", ip.address, ip.block.prefix_len())
}

/// One route per configured route. `gw` is the configured one, else the
/// gateway of the first address of the route's family (none if that family
/// was not allocated). 1.1.0-only fields are dropped for older versions.
fn result_routes(conf: &NetConf, ips: &[AllocatedIp]) -> Vec<RouteOut> {
    let has_v11_fields = conf.cni_version >= CniVersion::V1_1_0;
    conf.routes
        .iter()
        .map(|route| route_out(conf, route, ips, has_v11_fields))
        .collect()
}

fn route_out(conf: &NetConf, route: &Route, ips: &[AllocatedIp], has_v11_fields: bool) -> RouteOut {
    let family = route.dst.family();
    let gw = route.gw.or_else(|| {
        ips.iter()
            .find(|ip| Family::of(ip.address) == family)
            .map(|ip| gateway(conf, ip))
    });
    let v11 = |field: Option<u32>| field.filter(|_| has_v11_fields);
    RouteOut {
        dst: route.dst.to_string(),
        gw: gw.map(|g| g.to_string()),
        mtu: v11(route.mtu),
        advmss: v11(route.advmss),
        priority: v11(route.priority),
        table: v11(route.table),
        scope: v11(route.scope),
        family: Some(family),
    }
}

#[derive(Serialize)]
struct LegacyOut<'a> {
    #[serde(rename = "cniVersion")]
    cni_version: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    ip4: Option<LegacyIpOut>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ip6: Option<LegacyIpOut>,
    #[serde(skip_serializing_if = "Dns::is_empty")]
    dns: &'a Dns,
}

#[derive(Serialize)]
struct LegacyIpOut {
    ip: String,
    gateway: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    routes: Vec<RouteOut>,
}

/// The 0.1.0/0.2.0 shape: only the first address of each family, with the
/// routes whose destination is of that family.
fn legacy<'a>(
    conf: &'a NetConf,
    ips: &[AllocatedIp],
    routes: &[RouteOut],
    dns: &'a Dns,
) -> LegacyOut<'a> {
    let per_family = |family: Family| {
        ips.iter()
            .find(|ip| Family::of(ip.address) == family)
            .map(|ip| LegacyIpOut {
                ip: address_with_prefix(ip),
                gateway: gateway(conf, ip).to_string(),
                routes: routes
                    .iter()
                    .filter(|r| r.family == Some(family))
                    .cloned()
                    .collect(),
            })
    };
    LegacyOut {
        cni_version: conf.cni_version.as_str(),
        ip4: per_family(Family::V4),
        ip6: per_family(Family::V6),
        dns,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::conf;
    use crate::testutil::cidr;

    fn alloc(address: &str, block: &str) -> AllocatedIp {
        AllocatedIp {
            address: address.parse().unwrap(),
            block: cidr(block),
            gateway: None,
        }
    }

    const V4: &str = "198.19.0.0/24";
    const V6: &str = "2600:1900:4040:ae7:0:7::/112";

    fn v4() -> AllocatedIp {
        alloc("198.19.0.5", V4)
    }

    fn v6() -> AllocatedIp {
        alloc("2600:1900:4040:ae7:0:7::5", V6)
    }

    /// A config at `version`; `delegated` puts Metis behind bridge.
    fn netconf(version: &str, delegated: bool) -> NetConf {
        let plugin = if delegated { "bridge" } else { "metis" };
        let text = format!(
            r#"{{"cniVersion": "{version}", "name": "net", "type": "{plugin}",
                "ipam": {{"type": "metis",
                         "ranges": [[{{"subnet": "{V4}"}}], [{{"subnet": "{V6}"}}]],
                         "routes": [{{"dst": "0.0.0.0/0"}}, {{"dst": "::/0"}}]}}}}"#
        );
        conf::parse(text.as_bytes()).unwrap()
    }

    fn out(version: &str, delegated: bool, ips: &[AllocatedIp]) -> String {
        success(
            &netconf(version, delegated),
            "/var/run/netns/x",
            "eth0",
            ips,
            &Dns::default(),
        )
    }

    #[test]
    fn v1_top_level_dual_stack() {
        let want = r#"{
    "cniVersion": "1.1.0",
    "interfaces": [
        {
            "name": "eth0",
            "sandbox": "/var/run/netns/x"
        }
    ],
    "ips": [
        {
            "interface": 0,
            "address": "198.19.0.5/24",
            "gateway": "198.19.0.1"
        },
        {
            "interface": 0,
            "address": "2600:1900:4040:ae7:0:7:0:5/112",
            "gateway": "2600:1900:4040:ae7:0:7:0:1"
        }
    ],
    "routes": [
        {
            "dst": "0.0.0.0/0",
            "gw": "198.19.0.1"
        },
        {
            "dst": "::/0",
            "gw": "2600:1900:4040:ae7:0:7:0:1"
        }
    ]
}"#;
        // Given v6 first: IPv4 is still printed first.
        assert_eq!(out("1.1.0", false, &[v6(), v4()]), want);
        assert_eq!(
            out("1.0.0", false, &[v4(), v6()]),
            want.replace("1.1.0", "1.0.0")
        );
    }

    #[test]
    fn v1_top_level_without_netns_omits_sandbox() {
        let got = success(
            &netconf("1.0.0", false),
            "",
            "eth0",
            &[v4()],
            &Dns::default(),
        );
        assert!(got.contains("\"name\": \"eth0\"\n        }"), "{got}");
        assert!(!got.contains("sandbox"));
    }

    #[test]
    fn v1_delegated_v4_is_abbreviated() {
        assert_eq!(
            out("1.0.0", true, &[v4()]),
            r#"{
    "cniVersion": "1.0.0",
    "ips": [
        {
            "address": "198.19.0.5/24",
            "gateway": "198.19.0.1"
        }
    ],
    "routes": [
        {
            "dst": "0.0.0.0/0",
            "gw": "198.19.0.1"
        },
        {
            "dst": "::/0"
        }
    ]
}"#
        );
    }

    #[test]
    fn v1_delegated_v6() {
        assert_eq!(
            out("1.1.0", true, &[v6()]),
            r#"{
    "cniVersion": "1.1.0",
    "ips": [
        {
            "address": "2600:1900:4040:ae7:0:7:0:5/112",
            "gateway": "2600:1900:4040:ae7:0:7:0:1"
        }
    ],
    "routes": [
        {
            "dst": "0.0.0.0/0"
        },
        {
            "dst": "::/0",
            "gw": "2600:1900:4040:ae7:0:7:0:1"
        }
    ]
}"#
        );
    }

    #[test]
    fn v04_top_level_v4_has_version_first() {
        let want = r#"{
    "cniVersion": "0.4.0",
    "interfaces": [
        {
            "name": "eth0",
            "sandbox": "/var/run/netns/x"
        }
    ],
    "ips": [
        {
            "version": "4",
            "interface": 0,
            "address": "198.19.0.5/24",
            "gateway": "198.19.0.1"
        }
    ],
    "routes": [
        {
            "dst": "0.0.0.0/0",
            "gw": "198.19.0.1"
        },
        {
            "dst": "::/0"
        }
    ]
}"#;
        for version in ["0.3.0", "0.3.1", "0.4.0"] {
            assert_eq!(out(version, false, &[v4()]), want.replace("0.4.0", version));
        }
    }

    #[test]
    fn v04_delegated_dual_stack() {
        assert_eq!(
            out("0.3.1", true, &[v4(), v6()]),
            r#"{
    "cniVersion": "0.3.1",
    "ips": [
        {
            "version": "4",
            "address": "198.19.0.5/24",
            "gateway": "198.19.0.1"
        },
        {
            "version": "6",
            "address": "2600:1900:4040:ae7:0:7:0:5/112",
            "gateway": "2600:1900:4040:ae7:0:7:0:1"
        }
    ],
    "routes": [
        {
            "dst": "0.0.0.0/0",
            "gw": "198.19.0.1"
        },
        {
            "dst": "::/0",
            "gw": "2600:1900:4040:ae7:0:7:0:1"
        }
    ]
}"#
        );
    }

    #[test]
    fn v04_top_level_v6() {
        assert_eq!(
            out("0.4.0", false, &[v6()]),
            r#"{
    "cniVersion": "0.4.0",
    "interfaces": [
        {
            "name": "eth0",
            "sandbox": "/var/run/netns/x"
        }
    ],
    "ips": [
        {
            "version": "6",
            "interface": 0,
            "address": "2600:1900:4040:ae7:0:7:0:5/112",
            "gateway": "2600:1900:4040:ae7:0:7:0:1"
        }
    ],
    "routes": [
        {
            "dst": "0.0.0.0/0"
        },
        {
            "dst": "::/0",
            "gw": "2600:1900:4040:ae7:0:7:0:1"
        }
    ]
}"#
        );
    }

    #[test]
    fn legacy_dual_stack_splits_routes_by_family() {
        let want = r#"{
    "cniVersion": "0.2.0",
    "ip4": {
        "ip": "198.19.0.5/24",
        "gateway": "198.19.0.1",
        "routes": [
            {
                "dst": "0.0.0.0/0",
                "gw": "198.19.0.1"
            }
        ]
    },
    "ip6": {
        "ip": "2600:1900:4040:ae7:0:7:0:5/112",
        "gateway": "2600:1900:4040:ae7:0:7:0:1",
        "routes": [
            {
                "dst": "::/0",
                "gw": "2600:1900:4040:ae7:0:7:0:1"
            }
        ]
    }
}"#;
        // Top-level or delegated: the legacy shape has no interfaces.
        assert_eq!(out("0.2.0", false, &[v4(), v6()]), want);
        assert_eq!(
            out("0.1.0", true, &[v4(), v6()]),
            want.replace("0.2.0", "0.1.0")
        );
    }

    #[test]
    fn legacy_single_family_keeps_first_address() {
        let second = alloc("198.19.1.9", "198.19.1.0/24");
        assert_eq!(
            out("0.2.0", false, &[v4(), second]),
            r#"{
    "cniVersion": "0.2.0",
    "ip4": {
        "ip": "198.19.0.5/24",
        "gateway": "198.19.0.1",
        "routes": [
            {
                "dst": "0.0.0.0/0",
                "gw": "198.19.0.1"
            }
        ]
    }
}"#
        );
        assert_eq!(
            out("0.1.0", true, &[v6()]),
            r#"{
    "cniVersion": "0.1.0",
    "ip6": {
        "ip": "2600:1900:4040:ae7:0:7:0:5/112",
        "gateway": "2600:1900:4040:ae7:0:7:0:1",
        "routes": [
            {
                "dst": "::/0",
                "gw": "2600:1900:4040:ae7:0:7:0:1"
            }
        ]
    }
}"#
        );
    }

    #[test]
    fn address_uses_block_prefix_and_small_block_gateway() {
        let got = out("1.0.0", true, &[alloc("198.19.0.7", "198.19.0.7/32")]);
        assert!(got.contains(r#""address": "198.19.0.7/32""#), "{got}");
        assert!(got.contains(r#""gateway": "169.254.4.6""#), "{got}");
        assert!(got.contains(r#""gw": "169.254.4.6""#), "{got}");
    }

    fn route_conf(version: &str) -> NetConf {
        let text = format!(
            r#"{{"cniVersion": "{version}", "name": "net", "type": "bridge",
                "ipam": {{"type": "metis", "ranges": [[{{"subnet": "{V4}"}}]],
                         "routes": [{{"dst": "198.18.0.0/15", "gw": "198.19.0.254", "mtu": 1400,
                                      "advmss": 1360, "priority": 5, "table": 0, "scope": 253}},
                                    {{"dst": "198.19.0.0/16"}}]}}}}"#
        );
        conf::parse(text.as_bytes()).unwrap()
    }

    #[test]
    fn route_gw_selection_and_v11_fields() {
        let got = success(&route_conf("1.1.0"), "", "eth0", &[v4()], &Dns::default());
        assert!(
            got.ends_with(
                r#""routes": [
        {
            "dst": "198.18.0.0/15",
            "gw": "198.19.0.254",
            "mtu": 1400,
            "advmss": 1360,
            "priority": 5,
            "table": 0,
            "scope": 253
        },
        {
            "dst": "198.19.0.0/16",
            "gw": "198.19.0.1"
        }
    ]
}"#
            ),
            "{got}"
        );
    }

    #[test]
    fn v11_route_fields_dropped_before_1_1_0() {
        for version in ["1.0.0", "0.4.0", "0.3.1"] {
            let got = success(&route_conf(version), "", "eth0", &[v4()], &Dns::default());
            assert!(
                got.ends_with(
                    r#""routes": [
        {
            "dst": "198.18.0.0/15",
            "gw": "198.19.0.254"
        },
        {
            "dst": "198.19.0.0/16",
            "gw": "198.19.0.1"
        }
    ]
}"#
                ),
                "{version}: {got}"
            );
        }
    }

    #[test]
    fn no_addresses_no_interfaces() {
        assert_eq!(
            success(
                &netconf("1.0.0", false),
                "/ns",
                "eth0",
                &[],
                &Dns::default()
            ),
            r#"{
    "cniVersion": "1.0.0",
    "routes": [
        {
            "dst": "0.0.0.0/0"
        },
        {
            "dst": "::/0"
        }
    ]
}"#
        );
    }
}
