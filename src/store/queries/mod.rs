//! Read-only answers for operators and metrics: listings, table dumps,
//! usage and block counts. Reaches down to `rows` and `db`.

pub(crate) mod listings;
pub(crate) mod stats;
