//! Measurements through real processes: ADD+DEL cycles of Metis (with its
//! daemon), Debian's host-local and the floor program, interleaved; and a
//! burst of concurrent ADDs against one daemon.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::util::{
    Daemon, HOST_LOCAL, Invocation, METIS, RANGE_V4, Summary, TempDir, host_local_conf, metis_conf,
    result_address, with_prev_result,
};

/// ADD+DEL latency of the three programs, measured side by side.
pub struct Cycles {
    pub metis: Summary,
    pub host_local: Summary,
    pub floor: Summary,
    /// Metis ADD alone and DEL alone (medians are what the runtime waits).
    pub metis_add: Summary,
    pub metis_del: Summary,
}

/// One program under test: how to run it and what it is fed.
struct Subject<'a> {
    program: &'a Path,
    conf: String,
    /// Whether its ADD prints a result with an address (the floor does not).
    allocates: bool,
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
                self.addresses.insert(result_address(&result)),
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
}

/// `cycles` measured rounds (after `warmup` unrecorded ones), each running
/// Metis, host-local and the floor once, the order rotating every round.
pub fn cycles(floor: &Path, warmup: usize, cycles: usize) -> Cycles {
    let dir = TempDir::new("cycles");
    let _daemon = Daemon::start(&dir, &[]);
    let metis = Path::new(METIS);
    let mut subjects = [
        Subject::new(metis, metis_conf(&dir, RANGE_V4), true),
        Subject::new(Path::new(HOST_LOCAL), host_local_conf(&dir, RANGE_V4), true),
        Subject::new(floor, metis_conf(&dir, RANGE_V4), false),
    ];
    for round in 0..warmup + cycles {
        let container_id = format!("bench-cycle-{round:06}");
        for k in 0..subjects.len() {
            let index = (round + k) % subjects.len();
            subjects[index].cycle(&container_id, round >= warmup);
        }
    }
    let [metis, host_local, floor] = subjects;
    assert_eq!(metis.addresses.len(), warmup + cycles);
    assert_eq!(host_local.addresses.len(), warmup + cycles);
    Cycles {
        metis: Summary::of(&metis.total),
        host_local: Summary::of(&host_local.total),
        floor: Summary::of(&floor.total),
        metis_add: Summary::of(&metis.add),
        metis_del: Summary::of(&metis.del),
    }
}

/// `n` plugin ADDs started at once against one daemon.
pub struct Burst {
    pub count: usize,
    pub wall: Duration,
    pub latency: Summary,
    pub distinct: usize,
    /// ADDs that found no daemon and fell back to direct mode.
    pub direct_mode: usize,
}

pub fn burst(n: usize) -> Burst {
    let dir = TempDir::new("burst");
    let _daemon = Daemon::start(&dir, &[]);
    let conf = Arc::new(metis_conf(&dir, RANGE_V4));
    // Create the block first: the burst measures allocations, not the
    // one-time population of a /16.
    Invocation {
        program: Path::new(METIS),
        command: "ADD",
        container_id: "bench-burst-first",
        stdin: &conf,
    }
    .run();
    let barrier = Arc::new(Barrier::new(n + 1));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let barrier = Arc::clone(&barrier);
            let conf = Arc::clone(&conf);
            std::thread::spawn(move || {
                let container_id = format!("bench-burst-{i:04}");
                barrier.wait();
                let (result, took) = Invocation {
                    program: Path::new(METIS),
                    command: "ADD",
                    container_id: &container_id,
                    stdin: &conf,
                }
                .run();
                (result_address(&result), took, Instant::now())
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    let mut latencies = Vec::with_capacity(n);
    let mut addresses = HashSet::new();
    let mut last = start;
    for thread in threads {
        let (address, took, done) = thread.join().unwrap();
        addresses.insert(address);
        latencies.push(took);
        last = last.max(done);
    }
    let log = std::fs::read_to_string(dir.join("cni.log")).unwrap_or_default();
    let direct_mode = log.matches("using direct mode").count();
    Burst {
        count: latencies.len(),
        wall: last - start,
        latency: Summary::of(&latencies),
        distinct: addresses.len(),
        direct_mode,
    }
}
