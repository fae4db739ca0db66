//! WAL checkpoints off the daemon's loop.
//!
//! SQLite checkpoints inside the commit that pushes the WAL past 1,000
//! pages: copying those pages into the database file and syncing it then
//! lands on one client's request, which waits for it (measured here: ADD
//! p99.9 17 ms with it, 0.4 ms without; pairs/s +40 %). The daemon instead
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

use super::{Store, StoreError};
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
        let file = super::file_identity(&path);
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
/// checkpoints before it exits, in bytes: 32 frames of 4 KiB pages, about
/// four ADDs and four DELs. Every such process rebuilds the WAL's index by
/// reading the whole WAL when it opens the database, about 2,600
/// instructions a frame (callgrind): at 32 frames the average exec still
/// runs fewer instructions than one that checkpointed as it closed, and
/// syncs a tenth as often (bench/history.md, "Direct mode").
pub const ONE_REQUEST_WAL_LIMIT: u64 = 32 * (4096 + 24);

/// How long that checkpoint waits for other processes' transactions
/// before it leaves the work to the next process.
const ONE_REQUEST_CHECKPOINT_WAIT: Duration = Duration::from_millis(100);

impl Store {
    /// Leaves WAL checkpoints to a [`Checkpointer`]: this connection only
    /// checkpoints past [`LOOP_AUTOCHECKPOINT_PAGES`].
    pub fn defer_checkpoints(&self) -> Result<(), StoreError> {
        self.conn
            .pragma_update(None, "wal_autocheckpoint", LOOP_AUTOCHECKPOINT_PAGES)?;
        Ok(())
    }

    /// For a process that opens the database for one request and exits
    /// (direct mode): closing leaves the WAL to the next process instead of
    /// checkpointing and deleting it, which cost four syncs per request
    /// (the WAL and its directory when the next process recreated it, the
    /// WAL and the database at the checkpoint); [`Store::trim_wal`] then
    /// checkpoints every few requests. Durability is that of
    /// `synchronous=NORMAL`, as in the daemon: a commit not yet synced can
    /// be lost only with the machine, and the next boot releases every
    /// allocation of this one anyway.
    pub fn leave_wal_on_close(&self) -> Result<(), StoreError> {
        self.conn
            .set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)?;
        self.conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        Ok(())
    }

    /// Once the WAL has passed [`ONE_REQUEST_WAL_LIMIT`], copies it into
    /// the database and truncates it, so that the next process neither
    /// reads a long WAL nor finds one it cannot restart (a process that
    /// rebuilds the WAL's index no longer knows what was copied back).
    /// Gives up quietly when other processes keep the database busy: the
    /// next one tries again. Returns whether it checkpointed.
    pub fn trim_wal(&self) -> Result<bool, StoreError> {
        let mut wal = self.file.0.as_os_str().to_owned();
        wal.push("-wal");
        let size = std::fs::metadata(&wal).map_or(0, |meta| meta.len());
        if size < ONE_REQUEST_WAL_LIMIT {
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

/// The thread: a pass, then a wait that is short while the WAL moves and
/// doubles up to [`IDLE_INTERVAL`] while it does not.
fn run(path: &Path, file: Option<(u64, u64)>, stopped: &mpsc::Receiver<()>) {
    let mut conn: Option<Connection> = None;
    let mut wait = BUSY_INTERVAL;
    let mut last: Option<WalState> = None;
    let mut failing = false;
    loop {
        match stopped.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        match pass(&mut conn, path, file) {
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

fn pass(
    conn: &mut Option<Connection>,
    path: &Path,
    file: Option<(u64, u64)>,
) -> Result<WalState, rusqlite::Error> {
    let conn = match conn {
        Some(conn) => conn,
        None => {
            let opened = Connection::open_with_flags(
                path,
                OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )?;
            if super::file_identity(path) != file {
                return Err(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CANTOPEN),
                    Some("the file at the path is no longer the daemon's database".into()),
                ));
            }
            conn.insert(opened)
        }
    };
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
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
        let mut conn = None;
        assert!(pass(&mut conn, &dir.db(), None).is_err());
        assert!(conn.is_none());
        assert!(!dir.db().exists());
    }

    #[test]
    fn another_file_put_at_the_path_is_not_checkpointed() {
        let dir = TempDir::new();
        drop(dir.store());
        let daemons = super::super::file_identity(&dir.db());
        let other = dir.0.join("other.sqlite");
        Connection::open(&other)
            .unwrap()
            .execute_batch("CREATE TABLE mine (x)")
            .unwrap();
        std::fs::rename(&other, dir.db()).unwrap();
        let mut conn = None;
        let err = pass(&mut conn, &dir.db(), daemons).unwrap_err();
        assert!(err.to_string().contains("no longer the daemon's"), "{err}");
        assert!(conn.is_none());
    }
}
