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
//!   DELETE (with `preconditions`; an object with finalizers is only
//!   marked with a `deletionTimestamp`, goes with its last finalizer and
//!   takes no new one), and the owner-reference garbage collector:
//!   deleting an object deletes its dependents.
//! - The status subresource: `PUT`/`PATCH …/status` changes only `status`;
//!   writes to the main resource keep it; `metadata.generation` counts spec
//!   changes. A write that changes nothing is not a new version (no event).
//! - Sizes, as the API server and etcd refuse them: a request body over
//!   3 MiB is answered 413 `RequestEntityTooLarge` (the API server's
//!   limit) and its connection closed; a write whose stored object would
//!   be over 1.5 MiB (etcd's `--max-request-bytes`) is answered 500
//!   `InternalError` "etcdserver: request is too large", as the API
//!   server passes etcd's refusal on.
//! - Custom resources: the project's (NodeNetworkConfig, MetisPool,
//!   MetisBlock) and any cluster-scoped one a test serves
//!   ([`serve_custom`]), each with every verb above.
//! - Per-(verb, resource) request counters, request body bytes (and the
//!   largest body) by client, bytes sent on watches by client, and fault
//!   hooks: stop and start listening, fail the next N writes with a
//!   status, compact history, expire a list's continue token between its
//!   pages (after changing objects in between).
//!
//! Cost (it must not be the bottleneck of the controller bench): each
//! change is serialised once, as its watch event, whatever the number of
//! watchers; a watcher writes what it has pending in one write; lists and
//! watches walk only their resource's objects (keys are ordered by
//! resource), and the garbage collector only objects with owners.
//!
//! It plays no controller: one node's cloud controller is a reactor of
//! `cloud.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::http::{self, MAX_REQUEST, Request, merge_patch, read_request_within};
use super::tls::{Accepted, Stream, TlsServer};

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

/// Largest object etcd stores (its default `--max-request-bytes`).
pub const MAX_OBJECT: usize = 1536 * 1024;

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

/// Resources served beyond [`RESOURCES`], for every server of the process.
static SERVED: Mutex<Vec<&'static Resource>> = Mutex::new(Vec::new());

/// Serves a cluster-scoped custom resource of `group_version` (every
/// server of this process, as a CRD installed in every cluster);
/// returns its plural, for [`Key`]s.
pub fn serve_custom(group_version: &str, kind: &str, plural: &str, status: bool) -> &'static str {
    if let Some(known) = all_resources().find(|r| r.plural == plural) {
        assert_eq!(
            known.api_version, group_version,
            "{plural} is served already"
        );
        return known.plural;
    }
    let leak = |text: String| -> &'static str { Box::leak(text.into_boxed_str()) };
    let served: &'static Resource = Box::leak(Box::new(Resource {
        plural: leak(plural.to_string()),
        prefix: leak(format!("/apis/{group_version}")),
        api_version: leak(group_version.to_string()),
        kind: leak(kind.to_string()),
        namespaced: false,
        status,
        custom: true,
    }));
    SERVED.lock().unwrap().push(served);
    served.plural
}

fn all_resources() -> impl Iterator<Item = &'static Resource> {
    let served = SERVED.lock().unwrap().clone();
    RESOURCES.iter().chain(served)
}

impl Resource {
    /// Objects carry `metadata.generation`: custom resources and those
    /// with a status subresource.
    fn has_generation(&self) -> bool {
        self.status || self.custom
    }
}

/// The resource named `plural`.
pub fn resource(plural: &str) -> &'static Resource {
    all_resources()
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
    /// Request body bytes by (client, verb, resource), as `counts_by_client`.
    pub body_bytes: BTreeMap<(String, String, String), u64>,
    /// Each client's largest request body: (bytes, verb, resource).
    pub largest_body: BTreeMap<String, (u64, String, String)>,
    /// Bytes sent on watches (chunk framing included) by (client, resource).
    pub watch_bytes: BTreeMap<(String, String), u64>,
    /// Answers by (client, HTTP status).
    pub answers: BTreeMap<(String, u16), u64>,
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
    /// Each change's watch event, serialised once (`{"type":…,"object":…}`
    /// and a newline), beside `changes`.
    events: Vec<Arc<str>>,
    /// Keys of the objects that have ownerReferences (the collector's).
    owned: BTreeSet<Key>,
    /// Every request answered, in order, while `logging` (off by default:
    /// the controller bench's millions of requests would fill memory).
    pub log: Vec<Logged>,
    pub logging: bool,
    /// Asked about every request before it is answered: the first to
    /// give a status (and `Retry-After` seconds) refuses it with that.
    pub faults: Vec<Fault>,
    /// Run after each client write (create, update, patch) under the lock,
    /// before it is answered: a controller acting on the write at once
    /// (they may write in turn); the answer is the object after them.
    pub reactors: Vec<Reactor>,
    /// While set, open watches send nothing (a lagging watch).
    pub hold_watches: bool,
    /// Watches that send nothing while listed here, by client (its bearer
    /// token) and resource: one process's watch lagging.
    pub held_watches: BTreeSet<(String, String)>,
    /// The revision each client's last watch of each resource has sent
    /// every event up to.
    pub watch_followed: BTreeMap<(String, String), u64>,
    /// Open watches send each change only this long after it was made.
    pub watch_lag: Option<Duration>,
    /// Resource versions are opaque strings (see [`State::rv`]), not the
    /// revision's digits: clients may only compare them for equality.
    pub opaque: bool,
    /// Objects every list of their resource returns beside those that
    /// match (a proxy that ignores the selectors).
    pub list_extras: Vec<(&'static str, Value)>,
    /// Client certificates (DER) of accepted TLS handshakes, in order
    /// (consecutive repeats dropped).
    pub client_certs: Vec<Vec<u8>>,
    /// Why each refused TLS handshake failed, in order.
    pub tls_refused: Vec<String>,
}

/// One answered request, as [`State::log`] keeps it.
#[derive(Debug, Clone)]
pub struct Logged {
    /// The HTTP method, `WATCH` for a watch.
    pub method: String,
    pub path: String,
    /// The query as sent.
    pub query: String,
    pub status: u16,
    /// The bearer token, empty for none.
    pub token: String,
    pub body: Vec<u8>,
    pub at: Instant,
}

/// A fault hook, asked about every request by its verb (get, list, watch,
/// create, update, patch, delete) before it is answered:
/// `Some((status, retry_after_seconds))` refuses it.
pub type Fault = Box<dyn FnMut(&str) -> Option<(u16, Option<u64>)> + Send>;

/// A controller acting on a client write of the object at the key.
pub type Reactor = Box<dyn FnMut(&mut State, &Key) + Send>;

/// Every request of `verb` fails with `status` (and `Retry-After`).
pub fn fail(verb: &'static str, status: u16, retry_after: Option<u64>) -> Fault {
    Box::new(move |asked| (asked == verb).then_some((status, retry_after)))
}

/// The next `count` requests of `verb` fail with `status`.
pub fn fail_next(verb: &'static str, count: u32, status: u16) -> Fault {
    let mut left = count;
    Box::new(move |asked| {
        if asked != verb || left == 0 {
            return None;
        }
        left -= 1;
        Some((status, None))
    })
}

/// The whole store at one version, as an etcd backup holds it.
#[derive(Clone)]
pub struct Backup {
    version: u64,
    objects: BTreeMap<Key, Value>,
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
        self.of_resource(resource, "")
    }

    /// The objects of `plural` (in `namespace` unless empty), in key
    /// order, without walking other resources' objects.
    fn of_resource<'a>(
        &'a self,
        plural: &str,
        namespace: &'a str,
    ) -> impl Iterator<Item = (&'a Key, &'a Value)> {
        let plural = resource(plural).plural;
        self.objects
            .range(Key::new(plural, namespace, "")..)
            .take_while(move |(key, _)| {
                key.resource == plural && (namespace.is_empty() || key.namespace == namespace)
            })
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
        of_client(&self.counts_by_client, client)
    }

    /// Request body bytes `client` sent, by (verb, resource).
    pub fn body_bytes_of(&self, client: &str) -> BTreeMap<(String, String), u64> {
        of_client(&self.body_bytes, client)
    }

    /// `client`'s largest request body: (bytes, verb, resource).
    pub fn largest_body_of(&self, client: &str) -> Option<(u64, String, String)> {
        self.largest_body.get(client).cloned()
    }

    /// Bytes sent on `client`'s watches, all resources.
    pub fn watch_bytes_of(&self, client: &str) -> u64 {
        self.watch_bytes
            .iter()
            .filter(|((who, _), _)| who == client)
            .map(|(_, n)| n)
            .sum()
    }

    /// `client`'s answers with `status`.
    pub fn answers_of(&self, client: &str, status: u16) -> u64 {
        self.answers
            .get(&(client.to_string(), status))
            .copied()
            .unwrap_or(0)
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
        meta["resourceVersion"] = json!(self.rv(version));
        if res.has_generation() {
            meta["generation"] = json!(1);
        }
        if res.custom
            && res.status
            && let Some(fields) = object.as_object_mut()
        {
            // A custom resource with a status subresource: status is
            // written through the subresource only.
            fields.remove("status");
        }
        let text = stored_text(&object)?;
        self.commit(key, Some((object.clone(), text)), "ADDED");
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
        self.write(key, &current, next)
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
        self.write(key, &current, next)
    }

    /// Deletes an object (with `preconditions` from DeleteOptions) and,
    /// unless `keep_dependents`, the objects it owns; one with finalizers
    /// is only marked (`deletionTimestamp`).
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
        // Finalizers hold it: marked, it goes with the last of them.
        if !finalizers(&current).is_empty() {
            if current["metadata"]["deletionTimestamp"].is_string() {
                return Ok(current);
            }
            let mut marked = current;
            marked["metadata"]["deletionTimestamp"] =
                json!(metis::log::rfc3339_seconds(metis::log::now_ms()).to_string());
            marked["metadata"]["resourceVersion"] = json!(self.rv(self.version + 1));
            let text = stored_text(&marked)?;
            self.commit(key.clone(), Some((marked.clone(), text)), "MODIFIED");
            return Ok(marked);
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
                .owned
                .iter()
                .filter(|key| self.objects.get(key).is_some_and(|o| owned_by(o, &uid)))
                .cloned()
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
    /// anything changed. `None` when there is no such object, or the
    /// changed one is too large to store.
    pub fn edit(&mut self, key: &Key, change: impl FnOnce(&mut Value)) -> Option<Value> {
        let current = self.objects.get(key)?.clone();
        let mut next = current.clone();
        change(&mut next);
        if resource(key.resource).has_generation() {
            count_generation(&current, &mut next);
        }
        self.write(key, &current, next).ok()
    }

    /// History below the current version is gone: watches and lists from
    /// an older version get 410, and every open watch ends.
    pub fn compact(&mut self) {
        // A watch from the current version misses nothing.
        self.compacted_below = self.version;
        self.changes.clear();
        self.events.clear();
        self.snapshots.clear();
        self.watch_epoch += 1;
    }

    /// A copy of the whole store at the current version.
    pub fn backup(&self) -> Backup {
        Backup {
            version: self.version,
            objects: self.objects.clone(),
        }
    }

    /// etcd restored from `backup`: versions go back to it, history after
    /// it is gone and every open watch ends; a watch from a later version
    /// is answered `ResourceVersionTooLarge`.
    pub fn restore(&mut self, backup: Backup) {
        let kept = self
            .changes
            .partition_point(|c| c.version <= backup.version);
        self.changes.truncate(kept);
        self.events.truncate(kept);
        // A compaction since the backup dropped history below a version
        // the store now goes back under: only the restored version itself
        // can still be watched from (as from a snapshot's revision).
        self.compacted_below = self.compacted_below.min(backup.version);
        self.version = backup.version;
        self.owned = (backup.objects.iter())
            .filter(|(_, object)| object["metadata"]["ownerReferences"].is_array())
            .map(|(key, _)| key.clone())
            .collect();
        self.objects = backup.objects;
        self.snapshots.clear();
        self.watch_epoch += 1;
    }

    /// etcd restored from `backup` as its documented procedure does it
    /// (`etcdutl snapshot restore --bump-revision --mark-compacted`):
    /// versions go on past every one handed out, so none names two
    /// contents, and a watch from any earlier version is answered 410 (its
    /// client lists again).
    pub fn restore_bumped(&mut self, backup: Backup) {
        let handed_out = self.version;
        self.restore(backup);
        self.version = handed_out + 1;
        self.compacted_below = self.version;
        self.changes.clear();
        self.events.clear();
    }

    /// An event on the stream of watches that follow `key`, at a new
    /// version, that changes no stored object: a late copy delivered
    /// again, or another object a proxy passes off as this one.
    pub fn inject_event(&mut self, key: Key, kind: &'static str, object: Value) {
        self.version += 1;
        self.events.push(event_text(kind, &object.to_string()));
        self.changes.push(Change {
            version: self.version,
            key,
            kind,
            object,
            at: Instant::now(),
        });
    }

    /// The resource version of revision `version`: its digits, or with
    /// `opaque` a string that sorts unlike the revisions.
    pub fn rv(&self, version: u64) -> String {
        match self.opaque {
            false => version.to_string(),
            true => format!("{:x}.{version}", version.wrapping_mul(0x9e37_79b9) % 4093),
        }
    }

    /// The revision a resource version names (either spelling).
    pub fn position(&self, rv: &str) -> Option<u64> {
        match self.opaque {
            false => rv.parse().ok(),
            true => rv.rsplit('.').next()?.parse().ok(),
        }
    }

    /// Whether `client`'s watch of `resource` has sent every change up to
    /// the object at `key` as it is now.
    pub fn watched_up_to(&self, client: &str, resource: &str, key: &Key) -> bool {
        let now = self
            .get(key)
            .and_then(|o| o["metadata"]["resourceVersion"].as_str());
        let now = now.and_then(|rv| self.position(rv));
        let followed = self
            .watch_followed
            .get(&(client.to_string(), resource.to_string()));
        now.is_some_and(|at| followed.is_some_and(|f| *f >= at))
    }

    /// Logged requests of `method` (`WATCH` for watches) answered `status`.
    pub fn answered(&self, method: &str, status: u16) -> usize {
        self.times(method, status).len()
    }

    /// When the logged requests of `method` answered `status` were answered.
    pub fn times(&self, method: &str, status: u16) -> Vec<Instant> {
        (self.log.iter())
            .filter(|r| r.method == method && r.status == status)
            .map(|r| r.at)
            .collect()
    }

    /// The bearer tokens of logged requests, consecutive repeats dropped.
    pub fn tokens(&self) -> Vec<String> {
        let mut tokens: Vec<String> = Vec::new();
        for request in self.log.iter().filter(|r| !r.token.is_empty()) {
            if tokens.last() != Some(&request.token) {
                tokens.push(request.token.clone());
            }
        }
        tokens
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
            "deletionTimestamp",
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
        }
        if res.has_generation() {
            count_generation(current, &mut next);
        }
        next
    }

    /// Stores `next` for `key` unless it equals `current` (the API server
    /// writes nothing then); returns the object as stored.
    /// An object marked for deletion goes with its last finalizer, and
    /// takes no new one.
    fn write(&mut self, key: &Key, current: &Value, mut next: Value) -> Result<Value, Refusal> {
        next["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
        if &next == current {
            return Ok(next);
        }
        let marked = current["metadata"]["deletionTimestamp"].is_string();
        let before = finalizers(current);
        let after: Vec<String> = finalizers(&next).into_iter().map(str::to_string).collect();
        if marked && after.iter().any(|f| !before.contains(&f.as_str())) {
            return Err(refusal(
                422,
                "Invalid",
                "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted",
            ));
        }
        next["metadata"]["resourceVersion"] = json!(self.rv(self.version + 1));
        let text = stored_text(&next)?;
        if marked && after.is_empty() {
            self.commit(key.clone(), None, "DELETED");
        } else {
            self.commit(key.clone(), Some((next.clone(), text)), "MODIFIED");
        }
        Ok(next)
    }

    /// Records a change: `object` (and its JSON text) stored, or `None`
    /// for a deletion; its watch event is serialised here, once.
    fn commit(&mut self, key: Key, object: Option<(Value, String)>, kind: &'static str) {
        self.version += 1;
        let (recorded, text) = match object {
            Some((object, text)) => {
                self.objects.insert(key.clone(), object.clone());
                (object, text)
            }
            None => {
                let mut gone = self.objects.remove(&key).unwrap_or(Value::Null);
                gone["metadata"]["resourceVersion"] = json!(self.rv(self.version));
                let text = gone.to_string();
                (gone, text)
            }
        };
        match kind != "DELETED" && recorded["metadata"]["ownerReferences"].is_array() {
            true => self.owned.insert(key.clone()),
            false => self.owned.remove(&key),
        };
        self.events.push(event_text(kind, &text));
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

/// The JSON text `object` is stored as, refused as etcd refuses an object
/// over its request limit (the API server answers 500 with etcd's words).
fn stored_text(object: &Value) -> Result<String, Refusal> {
    let text = object.to_string();
    match text.len() > MAX_OBJECT {
        true => Err(refusal(
            500,
            "InternalError",
            "etcdserver: request is too large",
        )),
        false => Ok(text),
    }
}

/// `map`'s entries of `client`, keyed by (verb, resource).
fn of_client(
    map: &BTreeMap<(String, String, String), u64>,
    client: &str,
) -> BTreeMap<(String, String), u64> {
    map.iter()
        .filter(|((who, _, _), _)| who == client)
        .map(|((_, verb, resource), n)| ((verb.clone(), resource.clone()), *n))
        .collect()
}

/// Sets `next`'s generation to `current`'s, one more when the spec (all
/// but metadata and status) changed, as the API server counts it for a
/// resource with the status subresource (a custom resource without one
/// has no status the project writes).
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
    // Copied without its own status: a pool's status was most of the
    // server's copying under the controller bench.
    let mut next = match base.as_object() {
        Some(fields) => Value::Object(
            fields
                .iter()
                .filter(|(key, _)| *key != "status")
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect(),
        ),
        None => base.clone(),
    };
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
    (code, http::failure(code, reason, message))
}

fn invalid(message: &str) -> Refusal {
    refusal(400, "BadRequest", message)
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    /// The state, also after a test's assertion failed while it held it:
    /// the unwinding that follows drops the daemons and controllers the test
    /// started, which must not abort on a poisoned lock and leave them
    /// running.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The server's state, shared with another thread.
#[derive(Clone)]
pub struct Handle(Arc<Shared>);

impl Handle {
    /// Runs `look` on the state under the lock and wakes open watches.
    pub fn with<T>(&self, look: impl FnOnce(&mut State) -> T) -> T {
        let out = look(&mut self.0.lock());
        self.0.changed.notify_all();
        out
    }
}

/// The server; stops listening on drop.
pub struct KubeApi {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    running: Option<http::Acceptor>,
    tls: Option<Https>,
}

/// The HTTPS side: the server's TLS and the CA file kubeconfigs name.
struct Https {
    server: Arc<TlsServer>,
    ca_file: std::path::PathBuf,
}

impl KubeApi {
    /// An empty server listening on a free loopback port.
    pub fn start() -> KubeApi {
        KubeApi::start_with(None)
    }

    /// Like [`KubeApi::start`], speaking HTTPS through `tls`; the
    /// kubeconfigs it writes trust the CA bundle in `ca_file`.
    pub fn start_tls(tls: Arc<TlsServer>, ca_file: &std::path::Path) -> KubeApi {
        KubeApi::start_with(Some(Https {
            server: tls,
            ca_file: ca_file.to_path_buf(),
        }))
    }

    fn start_with(tls: Option<Https>) -> KubeApi {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut api = KubeApi {
            addr,
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
            }),
            running: None,
            tls,
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
        self.kubeconfig_with_user(path, &format!("    token: {client}"));
    }

    /// Writes a kubeconfig whose user entry is `user` (indented YAML lines).
    pub fn kubeconfig_with_user(&self, path: &std::path::Path, user: &str) {
        let cluster = match &self.tls {
            None => format!("    server: http://{}", self.addr),
            Some(https) => format!(
                "    server: https://{}\n    certificate-authority: {}",
                self.addr,
                https.ca_file.display()
            ),
        };
        let text = format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: sim\nclusters:\n- name: sim\n  cluster:\n{cluster}\ncontexts:\n- name: sim\n  context:\n    cluster: sim\n    user: sim\nusers:\n- name: sim\n  user:\n{user}\n",
        );
        std::fs::write(path, text).unwrap();
    }

    /// The server's TLS side (panics on a plain HTTP server).
    pub fn tls(&self) -> &TlsServer {
        &self.tls.as_ref().expect("an HTTPS server").server
    }

    /// Cuts every open connection (watches included) and keeps listening:
    /// an API server restarted with a rotated certificate.
    pub fn cut_connections(&self) {
        if let Some(running) = &self.running {
            running.cut();
        }
    }

    /// A handle other threads can read and change the state through.
    pub fn handle(&self) -> Handle {
        Handle(Arc::clone(&self.shared))
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
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
        super::poll(timeout, || condition(&self.state()).then_some(()))
            .unwrap_or_else(|| panic!("timed out waiting for {what}"));
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
        let tls = self.tls.as_ref().map(|https| Arc::clone(&https.server));
        self.running = Some(http::Acceptor::spawn(listener, move |stream, stop| {
            connection(stream, tls.as_deref(), &shared, stop)
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
    let resources: Vec<&'static Resource> = all_resources().collect();
    let (resource_prefix, rest) = resources
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
    let resource = resources
        .iter()
        .copied()
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

impl Route {
    /// The resource as counted: `RESOURCE/status` for the subresource.
    fn counted(&self) -> String {
        match self.status {
            true => format!("{}/status", self.resource.plural),
            false => self.resource.plural.to_string(),
        }
    }

    /// The API server's verb for `request` on this route.
    fn verb(&self, request: &Request) -> &'static str {
        let watch = matches!(request.param("watch"), Some("true" | "1"));
        match (request.method.as_str(), self.name.is_some()) {
            ("GET", true) => "get",
            ("GET", false) if watch => "watch",
            ("GET", false) => "list",
            ("POST", false) => "create",
            ("PUT", true) => "update",
            ("PATCH", true) => "patch",
            ("DELETE", true) => "delete",
            _ => "unsupported",
        }
    }
}

/// Serves one connection (after its TLS handshake, with `tls`), then cuts
/// it (the acceptor keeps a clone for `stop`: closing needs a shutdown).
fn connection(tcp: TcpStream, tls: Option<&TlsServer>, shared: &Shared, stop: &AtomicBool) {
    let Ok(closer) = tcp.try_clone() else {
        return;
    };
    let _ = tcp.set_nodelay(true);
    let Some(stream) = handshake(tcp, tls, shared) else {
        let _ = closer.shutdown(Shutdown::Both);
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let request = match read_request_within(&mut reader, MAX_REQUEST) {
            Ok(Some(request)) => request,
            Ok(None) => break,
            Err(too_large) => {
                refuse_too_large(reader.get_mut().as_mut(), shared, &too_large);
                break;
            }
        };
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let keep = handle(reader.get_mut().as_mut(), shared, stop, &request);
        if !keep || request.close {
            break;
        }
    }
    reader.get_mut().finish();
    let _ = closer.shutdown(Shutdown::Both);
}

/// The connection as requests are read from it: TLS up (the client's
/// certificate recorded), or plain; `None` for a refused handshake.
fn handshake(tcp: TcpStream, tls: Option<&TlsServer>, shared: &Shared) -> Option<Box<dyn Stream>> {
    let Some(tls) = tls else {
        return Some(Box::new(tcp));
    };
    let (stream, client) = match tls.accept(tcp) {
        Accepted::Up { stream, client } => (stream, client),
        Accepted::Refused(why) => {
            shared.lock().tls_refused.push(why);
            shared.changed.notify_all();
            return None;
        }
    };
    let mut state = shared.lock();
    if let Some(cert) = client
        && state.client_certs.last() != Some(&cert)
    {
        state.client_certs.push(cert);
    }
    Some(stream)
}

/// A body over the API server's limit: 413, counted, and the connection
/// closed (the body is left unread).
fn refuse_too_large(stream: &mut dyn Stream, shared: &Shared, too_large: &http::TooLarge) {
    let head = &too_large.head;
    let (verb, counted) = route(&head.path).map_or(("unsupported", String::new()), |route| {
        (route.verb(head), route.counted())
    });
    {
        let mut state = shared.lock();
        state.account(&head.token, verb, &counted, 0);
        *state.answers.entry((head.token.clone(), 413)).or_insert(0) += 1;
    }
    shared.changed.notify_all();
    let message = format!(
        "Request entity too large: limit is {MAX_REQUEST} ({} bytes sent)",
        too_large.length
    );
    respond_closing(
        stream,
        &text(refusal(413, "RequestEntityTooLarge", &message)),
    );
}

/// Answers one request; false when the connection must close (a watch).
fn handle(stream: &mut dyn Stream, shared: &Shared, stop: &AtomicBool, request: &Request) -> bool {
    let Some(route) = route(&request.path) else {
        let mut state = shared.lock();
        let unserved = (request.method.clone(), request.path.clone());
        state.unserved.push(unserved);
        state.note(request, "", 404);
        drop(state);
        respond(
            stream,
            &text(refusal(
                404,
                "NotFound",
                "the server could not find the requested resource",
            )),
        );
        return true;
    };
    let counted = route.counted();
    let verb = route.verb(request);
    let answer = {
        let mut state = shared.lock();
        state.account(&request.token, verb, &counted, request.body.len());
        if verb == "unsupported" {
            let unserved = (request.method.clone(), request.path.clone());
            state.unserved.push(unserved);
        }
        let fault = state.faults.iter_mut().find_map(|fault| fault(verb));
        if let Some((status, retry_after)) = fault {
            state.note(request, verb, status);
            Some(injected(status, retry_after))
        } else if verb == "watch" {
            state.note(request, verb, 200);
            None
        } else {
            let answer = answer(&mut state, &route, verb, request);
            state.note(request, verb, answer.0);
            *state
                .answers
                .entry((request.token.clone(), answer.0))
                .or_insert(0) += 1;
            if answer.0 == 409 {
                *state.conflicts.entry(request.token.clone()).or_insert(0) += 1;
            }
            Some((answer.0, answer.1, String::new()))
        }
    };
    shared.changed.notify_all();
    match answer {
        Some((status, body, headers)) => {
            http::respond(stream, status, &body, &headers);
            true
        }
        None => {
            let watch = Watch {
                route: &route,
                request,
                counted: &counted,
            };
            watch_stream(stream, shared, stop, &watch);
            false
        }
    }
}

/// A fault hook's refusal: (status, body, extra headers).
fn injected(status: u16, retry_after: Option<u64>) -> (u16, String, String) {
    let reason = match status {
        409 => "Conflict",
        500 => "InternalError",
        _ => "Injected",
    };
    let headers = retry_after
        .map(|seconds| format!("Retry-After: {seconds}\r\n"))
        .unwrap_or_default();
    let body = http::failure(status, reason, "injected by the test").to_string();
    (status, body, headers)
}

impl State {
    /// Logs one answered request (`verb` "watch" as `WATCH`), if logging.
    fn note(&mut self, request: &Request, verb: &str, status: u16) {
        if !self.logging {
            return;
        }
        let method = match verb {
            "watch" => "WATCH".to_string(),
            _ => request.method.clone(),
        };
        self.log.push(Logged {
            method,
            path: request.path.clone(),
            query: request.raw_query.clone(),
            status,
            token: request.token.clone(),
            body: request.body.clone(),
            at: Instant::now(),
        });
    }

    /// Counts one request of `client` and its body's bytes.
    fn account(&mut self, client: &str, verb: &str, resource: &str, body: usize) {
        *self
            .counts
            .entry((verb.to_string(), resource.to_string()))
            .or_insert(0) += 1;
        let key = (client.to_string(), verb.to_string(), resource.to_string());
        *self.counts_by_client.entry(key.clone()).or_insert(0) += 1;
        let bytes = u64::try_from(body).unwrap_or(u64::MAX);
        if bytes == 0 {
            return;
        }
        *self.body_bytes.entry(key).or_insert(0) += bytes;
        let largest = self.largest_body.entry(client.to_string()).or_default();
        if bytes > largest.0 {
            *largest = (bytes, verb.to_string(), resource.to_string());
        }
    }
}

/// An answer: its status and its JSON text.
type Answer = (u16, String);

fn text((status, body): Refusal) -> Answer {
    (status, body.to_string())
}

fn answer(state: &mut State, route: &Route, verb: &str, request: &Request) -> Answer {
    let plural = route.resource.plural;
    let writes = matches!(verb, "create" | "update" | "patch" | "delete");
    if writes && let Some(status) = state.injected_failure(plural) {
        let reason = match status {
            409 => "Conflict",
            500 => "InternalError",
            _ => "Injected",
        };
        return text(refusal(status, reason, "injected by the test"));
    }
    if writes
        && let Some((resource, name, status)) = &state.fail_object
        && *resource == plural
        && route.name.as_ref() == Some(name)
    {
        let status = *status;
        state.fail_object_hits += 1;
        return text(refusal(
            status,
            "Injected",
            "injected by the test for this object",
        ));
    }
    let body = match request.body.is_empty() {
        true => Ok(Value::Null),
        false => serde_json::from_slice::<Value>(&request.body),
    };
    let Ok(body) = body else {
        return text(invalid("the body is not JSON"));
    };
    let key = |name: &String| Key::new(plural, &route.namespace, name);
    let done = |result: Result<Value, Refusal>, ok: u16| match result {
        Ok(value) => (ok, value.to_string()),
        Err(refused) => text(refused),
    };
    match (verb, &route.name) {
        ("get", Some(name)) => match state.objects.get(&key(name)) {
            Some(object) => (200, object.to_string()),
            None => done(state.current(&key(name)), 200),
        },
        ("list", None) => list(state, route, request),
        ("create", None) => {
            let made = state.create(plural, &route.namespace, &body);
            done(reacted(state, route, made), 201)
        }
        ("update", Some(name)) => {
            let updated = state.update(&key(name), &body, route.status);
            done(reacted(state, route, updated), 200)
        }
        ("patch", Some(name)) => {
            if !request
                .content_type
                .starts_with("application/merge-patch+json")
            {
                return text(refusal(
                    415,
                    "UnsupportedMediaType",
                    "only JSON merge patches are served",
                ));
            }
            let patched = state.patch(&key(name), &body, route.status);
            done(reacted(state, route, patched), 200)
        }
        ("delete", Some(name)) => done(state.delete(&key(name), &body), 200),
        _ => text(refusal(
            405,
            "MethodNotAllowed",
            "the server does not allow this method",
        )),
    }
}

/// A client write's result once the reactors have acted on it: the
/// object as stored after them.
fn reacted(
    state: &mut State,
    route: &Route,
    written: Result<Value, Refusal>,
) -> Result<Value, Refusal> {
    let Ok(object) = written else {
        return written;
    };
    if state.reactors.is_empty() {
        return Ok(object);
    }
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let key = Key::new(route.resource.plural, &route.namespace, name);
    let mut reactors = std::mem::take(&mut state.reactors);
    for react in &mut reactors {
        react(state, &key);
    }
    reactors.append(&mut state.reactors);
    state.reactors = reactors;
    Ok(state.objects.get(&key).cloned().unwrap_or(object))
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
/// The page is serialised from the stored objects; only the rest of a
/// paginated list is copied.
fn list(state: &mut State, route: &Route, request: &Request) -> Answer {
    let limit = match request.param("limit").map(str::parse::<usize>) {
        None | Some(Ok(0)) => usize::MAX,
        Some(Ok(limit)) => limit,
        Some(Err(_)) => return text(invalid("limit must be a non-negative number")),
    };
    let (version, page, rest) = match request.param("continue").filter(|t| !t.is_empty()) {
        Some(token) => match continued(state, route, token) {
            Ok(Snapshot { version, mut items }) => {
                let rest = items.split_off(limit.min(items.len()));
                (version, serde_json::to_string(&items), rest)
            }
            Err(refused) => return text(refused),
        },
        None => {
            let selector = match Selector::parse(request) {
                Ok(selector) => selector,
                Err(refused) => return text(refused),
            };
            if let Some(asked) = request
                .param("resourceVersion")
                .and_then(|v| state.position(v))
                && asked != 0
                && asked < state.compacted_below
            {
                return text(refusal(
                    410,
                    "Expired",
                    &format!("too old resource version: {asked}"),
                ));
            }
            let extras = (state.list_extras.iter())
                .filter(|(plural, _)| *plural == route.resource.plural)
                .map(|(_, object)| object);
            let matching: Vec<&Value> = state
                .of_resource(route.resource.plural, &route.namespace)
                .filter(|(key, object)| selector.matches(route, key, object))
                .map(|(_, object)| object)
                .chain(extras)
                .collect();
            let cut = limit.min(matching.len());
            let rest: Vec<Value> = matching[cut..].iter().map(|o| (*o).clone()).collect();
            (state.version, serde_json::to_string(&matching[..cut]), rest)
        }
    };
    let Ok(page) = page else {
        return text(refusal(
            500,
            "InternalError",
            "the list cannot be serialised",
        ));
    };
    let mut metadata = json!({"resourceVersion": state.rv(version)});
    if !rest.is_empty() {
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
    let kind = json!(format!("{}List", route.resource.kind));
    let api_version = json!(route.resource.api_version);
    (
        200,
        format!(
            r#"{{"apiVersion":{api_version},"kind":{kind},"metadata":{metadata},"items":{page}}}"#
        ),
    )
}

/// The rest of a paginated list, by its continue token (410 once expired).
fn continued(state: &mut State, route: &Route, token: &str) -> Result<Snapshot, Refusal> {
    let Some((id, _)) = token
        .split_once('.')
        .and_then(|(id, rv)| Some((id.parse::<u64>().ok()?, rv.parse::<u64>().ok()?)))
    else {
        return Err(refusal(400, "BadRequest", "continue key is not valid"));
    };
    if let Some((_, between)) = state
        .expire_next_continue
        .take_if(|(resource, _)| *resource == route.resource.plural)
    {
        between(state);
        state.snapshots.remove(&id);
        state.continues_expired += 1;
    }
    state.snapshots.remove(&id).ok_or_else(|| {
        refusal(
            410,
            "Expired",
            "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
        )
    })
}

/// A watch request: what it watches, and whose bytes it counts.
struct Watch<'a> {
    route: &'a Route,
    request: &'a Request,
    counted: &'a str,
}

/// A watch event's chunk text, from the object's JSON text.
fn event_text(kind: &str, object: &str) -> Arc<str> {
    Arc::from(format!("{{\"type\":\"{kind}\",\"object\":{object}}}\n"))
}

/// Where a watch starts: `None` for the current objects (as ADDED), or
/// the version to follow from; an error event ends it at once.
fn watch_start(state: &State, request: &Request) -> Result<Option<u64>, Refusal> {
    match request.param("resourceVersion").unwrap_or("") {
        "" | "0" => Ok(None),
        text => (state.position(text))
            .map(Some)
            .ok_or_else(|| invalid(&format!("invalid resource version {text:?}"))),
    }
}

fn watch_stream(stream: &mut dyn Stream, shared: &Shared, stop: &AtomicBool, watch: &Watch) {
    let (route, request) = (watch.route, watch.request);
    let selector = match Selector::parse(request) {
        Ok(selector) => selector,
        Err(refused) => return respond_closing(stream, &text(refused)),
    };
    let from = match watch_start(&shared.lock(), request) {
        Ok(from) => from,
        Err(refused) => return respond_closing(stream, &text(refused)),
    };
    if http::start_watch(stream).is_err() {
        return;
    }
    let state = shared.lock();
    let mut pending: Vec<Arc<str>> = Vec::new();
    let sent = match from {
        Some(version) if version < state.compacted_below => {
            drop(state);
            let gone = refusal(
                410,
                "Expired",
                &format!("too old resource version: {version}"),
            )
            .1;
            return http::end_watch_with_error(stream, &gone);
        }
        Some(version) if version > state.version => {
            drop(state);
            let body = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "Too large resource version", "reason": "Timeout",
                "details": {"causes": [{"reason": "ResourceVersionTooLarge"}]}, "code": 504});
            return http::end_watch_with_error(stream, &body);
        }
        Some(version) => version,
        None => {
            pending.extend(
                state
                    .of_resource(route.resource.plural, &route.namespace)
                    .filter(|(key, object)| selector.matches(route, key, object))
                    .map(|(_, object)| event_text("ADDED", &object.to_string())),
            );
            state.version
        }
    };
    drop(state);
    follow(stream, shared, stop, watch, (selector, sent, pending));
}

/// Sends a watch's events from version `sent` on (after `pending`) until
/// it times out, the server stops or compacts, or the client goes.
fn follow(
    stream: &mut dyn Stream,
    shared: &Shared,
    stop: &AtomicBool,
    watch: &Watch,
    (selector, mut sent, mut pending): (Selector, u64, Vec<Arc<str>>),
) {
    let (route, request) = (watch.route, watch.request);
    let bookmarks = request.param("allowWatchBookmarks") == Some("true");
    let seconds: u64 = request
        .param("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1800);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut state = shared.lock();
    let epoch = state.watch_epoch;
    let mut last_sent = Instant::now();
    let mut written = 0u64;
    let mut ended = false;
    // This watch's client and resource, as the counts and holds name them.
    let key = (request.token.clone(), watch.counted.to_string());
    loop {
        if written > 0 {
            *state.watch_bytes.entry(key.clone()).or_insert(0) += written;
            written = 0;
        }
        match state.watch_followed.get_mut(&key) {
            Some(followed) => *followed = sent,
            None => {
                state.watch_followed.insert(key.clone(), sent);
            }
        }
        if ended {
            drop(state);
            let _ = write!(stream, "0\r\n\r\n");
            return;
        }
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
        let held = state.held_watches.contains(&key);
        sent = pending_since(&state, route, &selector, (sent, held), &mut pending);
        let idle = state
            .bookmark_every
            .is_some_and(|every| last_sent.elapsed() >= every);
        let timed_out = Instant::now() >= deadline;
        if bookmarks && pending.is_empty() && (idle || timed_out) {
            let bookmark = json!({"apiVersion": route.resource.api_version, "kind": route.resource.kind,
                "metadata": {"resourceVersion": state.rv(sent)}});
            pending.push(event_text("BOOKMARK", &bookmark.to_string()));
        }
        if !pending.is_empty() {
            drop(state);
            match send_events(stream, &pending) {
                Ok(bytes) => written = bytes,
                Err(_) => return,
            }
            pending.clear();
            last_sent = Instant::now();
            // Timed out: what was pending (its last bookmark) was the
            // watch's last word.
            ended = timed_out;
            state = shared.lock();
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
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0;
    }
}

/// Adds to `pending` the events of changes after version `sent` that the
/// watch may send now (nothing while it is `held`); returns the version it
/// has then followed to.
fn pending_since(
    state: &State,
    route: &Route,
    selector: &Selector,
    (sent, held): (u64, bool),
    pending: &mut Vec<Arc<str>>,
) -> u64 {
    let hold = state.hold_watches || held;
    let start = state.changes.partition_point(|c| c.version <= sent);
    // Each change's event was serialised once, when it was made (a
    // test that edited `changes` by hand gets its events made here).
    let aligned = state.events.len() == state.changes.len();
    let delayed = hold || state.watch_lag.is_some();
    for (at, change) in state.changes.iter().enumerate().skip(start) {
        let due = !hold && state.watch_lag.is_none_or(|lag| change.at.elapsed() >= lag);
        if delayed && !due {
            // A lagging watch: this change and the later ones wait.
            return state.changes[..at]
                .last()
                .map_or(sent, |c| c.version.max(sent));
        }
        if selector.matches(route, &change.key, &change.object) {
            pending.push(match aligned {
                true => Arc::clone(&state.events[at]),
                false => event_text(change.kind, &change.object.to_string()),
            });
        }
    }
    state.version
}

/// Events as chunks, in one write (no small segments for Nagle to hold);
/// the bytes sent.
fn send_events(stream: &mut dyn Stream, events: &[Arc<str>]) -> std::io::Result<u64> {
    let mut buffer = Vec::with_capacity(events.iter().map(|e| e.len() + 12).sum());
    for event in events {
        write!(buffer, "{:x}\r\n{event}\r\n", event.len())?;
    }
    stream.write_all(&buffer)?;
    stream.flush()?;
    Ok(u64::try_from(buffer.len()).unwrap_or(u64::MAX))
}

fn respond(stream: &mut dyn Stream, (status, text): &Answer) {
    http::respond(stream, *status, text, "");
}

/// Answers a request whose connection must close after it (a watch that
/// fails before its stream, a body too large to read): the client is told
/// so (else it could reuse it).
fn respond_closing(stream: &mut dyn Stream, (status, text): &Answer) {
    http::respond(stream, *status, text, "Connection: close\r\n");
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

/// An object's `metadata.finalizers`.
fn finalizers(object: &Value) -> Vec<&str> {
    let list = object["metadata"]["finalizers"].as_array();
    list.into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}
