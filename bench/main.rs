//! `make bench`: Metis against Debian's host-local and against the floor of
//! what a CNI plugin can cost, every figure taken in the same run and
//! reported as a ratio next to its target (README, "Performance").
//!
//! `cargo bench --bench metis -- [--smoke] [--out FILE]`. `--smoke` runs a
//! few cycles of every measurement and checks the results are sane (counts,
//! distinct addresses); it never judges a timing. Under `cargo test` (no
//! `--bench` argument) the program does nothing.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    clippy::cast_possible_wrap
)] // bench code: a panic is a failure report; figures are approximate

mod cni;
#[path = "../tests/common/mod.rs"]
mod common;
mod memory;
mod scale;
mod throughput;
mod util;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use metis::store::Durability;
use util::{HOST_LOCAL, METIS, TempDir, ms, ratio, us};

/// How much of everything to do.
struct Plan {
    smoke: bool,
    warmup: usize,
    cycles: usize,
    throughput_for: Duration,
    scale_samples: usize,
    v6_allocations: usize,
    memory_allocations: usize,
    burst: usize,
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
};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("metis bench: nothing to do outside `cargo bench` (see `make bench`)");
        return;
    }
    // The in-process measurements run the engine, which logs; keep quiet.
    metis::log::init(Box::new(std::io::sink()), 0);
    let plan = if args.iter().any(|a| a == "--smoke") {
        SMOKE
    } else {
        FULL
    };
    let out = args
        .iter()
        .position(|a| a == "--out")
        .map(|at| PathBuf::from(&args[at + 1]));
    assert!(
        Path::new(HOST_LOCAL).exists(),
        "{HOST_LOCAL} is missing: apt-get install containernetworking-plugins"
    );
    let report = run(&plan);
    print!("{report}");
    if let Some(out) = out {
        std::fs::write(&out, &report).unwrap();
        println!("\nwritten to {}", out.display());
    }
    if plan.smoke {
        println!("bench-smoke: every measurement ran and its results are sane");
    }
}

/// Compiles the floor program with the release profile's settings.
fn build_floor(dir: &TempDir) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/floor.rs");
    let binary = dir.join("floor");
    let status = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .args([
            "--edition",
            "2021",
            "-C",
            "opt-level=3",
            "-C",
            "panic=abort",
        ])
        .args(["-C", "codegen-units=1", "-C", "strip=symbols", "-o"])
        .arg(&binary)
        .arg(&source)
        .status()
        .unwrap();
    assert!(status.success(), "building the floor program failed");
    binary
}

/// One row of the summary: a figure, what it is compared with, the target.
struct Row {
    what: String,
    value: String,
    against: String,
    ratio: String,
    target: String,
    verdict: &'static str,
}

fn row(
    what: &str,
    value: String,
    against: String,
    ratio: String,
    target: &str,
    met: Option<bool>,
) -> Row {
    Row {
        what: what.to_string(),
        value,
        against,
        ratio,
        target: target.to_string(),
        verdict: match met {
            Some(true) => "met",
            Some(false) => "MISSED",
            None => "",
        },
    }
}

/// What the run found: summary rows and the notes under them.
#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    notes: Vec<String>,
}

fn run(plan: &Plan) -> String {
    let started = Instant::now();
    let tools = TempDir::new("tools");
    let floor = build_floor(&tools);
    let mut report = Report::default();
    eprintln!("[1/6] ADD+DEL cycles: metis, host-local, floor");
    report_cycles(plan, &floor, &mut report);
    eprintln!("[2/6] daemon throughput");
    report_throughput(plan, &mut report);
    eprintln!("[3/6] scale");
    report_scale(plan, &mut report);
    eprintln!("[4/6] memory");
    report_memory(plan, &floor, &mut report);
    report_binary_size(&mut report);
    eprintln!("[5/6] burst");
    report_burst(plan, &mut report);
    eprintln!("[6/6] report");
    render(plan, &report, started.elapsed())
}

/// ADD+DEL latency: Metis against host-local and the floor.
fn report_cycles(plan: &Plan, floor: &Path, report: &mut Report) {
    let c = cni::cycles(floor, plan.warmup, plan.cycles);
    let comparisons = [
        (
            "median",
            "host-local",
            c.metis.median,
            c.host_local.median,
            Some(0.35),
        ),
        ("median", "floor", c.metis.median, c.floor.median, Some(1.6)),
        ("p99", "host-local", c.metis.p99, c.host_local.p99, None),
        ("p99", "floor", c.metis.p99, c.floor.p99, None),
    ];
    for (stat, reference, ours, theirs, target) in comparisons {
        let r = ratio(ours, theirs);
        report.rows.push(row(
            &format!("ADD+DEL {stat}, Metis vs {reference}"),
            ms(ours),
            ms(theirs),
            format!("{r:.2}×"),
            &target.map_or(String::new(), |t| format!("≤ {t}×")),
            target.map(|t| r <= t),
        ));
    }
    report.rows.push(row(
        "ADD+DEL median, floor vs host-local (best possible)",
        ms(c.floor.median),
        ms(c.host_local.median),
        format!("{:.2}×", ratio(c.floor.median, c.host_local.median)),
        "",
        None,
    ));
    report.notes.push(format!(
        "ADD+DEL: {} cycles each (after {} warm-up), interleaved Metis / host-local / floor with the \
         order rotating; Metis ADD alone median {} p99 {}, DEL alone median {} p99 {}.",
        c.metis.count,
        plan.warmup,
        ms(c.metis_add.median),
        ms(c.metis_add.p99),
        ms(c.metis_del.median),
        ms(c.metis_del.p99),
    ));
}

/// Daemon pairs per second by client count, against the engine in-process.
fn report_throughput(plan: &Plan, report: &mut Report) {
    let inproc = throughput::in_process(plan.throughput_for, Durability::Normal);
    let mut daemon_rates = Vec::new();
    for threads in [1, 2, 8] {
        daemon_rates.push((
            threads,
            throughput::daemon(threads, plan.throughput_for, Durability::Normal),
        ));
    }
    for (threads, rate) in &daemon_rates {
        let share = rate.per_second() / inproc.per_second();
        let (target, met) = if *threads == 2 {
            (
                "≥ 20,000/s and ≥ 0.60×",
                Some(rate.per_second() >= 20_000.0 && share >= 0.60),
            )
        } else {
            ("", None)
        };
        report.rows.push(row(
            &format!("daemon pairs/s, {threads} client(s) vs in-process"),
            format!("{:.0}/s", rate.per_second()),
            format!("{:.0}/s", inproc.per_second()),
            format!("{share:.2}×"),
            target,
            met,
        ));
    }
}

/// Allocate latency as the tables grow, against the smallest point.
fn report_scale(plan: &Plan, report: &mut Report) {
    let mut points = scale::v4(plan.scale_samples, plan.smoke);
    let (v6_steady, v6_growth) = scale::v6(plan.v6_allocations, plan.scale_samples);
    points.push(v6_steady);
    points.push(v6_growth);
    let base = points[0].latency;
    for point in &points[1..] {
        let r = ratio(point.latency.median, base.median);
        report.rows.push(row(
            &format!("allocate median, {}", point.label),
            us(point.latency.median),
            us(base.median),
            format!("{r:.2}×"),
            "≤ 1.3×",
            Some(r <= 1.3),
        ));
    }
    for point in &points {
        report.notes.push(format!(
            "scale: {}: {} rows, set up in {}, allocate median {} p99 {} over {} samples.",
            point.label,
            point.rows,
            ms(point.setup),
            us(point.latency.median),
            us(point.latency.p99),
            point.latency.count,
        ));
    }
}

/// Peak RSS of the daemon (idle, loaded) and of one plugin ADD.
fn report_memory(plan: &Plan, floor: &Path, report: &mut Report) {
    let m = memory::measure(floor, plan.memory_allocations);
    let mib = |kib: u64| format!("{:.1} MiB", kib as f64 / 1024.0);
    report.rows.push(row(
        "daemon peak RSS, idle",
        mib(m.daemon_idle_kib),
        String::new(),
        String::new(),
        "≤ 8 MB",
        Some(m.daemon_idle_kib * 1024 <= 8_000_000),
    ));
    report.rows.push(row(
        &format!("daemon peak RSS, {} allocations", m.allocations),
        mib(m.daemon_loaded_kib),
        String::new(),
        String::new(),
        "≤ 16 MB",
        Some(m.daemon_loaded_kib * 1024 <= 16_000_000),
    ));
    report.rows.push(row(
        "plugin peak RSS, one ADD, Metis vs host-local",
        mib(m.metis_add_kib),
        mib(m.host_local_add_kib),
        format!(
            "{:.2}×",
            m.metis_add_kib as f64 / m.host_local_add_kib as f64
        ),
        "≤ 3 MB",
        Some(m.metis_add_kib * 1024 <= 3_000_000),
    ));
    report.notes.push(format!(
        "memory: the floor program's peak RSS is {}; MB targets are 10^6 bytes.",
        mib(m.floor_kib)
    ));
}

/// Binary size: Metis against host-local.
fn report_binary_size(report: &mut Report) {
    let (metis_size, metis_stripped) = memory::binary(Path::new(METIS));
    let (host_size, host_stripped) = memory::binary(Path::new(HOST_LOCAL));
    let size = |bytes: u64, stripped: bool| {
        format!(
            "{:.2} MiB{}",
            bytes as f64 / 1048576.0,
            if stripped { "" } else { " (not stripped)" }
        )
    };
    report.rows.push(row(
        "binary size, Metis vs host-local",
        size(metis_size, metis_stripped),
        size(host_size, host_stripped),
        format!("{:.2}×", metis_size as f64 / host_size as f64),
        "stripped",
        Some(metis_stripped),
    ));
    report_image_size(report, &size);
}

/// The image `make image` builds, when podman holds it: its size beside
/// the binary's (the image's binary is the static build, not `METIS`).
fn report_image_size(report: &mut Report, size: &dyn Fn(u64, bool) -> String) {
    let image = format!("localhost/metis:{}", env!("CARGO_PKG_VERSION"));
    let inspected = Command::new("podman")
        .args(["image", "inspect", "--format", "{{.Size}}", &image])
        .output();
    let bytes = inspected
        .ok()
        .filter(|output| output.status.success())
        .and_then(|output| {
            String::from_utf8_lossy(&output.stdout)
                .trim()
                .parse::<u64>()
                .ok()
        });
    let Some(bytes) = bytes else {
        report.notes.push(format!(
            "image: {image} not built (`make image`), its size not measured."
        ));
        return;
    };
    report.rows.push(row(
        &format!("image size, {image} (static binary on scratch)"),
        size(bytes, true),
        String::new(),
        String::new(),
        "built offline",
        None,
    ));
}

/// Concurrent ADDs: all succeed with distinct addresses.
fn report_burst(plan: &Plan, report: &mut Report) {
    let b = cni::burst(plan.burst);
    assert_eq!(b.count, plan.burst);
    assert_eq!(b.distinct, plan.burst, "burst addresses must be distinct");
    report.rows.push(row(
        &format!("burst: {} concurrent ADDs, wall time", b.count),
        ms(b.wall),
        String::new(),
        String::new(),
        "all succeed, distinct",
        Some(b.distinct == b.count),
    ));
    report.rows.push(row(
        "burst: ADD latency median / p99",
        format!("{} / {}", ms(b.latency.median), ms(b.latency.p99)),
        String::new(),
        String::new(),
        "",
        None,
    ));
    report.notes.push(format!(
        "burst: {} of {} ADDs fell back to direct mode; {} distinct addresses.",
        b.direct_mode, b.count, b.distinct
    ));
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

fn render(plan: &Plan, report: &Report, took: Duration) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown".into());
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
    let _ = writeln!(out, "| | |\n|---|---|");
    let _ = writeln!(
        out,
        "| date | {} |",
        command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"])
    );
    let _ = writeln!(
        out,
        "| nproc | {} |",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let _ = writeln!(out, "| CPU | {cpu} |");
    let _ = writeln!(
        out,
        "| kernel | {} |",
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
    );
    let _ = writeln!(
        out,
        "| durability | SQLite WAL, synchronous=NORMAL (the default), database in {} |",
        std::env::temp_dir().display()
    );
    let _ = writeln!(
        out,
        "| metis | release profile (lto, codegen-units=1, stripped), {} |",
        command_line("rustc", &["--version"])
    );
    let _ = writeln!(
        out,
        "| host-local | {HOST_LOCAL}, containernetworking-plugins {} |",
        command_line(
            "dpkg-query",
            &["-W", "-f", "${Version}", "containernetworking-plugins"]
        )
    );
    let _ = writeln!(out, "| run time | {:.0} s |\n", took.as_secs_f64());
    let _ = writeln!(
        out,
        "| measurement | Metis | reference | ratio | target | |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    for r in &report.rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            r.what, r.value, r.against, r.ratio, r.target, r.verdict
        );
    }
    let _ = writeln!(out);
    for note in &report.notes {
        let _ = writeln!(out, "- {note}");
    }
    out
}
