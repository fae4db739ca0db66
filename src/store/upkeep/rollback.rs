//! What upstream's store leaves in a Metis database (a rollback, then
//! forward again), found and healed at every writable open — inside the
//! open-time repair (`repair`), one pass — and named by `admin check`:
//!
//! - **revived blocks**: a block Metis retired or quarantined whose state
//!   is `Ready` or `Draining` (upstream's `UndrainOneCIDRBlock`, or a file
//!   from before `Withheld` existed) is withheld again (`withhold`); pods
//!   upstream put there keep their addresses until DEL;
//! - **rows beyond bounds**: upstream's IPv6 expansion starts after the
//!   block's highest-id row and knows no `rangeStart`/`rangeEnd`, so a
//!   bounded block gains rows outside its range. Free ones are reserved
//!   (never handed out, by anyone); held ones stay their pods', and their
//!   release gives them back to the reservation (`block::give_back`);
//! - **rows outside the prefix**: upstream gives a /127 or /128 a full
//!   batch of 64 rows. Free ones are deleted; held ones stay until DEL,
//!   which deletes them (`block::give_back`).
//!
//! Cheap on a clean database: one read of Metis's block records, one read
//! of the highest-id row of each bounded IPv6 block, and a scan of each
//! IPv6 block smaller than a growth batch (rare) — the rows of a bounded
//! block are read only when its highest-id row lies outside the range and
//! is not the gateway's, which only upstream's expansion produces.

use rusqlite::{Connection, OptionalExtension, params};

use crate::cidr::{Bounds, Cidr, Family};
use crate::store::db::connection::Healed;
use crate::store::db::{StoreError, parse_addr, parse_cidr};
use crate::store::rows::block::RESERVE_ROW_SQL;
use crate::store::rows::withhold::{self, Misaligned};

/// A row outside what its block may hand out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stray {
    pub row_id: i64,
    pub block_id: i64,
    pub cidr: Cidr,
    pub network: String,
    pub address: String,
    /// (container, interface) of the pod holding it; `None`: free.
    pub holder: Option<(String, String)>,
}

/// What [`find`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Leftovers {
    pub misaligned: Vec<Misaligned>,
    /// Rows of bounded blocks outside `rangeStart..=rangeEnd`.
    pub beyond_bounds: Vec<Stray>,
    /// Rows of small IPv6 blocks outside the prefix.
    pub outside_prefix: Vec<Stray>,
}

impl Leftovers {
    /// Whether an open must write.
    pub fn changes(&self) -> bool {
        !self.misaligned.is_empty()
            || self.beyond_bounds.iter().any(|s| s.holder.is_none())
            || self.outside_prefix.iter().any(|s| s.holder.is_none())
    }

    /// Each finding in words: what was (or the next open will be) done.
    /// Free rows are summed per block; held ones are named one by one.
    pub fn describe(&self, healed: bool) -> Vec<String> {
        let mut out: Vec<String> = self.misaligned.iter().map(Misaligned::describe).collect();
        let kinds = [
            (
                &self.beyond_bounds,
                "outside rangeStart..rangeEnd now in force",
                if healed {
                    "reserved"
                } else {
                    "the next open reserves them"
                },
            ),
            (
                &self.outside_prefix,
                "outside the prefix (upstream's rows of a /127 or /128)",
                if healed {
                    "deleted"
                } else {
                    "the next open deletes them"
                },
            ),
        ];
        for (strays, what, fix) in kinds {
            let mut free: Vec<(&Stray, usize)> = Vec::new();
            for stray in strays {
                match &stray.holder {
                    None => match free.last_mut() {
                        Some((first, count)) if first.block_id == stray.block_id => *count += 1,
                        _ => free.push((stray, 1)),
                    },
                    Some((container, ifname)) => out.push(format!(
                        "{}: address {} {what} is held by container {container:?} interface {ifname:?}; \
                         left to it, never handed out again after its DEL",
                        block_name(stray),
                        stray.address
                    )),
                }
            }
            for (first, count) in free {
                out.push(format!(
                    "{}: {count} free row(s) {what}, from {}; {fix}",
                    block_name(first),
                    first.address
                ));
            }
        }
        out
    }
}

fn block_name(stray: &Stray) -> String {
    format!(
        "block {} ({}, network {:?})",
        stray.block_id, stray.cidr, stray.network
    )
}

/// What upstream left, read only.
pub(in crate::store) fn find(conn: &Connection) -> Result<Leftovers, StoreError> {
    Ok(Leftovers {
        misaligned: withhold::misaligned(conn)?,
        beyond_bounds: beyond_bounds(conn)?,
        outside_prefix: outside_prefix(conn)?,
    })
}

/// Heals what [`find`] found (inside the caller's write transaction, which
/// found it under the same lock).
pub(in crate::store) fn heal(
    conn: &Connection,
    found: &Leftovers,
    now_ms: i64,
) -> Result<Healed, StoreError> {
    let settled = withhold::settle(conn, now_ms)?;
    let mut healed = Healed {
        revived_blocks: settled.iter().filter(|m| m.revived()).count() as u64,
        ..Healed::default()
    };
    let mut reserve = conn.prepare_cached(RESERVE_ROW_SQL)?;
    let mut bump = conn.prepare_cached(crate::store::rows::block::COUNT_CHANGE_SQL)?;
    for stray in found.beyond_bounds.iter().filter(|s| s.holder.is_none()) {
        if reserve.execute([stray.row_id])? > 0 {
            bump.execute([stray.block_id, 1])?;
            healed.rows_beyond_bounds += 1;
        }
    }
    let mut delete =
        conn.prepare_cached("DELETE FROM ip_addresses WHERE id = ?1 AND is_allocated = FALSE")?;
    for stray in found.outside_prefix.iter().filter(|s| s.holder.is_none()) {
        healed.rows_outside_prefix += delete.execute([stray.row_id])? as u64;
    }
    Ok(healed)
}

/// Rows of bounded IPv6 blocks outside their usable range that are not
/// reservations. IPv4 blocks get no rows from upstream (it only takes free
/// ones, which Metis keeps inside the range).
fn beyond_bounds(conn: &Connection) -> Result<Vec<Stray>, StoreError> {
    let bounded: Vec<(i64, String, String, String, String, String)> = conn
        .prepare_cached(
            "SELECT b.id, b.cidr, b.network, r.range_start, r.range_end, r.gateway \
             FROM metis_bounds r JOIN cidr_blocks b ON b.network = r.network AND b.cidr = r.cidr \
             WHERE b.ip_family = 'ipv6' AND b.state != 'Deleting' ORDER BY b.id",
        )?
        .query_map([], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
            ))
        })?
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for (id, cidr, network, start, end, gateway) in bounded {
        let cidr = parse_cidr(&cidr)?;
        let bounds = Bounds {
            start: parse_addr(&start)?,
            end: parse_addr(&end)?,
            gateway: parse_addr(&gateway)?,
        };
        let (gateway, first, last_usable) = bounds.offsets(&cidr);
        let outside = |address: &str| {
            parse_addr(address)
                .ok()
                .and_then(|a| cidr.offset_of(a))
                .is_none_or(|offset| offset < first || offset > last_usable)
        };
        // Only upstream's expansion (after the highest-id row) leaves a row
        // outside the range with the highest id — Metis's own reservations
        // there are the gateway's. The rows are read only then (and for
        // as long as the rows it left are there).
        let last: Option<String> = conn
            .prepare_cached(
                "SELECT address FROM ip_addresses WHERE cidr_block_id = ?1 ORDER BY id DESC LIMIT 1",
            )?
            .query_row([id], |r| r.get(0))
            .optional()?;
        let is_gateway = |address: &str| {
            gateway.is_some() && parse_addr(address).ok().and_then(|a| cidr.offset_of(a)) == gateway
        };
        if !last.is_some_and(|address| outside(&address) && !is_gateway(&address)) {
            continue;
        }
        for row in block_rows(conn, id)? {
            let reservation = row.allocated && row.container.is_empty();
            if outside(&row.address) && !reservation {
                out.push(row.into_stray(id, cidr, &network));
            }
        }
    }
    Ok(out)
}

/// Bounded IPv6 blocks whose gateway row sits just above `rangeEnd`:
/// harmless to Metis, but upstream's expansion of the range, once it is
/// used up, starts at that row and fails on the UNIQUE index — every later
/// IPv6 ADD of upstream's in that network fails (nothing is handed out
/// past the range). In words; the daemon logs them at start, `admin
/// downgrade` prints them.
pub(in crate::store) fn gateway_above_range(conn: &Connection) -> Result<Vec<String>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT b.id, b.cidr, b.network, r.range_end, r.gateway FROM metis_bounds r \
         JOIN cidr_blocks b ON b.network = r.network AND b.cidr = r.cidr \
         WHERE b.ip_family = 'ipv6' AND b.state != 'Deleting' \
           AND EXISTS (SELECT 1 FROM ip_addresses a WHERE a.address = r.gateway AND a.cidr_block_id = b.id) \
         ORDER BY b.id",
    )?;
    let rows: Vec<(i64, String, String, String, String)> = stmt
        .query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })?
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for (id, cidr, network, end, gateway) in rows {
        let (end, gateway) = (parse_addr(&end)?, parse_addr(&gateway)?);
        if crate::cidr::to_u128(gateway) == crate::cidr::to_u128(end).wrapping_add(1) {
            out.push(format!(
                "block {id} ({cidr}, network {network:?}): its gateway row {gateway} sits just above \
                 rangeEnd {end}; under upstream Metis, once the range is used up, every IPv6 ADD in \
                 the network fails with a UNIQUE error (no address past the range is handed out)"
            ));
        }
    }
    Ok(out)
}

/// Rows of IPv6 blocks smaller than a batch of 64 that lie outside the
/// block's prefix.
fn outside_prefix(conn: &Connection) -> Result<Vec<Stray>, StoreError> {
    let blocks: Vec<(i64, String, String)> = conn
        .prepare_cached(
            "SELECT id, cidr, network FROM cidr_blocks \
             WHERE ip_family = 'ipv6' AND state != 'Deleting' AND total_ips < 64 ORDER BY id",
        )?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for (id, cidr, network) in blocks {
        let cidr = parse_cidr(&cidr)?;
        if cidr.family() != Family::V6 {
            continue;
        }
        for row in block_rows(conn, id)? {
            if !parse_addr(&row.address).is_ok_and(|a| cidr.contains(a)) {
                out.push(row.into_stray(id, cidr, &network));
            }
        }
    }
    Ok(out)
}

struct Row {
    id: i64,
    address: String,
    allocated: bool,
    container: String,
    interface: String,
}

impl Row {
    fn into_stray(self, block_id: i64, cidr: Cidr, network: &str) -> Stray {
        let held = self.allocated && !self.container.is_empty();
        Stray {
            row_id: self.id,
            block_id,
            cidr,
            network: network.to_string(),
            address: self.address,
            holder: held.then_some((self.container, self.interface)),
        }
    }
}

fn block_rows(conn: &Connection, block_id: i64) -> Result<Vec<Row>, StoreError> {
    let rows = conn
        .prepare_cached(
            "SELECT id, address, is_allocated, COALESCE(container_id, ''), \
                    COALESCE(interface_name, '') FROM ip_addresses WHERE cidr_block_id = ?1 ORDER BY id",
        )?
        .query_map(params![block_id], |r| {
            Ok(Row {
                id: r.get(0)?,
                address: r.get(1)?,
                allocated: r.get(2)?,
                container: r.get(3)?,
                interface: r.get(4)?,
            })
        })?
        .collect::<Result<_, _>>()?;
    Ok(rows)
}

impl crate::store::db::connection::Store {
    /// What this open healed of what upstream's store left (see
    /// `rollback`).
    pub fn rollback_repairs(&self) -> crate::store::upkeep::rollback::Healed {
        self.healed
    }
    /// What would go wrong under upstream's store that Metis does not
    /// change (see `crate::store::upkeep::rollback::gateway_above_range`), in words.
    pub fn upstream_hazards(&self) -> Result<Vec<String>, StoreError> {
        crate::store::upkeep::rollback::gateway_above_range(&self.conn)
    }
}
