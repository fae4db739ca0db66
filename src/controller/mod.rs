//! `metis controller`: the cluster side of the NodeNetworkConfig protocol
//! for clusters without a cloud controller. It grants blocks from
//! `MetisPool`s into the nodes' `status.podCIDRs` (each claim a
//! `MetisBlock` object named by the block), takes released ones back, and
//! is leader-elected with a Lease. `decide` is the whole policy
//! as a pure function; the other modules read the cluster (`informer`),
//! elect a leader (`lease`) and write what `decide` says (`writer`).
//! docs/controller.md tells how it runs and why two controllers cannot
//! grant one block twice.

pub mod block;
pub mod cache;
pub mod clock;
pub mod decide;
pub mod demand;
pub mod informer;
pub mod lease;
pub mod pool;
pub mod refill;
pub mod retry;
pub mod run;
pub mod short_text;
pub mod small_set;
pub mod status;
pub mod taken;
pub mod writer;

pub use run::{Config, parse_config, run, usage};
