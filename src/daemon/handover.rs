//! The socket handed from one daemon to the next with no moment in which
//! its path is missing or reaches a daemon that will not answer.
//!
//! A starting daemon binds its listener at `SOCKET.next` before it waits to
//! own the database (see `ownership`), and moves it to `SOCKET` once it
//! does. A daemon that stops while a successor listens at `SOCKET.next`
//! renames the successor's socket over its own — one atomic step, after
//! which every connect reaches the successor, whose backlog holds it until
//! it serves — and then answers everything that reached it before. With no
//! successor it unlinks its socket, so that plugins go to direct mode at
//! once rather than queue where no one will answer. A daemon only ever
//! unlinks or replaces the socket whose (device, inode) it bound itself.

use std::fs;
use std::io;
use std::ops::Deref;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use super::DaemonError;
use super::socket::listen;
use crate::log;

/// Where a daemon waiting to take over from the one serving `socket`
/// listens meanwhile.
pub fn successor_path(socket: &Path) -> PathBuf {
    let mut path = socket.as_os_str().to_owned();
    path.push(".next");
    PathBuf::from(path)
}

/// (device, inode) of a socket file, not following symbolic links.
type Identity = (u64, u64);

fn identity(path: &Path) -> Option<Identity> {
    fs::symlink_metadata(path)
        .ok()
        .map(|meta| (meta.dev(), meta.ino()))
}

/// Whether a daemon listens on `path`. The probe connection is closed at
/// once; the listener reads an empty connection and drops it.
fn listens(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|meta| meta.file_type().is_socket())
        && UnixStream::connect(path).is_ok()
}

/// A listener bound beside the socket path, not yet in place.
pub struct Pending {
    listener: Option<UnixListener>,
    socket: PathBuf,
    bound_at: PathBuf,
    id: Identity,
    group: Option<u32>,
}

/// Binds the daemon's listener at [`successor_path`] (or, while another
/// daemon already waits there, at a name of this process's own, which no
/// stopping daemon hands over to: this start then has the short window of
/// a plain restart).
pub fn prepare(socket: &Path, group: Option<u32>) -> Result<Pending, DaemonError> {
    // Refused before the wait, not after it.
    replaceable(socket)?;
    let next = successor_path(socket);
    let bound_at = if listens(&next) {
        log::warn(
            "daemon",
            "another daemon is already waiting to take over this socket",
            &[("socket", &socket.display())],
        );
        let mut own = next.into_os_string();
        own.push(format!(".{}", std::process::id()));
        PathBuf::from(own)
    } else {
        next
    };
    let (listener, id) = bind(&bound_at, group)?;
    Ok(Pending {
        listener: Some(listener),
        socket: socket.to_path_buf(),
        bound_at,
        id,
        group,
    })
}

/// A socket path may be replaced only when nothing or a socket is there:
/// never a symbolic link or another kind of file.
fn replaceable(socket: &Path) -> Result<(), DaemonError> {
    let fail = |reason: String| DaemonError::Socket {
        path: socket.to_path_buf(),
        reason,
    };
    match fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_symlink() => {
            Err(fail("the path is a symbolic link".into()))
        }
        Ok(meta) if !meta.file_type().is_socket() => {
            Err(fail("the path exists and is not a socket".into()))
        }
        Ok(_) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err(fail(err.to_string())),
    }
}

fn bind(path: &Path, group: Option<u32>) -> Result<(UnixListener, Identity), DaemonError> {
    let listener = listen(path, group)?;
    let id = identity(path).ok_or_else(|| DaemonError::Socket {
        path: path.to_path_buf(),
        reason: "the socket vanished right after it was bound".into(),
    })?;
    Ok((listener, id))
}

impl Pending {
    /// Puts the listener at the socket path, once the daemon owns the
    /// database: the daemon it took over from may have moved it there
    /// already; otherwise it is renamed over whatever stale socket is
    /// there (never over a symbolic link or another kind of file).
    pub fn install(mut self) -> Result<Served, DaemonError> {
        let fail = |reason: String| DaemonError::Socket {
            path: self.socket.clone(),
            reason,
        };
        if identity(&self.socket) == Some(self.id) {
            log::info(
                "daemon",
                "the previous daemon handed its socket over",
                &[("socket", &self.socket.display())],
            );
        } else {
            replaceable(&self.socket)?;
            if identity(&self.bound_at) != Some(self.id) {
                // Someone removed it while this daemon waited: bind anew.
                let (listener, id) = bind(&self.bound_at, self.group)?;
                self.listener = Some(listener);
                self.id = id;
            }
            fs::rename(&self.bound_at, &self.socket).map_err(|err| {
                fail(format!(
                    "cannot move the socket from {}: {err}",
                    self.bound_at.display()
                ))
            })?;
        }
        let listener = self
            .listener
            .take()
            .ok_or_else(|| fail("the socket was already put in place".into()))?;
        Ok(Served {
            listener,
            socket: self.socket.clone(),
            id: self.id,
        })
    }
}

impl Drop for Pending {
    /// A start that ends before serving removes its own socket, wherever it
    /// is now.
    fn drop(&mut self) {
        if self.listener.is_none() {
            return;
        }
        for path in [&self.bound_at, &self.socket] {
            if identity(path) == Some(self.id) {
                let _ = fs::remove_file(path);
            }
        }
    }
}

/// The listener at the socket path, serving.
pub struct Served {
    listener: UnixListener,
    socket: PathBuf,
    id: Identity,
}

impl Served {
    /// Takes the socket path away from this daemon when it stops: a
    /// successor's socket is moved over it, or it is unlinked. After this,
    /// no new connection reaches the listener; those already in its
    /// backlog are still accepted and answered.
    pub fn retire(&self) {
        if identity(&self.socket) != Some(self.id) {
            log::warn(
                "daemon",
                "the socket path no longer holds this daemon's socket; leaving it alone",
                &[("socket", &self.socket.display())],
            );
            return;
        }
        let next = successor_path(&self.socket);
        if listens(&next) {
            match fs::rename(&next, &self.socket) {
                Ok(()) => {
                    log::info(
                        "daemon",
                        "handed the socket over to the daemon taking over",
                        &[("socket", &self.socket.display())],
                    );
                    return;
                }
                Err(err) => log::warn(
                    "daemon",
                    "cannot hand the socket over; removing it",
                    &[("socket", &self.socket.display()), ("error", &err)],
                ),
            }
        }
        if let Err(err) = fs::remove_file(&self.socket) {
            log::warn("daemon", "could not remove socket", &[("error", &err)]);
        }
    }
}

/// The loop polls and accepts on the listener itself.
impl Deref for Served {
    type Target = UnixListener;

    fn deref(&self) -> &UnixListener {
        &self.listener
    }
}
