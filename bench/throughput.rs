//! Daemon throughput: allocate+release pairs per second over the socket with
//! several client threads, against the same engine and store driven
//! in-process (no socket, no protobuf framing): the floor of our storage
//! design. Both use a /16 and no release cooldown, so the pool never drains.
//! Every figure is taken with SQLite's `synchronous=NORMAL` (the default)
//! and with `FULL`.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use metis::engine::Engine;
use metis::store::{Durability, Store, StoreOptions};

use crate::Bench;
use crate::report::{Report, Row};
use crate::util::{
    Build, Flavour, RANGE_V4, TempDir, allocate_request, allocated, client, release_request,
    released,
};

/// The daemon's pairs/s target with 8 clients (issue 13).
const TARGET_PER_SECOND: f64 = 20_000.0;

/// The durability a figure is taken with: its name and the daemon's flag.
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

/// Pairs completed and the time they took.
#[derive(Debug, Clone, Copy)]
pub struct Rate {
    pub pairs: u64,
    pub elapsed: Duration,
}

impl Rate {
    pub fn per_second(&self) -> f64 {
        self.pairs as f64 / self.elapsed.as_secs_f64()
    }
}

/// Pairs/s over the socket of `build`'s daemon with `threads` clients, each
/// on its own connection, running until `duration` has passed.
pub fn daemon(build: &Build, durability: Durability, threads: usize, duration: Duration) -> Rate {
    let dir = TempDir::new(&format!("throughput-{}", build.name()));
    let daemon = build.daemon(
        &dir,
        &["--release-cooldown", "0", durability_flag(durability)],
    );
    // Populate the block before timing.
    let mut warm = client(&daemon);
    allocated(
        &warm
            .call(&allocate_request("bench-warm", &[RANGE_V4]))
            .unwrap(),
    );
    released(&warm.call(&release_request("bench-warm")).unwrap());
    let barrier = Arc::new(Barrier::new(threads + 1));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let barrier = Arc::clone(&barrier);
            let mut client = client(&daemon);
            std::thread::spawn(move || {
                barrier.wait();
                let end = Instant::now() + duration;
                let mut pairs = 0u64;
                while Instant::now() < end {
                    let id = format!("bench-tp-{t}-{pairs}");
                    allocated(&client.call(&allocate_request(&id, &[RANGE_V4])).unwrap());
                    released(&client.call(&release_request(&id)).unwrap());
                    pairs += 1;
                }
                pairs
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    let pairs = workers.into_iter().map(|w| w.join().unwrap()).sum();
    Rate {
        pairs,
        elapsed: start.elapsed(),
    }
}

/// Pairs/s of the same requests handed straight to the engine.
pub fn in_process(durability: Durability, duration: Duration) -> Rate {
    let dir = TempDir::new("inproc");
    let options = StoreOptions {
        durability,
        ..StoreOptions::default()
    };
    let store = Store::open(&dir.join("metis.sqlite"), &options).unwrap();
    let mut engine = Engine::new(store);
    let mut pair = |id: &str| {
        allocated(
            &engine
                .handle(&allocate_request(id, &[RANGE_V4]), metis::log::now_ms())
                .into_response(),
        );
        released(
            &engine
                .handle(&release_request(id), metis::log::now_ms())
                .into_response(),
        );
    };
    pair("bench-warm");
    let start = Instant::now();
    let end = start + duration;
    let mut pairs = 0u64;
    while Instant::now() < end {
        pair(&format!("bench-tp-{pairs}"));
        pairs += 1;
    }
    Rate {
        pairs,
        elapsed: start.elapsed(),
    }
}

/// Pairs/s rows: 8 clients per build and durability against the engine
/// in-process with the same durability; 1 and 2 clients of the full build
/// at the default durability for the shape of the curve.
pub fn report(bench: &Bench, report: &mut Report) {
    let duration = bench.plan.throughput_for;
    for durability in [Durability::Normal, Durability::Full] {
        let sync = durability_name(durability);
        let inproc = in_process(durability, duration);
        report.rows.push(Row::plain(
            format!("engine pairs/s in-process, synchronous={sync}"),
            "",
            format!("{:.0}/s", inproc.per_second()),
        ));
        for build in &bench.builds {
            let curve: &[usize] = match (build.flavour, durability) {
                (Flavour::Full, Durability::Normal) => &[1, 2, 8],
                _ => &[8],
            };
            for &threads in curve {
                let rate = daemon(build, durability, threads, duration).per_second();
                let row = Row::plain(
                    format!("daemon pairs/s, {threads} client(s) / in-process, synchronous={sync}"),
                    build.name(),
                    format!("{rate:.0}/s"),
                )
                .against(
                    format!("{:.0}/s", inproc.per_second()),
                    rate / inproc.per_second(),
                );
                // The target is the default durability's; FULL is reported.
                report
                    .rows
                    .push(if threads == 8 && durability == Durability::Normal {
                        row.target("≥ 20,000/s", rate >= TARGET_PER_SECOND)
                    } else {
                        row
                    });
            }
        }
    }
    report.notes.push(format!(
        "throughput: allocate+release pairs for {:.1} s per figure, release cooldown 0; \
         in-process is the bench's own build of the engine, whose code is the same in both \
         builds (the `kube` feature does not reach src/engine.rs or src/store/).",
        duration.as_secs_f64()
    ));
}
