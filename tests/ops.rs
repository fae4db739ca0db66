//! The operator's subcommands against a real daemon: `metis health`,
//! `metis admin`, usage errors, and the plugin's log file.

use crate::common;

use std::os::unix::net::UnixListener;
use std::time::{Duration, Instant};

use common::{Plugin, TestDaemon, TestDir, assert_ok, conf, metis, out_err};
use serde_json::{Value, json};

const RANGE: &str = r#"[[{"subnet":"198.18.0.0/24"}]]"#;

fn socket_arg(daemon: &TestDaemon) -> String {
    daemon.socket.display().to_string()
}

/// `metis admin ARGS… --socket-path S -o json`, parsed.
fn admin_json(daemon: &TestDaemon, args: &[&str]) -> Value {
    let socket = socket_arg(daemon);
    let mut all = vec!["admin"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--socket-path", &socket, "-o", "json"]);
    let output = metis(&all);
    assert_ok(&output);
    serde_json::from_slice(&output.stdout).unwrap()
}

fn is_rfc3339_seconds(text: &str) -> bool {
    let bytes = text.as_bytes();
    bytes.len() == 20
        && text.ends_with('Z')
        && bytes[10] == b'T'
        && [4, 7].iter().all(|&i| bytes[i] == b'-')
        && [13, 16].iter().all(|&i| bytes[i] == b':')
}

#[test]
fn health_is_healthy_with_a_daemon_and_unhealthy_without() {
    let dir = TestDir::new("ops-health");
    let daemon = TestDaemon::start(&dir, &[]);
    let output = metis(&["health", "--socket-path", &socket_arg(&daemon)]);
    let (stdout, stderr) = out_err(&output);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert_eq!(stdout, "Healthy: Metis daemon is SERVING\n");
    assert_eq!(stderr, "");
    assert_eq!(daemon.stop().code(), Some(0));

    let output = metis(&[
        "health",
        "--socket-path",
        &dir.join("metis.sock").display().to_string(),
    ]);
    let (stdout, stderr) = out_err(&output);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(stdout, "");
    assert!(stderr.starts_with("Unhealthy: cannot connect"), "{stderr}");

    let output = metis(&["health", "--socket-path", &dir.path.display().to_string()]);
    assert_eq!(output.status.code(), Some(1));
    assert!(out_err(&output).1.starts_with("Unhealthy: "));
}

#[test]
fn health_gives_up_on_a_silent_socket_within_its_deadline() {
    let dir = TestDir::new("ops-silent");
    let path = dir.join("silent.sock");
    // Accepts connections (the kernel backlog) but never answers.
    let _listener = UnixListener::bind(&path).unwrap();
    let started = Instant::now();
    let output = metis(&["health", "--socket-path", &path.display().to_string()]);
    let elapsed = started.elapsed();
    assert_eq!(output.status.code(), Some(1));
    let stderr = out_err(&output).1;
    assert!(stderr.starts_with("Unhealthy: no answer"), "{stderr}");
    assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    assert!(elapsed >= Duration::from_secs(2), "took {elapsed:?}");
}

#[test]
fn subcommands_explain_themselves_and_reject_typos() {
    for args in [
        &["health", "--help"][..],
        &["install", "--help"],
        &["admin", "--help"],
        &["admin", "cidr-blocks", "--help"],
        &["admin", "ip-addresses", "-h"],
        &["admin", "usage", "--help"],
        &["--help"],
    ] {
        let output = metis(args);
        let (stdout, stderr) = out_err(&output);
        assert_eq!(output.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(stdout.contains("Usage"), "{args:?}: {stdout}");
    }
    let top = out_err(&metis(&["--help"])).0;
    for command in ["metis health", "metis install", "metis admin"] {
        assert!(top.contains(command), "{top}");
    }
    let cases: &[(&[&str], &str)] = &[
        (&["helth"], "unknown command \"helth\""),
        (&["health", "--socket"], "unknown flag \"--socket\""),
        (&["health", "--socket-path"], "needs a value"),
        (&["health", "extra"], "unexpected argument"),
        (&["health", "--socket-path="], "must not be empty"),
        (
            &["admin", "usage", "--socket-path", ""],
            "must not be empty",
        ),
        (&["install", "--cni-dir"], "needs a value"),
        (&["install", "--conflist", "x.conflist"], "go together"),
        (&["install", "--cnidir", "/x"], "unknown flag"),
        (&["admin"], "missing listing"),
        (&["admin", "blocks"], "unknown listing \"blocks\""),
        (
            &["admin", "usage", "--state", "Ready"],
            "unknown flag \"--state\"",
        ),
        (&["admin", "cidr-blocks", "-o", "yaml"], "table or json"),
        (
            &["admin", "cidr-blocks", "list", "--filter", "state='Ready'"],
            "--filter (upstream's raw SQL WHERE clause) is not supported",
        ),
        (
            &["admin", "ip-addresses", "--allocated", "yes"],
            "true or false",
        ),
    ];
    for (args, expected) in cases {
        let output = metis(args);
        let (stdout, stderr) = out_err(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stdout, "", "{args:?}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// A daemon with c1 and c2 allocated from 198.18.0.0/24 and c2 released.
fn daemon_with_allocations(dir: &TestDir) -> TestDaemon {
    let daemon = TestDaemon::start(dir, &[]);
    let config = conf(dir, "1.0.0", RANGE, "");
    for container in ["c1", "c2"] {
        assert_ok(&Plugin::new("ADD", container).run(&config));
    }
    assert_ok(&Plugin::new("DEL", "c2").run(&config));
    daemon
}

#[test]
fn admin_lists_blocks_as_json_with_column_names_and_types() {
    let dir = TestDir::new("ops-blocks");
    let daemon = daemon_with_allocations(&dir);
    let blocks = admin_json(&daemon, &["cidr-blocks"]);
    let block = &blocks.as_array().unwrap()[0];
    assert_eq!(blocks.as_array().unwrap().len(), 1, "{blocks}");
    for (key, value) in [
        ("id", json!(1)),
        ("cidr", json!("198.18.0.0/24")),
        ("network", json!("testnet")),
        ("ip_family", json!("ipv4")),
        ("total_ips", json!(256)),
        ("allocated_ips", json!(4)),
        ("state", json!("Ready")),
    ] {
        assert_eq!(block[key], value, "{key} in {block}");
    }
    for key in ["created_at", "updated_at"] {
        let text = block[key].as_str().unwrap();
        assert!(text.ends_with('Z') && text.contains('T'), "{key}: {text}");
    }
    assert_eq!(
        admin_json(&daemon, &["cidr-blocks", "--state", "Draining"]),
        json!([])
    );
    assert_eq!(
        admin_json(&daemon, &["cidr-blocks", "--family", "ipv6"]),
        json!([])
    );
}

#[test]
fn admin_filters_addresses_and_hostile_values_match_nothing() {
    let dir = TestDir::new("ops-addresses");
    let daemon = daemon_with_allocations(&dir);
    let mine = admin_json(&daemon, &["ip-addresses", "--container-id", "c1"]);
    let rows = mine.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{mine}");
    assert_eq!(rows[0]["address"], json!("198.18.0.2"));
    assert_eq!(rows[0]["is_allocated"], json!(true));
    assert_eq!(rows[0]["interface_name"], json!("eth0"));
    assert_eq!(rows[0]["cidr_block_id"], json!(1));
    assert_eq!(rows[0]["release_at"], Value::Null);
    assert!(rows[0]["allocated_at"].is_string());

    let released = admin_json(&daemon, &["ip-addresses", "--container-id", "c2"]);
    assert_eq!(released[0]["is_allocated"], json!(false));
    assert!(released[0]["release_at"].is_string(), "{released}");

    let free = admin_json(&daemon, &["ip-addresses", "--allocated", "false"]);
    // Rows exist for the first 64 addresses and the reserved last one;
    // the rest of the /24 is populated as addresses are taken.
    assert_eq!(free.as_array().unwrap().len(), 65 - 4);
    let taken = admin_json(
        &daemon,
        &[
            "ip-addresses",
            "--allocated",
            "true",
            "--network",
            "testnet",
        ],
    );
    assert_eq!(taken.as_array().unwrap().len(), 4);

    for hostile in [
        "c1' OR '1'='1",
        "c1\" OR 1=1 --",
        "%",
        "*",
        "c1; DROP TABLE ip_addresses; --",
    ] {
        for flag in ["--container-id", "--network"] {
            assert_eq!(
                admin_json(&daemon, &["ip-addresses", flag, hostile]),
                json!([]),
                "{flag} {hostile}"
            );
        }
    }
    assert_eq!(
        admin_json(&daemon, &["ip-addresses"])
            .as_array()
            .unwrap()
            .len(),
        65,
        "the table survived"
    );
}

#[test]
fn admin_tables_are_aligned_with_rfc3339_times() {
    let dir = TestDir::new("ops-table");
    let daemon = daemon_with_allocations(&dir);
    let output = metis(&[
        "admin",
        "ip-addresses",
        "--allocated=true",
        "--socket-path",
        &socket_arg(&daemon),
    ]);
    assert_ok(&output);
    let text = out_err(&output).0;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + 4, "{text}");
    assert_eq!(
        lines[0].split_whitespace().collect::<Vec<_>>()[..3],
        ["ID", "ADDRESS", "CIDR_BLOCK_ID"],
        "{text}"
    );
    // Every column starts at the same offset on every line: find each
    // header's offset, then check the c1 row has a value starting there.
    let c1 = lines.iter().find(|l| l.contains(" c1 ")).unwrap();
    for header in ["ADDRESS", "CONTAINER_ID", "IS_ALLOCATED", "ALLOCATED_AT"] {
        let at = lines[0].find(header).unwrap();
        assert_ne!(&c1[at..=at], " ", "{header} misaligned:\n{text}");
        assert_eq!(&c1[at - 1..at], " ", "{header} misaligned:\n{text}");
    }
    let at = lines[0].find("ALLOCATED_AT").unwrap();
    let stamp: String = c1[at..].chars().take(20).collect();
    assert!(is_rfc3339_seconds(&stamp), "{stamp:?} in\n{text}");
    assert!(c1.contains("198.18.0.2") && c1.contains("true"), "{c1}");
    // Reserved rows have SQL NULLs (pod_name): shown as NULL.
    assert!(lines[1].contains("NULL"), "{text}");
}

#[test]
fn admin_usage_counts_per_network_and_family() {
    let dir = TestDir::new("ops-usage");
    let daemon = daemon_with_allocations(&dir);
    assert_eq!(
        admin_json(&daemon, &["usage"]),
        json!([{"network": "testnet", "ip_family": "ipv4", "total": 256,
                "allocated": 1, "reserved": 3, "cooldown": 1, "draining": 0}])
    );
    assert_eq!(
        admin_json(&daemon, &["usage", "--family", "ipv6"]),
        json!([])
    );
    assert_eq!(
        admin_json(&daemon, &["usage", "--network", "other"]),
        json!([])
    );
    let output = metis(&["admin", "usage", "--socket-path", &socket_arg(&daemon)]);
    assert_ok(&output);
    assert_eq!(
        out_err(&output).0,
        "NETWORK  IP_FAMILY  TOTAL  ALLOCATED  RESERVED  COOLDOWN  DRAINING\n\
         testnet  ipv4       256    1          3         1         0\n"
    );

    // An IPv6 /64 shows its real size, 2^64, not upstream's saturated column.
    let v6 =
        conf(&dir, "1.0.0", r#"[[{"subnet":"2001:db8::/64"}]]"#, "").replace("testnet", "v6net");
    assert_ok(&Plugin::new("ADD", "c6").run(&v6));
    let usage = admin_json(&daemon, &["usage", "--network", "v6net"]);
    assert_eq!(usage[0]["total"], json!("18446744073709551616"), "{usage}");
    assert_eq!(usage[0]["allocated"], json!(1), "{usage}");
    let output = metis(&[
        "admin",
        "usage",
        "--network",
        "v6net",
        "--socket-path",
        &socket_arg(&daemon),
    ]);
    assert!(
        out_err(&output)
            .0
            .contains("v6net    ipv6       18446744073709551616  1 "),
        "{}",
        out_err(&output).0
    );
}

#[test]
fn admin_without_a_daemon_fails_cleanly() {
    let dir = TestDir::new("ops-nodaemon");
    let socket = dir.join("absent.sock").display().to_string();
    for listing in ["cidr-blocks", "ip-addresses", "usage"] {
        let output = metis(&["admin", listing, "--socket-path", &socket]);
        let (stdout, stderr) = out_err(&output);
        assert_eq!(output.status.code(), Some(1), "{listing}");
        assert_eq!(stdout, "");
        assert!(
            stderr.starts_with("metis admin: cannot connect"),
            "{stderr}"
        );
    }
}

#[test]
fn plugin_log_names_verb_and_container_on_every_line_and_rotates() {
    let dir = TestDir::new("ops-log");
    let log = dir.join("cni.log");
    let full = vec![b'x'; 10 * 1024 * 1024];
    std::fs::write(&log, &full).unwrap();
    // No daemon: direct mode, which logs more lines.
    let config = conf(&dir, "1.0.0", RANGE, "");
    assert_ok(&Plugin::new("ADD", "ctr-a").run(&config));
    assert_ok(&Plugin::new("DEL", "ctr-a").run(&config));
    let bad = Plugin::new("ADD", "ctr-b").run(&conf(
        &dir,
        "1.0.0",
        r#"[[{"subnet":"198.18.0.0/24"}]]"#,
        r#","runtimeConfig":{"ips":["203.0.113.9"]}"#,
    ));
    assert_eq!(bad.status.code(), Some(1));

    let rotated = std::fs::read(dir.join("cni.log.1")).unwrap();
    assert_eq!(rotated.len(), full.len(), "the full file moved aside whole");
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() >= 4, "{text}");
    for line in &lines {
        let tagged = (line.contains("verb=ADD") && line.contains("container_id=ctr-"))
            || (line.contains("verb=DEL") && line.contains("container_id=ctr-a"));
        assert!(tagged, "untagged line: {line}");
        assert_eq!(line.matches("container_id=").count(), 1, "{line}");
    }
    assert!(
        text.contains("container_id=ctr-b") && text.contains("ERROR"),
        "{text}"
    );
}

/// The Makefile finds the binary where cargo puts it: under
/// CARGO_TARGET_DIR when that is set (a dry run; nothing is built).
#[test]
fn makefile_honours_cargo_target_dir() {
    let dry_run = |target_dir: Option<&str>| {
        let mut make = std::process::Command::new("make");
        make.args(["-n", "demo"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("MAKEFLAGS");
        if let Some(dir) = target_dir {
            make.env("CARGO_TARGET_DIR", dir);
        }
        let output = make.output().expect("make is installed");
        assert_ok(&output);
        out_err(&output).0
    };
    // Release binaries are built for the host's triple, named explicitly.
    let rustc = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc is installed");
    let host = String::from_utf8_lossy(&rustc.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("host: ").map(str::to_string))
        .expect("rustc names its host");
    let elsewhere = dry_run(Some("/srv/metis-build"));
    assert!(
        elsewhere.contains(&format!("/srv/metis-build/{host}/release/metis daemon")),
        "{elsewhere}"
    );
    assert!(!elsewhere.contains("target/"), "{elsewhere}");
    let default = dry_run(None);
    assert!(
        default.contains(&format!("target/{host}/release/metis daemon")),
        "{default}"
    );
}
