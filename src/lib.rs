//! Metis: a node-local adaptive IPAM for Kubernetes pods.
pub mod adaptive;
pub mod cidr;
pub mod cli;
pub mod cni;
pub mod daemon;
pub mod defaults;
pub mod duration;
pub mod engine;
pub mod flags;
pub mod kube;
pub mod log;
pub mod metrics;
pub mod names;
pub mod store;
pub mod wire;

#[cfg(test)]
mod testutil;
