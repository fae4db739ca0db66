//! Keeping the file sound: the repair at open, what upstream left after a
//! rollback, `admin downgrade`, `admin check` and leak recovery after a
//! reboot. Reaches down to every room but `alloc` and `queries`.

pub(crate) mod boot;
pub(crate) mod check;
pub mod downgrade;
pub(crate) mod repair;
pub mod rollback;
