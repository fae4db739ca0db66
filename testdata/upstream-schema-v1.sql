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
CREATE TRIGGER IF NOT EXISTS update_cidr_blocks_updated_at AFTER UPDATE ON cidr_blocks FOR EACH ROW
BEGIN UPDATE cidr_blocks SET updated_at = (CAST(unixepoch('subsec') * 1000 AS INTEGER)) WHERE id = OLD.id; END;
CREATE TRIGGER IF NOT EXISTS update_ip_addresses_updated_at AFTER UPDATE ON ip_addresses FOR EACH ROW
BEGIN UPDATE ip_addresses SET updated_at = (CAST(unixepoch('subsec') * 1000 AS INTEGER)) WHERE id = OLD.id; END;
PRAGMA user_version = 1;
