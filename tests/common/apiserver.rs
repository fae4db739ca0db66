//! A test Kubernetes API server: real HTTP/1.1 on 127.0.0.1 implementing
//! the endpoints the daemon uses with Kubernetes semantics — GET, POST,
//! JSON merge PATCH with `resourceVersion` preconditions (409 on mismatch),
//! chunked watch streams with ADDED/MODIFIED events, `410 Gone` for
//! compacted versions — plus a simulated cloud controller that appends
//! Ready /28 pod CIDRs while `spec.allocations[].pods` exceeds what the
//! status's blocks hold (the node's own ranges are not counted, as the
//! contract says) and removes `releasableCIDRs` from the status. For the control-plane tests
//! it also misbehaves on request: other nodes' objects in watches and lists
//! (a proxy that ignores the field selector), opaque resource versions,
//! objects deleted and created anew (new uid), an etcd restore (versions
//! go back; watches from a later version are answered
//! `ResourceVersionTooLarge`) and watches that lag (held, or each event sent
//! a set time after it happened); it records every PATCH's precondition. With [`ApiServer::start_tls`]
//! it speaks HTTPS (`tls`): certificates rotate while it runs, and it
//! records every client certificate it accepts and every handshake it
//! refuses.

use std::io::BufReader;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::http::{self, Request, merge_patch, read_request, write_chunk};
use super::tls::{Accepted, Stream, TlsServer};

const NNC_COLLECTION: &str = "/apis/networking.gke.io/v1/nodenetworkconfigs";
const NODE_COLLECTION: &str = "/api/v1/nodes";

/// Everything the server knows; tests read and change it under the lock.
pub struct State {
    /// The last resource version handed out (etcd-style global counter).
    pub version: u64,
    /// Watches asking for a version below this get 410 Gone.
    pub compacted_below: u64,
    pub node: Value,
    pub nnc: Option<Value>,
    /// (version, kind "nnc"/"node", event type, object) in order.
    pub events: Vec<(u64, &'static str, &'static str, Value)>,
    /// (method, path, status) of every request answered.
    pub log: Vec<(String, String, u16)>,
    /// When each `log` entry was answered (same index).
    pub stamps: Vec<Instant>,
    /// Query string of each `log` entry (same index).
    pub queries: Vec<String>,
    /// Watches are answered with this status (and `Retry-After` seconds).
    pub fail_watches: Option<(u16, Option<u64>)>,
    /// PATCHes are answered with this status (and `Retry-After` seconds).
    pub fail_patches: Option<(u16, Option<u64>)>,
    /// The next this many PATCHes answer 409 whatever their version.
    pub inject_conflicts: u32,
    /// Pod CIDRs handed out so far by the simulated cloud controller.
    pub next_block: u32,
    pub controller: bool,
    /// Bearer tokens seen, in order (deduplicated consecutive repeats).
    pub tokens: Vec<String>,
    /// Whether the Node exists (`node` keeps its last content).
    pub node_exists: bool,
    /// Objects of other nodes every list returns beside this node's.
    pub foreign_in_lists: Vec<(&'static str, Value)>,
    /// Resource versions are opaque strings, not the position's digits.
    pub opaque: bool,
    /// Objects created so far (each gets its own uid).
    pub created: u32,
    /// `type` of the pod CIDRs the simulated controller publishes.
    pub block_type: &'static str,
    /// While set, open watches send nothing (a lagging watch).
    pub hold_watches: bool,
    /// Open watches send each event only this long after it happened.
    pub watch_lag: Option<Duration>,
    /// When each event (by stream position) happened.
    pub event_at: std::collections::BTreeMap<u64, Instant>,
    /// The `metadata.resourceVersion` precondition of every PATCH, in order.
    pub patch_bases: Vec<String>,
    /// Bumped by a restore: open watches end.
    pub generation: u64,
    /// Client certificates (DER) of accepted TLS handshakes, in order
    /// (consecutive repeats dropped).
    pub client_certs: Vec<Vec<u8>>,
    /// Why each refused TLS handshake failed, in order.
    pub tls_refused: Vec<String>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

pub struct ApiServer {
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

impl ApiServer {
    /// Starts a server that knows the Node `node` (with `pod_cidrs`).
    pub fn start(node: &str, pod_cidrs: &[&str]) -> ApiServer {
        ApiServer::start_with(node, pod_cidrs, None)
    }

    /// Like [`ApiServer::start`], speaking HTTPS through `tls`; the
    /// kubeconfigs it writes trust the CA bundle in `ca_file`.
    pub fn start_tls(
        node: &str,
        pod_cidrs: &[&str],
        tls: Arc<TlsServer>,
        ca_file: &std::path::Path,
    ) -> ApiServer {
        let https = Https {
            server: tls,
            ca_file: ca_file.to_path_buf(),
        };
        ApiServer::start_with(node, pod_cidrs, Some(https))
    }

    fn start_with(node: &str, pod_cidrs: &[&str], tls: Option<Https>) -> ApiServer {
        let node = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node, "uid": "uid-of-node", "resourceVersion": "1"},
            "spec": {"podCIDRs": pod_cidrs},
        });
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                version: 1,
                compacted_below: 0,
                node: node.clone(),
                nnc: None,
                events: vec![(1, "node", "ADDED", node)],
                log: Vec::new(),
                stamps: Vec::new(),
                queries: Vec::new(),
                fail_watches: None,
                node_exists: true,
                foreign_in_lists: Vec::new(),
                opaque: false,
                created: 0,
                block_type: "Reusable",
                hold_watches: false,
                watch_lag: None,
                event_at: std::collections::BTreeMap::new(),
                patch_bases: Vec::new(),
                generation: 0,
                fail_patches: None,
                inject_conflicts: 0,
                next_block: 0,
                controller: true,
                tokens: Vec::new(),
                client_certs: Vec::new(),
                tls_refused: Vec::new(),
            }),
            changed: Condvar::new(),
        });
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut server = ApiServer {
            addr,
            shared,
            running: None,
            tls,
        };
        server.serve(listener);
        server
    }

    /// Writes a kubeconfig pointing at this server.
    pub fn kubeconfig(&self, path: &std::path::Path) {
        self.kubeconfig_with_user(path, "    token: test-token");
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
            "apiVersion: v1\nkind: Config\ncurrent-context: test\nclusters:\n- name: test\n  cluster:\n{cluster}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\nusers:\n- name: test\n  user:\n{user}\n",
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

    pub fn state(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap()
    }

    /// Stops listening and cuts every open connection (watches included).
    pub fn stop(&mut self) {
        if let Some(running) = self.running.take() {
            running.stop(|| self.shared.changed.notify_all());
        }
    }

    /// Listens again on the same address.
    pub fn restart(&mut self) {
        let listener = http::rebind(self.addr);
        self.serve(listener);
    }

    /// Replaces `status.podCIDRs` (as a cloud controller would) and emits
    /// the MODIFIED event. Returns the new resource version.
    pub fn set_status(&self, pod_cidrs: Value) -> u64 {
        let mut state = self.state();
        if let Some(nnc) = state.nnc.as_mut() {
            nnc["status"]["podCIDRs"] = pod_cidrs;
        }
        state.record_nnc("MODIFIED");
        let version = state.version;
        drop(state);
        self.shared.changed.notify_all();
        version
    }

    /// Delivers an old version of the object to open watches again, as a
    /// late event would arrive (the stream position advances, the object's
    /// `resourceVersion` stays old).
    pub fn deliver_late(&self, object: Value) {
        let mut state = self.state();
        let position = state.bump();
        state.push_event(position, "nnc", "MODIFIED", object);
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Deletes the NodeNetworkConfig (someone else did), with its DELETED event.
    pub fn delete_nnc(&self) {
        let mut state = self.state();
        if let Some(mut gone) = state.nnc.take() {
            let version = state.bump();
            gone["metadata"]["resourceVersion"] = json!(state.rv(version));
            state.push_event(version, "nnc", "DELETED", gone);
        }
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Changes the state under the lock and wakes open watches.
    pub fn with_state<T>(&self, change: impl FnOnce(&mut State) -> T) -> T {
        let mut state = self.state();
        let out = change(&mut state);
        drop(state);
        self.shared.changed.notify_all();
        out
    }

    /// Someone deletes the NodeNetworkConfig and creates it again at once
    /// with `status` (a new uid, an empty spec).
    pub fn recreate_nnc(&self, status: Value) {
        self.with_state(|state| {
            let Some(old) = state.nnc.clone() else { return };
            let version = state.bump();
            let mut gone = old.clone();
            gone["metadata"]["resourceVersion"] = json!(state.rv(version));
            state.push_event(version, "nnc", "DELETED", gone);
            let metadata = &old["metadata"];
            let mut fresh = json!({
                "apiVersion": "networking.gke.io/v1",
                "kind": "NodeNetworkConfig",
                "metadata": {"name": metadata["name"], "ownerReferences": metadata["ownerReferences"]},
                "spec": {},
                "status": {"podCIDRs": status},
            });
            fresh["metadata"]["uid"] = json!(state.new_uid());
            state.nnc = Some(fresh);
            state.record_nnc("ADDED");
        });
    }

    /// Deletes the Node (DELETED), and the NodeNetworkConfig it owns with
    /// it, as the garbage collector does; `recreate_node` brings one back.
    pub fn delete_node(&self) {
        self.with_state(|state| {
            let version = state.bump();
            let mut gone = state.node.clone();
            gone["metadata"]["resourceVersion"] = json!(state.rv(version));
            state.push_event(version, "node", "DELETED", gone);
            state.node_exists = false;
            let uid = state.node["metadata"]["uid"].clone();
            let owned = state.nnc.as_ref().is_some_and(|nnc| {
                nnc["metadata"]["ownerReferences"]
                    .as_array()
                    .is_some_and(|owners| owners.iter().any(|o| o["uid"] == uid))
            });
            if owned && let Some(mut collected) = state.nnc.take() {
                let version = state.bump();
                collected["metadata"]["resourceVersion"] = json!(state.rv(version));
                state.push_event(version, "nnc", "DELETED", collected);
            }
        });
    }

    /// Creates the Node again (a new uid) with `cidrs`.
    pub fn recreate_node(&self, cidrs: &[&str]) {
        self.with_state(|state| {
            state.node["metadata"]["uid"] = json!(state.new_uid());
            state.node["spec"]["podCIDRs"] = json!(cidrs);
            state.node_exists = true;
            state.record_node("ADDED");
        });
    }

    /// An object of another node appears in open watches (and, with
    /// `in_lists`, in every list): a proxy that ignores the field selector.
    pub fn inject_foreign(&self, kind: &'static str, object: Value, in_lists: bool) {
        self.with_state(|state| {
            let version = state.bump();
            let mut object = object;
            object["metadata"]["resourceVersion"] = json!(state.rv(version));
            state
                .events
                .push((version, kind, "MODIFIED", object.clone()));
            if in_lists {
                state.foreign_in_lists.push((kind, object));
            }
        });
    }

    /// etcd restored from a backup taken at `snapshot` (a copy of the
    /// NodeNetworkConfig as it was then, with its version): versions go
    /// back to it, history after it is gone, open watches end, and a watch
    /// from a later version is answered `ResourceVersionTooLarge`.
    pub fn restore(&self, snapshot: Value) {
        self.with_state(|state| {
            let position = state
                .position(
                    snapshot["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap_or(""),
                )
                .unwrap_or(1);
            state.version = position;
            state
                .events
                .retain(|(version, _, _, _)| *version <= position);
            state.nnc = Some(snapshot);
            state.generation += 1;
        });
    }

    /// Forces watches from older versions to get 410 Gone.
    pub fn compact(&self) {
        let mut state = self.state();
        state.compacted_below = state.version + 1;
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Waits until `condition` holds on the state (re-checked on every change).
    pub fn wait_until(&self, what: &str, timeout: Duration, condition: impl Fn(&State) -> bool) {
        super::poll(timeout, || condition(&self.state()).then_some(()))
            .unwrap_or_else(|| panic!("timed out waiting for {what}"));
    }

    fn serve(&mut self, listener: TcpListener) {
        let shared = Arc::clone(&self.shared);
        let tls = self.tls.as_ref().map(|https| Arc::clone(&https.server));
        self.running = Some(http::Acceptor::spawn(listener, move |stream, stop| {
            connection(stream, tls.as_deref(), &shared, stop)
        }));
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl State {
    /// The NodeNetworkConfig's `spec.allocations[network].pods`.
    pub fn pods(&self, network: &str) -> Option<i64> {
        self.nnc.as_ref()?["spec"]["allocations"]
            .as_array()?
            .iter()
            .find(|a| a["network"] == network)
            .and_then(|a| a["pods"].as_i64())
    }

    /// CIDRs in `status.podCIDRs`.
    pub fn status_cidrs(&self) -> Vec<String> {
        self.nnc
            .as_ref()
            .and_then(|nnc| nnc["status"]["podCIDRs"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|c| c["cidr"].as_str().map(str::to_string))
            .collect()
    }

    /// The NodeNetworkConfig's `metis.x-k8s.io/serving` annotation.
    pub fn serving(&self) -> Option<String> {
        self.nnc.as_ref()?["metadata"]["annotations"]["metis.x-k8s.io/serving"]
            .as_str()
            .map(str::to_string)
    }

    /// CIDRs in `spec.releasableCIDRs`.
    pub fn releasable_cidrs(&self) -> Vec<String> {
        self.nnc
            .as_ref()
            .and_then(|nnc| nnc["spec"]["releasableCIDRs"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|c| c["cidr"].as_str().map(str::to_string))
            .collect()
    }

    /// Records one answered request.
    fn note(&mut self, method: &str, request: &Request, status: u16) {
        self.log
            .push((method.to_string(), request.path.clone(), status));
        self.stamps.push(Instant::now());
        self.queries.push(request.raw_query.clone());
    }

    /// When the requests matching (method, status) were answered.
    pub fn times(&self, method: &str, status: u16) -> Vec<Instant> {
        self.log
            .iter()
            .zip(&self.stamps)
            .filter(|((m, _, s), _)| m == method && *s == status)
            .map(|(_, at)| *at)
            .collect()
    }

    pub fn count(&self, method: &str, status: u16) -> usize {
        self.log
            .iter()
            .filter(|(m, _, s)| m == method && *s == status)
            .count()
    }

    /// Records an event at stream position `version`, now.
    fn push_event(&mut self, version: u64, kind: &'static str, event: &'static str, object: Value) {
        self.events.push((version, kind, event, object));
        self.event_at.insert(version, Instant::now());
    }

    /// Whether open watches may send the event at `version` yet.
    fn due(&self, version: u64) -> bool {
        !self.hold_watches
            && self.watch_lag.is_none_or(|lag| {
                self.event_at
                    .get(&version)
                    .is_none_or(|at| at.elapsed() >= lag)
            })
    }

    fn bump(&mut self) -> u64 {
        self.version += 1;
        self.version
    }

    /// The resource version of stream position `position`: its digits, or
    /// an opaque string that sorts unlike the positions.
    pub fn rv(&self, position: u64) -> String {
        match self.opaque {
            false => position.to_string(),
            true => format!("{:x}.{position}", position.wrapping_mul(0x9e37_79b9) % 4093),
        }
    }

    /// The stream position of a resource version (either spelling).
    pub fn position(&self, rv: &str) -> Option<u64> {
        rv.rsplit('.').next()?.parse().ok()
    }

    fn new_uid(&mut self) -> String {
        self.created += 1;
        format!("uid-{}", self.created)
    }

    fn record_nnc(&mut self, kind: &'static str) {
        let version = self.bump();
        let rv = self.rv(version);
        if let Some(nnc) = self.nnc.as_mut() {
            nnc["metadata"]["resourceVersion"] = json!(rv);
            let copy = nnc.clone();
            self.push_event(version, "nnc", kind, copy);
        }
    }

    fn record_node(&mut self, kind: &'static str) {
        let version = self.bump();
        self.node["metadata"]["resourceVersion"] = json!(self.rv(version));
        let copy = self.node.clone();
        self.push_event(version, "node", kind, copy);
    }

    /// The simulated cloud controller: grow the status to the requested
    /// pods with /28 blocks, and drop released blocks from it.
    fn reconcile(&mut self) {
        if !self.controller {
            return;
        }
        let Some(nnc) = self.nnc.as_ref() else { return };
        let releasable = self.releasable_cidrs();
        let mut status: Vec<Value> = nnc["status"]["podCIDRs"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let before = status.len();
        status.retain(|c| {
            !releasable
                .iter()
                .any(|r| Some(r.as_str()) == c["cidr"].as_str())
        });
        let mut changed = status.len() != before;
        let pods = self.pods("default").unwrap_or(0);
        let live = i64::try_from(status.len()).unwrap();
        let mut capacity = 16 * live;
        while pods > capacity {
            let block = self.next_block;
            self.next_block += 1;
            let cidr = format!("198.19.{}.{}/28", block / 16, (block % 16) * 16);
            status.push(json!({
                "id": format!("pod-cidr-{block}"),
                "network": "default",
                "cidr": cidr,
                "type": self.block_type,
                "condition": {"type": "Ready", "status": "True", "reason": "PodCIDRReady"},
            }));
            capacity += 16;
            changed = true;
        }
        if changed {
            if let Some(nnc) = self.nnc.as_mut() {
                nnc["status"]["podCIDRs"] = Value::Array(status);
            }
            self.record_nnc("MODIFIED");
        }
    }
}

fn respond(stream: &mut dyn Stream, status: u16, body: &Value) {
    respond_after(stream, status, body, None);
}

/// Answers with an optional `Retry-After` (seconds).
fn respond_after(stream: &mut dyn Stream, status: u16, body: &Value, retry_after: Option<u64>) {
    let retry = retry_after
        .map(|s| format!("Retry-After: {s}\r\n"))
        .unwrap_or_default();
    let headers = format!("{retry}Connection: close\r\n");
    http::respond(stream, status, &body.to_string(), &headers);
}

fn status_body(code: u16, reason: &str) -> Value {
    http::failure(code, reason, reason)
}

/// Serves one connection (after its TLS handshake, with `tls`), then cuts it
/// (the acceptor keeps a clone for `stop`: closing needs a shutdown).
fn connection(tcp: TcpStream, tls: Option<&TlsServer>, shared: &Shared, stop: &AtomicBool) {
    let closer = tcp.try_clone();
    let mut stream: Box<dyn Stream> = match tls {
        None => Box::new(tcp),
        Some(tls) => match tls.accept(tcp) {
            Accepted::Up { stream, client } => {
                let mut state = shared.state.lock().unwrap();
                if let Some(cert) = client
                    && state.client_certs.last() != Some(&cert)
                {
                    state.client_certs.push(cert);
                }
                stream
            }
            Accepted::Refused(why) => {
                shared.state.lock().unwrap().tls_refused.push(why);
                shared.changed.notify_all();
                if let Ok(closer) = closer {
                    let _ = closer.shutdown(Shutdown::Both);
                }
                return;
            }
        },
    };
    handle(stream.as_mut(), shared, stop);
    stream.finish();
    if let Ok(closer) = closer {
        let _ = closer.shutdown(Shutdown::Both);
    }
}

fn handle(stream: &mut dyn Stream, shared: &Shared, stop: &AtomicBool) {
    let Some(request) = read_request(&mut BufReader::new(&mut *stream)) else {
        return;
    };
    if stop.load(Ordering::SeqCst) {
        return;
    }
    if !request.token.is_empty() {
        let mut state = shared.state.lock().unwrap();
        if state.tokens.last() != Some(&request.token) {
            state.tokens.push(request.token.clone());
        }
    }
    let kind = if request.path.starts_with(NNC_COLLECTION) {
        "nnc"
    } else if request.path.starts_with(NODE_COLLECTION) {
        "node"
    } else {
        respond(stream, 404, &status_body(404, "NotFound"));
        return;
    };
    let is_watch = request.method == "GET" && request.param("watch") == Some("true");
    let fault = {
        let mut state = shared.state.lock().unwrap();
        let fault = match (is_watch, request.method.as_str()) {
            (true, _) => state.fail_watches,
            (false, "PATCH") => state.fail_patches,
            _ => None,
        };
        if let Some((status, _)) = fault {
            let method = if is_watch { "WATCH" } else { "PATCH" };
            state.note(method, &request, status);
        }
        fault
    };
    if let Some((status, retry_after)) = fault {
        shared.changed.notify_all();
        respond_after(
            stream,
            status,
            &status_body(status, "Injected"),
            retry_after,
        );
        return;
    }
    if is_watch {
        watch(stream, shared, stop, kind, &request);
        return;
    }
    let (status, body) = {
        let mut state = shared.state.lock().unwrap();
        let answer = answer(&mut state, kind, &request);
        state.note(&request.method, &request, answer.0);
        answer
    };
    shared.changed.notify_all();
    respond(stream, status, &body);
}

fn answer(state: &mut State, kind: &'static str, request: &Request) -> (u16, Value) {
    let is_collection = request.path == NNC_COLLECTION || request.path == NODE_COLLECTION;
    let object = match kind {
        "nnc" => state.nnc.clone(),
        _ => state.node_exists.then(|| state.node.clone()),
    };
    match (request.method.as_str(), is_collection) {
        ("GET", true) => {
            let foreign = state
                .foreign_in_lists
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, object)| object.clone());
            let items: Vec<Value> = object.into_iter().chain(foreign).collect();
            (
                200,
                json!({"metadata": {"resourceVersion": state.rv(state.version)}, "items": items}),
            )
        }
        ("GET", false) => match object {
            Some(object) => (200, object),
            None => (404, status_body(404, "NotFound")),
        },
        ("POST", true) if kind == "nnc" => {
            if state.nnc.is_some() {
                return (409, status_body(409, "AlreadyExists"));
            }
            let Ok(mut created) = serde_json::from_slice::<Value>(&request.body) else {
                return (400, status_body(400, "BadRequest"));
            };
            created["status"] = json!({"podCIDRs": []});
            created["metadata"]["uid"] = json!(state.new_uid());
            state.nnc = Some(created);
            state.record_nnc("ADDED");
            state.reconcile();
            (201, state.nnc.clone().unwrap_or_default())
        }
        ("PATCH", false) if kind == "nnc" => {
            let Ok(patch) = serde_json::from_slice::<Value>(&request.body) else {
                return (400, status_body(400, "BadRequest"));
            };
            let Some(current) = state.nnc.clone() else {
                return (404, status_body(404, "NotFound"));
            };
            let precondition = patch["metadata"]["resourceVersion"].as_str();
            state
                .patch_bases
                .push(precondition.unwrap_or_default().to_string());
            let stale = precondition
                .is_some_and(|v| Some(v) != current["metadata"]["resourceVersion"].as_str());
            if state.inject_conflicts > 0 || stale {
                state.inject_conflicts = state.inject_conflicts.saturating_sub(1);
                return (409, status_body(409, "Conflict"));
            }
            let mut merged = current;
            merge_patch(&mut merged, &patch);
            state.nnc = Some(merged);
            state.record_nnc("MODIFIED");
            state.reconcile();
            (200, state.nnc.clone().unwrap_or_default())
        }
        _ => (405, status_body(405, "MethodNotAllowed")),
    }
}

fn watch(
    stream: &mut dyn Stream,
    shared: &Shared,
    stop: &AtomicBool,
    kind: &'static str,
    request: &Request,
) {
    let from: u64 = {
        let state = shared.state.lock().unwrap();
        request
            .param("resourceVersion")
            .and_then(|v| state.position(v))
            .unwrap_or(0)
    };
    let seconds: u64 = request
        .param("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    // Read with the version check, under one lock: a restore between the
    // two would leave this watch open from a version the server no longer
    // reaches, silent (a real API server drops every watch at a restore).
    let generation = {
        let mut state = shared.state.lock().unwrap();
        state.note("WATCH", request, 200);
        let too_large = from > state.version;
        if from < state.compacted_below || too_large {
            drop(state);
            shared.changed.notify_all();
            let body = match too_large {
                // What the API server says after an etcd restore.
                true => json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": "Too large resource version", "reason": "Timeout",
                    "details": {"causes": [{"reason": "ResourceVersionTooLarge"}]}, "code": 504}),
                false => status_body(410, "Expired"),
            };
            if http::start_watch(stream).is_ok() {
                http::end_watch_with_error(stream, &body);
            }
            return;
        }
        state.generation
    };
    shared.changed.notify_all();
    if http::start_watch(stream).is_err() {
        return;
    }
    let mut sent = from;
    let mut state = shared.state.lock().unwrap();
    loop {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        if state.generation != generation {
            // Restored from a backup: the API server drops its watches.
            drop(state);
            http::end_watch(stream);
            return;
        }
        if state.compacted_below > sent {
            // History this watch stands on was compacted: end it; the
            // client's next watch from its version gets 410 Gone.
            drop(state);
            http::end_watch(stream);
            return;
        }
        let pending: Vec<(u64, &'static str, Value)> = state
            .events
            .iter()
            .filter(|(version, k, _, _)| *k == kind && *version > sent)
            .take_while(|(version, _, _, _)| state.due(*version))
            .map(|(version, _, event, object)| (*version, *event, object.clone()))
            .collect();
        if !pending.is_empty() {
            drop(state);
            for (version, event, object) in pending {
                let line = format!("{}\n", json!({"type": event, "object": object}));
                if write_chunk(stream, &line).is_err() {
                    return;
                }
                sent = version;
            }
            state = shared.state.lock().unwrap();
            continue;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            drop(state);
            http::end_watch(stream);
            return;
        }
        state = shared
            .changed
            .wait_timeout(state, left.min(Duration::from_millis(50)))
            .unwrap()
            .0;
    }
}
