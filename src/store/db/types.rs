//! The store's shared vocabulary: options, a block's state, owners and
//! allocations, listings' rows and filters, and the store's errors.

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use rusqlite::ErrorCode;

use crate::cidr::{Cidr, CidrError, Family};

/// How hard SQLite syncs: `synchronous=NORMAL` (default, safe with WAL
/// against application crashes) or `FULL` (also against power loss).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    #[default]
    Normal,
    Full,
}

/// Which addresses are kept out of allocation (network, gateway, broadcast).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReserveMode {
    /// Every block with ≥ 4 addresses: IPv4 offsets 0, 1, last; IPv6 0, 1.
    #[default]
    EveryBlock,
    /// Upstream's rule: only the network's first IPv4 block (0, 1, last).
    FirstBlock,
}

impl ReserveMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ReserveMode::EveryBlock => "every-block",
            ReserveMode::FirstBlock => "first-block",
        }
    }

    pub fn parse(text: &str) -> Option<ReserveMode> {
        match text {
            "every-block" => Some(ReserveMode::EveryBlock),
            "first-block" => Some(ReserveMode::FirstBlock),
            _ => None,
        }
    }
}

/// Options for [`Store::open`].
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreOptions {
    pub durability: Durability,
    /// `None`: use the mode stored in the database (default `EveryBlock`).
    /// `Some(m)`: store `m` (if different) and use it.
    pub reserve: Option<ReserveMode>,
    /// How long released addresses rest before reuse, in milliseconds.
    /// `None` (direct mode): the cooldown the daemon recorded, else 0, so
    /// direct-mode releases rest as long as the daemon's would.
    /// `Some(ms)` (the daemon): record `ms` (if different) and use it.
    pub release_cooldown: Option<i64>,
    /// A process that serves one request and exits (direct mode): the
    /// store leaves the WAL on close (`Store::leave_wal_on_close`).
    pub one_request: bool,
}

/// Lifecycle state of a CIDR block (`cidr_blocks.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    Ready,
    Draining,
    Deleting,
    /// Retired or quarantined by Metis (`metis_blocks` says which): a value
    /// upstream's store neither allocates from, undrains, expires nor
    /// deletes, so its pods keep their addresses whoever writes the file
    /// (see `store::withhold`).
    Withheld,
}

impl BlockState {
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::Ready => "Ready",
            BlockState::Draining => "Draining",
            BlockState::Deleting => "Deleting",
            BlockState::Withheld => "Withheld",
        }
    }

    pub fn parse(text: &str) -> Option<BlockState> {
        match text {
            "Ready" => Some(BlockState::Ready),
            "Draining" => Some(BlockState::Draining),
            "Deleting" => Some(BlockState::Deleting),
            "Withheld" => Some(BlockState::Withheld),
            _ => None,
        }
    }
}

impl fmt::Display for BlockState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Who an address is allocated to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner<'a> {
    pub network: &'a str,
    pub container_id: &'a str,
    pub interface_name: &'a str,
    pub pod_name: &'a str,
    pub pod_namespace: &'a str,
}

/// An allocated address and the block it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    pub address: IpAddr,
    pub block: Cidr,
    /// The gateway its result names instead of the one the block
    /// advertises, which a pod holds (`layout::gateway::stand_in`); `None`
    /// otherwise, and in lists of released or held addresses.
    pub gateway: Option<IpAddr>,
}

/// Result of [`Store::add_cidr_block`]: the block id, new or existing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddOutcome {
    Added(i64),
    Exists(i64),
}

impl AddOutcome {
    pub fn id(self) -> i64 {
        match self {
            AddOutcome::Added(id) | AddOutcome::Exists(id) => id,
        }
    }
}

/// Upstream's `GetIPUsage` over the non-Deleting blocks of a network+family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Rows allocated to pods (Draining blocks included, reserved rows not).
    pub allocated: i64,
    /// Rows the reservation holds (network, gateway, broadcast addresses).
    pub reserved: i64,
    /// Unallocated rows whose `release_at` is still in the future.
    pub cooldown: i64,
    /// Σ total_ips (saturating, as upstream's column holds it).
    pub total: i64,
    /// The blocks' real size, from their CIDRs: an IPv6 /64 is 2^64.
    pub addresses: u128,
    /// Σ total_ips of Draining blocks (saturating).
    pub draining: i64,
}

/// Cooling addresses of a network's Ready blocks (see [`Store::cooling`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cooling {
    /// How many come free by the time asked about.
    pub by_then: i64,
    /// When the first comes free (Unix ms), if any cools.
    pub first_free_ms: Option<i64>,
}

/// One `cidr_blocks` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockInfo {
    pub id: i64,
    pub cidr: String,
    pub network: String,
    pub family: Family,
    pub total_ips: i64,
    pub allocated_ips: i64,
    pub state: BlockState,
    pub created_at: i64,
    pub updated_at: i64,
}

/// A raw table dump for the admin interface.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Table {
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// Typed filter on blocks; every field set must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockFilter {
    pub network: Option<String>,
    pub state: Option<BlockState>,
    pub family: Option<Family>,
}

/// Typed filter on addresses; network/state/family apply to the owning block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressFilter {
    pub network: Option<String>,
    pub state: Option<BlockState>,
    pub family: Option<Family>,
    pub container_id: Option<String>,
    pub allocated: Option<bool>,
}

/// Why a requested address cannot be handed out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unavailable {
    /// The block reserves the position (network, gateway, broadcast, or
    /// outside host-local bounds).
    ReservedPosition { block: Cidr },
    /// The row is reserved (allocated without an owner).
    ReservedRow { block: Cidr },
    /// A pod holds it.
    Held { container_id: String },
    /// Released, resting until `until_ms` (Unix ms).
    Cooling { until_ms: i64 },
    /// Its block is quarantined.
    Quarantined { block: Cidr },
    /// host-local's co-written directory has a file for it naming another
    /// owner (host-local handed it out).
    HeldByHostLocal,
    /// Its block is Draining (or otherwise not Ready).
    BlockNotReady { block: Cidr, state: BlockState },
    /// It does not fit the configuration in force (outside its ranges, or
    /// its block is not one the configuration names).
    OutsideConfig { why: String },
    /// The requesting owner already holds another address of the family.
    OwnerHolds {
        container_id: String,
        interface_name: String,
        held: IpAddr,
        network: String,
    },
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::ReservedPosition { block } => write!(
                f,
                "it is reserved (network/gateway/broadcast) in block {block}"
            ),
            Unavailable::ReservedRow { block } => write!(f, "it is reserved in block {block}"),
            Unavailable::Held { container_id } => {
                write!(f, "it is held by container {container_id:?}")
            }
            Unavailable::Cooling { until_ms } => write!(
                f,
                "it is in release cooldown until {}",
                crate::log::rfc3339_millis(*until_ms)
            ),
            Unavailable::Quarantined { block } => {
                write!(f, "block {block} is quarantined (see `metis admin check`)")
            }
            Unavailable::HeldByHostLocal => {
                f.write_str("host-local's file records another owner for it")
            }
            Unavailable::BlockNotReady { block, state } => write!(f, "block {block} is {state}"),
            Unavailable::OutsideConfig { why } => f.write_str(why),
            Unavailable::OwnerHolds {
                container_id,
                interface_name,
                held,
                network,
            } => write!(
                f,
                "container {container_id:?} interface {interface_name:?} already holds {held} in network {network:?}"
            ),
        }
    }
}

/// Errors of the store. `Display` starts with `store: `.
#[derive(Debug)]
pub enum StoreError {
    /// The database path is empty.
    InvalidPath,
    /// The directory or file could not be created/opened.
    Open {
        path: PathBuf,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Any other error SQLite reports.
    Sqlite(rusqlite::Error),
    /// SQLITE_BUSY / SQLITE_LOCKED beyond the busy timeout, or where
    /// SQLite does not wait (see `busy`); `during` names the step ("" when
    /// none was named).
    Busy {
        during: &'static str,
        source: rusqlite::Error,
    },
    /// SQLite rolled back the transaction of a group commit on its own (an
    /// I/O error, a full disk): nothing of the batch was kept.
    BatchAborted,
    BadCidr(CidrError),
    NoAvailableIps {
        network: String,
        family: Family,
        /// The network's quarantined blocks of that family, in words: why
        /// it may be exhausted although it has addresses.
        quarantined: Vec<String>,
        /// Free rows and blocks passed over because they do not fit the
        /// configuration in force, in words.
        passed_over: Vec<String>,
        /// Blocks of the network and family not served while a pod holds
        /// their gateway (see `gateway`), in words.
        held_gateways: Vec<String>,
    },
    /// A repeated ADD: the address the owner holds may not be returned
    /// under the configuration in force ([`handout`]); a DEL frees it.
    HeldUnfit {
        address: IpAddr,
        container_id: String,
        why: String,
    },
    RequestedIpUnavailable {
        address: IpAddr,
        reason: Unavailable,
    },
    RequestedIpOutsideBlocks {
        address: IpAddr,
        network: String,
    },
    /// container_id or interface_name is empty.
    EmptyOwner,
    /// A row whose content does not parse.
    Corrupt(String),
    /// host-local's directory, co-written during a migration, could not be
    /// used (its lock, an entry that is not host-local's, an I/O error):
    /// nothing is allocated in that network meanwhile.
    HostLocal(String),
    /// A block would share addresses with another block: of the same
    /// network, or of another network when neither is isolated.
    Overlap {
        cidr: Cidr,
        network: String,
        other_cidr: String,
        other_network: String,
        /// The other block is of another network (`ipam.isolated` would
        /// allow it).
        isolation_helps: bool,
    },
}

/// At most three of `lines`, and how many more there are.
fn summary(lines: &[String]) -> String {
    const SHOWN: usize = 3;
    let mut text = lines
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    if lines.len() > SHOWN {
        text.push_str(&format!(" (and {} more)", lines.len() - SHOWN));
    }
    text
}

/// Prepared statements kept per connection. rusqlite keeps 16 by default,
/// fewer than the distinct statements one ADD runs (layout, bounds,
/// allocation), so every request re-parsed SQL; this holds them all.
pub(in crate::store) const STATEMENT_CACHE: usize = 256;

/// How long a connection waits for another's lock before SQLite answers
/// busy (each wait; see `busy` for what is retried beyond it).
pub(in crate::store) const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long [`Store::open`] keeps trying while the database is busy: a
/// daemon starting beside plugins in direct mode holds its lock for a
/// moment, and a node under load stretches every moment.
pub(in crate::store) const OPEN_PATIENCE: Duration = Duration::from_secs(30);

impl StoreError {
    /// Whether the caller should report "try again later" (lock contention,
    /// I/O, full disk, unopenable or read-only database).
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Busy { .. }
            | StoreError::Open { .. }
            | StoreError::BatchAborted
            | StoreError::HostLocal(_) => true,
            StoreError::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => matches!(
                e.code,
                ErrorCode::DatabaseBusy
                    | ErrorCode::DatabaseLocked
                    | ErrorCode::SystemIoFailure
                    | ErrorCode::DiskFull
                    | ErrorCode::CannotOpen
                    | ErrorCode::ReadOnly
                    | ErrorCode::FileLockingProtocolFailed
                    | ErrorCode::OutOfMemory
            ),
            _ => false,
        }
    }
}

impl StoreError {
    /// Whether SQLite found the file damaged or not a database at all.
    pub fn is_corrupt(&self) -> bool {
        match self {
            StoreError::Corrupt(_) => true,
            StoreError::Sqlite(e) => matches!(
                e.sqlite_error_code(),
                Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase)
            ),
            _ => false,
        }
    }
}

/// What an exhaustion's message adds after its first sentence: why blocks
/// with addresses served none.
struct WhyExhausted<'a> {
    quarantined: &'a [String],
    held_gateways: &'a [String],
    passed_over: &'a [String],
}

impl fmt::Display for WhyExhausted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.quarantined.is_empty() {
            write!(
                f,
                "; not served until the problem is solved and the daemon restarted \
                 (see `metis admin check`): {}",
                self.quarantined.join("; ")
            )?;
        }
        if !self.held_gateways.is_empty() {
            write!(
                f,
                "; served again once that pod is deleted: {}",
                self.held_gateways.join("; ")
            )?;
        }
        if !self.passed_over.is_empty() {
            write!(
                f,
                "; passed over, not fitting the configuration in force: {}",
                summary(self.passed_over)
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::InvalidPath => f.write_str("store: database path cannot be empty"),
            StoreError::Open { path, source } => {
                write!(
                    f,
                    "store: cannot open database {}: {source}",
                    path.display()
                )
            }
            StoreError::Sqlite(e) => write!(f, "store: sqlite: {e}"),
            StoreError::Busy { during, source } => {
                let code = code_name(source);
                match *during {
                    "" => write!(f, "store: database is busy ({code}): {source}"),
                    step => write!(f, "store: database is busy ({code} at {step}): {source}"),
                }
            }
            StoreError::BatchAborted => f.write_str(
                "store: SQLite rolled back the transaction this request was grouped in \
                 (an I/O error or a full disk); nothing of it was kept, retry",
            ),
            StoreError::BadCidr(e) => write!(f, "store: {e}"),
            StoreError::NoAvailableIps {
                network,
                family,
                quarantined,
                passed_over,
                held_gateways,
            } => write!(
                f,
                "store: no available IPs in store: no free {family} address in the Ready blocks of network {network:?}{}",
                WhyExhausted {
                    quarantined,
                    held_gateways,
                    passed_over,
                }
            ),
            StoreError::HeldUnfit {
                address,
                container_id,
                why,
            } => write!(
                f,
                "store: container {container_id:?} already holds {address}, which no result may \
                 carry: {why}; DEL the attachment and ADD it again"
            ),
            StoreError::RequestedIpUnavailable { address, reason } => {
                write!(f, "store: requested IP {address} is unavailable: {reason}")
            }
            StoreError::RequestedIpOutsideBlocks { address, network } => write!(
                f,
                "store: requested IP {address} is not inside any block of network {network:?}"
            ),
            StoreError::EmptyOwner => {
                f.write_str("store: container_id and interface_name must not be empty")
            }
            StoreError::Corrupt(what) => write!(f, "store: corrupt database content: {what}"),
            StoreError::HostLocal(what) => write!(f, "store: host-local's directory: {what}"),
            StoreError::Overlap {
                cidr,
                network,
                other_cidr,
                other_network,
                isolation_helps,
            } => {
                write!(
                    f,
                    "store: {cidr} of network {network:?} overlaps block {other_cidr} "
                )?;
                overlap_advice(f, other_network, *isolation_helps)
            }
        }
    }
}

/// What an operator can do about an overlap: nothing but another range when
/// the cluster granted the block, else name the network or isolate it.
fn overlap_advice(f: &mut fmt::Formatter<'_>, other: &str, isolation_helps: bool) -> fmt::Result {
    if !isolation_helps {
        return f.write_str(
            "that the cluster granted to the same network; use a range that does not overlap it",
        );
    }
    write!(
        f,
        "of network {other:?}, and one address must have one owner on a node. If this network \
         replaces {other:?} (as after an upgrade from upstream Metis, which keeps every pod \
         under network \"default\"), set \"ipam\": {{\"network\": {other:?}}}; if the two \
         networks' pods can never reach each other (separate VRFs or links), set \"ipam\": \
         {{\"isolated\": true}}"
    )
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Open { source, .. } => Some(source.as_ref()),
            StoreError::Sqlite(e) | StoreError::Busy { source: e, .. } => Some(e),
            StoreError::BadCidr(e) => Some(e),
            _ => None,
        }
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> StoreError {
        match &e {
            rusqlite::Error::SqliteFailure(f, _)
                if matches!(f.code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) =>
            {
                StoreError::Busy {
                    during: "",
                    source: e,
                }
            }
            _ => StoreError::Sqlite(e),
        }
    }
}

impl From<CidrError> for StoreError {
    fn from(e: CidrError) -> StoreError {
        StoreError::BadCidr(e)
    }
}
pub(crate) fn validate_owner(container_id: &str, interface_name: &str) -> Result<(), StoreError> {
    if container_id.is_empty() || interface_name.is_empty() {
        return Err(StoreError::EmptyOwner);
    }
    Ok(())
}

pub(crate) fn parse_addr(text: &str) -> Result<IpAddr, StoreError> {
    text.parse()
        .map_err(|_| StoreError::Corrupt(format!("address {text:?} is not an IP address")))
}

pub(crate) fn parse_cidr(text: &str) -> Result<Cidr, StoreError> {
    text.parse()
        .map_err(|e| StoreError::Corrupt(format!("block cidr {text:?}: {e}")))
}

pub(crate) fn parse_family(text: &str) -> Result<Family, StoreError> {
    Family::parse(text).ok_or_else(|| StoreError::Corrupt(format!("unknown ip_family {text:?}")))
}

pub(crate) fn parse_state(text: &str) -> Result<BlockState, StoreError> {
    BlockState::parse(text)
        .ok_or_else(|| StoreError::Corrupt(format!("unknown block state {text:?}")))
}

/// `total_ips` for a block: 2^host_bits, or `i64::MAX` at ≥ 62 host bits.
pub(crate) fn total_ips(cidr: &Cidr) -> i64 {
    let host = cidr.host_bits();
    if host >= 62 { i64::MAX } else { 1i64 << host }
}

/// SQLite's name for the (extended) result code of a busy or locked error.
pub(in crate::store) fn code_name(err: &rusqlite::Error) -> String {
    let rusqlite::Error::SqliteFailure(failure, _) = err else {
        return "not an SQLite result".into();
    };
    let name = match failure.extended_code {
        rusqlite::ffi::SQLITE_BUSY => "SQLITE_BUSY",
        rusqlite::ffi::SQLITE_BUSY_RECOVERY => "SQLITE_BUSY_RECOVERY",
        rusqlite::ffi::SQLITE_BUSY_SNAPSHOT => "SQLITE_BUSY_SNAPSHOT",
        rusqlite::ffi::SQLITE_BUSY_TIMEOUT => "SQLITE_BUSY_TIMEOUT",
        rusqlite::ffi::SQLITE_LOCKED => "SQLITE_LOCKED",
        rusqlite::ffi::SQLITE_LOCKED_SHAREDCACHE => "SQLITE_LOCKED_SHAREDCACHE",
        rusqlite::ffi::SQLITE_LOCKED_VTAB => "SQLITE_LOCKED_VTAB",
        other => return format!("SQLite result {other}"),
    };
    name.into()
}
