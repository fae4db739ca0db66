//! Golden files: the real binary, run for every case in `testdata/cases/`,
//! must print exactly (byte for byte) what the case's `.out` file says.
//!
//! A case is two files. `NAME.json` describes it:
//!
//! ```json
//! {"about": "why the case exists",
//!  "daemon": true,                      // start a daemon first (default true)
//!  "daemon_args": ["--release-cooldown", "0"],
//!  "steps": [{"env": {"CNI_COMMAND": "ADD", "CNI_NETNS": null},
//!             "stdin": {...} or "stdin_text": "...", "stdin_pad_to": 1048577},
//!            {"action": "stop_daemon"}]}
//! ```
//!
//! Every step runs the plugin with the default CNI environment below, changed
//! by `env` (`null` unsets a variable); `stdin` is sent as compact JSON,
//! `stdin_text` as is, padded with spaces to `stdin_pad_to` bytes. Actions
//! (`stop_daemon`, `start_daemon`) print nothing. `NAME.out` holds, per
//! plugin step, a line `### STEP VERB exit CODE`, then its stdout, then (only
//! if not empty) `### STEP stderr` and its stderr. `@DIR@` stands for the
//! case's private directory (the daemon's socket is `@DIR@/metis.sock`, its
//! database `@DIR@/metis.sqlite`) and `@VERSION@` for the crate version, in
//! the case and in the expected output.
//!
//! `METIS_BLESS=1 cargo test --test integration golden::` rewrites the `.out` files from
//! the actual output; review the diff before committing it.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{METIS, TestDaemon, TestDir, run_with_stdin};
use serde_json::Value;

const DEFAULT_ENV: &[(&str, &str)] = &[
    ("CNI_COMMAND", "ADD"),
    ("CNI_CONTAINERID", "ctr-1"),
    ("CNI_NETNS", "/var/run/netns/golden"),
    ("CNI_IFNAME", "eth0"),
    ("CNI_PATH", "/opt/cni/bin"),
    ("CNI_ARGS", "K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod"),
];

/// Cases run this many at a time: each has its own directory and daemon.
const WORKERS: usize = 4;

fn cases_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/cases")
}

/// The case names (file stems) with the given extension, sorted.
fn names_with(ext: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(cases_dir())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == ext))
        .map(|path| path.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Replaces the placeholders in `text` for a case run in `dir`.
fn expand(text: &str, dir: &Path) -> String {
    text.replace("@DIR@", &dir.display().to_string())
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"))
}

/// The inverse of [`expand`], used only when blessing. The crate version
/// is replaced only where the about text names it: as a bare string it
/// would also match CNI versions.
fn unexpand(text: &str, dir: &Path) -> String {
    let about = "Metis CNI plugin ";
    text.replace(&dir.display().to_string(), "@DIR@").replace(
        &format!("{about}{}", env!("CARGO_PKG_VERSION")),
        &format!("{about}@VERSION@"),
    )
}

fn step_stdin(step: &Value, dir: &Path) -> String {
    let mut stdin = match (step.get("stdin"), step.get("stdin_text")) {
        (Some(value), None) => expand(&value.to_string(), dir),
        (None, Some(Value::String(text))) => expand(text, dir),
        (None, None) => String::new(),
        _ => panic!("a step has either stdin (JSON) or stdin_text (string): {step}"),
    };
    if let Some(pad_to) = step.get("stdin_pad_to") {
        let pad_to = usize::try_from(pad_to.as_u64().unwrap()).unwrap();
        stdin.extend(std::iter::repeat_n(' ', pad_to.saturating_sub(stdin.len())));
    }
    stdin
}

fn step_env(step: &Value, dir: &Path) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = DEFAULT_ENV
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let overrides = step.get("env").and_then(Value::as_object);
    for (key, value) in overrides.into_iter().flatten() {
        match value {
            Value::Null => env.remove(key),
            Value::String(text) => env.insert(key.clone(), expand(text, dir)),
            other => panic!("env {key} must be a string or null, not {other}"),
        };
    }
    env
}

fn run_plugin(env: &BTreeMap<String, String>, stdin: &str) -> Output {
    let mut command = Command::new(METIS);
    command.env_clear().env("PATH", "/usr/bin:/bin").envs(env);
    run_with_stdin(command, stdin)
}

/// One plugin step in the `.out` format.
fn render(number: usize, env: &BTreeMap<String, String>, output: &Output) -> String {
    let verb = env.get("CNI_COMMAND").map_or("-", String::as_str);
    let verb = if verb.is_empty() { "-" } else { verb };
    let code = output
        .status
        .code()
        .map_or_else(|| format!("{:?}", output.status), |c| c.to_string());
    let mut text = format!(
        "### {number} {verb} exit {code}\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    if !output.stderr.is_empty() {
        text.push_str(&format!(
            "### {number} stderr\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    text
}

/// Runs a case and returns its rendered output (placeholders expanded).
fn run_case(name: &str, dir: &TestDir) -> String {
    let path = cases_dir().join(format!("{name}.json"));
    let case: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    let daemon_args: Vec<String> = case
        .get("daemon_args")
        .map(|args| serde_json::from_value(args.clone()).unwrap())
        .unwrap_or_default();
    let daemon_args: Vec<&str> = daemon_args.iter().map(String::as_str).collect();
    let start = || TestDaemon::start(dir, &daemon_args);
    let mut daemon = case
        .get("daemon")
        .is_none_or(|d| d.as_bool().unwrap())
        .then(start);
    let mut rendered = String::new();
    let steps = case["steps"].as_array().expect("steps");
    for (index, step) in steps.iter().enumerate() {
        match step.get("action").and_then(Value::as_str) {
            Some("stop_daemon") => {
                let status = daemon.take().expect("no daemon to stop").stop();
                assert!(status.success(), "{name}: daemon exited {status}");
            }
            Some("start_daemon") => daemon = Some(start()),
            Some(other) => panic!("{name}: unknown action {other:?}"),
            None => {
                let env = step_env(step, &dir.path);
                let output = run_plugin(&env, &step_stdin(step, &dir.path));
                rendered.push_str(&render(index + 1, &env, &output));
            }
        }
    }
    rendered
}

/// Compares one case; returns a report of the first difference.
fn check_case(name: &str) -> Option<String> {
    let dir = TestDir::new(&format!("golden-{name}"));
    let actual = run_case(name, &dir);
    let out_path = cases_dir().join(format!("{name}.out"));
    if std::env::var_os("METIS_BLESS").is_some() {
        std::fs::write(&out_path, unexpand(&actual, &dir.path)).unwrap();
        return None;
    }
    let expected = expand(
        &std::fs::read_to_string(&out_path)
            .unwrap_or_else(|err| panic!("{}: {err}", out_path.display())),
        &dir.path,
    );
    (actual != expected).then(|| difference(name, &expected, &actual))
}

fn difference(name: &str, expected: &str, actual: &str) -> String {
    let line = expected
        .lines()
        .zip(actual.lines())
        .position(|(e, a)| e != a)
        .unwrap_or_else(|| expected.lines().count().min(actual.lines().count()));
    format!(
        "{name}: output differs from line {} on\n--- expected\n{expected}\n--- actual\n{actual}",
        line + 1
    )
}

#[test]
fn every_case_prints_exactly_its_golden_output() {
    let names = names_with("json");
    assert!(names.len() >= 90, "only {} golden cases", names.len());
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..WORKERS {
            scope.spawn(|| {
                while let Some(name) = names.get(next.fetch_add(1, Ordering::Relaxed)) {
                    if let Some(report) = check_case(name) {
                        failures.lock().unwrap().push(report);
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} golden cases differ:\n\n{}",
        failures.len(),
        names.len(),
        failures.join("\n\n")
    );
}

#[test]
fn every_case_has_both_files() {
    assert_eq!(names_with("json"), names_with("out"));
}

#[test]
fn the_error_corpus_has_at_least_forty_cases() {
    let errors = names_with("json")
        .iter()
        .filter(|name| name.starts_with("error-"))
        .count();
    assert!(errors >= 40, "only {errors} error cases");
}
