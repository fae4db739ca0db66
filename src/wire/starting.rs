//! How a plugin tells "a daemon is starting" from "no daemon at all", so
//! that it waits only for the first. A starting daemon holds an exclusive
//! `flock(2)` on a marker file next to its socket (`SOCKET.starting`) from
//! before it opens the database until its socket is bound; a plugin that
//! finds no socket (or a refused one) probes the lock. The kernel drops the
//! lock when the daemon exits or dies, so a crashed start never makes
//! plugins wait, and a marker file left behind means nothing by itself.

use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The marker of a daemon serving `socket`.
pub fn marker_path(socket: &Path) -> PathBuf {
    let mut path = socket.as_os_str().to_owned();
    path.push(".starting");
    PathBuf::from(path)
}

/// Held by a starting daemon; dropping it says the socket is bound (or
/// the start failed).
#[derive(Debug)]
pub struct Starting {
    _locked: File,
}

impl Starting {
    /// Takes the marker's lock. The socket's directory must exist. Refuses
    /// a symbolic link; another process holding the lock (a second daemon
    /// starting on the same socket) is an error too.
    pub fn announce(socket: &Path) -> io::Result<Starting> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(marker_path(socket))?;
        file.try_lock().map_err(io::Error::from)?;
        Ok(Starting { _locked: file })
    }
}

/// Whether a daemon is starting on `socket` right now: its marker exists
/// and its lock is held. Anything else (no marker, no access, a symbolic
/// link) is "no".
pub fn daemon_starting(socket: &Path) -> bool {
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(marker_path(socket))
    else {
        return false;
    };
    // Closing the file drops the shared lock a free marker gives us.
    matches!(file.try_lock_shared(), Err(TryLockError::WouldBlock))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starting_only_while_the_lock_is_held() {
        let dir = crate::testutil::TempDir::new();
        let socket = dir.0.join("metis.sock");
        assert!(!daemon_starting(&socket), "no marker");
        let starting = Starting::announce(&socket).unwrap();
        assert!(daemon_starting(&socket));
        assert!(
            Starting::announce(&socket).is_err(),
            "a second daemon on the same socket"
        );
        drop(starting);
        assert!(marker_path(&socket).exists());
        assert!(!daemon_starting(&socket), "a marker left behind");
    }

    #[test]
    fn a_symbolic_link_is_no_marker() {
        let dir = crate::testutil::TempDir::new();
        let socket = dir.0.join("metis.sock");
        let target = dir.0.join("elsewhere");
        std::fs::write(&target, b"").unwrap();
        std::os::unix::fs::symlink(&target, marker_path(&socket)).unwrap();
        assert!(Starting::announce(&socket).is_err());
        let held = File::open(&target).unwrap();
        held.try_lock().unwrap();
        assert!(!daemon_starting(&socket));
    }
}
