//! Which blocks a network has and in which state: sources and placement,
//! host-local bounds, the cluster's grants, drain/undrain/expire, and a
//! block whose gateway a pod holds. Reaches down to `rows` and `db`.

pub(crate) mod blocks;
pub(crate) mod bounds;
pub mod gateway;
pub(crate) mod grants;
pub(crate) mod lifecycle;
