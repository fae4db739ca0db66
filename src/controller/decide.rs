//! The controller's decision, pure: every pool (spec, and its ledger as
//! the `MetisBlock` objects say), every NodeNetworkConfig (spec, status,
//! resourceVersion), which Nodes are gone since when, and the time → the
//! block writes, then the status writes that rely on them, and the Events.
//! No I/O: `writer` applies the result and a model test
//! (`tests/controller_model.rs`) drives it with random sequences.
//!
//! The rules (docs/controller.md, "How blocks move"):
//! - a block is granted (added to a node's `status.podCIDRs`) only through
//!   its `MetisBlock` object naming that node, written first (a POST that
//!   only one claimer wins, or a PUT carrying the object's
//!   resourceVersion) — before any status that adds or removes it;
//! - a block is free only when no status holds or overlaps it and no
//!   block object exists for it — the union over everything read;
//! - blocks follow the Node (by name): a block the node lists in
//!   `releasableCIDRs` leaves its status and cools for the pool's
//!   `reclaimDelay` (on this process's monotonic clock); a `NonReusable`
//!   one never comes back; the blocks of a Node gone longer than
//!   `--node-grace` go the same way; a deleted or re-created
//!   NodeNetworkConfig changes nothing, and what a node says it still
//!   serves stays its own;
//! - blocks are added until capacity covers `spec.allocations[].pods` per
//!   network and family, at most `maxBlocksPerNode` per pool and family;
//!   when no pool can, the NodeNetworkConfig says `QuotaExceeded…`;
//! - overlaps nobody granted (a hand-edited status, one block in two
//!   statuses) are reported, never granted further, never silently fixed.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use super::block::{self, BlockSpec, BlockState, GRANTED, NODE_GONE, RELEASED};
use super::demand::Demand;
use super::pool::{
    BlockCounts, Cooling, FamilyRange, Held, Pool, PoolCondition, PoolSpec, PoolStatus, Slot,
    Working,
};
use super::short_text::ShortText;
use super::small_set::SmallSet;
use super::status::{self, Entry, Names, ReadyRead, Status, StatusIndex, merge_condition};
use super::taken::{Applied, TakenIndex, span};
use crate::cidr::{Cidr, Family, from_u128};
use crate::kube::nnc::QuotaEnd;
use crate::kube::objects::Condition;
use crate::log::{rfc3339_millis, rfc3339_seconds};

pub use super::status::READY;
pub use crate::kube::nnc::QUOTA_EXCEEDED;
pub const INVALID: &str = "InvalidParametersToUpdateNetworkInterfacePodCIDRs";
pub use crate::kube::nnc::QUOTA_UNTIL as UNTIL;
/// Event reasons on the Node.
pub const QUOTA_EVENT: &str = "PodCIDRQuotaExceeded";
pub const CONFLICT_EVENT: &str = "PodCIDRConflict";
const FAMILIES: [Family; 2] = [Family::V4, Family::V6];

/// Everything one decision reads.
#[derive(Clone, Copy)]
pub struct World<'a> {
    /// Validated (`pool::validate`): a refused spec grants nothing and
    /// takes nothing back, but its ledger still counts.
    pub pools: &'a [Pool],
    pub nncs: &'a BTreeMap<ShortText, Box<Demand>>,
    /// The status of each NodeNetworkConfig as read (kept whole).
    pub statuses: &'a BTreeMap<ShortText, Box<Status>>,
    /// What the statuses say by block and by node (`StatusIndex::of`).
    pub index: &'a StatusIndex,
    /// Node names (of NodeNetworkConfigs and blocks) whose Node is
    /// missing, and since when this process saw it missing.
    pub absent: &'a BTreeMap<String, i64>,
    /// The deciding process's monotonic clock (ms): every delay is judged
    /// on it (cooling, grace), so no wall clock can shorten one.
    pub now_ms: i64,
    /// The wall clock (Unix ms) at `now_ms`: only for times written
    /// (informational, and the refusal's end time the node reads).
    pub wall_ms: i64,
    pub node_grace_ms: i64,
    /// The nodes this pass decides (with those whose Node is missing);
    /// the rest are as the last pass left them: settled, their statuses
    /// only read (taken blocks, overlaps). `None`: every node.
    pub scope: Option<&'a BTreeSet<ShortText>>,
    /// How many nodes' status writes the pass keeps.
    pub bound: Bound<'a>,
}

/// How many nodes' status writes one pass keeps: at most `nodes` that are
/// `ready` (a paused one costs its pass nothing: the writer skips it),
/// taken in name order from just after `after` (round robin: no node waits
/// behind busier ones), with the block writes they rely on. The other
/// nodes' writes, blocks and Events wait for the next pass, which decides
/// those nodes again; their texts are dropped as they are made, so what
/// one pass holds, writes and queues stays bounded whatever the cluster's
/// size.
#[derive(Clone, Copy)]
pub struct Bound<'b> {
    pub nodes: usize,
    pub after: Option<&'b str>,
    pub ready: &'b dyn Fn(&str) -> bool,
}

impl Bound<'_> {
    /// Every node's writes kept.
    pub const NONE: Bound<'static> = Bound {
        nodes: usize::MAX,
        after: None,
        ready: &every_node_ready,
    };
}

fn every_node_ready(_: &str) -> bool {
    true
}

/// One write of a `MetisBlock` object (named by its CIDR).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockWrite {
    pub name: String,
    pub cidr: Cidr,
    pub op: BlockOp,
}

#[derive(Debug, Clone, PartialEq)]
pub enum BlockOp {
    /// POST: a claim (409 AlreadyExists: someone else holds it).
    Create(BlockSpec),
    /// PUT carrying the resourceVersion read (also unchanged, to confirm
    /// the block is still as read before a status relies on it).
    Update(String, BlockSpec),
    /// PUT without the protection finalizer, carrying the resourceVersion
    /// read (the spec as read): cooled, and in no status. An object marked
    /// for deletion goes with it; another is deleted by a later pass.
    LetGo(String, BlockSpec),
    /// DELETE with that resourceVersion as precondition: an unprotected
    /// object whose block is free: free again.
    Delete(String),
}

/// A status write: PUT `.../NAME/status` carrying `resource_version`.
#[derive(Debug, Clone, PartialEq)]
pub struct Write {
    pub name: String,
    pub resource_version: String,
    /// The status, compact JSON text (thousands of writes in one pass cost
    /// their text, not their trees).
    pub status: String,
    /// Blocks whose object's write must have succeeded first (this write
    /// adds or removes them).
    pub after_blocks: Vec<String>,
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
    pub block_writes: Vec<BlockWrite>,
    /// The pools' counts and conditions (no write relies on them).
    pub pool_writes: Vec<Write>,
    pub nnc_writes: Vec<Write>,
    /// Posted once the NodeNetworkConfig's write succeeded.
    pub events: Vec<NodeEvent>,
    pub gauges: Vec<Gauge>,
    /// When (ms) time alone changes the next decision: the first cooling
    /// block comes free or the first missing Node's grace ends. The loop
    /// sleeps until then unless an event comes first.
    pub next_due_ms: Option<i64>,
    /// Blocks released again while still cooling (their status write was
    /// lost): their delay starts over now (block name, monotonic ms).
    pub cooling_restarts: Vec<(String, i64)>,
    /// The nodes decided that this pass did not leave settled (a status
    /// written, a trouble said, a block still wanted, a refusal's time
    /// running): the next pass decides them again, changed or not.
    pub unsettled: BTreeSet<ShortText>,
    /// The last node whose write was kept, when the [`Bound`] left others'
    /// for the next pass (which starts after it).
    pub bounded_after: Option<String>,
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
    name: &'a ShortText,
    nnc: &'a Demand,
    /// The status as read (none yet: a new object).
    read: Option<&'a Status>,
    entries: Vec<Cow<'a, Entry>>,
    /// Blocks whose object must be written before this status (one,
    /// almost always).
    blocks: SmallSet<Cidr>,
    trouble: Option<Trouble>,
}

/// Who holds each status entry in this pass: the statuses as read, but
/// for the nodes it decides, whose statuses are their plans.
struct Holders<'a> {
    read: &'a BTreeMap<Cidr, Names>,
    decided: BTreeSet<&'a str>,
    planned: BTreeMap<Cidr, Vec<&'a str>>,
}

impl<'a> Holders<'a> {
    /// The nodes whose status holds `cidr`, in name order.
    fn of(&self, cidr: &Cidr) -> Vec<&'a str> {
        let read = self.read.get(cidr).into_iter().flatten();
        let mut names: Vec<&'a str> = read.filter(|n| !self.decided.contains(n)).collect();
        names.extend(self.planned.get(cidr).into_iter().flatten());
        names.sort_unstable();
        names
    }

    /// Whether a status holds `cidr`.
    fn held(&self, cidr: &Cidr) -> bool {
        self.planned.contains_key(cidr)
            || self
                .read
                .get(cidr)
                .is_some_and(|names| names.iter().any(|n| !self.decided.contains(n)))
    }
}

/// The first block of `range` that nothing takes and `skip` allows.
fn first_free(
    range: &FamilyRange,
    taken: &TakenIndex,
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
/// claims or cools it, else the one its object names (it cooled out this
/// pass, its object not yet deleted), else a valid one covering it, else
/// (a block nobody granted, maybe from a pool refused for now) any pool,
/// so that a block released is timed somewhere and can never come back
/// early.
fn pool_of(pools: &[Pool], ledgers: &[Working], cidr: &Cidr) -> Option<usize> {
    ledgers
        .iter()
        .position(|l| l.claim(cidr).is_some() || l.cooling(cidr).is_some())
        .or_else(|| {
            pools
                .iter()
                .position(|p| p.ledger.versions.contains_key(cidr))
        })
        .or_else(|| {
            pools.iter().position(|p| {
                p.spec
                    .as_ref()
                    .is_ok_and(|s| s.range(cidr.family()).is_some_and(|r| r.covers(cidr)))
            })
        })
        .or_else(|| (!pools.is_empty()).then_some(0))
}

/// One pass being decided: the ledgers as they become and each node's
/// status as it becomes.
struct Pass<'a> {
    world: World<'a>,
    /// The pools' ledgers as this pass changes them: only the blocks it
    /// changed (and those a status relies on) can need a block write.
    ledgers: Vec<Working<'a>>,
    plans: BTreeMap<&'a str, Plan<'a>>,
    restarts: Vec<(String, i64)>,
    /// Nodes that wanted a block in this pass.
    wanted: BTreeSet<&'a str>,
    /// A node outside the scope is in a conflict this pass found: only a
    /// pass over every node decides it as it would alone.
    widen: bool,
}

/// Decides one pass. A pass over a scope decides what a pass over every
/// node would (debug builds check it), or is one when a conflict reaches
/// a node outside it. `taken` is what the world's statuses and ledgers
/// take (`TakenIndex::of`); the pass leaves it as it found it.
pub fn decide(world: &World, taken: &mut TakenIndex) -> Decision {
    let every_node = World {
        scope: None,
        ..*world
    };
    // A pass over every node never widens.
    let whole = |taken: &mut TakenIndex| decide_in(&every_node, taken).unwrap_or_default();
    if world.scope.is_none() {
        return whole(taken);
    }
    let Some(decision) = decide_in(world, taken) else {
        return whole(taken);
    };
    #[cfg(debug_assertions)]
    {
        let whole = whole(taken);
        let writes = |d: &Decision| {
            let of = (&d.block_writes, &d.pool_writes, &d.nnc_writes, &d.events);
            (
                format!("{of:?}"),
                d.gauges.clone(),
                d.next_due_ms,
                d.cooling_restarts.clone(),
            )
        };
        debug_assert_eq!(
            writes(&decision),
            writes(&whole),
            "a pass over {:?} decided otherwise than one over every node",
            world.scope
        );
    }
    decision
}

/// One pass over `world`'s scope; none when a conflict reaches outside it.
fn decide_in(world: &World, taken: &mut TakenIndex) -> Option<Decision> {
    let mut pass = Pass {
        world: *world,
        ledgers: world
            .pools
            .iter()
            .map(|p| Working::new(&p.ledger))
            .collect(),
        plans: BTreeMap::new(),
        restarts: Vec::new(),
        wanted: BTreeSet::new(),
        widen: false,
    };
    pass.cool_down();
    pass.release();
    pass.reassert(taken);
    pass.finish_claims(taken);
    // What this pass sees taken, applied to the index until `view` drops.
    let mut view = Applied::new(taken);
    let holders = pass.apply_view(&mut view);
    pass.check_overlaps(&holders, view.index());
    if pass.widen || pass.reaches_outside(view.index()) {
        return None;
    }
    let waiting = pass.grant_all(&mut view);
    Some(pass.into_decision(&holders, &waiting))
}

impl<'a> Pass<'a> {
    /// Whether a block this pass changed (in a ledger, or in the status of
    /// a node it decides) is one a node outside the scope says it serves,
    /// or overlaps one in such a node's status: what that node is told of
    /// it (a conflict and with whom, a cooling) may change.
    fn reaches_outside(&self, taken: &TakenIndex) -> bool {
        let world = self.world;
        if world.scope.is_none() {
            return false;
        }
        let outside = |nodes: Option<&Names>| {
            let mut nodes = nodes.into_iter().flatten();
            nodes.any(|n| !self.plans.contains_key(n))
        };
        let serving_outside = |cidr: &Cidr| {
            let nodes = world.index.serving_overlapping(cidr);
            nodes.iter().any(|n| !self.plans.contains_key(n.as_str()))
        };
        let mut changed: BTreeSet<Cidr> = self
            .ledgers
            .iter()
            .flat_map(Working::changed)
            .copied()
            .collect();
        for plan in self.plans.values() {
            let read = plan.read.map_or(&[][..], |s| &s.entries[..]);
            let before: BTreeSet<Cidr> = read.iter().filter_map(|e| e.cidr).collect();
            let after: BTreeSet<Cidr> = plan.entries.iter().filter_map(|e| e.cidr).collect();
            changed.extend(before.symmetric_difference(&after));
        }
        changed.iter().any(|cidr| {
            serving_outside(cidr)
                || taken
                    .overlapping(cidr)
                    .iter()
                    .any(|held| outside(world.index.held.get(held)))
        })
    }

    /// Whether Node `name` is gone past the grace.
    fn gone(&self, name: &str) -> bool {
        gone_past_grace(&self.world, name)
    }

    /// Blocks taken from a Node that is back go back to it (unless another
    /// machine says it serves one: then it is that machine's conflict, not
    /// a second server); blocks cooled long enough leave the ledger (free
    /// once no status holds them).
    fn cool_down(&mut self) {
        let world = self.world;
        for (pool, ledger) in world.pools.iter().zip(&mut self.ledgers) {
            // A gone Node's block stays until its NNC (if any) says so:
            // that write is what refuses a stale controller's old grant.
            let untold = |node: &str| {
                world.nncs.contains_key(node)
                    && !world.statuses.get(node).is_some_and(|s| s.gone_told)
            };
            let delay = pool.reclaim_delay_ms();
            let mut back = Vec::new();
            let mut cooled = Vec::new();
            for (cidr, c) in ledger.coolings() {
                let returned = c.node_gone && !world.absent.contains_key(c.node.as_str());
                if returned && !served_by_another(&world, cidr, &c.node) {
                    back.push((*cidr, c.node.clone()));
                } else if world.now_ms >= cooled_at(&world, c, delay)
                    && !(c.node_gone && untold(&c.node))
                {
                    cooled.push(*cidr);
                }
            }
            for (cidr, node) in back {
                ledger.set_claim(cidr, &node);
            }
            for cidr in cooled {
                ledger.set(cidr, None);
            }
        }
    }

    /// Releases: the blocks a node lists in `releasableCIDRs`, and all
    /// blocks of a Node gone past the grace, leave its status and cool.
    fn release(&mut self) {
        let world = self.world;
        // The plans are made in name order and the map built from them in
        // one go (its nodes full, as inserting one by one leaves them not).
        let mut plans = Vec::new();
        if let Some(scope) = world.scope {
            // Nodes whose Node is missing are always decided: their grace
            // runs out with time alone.
            let absent = world.absent.keys().map(String::as_str);
            let names: BTreeSet<&str> = scope.iter().map(ShortText::as_str).chain(absent).collect();
            plans.reserve(names.len());
            for name in names {
                if let Some((name, nnc)) = world.nncs.get_key_value(name) {
                    let plan = self.release_of(name, nnc, world.statuses.get(name).map(|s| &**s));
                    plans.push((name.as_str(), plan));
                }
            }
        } else {
            // Both maps are by name: walked side by side, without a lookup
            // per node.
            let mut statuses = world.statuses.iter().peekable();
            plans.reserve(world.nncs.len());
            for (name, nnc) in world.nncs {
                while statuses.next_if(|(n, _)| *n < name).is_some() {}
                let read = statuses.next_if(|(n, _)| *n == name).map(|(_, s)| &**s);
                plans.push((name.as_str(), self.release_of(name, nnc, read)));
            }
        }
        self.plans = plans.into_iter().collect();
    }

    /// Node `name`'s plan: its status as `read`, without what it releases.
    fn release_of(
        &mut self,
        name: &'a ShortText,
        nnc: &'a Demand,
        read: Option<&'a Status>,
    ) -> Plan<'a> {
        let gone = self.gone(name);
        let mut plan = Plan {
            name,
            nnc,
            read,
            entries: Vec::new(),
            blocks: SmallSet::default(),
            trouble: gone.then(|| Trouble::Gone(format!("Node {name} {}", status::GONE_TOLD))),
        };
        let raw_entries = read.map_or(&[][..], |s| &s.entries[..]);
        plan.entries.reserve(raw_entries.len());
        for raw in raw_entries {
            let released = gone
                || raw
                    .cidr_text()
                    .is_some_and(|cidr| nnc.lists_releasable(&cidr));
            match (released, raw.cidr) {
                (true, Some(cidr)) => {
                    if self.release_block(name, cidr, raw.reusable, gone) {
                        plan.blocks.insert(cidr);
                    }
                }
                _ => plan.entries.push(Cow::Borrowed(raw)),
            }
        }
        plan
    }

    /// Moves `cidr`, released by (or taken from) `node`, to cooling (or
    /// retires it); false when it is another node's block, granted or
    /// cooling (a copy of it leaves this status only: a cooling one's
    /// delay starts over, for its own node) or no pool accounts for it.
    fn release_block(&mut self, node: &str, cidr: Cidr, reusable: bool, gone: bool) -> bool {
        let now = self.world.now_ms;
        // Cooling for another node as read counts too: one this pass found
        // cooled out is still held (its owner's status keeps it while its
        // writes fail), and stays that node's.
        let cooling_elsewhere = self.ledgers.iter_mut().find_map(|l| {
            let cooled_out = (!l.holds(&cidr)).then(|| l.read.cooling.get(&cidr));
            let cooling = l.cooling(&cidr).or(cooled_out.flatten());
            let cooling = cooling.filter(|c| c.node != node)?.clone();
            Some((l, cooling))
        });
        if let Some((ledger, cooling)) = cooling_elsewhere {
            // Pods of this node may have used the copy: no other node gets
            // the block sooner than the delay after it left this status
            // either, and this node never takes it over.
            let restarted = Cooling {
                since_ms: now,
                ..cooling
            };
            ledger.set(cidr, Some(Slot::Cooling(restarted)));
            self.restarts.push((block::block_name(&cidr), now));
            return false;
        }
        let foreign = self
            .ledgers
            .iter()
            .any(|l| l.claim(&cidr).is_some_and(|h| h.node != node));
        let Some(i) = pool_of(self.world.pools, &self.ledgers, &cidr).filter(|_| !foreign) else {
            return false;
        };
        let ledger = &mut self.ledgers[i];
        if ledger.retired(&cidr) {
            // Retired for good, whatever a copy of it says.
            ledger.set(cidr, Some(Slot::Retired));
        } else if reusable {
            // Still in a status: the delay counts from now, when it leaves
            // it (again, after a lost write), also when it had cooled out.
            if ledger.read.cooling.contains_key(&cidr) {
                self.restarts.push((block::block_name(&cidr), now));
            }
            let cooling = Cooling {
                node: node.into(),
                since_ms: now,
                node_gone: gone,
            };
            ledger.set(cidr, Some(Slot::Cooling(cooling)));
        } else {
            ledger.set(cidr, Some(Slot::Retired));
        }
        true
    }

    /// What nodes say they still serve (their `serving` annotation), and
    /// have not released, is theirs: a block granted to the node stays
    /// (`finish_claims` puts it back into its status), one cooling for it
    /// is granted to it again, one without object is claimed for it
    /// (within `maxBlocksPerNode`); one another node holds is a conflict,
    /// said on the node, never dropped silently. Nodes absent now say
    /// nothing (their daemon is gone).
    fn reassert(&mut self, taken: &TakenIndex) {
        let world = self.world;
        let serving: Vec<(&'a ShortText, &'a Demand, &'a Status)> = self
            .plans
            .values()
            .filter_map(|p| Some((p.name, p.nnc, p.read?)))
            .filter(|(name, _, s)| !s.serving.is_empty() && !self.gone(name))
            .collect();
        for (name, nnc, status) in serving {
            for cidr in &status.serving {
                if nnc.lists_releasable_block(cidr) || self.claimed_by(cidr, name) {
                    continue;
                }
                // The first status (by node name) holding it, if not its own.
                let first = world.index.held.get(cidr).and_then(|names| names.first());
                let elsewhere = first.filter(|n| *n != name.as_str());
                if let Err(why) = self.keep_serving(name, cidr, elsewhere, taken)
                    && let Some(plan) = self.plans.get_mut(name.as_str())
                    && !matches!(plan.trouble, Some(Trouble::Gone(_)))
                {
                    plan.trouble.get_or_insert(Trouble::Conflict(why));
                }
            }
        }
    }

    /// Whether `cidr` is granted to node `name` now (then keeping it
    /// serving changes nothing).
    fn claimed_by(&self, cidr: &Cidr, name: &str) -> bool {
        self.ledgers
            .iter()
            .find_map(|l| l.claim(cidr))
            .is_some_and(|h| h.node == name)
    }

    /// Keeps `cidr`, which node `name` serves, the node's; why not when
    /// another holds it (`elsewhere`: another node's status holding it) or
    /// something else in `taken` overlaps it (a block of another size or
    /// pool, granted, cooling or retired).
    fn keep_serving(
        &mut self,
        name: &str,
        cidr: &Cidr,
        elsewhere: Option<&str>,
        taken: &TakenIndex,
    ) -> Result<(), String> {
        let pools = self.world.pools;
        let known = self
            .ledgers
            .iter()
            .position(|l| l.claim(cidr).is_some() || l.cooling(cidr).is_some() || l.retired(cidr));
        let served = format!("podCIDR {cidr}, which node {name} still serves,");
        let Some(i) = known else {
            if let Some(other) = elsewhere {
                return Err(format!("{served} is in the status of {other}"));
            }
            if let Some(other) = taken.overlapping(cidr).into_iter().find(|o| o != cidr) {
                return Err(format!("{served} overlaps {other}"));
            }
            // No object: claimed again for the node, within its quota.
            let owner = (0..pools.len()).find(|&j| {
                pools[j].spec.as_ref().is_ok_and(|s| {
                    s.range(cidr.family()).is_some_and(|r| r.is_block(cidr))
                        && held_in(&self.ledgers[j], name, cidr.family()) < s.max_blocks_per_node
                })
            });
            if let Some(i) = owner {
                self.ledgers[i].set_claim(*cidr, name);
            }
            return Ok(());
        };
        let ledger = &mut self.ledgers[i];
        if let Some(holder) = ledger.claim(cidr) {
            return match holder.node == name {
                true => Ok(()),
                false => Err(format!("{served} is granted to {}", holder.node)),
            };
        }
        match ledger.cooling(cidr) {
            Some(cooling) if cooling.node == name => {
                ledger.set_claim(*cidr, name);
                Ok(())
            }
            Some(cooling) => Err(format!(
                "{served} was released by {} and cools",
                cooling.node
            )),
            None => Err(format!("{served} is NonReusable")),
        }
    }

    /// Claims whose status entry is missing: finish the grant (the leader
    /// stopped between the two writes, or the node's NodeNetworkConfig was
    /// re-created), or take the block back when the node released it or
    /// its Node is gone past the grace. A missing NodeNetworkConfig takes
    /// nothing: blocks follow the Node. A claim that overlaps a block of
    /// another size in a status enters no status ([`overlap_in_a_status`]):
    /// it cools out, unless its node says it serves it (then it stays, and
    /// the node is told of the conflict).
    fn finish_claims(&mut self, taken: &TakenIndex) {
        let world = self.world;
        // Claims put into a status by this pass: two blocks of different
        // sizes (a stale create across a size change, both given back to
        // a returning Node) never enter together either.
        let mut entered = TakenIndex::default();
        for i in 0..self.ledgers.len() {
            let missing: Vec<(Cidr, String)> = self
                .claims_decided(i)
                .into_iter()
                .filter(|(cidr, node)| {
                    let plan = self.plans.get(node.as_str());
                    !plan.is_some_and(|p| p.entries.iter().any(|e| e.cidr == Some(*cidr)))
                })
                .collect();
            for (cidr, node) in missing {
                let nnc = world.nncs.get(node.as_str());
                let gone = self.gone(&node);
                let listed = nnc.is_some_and(|n| n.lists_releasable_block(&cidr));
                let overlap = match listed || gone {
                    true => None,
                    false => overlap_in_a_status(&cidr, world.index, taken)
                        .or_else(|| entered.overlapping(&cidr).first().copied())
                        .or_else(|| self.overlap_of_another(&cidr, &node, taken)),
                };
                if let Some(other) = overlap
                    && world
                        .index
                        .serving
                        .get(&cidr)
                        .is_some_and(|n| n.contains(&node))
                {
                    // Kept granted, never put beside the other: said.
                    let why = format!(
                        "podCIDR {cidr}, which node {node} still serves, overlaps {other} in a status"
                    );
                    if let Some(plan) = self.plans.get_mut(node.as_str()) {
                        plan.trouble.get_or_insert(Trouble::Conflict(why));
                    }
                    continue;
                }
                if !(listed || gone)
                    && let Some(why) = held_elsewhere(&world, &cidr, &node)
                {
                    // An older copy of an object or status (an etcd
                    // restore): the block enters no second status, and
                    // the machine serving it keeps it alone.
                    if let Some(plan) = self.plans.get_mut(node.as_str()) {
                        plan.trouble.get_or_insert(Trouble::Conflict(why));
                    }
                    continue;
                }
                if listed || gone || overlap.is_some() {
                    let cooling = Cooling {
                        node: node.into(),
                        since_ms: world.now_ms,
                        node_gone: gone,
                    };
                    self.ledgers[i].set(cidr, Some(Slot::Cooling(cooling)));
                } else if let Some(plan) = self.plans.get_mut(node.as_str()) {
                    let pool = &world.pools[i];
                    let network = pool
                        .spec
                        .as_ref()
                        .map_or(crate::defaults::DEFAULT_NETWORK, |s| &s.network);
                    let entry = Entry::granted(&pool.name, network, &cidr, world.wall_ms);
                    plan.entries.push(Cow::Owned(entry));
                    plan.blocks.insert(cidr);
                    entered.add(cidr);
                }
            }
        }
    }

    /// A block of another size overlapping `cidr` that a ledger grants to
    /// another node than `node`, or cools for one: `cidr`'s claim is then
    /// an older copy of its object (an etcd restore) beside a block made
    /// since.
    fn overlap_of_another(&self, cidr: &Cidr, node: &str, taken: &TakenIndex) -> Option<Cidr> {
        let another = |o: &Cidr| {
            self.ledgers.iter().any(|l| {
                l.claim(o).is_some_and(|h| h.node != node)
                    || l.cooling(o).is_some_and(|c| c.node != node)
            })
        };
        taken
            .overlapping(cidr)
            .into_iter()
            .find(|o| o != cidr && another(o))
    }

    /// The claims of ledger `i` whose node this pass decides, in block
    /// order: every claim, or those of the nodes in the scope and of the
    /// nodes whose Node is missing (read from their own claims). A node
    /// outside the scope is settled: its status holds its claims (a
    /// change to either would have put it in the scope).
    fn claims_decided(&self, i: usize) -> Vec<(Cidr, String)> {
        let ledger = &self.ledgers[i];
        let mut claims: Vec<(Cidr, String)> = match self.world.scope {
            None => ledger
                .claims()
                .map(|(c, h)| (*c, h.node.to_string()))
                .collect(),
            Some(_) => {
                let absent = self.world.absent.keys().map(String::as_str);
                let nodes: BTreeSet<&str> = self.plans.keys().copied().chain(absent).collect();
                nodes
                    .into_iter()
                    .flat_map(|n| ledger.claims_of(n).into_iter().map(|c| (c, n.to_string())))
                    .collect()
            }
        };
        claims.sort_unstable();
        claims
    }

    /// Applies to `view` what this pass changed of what is taken: the
    /// statuses of the nodes it decides are their plans, and the ledgers
    /// as it left them. Returns who holds each status entry now.
    fn apply_view(&self, view: &mut Applied) -> Holders<'a> {
        let mut planned: BTreeMap<Cidr, Vec<&'a str>> = BTreeMap::new();
        for (name, plan) in &self.plans {
            for cidr in plan.entries.iter().filter_map(|e| e.cidr) {
                planned.entry(cidr).or_default().push(name);
                view.add(cidr);
            }
        }
        for ledger in &self.ledgers {
            for cidr in ledger.changed() {
                if ledger.holds(cidr) {
                    view.add(*cidr);
                }
            }
        }
        // Taken back only once added again: no interval is split for a
        // block that stays.
        for plan in self.plans.values() {
            let read = plan.read.map_or(&[][..], |s| &s.entries[..]);
            for cidr in read.iter().filter_map(|e| e.cidr) {
                view.remove(cidr);
            }
        }
        for ledger in &self.ledgers {
            for cidr in ledger.changed().filter(|c| ledger.read.held(c).is_some()) {
                view.remove(*cidr);
            }
        }
        Holders {
            read: &self.world.index.held,
            decided: self.plans.keys().copied().collect(),
            planned,
        }
    }

    /// Overlaps nobody granted are reported; blocks in a status but not
    /// claimed (a pool grown over them) are adopted.
    fn check_overlaps(&mut self, holders: &Holders<'a>, taken: &TakenIndex) {
        let pools = self.world.pools;
        let mut adopted: Vec<(usize, Cidr, &str)> = Vec::new();
        let scoped = self.world.scope.is_some();
        let mut troubles: Vec<(&'a str, Trouble)> = Vec::new();
        for (name, plan) in self.plans.iter() {
            let mut trouble = None;
            for cidr in plan.entries.iter().filter_map(|e| e.cidr) {
                let takers = takers(&cidr, holders, taken, &self.ledgers);
                if let Some(why) = conflict(name, &cidr, &takers) {
                    trouble.get_or_insert(Trouble::Conflict(why));
                    // The other status's node has this conflict too.
                    self.widen |= scoped
                        && takers.iter().any(|(_, taker)| {
                            matches!(taker, Taker::Status(n) if !holders.decided.contains(n))
                        });
                    continue;
                }
                if self.ledgers.iter().any(|l| l.claim(&cidr).is_some()) {
                    continue;
                }
                let adopter = pools.iter().position(|p| {
                    p.spec
                        .as_ref()
                        .is_ok_and(|s| s.range(cidr.family()).is_some_and(|r| r.is_block(&cidr)))
                });
                if let Some(i) = adopter {
                    adopted.push((i, cidr, name));
                }
            }
            if let Some(trouble) = trouble {
                troubles.push((name, trouble));
            }
        }
        for (name, trouble) in troubles {
            if let Some(plan) = self.plans.get_mut(name) {
                plan.trouble.get_or_insert(trouble);
            }
        }
        for (i, cidr, name) in adopted {
            if let Some(plan) = self.plans.get_mut(name) {
                plan.blocks.insert(cidr);
            }
            self.ledgers[i].set_claim(cidr, name);
        }
    }

    /// Grants, first come first served: nodes refused before (by when
    /// their refusal began) ahead of the rest (by name). Cooling blocks
    /// are promised in the same order as they come free, so the time a
    /// refused node is told is the time its block comes free if nothing
    /// else changes, and a block coming free is one write (the grant), not
    /// one per refused node. Returns how many nodes wait on each pool.
    fn grant_all(&mut self, taken: &mut Applied) -> BTreeMap<usize, usize> {
        let mut waiting: BTreeMap<usize, usize> = BTreeMap::new();
        let mut promised: BTreeSet<Cidr> = BTreeSet::new();
        let world = self.world;
        // The networks and families some valid pool serves.
        let served: Vec<(&str, Family)> = world
            .pools
            .iter()
            .filter_map(|p| p.spec.as_ref().ok())
            .flat_map(|s| s.ranges.iter().map(|r| (s.network.as_str(), r.family)))
            .collect();
        // Only a node's own grants change what it holds: who still needs
        // a block is told once, before any grant.
        let wants =
            |p: &Plan| !world.absent.contains_key(p.name.as_str()) && !covered(p, p.nnc, &served);
        for (name, nnc) in grant_order(&self.plans, wants) {
            self.wanted.insert(name.as_str());
            let mut networks = BTreeSet::new();
            for allocation in nnc.allocations.iter() {
                let (network, pods) = (allocation.network(), allocation.pods);
                if !networks.insert(network) {
                    continue;
                }
                for family in FAMILIES {
                    let ask = Ask {
                        name,
                        nnc,
                        network,
                        family,
                        pods: u128::try_from(pods).unwrap_or(0),
                    };
                    let mut state = GrantState {
                        taken: &mut *taken,
                        waiting: &mut waiting,
                        promised: &mut promised,
                    };
                    self.grant(&ask, &mut state);
                }
            }
        }
        waiting
    }

    /// Adds blocks of `ask`'s network and family to its node until they
    /// cover its pods; says why when no pool can.
    fn grant(&mut self, ask: &Ask<'a>, state: &mut GrantState) {
        let Some(plan) = self.plans.get(ask.name.as_str()) else {
            return;
        };
        let mut capacity: u128 = plan
            .entries
            .iter()
            .filter(|e| e.network() == ask.network)
            .filter_map(|e| e.cidr)
            .filter(|c| c.family() == ask.family)
            .map(|c| c.size())
            .fold(0, u128::saturating_add);
        if capacity >= ask.pods {
            return;
        }
        let pools = self.world.pools;
        let serving: Vec<usize> = pools
            .iter()
            .enumerate()
            .filter(|(_, p)| {
                p.spec
                    .as_ref()
                    .is_ok_and(|s| s.network == *ask.network && s.range(ask.family).is_some())
            })
            .map(|(i, _)| i)
            .collect();
        if serving.is_empty() {
            return;
        }
        while capacity < ask.pods {
            match self.grant_one(ask, &serving, state.taken) {
                Ok(size) => capacity = capacity.saturating_add(size),
                Err((at_cap, empty)) => {
                    self.refuse(ask, capacity, (&at_cap, &empty), state);
                    return;
                }
            }
        }
    }

    /// Grants one block from the first of `serving` that has room and a
    /// free block; else the pools at the node's cap and those empty.
    fn grant_one(
        &mut self,
        ask: &Ask<'a>,
        serving: &[usize],
        taken: &mut Applied,
    ) -> Result<u128, (Vec<usize>, Vec<usize>)> {
        let pools = self.world.pools;
        let mut at_cap = Vec::new();
        let mut empty = Vec::new();
        for &i in serving {
            let Ok(spec) = &pools[i].spec else { continue };
            let Some(range) = spec.range(ask.family) else {
                continue;
            };
            if held_in(&self.ledgers[i], ask.name, ask.family) >= spec.max_blocks_per_node {
                at_cap.push(i);
                continue;
            }
            // Never one the node lists releasable, nor one another machine
            // says it still serves (its own block beyond its quota, say).
            let skip = |c: &Cidr| {
                ask.nnc.lists_releasable_block(c) || served_by_another(&self.world, c, ask.name)
            };
            let Some(block) = first_free(range, taken.index(), &skip) else {
                empty.push(i);
                continue;
            };
            taken.add(block);
            self.ledgers[i].set_claim(block, ask.name);
            let entry = Entry::granted(&pools[i].name, ask.network, &block, self.world.wall_ms);
            if let Some(plan) = self.plans.get_mut(ask.name.as_str()) {
                // Most plans gain one entry: room for that one only.
                plan.entries.reserve_exact(1);
                plan.entries.push(Cow::Owned(entry));
                plan.blocks.insert(block);
            }
            return Ok(block.size());
        }
        Err((at_cap, empty))
    }

    /// Notes why `ask` cannot be covered (QuotaExceeded), and when the
    /// first cooling block promised to it comes free: the refusal stands
    /// until then (the node fails fast until then, and waits for the
    /// grant after).
    fn refuse(
        &mut self,
        ask: &Ask<'a>,
        capacity: u128,
        (at_cap, empty): (&[usize], &[usize]),
        state: &mut GrantState,
    ) {
        let pools = self.world.pools;
        for i in empty {
            *state.waiting.entry(*i).or_default() += 1;
        }
        let names = |list: &[usize]| {
            list.iter()
                .map(|i| pools[*i].name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        // A node in conflict or gone is told that, not a refusal: it is
        // promised no cooling block another refused node could have.
        let told_otherwise =
            |p: &Plan| matches!(p.trouble, Some(Trouble::Conflict(_) | Trouble::Gone(_)));
        if self.plans.get(ask.name.as_str()).is_none_or(told_otherwise) {
            return;
        }
        let free_at = Promise {
            world: &self.world,
            ledgers: &self.ledgers,
            empty,
            need: ask.pods.saturating_sub(capacity),
        }
        .first_free_at(ask, state.promised);
        let (network, family, name, want) = (ask.network, ask.family, ask.name, ask.pods);
        let why = if empty.is_empty() {
            format!(
                "network {network:?} {family}: node {name} holds maxBlocksPerNode {family} blocks of pool {}; {capacity} addresses for {want} pods",
                names(at_cap)
            )
        } else {
            format!(
                "network {network:?} {family}: pool {} has no free block; {capacity} addresses for {want} pods",
                names(empty)
            )
        };
        let Some(plan) = self.plans.get_mut(name.as_str()) else {
            return;
        };
        // The told end time is the wall clock's now plus what remains on
        // the monotonic one (the node reads a wall-clock time).
        let world = &self.world;
        plan.trouble.get_or_insert(Trouble::Quota(match free_at {
            Some(at) => {
                let wall = world
                    .wall_ms
                    .saturating_add(at.saturating_sub(world.now_ms));
                format!("{why}; {UNTIL}{}", rfc3339_millis(wall))
            }
            None => why,
        }));
    }

    /// The writes: node statuses (on change), the block objects they rely
    /// on (and those that changed), and the pools' counts.
    fn into_decision(self, holders: &Holders, waiting: &BTreeMap<usize, usize>) -> Decision {
        let world = self.world;
        let mut decision = Decision {
            cooling_restarts: self.restarts,
            ..Decision::default()
        };
        let wanted = self.wanted;
        let (needed, deferred) = status_writes(&world, self.plans, &wanted, &mut decision);
        for (i, (pool, ledger)) in world.pools.iter().zip(&self.ledgers).enumerate() {
            let relied = (&needed, &deferred);
            let writes = block_writes(pool, ledger, relied, holders, world.pools);
            decision.block_writes.extend(writes);
            let waiting = waiting.get(&i).copied().unwrap_or(0);
            let (status, gauges) = pool_status(pool, ledger, waiting, world.wall_ms);
            decision.gauges.extend(gauges);
            if status != pool.status_text {
                decision.pool_writes.push(Write {
                    name: pool.name.clone(),
                    resource_version: pool.resource_version.clone(),
                    status,
                    after_blocks: Vec::new(),
                });
            }
        }
        one_write_per_object(&mut decision.block_writes);
        decision.next_due_ms = next_due(&world, &self.ledgers);
        // An object let go is deleted by the next pass, which nothing
        // else may bring soon.
        let let_go = |w: &BlockWrite| matches!(w.op, BlockOp::LetGo(..));
        if decision.block_writes.iter().any(let_go) {
            let soon = world.now_ms.saturating_add(1);
            decision.next_due_ms = Some(decision.next_due_ms.map_or(soon, |at| at.min(soon)));
        }
        decision
    }
}

/// The status writes of `plans` into `decision`, as many as its bound
/// keeps (in the bound's order, the paused ones last), their Events, and
/// the nodes left unsettled; and the blocks the kept writes rely on, and
/// those only the writes left for the next pass rely on (whose block
/// writes wait with them).
fn status_writes(
    world: &World,
    plans: BTreeMap<&str, Plan>,
    wanted: &BTreeSet<&str>,
    decision: &mut Decision,
) -> (BTreeSet<Cidr>, BTreeSet<Cidr>) {
    let bound = world.bound;
    let (mut needed, mut deferred) = (BTreeSet::new(), BTreeSet::new());
    let (mut kept, mut paused) = (Vec::new(), Vec::new());
    let mut left = false;
    for plan in in_bound_order(plans, bound.after) {
        let name = plan.name;
        let waits = plan.trouble.is_some()
            || wanted.contains(name.as_str())
            || plan
                .read
                .is_some_and(|s| s.told_until.is_some() || s.refused_since.is_some());
        let mut events = Vec::new();
        let write = status_write(world, plan, &mut events);
        if waits || write.is_some() {
            decision.unsettled.insert(name.clone());
        }
        let Some((write, blocks)) = write else {
            continue;
        };
        let ready = (bound.ready)(name);
        if ready && kept.len() >= bound.nodes {
            deferred.extend(&blocks);
            left = true;
            continue;
        }
        needed.extend(&blocks);
        decision.events.extend(events);
        match ready {
            true => kept.push(write),
            false => paused.push(write),
        }
    }
    if left {
        decision.bounded_after = kept.last().map(|w| w.name.clone());
    }
    decision.nnc_writes = kept;
    decision.nnc_writes.extend(paused);
    (needed, deferred)
}

/// `plans` in name order from just after `after` (round robin), taken
/// apart without a second collection of them.
fn in_bound_order<'a>(
    mut plans: BTreeMap<&'a str, Plan<'a>>,
    after: Option<&str>,
) -> impl Iterator<Item = Plan<'a>> {
    let (later, at) = match after {
        Some(after) => {
            let mut later = plans.split_off(after);
            let at = later.remove(after);
            (later, at)
        }
        None => (BTreeMap::new(), None),
    };
    let wrapped = plans.into_values().chain(at);
    later.into_values().chain(wrapped)
}

/// Whether `plan`'s entries already cover every network and family
/// `nnc` asks for that a pool serves (`served`), so that granting adds
/// nothing: told from one walk of the entries, as most nodes are in any
/// pass.
fn covered(plan: &Plan, nnc: &Demand, served: &[(&str, Family)]) -> bool {
    match &*nnc.allocations {
        [] => true,
        [allocation] => {
            let network = allocation.network();
            let want = u128::try_from(allocation.pods).unwrap_or(0);
            let mut have = [0u128; 2];
            for entry in plan.entries.iter().filter(|e| e.network() == network) {
                if let Some(cidr) = entry.cidr {
                    let at = usize::from(cidr.family() == Family::V6);
                    have[at] = have[at].saturating_add(cidr.size());
                }
            }
            FAMILIES
                .iter()
                .zip(have)
                .all(|(family, have)| have >= want || !served.contains(&(network, *family)))
        }
        // Several networks: `grant` tells each.
        _ => false,
    }
}

/// What one node asks of one network and family.
struct Ask<'a> {
    name: &'a ShortText,
    nnc: &'a Demand,
    network: &'a str,
    family: Family,
    pods: u128,
}

/// What the grants of one pass share.
struct GrantState<'s, 't> {
    taken: &'s mut Applied<'t>,
    waiting: &'s mut BTreeMap<usize, usize>,
    promised: &'s mut BTreeSet<Cidr>,
}

/// Blocks of `family` in `ledger` granted to `node`: `maxBlocksPerNode`
/// counts each family on its own.
fn held_in(ledger: &Working, node: &str, family: Family) -> usize {
    let held = ledger.claims_of(node);
    held.iter().filter(|c| c.family() == family).count()
}

/// `name`'s status write, if its status changes, and the blocks it relies
/// on; its Event goes to `events`.
fn status_write(
    world: &World,
    plan: Plan,
    events: &mut Vec<NodeEvent>,
) -> Option<(Write, SmallSet<Cidr>)> {
    let (name, nnc, read) = (plan.name, plan.nnc, plan.read);
    let stands = read.is_some_and(|r| unchanged(r, &plan, nnc.generation, world.wall_ms));
    if stands && !cfg!(debug_assertions) {
        return None;
    }
    // The status as read, without podCIDRs (compared as text below).
    let old = read.map_or(Value::Null, Status::rest);
    let conditions = status::conditions(&old);
    let (condition, event) = ready_condition(
        &conditions,
        plan.trouble.as_ref(),
        nnc.generation,
        world.wall_ms,
    );
    let mut status = if old.is_object() { old } else { json!({}) };
    let merged = merge_condition(conditions, condition);
    status["conditions"] = serde_json::to_value(merged).unwrap_or_default();
    let entries: Vec<&Entry> = plan.entries.iter().map(|e| &**e).collect();
    if read.is_some_and(|r| r.is(&status, &entries)) {
        return None;
    }
    debug_assert!(
        !stands,
        "{name}: the status stands, yet its rebuild differs"
    );
    if let Some((reason, message)) = event {
        events.push(NodeEvent {
            node: name.to_string(),
            reason,
            message,
        });
    }
    let write = Write {
        name: name.to_string(),
        resource_version: nnc.resource_version.to_string(),
        status: status::assemble(status, &entries).to_string(),
        after_blocks: plan
            .blocks
            .as_slice()
            .iter()
            .map(block::block_name)
            .collect(),
    };
    Some((write, plan.blocks))
}

/// Whether `plan` leaves the status `read` as it is, told without
/// rebuilding it: the same entries, and a Ready condition that stands.
fn unchanged(read: &Status, plan: &Plan, generation: i64, now: i64) -> bool {
    read.listed
        && read.entries.len() == plan.entries.len()
        && read
            .entries
            .iter()
            .zip(&plan.entries)
            .all(|(a, b)| match b {
                // Kept from this very status: itself (most entries).
                Cow::Borrowed(b) => std::ptr::eq(a, *b) || a == *b,
                Cow::Owned(b) => a == b,
            })
        && read
            .ready()
            .is_some_and(|r| ready_stands(&r, plan.trouble.as_ref(), generation, now))
}

/// A block's state, node and reason, as its object says them.
type BlockStateOf<'h> = (BlockState, &'h str, &'static str);

/// What a block object says for a ledger state.
fn block_state(held: Option<Held<'_>>) -> Option<BlockStateOf<'_>> {
    Some(match held? {
        Held::Retired => (BlockState::NonReusable, "", RELEASED),
        Held::Claim(holder) => (BlockState::Granted, &holder.node, GRANTED),
        Held::Cooling(cooling) if cooling.node_gone => {
            (BlockState::Cooling, &cooling.node, NODE_GONE)
        }
        Held::Cooling(cooling) => (BlockState::Cooling, &cooling.node, RELEASED),
    })
}

/// `pool`'s object spec for `cidr` in `state`, for `node`, for `reason`.
fn block_spec(pool: &Pool, cidr: &Cidr, (state, node, reason): BlockStateOf) -> BlockSpec {
    BlockSpec {
        pool: pool.name.as_str().into(),
        network: pool.spec.as_ref().map_or("", |s| s.network.as_str()).into(),
        cidr: cidr.to_string().into(),
        node: node.into(),
        state,
        reason: reason.into(),
    }
}

/// The writes that make `pool`'s block objects say `ledger`: the blocks
/// whose state changed, and those a status write relies on (`needed`: an
/// unchanged one is PUT as read, to confirm it still is). A block that
/// left the ledger (cooled) is deleted only when no status holds it. A
/// block whose object another of `pools` knows (its pool refused now, a
/// status adopting it here) is PUT over that object, never created again.
/// A block only writes left for the next pass rely on (`deferred`) waits
/// with them.
fn block_writes(
    pool: &Pool,
    ledger: &Working,
    (needed, deferred): (&BTreeSet<Cidr>, &BTreeSet<Cidr>),
    holders: &Holders,
    pools: &[Pool],
) -> Vec<BlockWrite> {
    // A block this pass did not change is as read: written only when a
    // status relies on it.
    let behind = &pool.ledger.behind;
    let cidrs: BTreeSet<&Cidr> = ledger.changed().chain(needed).chain(behind).collect();
    let waits = |cidr: &Cidr| deferred.contains(cidr) && !needed.contains(cidr);
    let mut writes = Vec::new();
    for cidr in cidrs.into_iter().filter(|c| !waits(c)) {
        let before = block_state(ledger.read.held(cidr));
        let after = block_state(ledger.held(cidr));
        let version = pool.ledger.versions.get(cidr);
        let confirm = needed.contains(cidr) || behind.contains(cidr);
        // A copy kept over an object gone (a NonReusable block's, after an
        // etcd restore) is written back too: created again.
        if before == after && !(confirm && version.is_some()) && !behind.contains(cidr) {
            continue;
        }
        let spec = after.map(|after| block_spec(pool, cidr, after));
        let elsewhere = || pools.iter().find_map(|p| p.ledger.versions.get(cidr));
        let op = match (version, spec) {
            (None, Some(spec)) => match elsewhere() {
                Some(version) => BlockOp::Update(version.to_string(), spec),
                None => BlockOp::Create(spec),
            },
            (Some(version), Some(spec)) => BlockOp::Update(version.to_string(), spec),
            (Some(version), None) if !holders.held(cidr) => {
                match before.filter(|_| !pool.ledger.unprotected.contains(cidr)) {
                    Some(read) => BlockOp::LetGo(version.to_string(), block_spec(pool, cidr, read)),
                    None => BlockOp::Delete(version.to_string()),
                }
            }
            _ => continue,
        };
        writes.push(BlockWrite {
            name: block::block_name(cidr),
            cidr: *cidr,
            op,
        });
    }
    writes
}

/// Whether node `name`'s Node has been missing for `--node-grace` or longer.
fn gone_past_grace(world: &World, name: &str) -> bool {
    (world.absent.get(name))
        .is_some_and(|since| world.now_ms >= grace_ends(*since, world.node_grace_ms))
}

/// When a Node missing since `missing_since` is gone past the grace
/// (monotonic ms): the one reading of `--node-grace`, for the passes and
/// for what the cache keeps.
pub fn grace_ends(missing_since: i64, grace_ms: i64) -> i64 {
    missing_since.saturating_add(grace_ms)
}

/// When a block cooling since `since` comes free: `delay` after that, and
/// not before its node's Node, if missing (since `missing_since`), is gone
/// past the grace. A node whose Node is missing may still serve what it
/// released or lost track of (a block whose object an etcd restore took
/// away): until the grace ends, nothing of its comes free.
pub fn frees_at(since: i64, delay: i64, missing_since: Option<i64>, grace_ms: i64) -> i64 {
    let freed = since.saturating_add(delay);
    missing_since.map_or(freed, |missing| freed.max(grace_ends(missing, grace_ms)))
}

/// Why `cidr`, granted to `node` and missing from its status, stays out
/// of it for now: another node's status holds it, or another machine
/// says it serves it.
fn held_elsewhere(world: &World, cidr: &Cidr, node: &str) -> Option<String> {
    let status = (world.index.held.get(cidr)).and_then(|names| names.iter().find(|n| *n != node));
    let granted = format!("podCIDR {cidr}, granted to {node},");
    match status {
        Some(other) => Some(format!(
            "{granted} is in the status of {other}; it enters once it leaves there"
        )),
        None => served_by_another(world, cidr, node).then(|| {
            format!("{granted} is served by another machine; it enters once that one lets it go")
        }),
    }
}

/// Whether a machine other than `node`'s (its Node not gone past the
/// grace) says it still serves `cidr`: such a block goes to no other node,
/// not even back to a returning one (an etcd restore brought back an older
/// copy of its object).
fn served_by_another(world: &World, cidr: &Cidr, node: &str) -> bool {
    (world.index.serving.get(cidr))
        .is_some_and(|names| (names.iter()).any(|o| o != node && !gone_past_grace(world, o)))
}

/// A block one pool lets go (it cooled out) and another grants in the same
/// pass is one object: only the grant, a PUT over the object, is written.
/// Else the let-go lands, the PUT finds the object gone, and a status
/// relying on the block's name would take it in without an object.
fn one_write_per_object(writes: &mut Vec<BlockWrite>) {
    let ends = |w: &BlockWrite| matches!(w.op, BlockOp::LetGo(..) | BlockOp::Delete(_));
    if !writes.iter().any(ends) {
        return;
    }
    let kept: BTreeSet<String> = (writes.iter())
        .filter(|w| !ends(w))
        .map(|w| w.name.clone())
        .collect();
    writes.retain(|w| !(ends(w) && kept.contains(&w.name)));
}

/// The NodeNetworkConfigs of `plans` that `wants`, in the order they are
/// granted to: those whose Ready condition says QuotaExceeded first, by
/// when that began (then by name), then the rest by name.
fn grant_order<'a>(
    plans: &BTreeMap<&'a str, Plan<'a>>,
    wants: impl Fn(&Plan) -> bool,
) -> Vec<(&'a ShortText, &'a Demand)> {
    // The map is in name order already: only the refused few are sorted.
    let mut refused: Vec<(i64, &'a ShortText, &'a Demand)> = Vec::new();
    let mut rest: Vec<(&'a ShortText, &'a Demand)> = Vec::new();
    for plan in plans.values().filter(|p| wants(p)) {
        match plan.read.and_then(|s| s.refused_since) {
            Some(since) => refused.push((since, plan.name, plan.nnc)),
            None => rest.push((plan.name, plan.nnc)),
        }
    }
    refused.sort_by_key(|(since, name, _)| (*since, *name));
    let first = refused.into_iter().map(|(_, name, nnc)| (name, nnc));
    first.chain(rest).collect()
}

/// What a refused node can be promised: the cooling blocks of its `empty`
/// pools (indexes into the world's pools and `ledgers`), to cover `need`
/// addresses.
struct Promise<'p> {
    world: &'p World<'p>,
    ledgers: &'p [Working<'p>],
    empty: &'p [usize],
    need: u128,
}

impl Promise<'_> {
    /// Promises `ask`'s node the cooling blocks that come free first, not
    /// promised to a node before it, until they cover `need` addresses
    /// (within each pool's `maxBlocksPerNode`); returns when the first
    /// comes free, or `None` when no cooling block is left for it.
    fn first_free_at(&self, ask: &Ask, promised: &mut BTreeSet<Cidr>) -> Option<i64> {
        let Promise {
            world,
            ledgers,
            empty,
            need,
        } = *self;
        let pools = world.pools;
        let family = ask.family;
        // Never granted to it while it lists the block releasable.
        let skip = |c: &Cidr| ask.nnc.lists_releasable_block(c);
        let mut cooling: Vec<(i64, Cidr, usize)> = Vec::new();
        for &i in empty {
            let Ok(spec) = &pools[i].spec else { continue };
            let Some(range) = spec.range(family) else {
                continue;
            };
            cooling.extend(
                ledgers[i]
                    .coolings()
                    .filter(|(c, _)| range.is_block(c) && !promised.contains(*c) && !skip(c))
                    .map(|(c, cool)| (cooled_at(world, cool, spec.reclaim_delay_ms), *c, i)),
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
                cap.saturating_sub(held_in(&ledgers[i], ask.name, family))
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
}

/// When `cooling` comes free ([`frees_at`]).
fn cooled_at(world: &World, cooling: &Cooling, delay: i64) -> i64 {
    let missing_since = world.absent.get(cooling.node.as_str()).copied();
    frees_at(cooling.since_ms, delay, missing_since, world.node_grace_ms)
}

/// The first time after `world.now_ms` at which a cooling block of
/// `ledgers` comes free, a missing Node's grace ends or the time a refused
/// node was told passes.
fn next_due(world: &World, ledgers: &[Working]) -> Option<i64> {
    let cooled = world.pools.iter().zip(ledgers).flat_map(|(pool, ledger)| {
        let delay = pool.reclaim_delay_ms();
        ledger
            .coolings()
            .map(move |(_, c)| cooled_at(world, c, delay))
    });
    let graced = world
        .absent
        .values()
        .map(|since| grace_ends(*since, world.node_grace_ms));
    // A refusal told "until" a time is rewritten once it passed (the node
    // stops failing fast then and waits for the next answer).
    let told = world.index.told.values().map(|wall| {
        wall.saturating_sub(world.wall_ms)
            .saturating_add(world.now_ms)
    });
    cooled
        .chain(graced)
        .chain(told)
        .filter(|at| *at > world.now_ms)
        .min()
}

/// A QuotaExceeded message without its "comes free at TIME" ending, and
/// that time (`None` when missing or unreadable).
fn split_until(message: &str) -> (&str, Option<i64>) {
    // The ending's "; " goes with it: a promise that moved leaves the
    // same text as one never made.
    let base = message
        .rsplit_once(UNTIL)
        .map_or(message, |(base, _)| base.strip_suffix("; ").unwrap_or(base));
    match QuotaEnd::of(message) {
        QuotaEnd::At(at) => (base, Some(at)),
        QuotaEnd::Unsaid | QuotaEnd::Unreadable => (base, None),
    }
}

#[derive(Clone, Copy)]
enum Taker<'i> {
    Status(&'i str),
    Claim(&'i str),
    Cooling(&'i str),
    Retired,
}

/// What takes a block overlapping `cidr` (`taken`: everything taken in
/// this pass), each block's takers together: blocks by first and last
/// address, a block's statuses (by name) before the ledgers' states.
fn takers<'i>(
    cidr: &Cidr,
    holders: &Holders<'i>,
    taken: &TakenIndex,
    ledgers: &'i [Working<'i>],
) -> Vec<(Cidr, Taker<'i>)> {
    let mut others = taken.overlapping(cidr);
    others.sort_unstable_by_key(span);
    let mut found = Vec::new();
    for other in others {
        let statuses = holders.of(&other).into_iter().map(Taker::Status);
        found.extend(statuses.map(|t| (other, t)));
        for ledger in ledgers {
            if let Some(holder) = ledger.claim(&other) {
                found.push((other, Taker::Claim(&holder.node)));
            }
            if let Some(cooling) = ledger.cooling(&other) {
                found.push((other, Taker::Cooling(&cooling.node)));
            }
            if ledger.retired(&other) {
                found.push((other, Taker::Retired));
            }
        }
    }
    found
}

/// Why `cidr` in `name`'s status is an overlap nobody granted, if it is
/// (`takers`: what overlaps it): another status holds an overlapping
/// block, or another node's claim, a cooling or a retired block overlaps
/// it.
fn conflict(name: &str, cidr: &Cidr, takers: &[(Cidr, Taker)]) -> Option<String> {
    let mut found: Option<(u8, String)> = None;
    for (other, taker) in takers {
        let (rank, why) = match taker {
            Taker::Status(n) if *n != name || other != cidr => (
                0,
                format!("podCIDR {cidr} overlaps {other} in the status of {n}"),
            ),
            Taker::Claim(node) if *node != name => (
                1,
                format!("podCIDR {cidr} overlaps {other}, granted to {node}"),
            ),
            Taker::Cooling(node) => (
                2,
                format!("podCIDR {cidr} overlaps {other}, released by {node} and cooling"),
            ),
            Taker::Retired => (
                3,
                format!("podCIDR {cidr} overlaps {other}, which is NonReusable"),
            ),
            _ => continue,
        };
        if found.as_ref().is_none_or(|(r, _)| rank < *r) {
            found = Some((rank, why));
        }
    }
    found.map(|(_, why)| why)
}

/// A block of another size that `cidr`, a claim missing from its node's
/// status, overlaps, and that a status holds or a machine says it serves:
/// the claim was decided before a block-size change (a stale controller's
/// create, which the API server could not refuse: the names differ), or
/// an etcd restore brought back an old one over a block made since.
fn overlap_in_a_status(cidr: &Cidr, index: &StatusIndex, taken: &TakenIndex) -> Option<Cidr> {
    let held = |o: &Cidr| index.held.get(o).is_some_and(|names| !names.is_empty());
    let served = |o: &Cidr| index.serving.get(o).is_some_and(|names| !names.is_empty());
    taken
        .overlapping(cidr)
        .into_iter()
        .find(|o| o != cidr && (held(o) || served(o)))
}

/// What a node's Ready condition says of `trouble`: (status, reason,
/// message).
fn ready_says(trouble: Option<&Trouble>) -> (&'static str, &'static str, String) {
    let (status, reason, message) = ready_text(trouble);
    (status, reason, message.to_string())
}

/// [`ready_says`], its message borrowed (a pass asks it of every node).
fn ready_text(trouble: Option<&Trouble>) -> (&'static str, &'static str, &str) {
    match trouble {
        None => ("True", READY, status::COVERED),
        Some(Trouble::Quota(why)) => ("False", QUOTA_EXCEEDED, why),
        Some(Trouble::Conflict(why)) => ("False", INVALID, why),
        Some(Trouble::Gone(why)) => ("False", INVALID, why),
    }
}

/// The message to write: a refusal whose substance stands keeps the time
/// it `told` until that time has passed, wherever the promise moved
/// meanwhile: an earlier block is a grant (a write anyway), a later one or
/// none is told once the old time passes. Only a refusal told no time
/// learns a new one at once (the node would fail fast past it).
fn kept_message(told: Option<&str>, same: bool, reason: &str, message: String, now: i64) -> String {
    match told {
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
    }
}

/// Whether the Ready condition read (`ready`) already says what `trouble`
/// makes it say for `generation`: then, with the same entries, the status
/// write would change nothing (checked against the full rebuild in
/// debug builds, which every test runs).
fn ready_stands(ready: &ReadyRead, trouble: Option<&Trouble>, generation: i64, now: i64) -> bool {
    let (status, reason, message) = ready_text(trouble);
    if !(*ready.status == *status
        && *ready.reason == *reason
        && ready.observed_generation == generation)
    {
        return false;
    }
    // As `kept_message` would keep it, without building the text: the
    // message itself, or a told time that still stands.
    *ready.message == *message
        || (reason == QUOTA_EXCEEDED && {
            let (base, told_until) = split_until(&ready.message);
            base == split_until(message).0 && told_until.is_some_and(|t| t > now)
        })
}

/// The node's Ready condition (replacing the one among `conditions`),
/// and the Event its change calls for.
fn ready_condition(
    conditions: &[Condition],
    trouble: Option<&Trouble>,
    generation: i64,
    now: i64,
) -> (Condition, Option<(&'static str, String)>) {
    let (status, reason, message) = ready_says(trouble);
    let previous = conditions
        .iter()
        .find(|c| c.kind.as_deref() == Some("Ready"));
    let same = previous.is_some_and(|p| {
        p.status.as_deref() == Some(status) && p.reason.as_deref() == Some(reason)
    });
    let told = previous.and_then(|p| p.message.as_deref());
    let message = kept_message(told, same, reason, message, now);
    // To the millisecond: refused nodes are served in this order, and
    // whole seconds would make most of a burst a tie (then by name).
    let since = previous
        .filter(|_| same)
        .and_then(|p| p.last_transition_time.clone())
        .unwrap_or_else(|| rfc3339_millis(now).to_string());
    let event = match trouble {
        Some(Trouble::Quota(why)) if !same => Some((QUOTA_EVENT, why.clone())),
        Some(Trouble::Conflict(why))
            if !same || previous.is_some_and(|p| p.message.as_deref() != Some(why)) =>
        {
            Some((CONFLICT_EVENT, why.clone()))
        }
        _ => None,
    };
    let condition = Condition {
        kind: Some("Ready".to_string()),
        status: Some(status.to_string()),
        reason: Some(reason.to_string()),
        message: Some(message),
        last_transition_time: Some(since),
        // Which spec this answers: a node fails fast on QuotaExceeded only
        // when it answers the demand it has now.
        observed_generation: Some(generation),
        rest: serde_json::Map::new(),
    };
    (condition, event)
}

fn count(n: u128) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// A pool's status as compact JSON text (keys sorted, so that an
/// unchanged status reads equal to the one the pool holds): its
/// generation, counts per family and conditions — nothing that grows with
/// nodes or blocks.
fn pool_status(pool: &Pool, ledger: &Working, waiting: usize, now: i64) -> (String, Vec<Gauge>) {
    let mut status = PoolStatus {
        conditions: Vec::new(),
        ipv4: None,
        ipv6: None,
        observed_generation: pool.generation,
    };
    let mut gauges = Vec::new();
    let valid = match &pool.spec {
        Ok(spec) => {
            for range in &spec.ranges {
                let counts = block_counts(range, ledger);
                gauges.push(Gauge {
                    pool: pool.name.clone(),
                    family: range.family,
                    free: counts.free,
                    granted: counts.granted,
                    cooling: counts.cooling,
                });
                match range.family {
                    Family::V4 => status.ipv4 = Some(counts),
                    Family::V6 => status.ipv6 = Some(counts),
                }
            }
            ("True", "Valid", describe(spec))
        }
        Err(why) => ("False", "InvalidSpec", why.clone()),
    };
    let exhausted = match waiting {
        0 => (
            "False",
            "BlocksAvailable",
            "no node waits for a block".to_string(),
        ),
        _ => (
            "True",
            "NoFreeBlock",
            format!("{waiting} node(s) wait for a block"),
        ),
    };
    for (kind, (state, reason, message)) in [("Exhausted", exhausted), ("Valid", valid)] {
        let previous = pool
            .conditions
            .iter()
            .find(|c| c.kind.as_deref() == Some(kind));
        let since = previous
            .filter(|p| p.status.as_deref() == Some(state))
            .and_then(|p| p.last_transition_time.clone())
            .unwrap_or_else(|| rfc3339_seconds(now).to_string());
        status.conditions.push(PoolCondition {
            last_transition_time: since,
            message,
            reason: reason.to_string(),
            status: state.to_string(),
            kind: kind.to_string(),
        });
    }
    // Serialising plain strings and numbers cannot fail.
    (serde_json::to_string(&status).unwrap_or_default(), gauges)
}

/// The blocks of one range by state.
fn block_counts(range: &FamilyRange, ledger: &Working) -> BlockCounts {
    let [granted, cooling, retired] = ledger.tally(range).map(u128::from);
    let free = range
        .blocks_total()
        .saturating_sub(granted + cooling + retired);
    BlockCounts {
        cooling: count(cooling),
        free: count(free),
        granted: count(granted),
        total: count(range.blocks_total()),
    }
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

    /// A pass over every node of this world (no Node missing, a minute's
    /// grace), with the indexes its statuses and ledgers make.
    /// A NodeNetworkConfig as the cache keeps it: the object and its
    /// status as read.
    fn nnc_read(object: Value) -> (Demand, Status) {
        use crate::controller::informer::{Item, Resource};
        match Item::parse(Resource::Nnc, object) {
            Item::Nnc(_, nnc, status) => (*nnc, status),
            _ => unreachable!(),
        }
    }

    /// The objects as the cache keeps them.
    fn boxed<T: Clone>(objects: &BTreeMap<String, T>) -> BTreeMap<ShortText, Box<T>> {
        let each = objects.iter();
        each.map(|(name, o)| (name.as_str().into(), Box::new(o.clone())))
            .collect()
    }

    fn decide_every(
        pools: &[Pool],
        nncs: &BTreeMap<String, Demand>,
        statuses: &BTreeMap<String, Status>,
        now_ms: i64,
        wall_ms: i64,
    ) -> Decision {
        let clock = (now_ms, wall_ms);
        decide_bounded(pools, nncs, statuses, clock, Bound::NONE)
    }

    fn decide_bounded(
        pools: &[Pool],
        nncs: &BTreeMap<String, Demand>,
        statuses: &BTreeMap<String, Status>,
        (now_ms, wall_ms): (i64, i64),
        bound: Bound,
    ) -> Decision {
        let nncs = boxed(nncs);
        let statuses = boxed(statuses);
        let world = World {
            pools,
            nncs: &nncs,
            statuses: &statuses,
            index: &StatusIndex::of(&statuses),
            absent: &BTreeMap::new(),
            now_ms,
            wall_ms,
            node_grace_ms: 60_000,
            scope: None,
            bound,
        };
        let mut taken = TakenIndex::of(&statuses, pools.iter().map(|p| &p.ledger));
        decide(&world, &mut taken)
    }

    fn pool(status: Value) -> Pool {
        Pool::parse(&json!({
            "metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z",
                         "resourceVersion": "7", "generation": 3},
            "spec": {"network": "default",
                     "ipv4": {"cidrs": ["198.18.0.0/24"], "blockPrefixLength": 28},
                     "ipv6": {"cidrs": ["2001:db8::/120"], "blockPrefixLength": 124}},
            "status": status,
        }))
    }

    /// A granted block that overlaps a block of another size in a status
    /// (a stale controller's create across a block-size change: the API
    /// server cannot refuse it, the names differ) enters no status. Its
    /// node not serving it, it cools out; serving it, it stays, and the
    /// node is told of the conflict.
    #[test]
    fn a_granted_block_overlapping_another_size_in_a_status_enters_none() {
        use crate::controller::block::{self, Block, BlockSpec, BlockState};
        let stray = BlockSpec {
            pool: "p".into(),
            network: "default".into(),
            cidr: "198.18.0.0/28".into(),
            node: "n1".into(),
            state: BlockState::Granted,
            reason: block::GRANTED.into(),
        };
        let object = block::object(&stray, "v4-198-18-0-0-28", "4", true);
        let pools = crate::controller::pool::with_ledgers(
            &[pool(json!({}))],
            [&Block::parse(object)].map(|(name, block)| (name.as_str(), block)),
            &BTreeMap::new(),
            1_000,
        );
        let nnc = |name: &str, serving: &str, held: &[&str]| {
            let entries: Vec<Value> = held.iter().map(|c| json!({"cidr": c})).collect();
            let object = json!({
                "metadata": {"name": name, "resourceVersion": "5",
                             "annotations": {"metis.x-k8s.io/serving": serving}},
                "spec": {"allocations": [], "releasableCIDRs": []},
                "status": {"podCIDRs": entries}});
            let (nnc, status) = nnc_read(object);
            (name.to_string(), nnc, status)
        };
        for serving in ["", "198.18.0.0/28"] {
            let all = [nnc("n1", serving, &[]), nnc("n2", "", &["198.18.0.0/27"])];
            let nncs = all
                .iter()
                .map(|(n, nnc, _)| (n.clone(), nnc.clone()))
                .collect();
            let statuses = all.into_iter().map(|(n, _, s)| (n, s)).collect();
            let decision = decide_every(&pools, &nncs, &statuses, 2_000, 1_795_971_700_000);
            let to_n1: Vec<&Write> = decision
                .nnc_writes
                .iter()
                .filter(|w| w.name == "n1")
                .collect();
            assert!(
                to_n1.iter().all(|w| !w.status.contains("198.18.0.0/28\"")),
                "{serving:?}: {decision:?}"
            );
            let cooled = decision.block_writes.iter().any(
                |w| matches!(&w.op, BlockOp::Update(_, spec) if spec.state == BlockState::Cooling),
            );
            assert_eq!(cooled, serving.is_empty(), "{serving:?}: {decision:?}");
            let told = to_n1
                .iter()
                .any(|w| w.status.contains("overlaps 198.18.0.0/27"));
            assert_eq!(told, !serving.is_empty(), "{serving:?}: {decision:?}");
        }
    }

    /// The pool's status is counts and conditions only, and an unchanged
    /// one reads back as the very text written (else every pass would
    /// write the pool).
    #[test]
    fn a_pool_status_holds_counts_only_and_reads_back_as_the_same_text() {
        // Entered as the blocks' objects say, as the cache enters them.
        let blocks = [
            ("198.18.0.0/28", "Granted"),
            ("198.18.0.16/28", "Granted"),
            ("2001:db8::10/124", "Granted"),
            ("198.18.0.32/28", "Cooling"),
            ("198.18.9.0/28", "Granted"),
        ]
        .map(|(cidr, state)| {
            let name = block::block_name(&cidr.parse().unwrap());
            crate::controller::block::Block::parse(json!({
                "metadata": {"name": name, "resourceVersion": "1"},
                "spec": {"pool": "p", "network": "default", "cidr": cidr, "node": "n",
                         "state": state, "reason": state}}))
        });
        let named = blocks.iter().map(|(name, block)| (name.as_str(), block));
        let pools =
            crate::controller::pool::with_ledgers(&[pool(json!({}))], named, &BTreeMap::new(), 0);
        let ledger = pools[0].ledger.clone();
        let now = 1_795_971_700_000;
        let (text, gauges) = pool_status(&pool(json!({})), &Working::new(&ledger), 2, now);
        let tree: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(tree.to_string(), text);
        assert_eq!(tree["ipv4"]["blocksGranted"], 2);
        assert_eq!(tree["ipv4"]["blocksCooling"], 1);
        assert_eq!(tree["ipv4"]["blocksFree"], 16 - 3);
        assert_eq!(tree["ipv6"]["blocksGranted"], 1);
        assert_eq!(tree["observedGeneration"], 3);
        assert!(tree.get("claims").is_none() && tree.get("cooling").is_none());
        assert_eq!(gauges.len(), 2);
        let exhausted = tree["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Exhausted")
            .unwrap();
        assert_eq!(exhausted["message"], "2 node(s) wait for a block");
        let again = pool(tree);
        assert_eq!(again.status_text, text);
        // Unchanged, the next pass writes the same text.
        assert_eq!(
            pool_status(&again, &Working::new(&ledger), 2, now + 1_000).0,
            text
        );
    }

    /// A Ready condition as this controller writes it reads back as one
    /// that stands for the same trouble and generation (the pass then
    /// skips the rebuild), and not for another.
    #[test]
    fn a_written_ready_condition_stands_until_its_substance_changes() {
        let now = 1_795_971_700_000;
        let quota = Trouble::Quota(format!(
            "pool p has no free block; {UNTIL}2030-01-01T00:00:00.000Z"
        ));
        for trouble in [None, Some(quota), Some(Trouble::Conflict("x".into()))] {
            let (condition, _) = ready_condition(&[], trouble.as_ref(), 4, now);
            let read = Status::parse(json!({"podCIDRs": [], "conditions": [
                {"type": "Other", "status": "True"}, condition]}));
            let ready = &read.ready().expect("a written condition is read");
            assert!(ready_stands(ready, trouble.as_ref(), 4, now + 1));
            assert!(!ready_stands(ready, trouble.as_ref(), 5, now + 1));
            let other = Trouble::Gone("gone".into());
            assert!(!ready_stands(ready, Some(&other), 4, now + 1));
        }
    }

    /// The pool with `block` cooling for n1 since 1 s, its object at
    /// version 9.
    fn cooling_for_n1(block: Cidr) -> Pool {
        let mut p = pool(json!({}));
        let cooling = Cooling {
            node: "n1".into(),
            since_ms: 1_000,
            node_gone: false,
        };
        p.ledger.cooling.insert(block, cooling);
        p.ledger.versions.insert(block, "9".into());
        p
    }

    /// A block that cooled is let go first (its finalizer removed, the
    /// next pass due at once), then deleted once its object is unprotected.
    #[test]
    fn a_cooled_block_is_let_go_then_deleted() {
        let block: Cidr = "198.18.0.0/28".parse().unwrap();
        let mut p = cooling_for_n1(block);
        let (nncs, statuses) = (BTreeMap::new(), BTreeMap::new());
        let now = 1_000 + p.spec.as_ref().unwrap().reclaim_delay_ms;
        let decision = decide_every(&[p.clone()], &nncs, &statuses, now, 1_795_971_700_000);
        match &decision.block_writes[..] {
            [
                BlockWrite {
                    op: BlockOp::LetGo(version, spec),
                    ..
                },
            ] => {
                assert_eq!(version, "9");
                assert_eq!((spec.state, &*spec.node), (BlockState::Cooling, "n1"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(decision.next_due_ms, Some(now + 1));
        // Before its delay ends: nothing.
        let early = decide_every(&[p.clone()], &nncs, &statuses, now - 1, 1_795_971_700_000);
        assert!(early.block_writes.is_empty(), "{early:?}");
        p.ledger.unprotected.insert(block);
        let decision = decide_every(&[p], &nncs, &statuses, now, 1_795_971_700_000);
        assert_eq!(decision.block_writes[0].op, BlockOp::Delete("9".into()));
        assert_ne!(decision.next_due_ms, Some(now + 1));
    }

    /// A block that cools out of one pool's ledger (its range moved away)
    /// while another pool grants it in the same pass is written once: a
    /// PUT over its object, never a let-go the grant's PUT then misses.
    #[test]
    fn a_block_cooled_in_one_pool_and_granted_by_another_is_written_once() {
        use crate::controller::informer::{Item, Resource};
        let block: Cidr = "198.18.0.0/28".parse().unwrap();
        let mut moved = cooling_for_n1(block);
        if let Ok(spec) = moved.spec.as_mut() {
            spec.ranges.retain(|r| r.family == Family::V6);
        }
        let taker = Pool::parse(&json!({
            "metadata": {"name": "q", "creationTimestamp": "2026-01-02T00:00:00Z",
                         "resourceVersion": "8", "generation": 1},
            "spec": {"network": "default",
                     "ipv4": {"cidrs": ["198.18.0.0/24"], "blockPrefixLength": 28}},
        }));
        let object = json!({
            "metadata": {"name": "n2", "resourceVersion": "5"},
            "spec": {"allocations": [{"network": "default", "pods": 4}]}});
        let Item::Nnc(_, nnc, status) = Item::parse(Resource::Nnc, object) else {
            panic!("not an NNC");
        };
        let nncs = BTreeMap::from([("n2".to_string(), *nnc)]);
        let statuses = BTreeMap::from([("n2".to_string(), status)]);
        let now = 1_000 + moved.spec.as_ref().unwrap().reclaim_delay_ms;
        let decision = decide_every(&[moved, taker], &nncs, &statuses, now, 1_795_971_700_000);
        let to_block: Vec<&BlockOp> = (decision.block_writes.iter())
            .filter(|w| w.cidr == block)
            .map(|w| &w.op)
            .collect();
        match &to_block[..] {
            [BlockOp::Update(version, spec)] => {
                assert_eq!(version, "9");
                let said = (&*spec.pool, &*spec.node, spec.state);
                assert_eq!(said, ("q", "n2", BlockState::Granted));
            }
            other => panic!("{other:?}: {decision:?}"),
        }
        let to_n2 = &decision.nnc_writes[0];
        assert!(to_n2.status.contains("198.18.0.0/28"), "{to_n2:?}");
    }

    /// A node whose status holds a copy of a block cooling for another
    /// node (an edit by hand) drops the copy when it releases it (the
    /// block's delay starts over, still that node's) and never takes the
    /// block over: saying it still serves it is a conflict until it cooled.
    #[test]
    fn releasing_a_copy_of_another_nodes_cooling_block_takes_nothing() {
        let block: Cidr = "198.18.0.0/28".parse().unwrap();
        let p = cooling_for_n1(block);
        let nnc = |releasable: bool| {
            let listed = if releasable {
                json!([{"cidr": "198.18.0.0/28"}])
            } else {
                json!([])
            };
            let object = json!({
                "metadata": {"name": "n0", "resourceVersion": "5",
                             "annotations": {"metis.x-k8s.io/serving": "198.18.0.0/28"}},
                "spec": {"allocations": [], "releasableCIDRs": listed},
                "status": {"podCIDRs": [{"cidr": "198.18.0.0/28", "network": "default"}]}});
            nnc_read(object)
        };
        for releasable in [true, false] {
            let (n0, status) = nnc(releasable);
            let nncs = BTreeMap::from([("n0".to_string(), n0)]);
            let statuses = BTreeMap::from([("n0".to_string(), status)]);
            let pools = [p.clone()];
            let decision = decide_every(&pools, &nncs, &statuses, 2_000, 1_795_971_700_000);
            assert!(
                decision.block_writes.is_empty(),
                "{releasable}: {decision:?}"
            );
            // Released, the copy restarts the block's delay, which stays n1's.
            let restarts = usize::from(releasable);
            assert_eq!(decision.cooling_restarts.len(), restarts, "{releasable}");
        }
    }

    /// A node the scope leaves out, whose status holds a copy of a block,
    /// is told with whom it conflicts: when a node of the scope drops its
    /// own copy, that text changes, so the pass is one over every node.
    #[test]
    fn a_copy_dropped_in_scope_decides_the_other_copys_node_again() {
        let block: Cidr = "198.18.0.0/28".parse().unwrap();
        let mut p = pool(json!({}));
        p.ledger.claim(block, &"n2".into());
        p.ledger.versions.insert(block, "9".into());
        let nnc = |name: &str, releasable: bool| {
            let listed = if releasable {
                json!([{"cidr": "198.18.0.0/28"}])
            } else {
                json!([])
            };
            let object = json!({
                "metadata": {"name": name, "resourceVersion": "5"},
                "spec": {"allocations": [], "releasableCIDRs": listed},
                "status": {"podCIDRs": [{"cidr": "198.18.0.0/28", "network": "default"}]}});
            (name.to_string(), nnc_read(object))
        };
        // n0 and n2 settled as before; n1 has just released its copy.
        let objects = BTreeMap::from([nnc("n0", false), nnc("n1", true), nnc("n2", false)]);
        let nncs = objects
            .iter()
            .map(|(n, (o, _))| (n.as_str().into(), Box::new(o.clone())))
            .collect();
        let statuses = (objects.into_iter())
            .map(|(n, (_, s))| (n.into(), Box::new(s)))
            .collect();
        let pools = [p];
        let scope = BTreeSet::from([ShortText::from("n1")]);
        let world = World {
            pools: &pools,
            nncs: &nncs,
            statuses: &statuses,
            index: &StatusIndex::of(&statuses),
            absent: &BTreeMap::new(),
            now_ms: 2_000,
            wall_ms: 1_795_971_700_000,
            node_grace_ms: 60_000,
            scope: Some(&scope),
            bound: Bound::NONE,
        };
        let mut taken = TakenIndex::of(&statuses, pools.iter().map(|p| &p.ledger));
        assert_eq!(decide_in(&world, &mut taken).map(|d| d.nnc_writes), None);
        let decision = decide(&world, &mut taken);
        let n0 = decision.nnc_writes.iter().find(|w| w.name == "n0");
        assert!(
            n0.is_some_and(|w| w.status.contains("in the status of n2")),
            "{decision:?}"
        );
    }

    /// A grant missing from its node's status (an etcd restore brought
    /// back an older object naming it) enters no second status, nor one
    /// while another machine says it serves the block: the node is told
    /// why, and the block enters once the other copy or server is gone.
    #[test]
    fn a_grant_enters_no_status_while_another_holds_or_serves_its_block() {
        let block: Cidr = "198.18.0.0/28".parse().unwrap();
        let mut p = pool(json!({}));
        p.ledger.claim(block, &"n1".into());
        p.ledger.versions.insert(block, "9".into());
        let nnc = |name: &str, serving: &str, held: bool| {
            let entries = match held {
                true => json!([{"cidr": "198.18.0.0/28", "network": "default"}]),
                false => json!([]),
            };
            let object = json!({
                "metadata": {"name": name, "resourceVersion": "5",
                             "annotations": {"metis.x-k8s.io/serving": serving}},
                "spec": {"allocations": [{"network": "default", "pods": 1}]},
                "status": {"podCIDRs": entries}});
            (name.to_string(), nnc_read(object))
        };
        let pools = [p];
        let decide_for = |objects: [(String, (Demand, Status)); 2]| {
            let nncs = (objects.iter())
                .map(|(n, (o, _))| (n.clone(), o.clone()))
                .collect();
            let statuses = objects.into_iter().map(|(n, (_, s))| (n, s)).collect();
            let d = decide_every(&pools, &nncs, &statuses, 2_000, 1_795_971_700_000);
            let n1 = d.nnc_writes.into_iter().find(|w| w.name == "n1");
            n1.map(|w| w.status).unwrap_or_default()
        };
        let enters = |status: &str| status.contains("\"cidr\":\"198.18.0.0/28\"");
        let cases = [
            (nnc("n2", "", true), "is in the status of n2"),
            (
                nnc("n2", "198.18.0.0/28", false),
                "is served by another machine",
            ),
        ];
        for (other, why) in cases {
            let status = decide_for([nnc("n1", "", false), other]);
            assert!(!enters(&status) && status.contains(why), "{status}");
        }
        let status = decide_for([nnc("n1", "", false), nnc("n2", "", false)]);
        assert!(enters(&status), "{status}");
    }

    /// An older object (an etcd restore) grants n1 a /28 inside a /27
    /// that cools for n2, made since with another block size: the /28
    /// enters no status, and cools out.
    #[test]
    fn a_grant_overlapping_another_nodes_block_of_another_size_cools_out() {
        let small: Cidr = "198.18.0.16/28".parse().unwrap();
        let large: Cidr = "198.18.0.0/27".parse().unwrap();
        let mut p = pool(json!({}));
        p.ledger.claim(small, &"n1".into());
        p.ledger.versions.insert(small, "9".into());
        let cooling = Cooling {
            node: "n2".into(),
            since_ms: 1_000,
            node_gone: false,
        };
        p.ledger.cooling.insert(large, cooling);
        p.ledger.versions.insert(large, "8".into());
        let object = json!({
            "metadata": {"name": "n1", "resourceVersion": "5"},
            "spec": {"allocations": [{"network": "default", "pods": 1}]},
            "status": {"podCIDRs": []}});
        let (nnc, status) = nnc_read(object);
        let nncs = BTreeMap::from([("n1".to_string(), nnc)]);
        let statuses = BTreeMap::from([("n1".to_string(), status)]);
        let d = decide_every(&[p], &nncs, &statuses, 2_000, 1_795_971_700_000);
        let n1 = d.nnc_writes.iter().find(|w| w.name == "n1");
        assert!(
            n1.is_none_or(|w| !w.status.contains("198.18.0.16/28")),
            "{d:?}"
        );
        let cools = d.block_writes.iter().any(|w| {
            w.cidr == small
                && matches!(&w.op, BlockOp::Update(_, spec) if spec.state == BlockState::Cooling)
        });
        assert!(cools, "{d:?}");
    }

    /// The Ready condition is replaced, typed; another condition keeps
    /// its fields unknown here, and an entry that is no condition is
    /// dropped with the rewrite.
    #[test]
    fn a_rewritten_status_keeps_other_conditions_whole() {
        let object = json!({
            "metadata": {"name": "n0", "resourceVersion": "5", "generation": 2},
            "spec": {"allocations": []},
            "status": {"podCIDRs": [], "note": {"kept": 1}, "conditions": [
                "text",
                {"type": "Zeta", "status": "True", "since": "then", "observedGeneration": 1},
                {"type": "Ready", "status": "False", "reason": QUOTA_EXCEEDED, "message": "m",
                 "lastTransitionTime": "2026-01-01T00:00:00.000Z"}]}});
        let (nnc, status) = nnc_read(object);
        let nncs = BTreeMap::from([("n0".to_string(), nnc)]);
        let statuses = BTreeMap::from([("n0".to_string(), status)]);
        let wall_ms = 1_795_971_700_000;
        let decision = decide_every(&[], &nncs, &statuses, 2_000, wall_ms);
        let [write] = decision.nnc_writes.as_slice() else {
            panic!("one status write: {decision:?}")
        };
        let written: Value = serde_json::from_str(&write.status).unwrap();
        let since = rfc3339_millis(wall_ms).to_string();
        assert_eq!(
            written,
            json!({"podCIDRs": [], "note": {"kept": 1}, "conditions": [
                {"type": "Ready", "status": "True", "reason": READY,
                 "message": "the granted blocks cover the demand",
                 "lastTransitionTime": since, "observedGeneration": 2},
                {"type": "Zeta", "status": "True", "since": "then", "observedGeneration": 1}]})
        );
        // Written back, it stands: the next pass writes nothing.
        let again = Status::parse(written);
        let statuses = BTreeMap::from([("n0".to_string(), again)]);
        let decision = decide_every(&[], &nncs, &statuses, 3_000, wall_ms + 1_000);
        assert!(decision.nnc_writes.is_empty(), "{decision:?}");
    }

    #[test]
    fn a_moved_promise_leaves_the_text_of_none() {
        let told = format!("pool p has no free block; {UNTIL}2026-01-02T03:04:05.678Z");
        assert_eq!(split_until(&told).0, "pool p has no free block");
        assert_eq!(
            split_until("pool p has no free block").0,
            "pool p has no free block"
        );
    }

    /// A bounded pass keeps the first nodes' status writes from just after
    /// the last node written, with the block writes they rely on; the rest
    /// (their blocks and Events too) wait, their nodes unsettled. A paused
    /// node's write (the writer skips it) is kept and counts for nothing.
    #[test]
    fn a_bounded_pass_writes_a_few_nodes_in_turn_and_leaves_the_rest_unsettled() {
        let ask = |name: &str| {
            let object = json!({"metadata": {"name": name, "resourceVersion": "5"},
                "spec": {"allocations": [{"network": "default", "pods": 4}]}});
            (name.to_string(), nnc_read(object).0)
        };
        let nncs = BTreeMap::from(["n1", "n2", "n3"].map(ask));
        let pools = [pool(json!({}))];
        let pass = |nodes: usize, after: Option<&str>, ready: &dyn Fn(&str) -> bool| {
            let bound = Bound {
                nodes,
                after,
                ready,
            };
            let clock = (2_000, 1_795_971_700_000);
            let d = decide_bounded(&pools, &nncs, &BTreeMap::new(), clock, bound);
            let written: Vec<&str> = d.nnc_writes.iter().map(|w| w.name.as_str()).collect();
            let created: BTreeSet<&str> = (d.block_writes.iter())
                .filter_map(|w| match &w.op {
                    BlockOp::Create(spec) => Some(&*spec.node),
                    _ => None,
                })
                .collect();
            let written_set: BTreeSet<&str> = written.iter().copied().collect();
            assert_eq!(created, written_set, "the blocks of the writes kept");
            let unsettled: Vec<&str> = d.unsettled.iter().map(ShortText::as_str).collect();
            assert_eq!(unsettled, ["n1", "n2", "n3"]);
            (written.join(","), d.bounded_after.clone())
        };
        let all = |_: &str| true;
        let first = pass(2, None, &all);
        assert_eq!(first, ("n1,n2".to_string(), Some("n2".to_string())));
        // The next starts after n2 and wraps round.
        let next = pass(2, Some("n2"), &all);
        assert_eq!(next, ("n3,n1".to_string(), Some("n1".to_string())));
        // Within the bound: nothing waits.
        assert_eq!(pass(3, Some("n1"), &all), ("n2,n3,n1".to_string(), None));
        assert_eq!(pass(usize::MAX, None, &all).1, None);
        // n1 paused: two ready ones fit, or one of them does.
        let paused = |n: &str| n != "n1";
        assert_eq!(pass(2, None, &paused), ("n2,n3,n1".to_string(), None));
        let one = pass(1, None, &paused);
        assert_eq!(one, ("n2,n1".to_string(), Some("n2".to_string())));
    }
}
