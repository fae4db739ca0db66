//! The hand-out check: at the moment an address is handed out it is judged
//! against the configuration in force for the request (the conflist's
//! ranges of the family, their `rangeStart`/`rangeEnd`/`gateway`) and
//! against Metis's own record of its block — whatever rows, frontier or
//! `cidr_blocks.state` the database holds. Another writer may have made
//! them: a direct-mode plugin under another conflist, upstream's store
//! after a rollback, a person with `sqlite3`. Pure: plain data in, a
//! verdict out; `alloc` calls it for every address it is about to return.

use std::fmt;
use std::net::IpAddr;

use crate::cidr::{Bounds, Cidr, gateway_for};

/// The configuration an address of one family is handed out under.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InForce {
    /// The conflist's ranges of the family. Empty: no conflist (the
    /// store's own callers, a request without ranges): every block of the
    /// network as laid out.
    pub ranges: Vec<Cidr>,
    /// host-local bounds of the ranges that have them (keyed by subnet).
    pub bounds: Vec<(Cidr, Bounds)>,
}

/// What Metis knows of the block an address lies in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRecord {
    pub cidr: Cidr,
    /// The reservation mode's fixed offsets (network, gateway, broadcast);
    /// they apply unless the block has host-local bounds of its own.
    pub fixed: Vec<u128>,
    /// Metis retired it (no source wants it), whatever its state says.
    pub retired: bool,
    pub quarantined: bool,
    /// Served beside the configured ranges: a source other than a
    /// conflist wants it (the daemon's `--cidr` flags, the Node, the
    /// NodeNetworkConfig), or Metis has no record of its sources
    /// (upstream's block, which the layout keeps as it is).
    pub granted: bool,
}

/// Why an address may not be handed out under the configuration in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unfit {
    Quarantined,
    Retired,
    /// The block neither overlaps a configured range nor is granted.
    BlockOutsideRanges {
        ranges: Vec<Cidr>,
    },
    /// The row's address does not lie in its own block.
    OutsideBlock,
    /// The address lies in no configured range (and its block is not
    /// granted).
    OutsideRanges {
        ranges: Vec<Cidr>,
    },
    /// Outside `rangeStart`..`rangeEnd` of its range.
    OutsideBounds {
        start: IpAddr,
        end: IpAddr,
    },
    /// The gateway a result for it would name, or its range's gateway.
    Gateway(IpAddr),
    /// A reserved position of its block (network, gateway, broadcast).
    Reserved,
    /// Another row of the node's address space holds it: an overlapping
    /// block (of this network or another that is not isolated) has a row
    /// for the same address, allocated. Not found by [`address_fit`] (it
    /// reads the database: `alloc` asks per candidate).
    HeldElsewhere {
        container_id: String,
        interface_name: String,
        network: String,
        block: String,
    },
    /// A live result Metis returned names it as its gateway (another
    /// conflist of the network, with another gateway): the host may route
    /// through it (bridge `isGateway` takes it). Not found by
    /// [`address_fit`] (`metis_gateways`: `alloc` asks per candidate).
    NamedGateway {
        container_id: String,
        interface_name: String,
        network: String,
    },
}

impl fmt::Display for Unfit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |ranges: &[Cidr]| {
            ranges
                .iter()
                .map(Cidr::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Unfit::Quarantined => f.write_str("its block is quarantined"),
            Unfit::Retired => f.write_str("its block was retired (no configuration wants it)"),
            Unfit::BlockOutsideRanges { ranges } => write!(
                f,
                "its block lies outside the configured ranges {}",
                list(ranges)
            ),
            Unfit::OutsideBlock => f.write_str("it lies outside its own block"),
            Unfit::OutsideRanges { ranges } => {
                write!(f, "it lies outside the configured ranges {}", list(ranges))
            }
            Unfit::OutsideBounds { start, end } => {
                write!(f, "it lies outside rangeStart..rangeEnd {start}-{end}")
            }
            Unfit::Gateway(gateway) => write!(f, "it is the gateway {gateway}"),
            Unfit::Reserved => f.write_str("it is a reserved address of its block"),
            Unfit::HeldElsewhere {
                container_id,
                interface_name,
                network,
                block,
            } => write!(
                f,
                "it is held by container {container_id:?} interface {interface_name:?} in block {block} of network {network:?}"
            ),
            Unfit::NamedGateway {
                container_id,
                interface_name,
                network,
            } => write!(
                f,
                "it is the gateway of the result container {container_id:?} interface {interface_name:?} holds in network {network:?}"
            ),
        }
    }
}

impl Unfit {
    /// The reason, as the `reason` label of the passed-over counter.
    pub fn reason(&self) -> &'static str {
        match self {
            Unfit::Quarantined => "quarantined",
            Unfit::Retired => "retired",
            Unfit::BlockOutsideRanges { .. } => "block_outside_ranges",
            Unfit::OutsideBlock => "outside_block",
            Unfit::OutsideRanges { .. } => "outside_ranges",
            Unfit::OutsideBounds { .. } => "outside_bounds",
            Unfit::Gateway(_) => "gateway",
            Unfit::Reserved => "reserved",
            Unfit::HeldElsewhere { .. } => "held_elsewhere",
            Unfit::NamedGateway { .. } => "named_gateway",
        }
    }
}

/// Whether anything of `block` may be handed out under `conf`.
pub fn block_fit(block: &BlockRecord, conf: &InForce) -> Result<(), Unfit> {
    if block.quarantined {
        return Err(Unfit::Quarantined);
    }
    if block.retired {
        return Err(Unfit::Retired);
    }
    let overlaps =
        |range: &Cidr| range.contains(block.cidr.base()) || block.cidr.contains(range.base());
    if conf.ranges.is_empty() || block.granted || conf.ranges.iter().any(overlaps) {
        return Ok(());
    }
    Err(Unfit::BlockOutsideRanges {
        ranges: conf.ranges.clone(),
    })
}

/// Whether `address`, a row of `block`, may be handed out under `conf`:
/// the one check every address the store returns passes.
pub fn address_fit(address: IpAddr, block: &BlockRecord, conf: &InForce) -> Result<(), Unfit> {
    block_fit(block, conf)?;
    let Some(offset) = block.cidr.offset_of(address) else {
        return Err(Unfit::OutsideBlock);
    };
    let in_range = conf.ranges.iter().any(|range| range.contains(address));
    if !conf.ranges.is_empty() && !in_range && !block.granted {
        return Err(Unfit::OutsideRanges {
            ranges: conf.ranges.clone(),
        });
    }
    // The gateway the CNI result names for an address of this block
    // (`cni::result`): the block's own configured one, else Metis's.
    let own = conf
        .bounds
        .iter()
        .find(|(subnet, _)| *subnet == block.cidr)
        .map(|(_, bounds)| bounds);
    let gateway = own.map_or_else(|| gateway_for(&block.cidr), |bounds| bounds.gateway);
    if address == gateway {
        return Err(Unfit::Gateway(gateway));
    }
    if let Some((_, bounds)) = conf
        .bounds
        .iter()
        .find(|(subnet, _)| subnet.contains(address))
    {
        if address < bounds.start || address > bounds.end {
            return Err(Unfit::OutsideBounds {
                start: bounds.start,
                end: bounds.end,
            });
        }
        if address == bounds.gateway {
            return Err(Unfit::Gateway(bounds.gateway));
        }
    }
    if own.is_none() && block.fixed.contains(&offset) {
        return Err(Unfit::Reserved);
    }
    Ok(())
}
