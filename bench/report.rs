//! The results table: one row per figure and build, the target beside it,
//! and the header that says what was measured (machine, binaries, profile).

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::Plan;
use crate::util::{Build, HOST_LOCAL};

/// One row of the table: a figure, what it is compared with, the target.
pub struct Row {
    pub what: String,
    /// `full`, `edge`, or empty for figures no build of Metis has (the
    /// floor) or that both share (the engine in-process).
    pub build: &'static str,
    pub value: String,
    pub against: String,
    pub ratio: String,
    pub target: String,
    /// `None`: reported without a target.
    pub met: Option<bool>,
}

impl Row {
    /// A row without reference or target.
    pub fn plain(what: impl Into<String>, build: &'static str, value: String) -> Row {
        Row {
            what: what.into(),
            build,
            value,
            against: String::new(),
            ratio: String::new(),
            target: String::new(),
            met: None,
        }
    }

    /// The row judged against `target` by `met`.
    pub fn target(mut self, target: impl Into<String>, met: bool) -> Row {
        self.target = target.into();
        self.met = Some(met);
        self
    }

    /// The row compared with `against`, `value / against` being `ratio`.
    pub fn against(mut self, against: String, ratio: f64) -> Row {
        self.against = against;
        self.ratio = format!("{ratio:.2}×");
        self
    }
}

/// What the run found: rows and the notes under them.
#[derive(Default)]
pub struct Report {
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

/// Mebibytes with two decimals, from bytes.
pub fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / 1_048_576.0)
}

fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(
            || "unknown".to_string(),
            |o| String::from_utf8_lossy(&o.stdout).trim().to_string(),
        )
}

/// `[profile.release]` of Cargo.toml as one line, with the optimisation
/// levels its per-package overrides set (`cargo bench` builds the full
/// binary with the bench profile, which inherits it; `make edge` builds
/// with it directly).
fn release_profile() -> String {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .unwrap_or_default();
    let settings = |section: &str| -> Vec<String> {
        manifest
            .lines()
            .skip_while(|line| line.trim() != section)
            .skip(1)
            .take_while(|line| !line.trim_start().starts_with('['))
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(str::to_string)
            .collect()
    };
    let release = settings("[profile.release]");
    let mut profile = match release.is_empty() {
        true => "cargo's defaults".to_string(),
        false => release.join(", "),
    };
    // Package name by opt-level, in the manifest's order.
    let mut levels: Vec<(String, Vec<&str>)> = Vec::new();
    for package in manifest
        .lines()
        .filter_map(|line| line.trim().strip_prefix("[profile.release.package."))
        .filter_map(|rest| rest.strip_suffix(']'))
    {
        let section = format!("[profile.release.package.{package}]");
        let Some(level) = settings(&section)
            .into_iter()
            .find_map(|line| line.strip_prefix("opt-level = ").map(str::to_string))
        else {
            continue;
        };
        match levels.iter_mut().find(|(known, _)| *known == level) {
            Some((_, packages)) => packages.push(package),
            None => levels.push((level, vec![package])),
        }
    }
    for (level, packages) in levels {
        profile.push_str(&format!("; opt-level {level} for {}", packages.join(", ")));
    }
    profile
}

fn header(out: &mut String, builds: &[Build], floor: &Path, took: Duration) {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let lines = [
        (
            "date".to_string(),
            command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        ),
        (
            "nproc".to_string(),
            std::thread::available_parallelism()
                .map_or(0, |n| n.get())
                .to_string(),
        ),
        ("CPU".to_string(), cpu),
        ("kernel".to_string(), kernel.trim().to_string()),
        (
            // Others' load on a shared machine: the figures' context.
            "load average at the end (1, 5, 15 min)".to_string(),
            std::fs::read_to_string("/proc/loadavg")
                .unwrap_or_default()
                .split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" "),
        ),
        (
            "durability".to_string(),
            format!(
                "SQLite WAL, synchronous=NORMAL (the default) unless a row says FULL, \
                 databases in {}",
                std::env::temp_dir().display()
            ),
        ),
        (
            "profile".to_string(),
            format!(
                "[profile.release] {}; {}",
                release_profile(),
                command_line("rustc", &["--version"])
            ),
        ),
    ];
    let _ = writeln!(out, "| | |\n|---|---|");
    for (name, value) in lines {
        let _ = writeln!(out, "| {name} | {value} |");
    }
    for build in builds {
        let _ = writeln!(
            out,
            "| metis, {} build | `{}`, {} |",
            build.name(),
            build.built.display(),
            build.features()
        );
    }
    let _ = writeln!(
        out,
        "| floor | `{}`, bench/floor.rs, built and linked by `make build` as the full build |",
        floor.display()
    );
    let _ = writeln!(
        out,
        "| host-local | `{HOST_LOCAL}`, containernetworking-plugins {} |",
        command_line(
            "dpkg-query",
            &["-W", "-f", "${Version}", "containernetworking-plugins"]
        )
    );
    let _ = writeln!(
        out,
        "| programs run | copies of the four above in a directory of the bench's, \
         made as `metis install` makes one |"
    );
    let _ = writeln!(out, "| run time | {:.0} s |\n", took.as_secs_f64());
}

pub fn render(
    plan: &Plan,
    builds: &[Build],
    floor: &Path,
    report: &Report,
    took: Duration,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Metis benchmark results{}\n",
        if plan.smoke {
            " (smoke: not figures)"
        } else {
            ""
        }
    );
    header(&mut out, builds, floor, took);
    let _ = writeln!(
        out,
        "| measurement | build | Metis | reference | ratio | target | |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for r in &report.rows {
        let verdict = match r.met {
            Some(true) => "met",
            Some(false) => "MISSED",
            None => "",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {verdict} |",
            r.what, r.build, r.value, r.against, r.ratio, r.target
        );
    }
    let _ = writeln!(out);
    for note in &report.notes {
        let _ = writeln!(out, "- {note}");
    }
    out
}
