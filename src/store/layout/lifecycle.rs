//! Block lifecycle: drain, undrain, expire (Draining → Deleting) and
//! delete, as upstream's monitor drives it.

use rusqlite::types::Value;
use rusqlite::{OptionalExtension, params};

use crate::cidr::Family;
use crate::store::db::{BlockFilter, BlockInfo, BlockState, Store, StoreError, parse_cidr};
use crate::store::rows::block::{
    BLOCK_COLUMNS, UNDRAINABLE_SQL, block_reserved, forget_block, query_blocks,
};
use crate::store::rows::free::pod_held;

impl Store {
    /// Marks a block Draining (no state guard, like upstream). False if no
    /// such block.
    pub fn drain_block(&mut self, id: i64, now_ms: i64) -> Result<bool, StoreError> {
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let n = tx
            .prepare_cached(
                "UPDATE cidr_blocks SET state = 'Draining', updated_at = ?2 WHERE id = ?1",
            )?
            .execute(params![id, now_ms])?;
        tx.commit()?;
        Ok(n > 0)
    }

    /// Returns the oldest Draining block of network+family to Ready (never
    /// one Metis retired or quarantined).
    pub fn undrain_one(
        &mut self,
        network: &str,
        family: Family,
        now_ms: i64,
    ) -> Result<Option<i64>, StoreError> {
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let id: Option<i64> = tx
            .prepare_cached(UNDRAINABLE_SQL)?
            .query_row(params![network, family.as_str()], |r| r.get(0))
            .optional()?;
        if let Some(id) = id {
            tx.prepare_cached(
                "UPDATE cidr_blocks SET state = 'Ready', updated_at = ?2 WHERE id = ?1",
            )?
            .execute(params![id, now_ms])?;
        }
        tx.commit()?;
        Ok(id)
    }

    /// Draining blocks that no pod uses and that were not modified for
    /// `expiration_ms` become Deleting; returns them (after the change).
    /// "No pod uses" = no allocated row with an owner; reserved rows do not
    /// count (upstream: `allocated_ips = 0`, which is the same thing when
    /// only the first block has reservations).
    pub fn expire_draining(
        &mut self,
        network: &str,
        family: Family,
        expiration_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<BlockInfo>, StoreError> {
        let mode = self.reserve;
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let draining = query_blocks(
            &tx,
            &format!(
                "SELECT {BLOCK_COLUMNS} FROM cidr_blocks b WHERE b.network = ?1 AND b.ip_family = ?2 \
                 AND b.state = 'Draining' AND b.updated_at + ?3 <= ?4 \
                 AND b.id NOT IN (SELECT block_id FROM metis_blocks WHERE retired = 1) ORDER BY b.id"
            ),
            &[
                Value::Text(network.to_string()),
                Value::Text(family.as_str().to_string()),
                Value::Integer(expiration_ms),
                Value::Integer(now_ms),
            ],
        )?;
        let mut expired = Vec::new();
        for block in draining {
            let cidr = parse_cidr(&block.cidr)?;
            let reserved = block_reserved(&tx, mode, block.id, network, &cidr)?;
            let reserved_len = i64::try_from(reserved.count(cidr.size())).unwrap_or(i64::MAX);
            if block.allocated_ips > reserved_len {
                continue;
            }
            let pod_held: bool = tx
                .prepare_cached(concat!(
                    "SELECT EXISTS (SELECT 1 FROM ip_addresses WHERE cidr_block_id = ?1 AND ",
                    pod_held!(""),
                    ")"
                ))?
                .query_row([block.id], |r| r.get(0))?;
            if pod_held {
                continue;
            }
            tx.prepare_cached(
                "UPDATE cidr_blocks SET state = 'Deleting', updated_at = ?2 WHERE id = ?1",
            )?
            .execute(params![block.id, now_ms])?;
            expired.extend(query_blocks(
                &tx,
                &format!("SELECT {BLOCK_COLUMNS} FROM cidr_blocks b WHERE b.id = ?1"),
                &[Value::Integer(block.id)],
            )?);
        }
        tx.commit()?;
        Ok(expired)
    }

    /// Deleting blocks of network+family, id ASC.
    pub fn deleting_blocks(
        &self,
        network: &str,
        family: Family,
    ) -> Result<Vec<BlockInfo>, StoreError> {
        self.blocks(&BlockFilter {
            network: Some(network.to_string()),
            state: Some(BlockState::Deleting),
            family: Some(family),
        })
    }

    /// Deletes a block (and, by cascade, its rows) only if it is Deleting.
    pub fn delete_block(&mut self, id: i64) -> Result<bool, StoreError> {
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let n = tx
            .prepare_cached("DELETE FROM cidr_blocks WHERE id = ?1 AND state = 'Deleting'")?
            .execute([id])?;
        if n > 0 {
            forget_block(&tx, id)?;
        }
        tx.commit()?;
        Ok(n > 0)
    }
}
