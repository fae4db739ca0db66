//! What the engine is asked, typed: names checked, ranges as [`Cidr`]s with
//! their bounds, addresses as [`IpAddr`]s. `crate::decode` makes these from
//! the wire, once; the plugin's direct mode and `metis import host-local`
//! build them directly, so nothing past this point parses a string.

use std::net::IpAddr;

use crate::cidr::Family;
use crate::names::Attachment;
use crate::store::{AddressFilter, BlockFilter, InForce};

/// One request to the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Boxed: an ADD is several times the size of any other request.
    Add(Box<Add>),
    Del(Del),
    Check(Check),
    ListBlocks(BlockFilter),
    ListAddresses(AddressFilter),
    Health,
    Usage(UsageQuery),
    Gc(Gc),
    Status(StatusQuery),
}

impl Command {
    /// Whether serving it may change the store. Every kind says so here (no
    /// wildcard): the daemon runs writes in a savepoint of its group commit
    /// and reads without the write lock.
    pub fn writes(&self) -> bool {
        match self {
            Command::Add(_) | Command::Del(_) | Command::Gc(_) => true,
            Command::Check(_)
            | Command::ListBlocks(_)
            | Command::ListAddresses(_)
            | Command::Health
            | Command::Usage(_)
            | Command::Status(_) => false,
        }
    }
}

/// A pod's namespace and name: labels on its rows and in messages, either
/// possibly empty (Podman sends none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
}

/// ADD: an address of each family the request has a part for (at least one).
#[derive(Debug, Clone, PartialEq)]
pub struct Add {
    pub network: String,
    pub pod: Pod,
    pub ipv4: Option<FamilyAdd>,
    pub ipv6: Option<FamilyAdd>,
    pub isolated: bool,
    /// The conflist's `name`: its GC covers the network after a rename of
    /// `ipam.network`.
    pub conf_name: String,
}

impl Add {
    /// The request's parts, IPv4 first.
    pub fn families(&self) -> [(Family, Option<&FamilyAdd>); 2] {
        [
            (Family::V4, self.ipv4.as_ref()),
            (Family::V6, self.ipv6.as_ref()),
        ]
    }
}

/// An ADD's part for one family.
#[derive(Debug, Clone, PartialEq)]
pub struct FamilyAdd {
    pub owner: Attachment,
    /// The conflist's ranges of the family (all of that family) with their
    /// host-local bounds (each of one of the ranges); empty when the request
    /// names none.
    pub ranges: InForce,
    /// The exact address asked for, of the family.
    pub requested: Option<IpAddr>,
}

/// DEL.
#[derive(Debug, Clone, PartialEq)]
pub struct Del {
    pub network: String,
    pub owner: Attachment,
    pub pod: Pod,
}

/// CHECK.
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    pub network: String,
    pub owner: Attachment,
}

/// GC: the network's allocations whose owners the runtime no longer lists.
#[derive(Debug, Clone, PartialEq)]
pub struct Gc {
    pub network: String,
    pub conf_name: String,
    /// Attachments still in use, as the runtime lists them (not checked:
    /// a name no allocation can have simply matches nothing).
    pub valid: Vec<(String, String)>,
    /// Allocations younger than this are spared (never negative).
    pub grace_ms: i64,
}

/// STATUS: whether an ADD with these ranges could be served now.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusQuery {
    pub network: String,
    pub isolated: bool,
    pub ipv4: InForce,
    pub ipv6: InForce,
}

/// Usage of one network or all, one family or both.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsageQuery {
    pub network: Option<String>,
    pub family: Option<Family>,
}
