//! Reboot-aware leak recovery. No container survives a reboot, but runtimes
//! never send DEL for them, so every address held when the machine went
//! down would leak forever. The database records the kernel's boot id (in
//! Metis's own `metis_settings`; upstream's tables are untouched); whoever
//! first opens it under a new boot id — the daemon at start or a plugin in
//! direct mode — releases the previous boot's allocations in the same
//! transaction that records the new id, so exactly one of them does it and
//! nothing allocated under the new boot is ever released.

use std::path::{Path, PathBuf};

use crate::store::db::{
    Allocation, Store, StoreError, get_setting, parse_addr, parse_cidr, set_setting,
};
use crate::store::rows::block::{HeldRow, give_back};
use crate::store::rows::free::pod_held;

/// `metis_settings` key: the kernel boot id the database was last used under.
const KEY_BOOT_ID: &str = "boot_id";
/// `metis_settings` key: `off` when the daemon runs with `--no-boot-recovery`,
/// so plugins in direct mode leave old allocations alone too.
const KEY_BOOT_RECOVERY: &str = "boot_recovery";

/// Where the kernel publishes the current boot id.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";
/// Environment variable naming another file to read the boot id from.
pub const BOOT_ID_ENV: &str = "METIS_BOOT_ID_FILE";

/// The file to read the boot id from: `METIS_BOOT_ID_FILE` if set (for
/// tests, and for containers that cannot see `/proc/sys`), else the kernel's.
pub fn boot_id_path(lookup: &dyn Fn(&str) -> Option<String>) -> PathBuf {
    lookup(BOOT_ID_ENV)
        .filter(|path| !path.is_empty())
        .map_or_else(|| PathBuf::from(BOOT_ID_PATH), PathBuf::from)
}

/// The boot id in `path`; `None` when it cannot be read or is empty
/// (recovery is then skipped: without one, a reboot cannot be told apart).
pub fn read_boot_id(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let id = text.trim();
    (!id.is_empty()).then(|| id.to_string())
}

/// What [`Store::recover_after_reboot`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootRecovery {
    /// The database was last used under this boot: nothing to do.
    SameBoot,
    /// No boot id was recorded yet (new database, or written by upstream or
    /// an older Metis): it is recorded, nothing is released.
    FirstRecord,
    /// A new boot: this many pod allocations of the previous one were released.
    Released(u64),
    /// A new boot, but recovery is disabled: the new id is recorded only.
    Disabled,
}

impl BootRecovery {
    /// Allocations released (0 unless `Released`).
    pub fn released(self) -> u64 {
        match self {
            BootRecovery::Released(n) => n,
            _ => 0,
        }
    }
}

impl Store {
    /// Records `boot_id` as the current boot; if an earlier, different one
    /// was recorded and recovery is enabled, first releases every pod
    /// allocation (resting the release cooldown). One immediate transaction.
    /// `enabled`: `Some(e)` (the daemon) also records whether recovery is
    /// enabled, for plugins in direct mode; `None` (a plugin) follows the
    /// recorded choice.
    pub fn recover_after_reboot(
        &mut self,
        boot_id: &str,
        enabled: Option<bool>,
        now_ms: i64,
    ) -> Result<BootRecovery, StoreError> {
        let stored = get_setting(&self.conn, KEY_BOOT_ID)?;
        // Only a choice to record is compared with the recorded one: a
        // plugin (`None`) reads one setting, not two.
        let setting_matches = match enabled {
            None => true,
            Some(e) => e != (get_setting(&self.conn, KEY_BOOT_RECOVERY)?.as_deref() == Some("off")),
        };
        if stored.as_deref() == Some(boot_id) && setting_matches {
            return Ok(BootRecovery::SameBoot);
        }
        let mode = self.reserve;
        let release_at = self.release_at(now_ms);
        let tx = crate::store::db::busy::During::during(
            crate::store::db::write(&mut self.conn, self.batch),
            "BEGIN IMMEDIATE (boot recovery)",
        )?;
        // Re-read under the write lock: another process may have recovered.
        let stored = get_setting(&tx, KEY_BOOT_ID)?;
        let enabled = match enabled {
            Some(enabled) => {
                set_setting(&tx, KEY_BOOT_RECOVERY, if enabled { "on" } else { "off" })?;
                enabled
            }
            None => get_setting(&tx, KEY_BOOT_RECOVERY)?.as_deref() != Some("off"),
        };
        let outcome = match stored.as_deref() {
            Some(id) if id == boot_id => BootRecovery::SameBoot,
            None => BootRecovery::FirstRecord,
            Some(_) if !enabled => BootRecovery::Disabled,
            Some(_) => {
                let mut rows = Vec::new();
                {
                    let mut stmt = tx.prepare(concat!(
                        "SELECT a.id, a.address, b.id, b.cidr, b.network FROM ip_addresses a \
                             JOIN cidr_blocks b ON b.id = a.cidr_block_id WHERE ",
                        pod_held!("a."),
                        " ORDER BY a.id"
                    ))?;
                    let mut query = stmt.query([])?;
                    while let Some(row) = query.next()? {
                        let address: String = row.get(1)?;
                        let cidr: String = row.get(3)?;
                        let held = HeldRow {
                            row_id: row.get(0)?,
                            block_id: row.get(2)?,
                            allocation: Allocation {
                                address: parse_addr(&address)?,
                                block: parse_cidr(&cidr)?,
                                gateway: None,
                            },
                        };
                        rows.push((held, row.get::<_, String>(4)?));
                    }
                }
                for (row, network) in &rows {
                    give_back(&tx, mode, network, row, release_at)?;
                }
                BootRecovery::Released(u64::try_from(rows.len()).unwrap_or(u64::MAX))
            }
        };
        set_setting(&tx, KEY_BOOT_ID, boot_id)?;
        tx.commit()?;
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::Family;
    use crate::store::Depth;
    use crate::testutil::{TempDir, owner};

    const NOW: i64 = 1_700_000_000_000;

    /// A store (1 m release cooldown, the daemon's default) with `pods` allocated.
    fn store_with_pods(dir: &TempDir, pods: &[&str]) -> Store {
        let mut store = dir.store_with_cooldown(60_000);
        store
            .add_cidr_block("pods", &"198.18.0.0/28".parse().unwrap())
            .unwrap();
        for pod in pods {
            store.allocate(&owner(pod), Family::V4, NOW).unwrap();
        }
        store
    }

    fn held(store: &Store, pod: &str) -> usize {
        store.check("pods", pod, "eth0").unwrap().len()
    }

    #[test]
    fn a_new_boot_releases_the_previous_boots_allocations_once() {
        let dir = TempDir::new();
        let mut store = store_with_pods(&dir, &[]);
        let first = store.recover_after_reboot("boot-1", Some(true), NOW);
        assert_eq!(first.unwrap(), BootRecovery::FirstRecord);
        for pod in ["a", "b"] {
            store.allocate(&owner(pod), Family::V4, NOW).unwrap();
        }
        let same = store.recover_after_reboot("boot-1", Some(true), NOW);
        assert_eq!(same.unwrap(), BootRecovery::SameBoot);
        assert_eq!(held(&store, "a"), 1);

        let next = store.recover_after_reboot("boot-2", Some(true), NOW);
        assert_eq!(next.unwrap(), BootRecovery::Released(2));
        assert_eq!((held(&store, "a"), held(&store, "b")), (0, 0));
        assert!(store.verify(Depth::Full).unwrap().is_ok());
        // Released with the cooldown: the next pod gets a fresh address.
        let cooling: i64 = store
            .conn
            .query_row(
                "SELECT COUNT(*) FROM ip_addresses WHERE is_allocated = 0 AND release_at = ?1",
                [NOW + 60_000],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(cooling, 2);
        // A plugin in direct mode under the same boot releases nothing more.
        store.allocate(&owner("c"), Family::V4, NOW).unwrap();
        let plugin = store.recover_after_reboot("boot-2", None, NOW);
        assert_eq!(plugin.unwrap(), BootRecovery::SameBoot);
        assert_eq!(held(&store, "c"), 1);
    }

    #[test]
    fn an_unrecorded_boot_keeps_existing_allocations() {
        let dir = TempDir::new();
        let mut store = store_with_pods(&dir, &["a"]);
        let outcome = store.recover_after_reboot("boot-1", None, NOW).unwrap();
        assert_eq!(outcome, BootRecovery::FirstRecord);
        assert_eq!(held(&store, "a"), 1);
    }

    #[test]
    fn disabled_recovery_records_the_boot_and_binds_direct_mode_too() {
        let dir = TempDir::new();
        let mut store = store_with_pods(&dir, &[]);
        store
            .recover_after_reboot("boot-1", Some(false), NOW)
            .unwrap();
        store.allocate(&owner("a"), Family::V4, NOW).unwrap();
        let daemon = store.recover_after_reboot("boot-2", Some(false), NOW);
        assert_eq!(daemon.unwrap(), BootRecovery::Disabled);
        // A plugin under yet another boot follows the daemon's choice.
        let plugin = store.recover_after_reboot("boot-3", None, NOW);
        assert_eq!(plugin.unwrap(), BootRecovery::Disabled);
        assert_eq!(held(&store, "a"), 1);
        // Re-enabled under the same boot: the boot is not new, nothing goes.
        let enabled = store.recover_after_reboot("boot-3", Some(true), NOW);
        assert_eq!(enabled.unwrap(), BootRecovery::SameBoot);
        assert_eq!(held(&store, "a"), 1);
    }

    #[test]
    fn boot_id_comes_from_the_kernel_or_the_override() {
        let dir = TempDir::new();
        assert_eq!(boot_id_path(&|_| None), PathBuf::from(BOOT_ID_PATH));
        let fake = dir.0.join("boot_id");
        std::fs::write(&fake, "  abc-123\n").unwrap();
        let path = boot_id_path(&|name| (name == BOOT_ID_ENV).then(|| fake.display().to_string()));
        assert_eq!(read_boot_id(&path).as_deref(), Some("abc-123"));
        std::fs::write(&fake, "\n").unwrap();
        assert_eq!(read_boot_id(&fake), None);
        assert_eq!(read_boot_id(&dir.0.join("missing")), None);
    }
}
