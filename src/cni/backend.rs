//! Where the plugin's requests go, behind the [`Backend`] seam: the daemon
//! over its socket, or — when no daemon answers (before the DaemonSet is up,
//! during a restart) — the same engine run in-process against the same
//! database ("direct mode"). SQLite's WAL, busy timeout and immediate
//! transactions make the two safe together: each direct-mode request is one
//! `BEGIN IMMEDIATE` transaction, everything it decides read under its lock. The daemon's client,
//! shared with the admin commands, is [`Daemon`] in `wire::client`.

use std::path::{Path, PathBuf};

use nix::unistd::{self, AccessFlags};
use std::time::Duration;

use crate::cni::error::CniError;
use crate::decode::to_wire;
use crate::engine::request::Command;
use crate::engine::{Engine, Outcome};
use crate::log;
use crate::store::{self, Store, StoreOptions};
use crate::wire::Response;
use crate::wire::client::{ClientError, Daemon};

/// How long the plugin waits for a daemon that is there but cannot take the
/// connection yet: one that is starting (its marker is locked, see
/// `wire::starting`) or one whose backlog is full. With no daemon at all (no
/// socket, or a refused one, and no start under way) it does not wait:
/// direct mode at once. Above a start's usual duration, far below a CNI
/// call's 10 s.
const WAIT_FOR_DAEMON: Duration = Duration::from_secs(1);
/// Bound on one connect; a live daemon accepts in microseconds.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Bound on one exchange: above the daemon's 9 s wait for new blocks and
/// below the 10 s runtimes commonly allow a plugin call... as upstream.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long direct mode keeps making a request again while the database
/// is busy (each attempt waits up to SQLite's busy timeout): a daemon
/// starting beside it, other plugins, a checkpoint hold the lock for a
/// moment, stretched on a loaded node. Runtimes wait minutes for a CNI call.
const DIRECT_PATIENCE: Duration = Duration::from_secs(30);

/// What the plugin's verbs talk to; unit tests put a fake here.
pub trait Backend {
    /// Serves one request; an error status comes back as a [`Response`].
    fn call(&mut self, command: Command) -> Result<Response, CniError>;

    /// Like [`Backend::call`] for requests that only read (STATUS): `Ok(None)`
    /// means there is nothing to read yet (no database; the first ADD will
    /// create it).
    fn call_read_only(&mut self, command: Command) -> Result<Option<Response>, CniError>;
}

/// The node's IPAM as the plugin reaches it: the daemon at its socket, else
/// direct mode on the database.
pub struct Node {
    daemon: Daemon,
    db_path: PathBuf,
}

impl Node {
    /// The daemon at `socket` (with the plugin's retry policy), backed by the
    /// database at `db_path`.
    pub fn new(socket: &Path, db_path: &Path) -> Node {
        Node {
            daemon: Daemon {
                socket: socket.to_path_buf(),
                connect_timeout: CONNECT_TIMEOUT,
                call_timeout: CALL_TIMEOUT,
                wait: WAIT_FOR_DAEMON,
            },
            db_path: db_path.to_path_buf(),
        }
    }

    /// The daemon's answer, or the request back (nothing was sent) when the
    /// daemon cannot be reached at all.
    fn ask_daemon(&self, command: Command) -> Result<Reached, CniError> {
        match self.daemon.exchange(&to_wire(&command)) {
            Ok(response) => Ok(Reached::Answered(response)),
            Err(err) if err.is_connect() => Ok(Reached::Unreachable(Box::new(command), err)),
            Err(err) => Err(CniError::from_client(&err)),
        }
    }
}

/// How far a request got with the daemon.
enum Reached {
    Answered(Response),
    /// Boxed: a request is much larger than a response.
    Unreachable(Box<Command>, ClientError),
}

impl Backend for Node {
    fn call(&mut self, command: Command) -> Result<Response, CniError> {
        match self.ask_daemon(command)? {
            Reached::Answered(response) => Ok(response),
            Reached::Unreachable(command, err) => {
                log::info(
                    "cni",
                    "daemon unreachable, using direct mode",
                    &[("error", &err), ("db", &self.db_path.display())],
                );
                call_direct(&self.db_path, &command)
            }
        }
    }

    /// In direct mode the database is opened read-only and never created.
    fn call_read_only(&mut self, command: Command) -> Result<Option<Response>, CniError> {
        match self.ask_daemon(command)? {
            Reached::Answered(response) => Ok(Some(response)),
            Reached::Unreachable(command, err) => {
                log::debug(
                    "cni",
                    "daemon unreachable, reading the database",
                    &[("error", &err), ("db", &self.db_path.display())],
                );
                let db_path = &self.db_path;
                let Some(store) = Store::open_read_only(db_path)
                    .map_err(|err| CniError::from_store_open(db_path, &err))?
                else {
                    return can_create(db_path).map(|()| None);
                };
                Ok(Some(serve(store, &command)))
            }
        }
    }
}

/// Whether direct mode could create the database, judged without creating
/// anything: its nearest existing ancestor must be a directory we may write
/// to, on a filesystem that is mounted writable and stores regular files
/// (root passes `access(2)` on `/proc` or `/sys`, where nothing can be made).
fn can_create(db_path: &Path) -> Result<(), CniError> {
    let existing = db_path.ancestors().skip(1).find(|dir| dir.exists());
    let usable = existing.is_some_and(|dir| {
        dir.is_dir()
            && unistd::access(dir, AccessFlags::W_OK | AccessFlags::X_OK).is_ok()
            && holds_files(dir)
    });
    if usable {
        Ok(())
    } else {
        Err(CniError::db_not_creatable(db_path))
    }
}

/// False for a read-only mount and for the kernel's virtual filesystems.
fn holds_files(dir: &Path) -> bool {
    use nix::sys::statfs::{self, FsType};
    use nix::sys::statvfs::{self, FsFlags};
    const VIRTUAL: [FsType; 10] = [
        statfs::PROC_SUPER_MAGIC,
        statfs::SYSFS_MAGIC,
        statfs::CGROUP_SUPER_MAGIC,
        statfs::CGROUP2_SUPER_MAGIC,
        statfs::DEVPTS_SUPER_MAGIC,
        statfs::DEBUGFS_MAGIC,
        statfs::TRACEFS_MAGIC,
        statfs::SECURITYFS_MAGIC,
        statfs::BPF_FS_MAGIC,
        statfs::NSFS_MAGIC,
    ];
    let writable = statvfs::statvfs(dir).is_ok_and(|vfs| !vfs.flags().contains(FsFlags::ST_RDONLY));
    let real = statfs::statfs(dir).is_ok_and(|fs| !VIRTUAL.contains(&fs.filesystem_type()));
    writable && real
}

/// A database missing while its daemon runs (or beside the copy a restore
/// left) was deleted, not never made: the daemon puts it back
/// (`daemon::restore`), and an empty one made here would hand its pods'
/// addresses out again.
fn refuse_a_deleted_database(db_path: &Path) -> Result<(), CniError> {
    if !db_path.exists() && store::db::ownership::database_owned(db_path) {
        return Err(CniError::try_again_later(format!(
            "the database {} is missing while its daemon runs; the daemon restores it, retry",
            db_path.display()
        )));
    }
    if store::db::ownership::restore_interrupted(db_path) {
        return Err(CniError::try_again_later(format!(
            "the database {} is missing and a restore of it was interrupted; start the \
             daemon to finish it",
            db_path.display()
        )));
    }
    Ok(())
}

/// The first to use the database after a reboot releases the previous
/// boot's allocations, before anything of this boot is allocated.
fn recover_after_reboot(store: &mut Store, db_path: &Path) -> Result<(), CniError> {
    let boot_id_path = store::boot_id_path(&|name| std::env::var(name).ok());
    if let Some(boot_id) = store::read_boot_id(&boot_id_path) {
        let recovered = store::patiently("boot recovery", DIRECT_PATIENCE, || {
            store.recover_after_reboot(&boot_id, None, log::now_ms())
        })
        .map_err(|err| CniError::from_store_open(db_path, &err))?;
        if recovered.released() > 0 {
            log::info(
                "cni",
                "new boot: released the allocations of the previous boot",
                &[("released", &recovered.released())],
            );
        }
    }
    Ok(())
}

fn call_direct(db_path: &Path, command: &Command) -> Result<Response, CniError> {
    refuse_a_deleted_database(db_path)?;
    let mut store = Store::open(
        db_path,
        &StoreOptions {
            durability: crate::store::Durability::Normal,
            reserve: None,
            // The daemon's recorded cooldown: direct-mode releases rest as long.
            release_cooldown: None,
            one_request: true,
        },
    )
    .map_err(|err| CniError::from_store_open(db_path, &err))?;
    for warning in store.open_warnings() {
        log::warn("cni", "database", &[("warning", warning)]);
    }
    if store.healing() == store::Healing::Skipped {
        log::debug("cni", "database as last healed, healing skipped", &[]);
    }
    recover_after_reboot(&mut store, db_path)?;
    let mut engine = Engine::new(store);
    // Made again as a whole while the database is busy: a failed attempt
    // leaves nothing.
    let served = store::patiently("serve the request", DIRECT_PATIENCE, || {
        match engine.handle_alone(command, log::now_ms()) {
            Outcome::Failed(failure) if failure.busy => Err(failure),
            outcome => Ok(outcome),
        }
    });
    let response = served.unwrap_or_else(Outcome::Failed).into_response();
    // After the answer is settled: a failed checkpoint loses nothing.
    if let Err(err) = engine
        .store()
        .trim_wal(|| store::db::ownership::database_owned(db_path))
    {
        log::warn("cni", "WAL checkpoint failed", &[("error", &err)]);
    }
    // Not closed: the plugin exits once the answer is printed. A
    // `one_request` store leaves the WAL on close, so a close writes nothing
    // (no checkpoint; the WAL and its index stay) and only finalizes
    // statements and frees memory, a twelfth of a direct-mode DEL. The exit closes the files and
    // drops the locks as a crash would, which the next opener handles as it
    // handles a close: it rebuilds the WAL index from the WAL either way.
    std::mem::forget(engine);
    Ok(response)
}

/// The engine run on a read-only store, as the daemon would serve it.
fn serve(store: Store, command: &Command) -> Response {
    Engine::new(store)
        .handle(command, log::now_ms())
        .into_response()
}
