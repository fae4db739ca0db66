//! Defaults shared by the plugin, the daemon and the command-line tools,
//! written once so they cannot drift apart.

/// Upstream's default socket path.
pub const DEFAULT_SOCKET_PATH: &str = "/var/lib/cni/metis/metis-adaptive-ipam.sock";
/// Upstream's default database path.
pub const DEFAULT_DB_PATH: &str = "/var/lib/cni/metis/metis.sqlite";
/// Network used when a request or a NodeNetworkConfig entry names none
/// (upstream's default pod network).
pub const DEFAULT_NETWORK: &str = "default";
/// Upstream's release cooldown (its daemon's, and `--release-cooldown`'s
/// default): what direct mode records when it first opens a database only
/// upstream has written.
pub const DEFAULT_RELEASE_COOLDOWN_MS: i64 = 60_000;
