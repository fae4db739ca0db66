//! One daemon per database. A daemon owns its database through an
//! exclusive `flock(2)` on `DB.lock`, beside the database, held for its
//! whole life; the kernel drops it when the daemon exits or dies, so a lock
//! file left behind by a dead daemon means nothing. A second daemon on the
//! same database (a DaemonSet update with `maxSurge`, or one started by
//! hand) waits for the first to let go, then takes over; SIGTERM/SIGINT
//! while it waits ends it cleanly, having touched nothing.

use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signalfd::SignalFd;

use super::DaemonError;
use crate::log;
use crate::store::db::ownership::{Ownership, lock_path, open_lock_file};

/// The database's lock file, open but not yet locked: opened first, so that
/// a database directory the daemon cannot write is reported as such.
pub struct Claim {
    path: PathBuf,
    db: PathBuf,
    file: File,
}

/// Opens the lock file of the database at `db`.
pub fn claim(db: &Path) -> Result<Claim, DaemonError> {
    let path = lock_path(db);
    match open_lock_file(&path) {
        Ok(file) => Ok(Claim {
            path,
            db: db.to_path_buf(),
            file,
        }),
        Err(err) => Err(DaemonError::Ownership {
            path,
            reason: err.to_string(),
        }),
    }
}

impl Claim {
    /// Takes ownership of the database, waiting for another daemon to let
    /// go if one holds it. `None`: a shutdown signal arrived first.
    pub fn take(mut self, signals: &SignalFd) -> Result<Option<Ownership>, DaemonError> {
        let fail = |reason: String| DaemonError::Ownership {
            path: self.path.clone(),
            reason,
        };
        match self.file.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                log::warn(
                    "daemon",
                    "another daemon owns the database; waiting for it to stop, then taking over",
                    &[
                        ("db", &self.db.display()),
                        ("owner_pid", &recorded_pid(&mut self.file)),
                    ],
                );
                if !wait_for_lock(&self.file, signals).map_err(|err| fail(err.to_string()))? {
                    return Ok(None);
                }
                log::info(
                    "daemon",
                    "the previous daemon let go of the database; taking over",
                    &[("db", &self.db.display())],
                );
            }
            Err(fs::TryLockError::Error(err)) => {
                return Err(fail(format!("cannot lock: {err}")));
            }
        }
        // Informational only (the lock is the truth): whom a waiting daemon
        // names as the owner.
        if let Err(err) = record_pid(&mut self.file) {
            log::warn(
                "daemon",
                "cannot record the daemon's pid in the lock file",
                &[("path", &self.path.display()), ("error", &err)],
            );
        }
        Ok(Some(Ownership::of(self.file)))
    }
}

/// Blocks until the lock is ours (`true`) or a shutdown signal arrives
/// (`false`). The blocking `flock` runs on a thread (on a duplicate of the
/// descriptor, which shares the lock), which says when it returns through
/// a socket pair the loop polls beside the signal fd.
fn wait_for_lock(file: &File, signals: &SignalFd) -> io::Result<bool> {
    let locker = file.try_clone()?;
    let (mut done, told) = UnixStream::pair()?;
    std::thread::Builder::new()
        .name("metis-db-lock".into())
        .spawn(move || {
            let outcome: u8 = match locker.lock() {
                Ok(()) => 1,
                Err(_) => 0,
            };
            let _ = done.write_all(&[outcome]);
        })?;
    loop {
        let mut fds = [
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(told.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::Error::EINTR) => {}
            Err(err) => return Err(err.into()),
        }
        let fired = |fd: &PollFd| fd.revents().is_some_and(|r| !r.is_empty());
        let (signal, locked) = (fired(&fds[0]), fired(&fds[1]));
        if signal && let Ok(Some(info)) = signals.read_signal() {
            log::info(
                "daemon",
                "received signal while waiting for the database; stopping",
                &[("signal", &info.ssi_signo)],
            );
            return Ok(false);
        }
        if locked {
            let mut outcome = [0u8];
            (&told).read_exact(&mut outcome)?;
            if outcome == [1] {
                return Ok(true);
            }
            return Err(io::Error::other("waiting for the lock failed"));
        }
    }
}

/// The pid the current owner wrote, as text ("unknown" if unreadable).
fn recorded_pid(file: &mut File) -> String {
    let mut text = String::new();
    let read = file
        .seek(SeekFrom::Start(0))
        .and_then(|_| file.take(32).read_to_string(&mut text));
    match read {
        Ok(_) if !text.trim().is_empty() => text.trim().to_string(),
        _ => "unknown".into(),
    }
}

fn record_pid(file: &mut File) -> io::Result<()> {
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    writeln!(file, "{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::db::ownership::database_owned;

    #[test]
    fn owned_only_while_the_lock_is_held() {
        let dir = crate::testutil::TempDir::new();
        let db = dir.db();
        assert!(!database_owned(&db), "no lock file");
        let held = claim(&db).unwrap();
        assert!(!database_owned(&db), "opened, not locked");
        held.file.try_lock().unwrap();
        assert!(database_owned(&db));
        drop(held);
        assert!(!database_owned(&db), "a lock file left behind");
    }

    #[test]
    fn the_owner_records_its_pid() {
        let dir = crate::testutil::TempDir::new();
        let path = lock_path(&dir.0.join("metis.sqlite"));
        let mut file = open_lock_file(&path).unwrap();
        assert_eq!(recorded_pid(&mut file), "unknown");
        std::fs::write(&path, "4242\n").unwrap();
        assert_eq!(recorded_pid(&mut file), "4242");
        record_pid(&mut file).unwrap();
        assert_eq!(recorded_pid(&mut file), std::process::id().to_string());
    }
}
