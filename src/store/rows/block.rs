//! One block's rows: what a block reserves (network, gateway, broadcast,
//! host-local bounds), how far it is populated (its frontier), inserting
//! and settling its rows, giving a row back, recounting its counter,
//! deleting it, and Metis's record of it (sources, retirement,
//! quarantine). Every verb of the store — allocation, layout, repair,
//! checks, lifecycle — is built from these; this layer imports only the
//! store's base.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

use rusqlite::types::Value;
use rusqlite::{Connection, OptionalExtension, Row, params, params_from_iter};

use crate::cidr::{Bounds, Cidr, Family};
use crate::store::db::{
    Allocation, BlockInfo, BlockState, ReserveMode, StoreError, parse_addr, parse_cidr,
    parse_family, parse_state, total_ips,
};

/// Rows are populated lazily, this many at a time, from a block's frontier
/// (IPv4 and IPv6 alike), so adding a block of any size is O(1).
pub const GROWTH_BATCH: u128 = 64;

/// The offsets (from the block base) a block reserves. Blocks with fewer
/// than 4 addresses reserve nothing. `EveryBlock`: IPv4 0, 1, last; IPv6 0,
/// 1. `FirstBlock`: IPv4 0, 1, last only for the network's first IPv4 block.
pub fn reserved_offsets(cidr: &Cidr, mode: ReserveMode, first_v4_block: bool) -> Vec<u128> {
    let size = cidr.size();
    if size < 4 {
        return Vec::new();
    }
    match (cidr.family(), mode) {
        (Family::V4, ReserveMode::EveryBlock) => vec![0, 1, size - 1],
        (Family::V4, ReserveMode::FirstBlock) if first_v4_block => vec![0, 1, size - 1],
        (Family::V6, ReserveMode::EveryBlock) => vec![0, 1],
        _ => Vec::new(),
    }
}

/// Whether block `id` is the lowest-id IPv4 block of `network`.
pub(in crate::store) fn is_first_v4(
    conn: &Connection,
    network: &str,
    id: i64,
) -> Result<bool, StoreError> {
    let first: Option<i64> = conn
        .prepare_cached(
            "SELECT MIN(id) FROM cidr_blocks WHERE network = ?1 AND ip_family = 'ipv4'",
        )?
        .query_row([network], |r| r.get(0))?;
    Ok(first == Some(id))
}

/// The blocks of network ?1 and family ?2 as upstream's table lists them,
/// oldest first: id, prefix, state, and whether the counter leaves room
/// (NULL: it does not). One statement for the layout's listing and the
/// allocation's candidates, with Metis's record read block by block
/// ([`BLOCK_RECORD_SQL`]): a one-request process (direct mode) prepares
/// every statement it runs, and each join with that record, or subquery
/// of it, cost more to prepare than the two together.
pub(in crate::store) const NETWORK_BLOCKS_SQL: &str = "SELECT id, cidr, state, total_ips > allocated_ips \
     FROM cidr_blocks WHERE network = ?1 AND ip_family = ?2 ORDER BY id";

/// A row of [`NETWORK_BLOCKS_SQL`]. A prefix or state that is not text
/// (another writer's) is `None`.
pub(in crate::store) struct Listed {
    pub(in crate::store) id: i64,
    pub(in crate::store) cidr: Option<String>,
    pub(in crate::store) state: Option<String>,
    pub(in crate::store) has_room: bool,
}

impl Listed {
    /// Whether its state is `state` (SQL's `state = ...`).
    pub(in crate::store) fn is(&self, state: &str) -> bool {
        self.state.as_deref() == Some(state)
    }

    pub(in crate::store) fn prefix(&self) -> Result<Cidr, StoreError> {
        parse_text(self.cidr.as_deref(), parse_cidr, || {
            format!("the prefix of block {}", self.id)
        })
    }

    pub(in crate::store) fn parsed_state(&self) -> Result<BlockState, StoreError> {
        parse_text(self.state.as_deref(), parse_state, || {
            format!("the state of block {}", self.id)
        })
    }
}

/// The blocks of `network` and `family`, oldest first.
pub(in crate::store) fn network_blocks(
    conn: &Connection,
    network: &str,
    family: Family,
) -> Result<Vec<Listed>, StoreError> {
    let mut stmt = conn.prepare_cached(NETWORK_BLOCKS_SQL)?;
    let mut rows = stmt.query(params![network, family.as_str()])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push(Listed {
            id: row.get(0)?,
            cidr: text_at(row, 1)?,
            state: text_at(row, 2)?,
            has_room: row.get::<_, Option<bool>>(3)? == Some(true),
        });
    }
    Ok(out)
}

/// Column `i` of `row` when it holds text; `None` for any other value
/// (another writer's), which a comparison with text in SQL never matches.
pub(in crate::store) fn text_at(row: &Row, i: usize) -> rusqlite::Result<Option<String>> {
    Ok(row.get_ref(i)?.as_str().ok().map(str::to_owned))
}

/// A column read by [`text_at`], parsed by `parse`; a value that was not
/// text is corrupt, as `what` names it.
pub(in crate::store) fn parse_text<T>(
    text: Option<&str>,
    parse: impl FnOnce(&str) -> Result<T, StoreError>,
    what: impl FnOnce() -> String,
) -> Result<T, StoreError> {
    match text {
        Some(text) => parse(text),
        None => Err(StoreError::Corrupt(format!("{} is not text", what()))),
    }
}

/// Metis's record of block ?1: its sources, retired, quarantined. Read by
/// its key, block by block, where a join of it with the network's blocks
/// cost a one-request process (direct mode) more to prepare; a scan of
/// every block's record instead would make each ADD pay for the blocks of
/// every other network on the node.
pub(in crate::store) const BLOCK_RECORD_SQL: &str = "SELECT sources, retired != 0, quarantine IS NOT NULL \
     FROM metis_blocks WHERE block_id = ?1";

/// Metis's record of a block ([`BLOCK_RECORD_SQL`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(in crate::store) struct Record {
    /// `None`: no record of where the block comes from (or one that is
    /// not text: another writer's).
    pub(in crate::store) sources: Option<String>,
    pub(in crate::store) retired: bool,
    pub(in crate::store) quarantined: bool,
}

/// Metis's record of block `id`, if it has one.
pub(in crate::store) fn record_of(
    conn: &Connection,
    id: i64,
) -> Result<Option<Record>, StoreError> {
    Ok(conn
        .prepare_cached(BLOCK_RECORD_SQL)?
        .query_row([id], |r| {
            Ok(Record {
                sources: text_at(r, 0)?,
                retired: r.get(1)?,
                quarantined: r.get(2)?,
            })
        })
        .optional()?)
}

/// Metis's records of blocks, each read at most once: for one allocation,
/// where its candidates and its hand-out check ask for the same blocks
/// (nothing an allocation writes changes a record).
#[derive(Debug, Default)]
pub(in crate::store) struct Records(BTreeMap<i64, Option<Record>>);

impl Records {
    /// Block `id`'s record, read the first time it is asked for.
    pub(in crate::store) fn get(
        &mut self,
        conn: &Connection,
        id: i64,
    ) -> Result<Option<&Record>, StoreError> {
        let record = match self.0.entry(id) {
            Entry::Occupied(read) => read.into_mut(),
            Entry::Vacant(unread) => unread.insert(record_of(conn, id)?),
        };
        Ok(record.as_ref())
    }
}

/// The positions a block keeps out of allocation: fixed offsets, and with
/// host-local bounds everything outside the usable range too (described,
/// never enumerated: an IPv6 block's outside may be 2^64 addresses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    offsets: Vec<u128>,
    /// Inclusive first and last usable offsets, when bounded.
    usable: Option<(u128, u128)>,
}

impl Reserved {
    /// Metis's rule (or upstream's, by mode): the fixed offsets only.
    pub fn fixed(offsets: Vec<u128>) -> Reserved {
        Reserved {
            offsets,
            usable: None,
        }
    }

    /// host-local's rule: outside `start..=end`, and the gateway.
    pub fn bounded(cidr: &Cidr, bounds: &Bounds) -> Reserved {
        let (gateway, start, end) = bounds.offsets(cidr);
        Reserved {
            offsets: gateway.into_iter().collect(),
            usable: Some((start, end)),
        }
    }

    /// Whether host-local bounds keep the block's outside out.
    pub fn is_bounded(&self) -> bool {
        self.usable.is_some()
    }

    /// The fixed offsets (network, gateway, broadcast), every one of which
    /// has a reserved row from the block's start.
    pub fn offsets(&self) -> &[u128] {
        &self.offsets
    }

    pub fn contains(&self, offset: &u128) -> bool {
        self.offsets.contains(offset)
            || self
                .usable
                .is_some_and(|(start, end)| *offset < start || *offset > end)
    }

    /// The offsets of a block of `size` addresses that may be handed out
    /// at all: the usable range when bounded, else the whole block.
    pub fn usable(&self, size: u128) -> std::ops::Range<u128> {
        match self.usable {
            Some((start, end)) => start..end.saturating_add(1).min(size),
            None => 0..size,
        }
    }

    /// How many of a block of `size` addresses are reserved.
    pub fn count(&self, size: u128) -> u128 {
        let Some((start, end)) = self.usable else {
            return self.offsets.iter().filter(|o| **o < size).count() as u128;
        };
        let usable = end.saturating_sub(start).saturating_add(1).min(size);
        let inside = self
            .offsets
            .iter()
            .filter(|o| (start..=end).contains(*o))
            .count() as u128;
        size - usable + inside
    }
}

/// The host-local bounds recorded for block `cidr` of `network`, if any.
pub(in crate::store) fn bounds_of(
    conn: &Connection,
    network: &str,
    cidr: &Cidr,
) -> Result<Option<Bounds>, StoreError> {
    let row: Option<(String, String, String)> = conn
        .prepare_cached(
            "SELECT range_start, range_end, gateway FROM metis_bounds \
             WHERE network = ?1 AND cidr = ?2",
        )?
        .query_row(params![network, cidr.to_string()], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .optional()?;
    row.map(|(start, end, gateway)| {
        Ok(Bounds {
            start: parse_addr(&start)?,
            end: parse_addr(&end)?,
            gateway: parse_addr(&gateway)?,
        })
    })
    .transpose()
}

/// The reserved positions of an existing block under `mode`: its
/// host-local bounds when it has some, else the mode's fixed offsets.
pub(in crate::store) fn block_reserved(
    conn: &Connection,
    mode: ReserveMode,
    id: i64,
    network: &str,
    cidr: &Cidr,
) -> Result<Reserved, StoreError> {
    if let Some(bounds) = bounds_of(conn, network, cidr)? {
        return Ok(Reserved::bounded(cidr, &bounds));
    }
    let first = mode == ReserveMode::FirstBlock
        && cidr.family() == Family::V4
        && is_first_v4(conn, network, id)?;
    Ok(Reserved::fixed(reserved_offsets(cidr, mode, first)))
}

/// Inserts the rows at `offsets` of a block, reserving those in `reserved`;
/// bumps the block's counter by the number reserved. Returns rows inserted.
pub(in crate::store) fn insert_rows(
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
        if insert.execute(params![
            crate::cidr::address_text(addr),
            block_id,
            is_reserved
        ])? == 0
        {
            continue;
        }
        inserted += 1;
        if is_reserved {
            reserved_count += 1;
        }
    }
    if reserved_count > 0 {
        conn.prepare_cached(COUNT_CHANGE_SQL)?
            .execute(params![block_id, reserved_count])?;
    }
    Ok(inserted)
}

/// Inserts the rows at a block's fixed reserved offsets that do not exist
/// yet (beyond the frontier: an IPv4 block's last address), reserved, so
/// the block's counter counts them from the start.
pub(in crate::store) fn insert_reserved_rows(
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

/// Inserts a Ready block and its first batch of rows, plus its reserved
/// rows (so counters count every reservation from the start), and records
/// its frontier: O(1) whatever the block's size. Returns its id.
pub(in crate::store) fn insert_block(
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
    set_frontier(conn, id, end)?;
    Ok(id)
}

/// Reads every row of a block to find its highest address: run once per
/// IPv6 block that has no recorded frontier (populated by upstream, or
/// before Metis recorded frontiers), never on the allocation path.
const HIGHEST_ROW_SCAN_SQL: &str = "SELECT address FROM ip_addresses WHERE cidr_block_id = ?1";

/// The next offset of a block to populate. Without a recorded frontier:
/// an IPv4 block was populated whole when added (by upstream, or by Metis
/// before IPv4 grew lazily); an IPv6 block continues after its highest row
/// (a scan, once per block, as upstream records no frontier).
pub(in crate::store) fn frontier(
    conn: &Connection,
    block_id: i64,
    cidr: &Cidr,
) -> Result<u128, StoreError> {
    let recorded = conn
        .prepare_cached("SELECT frontier FROM metis_blocks WHERE block_id = ?1")?
        .query_row([block_id], |r| r.get::<_, Option<String>>(0))
        .optional()?
        .flatten()
        .and_then(|text| text.parse::<u128>().ok());
    if let Some(frontier) = recorded {
        return Ok(cidr.size().min(frontier));
    }
    match cidr.family() {
        Family::V4 => Ok(cidr.size()),
        Family::V6 => Ok(highest_offset(conn, block_id, cidr)?.map_or(0, |h| h.saturating_add(1))),
    }
}

/// Records the next offset of a block to populate (a Metis record of the
/// block without one of its sources, if it had none).
pub(in crate::store) fn set_frontier(
    conn: &Connection,
    block_id: i64,
    next: u128,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO metis_blocks (block_id, frontier) VALUES (?1, ?2) \
         ON CONFLICT(block_id) DO UPDATE SET frontier = excluded.frontier",
    )?
    .execute(params![block_id, next.to_string()])?;
    Ok(())
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

/// An allocated row: its id, its block's id, and what it holds.
pub(in crate::store) struct HeldRow {
    pub(in crate::store) row_id: i64,
    pub(in crate::store) block_id: i64,
    pub(in crate::store) allocation: Allocation,
}

pub(in crate::store) const RELEASE_ROW_SQL: &str = concat!(
    "UPDATE ip_addresses SET is_allocated = 0, release_at = ?2, ",
    stamped!(),
    " WHERE id = ?1"
);

/// ?2 more allocated (or reserved) rows in block ?1; fewer when ?2 is
/// negative (a release is -1).
pub(in crate::store) const COUNT_CHANGE_SQL: &str = concat!(
    "UPDATE cidr_blocks SET allocated_ips = COALESCE(allocated_ips, 0) + ?2, ",
    stamped!(),
    " WHERE id = ?1"
);

/// A pod gives a reserved position back to the reservation.
pub(in crate::store) const RETURN_RESERVED_SQL: &str = concat!(
    "UPDATE ip_addresses SET container_id = '', interface_name = '', \
     pod_name = NULL, pod_namespace = NULL, release_at = NULL, ",
    stamped!(),
    " WHERE id = ?1"
);

/// Frees one allocated row of a block of `network`: it rests until
/// `release_at` (none if `None`) and the block's counter drops — unless
/// the row sits at a position the block reserves under `mode` (a pod left
/// there by an upstream database), which goes back to the reservation and
/// stays counted, and a row outside the block's prefix is deleted. Every
/// release (DEL, GC, boot recovery) ends here.
pub(in crate::store) fn give_back(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    row: &HeldRow,
    release_at: Option<i64>,
) -> Result<(), StoreError> {
    crate::store::db::co_writer::before_give_back(
        conn,
        network,
        row.row_id,
        row.allocation.address,
    )?;
    give_back_row(conn, mode, network, row, release_at)
}

/// [`give_back`] once host-local's file of the row was dealt with: a DEL
/// removes every file of the owner in its network first
/// (`co_writer::before_release`).
pub(in crate::store) fn give_back_row(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    row: &HeldRow,
    release_at: Option<i64>,
) -> Result<(), StoreError> {
    crate::store::rows::named_gateway::forget(conn, row.row_id)?;
    let Some(offset) = row.allocation.block.offset_of(row.allocation.address) else {
        // Outside the prefix (upstream's rows of a /127 or /128): the row
        // goes with its last pod, so no one is handed it again.
        conn.prepare_cached("DELETE FROM ip_addresses WHERE id = ?1")?
            .execute([row.row_id])?;
        conn.prepare_cached(COUNT_CHANGE_SQL)?
            .execute([row.block_id, -1])?;
        return Ok(());
    };
    let reserved = block_reserved(conn, mode, row.block_id, network, &row.allocation.block)?;
    let at_reserved = reserved.contains(&offset);
    if at_reserved {
        conn.prepare_cached(RETURN_RESERVED_SQL)?
            .execute([row.row_id])?;
        return Ok(());
    }
    conn.prepare_cached(RELEASE_ROW_SQL)?
        .execute(params![row.row_id, release_at])?;
    conn.prepare_cached(COUNT_CHANGE_SQL)?
        .execute([row.block_id, -1])?;
    Ok(())
}

/// Brings a reshaped block's rows in line: its fixed reserved positions
/// have rows, positions it reserves are reserved unless a pod holds them,
/// reserved rows elsewhere are freed, and the counters are recounted.
pub(in crate::store) fn settle(
    conn: &Connection,
    mode: ReserveMode,
    id: i64,
    network: &str,
    cidr: &Cidr,
) -> Result<(), StoreError> {
    let reserved = block_reserved(conn, mode, id, network, cidr)?;
    insert_reserved_rows(conn, id, cidr, &reserved)?;
    // Row by row: a bounded block's reserved positions are a description,
    // not a list.
    let rows: Vec<(i64, String, bool, String)> = conn
        .prepare_cached(
            "SELECT id, address, is_allocated, COALESCE(container_id, '') \
             FROM ip_addresses WHERE cidr_block_id = ?1",
        )?
        .query_map([id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
        .collect::<Result<_, _>>()?;
    for (row_id, address, allocated, container) in rows {
        let at_reserved = cidr
            .offset_of(parse_addr(&address)?)
            .is_some_and(|offset| reserved.contains(&offset));
        let sql = match (at_reserved, allocated, container.is_empty()) {
            (true, false, _) => RESERVE_ROW_SQL,
            (false, true, true) => FREE_RESERVED_ROW_SQL,
            _ => continue,
        };
        conn.prepare_cached(sql)?.execute([row_id])?;
    }
    conn.prepare_cached(concat!(
        "UPDATE cidr_blocks SET allocated_ips = \
         (SELECT COUNT(*) FROM ip_addresses WHERE cidr_block_id = ?1 AND is_allocated = 1), ",
        stamped!(),
        " WHERE id = ?1"
    ))?
    .execute([id])?;
    Ok(())
}

/// Reserves a free row (no owner, no cooldown); touches nothing else.
pub(in crate::store) const RESERVE_ROW_SQL: &str = concat!(
    "UPDATE ip_addresses SET is_allocated = 1, container_id = '', \
     interface_name = '', pod_name = NULL, pod_namespace = NULL, release_at = NULL, ",
    stamped!(),
    " WHERE id = ?1 AND is_allocated = FALSE"
);

/// Frees a reserved row (allocated, no owner) at once.
pub(in crate::store) const FREE_RESERVED_ROW_SQL: &str = concat!(
    "UPDATE ip_addresses SET is_allocated = 0, release_at = NULL, ",
    stamped!(),
    " WHERE id = ?1 AND is_allocated = 1 AND COALESCE(container_id, '') = ''"
);

/// Deletes a block, its rows and Metis's records of it.
pub(in crate::store) fn delete_block(conn: &Connection, id: i64) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM ip_addresses WHERE cidr_block_id = ?1")?
        .execute([id])?;
    conn.prepare_cached("DELETE FROM cidr_blocks WHERE id = ?1")?
        .execute([id])?;
    forget_block(conn, id)
}

/// Drops Metis's records of a deleted block.
pub(in crate::store) fn forget_block(conn: &Connection, id: i64) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM metis_blocks WHERE block_id = ?1")?
        .execute([id])?;
    Ok(())
}

/// Blocks whose `allocated_ips` differs from their count of allocated
/// rows: `(block id, allocated_ips, actual)`.
pub(in crate::store) fn counter_mismatches(
    conn: &Connection,
) -> Result<Vec<(i64, i64, i64)>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT b.id, COALESCE(b.allocated_ips, 0), \
                (SELECT COUNT(*) FROM ip_addresses a WHERE a.cidr_block_id = b.id AND a.is_allocated = 1) \
         FROM cidr_blocks b ORDER BY b.id",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (id, counter, actual) = row?;
        if counter != actual {
            out.push((id, counter, actual));
        }
    }
    Ok(out)
}

/// Sets the `allocated_ips` of each block in `ids` (those a row-level
/// check found wrong) to its count of allocated rows, counted again here
/// under the caller's write lock; returns how many were wrong.
pub(in crate::store) fn recount(conn: &Connection, ids: &[i64]) -> Result<usize, StoreError> {
    let mut fix = conn.prepare_cached(concat!(
        "UPDATE cidr_blocks SET allocated_ips = \
           (SELECT COUNT(*) FROM ip_addresses a WHERE a.cidr_block_id = ?1 AND a.is_allocated = 1), ",
        stamped!(),
        " WHERE id = ?1 AND COALESCE(allocated_ips, 0) != \
           (SELECT COUNT(*) FROM ip_addresses a WHERE a.cidr_block_id = ?1 AND a.is_allocated = 1)"
    ))?;
    let mut wrong = 0;
    for id in ids {
        wrong += fix.execute([id])?;
    }
    Ok(wrong)
}

/// Gives a block a Metis record of its sources (none yet) if it has none.
pub(in crate::store) fn ensure_record(conn: &Connection, id: i64) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO metis_blocks (block_id, sources) VALUES (?1, '') \
         ON CONFLICT(block_id) DO UPDATE SET sources = COALESCE(sources, '')",
    )?
    .execute([id])?;
    Ok(())
}

/// A block nothing new is allocated from, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantined {
    pub block_id: i64,
    pub cidr: String,
    pub network: String,
    pub why: String,
}

/// Quarantined blocks, id order.
pub(in crate::store) fn quarantined(conn: &Connection) -> Result<Vec<Quarantined>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT b.id, b.cidr, b.network, m.quarantine FROM metis_blocks m \
         JOIN cidr_blocks b ON b.id = m.block_id WHERE m.quarantine IS NOT NULL ORDER BY b.id",
    )?;
    let rows = stmt
        .query_map([], |r| {
            Ok(Quarantined {
                block_id: r.get(0)?,
                cidr: r.get(1)?,
                network: r.get(2)?,
                why: r.get(3)?,
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The quarantined blocks of `network` and `family`, in words.
pub(in crate::store) fn quarantined_in(
    conn: &Connection,
    network: &str,
    family: Family,
) -> Result<Vec<String>, StoreError> {
    Ok(quarantined(conn)?
        .into_iter()
        .filter(|q| {
            q.network == network && q.cidr.parse::<Cidr>().is_ok_and(|c| c.family() == family)
        })
        .map(|q| format!("quarantined block {} ({})", q.cidr, q.why))
        .collect())
}

/// The Draining block of network ?1 and family ?2 that exhaustion takes
/// back: the oldest one Metis neither retired nor quarantined.
pub(in crate::store) const UNDRAINABLE_SQL: &str = "SELECT id FROM cidr_blocks WHERE network = ?1 AND ip_family = ?2 \
     AND state = 'Draining' AND id NOT IN \
       (SELECT block_id FROM metis_blocks WHERE retired = 1 OR quarantine IS NOT NULL) \
     ORDER BY id LIMIT 1";

/// Lifts every quarantine (before it is recomputed from scratch).
pub(in crate::store) fn clear_quarantines(conn: &Connection) -> Result<(), StoreError> {
    conn.execute("UPDATE metis_blocks SET quarantine = NULL", [])?;
    Ok(())
}

/// Quarantines block `id`, saying why.
pub(in crate::store) fn quarantine(
    conn: &Connection,
    id: i64,
    why: &str,
) -> Result<(), StoreError> {
    ensure_record(conn, id)?;
    conn.prepare_cached("UPDATE metis_blocks SET quarantine = ?2 WHERE block_id = ?1")?
        .execute(params![id, why])?;
    crate::store::rows::withhold::settle_block(conn, id, crate::log::now_ms())
}

/// The columns [`block_info`] reads, of `cidr_blocks b`.
pub(in crate::store) const BLOCK_COLUMNS: &str = "b.id, b.cidr, b.network, b.ip_family, b.total_ips, \
     COALESCE(b.allocated_ips, 0), b.state, COALESCE(b.created_at, 0), COALESCE(b.updated_at, 0)";

fn block_info(row: &Row) -> Result<BlockInfo, StoreError> {
    Ok(BlockInfo {
        id: row.get(0)?,
        cidr: row.get(1)?,
        network: row.get(2)?,
        family: parse_family(&row.get::<_, String>(3)?)?,
        total_ips: row.get(4)?,
        allocated_ips: row.get(5)?,
        state: parse_state(&row.get::<_, String>(6)?)?,
        created_at: row.get(7)?,
        updated_at: row.get(8)?,
    })
}

/// The blocks a query selecting [`BLOCK_COLUMNS`] finds.
pub(in crate::store) fn query_blocks(
    conn: &Connection,
    sql: &str,
    params: &[Value],
) -> Result<Vec<BlockInfo>, StoreError> {
    let mut stmt = conn.prepare_cached(sql)?;
    let mut rows = stmt.query(params_from_iter(params.iter()))?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push(block_info(row)?);
    }
    Ok(out)
}

impl crate::store::db::connection::Store {
    /// Blocks whose `allocated_ips` differs from their count of allocated
    /// rows: `(block id, allocated_ips, actual)`.
    pub fn counter_mismatches(&self) -> Result<Vec<(i64, i64, i64)>, StoreError> {
        crate::store::rows::block::counter_mismatches(&self.conn)
    }
}
