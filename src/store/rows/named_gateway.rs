//! The gateways live results name (`metis_gateways`, see
//! [`crate::store::db::schema::GATEWAYS`]): two conflists of one network on one subnet
//! with different gateways each hand out, as an ordinary address, the
//! gateway the other's results name. Every result Metis returns records
//! its gateway in the allocation's transaction; no hand-out takes an
//! address a live record names ([`naming`]); the release deletes the
//! record ([`forget`]). A record counts only while its row is still
//! that allocation (allocated, same owner, same `allocated_at`): another
//! writer may release or reuse the row without knowing the table.

use std::net::IpAddr;

use rusqlite::{Connection, OptionalExtension, params};

use crate::store::db::{Owner, ReserveMode, StoreError};
use crate::store::rows::handout::Unfit;

/// Records that the result returned for allocation row `row_id` names
/// `gateway` ([`crate::store::db::schema::GATEWAYS`]): the row's owner and
/// `allocated_at` are copied from it, and records of an earlier allocation
/// of the row (released by a writer that does not know the table) go.
pub(in crate::store) fn record(
    conn: &Connection,
    row_id: i64,
    gateway: IpAddr,
) -> Result<(), StoreError> {
    conn.prepare_cached(FORGET_STALE_SQL)?.execute([row_id])?;
    conn.prepare_cached(RECORD_NAMED_SQL)?
        .execute(params![row_id, crate::cidr::address_text(gateway)])?;
    Ok(())
}

/// Records gateway `gateway` for row `row_id`, which owner
/// (`container_id`, `interface_name`) took at `allocated_at` in this
/// transaction (`alloc::take_row`): every record the row had was an
/// earlier allocation's. Nothing is recorded for an owner without a
/// container id, as [`record`] does. Two single-table statements, where
/// [`record`]'s copy from the row costs a one-request process (direct mode,
/// which prepares every statement it runs) three times as much to
/// prepare.
pub(in crate::store) fn record_taken(
    conn: &Connection,
    row_id: i64,
    gateway: IpAddr,
    owner: &Owner,
    allocated_at: i64,
) -> Result<(), StoreError> {
    forget(conn, row_id)?;
    if owner.container_id.is_empty() {
        return Ok(());
    }
    conn.prepare_cached(RECORD_TAKEN_SQL)?.execute(params![
        row_id,
        crate::cidr::address_text(gateway),
        owner.container_id,
        owner.interface_name,
        allocated_at
    ])?;
    Ok(())
}

/// Inserts the record of row ?1 naming gateway ?2 for owner (?3, ?4),
/// allocated at ?5.
const RECORD_TAKEN_SQL: &str = "INSERT OR IGNORE INTO metis_gateways \
     (row_id, gateway, container_id, interface_name, allocated_at) VALUES (?1, ?2, ?3, ?4, ?5)";

/// Forgets the gateways results for row `row_id` named: its allocation
/// ends (DEL, GC, roll-back, boot recovery).
pub(in crate::store) fn forget(conn: &Connection, row_id: i64) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM metis_gateways WHERE row_id = ?1")?
        .execute([row_id])?;
    Ok(())
}

/// The live result naming `address` as its gateway, in network `network`
/// or, unless it is isolated, any network sharing the node's address space:
/// `Unfit::NamedGateway`, else `None`.
pub(in crate::store) fn naming(
    conn: &Connection,
    network: &str,
    isolated: bool,
    address: IpAddr,
) -> Result<Option<Unfit>, StoreError> {
    let address = crate::cidr::address_text(address);
    // The join only where a record names the address at all: the common
    // case, an address no result names, then costs one index probe to
    // prepare instead of a three-table join (direct mode prepares every
    // statement it runs).
    let named = conn
        .prepare_cached(NAMED_AT_ALL_SQL)?
        .query_row([&address], |_| Ok(()))
        .optional()?;
    if named.is_none() {
        return Ok(None);
    }
    Ok(conn
        .prepare_cached(NAMING_SQL)?
        .query_row(params![address, network, isolated], |r| {
            Ok(Unfit::NamedGateway {
                container_id: r.get(0)?,
                interface_name: r.get(1)?,
                network: r.get(2)?,
            })
        })
        .optional()?)
}

/// Inserts the record of row ?1 naming gateway ?2 with the row's owner
/// and stamp (nothing when the row holds no pod).
const RECORD_NAMED_SQL: &str = "INSERT OR IGNORE INTO metis_gateways \
     (row_id, gateway, container_id, interface_name, allocated_at) \
     SELECT id, ?2, container_id, COALESCE(interface_name, ''), allocated_at FROM ip_addresses \
     WHERE id = ?1 AND is_allocated = 1 AND COALESCE(container_id, '') != ''";

/// Deletes the records of row ?1 that belong to another allocation of it.
const FORGET_STALE_SQL: &str = "DELETE FROM metis_gateways AS g WHERE g.row_id = ?1 AND NOT EXISTS \
     (SELECT 1 FROM ip_addresses a WHERE a.id = g.row_id AND a.is_allocated = 1 \
        AND a.container_id = g.container_id AND COALESCE(a.interface_name, '') = g.interface_name \
        AND a.allocated_at IS g.allocated_at)";

/// Whether any record, live or not, names ?1 as a gateway: one probe of
/// the gateway index.
pub(in crate::store) const NAMED_AT_ALL_SQL: &str =
    "SELECT 1 FROM metis_gateways WHERE gateway = ?1 LIMIT 1";

/// SQL: record `g` is live — its row `a` is still the allocation it was
/// made for (allocated, same owner, same stamp).
macro_rules! live_record {
    () => {
        "a.is_allocated = 1 AND a.container_id = g.container_id \
         AND COALESCE(a.interface_name, '') = g.interface_name AND a.allocated_at IS g.allocated_at"
    };
}

/// A live record naming ?1 as a gateway in network ?2 or, unless ?3 (the
/// asking network is isolated), any network not isolated: one probe of
/// the gateway index, then the row by its primary key.
pub(in crate::store) const NAMING_SQL: &str = concat!(
    "SELECT g.container_id, g.interface_name, b.network \
     FROM metis_gateways g JOIN ip_addresses a ON a.id = g.row_id \
       JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE g.gateway = ?1 AND ",
    live_record!(),
    " AND (b.network = ?2 OR (?3 = 0 AND b.network NOT IN \
         (SELECT network FROM metis_networks WHERE isolated = 1))) \
     LIMIT 1"
);

/// Every gateway live records name, by the block of the allocations
/// naming it, with how many do.
const LIVE_BY_BLOCK_SQL: &str = concat!(
    "SELECT a.cidr_block_id, g.gateway, COUNT(*) \
     FROM metis_gateways g JOIN ip_addresses a ON a.id = g.row_id WHERE ",
    live_record!(),
    " GROUP BY a.cidr_block_id, g.gateway ORDER BY a.cidr_block_id, g.gateway"
);

/// A gateway live results name, in the block of the allocations naming it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::store) struct NamedIn {
    pub(in crate::store) block_id: i64,
    pub(in crate::store) gateway: String,
    /// How many live results name it.
    pub(in crate::store) results: i64,
}

/// Every gateway live results name. Metis keeps each out of its hand-outs
/// by the record alone, which upstream's store does not read: to upstream
/// it is an ordinary address unless its row is reserved.
pub(in crate::store) fn live_by_block(conn: &Connection) -> Result<Vec<NamedIn>, StoreError> {
    Ok(conn
        .prepare_cached(LIVE_BY_BLOCK_SQL)?
        .query_map([], |r| {
            Ok(NamedIn {
                block_id: r.get(0)?,
                gateway: r.get(1)?,
                results: r.get(2)?,
            })
        })?
        .collect::<Result<_, _>>()?)
}

/// How the row of a named gateway's address stands in its block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::store) enum GatewayRow {
    /// Reserved (allocated, no owner): upstream never hands it out.
    Reserved,
    /// Free: row id.
    Free(i64),
    /// No row yet (a lazily populated block) at a position the block does
    /// not reserve: a downgrade's or upstream's IPv6 expansion would write
    /// it free. (At a reserved position it is [`GatewayRow::Reserved`]:
    /// its row is written reserved.)
    Missing,
    /// Not an address of its block.
    Outside,
    /// A pod holds it: container id.
    Held(String),
}

/// The row of `named`'s gateway in its block, under reservation mode
/// `mode`.
pub(in crate::store) fn gateway_row(
    conn: &Connection,
    mode: ReserveMode,
    named: &NamedIn,
) -> Result<GatewayRow, StoreError> {
    let row: Option<(i64, Option<bool>, String)> = conn
        .prepare_cached(
            "SELECT id, is_allocated, COALESCE(container_id, '') FROM ip_addresses \
             WHERE address = ?1 AND cidr_block_id = ?2",
        )?
        .query_row(params![named.gateway, named.block_id], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .optional()?;
    Ok(match row {
        None => missing_row(conn, mode, named)?,
        Some((id, None | Some(false), _)) => GatewayRow::Free(id),
        Some((_, Some(true), holder)) if holder.is_empty() => GatewayRow::Reserved,
        Some((_, Some(true), holder)) => GatewayRow::Held(holder),
    })
}

/// A named gateway without a row: reserved, missing or outside its block.
fn missing_row(
    conn: &Connection,
    mode: ReserveMode,
    named: &NamedIn,
) -> Result<GatewayRow, StoreError> {
    let (cidr, network): (String, String) = conn
        .prepare_cached("SELECT cidr, network FROM cidr_blocks WHERE id = ?1")?
        .query_row([named.block_id], |r| Ok((r.get(0)?, r.get(1)?)))?;
    let cidr = crate::store::db::parse_cidr(&cidr)?;
    let address = crate::store::db::parse_addr(&named.gateway)?;
    let Some(offset) = cidr.offset_of(address) else {
        return Ok(GatewayRow::Outside);
    };
    let reserved =
        crate::store::rows::block::block_reserved(conn, mode, named.block_id, &network, &cidr)?;
    Ok(match reserved.contains(&offset) {
        true => GatewayRow::Reserved,
        false => GatewayRow::Missing,
    })
}
