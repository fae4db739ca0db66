//! One node, one address space: where blocks come from, how they follow
//! configuration changes, and what is isolated when a database breaks the
//! rules.
//!
//! Every source of blocks declares the ranges it wants: the CNI ranges of
//! a network (the last ADD's configuration), the daemon's `--cidr` flags,
//! the Node's `podCIDRs` and the NodeNetworkConfig's status. The static
//! sources (CNI, flags) are recorded in `metis_ranges`; a network's blocks
//! are then laid out from the union of what they want:
//!
//! - a wanted range that strictly contains blocks of the network *grows in
//!   place*: the oldest of them takes the new prefix and the others' rows
//!   (holders, cooling rows) move into it, in one transaction;
//! - a wanted range inside a wider block of the network *narrows* it: the
//!   block takes the range and the rest of its prefix becomes retired
//!   pieces, so no address ever has two rows in one network;
//! - a block no source wants any more is *retired*: `Withheld` (see
//!   `withhold`, so upstream's store cannot allocate from it or undrain it
//!   either), no new allocations, pods keep their addresses; it is deleted once no pod
//!   holds an address in it and its cooldowns are over; a range that comes
//!   back takes it back.
//!
//! Blocks of one network never overlap, and a block never overlaps a block
//! of another network unless one of the two is *isolated* (its addresses
//! are a separate address space). Blocks the layout cannot trust — an
//! address held twice, rows outside their prefix, an overlap that holds
//! pods on both sides — are *quarantined*: nothing new is allocated from
//! them (state `Withheld` too), their pods keep their addresses and DEL
//! works.
//!
//! All of this lives in Metis's own tables (`metis_blocks`, `metis_ranges`)
//! and settings; upstream's tables keep their meaning.

use std::collections::{BTreeMap, BTreeSet};

use rusqlite::{Connection, OptionalExtension, params};

use crate::cidr::{self, Cidr, Family};
use crate::store::db::{
    BlockState, ReserveMode, Store, StoreError, parse_addr, parse_cidr, parse_family, total_ips,
};
use crate::store::rows::block::{
    Quarantined, bounds_of, delete_block, ensure_record, frontier, insert_block, parse_text,
    quarantined, set_frontier, settle, text_at,
};
use crate::store::rows::free::{cooling, pod_held};

/// Where a block comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source {
    /// The `ranges` of a network's CNI configuration.
    Cni,
    /// The daemon's `--cidr NETWORK=CIDR` flags.
    Flag,
    /// The Node's `spec.podCIDRs`.
    Node,
    /// The NodeNetworkConfig's `status.podCIDRs`.
    Nnc,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Cni => "cni",
            Source::Flag => "flag",
            Source::Node => "node",
            Source::Nnc => "nnc",
        }
    }

    /// The source a name stored in `metis_ranges` or `metis_blocks` stands
    /// for.
    pub fn parse(text: &str) -> Option<Source> {
        [Source::Cni, Source::Flag, Source::Node, Source::Nnc]
            .into_iter()
            .find(|source| source.as_str() == text)
    }

    /// Sources whose blocks Metis lays out from recorded ranges; the others
    /// (the cluster's, adaptive) are taken as the cluster gives them.
    fn is_static(self) -> bool {
        matches!(self, Source::Cni | Source::Flag)
    }
}

/// A block's sources as `metis_blocks.sources` stores them: names, comma
/// separated. A name no release wrote is skipped.
pub(in crate::store) fn parse_sources(text: &str) -> BTreeSet<Source> {
    text.split(',').filter_map(Source::parse).collect()
}

/// A non-Deleting block as the layout sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::store) struct Placed {
    pub(in crate::store) id: i64,
    pub(in crate::store) cidr: Cidr,
    pub(in crate::store) state: BlockState,
    /// `None`: no Metis record of its sources (written by upstream or an
    /// older Metis, or added without a source).
    pub(in crate::store) sources: Option<BTreeSet<Source>>,
    pub(in crate::store) retired: bool,
    pub(in crate::store) quarantined: bool,
}

impl Placed {
    fn is_adaptive(&self) -> bool {
        self.sources
            .as_ref()
            .is_some_and(|s| s.iter().any(|source| !source.is_static()))
    }
}

/// What a source wants for one network and family: these ranges, in the
/// node's shared address space or isolated from it.
#[derive(Debug, Clone, Copy)]
pub struct Wish<'a> {
    pub source: Source,
    pub network: &'a str,
    pub family: Family,
    pub ranges: &'a [Cidr],
    pub isolated: bool,
}

/// What a layout pass changed, for the caller to log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayoutChanges {
    pub lines: Vec<String>,
    /// Ranges refused (they overlap another network's or a granted block),
    /// in words; everything else was laid out.
    pub refused: Vec<String>,
}

/// What [`Store::isolate_problems`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Isolation {
    /// Every quarantined block.
    pub quarantined: Vec<Quarantined>,
    /// Overlapping blocks without pods that were deleted, in words.
    pub deleted: Vec<String>,
    /// Blocks whose `allocated_ips` was recounted.
    pub recounted: usize,
}

impl Store {
    /// Adds a block (Ready, its first 64 rows and its reserved rows
    /// populated; the rest grows on demand). An existing (cidr, network)
    /// is left as is.
    /// A prefix overlapping another block of the node's address space is
    /// refused ([`StoreError::Overlap`]).
    pub fn add_cidr_block(
        &mut self,
        network: &str,
        cidr: &Cidr,
    ) -> Result<crate::store::db::AddOutcome, StoreError> {
        let mode = self.reserve;
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let outcome = add_block(&tx, mode, network, cidr, None)?;
        tx.commit()?;
        Ok(outcome)
    }

    /// Declares the ranges `source` wants for `network` and `family` and
    /// brings the network's blocks in line (see the module documentation).
    /// Reads only when nothing changed, so it can run on every ADD. A range
    /// of `source` that cannot be laid out fails the call and changes
    /// nothing; other sources' ranges that cannot are skipped and reported.
    pub fn configure(&mut self, wish: &Wish, now_ms: i64) -> Result<LayoutChanges, StoreError> {
        self.lay_out(wish, true, now_ms)
    }

    /// [`Store::configure`]; with `strict`, a range of the wish's own source
    /// that cannot be laid out fails the call.
    fn lay_out(
        &mut self,
        wish: &Wish,
        strict: bool,
        now_ms: i64,
    ) -> Result<LayoutChanges, StoreError> {
        let Wish {
            source,
            network,
            family,
            ranges,
            isolated,
        } = *wish;
        // Ranges of the other family are the caller's mistake, ignored here.
        let ranges: Vec<Cidr> = ranges
            .iter()
            .filter(|range| range.family() == family)
            .copied()
            .collect();
        let of_family = Wish {
            ranges: &ranges,
            ..*wish
        };
        if self.configured_as(&of_family, now_ms)? {
            return Ok(LayoutChanges::default());
        }
        let mode = self.reserve;
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let was_isolated = is_isolated(&tx, network)?;
        set_isolated(&tx, network, isolated)?;
        replace_wanted(&tx, source, network, family, &ranges)?;
        let changes = relayout(&tx, mode, &of_family, strict, now_ms)?;
        if was_isolated && !isolated {
            // Its blocks were checked against nobody: joining the shared
            // address space over another network's block would hand out
            // that network's addresses a second time.
            check_joins_shared_space(&tx, network)?;
        }
        tx.commit()?;
        Ok(changes)
    }

    /// Declares every range of `source` at once (the daemon's `--cidr`
    /// flags at start): networks the source no longer names lose its blocks.
    /// A range that cannot be laid out (it overlaps another network's block)
    /// is reported in `refused`; everything else is laid out.
    pub fn configure_all(
        &mut self,
        source: Source,
        ranges: &[(String, Cidr)],
        now_ms: i64,
    ) -> Result<LayoutChanges, StoreError> {
        let mut wanted: BTreeMap<(String, Family), Vec<Cidr>> = BTreeMap::new();
        for (network, family) in wanted_networks(&self.conn, source)? {
            wanted.entry((network, family)).or_default();
        }
        for (network, cidr) in ranges {
            wanted
                .entry((network.clone(), cidr.family()))
                .or_default()
                .push(*cidr);
        }
        let mut all = LayoutChanges::default();
        for ((network, family), cidrs) in wanted {
            let isolated = is_isolated(&self.conn, &network)?;
            let wish = Wish {
                source,
                network: &network,
                family,
                ranges: &cidrs,
                isolated,
            };
            let changes = self.lay_out(&wish, false, now_ms)?;
            all.lines.extend(changes.lines);
            all.refused.extend(changes.refused);
        }
        Ok(all)
    }

    /// The network's non-Deleting blocks that only the NodeNetworkConfig
    /// accounts for (no static or Node source): (block id, CIDR).
    pub fn nnc_only_blocks(
        &self,
        network: &str,
        family: Family,
    ) -> Result<Vec<(i64, Cidr)>, StoreError> {
        Ok(placed(&self.conn, network, family)?
            .into_iter()
            .filter(|p| {
                p.sources
                    .as_ref()
                    .is_some_and(|s| s.len() == 1 && s.contains(&Source::Nnc))
            })
            .map(|p| (p.id, p.cidr))
            .collect())
    }

    /// Whether an address of this network may be one another network also
    /// hands out (the network opted in to a separate address space).
    pub fn is_isolated(&self, network: &str) -> Result<bool, StoreError> {
        is_isolated(&self.conn, network)
    }

    /// Quarantined blocks. None in a database Metis never wrote to (opened
    /// read-only, without Metis's tables).
    pub fn quarantined(&self) -> Result<Vec<Quarantined>, StoreError> {
        let recorded: bool = self.conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'metis_blocks')",
            [],
            |r| r.get(0),
        )?;
        if !recorded {
            return Ok(Vec::new());
        }
        quarantined(&self.conn)
    }
}

impl Store {
    /// What [`Store::configure`] of the CNI `ranges` with `isolated` would
    /// do, read only (STATUS): the refusal an ADD would get, else the
    /// ranges that would become new room (a block added or grown, not
    /// quarantined).
    pub(in crate::store) fn would_lay_out(
        &self,
        network: &str,
        family: Family,
        ranges: &[Cidr],
        isolated: bool,
    ) -> Result<Vec<Cidr>, StoreError> {
        let conn = &self.conn;
        if is_isolated(conn, network)? && !isolated {
            check_joins_shared_space(conn, network)?;
        }
        let blocks = placed(conn, network, family)?;
        let mut room = Vec::new();
        for range in ranges.iter().filter(|range| range.family() == family) {
            match placement(range, &blocks) {
                Placement::Served | Placement::Narrow(_) | Placement::Quarantined(_) => {}
                Placement::Granted(granted) => {
                    return Err(granted_overlap(network, range, &granted));
                }
                Placement::Add | Placement::Grow(_) => {
                    check_other_networks_as(conn, network, isolated, range)?;
                    room.push(*range);
                }
            }
        }
        Ok(room)
    }

    /// The fast path of [`Store::configure`]: the recorded ranges, the
    /// isolation and the blocks already match, and no retired block of
    /// the network is ready to be deleted.
    fn configured_as(&self, wish: &Wish, now_ms: i64) -> Result<bool, StoreError> {
        let Wish {
            source,
            network,
            family,
            ranges,
            isolated,
        } = *wish;
        let conn = &self.conn;
        let recorded: BTreeSet<String> = wanted(conn, Some(source), network, family)?
            .into_iter()
            .map(|(cidr, _)| cidr.to_string())
            .collect();
        if recorded != ranges.iter().map(Cidr::to_string).collect::<BTreeSet<_>>()
            || is_isolated(conn, network)? != isolated
        {
            return Ok(false);
        }
        let blocks = placed(conn, network, family)?;
        let served = |range: &Cidr| {
            blocks.iter().any(|b| {
                !b.retired
                    && !b.quarantined
                    && (b.cidr == *range || b.cidr.strictly_contains(range))
            })
        };
        if !ranges.iter().all(served) {
            return Ok(false);
        }
        Ok(sweepable(conn, &blocks, now_ms)?.is_empty())
    }
}

/// Lays out the blocks of one network and family from every static
/// source's wanted ranges, then retires what no source wants and deletes
/// retired blocks that are empty.
/// A target that overlaps a block it may not absorb fails the pass when
/// the `strict` source wants it, and is skipped and reported otherwise.
fn relayout(
    conn: &Connection,
    mode: ReserveMode,
    wish: &Wish,
    strict: bool,
    now_ms: i64,
) -> Result<LayoutChanges, StoreError> {
    let (network, family) = (wish.network, wish.family);
    let strict = strict.then_some(wish.source);
    let mut changes = LayoutChanges::default();
    let wanted = wanted(conn, None, network, family)?;
    let cidrs: Vec<Cidr> = wanted.iter().map(|(cidr, _)| *cidr).collect();
    for target in cidr::maximal(&cidrs) {
        // Each placement reshapes blocks: the next one sees them anew.
        let decided = placement(&target, &placed(conn, network, family)?);
        let refusal = match place(conn, mode, network, &target, decided)? {
            Ok(line) => {
                changes.lines.extend(line);
                continue;
            }
            Err(refusal) => refusal,
        };
        let strict_wants = wanted.iter().any(|(cidr, source)| {
            strict == Some(*source) && (*cidr == target || target.strictly_contains(cidr))
        });
        if strict_wants {
            return Err(refusal);
        }
        changes.refused.push(refusal.to_string());
    }
    let sources_changed = record_sources(conn, network, family, &wanted, now_ms)?;
    changes.lines.extend(sources_changed);
    for (id, cidr) in sweepable(conn, &placed(conn, network, family)?, now_ms)? {
        delete_block(conn, id)?;
        changes.lines.push(format!(
            "deleted retired block {cidr} of network {network:?}: no pod holds an address in it"
        ));
    }
    Ok(changes)
}

/// What one wanted range needs, decided from the network's blocks alone.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Placement {
    /// It overlaps this quarantined block: not served until that is solved.
    Quarantined(Cidr),
    /// A block has this prefix, or a granted block contains it.
    Served,
    /// This wider block (not granted) contains it: narrow the block to it.
    Narrow(Placed),
    /// It overlaps this block the cluster granted: refused.
    Granted(Cidr),
    /// No block of the network overlaps it: a new block.
    Add,
    /// It strictly contains these blocks: grow them into it in place.
    Grow(Vec<Placed>),
}

/// Where `target` goes among `blocks` (the network's, of its family).
fn placement(target: &Cidr, blocks: &[Placed]) -> Placement {
    if let Some(q) = blocks
        .iter()
        .find(|b| b.quarantined && b.cidr.overlaps(target))
    {
        return Placement::Quarantined(q.cidr);
    }
    let overlapping: Vec<&Placed> = blocks.iter().filter(|b| b.cidr.overlaps(target)).collect();
    if overlapping.iter().any(|b| b.cidr == *target) {
        return Placement::Served;
    }
    if let Some(wider) = overlapping
        .iter()
        .find(|b| b.cidr.strictly_contains(target))
    {
        return match wider.is_adaptive() {
            true => Placement::Served,
            false => Placement::Narrow((*wider).clone()),
        };
    }
    if let Some(granted) = overlapping.iter().find(|b| b.is_adaptive()) {
        return Placement::Granted(granted.cidr);
    }
    match overlapping.is_empty() {
        true => Placement::Add,
        false => Placement::Grow(overlapping.into_iter().cloned().collect()),
    }
}

/// Carries out a placement of `target`: what changed, in words (`None`:
/// nothing), or the refusal when it overlaps a block it may not take (a
/// granted one, or another network's).
fn place(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    target: &Cidr,
    decided: Placement,
) -> Result<Result<Option<String>, StoreError>, StoreError> {
    let line = match decided {
        Placement::Served => return Ok(Ok(None)),
        Placement::Granted(granted) => return Ok(Err(granted_overlap(network, target, &granted))),
        Placement::Quarantined(q) => format!(
            "range {target} of network {network:?} overlaps quarantined block {q}; not served until `metis admin check` passes"
        ),
        Placement::Narrow(wider) => {
            narrow(conn, mode, network, &wider, target)?;
            format!(
                "narrowed block {} of network {network:?} to {target}; the rest drains",
                wider.cidr
            )
        }
        Placement::Add => {
            if let Some(refusal) = other_network_refusal(conn, network, target)? {
                return Ok(Err(refusal));
            }
            let id = insert_block(conn, mode, network, target)?;
            ensure_record(conn, id)?;
            format!("added block {target} to network {network:?}")
        }
        Placement::Grow(inner) => {
            if let Some(refusal) = other_network_refusal(conn, network, target)? {
                return Ok(Err(refusal));
            }
            grow(conn, mode, network, &inner, target)?;
            format!(
                "grew {} block(s) of network {network:?} into {target} in place",
                inner.len()
            )
        }
    };
    Ok(Ok(Some(line)))
}

/// [`check_other_networks`], its refusal as a value.
/// The refusal of a range overlapping a block of its own network that
/// the cluster granted.
fn granted_overlap(network: &str, target: &Cidr, granted: &Cidr) -> StoreError {
    StoreError::Overlap {
        cidr: *target,
        network: network.to_string(),
        other_cidr: granted.to_string(),
        other_network: network.to_string(),
        isolation_helps: false,
    }
}

fn other_network_refusal(
    conn: &Connection,
    network: &str,
    target: &Cidr,
) -> Result<Option<StoreError>, StoreError> {
    match check_other_networks(conn, network, target) {
        Ok(()) => Ok(None),
        Err(err @ StoreError::Overlap { .. }) => Ok(Some(err)),
        Err(err) => Err(err),
    }
}

/// Writes which static sources want each block (adaptive sources are
/// kept), retires blocks no one wants and takes back retired blocks that
/// are wanted again. Blocks without a Metis record that nothing wants are
/// left as they are: their origin is unknown. Returns what changed, in
/// words.
fn record_sources(
    conn: &Connection,
    network: &str,
    family: Family,
    wanted: &[(Cidr, Source)],
    now_ms: i64,
) -> Result<Vec<String>, StoreError> {
    let mut lines = Vec::new();
    for block in placed(conn, network, family)? {
        let mut sources: BTreeSet<Source> = wanted
            .iter()
            .filter(|(cidr, _)| cidr.overlaps(&block.cidr))
            .map(|(_, source)| *source)
            .collect();
        let Some(previous) = &block.sources else {
            if !sources.is_empty() {
                ensure_record(conn, block.id)?;
                write_sources(conn, block.id, &sources)?;
            }
            continue;
        };
        sources.extend(
            previous
                .iter()
                .filter(|source| !source.is_static())
                .copied(),
        );
        if &sources != previous {
            write_sources(conn, block.id, &sources)?;
        }
        if block.quarantined {
            continue;
        }
        if sources.is_empty() && block.state == BlockState::Ready {
            set_retired(conn, block.id, true, now_ms)?;
            lines.push(format!(
                "retired block {} of network {network:?}: no longer configured; its pods keep their addresses",
                block.cidr
            ));
        } else if !sources.is_empty() && block.retired {
            set_retired(conn, block.id, false, now_ms)?;
            lines.push(format!(
                "block {} of network {network:?} is configured again",
                block.cidr
            ));
        }
    }
    Ok(lines)
}

/// The source that grants a block, and when.
#[derive(Debug, Clone, Copy)]
pub(in crate::store) struct Grant {
    pub(in crate::store) source: Source,
    pub(in crate::store) at_ms: i64,
}

/// Adds one block (the `--cidr`-less primitive behind
/// [`Store::add_cidr_block`] and [`Store::follow_grants`]).
pub(in crate::store) fn add_block(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    cidr: &Cidr,
    grant: Option<Grant>,
) -> Result<crate::store::db::AddOutcome, StoreError> {
    let blocks = placed(conn, network, cidr.family())?;
    if let Some(same) = blocks.iter().find(|b| b.cidr == *cidr) {
        if let Some(Grant { source, at_ms }) = grant {
            ensure_record(conn, same.id)?;
            let mut sources = same.sources.clone().unwrap_or_default();
            if sources.insert(source) {
                write_sources(conn, same.id, &sources)?;
            }
            if same.retired {
                set_retired(conn, same.id, false, at_ms)?;
            }
        }
        return Ok(crate::store::db::AddOutcome::Exists(same.id));
    }
    if let Some(other) = blocks.iter().find(|b| b.cidr.overlaps(cidr)) {
        return Err(StoreError::Overlap {
            cidr: *cidr,
            network: network.to_string(),
            other_cidr: other.cidr.to_string(),
            other_network: network.to_string(),
            isolation_helps: false,
        });
    }
    check_other_networks(conn, network, cidr)?;
    let id = insert_block(conn, mode, network, cidr)?;
    if let Some(Grant { source, .. }) = grant {
        ensure_record(conn, id)?;
        write_sources(conn, id, &BTreeSet::from([source]))?;
    }
    Ok(crate::store::db::AddOutcome::Added(id))
}

/// Refuses a prefix that overlaps a block of another network, unless one
/// of the two networks is isolated (`network` as recorded).
fn check_other_networks(conn: &Connection, network: &str, cidr: &Cidr) -> Result<(), StoreError> {
    check_other_networks_as(conn, network, is_isolated(conn, network)?, cidr)
}

/// [`check_other_networks`] with `network`'s isolation given.
fn check_other_networks_as(
    conn: &Connection,
    network: &str,
    isolated: bool,
    cidr: &Cidr,
) -> Result<(), StoreError> {
    if isolated {
        return Ok(());
    }
    let mut stmt = conn.prepare_cached(
        "SELECT cidr, network FROM cidr_blocks \
         WHERE network != ?1 AND ip_family = ?2 AND state != 'Deleting' ORDER BY id",
    )?;
    let mut rows = stmt.query(params![network, cidr.family().as_str()])?;
    while let Some(row) = rows.next()? {
        let other_cidr: String = row.get(0)?;
        let other_network: String = row.get(1)?;
        let Ok(other) = other_cidr.parse::<Cidr>() else {
            continue;
        };
        if other.overlaps(cidr) && !is_isolated(conn, &other_network)? {
            return Err(StoreError::Overlap {
                cidr: *cidr,
                network: network.to_string(),
                other_cidr,
                other_network,
                isolation_helps: true,
            });
        }
    }
    Ok(())
}

/// Refuses (with the first overlap) a network leaving isolation while any
/// of its blocks, of either family and in any state but Deleting, overlaps
/// a block of another network that is not isolated.
fn check_joins_shared_space(conn: &Connection, network: &str) -> Result<(), StoreError> {
    for family in [Family::V4, Family::V6] {
        for block in placed(conn, network, family)? {
            check_other_networks_as(conn, network, false, &block.cidr)?;
        }
    }
    Ok(())
}

/// Whether any of `blocks` has host-local bounds: its rows were written
/// only inside its range, whatever its frontier says.
fn had_bounds(conn: &Connection, network: &str, blocks: &[Placed]) -> Result<bool, StoreError> {
    for block in blocks {
        if bounds_of(conn, network, &block.cidr)?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Grows `inner` (blocks of the network strictly inside `target`) into one
/// block of prefix `target`: the oldest keeps its id and takes the prefix,
/// the others' rows move into it, then reservations and counters are
/// settled. The rest of the prefix is populated lazily like a new block's:
/// from the kept block's frontier when both start at the same address,
/// else from the start (rows already there are passed over once).
fn grow(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    inner: &[Placed],
    target: &Cidr,
) -> Result<(), StoreError> {
    let Some(keep) = inner.iter().min_by_key(|b| b.id) else {
        return Ok(());
    };
    let ready = inner
        .iter()
        .any(|b| b.state == BlockState::Ready && !b.retired);
    // Rows exist below the frontier only inside a bounded block's range, so
    // a block that had bounds starts over (passing over its rows once).
    let next = match keep.cidr.base() == target.base() && !had_bounds(conn, network, inner)? {
        true => frontier(conn, keep.id, &keep.cidr)?,
        false => 0,
    };
    set_frontier(conn, keep.id, next)?;
    conn.prepare_cached(concat!(
        "UPDATE cidr_blocks SET cidr = ?2, total_ips = ?3, state = ?4, ",
        stamped!(),
        " WHERE id = ?1"
    ))?
    .execute(params![
        keep.id,
        target.to_string(),
        total_ips(target),
        match ready {
            true => BlockState::Ready,
            false => keep.state,
        }
        .as_str()
    ])?;
    for other in inner.iter().filter(|b| b.id != keep.id) {
        conn.prepare_cached(concat!(
            "UPDATE ip_addresses SET cidr_block_id = ?2, ",
            stamped!(),
            " WHERE cidr_block_id = ?1"
        ))?
        .execute(params![other.id, keep.id])?;
        delete_block(conn, other.id)?;
    }
    if ready {
        ensure_record(conn, keep.id)?;
        conn.prepare_cached("UPDATE metis_blocks SET retired = 0 WHERE block_id = ?1")?
            .execute([keep.id])?;
    }
    settle(conn, mode, keep.id, network, target)
}

/// Narrows `wider` to `target` (inside it): rows outside `target` move to
/// retired pieces covering the rest of the old prefix.
fn narrow(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    wider: &Placed,
    target: &Cidr,
) -> Result<(), StoreError> {
    let pieces = cidr::subtract(&wider.cidr, target);
    // Rows exist below the wider block's frontier (inside its range only,
    // when bounded: then every part starts over). Each part, `target` and
    // the pieces alike, keeps the share of them that falls inside it: a
    // piece drains now but may be taken back, and its growth then starts
    // where its rows end.
    let populated = match had_bounds(conn, network, std::slice::from_ref(wider))? {
        true => None,
        false => Some(frontier(conn, wider.id, &wider.cidr)?),
    };
    let frontier_of = |part: &Cidr| {
        let shift = crate::cidr::to_u128(part.base()) - crate::cidr::to_u128(wider.cidr.base());
        populated.map_or(0, |next| next.saturating_sub(shift).min(part.size()))
    };
    set_frontier(conn, wider.id, frontier_of(target))?;
    conn.prepare_cached(concat!(
        "UPDATE cidr_blocks SET cidr = ?2, total_ips = ?3, ",
        stamped!(),
        " WHERE id = ?1"
    ))?
    .execute(params![wider.id, target.to_string(), total_ips(target)])?;
    let mut piece_ids = Vec::with_capacity(pieces.len());
    for piece in &pieces {
        conn.prepare_cached(
            "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips, state, created_at) \
             SELECT ?2, network, ip_family, ?3, 0, 'Withheld', created_at FROM cidr_blocks WHERE id = ?1",
        )?
        .execute(params![wider.id, piece.to_string(), total_ips(piece)])?;
        let id = conn.last_insert_rowid();
        ensure_record(conn, id)?;
        conn.prepare_cached("UPDATE metis_blocks SET retired = 1 WHERE block_id = ?1")?
            .execute([id])?;
        set_frontier(conn, id, frontier_of(piece))?;
        piece_ids.push((id, *piece));
    }
    let rows: Vec<(i64, String)> = conn
        .prepare_cached("SELECT id, address FROM ip_addresses WHERE cidr_block_id = ?1")?
        .query_map([wider.id], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<Result<_, _>>()?;
    let mut move_row = conn.prepare_cached(concat!(
        "UPDATE ip_addresses SET cidr_block_id = ?2, ",
        stamped!(),
        " WHERE id = ?1"
    ))?;
    for (row_id, text) in rows {
        let address = parse_addr(&text)?;
        if target.contains(address) {
            continue;
        }
        if let Some((piece_id, _)) = piece_ids.iter().find(|(_, p)| p.contains(address)) {
            move_row.execute(params![row_id, piece_id])?;
        }
    }
    settle(conn, mode, wider.id, network, target)?;
    for (id, piece) in &piece_ids {
        settle(conn, mode, *id, network, piece)?;
    }
    Ok(())
}

/// Retired blocks of the network that may go: no pod holds an address in
/// them and no address is still cooling down.
pub(in crate::store) fn sweepable(
    conn: &Connection,
    blocks: &[Placed],
    now_ms: i64,
) -> Result<Vec<(i64, Cidr)>, StoreError> {
    let mut out = Vec::new();
    let retired = blocks
        .iter()
        .filter(|b| b.retired && !b.quarantined && b.state == BlockState::Withheld);
    for block in retired {
        if !in_use(conn, block.id, now_ms)? {
            out.push((block.id, block.cidr));
        }
    }
    Ok(out)
}

pub(in crate::store) fn set_retired(
    conn: &Connection,
    id: i64,
    retired: bool,
    now_ms: i64,
) -> Result<(), StoreError> {
    ensure_record(conn, id)?;
    conn.prepare_cached("UPDATE metis_blocks SET retired = ?2 WHERE block_id = ?1")?
        .execute(params![id, retired])?;
    crate::store::rows::withhold::settle_block(conn, id, now_ms)
}

pub(in crate::store) fn write_sources(
    conn: &Connection,
    id: i64,
    sources: &BTreeSet<Source>,
) -> Result<(), StoreError> {
    let names: Vec<&str> = sources.iter().map(|source| source.as_str()).collect();
    let text = names.join(",");
    conn.prepare_cached("UPDATE metis_blocks SET sources = ?2 WHERE block_id = ?1")?
        .execute(params![id, text])?;
    Ok(())
}

/// Non-Deleting blocks of a network and family, oldest first.
pub(in crate::store) fn placed(
    conn: &Connection,
    network: &str,
    family: Family,
) -> Result<Vec<Placed>, StoreError> {
    let mut out = Vec::new();
    for block in crate::store::rows::block::network_blocks(conn, network, family)? {
        if block.is("Deleting") {
            continue;
        }
        let record = crate::store::rows::block::record_of(conn, block.id)?;
        let record = record.as_ref();
        out.push(Placed {
            id: block.id,
            cidr: block.prefix()?,
            state: block.parsed_state()?,
            retired: record.is_some_and(|r| r.retired),
            quarantined: record.is_some_and(|r| r.quarantined),
            sources: record.and_then(|r| r.sources.as_deref()).map(parse_sources),
        });
    }
    Ok(out)
}

/// The ranges static sources want for a network and family (one source,
/// or all): (range, source). A source name no release wrote is skipped.
pub(in crate::store) fn wanted(
    conn: &Connection,
    source: Option<Source>,
    network: &str,
    family: Family,
) -> Result<Vec<(Cidr, Source)>, StoreError> {
    // Filtered and ordered here: the source test and the order in SQL cost
    // a one-request process (direct mode) twice as much to prepare.
    let mut stmt =
        conn.prepare_cached("SELECT source, cidr FROM metis_ranges WHERE network = ?1")?;
    let mut rows = stmt.query([network])?;
    let mut listed: Vec<(String, Option<String>)> = Vec::new();
    while let Some(row) = rows.next()? {
        let Some(name) = text_at(row, 0)? else {
            continue;
        };
        if source.is_none_or(|source| source.as_str() == name) {
            listed.push((name, text_at(row, 1)?));
        }
    }
    listed.sort();
    let mut out = Vec::new();
    for (name, cidr) in listed {
        let cidr = parse_text(cidr.as_deref(), parse_cidr, || {
            format!("a range of network {network:?}")
        })?;
        if let (true, Some(source)) = (cidr.family() == family, Source::parse(&name)) {
            out.push((cidr, source));
        }
    }
    Ok(out)
}

/// (network, family) pairs a source has recorded ranges for.
fn wanted_networks(
    conn: &Connection,
    source: Source,
) -> Result<BTreeSet<(String, Family)>, StoreError> {
    let mut stmt =
        conn.prepare_cached("SELECT network, cidr FROM metis_ranges WHERE source = ?1")?;
    let mut rows = stmt.query([source.as_str()])?;
    let mut out = BTreeSet::new();
    while let Some(row) = rows.next()? {
        let cidr = parse_cidr(&row.get::<_, String>(1)?)?;
        out.insert((row.get(0)?, cidr.family()));
    }
    Ok(out)
}

fn replace_wanted(
    conn: &Connection,
    source: Source,
    network: &str,
    family: Family,
    ranges: &[Cidr],
) -> Result<(), StoreError> {
    debug_assert!(source.is_static());
    for (cidr, _) in wanted(conn, Some(source), network, family)? {
        conn.prepare_cached(
            "DELETE FROM metis_ranges WHERE source = ?1 AND network = ?2 AND cidr = ?3",
        )?
        .execute(params![source.as_str(), network, cidr.to_string()])?;
    }
    for cidr in ranges {
        conn.prepare_cached(
            "INSERT OR IGNORE INTO metis_ranges (source, network, cidr) VALUES (?1, ?2, ?3)",
        )?
        .execute(params![source.as_str(), network, cidr.to_string()])?;
    }
    Ok(())
}

pub(in crate::store) fn is_isolated(conn: &Connection, network: &str) -> Result<bool, StoreError> {
    Ok(conn
        .prepare_cached(crate::store::db::NETWORK_ROW_SQL)?
        .query_row([network], |r| r.get(crate::store::db::NETWORK_ROW_ISOLATED))
        .optional()?
        .unwrap_or(false))
}

fn set_isolated(conn: &Connection, network: &str, isolated: bool) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO metis_networks (network, isolated) VALUES (?1, ?2) \
         ON CONFLICT(network) DO UPDATE SET isolated = excluded.isolated",
    )?
    .execute(params![network, isolated])?;
    Ok(())
}

/// Finds overlapping blocks that share an address space (the same network,
/// or two networks neither of which is isolated). The side no pod uses is
/// deleted (its addresses stay covered by the other); when both have pods,
/// both are marked for quarantine.
pub(in crate::store) fn resolve_overlaps(
    conn: &Connection,
    marks: &mut BTreeMap<i64, String>,
    deleted: &mut Vec<String>,
    now_ms: i64,
) -> Result<(), StoreError> {
    let entries = overlap_entries(conn, marks, now_ms)?;
    for verdict in overlap_verdicts(&entries) {
        match verdict {
            Verdict::Delete(victim) => {
                delete_block(conn, victim.id)?;
                marks.remove(&victim.id);
                deleted.push(deleted_line(&victim));
            }
            Verdict::Quarantine { id, why } => {
                marks.entry(id).or_insert(why);
            }
        }
    }
    Ok(())
}

/// What the start logs of a block [`resolve_overlaps`] deleted.
fn deleted_line(victim: &Entry) -> String {
    format!(
        "deleted block {} of network {:?}: it overlapped another block and no pod held an address in it",
        victim.cidr, victim.network
    )
}

/// What [`resolve_overlaps`] would do now, read-only and in the words the
/// start logs: for `metis admin check`, the vet before an upgrade.
#[derive(Debug, Default)]
pub(in crate::store) struct Foreseen {
    /// Blocks it would quarantine: (id, cidr, network, why).
    pub(in crate::store) quarantined: Vec<(i64, Cidr, String, String)>,
    /// The lines of the blocks it would delete.
    pub(in crate::store) deleted: Vec<String>,
}

pub(in crate::store) fn foreseen_overlaps(
    conn: &Connection,
    now_ms: i64,
) -> Result<Foreseen, StoreError> {
    let mut unreadable = BTreeMap::new();
    let entries = overlap_entries(conn, &mut unreadable, now_ms)?;
    let mut foreseen = Foreseen::default();
    for verdict in overlap_verdicts(&entries) {
        match verdict {
            Verdict::Delete(victim) => foreseen.deleted.push(deleted_line(&victim)),
            Verdict::Quarantine { id, why } => {
                if let Some(entry) = entries.iter().find(|e| e.id == id) {
                    let (cidr, network) = (entry.cidr, entry.network.clone());
                    foreseen.quarantined.push((id, cidr, network, why));
                }
            }
        }
    }
    Ok(foreseen)
}

/// A non-Deleting block as the overlap resolution sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    id: i64,
    cidr: Cidr,
    network: String,
    isolated: bool,
    /// A pod holds an address in it, or an address is cooling.
    in_use: bool,
}

/// What to do about blocks that overlap.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// Delete it: no pod uses it, and the other block covers its addresses.
    Delete(Entry),
    /// Quarantine block `id` (unless already marked for another reason).
    Quarantine { id: i64, why: String },
}

/// Every non-Deleting block, sorted by base address then widest first, so
/// that overlaps are neighbours of the wider block's run. A block whose
/// prefix or family cannot be read is marked instead.
fn overlap_entries(
    conn: &Connection,
    marks: &mut BTreeMap<i64, String>,
    now_ms: i64,
) -> Result<Vec<Entry>, StoreError> {
    let mut entries = Vec::new();
    let mut stmt = conn.prepare(
        "SELECT id, cidr, network, ip_family FROM cidr_blocks WHERE state != 'Deleting' ORDER BY id",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let id: i64 = row.get(0)?;
        let network: String = row.get(2)?;
        let (Ok(cidr), Ok(_)) = (
            parse_cidr(&row.get::<_, String>(1)?),
            parse_family(&row.get::<_, String>(3)?),
        ) else {
            marks.insert(id, "its cidr or family cannot be read".to_string());
            continue;
        };
        entries.push(Entry {
            id,
            cidr,
            isolated: is_isolated(conn, &network)?,
            in_use: false,
            network,
        });
    }
    // Only an overlapping block's use decides anything, and telling that a
    // block is unused reads all its rows (no index leads with the block for
    // held rows): 77M instructions per start on a 100,000-row block.
    let overlapping: Vec<bool> = entries
        .iter()
        .map(|e| {
            entries
                .iter()
                .any(|other| other.id != e.id && other.cidr.overlaps(&e.cidr))
        })
        .collect();
    for (entry, overlaps) in entries.iter_mut().zip(overlapping) {
        if overlaps {
            entry.in_use = in_use(conn, entry.id, now_ms)?;
        }
    }
    entries.sort_by_key(|e| (crate::cidr::to_u128(e.cidr.base()), e.cidr.prefix_len()));
    Ok(entries)
}

/// The verdicts on `entries` (as [`overlap_entries`] sorts them), in the
/// order they are to be carried out: of each overlapping pair that shares
/// an address space, the side no pod uses goes (the first if neither is
/// used), and when both are used both are quarantined. A block deleted
/// takes no further part.
fn overlap_verdicts(entries: &[Entry]) -> Vec<Verdict> {
    let mut verdicts = Vec::new();
    let mut gone = BTreeSet::new();
    for (i, a) in entries.iter().enumerate() {
        for b in entries.iter().skip(i + 1) {
            if b.cidr.family() != a.cidr.family() {
                continue;
            }
            if !a.cidr.overlaps(&b.cidr) {
                break;
            }
            let shared = a.network == b.network || !(a.isolated || b.isolated);
            if !shared || gone.contains(&a.id) || gone.contains(&b.id) {
                continue;
            }
            let victim = match (a.in_use, b.in_use) {
                (false, _) => a,
                (true, false) => b,
                (true, true) => {
                    verdicts.extend([(a, b), (b, a)].map(|(this, other)| Verdict::Quarantine {
                        id: this.id,
                        why: format!(
                            "it overlaps block {} of network {:?} and both hold pods",
                            other.cidr, other.network
                        ),
                    }));
                    continue;
                }
            };
            gone.insert(victim.id);
            verdicts.push(Verdict::Delete(victim.clone()));
        }
    }
    verdicts
}

/// Whether any pod holds an address in the block, or an address is cooling.
pub(in crate::store) fn in_use(
    conn: &Connection,
    id: i64,
    now_ms: i64,
) -> Result<bool, StoreError> {
    Ok(conn
        .prepare_cached(concat!(
            "SELECT EXISTS (SELECT 1 FROM ip_addresses WHERE cidr_block_id = ?1 AND (",
            pod_held!(""),
            " OR ",
            cooling!("", "?2"),
            "))"
        ))?
        .query_row(params![id, now_ms], |r| r.get(0))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Depth, Owner};
    use crate::testutil::{TempDir, assert_sound, cidr, owner};

    const NOW: i64 = 1_000_000;
    const COOLDOWN: i64 = 60_000;

    fn configure(store: &mut Store, source: Source, network: &str, ranges: &[&str]) {
        let ranges: Vec<Cidr> = ranges.iter().map(|r| cidr(r)).collect();
        let family = ranges.first().map_or(Family::V4, Cidr::family);
        store
            .configure(
                &Wish {
                    source,
                    network,
                    family,
                    ranges: &ranges,
                    isolated: false,
                },
                NOW,
            )
            .unwrap();
    }

    fn take(store: &mut Store, who: &Owner) -> String {
        store
            .allocate(who, Family::V4, NOW)
            .unwrap()
            .address
            .to_string()
    }

    fn in_network<'a>(network: &'a str, container_id: &'a str) -> Owner<'a> {
        Owner {
            network,
            ..owner(container_id)
        }
    }

    /// (cidr, state) of every block of a network.
    fn layout(store: &Store, network: &str) -> Vec<(String, String)> {
        placed(&store.conn, network, Family::V4)
            .unwrap()
            .into_iter()
            .map(|b| (b.cidr.to_string(), b.state.as_str().to_string()))
            .collect()
    }

    #[test]
    fn a_widened_range_grows_in_place_and_pods_keep_their_addresses() {
        let dir = TempDir::new();
        let mut store = dir.store();
        configure(&mut store, Source::Cni, "pods", &["198.18.10.0/30"]);
        assert_eq!(take(&mut store, &owner("a")), "198.18.10.2");
        configure(&mut store, Source::Cni, "pods", &["198.18.10.0/29"]);
        assert_eq!(
            layout(&store, "pods"),
            [("198.18.10.0/29".into(), "Ready".into())]
        );
        assert_eq!(
            store.check("pods", "a", "eth0").unwrap()[0]
                .address
                .to_string(),
            "198.18.10.2"
        );
        // The /30's broadcast is an ordinary address of the /29.
        let next: Vec<String> = ["b", "c", "d", "e"]
            .iter()
            .map(|pod| take(&mut store, &owner(pod)))
            .collect();
        assert_eq!(
            next,
            ["198.18.10.3", "198.18.10.4", "198.18.10.5", "198.18.10.6"]
        );
        assert_sound(&store);
        // Narrowed back: the pods outside the /30 keep theirs in a retired piece.
        configure(&mut store, Source::Cni, "pods", &["198.18.10.0/30"]);
        assert_eq!(
            layout(&store, "pods"),
            [
                ("198.18.10.0/30".into(), "Ready".into()),
                ("198.18.10.4/30".into(), "Withheld".into())
            ]
        );
        assert_eq!(
            store.check("pods", "e", "eth0").unwrap()[0]
                .address
                .to_string(),
            "198.18.10.6"
        );
        assert_sound(&store);
    }

    #[test]
    fn a_flag_range_inside_a_cni_range_is_one_block() {
        let dir = TempDir::new();
        let mut store = dir.store();
        configure(&mut store, Source::Flag, "pods", &["198.18.11.0/29"]);
        take(&mut store, &owner("a"));
        configure(&mut store, Source::Cni, "pods", &["198.18.11.0/28"]);
        assert_eq!(
            layout(&store, "pods"),
            [("198.18.11.0/28".into(), "Ready".into())]
        );
        let mut seen = BTreeSet::from(["198.18.11.2".to_string()]);
        for pod in ["b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m"] {
            assert!(
                seen.insert(take(&mut store, &owner(pod))),
                "handed out twice"
            );
        }
        assert_sound(&store);
        // The flag goes away: the CNI range still wants the block.
        configure(&mut store, Source::Flag, "pods", &[]);
        assert_eq!(
            layout(&store, "pods"),
            [("198.18.11.0/28".into(), "Ready".into())]
        );
    }

    #[test]
    fn another_network_over_the_same_subnet_is_refused_unless_isolated() {
        let dir = TempDir::new();
        let mut store = dir.store();
        configure(&mut store, Source::Cni, "default", &["198.18.12.0/24"]);
        take(&mut store, &in_network("default", "a"));
        let refused = store
            .configure(
                &Wish {
                    source: Source::Cni,
                    network: "k8s-pod-network",
                    family: Family::V4,
                    ranges: &[cidr("198.18.12.0/24")],
                    isolated: false,
                },
                NOW,
            )
            .unwrap_err();
        let message = refused.to_string();
        assert!(message.contains("network \"default\""), "{message}");
        assert!(
            message.contains("\"ipam\": {\"network\": \"default\"}"),
            "{message}"
        );
        // Opting in to a separate address space allows it.
        store
            .configure(
                &Wish {
                    source: Source::Cni,
                    network: "vrf-b",
                    family: Family::V4,
                    ranges: &[cidr("198.18.12.0/24")],
                    isolated: true,
                },
                NOW,
            )
            .unwrap();
        assert_eq!(take(&mut store, &in_network("vrf-b", "x")), "198.18.12.2");
        assert_sound(&store);
    }

    #[test]
    fn leaving_isolation_over_another_networks_block_is_refused_and_changes_nothing() {
        let dir = TempDir::new();
        let mut store = dir.store_with_cooldown(0);
        configure(&mut store, Source::Cni, "net-y", &["198.18.70.0/28"]);
        assert_eq!(take(&mut store, &in_network("net-y", "y1")), "198.18.70.2");
        let ranges = [cidr("198.18.70.0/28")];
        let (source, network, family, ranges) = (Source::Cni, "net-x", Family::V4, &ranges[..]);
        store
            .configure(
                &Wish {
                    source,
                    network,
                    family,
                    ranges,
                    isolated: true,
                },
                NOW,
            )
            .unwrap();
        assert_eq!(take(&mut store, &in_network("net-x", "x1")), "198.18.70.2");
        let before = layout(&store, "net-x");
        // The conflist drops `isolated`: refused, with the way out named.
        let refused = store
            .configure(
                &Wish {
                    source,
                    network,
                    family,
                    ranges,
                    isolated: false,
                },
                NOW,
            )
            .unwrap_err();
        assert!(matches!(refused, StoreError::Overlap { .. }), "{refused}");
        let message = refused.to_string();
        assert!(message.contains("network \"net-y\""), "{message}");
        assert!(message.contains("\"isolated\": true"), "{message}");
        assert!(store.is_isolated("net-x").unwrap(), "isolation was kept");
        assert_eq!(layout(&store, "net-x"), before);
        // Also when the other family is the one asked about, and when the
        // ranges move at the same time (the old block keeps its pod).
        let v6 = [cidr("2001:db8:70::/120")];
        let refused = store.configure(
            &Wish {
                source,
                network,
                family: Family::V6,
                ranges: &v6,
                isolated: false,
            },
            NOW,
        );
        assert!(
            matches!(refused, Err(StoreError::Overlap { .. })),
            "{refused:?}"
        );
        let moved = [cidr("198.18.71.0/28")];
        let refused = store.configure(
            &Wish {
                source,
                network,
                family,
                ranges: &moved,
                isolated: false,
            },
            NOW,
        );
        assert!(
            matches!(refused, Err(StoreError::Overlap { .. })),
            "{refused:?}"
        );
        assert!(store.is_isolated("net-x").unwrap());
        assert_eq!(layout(&store, "net-x"), before);
        // Both networks go on serving their own address spaces.
        assert_eq!(take(&mut store, &in_network("net-y", "y2")), "198.18.70.3");
        assert_eq!(take(&mut store, &in_network("net-x", "x2")), "198.18.70.3");
        // Once x's pods and block are gone, leaving isolation is allowed.
        store.release("net-x", "x1", "eth0", NOW).unwrap();
        store.release("net-x", "x2", "eth0", NOW).unwrap();
        store
            .configure(
                &Wish {
                    source,
                    network,
                    family,
                    ranges: &moved,
                    isolated: false,
                },
                NOW,
            )
            .unwrap();
        assert!(!store.is_isolated("net-x").unwrap());
    }

    #[test]
    fn a_moved_range_retires_the_old_block_until_its_pods_are_gone() {
        let dir = TempDir::new();
        let mut store = dir.store_with_cooldown(COOLDOWN);
        configure(&mut store, Source::Cni, "pods", &["198.18.12.0/24"]);
        assert_eq!(take(&mut store, &owner("a")), "198.18.12.2");
        configure(&mut store, Source::Cni, "pods", &["198.18.13.0/24"]);
        assert_eq!(take(&mut store, &owner("b")), "198.18.13.2");
        assert_eq!(
            layout(&store, "pods"),
            [
                ("198.18.12.0/24".into(), "Withheld".into()),
                ("198.18.13.0/24".into(), "Ready".into())
            ]
        );
        // Exhaustion never takes a retired block back.
        assert_eq!(store.undrain_one("pods", Family::V4, NOW).unwrap(), None);
        store.release("pods", "a", "eth0", NOW).unwrap();
        configure(&mut store, Source::Cni, "pods", &["198.18.13.0/24"]);
        assert_eq!(
            layout(&store, "pods").len(),
            2,
            "kept while its address cools down"
        );
        store
            .configure(
                &Wish {
                    source: Source::Cni,
                    network: "pods",
                    family: Family::V4,
                    ranges: &[cidr("198.18.13.0/24")],
                    isolated: false,
                },
                NOW + COOLDOWN,
            )
            .unwrap();
        assert_eq!(
            layout(&store, "pods"),
            [("198.18.13.0/24".into(), "Ready".into())]
        );
        assert_sound(&store);
    }

    #[test]
    fn a_range_that_comes_back_takes_its_retired_block_back() {
        let dir = TempDir::new();
        let mut store = dir.store();
        configure(&mut store, Source::Cni, "pods", &["198.18.12.0/24"]);
        take(&mut store, &owner("a"));
        configure(&mut store, Source::Cni, "pods", &["198.18.13.0/24"]);
        configure(
            &mut store,
            Source::Cni,
            "pods",
            &["198.18.12.0/24", "198.18.13.0/24"],
        );
        assert_eq!(
            layout(&store, "pods"),
            [
                ("198.18.12.0/24".into(), "Ready".into()),
                ("198.18.13.0/24".into(), "Ready".into())
            ]
        );
        assert_eq!(take(&mut store, &owner("b")), "198.18.12.3");
    }

    #[test]
    fn overlapping_blocks_from_an_older_database_are_isolated_not_fatal() {
        let dir = TempDir::new();
        let mut store = dir.store();
        // What an older Metis wrote after a widened range: two blocks, one
        // address held twice.
        store.conn.execute_batch(
            "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips) VALUES \
               ('198.18.10.0/30', 'pods', 'ipv4', 4, 3), ('198.18.10.0/29', 'pods', 'ipv4', 8, 4), \
               ('198.18.20.0/30', 'pods', 'ipv4', 4, 3);
             INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) VALUES \
               ('198.18.10.0', 1, '', '', 1), ('198.18.10.1', 1, '', '', 1), ('198.18.10.2', 1, 'a', 'eth0', 1), \
               ('198.18.10.3', 1, '', '', 1), \
               ('198.18.10.0', 2, '', '', 1), ('198.18.10.1', 2, '', '', 1), ('198.18.10.2', 2, 'b', 'eth0', 1), \
               ('198.18.10.7', 2, '', '', 1), ('198.18.10.3', 2, '', '', 0), \
               ('198.18.20.0', 3, '', '', 1), ('198.18.20.3', 3, '', '', 1), ('198.18.20.1', 3, '', '', 1), \
               ('198.18.20.2', 3, '', '', 0);",
        ).unwrap();
        let report = store.verify(Depth::Quick).unwrap();
        assert!(!report.damaged);
        let isolation = store.isolate_problems(&report, NOW).unwrap();
        let ids: Vec<i64> = isolation.quarantined.iter().map(|q| q.block_id).collect();
        assert_eq!(ids, [1, 2]);
        assert!(isolation.recounted > 0, "the /30's counter was wrong");
        // The healthy block still serves; the quarantined ones do not.
        assert_eq!(take(&mut store, &owner("c")), "198.18.20.2");
        let failure = store.allocate(&owner("d"), Family::V4, NOW).unwrap_err();
        assert!(
            matches!(failure, StoreError::NoAvailableIps { .. }),
            "{failure}"
        );
        // Exhaustion names the quarantine, which is why there is no room.
        let message = failure.to_string();
        assert!(
            message.contains("quarantined") && message.contains("block 198.18.10.0/30"),
            "{message}"
        );
        // Pod b leaves: the overlap no longer holds pods on both sides, so
        // the next start deletes the pod-less block and lifts the quarantine.
        store.release("pods", "b", "eth0", NOW).unwrap();
        let report = store.verify(Depth::Quick).unwrap();
        let isolation = store.isolate_problems(&report, NOW).unwrap();
        assert!(isolation.quarantined.is_empty(), "{isolation:?}");
        assert_eq!(isolation.deleted.len(), 1, "{isolation:?}");
        assert_eq!(
            store.check("pods", "a", "eth0").unwrap()[0]
                .address
                .to_string(),
            "198.18.10.2"
        );
    }

    fn placed_block(id: i64, prefix: &str, sources: &[Source], quarantined: bool) -> Placed {
        Placed {
            id,
            cidr: cidr(prefix),
            state: BlockState::Ready,
            sources: Some(sources.iter().copied().collect()),
            retired: false,
            quarantined,
        }
    }

    #[test]
    fn placement_decides_from_the_blocks_alone() {
        let cni = placed_block(1, "198.18.0.0/24", &[Source::Cni], false);
        let granted = placed_block(2, "198.18.4.0/22", &[Source::Nnc], false);
        let sick = placed_block(3, "198.18.8.0/24", &[Source::Cni], true);
        let blocks = [cni.clone(), granted.clone(), sick];
        let cases = [
            ("198.18.0.0/24", Placement::Served),
            ("198.18.5.0/24", Placement::Served),
            ("198.18.0.0/25", Placement::Narrow(cni.clone())),
            ("198.18.0.0/23", Placement::Grow(vec![cni])),
            ("198.18.0.0/21", Placement::Granted(granted.cidr)),
            (
                "198.18.8.0/23",
                Placement::Quarantined(cidr("198.18.8.0/24")),
            ),
            ("198.18.16.0/24", Placement::Add),
        ];
        for (target, expected) in cases {
            assert_eq!(placement(&cidr(target), &blocks), expected, "{target}");
        }
    }

    fn entry(id: i64, prefix: &str, network: &str, isolated: bool, in_use: bool) -> Entry {
        Entry {
            id,
            cidr: cidr(prefix),
            network: network.to_string(),
            isolated,
            in_use,
        }
    }

    #[test]
    fn overlap_verdicts_delete_the_unused_side_and_quarantine_when_both_hold_pods() {
        // Sorted as overlap_entries sorts: base, then widest first.
        let wide = entry(1, "198.18.0.0/23", "a", false, true);
        let unused = entry(2, "198.18.0.0/24", "a", false, false);
        let used = entry(3, "198.18.1.0/24", "b", false, true);
        let apart = entry(4, "198.18.1.0/25", "c", true, true);
        let verdicts = overlap_verdicts(&[wide, unused.clone(), used, apart]);
        assert_eq!(
            verdicts,
            [
                Verdict::Delete(unused),
                Verdict::Quarantine {
                    id: 1,
                    why: "it overlaps block 198.18.1.0/24 of network \"b\" and both hold pods"
                        .to_string()
                },
                Verdict::Quarantine {
                    id: 3,
                    why: "it overlaps block 198.18.0.0/23 of network \"a\" and both hold pods"
                        .to_string()
                },
            ]
        );
        // Neither used: the first goes, and the pair is settled.
        let pair = [
            entry(1, "198.18.0.0/24", "a", false, false),
            entry(2, "198.18.0.0/25", "a", false, false),
        ];
        assert_eq!(overlap_verdicts(&pair), [Verdict::Delete(pair[0].clone())]);
        assert!(overlap_verdicts(&[entry(1, "2001:db8::/64", "a", false, true)]).is_empty());
    }
}
