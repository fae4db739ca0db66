//! Metis: a node-local adaptive IPAM for Kubernetes pods.
pub mod cidr;
