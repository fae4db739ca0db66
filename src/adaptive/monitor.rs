//! The adaptive monitor's store side: turning a NodeNetworkConfig snapshot
//! into local blocks, and one monitor pass (scale-up, drain, release) into
//! store changes plus at most one patch. The decisions themselves are the
//! pure functions of [`super::policy`].

use super::policy::{self, BlockLoad, Load, LowUtilization};
use crate::cidr::{Cidr, Family};
use crate::kube::nnc::{self, Nnc, NncPatch, PodCidr};
use crate::log;
use crate::store::{AddOutcome, BlockFilter, BlockState, Source, Store, StoreError};

/// Durations of the monitor, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct MonitorConfig {
    pub draining_expiration_ms: i64,
    pub sustained_low_utilization_ms: i64,
    /// `--scale-up-wait`: cooling addresses that come free within it count
    /// as capacity on its way.
    pub scale_up_wait_ms: i64,
}

/// What one pass decided besides its store changes.
#[derive(Debug, Default, PartialEq)]
pub struct PassOutcome {
    /// The patch to send, if anything changed.
    pub patch: Option<NncPatch>,
    /// (action, network) for metrics: scale_up, drain, release, delete.
    pub actions: Vec<(&'static str, String)>,
}

/// What syncing the status changed locally.
#[derive(Debug, Default, PartialEq)]
pub struct Synced {
    /// Networks that gained blocks (their waiters should be retried).
    pub grown: Vec<String>,
    /// Networks of released blocks deleted locally.
    pub deleted: Vec<String>,
    /// Entries refused (overlapping another block, or too large); each is
    /// logged as a warning.
    pub refused: u64,
}

/// Brings local blocks in line with the status: Ready IPv4 pod CIDRs not
/// stored yet are added (every network, also those only in the status),
/// and Deleting blocks whose CIDR left the status are deleted.
pub fn sync_blocks(store: &mut Store, nnc: &Nnc) -> Result<Synced, StoreError> {
    let mut synced = Synced::default();
    for entry in nnc.pod_cidrs.iter().filter(|entry| entry.ready) {
        let cidr = match entry.cidr.parse::<Cidr>() {
            Ok(cidr) if cidr.family() == Family::V4 => cidr,
            // IPv6 blocks come from the CNI ranges and grow lazily instead.
            Ok(_) => continue,
            Err(err) => {
                log::warn(
                    "monitor",
                    "ignoring unparsable podCIDR",
                    &[("cidr", &entry.cidr), ("error", &err)],
                );
                continue;
            }
        };
        if store.find_block(&entry.network, &cidr)?.is_some() {
            continue;
        }
        let outcome = store.add_granted_block(Source::Nnc, &entry.network, &cidr, log::now_ms());
        if is_refusal(&outcome) {
            synced.refused += 1;
        }
        if was_added(outcome)? {
            log::info(
                "monitor",
                "Watcher adding new ready podCIDR to local DB",
                &[("network", &entry.network), ("cidr", &cidr)],
            );
            if !synced.grown.contains(&entry.network) {
                synced.grown.push(entry.network.clone());
            }
        }
    }
    let deleting = store.blocks(&BlockFilter {
        network: None,
        state: Some(BlockState::Deleting),
        family: Some(Family::V4),
    })?;
    for block in deleting {
        if status_entry(nnc, &block.network, &block.cidr).is_none()
            && store.delete_block(block.id)?
        {
            log::info(
                "monitor",
                "released CIDR block left the status; deleted locally",
                &[("network", &block.network), ("cidr", &block.cidr)],
            );
            synced.deleted.push(block.network);
        }
    }
    Ok(synced)
}

/// Whether the store refused a granted block (see [`was_added`]).
fn is_refusal(outcome: &Result<AddOutcome, StoreError>) -> bool {
    matches!(outcome, Err(StoreError::Overlap { .. }))
}

/// A granted block the store refuses (it overlaps a block of the node's
/// address space) is skipped and reported; the rest of
/// the status is still synced.
/// Whether a block was added.
fn was_added(outcome: Result<AddOutcome, StoreError>) -> Result<bool, StoreError> {
    match outcome {
        Ok(outcome) => Ok(matches!(outcome, AddOutcome::Added(_))),
        Err(err @ StoreError::Overlap { .. }) => {
            log::warn(
                "monitor",
                "refusing a podCIDR from the cluster",
                &[("error", &err)],
            );
            Ok(false)
        }
        Err(err) => Err(err),
    }
}

/// Adds a Node's `spec.podCIDRs` as blocks of `network`. Returns whether a
/// block was added.
pub fn sync_node_cidrs(
    store: &mut Store,
    network: &str,
    cidrs: &[String],
) -> Result<bool, StoreError> {
    let mut added = false;
    for text in cidrs {
        let cidr = match text.parse::<Cidr>() {
            Ok(cidr) => cidr,
            Err(err) => {
                log::warn(
                    "monitor",
                    "ignoring unparsable node podCIDR",
                    &[("cidr", text), ("error", &err)],
                );
                continue;
            }
        };
        if was_added(store.add_granted_block(Source::Node, network, &cidr, log::now_ms()))? {
            log::info(
                "monitor",
                "added node podCIDR",
                &[("network", &network), ("cidr", &cidr)],
            );
            added = true;
        }
    }
    Ok(added)
}

/// One monitor pass over every network of the store (IPv4 only: IPv6
/// blocks grow lazily). `pending` counts the parked requests of a network.
pub fn pass(
    store: &mut Store,
    nnc: &Nnc,
    pending: &dyn Fn(&str) -> i64,
    config: MonitorConfig,
    now_ms: i64,
) -> Result<PassOutcome, StoreError> {
    let mut outcome = PassOutcome::default();
    let mut allocations = nnc.allocations.clone();
    let mut releasable: Vec<PodCidr> = Vec::new();
    for network in store.networks()? {
        let usage = store.usage(&network, Family::V4, now_ms)?;
        let cooling = store.cooling(
            &network,
            Family::V4,
            now_ms,
            now_ms.saturating_add(config.scale_up_wait_ms),
        )?;
        let load = Load {
            // Reserved rows are as unusable as pods' (upstream's count).
            allocated: usage.allocated.saturating_add(usage.reserved),
            pending: pending(&network),
            total: usage.total,
            granted: usage.total.saturating_sub(ungranted(store, nnc, &network)?),
            cooling_soon: cooling.by_then,
        };
        if load.total == 0 {
            continue;
        }
        let current = nnc.pods(&network).unwrap_or(0);
        let desired = policy::scale_up(load, current);
        for _ in 0..drain_if_idle(store, &network, load, config, now_ms)? {
            outcome.actions.push(("drain", network.clone()));
        }
        let released = release_expired(
            store,
            nnc,
            &network,
            config,
            now_ms,
            &mut releasable,
            &mut outcome.actions,
        )?;
        let wanted = policy::final_pods(desired, released);
        match allocations.iter_mut().find(|(n, _)| *n == network) {
            Some((_, pods)) if *pods == wanted => {}
            Some((_, pods)) => {
                log::info(
                    "monitor",
                    "Scale-up triggered: capacity expansion requested",
                    &[("network", &network), ("from", pods), ("to", &wanted)],
                );
                if wanted > *pods {
                    outcome.actions.push(("scale_up", network.clone()));
                }
                *pods = wanted;
            }
            None => {
                outcome.actions.push(("scale_up", network.clone()));
                allocations.push((network.clone(), wanted));
            }
        }
    }
    if allocations != nnc.allocations || releasable != nnc.releasable {
        outcome.patch = Some(NncPatch {
            resource_version: nnc.resource_version.clone(),
            allocations,
            releasable,
        });
    }
    Ok(outcome)
}

/// Addresses of the network's blocks that came from a NodeNetworkConfig
/// status which no longer lists them.
fn ungranted(store: &Store, nnc: &Nnc, network: &str) -> Result<i64, StoreError> {
    let mut sum = 0i64;
    for (_, cidr) in store.nnc_only_blocks(network, Family::V4)? {
        if status_entry(nnc, network, &cidr.to_string()).is_none() {
            sum = sum.saturating_add(i64::try_from(cidr.size()).unwrap_or(i64::MAX));
        }
    }
    Ok(sum)
}

/// The drain step, with the low-utilisation start time kept in the store so
/// a daemon restart does not reset the clock (upstream keeps it in memory).
/// Returns how many blocks were drained.
fn drain_if_idle(
    store: &mut Store,
    network: &str,
    load: Load,
    config: MonitorConfig,
    now_ms: i64,
) -> Result<usize, StoreError> {
    let since = store.low_utilization_since(network)?;
    match policy::low_utilization(load, since, now_ms, config.sustained_low_utilization_ms) {
        LowUtilization::Clear => store.set_low_utilization_since(network, None).map(|()| 0),
        LowUtilization::Since(since) => store
            .set_low_utilization_since(network, Some(since))
            .map(|()| 0),
        LowUtilization::Drain => {
            let ready: Vec<BlockLoad> = store
                .ready_blocks_newest_first(network, Family::V4)?
                .iter()
                .map(|block| BlockLoad {
                    id: block.id,
                    total: block.total_ips,
                    allocated: block.allocated_ips,
                })
                .collect();
            let drained = policy::blocks_to_drain(&ready, load);
            for id in &drained {
                store.drain_block(*id, now_ms)?;
                log::info(
                    "monitor",
                    "Marked CIDR block as Draining due to prolonged low utilization",
                    &[("network", &network), ("block_id", id)],
                );
            }
            if !drained.is_empty() {
                store.set_low_utilization_since(network, None)?;
            }
            Ok(drained.len())
        }
    }
}

/// Expires idle Draining blocks and lists every Deleting block that the
/// status still holds as releasable. Returns the addresses newly given
/// back (to take off the pod request once).
fn release_expired(
    store: &mut Store,
    nnc: &Nnc,
    network: &str,
    config: MonitorConfig,
    now_ms: i64,
    releasable: &mut Vec<PodCidr>,
    actions: &mut Vec<(&'static str, String)>,
) -> Result<i64, StoreError> {
    for block in
        store.expire_draining(network, Family::V4, config.draining_expiration_ms, now_ms)?
    {
        actions.push(("release", network.to_string()));
        log::info(
            "monitor",
            "CIDR block is fully drained; requesting release by adding to releasableCIDRs list",
            &[("network", &network), ("cidr", &block.cidr)],
        );
    }
    let mut released = 0i64;
    for block in store.deleting_blocks(network, Family::V4)? {
        match status_entry(nnc, network, &block.cidr) {
            None => {
                if store.delete_block(block.id)? {
                    actions.push(("delete", network.to_string()));
                }
            }
            Some(entry) => {
                let already = nnc
                    .releasable
                    .iter()
                    .any(|r| same_cidr(r.cidr(), &block.cidr));
                if !already {
                    released = released.saturating_add(block.total_ips);
                }
                releasable.push(entry.raw.clone());
            }
        }
    }
    Ok(released)
}

fn status_entry<'a>(nnc: &'a Nnc, network: &str, cidr: &str) -> Option<&'a nnc::StatusCidr> {
    nnc.pod_cidrs
        .iter()
        .find(|entry| entry.network == network && same_cidr(Some(&entry.cidr), cidr))
}

/// CIDR equality by value, so `198.18.0.0/28` matches however it is spelled.
fn same_cidr(a: Option<&str>, b: &str) -> bool {
    match (
        a.and_then(|a| a.parse::<Cidr>().ok()),
        b.parse::<Cidr>().ok(),
    ) {
        (Some(a), Some(b)) => a == b,
        _ => a == Some(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Owner;
    use crate::testutil::TempDir;
    use serde_json::json;

    const HOUR: i64 = 3_600_000;
    const CONFIG: MonitorConfig = MonitorConfig {
        draining_expiration_ms: 5 * HOUR,
        sustained_low_utilization_ms: 8 * 3_600_000,
        scale_up_wait_ms: 9_000,
    };

    fn nnc(version: &str, pods: Option<i64>, status: &[&str], releasable: &[&str]) -> Nnc {
        let allocations: Vec<_> = pods
            .map(|p| json!({"network": "default", "pods": p}))
            .into_iter()
            .collect();
        Nnc::parse(&json!({
            "metadata": {"resourceVersion": version},
            "spec": {
                "allocations": allocations,
                "releasableCIDRs": releasable.iter().map(|c| json!({"id": c, "network": "default", "cidr": c})).collect::<Vec<_>>(),
            },
            "status": {"podCIDRs": status.iter().map(|c| json!({"id": c, "network": "default", "cidr": c})).collect::<Vec<_>>()},
        }))
    }

    fn fill(store: &mut Store, count: usize) {
        for i in 0..count {
            let id = format!("c{i}");
            let owner = Owner {
                network: "default",
                container_id: &id,
                interface_name: "eth0",
                pod_name: "",
                pod_namespace: "",
            };
            store
                .allocate(&owner, Family::V4, crate::log::now_ms())
                .unwrap();
        }
    }

    #[test]
    fn sync_adds_ready_ipv4_blocks_of_every_network_once() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let mut snapshot = nnc("1", None, &["198.18.1.0/28", "2001:db8::/120"], &[]);
        snapshot.pod_cidrs[0].network = "only-in-status".into();
        assert_eq!(
            sync_blocks(&mut store, &snapshot).unwrap().grown,
            vec!["only-in-status".to_string()]
        );
        assert_eq!(
            sync_blocks(&mut store, &snapshot).unwrap(),
            Synced::default()
        );
        let blocks = store
            .blocks(&BlockFilter {
                network: None,
                state: None,
                family: None,
            })
            .unwrap();
        assert_eq!(blocks.len(), 1, "IPv6 is not taken from the status");
        assert_eq!(blocks[0].network, "only-in-status");
    }

    #[test]
    fn refused_entries_are_counted_and_the_rest_synced() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let snapshot = nnc(
            "1",
            None,
            &[
                "198.19.4.0/27",
                "198.19.4.0/28",
                "198.0.0.0/11",
                "198.19.5.0/28",
            ],
            &[],
        );
        let synced = sync_blocks(&mut store, &snapshot).unwrap();
        assert_eq!(synced.refused, 2);
        assert_eq!(synced.grown, vec!["default".to_string()]);
        let cidrs: Vec<String> = store
            .blocks(&BlockFilter::default())
            .unwrap()
            .into_iter()
            .map(|b| b.cidr)
            .collect();
        assert_eq!(cidrs, vec!["198.19.4.0/27", "198.19.5.0/28"]);
    }

    #[test]
    fn pass_asks_for_more_pods_when_busy() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store
            .add_cidr_block("default", &"198.18.0.0/28".parse().unwrap())
            .unwrap();
        fill(&mut store, 13);
        let snapshot = nnc("5", Some(16), &[], &[]);
        let outcome = pass(&mut store, &snapshot, &|_| 10, CONFIG, crate::log::now_ms()).unwrap();
        // 13 + 3 reserved + 10 waiting = 26 → ceil(26 / 0.75) = 35.
        assert_eq!(
            outcome.patch,
            Some(NncPatch {
                resource_version: "5".into(),
                allocations: vec![("default".into(), 35)],
                releasable: Vec::new(),
            })
        );
        assert_eq!(outcome.actions, vec![("scale_up", "default".to_string())]);
        // Nothing changed: no patch.
        let settled = nnc("6", Some(35), &[], &[]);
        let outcome = pass(&mut store, &settled, &|_| 10, CONFIG, crate::log::now_ms()).unwrap();
        assert_eq!(outcome.patch, None);
    }

    #[test]
    fn expired_blocks_become_releasable_once_then_disappear() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store
            .add_cidr_block("default", &"198.18.0.0/28".parse().unwrap())
            .unwrap();
        let extra = store
            .add_cidr_block("default", &"198.18.1.0/28".parse().unwrap())
            .unwrap();
        let AddOutcome::Added(extra_id) = extra else {
            panic!("{extra:?}")
        };
        assert!(store.drain_block(extra_id, crate::log::now_ms()).unwrap());
        let status = ["198.18.1.0/28"];
        let first = nnc("7", Some(32), &status, &[]);
        let outcome = pass(
            &mut store,
            &first,
            &|_| 0,
            CONFIG,
            crate::log::now_ms() + 6 * HOUR,
        )
        .unwrap();
        let patch = outcome.patch.unwrap();
        assert_eq!(patch.releasable[0].cidr(), Some("198.18.1.0/28"));
        // 32 requested − 16 given back.
        assert_eq!(patch.allocations, vec![("default".into(), 16)]);
        // Already listed: not subtracted twice.
        let second = nnc("8", Some(16), &status, &["198.18.1.0/28"]);
        let outcome = pass(
            &mut store,
            &second,
            &|_| 0,
            CONFIG,
            crate::log::now_ms() + 6 * HOUR,
        )
        .unwrap();
        assert_eq!(outcome.patch, None);
        // Gone from the status: deleted locally and dropped from the list.
        let third = nnc("9", Some(16), &[], &["198.18.1.0/28"]);
        let outcome = pass(
            &mut store,
            &third,
            &|_| 0,
            CONFIG,
            crate::log::now_ms() + 6 * HOUR,
        )
        .unwrap();
        assert!(outcome.patch.unwrap().releasable.is_empty());
        assert_eq!(
            store
                .blocks(&BlockFilter {
                    network: None,
                    state: None,
                    family: None
                })
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn low_utilization_clock_survives_restarts() {
        let dir = TempDir::new();
        let hour = 3_600_000;
        let t0 = crate::log::now_ms();
        {
            let mut store = dir.store();
            store
                .add_cidr_block("default", &"198.18.0.0/28".parse().unwrap())
                .unwrap();
            store
                .add_cidr_block("default", &"198.18.1.0/28".parse().unwrap())
                .unwrap();
            pass(
                &mut store,
                &nnc("1", Some(32), &[], &[]),
                &|_| 0,
                CONFIG,
                t0,
            )
            .unwrap();
        }
        // A new store (a restarted daemon) remembers when low use began.
        let mut store = dir.store();
        // The store stamps updated_at with the real clock, so keep expiry
        // out of reach of the simulated 9 hours.
        let config = MonitorConfig {
            draining_expiration_ms: 100 * hour,
            ..CONFIG
        };
        pass(
            &mut store,
            &nnc("2", Some(32), &[], &[]),
            &|_| 0,
            config,
            t0 + 9 * hour,
        )
        .unwrap();
        let draining = store
            .blocks(&BlockFilter {
                network: None,
                state: Some(BlockState::Draining),
                family: None,
            })
            .unwrap();
        assert_eq!(draining.len(), 1);
        assert_eq!(
            draining[0].cidr, "198.18.1.0/28",
            "the newest block drains, never the oldest"
        );
    }
}
