//! The CNI protocol as Metis speaks it: environment, `CNI_ARGS`, network
//! configuration, results and errors, and version negotiation. Everything
//! here is pure (no I/O) so the plugin's run flow can be tested around it.
pub mod args;
pub mod backend;
pub mod conf;
pub mod dns;
pub mod env;
pub mod error;
pub mod plugin;
pub mod result;
pub mod version;
