//! What the informers delivered, kept as the decision reads it; which
//! Nodes are missing since when, and since when each block is cooling
//! (this process's view on its monotonic clock, kept while standing by
//! too; a process started later starts both over, which only delays a
//! reclaim).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::block::{Block, BlockSpec, BlockState, NODE_GONE, RELEASED, block_name};
use super::decide::{Bound, World, frees_at, grace_ends};
use super::demand::Demand;
use super::informer::{Item, Resource};
use super::pool::{self, Ledger, Pool, PoolSpec};
use super::refill;
use super::short_text::ShortText;
use super::status::{Names, Status, StatusIndex};
use super::taken::TakenIndex;
use crate::cidr::Cidr;
use crate::kube::fresh::{self, Streamed};

#[derive(Debug, Default, Clone)]
pub struct Cache {
    /// Values boxed: a map's nodes are about half full (names come in
    /// order), and a pointer wastes less of them than a whole object.
    pub nncs: BTreeMap<ShortText, Box<Demand>>,
    pub statuses: BTreeMap<ShortText, Box<Status>>,
    /// What the statuses say, by block and by node.
    index: StatusIndex,
    /// What the statuses and the ledgers take (lent to each pass).
    taken: TakenIndex,
    pub nodes: BTreeSet<ShortText>,
    /// The pools, checked against each other when one changes (not at
    /// every pass), each with its ledger as the blocks say (kept block by
    /// block: a pass reads it, never rebuilds it).
    pools: Arc<Vec<Pool>>,
    /// The MetisBlocks by name.
    pub blocks: BTreeMap<ShortText, Box<Block>>,
    /// What machines whose NodeNetworkConfig is gone last said they serve,
    /// by node: kept (in the index, and their Node followed) until their
    /// daemon writes an object again or their Node is gone past the grace,
    /// since blocks follow the machine, not its object.
    served_gone: BTreeMap<String, Vec<Cidr>>,
    /// When this process first saw each cooling block cooling (monotonic
    /// ms, by block name): its delay counts from then.
    cooling_seen: BTreeMap<String, i64>,
    /// The monotonic time (ms) of what arrives now ([`Cache::at`]).
    now_ms: i64,
    /// Each pool's spec as read, before that check refused any.
    specs: BTreeMap<String, Result<PoolSpec, String>>,
    listed: BTreeSet<Resource>,
    absent: BTreeMap<String, i64>,
    /// How many NodeNetworkConfigs and blocks follow each Node name (a
    /// granted block, one taken from a gone Node): kept as objects come
    /// and go, so a missing Node is noted in what one change costs.
    followed: BTreeMap<ShortText, usize>,
    /// Objects whose copy came from outside the stream (a GET after a 409,
    /// a PUT's answer), by version: the stream's copies of them are older
    /// until it delivers that very version (its order is the objects';
    /// the rule is the node's, `kube::fresh::against_awaited`).
    ahead: BTreeMap<(Resource, String), String>,
    /// Nodes whose NodeNetworkConfig, Node or blocks changed since the
    /// last pass: the next pass decides them.
    dirty: BTreeSet<ShortText>,
    /// The next pass decides every node (a list, a pool changed, this
    /// process began to lead).
    whole: bool,
    /// Blocks whose object vanished while it still carried its protection
    /// finalizer (an etcd restored from a backup, a finalizer removed by
    /// hand), by name: kept in `blocks` as cooling for their node, without
    /// a version, for the reclaim delay (from `cooling_seen`).
    vanished: BTreeSet<String>,
    /// No vanished block's delay and no grace of what a machine without
    /// its object serves ends before this time (monotonic ms): until then
    /// [`Cache::at`] walks none of them. `None` when a pool, a Node's
    /// absence or what is kept changed since the last walk.
    due: Option<i64>,
    /// How long a missing Node may come back (`--node-grace`): a vanished
    /// block of a missing Node is kept at least until its grace ends.
    node_grace_ms: i64,
    /// Blocks kept as vanished since the loop last asked, with their node
    /// ([`Cache::take_vanished`]): the loop says so loudly.
    vanished_news: Vec<(String, String)>,
    /// Blocks whose object a list brought back older than the copy held
    /// ([`Cache::relisted`]), with their node: the loop says so loudly.
    went_back_news: Vec<(String, String)>,
    /// The versions of block objects that left the view, by name, for the
    /// next object of the name ([`Cache::remember_gone`]): at most one
    /// entry per block the pools name.
    gone_past: BTreeMap<String, Box<[u64]>>,
    /// What a read at this process's takeover found that the stream has
    /// not delivered yet: an object's version (`Some`; `""` for a Node's
    /// presence) or its deletion (`None`). No pass runs until none is left
    /// ([`Cache::reach`]).
    catch_up: BTreeMap<(Resource, String), Option<String>>,
    /// Objects changed since the maps were last rebuilt with full nodes
    /// ([`Cache::refill`]).
    puts_since_refill: usize,
}

impl Cache {
    /// An empty view for a controller whose `--node-grace` is
    /// `node_grace_ms`.
    pub fn with_node_grace(node_grace_ms: i64) -> Cache {
        Cache {
            node_grace_ms,
            ..Cache::default()
        }
    }

    /// Every kind was listed at least once: the view is whole.
    pub fn synced(&self) -> bool {
        Resource::ALL.iter().all(|kind| self.listed.contains(kind))
    }

    /// A read of `kind` (each object's name and version) taken after this
    /// process acquired the Lease: another leader may have written what
    /// the stream has not delivered yet (a lagging watch), so the view
    /// must reach the read before this process decides. Versions are only
    /// compared for equality: what the view holds already is reached, the
    /// rest waits for the stream to deliver that version or the deletion
    /// (or for a list), which it does in order.
    pub fn reach(&mut self, kind: Resource, read: Vec<(String, String)>) {
        self.catch_up.retain(|(k, _), _| *k != kind);
        let read_names: BTreeSet<&str> = read.iter().map(|(name, _)| name.as_str()).collect();
        let gone: Vec<String> = (self.names(kind).into_iter())
            .filter(|name| !read_names.contains(name.as_str()))
            .collect();
        for name in gone {
            self.catch_up.insert((kind, name), None);
        }
        for (name, version) in read {
            if !self.holds(kind, &name, Some(&version)) {
                self.catch_up.insert((kind, name), Some(version));
            }
        }
    }

    /// The view reached the last read at a takeover ([`Cache::reach`]).
    pub fn caught_up(&self) -> bool {
        self.catch_up.is_empty()
    }

    /// How many objects the view still waits for ([`Cache::reach`]).
    pub fn catching_up(&self) -> usize {
        self.catch_up.len()
    }

    /// The names of `kind`'s objects the view holds from the API server
    /// (a block kept as vanished is not one).
    fn names(&self, kind: Resource) -> Vec<String> {
        match kind {
            Resource::Nnc => self.nncs.keys().map(ShortText::to_string).collect(),
            Resource::Node => self.nodes.iter().map(ShortText::to_string).collect(),
            Resource::Pool => self.specs.keys().cloned().collect(),
            Resource::Block => (self.blocks.keys())
                .filter(|name| self.on_server(kind, name))
                .map(ShortText::to_string)
                .collect(),
        }
    }

    /// Whether the view holds `kind`'s object `name` (a block kept as
    /// vanished too).
    fn has(&self, kind: Resource, name: &str) -> bool {
        match kind {
            Resource::Nnc => self.nncs.contains_key(name),
            Resource::Node => self.nodes.contains(name),
            Resource::Pool => self.specs.contains_key(name),
            Resource::Block => self.blocks.contains_key(name),
        }
    }

    /// Whether the view holds `kind`'s object `name` as the API server
    /// has it (a block kept as vanished is not).
    fn on_server(&self, kind: Resource, name: &str) -> bool {
        self.has(kind, name) && !(kind == Resource::Block && self.vanished.contains(name))
    }

    /// Whether the view holds `kind`'s object `name` at `version` (a Node
    /// has none: present), or, for `None`, none from the API server.
    fn holds(&self, kind: Resource, name: &str, version: Option<&str>) -> bool {
        match version {
            None => !self.on_server(kind, name),
            Some(_) if kind == Resource::Node => self.nodes.contains(name),
            Some(v) => self.version_of(kind, name) == Some(v),
        }
    }

    /// Ends the waits [`Cache::reach`] left for `kind` that the view now
    /// meets (after a change, a deletion or a list).
    fn reached(&mut self, kind: Resource) {
        if self.catch_up.is_empty() {
            return;
        }
        let waits: Vec<((Resource, String), Option<String>)> = (self.catch_up.iter())
            .filter(|((k, _), _)| *k == kind)
            .map(|(key, want)| (key.clone(), want.clone()))
            .collect();
        for ((k, name), want) in waits {
            if self.holds(k, &name, want.as_deref()) {
                self.catch_up.remove(&(k, name));
            }
        }
    }

    pub fn listed(&mut self, kind: Resource, items: Vec<Item>) {
        let statuses_before = match kind {
            Resource::Nnc => std::mem::take(&mut self.statuses),
            _ => BTreeMap::new(),
        };
        match kind {
            Resource::Nnc => self.nncs.clear(),
            Resource::Node => self.nodes.clear(),
            Resource::Pool => {
                Arc::make_mut(&mut self.pools).clear();
                self.specs.clear();
            }
            Resource::Block => {}
        }
        let before = match kind {
            Resource::Block => std::mem::take(&mut self.blocks),
            _ => BTreeMap::new(),
        };
        // A list is the whole truth of its moment: nothing is held ahead
        // of it any more (at worst a copy older than a GET's, which costs
        // one more 409, never a stuck object).
        self.ahead.retain(|(k, _), _| *k != kind);
        self.whole = true;
        for item in items {
            let item = match item {
                Item::Block(name, block) => {
                    let block = self.relisted(&name, *block, &before);
                    Item::Block(name, Box::new(block))
                }
                item => item,
            };
            self.put_item(kind, item);
        }
        // Objects the list lacks: what their machines said they serve stands.
        for (name, status) in statuses_before {
            if !self.nncs.contains_key(&name) {
                self.keep_served(&name, status.serving.as_slice());
            }
        }
        if kind == Resource::Block {
            self.keep_vanished(before);
            let blocks = &self.blocks;
            self.cooling_seen
                .retain(|name, _| blocks.get(name.as_str()).is_some_and(|b| is_cooling(b)));
            self.revalidate();
        }
        self.recount_followed();
        self.reindex();
        self.listed.insert(kind);
        self.reached(kind);
        self.refill();
    }

    /// Block `listed` as a list brought it, against the copy held before
    /// the list (`before`). A copy at a version seen before the held one's
    /// is older than it: the cluster's state went back (etcd restored
    /// from a backup). The held copy stays the block's truth, since the
    /// machines serve what it says, at the listed version, so that the
    /// next write of the block puts it back over the older object.
    fn relisted(
        &mut self,
        name: &str,
        mut listed: Block,
        before: &BTreeMap<ShortText, Box<Block>>,
    ) -> Block {
        let Some(held) = before.get(name) else {
            return listed;
        };
        let same = says(&listed) == says(held) && listed.protected == held.protected;
        if same || held.resource_version.is_empty() || !held.saw_before(&listed.resource_version) {
            listed.succeeds(held);
            return listed;
        }
        let node = held.spec.as_ref().map(|(_, spec)| spec.node.to_string());
        self.went_back_news
            .push((name.to_string(), node.unwrap_or_default()));
        Block {
            resource_version: listed.resource_version,
            protected: listed.protected,
            behind: true,
            ..(**held).clone()
        }
    }

    /// Block `gone`'s object left the view: the versions it and the
    /// objects of its name before it had are remembered for the next
    /// object of that name (one a restore brings back is older).
    fn remember_gone(&mut self, name: &str, gone: &Block) {
        let seen = gone.versions_seen();
        if !seen.is_empty() {
            self.gone_past.insert(name.to_string(), seen);
        }
    }

    /// Blocks whose object a list brought back older than the copy held,
    /// since the loop last asked, with the node the copy kept names
    /// ([`Cache::relisted`]).
    pub fn take_went_back(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.went_back_news)
    }

    /// The indexes over the statuses and ledgers again, from scratch
    /// (after a list replaced a kind whole, or the pools changed).
    fn reindex(&mut self) {
        self.index = self.index_from_scratch();
        let ledgers = self.pools.iter().map(|p| &p.ledger);
        self.taken = TakenIndex::of(&self.statuses, ledgers);
    }

    /// The status index as the statuses and [`served_gone`](Cache::served_gone)
    /// make it.
    fn index_from_scratch(&self) -> StatusIndex {
        let mut index = StatusIndex::of(&self.statuses);
        for (name, cidrs) in &self.served_gone {
            index.serve(&self.node_name(name), cidrs);
        }
        index
    }

    /// Node `name`'s object is gone, its machine having said it serves
    /// `cidrs`: that stands until its daemon writes again or its Node is
    /// gone past the grace.
    fn keep_served(&mut self, name: &str, cidrs: &[Cidr]) {
        if cidrs.is_empty() || self.served_gone.contains_key(name) {
            return;
        }
        self.served_gone.insert(name.to_string(), cidrs.to_vec());
        let name_kept = self.node_name(name);
        self.index.serve(&name_kept, cidrs);
        self.follow(name, true);
        self.due = None;
    }

    /// What machines whose object is gone said they serve, as kept.
    pub fn served_without_object(&self) -> impl Iterator<Item = (&str, &[Cidr])> {
        (self.served_gone.iter()).map(|(name, cidrs)| (name.as_str(), cidrs.as_slice()))
    }

    /// What node `name`'s machine said with its object gone stands no
    /// more; the nodes around those blocks are decided again.
    fn drop_served(&mut self, name: &str) {
        let Some(cidrs) = self.served_gone.remove(name) else {
            return;
        };
        self.index.unserve(name, &cidrs);
        self.follow(name, false);
        for cidr in &cidrs {
            self.dirty_around(cidr);
        }
    }

    /// What arrives from now on arrives at `now_ms` (monotonic); blocks
    /// that vanished a reclaim delay ago are let go, and what machines gone
    /// past the grace said they serve is forgotten.
    /// Between those times it costs nothing, however many vanished.
    pub fn at(&mut self, now_ms: i64) {
        self.now_ms = now_ms;
        if self.due.is_some_and(|due| now_ms < due) {
            return;
        }
        let past_grace: Vec<String> = (self.served_gone.keys())
            .filter(|name| self.served_gone_until(name) <= now_ms)
            .cloned()
            .collect();
        for name in past_grace {
            self.drop_served(&name);
        }
        let cooled: Vec<String> = (self.vanished.iter())
            .filter(|name| self.vanished_until(name) <= now_ms)
            .cloned()
            .collect();
        for name in cooled {
            self.forget(Resource::Block, &name);
        }
        // After the forgetting: a Node no longer followed is not missing.
        let until = self.vanished.iter().map(|name| self.vanished_until(name));
        let graced = self
            .served_gone
            .keys()
            .map(|name| self.served_gone_until(name));
        self.due = Some(until.chain(graced).min().unwrap_or(i64::MAX));
    }

    /// When what node `name`'s machine said with its object gone stops
    /// standing: its Node gone past the grace (never while it is there).
    fn served_gone_until(&self, name: &str) -> i64 {
        (self.absent.get(name)).map_or(i64::MAX, |since| grace_ends(*since, self.node_grace_ms))
    }

    /// Block `name`'s copy, if held.
    fn block(&self, name: &str) -> Option<&Block> {
        self.blocks.get(name).map(|b| &**b)
    }

    /// When vanished block `name`'s reclaim delay ends (monotonic ms), and
    /// its node's grace if its Node is missing (as `decide::frees_at`).
    fn vanished_until(&self, name: &str) -> i64 {
        let since = self.cooling_seen.get(name).copied().unwrap_or(self.now_ms);
        self.kept_until(since, self.block(name))
    }

    /// [`vanished_until`](Cache::vanished_until) of `block`, cooling since
    /// `since`.
    fn kept_until(&self, since: i64, block: Option<&Block>) -> i64 {
        let block = block.and_then(|b| b.spec.as_ref());
        if block.is_some_and(|(_, spec)| spec.state == BlockState::NonReusable) {
            return i64::MAX;
        }
        let pool = block.and_then(|(_, spec)| self.pools.iter().find(|p| *p.name == *spec.pool));
        let delay = pool.map_or(pool::DEFAULT_RECLAIM_DELAY_MS, Pool::reclaim_delay_ms);
        let missing_since = block.and_then(|(_, spec)| self.absent.get(&*spec.node));
        frees_at(since, delay, missing_since.copied(), self.node_grace_ms)
    }

    /// The blocks of `before` (the view before a list) that the list
    /// lacks: those that vanished are kept as [`vanished`](Cache::vanished)
    /// ones, and so are those kept so before, until their delay ends.
    fn keep_vanished(&mut self, before: BTreeMap<ShortText, Box<Block>>) {
        for (name, old) in before {
            if self.blocks.contains_key(name.as_str()) {
                continue;
            }
            let seen = self.cooling_seen.get(name.as_str()).copied();
            if self.keep_if_vanished(&name, &old, seen) {
                continue;
            }
            match self.vanished.contains(name.as_str()) {
                true => {
                    self.blocks.insert(name, old);
                }
                false => self.remember_gone(&name, &old),
            }
        }
        let blocks = &self.blocks;
        self.vanished
            .retain(|name| blocks.contains_key(name.as_str()));
    }

    /// Block `name`'s object went from under its copy `old` (seen cooling
    /// since `seen`) without a deletion: if that copy still carried its
    /// finalizer, its block cools for its node — from now, or for what is
    /// left of its delay if it was cooling already. Whether it is kept.
    fn keep_if_vanished(&mut self, name: &str, old: &Block, seen: Option<i64>) -> bool {
        let Some(kept) = kept_when_vanished(old) else {
            return false;
        };
        let since = match seen {
            Some(seen) if is_cooling(old) => seen,
            _ => self.now_ms,
        };
        let until = self.kept_until(since, Some(&kept));
        if until <= self.now_ms {
            // Cooled already: another replica let it go while this one
            // was not listening (a relist after a 410), or nothing is left
            // to wait for either way.
            return false;
        }
        let node = kept.spec.as_ref().map(|(_, s)| s.node.to_string());
        if is_cooling(&kept) {
            self.cooling_seen.insert(name.to_string(), since);
        }
        self.blocks.insert(name.into(), Box::new(kept));
        self.vanished.insert(name.to_string());
        self.due = self.due.map(|due| due.min(until));
        self.vanished_news
            .push((name.to_string(), node.unwrap_or_default()));
        true
    }

    /// The blocks kept as vanished since the last call, each with the node
    /// it cools for ("" for a NonReusable one).
    pub fn take_vanished(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.vanished_news)
    }

    /// Cooling blocks that `old` held and the status now kept for `name`
    /// (none: the object is gone) does not: they left a status now, and
    /// their delay counts from now (not from when this process first saw
    /// them cooling while a status still held them).
    fn left_status(&mut self, old: Option<Box<Status>>, name: Option<&String>) {
        let Some(old) = old else { return };
        let now = name.and_then(|n| self.statuses.get(n.as_str()));
        let left: Vec<String> = old
            .entries
            .iter()
            .filter_map(|e| e.cidr)
            .filter(|cidr| !now.is_some_and(|s| s.entries.iter().any(|e| e.cidr == Some(*cidr))))
            .map(|cidr| block_name(&cidr))
            .filter(|name| self.block(name).is_some_and(is_cooling))
            .collect();
        for name in left {
            self.cool_since(&name, self.now_ms);
        }
    }

    /// The indexes follow node `name`'s status, which was `old`.
    fn reindex_status(&mut self, old: Option<&Status>, name: &str) {
        if let Some(old) = old {
            self.taken.remove_status(old);
            self.index.remove(name, old);
        }
        if let Some((name, now)) = self.statuses.get_key_value(name) {
            self.taken.add_status(now);
            self.index.add(name, now);
        }
        self.dirty_overlapping(old, name);
    }

    /// The nodes whose statuses hold a block overlapping one that entered
    /// or left `name`'s status (`old` is the status before) are decided
    /// again: what they are told of an overlap may change with it; so are
    /// those around a block its machine began or stopped saying it serves.
    fn dirty_overlapping(&mut self, old: Option<&Status>, name: &str) {
        let now = self.statuses.get(name).map(|s| &**s);
        let held = |s: &Status| s.entries.iter().filter_map(|e| e.cidr).collect();
        let serving = |s: &Status| s.serving.as_slice().iter().copied().collect();
        let (held, serving) = (changed(old, now, held), changed(old, now, serving));
        for cidr in held {
            self.dirty_status_holders(&cidr);
        }
        // What a machine serves holds a block back from others.
        for cidr in serving {
            self.dirty_around(&cidr);
        }
    }

    /// Whether a missing Node's NodeNetworkConfig exists and says the Node
    /// is gone decides whether the blocks taken from it still count as
    /// taken: when that changes, the nodes holding or serving a block
    /// overlapping one of them are decided again.
    fn dirty_around_blocks_of_missing(&mut self, node: &str) {
        // Only a missing Node's blocks are kept for it by that.
        if self.absent.contains_key(node) {
            self.dirty_around_blocks_of(node);
        }
    }

    /// The nodes holding or serving a block overlapping one of `node`'s:
    /// a walk over every block, on a rare change (a missing Node's object
    /// written or deleted, a Node gone missing or back).
    fn dirty_around_blocks_of(&mut self, node: &str) {
        // A pass over every node comes anyway (after a list, say).
        if self.whole {
            return;
        }
        let cidrs: Vec<Cidr> = (self.blocks.values())
            .filter_map(|b| b.spec.as_ref())
            .filter(|(_, spec)| *spec.node == *node)
            .map(|(cidr, _)| *cidr)
            .collect();
        for cidr in &cidrs {
            self.dirty_around(cidr);
        }
    }

    /// The nodes that say they serve a block overlapping `cidr`, those
    /// whose statuses hold one, and those its block objects name (a block
    /// taken from a Node that is back waits for what others hold or serve
    /// of it to go).
    fn dirty_around(&mut self, cidr: &Cidr) {
        let serving = self.index.serving_overlapping(cidr);
        self.dirty.extend(serving.into_iter().cloned());
        for other in self.taken.overlapping(cidr) {
            self.dirty_holders_of(&other);
            let block = self.blocks.get(block_name(&other).as_str());
            if let Some((_, spec)) = block.and_then(|b| b.spec.as_ref()) {
                self.dirty.insert(spec.node.clone());
            }
        }
    }

    /// The nodes whose statuses hold a block overlapping `cidr`.
    fn dirty_status_holders(&mut self, cidr: &Cidr) {
        for other in self.taken.overlapping(cidr) {
            self.dirty_holders_of(&other);
        }
    }

    /// The nodes whose statuses hold `cidr` itself.
    fn dirty_holders_of(&mut self, cidr: &Cidr) {
        let holders = self.index.held.get(cidr).map_or(&[][..], Names::kept);
        self.dirty.extend(holders.iter().cloned());
    }

    /// The delay of these blocks, released again, starts over.
    /// Only blocks cooling now: a restart noted for one granted since
    /// would make its next cooling start early.
    pub fn restart_cooling(&mut self, restarts: &[(String, i64)]) {
        for (name, since) in restarts {
            if self.block(name).is_some_and(is_cooling) {
                self.cool_since(name, *since);
            }
        }
    }

    /// A copy read outside the stream (a GET after a 409, a PUT's answer):
    /// newer than anything the stream has delivered of the object, so the
    /// stream's copies are skipped until it catches up with this version.
    pub fn put_fetched(&mut self, kind: Resource, item: Item) {
        let key = (kind, item.name().to_string());
        let version = item.resource_version().to_string();
        // The stream delivered this very version already (a 409 the
        // object's history does not show): nothing to wait for.
        let delivered = self.version_of(kind, &key.1) == Some(version.as_str());
        self.ahead.remove(&key);
        self.put(kind, item);
        if !(version.is_empty() || delivered) {
            self.ahead.insert(key, version);
        }
    }

    fn version_of(&self, kind: Resource, name: &str) -> Option<&str> {
        match kind {
            Resource::Nnc => self.nncs.get(name).map(|n| &*n.resource_version),
            Resource::Node => None,
            Resource::Pool => self
                .pools
                .iter()
                .find(|pool| pool.name == name)
                .map(|pool| pool.resource_version.as_str()),
            Resource::Block => self
                .blocks
                .get(name)
                .map(|block| block.resource_version.as_str()),
        }
    }

    /// A copy the stream delivered; whether it changed the view (the
    /// echo of this process's own write, or a version held already, does
    /// not, and calls for no pass).
    pub fn put(&mut self, kind: Resource, item: Item) -> bool {
        let changed = self.put_item(kind, item);
        self.reached(kind);
        self.puts_since_refill += usize::from(changed);
        if refill::due(self.puts_since_refill, self.held()) {
            self.refill();
        }
        changed
    }

    /// The objects held (Nodes, NNCs, blocks).
    fn held(&self) -> usize {
        self.nodes.len() + self.nncs.len() + self.blocks.len()
    }

    /// Rebuilds the maps with full nodes: filled in key order, as lists
    /// and grants fill them, they keep about half of each node empty. After
    /// each list, and once an eighth of what is held was put since the
    /// last ([`refill::due`]).
    fn refill(&mut self) {
        self.puts_since_refill = 0;
        refill::map(&mut self.nncs);
        refill::map(&mut self.statuses);
        refill::map(&mut self.blocks);
        refill::set(&mut self.nodes);
        refill::map(&mut self.followed);
        self.index.refill();
        self.taken.refill();
        for pool in Arc::make_mut(&mut self.pools) {
            pool.ledger.refill();
        }
    }

    fn put_item(&mut self, kind: Resource, item: Item) -> bool {
        let name = item.name().to_string();
        let version = item.resource_version().to_string();
        let key = (kind, name);
        match fresh::against_awaited(self.ahead.get(&key).map(String::as_str), &version) {
            Streamed::Reached => {
                self.ahead.remove(&key);
                return false;
            }
            Streamed::Behind => return false,
            Streamed::News => {}
        }
        // A block written back over an older object (`behind`) takes the
        // copy its write brings, unchanged or not.
        let behind =
            kind == Resource::Block && self.blocks.get(key.1.as_str()).is_some_and(|b| b.behind);
        if !version.is_empty() && self.version_of(kind, &key.1) == Some(version.as_str()) && !behind
        {
            return false;
        }
        match item {
            Item::Nnc(name, nnc, status) => {
                self.drop_served(&name);
                let kept_name = self.node_name(&name);
                self.dirty.insert(kept_name.clone());
                let told = status.gone_told;
                let old = self.statuses.insert(kept_name.clone(), Box::new(status));
                if old.as_ref().is_none_or(|o| o.gone_told != told) {
                    self.dirty_around_blocks_of_missing(&name);
                }
                self.reindex_status(old.as_deref(), &name);
                self.left_status(old, Some(&name));
                if self.nncs.insert(kept_name, nnc).is_none() {
                    self.follow(&name, true);
                }
            }
            Item::Node(name) => {
                // A Node's heartbeats change nothing the decision reads.
                let kept_name = self.node_name(&name);
                if !self.nodes.insert(kept_name.clone()) {
                    return false;
                }
                self.note_absence(&name);
                self.dirty.insert(kept_name);
            }
            Item::Pool(pool) => {
                if self.same_spec(&pool) {
                    self.pool_status_changed(*pool);
                    return true;
                }
                self.specs.insert(pool.name.clone(), pool.spec.clone());
                let pools = Arc::make_mut(&mut self.pools);
                pools.retain(|p| p.name != pool.name);
                pools.push(*pool);
                self.revalidate();
                self.whole = true;
            }
            Item::Block(name, block) => self.put_block(&name, *block),
        }
        true
    }

    /// A block's copy into the view (its ledger, the nodes it follows and
    /// those it concerns); it succeeds the copy held, or the versions
    /// remembered of its name.
    fn put_block(&mut self, name: &str, mut block: Block) {
        if let Some((_, spec)) = block.spec.as_mut() {
            spec.node = self.node_name(&spec.node);
        }
        self.vanished.remove(name);
        if is_cooling(&block) {
            let now = self.now_ms;
            self.cooling_seen.entry(name.to_string()).or_insert(now);
        } else {
            self.cooling_seen.remove(name);
        }
        let follows = followed_node(&block).map(str::to_string);
        let name = ShortText::from(name);
        match self.blocks.get(&name) {
            Some(old) => block.succeeds(old),
            None => {
                if let Some(past) = self.gone_past.remove(name.as_str()) {
                    block.past = past;
                }
            }
        }
        let old = self.blocks.insert(name.clone(), Box::new(block));
        if self.other_size(old.as_deref(), &name) {
            return;
        }
        self.enter_ledger(old.as_deref(), &name);
        self.dirty_holders(old.as_deref(), &name);
        let followed = old.as_deref().and_then(followed_node).map(str::to_string);
        if followed != follows {
            followed.inspect(|n| self.follow(n, false));
            follows.inspect(|n| self.follow(n, true));
        }
    }

    /// Object `name` was found gone by a write (a 404); whether the view
    /// held it. A block whose copy here still carried its finalizer is
    /// kept as vanished: nothing says how it went.
    pub fn remove(&mut self, kind: Resource, name: &str) -> bool {
        let held = self.take_out(kind, name, true);
        self.reached(kind);
        held
    }

    /// Object `name` was deleted: by this process's own write (a DELETE,
    /// or the PUT that removed a marked block's last finalizer), or as a
    /// DELETED event says (the API server deletes an object only once its
    /// finalizers are gone). Nothing vanished; whether the view held it.
    pub fn forget(&mut self, kind: Resource, name: &str) -> bool {
        let held = self.take_out(kind, name, false);
        self.reached(kind);
        held
    }

    fn take_out(&mut self, kind: Resource, name: &str, may_vanish: bool) -> bool {
        self.ahead.remove(&(kind, name.to_string()));
        if !self.has(kind, name) {
            return false;
        }
        match kind {
            Resource::Nnc | Resource::Node => {
                self.dirty.insert(self.node_name(name));
            }
            Resource::Pool => self.whole = true,
            Resource::Block => {}
        }
        match kind {
            Resource::Nnc => {
                if self.nncs.remove(name).is_some() {
                    self.follow(name, false);
                }
                let old = self.statuses.remove(name);
                self.reindex_status(old.as_deref(), name);
                if let Some(old) = &old {
                    self.keep_served(name, old.serving.as_slice());
                }
                self.left_status(old, None);
                self.dirty_around_blocks_of_missing(name);
            }
            Resource::Node => {
                self.nodes.remove(name);
                self.note_absence(name);
            }
            Resource::Pool => {
                self.specs.remove(name);
                Arc::make_mut(&mut self.pools).retain(|p| p.name != name);
                self.revalidate();
            }
            Resource::Block => {
                let old = self.blocks.remove(name);
                let seen = self.cooling_seen.remove(name);
                // An object that still carried its finalizer cannot have
                // been deleted: the cluster's state went back. Its node may
                // still serve its addresses, so it cools for that node.
                let vanished = old.as_ref().filter(|_| may_vanish);
                if !vanished.is_some_and(|old| self.keep_if_vanished(name, old, seen)) {
                    self.vanished.remove(name);
                    if let Some(old) = &old {
                        self.remember_gone(name, old);
                    }
                }
                if self.other_size(old.as_deref(), name) {
                    return true;
                }
                self.enter_ledger(old.as_deref(), name);
                self.dirty_holders(old.as_deref(), name);
                let follows = self.block(name).and_then(followed_node);
                let followed = old.as_deref().and_then(followed_node);
                if followed != follows {
                    let (followed, follows) =
                        (followed.map(str::to_string), follows.map(str::to_string));
                    followed.inspect(|n| self.follow(n, false));
                    follows.inspect(|n| self.follow(n, true));
                }
            }
        }
        true
    }

    /// Whether `pool` is held with the same spec (as read, before the
    /// overlap check) and the same creation: what validation and the
    /// ledgers depend on.
    fn same_spec(&self, pool: &Pool) -> bool {
        self.specs.get(&pool.name) == Some(&pool.spec)
            && self
                .pools
                .iter()
                .any(|p| p.name == pool.name && p.created == pool.created)
    }

    /// A pool whose spec stands changed elsewhere (its status, the echo of
    /// the controller's own write of its counts): no node's decision reads
    /// that, so the ledgers stay and no pass over every node is called for.
    fn pool_status_changed(&mut self, read: Pool) {
        let pools = Arc::make_mut(&mut self.pools);
        if let Some(pool) = pools.iter_mut().find(|p| p.name == read.name) {
            pool.resource_version = read.resource_version;
            pool.generation = read.generation;
            pool.status_text = read.status_text;
            pool.conditions = read.conditions;
        }
    }

    /// Whether block `name`, which was `old` (a new object, or gone now),
    /// adds or takes a block of another size than a pool's for its
    /// addresses: the pools are then checked again (`pool::validate`), the
    /// ledgers and indexes rebuilt and every node decided.
    fn other_size(&mut self, old: Option<&Block>, name: &str) -> bool {
        let cidr = |b: Option<&Block>| b.and_then(|b| b.spec.as_ref()).map(|(c, _)| *c);
        let (before, after) = (cidr(old), cidr(self.block(name)));
        let odd =
            |c: &Option<Cidr>| c.is_some_and(|c| pool::is_other_size(self.specs.values(), &c));
        if before == after || !(odd(&before) || odd(&after)) {
            return false;
        }
        self.revalidate();
        self.recount_followed();
        self.whole = true;
        true
    }

    /// Checks the pools against each other again, from their specs as read.
    fn revalidate(&mut self) {
        self.due = None;
        let pools = Arc::make_mut(&mut self.pools);
        for pool in pools.iter_mut() {
            if let Some(spec) = self.specs.get(&pool.name) {
                pool.spec = spec.clone();
            }
        }
        let blocks: Vec<_> = self
            .blocks
            .values()
            .filter_map(|b| Some(b.spec.as_ref()?.0))
            .collect();
        pool::validate(pools, &blocks);
        self.rebuild_ledgers();
    }

    /// Every ledger again from the blocks (the pools changed, or a list
    /// replaced the blocks).
    fn rebuild_ledgers(&mut self) {
        let pools = Arc::make_mut(&mut self.pools);
        for pool in pools.iter_mut() {
            pool.ledger = Ledger::default();
        }
        for (name, block) in &self.blocks {
            let since = self.cooling_seen.get(name.as_str()).copied();
            pool::enter_block(pools, block, since.unwrap_or(self.now_ms));
        }
        self.reindex();
    }

    /// The ledgers follow block `name`, which was `old` and is now as
    /// `self.blocks` holds it (or gone).
    fn enter_ledger(&mut self, old: Option<&Block>, name: &str) {
        let pools = Arc::make_mut(&mut self.pools);
        if let Some((cidr, _)) = old.and_then(|b| b.spec.as_ref())
            && pool::leave_block(pools, cidr)
        {
            self.taken.remove(*cidr);
        }
        if let Some(block) = self.blocks.get(name) {
            let since = self.cooling_seen.get(name).copied();
            if let Some(cidr) = pool::enter_block(pools, block, since.unwrap_or(self.now_ms)) {
                self.taken.add(cidr);
            }
        }
    }

    /// The nodes block `name` named before (`old`) and names now, those
    /// that say they serve it and those whose statuses hold it (or an
    /// overlapping block) are decided again.
    fn dirty_holders(&mut self, old: Option<&Block>, name: &str) {
        let now = self.blocks.get(name).map(|b| &**b);
        let mut cidrs = BTreeSet::new();
        for block in old.into_iter().chain(now) {
            if let Some((cidr, spec)) = &block.spec {
                self.dirty.insert(spec.node.clone());
                cidrs.insert(*cidr);
            }
        }
        for cidr in &cidrs {
            self.dirty_around(cidr);
        }
    }

    /// What the next pass decides: the nodes changed since the last one
    /// and those it left unsettled (`carried`), or every node (`None`).
    /// Both start over.
    pub fn take_scope(&mut self, carried: BTreeSet<ShortText>) -> Option<BTreeSet<ShortText>> {
        let dirty = std::mem::take(&mut self.dirty);
        if std::mem::take(&mut self.whole) {
            return None;
        }
        let mut scope = carried;
        scope.extend(dirty);
        Some(scope)
    }

    /// The next pass decides every node.
    pub fn decide_all(&mut self) {
        self.whole = true;
    }

    /// Cooling block `name` cools from `since` (monotonic ms).
    fn cool_since(&mut self, name: &str, since: i64) {
        self.cooling_seen.insert(name.to_string(), since);
        if self.vanished.contains(name) {
            self.due = None;
        }
        let Some((cidr, _)) = self.blocks.get(name).and_then(|b| b.spec.as_ref()) else {
            return;
        };
        for pool in Arc::make_mut(&mut self.pools).iter_mut() {
            if let Some(cooling) = pool.ledger.cooling.get_mut(cidr) {
                cooling.since_ms = since;
            }
        }
    }

    /// The pools, checked against each other.
    pub fn pools(&self) -> Arc<Vec<Pool>> {
        Arc::clone(&self.pools)
    }

    /// Node `name` as the cache keeps it: one kept already (a Node, an
    /// NNC, a followed name) is cloned, so that a name too long to be kept
    /// inline is one allocation however many maps and blocks name it.
    fn node_name(&self, name: &str) -> ShortText {
        (self.nodes.get(name))
            .or_else(|| self.nncs.get_key_value(name).map(|(k, _)| k))
            .or_else(|| self.followed.get_key_value(name).map(|(k, _)| k))
            .map_or_else(|| name.into(), ShortText::clone)
    }

    /// One NodeNetworkConfig or block more (`more`) or less follows Node
    /// `name`.
    fn follow(&mut self, name: &str, more: bool) {
        let count = self.followed.entry(self.node_name(name)).or_default();
        *count = if more {
            count.saturating_add(1)
        } else {
            count.saturating_sub(1)
        };
        if *count == 0 {
            self.followed.remove(name);
        }
        self.note_absence(name);
    }

    /// Notes whether Node `name` is missing now: something follows it and
    /// it is not there (since when it is kept while that stays so).
    fn note_absence(&mut self, name: &str) {
        let was = self.absent.contains_key(name);
        if self.followed.contains_key(name) && !self.nodes.contains(name) {
            let now = self.now_ms;
            self.absent.entry(name.to_string()).or_insert(now);
        } else {
            self.absent.remove(name);
        }
        // Its blocks cool until its grace ends while it is missing: a
        // vanished one may be kept longer or shorter now, and what
        // overlapping blocks' holders are told of them changes.
        if was != self.absent.contains_key(name) {
            self.due = None;
            self.dirty_around_blocks_of(name);
        }
    }

    /// Counts again what follows each Node name (after a list replaced a
    /// kind whole), and notes which are missing.
    fn recount_followed(&mut self) {
        let mut followed: BTreeMap<ShortText, usize> = BTreeMap::new();
        let of_blocks = self.blocks.values().filter_map(|b| followed_node(b));
        let gone = self.served_gone.keys().map(String::as_str);
        for name in self
            .nncs
            .keys()
            .map(ShortText::as_str)
            .chain(of_blocks)
            .chain(gone)
        {
            *followed.entry(self.node_name(name)).or_default() += 1;
        }
        self.followed = followed;
        let followed = self.followed.keys().map(ShortText::to_string);
        let names: BTreeSet<String> = followed.chain(self.absent.keys().cloned()).collect();
        for name in names {
            self.note_absence(&name);
        }
    }

    /// The pools with their ledgers, as the blocks say now (kept as they
    /// come; debug builds check them against a rebuild from every block).
    pub fn pools_with_ledgers(&self) -> Arc<Vec<Pool>> {
        #[cfg(debug_assertions)]
        {
            let bare: Vec<Pool> = self
                .pools
                .iter()
                .map(|p| Pool {
                    ledger: Ledger::default(),
                    ..p.clone()
                })
                .collect();
            let mut rebuilt = pool::with_ledgers(
                &bare,
                self.blocks.iter().map(|(name, b)| (name.as_str(), &**b)),
                &self.cooling_seen,
                self.now_ms,
            );
            let mut kept = self.pools.to_vec();
            for pool in rebuilt.iter_mut().chain(kept.iter_mut()) {
                pool.ledger.non_reusable.sort();
            }
            debug_assert_eq!(kept, rebuilt, "the ledgers kept are not the blocks'");
        }
        Arc::clone(&self.pools)
    }

    /// What the statuses and ledgers take, lent to a pass (which leaves it
    /// as it found it): given back with [`Cache::give_back_taken`].
    pub fn lend_taken(&mut self) -> TakenIndex {
        #[cfg(debug_assertions)]
        {
            let ledgers = self.pools.iter().map(|p| &p.ledger);
            let rebuilt = TakenIndex::of(&self.statuses, ledgers);
            debug_assert_eq!(
                self.taken, rebuilt,
                "the taken index kept is not the view's"
            );
        }
        std::mem::take(&mut self.taken)
    }

    pub fn give_back_taken(&mut self, taken: TakenIndex) {
        self.taken = taken;
    }

    pub fn world<'a>(
        &'a self,
        pools: &'a [Pool],
        clock: Clock,
        scope: Option<&'a BTreeSet<ShortText>>,
    ) -> World<'a> {
        debug_assert_eq!(
            self.index,
            self.index_from_scratch(),
            "the status index kept is not the statuses'"
        );
        World {
            scope,
            pools,
            nncs: &self.nncs,
            statuses: &self.statuses,
            index: &self.index,
            absent: &self.absent,
            now_ms: clock.now_ms,
            wall_ms: clock.wall_ms,
            node_grace_ms: self.node_grace_ms,
            bound: Bound::NONE,
        }
    }
}

/// One reading of both clocks.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// Monotonic (ms since the process's first reading): delays are judged
    /// on it.
    pub now_ms: i64,
    /// Unix ms: only for times written.
    pub wall_ms: i64,
}

/// The Node a block follows: the one it is granted to, the gone one it
/// was taken from (back to it if it returns), or the one it cools for
/// after its object vanished (kept without a version: that node may still
/// serve it, and its grace counts).
fn followed_node(block: &Block) -> Option<&str> {
    let (_, spec) = block.spec.as_ref()?;
    let follows = spec.state == BlockState::Granted
        || (spec.state == BlockState::Cooling && *spec.reason == *NODE_GONE)
        || block.resource_version.is_empty();
    follows.then_some(&*spec.node)
}

/// The CIDRs that `of` finds in one of `old` and `now` (a status before and
/// after a change; none for a status absent) and not in the other.
fn changed(
    old: Option<&Status>,
    now: Option<&Status>,
    of: impl Fn(&Status) -> BTreeSet<Cidr>,
) -> Vec<Cidr> {
    let (before, after) = (old.map(&of), now.map(&of));
    let (before, after) = (before.unwrap_or_default(), after.unwrap_or_default());
    before.symmetric_difference(&after).copied().collect()
}

/// What is kept of `block` when its object vanished while it still
/// carried its protection finalizer (none when the controller had let it
/// go): a block that gave its node addresses (granted or cooling) cools
/// for that node, with no version; a NonReusable one stays retired, and
/// its object is made again (`behind`), since it is never free.
fn kept_when_vanished(block: &Block) -> Option<Block> {
    let (cidr, spec) = block.spec.as_ref()?;
    if block.resource_version.is_empty() || !block.protected {
        return None;
    }
    let retired = spec.state == BlockState::NonReusable;
    let spec = match spec.state {
        BlockState::NonReusable => spec.clone(),
        BlockState::Granted | BlockState::Cooling => {
            let gone = spec.state == BlockState::Cooling && *spec.reason == *NODE_GONE;
            BlockSpec {
                state: BlockState::Cooling,
                reason: (if gone { NODE_GONE } else { RELEASED }).into(),
                ..spec.clone()
            }
        }
    };
    Some(Block {
        resource_version: ShortText::default(),
        spec: Some((*cidr, spec)),
        protected: true,
        past: block.past.clone(),
        behind: retired,
    })
}

/// What a block's object says that the decision reads: its pool, state,
/// node and reason (its network follows its pool).
fn says(block: &Block) -> Option<(&str, BlockState, &str, &str)> {
    let (_, spec) = block.spec.as_ref()?;
    Some((&spec.pool, spec.state, &spec.node, &spec.reason))
}

fn is_cooling(block: &Block) -> bool {
    block
        .spec
        .as_ref()
        .is_some_and(|(_, spec)| spec.state == BlockState::Cooling)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn nnc(version: &str, pods: i64) -> Item {
        Item::parse(
            Resource::Nnc,
            json!({"metadata": {"name": "n1", "resourceVersion": version},
                    "spec": {"allocations": [{"network": "default", "pods": pods}]}}),
        )
    }

    fn version(cache: &Cache) -> &str {
        &cache.nncs["n1"].resource_version
    }

    /// After a takeover the view waits for what a read found: each object
    /// at the version read (the stream delivers it in order), each object
    /// the read lacks gone, a Node present; a list ends the waits it meets.
    /// Versions are compared for equality only (opaque ones here).
    #[test]
    fn a_takeovers_read_is_reached_before_the_view_is_caught_up() {
        let named = |name: &str, version: &str| (name.to_string(), version.to_string());
        let mut cache = Cache::default();
        cache.put(Resource::Nnc, nnc("a.1", 1));
        cache.put(Resource::Node, Item::Node("n1".into()));
        cache.reach(Resource::Nnc, vec![named("n1", "a.1")]);
        cache.reach(Resource::Node, vec![named("n1", "")]);
        assert!(cache.caught_up(), "what the view holds is reached");
        cache.reach(Resource::Nnc, vec![named("n1", "c.3"), named("n2", "b.2")]);
        cache.reach(Resource::Node, vec![named("n2", "")]);
        assert_eq!(cache.catching_up(), 4);
        cache.put(Resource::Nnc, nnc("b.2", 2));
        assert_eq!(
            cache.catching_up(),
            4,
            "an older copy of n1 reaches nothing"
        );
        cache.put(Resource::Nnc, nnc("c.3", 3));
        cache.put(Resource::Node, Item::Node("n2".into()));
        assert_eq!(cache.catching_up(), 2, "n2's object, and n1's Node gone");
        cache.forget(Resource::Node, "n1");
        let n2 = json!({"metadata": {"name": "n2", "resourceVersion": "b.2"}, "spec": {}});
        cache.listed(
            Resource::Nnc,
            vec![nnc("c.3", 3), Item::parse(Resource::Nnc, n2)],
        );
        assert!(cache.caught_up());
        // A read lacking a block: its deletion is waited for.
        let block = |version: &str| {
            let spec = BlockSpec {
                pool: "p".into(),
                network: "default".into(),
                cidr: "198.18.0.0/28".into(),
                node: "n1".into(),
                state: BlockState::Granted,
                reason: super::super::block::GRANTED.into(),
            };
            let name = "v4-198-18-0-0-28";
            let object = super::super::block::object(&spec, name, version, true);
            let (name, block) = Block::parse(object);
            Item::Block(name, Box::new(block))
        };
        cache.put(Resource::Block, block("d.4"));
        cache.reach(Resource::Block, Vec::new());
        assert!(!cache.caught_up());
        cache.put(Resource::Block, block("e.5"));
        assert!(!cache.caught_up(), "a change is no deletion");
        cache.forget(Resource::Block, "v4-198-18-0-0-28");
        assert!(cache.caught_up());
    }

    #[test]
    fn the_streams_older_copies_never_replace_one_read_after_a_conflict() {
        let mut cache = Cache::default();
        cache.put(Resource::Nnc, nnc("1", 1));
        cache.put_fetched(Resource::Nnc, nnc("3", 3));
        cache.put(Resource::Nnc, nnc("2", 2));
        assert_eq!(version(&cache), "3", "the stream's older copy was taken");
        cache.put(Resource::Nnc, nnc("3", 3));
        cache.put(Resource::Nnc, nnc("4", 4));
        assert_eq!(version(&cache), "4", "the stream caught up: it leads again");
        // A read of the version the stream already delivered (a 409 its
        // history does not show) waits for nothing.
        cache.put_fetched(Resource::Nnc, nnc("4", 4));
        cache.put(Resource::Nnc, nnc("5", 5));
        assert_eq!(version(&cache), "5");
        // A list replaces what was read ahead of it; so does a deletion.
        cache.put_fetched(Resource::Nnc, nnc("7", 7));
        cache.listed(Resource::Nnc, vec![nnc("6", 6)]);
        assert_eq!(version(&cache), "6");
        cache.put(Resource::Nnc, nnc("8", 8));
        assert_eq!(version(&cache), "8");
        cache.put_fetched(Resource::Nnc, nnc("9", 9));
        cache.remove(Resource::Nnc, "n1");
        cache.put(Resource::Nnc, nnc("10", 1));
        assert_eq!(version(&cache), "10");
    }

    /// The missing Nodes as the old full pass computed them: the names of
    /// NodeNetworkConfigs, of blocks that follow a Node and of machines
    /// whose object is gone but what they serve stands, without a Node.
    fn absent_from_scratch(cache: &Cache) -> BTreeSet<String> {
        let of_blocks = cache.blocks.values().filter_map(|b| followed_node(b));
        let gone = cache.served_gone.keys().map(String::as_str);
        cache
            .nncs
            .keys()
            .map(ShortText::as_str)
            .chain(of_blocks)
            .chain(gone)
            .filter(|n| !cache.nodes.contains(*n))
            .map(str::to_string)
            .collect()
    }

    /// Kept change by change, the missing Nodes are always what a full
    /// count finds, and each keeps the time it was first seen missing.
    #[test]
    fn missing_nodes_kept_change_by_change_match_a_full_count() {
        use crate::controller::block::{self, BlockSpec, RELEASED};
        let mut cache = Cache::default();
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut since: BTreeMap<String, i64> = BTreeMap::new();
        // The last copy delivered: delivered again, it changes nothing.
        let mut last: Option<(Resource, Value)> = None;
        let view = |c: &Cache| {
            let of = (&c.nncs, &c.statuses, &c.nodes, &c.blocks, &c.absent);
            format!("{of:?} {:?}", c.pools)
        };
        for step in 0..3_000i64 {
            cache.at(step);
            let node = format!("n{}", next(6));
            let block = format!("b{}", next(8));
            let before = view(&cache);
            let changed = match next(8) {
                0 => cache.put(Resource::Node, Item::Node(node)),
                1 => cache.remove(Resource::Node, &node),
                2 => {
                    let object =
                        json!({"metadata": {"name": node, "resourceVersion": step.to_string()}});
                    last = Some((Resource::Nnc, object.clone()));
                    cache.put(Resource::Nnc, Item::parse(Resource::Nnc, object))
                }
                3 => cache.remove(Resource::Nnc, &node),
                7 => match &last {
                    Some((kind, object)) => cache.put(*kind, Item::parse(*kind, object.clone())),
                    None => false,
                },
                4 | 5 => {
                    let (state, reason) = [
                        (BlockState::Granted, block::GRANTED),
                        (BlockState::Cooling, NODE_GONE),
                        (BlockState::Cooling, RELEASED),
                    ][usize::try_from(next(3)).unwrap()];
                    let spec = BlockSpec {
                        pool: "p".into(),
                        network: "default".into(),
                        cidr: "198.18.0.0/28".into(),
                        node: node.into(),
                        state,
                        reason: reason.into(),
                    };
                    let object = block::object(&spec, &block, &step.to_string(), true);
                    last = Some((Resource::Block, object.clone()));
                    cache.put(Resource::Block, Item::parse(Resource::Block, object))
                }
                _ => cache.remove(Resource::Block, &block),
            };
            if !changed {
                assert_eq!(
                    view(&cache),
                    before,
                    "step {step}: a change said to be none"
                );
            }
            let missing: BTreeSet<String> = cache.absent.keys().cloned().collect();
            assert_eq!(missing, absent_from_scratch(&cache), "step {step}");
            since.retain(|name, _| missing.contains(name));
            for (name, at) in &cache.absent {
                assert_eq!(*since.entry(name.clone()).or_insert(*at), *at, "{name}");
            }
        }
    }

    #[test]
    fn a_cooling_block_cools_from_when_it_was_seen_leaving_a_status() {
        let mut cache = Cache::default();
        cache.listed(
            Resource::Pool,
            vec![pool("p", "2026-01-01T00:00:00Z", "198.18.0.0/24")],
        );
        cache.at(1_000);
        let cooling = block_item("198.18.0.0/28", "n1", BlockState::Cooling, "5", true);
        cache.put(Resource::Block, cooling);
        let held = json!({"metadata": {"name": "n1", "resourceVersion": "6"},
                          "status": {"podCIDRs": [{"cidr": "198.18.0.0/28"}]}});
        cache.put(Resource::Nnc, Item::parse(Resource::Nnc, held));
        let since = |cache: &Cache| {
            let pools = cache.pools_with_ledgers();
            pools[0].ledger.cooling.values().next().unwrap().since_ms
        };
        assert_eq!(since(&cache), 1_000, "first seen cooling");
        // Its status held it until the object went: it cools from then.
        cache.at(9_000);
        cache.remove(Resource::Nnc, "n1");
        assert_eq!(since(&cache), 9_000);
    }

    /// A MetisBlock that vanishes while it still carries its finalizer
    /// (etcd restored from a backup older than its grant, here seen by a
    /// list, or by a write answered 404) cools for its node: no other node is granted
    /// it within the reclaim delay, and its node, saying it still serves
    /// it, is granted it again. One the controller let go leaves no trace.
    #[test]
    fn a_block_that_vanished_with_its_finalizer_cools_for_its_node() {
        use crate::controller::decide::{self, BlockOp};
        let nnc = |name: &str, version: &str, pods: i64, serving: &str, held: &[&str]| {
            let entries: Vec<Value> = held.iter().map(|c| json!({"cidr": c})).collect();
            let object = json!({
                "metadata": {"name": name, "resourceVersion": version,
                             "annotations": {"metis.x-k8s.io/serving": serving}},
                "spec": {"allocations": [{"network": "default", "pods": pods}]},
                "status": {"podCIDRs": entries}});
            Item::parse(Resource::Nnc, object)
        };
        let granted = |node: &str, cidr: &str, version: &str, protected: bool| {
            block_item(cidr, node, BlockState::Granted, version, protected)
        };
        let creates = |d: &decide::Decision| -> Vec<(String, String)> {
            let mut found = Vec::new();
            for w in &d.block_writes {
                if let BlockOp::Create(spec) = &w.op {
                    found.push((spec.cidr.to_string(), spec.node.to_string()));
                }
            }
            found
        };
        for by_list in [true, false] {
            let mut cache = with_pool("198.18.0.0/27");
            let nodes =
                ["n1", "n2"].map(|n| Item::parse(Resource::Node, json!({"metadata": {"name": n}})));
            cache.listed(Resource::Node, nodes.to_vec());
            let both = [
                granted("n1", "198.18.0.0/28", "5", true),
                granted("n2", "198.18.0.16/28", "6", false),
            ];
            cache.listed(Resource::Block, both.to_vec());
            let statuses = vec![
                nnc("n1", "7", 10, "198.18.0.0/28", &["198.18.0.0/28"]),
                nnc("n2", "8", 10, "", &["198.18.0.16/28"]),
            ];
            cache.listed(Resource::Nnc, statuses);
            assert!(decide_at(&mut cache, 1_000).block_writes.is_empty());
            // etcd goes back to before both grants, when only n2 asked.
            cache.at(2_000);
            if by_list {
                cache.listed(Resource::Block, Vec::new());
            } else {
                // Writes to them answered 404.
                cache.remove(Resource::Block, "v4-198-18-0-0-28");
                cache.remove(Resource::Block, "v4-198-18-0-16-28");
            }
            // Said once, for the block its finalizer held.
            let told = vec![("v4-198-18-0-0-28".to_string(), "n1".to_string())];
            assert_eq!(cache.take_vanished(), told, "{by_list}");
            assert!(cache.take_vanished().is_empty());
            let restored = vec![nnc("n1", "7", 0, "", &[]), nnc("n2", "8", 10, "", &[])];
            cache.listed(Resource::Nnc, restored);
            // n2's block, written without the finalizer, is free again.
            let d = decide_at(&mut cache, 2_000);
            let to_n2 = ("198.18.0.16/28".to_string(), "n2".to_string());
            assert_eq!(creates(&d), vec![to_n2.clone()], "{by_list}: {d:?}");
            // n1 says it still serves its block: granted to it again.
            cache.put(Resource::Nnc, nnc("n1", "9", 10, "198.18.0.0/28", &[]));
            let d = decide_at(&mut cache, 3_000);
            let to_n1 = ("198.18.0.0/28".to_string(), "n1".to_string());
            assert_eq!(creates(&d), vec![to_n1, to_n2.clone()], "{by_list}: {d:?}");
            // Said by nobody, it stays n1's for the delay, then is free.
            cache.put(Resource::Nnc, nnc("n1", "10", 0, "", &[]));
            let d = decide_at(&mut cache, 3_000);
            assert_eq!(creates(&d), vec![to_n2.clone()], "{by_list}: {d:?}");
            cache.at(2_000 + pool::DEFAULT_RECLAIM_DELAY_MS);
            assert!(cache.vanished.is_empty(), "{by_list}");
            assert!(!cache.blocks.contains_key("v4-198-18-0-0-28"), "{by_list}");
        }
    }

    /// A NonReusable block whose object vanishes with its finalizer (an
    /// etcd restore to before its release) is never free: it stays
    /// retired, past any delay, no node is granted it, and its object is
    /// made again; once that lands, nothing more is written for it.
    #[test]
    fn a_nonreusable_block_whose_object_vanished_stays_retired_and_is_made_again() {
        use crate::controller::decide::BlockOp;
        let name = "v4-198-18-0-0-28";
        let mut cache = with_pool("198.18.0.0/27");
        let node = Item::parse(Resource::Node, json!({"metadata": {"name": "n2"}}));
        cache.listed(Resource::Node, vec![node]);
        let retired =
            |version| block_item("198.18.0.0/28", "", BlockState::NonReusable, version, true);
        cache.listed(Resource::Block, vec![retired("5")]);
        let asking = json!({"metadata": {"name": "n2", "resourceVersion": "7"},
                            "spec": {"allocations": [{"network": "default", "pods": 20}]},
                            "status": {"podCIDRs": []}});
        cache.listed(Resource::Nnc, vec![Item::parse(Resource::Nnc, asking)]);
        cache.at(2_000);
        cache.listed(Resource::Block, Vec::new());
        assert_eq!(
            cache.take_vanished(),
            vec![(name.to_string(), String::new())]
        );
        let ops = |cache: &mut Cache, at| {
            let d = decide_at(cache, at);
            (d.block_writes.iter())
                .map(|w| match &w.op {
                    BlockOp::Create(spec) => (w.name.clone(), spec.node.to_string(), spec.state),
                    op => panic!("{op:?}"),
                })
                .collect::<Vec<_>>()
        };
        let made_again = (name.to_string(), String::new(), BlockState::NonReusable);
        let to_n2 = (
            "v4-198-18-0-16-28".to_string(),
            "n2".to_string(),
            BlockState::Granted,
        );
        assert_eq!(
            ops(&mut cache, 2_000),
            vec![made_again.clone(), to_n2.clone()]
        );
        let later = 2_000 + 10 * pool::DEFAULT_RECLAIM_DELAY_MS;
        cache.at(later);
        assert!(cache.blocks.contains_key(name) && cache.vanished.contains(name));
        assert_eq!(ops(&mut cache, later), vec![made_again, to_n2.clone()]);
        cache.put(Resource::Block, retired("9"));
        assert!(cache.vanished.is_empty() && !cache.blocks[name].behind);
        assert_eq!(ops(&mut cache, later), vec![to_n2]);
    }

    /// What a machine said it serves stands when its NodeNetworkConfig is
    /// deleted: no other node is granted the block until its daemon writes
    /// an object again, or its Node is gone past the grace.
    #[test]
    fn what_a_machine_serves_stands_after_its_object_is_deleted() {
        use crate::controller::decide::BlockOp;
        let nnc = |name: &str, version: &str, pods: i64, serving: &str| {
            let object = json!({
                "metadata": {"name": name, "resourceVersion": version,
                             "annotations": {"metis.x-k8s.io/serving": serving}},
                "spec": {"allocations": [{"network": "default", "pods": pods}]},
                "status": {"podCIDRs": []}});
            Item::parse(Resource::Nnc, object)
        };
        let creates = |cache: &mut Cache, at| -> Vec<(String, String)> {
            let d = decide_at(cache, at);
            (d.block_writes.iter())
                .filter_map(|w| match &w.op {
                    BlockOp::Create(spec) => Some((spec.cidr.to_string(), spec.node.to_string())),
                    _ => None,
                })
                .collect()
        };
        let served = ("198.18.0.0/28".to_string(), "n2".to_string());
        let other = ("198.18.0.16/28".to_string(), "n2".to_string());
        for back in [false, true] {
            let mut cache = with_pool("198.18.0.0/27");
            let nodes =
                ["n1", "n2"].map(|n| Item::parse(Resource::Node, json!({"metadata": {"name": n}})));
            cache.listed(Resource::Node, nodes.to_vec());
            let objects = vec![nnc("n1", "5", 0, "198.18.0.0/28"), nnc("n2", "6", 20, "")];
            cache.listed(Resource::Nnc, objects);
            // While its object says so, the block is claimed for n1.
            let claimed = ("198.18.0.0/28".to_string(), "n1".to_string());
            assert_eq!(creates(&mut cache, 1_000), vec![claimed, other.clone()]);
            cache.remove(Resource::Nnc, "n1");
            assert_eq!(creates(&mut cache, 1_000), vec![other.clone()], "{back}");
            if back {
                // Its daemon writes its object again, saying nothing more.
                cache.put(Resource::Nnc, nnc("n1", "7", 0, ""));
                assert_eq!(
                    creates(&mut cache, 1_000),
                    vec![served.clone(), other.clone()]
                );
                continue;
            }
            cache.remove(Resource::Node, "n1");
            cache.at(1_000 + 59_999);
            // Its grace's end is when `at` walks next.
            assert_eq!(cache.due, Some(61_000));
            assert_eq!(creates(&mut cache, 60_999), vec![other.clone()]);
            cache.at(1_000 + 60_000);
            assert!(cache.served_gone.is_empty());
            assert_eq!(
                creates(&mut cache, 61_000),
                vec![served.clone(), other.clone()]
            );
        }
    }

    /// A block taken from a Node that is back waits while another machine
    /// says it serves it; once that machine stops saying so, the pass over
    /// what changed decides the returning node too, and gives it back.
    #[test]
    fn a_block_waiting_on_another_server_goes_back_once_it_stops_serving() {
        use crate::controller::block::{self, BlockSpec};
        use crate::controller::decide::BlockOp;
        let nnc = |name: &str, version: &str, serving: &str| {
            let object = json!({
                "metadata": {"name": name, "resourceVersion": version,
                             "annotations": {"metis.x-k8s.io/serving": serving}},
                "spec": {"allocations": [{"network": "default", "pods": 0}]},
                "status": {"podCIDRs": []}});
            Item::parse(Resource::Nnc, object)
        };
        let cidr = "198.18.0.0/28";
        let spec = BlockSpec {
            pool: "p".into(),
            network: "default".into(),
            cidr: cidr.into(),
            node: "n3".into(),
            state: BlockState::Cooling,
            reason: NODE_GONE.into(),
        };
        let name = block::block_name(&cidr.parse().unwrap());
        let taken = Item::parse(Resource::Block, block::object(&spec, &name, "4", true));
        let mut cache = with_pool("198.18.0.0/27");
        let nodes =
            ["n2", "n3"].map(|n| Item::parse(Resource::Node, json!({"metadata": {"name": n}})));
        cache.listed(Resource::Node, nodes.to_vec());
        cache.listed(
            Resource::Nnc,
            vec![nnc("n2", "5", cidr), nnc("n3", "6", "")],
        );
        cache.listed(Resource::Block, vec![taken]);
        let back = |d: &crate::controller::decide::Decision| {
            (d.block_writes.iter()).any(|w| matches!(&w.op, BlockOp::Update(_, s) if *s.node == *"n3" && s.state == BlockState::Granted))
        };
        assert!(!back(&decide_at(&mut cache, 1_000)), "n2 serves it");
        assert_eq!(cache.take_scope(BTreeSet::new()), None);
        cache.put(Resource::Nnc, nnc("n2", "7", ""));
        let scope = cache.take_scope(BTreeSet::new()).unwrap();
        assert!(scope.contains("n3"), "{scope:?}");
        let pools = cache.pools_with_ledgers();
        let mut taken = cache.lend_taken();
        let clock = Clock {
            now_ms: 1_000,
            wall_ms: 1_795_971_701_000,
        };
        let decision = crate::controller::decide::decide(
            &cache.world(&pools, clock, Some(&scope)),
            &mut taken,
        );
        cache.give_back_taken(taken);
        assert!(back(&decision));
        let n3 = decision.nnc_writes.iter().find(|w| w.name == "n3");
        assert!(n3.is_some_and(|w| w.status.contains(cidr)), "{decision:?}");
    }

    /// Vanished blocks are let go each when its own delay ends, the pool's
    /// as it is then; between those times `at` walks none of them.
    #[test]
    fn vanished_blocks_are_let_go_each_at_its_own_delay_end() {
        let pool_with_delay = |delay: &str| {
            let object = json!({"metadata": {"name": "p", "resourceVersion": delay,
                                             "creationTimestamp": "2026-01-01T00:00:00Z"},
                                "spec": {"network": "default", "reclaimDelay": delay,
                                         "ipv4": {"cidrs": ["198.18.0.0/27"], "blockPrefixLength": 28}},
                                "status": {}});
            Item::parse(Resource::Pool, object)
        };
        let (first, second) = ("v4-198-18-0-0-28", "v4-198-18-0-16-28");
        let mut cache = Cache::default();
        cache.at(0);
        cache.listed(Resource::Pool, vec![pool_with_delay("10s")]);
        let blocks = vec![
            block_item("198.18.0.0/28", "n1", BlockState::Granted, "5", true),
            block_item("198.18.0.16/28", "n2", BlockState::Granted, "6", true),
        ];
        cache.listed(Resource::Block, blocks);
        cache.at(1_000);
        cache.remove(Resource::Block, first);
        cache.at(5_000);
        cache.remove(Resource::Block, second);
        cache.at(10_999);
        assert_eq!(cache.due, Some(11_000));
        assert_eq!(cache.vanished.len(), 2);
        cache.at(11_000);
        assert_eq!(cache.vanished.iter().collect::<Vec<_>>(), [second]);
        assert_eq!(cache.due, Some(15_000));
        // A shorter delay, edited into the pool, counts from the same start.
        cache.put(Resource::Pool, pool_with_delay("8s"));
        cache.at(12_999);
        assert_eq!(cache.vanished.len(), 1);
        cache.at(13_000);
        assert!(cache.vanished.is_empty() && !cache.blocks.contains_key(second));
        assert_eq!(cache.due, Some(i64::MAX));
    }

    /// A cooling block whose object goes without a deletion cools for what
    /// is left of its delay; one with nothing left (another replica let it
    /// go while this one was not listening: a relist after a 410) is not
    /// kept, nor is a deleted one. What is kept is told once.
    #[test]
    fn a_cooling_block_that_vanishes_keeps_only_what_is_left_of_its_delay() {
        let delay = pool::DEFAULT_RECLAIM_DELAY_MS;
        let [cooled, cooling, granted, deleted] =
            ["0", "16", "32", "48"].map(|at| format!("v4-198-18-0-{at}-28"));
        let mut cache = with_pool("198.18.0.0/26");
        cache.listed(
            Resource::Node,
            (1..=4).map(|n| Item::Node(format!("n{n}"))).collect(),
        );
        let blocks = vec![
            block_item("198.18.0.0/28", "n1", BlockState::Cooling, "5", true),
            block_item("198.18.0.16/28", "n2", BlockState::Granted, "6", true),
            block_item("198.18.0.32/28", "n3", BlockState::Granted, "7", true),
            block_item("198.18.0.48/28", "n4", BlockState::Granted, "8", true),
        ];
        cache.listed(Resource::Block, blocks);
        cache.at(1_000 + delay / 2);
        let released = block_item("198.18.0.16/28", "n2", BlockState::Cooling, "9", true);
        assert!(cache.put(Resource::Block, released));
        let now = 1_000 + delay;
        cache.at(now);
        assert!(cache.forget(Resource::Block, &deleted));
        assert!(cache.remove(Resource::Block, &cooled));
        let listed = block_item("198.18.0.16/28", "n2", BlockState::Cooling, "9", true);
        cache.listed(Resource::Block, vec![listed]);
        cache.listed(Resource::Block, Vec::new());
        let kept: Vec<&String> = cache.vanished.iter().collect();
        assert_eq!(kept, [&cooling, &granted]);
        assert!(
            !cache.blocks.contains_key(cooled.as_str())
                && !cache.blocks.contains_key(deleted.as_str())
        );
        let told = |name: &String, node: &str| (name.clone(), node.to_string());
        // In the order they went: `granted` with the first list.
        assert_eq!(
            cache.take_vanished(),
            [told(&granted, "n3"), told(&cooling, "n2")]
        );
        assert!(cache.take_vanished().is_empty());
        cache.at(1_000 + delay / 2 + delay - 1);
        assert_eq!(cache.vanished.len(), 2);
        cache.at(1_000 + delay / 2 + delay);
        assert_eq!(cache.vanished.iter().collect::<Vec<_>>(), [&granted]);
        cache.at(now + delay);
        assert!(cache.vanished.is_empty() && cache.blocks.is_empty());
        assert!(cache.take_vanished().is_empty());
    }

    /// A vanished block of a node whose Node is missing is kept until the
    /// grace ends, longer than its delay; once the Node is back, its delay
    /// alone counts.
    #[test]
    fn a_missing_nodes_vanished_block_is_kept_until_its_grace_ends() {
        let object = json!({"metadata": {"name": "p", "resourceVersion": "1",
                                         "creationTimestamp": "2026-01-01T00:00:00Z"},
                            "spec": {"network": "default", "reclaimDelay": "10s",
                                     "ipv4": {"cidrs": ["198.18.0.0/27"], "blockPrefixLength": 28}},
                            "status": {}});
        let (missing, present) = ("v4-198-18-0-0-28", "v4-198-18-0-16-28");
        let mut cache = Cache::with_node_grace(30_000);
        cache.at(0);
        cache.listed(Resource::Pool, vec![Item::parse(Resource::Pool, object)]);
        cache.listed(Resource::Node, vec![Item::Node("n2".into())]);
        let blocks = vec![
            block_item("198.18.0.0/28", "n1", BlockState::Granted, "5", true),
            block_item("198.18.0.16/28", "n2", BlockState::Granted, "6", true),
        ];
        cache.listed(Resource::Block, blocks);
        cache.at(1_000);
        cache.listed(Resource::Block, Vec::new());
        assert_eq!(cache.vanished.len(), 2);
        cache.at(11_000);
        assert_eq!(cache.vanished.iter().collect::<Vec<_>>(), [missing]);
        cache.at(19_000);
        assert_eq!(cache.vanished.iter().collect::<Vec<_>>(), [missing]);
        assert!(cache.put(Resource::Node, Item::Node("n1".into())));
        cache.at(19_001);
        assert!(cache.vanished.is_empty() && !cache.blocks.contains_key(present));
    }

    /// A block written by someone else (a stale controller's create, an
    /// operator's edit) puts the node it names and the nodes that say they
    /// serve it into the next pass's scope, and no other node.
    #[test]
    fn a_block_changed_elsewhere_decides_its_node_and_those_serving_it() {
        let nnc = |name: &str, serving: &str| {
            let object = json!({
                "metadata": {"name": name, "resourceVersion": "3",
                             "annotations": {"metis.x-k8s.io/serving": serving}},
                "spec": {"allocations": []}, "status": {}});
            Item::parse(Resource::Nnc, object)
        };
        let mut cache = with_pool("198.18.0.0/27");
        cache.listed(Resource::Block, Vec::new());
        let nodes =
            ["n1", "n2", "n3"].map(|n| nnc(n, if n == "n2" { "198.18.0.0/28" } else { "" }));
        cache.listed(Resource::Nnc, nodes.to_vec());
        assert_eq!(
            cache.take_scope(BTreeSet::new()),
            None,
            "a list decides every node"
        );
        let granted = block_item("198.18.0.0/28", "n1", BlockState::Granted, "9", true);
        assert!(cache.put(Resource::Block, granted));
        let scope = cache.take_scope(BTreeSet::new());
        assert_eq!(scope, Some(BTreeSet::from(["n1".into(), "n2".into()])));
    }

    /// NodeNetworkConfig `name` at `version` whose status holds `cidrs`,
    /// its Ready condition saying `ready` (a message) when given.
    fn nnc_holding(name: &str, version: &str, cidrs: &[&str], ready: Option<&str>) -> Item {
        let entries: Vec<Value> = cidrs.iter().map(|c| json!({"cidr": c})).collect();
        let conditions: Vec<Value> = ready
            .map(|message| {
                json!({"type": "Ready", "status": "False", "reason": "InvalidParametersToUpdateNetworkInterfacePodCIDRs",
                       "message": message, "lastTransitionTime": "2026-12-06T00:00:00Z"})
            })
            .into_iter()
            .collect();
        let object = json!({
            "metadata": {"name": name, "resourceVersion": version},
            "spec": {"allocations": []},
            "status": {"podCIDRs": entries, "conditions": conditions}});
        Item::parse(Resource::Nnc, object)
    }

    /// A status written by someone else (a stale controller, a hand edit)
    /// that gains or loses a block decides the nodes whose statuses hold
    /// an overlapping one: what they are told of the overlap changes.
    #[test]
    fn a_status_changed_elsewhere_decides_the_holders_of_overlapping_blocks() {
        let mut cache = with_pool("198.18.0.0/26");
        cache.listed(Resource::Block, Vec::new());
        let statuses = vec![
            nnc_holding("n1", "1", &["198.18.0.0/28"], None),
            nnc_holding("n2", "2", &[], None),
            nnc_holding("n3", "3", &["198.18.0.0/27"], None),
            nnc_holding("n4", "4", &["198.18.0.32/28"], None),
        ];
        cache.listed(Resource::Nnc, statuses);
        assert_eq!(cache.take_scope(BTreeSet::new()), None);
        let names = |names: &[&str]| Some(names.iter().map(|n| ShortText::from(*n)).collect());
        let copied = nnc_holding("n2", "5", &["198.18.0.0/28"], None);
        assert!(cache.put(Resource::Nnc, copied));
        assert_eq!(
            cache.take_scope(BTreeSet::new()),
            names(&["n1", "n2", "n3"])
        );
        let dropped = nnc_holding("n2", "6", &[], None);
        assert!(cache.put(Resource::Nnc, dropped));
        assert_eq!(
            cache.take_scope(BTreeSet::new()),
            names(&["n1", "n2", "n3"])
        );
        let unrelated = nnc_holding("n2", "7", &["198.18.0.48/28"], None);
        assert!(cache.put(Resource::Nnc, unrelated));
        assert_eq!(cache.take_scope(BTreeSet::new()), names(&["n2"]));
    }

    /// A missing Node's blocks count as taken until its NodeNetworkConfig
    /// says it is gone (or is deleted): that write decides the nodes
    /// holding a block overlapping one of them.
    #[test]
    fn a_gone_node_told_decides_the_holders_of_its_blocks() {
        use crate::controller::block::NODE_GONE;
        let mut cache = with_pool("198.18.0.0/26");
        let taken = block_item("198.18.0.0/28", "gone", BlockState::Cooling, "9", true);
        let Item::Block(name, mut taken) = taken else {
            unreachable!()
        };
        if let Some((_, spec)) = taken.spec.as_mut() {
            spec.reason = NODE_GONE.into();
        }
        cache.listed(Resource::Block, vec![Item::Block(name, taken)]);
        cache.listed(Resource::Node, vec![Item::Node("n1".into())]);
        let statuses = vec![
            nnc_holding("gone", "1", &[], None),
            nnc_holding("n1", "2", &["198.18.0.0/28"], None),
            nnc_holding("n2", "3", &["198.18.0.16/28"], None),
        ];
        cache.listed(Resource::Nnc, statuses);
        assert_eq!(cache.take_scope(BTreeSet::new()), None);
        let told = format!("Node gone {}", crate::controller::status::GONE_TOLD);
        assert!(cache.put(Resource::Nnc, nnc_holding("gone", "4", &[], Some(&told))));
        let scope = cache.take_scope(BTreeSet::new());
        assert_eq!(scope, Some(["gone", "n1"].map(ShortText::from).into()));
        assert!(cache.forget(Resource::Nnc, "gone"));
        assert_eq!(cache.take_scope(BTreeSet::new()), scope);
    }

    /// A node's released blocks cool until its grace ends while its Node
    /// is missing: the Node going or coming back decides the nodes holding
    /// a block overlapping one of them (what they are told changes).
    #[test]
    fn a_node_gone_missing_or_back_decides_the_holders_of_its_blocks() {
        let mut cache = with_pool("198.18.0.0/26");
        let released = block_item("198.18.0.0/28", "n1", BlockState::Cooling, "9", true);
        cache.listed(Resource::Block, vec![released]);
        let nodes = ["n1", "n2", "n3"].map(|n| Item::Node(n.into()));
        cache.listed(Resource::Node, nodes.to_vec());
        let statuses = vec![
            nnc_holding("n1", "1", &[], None),
            nnc_holding("n2", "2", &["198.18.0.0/29"], None),
            nnc_holding("n3", "3", &["198.18.0.32/28"], None),
        ];
        cache.listed(Resource::Nnc, statuses);
        assert_eq!(cache.take_scope(BTreeSet::new()), None);
        let scope = Some(["n1", "n2"].map(ShortText::from).into());
        assert!(cache.forget(Resource::Node, "n1"));
        assert_eq!(cache.take_scope(BTreeSet::new()), scope);
        assert!(cache.put(Resource::Node, Item::Node("n1".into())));
        assert_eq!(cache.take_scope(BTreeSet::new()), scope);
    }

    /// A block this process let go (the PUT removing a marked object's
    /// last finalizer, answered gone) is forgotten at once: the stream's
    /// DELETE that follows finds nothing, and nothing is kept as vanished.
    #[test]
    fn a_block_let_go_by_this_process_leaves_nothing_behind() {
        let mut cache = with_pool("198.18.0.0/27");
        let name = "v4-198-18-0-0-28";
        let cooling = block_item("198.18.0.0/28", "n1", BlockState::Cooling, "5", true);
        cache.listed(Resource::Block, vec![cooling]);
        cache.forget(Resource::Block, name);
        assert!(!cache.remove(Resource::Block, name));
        assert!(cache.blocks.is_empty() && cache.vanished.is_empty());
        assert!(cache.pools_with_ledgers()[0].ledger.cooling.is_empty());
    }

    /// A pass over every node, at `now_ms`.
    fn decide_at(cache: &mut Cache, now_ms: i64) -> crate::controller::decide::Decision {
        let pools = cache.pools_with_ledgers();
        let mut taken = cache.lend_taken();
        let clock = Clock {
            now_ms,
            wall_ms: 1_795_971_700_000 + now_ms,
        };
        let world = cache.world(&pools, clock, None);
        let decision = crate::controller::decide::decide(&world, &mut taken);
        cache.give_back_taken(taken);
        decision
    }

    /// etcd restored to before a block moved: a list brings its object
    /// back at a version this process saw before the copy it holds. The
    /// held copy (the block with n2, whose machine serves it) stays the
    /// truth at the listed version, is said once, and the next pass
    /// writes it back over the older object, until a copy of the object
    /// comes again (the write's answer, changed or not). A version never
    /// seen is taken as listed, and so is an older one that says the
    /// same; a block deleted and made again keeps the versions of its
    /// name.
    #[test]
    fn a_block_listed_older_than_the_copy_held_is_kept_and_written_back() {
        use crate::controller::decide::BlockOp;
        let (cidr, name) = ("198.18.0.0/28", "v4-198-18-0-0-28");
        let at = |node: &str, state: BlockState, version: &str| {
            block_item(cidr, node, state, version, true)
        };
        let says = |cache: &Cache| {
            let block = &cache.blocks[name];
            let node = block.spec.as_ref().map(|(_, s)| s.node.clone());
            (block.resource_version.clone(), node, block.behind)
        };
        let updates = |cache: &mut Cache| -> Vec<(String, String)> {
            let d = decide_at(cache, 2_000);
            (d.block_writes.iter())
                .filter_map(|w| match &w.op {
                    BlockOp::Update(version, spec) => {
                        Some((version.clone(), spec.node.to_string()))
                    }
                    _ => None,
                })
                .collect()
        };
        let mut cache = with_pool("198.18.0.0/27");
        cache.listed(Resource::Block, vec![at("n1", BlockState::Granted, "5")]);
        cache.put(Resource::Block, at("n1", BlockState::Cooling, "6"));
        cache.put(Resource::Block, at("n2", BlockState::Granted, "9"));
        cache.listed(Resource::Block, vec![at("n1", BlockState::Granted, "5")]);
        assert_eq!(says(&cache), ("5".into(), Some("n2".into()), true));
        let told = vec![(name.to_string(), "n2".to_string())];
        assert_eq!(cache.take_went_back(), told);
        assert!(cache.take_went_back().is_empty());
        assert_eq!(updates(&mut cache), [("5".to_string(), "n2".to_string())]);
        // Its write changed nothing (the answer at the same version).
        cache.put_fetched(Resource::Block, at("n2", BlockState::Granted, "5"));
        assert_eq!(says(&cache), ("5".into(), Some("n2".into()), false));
        assert!(updates(&mut cache).is_empty());
        // Never seen: as listed. Seen, saying the same: as listed.
        cache.listed(Resource::Block, vec![at("n3", BlockState::Granted, "77")]);
        assert_eq!(says(&cache), ("77".into(), Some("n3".into()), false));
        cache.put(Resource::Block, at("n3", BlockState::Granted, "78"));
        cache.listed(Resource::Block, vec![at("n3", BlockState::Granted, "77")]);
        assert_eq!(says(&cache), ("77".into(), Some("n3".into()), false));
        // Deleted, then made again for n4: an older object of the name is
        // older than the new one too.
        cache.forget(Resource::Block, name);
        cache.put(Resource::Block, at("n4", BlockState::Granted, "80"));
        cache.listed(Resource::Block, vec![at("n3", BlockState::Granted, "78")]);
        assert_eq!(says(&cache), ("78".into(), Some("n4".into()), true));
        cache.put(Resource::Block, at("n4", BlockState::Granted, "81"));
        assert_eq!(says(&cache), ("81".into(), Some("n4".into()), false));
    }

    /// Block `cidr` of pool "p" in `state` for `node`, as read at
    /// `version`, with its finalizer or without.
    fn block_item(
        cidr: &str,
        node: &str,
        state: BlockState,
        version: &str,
        protected: bool,
    ) -> Item {
        use crate::controller::block::{self, BlockSpec, GRANTED};
        let reason = match state {
            BlockState::Granted => GRANTED,
            _ => RELEASED,
        };
        let spec = BlockSpec {
            pool: "p".into(),
            network: "default".into(),
            cidr: cidr.into(),
            node: node.into(),
            state,
            reason: reason.into(),
        };
        let name = block::block_name(&cidr.parse().unwrap());
        Item::parse(
            Resource::Block,
            block::object(&spec, &name, version, protected),
        )
    }

    /// A node name too long to be kept inline is one copy of its text,
    /// however many maps and blocks name it: the Node, its NNC and status,
    /// the block granted to it, the ledger's claim, the status index.
    #[test]
    fn a_long_node_name_is_kept_once() {
        let long = "ip-10-0-1-23.us-west-2.compute.internal";
        let mut cache = with_pool("198.18.0.0/26");
        let node = json!({"metadata": {"name": long, "uid": "u1"}});
        cache.put(Resource::Node, Item::parse(Resource::Node, node));
        cache.put(
            Resource::Nnc,
            nnc_holding(long, "2", &["198.18.0.0/28"], None),
        );
        let block = block_item("198.18.0.0/28", long, BlockState::Granted, "3", true);
        cache.put(Resource::Block, block);
        let cidr: Cidr = "198.18.0.0/28".parse().unwrap();
        let pools = cache.pools_with_ledgers();
        let spec = cache.blocks.values().find_map(|b| b.spec.as_ref());
        let copies = [
            cache.nodes.get(long).map(ShortText::as_str),
            cache.nncs.get_key_value(long).map(|(k, _)| k.as_str()),
            cache.statuses.get_key_value(long).map(|(k, _)| k.as_str()),
            spec.map(|(_, s)| s.node.as_str()),
            pools[0].ledger.claims.get(&cidr).map(|h| h.node.as_str()),
            cache.followed.get_key_value(long).map(|(k, _)| k.as_str()),
            cache.index.held.get(&cidr).and_then(|names| names.first()),
        ];
        let first = copies[0].expect("the Node is kept");
        for (i, copy) in copies.iter().enumerate() {
            let copy = copy.unwrap_or_else(|| panic!("copy {i} is missing"));
            assert_eq!(copy, long);
            assert!(std::ptr::eq(copy, first), "copy {i} is a text of its own");
        }
    }

    /// A cache at 1 s, with a minute's grace for missing Nodes, that has
    /// listed pool "p" of `cidr` (/28 blocks).
    fn with_pool(cidr: &str) -> Cache {
        let mut cache = Cache::with_node_grace(60_000);
        cache.at(1_000);
        let pools = vec![pool("p", "2026-01-01T00:00:00Z", cidr)];
        cache.listed(Resource::Pool, pools);
        cache
    }

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

    /// A block object of another size than its pool's (a stale leader's,
    /// an older pool's) refuses the pool until it is gone; blocks of the
    /// pool's own size change nothing of that. Each turn is a pass over
    /// every node.
    #[test]
    fn a_block_of_another_size_refuses_its_pool_while_it_exists() {
        let mut cache = Cache::default();
        let created = "2026-01-01T00:00:00Z";
        cache.listed(Resource::Pool, vec![pool("p", created, "198.18.0.0/24")]);
        cache.listed(Resource::Block, Vec::new());
        cache.take_scope(BTreeSet::new());
        let block = |cidr: &str| {
            let name = block_name(&cidr.parse().unwrap());
            Item::parse(
                Resource::Block,
                json!({"metadata": {"name": name, "resourceVersion": "1"},
                       "spec": {"pool": "p", "network": "default", "cidr": cidr, "node": "n1",
                                "state": "Granted", "reason": "Granted"}}),
            )
        };
        assert!(cache.put(Resource::Block, block("198.18.0.16/28")));
        assert_eq!(valid(&cache), [("p".into(), true)]);
        assert_ne!(cache.take_scope(BTreeSet::new()), None);
        assert!(cache.put(Resource::Block, block("198.18.0.32/29")));
        assert_eq!(valid(&cache), [("p".into(), false)]);
        assert_eq!(cache.take_scope(BTreeSet::new()), None);
        // Its blocks stay in its ledger, refused or not.
        assert_eq!(cache.pools()[0].ledger.claims.len(), 2);
        assert!(cache.remove(Resource::Block, "v4-198-18-0-32-29"));
        assert_eq!(valid(&cache), [("p".into(), true)]);
        assert_eq!(cache.take_scope(BTreeSet::new()), None);
        assert_eq!(cache.pools()[0].ledger.claims.len(), 1);
    }

    /// A pool's new status (the echo of the controller's own write of its
    /// counts) is taken in without a pass over every node; a new spec or a
    /// re-created pool calls for one.
    #[test]
    fn a_pools_status_alone_calls_for_no_pass_over_every_node() {
        let mut cache = Cache::default();
        let created = "2026-01-01T00:00:00Z";
        cache.listed(Resource::Pool, vec![pool("p", created, "198.18.0.0/24")]);
        assert_eq!(
            cache.take_scope(BTreeSet::new()),
            None,
            "a list: every node"
        );
        let mut counted = pool("p", created, "198.18.0.0/24");
        if let Item::Pool(p) = &mut counted {
            p.resource_version = "2".into();
            p.status_text = r#"{"observedGeneration":1}"#.into();
        }
        assert!(cache.put(Resource::Pool, counted));
        assert_eq!(cache.take_scope(BTreeSet::new()), Some(BTreeSet::new()));
        let held = cache.pools();
        assert_eq!(held[0].resource_version, "2");
        assert_eq!(held[0].status_text, r#"{"observedGeneration":1}"#);
        for (version, changed) in [
            ("3", pool("p", created, "198.18.0.0/25")),
            ("4", pool("p", "2026-03-01T00:00:00Z", "198.18.0.0/25")),
        ] {
            let mut changed = changed;
            if let Item::Pool(p) = &mut changed {
                p.resource_version = version.into();
            }
            assert!(cache.put(Resource::Pool, changed));
            assert_eq!(cache.take_scope(BTreeSet::new()), None);
        }
    }
}
