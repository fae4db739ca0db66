//! Who may talk to the daemon: the socket's mode and group, the peer
//! credential check (another user is refused with a clear error unless
//! `--allowed-uid` names it), private database files, and socket paths in
//! unsafe places refused. The tests run as root, as the daemon does, and
//! use `nobody` (65534) as the other user.

use crate::common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::process::Command;

use common::{TestDaemon, TestDir, json, run_with_stdin};

const OTHER: u32 = 65534;
const V4: &str = r#"[[{"subnet":"198.18.0.0/24"}]]"#;

fn mode(path: &std::path::Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

/// A directory `nobody` can traverse but not write, so it can reach a
/// group-accessible socket inside.
fn reachable_dir(name: &str) -> TestDir {
    let dir = TestDir::new(name);
    std::fs::set_permissions(&dir.path, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// A copy of the plugin binary in `dir`, which `nobody` can reach: the
/// checkout (and its target/) may live where other users cannot enter
/// (root's home, a `mktemp -d` directory).
fn binary_for_other_user(dir: &TestDir) -> std::path::PathBuf {
    let copy = dir.join("metis-for-other-user");
    if !copy.exists() {
        common::copy_binary(&copy, 0o755);
    }
    copy
}

/// The plugin binary run as `nobody`, ADD against the daemon of `dir`.
fn add_as_other_user(dir: &TestDir, container: &str) -> std::process::Output {
    let config = format!(
        r#"{{"cniVersion":"1.0.0","name":"access","type":"metis","ipam":{{"type":"metis","ranges":{V4},"daemonSocket":"{}","dbPath":"{}","logFile":"/dev/null"}}}}"#,
        dir.join("metis.sock").display(),
        dir.join("metis.sqlite").display(),
    );
    let mut command = Command::new(binary_for_other_user(dir));
    command
        .env_clear()
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", container)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_NETNS", "/var/run/netns/x")
        .env("CNI_PATH", "/opt/cni/bin")
        .uid(OTHER)
        .gid(OTHER);
    run_with_stdin(command, &config)
}

#[test]
fn another_user_is_refused_unless_allowed() {
    let dir = reachable_dir("access-peer");
    let group = OTHER.to_string();
    let daemon = TestDaemon::start(&dir, &["--socket-group", &group]);
    let meta = std::fs::metadata(&daemon.socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(meta.gid(), OTHER);

    // The group lets nobody connect; the credential check turns it away.
    let refused = add_as_other_user(&dir, "intruder");
    assert_eq!(refused.status.code(), Some(1));
    let error = json(&refused);
    assert_eq!(error["code"], 103, "{error}");
    let msg = error["msg"].as_str().unwrap();
    assert!(
        msg.contains(&format!("user {OTHER} may not use the metis daemon")),
        "{msg}"
    );
    assert!(
        daemon.log().contains("refused connection"),
        "{}",
        daemon.log()
    );
    drop(daemon);

    // --allowed-uid admits it.
    let daemon = TestDaemon::start(
        &dir,
        &[
            "--socket-group",
            &group,
            "--allowed-uid",
            &OTHER.to_string(),
        ],
    );
    let allowed = add_as_other_user(&dir, "guest");
    common::assert_ok(&allowed);
    assert_eq!(json(&allowed)["ips"][0]["address"], "198.18.0.2/24");
    drop(daemon);

    // Without the group the socket is 0600: nobody cannot even connect,
    // and cannot open the root-owned database in direct mode either.
    let daemon = TestDaemon::start(&dir, &[]);
    assert_eq!(mode(&daemon.socket), 0o600);
    let locked_out = add_as_other_user(&dir, "outsider");
    let error = json(&locked_out);
    assert_eq!(error["code"], 11, "{error}");
    assert!(
        error["msg"].as_str().unwrap().contains("cannot be used"),
        "{error}"
    );
}

#[test]
fn bad_socket_groups_are_usage_errors() {
    let output = Command::new(common::METIS)
        .args(["daemon", "--socket-group", "no-such-group-metis"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("no group named"));
}

#[test]
fn database_files_and_directory_are_private() {
    let dir = TestDir::new("access-db");
    let db_dir = dir.join("state/metis");
    let db = db_dir.join("metis.sqlite");
    let socket = dir.join("metis.sock");
    let child = Command::new(common::METIS)
        .args(["daemon", "--socket-path"])
        .arg(&socket)
        .arg("--db-path")
        .arg(&db)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let daemon = TestDaemon {
        child,
        socket: socket.clone(),
        db: db.clone(),
        stderr_path: dir.join("daemon.log"),
    };
    common::wait_for(
        "the daemon to listen",
        std::time::Duration::from_secs(10),
        || std::os::unix::net::UnixStream::connect(&socket).is_ok(),
    );
    // The WAL files exist once something is written.
    let config = common::conf(&dir, "1.0.0", V4, "").replace(
        dir.join("metis.sqlite").to_str().unwrap(),
        db.to_str().unwrap(),
    );
    common::assert_ok(&common::Plugin::new("ADD", "c1").run(&config));
    assert_eq!(mode(&db_dir), 0o700);
    for file in ["metis.sqlite", "metis.sqlite-wal", "metis.sqlite-shm"] {
        assert_eq!(mode(&db_dir.join(file)), 0o600, "{file}");
    }
    drop(daemon);
}

#[test]
fn sockets_in_unsafe_places_are_refused() {
    let dir = TestDir::new("access-unsafe");
    let start = |socket: &std::path::Path| {
        Command::new(common::METIS)
            .args(["daemon", "--socket-path"])
            .arg(socket)
            .arg("--db-path")
            .arg(dir.join("metis.sqlite"))
            .output()
            .unwrap()
    };
    // A directory others may write (even with the sticky bit, like /tmp).
    for bits in [0o777, 0o1777] {
        let open = dir.join(&format!("open-{bits:o}"));
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(bits)).unwrap();
        let output = start(&open.join("metis.sock"));
        assert_eq!(output.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("writable by others"), "{stderr}");
        assert!(!open.join("metis.sock").exists());
    }
    // A symlink at the socket path, even to a real socket.
    let real = TestDir::new("access-real");
    let daemon = TestDaemon::start(&real, &[]);
    let link = dir.join("link.sock");
    std::os::unix::fs::symlink(&daemon.socket, &link).unwrap();
    let output = start(&link);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("symbolic link"));
    // A regular file is not replaced.
    let file = dir.join("file.sock");
    std::fs::write(&file, b"keep").unwrap();
    let output = start(&file);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(std::fs::read(&file).unwrap(), b"keep");
}
