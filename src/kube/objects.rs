//! Kubernetes objects as serde types — the NodeNetworkConfig
//! (`networking.gke.io/v1`) and the coordination Lease: the fields Metis
//! reads and writes, shared by the daemon and the controller.
//! Every type keeps the fields it does not name (`rest`), so an object or
//! entry written back (a PodCIDR echoed into `releasableCIDRs`) is exactly
//! what was read. Reading is lenient where the cloud owns the data: each
//! list entry is read on its own ([`entries`]), and one malformed entry is
//! skipped, not the object.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The API group and version of the NodeNetworkConfig.
pub const NNC_API_VERSION: &str = "networking.gke.io/v1";
/// Its kind.
pub const NNC_KIND: &str = "NodeNetworkConfig";

/// Reads a field as `T`, or `T`'s default when it does not read: a
/// malformed field of an object the cloud owns costs that field alone.
pub fn lenient_field<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: DeserializeOwned + Default,
{
    Ok(lenient(&Value::deserialize(deserializer)?))
}

/// Reads a condition: missing or `null` is none; anything else that is
/// not a condition is an empty (malformed) one.
fn lenient_condition<'de, D>(deserializer: D) -> Result<Option<Condition>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    Ok(match Value::deserialize(deserializer)? {
        Value::Null => None,
        value => Some(lenient(&value)),
    })
}

/// The `metadata` fields Metis reads and writes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "String::is_empty"
    )]
    pub name: String,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "String::is_empty"
    )]
    pub namespace: String,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "String::is_empty"
    )]
    pub uid: String,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "String::is_empty"
    )]
    pub resource_version: String,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "is_zero"
    )]
    pub generation: i64,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "Map::is_empty"
    )]
    pub annotations: Map<String, Value>,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "Map::is_empty"
    )]
    pub labels: Map<String, Value>,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "String::is_empty"
    )]
    pub creation_timestamp: String,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub owner_references: Vec<OwnerReference>,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub finalizers: Vec<String>,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

fn is_zero(value: &i64) -> bool {
    *value == 0
}

/// A `metadata.ownerReferences` entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwnerReference {
    pub api_version: String,
    pub kind: String,
    pub name: String,
    pub uid: String,
    #[serde(default)]
    pub controller: bool,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A `spec.allocations` entry: the pods a network needs addresses for.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Allocation {
    /// Empty or missing: the default network.
    #[serde(default)]
    pub network: String,
    #[serde(default)]
    pub pods: i64,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A condition (of a PodCIDR entry, or of the object's status).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A PodCIDR object (`status.podCIDRs`, `spec.releasableCIDRs`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PodCidrEntry {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
    /// `Reusable`, `NonReusable` or missing.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Missing or `null`: none; not a condition: an empty one.
    #[serde(
        default,
        deserialize_with = "lenient_condition",
        skip_serializing_if = "Option::is_none"
    )]
    pub condition: Option<Condition>,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

impl PodCidrEntry {
    /// Its `cidr` field, as written.
    pub fn cidr(&self) -> Option<&str> {
        self.cidr.as_deref()
    }
}

/// The entries of a list that read as `T`, at most `cap` of them (one
/// malformed entry is skipped); whether the list held more than `cap`.
pub fn entries<T: DeserializeOwned>(list: &Value, cap: usize) -> (Vec<T>, bool) {
    let all = list.as_array().map_or(&[][..], Vec::as_slice);
    let mut read: Vec<T> = all
        .iter()
        .take(cap)
        .filter_map(|entry| T::deserialize(entry).ok())
        .collect();
    // Kept for the object's life (the controller holds thousands): not
    // the four slots a collect starts with for a list of one.
    read.shrink_to_fit();
    (read, all.len() > cap)
}

/// A list read entry by entry ([`entries`]): at most `CAP` entries that
/// read as `T`, and whether the list held more. Not a list: empty.
#[derive(Debug, Clone, PartialEq)]
pub struct Capped<T, const CAP: usize> {
    pub items: Vec<T>,
    pub truncated: bool,
}

impl<T, const CAP: usize> Default for Capped<T, CAP> {
    fn default() -> Self {
        Capped {
            items: Vec::new(),
            truncated: false,
        }
    }
}

impl<'de, T: DeserializeOwned, const CAP: usize> Deserialize<'de> for Capped<T, CAP> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let (items, truncated) = entries(&Value::deserialize(deserializer)?, CAP);
        Ok(Capped { items, truncated })
    }
}

/// A LIST answer: its items, and its metadata (the version to watch from).
#[derive(Debug, Default, Deserialize)]
pub struct ObjectList {
    #[serde(default, deserialize_with = "lenient_field")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub items: Vec<Value>,
}

impl ObjectList {
    /// `list` read, taken (its items are moved, not copied); a list of
    /// the wrong shape is empty.
    pub fn read(list: Value) -> ObjectList {
        serde_json::from_value(list).unwrap_or_default()
    }
}

/// A `Status` object (an API error, an `ERROR` watch event).
#[derive(Debug, Default, Deserialize)]
pub struct ApiStatus {
    #[serde(default, deserialize_with = "lenient_field")]
    pub code: u64,
}

/// An object's metadata, the rest of it left unread.
#[derive(Debug, Default, Deserialize)]
pub struct Metadata {
    #[serde(default, deserialize_with = "lenient_field")]
    pub metadata: ObjectMeta,
}

/// `value` read as `T`, or `T`'s default when it does not read (the cloud
/// owns the object: a malformed part is not fatal).
pub fn lenient<T: DeserializeOwned + Default>(value: &Value) -> T {
    T::deserialize(value).unwrap_or_default()
}

/// A `coordination.k8s.io/v1` Lease, read and written back whole.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    #[serde(default, deserialize_with = "lenient_field")]
    pub metadata: ObjectMeta,
    #[serde(default, deserialize_with = "lenient_field")]
    pub spec: LeaseSpec,
    /// `apiVersion`, `kind` and whatever else the object holds.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A Lease's `spec`; a malformed field reads as missing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseSpec {
    /// Empty or missing: the Lease is free.
    #[serde(default, deserialize_with = "lenient_field")]
    pub holder_identity: String,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "Option::is_none"
    )]
    pub lease_duration_seconds: Option<u64>,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "Option::is_none"
    )]
    pub acquire_time: Option<String>,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "Option::is_none"
    )]
    pub renew_time: Option<String>,
    #[serde(
        default,
        deserialize_with = "lenient_field",
        skip_serializing_if = "Option::is_none"
    )]
    pub lease_transitions: Option<i64>,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A body as JSON. The types written have string keys only, so this
/// cannot fail; `null` would be refused by the API server if it did.
pub fn to_json(body: &impl Serialize) -> Value {
    serde_json::to_value(body).unwrap_or(Value::Null)
}

/// The body of a NodeNetworkConfig's creation.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NewNnc {
    pub api_version: &'static str,
    pub kind: &'static str,
    pub metadata: ObjectMeta,
    /// Empty: the monitor's first pass writes the request.
    pub spec: Map<String, Value>,
}

/// The JSON merge patch of one monitor pass: the whole request, the whole
/// release list and the serving annotation, guarded by the version they
/// were computed from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SpecPatch {
    pub metadata: PatchMeta,
    pub spec: PatchSpec,
}

/// The metadata a spec patch writes.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PatchMeta {
    pub resource_version: String,
    /// An annotation set to `None` is removed (a merge patch's `null`).
    pub annotations: std::collections::BTreeMap<&'static str, Option<String>>,
}

/// The spec a patch writes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PatchSpec {
    pub allocations: Vec<Allocation>,
    #[serde(rename = "releasableCIDRs")]
    pub releasable_cidrs: Vec<PodCidrEntry>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unknown_fields_survive_a_round_trip() {
        let entry = json!({"id": "a", "network": "default", "cidr": "198.18.0.0/28",
            "type": "Reusable", "zone": "z1",
            "condition": {"type": "Ready", "status": "True", "lastTransitionTime": "t"}});
        let read: PodCidrEntry = lenient(&entry);
        assert_eq!(read.cidr.as_deref(), Some("198.18.0.0/28"));
        assert_eq!(
            read.condition.as_ref().unwrap().kind.as_deref(),
            Some("Ready")
        );
        assert_eq!(serde_json::to_value(&read).unwrap(), entry);
        let meta = json!({"name": "n", "uid": "u", "resourceVersion": "7", "labels": {"a": "b"}});
        let read: ObjectMeta = lenient(&meta);
        assert_eq!(
            (read.name.as_str(), read.resource_version.as_str()),
            ("n", "7")
        );
        assert_eq!(serde_json::to_value(&read).unwrap(), meta);
    }

    #[test]
    fn a_malformed_entry_is_skipped_not_the_list() {
        let list = json!([{"cidr": "198.18.0.0/28"}, {"cidr": 5}, "text", {"pods": 3}]);
        let (read, truncated): (Vec<PodCidrEntry>, bool) = entries(&list, 10);
        assert_eq!(read.len(), 2, "{read:?}");
        assert_eq!(read[1].cidr, None, "no cidr: the reader skips it");
        assert!(!truncated);
        let (capped, truncated): (Vec<PodCidrEntry>, bool) = entries(&list, 1);
        assert_eq!((capped.len(), truncated), (1, true));
        let (none, truncated): (Vec<Allocation>, bool) = entries(&json!(null), 10);
        assert!(none.is_empty() && !truncated);
        // A malformed field costs that field alone.
        let meta: ObjectMeta = lenient(&json!({"name": "n", "uid": 7, "ownerReferences": "x"}));
        assert_eq!((meta.name.as_str(), meta.uid.as_str()), ("n", ""));
        assert!(meta.owner_references.is_empty());
        let odd: PodCidrEntry = lenient(&json!({"cidr": "198.18.0.0/28", "condition": "Ready"}));
        assert_eq!(odd.condition, Some(Condition::default()));
        let none: PodCidrEntry = lenient(&json!({"cidr": "198.18.0.0/28", "condition": null}));
        assert_eq!(none.condition, None);
    }

    #[test]
    fn a_lease_keeps_unknown_fields_through_a_read_modify_write() {
        let read = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "l", "resourceVersion": "4", "labels": {"a": "b"}},
            "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15,
                     "preferredHolder": "b", "strategy": "OldestEmulationVersion"}});
        let mut lease: Lease = lenient(&read);
        assert_eq!(lease.spec.lease_duration_seconds, Some(15));
        lease.spec.holder_identity = String::new();
        let mut expected = read.clone();
        expected["spec"]["holderIdentity"] = json!("");
        assert_eq!(serde_json::to_value(&lease).unwrap(), expected);
        // A malformed field reads as missing, the rest of the Lease stands.
        let odd: Lease = lenient(&json!({"spec": {"holderIdentity": 7, "leaseTransitions": 2}}));
        assert_eq!(
            (
                odd.spec.holder_identity.as_str(),
                odd.spec.lease_transitions
            ),
            ("", Some(2))
        );
        let none: Lease = lenient(&json!({"spec": "x", "metadata": 3}));
        assert_eq!(none, Lease::default());
    }

    #[test]
    fn a_capped_list_skips_what_does_not_read_and_says_it_was_cut() {
        let read: Capped<String, 2> = lenient(&json!(["a", 7, "b"]));
        assert_eq!((read.items, read.truncated), (vec!["a".to_string()], true));
        let none: Capped<String, 2> = lenient(&json!({"a": 1}));
        assert_eq!(none, Capped::default());
        let meta: Metadata = lenient(&json!({"metadata": {"resourceVersion": "3"}, "spec": 1}));
        assert_eq!(meta.metadata.resource_version, "3");
        let list = ObjectList::read(json!({"metadata": {"resourceVersion": "9"},
                                           "items": [{"a": 1}, "b"]}));
        assert_eq!(
            (list.metadata.resource_version.as_str(), list.items.len()),
            ("9", 2)
        );
        let odd = ObjectList::read(json!({"metadata": 5, "items": []}));
        assert_eq!(odd.metadata, ObjectMeta::default());
        assert!(ObjectList::read(json!({"items": "x"})).items.is_empty());
        let status: ApiStatus = lenient(&json!({"kind": "Status", "code": 410}));
        assert_eq!(status.code, 410);
        assert_eq!(lenient::<ApiStatus>(&json!({"code": "gone"})).code, 0);
    }

    #[test]
    fn a_spec_patch_writes_exactly_its_fields() {
        let patch = SpecPatch {
            metadata: PatchMeta {
                resource_version: "9".into(),
                annotations: [("metis.x-k8s.io/serving", None)].into_iter().collect(),
            },
            spec: PatchSpec {
                allocations: vec![Allocation {
                    network: "default".into(),
                    pods: 4,
                    rest: Map::new(),
                }],
                releasable_cidrs: Vec::new(),
            },
        };
        assert_eq!(
            serde_json::to_value(&patch).unwrap(),
            json!({"metadata": {"resourceVersion": "9",
                                "annotations": {"metis.x-k8s.io/serving": null}},
                   "spec": {"allocations": [{"network": "default", "pods": 4}],
                            "releasableCIDRs": []}})
        );
    }
}
