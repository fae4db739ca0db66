//! The one-time move of Metis's per-block and per-network state from text
//! keys in `metis_settings` into typed columns: a block's frontier into
//! `metis_blocks.frontier`, a network's isolation and low-use clock into
//! `metis_networks` (and the columns that table gained since, added to
//! one created without them). Run at every writable open and idempotent: it finds
//! nothing to do on a database it already moved (two cheap reads), and
//! moves again whatever an older Metis (a plugin of the previous release
//! in direct mode, during an upgrade) wrote since. Upstream's tables are
//! never touched, and upstream reads none of the keys moved.

use rusqlite::{Connection, params};

use super::{StoreError, schema};

/// What is left to move, in words (empty: nothing). `admin check` reports
/// it; an open that may write moves it.
pub(super) fn leftovers(conn: &Connection) -> Result<Vec<String>, StoreError> {
    let mut left = Vec::new();
    if !has_frontier_column(conn)? {
        left.push("metis_blocks has no frontier column".to_string());
    }
    // A database without the table gets it whole at the next open.
    if has_networks_table(conn)? {
        for (column, _) in missing_network_columns(conn)? {
            left.push(format!("metis_networks has no {column} column"));
        }
    }
    for prefix in schema::LEGACY_KEYS {
        let count = legacy(conn, prefix)?.len();
        if count > 0 {
            left.push(format!("metis_settings holds {count} {prefix}… key(s)"));
        }
    }
    Ok(left)
}

/// Whether anything is left to move: one query, as every open asks (the
/// plugin in direct mode opens the store for each request).
pub(super) fn needed(conn: &Connection) -> Result<bool, StoreError> {
    let keys: Vec<String> = schema::LEGACY_KEYS
        .iter()
        .map(|prefix| format!("(key >= '{prefix}' AND key < '{}')", key_range_end(prefix)))
        .collect();
    let sql = format!(
        "SELECT NOT EXISTS (SELECT 1 FROM pragma_table_info('metis_blocks') WHERE name = 'frontier') \
         OR (SELECT COUNT(*) FROM pragma_table_info('metis_networks') WHERE name IN ({})) < {} \
         OR EXISTS (SELECT 1 FROM metis_settings WHERE {})",
        added_columns_list(),
        schema::NETWORKS_ADDED.len(),
        keys.join(" OR ")
    );
    Ok(conn.prepare_cached(&sql)?.query_row([], |r| r.get(0))?)
}

/// Moves every legacy key into its typed column and drops it, rebuilding
/// each of Metis's tables whose shape or keys an earlier release left in
/// today's shape, with the rows [`today`] reads. Runs inside the caller's
/// write transaction.
pub(super) fn migrate(conn: &Connection) -> Result<(), StoreError> {
    for table in Earlier::TABLES {
        if !table.needs_moving(conn)? {
            continue;
        }
        let (name, create, columns) = (table.name(), table.create(), table.columns());
        conn.execute_batch(&format!("ALTER TABLE {name} RENAME TO {name}_old"))?;
        conn.execute_batch(create)?;
        let rows = table.today(conn, &format!("{name}_old"))?;
        conn.execute_batch(&format!(
            "INSERT INTO {name} ({}) {rows}; DROP TABLE {name}_old",
            columns.join(", ")
        ))?;
    }
    for prefix in schema::LEGACY_KEYS {
        conn.prepare_cached("DELETE FROM metis_settings WHERE key >= ?1 AND key < ?2")?
            .execute(params![prefix, key_range_end(prefix)])?;
    }
    Ok(())
}

/// Readies a read-only connection (which may not move anything) to read
/// the file as today's Metis would after its next writable open: a TEMP
/// view (in memory, never in the file) in front of each of Metis's tables
/// an earlier release left in another shape or beside legacy keys, showing
/// the rows the migration would make of them ([`Earlier::today`]); then
/// empty stand-ins for the tables the file lacks
/// ([`schema::shadow_missing_tables`]). Unqualified names find TEMP before
/// `main`, so every read sees today's shape and meaning (an isolation an
/// `isolated/` key records, say) instead of failing on a missing column or
/// missing what the keys hold.
pub(super) fn shadow_for_reading(conn: &Connection) -> Result<(), StoreError> {
    // In memory: a read-only root filesystem has no temporary directory.
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    for table in Earlier::TABLES {
        if table.needs_moving(conn)? {
            let rows = table.today(conn, table.name())?;
            conn.execute_batch(&format!(
                "CREATE TEMP VIEW {} ({}) AS {rows}",
                table.name(),
                table.columns().join(", ")
            ))?;
        }
    }
    schema::shadow_missing_tables(conn)?;
    Ok(())
}

/// The tables of Metis's whose content an earlier release kept otherwise.
#[derive(Clone, Copy)]
enum Earlier {
    /// `metis_blocks` without `frontier`, a frontier in `ipv6_frontier/ID`.
    Blocks,
    /// No `metis_networks`, or one without [`schema::NETWORKS_ADDED`];
    /// isolation in `isolated/NET`, the low-use clock in
    /// `low_utilization_since/NET`.
    Networks,
}

/// `metis_blocks`'s columns, in the order of [`schema::BLOCKS`].
const BLOCK_COLUMNS: [&str; 5] = ["block_id", "sources", "retired", "quarantine", "frontier"];

/// `metis_networks`'s columns, in the order of [`schema::NETWORKS`].
const NETWORK_COLUMNS: [&str; 6] = [
    "network",
    "isolated",
    "low_utilization_since",
    "host_local_dir",
    "host_local_dir_identity",
    "conf_name",
];

impl Earlier {
    const TABLES: [Earlier; 2] = [Earlier::Blocks, Earlier::Networks];

    fn name(self) -> &'static str {
        match self {
            Earlier::Blocks => "metis_blocks",
            Earlier::Networks => "metis_networks",
        }
    }

    fn create(self) -> &'static str {
        match self {
            Earlier::Blocks => schema::BLOCKS,
            Earlier::Networks => schema::NETWORKS,
        }
    }

    fn columns(self) -> &'static [&'static str] {
        match self {
            Earlier::Blocks => &BLOCK_COLUMNS,
            Earlier::Networks => &NETWORK_COLUMNS,
        }
    }

    /// Whether the file keeps this table otherwise than today: in an
    /// earlier shape, or with its state (partly) in legacy keys.
    fn needs_moving(self, conn: &Connection) -> Result<bool, StoreError> {
        let present = file_columns(conn, self.name())?;
        let shaped = present.is_empty()
            || self
                .columns()
                .iter()
                .all(|column| present.iter().any(|p| p == column));
        if !shaped {
            return Ok(true);
        }
        if file_columns(conn, "metis_settings")?.is_empty() {
            return Ok(false);
        }
        for prefix in self.prefixes() {
            let any: bool = conn
                .prepare_cached(
                    "SELECT EXISTS (SELECT 1 FROM main.metis_settings WHERE key >= ?1 AND key < ?2)",
                )?
                .query_row(params![prefix, key_range_end(prefix)], |r| r.get(0))?;
            if any {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The legacy keys whose values belong in this table.
    fn prefixes(self) -> &'static [&'static str] {
        match self {
            Earlier::Blocks => &schema::LEGACY_KEYS[..1],
            Earlier::Networks => &schema::LEGACY_KEYS[1..],
        }
    }

    /// A SELECT of this table's rows as today's shape has them (its
    /// columns in order) from the file's table `source` as it is (absent:
    /// no rows) and the legacy keys, which win over the table's column as
    /// they did when an older Metis wrote them after the last move. A key
    /// whose block is gone, an isolation other than "1" and a low-use
    /// clock that is not an integer as Metis writes one give nothing.
    fn today(self, conn: &Connection, source: &str) -> Result<String, StoreError> {
        let settings = file_rows(conn, "metis_settings", &["key", "value"])?;
        let old = file_rows(conn, source, self.columns())?;
        let keys = |prefix: &str| {
            format!(
                "FROM {settings} WHERE key >= '{prefix}' AND key < '{}'",
                key_range_end(prefix)
            )
        };
        let after = |prefix: &str| prefix.len() + 1;
        Ok(match self {
            Earlier::Blocks => {
                let frontier = schema::LEGACY_KEYS[0];
                // The last key of a block wins, as the move ran in key order.
                format!(
                    "WITH keys (block_id, frontier, last) AS (\
                       SELECT CAST(substr(key, {}) AS INTEGER), value, max(key) {} GROUP BY 1), \
                     old AS {old} \
                     SELECT o.block_id, o.sources, COALESCE(o.retired, 0), o.quarantine, \
                       COALESCE((SELECT frontier FROM keys WHERE keys.block_id = o.block_id), o.frontier) \
                     FROM old o \
                     UNION ALL SELECT block_id, NULL, 0, NULL, frontier FROM keys \
                     WHERE block_id IN (SELECT id FROM main.cidr_blocks) \
                       AND block_id NOT IN (SELECT block_id FROM old)",
                    after(frontier),
                    keys(frontier)
                )
            }
            Earlier::Networks => {
                let [_, isolated, low_since] = schema::LEGACY_KEYS;
                format!(
                    "WITH iso (network) AS (SELECT substr(key, {}) {} AND value = '1'), \
                     low (network, since) AS (SELECT substr(key, {}), CAST(value AS INTEGER) {} \
                       AND CAST(CAST(value AS INTEGER) AS TEXT) = value), \
                     old AS {old}, \
                     names (network) AS (SELECT network FROM old UNION SELECT network FROM iso \
                       UNION SELECT network FROM low) \
                     SELECT n.network, \
                       CASE WHEN n.network IN (SELECT network FROM iso) THEN 1 \
                         ELSE COALESCE(o.isolated, 0) END, \
                       COALESCE((SELECT since FROM low WHERE low.network = n.network), \
                         o.low_utilization_since), \
                       o.host_local_dir, o.host_local_dir_identity, o.conf_name \
                     FROM names n LEFT JOIN old o ON o.network = n.network",
                    after(isolated),
                    keys(isolated),
                    after(low_since),
                    keys(low_since)
                )
            }
        })
    }
}

/// The columns of the file's table `table` (none when it has no such
/// table; a TEMP view in front of it does not count).
fn file_columns(conn: &Connection, table: &str) -> Result<Vec<String>, StoreError> {
    let mut stmt = conn.prepare_cached("SELECT name FROM pragma_table_info(?1, 'main')")?;
    let names = stmt
        .query_map([table], |r| r.get(0))?
        .collect::<Result<Vec<String>, _>>()?;
    Ok(names)
}

/// A subquery of the file's table `table` with `columns`, NULL for each
/// the file's table lacks; no rows when the file has no such table.
fn file_rows(conn: &Connection, table: &str, columns: &[&str]) -> Result<String, StoreError> {
    let present = file_columns(conn, table)?;
    let select: Vec<String> = columns
        .iter()
        .map(|column| match present.iter().any(|p| p == column) {
            true => column.to_string(),
            false => format!("NULL AS {column}"),
        })
        .collect();
    Ok(match present.is_empty() {
        true => format!("(SELECT {} WHERE 0)", select.join(", ")),
        false => format!("(SELECT {} FROM main.{table})", select.join(", ")),
    })
}

/// `'host_local_dir', …`: the names of [`schema::NETWORKS_ADDED`] as SQL.
fn added_columns_list() -> String {
    let names: Vec<String> = schema::NETWORKS_ADDED
        .iter()
        .map(|(name, _)| format!("'{name}'"))
        .collect();
    names.join(", ")
}

fn has_networks_table(conn: &Connection) -> Result<bool, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'metis_networks')",
        )?
        .query_row([], |r| r.get(0))?)
}

/// The columns of [`schema::NETWORKS_ADDED`] the file's `metis_networks`
/// lacks.
fn missing_network_columns(
    conn: &Connection,
) -> Result<Vec<(&'static str, &'static str)>, StoreError> {
    let present = file_columns(conn, "metis_networks")?;
    Ok(schema::NETWORKS_ADDED
        .into_iter()
        .filter(|(name, _)| !present.iter().any(|column| column == name))
        .collect())
}

fn has_frontier_column(conn: &Connection) -> Result<bool, StoreError> {
    Ok(file_columns(conn, "metis_blocks")?
        .iter()
        .any(|column| column == "frontier"))
}

/// The keys under `prefix` (which ends in '/'): (the rest of the key, value).
fn legacy(conn: &Connection, prefix: &str) -> Result<Vec<(String, String)>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT substr(key, length(?1) + 1), value FROM metis_settings \
         WHERE key >= ?1 AND key < ?2 ORDER BY key",
    )?;
    let rows = stmt
        .query_map(params![prefix, key_range_end(prefix)], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// The first key after every key under `prefix` ('/' + 1 is '0'), so the
/// primary key's index finds them.
fn key_range_end(prefix: &str) -> String {
    format!("{}0", prefix.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use crate::cidr::Family;
    use crate::store::{Depth, Source, Store, check_file};
    use crate::testutil::{TempDir, assert_sound, cidr, owner};

    const NOW: i64 = 1_700_000_000_000;

    /// Metis's block table as the releases before typed state created it.
    const OLD_BLOCKS: &str = "CREATE TABLE metis_blocks_old (block_id INTEGER PRIMARY KEY, \
         sources TEXT NOT NULL DEFAULT '', retired INTEGER NOT NULL DEFAULT 0, quarantine TEXT)";

    /// Rewrites a database in the shape of the release before typed state:
    /// frontiers, isolation and the low-use clock as `metis_settings` keys
    /// (plus a stale key of a block long gone), `metis_blocks` without a
    /// frontier column and only for blocks Metis recorded, no
    /// `metis_networks`.
    fn age(path: &std::path::Path) {
        let conn = Connection::open(path).unwrap();
        conn.execute_batch(&format!(
            "BEGIN;
             INSERT INTO metis_settings (key, value) SELECT 'ipv6_frontier/' || block_id, frontier \
               FROM metis_blocks WHERE frontier IS NOT NULL;
             INSERT INTO metis_settings (key, value) VALUES ('ipv6_frontier/99', '64');
             INSERT INTO metis_settings (key, value) SELECT 'isolated/' || network, '1' \
               FROM metis_networks WHERE isolated = 1;
             INSERT INTO metis_settings (key, value) SELECT 'low_utilization_since/' || network, \
               low_utilization_since FROM metis_networks WHERE low_utilization_since IS NOT NULL;
             {OLD_BLOCKS};
             INSERT INTO metis_blocks_old SELECT block_id, sources, retired, quarantine \
               FROM metis_blocks WHERE sources IS NOT NULL;
             DROP TABLE metis_blocks;
             ALTER TABLE metis_blocks_old RENAME TO metis_blocks;
             DROP TABLE metis_networks;
             COMMIT;"
        ))
        .unwrap();
    }

    /// (block id, sources, frontier) of every Metis block record.
    fn records(store: &Store) -> Vec<(i64, Option<String>, Option<String>)> {
        store
            .conn
            .prepare("SELECT block_id, sources, frontier FROM metis_blocks ORDER BY block_id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    fn settings(store: &Store) -> Vec<String> {
        store
            .conn
            .prepare("SELECT key FROM metis_settings ORDER BY key")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// What `admin check` says is left to move.
    fn left_to_move(path: &std::path::Path) -> Vec<String> {
        let report = check_file(path, Depth::Quick).unwrap();
        report
            .problems
            .into_iter()
            .filter(|p| p.starts_with("metis tables:"))
            .collect()
    }

    /// Network "pods" with a /24 (block 1) and an IPv6 /64 added without a
    /// source (block 2) holding three pods, and "vrf-b" isolated over the
    /// same /24 (block 3); pods's IPv4 use seen low since 12345.
    fn populate(store: &mut Store) {
        let v4 = cidr("198.18.0.0/24");
        store
            .configure(Source::Cni, "pods", Family::V4, &[v4], false, NOW)
            .unwrap();
        store
            .add_cidr_block("pods", &cidr("2001:db8::/64"))
            .unwrap();
        store
            .configure(Source::Cni, "vrf-b", Family::V4, &[v4], true, NOW)
            .unwrap();
        for pod in ["a", "b", "c"] {
            store.allocate(&owner(pod), Family::V6, NOW).unwrap();
        }
        store
            .set_low_utilization_since("pods", Some(12_345))
            .unwrap();
    }

    #[test]
    fn an_old_database_moves_its_keys_into_typed_columns_once() {
        let dir = TempDir::new();
        let before = {
            let mut store = dir.store();
            populate(&mut store);
            records(&store)
        };
        assert_eq!(before.len(), 3, "{before:?}");
        assert_eq!(before[1].1, None, "a block added without a source");
        age(&dir.db());

        // `admin check` names what is left to move, and moves nothing.
        let left = left_to_move(&dir.db());
        assert_eq!(left.len(), 4, "{left:?}");
        assert!(left[0].contains("no frontier column"), "{left:?}");
        assert!(super::needed(&Connection::open(dir.db()).unwrap()).unwrap());
        // A read-only look (STATUS in direct mode) before any open moved
        // them finds the frontiers where the earlier release kept them.
        let read_only = Store::open_read_only(&dir.db()).unwrap().unwrap();
        for (id, _, recorded) in [&before[0], &before[2]] {
            let next = crate::store::block::frontier(&read_only.conn, *id, &cidr("198.18.0.0/24"));
            assert_eq!(Some(next.unwrap().to_string()), *recorded, "block {id}");
        }
        drop(read_only);

        let mut store = dir.store();
        assert!(!super::needed(&store.conn).unwrap());
        assert_eq!(records(&store), before, "sources and frontiers kept");
        assert!(
            settings(&store).iter().all(|key| !key.contains('/')),
            "{:?}",
            settings(&store)
        );
        assert!(store.is_isolated("vrf-b").unwrap());
        assert!(!store.is_isolated("pods").unwrap());
        assert_eq!(store.low_utilization_since("pods").unwrap(), Some(12_345));
        assert_sound(&store);
        // Growth continues from the frontier moved.
        let next = store.allocate(&owner("d"), Family::V6, NOW).unwrap();
        assert_eq!(next.address.to_string(), "2001:db8::5");
        drop(store);

        // Once moved, an open finds nothing to do.
        let store = dir.store();
        assert_eq!(records(&store).len(), 3);
        assert!(check_file(&dir.db(), Depth::Quick).unwrap().is_ok());
    }

    #[test]
    fn a_networks_table_of_the_first_typed_release_gains_the_later_columns() {
        let dir = TempDir::new();
        {
            let mut store = dir.store();
            let v4 = cidr("198.18.0.0/24");
            store
                .configure(Source::Cni, "vrf-b", Family::V4, &[v4], true, NOW)
                .unwrap();
        }
        // metis_networks as the release that introduced it created it.
        Connection::open(dir.db())
            .unwrap()
            .execute_batch(
                "BEGIN;
                 CREATE TABLE metis_networks_old (network TEXT PRIMARY KEY, \
                   isolated INTEGER NOT NULL DEFAULT 0, low_utilization_since INTEGER);
                 INSERT INTO metis_networks_old SELECT network, isolated, low_utilization_since \
                   FROM metis_networks;
                 DROP TABLE metis_networks;
                 ALTER TABLE metis_networks_old RENAME TO metis_networks;
                 COMMIT;",
            )
            .unwrap();
        let left = left_to_move(&dir.db());
        assert_eq!(left.len(), 3, "{left:?}");
        assert!(left[0].contains("no host_local_dir column"), "{left:?}");
        assert!(left[2].contains("no conf_name column"), "{left:?}");
        assert!(super::needed(&Connection::open(dir.db()).unwrap()).unwrap());

        let store = dir.store();
        assert!(!super::needed(&store.conn).unwrap());
        assert!(store.is_isolated("vrf-b").unwrap(), "rows kept");
        assert_eq!(super::missing_network_columns(&store.conn).unwrap(), []);
        drop(store);
        assert!(check_file(&dir.db(), Depth::Quick).unwrap().is_ok());
    }

    /// Every row of Metis's table `table` as the connection reads it, in
    /// today's columns.
    fn rows_of(conn: &Connection, table: super::Earlier) -> Vec<String> {
        let quoted: Vec<String> = table
            .columns()
            .iter()
            .map(|column| format!("quote({column})"))
            .collect();
        let sql = format!(
            "SELECT {} FROM {} ORDER BY 1",
            quoted.join(" || '|' || "),
            table.name()
        );
        conn.prepare(&sql)
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// A read-only look reads a database of each earlier shape as the
    /// migration then writes it: the same rows, key for key (a frontier
    /// key of a block without a record, of a block long gone, two keys of
    /// one block, the later in key order winning; an isolation of "0", a clock that is no number, a
    /// network only the keys name), and the file unchanged by the look.
    #[test]
    fn a_read_only_look_reads_each_earlier_shape_as_the_migration_writes_it() {
        // The shape, as SQL run on today's file, and the keys added.
        let first_typed_networks = "CREATE TABLE metis_networks_old (network TEXT PRIMARY KEY, \
             isolated INTEGER NOT NULL DEFAULT 0, low_utilization_since INTEGER); \
             INSERT INTO metis_networks_old SELECT network, isolated, low_utilization_since \
               FROM metis_networks; \
             DROP TABLE metis_networks; \
             ALTER TABLE metis_networks_old RENAME TO metis_networks;";
        let only_settings = "DROP TABLE metis_blocks; DROP TABLE metis_networks;";
        let shapes = [
            ("oldest with tables", ""),
            ("first typed", first_typed_networks),
            ("settings only", only_settings),
        ];
        for (shape, sql) in shapes {
            let dir = TempDir::new();
            populate(&mut dir.store());
            // A second IPv6 block, added without a source.
            dir.store()
                .add_cidr_block("pods", &cidr("2001:db8:1::/64"))
                .unwrap();
            if sql.is_empty() {
                age(&dir.db());
            } else {
                Connection::open(dir.db())
                    .unwrap()
                    .execute_batch(&format!("BEGIN; {sql} COMMIT;"))
                    .unwrap();
            }
            Connection::open(dir.db())
                .unwrap()
                .execute_batch(
                    "INSERT OR REPLACE INTO metis_settings (key, value) VALUES \
                       ('ipv6_frontier/4', '77'), ('ipv6_frontier/04', '99'), \
                       ('ipv6_frontier/2', '70'), ('ipv6_frontier/42', '5'), \
                       ('isolated/pods', '0'), ('isolated/only-keys', '1'), \
                       ('low_utilization_since/vrf-b', 'soon'), \
                       ('low_utilization_since/quiet', '-7'); \
                     DELETE FROM metis_settings WHERE key = 'healed_state';",
                )
                .unwrap();
            let bytes = std::fs::read(dir.db()).unwrap();
            let read_only = Store::open_read_only(&dir.db()).unwrap().unwrap();
            let looked: Vec<Vec<String>> = super::Earlier::TABLES
                .iter()
                .map(|table| rows_of(&read_only.conn, *table))
                .collect();
            assert!(read_only.is_isolated("only-keys").unwrap(), "{shape}");
            drop(read_only);
            assert_eq!(
                std::fs::read(dir.db()).unwrap(),
                bytes,
                "{shape}: the look wrote"
            );

            let store = dir.store();
            assert!(!super::needed(&store.conn).unwrap(), "{shape}");
            let moved: Vec<Vec<String>> = super::Earlier::TABLES
                .iter()
                .map(|table| rows_of(&store.conn, *table))
                .collect();
            assert_eq!(looked, moved, "{shape}");
            // What the keys said, as the move made it.
            let blocks = &moved[0];
            assert!(
                blocks
                    .iter()
                    .any(|row| row.starts_with("4|") && row.ends_with("|'77'")),
                "{shape}: {blocks:?}"
            );
            assert!(
                blocks
                    .iter()
                    .any(|row| row.starts_with("2|") && row.ends_with("|'70'")),
                "{shape}: {blocks:?}"
            );
            assert!(
                !blocks.iter().any(|row| row.starts_with("42|")),
                "{shape}: {blocks:?}"
            );
            let networks = &moved[1];
            assert!(
                networks.contains(&"'only-keys'|1|NULL|NULL|NULL|NULL".to_string()),
                "{shape}: {networks:?}"
            );
            assert!(
                networks.contains(&"'quiet'|0|-7|NULL|NULL|NULL".to_string()),
                "{shape}: {networks:?}"
            );
            assert!(store.is_isolated("only-keys").unwrap(), "{shape}");
            assert_sound(&store);
        }
    }
}
