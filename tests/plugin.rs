//! The real plugin binary, executed with CNI environment and stdin, against
//! a running daemon and in direct mode.

use crate::common;

use std::time::Duration;

use common::node::holdings;
use common::{Plugin, TestDaemon, TestDir, add_concurrently, assert_ok, conf, json, wait_for};
use metis::store::ONE_REQUEST_WAL_LIMIT;
use metis::wire::starting::Starting;
use serde_json::json;

const V4: &str = r#"[[{"subnet":"198.18.0.0/24"}]]"#;
const DUAL: &str = r#"[[{"subnet":"198.18.0.0/24"}],[{"subnet":"2001:db8::/120"}]]"#;

/// Allocated rows with an owner in the test directory's database.
fn allocated_count(dir: &TestDir) -> usize {
    holdings(&dir.join("metis.sqlite")).len()
}

#[test]
fn add_check_del_through_the_daemon() {
    let dir = TestDir::new("plugin-daemon");
    let _daemon = TestDaemon::start(&dir, &[]);
    let config = conf(&dir, "1.0.0", V4, "");

    let add = Plugin::new("ADD", "ctr-1").run(&config);
    assert_ok(&add);
    assert!(add.stderr.is_empty(), "stderr must stay clean");
    assert_eq!(
        json(&add),
        json!({
            "cniVersion": "1.0.0",
            "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/test"}],
            "ips": [{"interface": 0, "address": "198.18.0.2/24", "gateway": "198.18.0.1"}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "198.18.0.1"}]
        })
    );
    assert_eq!(allocated_count(&dir), 1);

    let prev = String::from_utf8(add.stdout.clone()).unwrap();
    let with_prev = conf(&dir, "1.0.0", V4, &format!(r#","prevResult":{prev}"#));
    assert_ok(&Plugin::new("CHECK", "ctr-1").run(&with_prev));

    // A prevResult naming another address fails CHECK.
    let wrong = with_prev.replace("198.18.0.2/24", "198.18.0.9/24");
    let check = Plugin::new("CHECK", "ctr-1").run(&wrong);
    assert_eq!(check.status.code(), Some(1));
    assert_eq!(json(&check)["code"], 102);

    // Repeat ADD is idempotent.
    let again = Plugin::new("ADD", "ctr-1").run(&config);
    assert_eq!(json(&again)["ips"][0]["address"], "198.18.0.2/24");

    let del = Plugin::new("DEL", "ctr-1").run(&config);
    assert_ok(&del);
    assert!(del.stdout.is_empty());
    assert_eq!(allocated_count(&dir), 0);
    assert_ok(&Plugin::new("DEL", "ctr-1").run(&config));

    let gone = Plugin::new("CHECK", "ctr-1").run(&with_prev);
    assert_eq!(json(&gone)["code"], 101);
}

#[test]
fn dual_stack_and_delegated_results() {
    let dir = TestDir::new("plugin-dual");
    let _daemon = TestDaemon::start(&dir, &[]);
    let config = conf(&dir, "1.0.0", DUAL, "")
        .replace(r#""type":"metis","ipam""#, r#""type":"bridge","ipam""#);
    let add = Plugin::new("ADD", "ctr-dual").run(&config);
    assert_ok(&add);
    let result = json(&add);
    assert!(
        result.get("interfaces").is_none(),
        "delegated result is abbreviated: {result}"
    );
    assert_eq!(
        result["ips"][0],
        json!({"address": "198.18.0.2/24", "gateway": "198.18.0.1"})
    );
    assert_eq!(
        result["ips"][1],
        json!({"address": "2001:db8::2/120", "gateway": "2001:db8::1"})
    );
}

#[test]
fn direct_mode_without_daemon_then_daemon_on_same_database() {
    let dir = TestDir::new("plugin-direct");
    let config = conf(&dir, "1.0.0", V4, "");
    let add = Plugin::new("ADD", "early").run(&config);
    assert_ok(&add);
    assert_eq!(json(&add)["ips"][0]["address"], "198.18.0.2/24");

    let daemon = TestDaemon::start(&dir, &[]);
    let add = Plugin::new("ADD", "late").run(&config);
    assert_eq!(json(&add)["ips"][0]["address"], "198.18.0.3/24");
    assert_ok(&Plugin::new("DEL", "early").run(&config));
    assert_eq!(allocated_count(&dir), 1);
    drop(daemon);

    // Daemon gone again: DEL still succeeds in direct mode.
    assert_ok(&Plugin::new("DEL", "late").run(&config));
    assert_eq!(allocated_count(&dir), 0);
}

/// The plugin's log so far (empty before its first line).
fn cni_log(dir: &TestDir) -> String {
    std::fs::read_to_string(dir.join("cni.log")).unwrap_or_default()
}

#[test]
fn no_daemon_means_direct_mode_at_once() {
    let dir = TestDir::new("plugin-no-daemon");
    // Debug: every connection attempt that is retried says so.
    let config =
        conf(&dir, "1.0.0", V4, "").replace(r#""logFile""#, r#""logLevel":"debug","logFile""#);
    // No socket file at all.
    assert_ok(&Plugin::new("ADD", "no-socket").run(&config));
    // A socket a daemon left behind: the connection is refused.
    drop(std::os::unix::net::UnixListener::bind(dir.join("metis.sock")).unwrap());
    assert_ok(&Plugin::new("ADD", "stale-socket").run(&config));
    // A marker a daemon left behind, its lock released.
    drop(Starting::announce(&dir.join("metis.sock")).unwrap());
    assert_ok(&Plugin::new("DEL", "stale-socket").run(&config));
    let log = cni_log(&dir);
    assert_eq!(log.matches("using direct mode").count(), 3, "{log}");
    assert!(!log.contains("retrying"), "{log}");
    assert_eq!(allocated_count(&dir), 1);
}

#[test]
fn a_starting_daemon_is_waited_for() {
    let dir = TestDir::new("plugin-daemon-starting");
    let config = conf(&dir, "1.0.0", V4, "");
    // What a daemon holds from before it opens the database until its
    // socket is bound.
    let starting = Starting::announce(&dir.join("metis.sock")).unwrap();
    let plugin = {
        let config = config.clone();
        std::thread::spawn(move || Plugin::new("ADD", "patient").run(&config))
    };
    wait_for("the plugin to wait", Duration::from_secs(30), || {
        cni_log(&dir).contains("waiting for the daemon")
    });
    // The start failed: the lock goes, and the plugin stops waiting.
    drop(starting);
    let add = plugin.join().unwrap();
    assert_ok(&add);
    assert_eq!(json(&add)["ips"][0]["address"], "198.18.0.2/24");
    let log = cni_log(&dir);
    let waited = log.find("waiting for the daemon").unwrap();
    let direct = log
        .find("using direct mode")
        .expect("direct mode after the wait");
    assert!(waited < direct, "{log}");
    assert_eq!(log.matches("waiting for the daemon").count(), 1, "{log}");
}

#[test]
fn direct_mode_keeps_the_wal_short() {
    let dir = TestDir::new("plugin-direct-wal");
    let config = conf(&dir, "1.0.0", V4, "");
    let wal = dir.join("metis.sqlite-wal");
    let mut largest = 0;
    let mut checkpointed = false;
    let mut measure = || {
        let size = std::fs::metadata(&wal).map_or(0, |meta| meta.len());
        checkpointed |= size == 0;
        largest = largest.max(size);
    };
    for n in 0..40 {
        let id = format!("wal-{n}");
        let add = Plugin::new("ADD", &id).run(&config);
        assert_ok(&add);
        measure();
        let prev = String::from_utf8(add.stdout.clone()).unwrap();
        let del = conf(&dir, "1.0.0", V4, &format!(r#","prevResult":{prev}"#));
        assert_ok(&Plugin::new("DEL", &id).run(&del));
        measure();
    }
    // A process checkpoints once the WAL passes the limit: it never grows
    // by more than one request's frames beyond it.
    assert!(
        largest < ONE_REQUEST_WAL_LIMIT + 16 * 4120,
        "WAL reached {largest} bytes"
    );
    assert!(checkpointed, "the WAL was never truncated");
    assert_eq!(allocated_count(&dir), 0);
    assert_ok(&common::admin_check(&dir.join("metis.sqlite")));
}

#[test]
fn concurrent_direct_mode_processes_share_the_database() {
    let dir = TestDir::new("plugin-direct-concurrent");
    let config = conf(&dir, "1.0.0", V4, "");
    // Create the database once so every process races only on allocation.
    assert_ok(&Plugin::new("ADD", "seed").run(&config));
    let mut addresses = add_concurrently(&config, 0..24);
    addresses.sort();
    addresses.dedup();
    assert_eq!(addresses.len(), 24, "duplicate addresses: {addresses:?}");
    assert_eq!(allocated_count(&dir), 25);
}

#[test]
fn exhausted_pool_is_try_again_later() {
    let dir = TestDir::new("plugin-exhausted");
    let _daemon = TestDaemon::start(&dir, &[]);
    let config = conf(&dir, "1.0.0", r#"[[{"subnet":"198.18.0.0/30"}]]"#, "");
    assert_ok(&Plugin::new("ADD", "one").run(&config));
    let full = Plugin::new("ADD", "two").run(&config);
    assert_eq!(full.status.code(), Some(1));
    let error = json(&full);
    assert_eq!(error["code"], 11, "{error}");
    assert_eq!(error["cniVersion"], "1.0.0");
}

#[test]
fn bad_input_gets_the_right_error_code() {
    let dir = TestDir::new("plugin-bad");
    let good = conf(&dir, "1.0.0", V4, "");
    let cases: Vec<(String, Plugin, u64)> = vec![
        ("{not json".into(), Plugin::new("ADD", "c"), 6),
        (good.replace("1.0.0", "9.9.9"), Plugin::new("ADD", "c"), 1),
        (
            good.replace("198.18.0.0/24", "198.18.0.1/24"),
            Plugin::new("ADD", "c"),
            7,
        ),
        (good.clone(), Plugin::new("ADD", "bad/id"), 4),
        (
            good.clone(),
            Plugin {
                ifname: "a-very-long-interface-name",
                ..Plugin::new("ADD", "c")
            },
            4,
        ),
        (
            good.clone(),
            Plugin {
                netns: "",
                ..Plugin::new("ADD", "c")
            },
            4,
        ),
        (
            good.clone(),
            Plugin {
                args: "invalid;format",
                ..Plugin::new("ADD", "c")
            },
            4,
        ),
        (good.clone(), Plugin::new("BOGUS", "c"), 4),
    ];
    for (stdin, plugin, code) in cases {
        let output = plugin.run(&stdin);
        assert_eq!(output.status.code(), Some(1), "{stdin}");
        assert_eq!(json(&output)["code"], code, "{stdin}");
        assert!(output.stderr.is_empty());
    }
    // Nothing was allocated by any of them.
    assert!(!dir.join("metis.sqlite").exists() || allocated_count(&dir) == 0);
}

#[test]
fn version_lists_supported_versions() {
    let output = Plugin::new("VERSION", "").run(r#"{"cniVersion":"1.0.0"}"#);
    assert_ok(&output);
    let reply = json(&output);
    assert_eq!(reply["cniVersion"], "1.0.0");
    let versions = reply["supportedVersions"].as_array().unwrap();
    for v in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        assert!(versions.contains(&json!(v)), "missing {v}");
    }
}

/// A reader gone from stdout is a failed write (exit 1), not death by
/// SIGPIPE: the binary ignores the signal, as Rust's runtime start-up,
/// which it skips, would have.
#[test]
fn a_closed_stdout_pipe_is_an_error_not_sigpipe() {
    use std::os::unix::process::ExitStatusExt;
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut command = Plugin::new("VERSION", "").command();
    command.stdout(writer).stderr(std::process::Stdio::null());
    let mut child = command.stdin(std::process::Stdio::piped()).spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    std::io::Write::write_all(&mut stdin, br#"{"cniVersion":"1.0.0"}"#).unwrap();
    drop(stdin);
    let status = child.wait().unwrap();
    assert_eq!(
        (status.code(), status.signal()),
        (Some(1), None),
        "{status:?}"
    );
}

/// Started with stdout and stderr closed, the plugin gives neither number
/// to a file it opens: the result goes nowhere instead of into its log,
/// and the ADD is made.
#[test]
fn closed_standard_descriptors_are_given_to_no_file() {
    let dir = TestDir::new("plugin-closed-fds");
    let config = conf(&dir, "1.0.0", V4, "");
    let plugin = Plugin::new("ADD", "closed-fds").command();
    let mut command = std::process::Command::new("sh");
    command.args(["-c", r#"exec "$0" >&- 2>&-"#, common::METIS]);
    for (key, value) in plugin.get_envs() {
        match value {
            Some(value) => command.env(key, value),
            None => command.env_remove(key),
        };
    }
    let output = common::run_with_stdin(command, &config);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    assert_eq!(allocated_count(&dir), 1);
    let log = cni_log(&dir);
    assert!(log.contains("using direct mode"), "{log}");
    assert!(
        !log.contains(r#""ips""#),
        "the result went into the log: {log}"
    );
}

/// CHECK per spec: later plugins may add addresses and interfaces to the
/// result; only Metis's own allocation must be present and unchanged.
#[test]
fn check_accepts_a_result_later_plugins_extended() {
    let dir = TestDir::new("plugin-check-chain");
    let _daemon = TestDaemon::start(&dir, &[]);
    let config = conf(&dir, "1.1.0", DUAL, "");
    let add = Plugin::new("ADD", "ctr-chain").run(&config);
    assert_ok(&add);
    let mut prev = json(&add);
    prev["interfaces"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "veth-host", "mac": "02:00:00:00:00:01"}));
    prev["ips"]
        .as_array_mut()
        .unwrap()
        .push(json!({"interface": 1, "address": "198.19.5.5/32"}));
    let check = |prev: &serde_json::Value| {
        Plugin::new("CHECK", "ctr-chain").run(&conf(
            &dir,
            "1.1.0",
            DUAL,
            &format!(r#","prevResult":{prev}"#),
        ))
    };
    assert_ok(&check(&prev));

    // Reordered entries are still the same allocation.
    prev["ips"].as_array_mut().unwrap().reverse();
    assert_ok(&check(&prev));

    // Metis's IPv6 address dropped: code 102.
    let mut dropped = prev.clone();
    dropped["ips"]
        .as_array_mut()
        .unwrap()
        .retain(|ip| !ip["address"].as_str().unwrap().contains(':'));
    let failed = check(&dropped);
    assert_eq!(json(&failed)["code"], 102);
    assert_eq!(
        json(&failed)["msg"],
        "prevResult does not list the allocation's 2001:db8::2"
    );
    let moved = serde_json::from_str::<serde_json::Value>(
        &prev.to_string().replace("198.18.0.2/24", "198.18.0.3/24"),
    )
    .unwrap();
    assert_eq!(json(&check(&moved))["code"], 102);
}
