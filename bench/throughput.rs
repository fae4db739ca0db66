//! Daemon throughput: allocate+release pairs per second over the socket with
//! several client threads, against the same engine and store driven
//! in-process (no socket, no protobuf framing): the floor of our storage
//! design. Both use a /16 and no release cooldown, so the pool never drains.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use metis::engine::Engine;
use metis::store::{Durability, Store, StoreOptions};

use crate::util::{
    Daemon, RANGE_V4, TempDir, allocate_request, allocated, client, release_request, released,
};

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

/// Pairs/s over the daemon's socket with `threads` clients, each on its own
/// connection, running until `duration` has passed, with the daemon's
/// `--db-synchronous` set to `durability`.
pub fn daemon(threads: usize, duration: Duration, durability: Durability) -> Rate {
    let dir = TempDir::new("throughput");
    let sync = match durability {
        Durability::Normal => "normal",
        Durability::Full => "full",
    };
    let daemon = Daemon::start(&dir, &["--release-cooldown", "0", "--db-synchronous", sync]);
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
pub fn in_process(duration: Duration, durability: Durability) -> Rate {
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
