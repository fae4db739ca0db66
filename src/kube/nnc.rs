//! The NodeNetworkConfig custom resource (`networking.gke.io/v1`, cluster
//! scoped, named after the node) and the Node object, as Metis reads and
//! writes them. Only the fields Metis uses are interpreted; PodCIDR objects
//! are kept whole so the ones given back in `releasableCIDRs` are exactly
//! what the status published.

use serde_json::{Value, json};

use super::client::{ApiClient, KubeError};
use crate::defaults::DEFAULT_NETWORK;

const NNC_PATH: &str = "/apis/networking.gke.io/v1/nodenetworkconfigs";
const NODE_PATH: &str = "/api/v1/nodes";

/// Entries read from each list of the object (`spec.allocations`,
/// `spec.releasableCIDRs`, `status.podCIDRs`); the rest is ignored and
/// reported. A node holds at most a few hundred pods, so a status with
/// more than this many blocks is broken, not big.
pub const MAX_ENTRIES: usize = 256;

/// Which object a watch follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Nnc,
    Node,
}

impl Kind {
    fn collection(self) -> &'static str {
        match self {
            Kind::Nnc => NNC_PATH,
            Kind::Node => NODE_PATH,
        }
    }

    /// The object's own path.
    pub fn item_path(self, name: &str) -> String {
        format!("{}/{name}", self.collection())
    }

    /// A list of just this node's object.
    pub fn list_path(self, name: &str) -> String {
        format!("{}?fieldSelector=metadata.name%3D{name}", self.collection())
    }

    /// A watch of just this node's object from `resource_version`, ended
    /// by the server after `seconds`.
    pub fn watch_path(self, name: &str, resource_version: &str, seconds: u64) -> String {
        format!(
            "{}?fieldSelector=metadata.name%3D{name}&watch=true&allowWatchBookmarks=true&timeoutSeconds={seconds}&resourceVersion={resource_version}",
            self.collection()
        )
    }
}

/// A `status.podCIDRs` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusCidr {
    pub network: String,
    pub cidr: String,
    /// Ready unless a condition says otherwise (no condition = ready, as upstream).
    pub ready: bool,
    /// The whole object, echoed into `releasableCIDRs`.
    pub raw: PodCidr,
}

/// A PodCIDR object as the status published it, kept whole so the one
/// given back in `releasableCIDRs` is exactly that object.
#[derive(Debug, Clone, PartialEq)]
pub struct PodCidr(Value);

impl PodCidr {
    /// Its `cidr` field, as written.
    pub fn cidr(&self) -> Option<&str> {
        self.0["cidr"].as_str()
    }
}

/// What Metis needs of a NodeNetworkConfig.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Nnc {
    pub resource_version: String,
    /// `spec.allocations`: (network, pods).
    pub allocations: Vec<(String, i64)>,
    /// `spec.releasableCIDRs`, whole objects.
    pub releasable: Vec<PodCidr>,
    pub pod_cidrs: Vec<StatusCidr>,
    /// A list held more than [`MAX_ENTRIES`]; only the first were read.
    pub truncated: bool,
}

impl Nnc {
    /// Parses the resource; malformed parts are skipped rather than fatal,
    /// since the cloud controller owns the status.
    pub fn parse(value: &Value) -> Nnc {
        let network_of = |entry: &Value| {
            entry["network"]
                .as_str()
                .filter(|n| !n.is_empty())
                .unwrap_or(DEFAULT_NETWORK)
                .to_string()
        };
        let allocations = list(&value["spec"]["allocations"])
            .map(|entry| (network_of(entry), entry["pods"].as_i64().unwrap_or(0)))
            .collect();
        let releasable = list(&value["spec"]["releasableCIDRs"])
            .cloned()
            .map(PodCidr)
            .collect();
        let pod_cidrs = list(&value["status"]["podCIDRs"])
            .filter_map(|entry| {
                let cidr = entry["cidr"].as_str()?.to_string();
                let condition = &entry["condition"];
                let ready = condition.is_null() || condition["status"].as_str() == Some("True");
                Some(StatusCidr {
                    network: network_of(entry),
                    cidr,
                    ready,
                    raw: PodCidr(entry.clone()),
                })
            })
            .collect();
        let truncated = [
            &value["spec"]["allocations"],
            &value["spec"]["releasableCIDRs"],
            &value["status"]["podCIDRs"],
        ]
        .iter()
        .any(|l| l.as_array().is_some_and(|a| a.len() > MAX_ENTRIES));
        Nnc {
            resource_version: resource_version(value),
            allocations,
            releasable,
            pod_cidrs,
            truncated,
        }
    }

    /// The requested pod count of a network (0 if it has no entry).
    pub fn pods(&self, network: &str) -> Option<i64> {
        self.allocations
            .iter()
            .find(|(n, _)| n == network)
            .map(|(_, pods)| *pods)
    }
}

/// `spec.podCIDRs` of a Node object.
pub fn node_pod_cidrs(node: &Value) -> Vec<String> {
    list(&node["spec"]["podCIDRs"])
        .filter_map(|cidr| cidr.as_str().map(str::to_string))
        .chain(node["spec"]["podCIDR"].as_str().map(str::to_string))
        .fold(Vec::new(), |mut all, cidr| {
            if !all.contains(&cidr) {
                all.push(cidr);
            }
            all
        })
}

pub fn resource_version(value: &Value) -> String {
    value["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Whether `candidate` is a later version of the object than `current`.
/// Resource versions are etcd revisions (integers that only grow, across a
/// delete and re-create too); a version that is not one cannot be ordered
/// and counts as newer only if it differs.
pub fn is_newer(candidate: &str, current: &str) -> bool {
    match (candidate.parse::<u64>(), current.parse::<u64>()) {
        (Ok(candidate), Ok(current)) => candidate > current,
        _ => candidate != current,
    }
}

fn list(value: &Value) -> impl Iterator<Item = &Value> {
    value.as_array().into_iter().flatten().take(MAX_ENTRIES)
}

/// Makes sure this node's NodeNetworkConfig exists, created with the Node
/// as its controlling owner (so it goes away with the node).
pub fn ensure(client: &ApiClient, node: &str) -> Result<(), KubeError> {
    match client.get(&Kind::Nnc.item_path(node)) {
        Ok(_) => return Ok(()),
        Err(err) if err.is_status(404) => {}
        Err(err) => return Err(err),
    }
    let node_object = client.get(&Kind::Node.item_path(node))?;
    let uid = node_object["metadata"]["uid"].as_str().unwrap_or_default();
    let body = json!({
        "apiVersion": "networking.gke.io/v1",
        "kind": "NodeNetworkConfig",
        "metadata": {
            "name": node,
            "ownerReferences": [{
                "apiVersion": "v1",
                "kind": "Node",
                "name": node,
                "uid": uid,
                "controller": true,
            }],
        },
        "spec": {},
    });
    match client.post(NNC_PATH, &body) {
        Ok(_) => Ok(()),
        // Created concurrently (another daemon instance, a restart race).
        Err(err) if err.is_status(409) => Ok(()),
        Err(err) => Err(err),
    }
}

/// The change of one monitor pass: the whole allocation list and
/// releasable list, guarded by the resource version they were computed from.
#[derive(Debug, Clone, PartialEq)]
pub struct NncPatch {
    pub resource_version: String,
    /// `spec.allocations`: (network, pods).
    pub allocations: Vec<(String, i64)>,
    /// `spec.releasableCIDRs`.
    pub releasable: Vec<PodCidr>,
}

impl NncPatch {
    /// The JSON merge patch sent to the API server.
    pub fn to_json(&self) -> Value {
        let allocations: Vec<Value> = self
            .allocations
            .iter()
            .map(|(network, pods)| json!({"network": network, "pods": pods}))
            .collect();
        let releasable: Vec<&Value> = self.releasable.iter().map(|cidr| &cidr.0).collect();
        json!({
            "metadata": {"resourceVersion": self.resource_version},
            "spec": {"allocations": allocations, "releasableCIDRs": releasable},
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_node_network_config() {
        let value = json!({
            "metadata": {"name": "node-a", "resourceVersion": "42"},
            "spec": {
                "allocations": [{"network": "default", "pods": 32}, {"pods": 5}],
                "releasableCIDRs": [{"id": "r1", "network": "default", "cidr": "198.18.1.0/28"}]
            },
            "status": {"podCIDRs": [
                {"id": "a", "network": "default", "cidr": "198.18.0.0/28"},
                {"id": "b", "network": "default", "cidr": "198.18.0.16/28",
                 "condition": {"type": "Ready", "status": "False", "reason": "PodCIDRNotRoutable"}},
                {"id": "c", "cidr": "198.18.0.32/28", "condition": {"type": "Ready", "status": "True"}},
                {"id": "broken"}
            ]}
        });
        let nnc = Nnc::parse(&value);
        assert_eq!(nnc.resource_version, "42");
        assert_eq!(
            nnc.allocations,
            vec![("default".into(), 32), ("default".into(), 5)]
        );
        assert_eq!(nnc.pods("default"), Some(32));
        assert_eq!(nnc.pods("other"), None);
        assert_eq!(nnc.releasable.len(), 1);
        let ready: Vec<(&str, bool)> = nnc
            .pod_cidrs
            .iter()
            .map(|c| (c.cidr.as_str(), c.ready))
            .collect();
        assert_eq!(
            ready,
            vec![
                ("198.18.0.0/28", true),
                ("198.18.0.16/28", false),
                ("198.18.0.32/28", true)
            ]
        );
        assert_eq!(nnc.pod_cidrs[2].network, "default");
        assert_eq!(Nnc::parse(&json!(null)), Nnc::default());
    }

    #[test]
    fn lists_are_capped() {
        let entries: Vec<Value> = (0..MAX_ENTRIES + 5)
            .map(|i| json!({"cidr": format!("198.18.{}.{}/32", i / 256, i % 256)}))
            .collect();
        let nnc = Nnc::parse(&json!({"status": {"podCIDRs": entries}}));
        assert_eq!(nnc.pod_cidrs.len(), MAX_ENTRIES);
        assert!(nnc.truncated);
        assert!(!Nnc::parse(&json!({"status": {"podCIDRs": []}})).truncated);
    }

    #[test]
    fn node_pod_cidrs_merge_both_fields() {
        let node = json!({"spec": {"podCIDR": "198.18.0.0/24", "podCIDRs": ["198.18.0.0/24", "2001:db8::/64"]}});
        assert_eq!(
            node_pod_cidrs(&node),
            vec!["198.18.0.0/24", "2001:db8::/64"]
        );
        assert!(node_pod_cidrs(&json!({})).is_empty());
    }

    #[test]
    fn paths_select_only_this_node() {
        assert_eq!(
            Kind::Nnc.watch_path("n1", "7", 420),
            "/apis/networking.gke.io/v1/nodenetworkconfigs?fieldSelector=metadata.name%3Dn1&watch=true&allowWatchBookmarks=true&timeoutSeconds=420&resourceVersion=7"
        );
        assert_eq!(Kind::Node.item_path("n1"), "/api/v1/nodes/n1");
    }

    #[test]
    fn versions_are_ordered_as_numbers() {
        assert!(is_newer("10", "9"));
        assert!(!is_newer("9", "10"), "a late event is stale");
        assert!(!is_newer("10", "10"), "the same version is not news");
        assert!(is_newer("1", ""), "anything beats no version");
        assert!(is_newer("abc", "9") && !is_newer("abc", "abc"));
    }

    #[test]
    fn patch_carries_resource_version() {
        let patch = NncPatch {
            resource_version: "9".into(),
            allocations: vec![("default".into(), 74)],
            releasable: vec![PodCidr(json!({"id": "x"}))],
        };
        assert_eq!(
            patch.to_json(),
            json!({"metadata": {"resourceVersion": "9"},
                   "spec": {"allocations": [{"network": "default", "pods": 74}],
                            "releasableCIDRs": [{"id": "x"}]}})
        );
    }
}
