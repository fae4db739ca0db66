//! The loop's copy of what the cluster grants, and its application to the
//! store at every sync: which copies are true now ([`Follower`]), which
//! released blocks may come back ([`Returns`]), and what the store did,
//! told once per cause.

use std::collections::BTreeSet;

use super::grants::Returns;
use super::monitor::{self, Synced};
use crate::kube::follow::{Follower, Verdict};
use crate::kube::nnc::{Kind, Meta, Nnc, Node};
use crate::log;
use crate::metrics::Metrics;
use crate::store::{Store, StoreError, TakenBack};

/// What applying a copy did, for the loop.
#[derive(Debug, Default)]
pub struct Applied {
    /// Networks that gained blocks: retry their waiters.
    pub grown: Vec<String>,
    /// The object is another one now (re-created, deleted): nothing
    /// computed from the old one (an in-flight patch) counts any more.
    pub new_object: bool,
}

/// The cluster side of the daemon's state.
#[derive(Debug)]
pub struct Cluster {
    source: Kind,
    node_network: String,
    follower: Follower,
    returns: Returns,
    /// The NodeNetworkConfig copy applied last (`None`: none yet, or gone).
    latest: Option<Nnc>,
    /// Notices of the last sync, each warned once while it lasts.
    notices: BTreeSet<String>,
    /// Blocks the cluster took back that pods still use.
    taken_back: Vec<TakenBack>,
    /// When taken-back blocks were last swept (wall-clock ms): a cooldown
    /// that ended before it was already looked at.
    swept_at_ms: i64,
    /// Whether the uids earlier processes followed were read (at the
    /// first copy).
    uids_resumed: bool,
    /// The last write of the uids followed was refused: written again at
    /// the next copy.
    uids_unrecorded: bool,
}

impl Cluster {
    pub fn new(source: Kind, node_network: &str) -> Cluster {
        Cluster {
            source,
            node_network: node_network.to_string(),
            follower: Follower::default(),
            returns: Returns::default(),
            latest: None,
            notices: BTreeSet::new(),
            taken_back: Vec::new(),
            swept_at_ms: 0,
            uids_resumed: false,
            uids_unrecorded: false,
        }
    }

    /// A copy from the stream, judged as [`Follower::stream`] does, with
    /// the uids this node's earlier processes followed: read once, and
    /// recorded whenever the uid followed changes, so that an earlier
    /// object coming back after a restart is still known for one.
    fn follow_stream(&mut self, store: &mut Store, epoch: u64, meta: &Meta) -> Verdict {
        let kind = self.source.name();
        if !self.uids_resumed {
            self.uids_resumed = true;
            match store.followed_uids(kind) {
                Ok(uids) => self.follower.resume(uids),
                Err(err) => log::error(
                    "daemon",
                    "reading the followed uids failed",
                    &[("error", &err)],
                ),
            }
        }
        let another = self.follower.uid() != Some(meta.uid.as_str());
        let verdict = self.follower.stream(epoch, meta);
        if (another && verdict != Verdict::Ignore) || self.uids_unrecorded {
            let recorded = store.set_followed_uids(kind, &self.follower.uids());
            self.uids_unrecorded = recorded.is_err();
            if let Err(err) = recorded {
                log::error(
                    "daemon",
                    "recording the followed uids failed",
                    &[("error", &err)],
                );
            }
        }
        verdict
    }

    /// The NodeNetworkConfig as last applied.
    pub fn latest(&self) -> Option<&Nnc> {
        self.latest.as_ref()
    }

    /// A patch computed from the latest copy went out.
    pub fn patch_sent(&mut self, base: &str) {
        self.follower.patch_sent(base);
    }

    /// A NodeNetworkConfig copy from the stream.
    pub fn on_nnc(
        &mut self,
        store: &mut Store,
        metrics: &Metrics,
        nnc: Nnc,
        epoch: u64,
    ) -> Applied {
        let verdict = self.follow_stream(store, epoch, &nnc.meta);
        if verdict == Verdict::Ignore {
            log::debug(
                "daemon",
                "the watch is behind a copy this node read or wrote; skipping its older copy",
                &[("version", &nnc.meta.resource_version)],
            );
            return Applied::default();
        }
        self.apply_nnc(store, metrics, nnc, verdict)
    }

    /// The object a successful PATCH returned, or the GET after its 409,
    /// for the patch computed from `base`.
    pub fn on_answer(
        &mut self,
        store: &mut Store,
        metrics: &Metrics,
        base: &str,
        nnc: Nnc,
    ) -> Applied {
        let verdict = self.follower.answered(base, &nnc.meta);
        if verdict == Verdict::Ignore {
            log::debug(
                "daemon",
                "the watch is already past this answer; keeping its copy",
                &[("answer", &nnc.meta.resource_version)],
            );
            return Applied::default();
        }
        self.apply_nnc(store, metrics, nnc, verdict)
    }

    /// A Node copy from the stream.
    pub fn on_node(
        &mut self,
        store: &mut Store,
        metrics: &Metrics,
        node: Node,
        epoch: u64,
    ) -> Applied {
        let verdict = self.follow_stream(store, epoch, &node.meta);
        self.log_recreated(verdict, &node.meta);
        let network = self.node_network.clone();
        let synced = monitor::sync_node(store, &network, Some(&node), log::now_ms());
        let mut applied = self.finish(store, metrics, synced);
        applied.new_object = matches!(verdict, Verdict::Recreated | Verdict::WentBack);
        applied
    }

    /// The object is gone: nothing is granted now.
    pub fn on_gone(&mut self, store: &mut Store, metrics: &Metrics, epoch: u64) -> Applied {
        self.follower.gone(epoch);
        self.latest = None;
        let synced = match self.source {
            Kind::Nnc => monitor::sync_blocks(store, None, epoch, &mut self.returns, log::now_ms()),
            Kind::Node => {
                let network = self.node_network.clone();
                monitor::sync_node(store, &network, None, log::now_ms())
            }
        };
        let mut applied = self.finish(store, metrics, synced);
        applied.new_object = true;
        applied
    }

    /// Deletes taken-back blocks no pod uses any more and refreshes what
    /// health reports (after DELs and monitor passes).
    pub fn refresh(&mut self, store: &mut Store, metrics: &Metrics) {
        let now_ms = log::now_ms();
        self.swept_at_ms = now_ms;
        match store.sweep_taken_back(now_ms) {
            Ok(deleted) => {
                for (network, cidr) in deleted {
                    log::info(
                        "monitor",
                        "deleted a block the cluster took back: its last pod is gone",
                        &[("network", &network), ("cidr", &cidr)],
                    );
                    metrics.monitor_action("delete", &network);
                }
            }
            Err(err) => log::error(
                "daemon",
                "deleting blocks the cluster took back failed",
                &[("error", &err)],
            ),
        }
        self.read_taken_back(store);
    }

    /// When the next taken-back block no pod holds stops cooling and can be
    /// deleted (wall-clock ms): the loop sweeps then, so an empty block
    /// does not wait for the next DEL or sync (node mode has no pass).
    pub fn next_sweep_ms(&self) -> Option<i64> {
        self.taken_back
            .iter()
            .filter(|b| b.pods == 0)
            .filter_map(|b| b.cooled_at_ms)
            .filter(|at| *at > self.swept_at_ms)
            .min()
    }

    /// Blocks the cluster no longer grants that pods still hold
    /// addresses in (health is degraded while there are any).
    pub fn not_granted(&self) -> Vec<TakenBack> {
        self.taken_back
            .iter()
            .filter(|b| b.pods > 0)
            .cloned()
            .collect()
    }

    fn apply_nnc(
        &mut self,
        store: &mut Store,
        metrics: &Metrics,
        nnc: Nnc,
        verdict: Verdict,
    ) -> Applied {
        if nnc.truncated {
            log::warn(
                "daemon",
                "NodeNetworkConfig lists more entries than Metis reads; the rest is ignored",
                &[("max_entries", &crate::kube::nnc::MAX_ENTRIES)],
            );
        }
        self.log_recreated(verdict, &nnc.meta);
        let epoch = self.follower.epoch();
        if verdict == Verdict::WentBack {
            self.returns.new_epoch(epoch);
        }
        if verdict == Verdict::Recreated
            && let Err(err) = monitor::start_over(store, &mut self.returns, epoch)
        {
            log::error(
                "daemon",
                "reading released blocks failed",
                &[("error", &err)],
            );
        }
        let synced =
            monitor::sync_blocks(store, Some(&nnc), epoch, &mut self.returns, log::now_ms());
        self.latest = Some(nnc);
        let mut applied = self.finish(store, metrics, synced);
        applied.new_object = matches!(verdict, Verdict::Recreated | Verdict::WentBack);
        applied
    }

    fn log_recreated(&self, verdict: Verdict, meta: &Meta) {
        let message = match verdict {
            Verdict::Recreated => {
                "this node's object was created anew (another uid): starting over from what it grants"
            }
            Verdict::WentBack => {
                "this node's object went back to an earlier one (a uid it saw replaced, or \
                 an answer older than a copy the watch delivered): the cluster's state was \
                 restored; what it lists is old, and blocks this node released stay released"
            }
            Verdict::Apply | Verdict::Ignore => return,
        };
        log::warn(
            "daemon",
            message,
            &[("kind", &self.source.name()), ("uid", &meta.uid)],
        );
    }

    /// Reports a sync: metrics, each new notice once, and the taken-back
    /// blocks health reports.
    fn finish(
        &mut self,
        store: &mut Store,
        metrics: &Metrics,
        synced: Result<Synced, StoreError>,
    ) -> Applied {
        let synced = match synced {
            Ok(synced) => synced,
            Err(err) => {
                log::error(
                    "daemon",
                    "syncing blocks with what the cluster grants failed",
                    &[("error", &err)],
                );
                return Applied::default();
            }
        };
        for network in &synced.deleted {
            metrics.monitor_action("delete", network);
        }
        for network in &synced.taken_back {
            metrics.monitor_action("take_back", network);
        }
        let now: BTreeSet<String> = synced.notices.iter().map(|n| n.text.clone()).collect();
        let mut refused = 0;
        for notice in &synced.notices {
            if self.notices.contains(&notice.text) {
                continue;
            }
            log::warn("monitor", &notice.text, &[]);
            refused += u64::from(notice.refusal);
        }
        metrics.refused_pod_cidrs(refused);
        self.notices = now;
        self.read_taken_back(store);
        let mut grown = synced.grown;
        grown.dedup();
        Applied {
            grown,
            new_object: false,
        }
    }

    fn read_taken_back(&mut self, store: &Store) {
        match store.taken_back() {
            Ok(blocks) => self.taken_back = blocks,
            Err(err) => log::warn(
                "daemon",
                "reading blocks the cluster took back failed",
                &[("error", &err)],
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::Family;
    use crate::testutil::TempDir;
    use serde_json::json;

    const BLOCK: &str = "198.19.0.0/28";

    fn copy(uid: &str, version: &str, listed: &[&str]) -> Nnc {
        let ready = json!({"type": "Ready", "status": "True"});
        let entries: Vec<_> = (listed.iter())
            .map(|c| json!({"network": "default", "cidr": c, "condition": ready}))
            .collect();
        Nnc::parse(&json!({
            "metadata": {"name": "n1", "uid": uid, "resourceVersion": version},
            "spec": {"allocations": [{"network": "default", "pods": 0}]},
            "status": {"podCIDRs": entries},
        }))
    }

    fn held(store: &Store) -> bool {
        let ready = store.ready_blocks_newest_first("default", Family::V4);
        ready.unwrap().iter().any(|b| b.cidr == BLOCK)
    }

    /// A block this node released, its object re-created since, then etcd
    /// restored to the earlier object, which still lists the block: that
    /// uid is known as an earlier one (by a later process of the daemon
    /// too), so the block stays released. A new object listing it is a
    /// grant, and takes it again.
    #[test]
    fn an_earlier_object_back_grants_nothing_this_node_released() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let metrics = Metrics::default();
        let mut cluster = Cluster::new(Kind::Nnc, "default");
        cluster.on_nnc(&mut store, &metrics, copy("uid-a", "1", &[BLOCK]), 1);
        assert!(held(&store));
        let now = log::now_ms();
        let cidr = BLOCK.parse().unwrap();
        store.record_release("default", &cidr, true, now).unwrap();
        cluster.on_nnc(&mut store, &metrics, copy("uid-a", "2", &[]), 1);
        assert!(!held(&store));
        let applied = cluster.on_nnc(&mut store, &metrics, copy("uid-b", "3", &[]), 1);
        assert!(applied.new_object);
        // A later process of the daemon; then the restore, and its relist.
        let mut cluster = Cluster::new(Kind::Nnc, "default");
        cluster.on_nnc(&mut store, &metrics, copy("uid-b", "3", &[]), 1);
        let applied = cluster.on_nnc(&mut store, &metrics, copy("uid-a", "1", &[BLOCK]), 2);
        assert!(applied.new_object);
        assert!(
            !held(&store),
            "a released block taken from a restored object"
        );
        assert_eq!(store.released().unwrap().len(), 1);
        // The current object back, then a new one that lists the block.
        cluster.on_nnc(&mut store, &metrics, copy("uid-b", "4", &[]), 2);
        assert!(!held(&store));
        cluster.on_nnc(&mut store, &metrics, copy("uid-c", "5", &[BLOCK]), 2);
        assert!(held(&store), "a new object's grant refused");
        let uids = store.followed_uids(Kind::Nnc.name()).unwrap();
        assert_eq!(uids, ["uid-a", "uid-b", "uid-c"]);
    }
}
