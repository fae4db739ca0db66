//! What the informers delivered, kept as the decision reads it, and which
//! NodeNetworkConfigs' Nodes are missing since when (this process's view,
//! kept while standing by too; a process started later starts the grace
//! period over, which only delays a reclaim).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::decide::World;
use super::informer::{Item, Resource};
use super::pool::{self, Pool, PoolSpec};
use super::status::Status;
use crate::kube::nnc::Nnc;

#[derive(Debug, Default)]
pub struct Cache {
    pub nncs: BTreeMap<String, Nnc>,
    pub statuses: BTreeMap<String, Status>,
    pub nodes: BTreeSet<String>,
    /// The pools, checked against each other when one changes (not at
    /// every pass), each kept once: a ledger of thousands of claims is MiBs.
    pools: Arc<Vec<Pool>>,
    /// Each pool's spec as read, before that check refused any.
    specs: BTreeMap<String, Result<PoolSpec, String>>,
    listed: BTreeSet<Resource>,
    absent: BTreeMap<String, i64>,
    /// Versions a write was refused for (409): nothing is written from
    /// them; a newer copy from the watch replaces them.
    stale: BTreeSet<(Resource, String, String)>,
}

impl Cache {
    /// Every kind was listed at least once: the view is whole.
    pub fn synced(&self) -> bool {
        Resource::ALL.iter().all(|kind| self.listed.contains(kind))
    }

    pub fn listed(&mut self, kind: Resource, items: Vec<Item>) {
        match kind {
            Resource::Nnc => {
                self.nncs.clear();
                self.statuses.clear();
            }
            Resource::Node => self.nodes.clear(),
            Resource::Pool => {
                Arc::make_mut(&mut self.pools).clear();
                self.specs.clear();
            }
        }
        for item in items {
            self.put(kind, item);
        }
        self.listed.insert(kind);
    }

    pub fn mark_stale(&mut self, kind: Resource, name: &str, version: &str) {
        self.stale
            .insert((kind, name.to_string(), version.to_string()));
    }

    pub fn is_stale(&self, kind: Resource, name: &str, version: &str) -> bool {
        self.stale
            .contains(&(kind, name.to_string(), version.to_string()))
    }

    pub fn put(&mut self, kind: Resource, item: Item) {
        let name = item.name().to_string();
        let version = item.resource_version().to_string();
        // A copy of another version is newer (the stream's order): decide
        // from it. The stale version itself, delivered late, stays stale.
        self.stale
            .retain(|(k, n, v)| *k != kind || *n != name || *v == version);
        match item {
            Item::Nnc(nnc, status) => {
                self.statuses.insert(nnc.meta.name.clone(), status);
                self.nncs.insert(nnc.meta.name.clone(), *nnc);
            }
            Item::Node(name) => {
                self.nodes.insert(name);
            }
            Item::Pool(pool) => {
                self.specs.insert(pool.name.clone(), pool.spec.clone());
                let pools = Arc::make_mut(&mut self.pools);
                pools.retain(|p| p.name != pool.name);
                pools.push(*pool);
                self.revalidate();
            }
        }
    }

    pub fn remove(&mut self, kind: Resource, name: &str) {
        self.stale.retain(|(k, n, _)| *k != kind || n != name);
        match kind {
            Resource::Nnc => {
                self.nncs.remove(name);
                self.statuses.remove(name);
            }
            Resource::Node => {
                self.nodes.remove(name);
            }
            Resource::Pool => {
                self.specs.remove(name);
                Arc::make_mut(&mut self.pools).retain(|p| p.name != name);
                self.revalidate();
            }
        }
    }

    /// Checks the pools against each other again, from their specs as read.
    fn revalidate(&mut self) {
        let pools = Arc::make_mut(&mut self.pools);
        for pool in pools.iter_mut() {
            if let Some(spec) = self.specs.get(&pool.name) {
                pool.spec = spec.clone();
            }
        }
        pool::validate(pools);
    }

    /// The pools, checked against each other.
    pub fn pools(&self) -> Arc<Vec<Pool>> {
        Arc::clone(&self.pools)
    }

    /// Notes which Nodes are missing now: those of NodeNetworkConfigs and
    /// of claims.
    pub fn update_absent(&mut self, pools: &[Pool], now_ms: i64) {
        let names: BTreeSet<&String> = self
            .nncs
            .keys()
            .chain(
                pools
                    .iter()
                    .flat_map(|p| p.ledger.claims.values().map(|h| &h.node)),
            )
            .collect();
        let missing: BTreeSet<String> = names
            .into_iter()
            .filter(|n| !self.nodes.contains(*n))
            .cloned()
            .collect();
        self.absent.retain(|name, _| missing.contains(name));
        for name in missing {
            self.absent.entry(name).or_insert(now_ms);
        }
    }

    pub fn world<'a>(&'a self, pools: &'a [Pool], now_ms: i64, node_grace_ms: i64) -> World<'a> {
        World {
            pools,
            nncs: &self.nncs,
            statuses: &self.statuses,
            absent: &self.absent,
            now_ms,
            node_grace_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool(name: &str, created: &str, cidr: &str) -> Item {
        Item::parse(
            Resource::Pool,
            json!({"metadata": {"name": name, "resourceVersion": "1", "creationTimestamp": created},
                   "spec": {"network": "default", "ipv4": {"cidrs": [cidr], "blockPrefixLength": 28}},
                   "status": {}}),
        )
    }

    fn valid(cache: &Cache) -> Vec<(String, bool)> {
        cache
            .pools()
            .iter()
            .map(|p| (p.name.clone(), p.spec.is_ok()))
            .collect()
    }

    #[test]
    fn pools_are_checked_against_each_other_from_their_specs_as_read() {
        let mut cache = Cache::default();
        cache.listed(
            Resource::Pool,
            vec![pool("old", "2026-01-01T00:00:00Z", "198.18.0.0/24")],
        );
        // A newer overlapping pool is refused while the older one stands.
        cache.put(
            Resource::Pool,
            pool("new", "2026-02-01T00:00:00Z", "198.18.0.0/25"),
        );
        assert_eq!(valid(&cache), [("old".into(), true), ("new".into(), false)]);
        // A pass's copy stays as it was while the cache changes.
        let before = cache.pools();
        cache.remove(Resource::Pool, "old");
        assert_eq!(valid(&cache), [("new".into(), true)]);
        assert_eq!(before.len(), 2);
        // The older one back: the newer is refused again, not kept valid.
        cache.put(
            Resource::Pool,
            pool("old", "2026-01-01T00:00:00Z", "198.18.0.0/24"),
        );
        assert_eq!(valid(&cache), [("old".into(), true), ("new".into(), false)]);
        cache.listed(Resource::Pool, Vec::new());
        assert!(cache.pools().is_empty());
    }
}
