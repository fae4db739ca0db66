//! The repair run at open: brings any database — including one written
//! by upstream — in line with the reservation mode in force (reserved rows
//! where the mode reserves, none elsewhere, no row outside its prefix).

use crate::store::layout::blocks::{self, Isolation};
use crate::store::upkeep::check::Report;
use std::collections::{HashMap, HashSet};

use rusqlite::{Connection, OptionalExtension, params};

use crate::cidr::{Cidr, Family};
use crate::store::db::schema;
use crate::store::db::{
    BlockState, ReserveMode, Store, StoreError, get_setting, parse_cidr, parse_family, parse_state,
    set_setting,
};
use crate::store::rows::block::{
    COUNT_CHANGE_SQL, FREE_RESERVED_ROW_SQL, RESERVE_ROW_SQL, Reserved, bounds_of, insert_rows,
    reserved_offsets,
};
use crate::store::upkeep::rollback;

#[derive(Default)]
struct Plan {
    /// (row id, block id) of free rows to reserve.
    reserve: Vec<(i64, i64)>,
    /// (row id, block id) of reserved rows to free.
    free: Vec<(i64, i64)>,
    /// (block id, cidr, offset) of reserved positions beyond the block's
    /// frontier (no row yet), inserted reserved so counters count them.
    insert: Vec<(i64, Cidr, u128)>,
    warnings: Vec<String>,
    /// The full (expensive) part ran; record the layout marker.
    mark: bool,
    /// Blocks with host-local bounds: their reserved rows outside the
    /// usable range are not strays.
    bounded: HashMap<i64, (Cidr, Reserved)>,
}

impl Plan {
    fn changes(&self) -> bool {
        !self.reserve.is_empty() || !self.free.is_empty() || !self.insert.is_empty() || self.mark
    }
}

/// Every reserved row (allocated, no owner).
const RESERVED_ROWS_SQL: &str = "SELECT id, address, cidr_block_id FROM ip_addresses \
     WHERE container_id = '' AND is_allocated = 1";

/// The reserved rows whose address a result names as its gateway: what
/// `admin downgrade` reserved for upstream (`downgrade::fence_named_gateways`).
/// One probe of the address index per recorded gateway.
const FENCED_GATEWAYS_SQL: &str = "SELECT id, address, cidr_block_id FROM ip_addresses \
     WHERE address IN (SELECT gateway FROM metis_gateways) \
       AND container_id = '' AND is_allocated = 1";

/// A block the repair looks at (not Deleting, parseable).
struct RepairBlock {
    id: i64,
    cidr: Cidr,
    network: String,
}

/// What the repair would change under `mode`; reads only.
fn plan(conn: &Connection, mode: ReserveMode) -> Result<Plan, StoreError> {
    let mut plan = Plan::default();
    let layout = get_setting(conn, schema::KEY_LAYOUT)?;
    // The full part scans rows; it runs once per mode change.
    plan.mark = layout.as_deref() != Some(mode.as_str());
    let (blocks, first_v4) = plan.live_blocks(conn)?;
    let expected = plan.reserve_positions(conn, mode, &blocks, &first_v4)?;
    // The full pass frees every stray; otherwise only the gateways a
    // downgrade reserved for upstream (their records keep them out here).
    let strays = match plan.mark {
        true => RESERVED_ROWS_SQL,
        false => FENCED_GATEWAYS_SQL,
    };
    plan.free_stray_reservations(conn, &expected, strays)?;
    Ok(plan)
}

impl Plan {
    /// The blocks to repair, and the first IPv4 block id of each network
    /// (Deleting blocks count for that, as the allocator counts them).
    /// Unparseable blocks are warned about and skipped.
    fn live_blocks(
        &mut self,
        conn: &Connection,
    ) -> Result<(Vec<RepairBlock>, HashMap<String, i64>), StoreError> {
        let mut blocks = Vec::new();
        let mut first_v4: HashMap<String, i64> = HashMap::new();
        let mut stmt = conn.prepare_cached(
            "SELECT id, cidr, network, ip_family, state FROM cidr_blocks ORDER BY id",
        )?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let id: i64 = row.get(0)?;
            let cidr_text: String = row.get(1)?;
            let network: String = row.get(2)?;
            let family_text: String = row.get(3)?;
            let state_text: String = row.get(4)?;
            let (family, state) = match (parse_family(&family_text), parse_state(&state_text)) {
                (Ok(f), Ok(s)) => (f, s),
                (Err(e), _) | (_, Err(e)) => {
                    self.warnings.push(format!("block {id}: {e}; not repaired"));
                    continue;
                }
            };
            if family == Family::V4 {
                first_v4.entry(network.clone()).or_insert(id);
            }
            if state == BlockState::Deleting {
                continue;
            }
            let cidr = match parse_cidr(&cidr_text) {
                Ok(c) => c,
                Err(e) => {
                    self.warnings.push(format!("block {id}: {e}; not repaired"));
                    continue;
                }
            };
            blocks.push(RepairBlock { id, cidr, network });
        }
        Ok((blocks, first_v4))
    }

    /// Plans reserving the free rows at reserved positions; a pod holding
    /// one is warned about and left alone. Returns each block's reserved
    /// addresses.
    fn reserve_positions(
        &mut self,
        conn: &Connection,
        mode: ReserveMode,
        blocks: &[RepairBlock],
        first_v4: &HashMap<String, i64>,
    ) -> Result<HashMap<i64, HashSet<String>>, StoreError> {
        let mut lookup = conn.prepare_cached(
            "SELECT id, is_allocated, COALESCE(container_id, ''), COALESCE(interface_name, '') \
             FROM ip_addresses WHERE address = ?1 AND cidr_block_id = ?2",
        )?;
        let mut expected: HashMap<i64, HashSet<String>> = HashMap::new();
        for block in blocks {
            let first = first_v4.get(&block.network) == Some(&block.id);
            let offsets = match bounds_of(conn, &block.network, &block.cidr)? {
                Some(bounds) => {
                    let reserved = Reserved::bounded(&block.cidr, &bounds);
                    self.bounded.insert(block.id, (block.cidr, reserved));
                    bounds.offsets(&block.cidr).0.into_iter().collect()
                }
                None => reserved_offsets(&block.cidr, mode, first),
            };
            let mut set = HashSet::new();
            for offset in offsets {
                let Some(addr) = block.cidr.nth(offset) else {
                    continue;
                };
                let text = addr.to_string();
                let row: Option<(i64, bool, String, String)> = lookup
                    .query_row(params![text, block.id], |r| {
                        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                    })
                    .optional()?;
                match row {
                    None => self.insert.push((block.id, block.cidr, offset)),
                    Some((row_id, false, _, _)) => self.reserve.push((row_id, block.id)),
                    Some((_, true, cid, _)) if cid.is_empty() => {}
                    Some((_, true, cid, ifname)) => self.warnings.push(format!(
                        "store: block {} ({}, network {:?}): reserved address {addr} is held by container {cid:?} interface {ifname:?}; left alone until released",
                        block.id, block.cidr, block.network
                    )),
                }
                set.insert(text);
            }
            expected.insert(block.id, set);
        }
        Ok(expected)
    }

    /// Plans freeing the reserved rows `strays` selects (id, address,
    /// block) at positions the mode does not reserve.
    fn free_stray_reservations(
        &mut self,
        conn: &Connection,
        expected: &HashMap<i64, HashSet<String>>,
        strays: &str,
    ) -> Result<(), StoreError> {
        let mut stmt = conn.prepare_cached(strays)?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let row_id: i64 = row.get(0)?;
            let address: String = row.get(1)?;
            let block_id: i64 = row.get(2)?;
            let outside_bounds = self.bounded.get(&block_id).is_some_and(|(cidr, reserved)| {
                address
                    .parse()
                    .ok()
                    .and_then(|addr| cidr.offset_of(addr))
                    .is_some_and(|offset| reserved.contains(&offset))
            });
            if let Some(set) = expected.get(&block_id)
                && !set.contains(&address)
                && !outside_bounds
            {
                self.free.push((row_id, block_id));
            }
        }
        Ok(())
    }
}

impl Store {
    /// Brings reservations in line with the mode and heals what other
    /// writers left (`rollback`). Read-only unless something must change,
    /// or the file is clean and not yet stamped so ([`proven_healed`]).
    pub(in crate::store) fn repair(&mut self) -> Result<(), StoreError> {
        let mode = self.reserve;
        let first = plan(&self.conn, mode)?;
        let left = rollback::find(&self.conn)?;
        if !first.changes() && !left.changes() && !settles_clean(&first, &left) {
            self.warnings.extend(first.warnings);
            self.warnings.extend(store_lines(left.describe(false)));
            return Ok(());
        }
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        // Re-plan under the write lock: another process may have repaired.
        let plan = plan(&tx, mode)?;
        let left = rollback::find(&tx)?;
        {
            let mut reserve = tx.prepare_cached(RESERVE_ROW_SQL)?;
            let mut free = tx.prepare_cached(FREE_RESERVED_ROW_SQL)?;
            let mut bump = tx.prepare_cached(COUNT_CHANGE_SQL)?;
            for &(row_id, block_id) in &plan.reserve {
                if reserve.execute([row_id])? > 0 {
                    bump.execute([block_id, 1])?;
                }
            }
            for &(row_id, block_id) in &plan.free {
                if free.execute([row_id])? > 0 {
                    bump.execute([block_id, -1])?;
                }
            }
            for (block_id, cidr, offset) in &plan.insert {
                let at = *offset..offset.saturating_add(1);
                insert_rows(&tx, *block_id, cidr, at, &Reserved::fixed(vec![*offset]))?;
            }
            if plan.mark {
                set_setting(&tx, schema::KEY_LAYOUT, mode.as_str())?;
            }
        }
        self.healed = rollback::heal(&tx, &left, crate::log::now_ms())?;
        if settles_clean(&plan, &left) {
            set_setting(&tx, schema::KEY_HEALED, &healed_state(&tx)?)?;
        }
        tx.commit()?;
        self.warnings.extend(plan.warnings);
        self.warnings.extend(store_lines(left.describe(true)));
        Ok(())
    }
}

/// Whether healing what `plan` and `left` found leaves the file clean:
/// nothing it warns about, no pod holding a row it would heal once free.
/// Only then may the file be stamped healed: a row a pod holds outside its
/// block's range becomes something to heal when anyone (upstream too)
/// releases it, a write the stamp does not see.
fn settles_clean(plan: &Plan, left: &rollback::Leftovers) -> bool {
    plan.warnings.is_empty()
        && left
            .beyond_bounds
            .iter()
            .chain(&left.outside_prefix)
            .all(|stray| stray.holder.is_none())
}

/// Whether the file is exactly as the healing last left it clean: its
/// [`healed_state`] is the one recorded under [`schema::KEY_HEALED`] then.
/// An open may then skip the schema check and the healing: whoever wrote since (Metis's own requests, upstream's
/// allocations and releases) only allocated and released rows that were
/// there, which leaves nothing to heal in a clean file; any other write (a
/// block added, drained, undrained, a row inserted, a retirement, bounds,
/// the mode, the schema) changes the state. False when it cannot be read
/// (no settings table yet, an old file): the open then checks and heals
/// everything, as before.
pub(in crate::store) fn proven_healed(conn: &Connection) -> bool {
    match get_setting(conn, schema::KEY_HEALED) {
        Ok(Some(recorded)) => healed_state(conn).is_ok_and(|now| now == recorded),
        _ => false,
    }
}

/// The file's healed state as one text: which Metis healed (its version
/// and the size of its own tables' definitions: another Metis may check
/// more, or expect other tables), the schema's versions, the rows of
/// [`schema::HEALED_STATE`], the reservation mode and the layout mark.
fn healed_state(conn: &Connection) -> Result<String, StoreError> {
    use rusqlite::types::ValueRef;
    use std::fmt::Write;
    let versions = |name| conn.pragma_query_value(None, name, |r| r.get::<_, i64>(0));
    let own_tables: usize = schema::METIS_TABLES.iter().map(|(_, sql)| sql.len()).sum();
    let mut state = format!(
        "{} {own_tables} {} {}",
        env!("CARGO_PKG_VERSION"),
        versions("user_version")?,
        versions("schema_version")?
    );
    let mut stmt = conn.prepare(schema::HEALED_STATE)?;
    // Every arm's columns, however many the statement has.
    let columns = stmt.column_count();
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        state.push('|');
        for column in 0..columns {
            match row.get_ref(column)? {
                ValueRef::Null => state.push('-'),
                ValueRef::Integer(value) => {
                    let _ = write!(state, "{value}");
                }
                ValueRef::Text(text) => state.push_str(&String::from_utf8_lossy(text)),
                other => {
                    let _ = write!(state, "{other:?}");
                }
            }
            state.push(' ');
        }
    }
    for key in [schema::KEY_RESERVE_MODE, schema::KEY_LAYOUT] {
        state.push('|');
        state.push_str(get_setting(conn, key)?.as_deref().unwrap_or("-"));
    }
    Ok(state)
}

/// Findings as the open's warnings say them.
fn store_lines(lines: Vec<String>) -> impl Iterator<Item = String> {
    lines.into_iter().map(|line| format!("store: {line}"))
}

/// What the healing would do to the file as it is: lines naming each thing
/// it would change or leave pending (none: the file is healed clean).
#[cfg(test)]
pub(in crate::store) fn pending(
    conn: &Connection,
    mode: ReserveMode,
) -> Result<Vec<String>, StoreError> {
    let plan = plan(conn, mode)?;
    let left = rollback::find(conn)?;
    let mut lines = left.describe(false);
    lines.extend(plan.warnings.iter().cloned());
    let changes = [
        ("rows to reserve", plan.reserve.len()),
        ("reserved rows to free", plan.free.len()),
        ("reserved rows to insert", plan.insert.len()),
        ("layout marks", usize::from(plan.mark)),
    ];
    for (what, count) in changes {
        if count > 0 {
            lines.push(format!("{count} {what}"));
        }
    }
    Ok(lines)
}

impl Store {
    /// Fail safe instead of fail stop, run by the daemon at start (`admin
    /// check` only reports): after a row-level check recounts wrong
    /// counters; deletes the pod-less side of overlapping blocks, and
    /// quarantines every block it cannot trust (`suspects` from a check,
    /// and overlaps with pods on both sides). Quarantine is recomputed from
    /// scratch each time, so a block whose problem is gone is served again.
    pub fn isolate_problems(
        &mut self,
        report: &Report,
        now_ms: i64,
    ) -> Result<Isolation, StoreError> {
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let mut isolation = Isolation {
            // Only the blocks a row-level check found miscounted: counting
            // a block's rows reads every row.
            recounted: crate::store::rows::block::recount(&tx, &report.miscounted)?,
            ..Isolation::default()
        };
        crate::store::rows::block::clear_quarantines(&tx)?;
        let mut marks = report.suspects.clone();
        blocks::resolve_overlaps(&tx, &mut marks, &mut isolation.deleted, now_ms)?;
        for (id, why) in &marks {
            crate::store::rows::block::quarantine(&tx, *id, why)?;
        }
        crate::store::rows::withhold::settle(&tx, now_ms)?;
        isolation.quarantined = crate::store::rows::block::quarantined(&tx)?;
        tx.commit()?;
        Ok(isolation)
    }
}
