//! host-local's configuration syntax, case by case: each case of
//! `testdata/host-local/cases.json` runs its ADDs through the real Metis
//! plugin (with a daemon) and, when it is installed, through Debian's
//! host-local on the same `ipam` object; both must give the addresses,
//! gateways and DNS the case records (recorded from host-local), or fail
//! with its message. The real-world conflists of `testdata/conflists/`
//! must each be accepted and serve ADD.

use crate::common;

use common::host_local::{essence, host_local, run_ipam, with_host_local, with_metis};
use common::{METIS, TestDaemon, TestDir};
use serde_json::{Value, json};

fn cases() -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/testdata/host-local/cases.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The network configuration of a case: `bridge` delegating to the IPAM,
/// so both plugins print the abbreviated result.
fn network(case: &Value, dir: &TestDir) -> Value {
    let ipam = case["ipam"]
        .to_string()
        .replace("@DIR@", &dir.path.display().to_string());
    json!({"cniVersion": "1.0.0", "name": "hl", "type": "bridge",
           "ipam": serde_json::from_str::<Value>(&ipam).unwrap()})
}

/// Whether `got` is what `want` (one entry of a case's `expect`) asks of
/// the plugin `who` ("metis" or "host-local").
fn matches(who: &str, want: &Value, got: &Value) -> bool {
    let Some(error) = want.get("error") else {
        return want == got;
    };
    let needle = error.get(who).or_else(|| error.get("both"));
    let msg = got["error"].as_str().unwrap_or_default();
    needle
        .and_then(Value::as_str)
        .is_some_and(|n| msg.contains(n))
}

fn run_case(case: &Value, who: &str, binary: &str) {
    let name = case["name"].as_str().unwrap();
    let dir = TestDir::new(&format!("hl-{name}"));
    if let Some(text) = case["resolv_conf"].as_str() {
        std::fs::write(dir.join("resolv.conf"), text).unwrap();
    }
    let _daemon = (who == "metis").then(|| TestDaemon::start(&dir, &["--release-cooldown", "0"]));
    let base = network(case, &dir);
    let conf = match who {
        "metis" => with_metis(&base, &dir),
        _ => with_host_local(&base, &dir),
    };
    let adds = case["adds"].as_u64().unwrap();
    for (i, want) in (0..adds).zip(case["expect"].as_array().unwrap()) {
        let output = run_ipam(binary, "ADD", &format!("c{i}"), &conf.to_string());
        let got = essence(&output);
        assert!(
            matches(who, want, &got),
            "case {name}, {who}, ADD {i}:\n want {want}\n  got {got}\n stderr {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

#[test]
fn golden_cases_match_host_local() {
    let reference = host_local();
    for case in cases() {
        run_case(&case, "metis", METIS);
        if let Some(binary) = reference {
            run_case(&case, "host-local", binary);
        }
    }
}

/// The plugin configurations with an `ipam` object of a config file, as
/// the runtime hands them to the plugin (with `cniVersion` and `name`).
fn ipam_plugins(file: &Value) -> Vec<Value> {
    let plugins = match file.get("plugins") {
        Some(list) => list.as_array().unwrap().clone(),
        None => vec![file.clone()],
    };
    plugins
        .into_iter()
        .filter(|plugin| plugin.get("ipam").is_some())
        .map(|mut plugin| {
            plugin["cniVersion"] = file["cniVersion"].clone();
            plugin["name"] = file["name"].clone();
            plugin
        })
        .collect()
}

#[test]
fn real_world_conflists_are_accepted_and_serve_add() {
    let reference = host_local();
    let dir_path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/conflists");
    let mut files: Vec<_> = std::fs::read_dir(dir_path)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.extension()
                .is_some_and(|e| e == "conf" || e == "conflist")
        })
        .collect();
    files.sort();
    assert_eq!(files.len(), 6, "{files:?}");
    for path in files {
        let file: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let plugins = ipam_plugins(&file);
        assert_eq!(plugins.len(), 1, "{}", path.display());
        let dir = TestDir::new("conflist");
        let _daemon = TestDaemon::start(&dir, &[]);
        let metis = with_metis(&plugins[0], &dir);
        let output = run_ipam(METIS, "ADD", "c0", &metis.to_string());
        let got = essence(&output);
        assert!(
            output.status.success() && !got["ips"].as_array().unwrap().is_empty(),
            "{}: {got}",
            path.display()
        );
        if let Some(binary) = reference {
            let host_local = with_host_local(&plugins[0], &dir);
            let want = essence(&run_ipam(binary, "ADD", "c0", &host_local.to_string()));
            assert_eq!(got, want, "{}", path.display());
        }
    }
}
