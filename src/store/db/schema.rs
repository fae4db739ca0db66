//! Upstream Metis schema, version 1, byte-for-byte in meaning: same tables,
//! columns (order, types, defaults), constraints, indexes and triggers.

/// The value of `PRAGMA user_version` this schema stamps.
pub const SCHEMA_VERSION: i64 = 1;

/// Upstream's schema (all objects `IF NOT EXISTS`), run in one transaction
/// when `user_version` is not 1. Ends by setting `user_version = 1`.
pub const SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS cidr_blocks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    cidr TEXT NOT NULL,
    network TEXT NOT NULL,
    ip_family TEXT NOT NULL,
    total_ips INTEGER NOT NULL,
    allocated_ips INTEGER DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'Ready',
    created_at INTEGER DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    updated_at INTEGER DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    UNIQUE(cidr, network)
);

CREATE TABLE IF NOT EXISTS ip_addresses (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    address TEXT NOT NULL,
    cidr_block_id INTEGER NOT NULL,
    container_id TEXT,
    pod_name TEXT,
    pod_namespace TEXT,
    interface_name TEXT,
    is_allocated BOOLEAN DEFAULT FALSE,
    release_at INTEGER,
    allocated_at INTEGER,
    updated_at INTEGER DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    UNIQUE(address, cidr_block_id),
    FOREIGN KEY (cidr_block_id) REFERENCES cidr_blocks(id) ON DELETE CASCADE
);

CREATE INDEX IF NOT EXISTS idx_available_ips ON ip_addresses(cidr_block_id, id) WHERE is_allocated = FALSE;

CREATE INDEX IF NOT EXISTS idx_ip_idempotency ON ip_addresses(container_id, interface_name);

CREATE TRIGGER IF NOT EXISTS update_cidr_blocks_updated_at
AFTER UPDATE ON cidr_blocks
FOR EACH ROW
BEGIN
    UPDATE cidr_blocks SET updated_at = (CAST(unixepoch('subsec') * 1000 AS INTEGER)) WHERE id = OLD.id;
END;

CREATE TRIGGER IF NOT EXISTS update_ip_addresses_updated_at
AFTER UPDATE ON ip_addresses
FOR EACH ROW
BEGIN
    UPDATE ip_addresses SET updated_at = (CAST(unixepoch('subsec') * 1000 AS INTEGER)) WHERE id = OLD.id;
END;

PRAGMA user_version = 1;
";

/// Metis's own table (never part of upstream's schema); created on every
/// open if missing.
pub const SETTINGS: &str =
    "CREATE TABLE IF NOT EXISTS metis_settings (key TEXT PRIMARY KEY, value TEXT NOT NULL)";

/// Metis's record of each block: which sources want it (comma-separated:
/// cni, flag, node, nnc; NULL while Metis has no record of where the block
/// comes from — written by upstream, or added without a source), whether
/// Metis retired it (Draining because no source wants it any more), why it
/// is quarantined, if it is, and its population frontier: the next offset
/// to give a row, as decimal text because an IPv6 offset (up to 2^128)
/// does not fit SQLite's 64-bit INTEGER. No frontier: see
/// `block::frontier`.
pub const BLOCKS: &str = "CREATE TABLE IF NOT EXISTS metis_blocks (\
     block_id INTEGER PRIMARY KEY, sources TEXT, \
     retired INTEGER NOT NULL DEFAULT 0, quarantine TEXT, frontier TEXT)";

/// Metis's record of each network: whether it is isolated (an address
/// space of its own, `ipam.isolated`), since when (Unix ms) the monitor
/// has seen its IPv4 use low, across restarts, the host-local directory
/// Metis co-writes during a migration (`store::co_writer`), and the `name`
/// of the conflist whose ADD served it last (whose GC covers it).
pub const NETWORKS: &str = "CREATE TABLE IF NOT EXISTS metis_networks (\
     network TEXT PRIMARY KEY, isolated INTEGER NOT NULL DEFAULT 0, \
     low_utilization_since INTEGER, host_local_dir TEXT, host_local_dir_identity TEXT, \
     conf_name TEXT)";

/// The ranges each static source (cni, flag) wants, per network.
pub const RANGES: &str = "CREATE TABLE IF NOT EXISTS metis_ranges (\
     source TEXT NOT NULL, network TEXT NOT NULL, cidr TEXT NOT NULL, \
     PRIMARY KEY (source, network, cidr))";

/// host-local's `rangeStart`, `rangeEnd` and `gateway` of a network's block
/// (keyed by its prefix, so a block reshaped by the layout loses them) when
/// they depart from Metis's default reservation. The addresses they keep
/// out are reserved rows in `ip_addresses`, so upstream never hands them
/// out either; this table only says why.
pub const BOUNDS: &str = "CREATE TABLE IF NOT EXISTS metis_bounds (\
     network TEXT NOT NULL, cidr TEXT NOT NULL, range_start TEXT NOT NULL, \
     range_end TEXT NOT NULL, gateway TEXT NOT NULL, PRIMARY KEY (network, cidr))";

/// On a read-only connection, empty TEMP stand-ins (never in the file) for
/// Metis's tables the file lacks — a database only upstream has written —
/// so every read of them finds "nothing recorded" instead of failing.
/// `sqlite_master` still lists only the file's own tables.
pub(in crate::store) fn shadow_missing_tables(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    // In memory: a read-only root filesystem has no temporary directory.
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    let present: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for (name, create) in METIS_TABLES {
        if !present.iter().any(|table| table == name) {
            conn.execute_batch(&create.replacen("CREATE TABLE", "CREATE TEMP TABLE", 1))?;
        }
    }
    Ok(())
}

/// Blocks of the cluster's (Node podCIDRs, NodeNetworkConfig status) that
/// it no longer grants: retired, kept while pods hold addresses in them.
pub const TAKEN_BACK: &str = "CREATE TABLE IF NOT EXISTS metis_taken_back (\
     block_id INTEGER PRIMARY KEY, source TEXT NOT NULL, since_ms INTEGER NOT NULL)";

/// Every block this node gave back through `releasableCIDRs`: a
/// `NonReusable` one is never taken again, a reusable one only once it
/// left the status and came back (see `adaptive::grants`).
pub const RELEASED: &str = "CREATE TABLE IF NOT EXISTS metis_released (\
     network TEXT NOT NULL, cidr TEXT NOT NULL, reusable INTEGER NOT NULL, \
     released_at INTEGER NOT NULL, PRIMARY KEY (network, cidr))";

/// The gateway each live result Metis returned names, per allocation
/// row: no later hand-out (any conflist, any mode) takes it while that row
/// is still the same allocation. The owner and `allocated_at` are copied
/// from the row when the result is returned, and a record counts only
/// while the row still carries them (another writer may release or reuse
/// the row without knowing this table). Written in the allocation's
/// transaction, deleted with its release (`block::give_back`). Keyed by
/// its primary key alone (`WITHOUT ROWID`): an ADD and a DEL write one
/// B-tree page fewer. Files made before keep a rowid table; every
/// statement reads and writes both shapes alike.
pub const GATEWAYS: &str = "CREATE TABLE IF NOT EXISTS metis_gateways (\
     row_id INTEGER NOT NULL, gateway TEXT NOT NULL, container_id TEXT NOT NULL, \
     interface_name TEXT NOT NULL, allocated_at INTEGER, PRIMARY KEY (row_id, gateway)) WITHOUT ROWID; \
     CREATE INDEX IF NOT EXISTS metis_gateways_by_gateway ON metis_gateways (gateway)";

/// Metis's own tables, created on every open if missing.
pub const METIS_TABLES: [(&str, &str); 8] = [
    ("metis_settings", SETTINGS),
    ("metis_blocks", BLOCKS),
    ("metis_networks", NETWORKS),
    ("metis_ranges", RANGES),
    ("metis_bounds", BOUNDS),
    ("metis_taken_back", TAKEN_BACK),
    ("metis_released", RELEASED),
    ("metis_gateways", GATEWAYS),
];

/// Metis's own index on upstream's `ip_addresses`, created on every open
/// if missing: the free rows by the end of their cooldown (NULL first, then
/// by id). A claim reads the rows with none in id order, and those whose
/// cooldown is over from the longest-rested, without walking the rows still
/// cooling (`alloc::allocate::claim`). SQLite keeps an index for every
/// writer of the file, upstream's store included, so it is never stale;
/// upstream's own tables and indexes stay as they are.
pub const METIS_INDEXES: [(&str, &str); 1] = [(
    "metis_free_addresses",
    "CREATE INDEX IF NOT EXISTS metis_free_addresses ON ip_addresses(cidr_block_id, release_at) \
     WHERE is_allocated = FALSE",
)];

/// `metis_settings` key holding the reservation mode.
pub const KEY_RESERVE_MODE: &str = "reserve_mode";

/// `metis_settings` key recording the mode the full layout repair last ran
/// for (the expensive part of the repair is skipped while it matches).
pub const KEY_LAYOUT: &str = "reserve_layout";

/// `metis_settings` key holding the daemon's release cooldown in
/// milliseconds, read by the plugin in direct mode.
pub const KEY_RELEASE_COOLDOWN: &str = "release_cooldown_ms";

/// `metis_settings` key prefix (the source's kind follows) holding the
/// uids of this node's object the daemon followed, space-separated, the
/// current one last: an earlier uid coming back is the cluster's state
/// going back (an etcd restore), not a new object.
pub const KEY_FOLLOWED_UIDS: &str = "followed_uids_";

/// `metis_settings` key holding the fingerprint of the file as the daemon
/// left it at its last clean stop (absent while a daemon runs).
pub const KEY_CLEAN_STOP: &str = "clean_stop";

/// `metis_settings` key holding the watermark as of which a start check
/// found every address row sound (see `check::Watermark`).
pub const KEY_ROWS_VERIFIED: &str = "rows_verified";

/// `metis_settings` key holding the file's healed state (see
/// [`HEALED_STATE`]) as the open-time healing (`repair`) last left the file:
/// clean, nothing pending. While the file still says the same, nobody has
/// written anything that healing looks at since (see
/// `repair::proven_healed`), and an open skips it.
pub const KEY_HEALED: &str = "healed_state";

/// The rows of the file's healed state: everything the open-time healing
/// depends on but the schema (`user_version` and `schema_version` join
/// them) and the reservation mode and layout mark (settings): the highest
/// row id ever given in `cidr_blocks` and `ip_addresses`
/// (`sqlite_sequence`, AUTOINCREMENT: any row inserted — a block added,
/// upstream's IPv6 expansion — even if deleted again), every block's
/// state (a drain, an undrain, an expiry; a delete removes the row), Metis's
/// record of each block's retirement and quarantine, and the host-local
/// bounds. Not in it, so that ADD and DEL leave it alone: `allocated_ips`,
/// `updated_at` and the address rows' own columns — allocating and
/// releasing rows that exist, which by themselves never leave anything to
/// heal in a file healed clean. One statement of plain arms: its
/// preparation is most of what an open that skips the healing pays.
pub const HEALED_STATE: &str = "\
     SELECT 's', name, seq, NULL, NULL FROM sqlite_sequence \
     UNION ALL SELECT 'b', id, state, NULL, NULL FROM cidr_blocks \
     UNION ALL SELECT 'm', block_id, retired, quarantine IS NULL, NULL FROM metis_blocks \
     UNION ALL SELECT 'r', network || ' ' || cidr, range_start, range_end, gateway FROM metis_bounds";
