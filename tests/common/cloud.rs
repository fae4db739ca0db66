//! One node's cluster on the loopback API server (`kube_api.rs`): its Node
//! (`cluster::NODE`), the NodeNetworkConfig its daemon creates, and a fake
//! cloud controller, a reactor on the daemon's writes, that appends Ready
//! /28 pod CIDRs (198.19.N.M/28) while `spec.allocations[].pods` exceeds
//! what the status's blocks hold (the node's own ranges are not counted, as
//! the contract says) and drops `releasableCIDRs` from the status. Every
//! request is logged; the rest (faults, lagging watches, opaque versions,
//! TLS) is `kube_api`'s, through `Deref`.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use super::cluster::NODE;
use super::kube_api::{Backup, Key, KubeApi, NNCS, NODES, State};
use super::tls::TlsServer;

/// The node's API server and its cloud controller.
pub struct Cloud {
    api: KubeApi,
    controller: Arc<Controller>,
}

/// What the fake cloud controller does and has done.
struct Controller {
    on: AtomicBool,
    /// Pod CIDRs handed out so far.
    handed_out: AtomicU32,
    /// The `type` of the pod CIDRs it publishes.
    block_type: Mutex<&'static str>,
}

impl Deref for Cloud {
    type Target = KubeApi;

    fn deref(&self) -> &KubeApi {
        &self.api
    }
}

impl DerefMut for Cloud {
    fn deref_mut(&mut self) -> &mut KubeApi {
        &mut self.api
    }
}

pub fn nnc_key() -> Key {
    Key::cluster(NNCS, NODE)
}

pub fn node_key() -> Key {
    Key::cluster(NODES, NODE)
}

impl Cloud {
    /// A server that knows the Node (with `pod_cidrs`), its controller on.
    pub fn start(pod_cidrs: &[&str]) -> Cloud {
        Cloud::with(KubeApi::start(), pod_cidrs)
    }

    /// Like [`Cloud::start`], speaking HTTPS through `tls`; the
    /// kubeconfigs it writes trust the CA bundle in `ca_file`.
    pub fn start_tls(pod_cidrs: &[&str], tls: Arc<TlsServer>, ca_file: &std::path::Path) -> Cloud {
        Cloud::with(KubeApi::start_tls(tls, ca_file), pod_cidrs)
    }

    fn with(api: KubeApi, pod_cidrs: &[&str]) -> Cloud {
        let controller = Arc::new(Controller {
            on: AtomicBool::new(true),
            handed_out: AtomicU32::new(0),
            block_type: Mutex::new("Reusable"),
        });
        let acting = Arc::clone(&controller);
        api.with_state(|state| {
            state.logging = true;
            state
                .reactors
                .push(Box::new(move |state, key| acting.reconcile(state, key)));
        });
        let cloud = Cloud { api, controller };
        cloud.create_node(pod_cidrs);
        cloud
    }

    /// Whether the cloud controller grants and takes releases.
    pub fn set_controller(&self, on: bool) {
        self.controller.on.store(on, Ordering::SeqCst);
    }

    /// Pod CIDRs the cloud controller handed out so far.
    pub fn handed_out(&self) -> u32 {
        self.controller.handed_out.load(Ordering::SeqCst)
    }

    /// The `type` of the pod CIDRs the controller publishes from now on.
    pub fn set_block_type(&self, block_type: &'static str) {
        *lock(&self.controller.block_type) = block_type;
    }

    /// Replaces `status.podCIDRs` (as a cloud controller would).
    pub fn set_status(&self, pod_cidrs: Value) {
        self.with_state(|state| {
            state.edit(&nnc_key(), |nnc| nnc["status"]["podCIDRs"] = pod_cidrs);
        });
    }

    /// Delivers an old version of the object to open watches again, as a
    /// late event would arrive (the stream position advances, the object's
    /// `resourceVersion` stays old).
    pub fn deliver_late(&self, object: Value) {
        self.with_state(|state| state.inject_event(nnc_key(), "MODIFIED", object));
    }

    /// Deletes the NodeNetworkConfig (someone else did).
    pub fn delete_nnc(&self) {
        self.with_state(|state| {
            let _ = state.delete(&nnc_key(), &Value::Null);
        });
    }

    /// Someone deletes the NodeNetworkConfig and creates it again at once
    /// (a new uid, an empty spec, the same owner), then its status is
    /// written, as the API server takes it: through the subresource.
    pub fn recreate_nnc(&self, status: Value) {
        self.with_state(|state| {
            let Some(old) = state.get(&nnc_key()).cloned() else {
                return;
            };
            let _ = state.delete(&nnc_key(), &Value::Null);
            let metadata = &old["metadata"];
            let fresh = json!({
                "metadata": {"name": metadata["name"], "ownerReferences": metadata["ownerReferences"]},
                "spec": {},
            });
            state.create(NNCS, "", &fresh).unwrap();
            state.edit(&nnc_key(), |nnc| nnc["status"]["podCIDRs"] = status);
        });
    }

    /// Deletes the Node, and the NodeNetworkConfig it owns with it (the
    /// garbage collector); `recreate_node` brings one back.
    pub fn delete_node(&self) {
        self.with_state(|state| {
            let _ = state.delete(&node_key(), &Value::Null);
        });
    }

    /// Creates the Node again (a new uid) with `pod_cidrs`.
    pub fn recreate_node(&self, pod_cidrs: &[&str]) {
        self.create_node(pod_cidrs);
    }

    fn create_node(&self, pod_cidrs: &[&str]) {
        let node = json!({"metadata": {"name": NODE}, "spec": {"podCIDRs": pod_cidrs}});
        self.with_state(|state| state.create(NODES, "", &node).unwrap());
    }

    /// An object of another node appears in open watches of this node's
    /// NodeNetworkConfig (and, with `in_lists`, in every list): a proxy
    /// that ignores the field selector.
    pub fn inject_foreign(&self, mut object: Value, in_lists: bool) {
        self.with_state(|state| {
            object["metadata"]["resourceVersion"] = json!(state.rv(state.version + 1));
            if in_lists {
                state.list_extras.push((NNCS, object.clone()));
            }
            state.inject_event(nnc_key(), "MODIFIED", object);
        });
    }

    /// A write to an object the node does not watch (etcd's revisions are
    /// global), then a compaction: the node's version is now too old, so
    /// its next watch is answered 410 Gone and it relists.
    pub fn compact(&self) {
        self.with_state(|state| {
            state.version += 1;
            state.compact();
        });
    }

    /// etcd restored from `backup`.
    pub fn restore(&self, backup: Backup) {
        self.with_state(|state| state.restore(backup));
    }
}

impl Controller {
    /// Grows the status to the requested pods with /28 blocks and drops
    /// released blocks from it, after a client write of the object.
    fn reconcile(&self, state: &mut State, key: &Key) {
        if *key != nnc_key() || !self.on.load(Ordering::SeqCst) {
            return;
        }
        let Some(nnc) = state.get(key) else { return };
        let releasable = cidrs(&nnc["spec"]["releasableCIDRs"]);
        let mut status: Vec<Value> = nnc["status"]["podCIDRs"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let before = status.len();
        status.retain(|c| !releasable.iter().any(|r| c["cidr"] == r.as_str()));
        let mut changed = status.len() != before;
        let pods = state.pods("default").unwrap_or(0);
        let mut capacity = 16 * i64::try_from(status.len()).unwrap();
        let block_type = *lock(&self.block_type);
        while pods > capacity {
            let block = self.handed_out.fetch_add(1, Ordering::SeqCst);
            status.push(json!({
                "id": format!("pod-cidr-{block}"),
                "network": "default",
                "cidr": format!("198.19.{}.{}/28", block / 16, (block % 16) * 16),
                "type": block_type,
                "condition": {"type": "Ready", "status": "True", "reason": "PodCIDRReady"},
            }));
            capacity += 16;
            changed = true;
        }
        if changed {
            state.edit(key, |nnc| nnc["status"]["podCIDRs"] = Value::Array(status));
        }
    }
}

/// The controller's settings, also after a test's assertion failed while
/// it held them (the unwinding must not abort).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The `cidr`s of a list of entries.
fn cidrs(entries: &Value) -> Vec<String> {
    (entries.as_array().into_iter().flatten())
        .filter_map(|c| c["cidr"].as_str().map(str::to_string))
        .collect()
}

/// What the node's tests read on the server's state.
pub trait NodeView {
    /// The node's NodeNetworkConfig.
    fn nnc(&self) -> Option<&Value>;
    /// The Node.
    fn node(&self) -> Option<&Value>;
    /// The NodeNetworkConfig's `spec.allocations[network].pods`.
    fn pods(&self, network: &str) -> Option<i64>;
    /// CIDRs in `status.podCIDRs`.
    fn status_cidrs(&self) -> Vec<String>;
    /// CIDRs in `spec.releasableCIDRs`.
    fn releasable_cidrs(&self) -> Vec<String>;
    /// The NodeNetworkConfig's `metis.x-k8s.io/serving` annotation.
    fn serving(&self) -> Option<String>;
    /// Logged requests of `method` on paths ending in `suffix`.
    fn requests(&self, method: &str, suffix: &str) -> usize;
    /// The `metadata.resourceVersion` precondition of every logged PATCH.
    fn patch_bases(&self) -> Vec<String>;
}

impl NodeView for State {
    fn nnc(&self) -> Option<&Value> {
        self.get(&nnc_key())
    }

    fn node(&self) -> Option<&Value> {
        self.get(&node_key())
    }

    fn pods(&self, network: &str) -> Option<i64> {
        self.nnc()?["spec"]["allocations"]
            .as_array()?
            .iter()
            .find(|a| a["network"] == network)
            .and_then(|a| a["pods"].as_i64())
    }

    fn status_cidrs(&self) -> Vec<String> {
        self.nnc()
            .map(|nnc| cidrs(&nnc["status"]["podCIDRs"]))
            .unwrap_or_default()
    }

    fn releasable_cidrs(&self) -> Vec<String> {
        self.nnc()
            .map(|nnc| cidrs(&nnc["spec"]["releasableCIDRs"]))
            .unwrap_or_default()
    }

    fn serving(&self) -> Option<String> {
        self.nnc()?["metadata"]["annotations"]["metis.x-k8s.io/serving"]
            .as_str()
            .map(str::to_string)
    }

    fn requests(&self, method: &str, suffix: &str) -> usize {
        (self.log.iter())
            .filter(|r| r.method == method && r.path.ends_with(suffix))
            .count()
    }

    fn patch_bases(&self) -> Vec<String> {
        (self.log.iter())
            .filter(|r| r.method == "PATCH")
            .map(|r| {
                let patch: Value = serde_json::from_slice(&r.body).unwrap_or_default();
                let base = patch["metadata"]["resourceVersion"].as_str();
                base.unwrap_or_default().to_string()
            })
            .collect()
    }
}
