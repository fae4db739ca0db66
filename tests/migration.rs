//! Moving a live node from host-local to Metis and back, through the real
//! binaries: host-local allocates pods, `metis import host-local` records
//! them, Metis serves more pods without overlap and DEL/CHECK work for the
//! imported ones, and after `metis export host-local` host-local serves
//! again without re-issuing an address Metis handed out.

use crate::common;

use std::collections::BTreeSet;
use std::process::Output;

use common::host_local::{HOST_LOCAL, require_host_local, run_ipam, with_host_local};
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

    // Metis co-writes host-local's directory: its pods have files there,
    // so host-local (still run by a runtime mid-switch) never hands their
    // addresses out; its DEL removed hl-0's.
    let net = dir.join("networks/mig");
    for address in &served {
        assert!(net.join(address).is_file(), "{address}");
    }
    assert!(!net.join("198.18.0.10").exists());
    // A pod deleted through host-local after the import is released by
    // the next import.
    let del = run_ipam(host_local_bin, "DEL", "hl-1", &hl_conf.to_string());
    assert!(del.status.success(), "{:?}", out_err(&del));
    let again = import(&config, &[]);
    let (out, err) = out_err(&again);
    assert_eq!(again.status.code(), Some(0), "{err}");
    assert!(
        out.contains(
            "released 198.18.0.11 of container \"hl-1\" interface \"eth0\": host-local released it"
        ),
        "{out}"
    );
    assert!(
        !rows(&dir)
            .iter()
            .any(|(_, c, _, allocated)| c == "hl-1" && *allocated)
    );

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
    let exported = std::fs::read_to_string(back.join("mig/198.18.0.12")).unwrap();
    assert_eq!(exported, "hl-2\r\neth0");
    let mut hl_back = hl_conf.clone();
    hl_back["ipam"]["dataDir"] = json!(back);
    let reissued = add_pods(host_local_bin, "back", &hl_back);
    let still_held: BTreeSet<String> = rows(&dir)
        .into_iter()
        .filter(|(_, c, _, allocated)| *allocated && !c.is_empty())
        .map(|(a, _, _, _)| a)
        .collect();
    assert_eq!(still_held.len(), 12);
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
        (
            "198.18.0.20",
            "",
            "198.18.0.20: not host-local's \"CONTAINER\\r\\nIFNAME\" (0 bytes, content not shown)",
        ),
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

/// `metis ARGS…` that must end within a deadline (an import must never
/// hang on a FIFO): killed and failed otherwise.
fn metis_within(args: &[&str], deadline: std::time::Duration) -> Output {
    let mut child = std::process::Command::new(METIS)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    if common::poll(deadline, || child.try_wait().unwrap()).is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("{args:?} still running after {deadline:?}");
    }
    child.wait_with_output().unwrap()
}

#[test]
fn links_fifos_devices_directories_and_odd_names_are_refused_unread() {
    let dir = TestDir::new("migration-odd");
    let config = dir.join("net.conf");
    std::fs::write(&config, plugin(&dir).to_string()).unwrap();
    let config = config.to_str().unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "root:TOPSECRET-hash:19000:0:99999:7:::\n").unwrap();
    let net = dir.join("networks/mig");
    std::fs::create_dir_all(&net).unwrap();
    type Make<'a> = Box<dyn Fn(&std::path::Path) + 'a>;
    let cases: Vec<(&str, Make<'_>, &str)> = vec![
        (
            "198.18.0.21",
            Box::new(|p| std::os::unix::fs::symlink(&secret, p).unwrap()),
            "is a symbolic link, not an address file of host-local; not read or followed",
        ),
        (
            "198.18.0.22",
            Box::new(|p| {
                nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap()
            }),
            "is a FIFO, not an address file",
        ),
        (
            "198.18.0.23",
            Box::new(|p| {
                nix::sys::stat::mknod(
                    p,
                    nix::sys::stat::SFlag::S_IFCHR,
                    nix::sys::stat::Mode::from_bits_truncate(0o600),
                    nix::sys::stat::makedev(1, 3),
                )
                .unwrap()
            }),
            "is a device, not an address file",
        ),
        (
            "198.18.0.24",
            Box::new(|p| std::fs::create_dir(p).unwrap()),
            "is a directory, not an address file",
        ),
        (
            "198.18.0.25",
            Box::new(|p| std::fs::hard_link(&secret, p).unwrap()),
            "is a file with several hard links",
        ),
        (
            "2001:DB8::5",
            Box::new(|p| std::fs::write(p, "c5\r\neth0").unwrap()),
            "2001:DB8::5: not host-local's spelling of 2001:db8::5: host-local names it \"2001:db8::5\"",
        ),
    ];
    for (name, make, needle) in cases {
        let path = net.join(name);
        make(&path);
        let output = metis_within(
            &["import", "host-local", "--config", config],
            std::time::Duration::from_secs(20),
        );
        let (out, err) = out_err(&output);
        assert_eq!(output.status.code(), Some(1), "{name}: {out}{err}");
        assert!(err.contains(needle), "{name}: {err}");
        assert!(
            !err.contains("TOPSECRET") && !out.contains("TOPSECRET"),
            "{name}: {err}"
        );
        assert!(
            !dir.join("db/metis.sqlite").exists(),
            "{name}: nothing recorded"
        );
        if std::fs::symlink_metadata(&path).unwrap().is_dir() {
            std::fs::remove_dir(&path).unwrap();
        } else {
            std::fs::remove_file(&path).unwrap();
        }
    }
    assert_eq!(
        std::fs::read_to_string(&secret).unwrap(),
        "root:TOPSECRET-hash:19000:0:99999:7:::\n"
    );

    // A network directory that is a link is neither read nor written.
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::write(elsewhere.join("198.18.0.30"), "c30\r\neth0").unwrap();
    std::fs::remove_dir(&net).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &net).unwrap();
    let output = import(std::path::Path::new(config), &[]);
    let (_, err) = out_err(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("mig: is a symbolic link"), "{err}");
    assert!(!dir.join("db/metis.sqlite").exists());
    // Export: a database with a pod, a planted link where the directory goes.
    let add = run_ipam(METIS, "ADD", "m-0", &plugin(&dir).to_string());
    assert!(add.status.success(), "{:?}", out_err(&add));
    let output = metis(&["export", "host-local", "--config", config]);
    let (_, err) = out_err(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("mig: is a symbolic link"), "{err}");
    let names: Vec<_> = std::fs::read_dir(&elsewhere)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["198.18.0.30"], "nothing written through the link");
}

#[test]
fn a_dry_run_creates_nothing_next_to_the_database() {
    let dir = TestDir::new("migration-dry");
    let conf = plugin(&dir);
    let config = dir.join("net.conf");
    std::fs::write(&config, conf.to_string()).unwrap();
    // A database Metis used and closed: no -wal or -shm beside it.
    let add = run_ipam(METIS, "ADD", "m-0", &conf.to_string());
    assert!(add.status.success(), "{:?}", out_err(&add));
    let db = dir.join("db/metis.sqlite");
    let beside = |suffix: &str| dir.join(&format!("db/metis.sqlite{suffix}"));
    // Direct mode leaves its WAL for the next exec; the last connection to
    // close folds it in and removes both files, so whatever stands beside
    // the database afterwards is the dry run's doing.
    let last = rusqlite::Connection::open(&db).unwrap();
    last.query_row("SELECT count(*) FROM ip_addresses", [], |_| Ok(()))
        .unwrap();
    drop(last);
    assert!(!beside("-wal").exists() && !beside("-shm").exists());
    let before = std::fs::read(&db).unwrap();
    std::fs::create_dir_all(dir.join("networks/mig")).unwrap();
    std::fs::write(dir.join("networks/mig/198.18.0.30"), "hl-0\r\neth0").unwrap();
    let dry = import(&config, &["--dry-run"]);
    let (out, err) = out_err(&dry);
    assert_eq!(dry.status.code(), Some(0), "{err}");
    assert!(
        out.contains("would: recorded 198.18.0.30 for container \"hl-0\""),
        "{out}"
    );
    assert!(!beside("-wal").exists(), "dry run created -wal");
    assert!(!beside("-shm").exists(), "dry run created -shm");
    assert_eq!(std::fs::read(&db).unwrap(), before);
    let names: Vec<_> = std::fs::read_dir(dir.join("networks/mig"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["198.18.0.30"], "host-local's directory untouched");
}

#[test]
fn bounds_dead_containers_chains_and_range_sets() {
    let dir = TestDir::new("migration-smaller");
    let net = dir.join("networks/mig");
    std::fs::create_dir_all(&net).unwrap();
    let mut conf = plugin(&dir);
    // The chain: the first plugin with an ipam object is not host-local's.
    let list = |conf: &Value| {
        json!({"cniVersion": "1.0.0", "name": "mig", "plugins": [
            {"type": "macvlan", "ipam": {"type": "dhcp"}},
            conf, {"type": "portmap"}]})
    };
    conf["ipam"]["type"] = json!("host-local");
    let config = dir.join("10-mig.conflist");
    std::fs::write(&config, list(&conf).to_string()).unwrap();

    // Inside the subnet, outside rangeStart..rangeEnd.
    std::fs::write(net.join("198.18.0.5"), "low\r\neth0").unwrap();
    let output = import(&config, &[]);
    let (_, err) = out_err(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(
        err.contains("198.18.0.5 (container \"low\") is outside rangeStart 198.18.0.10..rangeEnd 198.18.0.40 of subnet 198.18.0.0/24"),
        "{err}"
    );
    std::fs::remove_file(net.join("198.18.0.5")).unwrap();

    // A file from before this boot: imported, with a warning.
    let old = net.join("198.18.0.30");
    std::fs::write(&old, "old\r\neth0").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&old)
        .unwrap()
        .set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000))
        .unwrap();
    let output = import(&config, &[]);
    let (out, err) = out_err(&output);
    assert_eq!(output.status.code(), Some(0), "{err}");
    assert!(
        out.contains("recorded 198.18.0.30 for container \"old\""),
        "{out}"
    );
    assert!(
        out.contains("warning: 198.18.0.30 of container \"old\" was written before this boot"),
        "{out}"
    );

    // Two IPv4 range sets (host-local gives one address of each): read as
    // host-local reads them, served as one, with a note.
    let mut two = conf.clone();
    two["ipam"]["ranges"] = json!([[{"subnet": "198.18.0.0/24", "rangeStart": "198.18.0.10", "rangeEnd": "198.18.0.40"}],
                                   [{"subnet": "198.18.2.0/24"}], [{"subnet": "2001:db8::/120"}]]);
    std::fs::write(&config, list(&two).to_string()).unwrap();
    std::fs::write(net.join("198.18.2.7"), "second\r\neth0").unwrap();
    let output = import(&config, &[]);
    let (out, err) = out_err(&output);
    assert_eq!(output.status.code(), Some(0), "{err}");
    assert!(
        err.contains("note: range sets [0, 1] are all ipv4"),
        "{err}"
    );
    assert!(
        out.contains("recorded 198.18.2.7 for container \"second\""),
        "{out}"
    );
    let mut old_version = list(&two);
    old_version["cniVersion"] = json!("0.2.0");
    std::fs::write(&config, old_version.to_string()).unwrap();
    let output = import(&config, &[]);
    let (_, err) = out_err(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(
        err.contains("CNI version 0.2.0 does not support more than 1 address per family"),
        "{err}"
    );
}

/// What the runtime believes: every live container's addresses, and those
/// whose DEL is under way (they may have released already).
#[derive(Default)]
struct Pods {
    live: std::collections::BTreeMap<String, Vec<String>>,
    deleting: BTreeSet<String>,
    next: usize,
    violations: Vec<String>,
}

impl Pods {
    /// Records an ADD's result, first checking that no other live pod
    /// holds one of its addresses.
    fn added(&mut self, id: &str, by: &str, addresses: Vec<String>) {
        for address in &addresses {
            for (other, held) in &self.live {
                if held.contains(address) && !self.deleting.contains(other) {
                    self.violations.push(format!(
                        "{by} gave {address} to {id} while {other} holds it"
                    ));
                }
            }
        }
        self.live.insert(id.to_string(), addresses);
    }
}

/// Both plugins on one network, as during a switch: the runtime runs
/// whichever the conflist names at that moment.
struct Live {
    metis: Value,
    host_local: Value,
    pods: std::sync::Mutex<Pods>,
    /// Percent of operations run through Metis.
    metis_share: std::sync::atomic::AtomicU64,
    host_local_running: std::sync::atomic::AtomicUsize,
    ops: std::sync::atomic::AtomicUsize,
    stop: std::sync::atomic::AtomicBool,
}

impl Live {
    /// Runs `command` for `id` through a plugin drawn by the current share.
    fn run(&self, rng: &mut common::rng::Rng, command: &str, id: &str) -> (&'static str, Output) {
        use std::sync::atomic::Ordering::SeqCst;
        // Counted before the share is read, so a switch can wait for every
        // host-local run that may have drawn the old share.
        self.host_local_running.fetch_add(1, SeqCst);
        let output = if rng.chance(self.metis_share.load(SeqCst)) {
            self.host_local_running.fetch_sub(1, SeqCst);
            return (METIS, run_ipam(METIS, command, id, &self.metis.to_string()));
        } else {
            run_ipam(HOST_LOCAL, command, id, &self.host_local.to_string())
        };
        self.host_local_running.fetch_sub(1, SeqCst);
        (HOST_LOCAL, output)
    }

    /// Sets the share of Metis; at 100, waits until no host-local run is left.
    fn share(&self, percent: u64) {
        use std::sync::atomic::Ordering::SeqCst;
        self.metis_share.store(percent, SeqCst);
        if percent == 100 {
            common::wait_for(
                "host-local runs to end",
                std::time::Duration::from_secs(60),
                || self.host_local_running.load(SeqCst) == 0,
            );
        }
    }

    fn del(&self, id: &str, rng: &mut common::rng::Rng) {
        let (binary, output) = self.run(rng, "DEL", id);
        let mut pods = self.pods.lock().unwrap();
        if !output.status.success() {
            pods.violations
                .push(format!("{binary} DEL {id} failed: {:?}", out_err(&output)));
        }
        pods.live.remove(id);
        pods.deleting.remove(id);
    }

    /// One random ADD or DEL through a random plugin; a failed ADD is
    /// followed by its DEL, as the runtime does.
    fn step(&self, rng: &mut common::rng::Rng) {
        let victim = {
            let mut pods = self.pods.lock().unwrap();
            let candidates: Vec<String> = pods
                .live
                .keys()
                .filter(|id| !pods.deleting.contains(*id))
                .cloned()
                .collect();
            if !candidates.is_empty() && (candidates.len() >= 12 || rng.chance(40)) {
                let id = candidates[rng.index(candidates.len())].clone();
                pods.deleting.insert(id.clone());
                Err(id)
            } else {
                pods.next += 1;
                Ok(format!("p{}", pods.next))
            }
        };
        match victim {
            Err(id) => self.del(&id, rng),
            Ok(id) => {
                let (binary, output) = self.run(rng, "ADD", &id);
                if output.status.success() {
                    let got = addresses(&output);
                    self.pods.lock().unwrap().added(&id, binary, got);
                } else {
                    let text = String::from_utf8_lossy(&output.stdout);
                    // Exhaustion or a busy database: the runtime retries.
                    let transient = text.contains("\"code\": 11")
                        || text.contains("\"code\":11")
                        || text.contains("no IP addresses available");
                    if !transient {
                        self.pods
                            .lock()
                            .unwrap()
                            .violations
                            .push(format!("{binary} ADD {id} failed: {:?}", out_err(&output)));
                    }
                    self.pods.lock().unwrap().deleting.insert(id.clone());
                    self.del(&id, rng);
                }
            }
        }
        self.ops.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Lets the burst run `more` further operations.
    fn run_for(&self, more: usize) {
        let target = self.ops.load(std::sync::atomic::Ordering::SeqCst) + more;
        common::wait_for("the burst", std::time::Duration::from_secs(300), || {
            self.ops.load(std::sync::atomic::Ordering::SeqCst) >= target
        });
    }
}

/// Every (address, container) host-local's files and Metis's rows record
/// for network `live`, read under host-local's lock (which also holds off
/// Metis's allocations in the co-written directory).
fn records(dir: &TestDir) -> Vec<(String, String)> {
    let net = dir.join("networks/live");
    let lock = std::fs::File::options()
        .read(true)
        .append(true)
        .create(true)
        .open(net.join("lock"))
        .unwrap();
    let _locked = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).unwrap();
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&net).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().into_string().unwrap();
        if name == "lock" || name.starts_with("last_reserved_ip.") {
            continue;
        }
        let content = std::fs::read_to_string(entry.path()).unwrap();
        let container = content.split("\r\n").next().unwrap().trim().to_string();
        out.push((name, container));
    }
    let db = [dir.join("metis.sqlite"), dir.join("db/metis.sqlite")]
        .into_iter()
        .find(|db| db.exists());
    if let Some(db) = db {
        let db = common::db(&db);
        let mut stmt = db
            .prepare(
                "SELECT a.address, a.container_id FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
                 WHERE b.network = 'live' AND a.is_allocated = 1 AND COALESCE(a.container_id, '') != ''",
            )
            .unwrap();
        out.extend(
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .map(Result::unwrap),
        );
    }
    out
}

/// No address recorded for two live pods across both plugins' records,
/// and no earlier violation.
fn assert_one_owner(live: &Live, dir: &TestDir, step: &str) {
    let records = records(dir);
    let pods = live.pods.lock().unwrap();
    let mut owners: std::collections::BTreeMap<&str, BTreeSet<&str>> = Default::default();
    for (address, container) in &records {
        if pods.live.contains_key(container) && !pods.deleting.contains(container) {
            owners.entry(address).or_default().insert(container);
        }
    }
    let shared: Vec<_> = owners.iter().filter(|(_, o)| o.len() > 1).collect();
    assert!(shared.is_empty(), "after {step}: {shared:?}");
    assert!(
        pods.violations.is_empty(),
        "by {step}: {:?}",
        pods.violations
    );
}

/// One round: Metis in direct mode, or (`daemon`) behind a daemon.
fn live_round(seed: u64, daemon: bool) {
    let dir = TestDir::new("migration-live");
    // The daemon's database is the test daemon's; direct mode's as the
    // other tests have it.
    let db = if daemon {
        dir.join("metis.sqlite")
    } else {
        dir.join("db/metis.sqlite")
    };
    // A short cooldown: addresses cool down, and come back, within a round.
    let _daemon = daemon.then(|| common::TestDaemon::start(&dir, &["--release-cooldown", "2s"]));
    let metis_conf = json!({"cniVersion": "1.0.0", "name": "live", "type": "bridge",
        "ipam": {"type": "metis",
                 "ranges": [[{"subnet": "198.18.8.0/27"}], [{"subnet": "2001:db8:8::/123"}]],
                 "dataDir": dir.join("networks"),
                 "dbPath": db,
                 "daemonSocket": dir.join("metis.sock"),
                 "logFile": dir.join("cni.log")}});
    let mut host_local_conf = metis_conf.clone();
    host_local_conf["ipam"]["type"] = json!("host-local");
    let config = dir.join("10-live.conf");
    std::fs::write(&config, metis_conf.to_string()).unwrap();
    let live = Live {
        metis: metis_conf,
        host_local: host_local_conf,
        pods: Default::default(),
        metis_share: 0.into(),
        host_local_running: 0.into(),
        ops: 0.into(),
        stop: false.into(),
    };
    let mut rng = common::rng::Rng::new(seed);
    let share = |percent: u64| live.share(percent);
    let import_ok = |step: &str| {
        let output = import(&config, &[]);
        let (out, err) = out_err(&output);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{step} (seed {seed}): {out}{err}"
        );
        assert_one_owner(&live, &dir, step);
        out
    };
    let export_ok = |step: &str| {
        let output = metis(&["export", "host-local", "--config", config.to_str().unwrap()]);
        let (out, err) = out_err(&output);
        assert_eq!(
            output.status.code(),
            Some(0),
            "{step} (seed {seed}): {out}{err}"
        );
        assert_one_owner(&live, &dir, step);
    };
    std::thread::scope(|scope| {
        for _ in 0..3 {
            let mut rng = rng.fork();
            let live = &live;
            scope.spawn(move || {
                while !live.stop.load(std::sync::atomic::Ordering::SeqCst) {
                    live.step(&mut rng);
                }
            });
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            live.run_for(15);
            assert_one_owner(&live, &dir, "host-local alone");
            import_ok("the import");
            share(50); // the switch under way: either plugin runs
            live.run_for(30);
            import_ok("a re-import while both serve");
            live.run_for(20);
            share(100); // switched
            import_ok("the re-import after the switch");
            live.run_for(20);
            let again = import_ok("one more re-import");
            // Deferred addresses (cooling down in Metis) wait, not repairs.
            assert!(
                !again
                    .lines()
                    .any(|l| l.starts_with("released ") || l.starts_with("recorded ")),
                "nothing left to repair once Metis alone serves (seed {seed}): {again}"
            );
            export_ok("the export");
            share(50); // switching back
            live.run_for(30);
            export_ok("a re-export while both serve");
            share(0);
            live.run_for(20);
            assert_one_owner(&live, &dir, "host-local alone again");
        }));
        live.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    });
    // Drain: every pod goes, through either plugin; then nothing is held.
    share(50);
    let ids: Vec<String> = live.pods.lock().unwrap().live.keys().cloned().collect();
    for id in ids {
        live.del(&id, &mut rng);
    }
    assert_one_owner(&live, &dir, "the drain");
    import_ok("the import after the drain");
    let left = records(&dir);
    assert!(
        left.is_empty(),
        "leaked after the drain (seed {seed}): {left:?}"
    );
}

#[test]
fn both_plugins_live_through_the_switch_and_back_never_share_an_address() {
    // Without host-local this proves nothing: it fails instead.
    require_host_local();
    let seconds: u64 = std::env::var("METIS_MIGRATION_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    let mut seeds = common::rng::Rng::from_env("METIS_MIGRATION_SEED");
    let mut rounds = 0;
    loop {
        let seed = seeds.next_u64();
        let daemon = rounds % 2 == 1;
        eprintln!("round {rounds}: seed {seed}, daemon {daemon}");
        live_round(seed, daemon);
        rounds += 1;
        // At least one round of each mode.
        if rounds >= 2 && std::time::Instant::now() >= deadline {
            break;
        }
    }
    eprintln!("{rounds} round(s)");
}

#[test]
fn a_refused_import_writes_nothing_and_a_refused_export_writes_the_rest() {
    let dir = TestDir::new("migration-refused");
    let conf = plugin(&dir);
    let config = dir.join("net.conf");
    std::fs::write(&config, conf.to_string()).unwrap();
    // Metis served before any import: its pod's address has no file.
    let add = run_ipam(METIS, "ADD", "m-0", &conf.to_string());
    assert_eq!(addresses(&add), ["198.18.0.10", "2001:db8::2"]);
    let net = dir.join("networks/mig");
    // No host-local directory: nothing to import, and none is created.
    let nothing = import(&config, &[]);
    assert_eq!(nothing.status.code(), Some(0), "{:?}", out_err(&nothing));
    assert!(!net.exists());
    std::fs::create_dir_all(&net).unwrap();
    for (name, owner) in [
        ("198.18.0.20", "a1"),
        ("198.18.0.21", "a2"),
        ("198.18.0.10", "intruder"),
    ] {
        std::fs::write(net.join(name), format!("{owner}\r\neth0")).unwrap();
    }
    let before = rows(&dir);
    let refused = import(&config, &[]);
    let (out, err) = out_err(&refused);
    assert_eq!(refused.status.code(), Some(1), "{out}{err}");
    assert!(
        err.contains("198.18.0.10 of container \"intruder\" interface \"eth0\": ")
            && err.contains("held by container \"m-0\""),
        "{err}"
    );
    assert!(err.contains("nothing was imported"), "{err}");
    assert_eq!(
        rows(&dir),
        before,
        "one transaction: a1 and a2 not recorded either"
    );
    assert!(
        !net.join("2001:db8::2").exists(),
        "nothing written to host-local's directory"
    );

    // Export with the same conflict: refused by name, every other address
    // written, and the file of a container Metis does not hold reported.
    let export = metis(&["export", "host-local", "--config", config.to_str().unwrap()]);
    let (out, err) = out_err(&export);
    assert_eq!(export.status.code(), Some(1), "{out}{err}");
    assert!(
        err.contains("198.18.0.10: host-local records container \"intruder\" interface \"eth0\", metis container \"m-0\""),
        "{err}"
    );
    assert!(err.contains("every other address was written"), "{err}");
    assert_eq!(
        std::fs::read_to_string(net.join("2001:db8::2")).unwrap(),
        "m-0\r\neth0"
    );
    assert!(
        err.contains(&format!(
            "198.18.0.20 names container \"a1\", which metis does not hold: host-local keeps the address until that container's DEL; if the container is gone: rm {}",
            net.join("198.18.0.20").display()
        )),
        "{err}"
    );
}

#[test]
fn a_container_host_local_gave_another_address_moves_with_its_file_kept() {
    let dir = TestDir::new("migration-moved");
    let config = dir.join("net.conf");
    std::fs::write(&config, plugin(&dir).to_string()).unwrap();
    let net = dir.join("networks/mig");
    std::fs::create_dir_all(&net).unwrap();
    std::fs::write(net.join("198.18.0.20"), "c\r\neth0").unwrap();
    let first = import(&config, &[]);
    assert_eq!(first.status.code(), Some(0), "{:?}", out_err(&first));
    // host-local released c's address and gave it another (a re-ADD).
    std::fs::remove_file(net.join("198.18.0.20")).unwrap();
    std::fs::write(net.join("198.18.0.21"), "c\r\neth0").unwrap();
    let again = import(&config, &[]);
    let (out, err) = out_err(&again);
    assert_eq!(again.status.code(), Some(0), "{err}");
    assert!(
        out.contains("released 198.18.0.20 of container \"c\""),
        "{out}"
    );
    assert!(
        out.contains("recorded 198.18.0.21 for container \"c\""),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(net.join("198.18.0.21")).unwrap(),
        "c\r\neth0"
    );
    let held: Vec<String> = rows(&dir)
        .into_iter()
        .filter(|(_, c, _, allocated)| *allocated && c == "c")
        .map(|(a, _, _, _)| a)
        .collect();
    assert_eq!(held, ["198.18.0.21"]);
}

#[test]
fn an_address_metis_cools_down_that_host_local_reissued_is_deferred_not_refused() {
    let dir = TestDir::new("migration-cooling");
    let _daemon = common::TestDaemon::start(&dir, &["--release-cooldown", "1h"]);
    let mut conf = plugin(&dir);
    conf["ipam"]["dbPath"] = json!(dir.join("metis.sqlite"));
    let config = dir.join("net.conf");
    std::fs::write(&config, conf.to_string()).unwrap();
    let net = dir.join("networks/mig");
    std::fs::create_dir_all(&net).unwrap();
    let first = import(&config, &[]);
    assert_eq!(first.status.code(), Some(0), "{:?}", out_err(&first));
    // A Metis pod comes and goes: its address cools down, its file is gone.
    let add = run_ipam(METIS, "ADD", "m-0", &conf.to_string());
    assert_eq!(addresses(&add)[0], "198.18.0.10");
    assert!(net.join("198.18.0.10").exists());
    let del = run_ipam(METIS, "DEL", "m-0", &conf.to_string());
    assert!(del.status.success(), "{:?}", out_err(&del));
    assert!(!net.join("198.18.0.10").exists());
    // host-local hands it out meanwhile, and another address.
    std::fs::write(net.join("198.18.0.10"), "h1\r\neth0").unwrap();
    std::fs::write(net.join("198.18.0.20"), "h2\r\neth0").unwrap();
    let again = import(&config, &[]);
    let (out, err) = out_err(&again);
    assert_eq!(again.status.code(), Some(0), "{err}");
    assert!(
        out.contains("recorded 198.18.0.20 for container \"h2\""),
        "{out}"
    );
    assert!(
        out.contains(
            "deferred 198.18.0.10 of container \"h1\" interface \"eth0\": metis cools it down until"
        ),
        "{out}"
    );
    // Metis hands out neither.
    let next = run_ipam(METIS, "ADD", "m-1", &conf.to_string());
    let got = addresses(&next);
    assert!(
        !got.contains(&"198.18.0.10".to_string()) && !got.contains(&"198.18.0.20".to_string()),
        "{got:?}"
    );
}
