//! A daemon following the test API server, and what tests read back from
//! it: blocks in its database, its health (its metrics: `scrape`).

use std::time::Duration;

use super::kube_api::KubeApi;
use super::{TestDaemon, TestDir, conf, db};

pub const NODE: &str = "edge-node-1";

/// Fast monitor settings so the adaptive loop runs in test time.
pub const FAST: &[&str] = &["--monitor-interval", "100ms", "--release-cooldown", "0"];

/// A daemon following `api` with [`FAST`] settings; a flag of `extra`
/// replaces the same flag of `FAST`.
pub fn start_daemon(dir: &TestDir, api: &KubeApi, source: &str, extra: &[&str]) -> TestDaemon {
    start_daemon_as(dir, api, source, "    token: test-token", extra)
}

/// Like [`start_daemon`], with the kubeconfig's user entry `user`
/// (indented YAML lines: a token file, a client certificate, …).
pub fn start_daemon_as(
    dir: &TestDir,
    api: &KubeApi,
    source: &str,
    user: &str,
    extra: &[&str],
) -> TestDaemon {
    let kubeconfig = dir.join("kubeconfig");
    api.kubeconfig_with_user(&kubeconfig, user);
    let kubeconfig = kubeconfig.display().to_string();
    let mut args = vec!["--cidr-source", source];
    for setting in FAST.chunks(2) {
        if !extra.contains(&setting[0]) {
            args.extend_from_slice(setting);
        }
    }
    args.extend_from_slice(extra);
    TestDaemon::start_with_env(
        dir,
        &args,
        &[("KUBECONFIG", &kubeconfig), ("NODE_NAME", NODE)],
    )
}

/// A daemon following `api` through an `https://` kubeconfig whose cluster
/// entry also has `tls_line`. The test API server speaks plain HTTP, so
/// every request fails in TLS.
pub fn start_daemon_over_https(
    dir: &TestDir,
    api: &KubeApi,
    tls_line: &str,
    extra: &[&str],
) -> TestDaemon {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "current-context: c\nclusters:\n- name: k\n  cluster:\n    server: https://{}\n    {tls_line}\ncontexts:\n- name: c\n  context:\n    cluster: k\n",
            api.addr
        ),
    )
    .unwrap();
    let kubeconfig = kubeconfig.display().to_string();
    let mut args = vec!["--cidr-source", "nnc"];
    args.extend_from_slice(extra);
    TestDaemon::start_with_env(
        dir,
        &args,
        &[("KUBECONFIG", &kubeconfig), ("NODE_NAME", NODE)],
    )
}

/// A network config for network `default`, the one the cloud publishes
/// NodeNetworkConfig blocks for.
pub fn default_conf(dir: &TestDir, version: &str, ranges: &str) -> String {
    conf(dir, version, ranges, "").replace(r#""name":"testnet""#, r#""name":"default""#)
}

pub fn blocks_in_db(dir: &TestDir) -> Vec<String> {
    let conn = db(&dir.join("metis.sqlite"));
    let mut stmt = conn
        .prepare("SELECT cidr FROM cidr_blocks ORDER BY cidr")
        .unwrap();
    stmt.query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// The state of block `cidr` (`None`: no such block).
pub fn block_state(dir: &TestDir, cidr: &str) -> Option<String> {
    use rusqlite::OptionalExtension;
    db(&dir.join("metis.sqlite"))
        .query_row(
            "SELECT state FROM cidr_blocks WHERE cidr = ?1",
            [cidr],
            |r| r.get(0),
        )
        .optional()
        .unwrap()
}

/// A Ready `status.podCIDRs` entry of network `default`.
pub fn status_entry(id: &str, cidr: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "network": "default", "cidr": cidr,
        "condition": {"type": "Ready", "status": "True"}})
}

pub fn health_detail(daemon: &TestDaemon) -> String {
    let health = metis::wire::client::Client::connect(
        &daemon.socket,
        Duration::from_secs(2),
        Duration::from_secs(5),
    )
    .unwrap()
    .call(&metis::wire::Request {
        kind: Some(metis::wire::request::Kind::Health(Default::default())),
    })
    .unwrap();
    match health.kind {
        Some(metis::wire::response::Kind::Health(h)) => h.detail,
        other => panic!("{other:?}"),
    }
}
