//! The multi-object loopback API server (tests/common/kube_api.rs) behaves
//! like the API server where the node daemon and `metis controller` depend
//! on it: asserted through the project's own client (GET, POST, merge
//! PATCH, watch) and raw HTTP (PUT, DELETE), and with a real daemon in NNC
//! mode finding and creating its objects there.

#![cfg(feature = "kube")]

use crate::common;

use std::time::Duration;

use common::kube_api::{BLOCKS, Key, KubeApi, LEASES, MAX_OBJECT, NNCS, NODES, serve_custom};
use common::{Plugin, TestDaemon, TestDir, assert_ok, json};
use metis::kube::client::{ApiClient, KubeError, WatchEvent};
use serde_json::{Value, json};

const NNC_PATH: &str = "/apis/networking.gke.io/v1/nodenetworkconfigs";
const NODE_PATH: &str = "/api/v1/nodes";
const LEASE_PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases";
const POOL_PATH: &str = "/apis/metis.x-k8s.io/v1alpha1/metispools";
const BLOCK_PATH: &str = "/apis/metis.x-k8s.io/v1alpha1/metisblocks";

fn client(api: &KubeApi, dir: &TestDir) -> ApiClient {
    let path = dir.join("kubeconfig");
    api.kubeconfig(&path);
    let config = metis::kube::config::from_kubeconfig(&path).unwrap();
    ApiClient::new(&config, Duration::from_secs(30)).unwrap()
}

fn code(err: &KubeError) -> u16 {
    match err {
        KubeError::Status { code, .. } => *code,
        other => panic!("not a status: {other}"),
    }
}

fn rv(object: &Value) -> String {
    object["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string()
}

fn nnc(name: &str) -> Value {
    json!({"apiVersion": "networking.gke.io/v1", "kind": "NodeNetworkConfig",
           "metadata": {"name": name}, "spec": {"allocations": [{"network": "default", "pods": 3}]},
           "status": {"podCIDRs": [{"cidr": "198.18.0.0/28"}]}})
}

/// Sends `request` as written on a fresh connection; the whole answer,
/// read until the server closes it.
fn raw(api: &KubeApi, request: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(api.addr).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

/// The names of a list's items.
fn item_names(list: &Value) -> Vec<&str> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap())
        .collect()
}

/// The next `n` events of `path`'s watch.
fn events(client: &ApiClient, path: &str, n: usize) -> Vec<WatchEvent> {
    client
        .watch(path)
        .unwrap()
        .take(n)
        .map(Result::unwrap)
        .collect()
}

#[test]
fn objects_are_created_read_and_listed_under_one_version_counter() {
    let dir = TestDir::new("kapi-crud");
    let api = KubeApi::start();
    let client = client(&api, &dir);
    let created = client.post(NNC_PATH, &nnc("n1")).unwrap();
    // A custom resource's status is written through the subresource only.
    assert!(created.get("status").is_none(), "{created}");
    assert_eq!(created["metadata"]["generation"], 1);
    let err = client.post(NNC_PATH, &nnc("n1")).unwrap_err();
    assert_eq!(code(&err), 409);
    assert!(err.to_string().contains("AlreadyExists"), "{err}");
    client.post(NNC_PATH, &nnc("n2")).unwrap();
    let node = client
        .post(NODE_PATH, &json!({"metadata": {"name": "n1"}, "spec": {}}))
        .unwrap();
    // One counter across kinds: each write is the next version.
    assert_eq!(
        [rv(&created), rv(&node)],
        ["1".to_string(), "3".to_string()]
    );
    let got = client.get(&format!("{NNC_PATH}/n1")).unwrap();
    assert_eq!(got, created);
    assert_eq!(
        code(&client.get(&format!("{NNC_PATH}/n9")).unwrap_err()),
        404
    );
    let all = client.get(NNC_PATH).unwrap();
    assert_eq!(all["metadata"]["resourceVersion"], "3");
    assert_eq!(all["kind"], "NodeNetworkConfigList");
    assert_eq!(all["items"].as_array().unwrap().len(), 2);
    // The daemon's list: its own object only (the selector URL-encoded).
    let one = client
        .get(&format!("{NNC_PATH}?fieldSelector=metadata.name%3Dn2"))
        .unwrap();
    assert_eq!(item_names(&one), ["n2"]);
    let state = api.state();
    assert_eq!(state.count("create", NNCS), 3);
    assert_eq!(state.count("get", NNCS), 2);
    assert_eq!(state.count("list", NNCS), 2);
    assert_eq!(state.count("create", NODES), 1);
}

#[test]
fn put_needs_the_current_version_and_the_status_subresource_is_separate() {
    let api = KubeApi::start();
    let (status, created) = api.call("POST", NNC_PATH, Some(&nnc("n1")));
    assert_eq!(status, 201);
    // A custom resource refuses an update without a version.
    let mut body = created.clone();
    body["metadata"]["resourceVersion"] = json!("");
    assert_eq!(
        api.call("PUT", &format!("{NNC_PATH}/n1"), Some(&body)).0,
        422
    );
    // A stale version is a conflict and changes nothing.
    let mut status_body = created.clone();
    status_body["status"] = json!({"podCIDRs": [{"cidr": "198.18.0.16/28"}]});
    status_body["spec"] = json!({"allocations": [{"network": "default", "pods": 99}]});
    status_body["metadata"]["resourceVersion"] = json!("999");
    let path = format!("{NNC_PATH}/n1/status");
    let (status, refused) = api.call("PUT", &path, Some(&status_body));
    assert_eq!(
        (status, refused["reason"].as_str()),
        (409, Some("Conflict"))
    );
    // With the version: only the status changes, and the generation stays.
    status_body["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"].clone();
    let (status, after) = api.call("PUT", &path, Some(&status_body));
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["status"]["podCIDRs"][0]["cidr"], "198.18.0.16/28");
    assert_eq!(after["spec"]["allocations"][0]["pods"], 3);
    assert_eq!(after["metadata"]["generation"], 1);
    assert_ne!(rv(&after), rv(&created));
    // A write of the main resource keeps the status and counts the spec
    // change as a new generation.
    let mut spec_body = after.clone();
    spec_body["spec"]["allocations"][0]["pods"] = json!(7);
    spec_body["status"] = json!({"podCIDRs": []});
    let (status, main) = api.call("PUT", &format!("{NNC_PATH}/n1"), Some(&spec_body));
    assert_eq!(status, 200, "{main}");
    assert_eq!(main["status"], after["status"]);
    assert_eq!(main["metadata"]["generation"], 2);
    assert_eq!(main["metadata"]["uid"], created["metadata"]["uid"]);
    // Writing the same again is no new version (and no event).
    let before = api.state().version;
    let (status, same) = api.call("PUT", &format!("{NNC_PATH}/n1"), Some(&main));
    assert_eq!((status, rv(&same)), (200, rv(&main)));
    assert_eq!(api.state().version, before);
    // A direct edit counts generations as those writes would: a status
    // change keeps it, a spec change is the next one, whatever `change`
    // writes there itself.
    let edit = |change: fn(&mut Value)| {
        api.with_state(|s| s.edit(&Key::cluster(NNCS, "n1"), change))
            .unwrap()
    };
    let status_only = edit(|n| n["status"] = json!({"podCIDRs": []}));
    assert_eq!(status_only["metadata"]["generation"], 2);
    assert_ne!(rv(&status_only), rv(&main));
    let spec = edit(|n| {
        n["spec"]["allocations"][0]["pods"] = json!(9);
        n["metadata"]["generation"] = json!(40);
    });
    assert_eq!(spec["metadata"]["generation"], 3);
    assert_eq!(spec["spec"]["allocations"][0]["pods"], 9);
    let unchanged = edit(|n| n["metadata"]["generation"] = json!(1));
    assert_eq!(
        (rv(&unchanged), &unchanged["metadata"]["generation"]),
        (rv(&spec), &json!(3))
    );
    // A built-in resource takes an unconditional update; a missing object
    // is 404; a body naming another object is refused.
    let lease = json!({"metadata": {"name": "l"}, "spec": {"holderIdentity": "a"}});
    assert_eq!(
        api.call("PUT", &format!("{LEASE_PATH}/l"), Some(&lease)).0,
        404
    );
    assert_eq!(api.call("POST", LEASE_PATH, Some(&lease)).0, 201);
    let taken = json!({"metadata": {"name": "l"}, "spec": {"holderIdentity": "b"}});
    let (status, lease) = api.call("PUT", &format!("{LEASE_PATH}/l"), Some(&taken));
    assert_eq!(
        (status, &lease["spec"]["holderIdentity"]),
        (200, &json!("b"))
    );
    assert_eq!(lease["metadata"]["namespace"], "kube-system");
    assert_eq!(
        api.call("PUT", &format!("{LEASE_PATH}/other"), Some(&taken))
            .0,
        404
    );
    let state = api.state();
    assert_eq!(state.count("update", "nodenetworkconfigs/status"), 2);
    assert_eq!(state.count("update", NNCS), 3);
    assert_eq!(state.count("update", LEASES), 3);
}

#[test]
fn merge_patches_honour_the_version_they_carry() {
    let dir = TestDir::new("kapi-patch");
    let api = KubeApi::start();
    let client = client(&api, &dir);
    let created = client.post(NNC_PATH, &nnc("n1")).unwrap();
    let path = format!("{NNC_PATH}/n1");
    let stale = json!({"metadata": {"resourceVersion": "77"}, "spec": {"allocations": []}});
    assert_eq!(code(&client.merge_patch(&path, &stale).unwrap_err()), 409);
    let patch = json!({"metadata": {"resourceVersion": rv(&created)},
        "spec": {"releasableCIDRs": [{"cidr": "198.18.0.0/28"}]},
        "status": {"podCIDRs": [{"cidr": "198.18.9.0/28"}]}});
    let patched = client.merge_patch(&path, &patch).unwrap();
    assert_eq!(patched["spec"]["allocations"][0]["pods"], 3);
    assert_eq!(
        patched["spec"]["releasableCIDRs"][0]["cidr"],
        "198.18.0.0/28"
    );
    // The main resource's patch does not reach the status.
    assert!(patched.get("status").is_none(), "{patched}");
    // Without a version the patch is unconditional; null removes a field.
    let status = client
        .merge_patch(
            &format!("{path}/status"),
            &json!({"status": {"podCIDRs": [{"cidr": "198.18.9.0/28"}]}, "spec": {"allocations": null}}),
        )
        .unwrap();
    assert_eq!(status["status"]["podCIDRs"][0]["cidr"], "198.18.9.0/28");
    assert_eq!(status["spec"]["allocations"][0]["pods"], 3);
    let answer = raw(
        &api,
        &format!(
            "PATCH {path} HTTP/1.1\r\nContent-Type: application/json-patch+json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        ),
    );
    assert!(answer.starts_with("HTTP/1.1 415"), "{answer}");
    assert_eq!(api.state().count("patch", "nodenetworkconfigs/status"), 1);
}

#[test]
fn watches_stream_changes_in_order_from_a_version() {
    let dir = TestDir::new("kapi-watch");
    let api = KubeApi::start();
    let client = client(&api, &dir);
    let first = client.post(NNC_PATH, &nnc("n1")).unwrap();
    client.post(NNC_PATH, &nnc("n2")).unwrap();
    client
        .merge_patch(
            &format!("{NNC_PATH}/n1"),
            &json!({"spec": {"allocations": []}}),
        )
        .unwrap();
    assert_eq!(api.call("DELETE", &format!("{NNC_PATH}/n1"), None).0, 200);
    // From the first version: what came after it, in order.
    let path = format!("{NNC_PATH}?watch=1&resourceVersion={}", rv(&first));
    let seen: Vec<(String, String, String)> = events(&client, &path, 3)
        .into_iter()
        .map(|e| {
            let name = e.object["metadata"]["name"].as_str().unwrap().to_string();
            (e.kind, name, rv(&e.object))
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("ADDED".into(), "n2".into(), "2".into()),
            ("MODIFIED".into(), "n1".into(), "3".into()),
            ("DELETED".into(), "n1".into(), "4".into())
        ]
    );
    // The daemon's watch: one name only. A later change reaches an open
    // watch.
    let mine = format!("{NNC_PATH}?fieldSelector=metadata.name%3Dn2&watch=true&resourceVersion=4");
    let mut stream = client.watch(&mine).unwrap();
    client
        .merge_patch(
            &format!("{NNC_PATH}/n2"),
            &json!({"spec": {"allocations": []}}),
        )
        .unwrap();
    let next = stream.next().unwrap().unwrap();
    assert_eq!(
        (next.kind.as_str(), rv(&next.object)),
        ("MODIFIED", "5".into())
    );
    // No version: the current objects first.
    let start = events(&client, &format!("{NNC_PATH}?watch=true"), 1);
    assert_eq!(start[0].kind, "ADDED");
    assert_eq!(start[0].object["metadata"]["name"], "n2");
    // A bookmark when asked for, at the server's timeout.
    let quiet = format!(
        "{NNC_PATH}?watch=true&resourceVersion=5&allowWatchBookmarks=true&timeoutSeconds=1"
    );
    let marks = events(&client, &quiet, 1);
    assert_eq!(marks[0].kind, "BOOKMARK");
    assert_eq!(rv(&marks[0].object), "5");
    // Nodes' watch sees no NNC change.
    api.with_state(|s| {
        s.create(NODES, "", &json!({"metadata": {"name": "n2"}}))
            .unwrap();
    });
    let nodes = events(
        &client,
        &format!("{NODE_PATH}?watch=true&resourceVersion=5"),
        1,
    );
    assert_eq!(nodes[0].object["kind"], "Node");
    assert_eq!(api.state().count("watch", NNCS), 4);
}

#[test]
fn compacted_versions_are_gone_and_open_watches_end() {
    let dir = TestDir::new("kapi-compact");
    let api = KubeApi::start();
    let client = client(&api, &dir);
    client.post(NNC_PATH, &nnc("n1")).unwrap();
    let mut open = client
        .watch(&format!("{NNC_PATH}?watch=true&resourceVersion=1"))
        .unwrap();
    client.post(NNC_PATH, &nnc("n2")).unwrap();
    assert_eq!(open.next().unwrap().unwrap().kind, "ADDED");
    api.with_state(|s| s.compact());
    assert!(open.next().is_none(), "an open watch ends at compaction");
    let gone = events(
        &client,
        &format!("{NNC_PATH}?watch=true&resourceVersion=1"),
        1,
    );
    assert_eq!(gone[0].kind, "ERROR");
    assert_eq!(gone[0].object["code"], 410);
    assert_eq!(gone[0].object["reason"], "Expired");
    let list = client
        .get(&format!("{NNC_PATH}?resourceVersion=1"))
        .unwrap_err();
    assert_eq!(code(&list), 410);
    // The current version still watches.
    let now = client.get(NNC_PATH).unwrap();
    let path = format!(
        "{NNC_PATH}?watch=true&resourceVersion={}",
        now["metadata"]["resourceVersion"].as_str().unwrap()
    );
    let mut fresh = client.watch(&path).unwrap();
    client.post(NNC_PATH, &nnc("n3")).unwrap();
    assert_eq!(
        fresh.next().unwrap().unwrap().object["metadata"]["name"],
        "n3"
    );
    let ahead = events(
        &client,
        &format!("{NNC_PATH}?watch=true&resourceVersion=999"),
        1,
    );
    assert_eq!(ahead[0].object["code"], 504);
}

/// etcd restored from a backup taken before a compaction: the restored
/// version lists and watches again (only older versions are gone), so a
/// client that relists is not sent round a list-and-410 loop.
#[test]
fn a_restore_past_a_compaction_watches_from_the_restored_version() {
    let dir = TestDir::new("kapi-restore");
    let api = KubeApi::start();
    let client = client(&api, &dir);
    client.post(NNC_PATH, &nnc("n1")).unwrap();
    let backup = api.state().backup();
    client.post(NNC_PATH, &nnc("n2")).unwrap();
    api.with_state(|s| {
        s.compact();
        s.restore(backup);
    });
    let list = client.get(NNC_PATH).unwrap();
    assert_eq!(item_names(&list), ["n1"]);
    let version = list["metadata"]["resourceVersion"].as_str().unwrap();
    let path = format!("{NNC_PATH}?watch=true&resourceVersion={version}");
    let mut watch = client.watch(&path).unwrap();
    client.post(NNC_PATH, &nnc("n3")).unwrap();
    let next = watch.next().unwrap().unwrap();
    assert_eq!(
        (next.kind.as_str(), &next.object["metadata"]["name"]),
        ("ADDED", &json!("n3"))
    );
}

#[test]
fn deleting_an_owner_collects_its_dependents_and_preconditions_hold() {
    let api = KubeApi::start();
    let (_, node) = api.call(
        "POST",
        NODE_PATH,
        Some(&json!({"metadata": {"name": "n1"}})),
    );
    let owned = json!({"metadata": {"name": "n1", "ownerReferences": [{"apiVersion": "v1",
        "kind": "Node", "name": "n1", "uid": node["metadata"]["uid"], "controller": true}]}, "spec": {}});
    assert_eq!(api.call("POST", NNC_PATH, Some(&owned)).0, 201);
    assert_eq!(api.call("POST", NNC_PATH, Some(&nnc("other"))).0, 201);
    let stale = json!({"preconditions": {"resourceVersion": "1000"}});
    let path = format!("{NODE_PATH}/n1");
    assert_eq!(api.call("DELETE", &path, Some(&stale)).0, 409);
    let (status, gone) = api.call("DELETE", &path, None);
    assert_eq!((status, rv(&gone)), (200, "4".to_string()));
    let state = api.state();
    assert!(
        state.get(&Key::cluster(NNCS, "n1")).is_none(),
        "dependent kept"
    );
    assert!(state.get(&Key::cluster(NNCS, "other")).is_some());
    let kinds: Vec<(&str, &str)> = state
        .changes
        .iter()
        .skip(3)
        .map(|c| (c.key.resource, c.kind))
        .collect();
    assert_eq!(kinds, [(NODES, "DELETED"), (NNCS, "DELETED")]);
    drop(state);
    assert_eq!(api.call("DELETE", &path, None).0, 404);
}

#[test]
fn namespaces_names_and_bad_requests() {
    let api = KubeApi::start();
    let event = json!({"metadata": {"generateName": "n1."}, "reason": "PoolExhausted",
        "involvedObject": {"kind": "Node", "name": "n1"}});
    let events = "/api/v1/namespaces/default/events";
    let (status, made) = api.call("POST", events, Some(&event));
    assert_eq!(status, 201, "{made}");
    assert!(
        made["metadata"]["name"]
            .as_str()
            .unwrap()
            .starts_with("n1.")
    );
    assert_eq!(made["metadata"]["namespace"], "default");
    let (status, twice) = api.call("POST", events, Some(&event));
    assert_eq!(status, 201);
    assert_ne!(twice["metadata"]["name"], made["metadata"]["name"]);
    // The cluster-wide list of a namespaced kind; a namespace elsewhere.
    let (_, all) = api.call("GET", "/api/v1/events", None);
    assert_eq!(all["items"].as_array().unwrap().len(), 2);
    let (_, none) = api.call("GET", "/api/v1/namespaces/other/events", None);
    assert_eq!(none["items"], json!([]));
    let wrong = json!({"metadata": {"name": "x", "namespace": "other"}});
    assert_eq!(api.call("POST", events, Some(&wrong)).0, 400);
    // Cluster-scoped kinds have no namespace; Leases no status; no name.
    for path in [
        "/api/v1/namespaces/default/nodes",
        "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/l/status",
        "/apis/coordination.k8s.io/v1/leases/l",
        "/apis/networking.gke.io/v1/widgets",
        "/apis/metis.x-k8s.io/v1/metispools",
    ] {
        assert_eq!(api.call("GET", path, None).0, 404, "{path}");
    }
    assert_eq!(
        api.call("POST", POOL_PATH, Some(&json!({"spec": {}}))).0,
        400
    );
    assert_eq!(api.call("POST", POOL_PATH, Some(&json!([1]))).0, 400);
    assert_eq!(api.call("DELETE", POOL_PATH, None).0, 405);
    // Each is on record, so a client calling what is not served is seen.
    assert_eq!(api.state().unserved.len(), 6);
    let (status, _) = api.call(
        "GET",
        &format!("{NODE_PATH}?fieldSelector=spec.unschedulable%3Dtrue"),
        None,
    );
    assert_eq!(status, 400);
    let answer = raw(
        &api,
        &format!(
            "POST {POOL_PATH} HTTP/1.1\r\nContent-Length: 3\r\nConnection: close\r\n\r\n{{{{{{"
        ),
    );
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
}

#[test]
fn fault_hooks_fail_writes_and_stop_listening() {
    let dir = TestDir::new("kapi-faults");
    let mut api = KubeApi::start();
    let client = client(&api, &dir);
    api.with_state(|s| s.fail_writes = Some((2, 500, Some(NNCS))));
    // Other resources are untouched; the NNC's next two writes fail.
    client
        .post(NODE_PATH, &json!({"metadata": {"name": "n1"}}))
        .unwrap();
    assert_eq!(code(&client.post(NNC_PATH, &nnc("n1")).unwrap_err()), 500);
    assert_eq!(code(&client.post(NNC_PATH, &nnc("n1")).unwrap_err()), 500);
    let made = client.post(NNC_PATH, &nnc("n1")).unwrap();
    api.with_state(|s| s.fail_writes = Some((1, 409, None)));
    let path = format!("{NNC_PATH}/n1");
    let patch = json!({"metadata": {"resourceVersion": rv(&made)}, "spec": {"allocations": []}});
    assert_eq!(code(&client.merge_patch(&path, &patch).unwrap_err()), 409);
    client.merge_patch(&path, &patch).unwrap();
    assert_eq!(api.state().count("create", NNCS), 3);
    // Stopped: nothing answers and open watches end; restarted: served.
    let mut open = client
        .watch(&format!("{NNC_PATH}?watch=true&resourceVersion=100000"))
        .unwrap();
    assert_eq!(open.next().unwrap().unwrap().object["code"], 504);
    let mut open = client
        .watch(&format!("{NNC_PATH}?watch=true&resourceVersion=3"))
        .unwrap();
    api.stop();
    assert!(!matches!(open.next(), Some(Ok(_))), "the stream ends");
    assert!(matches!(client.get(&path), Err(KubeError::Transport(_))));
    api.restart();
    assert_eq!(client.get(&path).unwrap()["metadata"]["name"], "n1");
}

/// The node daemon in NNC mode finds its Node, creates its
/// NodeNetworkConfig owned by it, asks for pods, and serves an ADD from a
/// block written into the status.
#[test]
fn a_daemon_in_nnc_mode_finds_and_creates_its_objects_here() {
    let dir = TestDir::new("kapi-daemon");
    let api = KubeApi::start();
    let node = api.with_state(|s| {
        s.create(
            NODES,
            "",
            &json!({"metadata": {"name": "sim-1"}, "spec": {}}),
        )
        .unwrap()
    });
    let kubeconfig = dir.join("kubeconfig");
    api.kubeconfig(&kubeconfig);
    let kubeconfig = kubeconfig.display().to_string();
    let daemon = TestDaemon::start_with_env(
        &dir,
        &["--cidr-source", "nnc", "--monitor-interval", "100ms"],
        &[("KUBECONFIG", &kubeconfig), ("NODE_NAME", "sim-1")],
    );
    let key = Key::cluster(NNCS, "sim-1");
    api.wait_until("the daemon's NNC", Duration::from_secs(20), |s| {
        s.get(&key).is_some()
    });
    let made = api.state().get(&key).cloned().unwrap();
    assert_eq!(
        made["metadata"]["ownerReferences"][0]["uid"],
        node["metadata"]["uid"]
    );
    // One address of its own; the second ADD asks the cluster for more.
    let config = common::cluster::default_conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/30"}]]"#);
    let first = Plugin::new("ADD", "c1").run(&config);
    assert_ok(&first);
    let config2 = config.clone();
    let second = std::thread::spawn(move || Plugin::new("ADD", "c2").run(&config2));
    api.wait_until("a demand of 2 pods", Duration::from_secs(20), |s| {
        s.get(&key)
            .is_some_and(|n| n["spec"]["allocations"][0]["pods"].as_i64() >= Some(2))
    });
    api.with_state(|s| {
        let current = s.get(&key).cloned().unwrap();
        let mut body = current.clone();
        body["status"] = json!({"podCIDRs": [{"id": "b0", "network": "default",
            "cidr": "198.19.0.0/28", "condition": {"type": "Ready", "status": "True"}}]});
        s.update(&key, &body, true).unwrap();
    });
    let second = second.join().unwrap();
    assert_ok(&second);
    let address = json(&second)["ips"][0]["address"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(address.starts_with("198.19.0."), "{address}");
    let state = api.state();
    // It found its Node by GET, its NNC by a listed watch, and wrote only
    // its spec by merge PATCH.
    assert!(state.count("get", NODES) >= 1);
    assert!(state.count("list", NNCS) >= 1 && state.count("watch", NNCS) >= 1);
    assert!(state.count("patch", NNCS) >= 1);
    assert_eq!(state.count("patch", "nodenetworkconfigs/status"), 0);
    drop(state);
    drop(daemon);
}

#[test]
fn lists_are_paginated_from_one_snapshot_and_an_expired_continue_is_gone() {
    let dir = TestDir::new("kapi-pages");
    let api = KubeApi::start();
    let client = client(&api, &dir);
    for i in 0..5 {
        client.post(NNC_PATH, &nnc(&format!("n{i}"))).unwrap();
    }
    let names = |page: &Value| -> Vec<String> {
        page["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    let first = client.get(&format!("{NNC_PATH}?limit=2")).unwrap();
    assert_eq!(names(&first), ["n0", "n1"]);
    assert_eq!(first["metadata"]["remainingItemCount"], 3);
    let version = rv(&first);
    // Written between pages: the pages still show the first page's version.
    client.post(NNC_PATH, &nnc("n5")).unwrap();
    client
        .merge_patch(
            &format!("{NNC_PATH}/n3"),
            &json!({"spec": {"allocations": []}}),
        )
        .unwrap();
    let token = first["metadata"]["continue"].as_str().unwrap();
    let second = client
        .get(&format!("{NNC_PATH}?limit=2&continue={token}"))
        .unwrap();
    assert_eq!(names(&second), ["n2", "n3"]);
    assert_eq!(rv(&second), version);
    assert_eq!(second["items"][1]["spec"]["allocations"][0]["pods"], 3);
    let token = second["metadata"]["continue"].as_str().unwrap();
    let last = client
        .get(&format!("{NNC_PATH}?limit=2&continue={token}"))
        .unwrap();
    assert_eq!(names(&last), ["n4"]);
    assert!(last["metadata"].get("continue").is_none());
    // A token serves once (the rest moved to the next page's token), a
    // bad one is refused, and without a limit the list is whole and new.
    let used = client
        .get(&format!("{NNC_PATH}?limit=2&continue={token}"))
        .unwrap_err();
    assert_eq!(code(&used), 410);
    let bad = client
        .get(&format!("{NNC_PATH}?limit=2&continue=garbage"))
        .unwrap_err();
    assert_eq!(code(&bad), 400);
    assert_eq!(
        code(&client.get(&format!("{NNC_PATH}?limit=x")).unwrap_err()),
        400
    );
    assert_eq!(names(&client.get(NNC_PATH).unwrap()).len(), 6);
    // A compaction between pages expires the token: 410, list again.
    let first = client.get(&format!("{NNC_PATH}?limit=4")).unwrap();
    let token = first["metadata"]["continue"].as_str().unwrap().to_string();
    api.with_state(|s| s.compact());
    let expired = client
        .get(&format!("{NNC_PATH}?limit=4&continue={token}"))
        .unwrap_err();
    assert_eq!(code(&expired), 410);
    assert!(expired.to_string().contains("Expired"), "{expired}");
    assert!(metis::kube::worker::needs_relist(&expired));
}

#[test]
fn status_merge_patches_honour_the_version_and_change_only_the_status() {
    let api = KubeApi::start();
    let (_, created) = api.call("POST", NNC_PATH, Some(&nnc("n1")));
    let path = format!("{NNC_PATH}/n1/status");
    let patch = |version: &str| {
        json!({"metadata": {"resourceVersion": version, "labels": {"sneaked": "in"}},
               "spec": {"allocations": null},
               "status": {"podCIDRs": [{"cidr": "198.18.0.16/28"}]}})
    };
    let (status, refused) = api.call("PATCH", &path, Some(&patch("999")));
    assert_eq!(
        (status, refused["reason"].as_str()),
        (409, Some("Conflict"))
    );
    assert_eq!(api.state().version, 1, "a refused patch writes nothing");
    let (status, patched) = api.call("PATCH", &path, Some(&patch(&rv(&created))));
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["status"]["podCIDRs"][0]["cidr"], "198.18.0.16/28");
    // Only the status: spec, labels and generation are the stored ones.
    assert_eq!(patched["spec"], created["spec"]);
    assert!(patched["metadata"].get("labels").is_none(), "{patched}");
    assert_eq!(patched["metadata"]["generation"], 1);
    assert_eq!(rv(&patched), "2");
    // The same patch again: its version is now stale.
    assert_eq!(api.call("PATCH", &path, Some(&patch(&rv(&created)))).0, 409);
    assert_eq!(api.state().count("patch", "nodenetworkconfigs/status"), 3);
}

fn block(cidr_name: &str, node: &str, state: &str) -> Value {
    json!({"apiVersion": "metis.x-k8s.io/v1alpha1", "kind": "MetisBlock",
           "metadata": {"name": cidr_name, "labels": {"metis.x-k8s.io/pool": "p", "metis.x-k8s.io/node": node}},
           "spec": {"pool": "p", "network": "default", "cidr": "198.18.0.16/28", "node": node, "state": state, "reason": ""}})
}

/// MetisBlocks: name uniqueness is the claim (409 AlreadyExists), every
/// later write carries the version, a deleted block can be claimed again.
#[test]
fn metis_blocks_are_claimed_by_name_and_written_with_their_version() {
    let dir = TestDir::new("kapi-blocks");
    let api = KubeApi::start();
    let client = client(&api, &dir);
    let claimed = client
        .post(BLOCK_PATH, &block("v4-198-18-0-16-28", "n1", "Granted"))
        .unwrap();
    assert_eq!(claimed["kind"], "MetisBlock");
    assert_eq!(claimed["metadata"]["generation"], 1);
    let err = client
        .post(BLOCK_PATH, &block("v4-198-18-0-16-28", "n2", "Granted"))
        .unwrap_err();
    assert_eq!(code(&err), 409);
    assert!(err.to_string().contains("AlreadyExists"), "{err}");
    client
        .post(BLOCK_PATH, &block("v4-198-18-0-32-28", "n2", "Granted"))
        .unwrap();
    let path = format!("{BLOCK_PATH}/v4-198-18-0-16-28");
    let mut cooling = block("v4-198-18-0-16-28", "n1", "Cooling");
    assert_eq!(api.call("PUT", &path, Some(&cooling)).0, 422);
    cooling["metadata"]["resourceVersion"] = json!("2");
    assert_eq!(api.call("PUT", &path, Some(&cooling)).0, 409);
    cooling["metadata"]["resourceVersion"] = json!(rv(&claimed));
    let (status, cooled) = api.call("PUT", &path, Some(&cooling));
    assert_eq!((status, &cooled["spec"]["state"]), (200, &json!("Cooling")));
    assert_eq!(cooled["metadata"]["generation"], 2);
    // A pool's or a node's blocks by label.
    let mine = client
        .get(&format!(
            "{BLOCK_PATH}?labelSelector=metis.x-k8s.io%2Fnode%3Dn1"
        ))
        .unwrap();
    assert_eq!(item_names(&mine), ["v4-198-18-0-16-28"]);
    assert_eq!(mine["kind"], "MetisBlockList");
    // Deleted only at its version; then the name is free to claim again.
    let stale = json!({"preconditions": {"resourceVersion": rv(&claimed)}});
    assert_eq!(api.call("DELETE", &path, Some(&stale)).0, 409);
    let current = json!({"preconditions": {"resourceVersion": rv(&cooled)}});
    assert_eq!(api.call("DELETE", &path, Some(&current)).0, 200);
    let again = client
        .post(BLOCK_PATH, &block("v4-198-18-0-16-28", "n2", "Granted"))
        .unwrap();
    // The watch from the first claim: every change since, in order.
    let seen: Vec<(String, String)> = events(
        &client,
        &format!("{BLOCK_PATH}?watch=true&resourceVersion={}", rv(&claimed)),
        4,
    )
    .into_iter()
    .map(|e| (e.kind, rv(&e.object)))
    .collect();
    assert_eq!(
        seen,
        [
            ("ADDED".into(), "2".into()),
            ("MODIFIED".into(), rv(&cooled)),
            ("DELETED".into(), "4".into()),
            ("ADDED".into(), rv(&again)),
        ]
    );
    // What the watch sent is counted, byte for byte: each change's event
    // as one chunk.
    let expected: u64 = {
        let state = api.state();
        state.changes[1..]
            .iter()
            .map(|c| {
                let line = format!("{}\n", json!({"type": c.kind, "object": c.object}));
                format!("{:x}\r\n{line}\r\n", line.len()).len() as u64
            })
            .sum()
    };
    api.wait_until("the watch's bytes counted", Duration::from_secs(10), |s| {
        s.watch_bytes_of("sim") == expected
    });
    // Any cluster-scoped custom resource can be served the same way.
    let widgets = serve_custom("example.x-k8s.io/v1", "Widget", "widgets", false);
    let widget_path = "/apis/example.x-k8s.io/v1/widgets";
    let widget = json!({"metadata": {"name": "w1"}, "spec": {"size": 3}, "status": {"ok": true}});
    let made = client.post(widget_path, &widget).unwrap();
    // No status subresource: the status is the object's like any field.
    assert_eq!(
        (&made["kind"], &made["status"]["ok"]),
        (&json!("Widget"), &json!(true))
    );
    assert_eq!(code(&client.post(widget_path, &widget).unwrap_err()), 409);
    assert!(api.state().get(&Key::cluster(widgets, "w1")).is_some());
    assert_eq!(api.state().count("create", BLOCKS), 4);
}

/// Finalizers: a DELETE only marks an object that has one; writes keep the
/// mark, may not add a finalizer, and the object goes with its last.
#[test]
fn a_finalized_object_is_marked_on_delete_and_goes_with_its_last_finalizer() {
    let dir = TestDir::new("kapi-finalizers");
    let api = KubeApi::start();
    let client = client(&api, &dir);
    let mut held = block("v4-198-18-0-16-28", "n1", "Granted");
    held["metadata"]["finalizers"] = json!(["metis.x-k8s.io/block-protection"]);
    let made = client.post(BLOCK_PATH, &held).unwrap();
    let path = format!("{BLOCK_PATH}/v4-198-18-0-16-28");
    let (status, marked) = api.call("DELETE", &path, None);
    assert_eq!(status, 200);
    assert!(marked["metadata"]["deletionTimestamp"].is_string());
    assert_ne!(rv(&marked), rv(&made));
    // Marked again: nothing changes.
    assert_eq!(rv(&api.call("DELETE", &path, None).1), rv(&marked));
    // A write keeps the mark whatever its body says; no finalizer added.
    let mut cooling = marked.clone();
    cooling["spec"]["state"] = json!("Cooling");
    cooling["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("deletionTimestamp");
    let (status, cooled) = api.call("PUT", &path, Some(&cooling));
    assert_eq!(status, 200);
    assert_eq!(
        cooled["metadata"]["deletionTimestamp"],
        marked["metadata"]["deletionTimestamp"]
    );
    let mut more = cooled.clone();
    more["metadata"]["finalizers"] = json!(["metis.x-k8s.io/block-protection", "x"]);
    assert_eq!(api.call("PUT", &path, Some(&more)).0, 422);
    // The last finalizer removed: gone, and the name free to claim.
    let mut let_go = cooled.clone();
    let_go["metadata"]["finalizers"] = json!([]);
    assert_eq!(api.call("PUT", &path, Some(&let_go)).0, 200);
    assert_eq!(code(&client.get(&path).unwrap_err()), 404);
    let seen: Vec<String> = events(
        &client,
        &format!("{BLOCK_PATH}?watch=true&resourceVersion={}", rv(&made)),
        3,
    )
    .into_iter()
    .map(|e| e.kind)
    .collect();
    assert_eq!(seen, ["MODIFIED", "MODIFIED", "DELETED"]);
    client.post(BLOCK_PATH, &held).unwrap();
}

/// The API server's limits: a body over 3 MiB is 413 (unread, the
/// connection closed), an object over etcd's 1.5 MiB is 500 with etcd's
/// words and nothing stored; every body is counted by client.
#[test]
fn oversized_bodies_and_objects_are_refused_and_bodies_are_counted() {
    let api = KubeApi::start();
    let declared = 3 * 1024 * 1024 + 1;
    let answer = raw(
        &api,
        &format!(
            "POST {NNC_PATH} HTTP/1.1\r\nAuthorization: Bearer big\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
        ),
    );
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("RequestEntityTooLarge"), "{answer}");
    assert!(answer.contains("Connection: close"), "{answer}");
    let mut huge = nnc("n1");
    huge["metadata"]["annotations"] = json!({"big": "x".repeat(MAX_OBJECT)});
    let (status, refused) = api.call("POST", NNC_PATH, Some(&huge));
    assert_eq!(status, 500, "{refused}");
    assert_eq!(refused["message"], "etcdserver: request is too large");
    let (status, small) = api.call("POST", NNC_PATH, Some(&nnc("n1")));
    assert_eq!(status, 201);
    // An update that would grow it past the limit is refused the same way.
    let mut grown = small.clone();
    grown["metadata"]["annotations"] = json!({"big": "x".repeat(MAX_OBJECT)});
    assert_eq!(
        api.call("PUT", &format!("{NNC_PATH}/n1"), Some(&grown)).0,
        500
    );
    let state = api.state();
    assert_eq!(state.version, 1, "only the small object was stored");
    assert_eq!(state.answers_of("big", 413), 1);
    assert_eq!(state.answers_of("", 500), 2);
    let huge_len = huge.to_string().len() as u64;
    let grown_len = grown.to_string().len() as u64;
    let small_len = nnc("n1").to_string().len() as u64;
    let bytes = state.body_bytes_of("");
    assert_eq!(
        bytes.get(&("create".to_string(), NNCS.to_string())),
        Some(&(huge_len + small_len))
    );
    // The refused update's body (the stored object's fields and the
    // annotation) is the largest.
    assert!(grown_len > huge_len);
    assert_eq!(
        state.largest_body_of(""),
        Some((grown_len, "update".to_string(), NNCS.to_string()))
    );
    assert_eq!(state.count("create", NNCS), 3);
}
