//! Who may open the database: a daemon owns it through an exclusive
//! `flock(2)` on `DB.lock` (see the daemon's `ownership`), and a database
//! missing beside an unfinished restore's copy is only the daemon's to put
//! back. Here so that the daemon, the plugin's direct mode and the admin
//! commands ask the same question of the same files.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::files::companion;

/// The copy a restore writes, beside the database, until it is in place.
pub const RESTORING: &str = ".restoring";

/// The lock file of the database at `db`.
pub fn lock_path(db: &Path) -> PathBuf {
    let mut path = db.as_os_str().to_owned();
    path.push(".lock");
    PathBuf::from(path)
}

/// Whether a daemon owns the database at `db` right now (its lock is
/// held). Anything else — no lock file, no access, a symbolic link — is
/// "no".
pub fn database_owned(db: &Path) -> bool {
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(lock_path(db))
    else {
        return false;
    };
    // Closing the file drops the shared lock a free one gives us.
    matches!(file.try_lock_shared(), Err(fs::TryLockError::WouldBlock))
}

/// Takes ownership of the database at `db` without waiting, for a command
/// that must not run beside a daemon (`metis admin downgrade`): `Ok(None)`
/// while a daemon holds it. A daemon started meanwhile waits for the
/// returned ownership to be dropped.
pub fn try_hold(db: &Path) -> io::Result<Option<Ownership>> {
    let file = open_lock_file(&lock_path(db))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(Ownership { _locked: file })),
        Err(fs::TryLockError::WouldBlock) => Ok(None),
        Err(fs::TryLockError::Error(err)) => Err(err),
    }
}

/// Held while the daemon owns its database; dropping it (or exiting) lets
/// the next daemon take over.
#[derive(Debug)]
pub struct Ownership {
    _locked: File,
}

impl Ownership {
    /// The ownership a locked lock file gives.
    pub(crate) fn of(locked: File) -> Ownership {
        Ownership { _locked: locked }
    }
}

/// Opens (creating 0600, in a directory created 0700 if missing) the lock
/// file; a symbolic link or anything but a regular file is refused.
pub(crate) fn open_lock_file(path: &Path) -> io::Result<File> {
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty())
        && !dir.exists()
    {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path);
    let file = match opened {
        Err(err) if err.raw_os_error() == Some(nix::libc::ELOOP) => {
            return Err(io::Error::other(
                "it is a symbolic link; refusing to follow it",
            ));
        }
        other => other?,
    };
    if !file.metadata()?.is_file() {
        return Err(io::Error::other("it is not a regular file"));
    }
    Ok(file)
}

/// Whether the database is missing beside the copy an unfinished restore
/// wrote: only a daemon may put it back (see
/// [`finish_interrupted_restore`]), never an empty one be made instead.
pub fn restore_interrupted(db: &Path) -> bool {
    fs::symlink_metadata(db).is_err() && fs::symlink_metadata(companion(db, RESTORING)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_symbolic_link_or_a_directory_is_refused() {
        let dir = crate::testutil::TempDir::new();
        let target = dir.0.join("elsewhere");
        std::fs::write(&target, b"").unwrap();
        let db = dir.0.join("metis.sqlite");
        std::os::unix::fs::symlink(&target, lock_path(&db)).unwrap();
        let err = open_lock_file(&lock_path(&db)).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");

        let other = dir.0.join("other.sqlite");
        std::fs::create_dir(lock_path(&other)).unwrap();
        assert!(open_lock_file(&lock_path(&other)).is_err());
    }
}
