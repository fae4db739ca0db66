//! The adaptive monitor's store side: turning a NodeNetworkConfig snapshot
//! into local blocks, and one monitor pass (scale-up, drain, release) into
//! store changes plus at most one patch. The decisions themselves are the
//! pure functions of [`super::policy`].

use super::grants::{self, Returns};
use super::policy::{self, BlockLoad, Load, LowUtilization};
use crate::cidr::{Cidr, Family};
use crate::kube::nnc::{self, Nnc, NncPatch, Node, PodCidr};
use crate::log;
use crate::store::{
    BlockFilter, BlockState, GrantChanges, Source, Store, StoreError, reserved_offsets,
};

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
    /// The cluster's blocks this node serves after the pass ([`serving`]).
    pub serving: Vec<Cidr>,
}

/// What syncing the cluster's grants changed locally.
#[derive(Debug, Default, PartialEq)]
pub struct Synced {
    /// Networks that gained blocks (their waiters should be retried).
    pub grown: Vec<String>,
    /// Networks of blocks deleted locally (released ones that left the
    /// status, taken-back ones no pod uses), one per block.
    pub deleted: Vec<String>,
    /// Networks of blocks the cluster took back, one per block.
    pub taken_back: Vec<String>,
    /// Entries not served, and why.
    pub notices: Vec<Notice>,
}

/// Why an entry of the cluster's is not served, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The store refused it (it overlaps another block); else it is
    /// withheld (not Ready, released, unparsable).
    pub refusal: bool,
    pub text: String,
}

/// Brings the NodeNetworkConfig's blocks in line with what `nnc` (of
/// stream `epoch`; `None`: the object is gone) grants now: Ready IPv4
/// entries are added (every network, also those only in the status),
/// local blocks it no longer grants are retired (their pods keep their
/// addresses) and deleted once unused, and Deleting blocks whose CIDR left
/// the status are deleted.
pub fn sync_blocks(
    store: &mut Store,
    nnc: Option<&Nnc>,
    epoch: u64,
    returns: &mut Returns,
    now_ms: i64,
) -> Result<Synced, StoreError> {
    let released = store.released()?;
    returns.observe(epoch, nnc, &released);
    let nothing = Nnc::default();
    let status = nnc.unwrap_or(&nothing);
    let grants = grants::decide(status, &released, returns);
    for (network, cidr) in &grants.returned {
        log::info(
            "monitor",
            "a block this node released came back to the status; taking it again",
            &[("network", network), ("cidr", cidr)],
        );
        store.forget_release(network, cidr)?;
    }
    let changes = store.follow_grants(Source::Nnc, &[Family::V4], &grants.granted, now_ms)?;
    let mut synced = synced_from(changes, "NodeNetworkConfig");
    synced
        .notices
        .extend(grants.withheld.iter().map(|w| Notice {
            refusal: false,
            text: w.describe(),
        }));
    let deleting = store.blocks(&BlockFilter {
        network: None,
        state: Some(BlockState::Deleting),
        family: Some(Family::V4),
    })?;
    for block in deleting {
        if status_entry(status, &block.network, &block.cidr).is_none()
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

/// A re-created object (another uid): what the old one listed is gone.
pub fn start_over(store: &Store, returns: &mut Returns, epoch: u64) -> Result<(), StoreError> {
    returns.start_over(epoch, &store.released()?);
    Ok(())
}

/// Makes the Node's `spec.podCIDRs` (`None`: the Node is gone) exactly the
/// blocks of `network` the Node source provides, both families.
pub fn sync_node(
    store: &mut Store,
    network: &str,
    node: Option<&Node>,
    now_ms: i64,
) -> Result<Synced, StoreError> {
    let mut granted = Vec::new();
    let mut notices = Vec::new();
    for text in node.map(|n| n.pod_cidrs.as_slice()).unwrap_or_default() {
        match text.parse::<Cidr>() {
            Ok(cidr) => granted.push((network.to_string(), cidr)),
            Err(err) => notices.push(Notice {
                refusal: false,
                text: format!("ignoring unparsable node podCIDR {text:?}: {err}"),
            }),
        }
    }
    let changes = store.follow_grants(Source::Node, &[Family::V4, Family::V6], &granted, now_ms)?;
    let mut synced = synced_from(changes, "Node");
    synced.notices.extend(notices);
    Ok(synced)
}

/// Logs what following the grants of `object` did and sums it up.
fn synced_from(changes: GrantChanges, object: &str) -> Synced {
    let mut synced = Synced::default();
    for (network, cidr) in changes.added.iter().chain(&changes.granted_again) {
        log::info(
            "monitor",
            "Watcher adding new ready podCIDR to local DB",
            &[("network", network), ("cidr", cidr), ("from", &object)],
        );
        if !synced.grown.contains(network) {
            synced.grown.push(network.clone());
        }
    }
    for (network, cidr) in &changes.taken_back {
        log::warn(
            "monitor",
            "the cluster no longer grants this block: nothing new is allocated from it; its pods keep their addresses until their DEL",
            &[("network", network), ("cidr", cidr), ("from", &object)],
        );
        synced.taken_back.push(network.clone());
    }
    for (network, cidr) in &changes.deleted {
        log::info(
            "monitor",
            "deleted a block the cluster took back: no pod holds an address in it",
            &[("network", network), ("cidr", cidr)],
        );
        synced.deleted.push(network.clone());
    }
    synced
        .notices
        .extend(changes.releasing.iter().map(|(network, cidr)| Notice {
        refusal: false,
        text: format!(
            "podCIDR {cidr} of network {network:?} is not allocated from: this node is releasing it"
        ),
    }));
    synced.notices.extend(changes.refused.iter().map(|r| Notice {
        refusal: true,
        text: format!(
            "refusing a podCIDR from the cluster: {} of network {:?} overlaps block {} of network {:?}, which belongs to {}",
            r.cidr, r.network, r.other_cidr, r.other_network, r.owner
        ),
    }));
    synced
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
        let share = cluster_share(store, nnc, &network)?;
        let load = Load {
            // Reserved rows of the cluster's blocks are as unusable as
            // pods' (upstream's count); the node's own ranges' are theirs.
            allocated: usage.allocated.saturating_add(share.reserved),
            pending: pending(&network),
            total: usage.total,
            from_cluster: share.addresses,
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
        let at = PassAt {
            nnc,
            config,
            now_ms,
        };
        let released =
            release_expired(store, &at, &network, &mut releasable, &mut outcome.actions)?;
        let wanted = policy::final_pods(desired, released);
        set_request(&mut allocations, &network, wanted, &mut outcome.actions);
    }
    outcome.serving = serving(store)?;
    let spec_changed = allocations != nnc.allocations || releasable != nnc.releasable;
    if spec_changed || serving_news(nnc, &outcome.serving) {
        outcome.patch = Some(NncPatch {
            resource_version: nnc.meta.resource_version.clone(),
            allocations,
            releasable,
            serving: serving_text(&outcome.serving),
        });
    }
    Ok(outcome)
}

/// Sets the request of `network` in `allocations` to `wanted`.
fn set_request(
    allocations: &mut Vec<(String, i64)>,
    network: &str,
    wanted: i64,
    actions: &mut Vec<(&'static str, String)>,
) {
    match allocations.iter_mut().find(|(n, _)| n == network) {
        Some((_, pods)) if *pods == wanted => {}
        Some((_, pods)) => {
            log::info(
                "monitor",
                "Scale-up triggered: capacity expansion requested",
                &[("network", &network), ("from", pods), ("to", &wanted)],
            );
            if wanted > *pods {
                actions.push(("scale_up", network.to_string()));
            }
            *pods = wanted;
        }
        None => {
            actions.push(("scale_up", network.to_string()));
            allocations.push((network.to_string(), wanted));
        }
    }
}

/// The blocks this node got from the cluster that it has not released and
/// still serves or drains: its NodeNetworkConfig blocks that are not
/// Deleting, and the ones the cluster took back that pods (or cooling
/// addresses) still keep in the store. Sorted, each once.
pub fn serving(store: &Store) -> Result<Vec<Cidr>, StoreError> {
    let mut cidrs = Vec::new();
    for network in store.networks()? {
        for family in [Family::V4, Family::V6] {
            cidrs.extend(
                store
                    .nnc_only_blocks(&network, family)?
                    .into_iter()
                    .map(|(_, c)| c),
            );
        }
    }
    for block in store.taken_back()? {
        if block.source == Source::Nnc.as_str()
            && let Ok(cidr) = block.cidr.parse::<Cidr>()
        {
            cidrs.push(cidr);
        }
    }
    cidrs.sort();
    cidrs.dedup();
    Ok(cidrs)
}

/// The `metis.x-k8s.io/serving` annotation's text: canonical CIDRs, in
/// order, comma-separated.
pub fn serving_text(cidrs: &[Cidr]) -> String {
    cidrs
        .iter()
        .map(Cidr::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Whether the annotation on `nnc` tells the controller something other
/// than `serving` does about blocks its status does not list — the only
/// ones the controller learns anything from it about (a listed block stays
/// this node's anyway). A block served but unlisted must be claimed back
/// (a re-created object); one claimed but no longer served must not be.
/// Otherwise the annotation rides along with the next spec PATCH and costs
/// no write of its own.
fn serving_news(nnc: &Nnc, serving: &[Cidr]) -> bool {
    let unlisted = |cidr: &Cidr| {
        !nnc.pod_cidrs
            .iter()
            .any(|entry| same_cidr(Some(&entry.cidr), &cidr.to_string()))
    };
    let mut claimed: Vec<Cidr> = nnc
        .serving
        .split(',')
        .filter_map(|text| text.trim().parse::<Cidr>().ok())
        .filter(unlisted)
        .collect();
    claimed.sort();
    claimed.dedup();
    let needed: Vec<Cidr> = serving.iter().copied().filter(unlisted).collect();
    claimed != needed
}

/// The network's IPv4 blocks that the cluster granted and its status
/// still lists: their addresses, and the rows they reserve (which no pod
/// can use). What the controller counts against the request; the node's
/// own ranges, blocks a re-created object's status does not list and
/// blocks the cluster took back are not counted (see
/// [`policy::Load::from_cluster`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ClusterShare {
    addresses: i64,
    reserved: i64,
}

fn cluster_share(store: &Store, nnc: &Nnc, network: &str) -> Result<ClusterShare, StoreError> {
    let first_v4 = store
        .blocks(&BlockFilter {
            network: Some(network.to_string()),
            state: None,
            family: Some(Family::V4),
        })?
        .iter()
        .map(|block| block.id)
        .min();
    let mut share = ClusterShare::default();
    for (id, cidr) in store.nnc_only_blocks(network, Family::V4)? {
        if status_entry(nnc, network, &cidr.to_string()).is_none() {
            continue;
        }
        let reserved = reserved_offsets(&cidr, store.reserve_mode(), first_v4 == Some(id)).len();
        share.addresses = share
            .addresses
            .saturating_add(i64::try_from(cidr.size()).unwrap_or(i64::MAX));
        share.reserved = share
            .reserved
            .saturating_add(i64::try_from(reserved).unwrap_or(i64::MAX));
    }
    Ok(share)
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

/// What one monitor pass reads: the node's NNC, the flags and the time.
#[derive(Clone, Copy)]
struct PassAt<'a> {
    nnc: &'a Nnc,
    config: MonitorConfig,
    now_ms: i64,
}

/// Expires idle Draining blocks and lists every Deleting block that the
/// status still holds as releasable. Returns the addresses newly given
/// back (to take off the pod request once).
fn release_expired(
    store: &mut Store,
    at: &PassAt,
    network: &str,
    releasable: &mut Vec<PodCidr>,
    actions: &mut Vec<(&'static str, String)>,
) -> Result<i64, StoreError> {
    let PassAt {
        nnc,
        config,
        now_ms,
    } = *at;
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
                    let cidr: Cidr = block.cidr.parse()?;
                    store.record_release(network, &cidr, entry.reusable, now_ms)?;
                }
                releasable.push(entry.raw.clone());
            }
        }
    }
    // A block this node released that is in the status again but not
    // taken (`Withheld::NotBackYet`: its leaving was seen in an earlier
    // stream epoch, before a relist or a restart, or it is NonReusable):
    // the controller counts it as this node's, so it is given back again
    // rather than held unused while ADDs wait for a grant that never comes.
    for release in store.released()? {
        let cidr = release.cidr.to_string();
        if release.network != network || releasable.iter().any(|r| same_cidr(r.cidr(), &cidr)) {
            continue;
        }
        if let Some(entry) = status_entry(nnc, network, &cidr) {
            // Given back as NonReusable now (a restored or edited status
            // says so): the cluster retires it, so this node never takes
            // it again either, whatever a later copy says.
            if release.reusable && !entry.reusable {
                store.record_release(network, &release.cidr, false, release.released_at)?;
            }
            let mut given_back = entry.raw.clone();
            // Released as NonReusable, listed again as reusable (a status
            // restored from before the release): said again, so that the
            // cluster retires it again instead of granting it elsewhere.
            if !release.reusable && entry.reusable {
                given_back.kind = Some("NonReusable".to_string());
            }
            releasable.push(given_back);
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
    use crate::store::{AddOutcome, Owner};
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
        // Entries as the status publishes them (Ready), echoed whole.
        let entry = |c: &&str| {
            json!({"id": c, "network": "default", "cidr": c,
                   "condition": {"type": "Ready", "status": "True"}})
        };
        Nnc::parse(&json!({
            "metadata": {"resourceVersion": version},
            "spec": {
                "allocations": allocations,
                "releasableCIDRs": releasable.iter().map(entry).collect::<Vec<_>>(),
            },
            "status": {"podCIDRs": status.iter().map(entry).collect::<Vec<_>>()},
        }))
    }

    fn sync(store: &mut Store, snapshot: &Nnc) -> Synced {
        sync_blocks(
            store,
            Some(snapshot),
            1,
            &mut Returns::default(),
            crate::log::now_ms(),
        )
        .unwrap()
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
            sync(&mut store, &snapshot).grown,
            vec!["only-in-status".to_string()]
        );
        assert_eq!(sync(&mut store, &snapshot), Synced::default());
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
        let synced = sync(&mut store, &snapshot);
        assert_eq!(synced.notices.iter().filter(|n| n.refusal).count(), 2);
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
        // 13 pods + 10 waiting = 23 → ceil(23 / 0.75) = 31; the --cidr
        // block's 3 reserved rows are the node's own, not the cluster's.
        assert_eq!(
            outcome.patch,
            Some(NncPatch {
                resource_version: "5".into(),
                allocations: vec![("default".into(), 31)],
                releasable: Vec::new(),
                serving: String::new(),
            })
        );
        assert_eq!(outcome.actions, vec![("scale_up", "default".to_string())]);
        // Nothing changed: no patch.
        let settled = nnc("6", Some(31), &[], &[]);
        let outcome = pass(&mut store, &settled, &|_| 10, CONFIG, crate::log::now_ms()).unwrap();
        assert_eq!(outcome.patch, None);
    }

    #[test]
    fn a_static_range_is_not_counted_as_held_and_the_request_settles() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store
            .add_cidr_block("default", &"198.18.0.0/24".parse().unwrap())
            .unwrap();
        fill(&mut store, 10);
        let now = crate::log::now_ms();
        let asked = |store: &mut Store, snapshot: &Nnc| {
            pass(store, snapshot, &|_| 0, CONFIG, now)
                .unwrap()
                .patch
                .map(|p| p.allocations)
        };
        // 10 pods: ceil(10 / 0.75) = 14, whatever the /24 holds.
        let first = nnc("1", None, &[], &[]);
        assert_eq!(
            asked(&mut store, &first),
            Some(vec![("default".into(), 14)])
        );
        // One /28 granted, which reserves 3 rows (this store reserves in
        // every block): 13 in use, ceil(13 / 0.75) = 18.
        let one = nnc("2", Some(14), &["198.19.0.0/28"], &[]);
        sync(&mut store, &one);
        assert_eq!(asked(&mut store, &one), Some(vec![("default".into(), 18)]));
        // Two /28s cover 18: the request is what the cluster holds (32).
        let two = ["198.19.0.0/28", "198.19.0.16/28"];
        let granted = nnc("3", Some(18), &two, &[]);
        sync(&mut store, &granted);
        assert_eq!(
            asked(&mut store, &granted),
            Some(vec![("default".into(), 32)])
        );
        // Covered: nothing more is asked for, pass after pass.
        let settled = nnc("4", Some(32), &two, &[]);
        for _ in 0..3 {
            assert_eq!(asked(&mut store, &settled), None);
        }
    }

    #[test]
    fn the_serving_annotation_is_written_alone_only_about_unlisted_blocks() {
        let cidrs =
            |texts: &[&str]| -> Vec<Cidr> { texts.iter().map(|t| t.parse().unwrap()).collect() };
        let with = |annotation: &str| {
            let mut copy = nnc("1", Some(16), &["198.19.0.0/28"], &[]);
            copy.serving = annotation.to_string();
            copy
        };
        let listed = ["198.19.0.0/28"];
        let both = ["198.19.0.0/28", "198.19.1.0/28"];
        // A listed block stays the node's: no write of its own for it.
        assert!(!serving_news(&with(""), &cidrs(&listed)));
        // Served but unlisted (a re-created object): claimed back.
        assert!(serving_news(&with(""), &cidrs(&both)));
        assert!(serving_news(&with("198.19.0.0/28"), &cidrs(&both)));
        // Already claimed, however spelled: nothing new.
        assert!(!serving_news(&with("198.19.1.0/28"), &cidrs(&both)));
        assert!(!serving_news(
            &with(" 198.19.1.0/28 ,garbage"),
            &cidrs(&both)
        ));
        // Claimed but no longer served: withdrawn.
        assert!(serving_news(&with("198.19.1.0/28"), &cidrs(&listed)));
        assert_eq!(
            serving_text(&cidrs(&["198.19.1.0/28", "198.19.0.0/28"])[..]),
            "198.19.1.0/28,198.19.0.0/28",
            "the caller sorts"
        );
        assert_eq!(serving_text(&cidrs(&both)), "198.19.0.0/28,198.19.1.0/28");
    }

    #[test]
    fn serving_lists_the_clusters_blocks_still_held_and_nothing_else() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store
            .add_cidr_block("default", &"198.18.0.0/30".parse().unwrap())
            .unwrap();
        let three = ["198.19.0.0/28", "198.19.0.16/28", "198.19.0.32/28"];
        sync(&mut store, &nnc("1", Some(16), &three, &[]));
        // A pod in the first cluster block (the /30's one address first).
        fill(&mut store, 2);
        let text = |store: &Store| serving_text(&serving(store).unwrap());
        assert_eq!(
            text(&store),
            "198.19.0.0/28,198.19.0.16/28,198.19.0.32/28",
            "the static /30 is the node's own"
        );
        // A re-created object lists none of them: the one with a pod is
        // kept for it (taken back) and still served; the empty ones go.
        sync(&mut store, &nnc("2", None, &[], &[]));
        assert_eq!(text(&store), "198.19.0.0/28");
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

    /// A reusable release that the status lists again as NonReusable (a
    /// restored or edited status) is given back as NonReusable: from then
    /// on this node never takes it again, whatever a later copy says.
    #[test]
    fn a_release_given_back_as_nonreusable_is_never_taken_again() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let own = "198.18.0.0/28".parse().unwrap();
        store.add_cidr_block("default", &own).unwrap();
        let block = "198.18.1.0/28";
        let now = crate::log::now_ms();
        store
            .record_release("default", &block.parse().unwrap(), true, now)
            .unwrap();
        let with = |version: &str, kind: &str| {
            Nnc::parse(&json!({
                "metadata": {"resourceVersion": version},
                "spec": {"allocations": [{"network": "default", "pods": 0}]},
                "status": {"podCIDRs": [{"id": "b", "network": "default", "cidr": block, "type": kind,
                    "condition": {"type": "Ready", "status": "True"}}]},
            }))
        };
        let listed = with("7", "NonReusable");
        let outcome = pass(&mut store, &listed, &|_| 0, CONFIG, now).unwrap();
        let releasable = outcome.patch.unwrap().releasable;
        assert_eq!(releasable.len(), 1);
        assert_eq!(releasable[0].cidr(), Some(block));
        assert!(!store.released().unwrap()[0].reusable);
        // The status drops it, then lists it again as reusable: withheld.
        let mut returns = Returns::default();
        let gone = nnc("8", Some(0), &[], &[]);
        sync_blocks(&mut store, Some(&gone), 1, &mut returns, now).unwrap();
        let back = with("9", "");
        let synced = sync_blocks(&mut store, Some(&back), 1, &mut returns, now).unwrap();
        let ready = store
            .ready_blocks_newest_first("default", Family::V4)
            .unwrap();
        assert!(ready.iter().all(|b| b.cidr != block), "{ready:?}");
        assert!(
            synced
                .notices
                .iter()
                .any(|n| n.text.contains("never taken again")),
            "{:?}",
            synced.notices
        );
    }

    /// A NonReusable release that a restored status lists again without
    /// its type is given back as NonReusable again: the cluster forgot,
    /// and retires it once more instead of granting it elsewhere.
    #[test]
    fn a_nonreusable_release_listed_again_as_reusable_is_given_back_as_nonreusable() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store
            .add_cidr_block("default", &"198.18.0.0/28".parse().unwrap())
            .unwrap();
        let block = "198.18.1.0/28";
        let now = crate::log::now_ms();
        store
            .record_release("default", &block.parse().unwrap(), false, now)
            .unwrap();
        let restored = Nnc::parse(&json!({
            "metadata": {"resourceVersion": "7"},
            "spec": {"allocations": [{"network": "default", "pods": 0}]},
            "status": {"podCIDRs": [{"id": "b", "network": "default", "cidr": block,
                "condition": {"type": "Ready", "status": "True"}}]},
        }));
        let outcome = pass(&mut store, &restored, &|_| 0, CONFIG, now).unwrap();
        let releasable = outcome.patch.unwrap().releasable;
        assert_eq!(releasable.len(), 1);
        assert_eq!(releasable[0].cidr(), Some(block));
        assert_eq!(releasable[0].kind.as_deref(), Some("NonReusable"));
        assert!(!store.released().unwrap()[0].reusable);
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
