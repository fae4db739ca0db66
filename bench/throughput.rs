//! Daemon throughput: allocate+release pairs per second over the socket with
//! several client threads, against the same engine and store driven
//! in-process (no socket, no protobuf framing): the floor of our storage
//! design. Both use a /16 and no release cooldown, so the pool never drains.
//! Every figure is taken with SQLite's `synchronous=NORMAL` (the default)
//! and with `FULL`, for each build; the figures run interleaved, in short
//! slices in rotating order, so a shared machine's drift hits all alike.

use std::time::{Duration, Instant};

use metis::engine::Engine;
use metis::store::{Checkpointer, Durability, Store, StoreOptions};
use metis::wire::client::Client;

use crate::Bench;
use crate::report::{Report, Row};
use crate::util::typed;
use crate::util::{
    Build, Daemon, Flavour, RANGE_V4, TempDir, allocate_request, allocated, client,
    release_request, released,
};

/// The daemon's pairs/s target with 8 clients at the default durability
/// (issue 13).
const TARGET_PER_SECOND: f64 = 20_000.0;

/// How many slices each figure's time is cut into.
const SLICES: u32 = 6;

fn durability_name(durability: Durability) -> &'static str {
    match durability {
        Durability::Normal => "NORMAL",
        Durability::Full => "FULL",
    }
}

fn durability_flag(durability: Durability) -> &'static str {
    match durability {
        Durability::Normal => "--db-synchronous=normal",
        Durability::Full => "--db-synchronous=full",
    }
}

/// Where a figure's pairs go. Fields drop in order: the engine or daemon
/// before its directory.
enum Route {
    InProcess {
        engine: Box<Engine>,
        /// Stopped before the directory goes.
        _checkpointer: Checkpointer,
        _dir: TempDir,
    },
    Daemon {
        clients: Vec<Client>,
        _daemon: Daemon,
        _dir: TempDir,
    },
}

/// One figure: its route, and the pairs done and time spent over its slices.
struct Figure {
    durability: Durability,
    /// `None` for the engine in-process.
    build: Option<(usize, usize)>,
    route: Route,
    pairs: u64,
    elapsed: Duration,
}

/// One allocate+release through the engine in-process.
fn engine_pair(engine: &mut Engine, id: &str) {
    allocated(
        &engine
            .handle(
                &typed(allocate_request(id, &[RANGE_V4])),
                metis::log::now_ms(),
            )
            .into_response(),
    );
    released(
        &engine
            .handle(&typed(release_request(id)), metis::log::now_ms())
            .into_response(),
    );
}

/// One allocate+release over a daemon connection.
fn client_pair(client: &mut Client, id: &str) {
    allocated(&client.call(&allocate_request(id, &[RANGE_V4])).unwrap());
    released(&client.call(&release_request(id)).unwrap());
}

impl Figure {
    fn in_process(durability: Durability) -> Figure {
        let dir = TempDir::new("inproc");
        let options = StoreOptions {
            durability,
            ..StoreOptions::default()
        };
        let store = Store::open(&dir.join("metis.sqlite"), &options).unwrap();
        // WAL checkpoints on their own thread, as in the daemon.
        store.defer_checkpoints().unwrap();
        let checkpointer = Checkpointer::start(&dir.join("metis.sqlite")).unwrap();
        let mut engine = Engine::new(store);
        // Populate the block before timing.
        engine_pair(&mut engine, "bench-warm");
        Figure {
            durability,
            build: None,
            route: Route::InProcess {
                engine: Box::new(engine),
                _checkpointer: checkpointer,
                _dir: dir,
            },
            pairs: 0,
            elapsed: Duration::ZERO,
        }
    }

    /// `threads` clients of a daemon of `builds[index]`.
    fn daemon(builds: &[Build], index: usize, durability: Durability, threads: usize) -> Figure {
        let build = &builds[index];
        let dir = TempDir::new(&format!("throughput-{}", build.name()));
        let daemon = build.daemon(
            &dir,
            &["--release-cooldown", "0", durability_flag(durability)],
        );
        let mut clients: Vec<Client> = (0..threads).map(|_| client(&daemon)).collect();
        client_pair(&mut clients[0], "bench-warm");
        Figure {
            durability,
            build: Some((index, threads)),
            route: Route::Daemon {
                clients,
                _daemon: daemon,
                _dir: dir,
            },
            pairs: 0,
            elapsed: Duration::ZERO,
        }
    }

    /// Pairs for `duration`; `slice` keeps container ids distinct.
    fn run(&mut self, slice: u32, duration: Duration) {
        let start = Instant::now();
        let end = start + duration;
        let pairs = match &mut self.route {
            Route::InProcess { engine, .. } => {
                let mut n = 0u64;
                while Instant::now() < end {
                    engine_pair(engine, &format!("bench-tp-{slice}-{n}"));
                    n += 1;
                }
                n
            }
            Route::Daemon { clients, .. } => std::thread::scope(|scope| {
                let workers: Vec<_> = clients
                    .iter_mut()
                    .enumerate()
                    .map(|(t, client)| {
                        scope.spawn(move || {
                            let mut n = 0u64;
                            while Instant::now() < end {
                                client_pair(client, &format!("bench-tp-{slice}-{t}-{n}"));
                                n += 1;
                            }
                            n
                        })
                    })
                    .collect();
                workers.into_iter().map(|w| w.join().unwrap()).sum()
            }),
        };
        self.pairs += pairs;
        self.elapsed += start.elapsed();
    }

    fn per_second(&self) -> f64 {
        self.pairs as f64 / self.elapsed.as_secs_f64()
    }
}

/// The figures: per durability, the engine in-process, 8 clients of each
/// build, and 1 and 2 clients of the full build at the default durability
/// for the shape of the curve.
fn figures(builds: &[Build]) -> Vec<Figure> {
    let mut figures = Vec::new();
    for durability in [Durability::Normal, Durability::Full] {
        figures.push(Figure::in_process(durability));
        for (index, build) in builds.iter().enumerate() {
            let curve: &[usize] = match (build.flavour, durability) {
                (Flavour::Full, Durability::Normal) => &[1, 2, 8],
                _ => &[8],
            };
            for &threads in curve {
                figures.push(Figure::daemon(builds, index, durability, threads));
            }
        }
    }
    figures
}

/// Pairs/s rows, each daemon figure against the in-process one of its
/// durability.
pub fn report(bench: &Bench, report: &mut Report) {
    let slice = bench.plan.throughput_for / SLICES;
    let mut figures = figures(&bench.builds);
    for round in 0..SLICES {
        let count = figures.len();
        for k in 0..count {
            figures[(round as usize + k) % count].run(round, slice);
        }
    }
    for figure in &figures {
        assert!(figure.pairs > 0, "a throughput figure completed no pair");
        let sync = durability_name(figure.durability);
        let rate = figure.per_second();
        let Some((index, threads)) = figure.build else {
            report.rows.push(Row::plain(
                format!("engine pairs/s in-process, synchronous={sync}"),
                "",
                format!("{rate:.0}/s"),
            ));
            continue;
        };
        let inproc = figures
            .iter()
            .find(|f| f.build.is_none() && f.durability == figure.durability)
            .map_or(f64::NAN, Figure::per_second);
        let row = Row::plain(
            format!("daemon pairs/s, {threads} client(s) / in-process, synchronous={sync}"),
            bench.builds[index].name(),
            format!("{rate:.0}/s"),
        )
        .against(format!("{inproc:.0}/s"), rate / inproc);
        // The target is the default durability's; FULL is reported.
        report
            .rows
            .push(if threads == 8 && figure.durability == Durability::Normal {
                row.target("≥ 20,000/s", rate >= TARGET_PER_SECOND)
            } else {
                row
            });
    }
    report.notes.push(format!(
        "throughput: allocate+release pairs for {:.1} s per figure in {SLICES} slices, every \
         figure's slice in turn (order rotating), release cooldown 0; in-process is the \
         bench's own build of the engine, whose code is the same in both builds (the `kube` \
         feature does not reach src/engine/, src/decode.rs or src/store/).",
        bench.plan.throughput_for.as_secs_f64()
    ));
}
