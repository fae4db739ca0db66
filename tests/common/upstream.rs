//! Databases written the way upstream Metis writes them: its schema
//! (version 1), no `metis_settings`, rows populated in batches, and
//! upstream's own bugs (an IPv6 /127 or /128 block handing out `::2`).
//!
//! [`Upstream::open`] is an upstream-like writer on a file Metis wrote (a
//! rollback to upstream, then forward again): SQL that does what
//! upstream's `pkg/store` does, behaviour for behaviour
//! (`../shared/reference/upstream-metis.md`, "Measured: upstream's store on
//! a Metis database"; upstream's `metis/pkg/store/store.go`):
//!
//! - allocation takes the lowest-id free, non-cooling row of any `Ready`
//!   block of the network whose `total_ips > allocated_ips`, oldest block
//!   first, knowing nothing of Metis's tables (bounds, quarantine,
//!   retirement) and seeing only the rows that exist (Metis writes rows
//!   lazily);
//! - idempotency is not scoped by network: an owner holding an address of
//!   the family anywhere gets that address back;
//! - IPv6 with no free row expands a block from (its highest-id row's
//!   address) + 1 by up to 64 rows inside the prefix, with no bounds check
//!   (a UNIQUE clash with an existing row is an error, as upstream's is),
//!   unless the block still has a free non-cooling row;
//! - `AddCIDR` checks nothing against other blocks; it reserves network,
//!   `.1` and broadcast only in a network's first IPv4 block, and gives an
//!   IPv6 block 64 rows from its base whatever its size (a /127 gets rows
//!   outside it);
//! - undrain turns a `Draining` block of the network back to `Ready`,
//!   whoever drained it;
//! - release takes the caller's cooldown (upstream's daemon: 1 minute) and
//!   keeps the last owner recorded.

use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use super::node::{Block, number};

/// Upstream's schema as upstream ships it (hand-written copy, so a change
/// to Metis's copy cannot hide here).
const UPSTREAM_SCHEMA: &str = include_str!("../../testdata/upstream-schema-v1.sql");

/// Upstream populates IPv6 blocks 64 rows at a time, whatever the prefix.
const IPV6_BATCH: u128 = 64;

/// Upstream's daemon's release cooldown.
pub const UPSTREAM_COOLDOWN_MS: i64 = 60_000;

/// Upstream recurses into allocation after every expansion attempt; where
/// no block can expand (every row cooling up to the prefix's end) it would
/// recurse forever. The writer stops there instead.
const MAX_EXPANSIONS: usize = 8;

/// What an upstream allocation gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    pub address: std::net::IpAddr,
    pub block_id: i64,
    /// False when idempotency returned what the owner already held (in any
    /// network).
    pub fresh: bool,
}

/// An upstream database being written.
pub struct Upstream {
    conn: Connection,
}

impl Upstream {
    /// Creates the file with upstream's schema.
    pub fn create(path: &std::path::Path) -> Upstream {
        let conn = Connection::open(path).unwrap();
        conn.execute_batch(UPSTREAM_SCHEMA).unwrap();
        Upstream { conn }
    }

    /// Opens a file some Metis wrote, as upstream's store opens it
    /// (`foreign_keys` on, a 5 s busy timeout, every write transaction
    /// `BEGIN IMMEDIATE`).
    pub fn open(path: &std::path::Path) -> Upstream {
        let conn = Connection::open(path).unwrap();
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .unwrap();
        conn.execute_batch("PRAGMA foreign_keys = ON").unwrap();
        Upstream { conn }
    }

    /// Upstream's `AddCIDR`: no check against other blocks; IPv4 gets every
    /// row, reserved (network, `.1`, broadcast) only when this is the
    /// network's first block of any family; IPv6 gets 64 rows from the base
    /// whatever the prefix. Returns the block id, or upstream's error.
    pub fn add_cidr(&mut self, network: &str, cidr: &str) -> Result<i64, String> {
        let block = Block::parse(cidr);
        let tx = self.immediate();
        let first: bool = tx
            .query_row(
                "SELECT COUNT(*) = 0 FROM cidr_blocks WHERE network = ?1",
                [network],
                |r| r.get(0),
            )
            .unwrap();
        let id = insert_block(&tx, &block, cidr, network, first && !block.v6)
            .map_err(|e| format!("cidr block already exists: {e}"))?;
        tx.commit().unwrap();
        Ok(id)
    }

    /// Upstream's `AllocateIP` of one family for (container, interface) in
    /// `network`.
    pub fn allocate(
        &mut self,
        network: &str,
        v6: bool,
        container: &str,
        ifname: &str,
        now_ms: i64,
    ) -> Result<Allocated, String> {
        let family = if v6 { "ipv6" } else { "ipv4" };
        for _ in 0..MAX_EXPANSIONS {
            let tx = self.immediate();
            let held: Option<(String, i64)> = tx
                .query_row(
                    "SELECT a.address, b.id FROM ip_addresses a JOIN cidr_blocks b \
                     ON a.cidr_block_id = b.id WHERE a.container_id = ?1 \
                     AND a.interface_name = ?2 AND a.is_allocated = 1 AND b.ip_family = ?3 LIMIT 1",
                    params![container, ifname, family],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()
                .unwrap();
            if let Some((address, block_id)) = held {
                return Ok(Allocated {
                    address: address.parse().unwrap(),
                    block_id,
                    fresh: false,
                });
            }
            let candidates = candidates(&tx, network, family);
            if candidates.is_empty() {
                return Err(format!(
                    "no available IPs in store: no available cidr blocks found for network {network}"
                ));
            }
            for &block_id in &candidates {
                if let Some(address) = take_lowest_free(&tx, block_id, container, ifname, now_ms) {
                    tx.commit().unwrap();
                    return Ok(Allocated {
                        address: address.parse().unwrap(),
                        block_id,
                        fresh: true,
                    });
                }
            }
            drop(tx);
            if !v6 {
                return Err(format!(
                    "no available IPs in store: failed to allocate ipv4 in any cidr block for network {network}"
                ));
            }
            for &block_id in &candidates {
                match self.expand(block_id, now_ms) {
                    Ok(true) => break,
                    Ok(false) => continue,
                    Err(e) => return Err(format!("failed to expand IPv6 block {block_id}: {e}")),
                }
            }
        }
        Err(format!(
            "upstream would recurse forever: no IPv6 block of network {network} can expand"
        ))
    }

    /// Upstream's `expandIPv6Block`: true when the block has a free
    /// non-cooling row or got new rows, false when exhausted.
    fn expand(&mut self, block_id: i64, now_ms: i64) -> Result<bool, String> {
        let tx = self.immediate();
        let has_free: bool = tx
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM ip_addresses WHERE cidr_block_id = ?1 \
                 AND is_allocated = 0 AND (release_at IS NULL OR release_at <= ?2))",
                params![block_id, now_ms],
                |r| r.get(0),
            )
            .unwrap();
        if has_free {
            return Ok(true);
        }
        let cidr: Option<String> = tx
            .query_row(
                "SELECT cidr FROM cidr_blocks WHERE id = ?1 AND ip_family = 'ipv6' \
                 AND total_ips > allocated_ips AND state = 'Ready'",
                [block_id],
                |r| r.get(0),
            )
            .optional()
            .unwrap();
        let Some(cidr) = cidr else {
            return Ok(false);
        };
        let block = Block::parse(&cidr);
        let last: Option<String> = tx
            .query_row(
                "SELECT address FROM ip_addresses WHERE cidr_block_id = ?1 ORDER BY id DESC LIMIT 1",
                [block_id],
                |r| r.get(0),
            )
            .optional()
            .unwrap();
        let start = last.map_or(block.base, |a| number(a.parse().unwrap()) + 1);
        let end = block.base + block.size();
        let mut inserted = 0;
        for n in (start..end).take(IPV6_BATCH as usize) {
            tx.execute(
                "INSERT INTO ip_addresses (cidr_block_id, address, is_allocated, container_id, interface_name) \
                 VALUES (?1, ?2, 0, '', '')",
                params![block_id, block.nth(n - block.base).to_string()],
            )
            .map_err(|e| e.to_string())?;
            inserted += 1;
        }
        tx.commit().unwrap();
        Ok(inserted > 0)
    }

    /// Upstream's `ReleaseIPByOwner`: every allocated row of the owner in
    /// blocks of `network` (any state) rests until `now + cooldown` (NULL
    /// when the cooldown is 0); the owner stays recorded. Returns the
    /// addresses.
    pub fn release(
        &mut self,
        network: &str,
        container: &str,
        ifname: &str,
        cooldown_ms: i64,
        now_ms: i64,
    ) -> Vec<std::net::IpAddr> {
        let tx = self.immediate();
        let rows: Vec<(i64, i64, String)> = {
            let mut stmt = tx
                .prepare(
                    "SELECT a.id, a.cidr_block_id, a.address FROM ip_addresses a \
                     JOIN cidr_blocks b ON a.cidr_block_id = b.id WHERE b.network = ?1 \
                     AND a.container_id = ?2 AND a.interface_name = ?3 AND a.is_allocated = 1",
                )
                .unwrap();
            stmt.query_map(params![network, container, ifname], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .unwrap()
            .map(Result::unwrap)
            .collect()
        };
        let release_at = (cooldown_ms > 0).then_some(now_ms + cooldown_ms);
        for (row, block, _) in &rows {
            tx.execute(
                "UPDATE ip_addresses SET is_allocated = 0, release_at = ?2 WHERE id = ?1",
                params![row, release_at],
            )
            .unwrap();
            tx.execute(
                "UPDATE cidr_blocks SET allocated_ips = allocated_ips - 1 WHERE id = ?1",
                [block],
            )
            .unwrap();
        }
        tx.commit().unwrap();
        rows.into_iter()
            .map(|(_, _, a)| a.parse().unwrap())
            .collect()
    }

    /// Upstream's `UndrainOneCIDRBlock`: one `Draining` block of the
    /// network and family back to `Ready`, whoever drained it. Returns its
    /// id.
    pub fn undrain_one(&mut self, network: &str, v6: bool) -> Option<i64> {
        let family = if v6 { "ipv6" } else { "ipv4" };
        let tx = self.immediate();
        let id: Option<i64> = tx
            .query_row(
                "SELECT id FROM cidr_blocks WHERE network = ?1 AND ip_family = ?2 \
                 AND state = 'Draining' LIMIT 1",
                params![network, family],
                |r| r.get(0),
            )
            .optional()
            .unwrap();
        if let Some(id) = id {
            tx.execute("UPDATE cidr_blocks SET state = 'Ready' WHERE id = ?1", [id])
                .unwrap();
        }
        tx.commit().unwrap();
        id
    }

    fn immediate(&mut self) -> rusqlite::Transaction<'_> {
        self.conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap()
    }

    /// Adds a block to `network` as upstream does: every IPv4 address as a
    /// row with offsets 0, 1 and the last reserved (upstream reserves them
    /// in the network's first block), IPv6 one batch of rows (past the
    /// prefix when the block is smaller than the batch: upstream's bug).
    /// Returns the block id.
    pub fn block(&self, cidr: &str, network: &str, reserve: bool) -> i64 {
        let block = Block::parse(cidr);
        insert_block(&self.conn, &block, cidr, network, reserve && !block.v6).unwrap()
    }

    /// Allocates `address` of block `id` to a pod, as upstream records it.
    pub fn hold(&self, id: i64, address: &str, container: &str, ifname: &str) {
        let changed = self
            .conn
            .execute(
                "UPDATE ip_addresses SET container_id = ?3, interface_name = ?4, \
                 pod_name = ?3, pod_namespace = 'default', is_allocated = 1, \
                 allocated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) \
                 WHERE cidr_block_id = ?1 AND address = ?2 AND is_allocated = 0",
                params![id, address, container, ifname],
            )
            .unwrap();
        assert_eq!(changed, 1, "{address} is not a free row of block {id}");
        self.conn
            .execute(
                "UPDATE cidr_blocks SET allocated_ips = allocated_ips + 1 WHERE id = ?1",
                [id],
            )
            .unwrap();
    }
}

/// Inserts a block as upstream's `AddCIDR` does (see [`Upstream::add_cidr`]),
/// with its reserved rows when `reserve`.
fn insert_block(
    conn: &Connection,
    block: &Block,
    cidr: &str,
    network: &str,
    reserve: bool,
) -> rusqlite::Result<i64> {
    let family = if block.v6 { "ipv6" } else { "ipv4" };
    let rows = if block.v6 { IPV6_BATCH } else { block.size() };
    let reserved =
        |offset: u128| reserve && block.size() >= 4 && (offset < 2 || offset == block.size() - 1);
    let reserved_count = (0..rows).filter(|o| reserved(*o)).count();
    let host_bits = if block.v6 { 128 } else { 32 } - u32::from(block.prefix);
    let total_ips = if host_bits >= 62 {
        i64::MAX
    } else {
        1i64 << host_bits
    };
    conn.execute(
        "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips, state) \
         VALUES (?1, ?2, ?3, ?4, ?5, 'Ready')",
        params![
            cidr,
            network,
            family,
            total_ips,
            i64::try_from(reserved_count).unwrap()
        ],
    )?;
    let id = conn.last_insert_rowid();
    for offset in 0..rows {
        conn.execute(
            "INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) \
             VALUES (?1, ?2, '', '', ?3)",
            params![block.nth(offset).to_string(), id, reserved(offset)],
        )?;
    }
    Ok(id)
}

/// Ready blocks of the network and family with room by their counters,
/// oldest first (upstream's candidates).
fn candidates(conn: &Connection, network: &str, family: &str) -> Vec<i64> {
    let mut stmt = conn
        .prepare(
            "SELECT id FROM cidr_blocks WHERE network = ?1 AND ip_family = ?2 \
             AND total_ips > allocated_ips AND state = 'Ready' ORDER BY id",
        )
        .unwrap();
    stmt.query_map(params![network, family], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// Claims the block's lowest-id free, non-cooling row for the owner, as
/// upstream's one UPDATE … RETURNING does; None when it has none.
fn take_lowest_free(
    conn: &Connection,
    block_id: i64,
    container: &str,
    ifname: &str,
    now_ms: i64,
) -> Option<String> {
    let address: Option<String> = conn
        .query_row(
            "UPDATE ip_addresses SET is_allocated = 1, container_id = ?2, interface_name = ?3, \
             allocated_at = ?4 WHERE id = (SELECT id FROM ip_addresses WHERE cidr_block_id = ?1 \
             AND is_allocated = 0 AND (release_at IS NULL OR release_at <= ?4) ORDER BY id LIMIT 1) \
             RETURNING address",
            params![block_id, container, ifname, now_ms],
            |r| r.get(0),
        )
        .optional()
        .unwrap();
    if address.is_some() {
        conn.execute(
            "UPDATE cidr_blocks SET allocated_ips = allocated_ips + 1 WHERE id = ?1",
            [block_id],
        )
        .unwrap();
    }
    address
}

/// Upstream's `AllocateIP` of `family` (`"ipv4"`, `"ipv6"`) for
/// `container`'s `eth0` in `network` on the file at `path` (see
/// [`Upstream::allocate`]). `None`: nothing left.
pub fn allocate_like_upstream(
    path: &std::path::Path,
    network: &str,
    family: &str,
    container: &str,
) -> Option<String> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap());
    Upstream::open(path)
        .allocate(network, family == "ipv6", container, "eth0", now_ms)
        .ok()
        .map(|allocated| allocated.address.to_string())
}
