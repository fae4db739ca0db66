//! The wire encoding of the engine's outcomes: the one place where a
//! domain result becomes a protobuf response, its status, metadata and
//! detail text. The daemon's connections and direct mode call it at the
//! edge; everything before it works on typed values.

use crate::cidr::Family;
use crate::engine::{Allocated, Health, NetworkUsage, Outcome, Readiness, Reply};
use crate::store::{Allocation, Table, TakenBack};
use crate::wire::admin::v1 as admin;
use crate::wire::envelope::v1 as envelope;
use crate::wire::envelope::v1::health_check_response::ServingStatus;
use crate::wire::ipam;
use crate::wire::{Code, HealthCheckResponse, Response, reason, response};

impl Outcome {
    /// The response a client receives: exhaustion becomes a wire status
    /// with its network and family metadata.
    pub fn into_response(self) -> Response {
        match self {
            Outcome::Done(reply) => Response::ok(reply_kind(reply)),
            Outcome::Failed(failure) => {
                Response::error(failure.code, failure.reason, failure.message)
            }
            Outcome::Exhausted {
                network,
                family,
                message,
            } => Response::error(Code::ResourceExhausted, reason::IP_POOL_EXHAUSTED, message)
                .with_metadata(reason::META_NETWORK, &network)
                .with_metadata(reason::META_IP_FAMILY, family.as_str()),
        }
    }
}

fn reply_kind(reply: Reply) -> response::Kind {
    match reply {
        Reply::Allocated(allocated) => response::Kind::Allocate(allocate_response(&allocated)),
        Reply::Released(released) => response::Kind::Deallocate(ipam::DeallocatePodIpResponse {
            released: pod_ips(&released),
        }),
        Reply::Held(held) => response::Kind::Check(ipam::CheckPodIpResponse {
            allocated: pod_ips(&held),
        }),
        Reply::Table(table) => response::Kind::Table(table_dump(table)),
        Reply::Health(health) => response::Kind::Health(health_response(&health)),
        Reply::Usage(usage) => response::Kind::Usage(envelope::UsageResponse {
            usage: usage.iter().map(network_usage).collect(),
        }),
        Reply::Collected(released) => response::Kind::Gc(envelope::GcResponse {
            released: pod_ips(&released),
        }),
        Reply::Readiness(readiness) => response::Kind::NetworkStatus(status_response(&readiness)),
    }
}

fn allocate_response(allocated: &Allocated) -> ipam::AllocatePodIpResponse {
    ipam::AllocatePodIpResponse {
        ipv4: allocated.ipv4.as_ref().map(pod_ip),
        ipv6: allocated.ipv6.as_ref().map(pod_ip),
    }
}

fn pod_ip(allocation: &Allocation) -> ipam::PodIp {
    ipam::PodIp {
        ip_address: crate::cidr::address_text(allocation.address),
        cidr: allocation.block.to_string(),
        gateway: allocation
            .gateway
            .map(crate::cidr::address_text)
            .unwrap_or_default(),
    }
}

fn pod_ips(allocations: &[Allocation]) -> Vec<ipam::PodIp> {
    allocations.iter().map(pod_ip).collect()
}

fn table_dump(table: Table) -> admin::AdminTableDumpResponse {
    admin::AdminTableDumpResponse {
        headers: table.headers,
        rows: table
            .rows
            .into_iter()
            .map(|values| admin::Row { values })
            .collect(),
    }
}

/// Serving always; the detail says what degrades it.
fn health_response(health: &Health) -> HealthCheckResponse {
    let mut detail = "Metis daemon is SERVING".to_string();
    if health.quarantined > 0 {
        detail.push_str(&format!(
            " (degraded: {} block(s) quarantined, nothing new is allocated from them; run `metis admin check`)",
            health.quarantined
        ));
    }
    if let Some(why) = &health.cluster_problem {
        detail.push_str(&format!(" (degraded: serving from local blocks; {why})"));
    }
    if !health.not_granted.is_empty() {
        detail.push_str(&format!(
            " (degraded: {})",
            not_granted(&health.not_granted)
        ));
    }
    HealthCheckResponse {
        status: ServingStatus::Serving as i32,
        detail,
    }
}

/// Blocks the cluster no longer grants that pods still hold, in words.
fn not_granted(blocks: &[TakenBack]) -> String {
    let holding: Vec<String> = blocks
        .iter()
        .map(|b| format!("{} of network {:?}: {} pod(s)", b.cidr, b.network, b.pods))
        .collect();
    format!(
        "{} block(s) the cluster no longer grants still hold pods ({}); nothing new is allocated from them, and each is deleted when its last pod is",
        holding.len(),
        holding.join(", ")
    )
}

fn status_response(readiness: &Readiness) -> envelope::NetworkStatusResponse {
    match readiness {
        Readiness::Ready => envelope::NetworkStatusResponse {
            can_allocate: true,
            detail: String::new(),
            ip_family: String::new(),
        },
        Readiness::Full {
            network,
            family,
            blocked,
            cluster_problem,
        } => envelope::NetworkStatusResponse {
            can_allocate: false,
            detail: full_detail(network, *family, blocked, cluster_problem.as_deref()),
            ip_family: family.as_str().to_string(),
        },
    }
}

fn full_detail(
    network: &str,
    family: Family,
    blocked: &[String],
    cluster_problem: Option<&str>,
) -> String {
    let mut detail = format!(
        "no free {family} address in network {network:?}: every block is full or cooling down and every configured range is already added"
    );
    if !blocked.is_empty() {
        detail.push_str(&format!("; not served: {}", blocked.join("; ")));
    }
    if let Some(why) = cluster_problem {
        detail.push_str(&format!(
            "; more cannot be requested: the API server is unreachable or refuses us ({why})"
        ));
    }
    detail
}

fn network_usage(entry: &NetworkUsage) -> envelope::NetworkUsage {
    let counts = &entry.usage;
    envelope::NetworkUsage {
        network: entry.network.clone(),
        ip_family: entry.family.as_str().to_string(),
        total: counts.total,
        allocated: counts.allocated,
        cooldown: counts.cooldown,
        draining: counts.draining,
        reserved: counts.reserved,
        total_exact: counts.addresses.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(reply: Reply) -> Option<response::Kind> {
        Outcome::Done(reply).into_response().kind
    }

    #[test]
    fn health_detail_names_every_degradation() {
        let Some(response::Kind::Health(health)) = encoded(Reply::Health(Health {
            quarantined: 2,
            cluster_problem: Some("watch: refused".into()),
            not_granted: vec![TakenBack {
                id: 7,
                network: "default".into(),
                cidr: "198.19.0.0/28".into(),
                source: "nnc".into(),
                since_ms: 1,
                pods: 3,
                cooled_at_ms: None,
            }],
        })) else {
            panic!("not a health reply")
        };
        assert_eq!(health.status, ServingStatus::Serving as i32);
        assert_eq!(
            health.detail,
            "Metis daemon is SERVING (degraded: 2 block(s) quarantined, nothing new is allocated \
             from them; run `metis admin check`) (degraded: serving from local blocks; watch: refused) \
             (degraded: 1 block(s) the cluster no longer grants still hold pods (198.19.0.0/28 of \
             network \"default\": 3 pod(s)); nothing new is allocated from them, and each is deleted \
             when its last pod is)"
        );
    }

    #[test]
    fn a_full_network_says_why_the_cluster_cannot_help() {
        let full = |cluster_problem: Option<&str>| Readiness::Full {
            network: "net".into(),
            family: Family::V4,
            blocked: Vec::new(),
            cluster_problem: cluster_problem.map(str::to_string),
        };
        let Some(response::Kind::NetworkStatus(alone)) = encoded(Reply::Readiness(full(None)))
        else {
            panic!("not a status reply")
        };
        assert!(!alone.can_allocate);
        assert_eq!(alone.ip_family, "ipv4");
        assert!(
            alone
                .detail
                .starts_with("no free ipv4 address in network \"net\""),
            "{}",
            alone.detail
        );
        let Some(response::Kind::NetworkStatus(cut_off)) =
            encoded(Reply::Readiness(full(Some("patch: 403"))))
        else {
            panic!("not a status reply")
        };
        assert_eq!(
            cut_off.detail,
            format!(
                "{}; more cannot be requested: the API server is unreachable or refuses us (patch: 403)",
                alone.detail
            )
        );
        let Some(response::Kind::NetworkStatus(ready)) =
            encoded(Reply::Readiness(Readiness::Ready))
        else {
            panic!("not a status reply")
        };
        assert!(ready.can_allocate && ready.detail.is_empty() && ready.ip_family.is_empty());
    }
}
