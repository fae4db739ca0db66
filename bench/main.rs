//! `make bench`: Metis against Debian's host-local and against the floor of
//! what a CNI plugin can cost, every figure taken in the same run and
//! reported as a ratio next to its target (README, "Performance").
//!
//! `cargo bench --bench metis -- --full BINARY --edge EDGE_BINARY --floor
//! FLOOR_BINARY [--smoke] [--out FILE] [--only TEXT]` (`make bench` builds all three and
//! passes them; the floor is the `metis-floor` binary `make build` links
//! beside `metis`). Every per-build
//! figure is taken for the full build (the binary `cargo bench` built with
//! default features) and for the edge build (`--no-default-features`).
//! `--smoke` runs a few cycles of every measurement and checks the results
//! are sane (counts, distinct addresses); it never judges a timing.
//! `--only TEXT` runs just the sections whose name contains TEXT. Under
//! `cargo test` (no `--bench` argument) the program does nothing.
//!
//! This file is the list of sections; each lives in its own module and
//! adds its rows to the report.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    clippy::cast_possible_wrap
)] // bench code: a panic is a failure report; figures are approximate

mod big;
mod cni;
#[allow(dead_code)] // the tests' harness: the bench uses a part of it
#[path = "../tests/common/mod.rs"]
mod common;
mod controller;
mod instructions;
mod limit;
mod memory;
mod report;
mod scale;
mod throughput;
mod util;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use report::Report;
use util::{Build, Flavour, HOST_LOCAL, Installed, TempDir};

/// How much of everything to do.
pub struct Plan {
    pub smoke: bool,
    pub warmup: usize,
    pub cycles: usize,
    pub throughput_for: Duration,
    pub scale_samples: usize,
    pub v6_allocations: usize,
    pub memory_allocations: usize,
    pub burst: usize,
    /// First ADDs of a /12 timed in-process.
    pub big_adds: usize,
    /// Small ADDs timed unloaded, then again under /12 ADDs.
    pub big_samples: usize,
    /// Address rows of the start-to-healthy database, and restarts timed.
    pub start_rows: u32,
    pub restarts: usize,
    /// Address rows of the restart-after-a-crash database.
    pub crash_rows: u32,
}

const FULL: Plan = Plan {
    smoke: false,
    warmup: 20,
    cycles: 600,
    throughput_for: Duration::from_secs(3),
    scale_samples: 2000,
    v6_allocations: 100_000,
    memory_allocations: 65_536,
    burst: 256,
    big_adds: 50,
    big_samples: 1000,
    start_rows: 1 << 20,
    restarts: 10,
    crash_rows: 100_000,
};

const SMOKE: Plan = Plan {
    smoke: true,
    warmup: 1,
    cycles: 5,
    throughput_for: Duration::from_millis(200),
    scale_samples: 50,
    v6_allocations: 1_000,
    memory_allocations: 1_000,
    burst: 256,
    big_adds: 3,
    big_samples: 20,
    start_rows: 4096,
    restarts: 1,
    crash_rows: 4096,
};

/// What every section gets: the plan, the builds, the floor program (linked
/// as the full build is) and host-local, each run from its copy in the
/// bench's [`Installed`] directory (where `make` and dpkg put them:
/// `built`, `floor_built` and `HOST_LOCAL`).
pub struct Bench {
    pub plan: Plan,
    pub builds: Vec<Build>,
    pub floor: PathBuf,
    pub floor_built: PathBuf,
    pub host_local: PathBuf,
}

type Section = fn(&Bench, &mut Report);

/// The sections, in the order they run and report.
const SECTIONS: &[(&str, Section)] = &[
    ("big blocks", big::report),
    (
        "ADD+DEL cycles: each build, host-local, floor",
        cni::report_cycles,
    ),
    ("instructions per exec (callgrind)", instructions::report),
    ("daemon throughput", throughput::report),
    ("scale", scale::report),
    ("memory", memory::report),
    ("binary size", memory::report_size),
    ("burst", cni::report_burst),
    ("controller at cluster scale", controller::report),
];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("metis bench: nothing to do outside `cargo bench` (see `make bench`)");
        return;
    }
    // The in-process measurements run the engine, which logs; keep quiet.
    metis::log::init(Box::new(std::io::sink()), 0);
    let value = |flag: &str| {
        args.iter().position(|a| a == flag).map(|at| {
            PathBuf::from(
                args.get(at + 1)
                    .unwrap_or_else(|| panic!("{flag} needs a value")),
            )
        })
    };
    let out = value("--out");
    let full = value("--full").expect("--full BINARY is required (`make bench` passes it)");
    let edge = value("--edge").expect("--edge EDGE_BINARY is required (`make bench` passes it)");
    // The in-process figures run the engine compiled into the bench, with
    // the full build's features; under `--no-default-features` it still
    // compiles (`make test`) but must not run.
    if !cfg!(feature = "kube") {
        panic!("run the bench with default features (`make bench`)");
    }
    assert!(
        Path::new(HOST_LOCAL).exists(),
        "{HOST_LOCAL} is missing: apt-get install containernetworking-plugins"
    );
    let plan = if args.iter().any(|a| a == "--smoke") {
        SMOKE
    } else {
        FULL
    };
    let installed = Installed::new();
    let built = |path: &Path, by: &str| {
        std::fs::canonicalize(path)
            .unwrap_or_else(|e| panic!("{}: {e} (`{by}` builds it)", path.display()))
    };
    let build = |flavour: Flavour, path: &Path, by: &str, name: &str| {
        let built = built(path, by);
        let binary = installed.copy(&built, name);
        Build {
            flavour,
            built,
            binary,
        }
    };
    let builds = vec![
        build(Flavour::Full, &full, "make build", "metis-full"),
        build(Flavour::Edge, &edge, "make edge", "metis-edge"),
    ];
    check_edge(&builds[1]);
    let started = Instant::now();
    let floor = value("--floor").expect("--floor BINARY is required (`make bench` passes it)");
    let floor_built = built(&floor, "make build");
    let bench = Bench {
        plan,
        builds,
        floor: installed.copy(&floor_built, "metis-floor"),
        floor_built,
        host_local: installed.copy(Path::new(HOST_LOCAL), "host-local"),
    };
    let mut report = Report::default();
    // `--only TEXT`: the sections whose name contains TEXT (a figure
    // measured before and after a change without the whole run).
    let only = value("--only").map(|only| only.to_string_lossy().into_owned());
    let sections: Vec<_> = SECTIONS
        .iter()
        .filter(|(name, _)| {
            only.as_ref()
                .is_none_or(|only| name.contains(only.as_str()))
        })
        .collect();
    assert!(
        !sections.is_empty(),
        "--only: no section's name contains {only:?}"
    );
    for (i, (name, section)) in sections.iter().enumerate() {
        eprintln!("[{}/{}] {name}", i + 1, sections.len());
        section(&bench, &mut report);
    }
    let text = report::render(
        &bench.plan,
        &bench.builds,
        &bench.floor_built,
        &report,
        started.elapsed(),
    );
    print!("{text}");
    if let Some(out) = out {
        std::fs::write(&out, &text).unwrap();
        println!("\nwritten to {}", out.display());
    }
    if bench.plan.smoke {
        println!("bench-smoke: every measurement ran for both builds and its results are sane");
    }
}

/// Fails unless `edge` is an edge build: it must refuse a cluster source as
/// a usage error (exit 2) that says it has no Kubernetes support.
fn check_edge(edge: &Build) {
    let dir = TempDir::new("edge-check");
    // No environment: a full build given by mistake must not find a cluster.
    let output = Command::new(&edge.binary)
        .env_clear()
        .args(["daemon", "--cidr-source", "node", "--socket-path"])
        .arg(dir.join("metis.sock"))
        .arg("--db-path")
        .arg(dir.join("metis.sqlite"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.code() == Some(2) && stderr.contains("needs Kubernetes support"),
        "{} is not an edge build (--cidr-source node: {}, {stderr})",
        edge.binary.display(),
        output.status
    );
}
