//! The daemon's listening socket, bound so that only the intended users
//! can ever connect.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::Path;

use nix::sys::stat::{Mode, umask};

use super::DaemonError;
use crate::log;
use crate::wire::starting::{self, Starting};

/// Binds the socket safely: its directory is created 0700 if missing and
/// must not be writable by others; an existing path must be a stale socket
/// (never a symlink or another kind of file); the socket is born 0600, or
/// 0660 and owned by `group` when one is given.
pub fn listen(path: &Path, group: Option<u32>) -> Result<UnixListener, DaemonError> {
    let fail = |reason: String| DaemonError::Socket {
        path: path.to_path_buf(),
        reason,
    };
    private_dir(path)?;
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => {
            return Err(fail("the path is a symbolic link".into()));
        }
        Ok(meta) if meta.file_type().is_socket() => {
            fs::remove_file(path)
                .map_err(|err| fail(format!("cannot remove stale socket: {err}")))?;
        }
        Ok(_) => return Err(fail("the path exists and is not a socket".into())),
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(fail(err.to_string())),
    }
    // The umask makes the socket 0600 from birth: no window in which
    // another user could connect.
    let (mask, mode) = match group {
        None => (0o177, 0o600),
        Some(_) => (0o117, 0o660),
    };
    let previous = umask(Mode::from_bits_truncate(mask));
    let bound = UnixListener::bind(path);
    umask(previous);
    let listener = bound.map_err(|err| fail(err.to_string()))?;
    if let Some(gid) = group {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(|err| fail(format!("cannot give the socket to group {gid}: {err}")))?;
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|err| fail(err.to_string()))?;
    listener
        .set_nonblocking(true)
        .map_err(|err| fail(err.to_string()))?;
    Ok(listener)
}

/// Says "a daemon is starting here" to plugins (see `wire::starting`) until
/// the value is dropped, once the socket is installed: the marker spans the
/// wait for the database's owner (`ownership`) as well. Without the marker the
/// start goes on: plugins then use direct mode rather than wait, which is
/// safe, only slower.
pub fn announce_start(path: &Path) -> Result<Option<Starting>, DaemonError> {
    private_dir(path)?;
    match Starting::announce(path) {
        Ok(starting) => Ok(Some(starting)),
        Err(err) => {
            log::warn(
                "daemon",
                "cannot mark the start; plugins use direct mode until the socket is bound",
                &[
                    ("marker", &starting::marker_path(path).display()),
                    ("error", &err),
                ],
            );
            Ok(None)
        }
    }
}

/// The socket's directory, created 0700 if missing; it must not be
/// writable by others.
fn private_dir(path: &Path) -> Result<(), DaemonError> {
    let fail = |reason: String| DaemonError::Socket {
        path: path.to_path_buf(),
        reason,
    };
    let dir = path
        .parent()
        .filter(|dir| !dir.as_os_str().is_empty())
        .ok_or_else(|| fail("the socket path has no directory".into()))?;
    if !dir.exists() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|err| fail(format!("cannot create {}: {err}", dir.display())))?;
    }
    let dir_meta = fs::metadata(dir).map_err(|err| fail(format!("{}: {err}", dir.display())))?;
    if dir_meta.permissions().mode() & 0o002 != 0 {
        return Err(fail(format!(
            "directory {} is writable by others; use a private directory",
            dir.display()
        )));
    }
    Ok(())
}
