//! Opening the database: create or check the schema, settle the recorded
//! options, and run the repair (or skip it on proof the file is clean).

use std::fs::{DirBuilder, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use rusqlite::Connection;
use rusqlite::config::DbConfig;

use crate::store::db::*;
use crate::store::{db, upkeep};

impl Store {
    /// Opens (creating if needed) the database at `path`: parent directory
    /// 0700, file 0600 (an existing file is tightened to 0600; a shared
    /// directory is only warned about, see [`files`]), WAL, foreign keys, 5 s busy timeout; installs the
    /// schema unless `user_version` is already 1; repairs reservations.
    pub fn open(path: &Path, opts: &StoreOptions) -> Result<Store, StoreError> {
        if path.as_os_str().is_empty() {
            return Err(StoreError::InvalidPath);
        }
        let open_err = |source: std::io::Error| StoreError::Open {
            path: path.to_path_buf(),
            source: Box::new(source),
        };
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
            && !parent.exists()
        {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(open_err)?;
        }
        if !path.exists() {
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
            {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(open_err(e)),
            }
        }
        let file_warnings = db::files::tighten(path);
        db::busy::patiently("open the database", OPEN_PATIENCE, || {
            Store::open_once(path, opts, file_warnings.clone())
        })
    }

    /// One attempt of [`Store::open`] on the file that is there; every
    /// step that takes a lock is named in a busy error.
    pub(in crate::store) fn open_once(
        path: &Path,
        opts: &StoreOptions,
        warnings: Vec<String>,
    ) -> Result<Store, StoreError> {
        use db::busy::During;
        let conn = Connection::open(path).map_err(|e| StoreError::Open {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
        configure(&conn, opts)?;
        let mut store = Store {
            conn,
            reserve: ReserveMode::EveryBlock,
            release_cooldown_ms: 0,
            warnings,
            file: (path.to_path_buf(), file_identity(path)),
            batch: Batch::None,
            passed_over: Default::default(),
            healed: Healed::default(),
            healing: Healing::Ran,
        };
        // Before any statement is cached: a change of the connection's
        // flags expires every prepared statement, to be parsed again.
        if opts.one_request
            && let Err(err) = store.leave_wal_on_close()
        {
            let warning = format!("closing checkpoints the database: {err}");
            store.warnings.push(warning);
        }
        // A file as the healing last left it clean needs neither the
        // schema check nor the healing (see `upkeep::repair::proven_healed`): most
        // of what a one-request process (direct mode) spent opening it.
        let proven = upkeep::repair::proven_healed(&store.conn);
        let upstream_only = match proven {
            true => false,
            false => store.install_schema()?,
        };
        let (reserve, mode_changed) = store
            .settle_reserve_mode(opts.reserve)
            .during("open: reserve mode")?;
        store.reserve = reserve;
        // Upstream released with its daemon's cooldown: a first open
        // without one asked for (direct mode) keeps that, not none.
        let cooldown = opts
            .release_cooldown
            .or(upstream_only.then_some(crate::defaults::DEFAULT_RELEASE_COOLDOWN_MS));
        store.release_cooldown_ms = store
            .settle_release_cooldown(cooldown)
            .during("open: release cooldown")?;
        store.healing = match proven && !mode_changed {
            true => Healing::Skipped,
            false => {
                store.repair().during("open: repair")?;
                Healing::Ran
            }
        };
        Ok(store)
    }
}

/// The connection's settings, before any statement is prepared.
fn configure(conn: &Connection, opts: &StoreOptions) -> Result<(), StoreError> {
    use db::busy::During;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    // Savepoints (the daemon's group commit) keep their undo in a
    // sub-journal: in memory, as a read-only root filesystem (the
    // DaemonSet's) has no temporary directory SQLite could use, and
    // every grouped commit would fail with an I/O error.
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
        .during("open: PRAGMA journal_mode=WAL")?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Corrupt(format!(
            "journal_mode is {mode}, WAL could not be enabled"
        )));
    }
    conn.pragma_update(None, "foreign_keys", "ON")?;
    let sync = match opts.durability {
        Durability::Normal => "NORMAL",
        Durability::Full => "FULL",
    };
    conn.pragma_update(None, "synchronous", sync)?;
    // Plans must not depend on bound values. Otherwise SQLite marks such
    // statements (the claim query among them) to be re-prepared whenever
    // their bindings are cleared, which rusqlite's statement cache does
    // on every reuse: a third of each allocation went to re-parsing.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    // Upstream's triggers only stamp `updated_at`, which every Metis UPDATE
    // of those tables stamps itself (`stamped!`, or the caller's clock where
    // it names one). Fired, they make each UPDATE in a transaction copy the
    // pages it changes into a statement journal, and a one-request process
    // compile them into each; the file keeps them for upstream's writes.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_TRIGGER, false)?;
    Ok(())
}
