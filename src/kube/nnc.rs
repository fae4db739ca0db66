//! The NodeNetworkConfig custom resource (`networking.gke.io/v1`, cluster
//! scoped, named after the node) and the Node object, as Metis reads and
//! writes them. Only the fields Metis uses are interpreted; PodCIDR objects
//! are kept whole so the ones given back in `releasableCIDRs` are exactly
//! what the status published.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::client::{ApiClient, KubeError};
use super::objects::{
    Allocation, Capped, Condition, Metadata, NNC_API_VERSION, NNC_KIND, NewNnc, ObjectMeta,
    OwnerReference, PatchMeta, PatchSpec, PodCidrEntry, SpecPatch, lenient, lenient_field, to_json,
};
use crate::defaults::DEFAULT_NETWORK;

const NNC_PATH: &str = "/apis/networking.gke.io/v1/nodenetworkconfigs";
const NODE_PATH: &str = "/api/v1/nodes";

/// Entries read from each list of the object (`spec.allocations`,
/// `spec.releasableCIDRs`, `status.podCIDRs`); the rest is ignored and
/// reported. A node holds at most a few hundred pods, so a status with
/// more than this many blocks is broken, not big.
pub const MAX_ENTRIES: usize = 256;

/// The annotation in which the node lists the blocks it got from the
/// cluster that it has not released and still serves or drains
/// (comma-separated canonical CIDRs, sorted): a controller that lost them
/// (a re-created object) learns they are in use.
pub const SERVING_ANNOTATION: &str = "metis.x-k8s.io/serving";

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

    /// The kind's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Nnc => "NodeNetworkConfig",
            Kind::Node => "Node",
        }
    }

    /// What a DELETED event of this node's object means.
    pub fn deleted_message(self) -> &'static str {
        match self {
            // ensure() creates it again at the next list.
            Kind::Nnc => {
                "this node's NodeNetworkConfig was deleted: it grants nothing now; listing (and creating it) again"
            }
            Kind::Node => {
                "this node's Node object was deleted: its podCIDRs are granted no more; listing again"
            }
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

/// Who an object is: its name and namespace (empty for the cluster-scoped
/// Node and NodeNetworkConfig), its `uid` (a new one means the object was
/// deleted and created again) and its opaque `resourceVersion`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Meta {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub resource_version: String,
}

impl Meta {
    pub fn parse(object: &Value) -> Meta {
        let Metadata { metadata: meta } = lenient(object);
        Meta {
            name: meta.name,
            namespace: meta.namespace,
            uid: meta.uid,
            resource_version: meta.resource_version,
        }
    }

    /// Whether this is the object of node `node`: named after it, and not
    /// namespaced (both kinds Metis reads are cluster-scoped).
    pub fn is_of_node(&self, node: &str) -> bool {
        self.name == node && self.namespace.is_empty()
    }
}

/// A `status.podCIDRs` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusCidr {
    pub network: String,
    pub cidr: String,
    /// Its condition is of type `Ready` with status `True`: the only state
    /// in which a block is allocated from.
    pub ready: bool,
    /// `type` is not `NonReusable`: once released, the block may come back
    /// to this node (see `adaptive::grants`).
    pub reusable: bool,
    /// The condition in words (`Ready=False (Updating)`, `none`), for logs.
    pub condition: String,
    /// The whole object, echoed into `releasableCIDRs`.
    pub raw: PodCidr,
}

impl StatusCidr {
    fn parse(entry: &PodCidrEntry) -> Option<StatusCidr> {
        let cidr = entry.cidr.clone()?;
        let condition = entry.condition.as_ref();
        let (kind, status) = (
            condition.and_then(|c| c.kind.as_deref()),
            condition.and_then(|c| c.status.as_deref()),
        );
        let condition_text = match (kind, status) {
            (Some(kind), Some(status)) => match condition.and_then(|c| c.reason.as_deref()) {
                Some(reason) if !reason.is_empty() => format!("{kind}={status} ({reason})"),
                _ => format!("{kind}={status}"),
            },
            _ if condition.is_none() => "none".to_string(),
            _ => "malformed".to_string(),
        };
        Some(StatusCidr {
            network: network_or_default(entry.network.as_deref()),
            cidr,
            ready: kind == Some("Ready") && status == Some("True"),
            reusable: entry.kind.as_deref() != Some("NonReusable"),
            condition: condition_text,
            raw: entry.clone(),
        })
    }
}

/// A PodCIDR object as the status published it, kept whole (unknown
/// fields included) so the one given back in `releasableCIDRs` is exactly
/// that object.
pub type PodCidr = PodCidrEntry;

/// What Metis needs of a NodeNetworkConfig.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Nnc {
    pub meta: Meta,
    /// `spec.allocations`: (network, pods).
    pub allocations: Vec<(String, i64)>,
    /// `spec.releasableCIDRs`, whole objects.
    pub releasable: Vec<PodCidr>,
    pub pod_cidrs: Vec<StatusCidr>,
    /// A list held more than [`MAX_ENTRIES`]; only the first were read.
    pub truncated: bool,
    /// `metadata.generation`: counts changes of the spec.
    pub generation: i64,
    /// The message of a `Ready=False` condition with reason
    /// [`QUOTA_EXCEEDED`] that answers this very spec (its
    /// `observedGeneration` is the object's generation): the cluster has no
    /// block for this node's demand, and waiting for one is pointless.
    pub quota_exceeded: Option<String>,
    /// Until when that refusal stands, as its message says.
    pub quota_until: QuotaEnd,
    /// The reason of the `Ready` condition in `status.conditions`, of
    /// whatever generation.
    pub ready_reason: Option<String>,
    /// The [`SERVING_ANNOTATION`]'s text ("" without one).
    pub serving: String,
}

/// The reason of the NodeNetworkConfig's Ready condition when no block can
/// be granted (upstream's spelling).
pub const QUOTA_EXCEEDED: &str = "QuotaExceededToUpdateNetworkInterfacePodCIDRs";
/// Ends a QuotaExceeded message of `metis controller` when released blocks
/// are cooling, followed by the RFC 3339 time the first comes free: the
/// refusal stands until then.
pub const QUOTA_UNTIL: &str = "the first released block comes free at ";

/// When a QuotaExceeded refusal ends, read from the end of its message
/// (the CRD has no field for it: the message is the contract,
/// docs/controller.md, "Conditions").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuotaEnd {
    /// No time given: the refusal stands until the next answer.
    #[default]
    Unsaid,
    /// Unix ms; a time already past means the refusal has ended.
    At(i64),
    /// A time that cannot be read (not RFC 3339 UTC, or outside years
    /// 0000–9999): the refusal is not trusted to stand, ADDs wait for a
    /// grant as without one.
    Unreadable,
}

impl QuotaEnd {
    /// Reads the end from a QuotaExceeded `message`: the text after the
    /// last [`QUOTA_UNTIL`], trimmed.
    pub fn of(message: &str) -> QuotaEnd {
        match message.rsplit_once(QUOTA_UNTIL) {
            None => QuotaEnd::Unsaid,
            Some((_, at)) => {
                crate::log::parse_rfc3339_ms(at.trim()).map_or(QuotaEnd::Unreadable, QuotaEnd::At)
            }
        }
    }

    /// Whether the refusal still stands at `now_ms`.
    pub fn stands_at(self, now_ms: i64) -> bool {
        match self {
            QuotaEnd::Unsaid => true,
            QuotaEnd::At(until) => now_ms < until,
            QuotaEnd::Unreadable => false,
        }
    }
}

/// A NodeNetworkConfig as read; each list read entry by entry.
#[derive(Debug, Default, Deserialize)]
struct NncObject {
    #[serde(default, deserialize_with = "lenient_field")]
    metadata: ObjectMeta,
    #[serde(default, deserialize_with = "lenient_field")]
    spec: NncSpec,
    #[serde(default, deserialize_with = "lenient_field")]
    status: NncStatus,
}

#[derive(Debug, Default, Deserialize)]
struct NncSpec {
    #[serde(default)]
    allocations: Capped<Allocation, MAX_ENTRIES>,
    #[serde(rename = "releasableCIDRs", default)]
    releasable_cidrs: Capped<PodCidrEntry, MAX_ENTRIES>,
}

#[derive(Debug, Default, Deserialize)]
struct NncStatus {
    #[serde(rename = "podCIDRs", default)]
    pod_cidrs: Capped<PodCidrEntry, MAX_ENTRIES>,
    #[serde(default)]
    conditions: Capped<Condition, MAX_ENTRIES>,
}

/// A Node as read: the fields Metis uses.
#[derive(Debug, Default, Deserialize)]
struct NodeObject {
    #[serde(default, deserialize_with = "lenient_field")]
    spec: NodeSpec,
}

#[derive(Debug, Default, Deserialize)]
struct NodeSpec {
    #[serde(rename = "podCIDRs", default)]
    pod_cidrs: Capped<String, MAX_ENTRIES>,
    #[serde(rename = "podCIDR", default, deserialize_with = "lenient_field")]
    pod_cidr: Option<String>,
}

impl Nnc {
    /// Parses the resource; malformed parts are skipped rather than fatal,
    /// since the cloud controller owns the status.
    pub fn parse(value: &Value) -> Nnc {
        let NncObject {
            metadata: meta,
            spec,
            status,
        } = lenient(value);
        let conditions = status.conditions.items;
        let generation = meta.generation;
        let ready = conditions
            .iter()
            .find(|c| c.kind.as_deref() == Some("Ready"));
        let quota_exceeded = ready
            .filter(|c| {
                c.status.as_deref() == Some("False")
                    && c.reason.as_deref() == Some(QUOTA_EXCEEDED)
                    && c.observed_generation.unwrap_or(0) == generation
            })
            .map(|c| c.message.clone().unwrap_or_default());
        let quota_until = quota_exceeded
            .as_deref()
            .map_or(QuotaEnd::Unsaid, QuotaEnd::of);
        Nnc {
            meta: Meta::parse(value),
            truncated: spec.allocations.truncated
                || spec.releasable_cidrs.truncated
                || status.pod_cidrs.truncated,
            serving: meta
                .annotations
                .get(SERVING_ANNOTATION)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            allocations: spec
                .allocations
                .items
                .into_iter()
                .map(|a| (network_or_default(Some(&a.network)), a.pods))
                .collect(),
            releasable: spec.releasable_cidrs.items,
            pod_cidrs: status
                .pod_cidrs
                .items
                .iter()
                .filter_map(StatusCidr::parse)
                .collect(),
            generation,
            quota_exceeded,
            quota_until,
            ready_reason: ready.and_then(|c| c.reason.clone()),
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

/// What Metis needs of a Node: who it is and its `spec.podCIDRs`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Node {
    pub meta: Meta,
    pub pod_cidrs: Vec<String>,
}

impl Node {
    pub fn parse(node: &Value) -> Node {
        let NodeObject { spec } = lenient(node);
        let pod_cidrs = spec.pod_cidrs.items.into_iter().chain(spec.pod_cidr).fold(
            Vec::new(),
            |mut all, cidr| {
                if !all.contains(&cidr) {
                    all.push(cidr);
                }
                all
            },
        );
        Node {
            meta: Meta::parse(node),
            pod_cidrs,
        }
    }
}

/// A list's or an object's `metadata.resourceVersion`. Opaque: compared
/// for equality only, never ordered (see docs/design.md, "Following the
/// control plane").
pub fn resource_version(value: &Value) -> String {
    let Metadata { metadata } = lenient(value);
    metadata.resource_version
}

/// A network's name as an entry gives it: empty or missing is the
/// default network.
fn network_or_default(network: Option<&str>) -> String {
    network
        .filter(|n| !n.is_empty())
        .unwrap_or(DEFAULT_NETWORK)
        .to_string()
}

/// Makes sure this node's NodeNetworkConfig exists, created with the Node
/// as its controlling owner (so it goes away with the node) and with
/// `serving` (the [`SERVING_ANNOTATION`]'s text) so that the controller
/// learns at once which blocks this node still serves.
pub fn ensure(client: &ApiClient, node: &str, serving: &str) -> Result<(), KubeError> {
    match client.get(&Kind::Nnc.item_path(node)) {
        Ok(_) => return Ok(()),
        Err(err) if err.is_status(404) => {}
        Err(err) => return Err(err),
    }
    let node_object = client.get(&Kind::Node.item_path(node))?;
    let mut metadata = ObjectMeta {
        name: node.to_string(),
        owner_references: vec![OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: node.to_string(),
            uid: Meta::parse(&node_object).uid,
            controller: true,
            rest: Map::new(),
        }],
        ..ObjectMeta::default()
    };
    if !serving.is_empty() {
        metadata
            .annotations
            .insert(SERVING_ANNOTATION.into(), serving.into());
    }
    let body = to_json(&NewNnc {
        api_version: NNC_API_VERSION,
        kind: NNC_KIND,
        metadata,
        spec: Map::new(),
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
    /// The [`SERVING_ANNOTATION`]'s text; "" removes the annotation.
    pub serving: String,
}

impl NncPatch {
    /// The JSON merge patch sent to the API server.
    pub fn to_json(&self) -> Value {
        let allocations = self
            .allocations
            .iter()
            .map(|(network, pods)| Allocation {
                network: network.clone(),
                pods: *pods,
                rest: Map::new(),
            })
            .collect();
        let serving = (!self.serving.is_empty()).then(|| self.serving.clone());
        to_json(&SpecPatch {
            metadata: PatchMeta {
                resource_version: self.resource_version.clone(),
                annotations: [(SERVING_ANNOTATION, serving)].into_iter().collect(),
            },
            spec: PatchSpec {
                allocations,
                releasable_cidrs: self.releasable.clone(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
                {"id": "d", "cidr": "198.18.0.48/28", "type": "NonReusable",
                 "condition": {"type": "Deleting", "status": "True"}},
                {"id": "e", "cidr": "198.18.0.64/28", "condition": {"type": "Ready", "status": "Unknown"}},
                {"id": "broken"}
            ]}
        });
        let nnc = Nnc::parse(&value);
        assert_eq!(nnc.meta.resource_version, "42");
        assert_eq!(nnc.meta.name, "node-a");
        assert!(nnc.meta.is_of_node("node-a") && !nnc.meta.is_of_node("node-b"));
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
        // Only a condition of type Ready with status True is ready: no
        // condition, another type or another status is not.
        assert_eq!(
            ready,
            vec![
                ("198.18.0.0/28", false),
                ("198.18.0.16/28", false),
                ("198.18.0.32/28", true),
                ("198.18.0.48/28", false),
                ("198.18.0.64/28", false)
            ]
        );
        assert_eq!(nnc.pod_cidrs[2].network, "default");
        assert_eq!(
            nnc.pod_cidrs[1].condition,
            "Ready=False (PodCIDRNotRoutable)"
        );
        assert_eq!(nnc.pod_cidrs[0].condition, "none");
        let reusable: Vec<bool> = nnc.pod_cidrs.iter().map(|c| c.reusable).collect();
        assert_eq!(reusable, [true, true, true, false, true]);
        assert_eq!(Nnc::parse(&json!(null)), Nnc::default());
    }

    #[test]
    fn quota_exceeded_counts_only_when_it_answers_this_spec() {
        let nnc = |observed: i64| {
            json!({"metadata": {"generation": 4}, "status": {"conditions": [{
                "type": "Ready", "status": "False", "reason": QUOTA_EXCEEDED,
                "message": "pool p has no free block", "observedGeneration": observed}]}})
        };
        assert_eq!(
            Nnc::parse(&nnc(4)).quota_exceeded.as_deref(),
            Some("pool p has no free block")
        );
        assert_eq!(
            Nnc::parse(&nnc(3)).quota_exceeded,
            None,
            "an older demand's answer"
        );
        let ready = json!({"metadata": {"generation": 1}, "status": {"conditions": [{
            "type": "Ready", "status": "True", "reason": "NodeNetworkConfigReady", "observedGeneration": 1}]}});
        assert_eq!(Nnc::parse(&ready).quota_exceeded, None);
    }

    #[test]
    fn a_refusal_ends_when_its_message_says_and_only_if_readable() {
        let refusal = |message: &str| {
            Nnc::parse(
                &json!({"metadata": {"generation": 2}, "status": {"conditions": [{
                "type": "Ready", "status": "False", "reason": QUOTA_EXCEEDED,
                "message": message, "observedGeneration": 2}]}}),
            )
            .quota_until
        };
        let base = "network \"default\" ipv4: pool p has no free block; 16 addresses for 20 pods";
        assert_eq!(refusal(base), QuotaEnd::Unsaid);
        assert_eq!(
            refusal(&format!("{base}; {QUOTA_UNTIL}2026-12-01T12:00:00.250Z")),
            QuotaEnd::At(1_796_126_400_250)
        );
        // Trailing blanks are forgiven; anything else unreadable is not
        // trusted: the refusal ends (ADDs wait for a grant).
        assert_eq!(
            refusal(&format!("{base}; {QUOTA_UNTIL}2026-12-01T12:00:00Z \n")),
            QuotaEnd::At(1_796_126_400_000)
        );
        for bad in [
            "soon",
            "",
            "2026-12-01",
            "99999-01-01T00:00:00Z",
            "2026-12-01T12:00:00Z; more",
        ] {
            assert_eq!(
                refusal(&format!("{base}; {QUOTA_UNTIL}{bad}")),
                QuotaEnd::Unreadable,
                "{bad:?}"
            );
        }
        // The last occurrence counts (a pool name cannot smuggle a time in).
        assert_eq!(
            refusal(&format!(
                "pool {QUOTA_UNTIL}2999-01-01T00:00:00Z; {QUOTA_UNTIL}2026-12-01T12:00:00Z"
            )),
            QuotaEnd::At(1_796_126_400_000)
        );
        let now = 1_796_126_400_000;
        assert!(QuotaEnd::Unsaid.stands_at(now));
        assert!(QuotaEnd::At(now + 1).stands_at(now));
        assert!(
            !QuotaEnd::At(now).stands_at(now),
            "a time reached has passed"
        );
        assert!(!QuotaEnd::At(0).stands_at(now), "the past");
        assert!(
            QuotaEnd::At(253_402_300_799_000).stands_at(now),
            "year 9999"
        );
        assert!(!QuotaEnd::Unreadable.stands_at(now));
    }

    #[test]
    fn the_serving_annotation_is_read_when_it_is_text() {
        let with = |annotations: Value| {
            Nnc::parse(&json!({"metadata": {"name": "n", "annotations": annotations}})).serving
        };
        assert_eq!(
            with(json!({SERVING_ANNOTATION: "198.19.0.0/28"})),
            "198.19.0.0/28"
        );
        assert_eq!(with(json!({SERVING_ANNOTATION: 5})), "");
        assert_eq!(with(json!({"other": "x"})), "");
        assert_eq!(with(json!("not a map")), "");
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
        // Parts of the wrong shape read as empty; the rest stands.
        let odd = Nnc::parse(&json!({"metadata": {"name": "n", "generation": "1"},
            "spec": {"allocations": {"pods": 3}, "releasableCIDRs": [{"cidr": "198.18.0.0/28"}]},
            "status": "text"}));
        assert_eq!((odd.meta.name.as_str(), odd.generation), ("n", 0));
        assert!(odd.allocations.is_empty() && odd.pod_cidrs.is_empty());
        assert_eq!(odd.releasable.len(), 1);
    }

    #[test]
    fn node_pod_cidrs_merge_both_fields() {
        let node = json!({"metadata": {"name": "n1", "uid": "u1"},
            "spec": {"podCIDR": "198.18.0.0/24", "podCIDRs": ["198.18.0.0/24", "2001:db8::/64"]}});
        let parsed = Node::parse(&node);
        assert_eq!(parsed.pod_cidrs, vec!["198.18.0.0/24", "2001:db8::/64"]);
        assert_eq!(parsed.meta.uid, "u1");
        assert!(Node::parse(&json!({})).pod_cidrs.is_empty());
        // A field of the wrong type costs that field alone.
        let odd = json!({"metadata": {"name": "n1", "uid": 3},
            "spec": {"podCIDR": 7, "podCIDRs": ["198.18.0.0/24", 5]}});
        let parsed = Node::parse(&odd);
        assert_eq!(parsed.pod_cidrs, vec!["198.18.0.0/24"]);
        assert_eq!(
            (parsed.meta.name.as_str(), parsed.meta.uid.as_str()),
            ("n1", "")
        );
        assert!(Node::parse(&json!({"spec": "x"})).pod_cidrs.is_empty());
        let namespaced = json!({"metadata": {"name": "n1", "namespace": "kube-system"}});
        assert!(!Meta::parse(&namespaced).is_of_node("n1"));
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
    fn patch_carries_resource_version() {
        let patch = NncPatch {
            resource_version: "9".into(),
            allocations: vec![("default".into(), 74)],
            releasable: vec![lenient(&json!({"id": "x"}))],
            serving: "198.19.0.0/28,198.19.0.16/28".into(),
        };
        assert_eq!(
            patch.to_json(),
            json!({"metadata": {"resourceVersion": "9",
                                "annotations": {SERVING_ANNOTATION: "198.19.0.0/28,198.19.0.16/28"}},
                   "spec": {"allocations": [{"network": "default", "pods": 74}],
                            "releasableCIDRs": [{"id": "x"}]}})
        );
        // Nothing served: the annotation is removed (a merge patch's null).
        let empty = NncPatch {
            serving: String::new(),
            ..patch
        };
        assert_eq!(
            empty.to_json()["metadata"]["annotations"],
            json!({SERVING_ANNOTATION: null})
        );
    }
}
