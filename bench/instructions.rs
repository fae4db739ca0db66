//! Instructions per exec, counted by callgrind (load on the machine does not
//! move them): the plugin's ADD and DEL with a daemon and in direct mode, the
//! daemon's work per ADD and per DEL, and the floor's. Needs
//! valgrind; without it the section says so and counts nothing.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Bench;
use crate::report::{Report, Row};
use crate::util::{
    Build, Invocation, RANGE_V4, TempDir, allocate_request, allocated, client, metis_conf,
    release_request, released, with_prev_result,
};

/// Unrecorded ADD+DEL pairs before counting: the block populated, the
/// database warm, as in the timed cycles.
const WARMUP: usize = 3;

/// Direct-mode pairs counted: about two of the WAL's truncation cycles.
const DIRECT_PAIRS: u64 = 8;

/// Instructions of one ADD and of its DEL.
#[derive(Clone, Copy)]
pub struct Pair {
    pub add: u64,
    pub del: u64,
}

/// valgrind's path, searched on PATH (the plugins run with an empty
/// environment, as from a runtime, so valgrind is named in full).
fn valgrind() -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("valgrind"))
        .find(|path| path.is_file())
}

/// `summary:` of a callgrind output file.
fn summary(out: &Path) -> u64 {
    let text = std::fs::read_to_string(out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    text.lines()
        .find_map(|l| l.strip_prefix("summary: "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{}: no summary line", out.display()))
}

/// Instructions of one invocation run under callgrind.
fn counted(valgrind: &Path, invocation: &Invocation, dir: &TempDir, name: &str) -> (String, u64) {
    let out = dir.join(&format!("{name}.callgrind"));
    let (stdout, _) = invocation.run_under(&[
        valgrind.display().to_string(),
        "--tool=callgrind".into(),
        "-q".into(),
        format!("--callgrind-out-file={}", out.display()),
    ]);
    (stdout, summary(&out))
}

/// The mean of `pairs` counted ADDs and DELs of `program` on `conf`, after
/// warm-up pairs (direct mode's cost depends on how long the WAL it finds
/// is: its mean needs a few pairs).
fn plugin_pair(
    valgrind: &Path,
    program: &Path,
    conf: &str,
    dir: &TempDir,
    tag: &str,
    pairs: u64,
) -> Pair {
    for i in 0..WARMUP {
        pair_natively(program, conf, &format!("count-{tag}-warm-{i}"));
    }
    let mut sum = Pair { add: 0, del: 0 };
    for n in 0..pairs {
        let container_id = format!("count-{tag}-{n}");
        let invocation = |command, stdin| Invocation {
            program,
            command,
            container_id: &container_id,
            stdin,
        };
        let (result, add) = counted(
            valgrind,
            &invocation("ADD", conf),
            dir,
            &format!("{tag}-{n}-add"),
        );
        let del_conf = with_prev_result(conf, &result);
        let (_, del) = counted(
            valgrind,
            &invocation("DEL", &del_conf),
            dir,
            &format!("{tag}-{n}-del"),
        );
        sum.add += add;
        sum.del += del;
    }
    Pair {
        add: sum.add / pairs,
        del: sum.del / pairs,
    }
}

fn pair_natively(program: &Path, conf: &str, container_id: &str) {
    let invocation = |command, stdin| Invocation {
        program,
        command,
        container_id,
        stdin,
    };
    let (result, _) = invocation("ADD", conf).run();
    invocation("DEL", &with_prev_result(conf, &result)).run();
}

/// A daemon run under callgrind, driven by valgrind's own control tool.
struct CountedDaemon {
    child: Child,
    dir: TempDir,
    dumps: usize,
}

impl CountedDaemon {
    /// The daemon under callgrind on `dir` (its database kept), with
    /// `extra` arguments.
    fn start(valgrind: &Path, build: &Build, dir: TempDir, extra: &[&str]) -> CountedDaemon {
        let socket = dir.join("metis.sock");
        let child = Command::new(valgrind)
            .arg("--tool=callgrind")
            .arg("-q")
            .arg("--separate-threads=yes")
            .arg(format!(
                "--callgrind-out-file={}",
                dir.join("daemon.callgrind").display()
            ))
            .arg(&build.binary)
            .arg("daemon")
            .arg("--socket-path")
            .arg(&socket)
            .arg("--db-path")
            .arg(dir.join("metis.sqlite"))
            .args(extra)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut daemon = CountedDaemon {
            child,
            dir,
            dumps: 0,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                daemon.child.try_wait().unwrap().is_none(),
                "the daemon under callgrind exited"
            );
            assert!(
                Instant::now() < deadline,
                "the daemon under callgrind did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon
    }

    fn control(&self, what: &str) {
        let status = Command::new("callgrind_control")
            .arg(what)
            .arg(self.child.id().to_string())
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "callgrind_control {what} failed");
    }

    /// Instructions since the last dump (or since the start): the loop's
    /// (the main thread, which serves every request), and the other
    /// threads' (the checkpoint thread, whose passes run on a clock: how
    /// many fall in a window follows the machine's speed, not the requests).
    fn dump(&mut self) -> Threads {
        self.control("--dump");
        self.dumps += 1;
        let prefix = format!("daemon.callgrind.{}-", self.dumps);
        let mut threads = Threads::default();
        for entry in std::fs::read_dir(&self.dir.path).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let Some(thread) = name.strip_prefix(&prefix) else {
                continue;
            };
            match thread == "01" {
                true => threads.main += summary(&path),
                false => threads.others += summary(&path),
            }
        }
        threads
    }

    /// The daemon's loop's instructions per ADD and per DEL over `n` of
    /// each, or per ADD alone unless `release` (each figure includes the
    /// little the idle loop does meanwhile); and the other threads' per
    /// ADD and DEL over the same time.
    fn per_request(&mut self, build: &Build, n: usize, release: bool) -> (Pair, Pair) {
        let conf = metis_conf(&self.dir, RANGE_V4);
        for i in 0..WARMUP {
            pair_natively(&build.binary, &conf, &format!("count-daemon-warm-{i}"));
        }
        let ids: Vec<String> = (0..n).map(|i| format!("count-daemon-{i}")).collect();
        let invocation = |command, container_id: &str, stdin: &str| {
            Invocation {
                program: &build.binary,
                command,
                container_id,
                stdin,
            }
            .run()
            .0
        };
        self.dump();
        let results: Vec<String> = ids.iter().map(|id| invocation("ADD", id, &conf)).collect();
        let add = self.dump();
        let del = match release {
            true => {
                for (id, result) in ids.iter().zip(&results) {
                    invocation("DEL", id, &with_prev_result(&conf, result));
                }
                self.dump()
            }
            false => Threads::default(),
        };
        let per = |add: u64, del: u64| Pair {
            add: add / n as u64,
            del: del / n as u64,
        };
        (per(add.main, del.main), per(add.others, del.others))
    }
}

/// Instructions of the daemon's main thread (its loop) and of its others.
#[derive(Default)]
struct Threads {
    main: u64,
    others: u64,
}

impl Drop for CountedDaemon {
    /// SIGTERM: the daemon stops and valgrind removes its vgdb FIFOs from
    /// the temporary directory, which a SIGKILL leaves behind.
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        if nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).is_err() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Per build: the plugin with its daemon, the daemon's loop and its other
/// threads, direct mode.
pub struct Counts {
    pub plugin: Pair,
    pub daemon: Pair,
    pub daemon_others: Pair,
    pub direct: Pair,
}

fn counts(valgrind: &Path, build: &Build, requests: usize) -> Counts {
    let dir = TempDir::new(&format!("count-daemon-{}", build.name()));
    let mut daemon = CountedDaemon::start(valgrind, build, dir, &[]);
    let (daemon_pair, daemon_others) = daemon.per_request(build, requests, true);
    // The plugin counted against a daemon that runs natively.
    let plugin_dir = TempDir::new(&format!("count-plugin-{}", build.name()));
    let _native = build.daemon(&plugin_dir, &[]);
    let plugin = plugin_pair(
        valgrind,
        &build.binary,
        &metis_conf(&plugin_dir, RANGE_V4),
        &plugin_dir,
        "plugin",
        1,
    );
    let direct_dir = TempDir::new(&format!("count-direct-{}", build.name()));
    // As in the timed cycles: the cooldown a daemon recorded once.
    assert!(build.daemon(&direct_dir, &[]).stop().success());
    let direct = plugin_pair(
        valgrind,
        &build.binary,
        &metis_conf(&direct_dir, RANGE_V4),
        &direct_dir,
        "direct",
        DIRECT_PAIRS,
    );
    Counts {
        plugin,
        daemon: daemon_pair,
        daemon_others,
        direct,
    }
}

/// A release cooldown no run outlasts: every released row stays cooling.
const LONG_COOLDOWN: &[&str] = &["--release-cooldown", "1h"];

/// A database of `build` with `rows` addresses allocated through a
/// daemon's socket under [`LONG_COOLDOWN`] (recorded for direct mode), and
/// released unless `held`: the same table either way, its rows cooling or
/// held.
fn populated(build: &Build, rows: usize, held: bool, tag: &str) -> TempDir {
    let dir = TempDir::new(&format!(
        "count-cooling-{tag}-{}-{rows}-{held}",
        build.name()
    ));
    let daemon = build.daemon(&dir, LONG_COOLDOWN);
    let mut client = client(&daemon);
    for i in 0..rows {
        let id = format!("count-cooling-{i}");
        allocated(&client.call(&allocate_request(&id, &[RANGE_V4])).unwrap());
        if !held {
            released(&client.call(&release_request(&id)).unwrap());
        }
    }
    drop(client);
    assert!(daemon.stop().success());
    dir
}

/// ADD instructions on a database [`populated`] with `rows` rows: (the
/// daemon's, direct mode's).
fn adds_after(
    valgrind: &Path,
    build: &Build,
    (rows, held): (usize, bool),
    direct_pairs: u64,
) -> (u64, u64) {
    let mut daemon = CountedDaemon::start(
        valgrind,
        build,
        populated(build, rows, held, "daemon"),
        LONG_COOLDOWN,
    );
    let in_daemon = daemon.per_request(build, 20, false).0.add;
    drop(daemon);
    let dir = populated(build, rows, held, "direct");
    let conf = metis_conf(&dir, RANGE_V4);
    let direct = plugin_pair(valgrind, &build.binary, &conf, &dir, "cool", direct_pairs).add;
    (in_daemon, direct)
}

/// Rows of ADD instructions with 600 and 2,000 rows cooling (a busy node's
/// minute of churn and more), each against the same table with those rows
/// held instead (none cooling): the claim's walk over cooling rows (issue
/// 35). A table that large costs every statement a deeper B-tree either
/// way; the note gives an empty one's count beside.
fn report_cooling(valgrind: &Path, bench: &Bench, report: &mut Report) {
    let (levels, direct_pairs): (&[usize], u64) = match bench.plan.smoke {
        true => (&[20], 1),
        false => (&[600, 2000], DIRECT_PAIRS),
    };
    for build in &bench.builds {
        let (empty_daemon, empty_direct) = adds_after(valgrind, build, (0, true), direct_pairs);
        for &rows in levels {
            let cooling = adds_after(valgrind, build, (rows, false), direct_pairs);
            let held = adds_after(valgrind, build, (rows, true), direct_pairs);
            for (what, ours, base) in [
                ("in the daemon's loop per ADD", cooling.0, held.0),
                ("per exec, direct-mode ADD", cooling.1, held.1),
            ] {
                let r = ours as f64 / base as f64;
                report.rows.push(
                    Row::plain(
                        format!("instructions {what}, {rows} rows cooling / {rows} held"),
                        build.name(),
                        thousands(ours),
                    )
                    .against(thousands(base), r)
                    .target("≤ 1.05×", r <= 1.05),
                );
            }
        }
        report.notes.push(format!(
            "instructions with rows cooling, {} build: on an empty table an ADD costs {} in the \
             daemon and {} in direct mode.",
            build.name(),
            thousands(empty_daemon),
            thousands(empty_direct)
        ));
    }
    report.notes.push(format!(
        "instructions with rows cooling: a database where a daemon with `--release-cooldown 1h` \
         allocated that many addresses and released them (cooling) or not (held); the daemon's \
         loop's over 20 ADDs under callgrind (after {WARMUP} warm-up pairs), direct mode's the \
         mean of {direct_pairs} ADDs (the cooldown the daemon recorded)."
    ));
}

fn thousands(n: u64) -> String {
    format!("{}k", (n + 500) / 1000)
}

pub fn report(bench: &Bench, report: &mut Report) {
    let Some(valgrind) = valgrind() else {
        report
            .notes
            .push("instructions: valgrind is not installed; nothing counted.".into());
        return;
    };
    let requests = if bench.plan.smoke { 3 } else { 50 };
    let floor_dir = TempDir::new("count-floor");
    let (_, floor) = counted(
        &valgrind,
        &Invocation {
            program: &bench.floor,
            command: "ADD",
            container_id: "count-floor",
            stdin: &metis_conf(&floor_dir, RANGE_V4),
        },
        &floor_dir,
        "floor",
    );
    for build in &bench.builds {
        let c = counts(&valgrind, build, requests);
        let name = build.name();
        for (what, ours) in [("ADD", c.plugin.add), ("DEL", c.plugin.del)] {
            report.rows.push(
                Row::plain(
                    format!("instructions per exec, plugin {what} with the daemon / floor"),
                    name,
                    thousands(ours),
                )
                .against(thousands(floor), ours as f64 / floor as f64),
            );
        }
        for (what, ours) in [("ADD", c.daemon.add), ("DEL", c.daemon.del)] {
            report.rows.push(Row::plain(
                format!("instructions in the daemon's loop per {what} (over {requests})"),
                name,
                thousands(ours),
            ));
        }
        for (what, ours) in [("ADD", c.direct.add), ("DEL", c.direct.del)] {
            report.rows.push(Row::plain(
                format!("instructions per exec, direct-mode {what} (mean of {DIRECT_PAIRS})"),
                name,
                thousands(ours),
            ));
        }
        report.notes.push(format!(
            "instructions, {name} build: ADD+DEL with the daemon {} in the plugins + {} in the \
             daemon's loop = {} ({:.2}× two floor execs), its checkpoint thread {} beside; \
             ADD+DEL in direct mode {}.",
            thousands(c.plugin.add + c.plugin.del),
            thousands(c.daemon.add + c.daemon.del),
            thousands(c.plugin.add + c.plugin.del + c.daemon.add + c.daemon.del),
            (c.plugin.add + c.plugin.del + c.daemon.add + c.daemon.del) as f64 / (2 * floor) as f64,
            thousands(c.daemon_others.add + c.daemon_others.del),
            thousands(c.direct.add + c.direct.del),
        ));
    }
    report_cooling(&valgrind, bench, report);
    report.notes.push(
        "instructions: callgrind's count (`valgrind --tool=callgrind`) of one exec after \
         warm-up pairs (direct mode: the mean of 8 pairs), for the floor one exec fed the \
         same configuration; the daemon's under \
         callgrind over a run of ADDs then of DELs (`callgrind_control --dump` around each), \
         divided by their number, on its loop's thread (`--separate-threads=yes`): its \
         checkpoint thread's passes run every 100 ms while frames come, so how many fall in a \
         run follows the machine's speed, and they are given apart. host-local (Go) is not \
         counted: valgrind aborts on it."
            .into(),
    );
}
