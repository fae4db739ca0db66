//! An open database: the connection, its write and batch discipline (one
//! immediate transaction per write, or a savepoint of the daemon's group
//! commit), settings, and what one store tallies (passed over, healed).

use std::fmt;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, Transaction, TransactionBehavior, params};

use super::schema::{SCHEMA, SCHEMA_VERSION};
use super::types::*;

/// An open database.
pub struct Store {
    pub(in crate::store) conn: Connection,
    pub(in crate::store) reserve: ReserveMode,
    pub(in crate::store) release_cooldown_ms: i64,
    pub(in crate::store) warnings: Vec<String>,
    /// The database file and its (device, inode) when opened.
    pub(in crate::store) file: (PathBuf, Option<(u64, u64)>),
    pub(in crate::store) batch: Batch,
    /// What the hand-out check passed over: logged (each once), counted.
    pub(in crate::store) passed_over: PassedOver,
    /// What the open-time repair healed of a rollback to upstream.
    pub(in crate::store) healed: Healed,
    /// Whether the open ran the healing.
    pub(in crate::store) healing: Healing,
}

/// What an open did about healing (`repair`): ran it (checking everything,
/// healing what it found), or skipped it on proof that the file is as the
/// healing last left it clean (`crate::store::upkeep::repair::proven_healed`). A read-only open
/// never heals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Healing {
    Ran,
    Skipped,
}

/// The group commit the daemon's loop may hold open (see
/// [`Store::begin_request`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Batch {
    /// Every write is its own `BEGIN IMMEDIATE` transaction.
    None,
    /// A transaction is open; writes are savepoints inside it.
    Open,
    /// A request served alone (or a batch's first) holds the transaction;
    /// its writes take no savepoint, and one dropped unfinished ends the
    /// transaction (see [`Store::alone_ended`]).
    Alone,
    /// SQLite rolled the batch's transaction back: nothing may be written
    /// until [`Store::commit_batch`] reports it and ends the batch.
    Lost,
}

/// One write: its own immediate transaction, or a savepoint of the batch.
/// Dropped without [`Write::commit`], it rolls back either way.
pub(crate) enum Write<'c> {
    Alone(Transaction<'c>),
    InBatch(InBatch<'c>),
}

impl std::ops::Deref for Write<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        match self {
            Write::Alone(tx) => tx,
            Write::InBatch(sp) => sp.conn,
        }
    }
}

impl Write<'_> {
    pub(crate) fn commit(self) -> Result<(), rusqlite::Error> {
        match self {
            Write::Alone(tx) => tx.commit(),
            Write::InBatch(mut sp) => {
                sp.open = false;
                match sp.savepoint {
                    true => control(sp.conn, "RELEASE write"),
                    false => Ok(()),
                }
            }
        }
    }
}

/// A write's savepoint inside the batch, its statements from the cache
/// (rusqlite's `Savepoint` parses `SAVEPOINT`/`RELEASE` again each time,
/// and most requests run one or two writes). Dropped open, it undoes the
/// write alone, as rusqlite's does.
pub(crate) struct InBatch<'c> {
    conn: &'c Connection,
    open: bool,
    /// False in a request served alone: nothing else shares its
    /// transaction, which a dropped write then ends.
    savepoint: bool,
}

impl<'c> InBatch<'c> {
    pub(in crate::store) fn begin(conn: &'c Connection) -> rusqlite::Result<InBatch<'c>> {
        control(conn, "SAVEPOINT write")?;
        Ok(InBatch {
            conn,
            open: true,
            savepoint: true,
        })
    }
}

impl Drop for InBatch<'_> {
    fn drop(&mut self) {
        if self.open && !self.savepoint {
            // Without a savepoint the write cannot be undone alone: the
            // whole transaction is, and the request is served again.
            let _ = control(self.conn, "ROLLBACK");
        } else if self.open {
            // A failure here leaves the savepoint to the request's own
            // `ROLLBACK TO` (the request failed) or to SQLite's rollback
            // of the batch, which `ensure_batch` reports.
            let _ = control(self.conn, "ROLLBACK TO write")
                .and_then(|()| control(self.conn, "RELEASE write"));
        }
    }
}

/// Runs a transaction-control statement from the statement cache: each
/// request runs several, and parsing one again costs more than running it.
pub(in crate::store) fn control(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// The columns of `metis_networks` read one network at a time, in one
/// statement that each reader shares and takes its own column from: a
/// process prepares it once, where a direct-mode ADD prepared one for its
/// isolation and one for the conflist that served it. (The co-writer's
/// registration, read by ADD and DEL alike, has its own.)
pub(in crate::store) const NETWORK_ROW_SQL: &str =
    "SELECT isolated, conf_name, low_utilization_since FROM metis_networks WHERE network = ?1";

/// Where [`NETWORK_ROW_SQL`] puts the isolation.
pub(in crate::store) const NETWORK_ROW_ISOLATED: usize = 0;

/// The columns of `metis_networks` that are set one network at a time;
/// each names its statements, so no SQL is built from strings.
#[derive(Clone, Copy)]
pub(in crate::store) enum NetworkColumn {
    /// When the monitor first saw the network's use low (ms).
    LowUtilizationSince,
    /// The conflist that served the network last (GC under a rename).
    ConfName,
}

impl NetworkColumn {
    /// The column's place in [`NETWORK_ROW_SQL`].
    pub(in crate::store) fn index(self) -> usize {
        match self {
            NetworkColumn::ConfName => 1,
            NetworkColumn::LowUtilizationSince => 2,
        }
    }

    pub(in crate::store) fn upsert_sql(self) -> &'static str {
        match self {
            NetworkColumn::LowUtilizationSince => {
                "INSERT INTO metis_networks (network, low_utilization_since) VALUES (?1, ?2) \
                 ON CONFLICT (network) DO UPDATE SET low_utilization_since = excluded.low_utilization_since"
            }
            NetworkColumn::ConfName => {
                "INSERT INTO metis_networks (network, conf_name) VALUES (?1, ?2) \
                 ON CONFLICT (network) DO UPDATE SET conf_name = excluded.conf_name"
            }
        }
    }
}

/// Starts a write on `conn`. Inside a batch whose transaction SQLite
/// already rolled back, writing on would commit on its own, outside the
/// batch, so that is refused.
pub(crate) fn write(conn: &mut Connection, batch: Batch) -> Result<Write<'_>, StoreError> {
    match batch {
        Batch::None => Ok(Write::Alone(
            conn.transaction_with_behavior(TransactionBehavior::Immediate)?,
        )),
        Batch::Open if !conn.is_autocommit() => Ok(Write::InBatch(InBatch::begin(conn)?)),
        Batch::Alone if !conn.is_autocommit() => Ok(Write::InBatch(InBatch {
            conn,
            open: true,
            savepoint: false,
        })),
        Batch::Open | Batch::Alone | Batch::Lost => Err(StoreError::BatchAborted),
    }
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("reserve", &self.reserve)
            .field("release_cooldown_ms", &self.release_cooldown_ms)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Fails when the database file was deleted or replaced since it was
    /// opened: what is written on would be lost at the next open, and a
    /// plugin in direct mode would not see it.
    pub fn ensure_file_unchanged(&self) -> Result<(), StoreError> {
        let (path, opened) = &self.file;
        if file_identity(path) == *opened {
            return Ok(());
        }
        Err(StoreError::Open {
            path: path.clone(),
            source: "the database file was deleted or replaced while open; \
                     the daemon puts it back from its open copy, retry"
                .into(),
        })
    }

    /// Starts one request of a group commit: opens the batch's transaction
    /// (`BEGIN IMMEDIATE`) if none is open, then a savepoint for the
    /// request, so that [`Store::end_request`] can undo this request alone.
    pub fn begin_request(&mut self) -> Result<(), StoreError> {
        use super::busy::During;
        match self.batch {
            Batch::None => {
                self.control("BEGIN IMMEDIATE").during("BEGIN IMMEDIATE")?;
                self.batch = Batch::Open;
            }
            // The batch's first request kept its writes without a savepoint
            // (it was alone in the transaction); the later ones take theirs.
            Batch::Alone => self.batch = Batch::Open,
            Batch::Open | Batch::Lost => {}
        }
        self.ensure_batch()?;
        self.control("SAVEPOINT request").during("SAVEPOINT")?;
        Ok(())
    }

    /// Starts a request served alone ([`crate::engine::Engine::handle_alone`]):
    /// a transaction without savepoints, neither the request's nor its
    /// writes', as it shares the transaction with nothing; a failed request
    /// ends it ([`Store::abandon_batch`]).
    pub fn begin_alone(&mut self) -> Result<(), StoreError> {
        use super::busy::During;
        self.control("BEGIN IMMEDIATE").during("BEGIN IMMEDIATE")?;
        self.batch = Batch::Alone;
        Ok(())
    }

    /// Whether a batch's transaction is open (or was lost and not yet
    /// reported by [`Store::commit_batch`]).
    pub fn holds_batch(&self) -> bool {
        self.batch != Batch::None
    }

    /// Whether the transaction of a request served alone has ended before
    /// its commit: a write dropped unfinished rolled it back (or SQLite
    /// did), so nothing the request did stays and its outcome must not be
    /// told.
    pub fn alone_ended(&self) -> bool {
        self.batch == Batch::Alone && self.conn.is_autocommit()
    }

    /// Undoes the batch's transaction and ends it (nothing to do without
    /// one, or once SQLite rolled it back itself).
    pub fn abandon_batch(&mut self) -> Result<(), StoreError> {
        self.batch = Batch::None;
        if !self.conn.is_autocommit() {
            self.control("ROLLBACK")?;
        }
        Ok(())
    }

    /// Ends the request [`Store::begin_request`] started: keeps what it
    /// wrote (`RELEASE`) or undoes it (`ROLLBACK TO`). Nothing is durable
    /// before [`Store::commit_batch`].
    pub fn end_request(&mut self, keep: bool) -> Result<(), StoreError> {
        self.ensure_batch()?;
        let ended = if keep {
            self.control("RELEASE request")
        } else {
            self.control("ROLLBACK TO request")
                .and_then(|()| self.control("RELEASE request"))
        };
        ended.map_err(|err| {
            self.batch = Batch::Lost;
            StoreError::from(err)
        })
    }

    /// Commits the batch's requests together (nothing to do without a
    /// batch). On failure the whole batch is rolled back: none of its
    /// requests left anything.
    pub fn commit_batch(&mut self) -> Result<(), StoreError> {
        let result = match std::mem::replace(&mut self.batch, Batch::None) {
            Batch::None => return Ok(()),
            Batch::Open | Batch::Alone => {
                super::busy::During::during(self.control("COMMIT"), "COMMIT")
            }
            Batch::Lost => Err(StoreError::BatchAborted),
        };
        // A failed COMMIT may leave the transaction open (SQLITE_BUSY,
        // a deferred constraint): end it, so the next batch starts clean.
        if result.is_err() && !self.conn.is_autocommit() {
            self.conn.execute_batch("ROLLBACK")?;
        }
        result
    }

    /// Runs a transaction-control statement of the group commit
    /// ([`control`]).
    pub(in crate::store) fn control(&self, sql: &str) -> rusqlite::Result<()> {
        control(&self.conn, sql)
    }

    /// Fails once SQLite has rolled the batch's transaction back by itself.
    pub(in crate::store) fn ensure_batch(&mut self) -> Result<(), StoreError> {
        if self.batch == Batch::Open && self.conn.is_autocommit() {
            self.batch = Batch::Lost;
        }
        match self.batch {
            Batch::Lost => Err(StoreError::BatchAborted),
            Batch::None | Batch::Open | Batch::Alone => Ok(()),
        }
    }

    /// Opens an existing database for reading only: no schema installation,
    /// no repair, no settings written, so observers (STATUS in direct mode,
    /// metrics, checks) never create a database or take the write lock.
    /// `Ok(None)` when there is nothing to read yet — no file, or no schema
    /// installed — in which case the first ADD creates it.
    pub fn open_read_only(path: &Path) -> Result<Option<Store>, StoreError> {
        if !path.exists() {
            return Ok(None);
        }
        let conn = Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| StoreError::Open {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version != SCHEMA_VERSION {
            return Ok(None);
        }
        // Nothing may be created here: Metis's tables a file lacks are
        // read through empty stand-ins.
        super::schema::shadow_missing_tables(&conn)?;
        // Upstream databases have no settings table: default mode then.
        let reserve = get_setting(&conn, super::schema::KEY_RESERVE_MODE)
            .ok()
            .flatten()
            .and_then(|text| ReserveMode::parse(&text))
            .unwrap_or_default();
        let release_cooldown_ms = recorded_cooldown(&conn);
        Ok(Some(Store {
            conn,
            reserve,
            release_cooldown_ms,
            warnings: Vec::new(),
            file: (path.to_path_buf(), file_identity(path)),
            batch: Batch::None,
            passed_over: Default::default(),
            healed: Healed::default(),
            healing: Healing::Skipped,
        }))
    }

    /// Writes a consistent copy of the database to `to` (which must not
    /// exist): SQLite's `VACUUM INTO`, allowed on a read-only connection.
    /// `metis import --dry-run` rehearses on such a copy.
    pub fn copy_to(&self, to: &Path) -> Result<(), StoreError> {
        let target = to
            .to_str()
            .ok_or_else(|| StoreError::Corrupt(format!("{} is not UTF-8", to.display())))?;
        self.conn.execute("VACUUM INTO ?1", [target])?;
        Ok(())
    }

    /// The reservation mode in force.
    pub fn reserve_mode(&self) -> ReserveMode {
        self.reserve
    }

    /// Problems found at open that were left alone (e.g. a pod holding an
    /// address at a reserved position), for the caller to log.
    pub fn open_warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Whether this open ran the healing or skipped it, the file being
    /// as the healing last left it clean.
    pub fn healing(&self) -> Healing {
        self.healing
    }

    /// Installs upstream's schema and Metis's tables where missing; true
    /// when the file had upstream's schema but none of Metis's settings (a
    /// database only upstream has written).
    pub(in crate::store) fn install_schema(&mut self) -> Result<bool, StoreError> {
        use super::busy::During;
        let version: i64 = self
            .conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .during("open: schema check")?;
        if version != SCHEMA_VERSION {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .during("open: BEGIN IMMEDIATE (schema)")?;
            tx.execute_batch(SCHEMA).during("open: schema creation")?;
            tx.commit().during("open: COMMIT (schema)")?;
        }
        // One read for Metis's tables and indexes: every statement costs a
        // parse in a process that opens the database for one request
        // (direct mode).
        let present: Vec<String> = self
            .conn
            .prepare("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")
            .and_then(|mut stmt| stmt.query_map([], |r| r.get(0))?.collect())
            .during("open: schema check")?;
        let upstream_only =
            version == SCHEMA_VERSION && !present.iter().any(|table| table == "metis_settings");
        let own = super::schema::METIS_TABLES
            .iter()
            .chain(super::schema::METIS_INDEXES.iter());
        for (name, create) in own {
            if !present.iter().any(|table| table == name) {
                let tx = self
                    .conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .during("open: BEGIN IMMEDIATE (Metis's tables)")?;
                tx.execute_batch(create)
                    .during("open: Metis's tables and indexes")?;
                tx.commit().during("open: COMMIT (Metis's tables)")?;
            }
        }
        Ok(upstream_only)
    }

    /// The release cooldown in force, in milliseconds (see
    /// [`StoreOptions::release_cooldown`]).
    pub fn release_cooldown(&self) -> i64 {
        self.release_cooldown_ms
    }

    /// When an address released at `now_ms` may be handed out again: `None`
    /// (at once) without a cooldown. The one place release times are made,
    /// for DEL, GC and boot recovery alike.
    pub(in crate::store) fn release_at(&self, now_ms: i64) -> Option<i64> {
        let cooldown = self.release_cooldown_ms;
        (cooldown > 0).then(|| now_ms.saturating_add(cooldown))
    }

    /// The cooldown in force: the one requested (recorded for direct mode
    /// when it changed), else the one recorded, else none.
    pub(in crate::store) fn settle_release_cooldown(
        &mut self,
        requested: Option<i64>,
    ) -> Result<i64, StoreError> {
        match requested {
            Some(cooldown_ms) => {
                self.put_setting(
                    super::schema::KEY_RELEASE_COOLDOWN,
                    Some(&cooldown_ms.to_string()),
                )?;
                Ok(cooldown_ms)
            }
            None => Ok(recorded_cooldown(&self.conn)),
        }
    }

    /// Since when (ms) the monitor has seen the network's use low, if it has.
    pub fn low_utilization_since(&self, network: &str) -> Result<Option<i64>, StoreError> {
        self.network_column(network, NetworkColumn::LowUtilizationSince)
    }

    /// Records (or with `None` forgets) when low use of the network began;
    /// writes only on a change.
    pub fn set_low_utilization_since(
        &mut self,
        network: &str,
        since_ms: Option<i64>,
    ) -> Result<(), StoreError> {
        self.set_network_column::<i64, i64>(network, NetworkColumn::LowUtilizationSince, since_ms)
    }

    /// One per-network column of `metis_networks` (`None` when the network
    /// has no row or the column is NULL).
    pub(in crate::store) fn network_column<T: rusqlite::types::FromSql>(
        &self,
        network: &str,
        column: NetworkColumn,
    ) -> Result<Option<T>, StoreError> {
        Ok(self
            .conn
            .prepare_cached(NETWORK_ROW_SQL)?
            .query_row([network], |r| r.get(column.index()))
            .optional()?
            .flatten())
    }

    /// Sets one per-network column of `metis_networks`, in its own write
    /// and only when the value changes (`Stored` is the type it is read
    /// back as, e.g. `String` for a `&str` value).
    pub(in crate::store) fn set_network_column<Stored, Value>(
        &mut self,
        network: &str,
        column: NetworkColumn,
        value: Option<Value>,
    ) -> Result<(), StoreError>
    where
        Stored: rusqlite::types::FromSql + PartialEq<Value>,
        Value: rusqlite::ToSql,
    {
        let unchanged = match (self.network_column::<Stored>(network, column)?, &value) {
            (Some(stored), Some(value)) => stored == *value,
            (stored, value) => stored.is_none() && value.is_none(),
        };
        if unchanged {
            return Ok(());
        }
        let tx = write(&mut self.conn, self.batch)?;
        tx.prepare_cached(column.upsert_sql())?
            .execute(params![network, value])?;
        tx.commit()?;
        Ok(())
    }

    /// A value of Metis's own settings table.
    pub fn setting(&self, key: &str) -> Result<Option<String>, StoreError> {
        get_setting(&self.conn, key)
    }

    /// Sets (or with `None` removes) a setting; writes only on a change.
    pub fn put_setting(&mut self, key: &str, value: Option<&str>) -> Result<(), StoreError> {
        if get_setting(&self.conn, key)?.as_deref() == value {
            return Ok(());
        }
        let tx = write(&mut self.conn, self.batch)?;
        match value {
            Some(value) => set_setting(&tx, key, value)?,
            None => {
                tx.prepare_cached("DELETE FROM metis_settings WHERE key = ?1")?
                    .execute([key])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// The mode in force, and whether it was recorded just now (changed).
    pub(in crate::store) fn settle_reserve_mode(
        &mut self,
        requested: Option<ReserveMode>,
    ) -> Result<(ReserveMode, bool), StoreError> {
        let stored = match get_setting(&self.conn, super::schema::KEY_RESERVE_MODE)? {
            None => None,
            Some(text) => {
                let parsed = ReserveMode::parse(&text);
                if parsed.is_none() {
                    self.warnings.push(format!(
                        "store: unknown reserve_mode {text:?} in metis_settings; using every-block"
                    ));
                }
                parsed
            }
        };
        match requested {
            None => Ok((stored.unwrap_or_default(), false)),
            Some(mode) => {
                let changed = stored != Some(mode);
                if changed {
                    let tx = self
                        .conn
                        .transaction_with_behavior(TransactionBehavior::Immediate)?;
                    set_setting(&tx, super::schema::KEY_RESERVE_MODE, mode.as_str())?;
                    tx.commit()?;
                }
                Ok((mode, changed))
            }
        }
    }
}

/// (device, inode) of the file at `path`, if there is one.
pub(in crate::store) fn file_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The release cooldown the daemon last recorded; 0 when there is none
/// (never recorded, an upstream database, or an unreadable value).
pub(in crate::store) fn recorded_cooldown(conn: &Connection) -> i64 {
    get_setting(conn, super::schema::KEY_RELEASE_COOLDOWN)
        .ok()
        .flatten()
        .and_then(|text| text.parse().ok())
        .unwrap_or(0)
}

pub(crate) fn get_setting(conn: &Connection, key: &str) -> Result<Option<String>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT value FROM metis_settings WHERE key = ?1")?
        .query_row([key], |r| r.get(0))
        .optional()?)
}

pub(crate) fn set_setting(conn: &Connection, key: &str, value: &str) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO metis_settings (key, value) VALUES (?1, ?2) \
         ON CONFLICT(key) DO UPDATE SET value = excluded.value",
    )?
    .execute(params![key, value])?;
    Ok(())
}

/// How many distinct passed-over rows and blocks a store logs.
const MAX_LOGGED_PASSED_OVER: usize = 1024;

/// What the hand-out check passed over, as one store saw it: the lines it
/// logged (each once), and the count by reason since the daemon last took
/// them ([`Store::take_passed_over_counts`]).
#[derive(Debug, Default)]
pub(crate) struct PassedOver {
    logged: std::collections::HashSet<String>,
    pub(in crate::store) counts: std::collections::BTreeMap<&'static str, u64>,
}

impl PassedOver {
    /// Counts one passed-over `line` of `network` by `reason`; logs it
    /// once per store (the first [`MAX_LOGGED_PASSED_OVER`]: a writer
    /// planting rows by the million costs no memory).
    pub(in crate::store) fn note(&mut self, reason: &'static str, line: &str, network: &str) {
        *self.counts.entry(reason).or_default() += 1;
        if self.logged.len() < MAX_LOGGED_PASSED_OVER && self.logged.insert(line.to_string()) {
            crate::log::warn(
                "store",
                "passed over what does not fit the configuration in force (another writer made it)",
                &[("network", &network), ("row", &line)],
            );
        }
    }
}

/// How many of each kind one open healed (the daemon counts them in
/// `metis_daemon_rollback_repairs_total`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Healed {
    /// Retired blocks made `Ready` by someone else, withheld again.
    pub revived_blocks: u64,
    /// Free rows beyond a block's bounds, reserved.
    pub rows_beyond_bounds: u64,
    /// Free rows outside a block's prefix, deleted.
    pub rows_outside_prefix: u64,
}

impl Healed {
    /// (kind label, count), the metric's series.
    pub fn by_kind(&self) -> [(&'static str, u64); 3] {
        [
            ("revived_block", self.revived_blocks),
            ("row_beyond_bounds", self.rows_beyond_bounds),
            ("row_outside_prefix", self.rows_outside_prefix),
        ]
    }
}
