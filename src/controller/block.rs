//! The `MetisBlock` resource (`metis.x-k8s.io/v1alpha1`, cluster scoped):
//! one object per granted, cooling or retired block, named by its CIDR
//! alone, so that the API server's name uniqueness is the fence — a claim
//! is a POST, and the loser of two claims gets 409 AlreadyExists. Its
//! `spec.node` is the Node's name: blocks follow the machine, not its
//! NodeNetworkConfig object. No ownerReferences: the garbage collector
//! never deletes a block with its Node or NodeNetworkConfig. Each object
//! carries the [`PROTECTION`] finalizer, so a DELETE by anyone only marks
//! it: the controller lets it go once its block is free.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::short_text::ShortText;
use crate::cidr::Cidr;
use crate::kube::objects::{ObjectMeta, lenient, lenient_field, to_json};

pub const BLOCK_PATH: &str = "/apis/metis.x-k8s.io/v1alpha1/metisblocks";
pub const POOL_LABEL: &str = "metis.x-k8s.io/pool";
pub const NODE_LABEL: &str = "metis.x-k8s.io/node";
/// The finalizer that keeps a block's object, the fence, while its block is
/// held or cooling, whoever deletes it (as `kubernetes.io/pvc-protection`).
pub const PROTECTION: &str = "metis.x-k8s.io/block-protection";

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
    pub pool: ShortText,
    pub network: ShortText,
    pub cidr: ShortText,
    pub node: ShortText,
    pub state: BlockState,
    #[serde(default)]
    pub reason: ShortText,
}

/// A `MetisBlock` object as read and written: the spec is kept as read
/// until [`Block::parse`] judges it, so that a malformed one costs that
/// block alone.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MetisBlock {
    #[serde(default, deserialize_with = "lenient_field")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Value,
    /// `apiVersion`, `kind` and whatever else the object holds.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A block as read from the API server (its name is the key it is kept
/// under).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub resource_version: ShortText,
    /// `None` when unreadable: a spec missing or malformed, or a CIDR
    /// whose name is not this object's (nobody but this controller writes
    /// blocks; such an object is reported, never trusted).
    pub spec: Option<(Cidr, BlockSpec)>,
    /// Whether the object carries [`PROTECTION`].
    pub protected: bool,
    /// The versions of this object this process saw before this copy,
    /// hashed, oldest first ([`Block::succeeds`]): a list that brings one
    /// back is the cluster's state going back (an etcd restore).
    pub past: Box<[u64]>,
    /// The object is older than this copy (a list brought it back): the
    /// next pass writes this copy back over it.
    pub behind: bool,
}

/// Versions of a block object remembered as seen before its copy: a
/// block's object changes a few times in its life.
const PAST_VERSIONS: usize = 8;

/// A version's hash: versions are only compared for equality.
fn version_hash(version: &str) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(version, &mut hasher);
    std::hash::Hasher::finish(&hasher)
}

impl Block {
    /// The object's name, and the block it is.
    pub fn parse(object: Value) -> (String, Block) {
        let object: MetisBlock = lenient(&object);
        let ObjectMeta {
            name,
            resource_version,
            finalizers,
            ..
        } = object.metadata;
        let spec = BlockSpec::deserialize(&object.spec).ok().and_then(|spec| {
            let cidr: Cidr = spec.cidr.parse().ok()?;
            (block_name(&cidr) == name && resource_version.len() < 64).then_some((cidr, spec))
        });
        let block = Block {
            resource_version: resource_version.into(),
            spec,
            protected: finalizers.iter().any(|f| f == PROTECTION),
            past: Box::default(),
            behind: false,
        };
        (name, block)
    }

    /// This copy follows `older`, the copy held before: it remembers the
    /// versions seen so far.
    pub fn succeeds(&mut self, older: &Block) {
        self.past = match older.resource_version == self.resource_version {
            true => older.past.clone(),
            false => older.versions_seen(),
        };
    }

    /// The versions of this object seen so far, this copy's last (none
    /// for a copy kept without one), hashed.
    pub fn versions_seen(&self) -> Box<[u64]> {
        let mut seen = self.past.to_vec();
        if !self.resource_version.is_empty() {
            if seen.len() == PAST_VERSIONS {
                seen.remove(0);
            }
            seen.push(version_hash(&self.resource_version));
        }
        seen.into_boxed_slice()
    }

    /// Whether `version` is one this process saw before this copy's.
    pub fn saw_before(&self, version: &str) -> bool {
        *version != *self.resource_version && self.past.contains(&version_hash(version))
    }
}

/// Whether a write's answer is an object the API server let go: marked
/// for deletion and no finalizer left.
pub fn is_gone(answer: &Value) -> bool {
    let meta = &answer["metadata"];
    meta["deletionTimestamp"].is_string() && meta["finalizers"].as_array().is_none_or(Vec::is_empty)
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

/// The whole object to POST (`resource_version` empty) or PUT, protected
/// or (to let it go) not. A name that is no label value (a node name may
/// be 253 characters) goes without that label: the spec is what the
/// controller reads.
pub fn object(spec: &BlockSpec, name: &str, resource_version: &str, protected: bool) -> Value {
    let mut labels = Map::new();
    for (key, value) in [(POOL_LABEL, &*spec.pool), (NODE_LABEL, &*spec.node)] {
        if is_label_value(value) {
            labels.insert(key.into(), Value::from(value));
        }
    }
    let mut rest = Map::new();
    rest.insert("apiVersion".into(), Value::from("metis.x-k8s.io/v1alpha1"));
    rest.insert("kind".into(), Value::from("MetisBlock"));
    to_json(&MetisBlock {
        metadata: ObjectMeta {
            name: name.into(),
            resource_version: resource_version.into(),
            labels,
            finalizers: protected
                .then(|| PROTECTION.to_string())
                .into_iter()
                .collect(),
            ..ObjectMeta::default()
        },
        spec: to_json(spec),
        rest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        let written = object(&spec("198.18.0.16/28"), "v4-198-18-0-16-28", "", true);
        assert_eq!(written["metadata"]["labels"][NODE_LABEL], "n1");
        assert!(written["metadata"].get("resourceVersion").is_none());
        let mut read = written.clone();
        read["metadata"]["resourceVersion"] = json!("7");
        let (name, block) = Block::parse(read.clone());
        assert_eq!(name, "v4-198-18-0-16-28");
        assert_eq!(block.resource_version, "7");
        let (cidr, back) = block.spec.unwrap();
        assert_eq!(cidr.to_string(), "198.18.0.16/28");
        assert_eq!(back, spec("198.18.0.16/28"));
        // Another block's name, a bad state, no spec: unreadable.
        read["metadata"]["name"] = json!("v4-198-18-0-32-28");
        assert_eq!(Block::parse(read.clone()).1.spec, None);
        read["metadata"]["name"] = json!("v4-198-18-0-16-28");
        read["spec"]["state"] = json!("Stolen");
        assert_eq!(Block::parse(read.clone()).1.spec, None);
        assert_eq!(
            Block::parse(json!({"metadata": {"name": "x"}})).1.spec,
            None
        );
        // A field of the wrong type, or no object at all: unreadable, no panic.
        read["spec"]["state"] = json!("Granted");
        read["spec"]["node"] = json!(7);
        assert_eq!(Block::parse(read.clone()).1.spec, None);
        read["metadata"]["name"] = json!(["v4-198-18-0-16-28"]);
        assert_eq!(Block::parse(read.clone()).0, "");
        // Its name is the key it is kept under, not a field: a block's box
        // is 200 bytes (232 with the name and a `Vec` of past versions).
        assert_eq!(std::mem::size_of::<Block>(), 200);
        assert_eq!(Block::parse(json!("text")).1.spec, None);
        // A node name that is no label value goes without the label.
        let mut long = spec("198.18.0.16/28");
        long.node = "n".repeat(64).into();
        let written = object(&long, "v4-198-18-0-16-28", "3", true);
        assert!(written["metadata"]["labels"].get(NODE_LABEL).is_none());
        assert_eq!(written["metadata"]["resourceVersion"], "3");
    }

    #[test]
    fn a_block_is_written_protected_and_goes_with_its_last_finalizer() {
        let mut read = object(&spec("198.18.0.16/28"), "v4-198-18-0-16-28", "7", true);
        assert_eq!(read["metadata"]["finalizers"], json!([PROTECTION]));
        assert!(Block::parse(read.clone()).1.protected);
        read["metadata"]["deletionTimestamp"] = json!("2026-12-05T23:00:00Z");
        assert!(!is_gone(&read), "its finalizer still holds it");
        let mut let_go = object(&spec("198.18.0.16/28"), "v4-198-18-0-16-28", "8", false);
        assert!(let_go["metadata"].get("finalizers").is_none());
        assert!(!Block::parse(let_go.clone()).1.protected);
        assert!(!is_gone(&let_go), "not marked for deletion: it stays");
        let_go["metadata"]["deletionTimestamp"] = json!("2026-12-05T23:00:00Z");
        assert!(is_gone(&let_go));
        // Someone else's finalizer still holds it.
        let_go["metadata"]["finalizers"] = json!(["x"]);
        assert!(!is_gone(&let_go));
    }

    #[test]
    fn a_block_object_keeps_unknown_fields_through_a_read_modify_write() {
        let read = json!({"apiVersion": "metis.x-k8s.io/v1alpha1", "kind": "MetisBlock",
            "metadata": {"name": "v4-198-18-0-16-28", "resourceVersion": "7",
                         "labels": {"team": "a"}, "finalizers": ["x"]},
            "spec": {"pool": "p", "network": "default", "cidr": "198.18.0.16/28",
                     "node": "n1", "state": "Granted", "reason": "Granted", "zone": "z"},
            "status": {"note": "kept"}});
        let mut object: MetisBlock = lenient(&read);
        object.spec["node"] = json!("n2");
        let mut expected = read.clone();
        expected["spec"]["node"] = json!("n2");
        assert_eq!(serde_json::to_value(&object).unwrap(), expected);
    }
}
