//! The adaptive side: growing and shrinking a node's blocks with the
//! cluster. `policy` decides from plain numbers, `monitor` applies a pass
//! to the store and computes the NodeNetworkConfig patch, and `state` runs
//! it all on the daemon's loop, parking allocations that wait for blocks.

pub mod cluster;
pub mod grants;
pub mod monitor;
pub mod policy;
pub mod state;

pub use monitor::MonitorConfig;
pub use state::{Adaptive, AdaptiveConfig, Delivery};
