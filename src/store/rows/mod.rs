//! A block and its rows, what every verb builds on: reservations, the
//! frontier, inserts and give-back, the one definition of "free now", the
//! hand-out check, the gateways results name, and `Withheld` following
//! Metis's record. Reaches down to `db` only.

pub(crate) mod block;
pub(crate) mod free;
pub(crate) mod handout;
pub(crate) mod named_gateway;
pub(crate) mod withhold;
