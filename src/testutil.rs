//! Helpers shared by unit tests: private temp directories and stores.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::cidr::Cidr;
use crate::store::{Depth, Owner, Store, StoreOptions};

/// A unique directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "metis-unit-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        // Private, as Metis wants its database directory.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        TempDir(dir)
    }

    pub fn db(&self) -> PathBuf {
        self.0.join("metis.sqlite")
    }

    /// A store on this directory's database, with default options.
    pub fn store(&self) -> Store {
        Store::open(&self.db(), &StoreOptions::default()).unwrap()
    }

    /// A store on this directory's database whose released addresses rest
    /// for `cooldown_ms`, as under a daemon started with that cooldown.
    pub fn store_with_cooldown(&self, cooldown_ms: i64) -> Store {
        let opts = StoreOptions {
            release_cooldown: Some(cooldown_ms),
            ..StoreOptions::default()
        };
        Store::open(&self.db(), &opts).unwrap()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Owner `container_id`/eth0 of a pod in network `pods`.
pub fn owner(container_id: &str) -> Owner<'_> {
    Owner {
        network: "pods",
        container_id,
        interface_name: "eth0",
        pod_name: "pod",
        pod_namespace: "ns",
    }
}

/// A prefix from its text, naming it on failure.
pub fn cidr(text: &str) -> Cidr {
    text.parse().unwrap_or_else(|e| panic!("{text}: {e}"))
}

/// The full `admin check` finds nothing wrong with `store`.
pub fn assert_sound(store: &Store) {
    let report = store.verify(Depth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
}

/// xorshift64*: a model test's steps from a seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        let len = u64::try_from(items.len()).unwrap();
        &items[usize::try_from(self.below(len)).unwrap()]
    }
}
