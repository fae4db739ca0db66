//! Aggregate counts for monitoring: addresses by type and blocks by state,
//! per network and family, in two grouped queries.

use std::collections::BTreeMap;

use rusqlite::params;

use super::{BlockState, Store, StoreError, parse_family, parse_state};
use crate::cidr::Family;

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
    /// Addresses of non-Deleting blocks.
    pub total: i64,
    /// Blocks per state: Ready, Draining, Deleting.
    pub blocks: [i64; 3],
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
            }
            entry.total = entry.total.saturating_add(total);
            entry.allocated = entry.allocated.saturating_add(allocated);
        }
        let mut cooling = self.conn.prepare_cached(
            "SELECT b.network, b.ip_family, b.state, COUNT(*) FROM ip_addresses a \
             JOIN cidr_blocks b ON b.id = a.cidr_block_id \
             WHERE a.is_allocated = FALSE AND a.release_at > ?1 AND b.state != 'Deleting' \
             GROUP BY b.network, b.ip_family, b.state",
        )?;
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
}
