//! SQLite store: upstream Metis's schema (version 1) and operations, with
//! Metis's fixes (reservations in every block, network-scoped idempotency,
//! bounded IPv6 expansion, repair of databases written by upstream).
//!
//! Every write is one short `BEGIN IMMEDIATE` transaction; the daemon and the
//! CNI plugin (direct mode) may open the same file concurrently (WAL + busy
//! timeout). A request (ADD, DEL, GC) runs all its writes and the reads they
//! decide on in one such transaction (see [`Store::begin_request`]): the
//! daemon's loop groups the requests of one turn in it, direct mode opens
//! one per request; every write then runs in a savepoint of it. Every
//! address handed out passes `handout`'s check against the configuration
//! in force. Timestamps are Unix milliseconds passed in by the caller.

mod alloc;
pub mod db;
pub mod layout;
mod queries;
mod rows;
#[cfg(test)]
mod tests;
pub mod upkeep;

use std::fmt;
use std::fs::{DirBuilder, OpenOptions};
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::config::DbConfig;
use rusqlite::{
    Connection, ErrorCode, OptionalExtension, Transaction, TransactionBehavior, params,
};

use crate::cidr::{Cidr, CidrError, Family};

pub use alloc::allocate::Released;
pub use db::busy::{Contended, patiently};
pub use db::checkpoint::{Checkpointer, ONE_REQUEST_WAL_LIMIT};
pub use db::schema::{SCHEMA, SCHEMA_VERSION};
pub use layout::blocks::{Isolation, LayoutChanges, Source};
pub use layout::grants::{GrantChanges, Refusal, ReleasedBlock, TakenBack};
pub use rows::block::{Quarantined, reserved_offsets};
pub use rows::handout::{BlockRecord, InForce, Unfit, address_fit, block_fit};
pub use upkeep::boot::{BOOT_ID_ENV, BOOT_ID_PATH, BootRecovery, boot_id_path, read_boot_id};
pub use upkeep::check::{Depth, Report, check_file};

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
#[derive(Debug, Clone, Default)]
pub struct BlockFilter {
    pub network: Option<String>,
    pub state: Option<BlockState>,
    pub family: Option<Family>,
}

/// Typed filter on addresses; network/state/family apply to the owning block.
#[derive(Debug, Clone, Default)]
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
const STATEMENT_CACHE: usize = 256;

/// How long a connection waits for another's lock before SQLite answers
/// busy (each wait; see `busy` for what is retried beyond it).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long [`Store::open`] keeps trying while the database is busy: a
/// daemon starting beside plugins in direct mode holds its lock for a
/// moment, and a node under load stretches every moment.
const OPEN_PATIENCE: Duration = Duration::from_secs(30);

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
                let code = db::busy::code_name(source);
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
                if !isolation_helps {
                    return f.write_str(
                        "that the cluster granted to the same network; use a range that does \
                         not overlap it",
                    );
                }
                write!(
                    f,
                    "of network {other_network:?}, and one address must have one owner on a \
                     node. If this network replaces {other_network:?} (as after an upgrade from \
                     upstream Metis, which keeps every pod under network \"default\"), set \
                     \"ipam\": {{\"network\": {other_network:?}}}; if the two networks' pods can \
                     never reach each other (separate VRFs or links), set \"ipam\": \
                     {{\"isolated\": true}}"
                )
            }
        }
    }
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

/// An open database.
pub struct Store {
    conn: Connection,
    reserve: ReserveMode,
    release_cooldown_ms: i64,
    warnings: Vec<String>,
    /// The database file and its (device, inode) when opened.
    file: (PathBuf, Option<(u64, u64)>),
    batch: Batch,
    /// What the hand-out check passed over: logged (each once), counted.
    passed_over: alloc::allocate::PassedOver,
    /// What the open-time repair healed of a rollback to upstream.
    healed: upkeep::rollback::Healed,
    /// Whether the open ran the healing.
    healing: Healing,
}

/// What an open did about healing (`repair`): ran it (checking everything,
/// healing what it found), or skipped it on proof that the file is as the
/// healing last left it clean (`upkeep::repair::proven_healed`). A read-only open
/// never heals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Healing {
    Ran,
    Skipped,
}

/// The group commit the daemon's loop may hold open (see
/// [`Store::begin_request`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Batch {
    /// Every write is its own `BEGIN IMMEDIATE` transaction.
    None,
    /// A transaction is open; writes are savepoints inside it.
    Open,
    /// SQLite rolled the batch's transaction back: nothing may be written
    /// until [`Store::commit_batch`] reports it and ends the batch.
    Lost,
}

/// One write: its own immediate transaction, or a savepoint of the batch.
/// Dropped without [`Write::commit`], it rolls back either way.
pub(crate) enum Write<'c> {
    Alone(Transaction<'c>),
    InBatch(InBatch<'c>),
}

impl std::ops::Deref for Write<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        match self {
            Write::Alone(tx) => tx,
            Write::InBatch(sp) => sp.conn,
        }
    }
}

impl Write<'_> {
    pub(crate) fn commit(self) -> Result<(), rusqlite::Error> {
        match self {
            Write::Alone(tx) => tx.commit(),
            Write::InBatch(mut sp) => {
                sp.open = false;
                control(sp.conn, "RELEASE write")
            }
        }
    }
}

/// A write's savepoint inside the batch, its statements from the cache
/// (rusqlite's `Savepoint` parses `SAVEPOINT`/`RELEASE` again each time,
/// and most requests run one or two writes). Dropped open, it undoes the
/// write alone, as rusqlite's does.
pub(crate) struct InBatch<'c> {
    conn: &'c Connection,
    open: bool,
}

impl<'c> InBatch<'c> {
    fn begin(conn: &'c Connection) -> rusqlite::Result<InBatch<'c>> {
        control(conn, "SAVEPOINT write")?;
        Ok(InBatch { conn, open: true })
    }
}

impl Drop for InBatch<'_> {
    fn drop(&mut self) {
        if self.open {
            // A failure here leaves the savepoint to the request's own
            // `ROLLBACK TO` (the request failed) or to SQLite's rollback
            // of the batch, which `ensure_batch` reports.
            let _ = control(self.conn, "ROLLBACK TO write")
                .and_then(|()| control(self.conn, "RELEASE write"));
        }
    }
}

/// Runs a transaction-control statement from the statement cache: each
/// request runs several, and parsing one again costs more than running it.
fn control(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// The columns of `metis_networks` that are set one network at a time;
/// each names its statements, so no SQL is built from strings.
#[derive(Clone, Copy)]
enum NetworkColumn {
    /// When the monitor first saw the network's use low (ms).
    LowUtilizationSince,
    /// The conflist that served the network last (GC under a rename).
    ConfName,
}

impl NetworkColumn {
    fn select_sql(self) -> &'static str {
        match self {
            NetworkColumn::LowUtilizationSince => {
                "SELECT low_utilization_since FROM metis_networks WHERE network = ?1"
            }
            NetworkColumn::ConfName => "SELECT conf_name FROM metis_networks WHERE network = ?1",
        }
    }

    fn upsert_sql(self) -> &'static str {
        match self {
            NetworkColumn::LowUtilizationSince => {
                "INSERT INTO metis_networks (network, low_utilization_since) VALUES (?1, ?2) \
                 ON CONFLICT (network) DO UPDATE SET low_utilization_since = excluded.low_utilization_since"
            }
            NetworkColumn::ConfName => {
                "INSERT INTO metis_networks (network, conf_name) VALUES (?1, ?2) \
                 ON CONFLICT (network) DO UPDATE SET conf_name = excluded.conf_name"
            }
        }
    }
}

/// Starts a write on `conn`. Inside a batch whose transaction SQLite
/// already rolled back, writing on would commit on its own, outside the
/// batch, so that is refused.
pub(crate) fn write(conn: &mut Connection, batch: Batch) -> Result<Write<'_>, StoreError> {
    match batch {
        Batch::None => Ok(Write::Alone(
            conn.transaction_with_behavior(TransactionBehavior::Immediate)?,
        )),
        Batch::Open if !conn.is_autocommit() => Ok(Write::InBatch(InBatch::begin(conn)?)),
        Batch::Open | Batch::Lost => Err(StoreError::BatchAborted),
    }
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("reserve", &self.reserve)
            .field("release_cooldown_ms", &self.release_cooldown_ms)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens (creating if needed) the database at `path`: parent directory
    /// 0700, file 0600 (an existing file is tightened to 0600; a shared
    /// directory is only warned about, see [`files`]), WAL, foreign keys, 5 s busy timeout; installs the
    /// schema unless `user_version` is already 1; repairs reservations.
    pub fn open(path: &Path, opts: &StoreOptions) -> Result<Store, StoreError> {
        if path.as_os_str().is_empty() {
            return Err(StoreError::InvalidPath);
        }
        let open_err = |source: std::io::Error| StoreError::Open {
            path: path.to_path_buf(),
            source: Box::new(source),
        };
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
            && !parent.exists()
        {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(open_err)?;
        }
        if !path.exists() {
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
            {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(open_err(e)),
            }
        }
        let file_warnings = db::files::tighten(path);
        db::busy::patiently("open the database", OPEN_PATIENCE, || {
            Store::open_once(path, opts, file_warnings.clone())
        })
    }

    /// One attempt of [`Store::open`] on the file that is there; every
    /// step that takes a lock is named in a busy error.
    fn open_once(
        path: &Path,
        opts: &StoreOptions,
        warnings: Vec<String>,
    ) -> Result<Store, StoreError> {
        use db::busy::During;
        let conn = Connection::open(path).map_err(|e| StoreError::Open {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        // Savepoints (the daemon's group commit) keep their undo in a
        // sub-journal: in memory, as a read-only root filesystem (the
        // DaemonSet's) has no temporary directory SQLite could use, and
        // every grouped commit would fail with an I/O error.
        conn.pragma_update(None, "temp_store", "MEMORY")?;
        let mode: String = conn
            .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
            .during("open: PRAGMA journal_mode=WAL")?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Corrupt(format!(
                "journal_mode is {mode}, WAL could not be enabled"
            )));
        }
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let sync = match opts.durability {
            Durability::Normal => "NORMAL",
            Durability::Full => "FULL",
        };
        conn.pragma_update(None, "synchronous", sync)?;
        // Plans must not depend on bound values. Otherwise SQLite marks such
        // statements (the claim query among them) to be re-prepared whenever
        // their bindings are cleared, which rusqlite's statement cache does
        // on every reuse: a third of each allocation went to re-parsing.
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;

        let mut store = Store {
            conn,
            reserve: ReserveMode::EveryBlock,
            release_cooldown_ms: 0,
            warnings,
            file: (path.to_path_buf(), file_identity(path)),
            batch: Batch::None,
            passed_over: Default::default(),
            healed: upkeep::rollback::Healed::default(),
            healing: Healing::Ran,
        };
        // A file as the healing last left it clean needs neither the
        // schema check nor the healing (see `upkeep::repair::proven_healed`): most
        // of what a one-request process (direct mode) spent opening it.
        let proven = upkeep::repair::proven_healed(&store.conn);
        let upstream_only = match proven {
            true => false,
            false => store.install_schema()?,
        };
        let (reserve, mode_changed) = store
            .settle_reserve_mode(opts.reserve)
            .during("open: reserve mode")?;
        store.reserve = reserve;
        // Upstream released with its daemon's cooldown: a first open
        // without one asked for (direct mode) keeps that, not none.
        let cooldown = opts
            .release_cooldown
            .or(upstream_only.then_some(crate::defaults::DEFAULT_RELEASE_COOLDOWN_MS));
        store.release_cooldown_ms = store
            .settle_release_cooldown(cooldown)
            .during("open: release cooldown")?;
        store.healing = match proven && !mode_changed {
            true => Healing::Skipped,
            false => {
                store.repair().during("open: repair")?;
                Healing::Ran
            }
        };
        Ok(store)
    }

    /// Fails when the database file was deleted or replaced since it was
    /// opened: what is written on would be lost at the next open, and a
    /// plugin in direct mode would not see it.
    pub fn ensure_file_unchanged(&self) -> Result<(), StoreError> {
        let (path, opened) = &self.file;
        if file_identity(path) == *opened {
            return Ok(());
        }
        Err(StoreError::Open {
            path: path.clone(),
            source: "the database file was deleted or replaced while open; \
                     the daemon puts it back from its open copy, retry"
                .into(),
        })
    }

    /// Starts one request of a group commit: opens the batch's transaction
    /// (`BEGIN IMMEDIATE`) if none is open, then a savepoint for the
    /// request, so that [`Store::end_request`] can undo this request alone.
    pub fn begin_request(&mut self) -> Result<(), StoreError> {
        use db::busy::During;
        if self.batch == Batch::None {
            self.control("BEGIN IMMEDIATE").during("BEGIN IMMEDIATE")?;
            self.batch = Batch::Open;
        }
        self.ensure_batch()?;
        self.control("SAVEPOINT request").during("SAVEPOINT")?;
        Ok(())
    }

    /// Ends the request [`Store::begin_request`] started: keeps what it
    /// wrote (`RELEASE`) or undoes it (`ROLLBACK TO`). Nothing is durable
    /// before [`Store::commit_batch`].
    pub fn end_request(&mut self, keep: bool) -> Result<(), StoreError> {
        self.ensure_batch()?;
        let ended = if keep {
            self.control("RELEASE request")
        } else {
            self.control("ROLLBACK TO request")
                .and_then(|()| self.control("RELEASE request"))
        };
        ended.map_err(|err| {
            self.batch = Batch::Lost;
            StoreError::from(err)
        })
    }

    /// Commits the batch's requests together (nothing to do without a
    /// batch). On failure the whole batch is rolled back: none of its
    /// requests left anything.
    pub fn commit_batch(&mut self) -> Result<(), StoreError> {
        let result = match std::mem::replace(&mut self.batch, Batch::None) {
            Batch::None => return Ok(()),
            Batch::Open => db::busy::During::during(self.control("COMMIT"), "COMMIT"),
            Batch::Lost => Err(StoreError::BatchAborted),
        };
        // A failed COMMIT may leave the transaction open (SQLITE_BUSY,
        // a deferred constraint): end it, so the next batch starts clean.
        if result.is_err() && !self.conn.is_autocommit() {
            self.conn.execute_batch("ROLLBACK")?;
        }
        result
    }

    /// Runs a transaction-control statement of the group commit
    /// ([`control`]).
    fn control(&self, sql: &str) -> rusqlite::Result<()> {
        control(&self.conn, sql)
    }

    /// Fails once SQLite has rolled the batch's transaction back by itself.
    fn ensure_batch(&mut self) -> Result<(), StoreError> {
        if self.batch == Batch::Open && self.conn.is_autocommit() {
            self.batch = Batch::Lost;
        }
        match self.batch {
            Batch::Lost => Err(StoreError::BatchAborted),
            Batch::None | Batch::Open => Ok(()),
        }
    }

    /// Opens an existing database for reading only: no schema installation,
    /// no repair, no settings written, so observers (STATUS in direct mode,
    /// metrics, checks) never create a database or take the write lock.
    /// `Ok(None)` when there is nothing to read yet — no file, or no schema
    /// installed — in which case the first ADD creates it.
    pub fn open_read_only(path: &Path) -> Result<Option<Store>, StoreError> {
        if !path.exists() {
            return Ok(None);
        }
        let conn = Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| StoreError::Open {
            path: path.to_path_buf(),
            source: Box::new(e),
        })?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version != SCHEMA_VERSION {
            return Ok(None);
        }
        // Nothing may be created here: Metis's tables a file lacks are
        // read through empty stand-ins.
        db::schema::shadow_missing_tables(&conn)?;
        // Upstream databases have no settings table: default mode then.
        let reserve = get_setting(&conn, db::schema::KEY_RESERVE_MODE)
            .ok()
            .flatten()
            .and_then(|text| ReserveMode::parse(&text))
            .unwrap_or_default();
        let release_cooldown_ms = recorded_cooldown(&conn);
        Ok(Some(Store {
            conn,
            reserve,
            release_cooldown_ms,
            warnings: Vec::new(),
            file: (path.to_path_buf(), file_identity(path)),
            batch: Batch::None,
            passed_over: Default::default(),
            healed: upkeep::rollback::Healed::default(),
            healing: Healing::Skipped,
        }))
    }

    /// Writes a consistent copy of the database to `to` (which must not
    /// exist): SQLite's `VACUUM INTO`, allowed on a read-only connection.
    /// `metis import --dry-run` rehearses on such a copy.
    pub fn copy_to(&self, to: &Path) -> Result<(), StoreError> {
        let target = to
            .to_str()
            .ok_or_else(|| StoreError::Corrupt(format!("{} is not UTF-8", to.display())))?;
        self.conn.execute("VACUUM INTO ?1", [target])?;
        Ok(())
    }

    /// The reservation mode in force.
    pub fn reserve_mode(&self) -> ReserveMode {
        self.reserve
    }

    /// Problems found at open that were left alone (e.g. a pod holding an
    /// address at a reserved position), for the caller to log.
    pub fn open_warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Whether this open ran the healing or skipped it, the file being
    /// as the healing last left it clean.
    pub fn healing(&self) -> Healing {
        self.healing
    }

    /// What this open healed of what upstream's store left (see
    /// `rollback`).
    pub fn rollback_repairs(&self) -> upkeep::rollback::Healed {
        self.healed
    }

    /// What would go wrong under upstream's store that Metis does not
    /// change (see `upkeep::rollback::gateway_above_range`), in words.
    pub fn upstream_hazards(&self) -> Result<Vec<String>, StoreError> {
        upkeep::rollback::gateway_above_range(&self.conn)
    }

    /// Blocks whose gateway a pod holds (not served; see `gateway`).
    pub fn held_gateways(&self) -> Result<Vec<layout::gateway::HeldGateway>, StoreError> {
        layout::gateway::all_held(&self.conn, self.reserve)
    }

    /// Installs upstream's schema and Metis's tables where missing; true
    /// when the file had upstream's schema but none of Metis's settings (a
    /// database only upstream has written).
    fn install_schema(&mut self) -> Result<bool, StoreError> {
        use db::busy::During;
        let version: i64 = self
            .conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .during("open: schema check")?;
        if version != SCHEMA_VERSION {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .during("open: BEGIN IMMEDIATE (schema)")?;
            tx.execute_batch(SCHEMA).during("open: schema creation")?;
            tx.commit().during("open: COMMIT (schema)")?;
        }
        // One read for Metis's tables: every statement costs a parse in
        // a process that opens the database for one request (direct mode).
        let present: Vec<String> = self
            .conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
            .and_then(|mut stmt| stmt.query_map([], |r| r.get(0))?.collect())
            .during("open: schema check")?;
        let upstream_only =
            version == SCHEMA_VERSION && !present.iter().any(|table| table == "metis_settings");
        for (name, create) in db::schema::METIS_TABLES {
            if !present.iter().any(|table| table == name) {
                let tx = self
                    .conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .during("open: BEGIN IMMEDIATE (Metis's tables)")?;
                tx.execute_batch(create).during("open: Metis's tables")?;
                tx.commit().during("open: COMMIT (Metis's tables)")?;
            }
        }
        Ok(upstream_only)
    }

    /// The release cooldown in force, in milliseconds (see
    /// [`StoreOptions::release_cooldown`]).
    pub fn release_cooldown(&self) -> i64 {
        self.release_cooldown_ms
    }

    /// When an address released at `now_ms` may be handed out again: `None`
    /// (at once) without a cooldown. The one place release times are made,
    /// for DEL, GC and boot recovery alike.
    fn release_at(&self, now_ms: i64) -> Option<i64> {
        let cooldown = self.release_cooldown_ms;
        (cooldown > 0).then(|| now_ms.saturating_add(cooldown))
    }

    /// The cooldown in force: the one requested (recorded for direct mode
    /// when it changed), else the one recorded, else none.
    fn settle_release_cooldown(&mut self, requested: Option<i64>) -> Result<i64, StoreError> {
        match requested {
            Some(cooldown_ms) => {
                self.put_setting(
                    db::schema::KEY_RELEASE_COOLDOWN,
                    Some(&cooldown_ms.to_string()),
                )?;
                Ok(cooldown_ms)
            }
            None => Ok(recorded_cooldown(&self.conn)),
        }
    }

    /// Since when (ms) the monitor has seen the network's use low, if it has.
    pub fn low_utilization_since(&self, network: &str) -> Result<Option<i64>, StoreError> {
        self.network_column(network, NetworkColumn::LowUtilizationSince)
    }

    /// Records (or with `None` forgets) when low use of the network began;
    /// writes only on a change.
    pub fn set_low_utilization_since(
        &mut self,
        network: &str,
        since_ms: Option<i64>,
    ) -> Result<(), StoreError> {
        self.set_network_column::<i64, i64>(network, NetworkColumn::LowUtilizationSince, since_ms)
    }

    /// One per-network column of `metis_networks` (`None` when the network
    /// has no row or the column is NULL).
    fn network_column<T: rusqlite::types::FromSql>(
        &self,
        network: &str,
        column: NetworkColumn,
    ) -> Result<Option<T>, StoreError> {
        Ok(self
            .conn
            .prepare_cached(column.select_sql())?
            .query_row([network], |r| r.get(0))
            .optional()?
            .flatten())
    }

    /// Sets one per-network column of `metis_networks`, in its own write
    /// and only when the value changes (`Stored` is the type it is read
    /// back as, e.g. `String` for a `&str` value).
    fn set_network_column<Stored, Value>(
        &mut self,
        network: &str,
        column: NetworkColumn,
        value: Option<Value>,
    ) -> Result<(), StoreError>
    where
        Stored: rusqlite::types::FromSql + PartialEq<Value>,
        Value: rusqlite::ToSql,
    {
        let unchanged = match (self.network_column::<Stored>(network, column)?, &value) {
            (Some(stored), Some(value)) => stored == *value,
            (stored, value) => stored.is_none() && value.is_none(),
        };
        if unchanged {
            return Ok(());
        }
        let tx = write(&mut self.conn, self.batch)?;
        tx.prepare_cached(column.upsert_sql())?
            .execute(params![network, value])?;
        tx.commit()?;
        Ok(())
    }

    /// A value of Metis's own settings table.
    pub fn setting(&self, key: &str) -> Result<Option<String>, StoreError> {
        get_setting(&self.conn, key)
    }

    /// Sets (or with `None` removes) a setting; writes only on a change.
    pub fn put_setting(&mut self, key: &str, value: Option<&str>) -> Result<(), StoreError> {
        if get_setting(&self.conn, key)?.as_deref() == value {
            return Ok(());
        }
        let tx = write(&mut self.conn, self.batch)?;
        match value {
            Some(value) => set_setting(&tx, key, value)?,
            None => {
                tx.prepare_cached("DELETE FROM metis_settings WHERE key = ?1")?
                    .execute([key])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// The mode in force, and whether it was recorded just now (changed).
    fn settle_reserve_mode(
        &mut self,
        requested: Option<ReserveMode>,
    ) -> Result<(ReserveMode, bool), StoreError> {
        let stored = match get_setting(&self.conn, db::schema::KEY_RESERVE_MODE)? {
            None => None,
            Some(text) => {
                let parsed = ReserveMode::parse(&text);
                if parsed.is_none() {
                    self.warnings.push(format!(
                        "store: unknown reserve_mode {text:?} in metis_settings; using every-block"
                    ));
                }
                parsed
            }
        };
        match requested {
            None => Ok((stored.unwrap_or_default(), false)),
            Some(mode) => {
                let changed = stored != Some(mode);
                if changed {
                    let tx = self
                        .conn
                        .transaction_with_behavior(TransactionBehavior::Immediate)?;
                    set_setting(&tx, db::schema::KEY_RESERVE_MODE, mode.as_str())?;
                    tx.commit()?;
                }
                Ok((mode, changed))
            }
        }
    }

    /// Blocks whose `allocated_ips` differs from their count of allocated
    /// rows: `(block id, allocated_ips, actual)`.
    pub fn counter_mismatches(&self) -> Result<Vec<(i64, i64, i64)>, StoreError> {
        rows::block::counter_mismatches(&self.conn)
    }
}

/// (device, inode) of the file at `path`, if there is one.
fn file_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The release cooldown the daemon last recorded; 0 when there is none
/// (never recorded, an upstream database, or an unreadable value).
fn recorded_cooldown(conn: &Connection) -> i64 {
    get_setting(conn, db::schema::KEY_RELEASE_COOLDOWN)
        .ok()
        .flatten()
        .and_then(|text| text.parse().ok())
        .unwrap_or(0)
}

pub(crate) fn get_setting(conn: &Connection, key: &str) -> Result<Option<String>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT value FROM metis_settings WHERE key = ?1")?
        .query_row([key], |r| r.get(0))
        .optional()?)
}

pub(crate) fn set_setting(conn: &Connection, key: &str, value: &str) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO metis_settings (key, value) VALUES (?1, ?2) \
         ON CONFLICT(key) DO UPDATE SET value = excluded.value",
    )?
    .execute(params![key, value])?;
    Ok(())
}

fn validate_owner(container_id: &str, interface_name: &str) -> Result<(), StoreError> {
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
