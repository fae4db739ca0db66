//! Databases written the way upstream Metis writes them: its schema
//! (version 1), no `metis_settings`, rows populated in batches, and
//! upstream's own bugs (an IPv6 /127 or /128 block handing out `::2`).

use rusqlite::{Connection, params};

use super::node::Block;

/// Upstream's schema as upstream ships it (hand-written copy, so a change
/// to Metis's copy cannot hide here).
const UPSTREAM_SCHEMA: &str = include_str!("../../testdata/upstream-schema-v1.sql");

/// Upstream populates IPv6 blocks 64 rows at a time, whatever the prefix.
const IPV6_BATCH: u128 = 64;

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

    /// Adds a block to `network` as upstream does: every IPv4 address as a
    /// row with offsets 0, 1 and the last reserved (upstream reserves them
    /// in the network's first block), IPv6 one batch of rows (past the
    /// prefix when the block is smaller than the batch: upstream's bug).
    /// Returns the block id.
    pub fn block(&self, cidr: &str, network: &str, reserve: bool) -> i64 {
        let block = Block::parse(cidr);
        let family = if block.v6 { "ipv6" } else { "ipv4" };
        let rows = if block.v6 { IPV6_BATCH } else { block.size() };
        let reserved =
            |offset: u128| reserve && !block.v6 && (offset < 2 || offset == block.size() - 1);
        let reserved_count = (0..rows).filter(|o| reserved(*o)).count();
        self.conn
            .execute(
                "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    cidr,
                    network,
                    family,
                    i64::try_from(block.size().min(1 << 62)).unwrap(),
                    i64::try_from(reserved_count).unwrap()
                ],
            )
            .unwrap();
        let id = self.conn.last_insert_rowid();
        for offset in 0..rows {
            self.conn
                .execute(
                    "INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) \
                     VALUES (?1, ?2, '', '', ?3)",
                    params![block.nth(offset).to_string(), id, reserved(offset)],
                )
                .unwrap();
        }
        id
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

/// Upstream's `AllocateIP` on the file at `path`, as its queries do it:
/// the lowest-id free, non-cooling row of the network's `Ready` blocks of
/// `family` with room, oldest block first (wall-clock cooldowns). `None`:
/// nothing left.
pub fn allocate_like_upstream(
    path: &std::path::Path,
    network: &str,
    family: &str,
    container: &str,
) -> Option<String> {
    let conn = Connection::open(path).unwrap();
    let now: i64 = conn
        .query_row(
            "SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER)",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let blocks: Vec<i64> = conn
        .prepare(
            "SELECT id FROM cidr_blocks WHERE network = ?1 AND ip_family = ?2 \
             AND total_ips > allocated_ips AND state = 'Ready' ORDER BY id",
        )
        .unwrap()
        .query_map(params![network, family], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for id in blocks {
        let address: Option<String> = conn
            .query_row(
                "UPDATE ip_addresses SET is_allocated = TRUE, container_id = ?2, interface_name = 'eth0' \
                 WHERE id = (SELECT id FROM ip_addresses WHERE cidr_block_id = ?1 AND is_allocated = FALSE \
                   AND (release_at IS NULL OR release_at <= ?3) ORDER BY id LIMIT 1) RETURNING address",
                params![id, container, now],
                |r| r.get(0),
            )
            .ok();
        if let Some(address) = address {
            conn.execute(
                "UPDATE cidr_blocks SET allocated_ips = allocated_ips + 1 WHERE id = ?1",
                [id],
            )
            .unwrap();
            return Some(address);
        }
    }
    None
}
