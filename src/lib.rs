//! Metis: a node-local adaptive IPAM for Kubernetes pods.
//!
//! The `kube` feature (on by default) builds the Kubernetes client and the
//! adaptive side; without it (the edge build) blocks come from the CNI
//! ranges and `--cidr` only, and no HTTP, TLS or YAML code is compiled.
#[cfg(feature = "kube")]
pub mod adaptive;
pub mod cidr;
pub mod cli;
pub mod cni;
#[cfg(feature = "kube")]
pub mod controller;
pub mod daemon;
pub mod decode;
pub mod defaults;
pub mod duration;
pub mod encode;
pub mod engine;
pub mod flags;
pub mod host_local_dir;
#[cfg(feature = "kube")]
pub mod kube;
pub mod log;
pub mod metrics;
pub mod names;
pub mod start;
pub mod store;
pub mod wire;

#[cfg(test)]
mod testutil;
