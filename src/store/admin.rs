//! Block lifecycle (drain, undrain, expire, delete), usage and the admin
//! queries.

use rusqlite::types::{Value, ValueRef};
use rusqlite::{Connection, OptionalExtension, Row, params, params_from_iter};

use super::reserve::block_reserved;
use super::{
    AddressFilter, BlockFilter, BlockInfo, BlockState, Cooling, Store, StoreError, Table, Usage,
    parse_cidr, parse_family, parse_state,
};
use crate::cidr::Family;

const BLOCK_COLUMNS: &str = "b.id, b.cidr, b.network, b.ip_family, b.total_ips, \
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

fn query_blocks(
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

/// Appends `AND <fragment with ?N>` for each set filter field. Only fixed
/// SQL fragments are appended; values are bound.
struct Where {
    sql: String,
    params: Vec<Value>,
}

impl Where {
    fn new() -> Where {
        Where {
            sql: String::from(" WHERE 1 = 1"),
            params: Vec::new(),
        }
    }

    fn and(&mut self, fragment: &str, value: Value) {
        self.params.push(value);
        self.sql
            .push_str(&format!(" AND {fragment} ?{}", self.params.len()));
    }

    fn block_filter(
        &mut self,
        network: Option<&String>,
        state: Option<BlockState>,
        family: Option<Family>,
    ) {
        if let Some(n) = network {
            self.and("b.network =", Value::Text(n.clone()));
        }
        if let Some(s) = state {
            self.and("b.state =", Value::Text(s.as_str().to_string()));
        }
        if let Some(f) = family {
            self.and("b.ip_family =", Value::Text(f.as_str().to_string()));
        }
    }
}

fn cell(value: ValueRef) -> String {
    match value {
        ValueRef::Null => "NULL".to_string(),
        ValueRef::Integer(i) => i.to_string(),
        ValueRef::Real(r) => r.to_string(),
        ValueRef::Text(t) => String::from_utf8_lossy(t).into_owned(),
        ValueRef::Blob(b) => {
            let hex: String = b.iter().map(|byte| format!("{byte:02x}")).collect();
            format!("x'{hex}'")
        }
    }
}

fn table(conn: &Connection, sql: &str, params: &[Value]) -> Result<Table, StoreError> {
    let mut stmt = conn.prepare(sql)?;
    let headers: Vec<String> = stmt.column_names().map(str::to_string).collect();
    let columns = headers.len();
    let mut rows = stmt.query(params_from_iter(params.iter()))?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let mut cells = Vec::with_capacity(columns);
        for i in 0..columns {
            cells.push(cell(row.get_ref(i)?));
        }
        out.push(cells);
    }
    Ok(Table { headers, rows: out })
}

impl Store {
    /// Marks a block Draining (no state guard, like upstream). False if no
    /// such block.
    pub fn drain_block(&mut self, id: i64, now_ms: i64) -> Result<bool, StoreError> {
        let tx = super::write(&mut self.conn, self.batch)?;
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
        let tx = super::write(&mut self.conn, self.batch)?;
        let id: Option<i64> = tx
            .prepare_cached(
                "SELECT id FROM cidr_blocks WHERE network = ?1 AND ip_family = ?2 \
                 AND state = 'Draining' AND id NOT IN \
                   (SELECT block_id FROM metis_blocks WHERE retired = 1 OR quarantine IS NOT NULL) \
                 ORDER BY id LIMIT 1",
            )?
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
        let tx = super::write(&mut self.conn, self.batch)?;
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
                .prepare_cached(
                    "SELECT EXISTS (SELECT 1 FROM ip_addresses WHERE cidr_block_id = ?1 \
                     AND is_allocated = 1 AND COALESCE(container_id, '') != '')",
                )?
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
        let tx = super::write(&mut self.conn, self.batch)?;
        let n = tx
            .prepare_cached("DELETE FROM cidr_blocks WHERE id = ?1 AND state = 'Deleting'")?
            .execute([id])?;
        if n > 0 {
            super::layout::forget_block(&tx, id)?;
        }
        tx.commit()?;
        Ok(n > 0)
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
                if state == BlockState::Draining {
                    usage.draining = usage.draining.saturating_add(total);
                }
            }
        }
        let count = |condition: &str, extra: Option<i64>| -> Result<i64, StoreError> {
            let sql = format!(
                "SELECT COUNT(*) FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
                 WHERE b.network = ?1 AND b.ip_family = ?2 AND b.state != 'Deleting' AND {condition}"
            );
            let mut stmt = self.conn.prepare_cached(&sql)?;
            Ok(match extra {
                Some(now) => {
                    stmt.query_row(params![network, family.as_str(), now], |r| r.get(0))?
                }
                None => stmt.query_row(params![network, family.as_str()], |r| r.get(0))?,
            })
        };
        usage.cooldown = count("a.is_allocated = FALSE AND a.release_at > ?3", Some(now_ms))?;
        usage.reserved = count("a.is_allocated = TRUE AND a.container_id = ''", None)?;
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
            .prepare_cached(
                "SELECT COUNT(CASE WHEN a.release_at <= ?4 THEN 1 END), MIN(a.release_at)                  FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id                  WHERE b.network = ?1 AND b.ip_family = ?2 AND b.state = 'Ready'                    AND a.is_allocated = FALSE AND a.release_at > ?3",
            )?
            .query_row(
                params![network, family.as_str(), now_ms, until_ms],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
        Ok(Cooling {
            by_then,
            first_free_ms,
        })
    }

    /// Distinct networks of non-Deleting blocks, sorted.
    pub fn networks(&self) -> Result<Vec<String>, StoreError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT DISTINCT network FROM cidr_blocks WHERE state != 'Deleting' ORDER BY network",
        )?;
        let rows = stmt.query_map([], |r| r.get(0))?;
        let mut out = Vec::new();
        for row in rows {
            out.push(row?);
        }
        Ok(out)
    }

    /// Blocks matching the filter, id ASC.
    pub fn blocks(&self, filter: &BlockFilter) -> Result<Vec<BlockInfo>, StoreError> {
        let mut w = Where::new();
        w.block_filter(filter.network.as_ref(), filter.state, filter.family);
        query_blocks(
            &self.conn,
            &format!(
                "SELECT {BLOCK_COLUMNS} FROM cidr_blocks b{} ORDER BY b.id",
                w.sql
            ),
            &w.params,
        )
    }

    /// Ready blocks of network+family, newest first (created_at DESC, id DESC).
    pub fn ready_blocks_newest_first(
        &self,
        network: &str,
        family: Family,
    ) -> Result<Vec<BlockInfo>, StoreError> {
        query_blocks(
            &self.conn,
            &format!(
                "SELECT {BLOCK_COLUMNS} FROM cidr_blocks b WHERE b.network = ?1 AND b.ip_family = ?2 \
                 AND b.state = 'Ready' ORDER BY b.created_at DESC, b.id DESC"
            ),
            &[
                Value::Text(network.to_string()),
                Value::Text(family.as_str().to_string()),
            ],
        )
    }

    /// Raw dump of `cidr_blocks` (all columns, table order), plus a `note`
    /// saying why a block takes no new allocations when Metis's records
    /// say so (taken back by the cluster, retired, quarantined).
    pub fn list_blocks(&self, filter: &BlockFilter) -> Result<Table, StoreError> {
        let mut w = Where::new();
        w.block_filter(filter.network.as_ref(), filter.state, filter.family);
        let recorded: bool = self.conn.query_row(
            "SELECT COUNT(*) = 2 FROM sqlite_master WHERE type = 'table' \
             AND name IN ('metis_blocks', 'metis_taken_back')",
            [],
            |r| r.get(0),
        )?;
        let sql = match recorded {
            true => format!(
                "SELECT b.*, CASE \
                   WHEN m.quarantine IS NOT NULL THEN 'quarantined: ' || m.quarantine \
                   WHEN t.block_id IS NOT NULL THEN 'no longer granted by the cluster (' || t.source \
                     || '): no new allocations; deleted when its last pod is' \
                   WHEN m.retired = 1 THEN 'retired: no source wants it; deleted when its last pod is' \
                   ELSE '' END AS note \
                 FROM cidr_blocks b LEFT JOIN metis_blocks m ON m.block_id = b.id \
                 LEFT JOIN metis_taken_back t ON t.block_id = b.id{} ORDER BY b.id",
                w.sql
            ),
            false => format!("SELECT b.* FROM cidr_blocks b{} ORDER BY b.id", w.sql),
        };
        table(&self.conn, &sql, &w.params)
    }

    /// Raw dump of `ip_addresses` (all columns, table order); network, state
    /// and family filter on the owning block.
    pub fn list_addresses(&self, filter: &AddressFilter) -> Result<Table, StoreError> {
        let mut w = Where::new();
        w.block_filter(filter.network.as_ref(), filter.state, filter.family);
        if let Some(c) = &filter.container_id {
            w.and("a.container_id =", Value::Text(c.clone()));
        }
        if let Some(allocated) = filter.allocated {
            w.and("a.is_allocated =", Value::Integer(i64::from(allocated)));
        }
        table(
            &self.conn,
            &format!(
                "SELECT a.* FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id{} ORDER BY a.id",
                w.sql
            ),
            &w.params,
        )
    }
}
