//! Kubernetes: where extra address blocks come from. Blocking HTTP lives on
//! threads of its own that never touch SQLite; they hand the daemon's loop
//! typed events over a channel and wake it through a pipe.

pub mod backoff;
pub mod client;
pub mod config;
pub mod follow;
pub mod fresh;
pub mod nnc;
pub mod objects;
pub mod worker;
