//! `metis install` with the real binary: where it installs, atomic
//! replacement under a running plugin, modes, and config lists.

use crate::common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{METIS, TestDaemon, TestDir, assert_ok, metis, out_err};

const CONFLIST: &str = r#"{
  "cniVersion": "1.0.0",
  "name": "pods",
  "plugins": [
    {"type": "ptp", "ipam": {"type": "metis", "ranges": [[{"subnet": "198.18.0.0/24"}]]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
"#;

/// Runs `binary install ARGS…` with `CNI_DIR` set or removed.
fn install(binary: &Path, cni_dir_env: Option<&Path>, args: &[&str]) -> Output {
    let mut command = Command::new(binary);
    command.arg("install").args(args).stdin(Stdio::null());
    match cni_dir_env {
        Some(dir) => command.env("CNI_DIR", dir),
        None => command.env_remove("CNI_DIR"),
    };
    command.env_remove("CNI_COMMAND").output().unwrap()
}

/// `metis install --cni-dir CNI --conflist FILE --net-dir NET`.
fn install_conflist(cni: &Path, file: &Path, net: &Path) -> Output {
    let args = ["--cni-dir", "--conflist", "--net-dir"]
        .into_iter()
        .zip([cni, file, net])
        .flat_map(|(flag, path)| [flag.to_string(), path_arg(path)])
        .collect::<Vec<_>>();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    install(Path::new(METIS), None, &args)
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|list| {
            list.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn path_arg(path: &Path) -> String {
    path.display().to_string()
}

#[test]
fn installs_into_the_flag_dir_then_cni_dir_env() {
    let dir = TestDir::new("install-where");
    let (flag_dir, env_dir) = (dir.join("flag"), dir.join("env"));
    fs::create_dir(&flag_dir).unwrap();
    fs::create_dir(&env_dir).unwrap();
    let metis_bin = Path::new(METIS);

    let output = install(
        metis_bin,
        Some(&env_dir),
        &["--cni-dir", &path_arg(&flag_dir)],
    );
    assert_ok(&output);
    assert_eq!(
        out_err(&output).0,
        format!("installed {}\n", flag_dir.join("bin/metis").display())
    );
    assert_eq!(entries(&env_dir), Vec::<String>::new());
    assert_eq!(entries(&flag_dir.join("bin")), ["metis"]);
    assert_eq!(
        fs::read(flag_dir.join("bin/metis")).unwrap(),
        fs::read(METIS).unwrap()
    );

    assert_ok(&install(metis_bin, Some(&env_dir), &[]));
    assert_eq!(entries(&env_dir.join("bin")), ["metis"]);

    // Neither: the default, which does not exist here, so nothing is written.
    let default = Path::new("/host/opt/cni");
    if !default.exists() {
        let output = install(metis_bin, None, &[]);
        assert_eq!(output.status.code(), Some(1));
        assert!(out_err(&output).1.contains("/host/opt/cni does not exist"));
        assert!(!default.exists());
    }
}

#[test]
fn keeps_the_mode_and_leaves_no_temp_files() {
    let dir = TestDir::new("install-mode");
    for mode in [0o700, 0o755] {
        let source_dir = dir.join(&format!("src-{mode:o}"));
        fs::create_dir(&source_dir).unwrap();
        let source = source_dir.join("metis");
        common::copy_binary(&source, mode);
        let cni = dir.join(&format!("cni-{mode:o}"));
        fs::create_dir(&cni).unwrap();
        assert_ok(&install(&source, None, &["--cni-dir", &path_arg(&cni)]));
        let installed = fs::metadata(cni.join("bin/metis")).unwrap();
        assert_eq!(installed.permissions().mode() & 0o7777, mode);
        assert_eq!(entries(&cni.join("bin")), ["metis"]);
    }
}

#[test]
fn replaces_a_running_plugin_without_disturbing_it() {
    let dir = TestDir::new("install-running");
    let cni = dir.join("cni");
    fs::create_dir_all(cni.join("bin")).unwrap();
    let old = cni.join("bin/metis");
    common::copy_binary(&old, 0o755);
    // The old copy runs (as a daemon) while the new one is installed over it:
    // writing into the executing file would fail with ETXTBSY.
    let daemon = TestDaemon::start_from(&old, &dir, &[]);
    let old_inode = fs::metadata(&old).unwrap().ino();

    for _ in 0..2 {
        assert_ok(&install(
            Path::new(METIS),
            None,
            &["--cni-dir", &path_arg(&cni)],
        ));
    }
    assert_ne!(fs::metadata(&old).unwrap().ino(), old_inode);
    assert_eq!(entries(&cni.join("bin")), ["metis"]);
    let health = metis(&["health", "--socket-path", &path_arg(&daemon.socket)]);
    assert_ok(&health);
    assert_eq!(daemon.stop().code(), Some(0));
    // The new copy runs.
    let output = Command::new(&old).arg("--version").output().unwrap();
    assert_ok(&output);
}

#[test]
fn installs_a_valid_conflist_after_the_binary() {
    let dir = TestDir::new("install-conflist");
    let (cni, net) = (dir.join("cni"), dir.join("net.d"));
    fs::create_dir(&cni).unwrap();
    fs::create_dir(&net).unwrap();
    let file = dir.join("10-metis.conflist");
    fs::write(&file, CONFLIST).unwrap();
    let output = install_conflist(&cni, &file, &net);
    assert_ok(&output);
    let written = net.join("10-metis.conflist");
    assert_eq!(fs::read_to_string(&written).unwrap(), CONFLIST);
    assert_eq!(
        fs::metadata(&written).unwrap().permissions().mode() & 0o777,
        0o644
    );
    assert_eq!(entries(&net), ["10-metis.conflist"]);
    assert_eq!(entries(&cni.join("bin")), ["metis"]);
}

#[test]
fn bad_input_writes_nothing() {
    let dir = TestDir::new("install-bad");
    let (cni, net) = (dir.join("cni"), dir.join("net.d"));
    fs::create_dir(&cni).unwrap();
    fs::create_dir(&net).unwrap();
    let write = |name: &str, text: &str| -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, text).unwrap();
        path
    };
    let cases: Vec<(PathBuf, &str)> = vec![
        (write("a.conflist", "{not json"), "not JSON"),
        (
            write(
                "b.conflist",
                &CONFLIST.replace("198.18.0.0/24", "198.18.0.1/24"),
            ),
            "plugins[0]",
        ),
        (
            write(
                "c.conflist",
                &CONFLIST.replace("\"metis\"", "\"host-local\""),
            ),
            "no plugin",
        ),
        (write("d.conf", CONFLIST), ".conflist"),
        (dir.join("missing.conflist"), "cannot read"),
    ];
    for (file, expected) in cases {
        let output = install_conflist(&cni, &file, &net);
        let (stdout, stderr) = out_err(&output);
        assert_eq!(output.status.code(), Some(1), "{file:?}: {stderr}");
        assert_eq!(stdout, "");
        assert!(stderr.contains(expected), "{file:?}: {stderr}");
        assert_eq!(entries(&cni), Vec::<String>::new(), "{file:?}");
        assert_eq!(entries(&net), Vec::<String>::new(), "{file:?}");
    }

    let good = write("ok.conflist", CONFLIST);
    let missing_net = install_conflist(&cni, &good, &dir.join("absent"));
    assert_eq!(missing_net.status.code(), Some(1));
    assert!(out_err(&missing_net).1.contains("does not exist"));
    assert_eq!(entries(&cni), Vec::<String>::new());

    let missing_cni = install(
        Path::new(METIS),
        None,
        &["--cni-dir", &path_arg(&dir.join("no"))],
    );
    assert_eq!(missing_cni.status.code(), Some(1));
    assert!(!dir.join("no").exists());

    // The targets are directories: the renames fail after the temp files
    // were written, and the temp files are removed.
    fs::create_dir_all(cni.join("bin/metis/keep")).unwrap();
    let clash = install(Path::new(METIS), None, &["--cni-dir", &path_arg(&cni)]);
    assert_eq!(clash.status.code(), Some(1));
    assert_eq!(entries(&cni.join("bin")), ["metis"]);
    assert!(cni.join("bin/metis/keep").is_dir());
    fs::remove_dir_all(cni.join("bin")).unwrap();
    fs::create_dir_all(net.join("ok.conflist/keep")).unwrap();
    let clash = install_conflist(&cni, &good, &net);
    assert_eq!(clash.status.code(), Some(1));
    assert!(out_err(&clash).1.contains("ok.conflist"));
    assert_eq!(entries(&net), ["ok.conflist"]);
    fs::remove_dir_all(cni.join("bin")).unwrap();

    // `bin` is a file: the copy cannot land and the file is left alone.
    fs::write(cni.join("bin"), "not a dir").unwrap();
    let blocked = install(Path::new(METIS), None, &["--cni-dir", &path_arg(&cni)]);
    assert_eq!(blocked.status.code(), Some(1));
    assert!(
        out_err(&blocked)
            .1
            .starts_with("metis install: cannot install")
    );
    assert_eq!(fs::read_to_string(cni.join("bin")).unwrap(), "not a dir");
    assert_eq!(entries(&cni), ["bin"]);
}
