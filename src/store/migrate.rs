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

/// Moves every legacy key into its typed column and drops it; rebuilds
/// `metis_blocks` with a frontier column first if it has none. Runs inside
/// the caller's write transaction.
pub(super) fn migrate(conn: &Connection) -> Result<(), StoreError> {
    if !has_frontier_column(conn)? {
        rebuild_blocks(conn)?;
    }
    for (column, kind) in missing_network_columns(conn)? {
        conn.execute_batch(&format!(
            "ALTER TABLE metis_networks ADD COLUMN {column} {kind}"
        ))?;
    }
    let [frontier, isolated, low_since] = schema::LEGACY_KEYS;
    for (id, value) in legacy(conn, frontier)? {
        // A key of a block that is gone (deleted by upstream) is dropped.
        conn.prepare_cached(
            "INSERT INTO metis_blocks (block_id, frontier) \
             SELECT id, ?2 FROM cidr_blocks WHERE id = CAST(?1 AS INTEGER) \
             ON CONFLICT(block_id) DO UPDATE SET frontier = excluded.frontier",
        )?
        .execute(params![id, value])?;
    }
    for (network, value) in legacy(conn, isolated)? {
        if value == "1" {
            conn.prepare_cached(
                "INSERT INTO metis_networks (network, isolated) VALUES (?1, 1) \
                 ON CONFLICT(network) DO UPDATE SET isolated = 1",
            )?
            .execute([network])?;
        }
    }
    for (network, value) in legacy(conn, low_since)? {
        // An unreadable value read as "never seen low", as it did before.
        if let Ok(since) = value.parse::<i64>() {
            conn.prepare_cached(
                "INSERT INTO metis_networks (network, low_utilization_since) VALUES (?1, ?2) \
                 ON CONFLICT(network) DO UPDATE SET low_utilization_since = excluded.low_utilization_since",
            )?
            .execute(params![network, since])?;
        }
    }
    for prefix in schema::LEGACY_KEYS {
        conn.prepare_cached("DELETE FROM metis_settings WHERE key >= ?1 AND key < ?2")?
            .execute(params![prefix, key_range_end(prefix)])?;
    }
    Ok(())
}

/// `metis_blocks` as the first releases created it (no frontier column,
/// `sources` never NULL, a row meaning "Metis has a record"), rebuilt in
/// today's shape: rows keep their sources, so "recorded" keeps its meaning.
fn rebuild_blocks(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch("ALTER TABLE metis_blocks RENAME TO metis_blocks_old")?;
    conn.execute_batch(schema::BLOCKS)?;
    conn.execute_batch(
        "INSERT INTO metis_blocks (block_id, sources, retired, quarantine) \
         SELECT block_id, sources, retired, quarantine FROM metis_blocks_old; \
         DROP TABLE metis_blocks_old;",
    )?;
    Ok(())
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

/// The columns of [`schema::NETWORKS_ADDED`] `metis_networks` lacks.
fn missing_network_columns(
    conn: &Connection,
) -> Result<Vec<(&'static str, &'static str)>, StoreError> {
    let mut missing = Vec::new();
    for (name, kind) in schema::NETWORKS_ADDED {
        let exists: bool = conn
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM pragma_table_info('metis_networks') WHERE name = ?1)",
            )?
            .query_row([name], |r| r.get(0))?;
        if !exists {
            missing.push((name, kind));
        }
    }
    Ok(missing)
}

fn has_frontier_column(conn: &Connection) -> Result<bool, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM pragma_table_info('metis_blocks') WHERE name = 'frontier')",
        )?
        .query_row([], |r| r.get(0))?)
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

    #[test]
    fn an_old_database_moves_its_keys_into_typed_columns_once() {
        let dir = TempDir::new();
        let before = {
            let mut store = dir.store();
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
}
