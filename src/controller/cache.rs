//! What the informers delivered, kept as the decision reads it, and which
//! NodeNetworkConfigs' Nodes are missing since when (this process's view,
//! kept while standing by too; a process started later starts the grace
//! period over, which only delays a reclaim).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::decide::World;
use super::informer::{Item, Resource};
use super::pool::{self, Pool};
use super::status::Status;
use crate::kube::nnc::Nnc;

#[derive(Debug, Default)]
pub struct Cache {
    pub nncs: BTreeMap<String, Nnc>,
    pub statuses: BTreeMap<String, Status>,
    pub nodes: BTreeSet<String>,
    pub pools: BTreeMap<String, Pool>,
    /// `pools`, checked against each other: computed when one changes, not
    /// at every pass.
    validated: Arc<Vec<Pool>>,
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
            Resource::Pool => self.pools.clear(),
        }
        for item in items {
            self.put(kind, item);
        }
        self.listed.insert(kind);
        self.revalidate(kind);
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
                self.pools.insert(pool.name.clone(), *pool);
            }
        }
        self.revalidate(kind);
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
                self.pools.remove(name);
            }
        }
        self.revalidate(kind);
    }

    fn revalidate(&mut self, kind: Resource) {
        if kind == Resource::Pool {
            let mut pools: Vec<Pool> = self.pools.values().cloned().collect();
            pool::validate(&mut pools);
            self.validated = Arc::new(pools);
        }
    }

    /// The pools, checked against each other.
    pub fn pools(&self) -> Arc<Vec<Pool>> {
        Arc::clone(&self.validated)
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
