//! Adding blocks, allocating, releasing and checking addresses.

use std::net::IpAddr;

use rusqlite::{Connection, OptionalExtension, params};

use super::reserve::{Reserved, block_reserved};
use super::{
    Allocation, Owner, ReserveMode, Store, StoreError, get_setting, parse_addr, parse_cidr, schema,
    set_setting, total_ips, validate_owner,
};
use crate::cidr::{Cidr, Family};

/// Rows are populated lazily, this many at a time, from a block's frontier
/// (IPv4 and IPv6 alike), so adding a block of any size is O(1).
pub const GROWTH_BATCH: u128 = 64;

/// Bound on expand-then-claim rounds per block within one allocation.
const MAX_EXPANSIONS_PER_BLOCK: usize = 4;

/// Inserts the rows at `offsets` of a block, reserving those in `reserved`;
/// bumps the block's counter by the number reserved. Returns rows inserted.
pub(super) fn insert_rows(
    conn: &Connection,
    block_id: i64,
    cidr: &Cidr,
    offsets: std::ops::Range<u128>,
    reserved: &Reserved,
) -> Result<u64, StoreError> {
    // OR IGNORE: a requested IPv6 address may already have its row, and
    // another writer (upstream) may have populated ahead of our frontier.
    let mut insert = conn.prepare_cached(
        "INSERT OR IGNORE INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) \
         VALUES (?1, ?2, '', '', ?3)",
    )?;
    let mut inserted = 0u64;
    let mut reserved_count = 0i64;
    for offset in offsets {
        let Some(addr) = cidr.nth(offset) else {
            break;
        };
        let is_reserved = reserved.contains(&offset);
        if insert.execute(params![addr.to_string(), block_id, is_reserved])? == 0 {
            continue;
        }
        inserted += 1;
        if is_reserved {
            reserved_count += 1;
        }
    }
    if reserved_count > 0 {
        conn.prepare_cached(
            "UPDATE cidr_blocks SET allocated_ips = COALESCE(allocated_ips, 0) + ?2 WHERE id = ?1",
        )?
        .execute(params![block_id, reserved_count])?;
    }
    Ok(inserted)
}

/// An allocated row: its id, its block's id, and what it holds.
pub(super) struct HeldRow {
    pub(super) row_id: i64,
    pub(super) block_id: i64,
    pub(super) allocation: Allocation,
}

/// Frees one allocated row of a block of `network`: it rests until
/// `release_at` (none if `None`) and the block's counter drops — unless
/// the row sits at a position the block reserves under `mode` (a pod left
/// there by an upstream database), which goes back to the reservation and
/// stays counted. Every release (DEL, GC, boot recovery) ends here.
pub(super) fn give_back(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    row: &HeldRow,
    release_at: Option<i64>,
) -> Result<(), StoreError> {
    crate::host_local_lock::before_give_back(conn, network, row.row_id, row.allocation.address)?;
    let reserved = block_reserved(conn, mode, row.block_id, network, &row.allocation.block)?;
    let at_reserved = row
        .allocation
        .block
        .offset_of(row.allocation.address)
        .is_some_and(|offset| reserved.contains(&offset));
    if at_reserved {
        conn.prepare_cached(RETURN_RESERVED_SQL)?
            .execute([row.row_id])?;
        return Ok(());
    }
    conn.prepare_cached(RELEASE_ROW_SQL)?
        .execute(params![row.row_id, release_at])?;
    conn.prepare_cached(COUNT_RELEASED_SQL)?
        .execute([row.block_id])?;
    Ok(())
}

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
    let host_local = crate::host_local_lock::before_take(
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

const RELEASE_ROW_SQL: &str =
    "UPDATE ip_addresses SET is_allocated = 0, release_at = ?2 WHERE id = ?1";

const COUNT_RELEASED_SQL: &str =
    "UPDATE cidr_blocks SET allocated_ips = COALESCE(allocated_ips, 0) - 1 WHERE id = ?1";

/// A pod gives a reserved position back to the reservation.
const RETURN_RESERVED_SQL: &str = "UPDATE ip_addresses SET container_id = '', interface_name = '', \
     pod_name = NULL, pod_namespace = NULL, release_at = NULL WHERE id = ?1";

/// Reads every row of a block to find its highest address: run once per
/// IPv6 block that has no recorded frontier (populated by upstream, or
/// before Metis recorded frontiers), never on the allocation path.
const HIGHEST_ROW_SCAN_SQL: &str = "SELECT address FROM ip_addresses WHERE cidr_block_id = ?1";

/// Every statement that runs for each allocation, release or check, for
/// the query-plan test: none may scan `ip_addresses`, which holds every
/// populated address of every block. (Growth continues from a frontier
/// recorded in `metis_settings`, so it scans nothing either.)
#[cfg(test)]
pub(super) const ALLOCATION_PATH: [&str; 9] = [
    HELD_SQL,
    CANDIDATES_SQL,
    FIND_BLOCK_SQL,
    CLAIM_SQL,
    TAKE_ROW_SQL,
    COUNT_TAKEN_SQL,
    RELEASE_ROW_SQL,
    COUNT_RELEASED_SQL,
    RETURN_RESERVED_SQL,
];

/// The lowest-id free, non-cooling row of block ?1 at time ?2.
pub(super) const CLAIM_SQL: &str = "SELECT id, address FROM ip_addresses \
     WHERE cidr_block_id = ?1 AND is_allocated = FALSE \
       AND (release_at IS NULL OR release_at <= ?2) \
     ORDER BY id LIMIT 1";

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
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM ip_addresses WHERE cidr_block_id = ?1 \
             AND is_allocated = FALSE AND (release_at IS NULL OR release_at <= ?2))",
        )?
        .query_row(params![block_id, now_ms], |r| r.get(0))?;
    if has_free {
        return Ok(0);
    }
    let key = frontier_key(block_id);
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
        set_setting(conn, &key, &end.to_string())?;
        if inserted > 0 {
            return Ok(inserted);
        }
        start = end;
    }
    Ok(0)
}

/// The next offset of a block to populate. Without a recorded frontier:
/// an IPv4 block was populated whole when added (by upstream, or by Metis
/// before IPv4 grew lazily); an IPv6 block continues after its highest row
/// (a scan, once per block, as upstream records no frontier).
pub(super) fn frontier(conn: &Connection, block_id: i64, cidr: &Cidr) -> Result<u128, StoreError> {
    // A read-only look at an upstream database finds no settings table:
    // no frontier recorded then.
    let recorded = get_setting(conn, &frontier_key(block_id))
        .ok()
        .flatten()
        .and_then(|text| text.parse().ok());
    if let Some(frontier) = recorded {
        return Ok(cidr.size().min(frontier));
    }
    match cidr.family() {
        Family::V4 => Ok(cidr.size()),
        Family::V6 => Ok(highest_offset(conn, block_id, cidr)?.map_or(0, |h| h.saturating_add(1))),
    }
}

/// The `metis_settings` key of a block's population frontier.
pub(super) fn frontier_key(block_id: i64) -> String {
    format!("{}{block_id}", schema::KEY_FRONTIER)
}

/// The highest populated offset of a block: a scan of its rows, done once
/// per IPv6 block that has no recorded frontier (populated by upstream).
fn highest_offset(
    conn: &Connection,
    block_id: i64,
    cidr: &Cidr,
) -> Result<Option<u128>, StoreError> {
    let mut highest: Option<u128> = None;
    let mut stmt = conn.prepare_cached(HIGHEST_ROW_SCAN_SQL)?;
    let mut rows = stmt.query([block_id])?;
    while let Some(row) = rows.next()? {
        let text: String = row.get(0)?;
        if let Some(offset) = cidr.offset_of(parse_addr(&text)?) {
            highest = Some(highest.map_or(offset, |h| h.max(offset)));
        }
    }
    Ok(highest)
}

/// Inserts a Ready block and its first batch of rows, plus its reserved
/// rows (so counters count every reservation from the start), and records
/// its frontier: O(1) whatever the block's size. Returns its id.
pub(super) fn insert_block(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    cidr: &Cidr,
) -> Result<i64, StoreError> {
    conn.prepare_cached(
        "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips, state) \
         VALUES (?1, ?2, ?3, ?4, 0, 'Ready')",
    )?
    .execute(params![
        cidr.to_string(),
        network,
        cidr.family().as_str(),
        total_ips(cidr)
    ])?;
    let id = conn.last_insert_rowid();
    let reserved = block_reserved(conn, mode, id, network, cidr)?;
    // Only the usable range is ever populated (host-local bounds): what
    // lies outside it is reserved by description, never row by row.
    let usable = reserved.usable(cidr.size());
    let end = usable.start.saturating_add(GROWTH_BATCH).min(usable.end);
    insert_rows(conn, id, cidr, usable.start..end, &reserved)?;
    insert_reserved_rows(conn, id, cidr, &reserved)?;
    set_setting(conn, &frontier_key(id), &end.to_string())?;
    Ok(id)
}

/// Inserts the rows at a block's fixed reserved offsets that do not exist
/// yet (beyond the frontier: an IPv4 block's last address), reserved, so
/// the block's counter counts them from the start.
pub(super) fn insert_reserved_rows(
    conn: &Connection,
    id: i64,
    cidr: &Cidr,
    reserved: &Reserved,
) -> Result<(), StoreError> {
    for offset in reserved.offsets() {
        insert_rows(conn, id, cidr, *offset..offset.saturating_add(1), reserved)?;
    }
    Ok(())
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
        // Keep any rows populated on the way; they are valid.
        tx.commit()?;
        Err(StoreError::NoAvailableIps {
            network: owner.network.to_string(),
            family,
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
                format!("it is reserved (network/gateway/broadcast) in block {cidr}"),
            ));
        }
        if is_quarantined(&tx, block_id)? {
            return Err(unavailable(
                address,
                format!("block {cidr} is quarantined (see `metis admin check`)"),
            ));
        }
        let row = requested_row(&tx, block_id, &cidr, address, offset)?;
        row.ensure_free(owner, &cidr, address, now_ms)?;
        if !take_row(&tx, row.id, block_id, address, owner, now_ms)? {
            return Err(unavailable(
                address,
                "host-local's file records another owner for it".to_string(),
            ));
        }
        tx.commit()?;
        Ok(Allocation {
            address,
            block: cidr,
        })
    }

    /// Releases every address the owner holds in `network` (all families,
    /// any block state). Addresses rest for the store's release cooldown;
    /// the last owner stays recorded. A pod that held a reserved position
    /// gives it back to the reservation.
    pub fn release(
        &mut self,
        network: &str,
        container_id: &str,
        interface_name: &str,
        now_ms: i64,
    ) -> Result<Vec<Allocation>, StoreError> {
        let release_at = self.release_at(now_ms);
        self.give_back_owner(network, container_id, interface_name, None, release_at)
    }

    /// Like [`Store::release`] for one family, but the address is free at once:
    /// for an allocation undone before it reached a pod.
    pub fn roll_back(
        &mut self,
        network: &str,
        container_id: &str,
        interface_name: &str,
        family: Family,
    ) -> Result<Vec<Allocation>, StoreError> {
        self.give_back_owner(network, container_id, interface_name, Some(family), None)
    }

    fn give_back_owner(
        &mut self,
        network: &str,
        container_id: &str,
        interface_name: &str,
        family: Option<Family>,
        release_at: Option<i64>,
    ) -> Result<Vec<Allocation>, StoreError> {
        validate_owner(container_id, interface_name)?;
        let mode = self.reserve;
        let tx = super::write(&mut self.conn, self.batch)?;
        crate::host_local_lock::before_release(&tx, network, container_id, interface_name, family)?;
        let rows = held(&tx, network, container_id, interface_name, family)?;
        for row in &rows {
            give_back(&tx, mode, network, row, release_at)?;
        }
        tx.commit()?;
        Ok(rows.into_iter().map(|row| row.allocation).collect())
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

fn unavailable(address: IpAddr, reason: String) -> StoreError {
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
        format!(
            "container {:?} interface {:?} already holds {} in network {:?}",
            owner.container_id, owner.interface_name, existing.address, owner.network
        ),
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
        let state: String = row.get(2)?;
        if state != "Ready" {
            return Err(unavailable(address, format!("block {cidr} is {state}")));
        }
        return Ok((row.get(0)?, cidr));
    }
    Err(StoreError::RequestedIpOutsideBlocks {
        address,
        network: network.to_string(),
    })
}

/// The row of `address` (at `offset`) in block `block_id`, inserted first
/// if the block has not been populated that far.
fn requested_row(
    conn: &Connection,
    block_id: i64,
    cidr: &Cidr,
    address: IpAddr,
    offset: u128,
) -> Result<RowState, StoreError> {
    let text = address.to_string();
    if let Some(row) = RowState::find(conn, &text, block_id)? {
        return Ok(row);
    }
    insert_rows(
        conn,
        block_id,
        cidr,
        offset..offset + 1,
        &Reserved::fixed(Vec::new()),
    )?;
    RowState::find(conn, &text, block_id)?
        .ok_or_else(|| StoreError::Corrupt(format!("row {text} vanished after insert")))
}

struct RowState {
    id: i64,
    allocated: bool,
    container_id: String,
    interface_name: String,
    release_at: Option<i64>,
}

impl RowState {
    fn find(
        conn: &Connection,
        address: &str,
        block_id: i64,
    ) -> Result<Option<RowState>, StoreError> {
        Ok(conn
            .prepare_cached(
                "SELECT id, is_allocated, COALESCE(container_id, ''), \
                 COALESCE(interface_name, ''), release_at \
                 FROM ip_addresses WHERE address = ?1 AND cidr_block_id = ?2",
            )?
            .query_row(params![address, block_id], |r| {
                Ok(RowState {
                    id: r.get(0)?,
                    allocated: r.get(1)?,
                    container_id: r.get(2)?,
                    interface_name: r.get(3)?,
                    release_at: r.get(4)?,
                })
            })
            .optional()?)
    }

    /// Refuses a row that is reserved, held, or still cooling at `now_ms`
    /// for anyone but its last owner: the cooldown protects a new owner
    /// from the old one's late traffic, while the old owner itself (a
    /// runtime re-adding the same container and interface, as `podman
    /// network reload` does) may take its address back.
    fn ensure_free(
        &self,
        owner: &Owner,
        cidr: &Cidr,
        address: IpAddr,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        if self.allocated {
            if self.container_id.is_empty() {
                return Err(unavailable(
                    address,
                    format!("it is reserved in block {cidr}"),
                ));
            }
            return Err(unavailable(
                address,
                format!("it is held by container {:?}", self.container_id),
            ));
        }
        let last_owner =
            self.container_id == owner.container_id && self.interface_name == owner.interface_name;
        if let Some(until) = self.release_at
            && until > now_ms
            && !last_owner
        {
            return Err(unavailable(
                address,
                format!(
                    "it is in release cooldown until {}",
                    crate::log::rfc3339_millis(until)
                ),
            ));
        }
        Ok(())
    }
}

fn is_quarantined(conn: &Connection, block_id: i64) -> Result<bool, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM metis_blocks WHERE block_id = ?1 AND quarantine IS NOT NULL)",
        )?
        .query_row([block_id], |r| r.get(0))?)
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
