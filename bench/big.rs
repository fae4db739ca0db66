//! Big blocks: the loop time of a first ADD that adds a /12, a small ADD's
//! latency while other networks add /12s, the daemon's start to healthy on
//! a database holding 1,048,576 address rows, and its restart after a
//! crash (SIGKILL) on one holding 100,000, for each build.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use metis::engine::Engine;
use metis::store::{Checkpointer, Store, StoreOptions};
use metis::wire::{Code, Request, ipam, request};

use crate::Bench;
use crate::report::{Report, Row, mib};
use crate::util::typed;
use crate::util::{
    Daemon, METIS, RANGE_V4, Summary, TempDir, allocate_request, allocated, client,
    daemon_peak_rss_kib, ms, ratio, release_request, released,
};

/// The peak RSS a daemon started after a crash may reach: the daemon's own
/// with 65,536 allocations, 7.2 MiB.
const CRASH_START_RSS_LIMIT: u64 = 7 * 1024 * 1024 + 205 * 1024;

/// A /12: 1,048,576 addresses, the largest block the issue asks about.
pub const BIG: &str = "198.16.0.0/12";

/// How often the loading client adds a /12 (each in a new network).
const BIG_ADD_EVERY: Duration = Duration::from_millis(10);

/// A first ADD in network `network` (isolated, so every /12 may overlap
/// the others) whose block is [`BIG`].
fn big_add(network: &str) -> Request {
    Request {
        kind: Some(request::Kind::Allocate(ipam::AllocatePodIpRequest {
            network: network.into(),
            ipv4_config: Some(ipam::IpConfig {
                interface_name: "eth0".into(),
                container_id: format!("{network}-first"),
                initial_pod_cidr: BIG.into(),
                ..Default::default()
            }),
            ipv6_config: None,
            pod_name: "pod".into(),
            pod_namespace: "bench".into(),
            isolated: true,
            conf_name: String::new(),
        })),
    }
}

/// Engine time of `count` first ADDs, each adding a /12 in a new network:
/// what one such request holds the daemon's loop for.
pub fn add_loop_time(count: usize) -> Summary {
    let dir = TempDir::new("big-loop");
    let store = Store::open(&dir.join("metis.sqlite"), &StoreOptions::default()).unwrap();
    // As in the daemon: WAL checkpoints run on their own thread.
    store.defer_checkpoints().unwrap();
    let _checkpointer = Checkpointer::start(&dir.join("metis.sqlite")).unwrap();
    let mut engine = Engine::new(store);
    let samples: Vec<Duration> = (0..count)
        .map(|n| {
            let request = big_add(&format!("big{n}"));
            let started = Instant::now();
            let outcome = engine.handle(&typed(request), metis::log::now_ms());
            let took = started.elapsed();
            assert_eq!(allocated(&outcome.into_response()), "198.16.0.2");
            took
        })
        .collect();
    Summary::of(&samples)
}

/// Round trips of small ADDs (and their DELs, so the pool never drains),
/// `samples` of them, unloaded and then while another client adds a /12 in
/// a fresh network every [`BIG_ADD_EVERY`]. Returns (unloaded, loaded,
/// /12s added).
pub fn small_add_under_big_adds(samples: usize) -> (Summary, Summary, usize) {
    let dir = TempDir::new("big-load");
    let daemon = Daemon::start(&dir, &["--release-cooldown", "0"]);
    let mut small = client(&daemon);
    let mut measure = |tag: &str| -> Summary {
        let times: Vec<Duration> = (0..samples)
            .map(|n| {
                let id = format!("small-{tag}-{n}");
                let started = Instant::now();
                allocated(&small.call(&allocate_request(&id, &[RANGE_V4])).unwrap());
                let took = started.elapsed();
                crate::util::released(&small.call(&crate::util::release_request(&id)).unwrap());
                took
            })
            .collect();
        Summary::of(&times)
    };
    measure("warm");
    let unloaded = measure("unloaded");
    let stop = Arc::new(AtomicBool::new(false));
    let mut big = client(&daemon);
    let adder = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut added = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let next = Instant::now() + BIG_ADD_EVERY;
                let reply = big.call(&big_add(&format!("load{added}"))).unwrap();
                assert_eq!(reply.code(), Code::Ok, "{reply:?}");
                added += 1;
                // Pacing, not synchronisation: back to back, the daemon
                // would serve the two clients in turn whatever they ask.
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
            }
            added
        })
    };
    let loaded = measure("loaded");
    stop.store(true, Ordering::Relaxed);
    let added = adder.join().unwrap();
    assert!(daemon.stop().success());
    (unloaded, loaded, added)
}

/// Start to healthy of a daemon on a database whose /12 has its first
/// `rows` address rows (all 1,048,576: as upstream or an older Metis wrote
/// it): (first start, which reads every row as someone else wrote the
/// file; starts after a clean stop, `restarts` of them).
pub fn start_to_healthy(rows: u32, restarts: usize) -> (Duration, Summary) {
    let dir = TempDir::new("big-start");
    let flags = ["--cidr", &format!("pods={BIG}")];
    let daemon = Daemon::start(&dir, &flags);
    assert!(daemon.stop().success());
    fill_rows(&dir.join("metis.sqlite"), rows);
    let stopped = |(took, daemon): (Duration, Daemon)| {
        assert!(daemon.stop().success());
        took
    };
    let first = stopped(timed_start(&dir, &flags, METIS.as_ref()));
    let samples: Vec<Duration> = (0..restarts)
        .map(|_| stopped(timed_start(&dir, &flags, METIS.as_ref())))
        .collect();
    (first, Summary::of(&samples))
}

/// What [`restart_after_crash`] measured.
pub struct CrashRestarts {
    /// The first start, after another process wrote the rows (reads them).
    pub first: Duration,
    /// Starts after a SIGKILL that came after the daemon's own writes.
    pub restarts: Summary,
    /// The highest peak RSS (KiB) of a daemon started after a crash.
    pub peak_rss_kib: u64,
}

/// Start to healthy of `binary`'s daemon after a crash: on a database whose
/// /12 has its first `rows` address rows, each round starts the daemon,
/// allocates and releases one address through it, and SIGKILLs it.
pub fn restart_after_crash(binary: &Path, rows: u32, restarts: usize) -> CrashRestarts {
    let dir = TempDir::new("big-crash");
    let flags = ["--cidr", &format!("pods={BIG}")];
    let daemon = Daemon::start_from(binary, &dir, &flags);
    assert!(daemon.stop().success());
    fill_rows(&dir.join("metis.sqlite"), rows);
    // (start to healthy, peak RSS in KiB) of one round.
    let crash = |round: usize| -> (Duration, u64) {
        let (took, daemon) = timed_start(&dir, &flags, binary);
        let rss = daemon_peak_rss_kib(&daemon);
        let mut pods = client(&daemon);
        let id = format!("crash-{round}");
        let mut add = allocate_request(&id, &[BIG]);
        if let Some(request::Kind::Allocate(allocate)) = &mut add.kind {
            allocate.network = "pods".into();
        }
        allocated(&pods.call(&add).unwrap());
        let mut del = release_request(&id);
        if let Some(request::Kind::Deallocate(release)) = &mut del.kind {
            release.network = "pods".into();
        }
        released(&pods.call(&del).unwrap());
        drop(daemon); // SIGKILL
        (took, rss)
    };
    let (first, _) = crash(0);
    let rounds: Vec<(Duration, u64)> = (1..=restarts).map(crash).collect();
    let samples: Vec<Duration> = rounds.iter().map(|(took, _)| *took).collect();
    CrashRestarts {
        first,
        restarts: Summary::of(&samples),
        peak_rss_kib: rounds.iter().map(|(_, rss)| *rss).max().unwrap_or(0),
    }
}

/// Populates the /12 up to offset `rows` (its first 64 rows and its last,
/// reserved, exist already) and moves its frontier there. The rows are
/// stamped an hour old, as a long-lived node's are.
fn fill_rows(db: &std::path::Path, rows: u32) {
    let conn = rusqlite::Connection::open(db).unwrap();
    conn.execute_batch(&format!(
        "BEGIN; \
         WITH RECURSIVE n(i) AS (SELECT 64 UNION ALL SELECT i + 1 FROM n WHERE i < {last}) \
         INSERT OR IGNORE INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated, updated_at) \
         SELECT '198.' || (16 + (i >> 16)) || '.' || ((i >> 8) & 255) || '.' || (i & 255), 1, '', '', 0, \
                CAST(unixepoch('subsec') * 1000 AS INTEGER) - 3600000 FROM n; \
         UPDATE metis_blocks SET frontier = '{rows}' WHERE block_id = 1; \
         COMMIT;",
        last = rows - 1,
    ))
    .unwrap();
    let count: i64 = conn
        .query_row("SELECT COUNT(*) FROM ip_addresses", [], |r| r.get(0))
        .unwrap();
    // The last, reserved row exists whatever `rows` is.
    assert!(
        count == i64::from(rows) || count == i64::from(rows) + 1,
        "{count}"
    );
}

/// Spawn of `binary`'s daemon to a `metis health` that answers healthy;
/// the daemon is the caller's to stop or kill.
fn timed_start(dir: &TempDir, flags: &[&str], binary: &Path) -> (Duration, Daemon) {
    let socket = dir.join("metis.sock");
    let started = Instant::now();
    let daemon = Daemon::start_from(binary, dir, flags);
    let deadline = started + Duration::from_secs(60);
    loop {
        let health = Command::new(METIS)
            .args(["health", "--socket-path"])
            .arg(&socket)
            .output()
            .unwrap();
        if health.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "daemon never healthy");
    }
    (started.elapsed(), daemon)
}

/// Big blocks (full build: the engine is the same in both): loop time to
/// add a /12, a small ADD's p99 while /12s are added next to it, start to
/// healthy on a 1,048,576-row database.
pub fn report(bench: &Bench, report: &mut Report) {
    let plan = &bench.plan;
    let adds = add_loop_time(plan.big_adds);
    let mut loop_row = Row::plain(
        "loop time of a first ADD adding a /12 (p99)",
        "full",
        ms(adds.p99),
    );
    if !plan.smoke {
        loop_row = loop_row.target("≤ 50 ms", adds.p99 <= Duration::from_millis(50));
    }
    report.rows.push(loop_row);
    let (unloaded, loaded, added) = small_add_under_big_adds(plan.big_samples);
    let r = ratio(loaded.p99, unloaded.p99);
    let mut under_load = Row::plain(
        "small ADD p99 while another client adds a /12 every 10 ms, vs unloaded",
        "full",
        ms(loaded.p99),
    )
    .against(ms(unloaded.p99), r);
    if !plan.smoke {
        under_load = under_load.target("≤ 2×", r <= 2.0);
    }
    report.rows.push(under_load);
    let (first, restarts) = start_to_healthy(plan.start_rows, plan.restarts);
    let mut start = Row::plain(
        format!(
            "daemon start to healthy, {} address rows, after a clean stop (median), vs the first start",
            plan.start_rows
        ),
        "full",
        ms(restarts.median),
    )
    .against(ms(first), ratio(restarts.median, first));
    if !plan.smoke {
        start = start.target("≤ 200 ms", restarts.median <= Duration::from_millis(200));
    }
    report.rows.push(start);
    for build in &bench.builds {
        let crashed = restart_after_crash(&build.binary, plan.crash_rows, plan.restarts);
        let mut row = Row::plain(
            format!(
                "daemon start to healthy after a crash, {} address rows (median), vs the first start",
                plan.crash_rows
            ),
            build.name(),
            ms(crashed.restarts.median),
        )
        .against(
            ms(crashed.first),
            ratio(crashed.restarts.median, crashed.first),
        );
        if !plan.smoke {
            row = row.target(
                "≤ 100 ms",
                crashed.restarts.median <= Duration::from_millis(100),
            );
        }
        report.rows.push(row);
        // Held to the daemon's RSS with 65,536 allocations (issue 22's
        // figure): the start after a crash may not cost more than serving.
        let peak = crashed.peak_rss_kib * 1024;
        report.rows.push(
            Row::plain(
                format!(
                    "daemon peak RSS, started after a crash on {} address rows",
                    plan.crash_rows
                ),
                build.name(),
                mib(peak),
            )
            .target("≤ 7.2 MiB", peak <= CRASH_START_RSS_LIMIT),
        );
        report.notes.push(format!(
            "restart after a crash, {} build: {} rounds of start, one ADD and its DEL through \
             the daemon, SIGKILL; start to healthy median {} p99 {}, against {} for the first \
             start (the rows were written by another process, so it reads every row); peak RSS \
             of those daemons at most {}.",
            build.name(),
            crashed.restarts.count,
            ms(crashed.restarts.median),
            ms(crashed.restarts.p99),
            ms(crashed.first),
            mib(peak),
        ));
    }
    report.notes.push(format!(
        "big blocks: {} first ADDs of a /12 in-process: median {} p99 {}; {} small ADDs each \
         unloaded (median {} p99 {}) and while {added} /12s were added next to them (median {} \
         p99 {}); start to healthy over {} restarts after a clean stop: median {} p99 {}, \
         against {} for the first start after the rows were written by another process (it \
         reads every row).",
        adds.count,
        ms(adds.median),
        ms(adds.p99),
        plan.big_samples,
        ms(unloaded.median),
        ms(unloaded.p99),
        ms(loaded.median),
        ms(loaded.p99),
        restarts.count,
        ms(restarts.median),
        ms(restarts.p99),
        ms(first),
    ));
}
