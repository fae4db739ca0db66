//! A database deleted or replaced under the running daemon is put back at
//! its path from the daemon's open connection, never replaced by an empty
//! one: the open (unlinked) file is then the only record of which pod holds
//! which address, and a daemon that started on an empty database would hand
//! every one of them out again.
//!
//! The loop checks the file's (device, inode) at every turn, between
//! batches (see [`Keeper::keep`]). Restoring takes three steps, each safe
//! to retry at the next turn if it fails:
//! 1. copy: `VACUUM INTO` a file beside the database writes a consistent
//!    copy through the open connection, synced;
//! 2. close: every connection to the deleted file is closed (the engine's
//!    and the checkpoint thread's), so that none writes `DB-wal` once the
//!    restored file owns that name. A stand-in store whose file is already
//!    gone takes the engine's store's place, so that every request meanwhile
//!    is refused (code 11), never served from anything but the restored file;
//! 3. install: whatever now lies at the path is moved aside (kept for the
//!    operator), the closed connections' `DB-wal` and `DB-shm` are removed
//!    (SQLite leaves them when the database file was unlinked, and would
//!    replay them onto the copy), the copy is linked at the path, and the
//!    daemon reopens it.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::checkpoints::defer_checkpoints;
use crate::engine::Engine;
use crate::log;
use crate::metrics::Metrics;
use crate::store::db::ownership::{RESTORING, restore_interrupted};
use crate::store::{Checkpointer, Store, StoreOptions};

/// Keeps the daemon's database at its path.
pub struct Keeper {
    db: PathBuf,
    options: StoreOptions,
    checkpointer: Option<Checkpointer>,
    metrics: Arc<Metrics>,
    /// Step 2 is done: the copy waits to be installed, and the engine holds
    /// the stand-in.
    copied: bool,
}

/// The stand-in's file, beside the database (see [`Keeper::stand_in`]).
const STAND_IN: &str = ".stand-in";

/// `DB` + `suffix`, beside the database.
fn beside(db: &Path, suffix: &str) -> PathBuf {
    let mut path = db.as_os_str().to_owned();
    path.push(suffix);
    PathBuf::from(path)
}

fn identity(path: &Path) -> Option<(u64, u64)> {
    fs::symlink_metadata(path)
        .ok()
        .map(|meta| (meta.dev(), meta.ino()))
}

/// Removes a database file and its WAL companions, if there.
fn remove_with_companions(path: &Path) -> io::Result<()> {
    remove_if_there(path)?;
    remove_companions(path)
}

/// Removes `DB-wal` and `DB-shm`, if there.
fn remove_companions(db: &Path) -> io::Result<()> {
    remove_if_there(&beside(db, "-wal"))?;
    remove_if_there(&beside(db, "-shm"))
}

fn remove_if_there(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

/// At start, before the database is opened: a database missing at its path
/// beside the copy an unfinished restore wrote (the daemon stopped or died
/// between the copy and its install) is put back from that copy instead of
/// being created empty.
pub fn finish_interrupted_restore(db: &Path) {
    if !restore_interrupted(db) {
        return;
    }
    let copy = beside(db, RESTORING);
    let installed = remove_companions(db)
        .and_then(|()| fs::hard_link(&copy, db))
        .and_then(|()| fs::remove_file(&copy));
    match installed {
        Ok(()) => log::error(
            "store",
            "the database was missing; put back the copy an interrupted restore made",
            &[("db", &db.display())],
        ),
        Err(err) => log::error(
            "store",
            "the database is missing and the copy an interrupted restore made could not \
             be put back",
            &[
                ("db", &db.display()),
                ("copy", &copy.display()),
                ("error", &err),
            ],
        ),
    }
}

impl Keeper {
    pub fn new(
        db: &Path,
        options: StoreOptions,
        checkpointer: Option<Checkpointer>,
        metrics: Arc<Metrics>,
    ) -> Keeper {
        Keeper {
            db: db.to_path_buf(),
            options,
            checkpointer,
            metrics,
            copied: false,
        }
    }

    /// Restores the database if its file left its path. Call only between
    /// batches (no transaction open).
    pub fn keep(&mut self, engine: &mut Engine) {
        if !self.copied && engine.store().ensure_file_unchanged().is_ok() {
            return;
        }
        if !self.copied {
            log::error(
                "store",
                "the database file was deleted or replaced under the daemon; restoring it \
                 from the daemon's open copy",
                &[("db", &self.db.display())],
            );
        }
        match self.restore(engine) {
            Ok(aside) => {
                self.metrics.database_restored();
                log::error(
                    "store",
                    "database restored at its path with every allocation",
                    &[
                        ("db", &self.db.display()),
                        (
                            "found_there_and_kept",
                            &aside
                                .as_ref()
                                .map_or("nothing".into(), |p| p.display().to_string()),
                        ),
                    ],
                );
            }
            Err(err) => log::error(
                "store",
                "restoring the database failed; requests get code 11 until it succeeds \
                 (retried at every turn)",
                &[("db", &self.db.display()), ("error", &err)],
            ),
        }
    }

    fn restore(&mut self, engine: &mut Engine) -> Result<Option<PathBuf>, String> {
        let copy = beside(&self.db, RESTORING);
        if !self.copied {
            // Step 1.
            remove_with_companions(&copy).map_err(|err| format!("clearing {copy:?}: {err}"))?;
            engine
                .store()
                .copy_to(&copy)
                .map_err(|err| format!("copying the open database: {err}"))?;
            File::open(&copy)
                .and_then(|file| file.sync_all())
                .map_err(|err| format!("syncing the copy: {err}"))?;
            // Step 2.
            let stand_in = self.stand_in()?;
            self.checkpointer = None;
            drop(std::mem::replace(engine.store_mut(), stand_in));
            self.copied = true;
        }
        // Step 3.
        let aside = self.clear_path(&copy)?;
        if identity(&self.db).is_none() {
            // Leftovers of the closed connections (or of a file moved
            // aside), never the restored file's: it is not linked yet.
            remove_companions(&self.db)
                .map_err(|err| format!("removing stale WAL files: {err}"))?;
            fs::hard_link(&copy, &self.db)
                .map_err(|err| format!("linking the copy at the path: {err}"))?;
        }
        let restored = Store::open(&self.db, &self.options)
            .map_err(|err| format!("opening the restored database: {err}"))?;
        drop(std::mem::replace(engine.store_mut(), restored));
        self.copied = false;
        // SQLite leaves the WAL files of a closed connection whose database
        // file was unlinked.
        let stand_in = beside(&self.db, STAND_IN);
        if let Err(err) = remove_if_there(&copy).and_then(|()| remove_companions(&stand_in)) {
            log::warn(
                "store",
                "could not remove the restore's temporary files",
                &[("db", &self.db.display()), ("error", &err)],
            );
        }
        self.checkpointer = defer_checkpoints(engine.store(), &self.db);
        Ok(aside)
    }

    /// A store that refuses every request (its file is gone), holding no
    /// connection to anything at the database's path.
    fn stand_in(&self) -> Result<Store, String> {
        let path = beside(&self.db, STAND_IN);
        remove_with_companions(&path).map_err(|err| format!("clearing {path:?}: {err}"))?;
        let store = Store::open(&path, &self.options)
            .map_err(|err| format!("opening a stand-in: {err}"))?;
        fs::remove_file(&path).map_err(|err| format!("removing the stand-in: {err}"))?;
        Ok(store)
    }

    /// Moves whatever now lies at the path (another file put there, or a
    /// database something created) aside, named by the time, unless it is
    /// the copy itself (an earlier attempt linked it). Its WAL companions
    /// cannot be told from the old connection's by name and are not kept.
    fn clear_path(&self, copy: &Path) -> Result<Option<PathBuf>, String> {
        let found = identity(&self.db);
        if found.is_none() || found == identity(copy) {
            return Ok(None);
        }
        let aside = beside(&self.db, &format!(".replaced-{}", log::now_ms()));
        fs::rename(&self.db, &aside)
            .map_err(|err| format!("moving what is at the path aside: {err}"))?;
        Ok(Some(aside))
    }
}
