//! The database itself: upstream's schema and Metis's tables, the file's
//! modes and who may open it, lock contention, WAL checkpoints, and the
//! hooks that co-write host-local's directory. Reaches nothing else of the
//! store but its shared types.

pub(crate) mod busy;
pub(crate) mod checkpoint;
pub mod co_writer;
pub(crate) mod connection;
pub(crate) mod files;
pub mod ownership;
pub(crate) mod schema;
pub(crate) mod types;

pub(crate) use connection::*;
pub(crate) use schema::SCHEMA_VERSION;
pub(crate) use types::*;
