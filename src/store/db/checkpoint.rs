//! WAL checkpoints off the daemon's loop.
//!
//! SQLite checkpoints inside the commit that pushes the WAL past 1,000
//! pages: copying those pages into the database file and syncing it then
//! lands on one client's request, which waits for it (bench/history.md,
//! "Measurements once in comments"). The daemon instead
//! leaves checkpoints to a thread with its own connection. It checkpoints
//! PASSIVE — it never waits for, nor blocks, the loop's reads and writes —
//! soon after writes, and backs off to a slow poll while the daemon idles.
//! The loop's connection keeps a much larger automatic threshold, so the
//! WAL stays bounded should the thread ever fall behind or fail.
//! Durability is unchanged: what a checkpoint copies was committed (and, at
//! `synchronous=FULL`, synced) before, and a checkpoint cut short by a crash
//! is redone from the WAL at the next open.

use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::config::DbConfig;
use rusqlite::{Connection, OpenFlags};

use super::connection::Store;
use super::types::StoreError;
use crate::log;

/// The loop connection's own automatic checkpoint, in pages (64 MiB of
/// 4 KiB pages): only reached when the thread falls behind.
pub const LOOP_AUTOCHECKPOINT_PAGES: i64 = 16_384;

/// How soon after a pass that found new frames the next one runs.
const BUSY_INTERVAL: Duration = Duration::from_millis(100);

/// The longest wait between passes while nothing is written.
const IDLE_INTERVAL: Duration = Duration::from_secs(5);

/// The checkpoint thread; stopped and joined when dropped.
pub struct Checkpointer {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Starts checkpointing the database at `path` (opened lazily, reopened
    /// after an error) — only the file that is there now: one put at the
    /// path later would take this database's WAL for its own.
    pub fn start(path: &Path) -> std::io::Result<Checkpointer> {
        let (stop, stopped) = mpsc::channel::<()>();
        let path = path.to_path_buf();
        let file = super::connection::file_identity(&path);
        let thread = std::thread::Builder::new()
            .name("metis-checkpoint".into())
            .spawn(move || run(&path, file, &stopped))?;
        Ok(Checkpointer {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // Dropping the sender wakes the thread at once.
        self.stop.take();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            log::error("store", "the checkpoint thread panicked", &[]);
        }
    }
}

/// WAL size past which a process that served one request (direct mode)
/// checkpoints before it exits, in bytes: 64 frames of 4 KiB pages, about
/// nine execs. It trades the WAL index every opener rebuilds against the
/// checkpoint's syncs ([`Store::trim_wal`]); measured in bench/history.md,
/// "Issue 22: direct mode's wall clock".
pub const ONE_REQUEST_WAL_LIMIT: u64 = 64 * (4096 + 24);

/// How long that checkpoint waits for other processes' transactions
/// before it leaves the work to the next process.
const ONE_REQUEST_CHECKPOINT_WAIT: Duration = Duration::from_millis(100);

impl Store {
    /// Leaves WAL checkpoints to a [`Checkpointer`]: this connection only
    /// checkpoints past [`LOOP_AUTOCHECKPOINT_PAGES`].
    /// Its WAL file is cut back to [`WAL_SIZE_LIMIT_BYTES`] when it starts
    /// over.
    pub fn defer_checkpoints(&self) -> Result<(), StoreError> {
        self.conn
            .pragma_update(None, "wal_autocheckpoint", LOOP_AUTOCHECKPOINT_PAGES)?;
        self.conn
            .pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT_BYTES)?;
        Ok(())
    }

    /// For a process that serves one request and exits (direct mode):
    /// closing leaves the WAL to the next process instead of checkpointing
    /// it; [`Store::trim_wal`] checkpoints every few requests instead.
    pub fn leave_wal_on_close(&self) -> Result<(), StoreError> {
        self.conn
            .set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)?;
        self.conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        Ok(())
    }

    /// Past [`ONE_REQUEST_WAL_LIMIT`], copies the WAL into the database and
    /// truncates it (only `TRUNCATE` leaves a mark the next process sees),
    /// giving up quietly while others keep the database busy. Never while
    /// `daemon_owns` (asked only past the limit): the daemon's thread bounds
    /// the WAL, and the reader it pins would make this checkpoint fail while
    /// holding the write lock. Returns whether it checkpointed.
    pub fn trim_wal(&self, daemon_owns: impl FnOnce() -> bool) -> Result<bool, StoreError> {
        let mut wal = self.file.0.as_os_str().to_owned();
        wal.push("-wal");
        let size = std::fs::metadata(&wal).map_or(0, |meta| meta.len());
        if size < ONE_REQUEST_WAL_LIMIT || daemon_owns() {
            return Ok(false);
        }
        self.conn.busy_timeout(ONE_REQUEST_CHECKPOINT_WAIT)?;
        let busy: i64 = super::busy::During::during(
            self.conn
                .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |row| row.get(0)),
            "PRAGMA wal_checkpoint(TRUNCATE)",
        )?;
        Ok(busy == 0)
    }
}

/// Frames the WAL may grow to before the thread lets it start over: about
/// 75 ADD+DEL pairs, 4 MiB. See [`Pin`].
const RESTART_FRAMES: i64 = 1_000;

/// The size the daemon's WAL file is cut back to when it starts over
/// (`journal_size_limit`): a quarter above [`RESTART_FRAMES`] frames, so a
/// steady cycle reuses the file and a burst's growth does not stay.
pub const WAL_SIZE_LIMIT_BYTES: i64 = RESTART_FRAMES * 5 / 4 * (4096 + 24);

/// A read transaction the thread holds at the WAL's end, so that the
/// daemon's next write appends to the WAL rather than starting it over.
///
/// Once a checkpoint has copied every frame, SQLite's next writer starts
/// the WAL over — unless a reader still uses it — and a WAL started over
/// gets a new header, which SQLite syncs (`fsync`) inside that writer's
/// commit, at `synchronous=NORMAL` too. Checkpointing soon after writes
/// put that sync on the first request after nearly every pass
/// (bench/history.md). Held from before
/// each checkpoint, the pin lets the checkpoint copy everything and keeps
/// the WAL from starting over, until it holds [`RESTART_FRAMES`]: then it
/// is let go until the WAL has started over, and two requests in that
/// many frames pay the sync (the pass that sees the new WAL copied it
/// unpinned). Durability is unchanged (every commit writes its frames as
/// before); the loop's own threshold still bounds the WAL.
struct Pin {
    conn: Connection,
    /// The checkpoint connection's `data_version` when the pin was taken:
    /// taken again only after other connections committed (an
    /// unchanged, fully copied WAL would not be held).
    seen: Option<i64>,
    /// The WAL reached the limit: no pin until it has started over.
    releasing: bool,
    last_frames: i64,
    limit: i64,
}

impl Pin {
    fn new(conn: Connection, limit: i64) -> Pin {
        Pin {
            conn,
            seen: None,
            releasing: false,
            last_frames: 0,
            limit,
        }
    }

    /// Before a checkpoint: holds a read transaction at the WAL's end now,
    /// if anything was committed since the last one.
    fn take(&mut self, version: i64) -> rusqlite::Result<()> {
        if self.releasing || self.seen == Some(version) {
            return Ok(());
        }
        self.end()?;
        // Cached: a pass runs these every 100 ms while the daemon writes.
        self.conn.prepare_cached("BEGIN")?.execute([])?;
        self.conn
            .prepare_cached("SELECT COUNT(*) FROM sqlite_master")?
            .query_row([], |_| Ok(()))?;
        self.seen = Some(version);
        Ok(())
    }

    fn end(&mut self) -> rusqlite::Result<()> {
        if !self.conn.is_autocommit() {
            self.conn.prepare_cached("COMMIT")?.execute([])?;
        }
        Ok(())
    }

    /// After a checkpoint that found the WAL as `state` says.
    fn after(&mut self, state: WalState) -> rusqlite::Result<()> {
        if self.releasing && state.frames < self.last_frames {
            // Started over: held again from the next pass.
            self.releasing = false;
            self.seen = None;
        } else if !self.releasing && state.frames >= self.limit {
            self.end()?;
            self.releasing = true;
        }
        self.last_frames = state.frames;
        Ok(())
    }
}

/// The thread: a pass, then a wait that is short while the WAL moves and
/// doubles up to [`IDLE_INTERVAL`] while it does not.
fn run(path: &Path, file: Option<(u64, u64)>, stopped: &mpsc::Receiver<()>) {
    let mut conn: Option<Connection> = None;
    let mut pin: Option<Pin> = None;
    let mut wait = BUSY_INTERVAL;
    let mut last: Option<WalState> = None;
    let mut failing = false;
    loop {
        match stopped.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        match pinned_pass(&mut conn, &mut pin, path, file) {
            Ok(state) => {
                failing = false;
                wait = match Some(state) == last && state.done() {
                    true => wait.saturating_mul(2).min(IDLE_INTERVAL),
                    false => BUSY_INTERVAL,
                };
                last = Some(state);
            }
            Err(err) => {
                // Logged once per run of failures; the loop's own threshold
                // keeps the WAL bounded meanwhile.
                if !failing {
                    log::warn(
                        "store",
                        "WAL checkpoint failed; retrying",
                        &[("error", &err)],
                    );
                }
                failing = true;
                conn = None;
                pin = None;
                wait = IDLE_INTERVAL;
            }
        }
    }
}

/// What `PRAGMA wal_checkpoint` reports: frames in the WAL and frames
/// copied into the database file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WalState {
    frames: i64,
    copied: i64,
}

impl WalState {
    fn done(self) -> bool {
        self.copied >= self.frames
    }
}

/// A pass holding the [`Pin`] (opened with the checkpoint connection).
fn pinned_pass(
    conn: &mut Option<Connection>,
    pin: &mut Option<Pin>,
    path: &Path,
    file: Option<(u64, u64)>,
) -> Result<WalState, rusqlite::Error> {
    let checkpoint = opened(conn, path, file)?;
    let pin = match pin {
        Some(pin) => pin,
        None => pin.insert(Pin::new(open(path, file)?, RESTART_FRAMES)),
    };
    let version: i64 = checkpoint
        .prepare_cached("PRAGMA data_version")?
        .query_row([], |row| row.get(0))?;
    pin.take(version)?;
    let state = checkpoint_passive(checkpoint)?;
    pin.after(state)?;
    Ok(state)
}

/// The checkpoint connection, opened if it is not yet.
fn opened<'c>(
    conn: &'c mut Option<Connection>,
    path: &Path,
    file: Option<(u64, u64)>,
) -> Result<&'c mut Connection, rusqlite::Error> {
    Ok(match conn {
        Some(conn) => conn,
        None => conn.insert(open(path, file)?),
    })
}

/// A connection to the daemon's database — the file that is at `path`
/// now, if it is still the one the daemon opened.
fn open(path: &Path, file: Option<(u64, u64)>) -> Result<Connection, rusqlite::Error> {
    let opened = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    if super::connection::file_identity(path) != file {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CANTOPEN),
            Some("the file at the path is no longer the daemon's database".into()),
        ));
    }
    Ok(opened)
}

fn checkpoint_passive(conn: &Connection) -> Result<WalState, rusqlite::Error> {
    conn.prepare_cached("PRAGMA wal_checkpoint(PASSIVE)")?
        .query_row([], |row| {
            Ok(WalState {
                frames: row.get(1)?,
                copied: row.get(2)?,
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::Family;
    use crate::testutil::{TempDir, owner};

    /// Rows allocated as the database file alone says, WAL ignored.
    fn allocated_in_file(path: &Path) -> i64 {
        let uri = format!("file:{}?immutable=1", path.display());
        let conn = Connection::open_with_flags(
            uri,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_URI,
        )
        .unwrap();
        conn.query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE container_id != ''",
            [],
            |r| r.get(0),
        )
        .unwrap_or(0)
    }

    #[test]
    fn committed_allocations_reach_the_database_file_off_the_writers_connection() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store.defer_checkpoints().unwrap();
        store
            .add_cidr_block("pods", &"198.18.0.0/24".parse().unwrap())
            .unwrap();
        for n in 0..200 {
            store
                .allocate(&owner(&format!("c{n}")), Family::V4, 0)
                .unwrap();
        }
        // Committed, but only in the WAL: the writer does not checkpoint.
        assert!(allocated_in_file(&dir.db()) < 200);
        let checkpointer = Checkpointer::start(&dir.db()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while allocated_in_file(&dir.db()) != 200 {
            assert!(
                std::time::Instant::now() < deadline,
                "the checkpoint never came"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(checkpointer);
        // The writer goes on after the thread stopped.
        store.allocate(&owner("late"), Family::V4, 0).unwrap();
    }

    #[test]
    fn a_missing_database_is_an_error_and_is_not_created() {
        let dir = TempDir::new();
        let (mut conn, mut pin) = (None, None);
        assert!(pinned_pass(&mut conn, &mut pin, &dir.db(), None).is_err());
        assert!(conn.is_none() && pin.is_none());
        assert!(!dir.db().exists());
    }

    #[test]
    fn another_file_put_at_the_path_is_not_checkpointed() {
        let dir = TempDir::new();
        drop(dir.store());
        let daemons = crate::store::db::connection::file_identity(&dir.db());
        let other = dir.0.join("other.sqlite");
        Connection::open(&other)
            .unwrap()
            .execute_batch("CREATE TABLE mine (x)")
            .unwrap();
        std::fs::rename(&other, dir.db()).unwrap();
        let (mut conn, mut pin) = (None, None);
        let err = pinned_pass(&mut conn, &mut pin, &dir.db(), daemons).unwrap_err();
        assert!(err.to_string().contains("no longer the daemon's"), "{err}");
        assert!(conn.is_none() && pin.is_none());
    }

    fn wal_size(dir: &TempDir) -> u64 {
        let mut wal = dir.db().into_os_string();
        wal.push("-wal");
        std::fs::metadata(wal).map_or(0, |meta| meta.len())
    }

    #[test]
    fn a_one_request_process_trims_the_wal_past_the_limit_unless_a_daemon_owns_the_database() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store.leave_wal_on_close().unwrap();
        store
            .add_cidr_block("pods", &"198.18.0.0/24".parse().unwrap())
            .unwrap();
        // Below the limit the owner is not even asked.
        let asked = std::cell::Cell::new(false);
        let below = store.trim_wal(|| {
            asked.set(true);
            false
        });
        assert!(!below.unwrap() && !asked.get());
        let mut n = 0;
        while wal_size(&dir) < ONE_REQUEST_WAL_LIMIT {
            store
                .allocate(&owner(&format!("c{n}")), Family::V4, 0)
                .unwrap();
            n += 1;
        }
        let before = wal_size(&dir);
        // A daemon owns it: its thread's business, the WAL is left as is.
        assert!(!store.trim_wal(|| true).unwrap());
        assert_eq!(wal_size(&dir), before);
        // No daemon: copied back and truncated.
        assert!(store.trim_wal(|| false).unwrap());
        assert_eq!(wal_size(&dir), 0);
        assert_eq!(allocated_in_file(&dir.db()), n);
    }

    #[test]
    fn a_wal_a_burst_grew_past_the_size_limit_is_cut_back_when_it_starts_over() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store.defer_checkpoints().unwrap();
        store
            .add_cidr_block("pods", &"198.18.0.0/20".parse().unwrap())
            .unwrap();
        let limit = u64::try_from(WAL_SIZE_LIMIT_BYTES).unwrap();
        let mut n = 0;
        while wal_size(&dir) <= limit {
            store
                .allocate(&owner(&format!("c{n}")), Family::V4, 0)
                .unwrap();
            n += 1;
        }
        let grown = wal_size(&dir);
        // The thread's pass: everything copied, nothing pinned.
        let file = crate::store::db::connection::file_identity(&dir.db());
        let mut conn = None;
        let state = checkpoint_passive(opened(&mut conn, &dir.db(), file).unwrap()).unwrap();
        assert!(state.done(), "{state:?}");
        assert_eq!(wal_size(&dir), grown, "a checkpoint alone cuts nothing");
        // The next write starts the WAL over and cuts the file back.
        store.allocate(&owner("after"), Family::V4, 0).unwrap();
        let cut = wal_size(&dir);
        assert!(
            cut <= limit && cut < grown,
            "the WAL grew to {grown} bytes and is {cut} after it started over (limit {limit})"
        );
        assert_eq!(allocated_in_file(&dir.db()), n);
    }

    /// The daemon's writes with checkpoints after each: (frames in the
    /// WAL, copied) after each pass. With the pin, a write after a full
    /// checkpoint appends (the WAL grows, no new header to sync) until
    /// `limit` frames, then the WAL starts over once; without it, it starts
    /// over after every pass.
    fn passes(pinned: Option<i64>) -> Vec<WalState> {
        let dir = TempDir::new();
        let mut store = dir.store();
        store.defer_checkpoints().unwrap();
        store
            .add_cidr_block("pods", &"198.18.0.0/22".parse().unwrap())
            .unwrap();
        let file = crate::store::db::connection::file_identity(&dir.db());
        let mut conn = None;
        let mut pin = pinned.map(|limit| Pin::new(open(&dir.db(), file).unwrap(), limit));
        let mut states = Vec::new();
        for n in 0..24 {
            store
                .allocate(&owner(&format!("c{n}")), Family::V4, 0)
                .unwrap();
            let state = if pin.is_some() {
                pinned_pass(&mut conn, &mut pin, &dir.db(), file).unwrap()
            } else {
                checkpoint_passive(opened(&mut conn, &dir.db(), file).unwrap()).unwrap()
            };
            assert!(state.done(), "{state:?}: the pin held the checkpoint back");
            states.push(state);
        }
        states
    }

    /// How many times the WAL started over along `states` (one write
    /// after each pass: a WAL that did not grow started over).
    fn restarts(states: &[WalState]) -> usize {
        states
            .windows(2)
            .filter(|w| w[1].frames <= w[0].frames)
            .count()
    }

    #[test]
    fn the_wal_starts_over_once_it_holds_the_limit_not_after_every_checkpoint() {
        let unpinned = passes(None);
        assert!(restarts(&unpinned) >= 20, "{unpinned:?}");
        let pinned = passes(Some(30));
        let frames: Vec<i64> = pinned.iter().map(|state| state.frames).collect();
        assert!(
            restarts(&pinned) >= 1,
            "{frames:?}: the WAL grew without bound"
        );
        // Twice per run up to the limit: the pass that sees the WAL
        // started over copied it unpinned, so the next write starts it
        // over again.
        assert!(restarts(&pinned) * 2 <= restarts(&unpinned), "{frames:?}");
        // (The first pass finds the block's rows too.)
        assert!(frames[1..].iter().all(|&n| n < 30 + 14), "{frames:?}");
    }
}
