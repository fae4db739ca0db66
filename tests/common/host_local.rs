//! Running Debian's host-local (containernetworking-plugins) next to Metis
//! on the same configuration.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};

use super::{TestDir, run_with_stdin};

/// Where Debian's containernetworking-plugins installs host-local.
pub const HOST_LOCAL: &str = "/usr/lib/cni/host-local";

/// Whether host-local is installed; cross-checks are skipped (with a note)
/// when it is not. `METIS_REQUIRE_HOST_LOCAL=1` turns its absence into a
/// failure, as `make conformance` does.
pub fn host_local() -> Option<&'static str> {
    if Path::new(HOST_LOCAL).exists() {
        return Some(HOST_LOCAL);
    }
    if std::env::var_os("METIS_REQUIRE_HOST_LOCAL").is_some() {
        return Some(require_host_local());
    }
    eprintln!("note: {HOST_LOCAL} not installed; host-local cross-checks skipped");
    None
}

/// host-local, for a test that proves nothing without it: its absence
/// fails the test instead of passing it unseen.
pub fn require_host_local() -> &'static str {
    assert!(
        Path::new(HOST_LOCAL).exists(),
        "{HOST_LOCAL} is missing (apt-get install containernetworking-plugins)"
    );
    HOST_LOCAL
}

/// Runs an IPAM plugin binary with a scrubbed CNI environment.
pub fn run_ipam(binary: &str, command: &str, container_id: &str, stdin: &str) -> Output {
    let mut cmd = Command::new(binary);
    for (key, _) in std::env::vars() {
        if key.starts_with("CNI_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_NETNS", "/var/run/netns/test")
        .env("CNI_PATH", "/usr/lib/cni");
    run_with_stdin(cmd, stdin)
}

/// `plugin` (a network configuration object with an `ipam` object) made
/// to use Metis with the test directory's daemon socket and database.
pub fn with_metis(plugin: &Value, dir: &TestDir) -> Value {
    let mut plugin = plugin.clone();
    let ipam = &mut plugin["ipam"];
    ipam["type"] = json!("metis");
    ipam["daemonSocket"] = json!(dir.join("metis.sock"));
    ipam["dbPath"] = json!(dir.join("metis.sqlite"));
    ipam["logFile"] = json!(dir.join("cni.log"));
    plugin
}

/// `plugin` made to use host-local with its data in the test directory.
pub fn with_host_local(plugin: &Value, dir: &TestDir) -> Value {
    let mut plugin = plugin.clone();
    plugin["ipam"]["type"] = json!("host-local");
    plugin["ipam"]["dataDir"] = json!(dir.join("host-local"));
    plugin
}

/// What both plugins must agree on in an ADD's output: the addresses with
/// their gateways, and DNS; or the error message.
pub fn essence(output: &Output) -> Value {
    let Ok(result) = serde_json::from_slice::<Value>(&output.stdout) else {
        return json!({"unparseable": String::from_utf8_lossy(&output.stdout)});
    };
    if !output.status.success() {
        return json!({"error": result["msg"]});
    }
    let ips: Vec<Value> = result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|ip| json!({"address": ip["address"], "gateway": ip["gateway"]}))
        .collect();
    let dns = match &result["dns"] {
        Value::Null => json!({}),
        dns => dns.clone(),
    };
    json!({"ips": ips, "dns": dns})
}
