//! STATUS's question about the blocks a network already has: would an ADD
//! of a new owner be handed an address from them now? Answered read-only
//! by walking what [`Store::allocate_under`] walks, in its order, through
//! the same hand-out check ([`crate::store::alloc::allocate::fit_row`]): the populated free
//! rows of the servable Ready blocks, then what their growth would add,
//! then (IPv4) the Draining block exhaustion takes back. So a row the
//! check passes over — the gateway a live result names, an address held
//! in an overlapping block, one outside the ranges or bounds in force — is
//! no room for STATUS either. Where it still approximates is said in
//! docs/cni.md ("STATUS").

use rusqlite::{Connection, OptionalExtension, params};

use crate::cidr::{Cidr, Family};
use crate::store::alloc::allocate::{
    CLAIM_SQL, COOLED_SQL, Judge, MAX_EXPANSIONS_PER_BLOCK, candidates_of, fit_address, fit_row,
};
use crate::store::db::{Store, StoreError, parse_cidr};
use crate::store::rows::block::{GROWTH_BATCH, UNDRAINABLE_SQL, block_reserved, frontier};
use crate::store::rows::handout::InForce;

impl Store {
    /// `Ok(())` when an allocation of `family` in `network` under `conf`
    /// would find an address in the network's blocks as they are; else
    /// what the hand-out check passed over on the way, in words (empty
    /// when there was simply nothing free).
    pub(in crate::store) fn first_fit(
        &self,
        network: &str,
        family: Family,
        conf: &InForce,
        now_ms: i64,
    ) -> Result<Result<(), Vec<String>>, StoreError> {
        let (conn, mode) = (&self.conn, self.reserve);
        let mut judge = Judge::new(conn, Some(conf), mode, network, None)?;
        let ready = candidates_of(conn, network, family, &mut judge.records)?;
        if has_room(conn, &mut judge, ready, now_ms)? {
            return Ok(Ok(()));
        }
        // On IPv4 exhaustion the ADD takes back the oldest Draining block and
        // allocates again (`Engine::allocate_family`): judged as a candidate.
        if family == Family::V4 {
            let undrainable: Option<(i64, String)> = conn
                .prepare_cached(UNDRAINABLE_SQL)?
                .query_row(params![network, family.as_str()], |r| r.get(0))
                .optional()?
                .map(|id: i64| {
                    conn.prepare_cached(WITH_ROOM_SQL)?
                        .query_row([id], |r| Ok((r.get(0)?, r.get(1)?)))
                        .optional()
                })
                .transpose()?
                .flatten();
            if let Some((id, cidr)) = undrainable {
                let taken_back = vec![(id, parse_cidr(&cidr)?)];
                if has_room(conn, &mut judge, taken_back, now_ms)? {
                    return Ok(Ok(()));
                }
            }
        }
        Ok(Err(judge.passed_over))
    }
}

/// Block ?1 (id, cidr) when its counter leaves room, as [`candidates_of`]
/// asks of a Ready block.
const WITH_ROOM_SQL: &str =
    "SELECT id, cidr FROM cidr_blocks WHERE id = ?1 AND total_ips > allocated_ips";

/// Whether an allocation would find an address in `candidates`: the
/// servable ones ([`crate::store::layout::gateway::servable`]) the block check passes,
/// their free rows first, then their growth.
fn has_room(
    conn: &Connection,
    judge: &mut Judge,
    candidates: Vec<(i64, Cidr)>,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let (servable, _) =
        crate::store::layout::gateway::servable(conn, judge.gateway_rule(), candidates)?;
    let mut blocks = Vec::with_capacity(servable.len());
    for (id, cidr) in servable {
        if judge.block(conn, id, &cidr)? {
            blocks.push((id, cidr));
        }
    }
    for (id, cidr) in &blocks {
        if free_row_fits(conn, judge, *id, cidr, now_ms)? {
            return Ok(true);
        }
    }
    for (id, cidr) in &blocks {
        if growth_fits(conn, judge, *id, cidr)? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether a populated free, non-cooling row of block `id` passes the
/// hand-out check (the rows [`crate::store::alloc::allocate::claim`] walks).
fn free_row_fits(
    conn: &Connection,
    judge: &mut Judge,
    id: i64,
    cidr: &Cidr,
    now_ms: i64,
) -> Result<bool, StoreError> {
    let mut after = 0i64;
    loop {
        let row: Option<(i64, String)> = conn
            .prepare_cached(CLAIM_SQL)?
            .query_row(params![id, after], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        let Some((row_id, text)) = row else {
            break;
        };
        after = row_id;
        if fit_row(conn, judge, id, cidr, &text)?.is_some() {
            return Ok(true);
        }
    }
    let mut stmt = conn.prepare_cached(COOLED_SQL)?;
    let mut rows = stmt.query(params![id, now_ms])?;
    while let Some(row) = rows.next()? {
        if fit_row(conn, judge, id, cidr, &row.get::<_, String>(1)?)?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether an address block `id`'s growth would add passes the hand-out
/// check: the offsets from its frontier as far as one allocation grows it
/// ([`MAX_EXPANSIONS_PER_BLOCK`] batches), its reserved ones and those
/// that already have a row (judged as rows, or taken) left out.
fn growth_fits(
    conn: &Connection,
    judge: &mut Judge,
    id: i64,
    cidr: &Cidr,
) -> Result<bool, StoreError> {
    let reserved = block_reserved(conn, judge.mode, id, judge.network, cidr)?;
    let usable = reserved.usable(cidr.size());
    let start = frontier(conn, id, cidr)?.max(usable.start);
    let reach = GROWTH_BATCH.saturating_mul(MAX_EXPANSIONS_PER_BLOCK as u128);
    let end = start.saturating_add(reach).min(usable.end);
    for offset in start..end {
        if reserved.contains(&offset) {
            continue;
        }
        let Some(address) = cidr.nth(offset) else {
            break;
        };
        let exists: bool = conn
            .prepare_cached(ROW_EXISTS_SQL)?
            .query_row(params![address.to_string(), id], |r| r.get(0))?;
        if !exists && fit_address(conn, judge, id, cidr, address)?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether block ?2 has a row for address ?1 (the UNIQUE index).
const ROW_EXISTS_SQL: &str =
    "SELECT EXISTS (SELECT 1 FROM ip_addresses WHERE address = ?1 AND cidr_block_id = ?2)";
