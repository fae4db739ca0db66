//! SQLite store: upstream Metis's schema (version 1) and operations, with
//! Metis's fixes (reservations in every block, network-scoped idempotency,
//! bounded IPv6 expansion, repair of databases written by upstream).
//!
//! Every write is one short `BEGIN IMMEDIATE` transaction; the daemon and the
//! CNI plugin (direct mode) may open the same file concurrently (WAL + busy
//! timeout). A request (ADD, DEL, GC) runs all its writes and the reads they
//! decide on in one such transaction (see [`Store::begin_request`]): the
//! daemon's loop groups the requests of one turn in it, direct mode opens
//! one per request; every write then runs in a savepoint of it. Every
//! address handed out passes `handout`'s check against the configuration
//! in force. Timestamps are Unix milliseconds passed in by the caller.

/// `updated_at = …` with the expression of upstream's `updated_at`
/// triggers, set by every Metis UPDATE of `ip_addresses` and `cidr_blocks`
/// (Metis's connections run with the triggers off), spelled once.
macro_rules! stamped {
    () => {
        "updated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}

mod alloc;
pub mod db;
pub mod layout;
mod open;
mod queries;
mod rows;
#[cfg(test)]
mod tests;
pub mod upkeep;

pub use alloc::allocate::Released;
pub use db::busy::{Contended, patiently};
pub use db::checkpoint::{Checkpointer, ONE_REQUEST_WAL_LIMIT};
pub use db::connection::{Healed, Healing, Store};
pub use db::schema::{SCHEMA, SCHEMA_VERSION};
pub use db::types::*;
pub use layout::blocks::{Isolation, LayoutChanges, Source, Wish};
pub use layout::grants::{GrantChanges, Refusal, ReleasedBlock, TakenBack};
pub use rows::block::{Quarantined, reserved_offsets};
pub use rows::handout::{BlockRecord, InForce, Unfit, address_fit, block_fit};
pub use upkeep::boot::{BOOT_ID_ENV, BOOT_ID_PATH, BootRecovery, boot_id_path, read_boot_id};
pub use upkeep::check::{Depth, Report, check_file};
