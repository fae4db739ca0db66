//! Where the plugin's requests go: the daemon over its socket, or — when no
//! daemon answers (before the DaemonSet is up, during a restart) — the same
//! engine run in-process against the same database ("direct mode"). SQLite's
//! WAL, busy timeout and immediate transactions make the two safe together.

use std::path::Path;

use nix::unistd::{self, AccessFlags};
use std::time::Duration;

use crate::cni::error::CniError;
use crate::engine::Engine;
use crate::log;
use crate::store::{self, Store, StoreOptions};
use crate::wire::client::{Client, ClientError};
use crate::wire::{Request, Response};

/// Connection attempts before falling back to direct mode (upstream's 3).
const CONNECT_ATTEMPTS: u32 = 3;
/// Pause between connection attempts (upstream's 100 ms).
const CONNECT_RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Bound on one connect; a live daemon accepts in microseconds.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Bound on one exchange: above the daemon's 9 s wait for new blocks and
/// below the 10 s runtimes commonly allow a plugin call... as upstream.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Sends `request` to the daemon at `socket`, or serves it in-process from
/// `db_path` when the daemon cannot be reached at all.
pub fn call(socket: &Path, db_path: &Path, request: &Request) -> Result<Response, CniError> {
    match call_daemon(socket, request) {
        Ok(response) => Ok(response),
        Err(err) if err.is_connect() => {
            log::info(
                "cni",
                "daemon unreachable, using direct mode",
                &[("error", &err), ("db", &db_path.display())],
            );
            call_direct(db_path, request)
        }
        Err(err) => Err(CniError::from_client(&err)),
    }
}

/// Like [`call`] for requests that only read (STATUS): in direct mode the
/// database is opened read-only, and `Ok(None)` means it does not exist yet
/// (nothing to read; the first ADD will create it).
pub fn call_read_only(
    socket: &Path,
    db_path: &Path,
    request: &Request,
) -> Result<Option<Response>, CniError> {
    match call_daemon(socket, request) {
        Ok(response) => Ok(Some(response)),
        Err(err) if err.is_connect() => {
            log::debug(
                "cni",
                "daemon unreachable, reading the database",
                &[("error", &err), ("db", &db_path.display())],
            );
            let Some(store) = Store::open_read_only(db_path)
                .map_err(|err| CniError::from_store_open(db_path, &err))?
            else {
                return can_create(db_path).map(|()| None);
            };
            let mut engine = Engine::new(store);
            Ok(Some(engine.handle(request.clone(), log::now_ms())))
        }
        Err(err) => Err(CniError::from_client(&err)),
    }
}

/// Whether direct mode could create the database: its nearest existing
/// ancestor must be a directory we may write to.
fn can_create(db_path: &Path) -> Result<(), CniError> {
    let existing = db_path.ancestors().skip(1).find(|dir| dir.exists());
    let usable = existing.is_some_and(|dir| {
        dir.is_dir() && unistd::access(dir, AccessFlags::W_OK | AccessFlags::X_OK).is_ok()
    });
    if usable {
        Ok(())
    } else {
        Err(CniError::db_not_creatable(db_path))
    }
}

fn call_daemon(socket: &Path, request: &Request) -> Result<Response, ClientError> {
    let mut attempt = 1;
    loop {
        match Client::connect(socket, CONNECT_TIMEOUT, CALL_TIMEOUT) {
            Ok(mut client) => return client.call(request),
            Err(err) if attempt >= CONNECT_ATTEMPTS => return Err(err),
            Err(err) => {
                log::debug("cni", "connect failed, retrying", &[("error", &err)]);
                attempt += 1;
                std::thread::sleep(CONNECT_RETRY_PAUSE);
            }
        }
    }
}

fn call_direct(db_path: &Path, request: &Request) -> Result<Response, CniError> {
    let mut store = Store::open(
        db_path,
        &StoreOptions {
            durability: crate::store::Durability::Normal,
            reserve: None,
            // The daemon's recorded cooldown, so direct-mode releases honour it too.
            release_cooldown: None,
        },
    )
    .map_err(|err| CniError::from_store_open(db_path, &err))?;
    // The first to use the database after a reboot releases the previous
    // boot's allocations, before anything of this boot is allocated.
    let boot_id_path = store::boot_id_path(&|name| std::env::var(name).ok());
    if let Some(boot_id) = store::read_boot_id(&boot_id_path) {
        let recovered = store
            .recover_after_reboot(&boot_id, None, log::now_ms())
            .map_err(|err| CniError::from_store_open(db_path, &err))?;
        if recovered.released() > 0 {
            log::info(
                "cni",
                "new boot: released the allocations of the previous boot",
                &[("released", &recovered.released())],
            );
        }
    }
    let mut engine = Engine::new(store);
    Ok(engine.handle(request.clone(), log::now_ms()))
}
