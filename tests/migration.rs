//! Moving a live node from host-local to Metis and back, through the real
//! binaries: host-local allocates pods, `metis import host-local` records
//! them, Metis serves more pods without overlap and DEL/CHECK work for the
//! imported ones, and after `metis export host-local` host-local serves
//! again without re-issuing an address Metis handed out.

use crate::common;

use std::collections::BTreeSet;
use std::process::Output;

use common::host_local::{require_host_local, run_ipam, with_host_local};
use common::{METIS, TestDir, metis, out_err};
use serde_json::{Value, json};

/// The network as the operator's conflist has it (host-local syntax).
fn plugin(dir: &TestDir) -> Value {
    json!({"cniVersion": "1.0.0", "name": "mig", "type": "bridge",
           "ipam": {"type": "metis",
                    "ranges": [[{"subnet": "198.18.0.0/24", "rangeStart": "198.18.0.10", "rangeEnd": "198.18.0.40"}],
                               [{"subnet": "2001:db8::/120"}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": dir.join("networks"),
                    "dbPath": dir.join("db/metis.sqlite"),
                    "daemonSocket": dir.join("metis.sock"),
                    "logFile": dir.join("cni.log")}})
}

fn addresses(output: &Output) -> Vec<String> {
    assert!(output.status.success(), "{:?}", out_err(output));
    let result: Value = serde_json::from_slice(&output.stdout).unwrap();
    result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ip| {
            ip["address"]
                .as_str()
                .unwrap()
                .split('/')
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// ADDs four pods `PREFIX-N` through `binary`; every address they got.
fn add_pods(binary: &str, prefix: &str, conf: &Value) -> BTreeSet<String> {
    (0..4)
        .flat_map(|i| {
            addresses(&run_ipam(
                binary,
                "ADD",
                &format!("{prefix}-{i}"),
                &conf.to_string(),
            ))
        })
        .collect()
}

/// Every (address, container, interface) row of the database, reserved
/// rows included: what "changes nothing" is measured against.
fn rows(dir: &TestDir) -> Vec<(String, String, String, bool)> {
    let db = common::db(&dir.join("db/metis.sqlite"));
    let mut stmt = db
        .prepare("SELECT address, COALESCE(container_id,''), COALESCE(interface_name,''), is_allocated FROM ip_addresses ORDER BY id")
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

fn import(config: &std::path::Path, extra: &[&str]) -> Output {
    let mut args = vec!["import", "host-local", "--config", config.to_str().unwrap()];
    args.extend(extra);
    metis(&args)
}

#[test]
fn a_node_moves_to_metis_and_back_without_reissuing_an_address() {
    // docs/design.md cites this test for a guarantee: without host-local
    // it fails rather than pass having proven nothing.
    let host_local_bin = require_host_local();
    let dir = TestDir::new("migration");
    let metis_conf = plugin(&dir);
    let config = dir.join("10-mig.conflist");
    std::fs::write(
        &config,
        json!({"cniVersion": "1.0.0", "name": "mig", "plugins": [metis_conf, {"type": "portmap"}]})
            .to_string(),
    )
    .unwrap();
    // host-local's state where the config's dataDir says.
    let mut hl_conf = with_host_local(&metis_conf, &dir);
    hl_conf["ipam"]["dataDir"] = json!(dir.join("networks"));
    let held = add_pods(host_local_bin, "hl", &hl_conf);
    assert_eq!(held.len(), 8);

    // Dry run: says what it would do, creates nothing.
    let dry = import(&config, &["--dry-run"]);
    let (out, err) = out_err(&dry);
    assert_eq!(dry.status.code(), Some(0), "{err}");
    assert!(
        out.contains(
            "would: recorded 198.18.0.10, 2001:db8::2 for container \"hl-0\" interface \"eth0\""
        ),
        "{out}"
    );
    assert!(!dir.join("db/metis.sqlite").exists());

    let first = import(&config, &[]);
    assert_eq!(first.status.code(), Some(0), "{:?}", out_err(&first));
    let after_first = rows(&dir);
    let again = import(&config, &[]);
    assert_eq!(again.status.code(), Some(0));
    assert_eq!(out_err(&again).0.matches("unchanged").count(), 4);
    assert_eq!(rows(&dir), after_first, "a second import changes nothing");

    // Metis serves more pods (direct mode: no daemon) without overlap.
    let served = add_pods(METIS, "m", &metis_conf);
    assert_eq!(served.len(), 8);
    assert!(held.is_disjoint(&served), "{held:?} {served:?}");

    // CHECK and DEL work for a host-local-era pod; its address comes free.
    let check = run_ipam(METIS, "CHECK", "hl-0", &metis_conf.to_string());
    assert!(check.status.success(), "{:?}", out_err(&check));
    let del = run_ipam(METIS, "DEL", "hl-0", &metis_conf.to_string());
    assert!(del.status.success(), "{:?}", out_err(&del));
    assert!(
        !rows(&dir)
            .iter()
            .any(|(_, c, _, allocated)| c == "hl-0" && *allocated)
    );

    // An address host-local records for another owner than Metis's is a
    // conflict: refused, nothing written.
    let before = rows(&dir);
    std::fs::write(dir.join("networks/mig/198.18.0.14"), "intruder\r\neth0").unwrap();
    let refused = import(&config, &[]);
    let (_, err) = out_err(&refused);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(
        err.contains("198.18.0.14 of container \"intruder\" interface \"eth0\""),
        "{err}"
    );
    assert!(err.contains("nothing was imported"), "{err}");
    assert_eq!(rows(&dir), before);
    std::fs::remove_file(dir.join("networks/mig/198.18.0.14")).unwrap();

    // Back to host-local: export into a fresh data directory, then
    // host-local serves without touching any address Metis handed out.
    let back = dir.join("back");
    let export_to_back = || {
        metis(&[
            "export",
            "host-local",
            "--config",
            config.to_str().unwrap(),
            "--data-dir",
            back.to_str().unwrap(),
        ])
    };
    let export = export_to_back();
    assert_eq!(export.status.code(), Some(0), "{:?}", out_err(&export));
    let exported = std::fs::read_to_string(back.join("mig/198.18.0.11")).unwrap();
    assert_eq!(exported, "hl-1\r\neth0");
    let mut hl_back = hl_conf.clone();
    hl_back["ipam"]["dataDir"] = json!(back);
    let reissued = add_pods(host_local_bin, "back", &hl_back);
    let still_held: BTreeSet<String> = rows(&dir)
        .into_iter()
        .filter(|(_, c, _, allocated)| *allocated && !c.is_empty())
        .map(|(a, _, _, _)| a)
        .collect();
    assert_eq!(still_held.len(), 14);
    assert!(
        still_held.is_disjoint(&reissued),
        "{still_held:?} {reissued:?}"
    );
    // Exporting again writes nothing new.
    let export = export_to_back();
    assert_eq!(export.status.code(), Some(0), "{:?}", out_err(&export));
    assert!(!out_err(&export).0.contains("wrote"));
}

#[test]
fn misuse_and_hostile_directories_are_refused() {
    let dir = TestDir::new("migration-misuse");
    let config = dir.join("net.conf");
    std::fs::write(&config, plugin(&dir).to_string()).unwrap();
    let config = config.to_str().unwrap();
    for (args, code, needle) in [
        (vec!["import"], 2, "the only source is `host-local`"),
        (vec!["import", "host-local"], 2, "--config FILE is required"),
        (
            vec!["export", "host-local", "--config", config, "--dry-run"],
            2,
            "--dry-run is for import",
        ),
        (
            vec!["import", "host-local", "--config", "/nonexistent.conf"],
            1,
            "/nonexistent.conf: No such file",
        ),
        (
            vec!["export", "host-local", "--config", config],
            1,
            "no Metis database here",
        ),
    ] {
        let output = metis(&args);
        let (_, err) = out_err(&output);
        assert_eq!(output.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let net = dir.join("networks/mig");
    std::fs::create_dir_all(&net).unwrap();
    for (name, content, needle) in [
        (
            "198.18.1.5",
            "c\r\neth0",
            "198.18.1.5 (container \"c\") is outside every range",
        ),
        ("198.18.0.20", "", "198.18.0.20: expected"),
        (
            "not-an-ip",
            "c",
            "not-an-ip: not an address file of host-local",
        ),
    ] {
        std::fs::write(net.join(name), content).unwrap();
        let output = metis(&["import", "host-local", "--config", config]);
        let (_, err) = out_err(&output);
        assert_eq!(output.status.code(), Some(1), "{name}: {err}");
        assert!(err.contains(needle), "{name}: {err}");
        assert!(!dir.join("db/metis.sqlite").exists());
        std::fs::remove_file(net.join(name)).unwrap();
    }
}

#[test]
fn an_import_after_a_reboot_runs_boot_recovery_first_so_it_is_not_undone() {
    let dir = TestDir::new("migration-boot");
    let conf = plugin(&dir);
    let config = dir.join("net.conf");
    std::fs::write(&config, conf.to_string()).unwrap();
    let boot = dir.join("boot_id");
    let with_boot = |command: &mut std::process::Command| {
        command.env("METIS_BOOT_ID_FILE", &boot);
    };
    std::fs::write(&boot, "boot-a\n").unwrap();
    let mut add = std::process::Command::new(METIS);
    with_boot(&mut add);
    add.env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", "before-reboot")
        .env("CNI_NETNS", "/var/run/netns/test")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/opt/cni/bin");
    let output = common::run_with_stdin(add, &conf.to_string());
    assert!(output.status.success(), "{:?}", out_err(&output));

    std::fs::write(&boot, "boot-b\n").unwrap();
    std::fs::create_dir_all(dir.join("networks/mig")).unwrap();
    std::fs::write(dir.join("networks/mig/198.18.0.30"), "after-reboot\r\neth0").unwrap();
    let mut import = std::process::Command::new(METIS);
    with_boot(&mut import);
    let output = import
        .args(["import", "host-local", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let (out, err) = out_err(&output);
    assert_eq!(output.status.code(), Some(0), "{err}");
    assert!(
        out.contains("released 2 allocation(s) of the previous boot first"),
        "{out}"
    );
    let held: Vec<String> = rows(&dir)
        .into_iter()
        .filter(|(_, c, _, allocated)| *allocated && !c.is_empty())
        .map(|(a, c, _, _)| format!("{a} {c}"))
        .collect();
    assert_eq!(held, ["198.18.0.30 after-reboot"]);
}
