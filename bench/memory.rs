//! Memory and size: the daemon's peak RSS idle and after many allocations,
//! each plugin's peak RSS for one ADD, and binary sizes.

use std::collections::HashSet;
use std::path::Path;

use crate::util::{
    Daemon, HOST_LOCAL, Invocation, METIS, RANGE_V4, RANGE_V4_SECOND, TempDir, allocate_request,
    allocated, client, daemon_peak_rss_kib, host_local_conf, metis_conf, peak_rss_kib,
};

pub struct Memory {
    pub daemon_idle_kib: u64,
    pub daemon_loaded_kib: u64,
    pub allocations: usize,
    pub metis_add_kib: u64,
    pub host_local_add_kib: u64,
    pub floor_kib: u64,
}

/// Peak RSS figures; the loaded daemon holds `allocations` addresses.
pub fn measure(floor: &Path, allocations: usize) -> Memory {
    let dir = TempDir::new("memory");
    let daemon = Daemon::start(&dir, &[]);
    let daemon_idle_kib = daemon_peak_rss_kib(&daemon);

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
    let daemon_loaded_kib = daemon_peak_rss_kib(&daemon);

    let probe = |program: &Path, conf: &str| {
        peak_rss_kib(&Invocation {
            program,
            command: "ADD",
            container_id: "bench-rss",
            stdin: conf,
        })
    };
    let plugin_dir = TempDir::new("memory-plugin");
    let plugin_daemon = Daemon::start(&plugin_dir, &[]);
    let conf = metis_conf(&plugin_dir, RANGE_V4);
    // The first ADD populates the block; measure a steady-state ADD.
    Invocation {
        program: Path::new(METIS),
        command: "ADD",
        container_id: "bench-rss-first",
        stdin: &conf,
    }
    .run();
    let metis_add_kib = probe(Path::new(METIS), &conf);
    drop(plugin_daemon);
    Memory {
        daemon_idle_kib,
        daemon_loaded_kib,
        allocations,
        metis_add_kib,
        host_local_add_kib: probe(Path::new(HOST_LOCAL), &host_local_conf(&dir, RANGE_V4)),
        floor_kib: probe(floor, &conf),
    }
}

/// A binary's size in bytes and whether it carries a symbol table.
pub fn binary(path: &Path) -> (u64, bool) {
    let bytes = std::fs::read(path).unwrap();
    let has_symtab = bytes.windows(8).any(|w| w == b".symtab\0");
    (bytes.len() as u64, !has_symtab)
}
