//! Memory and size, per build: the daemon's peak RSS idle and after many
//! allocations, the plugin's peak RSS for one ADD (host-local and the floor
//! beside it), and binary sizes (host-local beside them).

use std::collections::HashSet;
use std::path::Path;
use std::process::Command;

use crate::Bench;
use crate::report::{Report, Row, mib};
use crate::util::{
    Build, Flavour, HOST_LOCAL, Invocation, RANGE_V4, RANGE_V4_SECOND, TempDir, allocate_request,
    allocated, client, daemon_peak_rss_kib, host_local_conf, metis_conf, peak_rss_kib,
};

const MIB: u64 = 1_048_576;

/// Peak RSS (bytes) of `build`'s daemon idle, then holding `allocations`
/// addresses.
fn daemon_rss(build: &Build, allocations: usize) -> (u64, u64) {
    let dir = TempDir::new(&format!("memory-{}", build.name()));
    let daemon = build.daemon(&dir, &[]);
    let idle = daemon_peak_rss_kib(&daemon) * 1024;
    let ranges = [RANGE_V4, RANGE_V4_SECOND];
    let threads = 2;
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let mut client = client(&daemon);
            std::thread::spawn(move || {
                (t..allocations)
                    .step_by(threads)
                    .map(|i| {
                        let id = format!("bench-mem-{i}");
                        allocated(&client.call(&allocate_request(&id, &ranges)).unwrap())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut addresses = HashSet::new();
    for worker in workers {
        addresses.extend(worker.join().unwrap());
    }
    assert_eq!(addresses.len(), allocations, "addresses must be distinct");
    (idle, daemon_peak_rss_kib(&daemon) * 1024)
}

/// Peak RSS (bytes) of one ADD of `program` fed `conf`.
fn add_rss(program: &Path, conf: &str) -> u64 {
    peak_rss_kib(&Invocation {
        program,
        command: "ADD",
        container_id: "bench-rss",
        stdin: conf,
    }) * 1024
}

/// Peak RSS (bytes) of one steady-state plugin ADD of `build` (the first
/// ADD, which populates the block, is not measured).
fn plugin_rss(build: &Build) -> u64 {
    let dir = TempDir::new(&format!("memory-plugin-{}", build.name()));
    let _daemon = build.daemon(&dir, &[]);
    let conf = metis_conf(&dir, RANGE_V4);
    Invocation {
        program: &build.binary,
        command: "ADD",
        container_id: "bench-rss-first",
        stdin: &conf,
    }
    .run();
    add_rss(&build.binary, &conf)
}

/// Peak RSS rows for every build.
pub fn report(bench: &Bench, report: &mut Report) {
    let allocations = bench.plan.memory_allocations;
    let reference_dir = TempDir::new("memory-reference");
    let host_local = add_rss(
        &bench.host_local,
        &host_local_conf(&reference_dir, RANGE_V4),
    );
    let floor = add_rss(&bench.floor, &metis_conf(&reference_dir, RANGE_V4));
    for build in &bench.builds {
        let (idle, loaded) = daemon_rss(build, allocations);
        report.rows.push(
            Row::plain("daemon peak RSS, idle", build.name(), mib(idle))
                .target("≤ 8 MB", idle <= 8_000_000),
        );
        report.rows.push(
            Row::plain(
                format!("daemon peak RSS, {allocations} allocations"),
                build.name(),
                mib(loaded),
            )
            .target("≤ 16 MB", loaded <= 16_000_000),
        );
        let plugin = plugin_rss(build);
        let limit = match build.flavour {
            Flavour::Full => 3.0,
            Flavour::Edge => 2.5,
        };
        report.rows.push(
            Row::plain(
                "plugin peak RSS, one ADD / host-local",
                build.name(),
                mib(plugin),
            )
            .against(mib(host_local), plugin as f64 / host_local as f64)
            .target(
                format!("≤ {limit} MiB"),
                plugin as f64 <= limit * MIB as f64,
            ),
        );
    }
    report.notes.push(format!(
        "memory: peak RSS is `VmHWM`; the floor program's for one ADD is {}; MB targets are \
         10^6 bytes, MiB 2^20.",
        mib(floor)
    ));
}

/// A binary's size in bytes and whether it carries a symbol table.
fn binary(path: &Path) -> (u64, bool) {
    let bytes = std::fs::read(path).unwrap();
    let has_symtab = bytes.windows(8).any(|w| w == b".symtab\0");
    (bytes.len() as u64, !has_symtab)
}

fn size(bytes: u64, stripped: bool) -> String {
    format!(
        "{}{}",
        mib(bytes),
        if stripped { "" } else { " (not stripped)" }
    )
}

/// Binary size rows for every build, host-local beside each; the image's
/// size when podman holds it.
pub fn report_size(bench: &Bench, report: &mut Report) {
    let (host_size, host_stripped) = binary(Path::new(HOST_LOCAL));
    for build in &bench.builds {
        let (bytes, stripped) = binary(&build.binary);
        // Issue 22: the edge build no larger than host-local itself.
        let (limit, target) = match build.flavour {
            Flavour::Full => (4.5 * MIB as f64, "≤ 4.5 MiB, stripped".to_string()),
            Flavour::Edge => (host_size as f64, "≤ host-local's, stripped".to_string()),
        };
        report.rows.push(
            Row::plain(
                "binary size / host-local",
                build.name(),
                size(bytes, stripped),
            )
            .against(
                size(host_size, host_stripped),
                bytes as f64 / host_size as f64,
            )
            .target(target, stripped && bytes as f64 <= limit),
        );
    }
    report_image_size(report);
}

/// The image `make image` builds, when podman holds it: its size beside
/// the binaries' (the image's binary is the full build, static).
fn report_image_size(report: &mut Report) {
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
    report.rows.push(Row::plain(
        format!("image size, {image} (static binary on scratch)"),
        "full",
        mib(bytes),
    ));
}
