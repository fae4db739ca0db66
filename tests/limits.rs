//! Sizes with a purpose (issue 11): identifiers are bounded at every edge
//! with the same rules, oversize requests get a non-retryable code, and GC
//! works for thousands of attachments. All through the real binary.

use crate::common;

use std::time::Duration;

use common::{Plugin, TestDaemon, TestDir, assert_ok, conf, db, json};
use metis::wire::client::Client;
use metis::wire::{Code, Request, ipam, reason, request};

const V4: &str = r#"[[{"subnet":"198.18.0.0/24"}]]"#;

/// A kubelet-shaped container id: 64 hex characters.
fn kubelet_id(n: usize) -> String {
    format!("{n:064x}")
}

fn owners(dir: &TestDir) -> Vec<String> {
    db(&dir.join("metis.sqlite"))
        .prepare(
            "SELECT container_id FROM ip_addresses \
             WHERE is_allocated = 1 AND container_id != '' ORDER BY container_id",
        )
        .unwrap()
        .query_map([], |row| row.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn gc_config(dir: &TestDir, valid: &[String]) -> String {
    let attachments: Vec<serde_json::Value> = valid
        .iter()
        .map(|id| serde_json::json!({"containerID": id, "ifname": "eth0"}))
        .collect();
    conf(dir, "1.1.0", V4, "")
        .replace(
            r#""type":"metis","ranges""#,
            r#""type":"metis","gcGracePeriod":"0s","ranges""#,
        )
        .replace(
            r#""type":"metis","ipam""#,
            &format!(
                r#""type":"metis","cni.dev/valid-attachments":{},"ipam""#,
                serde_json::Value::from(attachments)
            ),
        )
}

#[test]
fn gc_with_five_thousand_attachments_succeeds_through_the_daemon() {
    let dir = TestDir::new("limits-gc");
    let daemon = TestDaemon::start(&dir, &[]);
    let config = conf(&dir, "1.1.0", V4, "");
    let (kept, stale) = (kubelet_id(7), kubelet_id(9_999_999));
    for id in [&kept, &stale] {
        assert_ok(&Plugin::new("ADD", id).run(&config));
    }
    let mut valid: Vec<String> = (0..5_000).map(kubelet_id).collect();
    assert!(valid.contains(&kept));
    valid.sort();
    let gc = gc_config(&dir, &valid);
    assert!(
        gc.len() > 400_000,
        "the list is realistic: {} bytes",
        gc.len()
    );
    let output = Plugin::new("GC", "").run(&gc);
    assert_ok(&output);
    assert_eq!(owners(&dir), vec![kept]);
    // Repeating it is as good (no permanent failure, nothing left to do).
    assert_ok(&Plugin::new("GC", "").run(&gc));
    let log = daemon.log();
    assert!(
        log.contains("GC released a stale allocation"),
        "the daemon, not direct mode, served GC: {log}"
    );
}

#[test]
fn oversized_identifiers_are_refused_the_same_in_both_modes() {
    let dir = TestDir::new("limits-ids");
    let config = conf(&dir, "1.1.0", V4, "");
    let long_id = "a".repeat(70_000);
    let long_network = conf(&dir, "1.1.0", V4, "").replace(
        r#""type":"metis","ranges""#,
        &format!(
            r#""type":"metis","network":"{}","ranges""#,
            "n".repeat(100_000)
        ),
    );
    let check = |what: &str| {
        let add = Plugin::new("ADD", &long_id).run(&config);
        assert_eq!(json(&add)["code"], 4, "{what}: {add:?}");
        let msg = json(&add)["msg"].as_str().unwrap().to_string();
        assert!(
            msg.ends_with("is 70000 bytes, more than the 256 allowed"),
            "{what}: {msg}"
        );
        assert!(msg.len() < 300, "{what}: the id is not echoed whole");
        let del = Plugin::new("DEL", &long_id).run(&config);
        assert_eq!(json(&del)["code"], 4, "{what}");
        let add = Plugin::new("ADD", "ctr-1").run(&long_network);
        assert_eq!(json(&add)["code"], 7, "{what}: {add:?}");
        assert!(
            json(&add)["msg"]
                .as_str()
                .unwrap()
                .starts_with("invalid ipam.network \"nnn"),
            "{what}: {add:?}"
        );
        let pod = Plugin {
            args: "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=\u{1}",
            ..Plugin::new("ADD", "ctr-1")
        };
        assert_eq!(json(&pod.run(&config))["code"], 4, "{what}");
    };
    check("direct mode");
    let daemon = TestDaemon::start(&dir, &[]);
    check("daemon mode");
    assert!(owners(&dir).is_empty());
    drop(daemon);
}

#[test]
fn the_daemon_applies_the_same_bounds_over_the_socket() {
    let dir = TestDir::new("limits-wire");
    let daemon = TestDaemon::start(&dir, &[]);
    let mut client = Client::connect(
        &daemon.socket,
        Duration::from_secs(2),
        Duration::from_secs(10),
    )
    .unwrap();
    let allocate = |container: &str, ifname: &str, network: &str| Request {
        kind: Some(request::Kind::Allocate(ipam::AllocatePodIpRequest {
            network: network.into(),
            ipv4_config: Some(ipam::IpConfig {
                interface_name: ifname.into(),
                container_id: container.into(),
                initial_pod_cidr: "198.18.0.0/24".into(),
                ..Default::default()
            }),
            ..Default::default()
        })),
    };
    let long = "c".repeat(257);
    for (container, ifname, network, why) in [
        ("a\0b", "eth0", "", "invalid container_id \"a\\0b\""),
        ("a/b", "eth0", "", "invalid container_id \"a/b\""),
        (long.as_str(), "eth0", "", "is 257 bytes, more than the 256"),
        ("ok", "eth/0", "", "invalid interface_name"),
        ("ok", "eth0", "my net", "invalid network \"my net\""),
    ] {
        let reply = client.call(&allocate(container, ifname, network)).unwrap();
        let status = reply.status.clone().unwrap();
        assert_eq!(reply.code(), Code::InvalidArgument, "{container:?}");
        assert_eq!(status.reason, reason::INVALID_REQUEST);
        assert!(status.message.contains(why), "{}", status.message);
    }
    let deallocate = Request {
        kind: Some(request::Kind::Deallocate(ipam::DeallocatePodIpRequest {
            container_id: "x\0".into(),
            interface_name: "eth0".into(),
            ..Default::default()
        })),
    };
    assert_eq!(
        client.call(&deallocate).unwrap().code(),
        Code::InvalidArgument
    );
    assert!(owners(&dir).is_empty());

    // An upstream admin client's raw SQL filter is refused, not ignored.
    let filtered = Request {
        kind: Some(request::Kind::ListCidrBlocks(
            metis::wire::admin::v1::ListCidrBlocksRequest {
                filter: "state = 'Ready'".into(),
                ..Default::default()
            },
        )),
    };
    let reply = client.call(&filtered).unwrap();
    assert_eq!(reply.code(), Code::InvalidArgument);
    assert!(
        reply.status.unwrap().message.contains("raw SQL `filter`"),
        "refused with a reason"
    );
}

/// The test configuration with its database and log at paths below `dir`
/// whose directories do not exist yet.
fn conf_under(dir: &TestDir, db: &str, log: &str) -> String {
    conf(dir, "1.1.0", V4, "")
        .replace(
            dir.join("metis.sqlite").to_str().unwrap(),
            dir.join(db).to_str().unwrap(),
        )
        .replace(
            dir.join("cni.log").to_str().unwrap(),
            dir.join(log).to_str().unwrap(),
        )
}

fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// STATUS with the daemon down creates nothing, and is not ready when the
/// database can be neither opened nor created.
#[test]
fn status_is_truthful_and_creates_nothing() {
    let dir = TestDir::new("limits-status");
    let nested = conf_under(&dir, "data/metis.sqlite", "logs/cni.log");
    assert_ok(&Plugin::new("STATUS", "").run(&nested));
    assert!(listing(&dir.path).is_empty(), "{:?}", listing(&dir.path));

    let impossible = nested.replace(
        dir.join("data/metis.sqlite").to_str().unwrap(),
        "/proc/metis-test/metis.sqlite",
    );
    let status = Plugin::new("STATUS", "").run(&impossible);
    assert_eq!(status.status.code(), Some(1));
    let error = json(&status);
    assert_eq!(error["code"], 50, "{error}");
    assert!(
        error["msg"]
            .as_str()
            .unwrap()
            .contains("/proc/metis-test/metis.sqlite cannot be created"),
        "{error}"
    );
    assert!(!std::path::Path::new("/proc/metis-test").exists());
    assert!(listing(&dir.path).is_empty());

    // After a direct-mode ADD, STATUS reads the database and adds no file
    // of its own. SQLite's read-only connection may leave the database's
    // WAL companions (same mode; the next writer removes them).
    assert_ok(&Plugin::new("ADD", "ctr-1").run(&nested));
    let logs = listing(&dir.join("logs"));
    assert_ok(&Plugin::new("STATUS", "").run(&nested));
    assert_eq!(listing(&dir.join("logs")), logs);
    let mut data = listing(&dir.join("data"));
    data.retain(|name| !name.ends_with("-wal") && !name.ends_with("-shm"));
    assert_eq!(data, vec!["metis.sqlite"]);
}

/// A dual-stack conflist whose IPv4 range has host-local bounds: STATUS
/// takes each bound with the ranges of its own family (it once checked the
/// IPv4 bound against the IPv6 ranges and refused every such STATUS).
#[test]
fn status_of_a_dual_stack_conflist_with_bounds_is_ready() {
    let dir = TestDir::new("limits-status-dual");
    let ranges = r#"[[{"subnet":"198.18.0.0/24","rangeStart":"198.18.0.10","rangeEnd":"198.18.0.20"}],[{"subnet":"2001:db8::/64"}]]"#;
    let conf = common::conf(&dir, "1.1.0", ranges, "");
    let added = Plugin::new("ADD", "ctr-1").run(&conf);
    assert_ok(&added);
    assert_eq!(json(&added)["ips"][0]["address"], "198.18.0.10/24");
    let status = Plugin::new("STATUS", "").run(&conf);
    assert_ok(&status);
    assert!(status.stdout.is_empty(), "{:?}", status.stdout);
}

/// Files are as private as documented: directories the plugin creates are
/// 0700, and a database that exists with mode 0644 is tightened to 0600.
#[test]
fn direct_mode_keeps_files_private() {
    use std::os::unix::fs::PermissionsExt;
    let mode =
        |path: &std::path::Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o7777;
    let dir = TestDir::new("limits-modes");
    let nested = conf_under(&dir, "data/metis.sqlite", "data/cni.log");
    assert_ok(&Plugin::new("ADD", "ctr-1").run(&nested));
    assert_eq!(mode(&dir.join("data")), 0o700);
    let db_path = dir.join("data/metis.sqlite");
    assert_eq!(mode(&db_path), 0o600);

    std::fs::set_permissions(&db_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_ok(&Plugin::new("ADD", "ctr-2").run(&nested));
    assert_eq!(mode(&db_path), 0o600);
    for companion in ["metis.sqlite-wal", "metis.sqlite-shm"] {
        let path = dir.join("data").join(companion);
        if path.exists() {
            assert_eq!(mode(&path), 0o600, "{companion}");
        }
    }

    // A shared directory is left alone but reported in the log.
    std::fs::set_permissions(dir.join("data"), std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_ok(&Plugin::new("ADD", "ctr-3").run(&nested));
    assert_eq!(mode(&dir.join("data")), 0o755);
    let log = std::fs::read_to_string(dir.join("data/cni.log")).unwrap();
    assert!(log.contains("has mode 0755"), "{log}");
}

/// `--cidr NAME=` and `--node-network` follow the rule of `name`.
#[test]
fn daemon_flags_validate_network_names_like_name() {
    for args in [
        &["daemon", "--cidr", "my net=198.18.0.0/24"][..],
        &["daemon", "--cidr", "-pods=198.18.0.0/24"],
    ] {
        let output = common::metis(args);
        let (stdout, stderr) = common::out_err(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stdout, "");
        assert!(stderr.contains("--cidr"), "{stderr}");
        assert!(stderr.contains("network name"), "{stderr}");
    }
}
