//! `metis daemon`: owns the node's address blocks in SQLite and serves the
//! plugin over a Unix socket from one single-threaded loop.

mod checkpoints;
mod config;
mod conn;
mod event_loop;
mod handover;
#[cfg(not(feature = "kube"))]
mod no_cluster;
mod ownership;
mod restore;
mod run;
mod socket;

use std::fmt;
use std::path::PathBuf;

use crate::flags::FlagError;
use crate::store::StoreError;

#[cfg(feature = "kube")]
pub use config::AdaptiveSettings;
pub use config::{Config, parse_config, usage};
pub use conn::Limits;
pub use event_loop::Admission;
pub use run::{recover_after_reboot, run};

/// A failure that stops the daemon.
#[derive(Debug)]
pub enum DaemonError {
    Usage(FlagError),
    Store(StoreError),
    Socket {
        path: PathBuf,
        reason: String,
    },
    Signals(nix::Error),
    /// The lock that makes this daemon the database's only one.
    Ownership {
        path: PathBuf,
        reason: String,
    },
    Kube(String),
    /// The database fails its invariant check; the report names the problems.
    Unsafe(String),
    Metrics(String),
}

impl fmt::Display for DaemonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DaemonError::Usage(err) => write!(f, "{err}"),
            DaemonError::Store(err) => write!(f, "failed to initialize sqlite store: {err}"),
            DaemonError::Socket { path, reason } => {
                write!(f, "cannot listen on {}: {reason}", path.display())
            }
            DaemonError::Signals(err) => write!(f, "cannot set up signal handling: {err}"),
            DaemonError::Ownership { path, reason } => write!(
                f,
                "cannot take the database's lock file {}: {reason}",
                path.display()
            ),
            DaemonError::Kube(why) => write!(f, "cannot start the Kubernetes client: {why}"),
            DaemonError::Unsafe(report) => write!(
                f,
                "refusing to serve a database that fails its checks (inspect it with \
                 `metis admin check`): {report}"
            ),
            DaemonError::Metrics(why) => write!(f, "cannot serve metrics on {why}"),
        }
    }
}

impl std::error::Error for DaemonError {}
