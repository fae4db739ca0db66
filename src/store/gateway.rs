//! A block's gateway held by a pod. Upstream reserves the network, gateway
//! and broadcast addresses only in a network's first IPv4 block, so on a
//! node upgraded from upstream a pod can hold the address a later block
//! advertises as its gateway (`gateway` of its host-local bounds, else
//! base + 1). A result naming it would make the host (bridge `isGateway`)
//! take that pod's address. So an allocation is never served from such a
//! block: the network is served from its other blocks, and when none is
//! left the ADD fails with "no available IPs" naming the block and the
//! holder. Once that pod's DEL gives the address back to the reservation,
//! the block is served again (no restart needed).
//!
//! The rule applies where Metis's reservation keeps the gateway out of
//! allocation — `every-block` mode, and every block with host-local bounds.
//! In `first-block` mode (upstream's rule, opt-in) a later block reserves
//! nothing, its base + 1 is a pod address by that rule, and the rule does
//! not apply.

use std::net::IpAddr;

use rusqlite::{Connection, OptionalExtension, params};

use super::block::bounds_of;
use super::{ReserveMode, StoreError, parse_cidr};
use crate::cidr::{Cidr, gateway_for};

/// A pod holding the address a block advertises as its gateway, in any
/// block of that network.
pub(super) const HELD_GATEWAY_SQL: &str = "SELECT a.container_id, COALESCE(a.interface_name, '') \
     FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE a.address = ?1 AND b.network = ?2 AND a.is_allocated = 1 AND a.container_id != '' \
     LIMIT 1";

/// A block whose gateway a pod holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldGateway {
    pub block_id: i64,
    pub cidr: Cidr,
    pub network: String,
    pub gateway: IpAddr,
    pub container_id: String,
    pub interface_name: String,
}

impl HeldGateway {
    /// In words, for the log, `admin check` and the exhaustion error.
    pub fn describe(&self) -> String {
        format!(
            "block {} (network {:?}) is not served while its gateway {} is held by container {:?} interface {:?}",
            self.cidr, self.network, self.gateway, self.container_id, self.interface_name
        )
    }
}

/// Who holds the gateway block `id` (`cidr` of `network`) advertises, if
/// a pod does and the rule applies under `mode`: two indexed reads.
pub(super) fn held(
    conn: &Connection,
    mode: ReserveMode,
    id: i64,
    network: &str,
    cidr: &Cidr,
) -> Result<Option<HeldGateway>, StoreError> {
    let gateway = match bounds_of(conn, network, cidr)? {
        Some(bounds) => bounds.gateway,
        None if mode == ReserveMode::EveryBlock => gateway_for(cidr),
        None => return Ok(None),
    };
    let holder: Option<(String, String)> = conn
        .prepare_cached(HELD_GATEWAY_SQL)?
        .query_row(params![gateway.to_string(), network], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?;
    Ok(holder.map(|(container_id, interface_name)| HeldGateway {
        block_id: id,
        cidr: *cidr,
        network: network.to_string(),
        gateway,
        container_id,
        interface_name,
    }))
}

/// Candidate blocks of an allocation: (block id, prefix).
pub(super) type Blocks = Vec<(i64, Cidr)>;

/// The blocks of `candidates` an allocation may be served from, and the
/// ones it may not (their gateway is a pod's address).
pub(super) fn servable(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    candidates: Blocks,
) -> Result<(Blocks, Vec<HeldGateway>), StoreError> {
    let mut served = Vec::with_capacity(candidates.len());
    let mut refused = Vec::new();
    for (id, cidr) in candidates {
        match held(conn, mode, id, network, &cidr)? {
            Some(gateway) => refused.push(gateway),
            None => served.push((id, cidr)),
        }
    }
    Ok((served, refused))
}

/// The network's Ready blocks of `family` whose gateway a pod holds (STATUS
/// counts nothing in them, as ADD takes nothing from them).
pub(super) fn held_in(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    family: crate::cidr::Family,
) -> Result<Vec<HeldGateway>, StoreError> {
    let blocks: Vec<(i64, String)> = conn
        .prepare_cached(
            "SELECT id, cidr FROM cidr_blocks WHERE network = ?1 AND ip_family = ?2 \
             AND state = 'Ready' ORDER BY id",
        )?
        .query_map(params![network, family.as_str()], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for (id, cidr) in blocks {
        if let Some(gateway) = held(conn, mode, id, network, &parse_cidr(&cidr)?)? {
            out.push(gateway);
        }
    }
    Ok(out)
}

/// Every block Metis may serve from (Ready, or Draining: taken back on
/// exhaustion) whose gateway a pod holds (start-up log, `admin check`, the
/// metric).
pub(super) fn all_held(
    conn: &Connection,
    mode: ReserveMode,
) -> Result<Vec<HeldGateway>, StoreError> {
    let blocks: Vec<(i64, String, String)> = conn
        .prepare_cached(
            "SELECT id, cidr, network FROM cidr_blocks WHERE state IN ('Ready', 'Draining') ORDER BY id",
        )?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for (id, cidr, network) in blocks {
        // An unreadable block is `admin check`'s to report.
        let Ok(cidr) = parse_cidr(&cidr) else {
            continue;
        };
        if let Some(gateway) = held(conn, mode, id, &network, &cidr)? {
            out.push(gateway);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateway_lookup_searches_an_index() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(super::super::schema::SCHEMA).unwrap();
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {HELD_GATEWAY_SQL}"))
            .unwrap()
            .query_map(params!["198.18.0.1", "n"], |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(
            plan.iter().all(|step| !step.starts_with("SCAN a")),
            "{plan:?}"
        );
    }
}
