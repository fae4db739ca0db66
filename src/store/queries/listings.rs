//! Listings: networks, blocks by filter, and the raw table dumps of the
//! admin interface (filters bound, never spliced into SQL).

use rusqlite::types::{Value, ValueRef};
use rusqlite::{Connection, params_from_iter};

use crate::cidr::Family;
use crate::store::db::{
    AddressFilter, BlockFilter, BlockInfo, BlockState, Store, StoreError, Table,
};
use crate::store::rows::block::{BLOCK_COLUMNS, query_blocks};

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
