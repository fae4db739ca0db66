//! A loopback Kubernetes API server holding many objects of several kinds,
//! for the simulated cluster (tests/cluster.rs) and the controller bench:
//! real HTTP/1.1 on 127.0.0.1 (persistent connections, chunked watches)
//! with the semantics the node daemon and `metis controller` depend on.
//!
//! - Objects are keyed by resource, namespace and name; one global
//!   `resourceVersion` counter orders every write (etcd's revision).
//! - GET, LIST (with the list's `resourceVersion`, `fieldSelector`
//!   `metadata.name=` and equality `labelSelector`s), WATCH (chunked JSON
//!   lines from a version: ADDED/MODIFIED/DELETED, BOOKMARK when asked
//!   for, an `ERROR` 410 `Expired` for a compacted version; no version or
//!   `0` starts with the current objects as ADDED).
//! - POST (409 `AlreadyExists`, `generateName`), PUT with the
//!   `metadata.resourceVersion` precondition (409 `Conflict`; custom
//!   resources refuse a PUT without one, 422, as the API server does),
//!   JSON merge PATCH (the same precondition when the patch carries one),
//!   DELETE (with `preconditions`), and the owner-reference garbage
//!   collector: deleting an object deletes its dependents.
//! - The status subresource: `PUT`/`PATCH …/status` changes only `status`;
//!   writes to the main resource keep it; `metadata.generation` counts spec
//!   changes. A write that changes nothing is not a new version (no event).
//! - Per-(verb, resource) request counters and fault hooks: stop and start
//!   listening, fail the next N writes with a status, compact history,
//!   expire a list's continue token between its pages (after changing
//!   objects in between).
//!
//! The older `apiserver.rs` is a one-node server that plays the cloud
//! controller itself; this one plays no controller.

use std::collections::BTreeMap;
use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::http::{self, Request, merge_patch, read_request};

/// One resource the server serves.
#[derive(Debug)]
pub struct Resource {
    pub plural: &'static str,
    /// `/api/v1` or `/apis/GROUP/VERSION`.
    pub prefix: &'static str,
    pub api_version: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Has a status subresource.
    pub status: bool,
    /// A custom resource: PUT needs `metadata.resourceVersion`.
    pub custom: bool,
}

pub const NNCS: &str = "nodenetworkconfigs";
pub const NODES: &str = "nodes";
pub const LEASES: &str = "leases";
pub const EVENTS: &str = "events";
pub const POOLS: &str = "metispools";
pub const BLOCKS: &str = "metisblocks";

pub const RESOURCES: [Resource; 6] = [
    Resource {
        plural: NNCS,
        prefix: "/apis/networking.gke.io/v1",
        api_version: "networking.gke.io/v1",
        kind: "NodeNetworkConfig",
        namespaced: false,
        status: true,
        custom: true,
    },
    Resource {
        plural: NODES,
        prefix: "/api/v1",
        api_version: "v1",
        kind: "Node",
        namespaced: false,
        status: true,
        custom: false,
    },
    Resource {
        plural: LEASES,
        prefix: "/apis/coordination.k8s.io/v1",
        api_version: "coordination.k8s.io/v1",
        kind: "Lease",
        namespaced: true,
        status: false,
        custom: false,
    },
    Resource {
        plural: EVENTS,
        prefix: "/api/v1",
        api_version: "v1",
        kind: "Event",
        namespaced: true,
        status: false,
        custom: false,
    },
    Resource {
        plural: POOLS,
        prefix: "/apis/metis.x-k8s.io/v1alpha1",
        api_version: "metis.x-k8s.io/v1alpha1",
        kind: "MetisPool",
        namespaced: false,
        status: true,
        custom: true,
    },
    Resource {
        plural: BLOCKS,
        prefix: "/apis/metis.x-k8s.io/v1alpha1",
        api_version: "metis.x-k8s.io/v1alpha1",
        kind: "MetisBlock",
        namespaced: false,
        status: false,
        custom: true,
    },
];

/// The resource named `plural`.
pub fn resource(plural: &str) -> &'static Resource {
    RESOURCES
        .iter()
        .find(|r| r.plural == plural)
        .unwrap_or_else(|| panic!("no resource {plural}"))
}

/// Where an object lives.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub resource: &'static str,
    /// Empty for cluster-scoped objects.
    pub namespace: String,
    pub name: String,
}

impl Key {
    pub fn new(resource: &'static str, namespace: &str, name: &str) -> Key {
        Key {
            resource,
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }

    /// A cluster-scoped object.
    pub fn cluster(resource: &'static str, name: &str) -> Key {
        Key::new(resource, "", name)
    }
}

/// One change, as watches deliver it.
#[derive(Debug, Clone)]
pub struct Change {
    pub version: u64,
    pub key: Key,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub kind: &'static str,
    pub object: Value,
    pub at: Instant,
}

/// A refused request: its status and the `Status` object answered.
pub type Refusal = (u16, Value);

/// Everything the server knows; tests read and change it under the lock.
#[derive(Default)]
pub struct State {
    /// The last resource version handed out.
    pub version: u64,
    pub objects: BTreeMap<Key, Value>,
    /// Every change in order; watches read from here.
    pub changes: Vec<Change>,
    /// A watch or list from a version below this is answered 410.
    pub compacted_below: u64,
    /// Requests answered, by (verb, resource); a subresource counts as
    /// `RESOURCE/status`. Verbs are the API server's: get, list, watch,
    /// create, update, patch, delete.
    pub counts: BTreeMap<(String, String), u64>,
    /// The same by client (its bearer token; "" without one).
    pub counts_by_client: BTreeMap<(String, String, String), u64>,
    /// 409 answers by client.
    pub conflicts: BTreeMap<String, u64>,
    /// (method, path) of requests that named no resource this server
    /// serves (answered 404), or used a verb it does not serve (405).
    pub unserved: Vec<(String, String)>,
    /// The next writes (create/update/patch/delete) of a resource (any
    /// when `None`) fail: (how many more, HTTP status, resource).
    pub fail_writes: Option<(u32, u16, Option<&'static str>)>,
    /// Every write of one object fails, until cleared: (resource, name,
    /// HTTP status); `fail_object_hits` counts the writes it refused.
    pub fail_object: Option<(&'static str, String, u16)>,
    pub fail_object_hits: u64,
    /// Deleting an object deletes the objects whose ownerReferences name
    /// its uid, as the garbage collector does (on by default).
    pub keep_dependents: bool,
    /// Idle watches that asked for bookmarks get one this often.
    pub bookmark_every: Option<Duration>,
    /// Bumped to end every open watch (a compaction, an API server restart).
    pub watch_epoch: u64,
    /// The next `continue` of a list of this resource finds its token
    /// expired (410 `Expired`, as after a compaction between two pages);
    /// the closure runs first, under the lock: what changed between them.
    pub expire_next_continue: Option<(&'static str, Between)>,
    /// Continue tokens answered 410 by that hook.
    pub continues_expired: u64,
    uids: u64,
    /// Paginated lists still being read, by continue token: the snapshot
    /// the first page was cut from (the API server serves every page at the
    /// first one's resourceVersion). A compaction drops them, so a continue
    /// token older than it is answered 410, as etcd's compaction does.
    snapshots: BTreeMap<u64, Snapshot>,
    snapshot_ids: u64,
}

/// What happens to the objects between two pages of a list.
pub type Between = Box<dyn FnOnce(&mut State) + Send>;

/// The rest of a paginated list.
struct Snapshot {
    version: u64,
    items: Vec<Value>,
}

impl State {
    pub fn get(&self, key: &Key) -> Option<&Value> {
        self.objects.get(key)
    }

    /// The objects of `resource`, in key order.
    pub fn list(&self, resource: &str) -> impl Iterator<Item = (&Key, &Value)> {
        self.objects
            .iter()
            .filter(move |(key, _)| key.resource == resource)
    }

    /// Requests of `verb` on `resource` (`RESOURCE/status` for the
    /// subresource) answered so far.
    pub fn count(&self, verb: &str, resource: &str) -> u64 {
        self.counts
            .get(&(verb.to_string(), resource.to_string()))
            .copied()
            .unwrap_or(0)
    }

    /// The requests of the client with token `client`, by (verb, resource).
    pub fn counts_of(&self, client: &str) -> BTreeMap<(String, String), u64> {
        self.counts_by_client
            .iter()
            .filter(|((who, _, _), _)| who == client)
            .map(|((_, verb, resource), n)| ((verb.clone(), resource.clone()), *n))
            .collect()
    }

    /// How many of `client`'s requests were answered 409.
    pub fn conflicts_of(&self, client: &str) -> u64 {
        self.conflicts.get(client).copied().unwrap_or(0)
    }

    /// Creates `object` (its `metadata.name` or `generateName`) in
    /// `namespace`, as a POST does.
    pub fn create(
        &mut self,
        plural: &str,
        namespace: &str,
        body: &Value,
    ) -> Result<Value, Refusal> {
        let res = resource(plural);
        let mut object = body.clone();
        if !object.is_object() || !object["metadata"].is_object() && !object["metadata"].is_null() {
            return Err(invalid("the body is not an object with metadata"));
        }
        let name = match (
            object["metadata"]["name"].as_str(),
            object["metadata"]["generateName"].as_str(),
        ) {
            (Some(name), _) if !name.is_empty() => name.to_string(),
            (_, Some(prefix)) if !prefix.is_empty() => {
                self.uids += 1;
                format!("{prefix}{:05x}", self.uids)
            }
            _ => return Err(invalid("metadata.name: Required value")),
        };
        let given_namespace = object["metadata"]["namespace"].as_str().unwrap_or("");
        if !res.namespaced && !given_namespace.is_empty()
            || res.namespaced && !given_namespace.is_empty() && given_namespace != namespace
        {
            return Err(refusal(
                400,
                "BadRequest",
                "the namespace does not match the path",
            ));
        }
        let key = Key::new(res.plural, namespace, &name);
        if self.objects.contains_key(&key) {
            return Err(refusal(
                409,
                "AlreadyExists",
                &format!("{} \"{name}\" already exists", res.plural),
            ));
        }
        self.uids += 1;
        let version = self.version + 1;
        object["apiVersion"] = json!(res.api_version);
        object["kind"] = json!(res.kind);
        let meta = &mut object["metadata"];
        meta["name"] = json!(name);
        if res.namespaced {
            meta["namespace"] = json!(namespace);
        }
        meta["uid"] = json!(format!("uid-{:06}", self.uids));
        meta["creationTimestamp"] =
            json!(metis::log::rfc3339_seconds(metis::log::now_ms()).to_string());
        meta["resourceVersion"] = json!(version.to_string());
        if res.status {
            meta["generation"] = json!(1);
        }
        if res.custom
            && let Some(fields) = object.as_object_mut()
        {
            // A custom resource with a status subresource: status is
            // written through the subresource only.
            fields.remove("status");
        }
        self.commit(key, Some(object.clone()), "ADDED");
        Ok(object)
    }

    /// Replaces an object (`status`: only its status), as a PUT does.
    pub fn update(&mut self, key: &Key, body: &Value, status: bool) -> Result<Value, Refusal> {
        let res = resource(key.resource);
        let current = self.current(key)?;
        if body["metadata"]["name"].as_str() != Some(key.name.as_str()) {
            return Err(refusal(
                400,
                "BadRequest",
                "metadata.name does not match the path",
            ));
        }
        match body["metadata"]["resourceVersion"].as_str().unwrap_or("") {
            "" if res.custom => {
                return Err(refusal(
                    422,
                    "Invalid",
                    "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
                ));
            }
            "" => {}
            given => precondition(&current, given, &key.name)?,
        }
        let next = match status {
            true => with_status_of(&current, body),
            false => self.main_write(res, &current, body.clone()),
        };
        Ok(self.write(key, &current, next))
    }

    /// Applies a JSON merge patch (`status`: to the status only); a
    /// `metadata.resourceVersion` in the patch is a precondition.
    pub fn patch(&mut self, key: &Key, patch: &Value, status: bool) -> Result<Value, Refusal> {
        let res = resource(key.resource);
        let current = self.current(key)?;
        if !patch.is_object() {
            return Err(invalid("a merge patch must be an object"));
        }
        if let Some(given) = patch["metadata"]["resourceVersion"].as_str() {
            precondition(&current, given, &key.name)?;
        }
        let mut merged = current.clone();
        merge_patch(&mut merged, patch);
        let next = match status {
            true => with_status_of(&current, &merged),
            false => self.main_write(res, &current, merged),
        };
        Ok(self.write(key, &current, next))
    }

    /// Deletes an object (with `preconditions` from DeleteOptions) and,
    /// unless `keep_dependents`, the objects it owns.
    pub fn delete(&mut self, key: &Key, options: &Value) -> Result<Value, Refusal> {
        let current = self.current(key)?;
        let wanted = &options["preconditions"];
        if let Some(given) = wanted["resourceVersion"].as_str() {
            precondition(&current, given, &key.name)?;
        }
        if let Some(uid) = wanted["uid"].as_str()
            && current["metadata"]["uid"].as_str() != Some(uid)
        {
            return Err(refusal(
                409,
                "Conflict",
                "Precondition failed: UID mismatch",
            ));
        }
        self.commit(key.clone(), None, "DELETED");
        let gone = self
            .changes
            .last()
            .map(|c| c.object.clone())
            .unwrap_or_default();
        let uid = current["metadata"]["uid"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if !self.keep_dependents {
            let dependents: Vec<Key> = self
                .objects
                .iter()
                .filter(|(_, object)| owned_by(object, &uid))
                .map(|(key, _)| key.clone())
                .collect();
            for dependent in dependents {
                let _ = self.delete(&dependent, &Value::Null);
            }
        }
        Ok(gone)
    }

    /// Changes an object in place through `change`, as an admin's PUT of
    /// the object and one of its status would: a spec change of a resource
    /// with the status subresource is a new generation (`change` cannot
    /// set one itself, as no client can), and a new version only if
    /// anything changed.
    pub fn edit(&mut self, key: &Key, change: impl FnOnce(&mut Value)) -> Option<Value> {
        let current = self.objects.get(key)?.clone();
        let mut next = current.clone();
        change(&mut next);
        if resource(key.resource).status {
            count_generation(&current, &mut next);
        }
        Some(self.write(key, &current, next))
    }

    /// History below the current version is gone: watches and lists from
    /// an older version get 410, and every open watch ends.
    pub fn compact(&mut self) {
        // A watch from the current version misses nothing.
        self.compacted_below = self.version;
        self.changes.clear();
        self.snapshots.clear();
        self.watch_epoch += 1;
    }

    fn current(&self, key: &Key) -> Result<Value, Refusal> {
        self.objects.get(key).cloned().ok_or_else(|| {
            refusal(
                404,
                "NotFound",
                &format!("{} \"{}\" not found", key.resource, key.name),
            )
        })
    }

    /// A write of the main resource: identity fields stay, status stays
    /// where there is a status subresource, a spec change is a new
    /// generation.
    fn main_write(&self, res: &Resource, current: &Value, mut next: Value) -> Value {
        for field in [
            "uid",
            "creationTimestamp",
            "name",
            "namespace",
            "generation",
        ] {
            match current["metadata"].get(field) {
                Some(value) => next["metadata"][field] = value.clone(),
                None => {
                    if let Some(meta) = next["metadata"].as_object_mut() {
                        meta.remove(field);
                    }
                }
            }
        }
        next["apiVersion"] = json!(res.api_version);
        next["kind"] = json!(res.kind);
        if res.status {
            next = with_status_of(&next, current);
            count_generation(current, &mut next);
        }
        next
    }

    /// Stores `next` for `key` unless it equals `current` (the API server
    /// writes nothing then); returns the object as stored.
    fn write(&mut self, key: &Key, current: &Value, mut next: Value) -> Value {
        next["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
        if &next == current {
            return next;
        }
        next["metadata"]["resourceVersion"] = json!((self.version + 1).to_string());
        self.commit(key.clone(), Some(next.clone()), "MODIFIED");
        next
    }

    fn commit(&mut self, key: Key, object: Option<Value>, kind: &'static str) {
        self.version += 1;
        let recorded = match object {
            Some(object) => {
                self.objects.insert(key.clone(), object.clone());
                object
            }
            None => {
                let mut gone = self.objects.remove(&key).unwrap_or(Value::Null);
                gone["metadata"]["resourceVersion"] = json!(self.version.to_string());
                gone
            }
        };
        self.changes.push(Change {
            version: self.version,
            key,
            kind,
            object: recorded,
            at: Instant::now(),
        });
    }

    /// A write refused by the fault hook, if one is armed for `plural`.
    fn injected_failure(&mut self, plural: &str) -> Option<u16> {
        let (left, status, only) = self.fail_writes.as_mut()?;
        if only.is_some_and(|only| only != plural) {
            return None;
        }
        let status = *status;
        *left = left.saturating_sub(1);
        if *left == 0 {
            self.fail_writes = None;
        }
        Some(status)
    }
}

/// Sets `next`'s generation to `current`'s, one more when the spec (all
/// but metadata and status) changed, as the API server counts it for a
/// resource with the status subresource.
fn count_generation(current: &Value, next: &mut Value) {
    let generation = current["metadata"]["generation"].as_i64().unwrap_or(0);
    let changed = spec_of(next) != spec_of(current);
    next["metadata"]["generation"] = json!(generation + i64::from(changed));
}

fn spec_of(object: &Value) -> Value {
    let mut spec = object.clone();
    if let Some(fields) = spec.as_object_mut() {
        fields.remove("metadata");
        fields.remove("status");
    }
    spec
}

/// `base` with the status of `source` (none if it has none).
fn with_status_of(base: &Value, source: &Value) -> Value {
    let mut next = base.clone();
    if let Some(fields) = next.as_object_mut() {
        match source.get("status") {
            Some(status) if !status.is_null() => {
                fields.insert("status".into(), status.clone());
            }
            _ => {
                fields.remove("status");
            }
        }
    }
    next
}

fn owned_by(object: &Value, uid: &str) -> bool {
    object["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|owners| owners.iter().any(|o| o["uid"].as_str() == Some(uid)))
}

fn precondition(current: &Value, given: &str, name: &str) -> Result<(), Refusal> {
    match current["metadata"]["resourceVersion"].as_str() == Some(given) {
        true => Ok(()),
        false => Err(refusal(
            409,
            "Conflict",
            &format!(
                "Operation cannot be fulfilled on \"{name}\": the object has been modified; please apply your changes to the latest version and try again"
            ),
        )),
    }
}

/// A `Status` failure object.
pub fn refusal(code: u16, reason: &str, message: &str) -> Refusal {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code}),
    )
}

fn invalid(message: &str) -> Refusal {
    refusal(400, "BadRequest", message)
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

/// The server's state, shared with another thread.
#[derive(Clone)]
pub struct Handle(Arc<Shared>);

impl Handle {
    /// Runs `look` on the state under the lock and wakes open watches.
    pub fn with<T>(&self, look: impl FnOnce(&mut State) -> T) -> T {
        let out = look(&mut self.0.state.lock().unwrap());
        self.0.changed.notify_all();
        out
    }
}

/// The server; stops listening on drop.
pub struct KubeApi {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    running: Option<http::Acceptor>,
}

impl KubeApi {
    /// An empty server listening on a free loopback port.
    pub fn start() -> KubeApi {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut api = KubeApi {
            addr,
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
            running: None,
        };
        api.serve(listener);
        api
    }

    /// Writes a kubeconfig pointing at this server.
    pub fn kubeconfig(&self, path: &std::path::Path) {
        self.kubeconfig_as(path, "sim");
    }

    /// Writes a kubeconfig whose bearer token is `client`: the server
    /// counts that client's requests apart (`State::counts_of`).
    pub fn kubeconfig_as(&self, path: &std::path::Path, client: &str) {
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: sim\nclusters:\n- name: sim\n  cluster:\n    server: http://{}\ncontexts:\n- name: sim\n  context:\n    cluster: sim\n    user: sim\nusers:\n- name: sim\n  user:\n    token: {client}\n",
            self.addr
        );
        std::fs::write(path, text).unwrap();
    }

    /// A handle other threads can read and change the state through.
    pub fn handle(&self) -> Handle {
        Handle(Arc::clone(&self.shared))
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap()
    }

    /// Changes the state under the lock and wakes open watches.
    pub fn with_state<T>(&self, change: impl FnOnce(&mut State) -> T) -> T {
        let out = change(&mut self.state());
        self.shared.changed.notify_all();
        out
    }

    /// Waits until `condition` holds (re-checked on every change); panics
    /// naming `what` after `timeout`.
    pub fn wait_until(&self, what: &str, timeout: Duration, condition: impl Fn(&State) -> bool) {
        http::wait_until(
            &self.shared.state,
            &self.shared.changed,
            what,
            timeout,
            condition,
        );
    }

    /// Stops listening and cuts every open connection (watches included).
    pub fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop(|| self.with_state(|state| state.watch_epoch += 1));
        }
    }

    /// Listens again on the same address.
    pub fn restart(&mut self) {
        let listener = http::rebind(self.addr);
        self.serve(listener);
    }

    fn serve(&mut self, listener: TcpListener) {
        let shared = Arc::clone(&self.shared);
        self.running = Some(http::Acceptor::spawn(listener, move |stream, stop| {
            connection(stream, &shared, stop)
        }));
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What a path names.
struct Route {
    resource: &'static Resource,
    namespace: String,
    name: Option<String>,
    status: bool,
}

fn route(path: &str) -> Option<Route> {
    let (resource_prefix, rest) = RESOURCES
        .iter()
        .filter_map(|r| Some((r.prefix, path.strip_prefix(r.prefix)?.strip_prefix('/')?)))
        .next()?;
    let segments: Vec<&str> = rest.split('/').collect();
    let (namespace, segments) = match segments.as_slice() {
        ["namespaces", namespace, rest @ ..] if !rest.is_empty() => (*namespace, rest),
        all => ("", all),
    };
    let (plural, name, status) = match segments {
        [plural] => (*plural, None, false),
        [plural, name] => (*plural, Some(*name), false),
        [plural, name, "status"] => (*plural, Some(*name), true),
        _ => return None,
    };
    let resource = RESOURCES
        .iter()
        .find(|r| r.prefix == resource_prefix && r.plural == plural)?;
    // A namespaced object needs its namespace (a cluster-wide list does
    // not); a cluster-scoped one has none.
    let scoped = match resource.namespaced {
        true => !namespace.is_empty() || name.is_none(),
        false => namespace.is_empty(),
    };
    if !scoped || status && !resource.status || name == Some("") {
        return None;
    }
    Some(Route {
        resource,
        namespace: namespace.to_string(),
        name: name.map(str::to_string),
        status,
    })
}

fn connection(stream: TcpStream, shared: &Shared, stop: &AtomicBool) {
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut stream = stream;
    let _ = stream.set_nodelay(true);
    while let Some(request) = read_request(&mut reader) {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let keep = handle(&mut stream, shared, stop, &request);
        if !keep || request.close {
            break;
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Answers one request; false when the connection must close (a watch).
fn handle(stream: &mut TcpStream, shared: &Shared, stop: &AtomicBool, request: &Request) -> bool {
    let Some(route) = route(&request.path) else {
        let unserved = (request.method.clone(), request.path.clone());
        shared.state.lock().unwrap().unserved.push(unserved);
        respond(
            stream,
            &refusal(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
        return true;
    };
    let counted = match route.status {
        true => format!("{}/status", route.resource.plural),
        false => route.resource.plural.to_string(),
    };
    let watch = matches!(request.param("watch"), Some("true" | "1"));
    let verb = match (request.method.as_str(), route.name.is_some()) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", false) => "create",
        ("PUT", true) => "update",
        ("PATCH", true) => "patch",
        ("DELETE", true) => "delete",
        _ => "unsupported",
    };
    let answer = {
        let mut state = shared.state.lock().unwrap();
        *state
            .counts
            .entry((verb.to_string(), counted.clone()))
            .or_insert(0) += 1;
        *state
            .counts_by_client
            .entry((request.token.clone(), verb.to_string(), counted))
            .or_insert(0) += 1;
        if verb == "unsupported" {
            let unserved = (request.method.clone(), request.path.clone());
            state.unserved.push(unserved);
        }
        if verb == "watch" {
            None
        } else {
            let answer = answer(&mut state, &route, verb, request);
            if answer.0 == 409 {
                *state.conflicts.entry(request.token.clone()).or_insert(0) += 1;
            }
            Some(answer)
        }
    };
    shared.changed.notify_all();
    match answer {
        Some(answer) => {
            respond(stream, &answer);
            true
        }
        None => {
            watch_stream(stream, shared, stop, &route, request);
            false
        }
    }
}

fn answer(state: &mut State, route: &Route, verb: &str, request: &Request) -> (u16, Value) {
    let plural = route.resource.plural;
    let writes = matches!(verb, "create" | "update" | "patch" | "delete");
    if writes && let Some(status) = state.injected_failure(plural) {
        let reason = match status {
            409 => "Conflict",
            500 => "InternalError",
            _ => "Injected",
        };
        return refusal(status, reason, "injected by the test");
    }
    if writes
        && let Some((resource, name, status)) = &state.fail_object
        && *resource == plural
        && route.name.as_ref() == Some(name)
    {
        let status = *status;
        state.fail_object_hits += 1;
        return refusal(status, "Injected", "injected by the test for this object");
    }
    let body = match request.body.is_empty() {
        true => Ok(Value::Null),
        false => serde_json::from_slice::<Value>(&request.body),
    };
    let Ok(body) = body else {
        return invalid("the body is not JSON");
    };
    let key = |name: &String| Key::new(plural, &route.namespace, name);
    let done = |result: Result<Value, Refusal>, ok: u16| result.map_or_else(|e| e, |v| (ok, v));
    match (verb, &route.name) {
        ("get", Some(name)) => done(state.current(&key(name)), 200),
        ("list", None) => list(state, route, request),
        ("create", None) => done(state.create(plural, &route.namespace, &body), 201),
        ("update", Some(name)) => done(state.update(&key(name), &body, route.status), 200),
        ("patch", Some(name)) => {
            if !request
                .content_type
                .starts_with("application/merge-patch+json")
            {
                return refusal(
                    415,
                    "UnsupportedMediaType",
                    "only JSON merge patches are served",
                );
            }
            done(state.patch(&key(name), &body, route.status), 200)
        }
        ("delete", Some(name)) => done(state.delete(&key(name), &body), 200),
        _ => refusal(
            405,
            "MethodNotAllowed",
            "the server does not allow this method",
        ),
    }
}

/// The selectors of a list or watch: `metadata.name=` and equality labels.
struct Selector {
    name: Option<String>,
    labels: Vec<(String, String)>,
}

impl Selector {
    fn parse(request: &Request) -> Result<Selector, Refusal> {
        let mut name = None;
        for term in request.param("fieldSelector").unwrap_or("").split(',') {
            match term.split_once('=') {
                _ if term.is_empty() => {}
                Some(("metadata.name", value)) => {
                    name = Some(value.trim_start_matches('=').to_string())
                }
                _ => return Err(invalid(&format!("field selector {term:?} is not served"))),
            }
        }
        let mut labels = Vec::new();
        for term in request.param("labelSelector").unwrap_or("").split(',') {
            match term.split_once('=') {
                _ if term.is_empty() => {}
                Some((key, value)) if !key.ends_with('!') => {
                    labels.push((key.to_string(), value.trim_start_matches('=').to_string()));
                }
                _ => return Err(invalid(&format!("label selector {term:?} is not served"))),
            }
        }
        Ok(Selector { name, labels })
    }

    fn matches(&self, route: &Route, key: &Key, object: &Value) -> bool {
        key.resource == route.resource.plural
            && (route.namespace.is_empty() || key.namespace == route.namespace)
            && self.name.as_ref().is_none_or(|name| *name == key.name)
            && self
                .labels
                .iter()
                .all(|(k, v)| object["metadata"]["labels"][k].as_str() == Some(v))
    }
}

/// A list, whole or a page of at most `limit` items (`limit` and
/// `continue`, as the API server paginates: the page's `metadata.continue`
/// names the rest, served from the same snapshot and resourceVersion).
fn list(state: &mut State, route: &Route, request: &Request) -> (u16, Value) {
    let limit = match request.param("limit").map(str::parse::<usize>) {
        None | Some(Ok(0)) => None,
        Some(Ok(limit)) => Some(limit),
        Some(Err(_)) => return invalid("limit must be a non-negative number"),
    };
    let (version, items) = match request.param("continue").filter(|t| !t.is_empty()) {
        Some(token) => {
            let Some((id, _)) = token
                .split_once('.')
                .and_then(|(id, rv)| Some((id.parse::<u64>().ok()?, rv.parse::<u64>().ok()?)))
            else {
                return refusal(400, "BadRequest", "continue key is not valid");
            };
            if let Some((_, between)) = state
                .expire_next_continue
                .take_if(|(resource, _)| *resource == route.resource.plural)
            {
                between(state);
                state.snapshots.remove(&id);
                state.continues_expired += 1;
            }
            match state.snapshots.remove(&id) {
                Some(snapshot) => (snapshot.version, snapshot.items),
                None => {
                    return refusal(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                    );
                }
            }
        }
        None => {
            let selector = match Selector::parse(request) {
                Ok(selector) => selector,
                Err(refused) => return refused,
            };
            if let Some(Ok(asked)) = request.param("resourceVersion").map(str::parse::<u64>)
                && asked != 0
                && asked < state.compacted_below
            {
                return refusal(
                    410,
                    "Expired",
                    &format!("too old resource version: {asked}"),
                );
            }
            let items: Vec<Value> = state
                .objects
                .iter()
                .filter(|(key, object)| selector.matches(route, key, object))
                .map(|(_, object)| object.clone())
                .collect();
            (state.version, items)
        }
    };
    let mut metadata = json!({"resourceVersion": version.to_string()});
    let mut items = items;
    if let Some(limit) = limit.filter(|limit| items.len() > *limit) {
        let rest = items.split_off(limit);
        state.snapshot_ids += 1;
        let id = state.snapshot_ids;
        metadata["continue"] = json!(format!("{id}.{version}"));
        metadata["remainingItemCount"] = json!(rest.len());
        state.snapshots.insert(
            id,
            Snapshot {
                version,
                items: rest,
            },
        );
    }
    (
        200,
        json!({"apiVersion": route.resource.api_version, "kind": format!("{}List", route.resource.kind),
               "metadata": metadata, "items": items}),
    )
}

fn watch_stream(
    stream: &mut TcpStream,
    shared: &Shared,
    stop: &AtomicBool,
    route: &Route,
    request: &Request,
) {
    let selector = match Selector::parse(request) {
        Ok(selector) => selector,
        Err(refused) => return respond_closing(stream, &refused),
    };
    let from = match request.param("resourceVersion").unwrap_or("") {
        "" | "0" => None,
        text => match text.parse::<u64>() {
            Ok(version) => Some(version),
            Err(_) => {
                return respond_closing(
                    stream,
                    &invalid(&format!("invalid resource version {text:?}")),
                );
            }
        },
    };
    let bookmarks = request.param("allowWatchBookmarks") == Some("true");
    let seconds: u64 = request
        .param("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1800);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    if write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    .is_err()
    {
        return;
    }
    let mut state = shared.state.lock().unwrap();
    let epoch = state.watch_epoch;
    let mut pending: Vec<Value> = Vec::new();
    let mut sent = match from {
        Some(version) if version < state.compacted_below => {
            drop(state);
            let gone = refusal(
                410,
                "Expired",
                &format!("too old resource version: {version}"),
            )
            .1;
            let _ = write_chunk(stream, &json!({"type": "ERROR", "object": gone}));
            let _ = write!(stream, "0\r\n\r\n");
            return;
        }
        Some(version) if version > state.version => {
            drop(state);
            let body = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "Too large resource version", "reason": "Timeout",
                "details": {"causes": [{"reason": "ResourceVersionTooLarge"}]}, "code": 504});
            let _ = write_chunk(stream, &json!({"type": "ERROR", "object": body}));
            let _ = write!(stream, "0\r\n\r\n");
            return;
        }
        Some(version) => version,
        None => {
            pending.extend(
                state
                    .objects
                    .iter()
                    .filter(|(key, object)| selector.matches(route, key, object))
                    .map(|(_, object)| json!({"type": "ADDED", "object": object})),
            );
            state.version
        }
    };
    let mut last_sent = Instant::now();
    loop {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        if state.watch_epoch != epoch {
            // Compacted: the server ends its watches; the client's next
            // watch from its version is answered 410.
            drop(state);
            let _ = write!(stream, "0\r\n\r\n");
            return;
        }
        let start = state.changes.partition_point(|c| c.version <= sent);
        pending.extend(
            state.changes[start..]
                .iter()
                .filter(|c| selector.matches(route, &c.key, &c.object))
                .map(|c| json!({"type": c.kind, "object": c.object})),
        );
        sent = state.version;
        let idle = state
            .bookmark_every
            .is_some_and(|every| last_sent.elapsed() >= every);
        let timed_out = Instant::now() >= deadline;
        if bookmarks && pending.is_empty() && (idle || timed_out) {
            pending.push(json!({"type": "BOOKMARK", "object": {
                "apiVersion": route.resource.api_version, "kind": route.resource.kind,
                "metadata": {"resourceVersion": sent.to_string()}}}));
        }
        if !pending.is_empty() {
            drop(state);
            for event in pending.drain(..) {
                if write_chunk(stream, &event).is_err() {
                    return;
                }
            }
            last_sent = Instant::now();
            state = shared.state.lock().unwrap();
            continue;
        }
        if timed_out {
            drop(state);
            let _ = write!(stream, "0\r\n\r\n");
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        state = shared
            .changed
            .wait_timeout(state, left.min(Duration::from_millis(100)))
            .unwrap()
            .0;
    }
}

/// One event as one chunk, in one write (no small segments for Nagle to hold).
fn write_chunk(stream: &mut TcpStream, event: &Value) -> std::io::Result<()> {
    http::write_chunk(stream, &format!("{event}\n"))
}

fn respond(stream: &mut TcpStream, answer: &(u16, Value)) {
    respond_with(stream, answer, "");
}

/// Answers a watch request that fails before its stream: the connection
/// closes after it, and the client is told so (else it could reuse it).
fn respond_closing(stream: &mut TcpStream, answer: &(u16, Value)) {
    respond_with(stream, answer, "Connection: close\r\n");
}

fn respond_with(stream: &mut TcpStream, (status, body): &(u16, Value), headers: &str) {
    let text = body.to_string();
    let reason = http::reason(*status);
    let whole = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\r\n{text}",
        text.len()
    );
    let _ = stream.write_all(whole.as_bytes());
}

impl KubeApi {
    /// One HTTP request to the server as any client would send it (a
    /// fresh connection), for verbs the project's client does not speak:
    /// (status, JSON body; `Null` if the body is not JSON).
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let mut stream = TcpStream::connect(self.addr).unwrap();
        let text = body.map(Value::to_string).unwrap_or_default();
        let content_type = match method {
            "PATCH" => "application/merge-patch+json",
            _ => "application/json",
        };
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: sim\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        );
        stream.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer);
        let status = answer
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or(0);
        let body = answer
            .split_once("\r\n\r\n")
            .and_then(|(_, body)| serde_json::from_str(body).ok())
            .unwrap_or(Value::Null);
        (status, body)
    }
}
