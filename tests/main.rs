//! The integration tests: one crate, each file of `tests/` a module of it,
//! so the shared harness (`common`) and the library are compiled and linked
//! once instead of once per file. `cargo test --test integration NAME::`
//! runs one file's tests. `tests/stall.rs`, which measures latency under
//! load, is a crate of its own so no other test's daemon adds to the load.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

mod common;

mod access;
mod big_blocks;
mod boot;
mod crash;
mod daemon_batch;
mod daemon_wire;
mod deploy;
mod golden;
mod host_local;
mod hostile;
mod install;
mod kube;
mod limits;
mod metrics;
mod migration;
mod model;
mod ops;
mod plugin;
mod properties;
mod proto_sync;
mod reconcile;
mod storage_faults;
