//! Allocating, releasing and checking addresses.

use std::net::IpAddr;

use rusqlite::{Connection, OptionalExtension, params};

use crate::cidr::{Cidr, Family};
use crate::store::db::connection::PassedOver;
use crate::store::db::{
    Allocation, BlockState, Owner, ReserveMode, Store, StoreError, Unavailable, parse_addr,
    parse_cidr, parse_state, validate_owner,
};
use crate::store::layout::gateway::Names;
use crate::store::rows::block::{
    GROWTH_BATCH, HeldRow, Reserved, block_reserved, frontier, give_back, give_back_row,
    insert_rows, parse_text, quarantined_in, set_frontier, text_at,
};
use crate::store::rows::free::{Holder, RowView, Taken, availability, cooled, unused};
use crate::store::rows::handout::{BlockRecord, InForce, Unfit, address_fit, block_fit};

/// The `reason` of a row that holds no address.
const NOT_AN_ADDRESS: &str = "not_an_address";

/// Bound on expand-then-claim rounds per block within one allocation.
pub(super) const MAX_EXPANSIONS_PER_BLOCK: usize = 4;

/// Allocated rows of an owner in blocks of `network` (optionally one
/// family), IPv4 first.
pub(in crate::store) fn held(
    conn: &Connection,
    network: &str,
    container_id: &str,
    interface_name: &str,
    family: Option<Family>,
) -> Result<Vec<HeldRow>, StoreError> {
    owner_rows(conn, container_id, interface_name)?
        .into_iter()
        .filter(|row| row.network == network && family.is_none_or(|f| row.family == f.as_str()))
        .map(OwnerRow::parse)
        .collect()
}

/// An allocated row of an owner, with its block's network and family, its
/// address and prefix not yet parsed.
struct OwnerRow {
    network: String,
    family: String,
    row_id: i64,
    block_id: i64,
    address: String,
    cidr: Option<String>,
}

impl OwnerRow {
    fn parse(self) -> Result<HeldRow, StoreError> {
        let block = parse_text(self.cidr.as_deref(), parse_cidr, || {
            format!("the prefix of block {}", self.block_id)
        })?;
        Ok(HeldRow {
            row_id: self.row_id,
            block_id: self.block_id,
            allocation: Allocation {
                address: parse_addr(&self.address)?,
                block,
                gateway: None,
            },
        })
    }
}

/// The allocated rows of owner (container ?1, interface ?2) in any block:
/// one probe of upstream's idempotency index. Their blocks are read one
/// by one ([`BLOCK_OF_ROW_SQL`]) rather than joined: the join costs a
/// one-request process (direct mode prepares every statement it runs)
/// more to prepare than both together, and an ADD finds no row at all.
const OWNER_ROWS_SQL: &str = "SELECT id, cidr_block_id, address FROM ip_addresses \
     WHERE container_id = ?1 AND interface_name = ?2 AND is_allocated = 1";

/// Block ?1's prefix, network and family.
const BLOCK_OF_ROW_SQL: &str = "SELECT cidr, network, ip_family FROM cidr_blocks WHERE id = ?1";

/// The allocated rows of owner (container, interface) in every block,
/// ordered by network, family and row id. A row whose block is missing
/// (or whose block id is not an integer: another writer's) belongs to no
/// network and is not listed.
fn owner_rows(
    conn: &Connection,
    container_id: &str,
    interface_name: &str,
) -> Result<Vec<OwnerRow>, StoreError> {
    let mut rows = Vec::new();
    let mut stmt = conn.prepare_cached(OWNER_ROWS_SQL)?;
    let mut found = stmt.query(params![container_id, interface_name])?;
    while let Some(row) = found.next()? {
        let Ok(block_id) = row.get_ref(1)?.as_i64() else {
            continue;
        };
        // A network or family that is not text is no network's, as in a
        // join on it; a prefix that is not text fails once parsed.
        let block = conn
            .prepare_cached(BLOCK_OF_ROW_SQL)?
            .query_row([block_id], |r| {
                Ok((text_at(r, 0)?, text_at(r, 1)?, text_at(r, 2)?))
            })
            .optional()?;
        let Some((cidr, Some(network), Some(family))) = block else {
            continue;
        };
        rows.push(OwnerRow {
            network,
            family,
            row_id: row.get(0)?,
            block_id,
            address: row.get(2)?,
            cidr,
        });
    }
    rows.sort_by(|a, b| (&a.network, &a.family, a.row_id).cmp(&(&b.network, &b.family, b.row_id)));
    Ok(rows)
}

/// What a DEL released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    pub addresses: Vec<Allocation>,
    /// The networks other than the one asked that held them (renamed under
    /// the pod); empty when the network asked held them.
    pub elsewhere: Vec<String>,
}

/// Where a release looks for the owner's addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// The named network only.
    Network,
    /// The named network, or every network when it holds nothing.
    OrAnyNetworkWhenNone,
}

/// Allocated rows of owner (container, interface) in every network:
/// (network, row), network order.
pub(in crate::store) fn held_in_any_network(
    conn: &Connection,
    container_id: &str,
    interface_name: &str,
) -> Result<Vec<(String, HeldRow)>, StoreError> {
    owner_rows(conn, container_id, interface_name)?
        .into_iter()
        .map(|row| Ok((row.network.clone(), row.parse()?)))
        .collect()
}

/// The row `owner` already holds in its network for `family`, if any
/// (the idempotency check of both allocation paths).
fn held_row_by_owner(
    conn: &Connection,
    owner: &Owner,
    family: Family,
) -> Result<Option<HeldRow>, StoreError> {
    Ok(held(
        conn,
        owner.network,
        owner.container_id,
        owner.interface_name,
        Some(family),
    )?
    .into_iter()
    .next())
}

/// What a repeated ADD returns: the address the owner already holds. It
/// passed the hand-out check when it was handed out; under the
/// configuration now in force it is returned again when it only lies
/// outside the ranges or bounds now configured, at a position they
/// reserve, or in a block since retired or quarantined (the pod has it, and
/// moving a live pod's address is not IPAM's to do: logged), and refused
/// when no result may carry it — the gateway that result would name, or an
/// address outside its own block — so that a DEL and a new ADD replace it.
fn kept(
    conn: &Connection,
    judge: &mut Judge,
    owner: &Owner,
    existing: HeldRow,
) -> Result<Allocation, StoreError> {
    let Allocation { address, block, .. } = existing.allocation;
    match judge.address(conn, existing.block_id, &block, address)? {
        // The owner holds the gateway its result would name: it names a
        // stand-in (`layout::gateway`).
        Ok(()) | Err(Unfit::Gateway(_)) => {}
        Err(unfit @ Unfit::OutsideBlock) => {
            return Err(StoreError::HeldUnfit {
                address,
                container_id: owner.container_id.to_string(),
                why: unfit.to_string(),
            });
        }
        Err(unfit) => {
            crate::log::warn(
                "store",
                "a repeated ADD returns the address the owner holds, which the configuration now in force would not hand out",
                &[
                    ("network", &owner.network),
                    ("container_id", &owner.container_id),
                    ("address", &address),
                    ("why", &unfit),
                ],
            );
        }
    }
    let at = BlockAt {
        id: existing.block_id,
        cidr: &block,
    };
    let names = names(conn, judge, at)?;
    let gateway = record_gateway(conn, existing.row_id, names, RowAllocation::Kept)?;
    Ok(Allocation {
        gateway,
        ..existing.allocation
    })
}

/// What results for block `at` name under the configuration in force
/// ([`crate::store::layout::gateway::naming`]); refused (code 11, naming
/// the gateway and its holder) when no address can stand in for the one a
/// pod holds.
fn names(conn: &Connection, judge: &Judge, at: BlockAt) -> Result<Names, StoreError> {
    crate::store::layout::gateway::naming(conn, judge.gateway_rule(), at.id, at.cidr)?.map_err(
        |held| StoreError::NoAvailableIps {
            network: judge.network.to_string(),
            family: at.cidr.family(),
            quarantined: Vec::new(),
            held_gateways: vec![held.describe_refused()],
            passed_over: Vec::new(),
        },
    )
}

/// `names` once row `address` of block `at` is taken: the stand-in is
/// looked for again when it was that very address.
fn names_after_take(
    conn: &Connection,
    judge: &Judge,
    at: BlockAt,
    names: Names,
    address: IpAddr,
) -> Result<Names, StoreError> {
    match names {
        Names::StandIn(stand_in) if stand_in == address => self::names(conn, judge, at),
        names => Ok(names),
    }
}

/// Records the gateway `names` says the result for row `row_id` names, so
/// that no later hand-out takes it while the allocation lives
/// ([`crate::store::rows::named_gateway::record`]); returns the stand-in,
/// which the result must name instead of the advertised one.
fn record_gateway(
    conn: &Connection,
    row_id: i64,
    names: Names,
    allocation: RowAllocation,
) -> Result<Option<IpAddr>, StoreError> {
    let (gateway, stand_in) = match names {
        Names::Nothing => return Ok(None),
        Names::Advertised(gateway) => (gateway, None),
        Names::StandIn(gateway) => (gateway, Some(gateway)),
    };
    match allocation {
        RowAllocation::Kept => crate::store::rows::named_gateway::record(conn, row_id, gateway)?,
        RowAllocation::Taken { owner, at_ms } => {
            crate::store::rows::named_gateway::record_taken(conn, row_id, gateway, owner, at_ms)?
        }
    }
    Ok(stand_in)
}

/// Which allocation of a row a gateway record is for.
#[derive(Clone, Copy)]
enum RowAllocation<'o> {
    /// The row's, as it stands (a repeated ADD).
    Kept,
    /// The one [`take_row`] just made for `owner` at `at_ms`.
    Taken { owner: &'o Owner<'o>, at_ms: i64 },
}

/// A block as the allocation walks it: its id and prefix.
#[derive(Clone, Copy)]
struct BlockAt<'c> {
    id: i64,
    cidr: &'c Cidr,
}

/// Who takes an address, and when.
#[derive(Clone, Copy)]
struct Claimant<'o> {
    owner: &'o Owner<'o>,
    now_ms: i64,
}

/// Marks row `row_id` (holding `address`) of block `block_id` allocated to
/// `owner` and returns true; or, when host-local's co-written directory
/// records another owner for the address, to that owner, returning false.
fn take_row(
    conn: &Connection,
    row_id: i64,
    block_id: i64,
    address: IpAddr,
    claimant: Claimant,
) -> Result<bool, StoreError> {
    let Claimant { owner, now_ms } = claimant;
    let host_local = crate::store::db::co_writer::before_take(
        conn,
        owner.network,
        address,
        owner.container_id,
        owner.interface_name,
    )?;
    let (container_id, interface_name, pod_name, pod_namespace) = match &host_local {
        None => (
            owner.container_id,
            owner.interface_name,
            owner.pod_name,
            owner.pod_namespace,
        ),
        Some(held) => (held.container_id.as_str(), held.ifname.as_str(), "", ""),
    };
    conn.prepare_cached(TAKE_ROW_SQL)?.execute(params![
        row_id,
        container_id,
        interface_name,
        pod_name,
        pod_namespace,
        now_ms
    ])?;
    conn.prepare_cached(crate::store::rows::block::COUNT_CHANGE_SQL)?
        .execute([block_id, 1])?;
    Ok(host_local.is_none())
}

const FIND_BLOCK_SQL: &str = "SELECT id FROM cidr_blocks WHERE cidr = ?1 AND network = ?2";

/// An unknown pod name or namespace is stored as NULL, as upstream does.
const TAKE_ROW_SQL: &str = concat!(
    "UPDATE ip_addresses SET is_allocated = 1, container_id = ?2, interface_name = ?3, \
     pod_name = NULLIF(?4, ''), pod_namespace = NULLIF(?5, ''), allocated_at = ?6, release_at = NULL, ",
    stamped!(),
    " WHERE id = ?1"
);

/// Every statement that runs for each allocation, release or check, for
/// the query-plan test: none may scan `ip_addresses`, which holds every
/// populated address of every block. (Growth continues from a frontier
/// recorded per block, so it scans nothing either.)
#[cfg(test)]
pub(in crate::store) const ALLOCATION_PATH: [&str; 16] = [
    OWNER_ROWS_SQL,
    BLOCK_OF_ROW_SQL,
    crate::store::rows::free::ALLOCATED_ELSEWHERE_SQL,
    HELD_ELSEWHERE_SQL,
    crate::store::rows::named_gateway::NAMED_AT_ALL_SQL,
    crate::store::rows::named_gateway::NAMING_SQL,
    FIND_BLOCK_SQL,
    CLAIM_SQL,
    COOLED_SQL,
    HAS_FREE_AFTER_SQL,
    crate::store::rows::block::BLOCK_RECORD_SQL,
    crate::store::rows::block::NETWORK_BLOCKS_SQL,
    TAKE_ROW_SQL,
    crate::store::rows::block::COUNT_CHANGE_SQL,
    crate::store::rows::block::RELEASE_ROW_SQL,
    crate::store::rows::block::RETURN_RESERVED_SQL,
];

/// The lowest-id unused row of block ?1 after row id ?2 (the rows before
/// it were passed over), from Metis's index of free rows: the rows still
/// cooling are not in its range, however many there are.
pub(in crate::store) const CLAIM_SQL: &str = concat!(
    "SELECT id, address FROM ip_addresses WHERE cidr_block_id = ?1 AND id > ?2 AND ",
    unused!(""),
    " ORDER BY id LIMIT 1"
);

/// Block ?1's rows whose cooldown is over at ?2, the longest-rested first:
/// the same index's range below ?2, stepped only as far as a claim goes.
pub(in crate::store) const COOLED_SQL: &str = concat!(
    "SELECT id, address FROM ip_addresses WHERE cidr_block_id = ?1 AND ",
    cooled!("", "?2"),
    " ORDER BY release_at"
);

/// Whether block ?1 has an unused row after row id ?2.
const HAS_FREE_AFTER_SQL: &str = concat!(
    "SELECT EXISTS (SELECT 1 FROM ip_addresses WHERE cidr_block_id = ?1 AND id > ?2 AND ",
    unused!(""),
    ")"
);

/// Who holds address ?1 in a block other than ?2, in network ?3 or, unless
/// ?4 (the asking network is isolated), in any network that shares the
/// node's address space: one probe of the `(address, cidr_block_id)`
/// UNIQUE index. Upstream's UNIQUE is per block, so two overlapping
/// blocks of two networks (upstream's `AddCIDR` after a rollback) each
/// have a row for one address.
const HELD_ELSEWHERE_SQL: &str = "SELECT a.container_id, COALESCE(a.interface_name, ''), b.network, b.cidr \
     FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE a.address = ?1 AND a.cidr_block_id != ?2 AND a.is_allocated = 1 \
       AND (b.network = ?3 OR (?4 = 0 AND b.network NOT IN \
         (SELECT network FROM metis_networks WHERE isolated = 1))) \
     LIMIT 1";

/// Why `address` of block `block_id` is another allocation's, in the
/// node's address space as `network` sees it, if it is: its owner in
/// another block (see [`HELD_ELSEWHERE_SQL`]), or a live result naming it
/// as its gateway ([`crate::store::rows::named_gateway::naming`]).
pub(in crate::store) fn taken_elsewhere(
    conn: &Connection,
    network: &str,
    isolated: bool,
    block_id: i64,
    address: IpAddr,
) -> Result<Option<Unfit>, StoreError> {
    let address_text = crate::cidr::address_text(address);
    // The join only where the cheap probe finds the address allocated.
    let held = match crate::store::rows::free::allocated_elsewhere(
        conn,
        &address_text,
        Some(block_id),
        Holder::Any,
    )? {
        false => None,
        true => conn
            .prepare_cached(HELD_ELSEWHERE_SQL)?
            .query_row(params![address_text, block_id, network, isolated], |r| {
                Ok(Unfit::HeldElsewhere {
                    container_id: r.get(0)?,
                    interface_name: r.get(1)?,
                    network: r.get(2)?,
                    block: r.get(3)?,
                })
            })
            .optional()?,
    };
    match held {
        Some(unfit) => Ok(Some(unfit)),
        None => crate::store::rows::named_gateway::naming(conn, network, isolated, address),
    }
}

/// The hand-out check of one allocation ([`crate::store::rows::handout`]): the
/// configuration in force, Metis's record of each block looked at, and
/// what was passed over, for the exhaustion message.
pub(super) struct Judge<'s> {
    conf: InForce,
    /// No configuration was given: each block's recorded bounds stand in.
    recorded: bool,
    pub(super) mode: ReserveMode,
    pub(super) network: &'s str,
    /// Whether `network` is isolated (read once: nothing an allocation
    /// does changes it).
    isolated: bool,
    /// Metis's record of each block asked about, read once per allocation.
    pub(super) records: crate::store::rows::block::Records,
    blocks: Vec<(i64, BlockRecord)>,
    pub(super) passed_over: Vec<String>,
    /// What this store already logged as passed over, and the counts
    /// (`None`: a read-only question, STATUS's, which logs and counts
    /// nothing).
    seen: Option<&'s mut PassedOver>,
}

impl<'s> Judge<'s> {
    pub(super) fn new(
        conn: &Connection,
        conf: Option<&InForce>,
        mode: ReserveMode,
        network: &'s str,
        seen: Option<&'s mut PassedOver>,
    ) -> Result<Judge<'s>, StoreError> {
        Ok(Judge {
            conf: conf.cloned().unwrap_or_default(),
            recorded: conf.is_none(),
            mode,
            network,
            isolated: crate::store::layout::blocks::is_isolated(conn, network)?,
            records: crate::store::rows::block::Records::default(),
            blocks: Vec::new(),
            passed_over: Vec::new(),
            seen,
        })
    }

    /// The held-gateway rule of this allocation: where a holder of the
    /// network's gateway is looked for, under the bounds in force.
    pub(super) fn gateway_rule(&self) -> crate::store::layout::gateway::GatewayRule<'_> {
        crate::store::layout::gateway::GatewayRule {
            mode: self.mode,
            network: self.network,
            in_force: self.in_force(),
            space: crate::store::layout::gateway::Space::Shared {
                isolated: self.isolated,
            },
        }
    }

    /// Where Metis's record of block `id` is in `blocks` (read once per
    /// allocation).
    pub(super) fn record(
        &mut self,
        conn: &Connection,
        id: i64,
        cidr: &Cidr,
    ) -> Result<usize, StoreError> {
        if let Some(at) = self.blocks.iter().position(|(block, _)| *block == id) {
            return Ok(at);
        }
        let record = self.records.get(conn, id)?.cloned();
        let record = block_record(conn, self.mode, self.network, BlockAt { id, cidr }, record)?;
        if self.recorded
            && let Some(bounds) = crate::store::rows::block::bounds_of(conn, self.network, cidr)?
        {
            self.conf.bounds.push((*cidr, bounds));
        }
        self.blocks.push((id, record));
        Ok(self.blocks.len() - 1)
    }

    /// The bounds of the configuration in force, for the held-gateway rule
    /// (`None`: none given, each block's recorded bounds stand in).
    fn in_force(&self) -> crate::store::layout::gateway::InForceBounds<'_> {
        (!self.recorded).then_some(self.conf.bounds.as_slice())
    }

    /// Whether anything of block `id` may be handed out (noted when not).
    pub(super) fn block(
        &mut self,
        conn: &Connection,
        id: i64,
        cidr: &Cidr,
    ) -> Result<bool, StoreError> {
        let at = self.record(conn, id, cidr)?;
        let verdict = block_fit(&self.blocks[at].1, &self.conf);
        match verdict {
            Ok(()) => Ok(true),
            Err(unfit) => {
                self.pass_over(format!("block {cidr}"), unfit.reason(), &unfit);
                Ok(false)
            }
        }
    }

    /// The hand-out check of `address` in block `id`: every address the
    /// store returns passes here.
    pub(super) fn address(
        &mut self,
        conn: &Connection,
        id: i64,
        cidr: &Cidr,
        address: IpAddr,
    ) -> Result<Result<(), Unfit>, StoreError> {
        let at = self.record(conn, id, cidr)?;
        Ok(address_fit(address, &self.blocks[at].1, &self.conf))
    }

    /// Notes what was passed over and why (and tells the store, which
    /// logs and counts it: [`PassedOver::note`]).
    pub(super) fn pass_over(
        &mut self,
        what: String,
        reason: &'static str,
        why: &dyn std::fmt::Display,
    ) {
        let line = format!("{what}: {why}");
        if let Some(seen) = self.seen.as_deref_mut() {
            seen.note(reason, &line, self.network);
        }
        self.passed_over.push(line);
    }
}

/// What Metis knows of block `id` ([`BlockRecord`]), from its `record`.
fn block_record(
    conn: &Connection,
    mode: ReserveMode,
    network: &str,
    block: BlockAt,
    record: Option<crate::store::rows::block::Record>,
) -> Result<BlockRecord, StoreError> {
    let BlockAt { id, cidr } = block;
    let crate::store::rows::block::Record {
        sources,
        retired,
        quarantined,
    } = record.unwrap_or_default();
    let first = mode == ReserveMode::FirstBlock
        && cidr.family() == Family::V4
        && crate::store::rows::block::is_first_v4(conn, network, id)?;
    Ok(BlockRecord {
        cidr: *cidr,
        fixed: crate::store::rows::block::reserved_offsets(cidr, mode, first),
        retired,
        quarantined,
        // No record of its sources: upstream's block (or an older
        // Metis's), which the layout keeps as it is (`layout::record_sources`).
        granted: sources.is_none_or(|text| {
            crate::store::layout::blocks::parse_sources(&text)
                .iter()
                .any(|source| *source != crate::store::layout::blocks::Source::Cni)
        }),
    })
}

/// One allocation's claims in a block: how far they walked its free rows
/// (the unused ones up to row `after`, and whether the cooled ones were
/// walked: they do not change within the allocation's transaction), and
/// the gateway the result will name.
#[derive(Debug, Clone, Copy)]
struct Walk {
    after: i64,
    cooled_walked: bool,
    names: Names,
}

impl Walk {
    fn new(names: Names) -> Walk {
        Walk {
            after: 0,
            cooled_walked: false,
            names,
        }
    }
}

/// Claims a free row of a block: the lowest-id unused one after
/// `walk.after`, else (once per allocation) the cooled one that rested
/// longest — passing over rows that fail the hand-out check, and those
/// host-local turns out to hold (each recorded for its holder). Unused
/// first keeps upstream's order where no cooldown is in force, and
/// otherwise lets released addresses rest as long as the block allows.
fn claim(
    conn: &Connection,
    judge: &mut Judge,
    block: BlockAt,
    claimant: Claimant,
    walk: &mut Walk,
) -> Result<Option<Allocation>, StoreError> {
    loop {
        let row: Option<(i64, String)> = conn
            .prepare_cached(CLAIM_SQL)?
            .query_row(params![block.id, walk.after], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()?;
        let Some((row_id, text)) = row else {
            break;
        };
        walk.after = row_id;
        let row = (row_id, text.as_str());
        if let Some(taken) = take_if_fit(conn, judge, block, claimant, (row, walk.names))? {
            return Ok(Some(taken));
        }
    }
    if std::mem::replace(&mut walk.cooled_walked, true) {
        return Ok(None);
    }
    let mut stmt = conn.prepare_cached(COOLED_SQL)?;
    let mut rows = stmt.query(params![block.id, claimant.now_ms])?;
    while let Some(row) = rows.next()? {
        let (row_id, text): (i64, String) = (row.get(0)?, row.get(1)?);
        let row = (row_id, text.as_str());
        if let Some(taken) = take_if_fit(conn, judge, block, claimant, (row, walk.names))? {
            return Ok(Some(taken));
        }
    }
    Ok(None)
}

/// Takes row (id, address text) of `block` for the claimant when it passes
/// the hand-out check and host-local holds no other owner for it; its
/// result names what `names` says (looked for again when the row taken
/// was the stand-in itself).
fn take_if_fit(
    conn: &Connection,
    judge: &mut Judge,
    block: BlockAt,
    claimant: Claimant,
    ((row_id, text), names): ((i64, &str), Names),
) -> Result<Option<Allocation>, StoreError> {
    let Some(address) = fit_row(conn, judge, block.id, block.cidr, text)? else {
        return Ok(None);
    };
    if !take_row(conn, row_id, block.id, address, claimant)? {
        return Ok(None);
    }
    let names = names_after_take(conn, judge, block, names, address)?;
    let taken = RowAllocation::Taken {
        owner: claimant.owner,
        at_ms: claimant.now_ms,
    };
    Ok(Some(Allocation {
        address,
        block: *block.cidr,
        gateway: record_gateway(conn, row_id, names, taken)?,
    }))
}

/// The address of row `text` of block `block_id` when the hand-out check
/// passes it (else it is noted as passed over): what [`claim`] takes and
/// STATUS counts as room ([`room`]).
pub(super) fn fit_row(
    conn: &Connection,
    judge: &mut Judge,
    block_id: i64,
    cidr: &Cidr,
    text: &str,
) -> Result<Option<IpAddr>, StoreError> {
    let Ok(address) = text.parse::<IpAddr>() else {
        judge.pass_over(
            format!("row {text:?} of block {cidr}"),
            NOT_AN_ADDRESS,
            &"not an address",
        );
        return Ok(None);
    };
    fit_address(conn, judge, block_id, cidr, address)
}

/// `address` of block `block_id` when the hand-out check passes it (else
/// noted as passed over): the configuration in force, then the rest of
/// the node's address space ([`taken_elsewhere`]).
pub(super) fn fit_address(
    conn: &Connection,
    judge: &mut Judge,
    block_id: i64,
    cidr: &Cidr,
    address: IpAddr,
) -> Result<Option<IpAddr>, StoreError> {
    let unfit = match judge.address(conn, block_id, cidr, address)? {
        Err(unfit) => Some(unfit),
        Ok(()) => taken_elsewhere(conn, judge.network, judge.isolated, block_id, address)?,
    };
    match unfit {
        Some(unfit) => {
            judge.pass_over(format!("{address} of block {cidr}"), unfit.reason(), &unfit);
            Ok(None)
        }
        None => Ok(Some(address)),
    }
}

/// Populates the next batch of a block from its frontier. Returns rows
/// inserted (0: has a free usable row after row `after` already, or
/// populated to its end).
fn expand(
    conn: &Connection,
    mode: ReserveMode,
    block: BlockAt,
    claimant: Claimant,
    after: i64,
) -> Result<u64, StoreError> {
    let BlockAt { id: block_id, cidr } = block;
    let network = claimant.owner.network;
    let has_free: bool = conn
        .prepare_cached(HAS_FREE_AFTER_SQL)?
        .query_row(params![block_id, after], |r| r.get(0))?;
    if has_free {
        return Ok(0);
    }
    let mut start = frontier(conn, block_id, cidr)?;
    let reserved = block_reserved(conn, mode, block_id, network, cidr)?;
    // Only the usable range is populated (host-local bounds): the rest of
    // the block is reserved by description, never row by row.
    let usable = reserved.usable(cidr.size());
    start = start.max(usable.start);
    // Batches already populated by someone else (or rows moved in when
    // the block grew) insert nothing: move on until one adds a row or the
    // range ends. Each row is passed over once: the frontier is recorded.
    while start < usable.end {
        let end = start.saturating_add(GROWTH_BATCH).min(usable.end);
        let inserted = insert_rows(conn, block_id, cidr, start..end, &reserved)?;
        set_frontier(conn, block_id, end)?;
        if inserted > 0 {
            return Ok(inserted);
        }
        start = end;
    }
    Ok(0)
}

impl Store {
    /// Records that the conflist named `conf_name` served `network` last,
    /// so that its GC covers the network also after its `ipam.network` is
    /// renamed. Writes only when that changes; an empty name records
    /// nothing.
    pub fn note_served_by(&mut self, network: &str, conf_name: &str) -> Result<(), StoreError> {
        if conf_name.is_empty() {
            return Ok(());
        }
        self.set_network_column::<String, &str>(
            network,
            crate::store::db::NetworkColumn::ConfName,
            Some(conf_name),
        )
    }

    /// What the hand-out check passed over since the last call, by reason
    /// (the daemon adds it to its counter).
    pub fn take_passed_over_counts(&mut self) -> std::collections::BTreeMap<&'static str, u64> {
        std::mem::take(&mut self.passed_over.counts)
    }

    /// The id of the block (cidr, network), if any.
    pub fn find_block(&self, network: &str, cidr: &Cidr) -> Result<Option<i64>, StoreError> {
        find_block(&self.conn, network, &cidr.to_string())
    }

    /// Allocates an address of `family` in `network` to `owner`, judged
    /// against the network's blocks as laid out and recorded (no
    /// configuration in force: see [`Store::allocate_under`]).
    pub fn allocate(
        &mut self,
        owner: &Owner,
        family: Family,
        now_ms: i64,
    ) -> Result<Allocation, StoreError> {
        self.allocate_under(owner, family, None, now_ms)
    }

    /// Allocates an address of `family` in `network` to `owner`; repeating
    /// the call returns the address already held (see [`kept`]). Every
    /// address returned passed the hand-out check against `conf`, the
    /// configuration in force (`None`: the blocks as recorded); one that
    /// fails it is passed over, and when none is left the exhaustion says
    /// what was passed over and why.
    pub fn allocate_under(
        &mut self,
        owner: &Owner,
        family: Family,
        conf: Option<&InForce>,
        now_ms: i64,
    ) -> Result<Allocation, StoreError> {
        validate_owner(owner.container_id, owner.interface_name)?;
        let mode = self.reserve;
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let mut judge = Judge::new(&tx, conf, mode, owner.network, Some(&mut self.passed_over))?;
        if let Some(existing) = held_row_by_owner(&tx, owner, family)? {
            let kept = kept(&tx, &mut judge, owner, existing)?;
            // Keeps the record of the gateway this result names.
            tx.commit()?;
            return Ok(kept);
        }
        // Each block is judged when the allocation comes to it, oldest
        // first: the first with a free row ends it, and the rest are looked
        // at only when none has one (their held gateways then go into the
        // exhaustion message).
        let claimant = Claimant { owner, now_ms };
        let mut held_gateways = Vec::new();
        let mut candidates = Vec::new();
        for (id, cidr) in candidates_of(&tx, owner.network, family, &mut judge.records)? {
            let block = BlockAt { id, cidr: &cidr };
            let rule = judge.gateway_rule();
            let names = match crate::store::layout::gateway::naming(&tx, rule, id, &cidr)? {
                Ok(names) => names,
                Err(held) => {
                    held_gateways.push(held.describe_refused());
                    continue;
                }
            };
            if !judge.block(&tx, id, &cidr)? {
                continue;
            }
            let mut walk = Walk::new(names);
            if let Some(allocation) = claim(&tx, &mut judge, block, claimant, &mut walk)? {
                tx.commit()?;
                return Ok(allocation);
            }
            candidates.push((id, cidr, walk));
        }
        for (id, cidr, walk) in &mut candidates {
            for _ in 0..MAX_EXPANSIONS_PER_BLOCK {
                let block = BlockAt { id: *id, cidr };
                if expand(&tx, mode, block, claimant, walk.after)? == 0 {
                    break;
                }
                if let Some(allocation) = claim(&tx, &mut judge, block, claimant, walk)? {
                    tx.commit()?;
                    return Ok(allocation);
                }
            }
        }
        let quarantined = quarantined_in(&tx, owner.network, family)?;
        let passed_over = std::mem::take(&mut judge.passed_over);
        // Keep any rows populated on the way; they are valid.
        tx.commit()?;
        Err(StoreError::NoAvailableIps {
            network: owner.network.to_string(),
            family,
            quarantined,
            held_gateways,
            passed_over,
        })
    }

    /// Allocates exactly `address` to `owner` (static IP request), judged
    /// against the blocks as recorded (see [`Store::allocate_requested_under`]).
    pub fn allocate_requested(
        &mut self,
        owner: &Owner,
        address: IpAddr,
        now_ms: i64,
    ) -> Result<Allocation, StoreError> {
        self.allocate_requested_under(owner, address, None, now_ms)
    }

    /// Allocates exactly `address` to `owner` (static IP request), once it
    /// passed the hand-out check against `conf`.
    pub fn allocate_requested_under(
        &mut self,
        owner: &Owner,
        address: IpAddr,
        conf: Option<&InForce>,
        now_ms: i64,
    ) -> Result<Allocation, StoreError> {
        validate_owner(owner.container_id, owner.interface_name)?;
        let mode = self.reserve;
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let mut judge = Judge::new(&tx, conf, mode, owner.network, Some(&mut self.passed_over))?;
        if let Some(existing) = held_row_by_owner(&tx, owner, Family::of(address))? {
            let existing = kept(&tx, &mut judge, owner, existing)?;
            let answer = already_held(owner, existing, address)?;
            tx.commit()?;
            return Ok(answer);
        }
        let (block_id, cidr) = ready_block_containing(&tx, owner.network, address)?;
        if let Err(unfit) = judge.address(&tx, block_id, &cidr, address)? {
            let reason = match unfit {
                Unfit::Quarantined => Unavailable::Quarantined { block: cidr },
                Unfit::Reserved | Unfit::Gateway(_) | Unfit::OutsideBounds { .. } => {
                    Unavailable::ReservedPosition { block: cidr }
                }
                Unfit::HeldElsewhere { container_id, .. } => Unavailable::Held { container_id },
                Unfit::NamedGateway { .. }
                | Unfit::Retired
                | Unfit::BlockOutsideRanges { .. }
                | Unfit::OutsideRanges { .. }
                | Unfit::OutsideBlock => Unavailable::OutsideConfig {
                    why: unfit.to_string(),
                },
            };
            return Err(unavailable(address, reason));
        }
        match taken_elsewhere(&tx, owner.network, judge.isolated, block_id, address)? {
            Some(Unfit::HeldElsewhere { container_id, .. }) => {
                return Err(unavailable(address, Unavailable::Held { container_id }));
            }
            Some(unfit) => {
                return Err(unavailable(
                    address,
                    Unavailable::OutsideConfig {
                        why: unfit.to_string(),
                    },
                ));
            }
            None => {}
        }
        let block = BlockAt {
            id: block_id,
            cidr: &cidr,
        };
        let names = names(&tx, &judge, block)?;
        let offset = cidr.offset_of(address).unwrap_or(0);
        let (row_id, row) = requested_row(&tx, block_id, &cidr, address, offset)?;
        ensure_free(&row, owner, &cidr, address, now_ms)?;
        if !take_row(&tx, row_id, block_id, address, Claimant { owner, now_ms })? {
            return Err(unavailable(address, Unavailable::HeldByHostLocal));
        }
        let names = names_after_take(&tx, &judge, block, names, address)?;
        let taken = RowAllocation::Taken {
            owner,
            at_ms: now_ms,
        };
        let gateway = record_gateway(&tx, row_id, names, taken)?;
        tx.commit()?;
        Ok(Allocation {
            address,
            block: cidr,
            gateway,
        })
    }

    /// DEL: releases every address the owner holds in `network` (all
    /// families, any block state). Addresses rest for the store's release
    /// cooldown; the last owner stays recorded. A pod that held a reserved
    /// position gives it back to the reservation. When `network` holds
    /// nothing for the owner, what other networks hold for
    /// exactly (`container_id`, `interface_name`) is released instead — the
    /// allocation of a network renamed under its pod (`ipam.network`
    /// changed), which no DEL under the new name could reach otherwise. An
    /// interface of a container has one IPAM configuration, so that key is
    /// the same attachment. Returns the addresses and the networks they were
    /// released from when not `network`.
    pub fn release(
        &mut self,
        network: &str,
        container_id: &str,
        interface_name: &str,
        now_ms: i64,
    ) -> Result<Released, StoreError> {
        let release_at = self.release_at(now_ms);
        let rows = self.give_back_owner(
            network,
            container_id,
            interface_name,
            None,
            release_at,
            Reach::OrAnyNetworkWhenNone,
        )?;
        let mut elsewhere: Vec<String> = rows
            .iter()
            .filter(|(held_in, _)| held_in != network)
            .map(|(held_in, _)| held_in.clone())
            .collect();
        elsewhere.dedup();
        Ok(Released {
            addresses: rows.into_iter().map(|(_, allocation)| allocation).collect(),
            elsewhere,
        })
    }

    /// Like [`Store::release`] of `network` alone for one family, but the
    /// address is free at once:
    /// for an allocation undone before it reached a pod.
    pub fn roll_back(
        &mut self,
        network: &str,
        container_id: &str,
        interface_name: &str,
        family: Family,
    ) -> Result<Vec<Allocation>, StoreError> {
        let rows = self.give_back_owner(
            network,
            container_id,
            interface_name,
            Some(family),
            None,
            Reach::Network,
        )?;
        Ok(rows.into_iter().map(|(_, allocation)| allocation).collect())
    }

    /// Releases what the owner holds, inside one write transaction; every
    /// release passes host-local's co-writer first. Returns each address
    /// with the network it was released from.
    fn give_back_owner(
        &mut self,
        network: &str,
        container_id: &str,
        interface_name: &str,
        family: Option<Family>,
        release_at: Option<i64>,
        reach: Reach,
    ) -> Result<Vec<(String, Allocation)>, StoreError> {
        validate_owner(container_id, interface_name)?;
        let mode = self.reserve;
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        crate::store::db::co_writer::before_release(
            &tx,
            network,
            container_id,
            interface_name,
            family,
        )?;
        let mut rows: Vec<(String, HeldRow)> =
            held(&tx, network, container_id, interface_name, family)?
                .into_iter()
                .map(|row| (network.to_string(), row))
                .collect();
        if rows.is_empty() && reach == Reach::OrAnyNetworkWhenNone {
            rows = held_in_any_network(&tx, container_id, interface_name)?;
        }
        for (held_in, row) in &rows {
            if held_in == network {
                give_back_row(&tx, mode, held_in, row, release_at)?;
            } else {
                give_back(&tx, mode, held_in, row, release_at)?;
            }
        }
        tx.commit()?;
        Ok(rows
            .into_iter()
            .map(|(held_in, row)| (held_in, row.allocation))
            .collect())
    }

    /// The addresses the owner holds in `network`, IPv4 first (empty: none).
    pub fn check(
        &self,
        network: &str,
        container_id: &str,
        interface_name: &str,
    ) -> Result<Vec<Allocation>, StoreError> {
        validate_owner(container_id, interface_name)?;
        Ok(
            held(&self.conn, network, container_id, interface_name, None)?
                .into_iter()
                .map(|row| row.allocation)
                .collect(),
        )
    }
}

fn unavailable(address: IpAddr, reason: Unavailable) -> StoreError {
    StoreError::RequestedIpUnavailable { address, reason }
}

/// The answer to a static request from an owner that already holds an
/// address of that family: the same address again, else a refusal.
fn already_held(
    owner: &Owner,
    existing: Allocation,
    address: IpAddr,
) -> Result<Allocation, StoreError> {
    if existing.address == address {
        return Ok(existing);
    }
    Err(unavailable(
        address,
        Unavailable::OwnerHolds {
            container_id: owner.container_id.to_string(),
            interface_name: owner.interface_name.to_string(),
            held: existing.address,
            network: owner.network.to_string(),
        },
    ))
}

/// The non-Deleting block of `network` containing `address`, which must
/// be Ready: (id, cidr).
fn ready_block_containing(
    conn: &Connection,
    network: &str,
    address: IpAddr,
) -> Result<(i64, Cidr), StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, cidr, state FROM cidr_blocks \
         WHERE network = ?1 AND ip_family = ?2 AND state != 'Deleting' ORDER BY id",
    )?;
    let mut rows = stmt.query(params![network, Family::of(address).as_str()])?;
    while let Some(row) = rows.next()? {
        let cidr = parse_cidr(&row.get::<_, String>(1)?)?;
        if !cidr.contains(address) {
            continue;
        }
        let state = parse_state(&row.get::<_, String>(2)?)?;
        if state != BlockState::Ready {
            return Err(unavailable(
                address,
                Unavailable::BlockNotReady { block: cidr, state },
            ));
        }
        return Ok((row.get(0)?, cidr));
    }
    Err(StoreError::RequestedIpOutsideBlocks {
        address,
        network: network.to_string(),
    })
}

/// The row of `address` (at `offset`) in block `block_id`, inserted first
/// if the block has not been populated that far: (row id, what it holds).
fn requested_row(
    conn: &Connection,
    block_id: i64,
    cidr: &Cidr,
    address: IpAddr,
    offset: u128,
) -> Result<(i64, RowView), StoreError> {
    let text = crate::cidr::address_text(address);
    if let Some(row) = find_row(conn, &text, block_id)? {
        return Ok(row);
    }
    insert_rows(
        conn,
        block_id,
        cidr,
        offset..offset + 1,
        &Reserved::fixed(Vec::new()),
    )?;
    find_row(conn, &text, block_id)?
        .ok_or_else(|| StoreError::Corrupt(format!("row {text} vanished after insert")))
}

fn find_row(
    conn: &Connection,
    address: &str,
    block_id: i64,
) -> Result<Option<(i64, RowView)>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT id, is_allocated, COALESCE(container_id, ''), \
             COALESCE(interface_name, ''), release_at \
             FROM ip_addresses WHERE address = ?1 AND cidr_block_id = ?2",
        )?
        .query_row(params![address, block_id], |r| {
            Ok((
                r.get(0)?,
                RowView {
                    allocated: r.get(1)?,
                    container_id: r.get(2)?,
                    interface_name: r.get(3)?,
                    release_at: r.get(4)?,
                },
            ))
        })
        .optional()?)
}

/// Refuses a row that is not free now for `owner` (see [`availability`]).
fn ensure_free(
    row: &RowView,
    owner: &Owner,
    cidr: &Cidr,
    address: IpAddr,
    now_ms: i64,
) -> Result<(), StoreError> {
    availability(row, owner.container_id, owner.interface_name, now_ms).map_err(|taken| {
        let reason = match taken {
            Taken::Reserved => Unavailable::ReservedRow { block: *cidr },
            Taken::Held { container_id } => Unavailable::Held { container_id },
            Taken::Cooling { until_ms } => Unavailable::Cooling { until_ms },
        };
        unavailable(address, reason)
    })
}

fn find_block(conn: &Connection, network: &str, cidr: &str) -> Result<Option<i64>, StoreError> {
    Ok(conn
        .prepare_cached(FIND_BLOCK_SQL)?
        .query_row(params![cidr, network], |r| r.get(0))
        .optional()?)
}

/// Ready, unquarantined blocks of network+family with room, oldest
/// (lowest id) first.
pub(in crate::store) fn candidates_of(
    conn: &Connection,
    network: &str,
    family: Family,
    records: &mut crate::store::rows::block::Records,
) -> Result<Vec<(i64, Cidr)>, StoreError> {
    let mut out = Vec::new();
    for block in crate::store::rows::block::network_blocks(conn, network, family)? {
        if !block.is("Ready") || !block.has_room {
            continue;
        }
        if records.get(conn, block.id)?.is_some_and(|r| r.quarantined) {
            continue;
        }
        out.push((block.id, block.prefix()?));
    }
    Ok(out)
}
