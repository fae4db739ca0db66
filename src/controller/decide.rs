//! The controller's decision, pure: every pool (spec and ledger), every
//! NodeNetworkConfig (spec, status, resourceVersion), which Nodes are gone
//! since when, and the time → the status writes, in the order they must
//! happen, and the Events. No I/O: `writer` applies the result and a
//! model test (`tests::model`) drives it with random sequences.
//!
//! The rules (docs/controller.md, "How blocks move"):
//! - a block is granted (added to a node's `status.podCIDRs`) only through
//!   a claim in its pool's ledger, and the pool's status is written (a
//!   compare-and-swap on its resourceVersion) before any status that adds
//!   or removes one of its blocks;
//! - a block is free only when no status holds or overlaps it and no pool
//!   claims, cools or retired it — the union over everything read;
//! - a block the node lists in `releasableCIDRs` leaves its status and
//!   cools for the pool's `reclaimDelay`; a `NonReusable` one never comes
//!   back; the blocks of a Node gone longer than `--node-grace` go the same
//!   way;
//! - blocks are added until capacity covers `spec.allocations[].pods` per
//!   network and family, at most `maxBlocksPerNode` per pool; when no pool
//!   can, the NodeNetworkConfig says `QuotaExceeded…`;
//! - overlaps nobody granted (a hand-edited status, one block in two
//!   statuses) are reported, never granted further, never silently fixed.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use super::pool::{Cooling, FamilyRange, Holder, Ledger, Pool, PoolSpec};
use super::status::{self, Entry, Status};
use crate::cidr::{Cidr, Family, from_u128, to_u128};
use crate::kube::nnc::{Nnc, QuotaEnd};
use crate::log::{rfc3339_millis, rfc3339_seconds};

pub const READY: &str = "NodeNetworkConfigReady";
pub use crate::kube::nnc::QUOTA_EXCEEDED;
pub const INVALID: &str = "InvalidParametersToUpdateNetworkInterfacePodCIDRs";
pub use crate::kube::nnc::QUOTA_UNTIL as UNTIL;
/// Event reasons on the Node.
pub const QUOTA_EVENT: &str = "PodCIDRQuotaExceeded";
pub const CONFLICT_EVENT: &str = "PodCIDRConflict";
const FAMILIES: [Family; 2] = [Family::V4, Family::V6];

/// Everything one decision reads.
pub struct World<'a> {
    /// Validated (`pool::validate`): a refused spec grants nothing and
    /// takes nothing back, but its ledger still counts.
    pub pools: &'a [Pool],
    pub nncs: &'a BTreeMap<String, Nnc>,
    /// The status of each NodeNetworkConfig as read (kept whole).
    pub statuses: &'a BTreeMap<String, Status>,
    /// NodeNetworkConfig names whose Node is missing, and since when (ms).
    pub absent: &'a BTreeMap<String, i64>,
    pub now_ms: i64,
    pub node_grace_ms: i64,
}

/// A status write: PUT `.../NAME/status` carrying `resource_version`.
#[derive(Debug, Clone, PartialEq)]
pub struct Write {
    pub name: String,
    pub resource_version: String,
    /// The status, compact JSON text (thousands of writes in one pass cost
    /// their text, not their trees).
    pub status: String,
    /// Pools whose status write must have succeeded first (this write adds
    /// or removes blocks they account for).
    pub after_pools: Vec<String>,
}

/// An Event on a Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEvent {
    pub node: String,
    pub reason: &'static str,
    pub message: String,
}

/// Blocks of one pool family by state, for the metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gauge {
    pub pool: String,
    pub family: Family,
    pub free: u64,
    pub granted: u64,
    pub cooling: u64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decision {
    pub pool_writes: Vec<Write>,
    pub nnc_writes: Vec<Write>,
    /// Posted once the NodeNetworkConfig's write succeeded.
    pub events: Vec<NodeEvent>,
    pub gauges: Vec<Gauge>,
    /// When (ms) time alone changes the next decision: the first cooling
    /// block comes free or the first missing Node's grace ends. The loop
    /// sleeps until then unless an event comes first.
    pub next_due_ms: Option<i64>,
}

/// Why a node's Ready condition is not `NodeNetworkConfigReady`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Trouble {
    Conflict(String),
    Quota(String),
    Gone(String),
}

/// One node's status being rebuilt: the entries it keeps, borrowed from
/// the status read, and those it gains.
struct Plan<'a> {
    entries: Vec<Cow<'a, Entry>>,
    pools: BTreeSet<String>,
    trouble: Option<Trouble>,
}

/// Address intervals taken, per family, kept merged and sorted.
#[derive(Default)]
struct Taken {
    v4: Vec<(u128, u128)>,
    v6: Vec<(u128, u128)>,
}

impl Taken {
    fn of(&mut self, family: Family) -> &mut Vec<(u128, u128)> {
        match family {
            Family::V4 => &mut self.v4,
            Family::V6 => &mut self.v6,
        }
    }

    fn add(&mut self, cidr: &Cidr) {
        let (lo, hi) = span(cidr);
        let list = self.of(cidr.family());
        let at = list.partition_point(|(_, end)| end.saturating_add(1) < lo);
        let mut lo = lo;
        let mut hi = hi;
        let mut until = at;
        while until < list.len() && list[until].0 <= hi.saturating_add(1) {
            lo = lo.min(list[until].0);
            hi = hi.max(list[until].1);
            until += 1;
        }
        list.splice(at..until, [(lo, hi)]);
    }

    /// The end of the first taken interval overlapping `lo..=hi`.
    fn overlap(&mut self, family: Family, lo: u128, hi: u128) -> Option<u128> {
        let list = self.of(family);
        let at = list.partition_point(|(_, end)| *end < lo);
        list.get(at)
            .filter(|(start, _)| *start <= hi)
            .map(|(_, end)| *end)
    }
}

fn span(cidr: &Cidr) -> (u128, u128) {
    let lo = to_u128(cidr.base());
    (lo, lo.saturating_add(cidr.size().saturating_sub(1)))
}

/// The first block of `range` that nothing takes and `skip` allows.
fn first_free(
    range: &FamilyRange,
    taken: &mut Taken,
    skip: &dyn Fn(&Cidr) -> bool,
) -> Option<Cidr> {
    let size = range.block_size();
    for cidr in &range.cidrs {
        let (start, end) = span(cidr);
        let mut at = start;
        loop {
            let block_end = at.checked_add(size - 1)?;
            if block_end > end {
                break;
            }
            match taken.overlap(range.family, at, block_end) {
                Some(taken_end) => {
                    // Next block boundary past the taken interval.
                    let past = taken_end.checked_add(1)?.checked_sub(start)?;
                    at = start.checked_add(past.div_ceil(size).checked_mul(size)?)?;
                }
                None => {
                    let block = Cidr::new(from_u128(range.family, at), range.block_prefix).ok()?;
                    if !skip(&block) {
                        return Some(block);
                    }
                    at = at.checked_add(size)?;
                }
            }
        }
    }
    None
}

/// The pool whose ledger or ranges account for `cidr`: the one that
/// claims or cools it, else a valid one covering it, else (a block nobody
/// granted, maybe from a pool refused for now) any pool, so that a block
/// released is timed somewhere and can never come back early.
fn pool_of(pools: &[Pool], ledgers: &[Ledger], cidr: &Cidr) -> Option<usize> {
    ledgers
        .iter()
        .position(|l| l.claims.contains_key(cidr) || l.cooling.contains_key(cidr))
        .or_else(|| {
            pools.iter().position(|p| {
                p.spec
                    .as_ref()
                    .is_ok_and(|s| s.range(cidr.family()).is_some_and(|r| r.covers(cidr)))
            })
        })
        .or_else(|| (!pools.is_empty()).then_some(0))
}

/// Whether the node lists `cidr` in `releasableCIDRs`.
fn lists_releasable(nnc: &Nnc, cidr: &str) -> bool {
    nnc.releasable.iter().any(|r| r.cidr() == Some(cidr))
}

/// Decides one pass.
pub fn decide(world: &World) -> Decision {
    let pools = world.pools;
    let mut ledgers: Vec<Ledger> = pools.iter().map(|p| p.ledger.clone()).collect();
    let now = world.now_ms;
    // Cooled long enough: free again.
    for (pool, ledger) in pools.iter().zip(&mut ledgers) {
        let delay = reclaim_delay_ms(pool);
        ledger
            .cooling
            .retain(|_, c| now.saturating_sub(c.since_ms) < delay);
    }
    let gone = |name: &str| {
        world
            .absent
            .get(name)
            .is_some_and(|since| now.saturating_sub(*since) >= world.node_grace_ms)
    };
    let mut plans: BTreeMap<&str, Plan> = BTreeMap::new();
    // Releases, and the blocks of gone nodes.
    for (name, nnc) in world.nncs {
        let gone = gone(name);
        let mut plan = Plan {
            entries: Vec::new(),
            pools: BTreeSet::new(),
            trouble: gone
                .then(|| Trouble::Gone(format!("Node {name} is gone: its blocks were taken back"))),
        };
        let raw_entries = world
            .statuses
            .get(name)
            .map_or(&[][..], |s| s.entries.as_slice());
        for raw in raw_entries {
            let released = gone
                || raw
                    .cidr_text
                    .as_deref()
                    .is_some_and(|cidr| lists_releasable(nnc, cidr));
            match (released, raw.cidr) {
                (true, Some(cidr)) => {
                    let holder = Holder {
                        node: name.clone(),
                        uid: nnc.meta.uid.clone(),
                    };
                    let foreign = ledgers
                        .iter()
                        .any(|l| l.claims.get(&cidr).is_some_and(|h| *h != holder));
                    // A copy of another node's block leaves this status
                    // only; the block stays the other node's.
                    if !foreign && let Some(i) = pool_of(pools, &ledgers, &cidr) {
                        let ledger = &mut ledgers[i];
                        ledger.claims.remove(&cidr);
                        if raw.reusable {
                            // Still in a status: the delay counts from now,
                            // when it leaves it (again, after a lost write).
                            ledger.cooling.insert(
                                cidr,
                                Cooling {
                                    node: name.clone(),
                                    since_ms: now,
                                },
                            );
                        } else {
                            if !ledger.non_reusable.contains(&cidr) {
                                ledger.non_reusable.push(cidr);
                            }
                            ledger.cooling.remove(&cidr);
                        }
                        plan.pools.insert(pools[i].name.clone());
                    }
                }
                _ => plan.entries.push(Cow::Borrowed(raw)),
            }
        }
        plans.insert(name, plan);
    }
    // Claims whose status entry is missing: finish the grant, or take the
    // block back when its object is gone.
    for (i, ledger) in ledgers.iter_mut().enumerate() {
        let claims: Vec<(Cidr, Holder)> =
            ledger.claims.iter().map(|(c, h)| (*c, h.clone())).collect();
        for (cidr, holder) in claims {
            let nnc = world.nncs.get(&holder.node);
            let current = nnc.is_some_and(|n| n.meta.uid == holder.uid);
            let held = plans
                .get(holder.node.as_str())
                .is_some_and(|p| p.entries.iter().any(|e| e.cidr == Some(cidr)));
            if current && held {
                continue;
            }
            let listed = nnc.is_some_and(|n| lists_releasable(n, &cidr.to_string()));
            let reclaim = match nnc {
                Some(_) if current => listed || gone(&holder.node),
                Some(_) => true,
                None => !world.absent.contains_key(&holder.node) || gone(&holder.node),
            };
            if reclaim {
                ledger.claims.remove(&cidr);
                ledger.cooling.entry(cidr).or_insert(Cooling {
                    node: holder.node.clone(),
                    since_ms: now,
                });
            } else if current && let Some(plan) = plans.get_mut(holder.node.as_str()) {
                let network = pools[i]
                    .spec
                    .as_ref()
                    .map_or(crate::defaults::DEFAULT_NETWORK, |s| &s.network);
                plan.entries.push(Cow::Owned(granted_entry(
                    &pools[i].name,
                    network,
                    &cidr,
                    now,
                )));
                plan.pools.insert(pools[i].name.clone());
            }
        }
    }
    // What every status, claim, cooling and retired block takes.
    let mut taken = Taken::default();
    let mut holders: BTreeMap<Cidr, Vec<&str>> = BTreeMap::new();
    for (name, plan) in &plans {
        for cidr in plan.entries.iter().filter_map(|e| e.cidr) {
            taken.add(&cidr);
            holders.entry(cidr).or_default().push(*name);
        }
    }
    for ledger in &ledgers {
        for cidr in ledger
            .claims
            .keys()
            .chain(ledger.cooling.keys())
            .chain(&ledger.non_reusable)
        {
            taken.add(cidr);
        }
    }
    // Overlaps nobody granted; blocks not yet claimed are adopted.
    let all_entries: Vec<(&str, Cidr)> = holders
        .iter()
        .flat_map(|(c, names)| names.iter().map(move |n| (*n, *c)))
        .collect();
    for (name, plan) in plans.iter_mut() {
        let uid = world
            .nncs
            .get(*name)
            .map(|n| n.meta.uid.clone())
            .unwrap_or_default();
        let mut trouble = None;
        for entry in &plan.entries {
            let Some(cidr) = entry.cidr else {
                continue;
            };
            let clash = conflict(name, &cidr, &all_entries, &ledgers, &uid);
            match clash {
                Some(why) => {
                    trouble.get_or_insert(Trouble::Conflict(why));
                }
                None => {
                    let claimed = ledgers.iter().any(|l| l.claims.contains_key(&cidr));
                    if !claimed
                        && let Some(i) = pools.iter().position(|p| {
                            p.spec.as_ref().is_ok_and(|s| {
                                s.range(cidr.family()).is_some_and(|r| r.is_block(&cidr))
                            })
                        })
                    {
                        ledgers[i].claims.insert(
                            cidr,
                            Holder {
                                node: name.to_string(),
                                uid: uid.clone(),
                            },
                        );
                    }
                }
            }
        }
        if let Some(t) = trouble
            && plan.trouble.is_none()
        {
            plan.trouble = Some(t);
        }
    }
    // Grants, first come first served: nodes refused before (by when
    // their refusal began) ahead of the rest (by name). Cooling blocks are
    // promised in the same order as they come free, so the time a refused
    // node is told is the time its block comes free if nothing else
    // changes, and a block coming free is one write (the grant), not one
    // per refused node.
    let mut waiting: BTreeMap<usize, usize> = BTreeMap::new();
    let mut promised: BTreeSet<Cidr> = BTreeSet::new();
    for (name, nnc) in grant_order(world) {
        if world.absent.contains_key(name) {
            continue;
        }
        let Some(plan) = plans.get_mut(name.as_str()) else {
            continue;
        };
        let mut networks = BTreeSet::new();
        for (network, pods) in &nnc.allocations {
            if !networks.insert(network.as_str()) {
                continue;
            }
            for family in FAMILIES {
                let serving: Vec<usize> = pools
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| {
                        p.spec
                            .as_ref()
                            .is_ok_and(|s| s.network == *network && s.range(family).is_some())
                    })
                    .map(|(i, _)| i)
                    .collect();
                if serving.is_empty() {
                    continue;
                }
                let mut capacity: u128 = plan
                    .entries
                    .iter()
                    .filter(|e| *e.network == **network)
                    .filter_map(|e| e.cidr)
                    .filter(|c| c.family() == family)
                    .map(|c| c.size())
                    .fold(0, u128::saturating_add);
                let want = u128::try_from(*pods).unwrap_or(0);
                while capacity < want {
                    let mut granted = false;
                    let mut at_cap = Vec::new();
                    let mut empty = Vec::new();
                    for &i in &serving {
                        let Ok(spec) = &pools[i].spec else { continue };
                        let Some(range) = spec.range(family) else {
                            continue;
                        };
                        let mine = ledgers[i]
                            .claims
                            .values()
                            .filter(|h| h.node == *name)
                            .count();
                        if mine >= spec.max_blocks_per_node {
                            at_cap.push(i);
                            continue;
                        }
                        let skip = |c: &Cidr| lists_releasable(nnc, &c.to_string());
                        let Some(block) = first_free(range, &mut taken, &skip) else {
                            empty.push(i);
                            continue;
                        };
                        taken.add(&block);
                        ledgers[i].claims.insert(
                            block,
                            Holder {
                                node: name.clone(),
                                uid: nnc.meta.uid.clone(),
                            },
                        );
                        plan.entries.push(Cow::Owned(granted_entry(
                            &pools[i].name,
                            network,
                            &block,
                            now,
                        )));
                        plan.pools.insert(pools[i].name.clone());
                        capacity = capacity.saturating_add(block.size());
                        granted = true;
                        break;
                    }
                    if granted {
                        continue;
                    }
                    for i in &empty {
                        *waiting.entry(*i).or_default() += 1;
                    }
                    let names = |list: &[usize]| {
                        list.iter()
                            .map(|i| pools[*i].name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    };
                    // When the first cooling block promised to this node
                    // comes free: the refusal stands until then (the node
                    // fails fast until then, and waits for the grant after).
                    let free_at = promise(
                        pools,
                        &ledgers,
                        nnc,
                        &empty,
                        family,
                        want.saturating_sub(capacity),
                        &mut promised,
                    );
                    let why = if empty.is_empty() {
                        format!(
                            "network {network:?} {family}: node {name} holds maxBlocksPerNode blocks of pool {}; {capacity} addresses for {want} pods",
                            names(&at_cap)
                        )
                    } else {
                        format!(
                            "network {network:?} {family}: pool {} has no free block; {capacity} addresses for {want} pods",
                            names(&empty)
                        )
                    };
                    if !matches!(
                        plan.trouble,
                        Some(Trouble::Conflict(_)) | Some(Trouble::Gone(_))
                    ) {
                        plan.trouble.get_or_insert(Trouble::Quota(match free_at {
                            Some(at) => format!("{why}; {UNTIL}{}", rfc3339_millis(at)),
                            None => why,
                        }));
                    }
                    break;
                }
            }
        }
    }
    let mut decision = Decision::default();
    // Node statuses, written only on change.
    for (name, plan) in plans {
        let Some(nnc) = world.nncs.get(name) else {
            continue;
        };
        let read = world.statuses.get(name);
        // The status as read, without podCIDRs (compared as text below).
        let old = read.map_or(Value::Null, Status::rest);
        let (condition, event) = ready_condition(&old, plan.trouble.as_ref(), nnc.generation, now);
        let mut status = if old.is_object() {
            old.clone()
        } else {
            json!({})
        };
        status["conditions"] = merge_condition(&old["conditions"], condition);
        let entries: Vec<&Entry> = plan.entries.iter().map(|e| &**e).collect();
        if !read.is_some_and(|r| r.is(&status, &entries)) {
            decision.nnc_writes.push(Write {
                name: name.to_string(),
                resource_version: nnc.meta.resource_version.clone(),
                status: status::assemble(status, &entries).to_string(),
                after_pools: plan.pools.into_iter().collect(),
            });
            if let Some((reason, message)) = event {
                decision.events.push(NodeEvent {
                    node: name.to_string(),
                    reason,
                    message,
                });
            }
        }
    }
    // Pool statuses: on change, or to confirm the claims a node write uses.
    let needed: BTreeSet<&String> = decision
        .nnc_writes
        .iter()
        .flat_map(|w| &w.after_pools)
        .collect();
    for (i, (pool, ledger)) in pools.iter().zip(&ledgers).enumerate() {
        let (status, gauges) =
            pool_status(pool, ledger, waiting.get(&i).copied().unwrap_or(0), now);
        decision.gauges.extend(gauges);
        if status != pool.status_text || needed.contains(&pool.name) {
            decision.pool_writes.push(Write {
                name: pool.name.clone(),
                resource_version: pool.resource_version.clone(),
                status,
                after_pools: Vec::new(),
            });
        }
    }
    decision.next_due_ms = next_due(world, &ledgers);
    decision
}

/// The NodeNetworkConfigs in the order they are granted to: those whose
/// Ready condition says QuotaExceeded first, by when that began (then by
/// name), then the rest by name.
fn grant_order<'a>(world: &World<'a>) -> Vec<(&'a String, &'a Nnc)> {
    let refused_since = |name: &str| world.statuses.get(name)?.refused_since;
    let mut order: Vec<(Option<i64>, &'a String, &'a Nnc)> = world
        .nncs
        .iter()
        .map(|(name, nnc)| (refused_since(name), name, nnc))
        .collect();
    order.sort_by_key(|(since, name, _)| (since.is_none(), *since, *name));
    order
        .into_iter()
        .map(|(_, name, nnc)| (name, nnc))
        .collect()
}

/// Promises a refused node the cooling blocks of its `empty` pools that
/// come free first, not promised to a node before it, until they cover
/// `need` addresses (within each pool's `maxBlocksPerNode`); returns when
/// the first comes free, or `None` when no cooling block is left for it.
fn promise(
    pools: &[Pool],
    ledgers: &[Ledger],
    nnc: &Nnc,
    empty: &[usize],
    family: Family,
    need: u128,
    promised: &mut BTreeSet<Cidr>,
) -> Option<i64> {
    // Never granted to it while it lists the block releasable.
    let skip = |c: &Cidr| lists_releasable(nnc, &c.to_string());
    let mut cooling: Vec<(i64, Cidr, usize)> = Vec::new();
    for &i in empty {
        let Ok(spec) = &pools[i].spec else { continue };
        let Some(range) = spec.range(family) else {
            continue;
        };
        cooling.extend(
            ledgers[i]
                .cooling
                .iter()
                .filter(|(c, _)| range.is_block(c) && !promised.contains(*c) && !skip(c))
                .map(|(c, cool)| (cool.since_ms.saturating_add(spec.reclaim_delay_ms), *c, i)),
        );
    }
    cooling.sort();
    let mut room: BTreeMap<usize, usize> = BTreeMap::new();
    let mut covered: u128 = 0;
    let mut first = None;
    for (at, cidr, i) in cooling {
        if covered >= need {
            break;
        }
        let left = room.entry(i).or_insert_with(|| {
            let cap = pools[i].spec.as_ref().map_or(0, |s| s.max_blocks_per_node);
            let mine = ledgers[i]
                .claims
                .values()
                .filter(|h| h.node == nnc.meta.name)
                .count();
            cap.saturating_sub(mine)
        });
        if *left == 0 {
            continue;
        }
        *left -= 1;
        promised.insert(cidr);
        covered = covered.saturating_add(cidr.size());
        first.get_or_insert(at);
    }
    first
}

/// How long a released block of `pool` cools (the default under a
/// refused spec).
fn reclaim_delay_ms(pool: &Pool) -> i64 {
    pool.spec
        .as_ref()
        .map_or(super::pool::DEFAULT_RECLAIM_DELAY_MS, |s| {
            s.reclaim_delay_ms
        })
}

/// The first time after `world.now_ms` at which a cooling block of
/// `ledgers` comes free, a missing Node's grace ends or the time a refused
/// node was told passes.
fn next_due(world: &World, ledgers: &[Ledger]) -> Option<i64> {
    let cooled = world.pools.iter().zip(ledgers).flat_map(|(pool, ledger)| {
        let delay = reclaim_delay_ms(pool);
        ledger
            .cooling
            .values()
            .map(move |c| c.since_ms.saturating_add(delay))
    });
    let graced = world
        .absent
        .values()
        .map(|since| since.saturating_add(world.node_grace_ms));
    // A refusal told "until" a time is rewritten once it passed (the node
    // stops failing fast then and waits for the next answer).
    let told = world
        .statuses
        .values()
        .filter_map(|status| status.told_until);
    cooled
        .chain(graced)
        .chain(told)
        .filter(|at| *at > world.now_ms)
        .min()
}

/// A QuotaExceeded message without its "comes free at TIME" ending, and
/// that time (`None` when missing or unreadable).
fn split_until(message: &str) -> (&str, Option<i64>) {
    let base = message.rsplit_once(UNTIL).map_or(message, |(base, _)| base);
    match QuotaEnd::of(message) {
        QuotaEnd::At(at) => (base, Some(at)),
        QuotaEnd::Unsaid | QuotaEnd::Unreadable => (base, None),
    }
}

/// Why `cidr` in `name`'s status is an overlap nobody granted, if it is.
fn conflict(
    name: &str,
    cidr: &Cidr,
    entries: &[(&str, Cidr)],
    ledgers: &[Ledger],
    uid: &str,
) -> Option<String> {
    let twice = entries
        .iter()
        .filter(|(n, c)| c.overlaps(cidr) && (*n != name || c != cidr))
        .map(|(n, c)| format!("podCIDR {cidr} overlaps {c} in the status of {n}"))
        .next();
    if twice.is_some() {
        return twice;
    }
    for ledger in ledgers {
        for (other, holder) in &ledger.claims {
            if other.overlaps(cidr) && (holder.node != name || holder.uid != uid) {
                return Some(format!(
                    "podCIDR {cidr} overlaps {other}, granted to {}",
                    holder.node
                ));
            }
        }
        for (other, cooling) in &ledger.cooling {
            if other.overlaps(cidr) {
                return Some(format!(
                    "podCIDR {cidr} overlaps {other}, released by {} and cooling",
                    cooling.node
                ));
            }
        }
        if let Some(other) = ledger.non_reusable.iter().find(|c| c.overlaps(cidr)) {
            return Some(format!(
                "podCIDR {cidr} overlaps {other}, which is NonReusable"
            ));
        }
    }
    None
}

fn granted_entry(pool: &str, network: &str, cidr: &Cidr, now: i64) -> Entry {
    let id: String = format!("{pool}-{cidr}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    Entry::parse(&json!({
        "id": id,
        "network": network,
        "cidr": cidr.to_string(),
        "condition": {
            "type": "Ready",
            "status": "True",
            "reason": "PodCIDRReady",
            "message": format!("granted from MetisPool {pool}"),
            "lastTransitionTime": rfc3339_seconds(now).to_string(),
        },
    }))
}

/// The node's Ready condition, and the Event its change calls for.
fn ready_condition(
    old: &Value,
    trouble: Option<&Trouble>,
    generation: i64,
    now: i64,
) -> (Value, Option<(&'static str, String)>) {
    let (status, reason, message) = match trouble {
        None => (
            "True",
            READY,
            "the granted blocks cover the demand".to_string(),
        ),
        Some(Trouble::Quota(why)) => ("False", QUOTA_EXCEEDED, why.clone()),
        Some(Trouble::Conflict(why)) => ("False", INVALID, why.clone()),
        Some(Trouble::Gone(why)) => ("False", INVALID, why.clone()),
    };
    let previous = old["conditions"]
        .as_array()
        .and_then(|l| l.iter().find(|c| c["type"] == "Ready"));
    let same = previous.is_some_and(|p| p["status"] == status && p["reason"] == reason);
    // A refusal whose substance stands keeps the time it told until that
    // time has passed, wherever the promise moved meanwhile: an earlier
    // block is a grant (a write anyway), a later one or none is told once
    // the old time passes. Only a refusal told no time learns a new one at
    // once (the node would fail fast past it).
    let message = match previous.and_then(|p| p["message"].as_str()) {
        Some(told) if same && reason == QUOTA_EXCEEDED => {
            let (base, told_until) = split_until(told);
            let (new_base, _) = split_until(&message);
            if base == new_base && told_until.is_some_and(|t| t > now) {
                told.to_string()
            } else {
                message
            }
        }
        _ => message,
    };
    let since = match previous {
        Some(p) if same => p["lastTransitionTime"].clone(),
        _ => Value::from(rfc3339_seconds(now).to_string()),
    };
    let event = match trouble {
        Some(Trouble::Quota(why)) if !same => Some((QUOTA_EVENT, why.clone())),
        Some(Trouble::Conflict(why))
            if !same || previous.is_some_and(|p| p["message"] != why.as_str()) =>
        {
            Some((CONFLICT_EVENT, why.clone()))
        }
        _ => None,
    };
    let condition = json!({
        "type": "Ready",
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        // Which spec this answers: a node fails fast on QuotaExceeded only
        // when it answers the demand it has now.
        "observedGeneration": generation,
    });
    (condition, event)
}

/// `conditions` with the one of `condition`'s type replaced (others kept).
fn merge_condition(conditions: &Value, condition: Value) -> Value {
    let mut list: Vec<Value> = conditions
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["type"] != condition["type"])
        .cloned()
        .collect();
    list.push(condition);
    list.sort_by(|a, b| a["type"].as_str().cmp(&b["type"].as_str()));
    Value::Array(list)
}

fn count(n: u128) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// A pool's status as compact JSON text, keys sorted as `Value`'s text
/// sorts them (so that an unchanged status reads equal to the one the
/// pool holds, [`Pool::status_text`]): the ledger's long lists written
/// straight as text ([`Ledger::status_texts`]), the rest — counts and
/// conditions, a few dozen values — as a tree.
fn pool_status(pool: &Pool, ledger: &Ledger, waiting: usize, now: i64) -> (String, Vec<Gauge>) {
    let (small, gauges) = pool_status_rest(pool, ledger, waiting, now);
    let mut fields: BTreeMap<&str, String> = ledger.status_texts().into_iter().collect();
    if let Value::Object(small) = &small {
        for (key, value) in small {
            fields.insert(key, value.to_string());
        }
    }
    let mut text = String::with_capacity(fields.values().map(|v| v.len() + 24).sum());
    text.push('{');
    for (i, (key, value)) in fields.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        super::pool::json_string(&mut text, key);
        text.push(':');
        text.push_str(value);
    }
    text.push('}');
    (text, gauges)
}

/// A pool's status but the ledger's lists: its generation, counts per
/// family and conditions.
fn pool_status_rest(pool: &Pool, ledger: &Ledger, waiting: usize, now: i64) -> (Value, Vec<Gauge>) {
    let mut status = json!({"observedGeneration": pool.generation});
    let mut gauges = Vec::new();
    let (valid, valid_reason, valid_message) = match &pool.spec {
        Ok(spec) => {
            for range in &spec.ranges {
                let inside = |c: &&Cidr| range.is_block(c);
                let granted = ledger.claims.keys().filter(inside).count() as u128;
                let cooling = ledger.cooling.keys().filter(inside).count() as u128;
                let retired = ledger.non_reusable.iter().filter(inside).count() as u128;
                let free = range
                    .blocks_total()
                    .saturating_sub(granted + cooling + retired);
                status[range.family.as_str()] = json!({
                    "blocksTotal": count(range.blocks_total()),
                    "blocksFree": count(free),
                    "blocksGranted": count(granted),
                    "blocksCooling": count(cooling),
                });
                gauges.push(Gauge {
                    pool: pool.name.clone(),
                    family: range.family,
                    free: count(free),
                    granted: count(granted),
                    cooling: count(cooling),
                });
            }
            ("True", "Valid", describe(spec))
        }
        Err(why) => ("False", "InvalidSpec", why.clone()),
    };
    let (exhausted, exhausted_reason, exhausted_message) = if waiting > 0 {
        (
            "True",
            "NoFreeBlock",
            format!("{waiting} node(s) wait for a block"),
        )
    } else {
        (
            "False",
            "BlocksAvailable",
            "no node waits for a block".to_string(),
        )
    };
    let mut conditions = Value::Array(Vec::new());
    for (kind, state, reason, message) in [
        ("Exhausted", exhausted, exhausted_reason, exhausted_message),
        ("Valid", valid, valid_reason, valid_message),
    ] {
        let previous = pool
            .conditions
            .as_array()
            .and_then(|l| l.iter().find(|c| c["type"] == kind));
        let since = match previous {
            Some(p) if p["status"] == state => p["lastTransitionTime"].clone(),
            _ => Value::from(rfc3339_seconds(now).to_string()),
        };
        conditions = merge_condition(
            &conditions,
            json!({"type": kind, "status": state, "reason": reason, "message": message, "lastTransitionTime": since}),
        );
    }
    status["conditions"] = conditions;
    (status, gauges)
}

fn describe(spec: &PoolSpec) -> String {
    let ranges: Vec<String> = spec
        .ranges
        .iter()
        .map(|r| {
            let cidrs: Vec<String> = r.cidrs.iter().map(Cidr::to_string).collect();
            format!(
                "{} /{} blocks from {}",
                r.family,
                r.block_prefix,
                cidrs.join(" ")
            )
        })
        .collect();
    format!("network {:?}: {}", spec.network, ranges.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The status is written as text, not built as a tree; it must be the
    /// very text the tree would give (keys sorted, compact, serde_json's
    /// escaping), or every pass would see a change and write the pool.
    #[test]
    fn a_pool_status_written_as_text_reads_back_as_the_same_text_and_ledger() {
        let odd = "n\"o\\d\u{e9}\u{1}e\n";
        let mut object = json!({
            "metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z",
                         "resourceVersion": "7", "generation": 3},
            "spec": {"network": "default",
                     "ipv4": {"cidrs": ["198.18.0.0/24"], "blockPrefixLength": 28},
                     "ipv6": {"cidrs": ["2001:db8::/120"], "blockPrefixLength": 124}},
            "status": {
                "claims": [
                    {"node": "a", "uid": "u-a", "cidrs": ["198.18.0.0/28", "198.18.0.16/28"]},
                    {"node": odd, "uid": "u-\"odd\"", "cidrs": ["2001:db8::10/124"]},
                ],
                "cooling": [{"cidr": "198.18.0.32/28", "node": "b",
                             "since": "2026-11-29T17:01:24.123Z"}],
                "nonReusable": ["198.18.0.48/28"],
            },
        });
        let pool = Pool::parse(&object);
        assert_eq!(pool.ledger.claims.len(), 3, "{:?}", pool.ledger);
        let now = 1_795_971_700_000;
        let (text, gauges) = pool_status(&pool, &pool.ledger, 2, now);
        let tree: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(tree.to_string(), text);
        object["status"] = tree.clone();
        let again = Pool::parse(&object);
        assert_eq!(again.status_text, text);
        assert_eq!(again.ledger, pool.ledger);
        assert_eq!(tree["ipv4"]["blocksGranted"], 2);
        assert_eq!(tree["ipv4"]["blocksFree"], 16 - 4);
        assert_eq!(tree["ipv6"]["blocksGranted"], 1);
        assert_eq!(tree["observedGeneration"], 3);
        assert_eq!(gauges.len(), 2);
        let exhausted = tree["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Exhausted")
            .unwrap();
        assert_eq!(exhausted["message"], "2 node(s) wait for a block");
        // Unchanged, the next pass writes the same text.
        assert_eq!(pool_status(&again, &again.ledger, 2, now + 1_000).0, text);
    }
}
