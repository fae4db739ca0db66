//! Aggregate counts: addresses by type and blocks by state per network and
//! family (monitoring, in two grouped queries), upstream's `GetIPUsage`,
//! and the cooling addresses the monitor waits for.

use std::collections::BTreeMap;

use rusqlite::params;

use crate::cidr::Family;
use crate::store::db::{
    BlockState, Cooling, Store, StoreError, Usage, parse_cidr, parse_family, parse_state,
};
use crate::store::rows::free::cooling;

/// Counts the rows of the non-Deleting blocks of network ?1 and family ?2
/// that meet a condition, appended.
macro_rules! usage_rows {
    () => {
        "SELECT COUNT(*) FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
         WHERE b.network = ?1 AND b.ip_family = ?2 AND b.state != 'Deleting' AND "
    };
}

/// Cooling rows at ?3.
const USAGE_COOLING_SQL: &str = concat!(usage_rows!(), cooling!("a.", "?3"));

/// Reserved rows (allocated, no owner).
const USAGE_RESERVED_SQL: &str = concat!(
    usage_rows!(),
    "a.is_allocated = TRUE AND a.container_id = ''"
);

/// Counts of one network and family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FamilyStats {
    /// Free, not cooling, in Ready blocks.
    pub available: i64,
    /// Allocated rows (reserved included) in non-Deleting blocks.
    pub allocated: i64,
    /// Free rows still in release cooldown, in non-Deleting blocks.
    pub cooldown: i64,
    /// Addresses of Draining blocks.
    pub draining: i64,
    /// Addresses of Deleting blocks.
    pub deleting: i64,
    /// Addresses of Withheld blocks (retired or quarantined).
    pub withheld: i64,
    /// Addresses of non-Deleting blocks.
    pub total: i64,
    /// Blocks per state: Ready, Draining, Deleting, Withheld.
    pub blocks: [i64; 4],
}

impl Store {
    /// Counts for every (network, family) that has a block.
    pub fn stats(
        &self,
        now_ms: i64,
    ) -> Result<BTreeMap<(String, Family), FamilyStats>, StoreError> {
        let mut out: BTreeMap<(String, Family), FamilyStats> = BTreeMap::new();
        let mut blocks = self.conn.prepare_cached(
            "SELECT network, ip_family, state, COUNT(*), SUM(total_ips), SUM(COALESCE(allocated_ips, 0)) \
             FROM cidr_blocks GROUP BY network, ip_family, state",
        )?;
        let mut rows = blocks.query([])?;
        while let Some(row) = rows.next()? {
            let key = (
                row.get::<_, String>(0)?,
                parse_family(&row.get::<_, String>(1)?)?,
            );
            let state = parse_state(&row.get::<_, String>(2)?)?;
            let (count, total, allocated): (i64, i64, i64) =
                (row.get(3)?, row.get(4)?, row.get(5)?);
            let entry = out.entry(key).or_default();
            match state {
                BlockState::Ready => {
                    entry.blocks[0] = count;
                    entry.available = entry
                        .available
                        .saturating_add(total.saturating_sub(allocated));
                }
                BlockState::Draining => {
                    entry.blocks[1] = count;
                    entry.draining = total;
                }
                BlockState::Deleting => {
                    entry.blocks[2] = count;
                    entry.deleting = total;
                    continue;
                }
                BlockState::Withheld => {
                    entry.blocks[3] = count;
                    entry.withheld = total;
                }
            }
            entry.total = entry.total.saturating_add(total);
            entry.allocated = entry.allocated.saturating_add(allocated);
        }
        let mut cooling = self.conn.prepare_cached(concat!(
            "SELECT b.network, b.ip_family, b.state, COUNT(*) FROM ip_addresses a \
                 JOIN cidr_blocks b ON b.id = a.cidr_block_id WHERE ",
            cooling!("a.", "?1"),
            " AND b.state != 'Deleting' GROUP BY b.network, b.ip_family, b.state"
        ))?;
        let mut rows = cooling.query(params![now_ms])?;
        while let Some(row) = rows.next()? {
            let key = (
                row.get::<_, String>(0)?,
                parse_family(&row.get::<_, String>(1)?)?,
            );
            let state = parse_state(&row.get::<_, String>(2)?)?;
            let count: i64 = row.get(3)?;
            let entry = out.entry(key).or_default();
            entry.cooldown = entry.cooldown.saturating_add(count);
            if state == BlockState::Ready {
                entry.available = entry.available.saturating_sub(count);
            }
        }
        Ok(out)
    }

    /// Upstream's `GetIPUsage` over non-Deleting blocks of network+family,
    /// with reserved rows counted apart from pods' and the exact size.
    pub fn usage(&self, network: &str, family: Family, now_ms: i64) -> Result<Usage, StoreError> {
        let mut usage = Usage::default();
        let mut allocated_rows: i64 = 0;
        {
            let mut stmt = self.conn.prepare_cached(
                "SELECT COALESCE(allocated_ips, 0), total_ips, state, cidr FROM cidr_blocks \
                 WHERE network = ?1 AND ip_family = ?2 AND state != 'Deleting'",
            )?;
            let mut rows = stmt.query(params![network, family.as_str()])?;
            while let Some(row) = rows.next()? {
                let allocated: i64 = row.get(0)?;
                let total: i64 = row.get(1)?;
                let state = parse_state(&row.get::<_, String>(2)?)?;
                let cidr = parse_cidr(&row.get::<_, String>(3)?)?;
                allocated_rows = allocated_rows.saturating_add(allocated);
                usage.total = usage.total.saturating_add(total);
                usage.addresses = usage.addresses.saturating_add(cidr.size());
                // A withheld block is capacity nothing is allocated from,
                // as a Draining one is (retired blocks were Draining before
                // they had a state of their own).
                if matches!(state, BlockState::Draining | BlockState::Withheld) {
                    usage.draining = usage.draining.saturating_add(total);
                }
            }
        }
        usage.cooldown = self
            .conn
            .prepare_cached(USAGE_COOLING_SQL)?
            .query_row(params![network, family.as_str(), now_ms], |r| r.get(0))?;
        usage.reserved = self
            .conn
            .prepare_cached(USAGE_RESERVED_SQL)?
            .query_row(params![network, family.as_str()], |r| r.get(0))?;
        usage.allocated = allocated_rows.saturating_sub(usage.reserved);
        Ok(usage)
    }

    /// Cooling addresses of the network's Ready blocks (the ones a new
    /// allocation can get once their cooldown ends): how many come free by
    /// `until_ms`, and when the first does (Unix ms).
    pub fn cooling(
        &self,
        network: &str,
        family: Family,
        now_ms: i64,
        until_ms: i64,
    ) -> Result<Cooling, StoreError> {
        let (by_then, first_free_ms) = self
            .conn
            .prepare_cached(concat!(
                "SELECT COUNT(CASE WHEN a.release_at <= ?4 THEN 1 END), MIN(a.release_at) \
                     FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
                     WHERE b.network = ?1 AND b.ip_family = ?2 AND b.state = 'Ready' AND ",
                cooling!("a.", "?3")
            ))?
            .query_row(params![network, family.as_str(), now_ms, until_ms], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })?;
        Ok(Cooling {
            by_then,
            first_free_ms,
        })
    }
}
