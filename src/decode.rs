//! The wire's requests as the engine's typed [`Command`]s: the one place a
//! protobuf request is read, checked as the plugin checks its own input
//! (the wire is not trusted: a client may bypass the plugin). [`to_wire`] is
//! its exact inverse, for the plugin's requests to the daemon; `encode.rs`
//! does the same for the engine's outcomes.

use std::net::IpAddr;

use crate::cidr::{Bounds, Cidr, Family};
use crate::defaults::DEFAULT_NETWORK;
use crate::engine::Failure;
use crate::engine::request::{
    Add, Check, Command, Del, FamilyAdd, Gc, Pod, StatusQuery, UsageQuery,
};
use crate::names::{self, Attachment, AttachmentError};
use crate::store::{AddressFilter, BlockFilter, BlockState, InForce};
use crate::wire::admin::v1 as admin;
use crate::wire::envelope::v1 as envelope;
use crate::wire::{Code, HealthCheckRequest, Request, ipam, reason, request};

/// The typed request a wire request asks for, or what its client is told.
pub fn decode(request: Request) -> Result<Command, Failure> {
    let Some(kind) = request.kind else {
        return Err(Failure {
            code: Code::Unimplemented,
            reason: reason::UNKNOWN_REQUEST,
            message: "request carries no known message".to_string(),
            scope: None,
            busy: false,
        });
    };
    Ok(match kind {
        request::Kind::Allocate(req) => Command::Add(Box::new(add(req)?)),
        request::Kind::Deallocate(req) => Command::Del(Del {
            network: network_or_default(&req.network)?,
            owner: owner(&req.container_id, &req.interface_name)?,
            pod: pod(req.pod_namespace, req.pod_name)?,
        }),
        request::Kind::Check(req) => Command::Check(Check {
            network: network_or_default(&req.network)?,
            owner: owner(&req.container_id, &req.interface_name)?,
        }),
        request::Kind::ListCidrBlocks(req) => Command::ListBlocks(block_filter(req)?),
        request::Kind::ListIpAddresses(req) => Command::ListAddresses(address_filter(req)?),
        request::Kind::Health(_) => Command::Health,
        request::Kind::Usage(req) => Command::Usage(UsageQuery {
            family: family(&req.ip_family)?,
            network: non_empty(req.network),
        }),
        request::Kind::Gc(req) => Command::Gc(gc(req)?),
        request::Kind::NetworkStatus(req) => Command::Status(status(req)?),
    })
}

fn add(req: ipam::AllocatePodIpRequest) -> Result<Add, Failure> {
    let network = network_or_default(&req.network)?;
    if req.ipv4_config.is_none() && req.ipv6_config.is_none() {
        return Err(Failure::invalid(
            "both ipv4_config and ipv6_config are missing",
        ));
    }
    let pod = pod(req.pod_namespace, req.pod_name)?;
    let part = |family, config: Option<ipam::IpConfig>| {
        config.map(|config| family_add(family, config)).transpose()
    };
    Ok(Add {
        ipv4: part(Family::V4, req.ipv4_config)?,
        ipv6: part(Family::V6, req.ipv6_config)?,
        network,
        pod,
        isolated: req.isolated,
        conf_name: req.conf_name,
    })
}

fn family_add(family: Family, config: ipam::IpConfig) -> Result<FamilyAdd, Failure> {
    let owner = owner(&config.container_id, &config.interface_name)?;
    let texts = std::iter::once(&config.initial_pod_cidr)
        .filter(|text| !text.is_empty())
        .chain(&config.additional_pod_cidrs);
    let mut ranges = Vec::new();
    for text in texts {
        let cidr: Cidr = text
            .parse()
            .map_err(|err| Failure::invalid(format!("initial pod CIDR: {err}")))?;
        if cidr.family() != family {
            return Err(Failure::invalid(format!(
                "initial pod CIDR {cidr} is not an {family} block"
            )));
        }
        ranges.push(cidr);
    }
    // Bounds only ever narrow a range: without ranges there is nothing to
    // narrow, and the request is served from the network as laid out.
    let bounds = match ranges.is_empty() {
        true => Vec::new(),
        false => range_bounds(family, &ranges, &config.bounds)?,
    };
    Ok(FamilyAdd {
        owner,
        ranges: InForce { ranges, bounds },
        requested: requested(family, &config.requested_ip)?,
    })
}

fn requested(family: Family, text: &str) -> Result<Option<IpAddr>, Failure> {
    if text.is_empty() {
        return Ok(None);
    }
    let address: IpAddr = text
        .parse()
        .map_err(|_| Failure::invalid(format!("requested_ip {text:?} is not an IP address")))?;
    if Family::of(address) != family {
        return Err(Failure::invalid(format!(
            "requested_ip {address} is not an {family} address"
        )));
    }
    Ok(Some(address))
}

fn gc(req: envelope::GcRequest) -> Result<Gc, Failure> {
    let network = network_or_default(&req.network)?;
    if req.grace_period_ms < 0 {
        return Err(Failure::invalid(format!(
            "grace_period_ms {} is negative",
            req.grace_period_ms
        )));
    }
    Ok(Gc {
        network,
        conf_name: req.conf_name,
        valid: req
            .valid
            .into_iter()
            .map(|a| (a.container_id, a.interface_name))
            .collect(),
        grace_ms: req.grace_period_ms,
    })
}

/// Each bound goes with the ranges of its own family.
fn status(req: envelope::NetworkStatusRequest) -> Result<StatusQuery, Failure> {
    let network = network_or_default(&req.network)?;
    let in_force = |family: Family, texts: &[String]| -> Result<InForce, Failure> {
        let ranges = texts
            .iter()
            .map(|text| text.parse::<Cidr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| Failure::invalid(format!("range: {err}")))?;
        let of_family: Vec<ipam::RangeBounds> = req
            .bounds
            .iter()
            .filter(|entry| {
                entry
                    .subnet
                    .parse::<Cidr>()
                    .map_or(true, |cidr| cidr.family() == family)
            })
            .cloned()
            .collect();
        let bounds = match ranges.is_empty() {
            true => Vec::new(),
            false => range_bounds(family, &ranges, &of_family)?,
        };
        Ok(InForce { ranges, bounds })
    };
    Ok(StatusQuery {
        ipv4: in_force(Family::V4, &req.ipv4_ranges)?,
        ipv6: in_force(Family::V6, &req.ipv6_ranges)?,
        network,
        isolated: req.isolated,
    })
}

fn block_filter(req: admin::ListCidrBlocksRequest) -> Result<BlockFilter, Failure> {
    refuse_sql_filter(&req.filter)?;
    Ok(BlockFilter {
        state: state(&req.state)?,
        family: family(&req.ip_family)?,
        network: non_empty(req.network),
    })
}

fn address_filter(req: admin::ListIpAddressesRequest) -> Result<AddressFilter, Failure> {
    refuse_sql_filter(&req.filter)?;
    Ok(AddressFilter {
        state: state(&req.state)?,
        family: family(&req.ip_family)?,
        network: non_empty(req.network),
        container_id: non_empty(req.container_id),
        allocated: req.allocated,
    })
}

/// The request's network, or the default; refused unless it meets the
/// bounds the plugin applies to `name` and `ipam.network` ([`names`]).
fn network_or_default(network: &str) -> Result<String, Failure> {
    if network.is_empty() {
        return Ok(DEFAULT_NETWORK.to_string());
    }
    names::network(network).map_err(|err| Failure::invalid(format!("invalid network {err}")))?;
    Ok(network.to_string())
}

/// The attachment a request names, refused in the wire's field names.
pub fn owner(container_id: &str, interface_name: &str) -> Result<Attachment, Failure> {
    Attachment::new(container_id, interface_name).map_err(|err| match err {
        AttachmentError::ContainerId(err) => {
            Failure::invalid(format!("invalid container_id {err}"))
        }
        AttachmentError::Interface(err) => {
            Failure::invalid(format!("invalid interface_name {err}"))
        }
    })
}

/// Pod name and namespace only label rows and messages; bounded all the same.
fn pod(namespace: String, name: String) -> Result<Pod, Failure> {
    for (field, value) in [("pod_namespace", &namespace), ("pod_name", &name)] {
        names::pod_field(value)
            .map_err(|err| Failure::invalid(format!("invalid {field} {err}")))?;
    }
    Ok(Pod { namespace, name })
}

/// Upstream's admin requests carried a raw SQL WHERE clause. Metis never
/// runs caller text as SQL; answering with the unfiltered table would look
/// like an answer to the question asked, so the request is refused.
fn refuse_sql_filter(filter: &str) -> Result<(), Failure> {
    if filter.is_empty() {
        return Ok(());
    }
    Err(Failure::invalid(
        "the raw SQL `filter` of upstream's admin API is not supported; \
         use the typed fields network, state, ip_family, container_id and allocated",
    ))
}

fn non_empty(text: String) -> Option<String> {
    (!text.is_empty()).then_some(text)
}

fn state(text: &str) -> Result<Option<BlockState>, Failure> {
    if text.is_empty() {
        return Ok(None);
    }
    BlockState::parse(text).map(Some).ok_or_else(|| {
        Failure::invalid(format!(
            "unknown block state {text:?} (Ready, Draining, Deleting or Withheld)"
        ))
    })
}

fn family(text: &str) -> Result<Option<Family>, Failure> {
    if text.is_empty() {
        return Ok(None);
    }
    Family::parse(text)
        .map(Some)
        .ok_or_else(|| Failure::invalid(format!("unknown IP family {text:?} (ipv4 or ipv6)")))
}

/// The request's host-local bounds, each checked as the plugin checks it:
/// of a range of the request, canonical.
fn range_bounds(
    family: Family,
    ranges: &[Cidr],
    wire: &[ipam::RangeBounds],
) -> Result<Vec<(Cidr, Bounds)>, Failure> {
    wire.iter()
        .map(|entry| {
            let cidr: Cidr = entry
                .subnet
                .parse()
                .map_err(|err| Failure::invalid(format!("range bounds: {err}")))?;
            if cidr.family() != family || !ranges.contains(&cidr) {
                return Err(Failure::invalid(format!(
                    "range bounds of {cidr}: not an {family} range of the request"
                )));
            }
            let ip = |text: &str| -> Result<IpAddr, Failure> {
                text.parse().map_err(|_| {
                    Failure::invalid(format!(
                        "range bounds of {cidr}: {text:?} is not an address"
                    ))
                })
            };
            let bounds = Bounds::new(
                &cidr,
                Some(ip(&entry.range_start)?),
                Some(ip(&entry.range_end)?),
                Some(ip(&entry.gateway)?),
            )
            .map_err(|err| Failure::invalid(format!("range bounds of {cidr}: {err}")))?;
            Ok((cidr, bounds))
        })
        .collect()
}

/// The wire request [`decode`] reads back as `command`.
pub fn to_wire(command: &Command) -> Request {
    let kind = match command {
        Command::Add(add) => request::Kind::Allocate(ipam::AllocatePodIpRequest {
            network: add.network.clone(),
            ipv4_config: add.ipv4.as_ref().map(ip_config),
            ipv6_config: add.ipv6.as_ref().map(ip_config),
            pod_name: add.pod.name.clone(),
            pod_namespace: add.pod.namespace.clone(),
            isolated: add.isolated,
            conf_name: add.conf_name.clone(),
        }),
        Command::Del(del) => request::Kind::Deallocate(ipam::DeallocatePodIpRequest {
            network: del.network.clone(),
            interface_name: del.owner.interface().to_string(),
            container_id: del.owner.container_id().to_string(),
            pod_name: del.pod.name.clone(),
            pod_namespace: del.pod.namespace.clone(),
        }),
        Command::Check(check) => request::Kind::Check(ipam::CheckPodIpRequest {
            network: check.network.clone(),
            interface_name: check.owner.interface().to_string(),
            container_id: check.owner.container_id().to_string(),
            ..Default::default()
        }),
        Command::ListBlocks(filter) => {
            request::Kind::ListCidrBlocks(admin::ListCidrBlocksRequest {
                filter: String::new(),
                network: filter.network.clone().unwrap_or_default(),
                state: state_text(filter.state),
                ip_family: family_text(filter.family),
            })
        }
        Command::ListAddresses(filter) => list_addresses(filter),
        Command::Health => request::Kind::Health(HealthCheckRequest {}),
        Command::Usage(query) => request::Kind::Usage(envelope::UsageRequest {
            network: query.network.clone().unwrap_or_default(),
            ip_family: family_text(query.family),
        }),
        Command::Gc(gc) => request::Kind::Gc(envelope::GcRequest {
            network: gc.network.clone(),
            valid: gc
                .valid
                .iter()
                .map(|(container_id, interface_name)| envelope::Attachment {
                    container_id: container_id.clone(),
                    interface_name: interface_name.clone(),
                })
                .collect(),
            grace_period_ms: gc.grace_ms,
            conf_name: gc.conf_name.clone(),
        }),
        Command::Status(query) => request::Kind::NetworkStatus(status_request(query)),
    };
    Request { kind: Some(kind) }
}

fn list_addresses(filter: &AddressFilter) -> request::Kind {
    request::Kind::ListIpAddresses(admin::ListIpAddressesRequest {
        filter: String::new(),
        network: filter.network.clone().unwrap_or_default(),
        state: state_text(filter.state),
        ip_family: family_text(filter.family),
        container_id: filter.container_id.clone().unwrap_or_default(),
        allocated: filter.allocated,
    })
}

fn status_request(query: &StatusQuery) -> envelope::NetworkStatusRequest {
    let texts = |in_force: &InForce| in_force.ranges.iter().map(Cidr::to_string).collect();
    envelope::NetworkStatusRequest {
        network: query.network.clone(),
        ipv4_ranges: texts(&query.ipv4),
        ipv6_ranges: texts(&query.ipv6),
        isolated: query.isolated,
        bounds: [&query.ipv4, &query.ipv6]
            .into_iter()
            .flat_map(|in_force| wire_bounds(&in_force.bounds))
            .collect(),
    }
}

fn ip_config(part: &FamilyAdd) -> ipam::IpConfig {
    let (first, rest) = match part.ranges.ranges.split_first() {
        Some((first, rest)) => (first.to_string(), rest),
        None => (String::new(), &[][..]),
    };
    ipam::IpConfig {
        interface_name: part.owner.interface().to_string(),
        container_id: part.owner.container_id().to_string(),
        initial_pod_cidr: first,
        additional_pod_cidrs: rest.iter().map(Cidr::to_string).collect(),
        requested_ip: part.requested.map(|ip| ip.to_string()).unwrap_or_default(),
        bounds: wire_bounds(&part.ranges.bounds),
    }
}

fn wire_bounds(bounds: &[(Cidr, Bounds)]) -> Vec<ipam::RangeBounds> {
    bounds
        .iter()
        .map(|(subnet, bounds)| ipam::RangeBounds {
            subnet: subnet.to_string(),
            range_start: bounds.start.to_string(),
            range_end: bounds.end.to_string(),
            gateway: bounds.gateway.to_string(),
        })
        .collect()
}

fn state_text(state: Option<BlockState>) -> String {
    state.map(|s| s.as_str().to_string()).unwrap_or_default()
}

fn family_text(family: Option<Family>) -> String {
    family.map(|f| f.as_str().to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(container: &str, cidr: &str) -> ipam::IpConfig {
        ipam::IpConfig {
            interface_name: "eth0".into(),
            container_id: container.into(),
            initial_pod_cidr: cidr.into(),
            ..Default::default()
        }
    }

    fn allocate(v4: Option<ipam::IpConfig>) -> Request {
        Request {
            kind: Some(request::Kind::Allocate(ipam::AllocatePodIpRequest {
                network: "net".into(),
                ipv4_config: v4,
                pod_name: "p".into(),
                pod_namespace: "ns".into(),
                ..Default::default()
            })),
        }
    }

    fn refused(request: Request) -> Failure {
        match decode(request) {
            Err(failure) => failure,
            Ok(command) => panic!("decoded {command:?}"),
        }
    }

    fn bounds(subnet: &str, start: &str, end: &str, gateway: &str) -> ipam::RangeBounds {
        ipam::RangeBounds {
            subnet: subnet.into(),
            range_start: start.into(),
            range_end: end.into(),
            gateway: gateway.into(),
        }
    }

    #[test]
    fn bounds_from_the_wire_are_checked() {
        let hostile = [
            ("198.18.9.0/24", "198.18.9.10", "198.18.9.20", "198.18.9.1"),
            ("2001:db8::/64", "2001:db8::1", "2001:db8::2", "2001:db8::1"),
            ("nope", "198.18.0.10", "198.18.0.20", "198.18.0.1"),
            ("198.18.0.0/24", "", "198.18.0.20", "198.18.0.1"),
            ("198.18.0.0/24", "198.18.0.30", "198.18.0.20", "198.18.0.1"),
            ("198.18.0.0/24", "198.18.1.30", "198.18.0.20", "198.18.0.1"),
            ("198.18.0.0/24", "198.18.0.10", "198.18.0.20", "2001:db8::1"),
        ];
        for (subnet, start, end, gateway) in hostile {
            let mut part = config("h", "198.18.0.0/24");
            part.bounds = vec![bounds(subnet, start, end, gateway)];
            let failure = refused(allocate(Some(part)));
            assert_eq!(
                (failure.code, failure.reason),
                (Code::InvalidArgument, reason::INVALID_REQUEST),
                "{subnet} {start} {end} {gateway}"
            );
        }
        let mut part = config("a", "198.18.0.0/24");
        part.bounds = vec![bounds(
            "198.18.0.0/24",
            "198.18.0.10",
            "198.18.0.20",
            "198.18.0.10",
        )];
        let Ok(Command::Add(add)) = decode(allocate(Some(part))) else {
            panic!("refused")
        };
        let decoded = add.ipv4.unwrap().ranges.bounds;
        assert_eq!(decoded.len(), 1);
        assert_eq!(decoded[0].1.start.to_string(), "198.18.0.10");
        assert_eq!(decoded[0].1.gateway.to_string(), "198.18.0.10");
    }

    #[test]
    fn malformed_parts_of_an_add_are_refused_with_their_field() {
        let with = |edit: &dyn Fn(&mut ipam::IpConfig)| {
            let mut part = config("c", "198.18.0.0/24");
            edit(&mut part);
            refused(allocate(Some(part))).message
        };
        type Edit = dyn Fn(&mut ipam::IpConfig);
        let cases: [(&Edit, &str); 7] = [
            (
                &|c| c.requested_ip = "not-an-ip".into(),
                "requested_ip \"not-an-ip\" is not an IP address",
            ),
            (
                &|c| c.requested_ip = "2001:db8::1".into(),
                "requested_ip 2001:db8::1 is not an ipv4 address",
            ),
            (
                &|c| c.initial_pod_cidr = "2001:db8::/64".into(),
                "initial pod CIDR 2001:db8::/64 is not an ipv4 block",
            ),
            (
                &|c| c.initial_pod_cidr = "198.18.0.1/24".into(),
                "initial pod CIDR: ",
            ),
            (
                &|c| c.container_id = String::new(),
                "invalid container_id \"\"",
            ),
            (
                &|c| c.container_id = "-x".into(),
                "invalid container_id \"-x\"",
            ),
            (
                &|c| c.interface_name = "a/b".into(),
                "invalid interface_name \"a/b\"",
            ),
        ];
        for (edit, expected) in cases {
            let message = with(edit);
            assert!(message.starts_with(expected), "{message}");
        }
        assert_eq!(
            refused(allocate(None)).message,
            "both ipv4_config and ipv6_config are missing"
        );
        let unknown = refused(Request { kind: None });
        assert_eq!(unknown.code, Code::Unimplemented);
    }

    #[test]
    fn a_dual_stack_status_takes_each_bound_with_its_own_family() {
        let request = Request {
            kind: Some(request::Kind::NetworkStatus(
                envelope::NetworkStatusRequest {
                    network: String::new(),
                    ipv4_ranges: vec!["198.18.0.0/24".into()],
                    ipv6_ranges: vec!["2001:db8::/64".into()],
                    isolated: false,
                    bounds: vec![bounds(
                        "198.18.0.0/24",
                        "198.18.0.10",
                        "198.18.0.20",
                        "198.18.0.1",
                    )],
                },
            )),
        };
        let Ok(Command::Status(query)) = decode(request) else {
            panic!("refused")
        };
        assert_eq!(query.network, DEFAULT_NETWORK);
        assert_eq!(query.ipv4.bounds.len(), 1);
        assert!(query.ipv6.bounds.is_empty());
        assert_eq!(
            decode(to_wire(&Command::Status(query.clone()))),
            Ok(Command::Status(query))
        );
    }
}
