//! Measurements through real processes: ADD+DEL cycles of each build of
//! Metis (with its daemon), Debian's host-local and the floor program,
//! interleaved, with each build also against a daemon that answers at once
//! (the design's limit); and a burst of ADDs launched back to back against
//! one daemon per build.

use std::collections::HashSet;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;

use crate::Bench;
use crate::common::rng::Rng;
use crate::limit::Replay;
use crate::report::{Report, Row};
use crate::util::{
    Build, Daemon, Invocation, RANGE_V4, Summary, TempDir, host_local_conf, metis_conf, ms, ratio,
    result_address, with_prev_result,
};

/// ADD+DEL latency of one program: the pair, ADD alone, DEL alone.
pub struct Timing {
    pub total: Summary,
    pub add: Summary,
    pub del: Summary,
}

/// ADD+DEL latency of every build, host-local and the floor, measured
/// side by side.
pub struct Cycles {
    /// In the order of the builds given.
    pub builds: Vec<Timing>,
    /// The same builds with no daemon: direct mode.
    pub direct: Vec<Timing>,
    /// The same builds against a daemon that answers at once: the design's
    /// limit.
    pub limit: Vec<Timing>,
    pub host_local: Summary,
    pub floor: Summary,
}

/// One program under test: how to run it and what it is fed.
struct Subject<'a> {
    program: &'a Path,
    conf: String,
    /// Whether its ADD prints a result with an address (the floor does not).
    allocates: bool,
    /// Whether that address must be new every round (a replayed answer's
    /// is always the same).
    unique: bool,
    add: Vec<Duration>,
    del: Vec<Duration>,
    total: Vec<Duration>,
    addresses: HashSet<String>,
}

impl<'a> Subject<'a> {
    fn new(program: &'a Path, conf: String, allocates: bool) -> Subject<'a> {
        Subject {
            program,
            conf,
            allocates,
            unique: allocates,
            add: Vec::new(),
            del: Vec::new(),
            total: Vec::new(),
            addresses: HashSet::new(),
        }
    }

    /// One ADD then DEL (with the ADD's result as `prevResult`).
    fn cycle(&mut self, container_id: &str, record: bool) {
        let (result, add) = Invocation {
            program: self.program,
            command: "ADD",
            container_id,
            stdin: &self.conf,
        }
        .run();
        let del_conf = if self.allocates {
            assert!(
                self.addresses.insert(result_address(&result)) || !self.unique,
                "{} handed out an address twice",
                self.program.display()
            );
            with_prev_result(&self.conf, &result)
        } else {
            self.conf.clone()
        };
        let (_, del) = Invocation {
            program: self.program,
            command: "DEL",
            container_id,
            stdin: &del_conf,
        }
        .run();
        if record {
            self.add.push(add);
            self.del.push(del);
            self.total.push(add + del);
        }
    }

    fn timing(&self) -> Timing {
        Timing {
            total: Summary::of(&self.total),
            add: Summary::of(&self.add),
            del: Summary::of(&self.del),
        }
    }
}

/// A release cooldown longer than any run of the cycles: each round's
/// address must be new (the uniqueness check), and on a loaded machine the
/// 620 rounds outlast the default minute, after which the first address
/// released is rightly handed out again.
const CYCLE_COOLDOWN: &[&str] = &["--release-cooldown", "1h"];

/// Each build in direct mode: no daemon on these, every exec finds no
/// socket and serves itself. A daemon started and stopped once records its
/// release cooldown, which direct mode keeps too (released addresses rest,
/// as with the daemon).
fn direct_dirs(builds: &[Build]) -> Vec<TempDir> {
    builds
        .iter()
        .map(|build| {
            let dir = TempDir::new(&format!("cycles-direct-{}", build.name()));
            assert!(build.daemon(&dir, CYCLE_COOLDOWN).stop().success());
            dir
        })
        .collect()
}

/// The seed of the rounds' orders: the same sequence in every run.
const CYCLE_ORDER_SEED: u64 = 0x6379_636c_6573;

/// Puts `order` in a random order (Fisher–Yates).
fn shuffle(order: &mut [usize], rng: &mut Rng) {
    for last in (1..order.len()).rev() {
        order.swap(last, rng.index(last + 1));
    }
}

/// `cycles` measured rounds (after `warmup` unrecorded ones), each running
/// every build (against its own daemon, in direct mode and against a
/// replaying daemon), host-local and the floor once, in a new random order
/// every round: a fixed rotation would give every subject the same
/// predecessor in every round, and a heavy predecessor (a direct-mode exec
/// that leaves writeback behind) slows the one after it.
pub fn cycles(bench: &Bench, warmup: usize, cycles: usize) -> Cycles {
    let (builds, floor) = (&bench.builds[..], &bench.floor);
    let named = |what: &str| -> Vec<TempDir> {
        builds
            .iter()
            .map(|b| TempDir::new(&format!("cycles-{what}-{}", b.name())))
            .collect()
    };
    let dirs = named("daemon");
    let _daemons: Vec<Daemon> = builds
        .iter()
        .zip(&dirs)
        .map(|(build, dir)| build.daemon(dir, CYCLE_COOLDOWN))
        .collect();
    let direct_dirs = direct_dirs(builds);
    let limit_dirs = named("limit");
    let _replays: Vec<Replay> = builds
        .iter()
        .zip(&limit_dirs)
        .map(|(build, dir)| Replay::start(build, dir))
        .collect();
    let mut subjects: Vec<Subject> = Vec::new();
    for dirs in [&dirs, &direct_dirs, &limit_dirs] {
        subjects.extend(
            builds
                .iter()
                .zip(dirs)
                .map(|(build, dir)| Subject::new(&build.binary, metis_conf(dir, RANGE_V4), true)),
        );
    }
    for limit in &mut subjects[2 * builds.len()..] {
        limit.unique = false;
    }
    let host_local_dir = TempDir::new("cycles-host-local");
    subjects.push(Subject::new(
        &bench.host_local,
        host_local_conf(&host_local_dir, RANGE_V4),
        true,
    ));
    subjects.push(Subject::new(floor, metis_conf(&dirs[0], RANGE_V4), false));
    let mut order: Vec<usize> = (0..subjects.len()).collect();
    let mut rng = Rng::new(CYCLE_ORDER_SEED);
    for round in 0..warmup + cycles {
        let container_id = format!("bench-cycle-{round:06}");
        shuffle(&mut order, &mut rng);
        for &index in &order {
            subjects[index].cycle(&container_id, round >= warmup);
        }
    }
    let floor = subjects.pop().unwrap();
    let host_local = subjects.pop().unwrap();
    let limit = subjects.split_off(2 * builds.len());
    for subject in subjects.iter().chain([&host_local]) {
        assert_eq!(subject.addresses.len(), warmup + cycles);
    }
    let direct = subjects.split_off(builds.len());
    Cycles {
        builds: subjects.iter().map(Subject::timing).collect(),
        direct: direct.iter().map(Subject::timing).collect(),
        limit: limit.iter().map(Subject::timing).collect(),
        host_local: Summary::of(&host_local.total),
        floor: Summary::of(&floor.total),
    }
}

/// ADD+DEL rows: each build against the floor and host-local.
pub fn report_cycles(bench: &Bench, report: &mut Report) {
    let plan = &bench.plan;
    let c = cycles(bench, plan.warmup, plan.cycles);
    for ((build, t), limit) in bench.builds.iter().zip(&c.builds).zip(&c.limit) {
        for (reference, theirs, target) in [
            ("trivial-binary floor", c.floor.median, 1.25),
            (
                "the design's limit (its daemon replayed)",
                limit.total.median,
                1.15,
            ),
            ("host-local", c.host_local.median, 0.45),
        ] {
            let r = ratio(t.total.median, theirs);
            report.rows.push(
                Row::plain(
                    format!("ADD+DEL median through the binary / {reference}"),
                    build.name(),
                    ms(t.total.median),
                )
                .against(ms(theirs), r)
                .target(format!("≤ {target}×"), r <= target),
            );
        }
        report.notes.push(format!(
            "ADD+DEL, {} build: ADD alone median {} p99 {}, DEL alone median {} p99 {}, \
             the pair p99 {} (floor p99 {}, host-local p99 {}).",
            build.name(),
            ms(t.add.median),
            ms(t.add.p99),
            ms(t.del.median),
            ms(t.del.p99),
            ms(t.total.p99),
            ms(c.floor.p99),
            ms(c.host_local.p99),
        ));
        report.rows.push(
            Row::plain(
                "ADD+DEL median, the design's limit / host-local",
                build.name(),
                ms(limit.total.median),
            )
            .against(
                ms(c.host_local.median),
                ratio(limit.total.median, c.host_local.median),
            ),
        );
    }
    for (build, t) in bench.builds.iter().zip(&c.direct) {
        let r = ratio(t.total.median, c.host_local.median);
        report.rows.push(
            Row::plain(
                "ADD+DEL median in direct mode (no daemon) / host-local",
                build.name(),
                ms(t.total.median),
            )
            .against(ms(c.host_local.median), r)
            .target("≤ 0.6×", r <= 0.6),
        );
        report.notes.push(format!(
            "ADD+DEL in direct mode, {} build: ADD alone median {} p99 {}, DEL alone median {} \
             p99 {}, the pair p99 {}.",
            build.name(),
            ms(t.add.median),
            ms(t.add.p99),
            ms(t.del.median),
            ms(t.del.p99),
            ms(t.total.p99),
        ));
    }
    report.rows.push(
        Row::plain(
            "ADD+DEL median, floor / host-local (the best possible)",
            "",
            ms(c.floor.median),
        )
        .against(
            ms(c.host_local.median),
            ratio(c.floor.median, c.host_local.median),
        ),
    );
    report.notes.push(format!(
        "ADD+DEL: {} cycles each (after {} warm-up), interleaved: every round runs each build \
         (against its own daemon), each build in direct mode (no daemon, its own database), \
         each build against the design's limit (a thread of the bench that answers every \
         request at once with the frame its build's daemon sent to one of the same kind), \
         host-local and the floor program, in a new random order every round.",
        plan.cycles, plan.warmup,
    ));
}

/// `n` plugin ADDs launched back to back against one daemon.
pub struct Burst {
    pub count: usize,
    pub wall: Duration,
    pub latency: Summary,
    pub distinct: usize,
    /// ADDs that found no daemon and fell back to direct mode.
    pub direct_mode: usize,
}

/// A process that waits on its stdin and leads the process group the
/// burst's plugins join, so that they and only they are reaped by group.
struct GroupLeader(std::process::Child);

impl GroupLeader {
    fn start(floor: &Path) -> GroupLeader {
        let child = Command::new(floor)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        GroupLeader(child)
    }

    fn pgid(&self) -> i32 {
        i32::try_from(self.0.id()).unwrap()
    }
}

impl Drop for GroupLeader {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

/// Reaps `n` exits of group `pgid` as they come: (pid, when, success).
fn reap(pgid: i32, n: usize) -> Vec<(i32, Instant, bool)> {
    (0..n)
        .map(|_| match waitpid(Pid::from_raw(-pgid), None).unwrap() {
            WaitStatus::Exited(pid, code) => (pid.as_raw(), Instant::now(), code == 0),
            other => panic!("a burst ADD ended with {other:?}"),
        })
        .collect()
}

/// One launcher thread spawns `n` plugin ADDs back to back, as a runtime
/// starting a burst of pods does; another reaps each as it exits. An ADD's
/// latency runs from its spawn's start to its exit being reaped.
pub fn burst(build: &Build, floor: &Path, n: usize) -> Burst {
    let dir = TempDir::new(&format!("burst-{}", build.name()));
    let _daemon = build.daemon(&dir, &[]);
    let conf = metis_conf(&dir, RANGE_V4);
    // Create the block first: the burst measures allocations, not the
    // one-time population of a /16.
    Invocation {
        program: &build.binary,
        command: "ADD",
        container_id: "bench-burst-first",
        stdin: &conf,
    }
    .run();
    let conf_path = dir.join("burst-conf.json");
    std::fs::write(&conf_path, &conf).unwrap();
    let leader = GroupLeader::start(floor);
    let pgid = leader.pgid();
    let reaper = std::thread::spawn(move || reap(pgid, n));
    let mut started = std::collections::HashMap::new();
    for i in 0..n {
        let container_id = format!("bench-burst-{i:04}");
        let output = std::fs::File::create(dir.join(&format!("{container_id}.out"))).unwrap();
        let start = Instant::now();
        let mut command = Invocation {
            program: &build.binary,
            command: "ADD",
            container_id: &container_id,
            stdin: &conf,
        }
        .command();
        // Reaped by the group's `waitpid` in `reap`, not through `Child`.
        #[allow(clippy::zombie_processes)]
        let child = command
            .process_group(pgid)
            .stdin(std::fs::File::open(&conf_path).unwrap())
            .stdout(output)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        started.insert(i32::try_from(child.id()).unwrap(), start);
    }
    let ends = reaper.join().unwrap();
    drop(leader);
    assert!(ends.iter().all(|end| end.2), "a burst ADD failed");
    let latencies: Vec<Duration> = ends
        .iter()
        .map(|(pid, end, _)| *end - started[pid])
        .collect();
    let first = started.values().min().unwrap();
    let last = ends.iter().map(|end| end.1).max().unwrap();
    let addresses: HashSet<String> = (0..n)
        .map(|i| {
            let out =
                std::fs::read_to_string(dir.join(&format!("bench-burst-{i:04}.out"))).unwrap();
            result_address(&out)
        })
        .collect();
    let log = std::fs::read_to_string(dir.join("cni.log")).unwrap_or_default();
    Burst {
        count: latencies.len(),
        wall: last - *first,
        latency: Summary::of(&latencies),
        distinct: addresses.len(),
        direct_mode: log.matches("using direct mode").count(),
    }
}

/// Concurrent ADDs per build: all succeed with distinct addresses.
pub fn report_burst(bench: &Bench, report: &mut Report) {
    let n = bench.plan.burst;
    for build in &bench.builds {
        let b = burst(build, &bench.floor, n);
        assert_eq!(b.count, n);
        assert_eq!(b.distinct, n, "burst addresses must be distinct");
        report.rows.push(
            Row::plain(
                format!("burst: {n} ADDs launched back to back, wall time"),
                build.name(),
                ms(b.wall),
            )
            .target("all succeed, distinct", b.distinct == b.count),
        );
        report.rows.push(Row::plain(
            "burst: ADD latency median / p99 (spawn to exit)",
            build.name(),
            format!("{} / {}", ms(b.latency.median), ms(b.latency.p99)),
        ));
        report.notes.push(format!(
            "burst, {} build: {} of {} ADDs fell back to direct mode; {} distinct addresses.",
            build.name(),
            b.direct_mode,
            b.count,
            b.distinct
        ));
    }
}
