//! A block's gateway held by a pod. Upstream reserves the network, gateway
//! and broadcast addresses only in a network's first IPv4 block, and
//! nothing in an IPv6 block, so on a node upgraded from upstream a pod can
//! hold the address a block advertises as its gateway (`gateway` of its
//! host-local bounds, else base + 1; the second pod of an IPv6 block holds
//! `::1`). A result naming it would make the host take that pod's address
//! (bridge `isGateway` puts the gateway on the bridge, ptp on every host
//! veth). So the block keeps being served, and its results name a
//! *stand-in* instead ([`stand_in`]): an address near the top of the block
//! that no pod holds, which the results' records (`named_gateway`) keep out
//! of every hand-out while one lives. A repeated ADD returns what its owner
//! holds, with the stand-in, also when the owner is the pod on the
//! gateway. Only when no address near the top is free is the block not
//! served: the network is served from its other blocks, and when none is
//! left the ADD fails with "no available IPs" naming the block and the
//! holder. Once that pod's DEL gives the address back to the reservation,
//! results name the block's own gateway again (no restart needed).
//!
//! The rule applies where Metis's reservation keeps the gateway out of
//! allocation — `every-block` mode, and every block with host-local bounds.
//! In `first-block` mode (upstream's rule, opt-in) a later block reserves
//! nothing, its base + 1 is a pod address by that rule, and the rule does
//! not apply.

use std::net::IpAddr;

use rusqlite::{Connection, OptionalExtension, params};

use crate::cidr::{Bounds, Cidr, gateway_for};
use crate::store::db::{ReserveMode, StoreError, parse_cidr};
use crate::store::rows::block::bounds_of;
use crate::store::rows::free::Holder;

/// A pod holding the address a block advertises as its gateway (?1), in
/// any block of that network (?2): for a database without Metis's tables
/// (`admin check` of an upstream-only file).
pub(in crate::store) const HELD_GATEWAY_IN_NETWORK_SQL: &str = "SELECT a.container_id, COALESCE(a.interface_name, '') \
     FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE a.address = ?1 AND b.network = ?2 AND a.is_allocated = 1 AND a.container_id != '' \
     LIMIT 1";

/// A pod holding the address a block advertises as its gateway (?1), in
/// any block of that network (?2) or, unless it is isolated (?3), of any
/// network sharing the node's address space (an overlapping block
/// upstream added).
pub(in crate::store) const HELD_GATEWAY_SQL: &str = "SELECT a.container_id, COALESCE(a.interface_name, '') \
     FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE a.address = ?1 AND a.is_allocated = 1 AND a.container_id != '' \
       AND (b.network = ?2 OR (?3 = 0 AND b.network NOT IN \
         (SELECT network FROM metis_networks WHERE isolated = 1))) \
     LIMIT 1";

/// The host-local bounds of the configuration in force (the conflist's
/// ranges with `rangeStart`/`rangeEnd`/`gateway`), keyed by subnet:
/// the gateway a result names is its block's there, else Metis's. `None`:
/// no configuration given, the bounds recorded for each block stand in.
pub(in crate::store) type InForceBounds<'c> = Option<&'c [(Cidr, Bounds)]>;

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
    /// In words, for the log, `admin check` and the metric's help.
    pub fn describe(&self) -> String {
        format!(
            "block {} (network {:?}): its gateway {} is held by container {:?} interface {:?}; \
             results name a stand-in gateway near the top of the block until that pod is deleted",
            self.cidr, self.network, self.gateway, self.container_id, self.interface_name
        )
    }

    /// In words, when no stand-in is free either (the exhaustion error).
    pub fn describe_refused(&self) -> String {
        format!(
            "block {} (network {:?}) is not served while its gateway {} is held by container {:?} \
             interface {:?} and pods hold the {STAND_IN_REACH} addresses that could stand in",
            self.cidr, self.network, self.gateway, self.container_id, self.interface_name
        )
    }
}

/// How many addresses from the top of a block [`stand_in`] looks at.
pub(in crate::store) const STAND_IN_REACH: usize = 64;

/// The gateway results for block `cidr` name while a pod holds the one it
/// advertises (`advertised`): the highest address of the block — below an
/// IPv4 block's broadcast, above its base — that no pod holds in the
/// rule's address space. Nothing takes it meanwhile (the results' records
/// keep it out of every hand-out), so each result of the block names the
/// same one. `None`: pods hold the top [`STAND_IN_REACH`] addresses.
pub(in crate::store) fn stand_in(
    conn: &Connection,
    rule: GatewayRule,
    cidr: &Cidr,
    advertised: IpAddr,
) -> Result<Option<IpAddr>, StoreError> {
    let top = match cidr.family() {
        crate::cidr::Family::V4 => cidr.size().saturating_sub(2),
        crate::cidr::Family::V6 => cidr.size().saturating_sub(1),
    };
    for offset in (1..=top).rev().take(STAND_IN_REACH) {
        let Some(address) = cidr.nth(offset) else {
            continue;
        };
        if address != advertised && holder(conn, rule, address)?.is_none() {
            return Ok(Some(address));
        }
    }
    Ok(None)
}

/// The gateway a result for an address of block `cidr` (of `network`)
/// names under `in_force` — the conflist's explicit `gateway`, else the
/// block's computed one — where the rule applies under `mode` (`None`:
/// `first-block` mode without bounds, where base + 1 of a later block is a
/// pod address by upstream's rule).
pub(in crate::store) fn result_gateway(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    cidr: &Cidr,
    in_force: InForceBounds,
) -> Result<Option<IpAddr>, StoreError> {
    let bounds = match in_force {
        Some(list) => list
            .iter()
            .find(|(subnet, _)| subnet == cidr)
            .map(|(_, bounds)| *bounds),
        None => bounds_of(conn, network, cidr)?,
    };
    Ok(match bounds {
        Some(bounds) => Some(bounds.gateway),
        None if mode == ReserveMode::EveryBlock => Some(gateway_for(cidr)),
        None => None,
    })
}

/// What a network's gateways are judged by: the reservation mode, the
/// network, the bounds in force and where a holder is looked for.
#[derive(Clone, Copy)]
pub(in crate::store) struct GatewayRule<'c> {
    pub(in crate::store) mode: ReserveMode,
    pub(in crate::store) network: &'c str,
    pub(in crate::store) in_force: InForceBounds<'c>,
    pub(in crate::store) space: Space,
}

/// Who holds the gateway block `id` (`cidr` of the rule's network)
/// advertises under the bounds in force — the conflist's explicit
/// `gateway`, else the block's computed one — if a pod does and the rule
/// applies under its mode: a few indexed reads.
pub(in crate::store) fn held(
    conn: &Connection,
    rule: GatewayRule,
    id: i64,
    cidr: &Cidr,
) -> Result<Option<HeldGateway>, StoreError> {
    match result_gateway(conn, rule.mode, rule.network, cidr, rule.in_force)? {
        Some(gateway) => held_at(conn, rule, (id, cidr), gateway),
        None => Ok(None),
    }
}

/// Who holds `gateway`, the one block (`id`, `cidr`) advertises, if a pod
/// does.
fn held_at(
    conn: &Connection,
    rule: GatewayRule,
    (id, cidr): (i64, &Cidr),
    gateway: IpAddr,
) -> Result<Option<HeldGateway>, StoreError> {
    let holder = holder(conn, rule, gateway)?;
    Ok(holder.map(|(container_id, interface_name)| HeldGateway {
        block_id: id,
        cidr: *cidr,
        network: rule.network.to_string(),
        gateway,
        container_id,
        interface_name,
    }))
}

/// The gateway the results for a block's addresses name under a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::store) enum Names {
    /// None Metis keeps track of (`first-block` mode's later blocks).
    Nothing,
    /// The one the block advertises, as the plugin computes it.
    Advertised(IpAddr),
    /// A pod holds the advertised one: this stands in ([`stand_in`]).
    StandIn(IpAddr),
}

/// What results for block `id` (`cidr`) name under `rule`: the advertised
/// gateway, or the stand-in while a pod holds it; `Err` (the block is not
/// served) when a pod holds it and no address can stand in.
pub(in crate::store) fn naming(
    conn: &Connection,
    rule: GatewayRule,
    id: i64,
    cidr: &Cidr,
) -> Result<Result<Names, HeldGateway>, StoreError> {
    let Some(advertised) = result_gateway(conn, rule.mode, rule.network, cidr, rule.in_force)?
    else {
        return Ok(Ok(Names::Nothing));
    };
    let Some(held) = held_at(conn, rule, (id, cidr), advertised)? else {
        return Ok(Ok(Names::Advertised(advertised)));
    };
    Ok(match stand_in(conn, rule, cidr, advertised)? {
        Some(stand_in) => Ok(Names::StandIn(stand_in)),
        None => Err(held),
    })
}

/// The pod (container, interface) holding `address` in the rule's address
/// space, if any: the joins only where the cheap probe finds a pod holding
/// the address at all.
fn holder(
    conn: &Connection,
    rule: GatewayRule,
    address: IpAddr,
) -> Result<Option<(String, String)>, StoreError> {
    let text = crate::cidr::address_text(address);
    if !crate::store::rows::free::allocated_elsewhere(conn, &text, None, Holder::Pod)? {
        return Ok(None);
    }
    let row = |r: &rusqlite::Row| Ok((r.get(0)?, r.get(1)?));
    Ok(match rule.space {
        Space::Shared { isolated } => conn
            .prepare_cached(HELD_GATEWAY_SQL)?
            .query_row(params![text, rule.network, isolated], row)
            .optional()?,
        Space::NetworkOnly => conn
            .prepare_cached(HELD_GATEWAY_IN_NETWORK_SQL)?
            .query_row(params![text, rule.network], row)
            .optional()?,
    })
}

/// Where a holder of a network's gateway is looked for: the node's
/// address space as that network sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::store) enum Space {
    /// The network's own blocks, or (unless `isolated`) those of every
    /// network not isolated either.
    Shared { isolated: bool },
    /// The network's own blocks: a database without Metis's
    /// `metis_networks` (one only upstream wrote, opened read-only).
    NetworkOnly,
}

impl Space {
    /// `network`'s space as the database records it. A writable store
    /// always has `metis_networks` (the open creates it), and knows its
    /// network's space once per allocation ([`Space::Shared`] with
    /// `layout::is_isolated`); this is for the readers.
    pub(in crate::store) fn of(conn: &Connection, network: &str) -> Result<Space, StoreError> {
        let has_networks: bool = conn
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'metis_networks')",
            )?
            .query_row([], |r| r.get(0))?;
        Ok(if has_networks {
            Space::Shared {
                isolated: crate::store::layout::blocks::is_isolated(conn, network)?,
            }
        } else {
            Space::NetworkOnly
        })
    }
}

/// Candidate blocks of an allocation: (block id, prefix).
pub(in crate::store) type Blocks = Vec<(i64, Cidr)>;

/// The refusal of block `id` when a pod holds its gateway and no address
/// can stand in for it ([`stand_in`]); `None` when it is served.
pub(in crate::store) fn refused(
    conn: &Connection,
    rule: GatewayRule,
    id: i64,
    cidr: &Cidr,
) -> Result<Option<HeldGateway>, StoreError> {
    Ok(naming(conn, rule, id, cidr)?.err())
}

/// The blocks of `candidates` an allocation may be served from, and the
/// ones it may not ([`refused`]).
pub(in crate::store) fn servable(
    conn: &Connection,
    rule: GatewayRule,
    candidates: Blocks,
) -> Result<(Blocks, Vec<HeldGateway>), StoreError> {
    let mut served = Vec::with_capacity(candidates.len());
    let mut not_served = Vec::new();
    for (id, cidr) in candidates {
        match refused(conn, rule, id, &cidr)? {
            Some(gateway) => not_served.push(gateway),
            None => served.push((id, cidr)),
        }
    }
    Ok((served, not_served))
}

/// The network's Ready blocks of `family` that are not served ([`refused`]:
/// STATUS counts nothing in them, as ADD takes nothing from them).
pub(in crate::store) fn refused_in(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    family: crate::cidr::Family,
    in_force: InForceBounds,
) -> Result<Vec<HeldGateway>, StoreError> {
    let rule = GatewayRule {
        mode,
        network,
        in_force,
        space: Space::of(conn, network)?,
    };
    let mut out = Vec::new();
    for block in crate::store::rows::block::network_blocks(conn, network, family)? {
        if !block.is("Ready") {
            continue;
        }
        let cidr = block.prefix()?;
        if let Some(gateway) = refused(conn, rule, block.id, &cidr)? {
            out.push(gateway);
        }
    }
    Ok(out)
}

/// Every block Metis may serve from (Ready, or Draining: taken back on
/// exhaustion) whose gateway a pod holds (start-up log, `admin check`, the
/// metric).
pub(in crate::store) fn all_held(
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
        let rule = GatewayRule {
            mode,
            network: &network,
            in_force: None,
            space: Space::of(conn, &network)?,
        };
        if let Some(gateway) = held(conn, rule, id, &cidr)? {
            out.push(gateway);
        }
    }
    Ok(out)
}

impl crate::store::db::connection::Store {
    /// Blocks whose gateway a pod holds (not served; see `gateway`).
    pub fn held_gateways(
        &self,
    ) -> Result<Vec<crate::store::layout::gateway::HeldGateway>, StoreError> {
        crate::store::layout::gateway::all_held(&self.conn, self.reserve)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gateway_lookup_searches_an_index() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::db::schema::SCHEMA)
            .unwrap();
        conn.execute_batch(crate::store::db::schema::NETWORKS)
            .unwrap();
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {HELD_GATEWAY_SQL}"))
            .unwrap()
            .query_map(params!["198.18.0.1", "n", false], |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(
            plan.iter().all(|step| !step.starts_with("SCAN a")),
            "{plan:?}"
        );
    }
}
