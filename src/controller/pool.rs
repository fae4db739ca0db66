//! The `MetisPool` resource (`metis.x-k8s.io/v1alpha1`, cluster scoped):
//! its spec as plain data, checked whole (a bad spec is refused, never
//! partly applied), and its ledger: which block is granted to which node,
//! cooling or retired, as the `MetisBlock` objects say (`block`). The
//! pool's own status holds only counts and conditions.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::block::{Block, BlockState, NODE_GONE};
use super::short_text::ShortText;
use super::small_set::SmallSet;
use crate::cidr::{Cidr, Family};
use crate::duration::parse_duration_ms;
use crate::kube::objects::{Condition, ObjectMeta, lenient, lenient_field};

pub const POOL_PATH: &str = "/apis/metis.x-k8s.io/v1alpha1/metispools";
pub const DEFAULT_V4_BLOCK: u8 = 28;
pub const DEFAULT_V6_BLOCK: u8 = 124;
pub const DEFAULT_MAX_BLOCKS_PER_NODE: usize = 64;
pub const DEFAULT_RECLAIM_DELAY_MS: i64 = 5 * 60 * 1000;
/// CIDRs read from one family of a pool: more is a spec error, not a
/// big pool (one CIDR can be as large as needed).
pub const MAX_POOL_CIDRS: usize = 64;

/// One family of a pool: where its blocks come from and how big they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyRange {
    pub family: Family,
    pub cidrs: Vec<Cidr>,
    pub block_prefix: u8,
}

impl FamilyRange {
    /// Addresses in one block.
    pub fn block_size(&self) -> u128 {
        1u128
            .checked_shl(u32::from(self.family.bits() - self.block_prefix))
            .unwrap_or(u128::MAX)
    }

    /// Blocks in all CIDRs (saturating).
    pub fn blocks_total(&self) -> u128 {
        self.cidrs
            .iter()
            .map(|c| {
                1u128
                    .checked_shl(u32::from(self.block_prefix - c.prefix_len()))
                    .unwrap_or(u128::MAX)
            })
            .fold(0u128, u128::saturating_add)
    }

    /// Whether `block` is one of this range's blocks (inside a CIDR, of
    /// the block size).
    pub fn is_block(&self, block: &Cidr) -> bool {
        block.family() == self.family
            && block.prefix_len() == self.block_prefix
            && self.cidrs.iter().any(|c| c.contains(block.base()))
    }

    pub fn covers(&self, block: &Cidr) -> bool {
        self.cidrs.iter().any(|c| c.overlaps(block))
    }
}

/// A pool's spec, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    pub network: String,
    pub ranges: Vec<FamilyRange>,
    pub max_blocks_per_node: usize,
    pub reclaim_delay_ms: i64,
}

impl PoolSpec {
    pub fn range(&self, family: Family) -> Option<&FamilyRange> {
        self.ranges.iter().find(|r| r.family == family)
    }
}

/// Who a block is granted to: the Node's name (blocks follow the
/// machine, not its NodeNetworkConfig object).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Holder {
    pub node: ShortText,
}

/// A block waiting out the reclaim delay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cooling {
    pub node: ShortText,
    /// When this process first saw it cooling (its monotonic clock, ms):
    /// a new leader starts the delay over, it never shortens.
    pub since_ms: i64,
    /// Taken from a Node gone past the grace (not released): the Node
    /// coming back gets it back.
    pub node_gone: bool,
}

/// A pool's blocks by state, as the `MetisBlock` objects say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    /// Block → who it is granted to. A block enters a status only after
    /// its object says so (docs/controller.md).
    pub claims: BTreeMap<Cidr, Holder>,
    pub cooling: BTreeMap<Cidr, Cooling>,
    pub non_reusable: Vec<Cidr>,
    /// The resourceVersion of each block's object (absent: no object).
    pub versions: BTreeMap<Cidr, ShortText>,
    /// Blocks whose object lacks the protection finalizer (let go, or
    /// written before it): deleted once free, never let go again.
    pub unprotected: BTreeSet<Cidr>,
    /// Blocks whose object is older than the copy kept (an etcd restore
    /// brought it back): the next pass writes the copy back over it.
    pub behind: BTreeSet<Cidr>,
    /// The claims by node: a pass reads one node's without walking all.
    pub by_node: BTreeMap<ShortText, SmallSet<Cidr>>,
    /// The blocks of the pool's range of each family (IPv4, IPv6) in each
    /// state (granted, cooling, retired): its counts without a walk.
    pub tally: [[u64; 3]; 2],
}

/// A pool's status as the controller writes it. Fields in key order, so
/// that its compact text is the text `serde_json::Value` gives: an
/// unchanged status reads back equal and is not written again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolStatus {
    pub conditions: Vec<PoolCondition>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<BlockCounts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv6: Option<BlockCounts>,
    #[serde(rename = "observedGeneration")]
    pub observed_generation: i64,
}

/// One family's blocks by state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockCounts {
    #[serde(rename = "blocksCooling")]
    pub cooling: u64,
    #[serde(rename = "blocksFree")]
    pub free: u64,
    #[serde(rename = "blocksGranted")]
    pub granted: u64,
    #[serde(rename = "blocksTotal")]
    pub total: u64,
}

/// A condition of the pool (`Valid`, `Exhausted`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolCondition {
    #[serde(rename = "lastTransitionTime")]
    pub last_transition_time: String,
    pub message: String,
    pub reason: String,
    pub status: String,
    #[serde(rename = "type")]
    pub kind: String,
}

/// A pool as read from the API server.
#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    pub name: String,
    pub resource_version: String,
    pub generation: i64,
    /// `metadata.creationTimestamp`: older pools win an overlap.
    pub created: String,
    pub spec: Result<PoolSpec, String>,
    /// Filled from the blocks for each decision ([`with_ledgers`]).
    pub ledger: Ledger,
    /// The status as read, compact JSON text (keys sorted, so an equal
    /// status has an equal text), to write only on change.
    pub status_text: String,
    /// Its `conditions` (what is no condition skipped).
    pub conditions: Vec<Condition>,
}

/// A `MetisPool` object as read: the spec's fields are kept as read for
/// [`parse_spec`] to judge (its errors quote the offending value).
#[derive(Debug, Default, Deserialize)]
struct MetisPool {
    #[serde(default, deserialize_with = "lenient_field")]
    metadata: ObjectMeta,
    #[serde(default)]
    spec: Value,
    /// Kept whole: written again only when it changes.
    #[serde(default)]
    status: Value,
}

/// The fields of `spec`, each as read (missing: `null`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecFields {
    #[serde(default)]
    network: Value,
    #[serde(default)]
    ipv4: Value,
    #[serde(default)]
    ipv6: Value,
    #[serde(default)]
    max_blocks_per_node: Value,
    #[serde(default)]
    reclaim_delay: Value,
}

/// The fields of a family's range, each as read.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RangeFields {
    #[serde(default)]
    block_prefix_length: Value,
    #[serde(default)]
    cidrs: Value,
}

impl Pool {
    pub fn parse(object: &Value) -> Pool {
        let MetisPool {
            metadata,
            spec,
            status,
        } = lenient(object);
        Pool {
            name: metadata.name,
            resource_version: metadata.resource_version,
            generation: metadata.generation,
            created: metadata.creation_timestamp,
            spec: parse_spec(&spec),
            ledger: Ledger::default(),
            status_text: status.to_string(),
            conditions: super::status::conditions(&status),
        }
    }

    /// How long a released block of this pool cools (the default under a
    /// refused spec).
    pub fn reclaim_delay_ms(&self) -> i64 {
        self.spec
            .as_ref()
            .map_or(DEFAULT_RECLAIM_DELAY_MS, |s| s.reclaim_delay_ms)
    }
}

/// Checks a spec alone; overlaps between pools are [`validate`]'s.
pub fn parse_spec(spec: &Value) -> Result<PoolSpec, String> {
    let spec: SpecFields = lenient(spec);
    let network = spec
        .network
        .as_str()
        .filter(|n| !n.is_empty())
        .ok_or("spec.network is required (the NodeNetworkConfig network, e.g. \"default\")")?
        .to_string();
    let mut ranges = Vec::new();
    for (range, key, family, default) in [
        (&spec.ipv4, "ipv4", Family::V4, DEFAULT_V4_BLOCK),
        (&spec.ipv6, "ipv6", Family::V6, DEFAULT_V6_BLOCK),
    ] {
        if range.is_null() {
            continue;
        }
        ranges.push(parse_range(range, key, family, default)?);
    }
    if ranges.is_empty() {
        return Err("the pool has neither spec.ipv4 nor spec.ipv6".into());
    }
    let max_blocks_per_node = match &spec.max_blocks_per_node {
        Value::Null => DEFAULT_MAX_BLOCKS_PER_NODE,
        value => value
            .as_u64()
            .filter(|n| (1..=4096).contains(n))
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| format!("spec.maxBlocksPerNode {value} is not a number in 1..4096"))?,
    };
    let reclaim_delay_ms = match &spec.reclaim_delay {
        Value::Null => DEFAULT_RECLAIM_DELAY_MS,
        value => value
            .as_str()
            .and_then(parse_duration_ms)
            .ok_or_else(|| format!("spec.reclaimDelay {value} is not a duration such as \"5m\""))?,
    };
    Ok(PoolSpec {
        network,
        ranges,
        max_blocks_per_node,
        reclaim_delay_ms,
    })
}

fn parse_range(
    value: &Value,
    key: &str,
    family: Family,
    default: u8,
) -> Result<FamilyRange, String> {
    let value: RangeFields = lenient(value);
    let block_prefix = match &value.block_prefix_length {
        Value::Null => default,
        v => v
            .as_u64()
            .and_then(|n| u8::try_from(n).ok())
            .filter(|n| *n <= family.bits())
            .ok_or_else(|| {
                format!(
                    "spec.{key}.blockPrefixLength {v} is not a prefix length of {family} (0..{})",
                    family.bits()
                )
            })?,
    };
    let list = value
        .cidrs
        .as_array()
        .filter(|l| !l.is_empty())
        .ok_or_else(|| format!("spec.{key}.cidrs must list at least one CIDR"))?;
    if list.len() > MAX_POOL_CIDRS {
        return Err(format!(
            "spec.{key}.cidrs lists more than {MAX_POOL_CIDRS} CIDRs"
        ));
    }
    let mut cidrs: Vec<Cidr> = Vec::new();
    for entry in list {
        let text = entry
            .as_str()
            .ok_or_else(|| format!("spec.{key}.cidrs: {entry} is not a string"))?;
        let cidr: Cidr = text
            .parse()
            .map_err(|err| format!("spec.{key}.cidrs: {err}"))?;
        if cidr.family() != family {
            return Err(format!("spec.{key}.cidrs: {cidr} is not an {family} CIDR"));
        }
        if block_prefix < cidr.prefix_len() {
            return Err(format!(
                "spec.{key}: blocks of /{block_prefix} are larger than {cidr}"
            ));
        }
        if let Some(other) = cidrs.iter().find(|c| c.overlaps(&cidr)) {
            return Err(format!("spec.{key}.cidrs: {cidr} overlaps {other}"));
        }
        cidrs.push(cidr);
    }
    Ok(FamilyRange {
        family,
        cidrs,
        block_prefix,
    })
}

/// Refuses pools that overlap an older valid one (the older, by creation
/// then name, keeps its CIDRs; the newer is rejected whole), and pools
/// whose block size is not that of a block object inside their CIDRs
/// (`blocks`, every object's CIDR): a block's name fences only blocks of
/// its own size, so one size holds wherever a block object lies.
pub fn validate(pools: &mut [Pool], blocks: &[Cidr]) {
    pools.sort_by(|a, b| (&a.created, &a.name).cmp(&(&b.created, &b.name)));
    for i in 0..pools.len() {
        let Ok(spec) = &pools[i].spec else { continue };
        let clash = other_size(spec, blocks).or_else(|| {
            pools[..i].iter().find_map(|older| {
                let older_spec = older.spec.as_ref().ok()?;
                spec.ranges.iter().find_map(|range| {
                    range.cidrs.iter().find_map(|cidr| {
                        let theirs = older_spec.range(range.family)?;
                        let other = theirs.cidrs.iter().find(|c| c.overlaps(cidr))?;
                        Some(format!(
                            "{cidr} overlaps {other} of pool {:?}, which is older",
                            older.name
                        ))
                    })
                })
            })
        });
        if let Some(why) = clash {
            pools[i].spec = Err(why);
        }
    }
}

/// Why `spec`'s block size cannot be in force: a block object of another
/// size inside one of its CIDRs.
fn other_size(spec: &PoolSpec, blocks: &[Cidr]) -> Option<String> {
    spec.ranges.iter().find_map(|range| {
        range.cidrs.iter().find_map(|cidr| {
            let odd = blocks
                .iter()
                .find(|b| b.prefix_len() != range.block_prefix && cidr.overlaps(b))?;
            let size = odd.prefix_len();
            Some(format!(
                "{cidr} holds blocks of /{size} ({odd} among them): its block size changes \
                 only once they are gone (blockPrefixLength {size} until then)"
            ))
        })
    })
}

/// Whether a block of `cidr` would make any of `specs` refused or valid
/// again: it lies in a CIDR of another block size.
pub fn is_other_size<'s>(
    specs: impl IntoIterator<Item = &'s Result<PoolSpec, String>>,
    cidr: &Cidr,
) -> bool {
    specs.into_iter().flatten().any(|spec| {
        spec.range(cidr.family()).is_some_and(|range| {
            range.block_prefix != cidr.prefix_len() && range.cidrs.iter().any(|c| c.overlaps(cidr))
        })
    })
}

/// The pool a block belongs to: the one its spec names, else a valid
/// one covering it (a pool re-created under another name).
fn pool_index(pools: &[Pool], cidr: &Cidr, named: &str) -> Option<usize> {
    pools.iter().position(|p| p.name == named).or_else(|| {
        pools.iter().position(|p| {
            p.spec
                .as_ref()
                .is_ok_and(|s| s.range(cidr.family()).is_some_and(|r| r.covers(cidr)))
        })
    })
}

/// `pools` with their ledgers filled from `blocks` (by name). A cooling
/// block cools from when this process first saw it cooling
/// (`cooling_seen`, by name; `now_ms` if not noted yet). Unreadable blocks and blocks no pool knows
/// are left out (nothing is granted from outside a pool).
pub fn with_ledgers<'a>(
    pools: &[Pool],
    blocks: impl IntoIterator<Item = (&'a str, &'a Block)>,
    cooling_seen: &BTreeMap<String, i64>,
    now_ms: i64,
) -> Vec<Pool> {
    let mut pools = pools.to_vec();
    for (name, block) in blocks {
        let since_ms = cooling_seen.get(name).copied().unwrap_or(now_ms);
        enter_block(&mut pools, block, since_ms);
    }
    pools
}

/// Enters `block` into the ledger of its pool, as [`with_ledgers`] does
/// (a cooling one cooling since `since_ms`); one no pool knows, or
/// unreadable, is left out. Returns the block's CIDR if it entered.
pub fn enter_block(pools: &mut [Pool], block: &Block, since_ms: i64) -> Option<Cidr> {
    let (cidr, spec) = block.spec.as_ref()?;
    let i = pool_index(pools, cidr, &spec.pool)?;
    let counted = in_range(&pools[i], cidr);
    let ledger = &mut pools[i].ledger;
    // A block whose object vanished has no version: it is never written
    // over, only created again (`Cache::remove`).
    if !block.resource_version.is_empty() {
        ledger
            .versions
            .insert(*cidr, block.resource_version.clone());
    }
    if !block.protected {
        ledger.unprotected.insert(*cidr);
    }
    if block.behind {
        ledger.behind.insert(*cidr);
    }
    match spec.state {
        BlockState::Granted => ledger.claim(*cidr, &spec.node),
        BlockState::Cooling => {
            let cooling = Cooling {
                node: spec.node.clone(),
                since_ms,
                node_gone: *spec.reason == *NODE_GONE,
            };
            ledger.cooling.insert(*cidr, cooling);
        }
        BlockState::NonReusable => ledger.non_reusable.push(*cidr),
    }
    if counted && let Some(held) = ledger.held(cidr) {
        ledger.tally[family_slot(cidr)][held.tally_index()] += 1;
    }
    Some(*cidr)
}

/// Whether `cidr` is a block of `pool`'s range (what its counts count).
fn in_range(pool: &Pool, cidr: &Cidr) -> bool {
    let spec = pool.spec.as_ref();
    spec.is_ok_and(|s| s.range(cidr.family()).is_some_and(|r| r.is_block(cidr)))
}

fn family_slot(cidr: &Cidr) -> usize {
    usize::from(cidr.family() == Family::V6)
}

/// Takes `cidr`'s block out of every ledger (its object changed or left);
/// whether one held it.
pub fn leave_block(pools: &mut [Pool], cidr: &Cidr) -> bool {
    let mut held_it = false;
    for pool in pools {
        let state = pool.ledger.held(cidr).map(Held::tally_index);
        held_it |= state.is_some();
        if let Some(state) = state.filter(|_| in_range(pool, cidr)) {
            let tally = &mut pool.ledger.tally[family_slot(cidr)][state];
            *tally = tally.saturating_sub(1);
        }
        let ledger = &mut pool.ledger;
        ledger.versions.remove(cidr);
        ledger.unprotected.remove(cidr);
        ledger.behind.remove(cidr);
        if let Some(holder) = ledger.claims.remove(cidr)
            && let Some(held) = ledger.by_node.get_mut(&holder.node)
        {
            held.remove(cidr);
            if held.is_empty() {
                ledger.by_node.remove(&holder.node);
            }
        }
        ledger.cooling.remove(cidr);
        ledger.non_reusable.retain(|c| c != cidr);
    }
    held_it
}

/// A block's state in a ledger, borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held<'l> {
    Claim(&'l Holder),
    Cooling(&'l Cooling),
    Retired,
}

impl Held<'_> {
    /// Where [`Ledger::tally`] counts it.
    fn tally_index(self) -> usize {
        match self {
            Held::Claim(_) => 0,
            Held::Cooling(_) => 1,
            Held::Retired => 2,
        }
    }
}

impl Ledger {
    /// Its maps rebuilt with full nodes ([`super::refill`]).
    pub fn refill(&mut self) {
        use super::refill::{map, set};
        map(&mut self.claims);
        map(&mut self.cooling);
        map(&mut self.versions);
        set(&mut self.unprotected);
        set(&mut self.behind);
        map(&mut self.by_node);
    }

    /// `cidr`'s state (a block is in one state at most: its object says one).
    pub fn held(&self, cidr: &Cidr) -> Option<Held<'_>> {
        if let Some(holder) = self.claims.get(cidr) {
            Some(Held::Claim(holder))
        } else if let Some(cooling) = self.cooling.get(cidr) {
            Some(Held::Cooling(cooling))
        } else {
            self.non_reusable.contains(cidr).then_some(Held::Retired)
        }
    }

    /// Grants `cidr` to `node` (the block's object says so).
    pub fn claim(&mut self, cidr: Cidr, node: &ShortText) {
        let holder = Holder { node: node.clone() };
        self.claims.insert(cidr, holder);
        self.by_node.entry(node.clone()).or_default().insert(cidr);
    }
}

/// A block's state in a ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    Claim(Holder),
    Cooling(Cooling),
    Retired,
}

/// A pass's view of a ledger: the ledger as read (kept by the cache,
/// never copied) and the blocks whose state the pass set.
#[derive(Debug, Clone)]
pub struct Working<'r> {
    pub read: &'r Ledger,
    /// Each block the pass set, and its state now (`None`: out of the
    /// ledger).
    changed: BTreeMap<Cidr, Option<Slot>>,
}

impl<'r> Working<'r> {
    pub fn new(read: &'r Ledger) -> Working<'r> {
        Working {
            read,
            changed: BTreeMap::new(),
        }
    }

    /// The blocks whose state the pass set (maybe back to as read).
    pub fn changed(&self) -> impl Iterator<Item = &Cidr> {
        self.changed.keys()
    }

    /// `cidr`'s state, as the pass left it.
    pub fn held(&self, cidr: &Cidr) -> Option<Held<'_>> {
        match self.changed.get(cidr) {
            Some(Some(Slot::Claim(holder))) => Some(Held::Claim(holder)),
            Some(Some(Slot::Cooling(cooling))) => Some(Held::Cooling(cooling)),
            Some(Some(Slot::Retired)) => Some(Held::Retired),
            Some(None) => None,
            None => self.read.held(cidr),
        }
    }

    pub fn claim(&self, cidr: &Cidr) -> Option<&Holder> {
        match self.held(cidr) {
            Some(Held::Claim(holder)) => Some(holder),
            _ => None,
        }
    }

    pub fn cooling(&self, cidr: &Cidr) -> Option<&Cooling> {
        match self.held(cidr) {
            Some(Held::Cooling(cooling)) => Some(cooling),
            _ => None,
        }
    }

    pub fn retired(&self, cidr: &Cidr) -> bool {
        matches!(self.held(cidr), Some(Held::Retired))
    }

    /// Whether `cidr` is in the ledger, in any state.
    pub fn holds(&self, cidr: &Cidr) -> bool {
        self.held(cidr).is_some()
    }

    /// The blocks of `range` in each state, as the pass left them: the
    /// ledger's tally and what the pass changed.
    pub fn tally(&self, range: &FamilyRange) -> [u64; 3] {
        let slot = usize::from(range.family == Family::V6);
        let mut tally = self.read.tally[slot];
        for cidr in self.changed().filter(|c| range.is_block(c)) {
            if let Some(held) = self.read.held(cidr) {
                let count = &mut tally[held.tally_index()];
                *count = count.saturating_sub(1);
            }
            if let Some(held) = self.held(cidr) {
                tally[held.tally_index()] += 1;
            }
        }
        tally
    }

    /// Sets `cidr`'s state (`None`: out of the ledger).
    pub fn set(&mut self, cidr: Cidr, slot: Option<Slot>) {
        self.changed.insert(cidr, slot);
    }

    pub fn set_claim(&mut self, cidr: Cidr, node: &str) {
        let holder = Holder { node: node.into() };
        self.set(cidr, Some(Slot::Claim(holder)));
    }

    /// Every claim, in no particular order.
    pub fn claims(&self) -> impl Iterator<Item = (&Cidr, &Holder)> {
        let changed = &self.changed;
        let read = self.read.claims.iter();
        let kept = read.filter(move |(c, _)| changed.is_empty() || !changed.contains_key(c));
        kept.chain(changed.iter().filter_map(|(c, slot)| match slot {
            Some(Slot::Claim(holder)) => Some((c, holder)),
            _ => None,
        }))
    }

    /// Every cooling block, in no particular order.
    pub fn coolings(&self) -> impl Iterator<Item = (&Cidr, &Cooling)> {
        let changed = &self.changed;
        let read = self.read.cooling.iter();
        let kept = read.filter(move |(c, _)| changed.is_empty() || !changed.contains_key(c));
        kept.chain(changed.iter().filter_map(|(c, slot)| match slot {
            Some(Slot::Cooling(cooling)) => Some((c, cooling)),
            _ => None,
        }))
    }

    /// The blocks granted to `node`, in order: read from the node's own
    /// claims and what the pass changed, not from every claim.
    pub fn claims_of(&self, node: &str) -> Vec<Cidr> {
        let read = self.read.by_node.get(node).into_iter().flatten();
        let mut held: Vec<Cidr> = read
            .filter(|c| !self.changed.contains_key(c))
            .copied()
            .collect();
        held.extend(self.changed.iter().filter_map(|(c, slot)| match slot {
            Some(Slot::Claim(holder)) if holder.node == node => Some(*c),
            _ => None,
        }));
        held.sort_unstable();
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool(name: &str, created: &str, spec: Value) -> Pool {
        Pool::parse(&json!({
            "metadata": {"name": name, "creationTimestamp": created, "resourceVersion": "1"},
            "spec": spec,
        }))
    }

    #[test]
    fn a_spec_gets_its_defaults() {
        let spec = parse_spec(&json!({"network": "default", "ipv4": {"cidrs": ["198.18.0.0/24"]}}))
            .unwrap();
        assert_eq!(spec.ranges[0].block_prefix, 28);
        assert_eq!(spec.ranges[0].blocks_total(), 16);
        assert_eq!(spec.ranges[0].block_size(), 16);
        assert_eq!(spec.max_blocks_per_node, 64);
        assert_eq!(spec.reclaim_delay_ms, 300_000);
        let v6 = parse_spec(
            &json!({"network": "n", "ipv6": {"cidrs": ["2001:db8::/120"]}, "reclaimDelay": "90s"}),
        )
        .unwrap();
        assert_eq!(v6.ranges[0].block_prefix, 124);
        assert_eq!(v6.ranges[0].blocks_total(), 16);
        assert_eq!(v6.reclaim_delay_ms, 90_000);
    }

    #[test]
    fn bad_specs_are_refused_with_a_reason() {
        let cases = [
            (
                json!({"ipv4": {"cidrs": ["198.18.0.0/24"]}}),
                "spec.network is required",
            ),
            (json!({"network": "d"}), "neither spec.ipv4 nor spec.ipv6"),
            (
                json!({"network": "d", "ipv4": {"cidrs": []}}),
                "at least one CIDR",
            ),
            (
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.0.0/24"], "blockPrefixLength": 20}}),
                "larger than 198.18.0.0/24",
            ),
            (
                json!({"network": "d", "ipv4": {"cidrs": ["2001:db8::/64"]}}),
                "is not an ipv4 CIDR",
            ),
            (
                json!({"network": "d", "ipv6": {"cidrs": ["198.18.0.0/24"]}}),
                "is not an ipv6 CIDR",
            ),
            (
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.0.1/24"]}}),
                "host bits set",
            ),
            (
                json!({"network": "d", "ipv4": {"cidrs": ["nonsense"]}}),
                "invalid CIDR",
            ),
            (
                json!({"network": "d", "ipv4": {"cidrs": [7]}}),
                "is not a string",
            ),
            (
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.0.0/24", "198.18.0.128/25"]}}),
                "overlaps 198.18.0.0/24",
            ),
            (
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.0.0/24"], "blockPrefixLength": 33}}),
                "not a prefix length",
            ),
            (
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.0.0/24"]}, "maxBlocksPerNode": 0}),
                "maxBlocksPerNode",
            ),
            (
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.0.0/24"]}, "reclaimDelay": "soon"}),
                "reclaimDelay",
            ),
        ];
        for (spec, expected) in cases {
            let err = parse_spec(&spec).unwrap_err();
            assert!(err.contains(expected), "{spec}: {err}");
        }
    }

    /// A pool's block size holds only where no block object of another
    /// size lies: block names fence blocks of one size. With them gone
    /// (or elsewhere), it holds again; the older pool's clash still counts.
    #[test]
    fn a_block_size_other_than_that_of_existing_blocks_is_refused() {
        let sized = |prefix: u8| {
            pool(
                "a",
                "2026-01-01T00:00:00Z",
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.0.0/24"], "blockPrefixLength": prefix}}),
            )
        };
        let cidr = |c: &str| c.parse::<Cidr>().unwrap();
        let mut pools = vec![sized(29)];
        validate(
            &mut pools,
            &[cidr("198.18.0.16/28"), cidr("198.18.0.32/29")],
        );
        let err = pools[0].spec.as_ref().unwrap_err();
        assert!(
            err.contains("198.18.0.0/24 holds blocks of /28 (198.18.0.16/28 among them)"),
            "{err}"
        );
        for blocks in [
            vec![cidr("198.18.0.32/29")],
            vec![cidr("198.18.1.0/28")],
            vec![],
        ] {
            let mut pools = vec![sized(29)];
            validate(&mut pools, &blocks);
            assert!(pools[0].spec.is_ok(), "{blocks:?}: {:?}", pools[0].spec);
        }
        assert!(is_other_size([&sized(29).spec], &cidr("198.18.0.16/28")));
        assert!(!is_other_size([&sized(28).spec], &cidr("198.18.0.16/28")));
        assert!(!is_other_size([&sized(29).spec], &cidr("198.18.1.0/28")));
    }

    #[test]
    fn the_newer_of_two_overlapping_pools_is_refused_whole() {
        let mut pools = vec![
            pool(
                "b",
                "2026-01-02T00:00:00Z",
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.1.0/24", "198.18.0.128/25"]}}),
            ),
            pool(
                "a",
                "2026-01-01T00:00:00Z",
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.0.0/24"]}}),
            ),
            pool(
                "c",
                "2026-01-03T00:00:00Z",
                json!({"network": "d", "ipv4": {"cidrs": ["198.18.2.0/24"]}}),
            ),
        ];
        validate(&mut pools, &[]);
        assert_eq!(pools[0].name, "a");
        assert!(pools[0].spec.is_ok());
        let err = pools[1].spec.as_ref().unwrap_err();
        assert!(
            err.contains("198.18.0.128/25 overlaps 198.18.0.0/24 of pool \"a\""),
            "{err}"
        );
        assert!(pools[2].spec.is_ok());
    }

    #[test]
    fn the_ledger_is_what_the_blocks_say() {
        use crate::controller::block::{self, BlockSpec, RELEASED};
        let pools = vec![pool(
            "p",
            "2026-01-01T00:00:00Z",
            json!({"network": "d", "ipv4": {"cidrs": ["198.18.0.0/24"]}}),
        )];
        let object = |cidr: &str, pool: &str, state, reason: &str, version: &str| {
            let spec = BlockSpec {
                pool: pool.into(),
                network: "d".into(),
                cidr: cidr.into(),
                node: "n1".into(),
                state,
                reason: reason.into(),
            };
            let name = block::block_name(&cidr.parse().unwrap());
            Block::parse(block::object(&spec, &name, version, true))
        };
        let blocks = [
            object("198.18.0.0/28", "p", BlockState::Granted, "", "1"),
            // Its pool renamed: the pool covering it keeps it.
            object("198.18.0.16/28", "old", BlockState::Cooling, RELEASED, "2"),
            object("198.18.0.32/28", "p", BlockState::Cooling, NODE_GONE, "3"),
            object("198.18.0.48/28", "p", BlockState::NonReusable, "", "4"),
            // Outside every pool: left out.
            object("198.18.9.0/28", "gone", BlockState::Granted, "", "5"),
        ];
        let seen = BTreeMap::from([("v4-198-18-0-16-28".to_string(), 100)]);
        let named = blocks.iter().map(|(name, block)| (name.as_str(), block));
        let ledger = with_ledgers(&pools, named, &seen, 500).remove(0).ledger;
        let cidr = |c: &str| -> Cidr { c.parse().unwrap() };
        assert_eq!(ledger.claims[&cidr("198.18.0.0/28")].node, "n1");
        let released = &ledger.cooling[&cidr("198.18.0.16/28")];
        assert_eq!((released.since_ms, released.node_gone), (100, false));
        let gone = &ledger.cooling[&cidr("198.18.0.32/28")];
        assert_eq!((gone.since_ms, gone.node_gone), (500, true));
        assert_eq!(ledger.non_reusable, [cidr("198.18.0.48/28")]);
        assert_eq!(ledger.versions.len(), 4);
        assert_eq!(ledger.versions[&cidr("198.18.0.48/28")], "4");
    }

    #[test]
    fn a_malformed_pool_object_is_refused_or_read_as_far_as_it_goes() {
        let read = Pool::parse(&json!({
            "metadata": {"name": "p", "generation": "two", "resourceVersion": 3},
            "spec": "ipv4",
            "status": {"conditions": [{"type": "Ready"}, "text", {"type": 7}], "counts": {"granted": 2}},
        }));
        assert_eq!((read.name.as_str(), read.generation), ("p", 0));
        assert_eq!(read.resource_version, "");
        assert!(read.spec.unwrap_err().contains("spec.network is required"));
        let ready = Condition {
            kind: Some("Ready".into()),
            ..Condition::default()
        };
        assert_eq!(read.conditions, [ready], "what is no condition is skipped");
        assert_eq!(
            read.status_text,
            r#"{"conditions":[{"type":"Ready"},"text",{"type":7}],"counts":{"granted":2}}"#
        );
        let nothing = Pool::parse(&json!("text"));
        assert_eq!(
            (nothing.status_text.as_str(), nothing.conditions),
            ("null", Vec::new())
        );
        assert!(nothing.spec.is_err());
    }
}
