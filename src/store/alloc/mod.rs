//! Addresses in and out: allocate, release, requested addresses, STATUS's
//! read-only walk of the same blocks, and CNI GC. Reaches down to `layout`,
//! `rows` and `db`.

pub(crate) mod allocate;
pub(crate) mod gc;
pub(crate) mod room;
