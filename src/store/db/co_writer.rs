//! Metis as a co-writer of host-local's directory during a migration.
//!
//! While a network's host-local directory (`<dataDir>/<name>/`) exists and
//! `metis import|export host-local` registered it, both plugins may serve
//! the network (the runtime runs whichever the conflist names at that
//! moment). Each address then has one record both plugins honour: its
//! host-local file, created exclusively under host-local's own lock. So,
//! inside the write transaction that takes a row, the store calls
//! [`before_take`]: if host-local's file names someone else, the row is
//! recorded for that owner instead (host-local holds it) and the next
//! address is tried; otherwise Metis creates the file for its owner, so
//! host-local never hands the address out. Every release of a row calls
//! [`before_give_back`], which removes the file if it still names the
//! owner, so host-local can serve the address again; a DEL also removes
//! the owner's files of pods host-local served ([`before_release`]).
//!
//! The registration is typed state of the network: `metis_networks`'
//! `host_local_dir` (the absolute path) and `host_local_dir_identity`
//! (`DEV:INODE` of the directory when it was registered).
//!
//! Removing the directory (the migration is over) ends the registration
//! at the next allocation; a directory created again later is another one
//! (its inode differs) and is not co-written until imported again.

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rusqlite::{Connection, OptionalExtension, params};

use super::connection::{Store, write};
use super::types::StoreError;
use crate::cidr::Family;
use crate::host_local_dir::{self, DirError, Held, Lock};

fn store_error(err: DirError) -> StoreError {
    StoreError::HostLocal(err.0)
}

/// A directory's identity as recorded: `DEV:INODE`.
fn identity_text((dev, ino): (u64, u64)) -> String {
    format!("{dev}:{ino}")
}

/// The directory `network` is registered with (`metis_networks`), and
/// its identity then, if any.
fn registration(conn: &Connection, network: &str) -> Result<Option<(PathBuf, String)>, StoreError> {
    let row: Option<(Option<String>, Option<String>)> = conn
        .prepare_cached(
            "SELECT host_local_dir, host_local_dir_identity FROM metis_networks WHERE network = ?1",
        )?
        .query_row([network], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    Ok(match row {
        Some((Some(dir), Some(identity))) => Some((PathBuf::from(dir), identity)),
        _ => None,
    })
}

/// Records (or with `None` ends) `network`'s registration.
fn set_registration(
    conn: &Connection,
    network: &str,
    registered: Option<(&str, &str)>,
) -> Result<(), StoreError> {
    let (dir, identity) = registered.unzip();
    conn.prepare_cached(
        "INSERT INTO metis_networks (network, host_local_dir, host_local_dir_identity) \
         VALUES (?1, ?2, ?3) ON CONFLICT(network) DO UPDATE SET \
         host_local_dir = excluded.host_local_dir, \
         host_local_dir_identity = excluded.host_local_dir_identity",
    )?
    .execute(params![network, dir, identity])?;
    Ok(())
}

/// Whether `dir` is still the very directory registered (neither gone
/// nor replaced).
fn is_current(dir: &Path, registered: &str) -> Result<bool, StoreError> {
    let now = host_local_dir::identity(dir).map_err(store_error)?;
    Ok(now.map(identity_text).as_deref() == Some(registered))
}

/// The directory `network` is co-written in now, if any. A registered one
/// that is gone or was replaced ends the registration (recorded in the
/// caller's transaction).
fn co_written(conn: &Connection, network: &str) -> Result<Option<PathBuf>, StoreError> {
    let Some((dir, identity)) = registration(conn, network)? else {
        return Ok(None);
    };
    if is_current(&dir, &identity)? {
        return Ok(Some(dir));
    }
    set_registration(conn, network, None)?;
    crate::log::warn(
        "host-local",
        "host-local's directory is gone or was replaced: no longer co-written",
        &[
            ("network", &network),
            ("dir", &dir.display()),
            ("identity", &identity),
        ],
    );
    Ok(None)
}

/// Whether `network` is co-written in `dir` now: registered by an earlier
/// import or export, and still that very directory.
pub fn is_registered(store: &Store, network: &str, dir: &Path) -> Result<bool, StoreError> {
    let Some((registered, identity)) = registration(&store.conn, network)? else {
        return Ok(false);
    };
    Ok(registered == dir && is_current(dir, &identity)?)
}

/// Registers `dir` (when it exists) as `network`'s host-local directory:
/// from now on the network is co-written there.
pub fn register(store: &mut Store, network: &str, dir: &Path) -> Result<(), StoreError> {
    let Some(identity) = host_local_dir::identity(dir).map_err(store_error)? else {
        return Ok(());
    };
    let path = dir
        .to_str()
        .ok_or_else(|| StoreError::Corrupt(format!("{} is not UTF-8", dir.display())))?;
    store.put_registration(network, Some((path, &identity_text(identity))))
}

/// Ends `network`'s registration: its directory is no longer co-written.
pub fn unregister(store: &mut Store, network: &str) -> Result<(), StoreError> {
    store.put_registration(network, None)
}

impl Store {
    /// Records `network`'s registration; writes only on a change.
    fn put_registration(
        &mut self,
        network: &str,
        registered: Option<(&str, &str)>,
    ) -> Result<(), StoreError> {
        let now = registration(&self.conn, network)?;
        let now = now
            .as_ref()
            .and_then(|(dir, identity)| Some((dir.to_str()?, identity.as_str())));
        if now == registered {
            return Ok(());
        }
        let tx = write(&mut self.conn, self.batch)?;
        set_registration(&tx, network, registered)?;
        tx.commit()?;
        Ok(())
    }
}

/// Called inside the write transaction before a row of `network` becomes
/// `container_id`/`ifname`'s: `None` when the owner may take it (its
/// host-local file now exists, or the network is not co-written), else
/// the owner host-local's file records, who holds it.
pub(in crate::store) fn before_take(
    conn: &Connection,
    network: &str,
    address: IpAddr,
    container_id: &str,
    ifname: &str,
) -> Result<Option<Held>, StoreError> {
    let Some(dir) = co_written(conn, network)? else {
        return Ok(None);
    };
    let _lock = Lock::take(&dir).map_err(store_error)?;
    let wanted = Held {
        address,
        container_id: container_id.to_string(),
        ifname: ifname.to_string(),
    };
    if host_local_dir::write(&dir, &wanted).map_err(store_error)? {
        return Ok(None);
    }
    match host_local_dir::read_address(&dir, address).map_err(store_error)? {
        Some(held) if !held.names(container_id, ifname) => Ok(Some(held)),
        _ => Ok(None),
    }
}

/// Called inside the write transaction before row `row_id` (holding
/// `address`) of `network` is released: removes host-local's file if it
/// names the row's owner.
pub(in crate::store) fn before_give_back(
    conn: &Connection,
    network: &str,
    row_id: i64,
    address: IpAddr,
) -> Result<(), StoreError> {
    let Some(dir) = co_written(conn, network)? else {
        return Ok(());
    };
    let owner: Option<(String, String)> = conn
        .prepare_cached(
            "SELECT COALESCE(container_id, ''), COALESCE(interface_name, '') FROM ip_addresses WHERE id = ?1",
        )?
        .query_row([row_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let Some((container_id, ifname)) = owner.filter(|(c, _)| !c.is_empty()) else {
        return Ok(());
    };
    let _lock = Lock::take(&dir).map_err(store_error)?;
    host_local_dir::remove_owned(&dir, address, &container_id, &ifname).map_err(store_error)?;
    Ok(())
}

/// Called inside the write transaction of a DEL (or the undo of one
/// family of a failed ADD) of `container_id`/`ifname` in `network`: removes
/// every host-local file naming the owner, as host-local's DEL would, also
/// of a pod host-local served and Metis never recorded.
pub(in crate::store) fn before_release(
    conn: &Connection,
    network: &str,
    container_id: &str,
    ifname: &str,
    family: Option<Family>,
) -> Result<(), StoreError> {
    let Some(dir) = co_written(conn, network)? else {
        return Ok(());
    };
    let _lock = Lock::take(&dir).map_err(store_error)?;
    host_local_dir::remove_all_owned(&dir, container_id, ifname, family).map_err(store_error)?;
    Ok(())
}

/// Called inside the write transaction of a GC of `network`: removes
/// host-local's files of every owner not in `valid` written at or before
/// `allocated_until_ms` (ms since the epoch), as host-local's own GC
/// would — also of pods Metis never recorded. A legacy file (container
/// only) is kept while any attachment of its container is valid.
pub(in crate::store) fn before_gc(
    conn: &Connection,
    network: &str,
    valid: &HashSet<(&str, &str)>,
    allocated_until_ms: i64,
) -> Result<Vec<IpAddr>, StoreError> {
    let Some(dir) = co_written(conn, network)? else {
        return Ok(Vec::new());
    };
    let until = u64::try_from(allocated_until_ms).map_or(SystemTime::UNIX_EPOCH, |ms| {
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
    });
    let keep = |container_id: &str, ifname: &str| {
        valid.contains(&(container_id, ifname))
            || (ifname == host_local_dir::LEGACY_IFNAME
                && valid.iter().any(|(valid_id, _)| *valid_id == container_id))
    };
    let _lock = Lock::take(&dir).map_err(store_error)?;
    host_local_dir::remove_unkept(&dir, &keep, until).map_err(store_error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Source;
    use crate::testutil::{TempDir, cidr, owner};

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn file(dir: &Path, address: &str) -> Option<String> {
        std::fs::read_to_string(dir.join(address)).ok()
    }

    #[test]
    fn a_co_written_network_shares_one_record_per_address_with_host_local() {
        let (_tmp, dir, mut store) = network_with_dir("198.18.3.0/29");
        // Not registered: host-local's directory is not touched.
        assert_eq!(
            store.allocate(&owner("m0"), Family::V4, 0).unwrap().address,
            ip("198.18.3.2")
        );
        assert_eq!(file(&dir, "198.18.3.2"), None);
        register(&mut store, "pods", &dir).unwrap();
        assert!(is_registered(&store, "pods", &dir).unwrap());
        // Typed state of the network, not a settings key.
        let (recorded, _) = registration(&store.conn, "pods").unwrap().unwrap();
        assert_eq!(recorded, dir);
        // host-local holds .2: recorded for its pod, Metis's gets .3 and
        // its file.
        std::fs::write(dir.join("198.18.3.3"), "h1\r\neth0").unwrap();
        assert_eq!(
            store.allocate(&owner("m1"), Family::V4, 0).unwrap().address,
            ip("198.18.3.4")
        );
        assert_eq!(file(&dir, "198.18.3.4").as_deref(), Some("m1\r\neth0"));
        let h1 = store.check("pods", "h1", "eth0").unwrap();
        assert_eq!(
            h1.iter().map(|a| a.address).collect::<Vec<_>>(),
            [ip("198.18.3.3")]
        );
        // A requested address host-local holds is refused.
        let err = store
            .allocate_requested(&owner("m2"), ip("198.18.3.3"), 0)
            .unwrap_err();
        assert!(
            err.to_string().contains("held by container \"h1\""),
            "{err}"
        );
        std::fs::write(dir.join("198.18.3.5"), "h2\r\neth0").unwrap();
        let err = store
            .allocate_requested(&owner("m2"), ip("198.18.3.5"), 0)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("host-local's file records another owner"),
            "{err}"
        );
        // A DEL removes the owner's files, also of a pod Metis never recorded.
        store.release("pods", "m1", "eth0", 0).unwrap();
        assert_eq!(file(&dir, "198.18.3.4"), None);
        std::fs::write(dir.join("198.18.3.6"), "h3\r\neth0").unwrap();
        store.release("pods", "h3", "eth0", 0).unwrap();
        assert_eq!(file(&dir, "198.18.3.6"), None);
        assert_eq!(file(&dir, "198.18.3.5").as_deref(), Some("h2\r\neth0"));
        // The directory removed (the migration over): no longer co-written.
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(store.allocate(&owner("m3"), Family::V4, 0).is_ok());
        assert!(!dir.exists());
        std::fs::create_dir_all(&dir).unwrap();
        assert!(
            !is_registered(&store, "pods", &dir).unwrap(),
            "a new directory is another one"
        );
        crate::testutil::assert_sound(&store);
    }

    /// Network "pods" laid out on `block`, and host-local's directory for
    /// it (not yet registered).
    fn network_with_dir(block: &str) -> (TempDir, PathBuf, Store) {
        let tmp = TempDir::new();
        let dir = tmp.0.join("networks/pods");
        std::fs::create_dir_all(&dir).unwrap();
        let mut store = tmp.store();
        store
            .configure(
                &crate::store::Wish {
                    source: Source::Cni,
                    network: "pods",
                    family: Family::V4,
                    ranges: &[cidr(block)],
                    isolated: false,
                },
                0,
            )
            .unwrap();
        (tmp, dir, store)
    }

    /// Sets a file's modification time `seconds` before now.
    fn age(path: &Path, seconds: u64) {
        let file = std::fs::File::options().write(true).open(path).unwrap();
        file.set_modified(SystemTime::now() - Duration::from_secs(seconds))
            .unwrap();
    }

    #[test]
    fn a_gc_of_a_co_written_network_removes_host_locals_files_of_attachments_no_longer_listed() {
        let (_tmp, dir, mut store) = network_with_dir("198.18.4.0/28");
        register(&mut store, "pods", &dir).unwrap();
        // Metis's own pods: m-gone (not listed) and m-live (listed).
        let gone = store
            .allocate(&owner("m-gone"), Family::V4, 0)
            .unwrap()
            .address;
        let live = store
            .allocate(&owner("m-live"), Family::V4, 0)
            .unwrap()
            .address;
        // host-local's pods Metis never recorded: h-gone, old and not
        // listed; h-live, listed; h-legacy (container only), listed under
        // another interface; h-young, not listed but written just now.
        for (address, content) in [
            ("198.18.4.10", "h-gone\r\neth0"),
            ("198.18.4.11", "h-live\r\neth0"),
            ("198.18.4.12", "h-legacy"),
            ("198.18.4.13", "h-young\r\neth0"),
        ] {
            std::fs::write(dir.join(address), content).unwrap();
        }
        for address in ["198.18.4.10", "198.18.4.11", "198.18.4.12"] {
            age(&dir.join(address), 600);
        }
        let now_ms = i64::try_from(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_millis(),
        )
        .unwrap();
        let valid: HashSet<(&str, &str)> =
            [("m-live", "eth0"), ("h-live", "eth0"), ("h-legacy", "eth1")]
                .into_iter()
                .collect();
        let released = store
            .gc("pods", "", &valid, now_ms - 60_000, now_ms)
            .unwrap();
        assert_eq!(
            released.iter().map(|(_, a)| a.address).collect::<Vec<_>>(),
            [gone],
            "Metis releases its own row of the attachment no longer listed"
        );
        // Its file went with it although it was written just now.
        assert_eq!(file(&dir, &gone.to_string()), None);
        assert_eq!(file(&dir, "198.18.4.10"), None, "host-local's stale file");
        assert_eq!(
            file(&dir, &live.to_string()).as_deref(),
            Some("m-live\r\neth0")
        );
        assert_eq!(file(&dir, "198.18.4.11").as_deref(), Some("h-live\r\neth0"));
        assert_eq!(file(&dir, "198.18.4.12").as_deref(), Some("h-legacy"));
        assert_eq!(
            file(&dir, "198.18.4.13").as_deref(),
            Some("h-young\r\neth0"),
            "a file younger than the GC's cut-off may be an ADD in flight"
        );
        // host-local's bookkeeping is never touched.
        std::fs::write(dir.join("last_reserved_ip.0"), "198.18.4.13").unwrap();
        store
            .gc("pods", "", &HashSet::new(), now_ms - 60_000, now_ms)
            .unwrap();
        assert!(dir.join("last_reserved_ip.0").exists());
        crate::testutil::assert_sound(&store);
    }
}
