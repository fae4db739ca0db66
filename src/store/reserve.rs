//! Reserved addresses (network, gateway, broadcast) and the repair run at
//! open that brings any database — including one written by upstream — in
//! line with the reservation mode in force.

use std::collections::{HashMap, HashSet};

use rusqlite::{Connection, OptionalExtension, params};

use super::{
    ReserveMode, Store, StoreError, parse_addr, parse_cidr, parse_family, parse_state, schema,
};
use crate::cidr::{Bounds, Cidr, Family};

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
pub(super) fn is_first_v4(conn: &Connection, network: &str, id: i64) -> Result<bool, StoreError> {
    let first: Option<i64> = conn
        .prepare_cached(
            "SELECT MIN(id) FROM cidr_blocks WHERE network = ?1 AND ip_family = 'ipv4'",
        )?
        .query_row([network], |r| r.get(0))?;
    Ok(first == Some(id))
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
pub(super) fn bounds_of(
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

/// After a block's bounds changed: rows exist from the old range start up
/// to the frontier, so a range that now starts lower needs growth from its
/// new start (rows already there are passed over once, at the next growth).
fn rewind_frontier(
    conn: &Connection,
    mode: ReserveMode,
    id: i64,
    network: &str,
    cidr: &Cidr,
) -> Result<(), StoreError> {
    let start = block_reserved(conn, mode, id, network, cidr)?
        .usable(cidr.size())
        .start;
    if start < super::alloc::frontier(conn, id, cidr)? {
        super::set_setting(conn, &super::alloc::frontier_key(id), &start.to_string())?;
    }
    Ok(())
}

/// The reserved positions of an existing block under `mode`: its
/// host-local bounds when it has some, else the mode's fixed offsets.
pub(super) fn block_reserved(
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

#[derive(Default)]
struct Plan {
    /// (row id, block id) of free rows to reserve.
    reserve: Vec<(i64, i64)>,
    /// (row id, block id) of reserved rows to free.
    free: Vec<(i64, i64)>,
    /// Free rows outside their block's prefix (upstream's /127, /128 bug).
    delete: Vec<i64>,
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
        !self.reserve.is_empty()
            || !self.free.is_empty()
            || !self.delete.is_empty()
            || !self.insert.is_empty()
            || self.mark
    }
}

/// A block the repair looks at (not Deleting, parseable).
struct RepairBlock {
    id: i64,
    cidr: Cidr,
    network: String,
}

/// What the repair would change under `mode`; reads only.
fn plan(conn: &Connection, mode: ReserveMode) -> Result<Plan, StoreError> {
    let mut plan = Plan::default();
    let layout = super::get_setting(conn, schema::KEY_LAYOUT)?;
    // The full part scans rows; it runs once per mode change.
    plan.mark = layout.as_deref() != Some(mode.as_str());
    let (blocks, first_v4) = plan.live_blocks(conn)?;
    let expected = plan.reserve_positions(conn, mode, &blocks, &first_v4)?;
    if plan.mark {
        plan.free_stray_reservations(conn, &expected)?;
        plan.delete_rows_outside_prefix(conn, &blocks)?;
    }
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
            if state == super::BlockState::Deleting {
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

    /// Plans freeing reserved rows at positions the mode does not reserve.
    fn free_stray_reservations(
        &mut self,
        conn: &Connection,
        expected: &HashMap<i64, HashSet<String>>,
    ) -> Result<(), StoreError> {
        let mut stmt = conn.prepare_cached(
            "SELECT id, address, cidr_block_id FROM ip_addresses \
             WHERE container_id = '' AND is_allocated = 1",
        )?;
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

    /// Plans deleting free rows outside a small IPv6 block's prefix
    /// (upstream inserted a full batch of 64 even for /127 and /128).
    fn delete_rows_outside_prefix(
        &mut self,
        conn: &Connection,
        blocks: &[RepairBlock],
    ) -> Result<(), StoreError> {
        let mut stmt = conn.prepare_cached(
            "SELECT id, address, is_allocated FROM ip_addresses WHERE cidr_block_id = ?1",
        )?;
        for block in blocks
            .iter()
            .filter(|b| b.cidr.family() == Family::V6 && b.cidr.size() < 64)
        {
            let mut rows = stmt.query([block.id])?;
            while let Some(row) = rows.next()? {
                let row_id: i64 = row.get(0)?;
                let address: String = row.get(1)?;
                let allocated: bool = row.get(2)?;
                let inside = address
                    .parse()
                    .map(|a| block.cidr.contains(a))
                    .unwrap_or(false);
                if inside {
                    continue;
                }
                if allocated {
                    self.warnings.push(format!(
                        "store: block {} ({}): allocated row {address:?} lies outside the prefix; left alone",
                        block.id, block.cidr
                    ));
                } else {
                    self.delete.push(row_id);
                }
            }
        }
        Ok(())
    }
}

/// A network's recorded bounds of one family, by block prefix.
fn recorded_bounds(
    conn: &Connection,
    network: &str,
    family: Family,
) -> Result<Vec<(String, Bounds)>, StoreError> {
    let rows: Vec<String> = conn
        .prepare_cached("SELECT cidr FROM metis_bounds WHERE network = ?1 ORDER BY cidr")?
        .query_map([network], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    let mut recorded = Vec::new();
    for text in rows {
        let cidr = parse_cidr(&text)?;
        if cidr.family() != family {
            continue;
        }
        if let Some(bounds) = bounds_of(conn, network, &cidr)? {
            recorded.push((text, bounds));
        }
    }
    Ok(recorded)
}

impl Store {
    /// Records the host-local bounds of `network`'s `family` blocks (the
    /// CNI ranges that have some; the others lose theirs) and re-reserves
    /// every block whose bounds changed, pods keeping their addresses.
    /// Reads only when nothing changed, so it runs on every ADD. Returns
    /// the prefixes whose reservation changed.
    pub fn set_bounds(
        &mut self,
        network: &str,
        family: Family,
        wanted: &[(Cidr, Bounds)],
    ) -> Result<Vec<String>, StoreError> {
        let mut want: Vec<(String, Bounds)> = wanted
            .iter()
            .filter(|(cidr, _)| cidr.family() == family)
            .map(|(cidr, bounds)| (cidr.to_string(), *bounds))
            .collect();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        let have = recorded_bounds(&self.conn, network, family)?;
        if have == want {
            return Ok(Vec::new());
        }
        let mut changed: Vec<String> = have
            .iter()
            .filter(|entry| !want.contains(entry))
            .chain(want.iter().filter(|entry| !have.contains(entry)))
            .map(|(cidr, _)| cidr.clone())
            .collect();
        changed.sort();
        changed.dedup();
        let mode = self.reserve;
        let tx = super::write(&mut self.conn, self.batch)?;
        for (cidr, _) in &have {
            tx.prepare_cached("DELETE FROM metis_bounds WHERE network = ?1 AND cidr = ?2")?
                .execute(params![network, cidr])?;
        }
        for (cidr, bounds) in &want {
            tx.prepare_cached(
                "INSERT INTO metis_bounds (network, cidr, range_start, range_end, gateway) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                network,
                cidr,
                bounds.start.to_string(),
                bounds.end.to_string(),
                bounds.gateway.to_string()
            ])?;
        }
        for text in &changed {
            let block: Option<i64> = tx
                .prepare_cached(
                    "SELECT id FROM cidr_blocks WHERE network = ?1 AND cidr = ?2 \
                     AND state != 'Deleting'",
                )?
                .query_row(params![network, text], |r| r.get(0))
                .optional()?;
            if let Some(id) = block {
                let cidr = parse_cidr(text)?;
                rewind_frontier(&tx, mode, id, network, &cidr)?;
                super::layout::settle(&tx, mode, id, network, &cidr)?;
            }
        }
        tx.commit()?;
        Ok(changed)
    }

    /// Brings reservations in line with the mode. Read-only unless
    /// something must change.
    pub(super) fn repair(&mut self) -> Result<(), StoreError> {
        let mode = self.reserve;
        let first = plan(&self.conn, mode)?;
        if !first.changes() {
            self.warnings.extend(first.warnings);
            return Ok(());
        }
        let tx = super::write(&mut self.conn, self.batch)?;
        // Re-plan under the write lock: another process may have repaired.
        let plan = plan(&tx, mode)?;
        {
            let mut reserve = tx.prepare_cached(
                "UPDATE ip_addresses SET is_allocated = 1, container_id = '', interface_name = '', \
                 pod_name = NULL, pod_namespace = NULL, release_at = NULL \
                 WHERE id = ?1 AND is_allocated = FALSE",
            )?;
            let mut free = tx.prepare_cached(
                "UPDATE ip_addresses SET is_allocated = 0, release_at = NULL \
                 WHERE id = ?1 AND is_allocated = 1 AND container_id = ''",
            )?;
            let mut delete = tx.prepare_cached(
                "DELETE FROM ip_addresses WHERE id = ?1 AND is_allocated = FALSE",
            )?;
            let mut bump = tx.prepare_cached(
                "UPDATE cidr_blocks SET allocated_ips = COALESCE(allocated_ips, 0) + ?2 WHERE id = ?1",
            )?;
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
            for &row_id in &plan.delete {
                delete.execute([row_id])?;
            }
            for (block_id, cidr, offset) in &plan.insert {
                let at = *offset..offset.saturating_add(1);
                super::alloc::insert_rows(
                    &tx,
                    *block_id,
                    cidr,
                    at,
                    &Reserved::fixed(vec![*offset]),
                )?;
            }
            if plan.mark {
                super::set_setting(&tx, schema::KEY_LAYOUT, mode.as_str())?;
            }
        }
        tx.commit()?;
        self.warnings.extend(plan.warnings);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Source;
    use crate::testutil::{TempDir, assert_sound, cidr, owner};

    const NOW: i64 = 1_000_000;

    fn bounded(
        store: &mut Store,
        subnet: &str,
        start: &str,
        end: &str,
        gateway: &str,
    ) -> Vec<String> {
        let net = cidr(subnet);
        store
            .configure(Source::Cni, "pods", net.family(), &[net], false, NOW)
            .unwrap();
        let bounds = Bounds::new(
            &net,
            Some(start.parse().unwrap()),
            Some(end.parse().unwrap()),
            Some(gateway.parse().unwrap()),
        )
        .unwrap();
        store
            .set_bounds("pods", net.family(), &[(net, bounds)])
            .unwrap()
    }

    fn take_all(store: &mut Store, family: Family) -> Vec<String> {
        (0..)
            .map(|i| format!("c{i}"))
            .map_while(|id| store.allocate(&owner(&id), family, NOW).ok())
            .map(|a| a.address.to_string())
            .collect()
    }

    #[test]
    fn a_bounded_block_hands_out_only_its_range_and_never_its_gateway() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let changed = bounded(
            &mut store,
            "198.18.0.0/28",
            "198.18.0.4",
            "198.18.0.8",
            "198.18.0.6",
        );
        assert_eq!(changed, ["198.18.0.0/28"]);
        assert_eq!(
            take_all(&mut store, Family::V4),
            ["198.18.0.4", "198.18.0.5", "198.18.0.7", "198.18.0.8"]
        );
        assert_sound(&store);
        // The same bounds again: nothing to do, nothing written.
        assert!(
            bounded(
                &mut store,
                "198.18.0.0/28",
                "198.18.0.4",
                "198.18.0.8",
                "198.18.0.6"
            )
            .is_empty()
        );
        // A gateway outside the block reserves nothing in it.
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "198.18.1.0/29",
            "198.18.1.0",
            "198.18.1.7",
            "198.19.0.1",
        );
        assert_eq!(take_all(&mut store, Family::V4).len(), 8);
        assert_sound(&store);
    }

    #[test]
    fn requested_addresses_outside_the_range_are_refused() {
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "198.18.0.0/28",
            "198.18.0.4",
            "198.18.0.8",
            "198.18.0.6",
        );
        for refused in ["198.18.0.3", "198.18.0.6", "198.18.0.9"] {
            let err = store
                .allocate_requested(&owner("r"), refused.parse().unwrap(), NOW)
                .unwrap_err();
            assert!(
                matches!(err, StoreError::RequestedIpUnavailable { .. }),
                "{refused}: {err}"
            );
        }
        let got = store
            .allocate_requested(&owner("r"), "198.18.0.8".parse().unwrap(), NOW)
            .unwrap();
        assert_eq!(got.address.to_string(), "198.18.0.8");
    }

    #[test]
    fn narrowing_the_range_keeps_pods_and_takes_back_their_addresses_on_release() {
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "198.18.0.0/28",
            "198.18.0.2",
            "198.18.0.14",
            "198.18.0.1",
        );
        let first = store.allocate(&owner("a"), Family::V4, NOW).unwrap();
        assert_eq!(first.address.to_string(), "198.18.0.2");
        // .2 leaves the range while pod "a" holds it.
        bounded(
            &mut store,
            "198.18.0.0/28",
            "198.18.0.10",
            "198.18.0.14",
            "198.18.0.1",
        );
        assert_sound(&store);
        assert_eq!(
            take_all(&mut store, Family::V4),
            [
                "198.18.0.10",
                "198.18.0.11",
                "198.18.0.12",
                "198.18.0.13",
                "198.18.0.14"
            ]
        );
        store.release("pods", "a", "eth0", NOW).unwrap();
        assert_sound(&store);
        assert!(store.allocate(&owner("late"), Family::V4, NOW).is_err());
        // Bounds dropped: Metis's own reservation again (.2-.9 free).
        let net = cidr("198.18.0.0/28");
        assert_eq!(
            store.set_bounds("pods", Family::V4, &[]).unwrap(),
            ["198.18.0.0/28"]
        );
        assert_eq!(
            store
                .allocate(&owner("late"), Family::V4, NOW)
                .unwrap()
                .address
                .to_string(),
            "198.18.0.2"
        );
        assert_eq!(bounds_of(&store.conn, "pods", &net).unwrap(), None);
        assert_sound(&store);
    }

    fn row_count(store: &Store) -> i64 {
        store
            .conn
            .query_row("SELECT COUNT(*) FROM ip_addresses", [], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn a_bounded_big_ipv4_block_writes_rows_only_inside_its_range() {
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "198.16.0.0/12",
            "198.16.1.0",
            "198.16.1.9",
            "198.16.1.1",
        );
        let first = take_all(&mut store, Family::V4);
        assert_eq!(first.len(), 9);
        assert_eq!(first[0], "198.16.1.0");
        assert!(!first.contains(&"198.16.1.1".to_string()));
        // The first batch, the broadcast and the range: never the /12.
        assert!(row_count(&store) < 200, "{}", row_count(&store));
        assert!(!store.can_allocate("pods", Family::V4, &[], NOW).unwrap());
        assert_sound(&store);

        // A range that now starts lower grows from its new start.
        let net = cidr("198.16.0.0/12");
        let lower = Bounds::new(
            &net,
            Some("198.16.0.250".parse().unwrap()),
            Some("198.16.1.9".parse().unwrap()),
            Some("198.16.1.1".parse().unwrap()),
        )
        .unwrap();
        store
            .set_bounds("pods", Family::V4, &[(net, lower)])
            .unwrap();
        assert!(store.can_allocate("pods", Family::V4, &[], NOW).unwrap());
        let more: Vec<String> = (0..)
            .map(|i| format!("d{i}"))
            .map_while(|id| store.allocate(&owner(&id), Family::V4, NOW).ok())
            .map(|a| a.address.to_string())
            .collect();
        assert_eq!(
            more,
            [
                "198.16.0.250",
                "198.16.0.251",
                "198.16.0.252",
                "198.16.0.253",
                "198.16.0.254",
                "198.16.0.255"
            ]
        );
        assert_sound(&store);
    }

    #[test]
    fn a_block_narrowed_out_of_its_bounds_grows_every_address_it_skipped() {
        let dir = TempDir::new();
        let mut store = dir.store();
        // Rows: the first batch, then the range far beyond it.
        bounded(
            &mut store,
            "198.18.0.0/24",
            "198.18.0.100",
            "198.18.0.101",
            "198.18.0.1",
        );
        assert_eq!(take_all(&mut store, Family::V4).len(), 2);
        let half = cidr("198.18.0.0/25");
        store
            .configure(Source::Cni, "pods", Family::V4, &[half], false, NOW)
            .unwrap();
        store.set_bounds("pods", Family::V4, &[]).unwrap();
        let rest: Vec<String> = (0..)
            .map(|i| format!("d{i}"))
            .map_while(|id| store.allocate(&owner(&id), Family::V4, NOW).ok())
            .map(|a| a.address.to_string())
            .collect();
        // 128 addresses: network, gateway, broadcast reserved, two held.
        assert_eq!(rest.len(), 128 - 3 - 2, "{rest:?}");
        assert!(rest.contains(&"198.18.0.64".to_string()));
        assert_sound(&store);
    }

    #[test]
    fn a_bounded_ipv6_block_grows_lazily_inside_its_range() {
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "2001:db8::/64",
            "2001:db8::ffff:ffff:ffff:fffe",
            "2001:db8::ffff:ffff:ffff:ffff",
            "2001:db8::1",
        );
        assert_eq!(
            take_all(&mut store, Family::V6),
            [
                "2001:db8::ffff:ffff:ffff:fffe",
                "2001:db8::ffff:ffff:ffff:ffff"
            ]
        );
        let reserved = Reserved::bounded(
            &cidr("2001:db8::/64"),
            &Bounds::new(
                &cidr("2001:db8::/64"),
                None,
                Some("2001:db8::ff".parse().unwrap()),
                None,
            )
            .unwrap(),
        );
        assert_eq!(reserved.count(1 << 64), (1u128 << 64) - 255 + 1);
    }
}
