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
mod busy_writers;
mod cluster;
mod control_plane;
mod control_plane_model;
mod control_plane_tls;
mod controller_model;
mod crash;
mod daemon_batch;
mod daemon_wire;
mod deploy;
mod direct_writers;
mod golden;
mod handover;
mod host_local;
mod hostile;
mod install;
mod kube;
mod kube_api;
mod limits;
mod metrics;
mod migration;
mod model;
mod model_multi_writer;
mod ops;
mod plugin;
mod properties;
mod proto_sync;
mod read_only;
mod reconcile;
mod storage_faults;
mod upstream_rollback;
mod writers;

/// With `autotests = false`, a file of `tests/` that is neither a module
/// here nor a `[[test]]` of its own in Cargo.toml would never be compiled,
/// and its tests would pass unseen.
#[test]
fn every_test_file_is_compiled() {
    let this = include_str!("main.rs");
    let manifest = include_str!("../Cargo.toml");
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests");
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(module) = name.strip_suffix(".rs") else {
            continue;
        };
        assert!(
            module == "main"
                || this.contains(&format!("\nmod {module};\n"))
                || manifest.contains(&format!("path = \"tests/{name}\"")),
            "tests/{name} is not compiled: add `mod {module};` to tests/main.rs"
        );
    }
}
