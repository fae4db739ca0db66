//! `metis admin downgrade`: readies a Metis database for upstream's store
//! (a rollback), in one write transaction, idempotently. What upstream's
//! store would otherwise get wrong on a file Metis wrote:
//!
//! - **lazy IPv4 rows**: upstream never adds rows to an IPv4 block, so a
//!   /24 Metis populated 64 rows at a time looks full to it after 61 pods.
//!   Every row of every IPv4 block is written (free, or reserved where
//!   Metis reserves: network, gateway, broadcast, and everything outside a
//!   host-local `rangeStart`..`rangeEnd`), so upstream's allocation — the
//!   lowest-id free row of a Ready block — finds every usable address and
//!   no other;
//! - **retired and quarantined blocks**: made `Withheld` (see `withhold`),
//!   which no query of upstream's selects;
//! - **bounded IPv6 blocks**: upstream's `expandIPv6Block` starts after
//!   the block's highest-id row and knows no bounds. The usable range's
//!   rows are written (up to [`MAX_RANGE_ROWS`]), and the highest id is
//!   given to a row whose successor already has a row, so upstream's
//!   expansion fails on the UNIQUE index instead of handing out addresses
//!   past `rangeEnd`: an exhausted range is an error, never an address
//!   outside it;
//! - **other IPv6 blocks**: the same expansion hits the UNIQUE index (and
//!   fails the allocation) on any row above the highest-id row's address —
//!   a requested address, a row Metis wrote lazily. The block's missing
//!   rows below its highest row are written (up to [`MAX_RANGE_ROWS`]) and
//!   that highest row is given the highest id, so upstream serves the holes
//!   and expands past every existing row.
//!
//! - **gateways live results name**: Metis keeps each out of its
//!   hand-outs by its record (`metis_gateways`), which upstream does not
//!   read — two conflists of one subnet with different gateways each
//!   name one the other hands out. Its row is reserved (written reserved
//!   where the block had none yet), so upstream never hands it out; the
//!   next open by Metis frees it again (`repair`), its record being enough
//!   there.
//!
//! - **addresses held through an overlapping block**: two blocks of one
//!   address space may overlap (upstream's `AddCIDR` after an earlier
//!   rollback puts a /29 of one network inside another network's /28),
//!   each with a row per address. Metis never hands out a row whose twin
//!   a pod holds; upstream takes the lowest free row of its own block.
//!   Every such free twin is reserved, and the next open by Metis runs its
//!   full repair, which frees them again.
//!
//! What it cannot fix is reported: a pod holding a block's gateway, a row
//! held outside its bounds.

use std::collections::HashSet;

use rusqlite::{Connection, params};

use crate::cidr::{Cidr, Family};
use crate::store::db::{ReserveMode, Store, StoreError, parse_addr, parse_cidr, schema};
use crate::store::rows::block::{
    COUNT_CHANGE_SQL, RESERVE_ROW_SQL, block_reserved, insert_rows, set_frontier,
};
use crate::store::rows::withhold;

/// Most rows of a bounded IPv6 range written ahead for upstream.
pub const MAX_RANGE_ROWS: u128 = 65_536;

/// What a downgrade did, in words (nothing: already ready).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Downgraded {
    pub done: Vec<String>,
    /// What it could not fix.
    pub warnings: Vec<String>,
}

struct Live {
    id: i64,
    cidr: Cidr,
    network: String,
}

impl Store {
    /// Readies the database for upstream's store (see the module docs).
    pub fn downgrade(&mut self, now_ms: i64) -> Result<Downgraded, StoreError> {
        let mode = self.reserve;
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let mut out = Downgraded::default();
        for block in withhold::settle(&tx, now_ms)? {
            out.done.push(block.describe());
        }
        // Before the blocks' rows: a gateway's row written here is one
        // the IPv6 ordering below accounts for.
        fence_named_gateways(&tx, mode, &mut out)?;
        for block in live_blocks(&tx)? {
            let reserved = block_reserved(&tx, mode, block.id, &block.network, &block.cidr)?;
            let name = format!(
                "block {} ({}, network {:?})",
                block.id, block.cidr, block.network
            );
            match block.cidr.family() {
                Family::V4 => {
                    let size = block.cidr.size();
                    let written = insert_rows(&tx, block.id, &block.cidr, 0..size, &reserved)?;
                    set_frontier(&tx, block.id, size)?;
                    if written > 0 {
                        out.done.push(format!(
                            "{name}: wrote {written} row(s): upstream sees every address of the block"
                        ));
                    }
                }
                Family::V6 if !reserved.is_bounded() => {
                    order_for_expansion(&tx, &block, &reserved, &mut out)?;
                }
                Family::V6 => {
                    let usable = reserved.usable(block.cidr.size());
                    let len = usable.end.saturating_sub(usable.start);
                    let written = match len <= MAX_RANGE_ROWS {
                        true => insert_rows(&tx, block.id, &block.cidr, usable.clone(), &reserved)?,
                        false => 0,
                    };
                    if written > 0 {
                        out.done.push(format!(
                            "{name}: wrote {written} row(s) of its range for upstream"
                        ));
                    }
                    match fence_expansion(&tx, block.id, &block.cidr)? {
                        Fence::Already => {}
                        Fence::Moved(address) => out.done.push(format!(
                            "{name}: row {address} now has the highest id, so upstream's IPv6 \
                             expansion (after the highest-id row) fails on an existing row \
                             instead of handing out addresses past rangeEnd"
                        )),
                        Fence::Impossible => out.warnings.push(format!(
                            "{name}: no row has a successor row; upstream's IPv6 expansion may \
                             hand out addresses past rangeEnd once the range is exhausted"
                        )),
                    }
                }
            }
        }
        // After the rows written above: a new row may be such a twin.
        fence_held_twins(&tx, &mut out)?;
        let leftovers = crate::store::upkeep::rollback::find(&tx)?;
        out.warnings.extend(
            leftovers
                .describe(false)
                .into_iter()
                .filter(|line| line.contains("is held by")),
        );
        out.warnings
            .extend(crate::store::upkeep::rollback::gateway_above_range(&tx)?);
        for held in crate::store::layout::gateway::all_held(&tx, mode)? {
            out.warnings.push(format!(
                "{}; upstream will hand out the block's addresses with that gateway",
                held.describe()
            ));
        }
        tx.commit()?;
        Ok(out)
    }
}

/// Reserves the row of every gateway live results name (see the module
/// docs), saying what it did; a gateway a pod holds is a warning. When it
/// reserves any, the file's healed state is forgotten, so that the next
/// open by Metis heals (frees) them.
fn fence_named_gateways(
    conn: &Connection,
    mode: ReserveMode,
    out: &mut Downgraded,
) -> Result<(), StoreError> {
    use crate::store::rows::named_gateway::{GatewayRow, gateway_row, live_by_block};
    let mut fenced = false;
    for named in live_by_block(conn)? {
        let what = format!(
            "block {}: {}, the gateway {} live result(s) name",
            named.block_id, named.gateway, named.results
        );
        match gateway_row(conn, mode, &named)? {
            GatewayRow::Reserved => continue,
            GatewayRow::Held(holder) => {
                out.warnings.push(format!(
                    "{what}, is held by container {holder:?}; upstream sees it as that pod's"
                ));
                continue;
            }
            GatewayRow::Free(row_id) => {
                conn.prepare_cached(RESERVE_ROW_SQL)?.execute([row_id])?;
            }
            GatewayRow::Outside => {
                out.warnings.push(format!("{what}, lies outside the block"));
                continue;
            }
            GatewayRow::Missing => {
                conn.prepare_cached(
                    "INSERT INTO ip_addresses (address, cidr_block_id, container_id, \
                     interface_name, is_allocated) VALUES (?1, ?2, '', '', TRUE)",
                )?
                .execute(params![named.gateway, named.block_id])?;
            }
        }
        conn.prepare_cached(COUNT_CHANGE_SQL)?
            .execute([named.block_id, 1])?;
        out.done.push(format!(
            "{what}: reserved, so that upstream never hands it out (Metis's next start frees it)"
        ));
        fenced = true;
    }
    if fenced {
        conn.prepare_cached("DELETE FROM metis_settings WHERE key = ?1")?
            .execute([schema::KEY_HEALED])?;
    }
    Ok(())
}

/// The free rows of live blocks whose address a pod holds through another
/// block of the same address space (the same network, or two networks
/// neither of which is isolated), as (row id, block id, address, holder),
/// each row once (with one of its holders).
const HELD_TWINS_SQL: &str = "SELECT f.id, f.cidr_block_id, f.address, h.container_id \
     FROM ip_addresses f JOIN cidr_blocks fb ON fb.id = f.cidr_block_id \
     JOIN ip_addresses h ON h.address = f.address AND h.cidr_block_id != f.cidr_block_id \
     JOIN cidr_blocks hb ON hb.id = h.cidr_block_id \
     WHERE f.is_allocated = 0 AND fb.state IN ('Ready', 'Draining') \
       AND h.is_allocated = 1 AND COALESCE(h.container_id, '') != '' \
       AND (hb.network = fb.network OR (\
         fb.network NOT IN (SELECT network FROM metis_networks WHERE isolated = 1) \
         AND hb.network NOT IN (SELECT network FROM metis_networks WHERE isolated = 1))) \
     GROUP BY f.id ORDER BY f.id";

/// Reserves every free row a pod holds through an overlapping block (see
/// the module docs), saying so; then Metis's next open runs the full
/// repair (its layout setting forgotten), which frees them.
fn fence_held_twins(conn: &Connection, out: &mut Downgraded) -> Result<(), StoreError> {
    let twins: Vec<(i64, i64, String, String)> = conn
        .prepare(HELD_TWINS_SQL)?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
        .collect::<Result<_, _>>()?;
    for (row_id, block_id, address, holder) in &twins {
        conn.prepare_cached(RESERVE_ROW_SQL)?.execute([row_id])?;
        conn.prepare_cached(COUNT_CHANGE_SQL)?
            .execute([*block_id, 1])?;
        out.done.push(format!(
            "block {block_id}: {address}, held by container {holder:?} through an overlapping \
             block: reserved, so that upstream never hands it out (Metis's next start frees it)"
        ));
    }
    if !twins.is_empty() {
        conn.prepare_cached("DELETE FROM metis_settings WHERE key IN (?1, ?2)")?
            .execute([schema::KEY_HEALED, schema::KEY_LAYOUT])?;
    }
    Ok(())
}

/// Non-Deleting, non-withheld blocks (a withheld one is out of upstream's
/// reach already), oldest first.
fn live_blocks(conn: &Connection) -> Result<Vec<Live>, StoreError> {
    let rows: Vec<(i64, String, String)> = conn
        .prepare(
            "SELECT id, cidr, network FROM cidr_blocks \
             WHERE state IN ('Ready', 'Draining') ORDER BY id",
        )?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<Result<_, _>>()?;
    rows.into_iter()
        .map(|(id, cidr, network)| {
            Ok(Live {
                id,
                cidr: parse_cidr(&cidr)?,
                network,
            })
        })
        .collect()
}

/// For an IPv6 block without bounds: writes its missing rows below its
/// highest row (when at most [`MAX_RANGE_ROWS`]) and gives that row the
/// highest id, so that upstream's expansion, which starts after the
/// highest-id row, never meets an existing row. Says what it did, and the
/// holes it had to leave.
fn order_for_expansion(
    conn: &Connection,
    block: &Live,
    reserved: &crate::store::rows::block::Reserved,
    out: &mut Downgraded,
) -> Result<(), StoreError> {
    let name = format!(
        "block {} ({}, network {:?})",
        block.id, block.cidr, block.network
    );
    let rows = offsets_by_id(conn, block.id, &block.cidr)?;
    let Some(top) = rows.iter().filter_map(|(_, offset, _)| *offset).max() else {
        return Ok(());
    };
    if top < MAX_RANGE_ROWS {
        let written = insert_rows(conn, block.id, &block.cidr, 0..top, reserved)?;
        if written > 0 {
            out.done.push(format!(
                "{name}: wrote {written} row(s) below its highest address for upstream"
            ));
        }
    } else if (rows.len() as u128) <= top {
        out.warnings.push(format!(
            "{name}: its highest row lies more than {MAX_RANGE_ROWS} addresses into the block; \
             the addresses below it that have no row are not written, and upstream never \
             hands them out"
        ));
    }
    let (top_id, _, text) = rows
        .iter()
        .find(|(_, offset, _)| *offset == Some(top))
        .cloned()
        .unwrap_or_default();
    let block_highest: i64 = conn.query_row(
        "SELECT MAX(id) FROM ip_addresses WHERE cidr_block_id = ?1",
        [block.id],
        |r| r.get(0),
    )?;
    if top_id != block_highest && renumber_last(conn, top_id)? {
        out.done.push(format!(
            "{name}: row {text} (its highest address) now has the highest id, so upstream's \
             IPv6 expansion starts past every existing row"
        ));
    }
    Ok(())
}

/// What upstream's IPv6 expansion would trip on in the file as it is: each
/// live IPv6 block without bounds whose highest-id row is not its highest
/// address (a requested address, a row Metis wrote lazily), in words.
/// [`order_for_expansion`] is the fix.
pub(in crate::store) fn expansion_hazards(
    conn: &Connection,
    mode: ReserveMode,
) -> Result<Vec<String>, StoreError> {
    let mut out = Vec::new();
    for block in live_blocks(conn)? {
        if block.cidr.family() != Family::V6
            || block_reserved(conn, mode, block.id, &block.network, &block.cidr)?.is_bounded()
        {
            continue;
        }
        let rows = offsets_by_id(conn, block.id, &block.cidr)?;
        let (Some(last), Some(top)) = (
            rows.last(),
            rows.iter()
                .filter(|(_, offset, _)| offset.is_some())
                .max_by_key(|(_, offset, _)| *offset),
        ) else {
            continue;
        };
        if last.1 < top.1 {
            out.push(format!(
                "before a rollback: block {} ({}, network {:?}): upstream's IPv6 expansion starts \
                 after its highest-id row {} and would meet the row of {}, failing IPv6 allocations; \
                 `metis admin downgrade` gives that row the highest id",
                block.id, block.cidr, block.network, last.2, top.2
            ));
        }
    }
    Ok(out)
}

/// The block's rows in id order: (id, offset in the block, address).
fn offsets_by_id(
    conn: &Connection,
    block_id: i64,
    cidr: &Cidr,
) -> Result<Vec<(i64, Option<u128>, String)>, StoreError> {
    let rows: Vec<(i64, String)> = conn
        .prepare("SELECT id, address FROM ip_addresses WHERE cidr_block_id = ?1 ORDER BY id")?
        .query_map([block_id], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<Result<_, _>>()?;
    Ok(rows
        .into_iter()
        .map(|(id, text)| {
            let offset = parse_addr(&text).ok().and_then(|a| cidr.offset_of(a));
            (id, offset, text)
        })
        .collect())
}

/// Gives row `id` the highest id of the table, unless it has it already.
/// Row ids are referenced only by `metis_gateways`, which follows.
fn renumber_last(conn: &Connection, id: i64) -> Result<bool, StoreError> {
    let highest: i64 = conn.query_row("SELECT MAX(id) FROM ip_addresses", [], |r| r.get(0))?;
    if highest == id {
        return Ok(false);
    }
    conn.execute(
        "UPDATE ip_addresses SET id = ?2 WHERE id = ?1",
        params![id, highest + 1],
    )?;
    conn.execute(
        "UPDATE metis_gateways SET row_id = ?2 WHERE row_id = ?1",
        params![id, highest + 1],
    )?;
    Ok(true)
}

enum Fence {
    /// The highest-id row's successor already has a row.
    Already,
    /// This row was given the highest id.
    Moved(String),
    /// No row has a successor row.
    Impossible,
}

/// Makes the block's highest-id row one whose next address already has a
/// row of the block (upstream's expansion starts there and then fails on
/// the UNIQUE index). Row ids are referenced only by `metis_gateways`, which
/// follows.
fn fence_expansion(conn: &Connection, block_id: i64, cidr: &Cidr) -> Result<Fence, StoreError> {
    let offsets = offsets_by_id(conn, block_id, cidr)?;
    let present: HashSet<u128> = offsets.iter().filter_map(|(_, o, _)| *o).collect();
    let fenced = |offset: &Option<u128>| offset.is_some_and(|o| present.contains(&(o + 1)));
    if offsets.last().is_some_and(|(_, offset, _)| fenced(offset)) {
        return Ok(Fence::Already);
    }
    // The highest such offset: the fence sits at the range's end.
    let Some((id, _, text)) = offsets
        .iter()
        .filter(|(_, offset, _)| fenced(offset))
        .max_by_key(|(_, offset, _)| *offset)
    else {
        return Ok(Fence::Impossible);
    };
    renumber_last(conn, *id)?;
    Ok(Fence::Moved(text.clone()))
}

/// What a file offered for downgrade holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// Upstream's schema and Metis's tables: a downgrade has work.
    Metis,
    /// Upstream's schema only: upstream already reads it as its own.
    UpstreamOnly,
}

/// Why a file cannot be downgraded (nothing was changed).
#[derive(Debug)]
pub enum Refusal {
    Missing,
    NotAFile,
    ReadOnly,
    NotADatabase(String),
    Newer(i64),
    NotMetis(String),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Missing => f.write_str("no database at this path (nothing was created)"),
            Refusal::NotAFile => f.write_str("not a regular file"),
            Refusal::ReadOnly => f.write_str(
                "the file is read-only (no write permission for its owner); nothing was changed",
            ),
            Refusal::NotADatabase(why) => write!(f, "not an SQLite database: {why}"),
            Refusal::Newer(version) => write!(
                f,
                "schema version {version} is newer than this release understands ({}); \
                 downgrade with the release that wrote it",
                crate::store::db::SCHEMA_VERSION
            ),
            Refusal::NotMetis(why) => write!(f, "not a Metis or upstream Metis database: {why}"),
        }
    }
}

/// Looks at `path` without writing (no file, lock, `-wal` or `-shm`
/// created): whether a downgrade may run on it.
pub fn inspect(path: &std::path::Path) -> Result<FileKind, Refusal> {
    use std::os::unix::fs::PermissionsExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Err(Refusal::Missing),
        Err(err) => return Err(Refusal::NotADatabase(err.to_string())),
    };
    if !meta.is_file() {
        return Err(Refusal::NotAFile);
    }
    // Permission bits, not access(2): root may write anything, but a file
    // its owner made read-only is not to be changed behind their back.
    if meta.permissions().mode() & 0o200 == 0 {
        return Err(Refusal::ReadOnly);
    }
    let conn = Connection::open_with_flags(
        path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| Refusal::NotADatabase(e.to_string()))?;
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(|e| Refusal::NotADatabase(e.to_string()))?;
    if version > crate::store::db::SCHEMA_VERSION {
        return Err(Refusal::Newer(version));
    }
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
        .and_then(|mut stmt| {
            stmt.query_map([], |r| r.get(0))?
                .collect::<Result<Vec<String>, _>>()
        })
        .map_err(|e| Refusal::NotADatabase(e.to_string()))?;
    let has = |name: &str| tables.iter().any(|t| t == name);
    if version != crate::store::db::SCHEMA_VERSION || !has("cidr_blocks") || !has("ip_addresses") {
        return Err(Refusal::NotMetis(format!(
            "user_version {version}, tables cidr_blocks and ip_addresses {}",
            match has("cidr_blocks") && has("ip_addresses") {
                true => "present",
                false => "missing",
            }
        )));
    }
    Ok(match has("metis_settings") {
        true => FileKind::Metis,
        false => FileKind::UpstreamOnly,
    })
}
