//! Allocating, releasing and checking addresses.

use std::net::IpAddr;

use rusqlite::{Connection, OptionalExtension, params};

use super::block::{
    GROWTH_BATCH, HeldRow, Reserved, block_reserved, frontier, give_back, insert_rows,
    is_quarantined, quarantined_in, set_frontier,
};
use super::free::{HAS_FREE_SQL, RowView, Taken, availability, free_now};
use super::{
    Allocation, BlockState, Owner, ReserveMode, Store, StoreError, Unavailable, parse_addr,
    parse_cidr, parse_state, validate_owner,
};
use crate::cidr::{Cidr, Family};

/// Bound on expand-then-claim rounds per block within one allocation.
const MAX_EXPANSIONS_PER_BLOCK: usize = 4;

/// Allocated rows of an owner in blocks of `network` (optionally one
/// family), IPv4 first.
fn held(
    conn: &Connection,
    network: &str,
    container_id: &str,
    interface_name: &str,
    family: Option<Family>,
) -> Result<Vec<HeldRow>, StoreError> {
    let mut stmt = conn.prepare_cached(HELD_SQL)?;
    let mut rows = stmt.query(params![
        container_id,
        interface_name,
        network,
        family.map(Family::as_str)
    ])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let address: String = row.get(1)?;
        let cidr: String = row.get(3)?;
        out.push(HeldRow {
            row_id: row.get(0)?,
            block_id: row.get(2)?,
            allocation: Allocation {
                address: parse_addr(&address)?,
                block: parse_cidr(&cidr)?,
            },
        });
    }
    Ok(out)
}

/// What a DEL released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    pub addresses: Vec<Allocation>,
    /// The networks other than the one asked that held them (renamed under
    /// the pod); empty when the network asked held them.
    pub elsewhere: Vec<String>,
}

/// Where a release looks for the owner's addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// The named network only.
    Network,
    /// The named network, or every network when it holds nothing.
    OrAnyNetworkWhenNone,
}

/// Allocated rows of owner (container, interface) in every network:
/// (network, row), network order.
fn held_in_any_network(
    conn: &Connection,
    container_id: &str,
    interface_name: &str,
) -> Result<Vec<(String, HeldRow)>, StoreError> {
    let mut stmt = conn.prepare_cached(HELD_ANYWHERE_SQL)?;
    let mut rows = stmt.query(params![container_id, interface_name])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push((
            row.get(4)?,
            HeldRow {
                row_id: row.get(0)?,
                block_id: row.get(2)?,
                allocation: Allocation {
                    address: parse_addr(&row.get::<_, String>(1)?)?,
                    block: parse_cidr(&row.get::<_, String>(3)?)?,
                },
            },
        ));
    }
    Ok(out)
}

/// The address `owner` already holds in its network for `family`, if any
/// (the idempotency check of both allocation paths).
fn held_by_owner(
    conn: &Connection,
    owner: &Owner,
    family: Family,
) -> Result<Option<Allocation>, StoreError> {
    Ok(held(
        conn,
        owner.network,
        owner.container_id,
        owner.interface_name,
        Some(family),
    )?
    .into_iter()
    .next()
    .map(|row| row.allocation))
}

/// Marks row `row_id` (holding `address`) of block `block_id` allocated to
/// `owner` and returns true; or, when host-local's co-written directory
/// records another owner for the address, to that owner, returning false.
fn take_row(
    conn: &Connection,
    row_id: i64,
    block_id: i64,
    address: IpAddr,
    owner: &Owner,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let host_local = super::co_writer::before_take(
        conn,
        owner.network,
        address,
        owner.container_id,
        owner.interface_name,
    )?;
    let (container_id, interface_name, pod_name, pod_namespace) = match &host_local {
        None => (
            owner.container_id,
            owner.interface_name,
            owner.pod_name,
            owner.pod_namespace,
        ),
        Some(held) => (held.container_id.as_str(), held.ifname.as_str(), "", ""),
    };
    conn.prepare_cached(TAKE_ROW_SQL)?.execute(params![
        row_id,
        container_id,
        interface_name,
        pod_name,
        pod_namespace,
        now_ms
    ])?;
    conn.prepare_cached(COUNT_TAKEN_SQL)?.execute([block_id])?;
    Ok(host_local.is_none())
}

/// Allocated rows of owner (?1 container, ?2 interface) in network ?3,
/// of family ?4 (NULL: any).
/// [`HELD_SQL`] in every network, with the network.
const HELD_ANYWHERE_SQL: &str = "SELECT a.id, a.address, b.id, b.cidr, b.network FROM ip_addresses a \
     JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE a.container_id = ?1 AND a.interface_name = ?2 AND a.is_allocated = 1 \
     ORDER BY b.network, b.ip_family, a.id";

const HELD_SQL: &str = "SELECT a.id, a.address, b.id, b.cidr FROM ip_addresses a \
     JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE a.container_id = ?1 AND a.interface_name = ?2 AND a.is_allocated = 1 \
       AND b.network = ?3 AND (?4 IS NULL OR b.ip_family = ?4) \
     ORDER BY b.ip_family, a.id";

/// Ready, unquarantined blocks of network ?1 and family ?2 with room,
/// oldest first.
const CANDIDATES_SQL: &str = "SELECT id, cidr FROM cidr_blocks \
     WHERE network = ?1 AND ip_family = ?2 AND state = 'Ready' AND total_ips > allocated_ips \
       AND id NOT IN (SELECT block_id FROM metis_blocks WHERE quarantine IS NOT NULL) \
     ORDER BY id";

const FIND_BLOCK_SQL: &str = "SELECT id FROM cidr_blocks WHERE cidr = ?1 AND network = ?2";

/// An unknown pod name or namespace is stored as NULL, as upstream does.
const TAKE_ROW_SQL: &str = "UPDATE ip_addresses SET is_allocated = 1, container_id = ?2, interface_name = ?3, \
     pod_name = NULLIF(?4, ''), pod_namespace = NULLIF(?5, ''), allocated_at = ?6, release_at = NULL \
     WHERE id = ?1";

const COUNT_TAKEN_SQL: &str =
    "UPDATE cidr_blocks SET allocated_ips = COALESCE(allocated_ips, 0) + 1 WHERE id = ?1";

/// Every statement that runs for each allocation, release or check, for
/// the query-plan test: none may scan `ip_addresses`, which holds every
/// populated address of every block. (Growth continues from a frontier
/// recorded per block, so it scans nothing either.)
#[cfg(test)]
pub(super) const ALLOCATION_PATH: [&str; 9] = [
    HELD_SQL,
    CANDIDATES_SQL,
    FIND_BLOCK_SQL,
    CLAIM_SQL,
    TAKE_ROW_SQL,
    COUNT_TAKEN_SQL,
    super::block::RELEASE_ROW_SQL,
    super::block::COUNT_RELEASED_SQL,
    super::block::RETURN_RESERVED_SQL,
];

/// The lowest-id free, non-cooling row of block ?1 at time ?2.
pub(super) const CLAIM_SQL: &str = concat!(
    "SELECT id, address FROM ip_addresses WHERE cidr_block_id = ?1 AND ",
    free_now!("", "?2"),
    " ORDER BY id LIMIT 1"
);

/// Claims the lowest-id free, non-cooling row of a block (passing over
/// those host-local turns out to hold: each is recorded for its holder).
fn claim(
    conn: &Connection,
    block_id: i64,
    cidr: &Cidr,
    owner: &Owner,
    now_ms: i64,
) -> Result<Option<IpAddr>, StoreError> {
    loop {
        let row: Option<(i64, String)> = conn
            .prepare_cached(CLAIM_SQL)?
            .query_row(params![block_id, now_ms], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        let Some((row_id, text)) = row else {
            return Ok(None);
        };
        let address = parse_addr(&text)?;
        if !cidr.contains(address) {
            return Err(StoreError::Corrupt(format!(
                "free row {text:?} of block {block_id} lies outside {cidr}"
            )));
        }
        if take_row(conn, row_id, block_id, address, owner, now_ms)? {
            return Ok(Some(address));
        }
    }
}

/// Populates the next batch of a block from its frontier. Returns rows
/// inserted (0: has a free usable row already, or populated to its end).
fn expand(
    conn: &Connection,
    mode: ReserveMode,
    block_id: i64,
    network: &str,
    cidr: &Cidr,
    now_ms: i64,
) -> Result<u64, StoreError> {
    let has_free: bool = conn
        .prepare_cached(HAS_FREE_SQL)?
        .query_row(params![block_id, now_ms], |r| r.get(0))?;
    if has_free {
        return Ok(0);
    }
    let mut start = frontier(conn, block_id, cidr)?;
    let reserved = block_reserved(conn, mode, block_id, network, cidr)?;
    // Only the usable range is populated (host-local bounds): the rest of
    // the block is reserved by description, never row by row.
    let usable = reserved.usable(cidr.size());
    start = start.max(usable.start);
    // Batches already populated by someone else (or rows moved in when
    // the block grew) insert nothing: move on until one adds a row or the
    // range ends. Each row is passed over once: the frontier is recorded.
    while start < usable.end {
        let end = start.saturating_add(GROWTH_BATCH).min(usable.end);
        let inserted = insert_rows(conn, block_id, cidr, start..end, &reserved)?;
        set_frontier(conn, block_id, end)?;
        if inserted > 0 {
            return Ok(inserted);
        }
        start = end;
    }
    Ok(0)
}

impl Store {
    /// The id of the block (cidr, network), if any.
    pub fn find_block(&self, network: &str, cidr: &Cidr) -> Result<Option<i64>, StoreError> {
        find_block(&self.conn, network, &cidr.to_string())
    }

    /// Allocates an address of `family` in `network` to `owner`; repeating
    /// the call returns the address already held.
    pub fn allocate(
        &mut self,
        owner: &Owner,
        family: Family,
        now_ms: i64,
    ) -> Result<Allocation, StoreError> {
        validate_owner(owner.container_id, owner.interface_name)?;
        let mode = self.reserve;
        let tx = super::write(&mut self.conn, self.batch)?;
        if let Some(existing) = held_by_owner(&tx, owner, family)? {
            return Ok(existing);
        }
        let candidates = candidates(&tx, owner.network, family)?;
        let (candidates, held_gateways) =
            super::gateway::servable(&tx, mode, owner.network, candidates)?;
        for (id, cidr) in &candidates {
            if let Some(address) = claim(&tx, *id, cidr, owner, now_ms)? {
                tx.commit()?;
                return Ok(Allocation {
                    address,
                    block: *cidr,
                });
            }
        }
        for (id, cidr) in &candidates {
            for _ in 0..MAX_EXPANSIONS_PER_BLOCK {
                if expand(&tx, mode, *id, owner.network, cidr, now_ms)? == 0 {
                    break;
                }
                if let Some(address) = claim(&tx, *id, cidr, owner, now_ms)? {
                    tx.commit()?;
                    return Ok(Allocation {
                        address,
                        block: *cidr,
                    });
                }
            }
        }
        let quarantined = quarantined_in(&tx, owner.network, family)?;
        // Keep any rows populated on the way; they are valid.
        tx.commit()?;
        Err(StoreError::NoAvailableIps {
            network: owner.network.to_string(),
            family,
            quarantined,
            held_gateways: held_gateways.iter().map(|g| g.describe()).collect(),
        })
    }

    /// Allocates exactly `address` to `owner` (static IP request).
    pub fn allocate_requested(
        &mut self,
        owner: &Owner,
        address: IpAddr,
        now_ms: i64,
    ) -> Result<Allocation, StoreError> {
        validate_owner(owner.container_id, owner.interface_name)?;
        let mode = self.reserve;
        let tx = super::write(&mut self.conn, self.batch)?;
        if let Some(existing) = held_by_owner(&tx, owner, Family::of(address))? {
            return already_held(owner, existing, address);
        }
        let (block_id, cidr) = ready_block_containing(&tx, owner.network, address)?;
        let offset = cidr.offset_of(address).unwrap_or(0);
        if block_reserved(&tx, mode, block_id, owner.network, &cidr)?.contains(&offset) {
            return Err(unavailable(
                address,
                Unavailable::ReservedPosition { block: cidr },
            ));
        }
        if is_quarantined(&tx, block_id)? {
            return Err(unavailable(
                address,
                Unavailable::Quarantined { block: cidr },
            ));
        }
        let (row_id, row) = requested_row(&tx, block_id, &cidr, address, offset)?;
        ensure_free(&row, owner, &cidr, address, now_ms)?;
        if !take_row(&tx, row_id, block_id, address, owner, now_ms)? {
            return Err(unavailable(address, Unavailable::HeldByHostLocal));
        }
        tx.commit()?;
        Ok(Allocation {
            address,
            block: cidr,
        })
    }

    /// DEL: releases every address the owner holds in `network` (all
    /// families, any block state). Addresses rest for the store's release
    /// cooldown; the last owner stays recorded. A pod that held a reserved
    /// position gives it back to the reservation. When `network` holds
    /// nothing for the owner, what other networks hold for
    /// exactly (`container_id`, `interface_name`) is released instead — the
    /// allocation of a network renamed under its pod (`ipam.network`
    /// changed), which no DEL under the new name could reach otherwise. An
    /// interface of a container has one IPAM configuration, so that key is
    /// the same attachment. Returns the addresses and the networks they were
    /// released from when not `network`.
    pub fn release(
        &mut self,
        network: &str,
        container_id: &str,
        interface_name: &str,
        now_ms: i64,
    ) -> Result<Released, StoreError> {
        let release_at = self.release_at(now_ms);
        let rows = self.give_back_owner(
            network,
            container_id,
            interface_name,
            None,
            release_at,
            Reach::OrAnyNetworkWhenNone,
        )?;
        let mut elsewhere: Vec<String> = rows
            .iter()
            .filter(|(held_in, _)| held_in != network)
            .map(|(held_in, _)| held_in.clone())
            .collect();
        elsewhere.dedup();
        Ok(Released {
            addresses: rows.into_iter().map(|(_, allocation)| allocation).collect(),
            elsewhere,
        })
    }

    /// Like [`Store::release`] of `network` alone for one family, but the
    /// address is free at once:
    /// for an allocation undone before it reached a pod.
    pub fn roll_back(
        &mut self,
        network: &str,
        container_id: &str,
        interface_name: &str,
        family: Family,
    ) -> Result<Vec<Allocation>, StoreError> {
        let rows = self.give_back_owner(
            network,
            container_id,
            interface_name,
            Some(family),
            None,
            Reach::Network,
        )?;
        Ok(rows.into_iter().map(|(_, allocation)| allocation).collect())
    }

    /// Releases what the owner holds, inside one write transaction; every
    /// release passes host-local's co-writer first. Returns each address
    /// with the network it was released from.
    fn give_back_owner(
        &mut self,
        network: &str,
        container_id: &str,
        interface_name: &str,
        family: Option<Family>,
        release_at: Option<i64>,
        reach: Reach,
    ) -> Result<Vec<(String, Allocation)>, StoreError> {
        validate_owner(container_id, interface_name)?;
        let mode = self.reserve;
        let tx = super::write(&mut self.conn, self.batch)?;
        super::co_writer::before_release(&tx, network, container_id, interface_name, family)?;
        let mut rows: Vec<(String, HeldRow)> =
            held(&tx, network, container_id, interface_name, family)?
                .into_iter()
                .map(|row| (network.to_string(), row))
                .collect();
        if rows.is_empty() && reach == Reach::OrAnyNetworkWhenNone {
            rows = held_in_any_network(&tx, container_id, interface_name)?;
        }
        for (held_in, row) in &rows {
            give_back(&tx, mode, held_in, row, release_at)?;
        }
        tx.commit()?;
        Ok(rows
            .into_iter()
            .map(|(held_in, row)| (held_in, row.allocation))
            .collect())
    }

    /// The addresses the owner holds in `network`, IPv4 first (empty: none).
    pub fn check(
        &self,
        network: &str,
        container_id: &str,
        interface_name: &str,
    ) -> Result<Vec<Allocation>, StoreError> {
        validate_owner(container_id, interface_name)?;
        Ok(
            held(&self.conn, network, container_id, interface_name, None)?
                .into_iter()
                .map(|row| row.allocation)
                .collect(),
        )
    }
}

fn unavailable(address: IpAddr, reason: Unavailable) -> StoreError {
    StoreError::RequestedIpUnavailable { address, reason }
}

/// The answer to a static request from an owner that already holds an
/// address of that family: the same address again, else a refusal.
fn already_held(
    owner: &Owner,
    existing: Allocation,
    address: IpAddr,
) -> Result<Allocation, StoreError> {
    if existing.address == address {
        return Ok(existing);
    }
    Err(unavailable(
        address,
        Unavailable::OwnerHolds {
            container_id: owner.container_id.to_string(),
            interface_name: owner.interface_name.to_string(),
            held: existing.address,
            network: owner.network.to_string(),
        },
    ))
}

/// The non-Deleting block of `network` containing `address`, which must
/// be Ready: (id, cidr).
fn ready_block_containing(
    conn: &Connection,
    network: &str,
    address: IpAddr,
) -> Result<(i64, Cidr), StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, cidr, state FROM cidr_blocks \
         WHERE network = ?1 AND ip_family = ?2 AND state != 'Deleting' ORDER BY id",
    )?;
    let mut rows = stmt.query(params![network, Family::of(address).as_str()])?;
    while let Some(row) = rows.next()? {
        let cidr = parse_cidr(&row.get::<_, String>(1)?)?;
        if !cidr.contains(address) {
            continue;
        }
        let state = parse_state(&row.get::<_, String>(2)?)?;
        if state != BlockState::Ready {
            return Err(unavailable(
                address,
                Unavailable::BlockNotReady { block: cidr, state },
            ));
        }
        return Ok((row.get(0)?, cidr));
    }
    Err(StoreError::RequestedIpOutsideBlocks {
        address,
        network: network.to_string(),
    })
}

/// The row of `address` (at `offset`) in block `block_id`, inserted first
/// if the block has not been populated that far: (row id, what it holds).
fn requested_row(
    conn: &Connection,
    block_id: i64,
    cidr: &Cidr,
    address: IpAddr,
    offset: u128,
) -> Result<(i64, RowView), StoreError> {
    let text = address.to_string();
    if let Some(row) = find_row(conn, &text, block_id)? {
        return Ok(row);
    }
    insert_rows(
        conn,
        block_id,
        cidr,
        offset..offset + 1,
        &Reserved::fixed(Vec::new()),
    )?;
    find_row(conn, &text, block_id)?
        .ok_or_else(|| StoreError::Corrupt(format!("row {text} vanished after insert")))
}

fn find_row(
    conn: &Connection,
    address: &str,
    block_id: i64,
) -> Result<Option<(i64, RowView)>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT id, is_allocated, COALESCE(container_id, ''), \
             COALESCE(interface_name, ''), release_at \
             FROM ip_addresses WHERE address = ?1 AND cidr_block_id = ?2",
        )?
        .query_row(params![address, block_id], |r| {
            Ok((
                r.get(0)?,
                RowView {
                    allocated: r.get(1)?,
                    container_id: r.get(2)?,
                    interface_name: r.get(3)?,
                    release_at: r.get(4)?,
                },
            ))
        })
        .optional()?)
}

/// Refuses a row that is not free now for `owner` (see [`availability`]).
fn ensure_free(
    row: &RowView,
    owner: &Owner,
    cidr: &Cidr,
    address: IpAddr,
    now_ms: i64,
) -> Result<(), StoreError> {
    availability(row, owner.container_id, owner.interface_name, now_ms).map_err(|taken| {
        let reason = match taken {
            Taken::Reserved => Unavailable::ReservedRow { block: *cidr },
            Taken::Held { container_id } => Unavailable::Held { container_id },
            Taken::Cooling { until_ms } => Unavailable::Cooling { until_ms },
        };
        unavailable(address, reason)
    })
}

fn find_block(conn: &Connection, network: &str, cidr: &str) -> Result<Option<i64>, StoreError> {
    Ok(conn
        .prepare_cached(FIND_BLOCK_SQL)?
        .query_row(params![cidr, network], |r| r.get(0))
        .optional()?)
}

/// Ready blocks of network+family with room, oldest (lowest id) first.
fn candidates(
    conn: &Connection,
    network: &str,
    family: Family,
) -> Result<Vec<(i64, Cidr)>, StoreError> {
    let mut stmt = conn.prepare_cached(CANDIDATES_SQL)?;
    let mut rows = stmt.query(params![network, family.as_str()])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push((row.get(0)?, parse_cidr(&row.get::<_, String>(1)?)?));
    }
    Ok(out)
}
