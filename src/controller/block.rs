//! The `MetisBlock` resource (`metis.x-k8s.io/v1alpha1`, cluster scoped):
//! one object per granted, cooling or retired block, named by its CIDR
//! alone, so that the API server's name uniqueness is the fence — a claim
//! is a POST, and the loser of two claims gets 409 AlreadyExists. Its
//! `spec.node` is the Node's name: blocks follow the machine, not its
//! NodeNetworkConfig object. No ownerReferences: the garbage collector
//! never deletes a block with its Node or NodeNetworkConfig.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::cidr::Cidr;

pub const BLOCK_PATH: &str = "/apis/metis.x-k8s.io/v1alpha1/metisblocks";
pub const POOL_LABEL: &str = "metis.x-k8s.io/pool";
pub const NODE_LABEL: &str = "metis.x-k8s.io/node";

/// Where a block stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockState {
    /// In (or on its way into) the status of `spec.node`'s NNC.
    Granted,
    /// Released (or taken from a Node gone past the grace): free again
    /// once it cooled for the pool's `reclaimDelay`.
    Cooling,
    /// Released as `NonReusable`: never granted again.
    NonReusable,
}

/// Why a block cools: the node released it, or its Node is gone.
pub const RELEASED: &str = "Released";
pub const NODE_GONE: &str = "NodeGone";
pub const GRANTED: &str = "Granted";

/// `spec`, written by the controller only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSpec {
    pub pool: String,
    pub network: String,
    pub cidr: String,
    pub node: String,
    pub state: BlockState,
    #[serde(default)]
    pub reason: String,
}

#[derive(Deserialize)]
struct ObjectMeta {
    #[serde(default)]
    name: String,
    #[serde(rename = "resourceVersion", default)]
    resource_version: String,
}

#[derive(Deserialize)]
struct BlockObject {
    metadata: ObjectMeta,
    spec: Option<BlockSpec>,
}

/// A block as read from the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub name: String,
    pub resource_version: String,
    /// `None` when unreadable: a spec missing or malformed, or a CIDR
    /// whose name is not this object's (nobody but this controller writes
    /// blocks; such an object is reported, never trusted).
    pub spec: Option<(Cidr, BlockSpec)>,
}

impl Block {
    pub fn parse(object: Value) -> Block {
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let resource_version = object["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let spec = serde_json::from_value::<BlockObject>(object)
            .ok()
            .and_then(|o| {
                let spec = o.spec?;
                let cidr: Cidr = spec.cidr.parse().ok()?;
                (block_name(&cidr) == o.metadata.name && o.metadata.resource_version.len() < 64)
                    .then_some((cidr, spec))
            });
        Block {
            name,
            resource_version,
            spec,
        }
    }
}

/// The object's name for `cidr`: `v4-198-18-0-16-28`, or
/// `v6-2001-db8-1-0-0-0-0-10-124` (all eight groups, lowercase hex).
pub fn block_name(cidr: &Cidr) -> String {
    match cidr.base() {
        IpAddr::V4(v4) => {
            let [a, b, c, d] = v4.octets();
            format!("v4-{a}-{b}-{c}-{d}-{}", cidr.prefix_len())
        }
        IpAddr::V6(v6) => {
            let groups: Vec<String> = v6.segments().iter().map(|g| format!("{g:x}")).collect();
            format!("v6-{}-{}", groups.join("-"), cidr.prefix_len())
        }
    }
}

/// Whether `value` is a valid label value (≤ 63 characters, alphanumeric
/// at both ends, `-_.` between).
fn is_label_value(value: &str) -> bool {
    value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && value
            .chars()
            .next()
            .is_none_or(|c| c.is_ascii_alphanumeric())
        && value
            .chars()
            .last()
            .is_none_or(|c| c.is_ascii_alphanumeric())
}

/// The whole object to POST (`resource_version` empty) or PUT. A name
/// that is no label value (a node name may be 253 characters) goes
/// without that label: the spec is what the controller reads.
pub fn object(spec: &BlockSpec, name: &str, resource_version: &str) -> Value {
    let mut labels = serde_json::Map::new();
    for (key, value) in [(POOL_LABEL, &spec.pool), (NODE_LABEL, &spec.node)] {
        if is_label_value(value) {
            labels.insert(key.into(), Value::from(value.as_str()));
        }
    }
    let mut metadata = json!({"name": name, "labels": labels});
    if !resource_version.is_empty() {
        metadata["resourceVersion"] = Value::from(resource_version);
    }
    json!({
        "apiVersion": "metis.x-k8s.io/v1alpha1",
        "kind": "MetisBlock",
        "metadata": metadata,
        "spec": spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(cidr: &str) -> BlockSpec {
        BlockSpec {
            pool: "p".into(),
            network: "default".into(),
            cidr: cidr.into(),
            node: "n1".into(),
            state: BlockState::Granted,
            reason: GRANTED.into(),
        }
    }

    #[test]
    fn a_block_is_named_by_its_cidr_alone() {
        let v4: Cidr = "198.18.0.16/28".parse().unwrap();
        assert_eq!(block_name(&v4), "v4-198-18-0-16-28");
        let v6: Cidr = "2001:db8:1::10/124".parse().unwrap();
        assert_eq!(block_name(&v6), "v6-2001-db8-1-0-0-0-0-10-124");
        assert!(crate::names::is_dns_subdomain(&block_name(&v6)));
    }

    #[test]
    fn a_block_reads_back_what_was_written_and_refuses_a_name_not_its_cidr() {
        let written = object(&spec("198.18.0.16/28"), "v4-198-18-0-16-28", "");
        assert_eq!(written["metadata"]["labels"][NODE_LABEL], "n1");
        assert!(written["metadata"].get("resourceVersion").is_none());
        let mut read = written.clone();
        read["metadata"]["resourceVersion"] = json!("7");
        let block = Block::parse(read.clone());
        assert_eq!(block.resource_version, "7");
        let (cidr, back) = block.spec.unwrap();
        assert_eq!(cidr.to_string(), "198.18.0.16/28");
        assert_eq!(back, spec("198.18.0.16/28"));
        // Another block's name, a bad state, no spec: unreadable.
        read["metadata"]["name"] = json!("v4-198-18-0-32-28");
        assert_eq!(Block::parse(read.clone()).spec, None);
        read["metadata"]["name"] = json!("v4-198-18-0-16-28");
        read["spec"]["state"] = json!("Stolen");
        assert_eq!(Block::parse(read.clone()).spec, None);
        assert_eq!(Block::parse(json!({"metadata": {"name": "x"}})).spec, None);
        // A node name that is no label value goes without the label.
        let mut long = spec("198.18.0.16/28");
        long.node = "n".repeat(64);
        let written = object(&long, "v4-198-18-0-16-28", "3");
        assert!(written["metadata"]["labels"].get(NODE_LABEL).is_none());
        assert_eq!(written["metadata"]["resourceVersion"], "3");
    }
}
