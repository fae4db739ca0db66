//! Scale: allocation latency as the store grows, in-process (the engine the
//! daemon runs, without the socket, so nothing dilutes the store's cost).
//!
//! IPv4 stores are built with the real `add_cidr_block`, every address then
//! given a row (blocks grow lazily; this is their worst case, full) and half
//! of every block marked allocated with one bulk `UPDATE` (the rows look as
//! if pods held them); the measured network allocates and releases pods
//! (cooldown 0) against that. IPv6 goes through the real allocation path for
//! every one of its 100,000 allocations, lazy expansion included.

use std::time::{Duration, Instant};

use metis::cidr::{Cidr, Family};
use metis::engine::Engine;
use metis::store::{Source, Store, StoreOptions};

use crate::Bench;
use crate::report::{Report, Row};
use crate::util::typed;
use crate::util::{
    Summary, TempDir, allocate_request, allocated, ms, ratio, release_request, released, us,
};

/// One store size and what allocating in it costs.
pub struct Point {
    pub label: String,
    pub rows: u64,
    pub setup: Duration,
    pub latency: Summary,
}

/// A block of a network and the share of it to mark allocated.
struct Block {
    network: &'static str,
    cidr: &'static str,
    fill: f64,
}

const FILLER_NETWORKS: [&str; 7] = [
    "fill-1", "fill-2", "fill-3", "fill-4", "fill-5", "fill-6", "fill-7",
];

/// The measured network's blocks, in order.
fn bench_ranges(blocks: &[Block]) -> Vec<&'static str> {
    blocks
        .iter()
        .filter(|b| b.network == "bench")
        .map(|b| b.cidr)
        .collect()
}

fn build_v4(dir: &TempDir, blocks: &[Block]) -> (Engine, u64) {
    let path = dir.join("metis.sqlite");
    let mut store = Store::open(&path, &StoreOptions::default()).unwrap();
    let mut networks: Vec<&str> = blocks.iter().map(|b| b.network).collect();
    networks.dedup();
    for network in networks {
        let ranges: Vec<Cidr> = blocks
            .iter()
            .filter(|b| b.network == network)
            .map(|b| b.cidr.parse().unwrap())
            .collect();
        // The other networks repeat the measured one's prefixes, so each is
        // an isolated address space (one address, one owner otherwise).
        store
            .configure(
                &metis::store::Wish {
                    source: Source::Cni,
                    network,
                    family: Family::V4,
                    ranges: &ranges,
                    isolated: network != "bench",
                },
                metis::log::now_ms(),
            )
            .unwrap();
    }
    drop(store);
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch("BEGIN IMMEDIATE").unwrap();
    for block in blocks {
        let id: i64 = conn
            .query_row(
                "SELECT id FROM cidr_blocks WHERE network = ?1 AND cidr = ?2",
                [block.network, block.cidr],
                |r| r.get(0),
            )
            .unwrap();
        let cidr = block.cidr.parse::<Cidr>().unwrap();
        populate(&conn, id, &cidr);
        let take = (cidr.size() as f64 * block.fill) as i64;
        conn.execute(
            "UPDATE ip_addresses SET is_allocated = 1, container_id = 'fill-' || id, \
             interface_name = 'eth0', pod_name = 'fill', pod_namespace = 'bench', \
             allocated_at = ?3 WHERE id IN (SELECT id FROM ip_addresses \
             WHERE cidr_block_id = ?1 AND is_allocated = 0 ORDER BY id LIMIT ?2)",
            rusqlite::params![id, take, metis::log::now_ms()],
        )
        .unwrap();
    }
    conn.execute_batch(
        "UPDATE cidr_blocks SET allocated_ips = (SELECT COUNT(*) FROM ip_addresses a \
         WHERE a.cidr_block_id = cidr_blocks.id AND a.is_allocated = 1); COMMIT",
    )
    .unwrap();
    let rows: i64 = conn
        .query_row("SELECT COUNT(*) FROM ip_addresses", [], |r| r.get(0))
        .unwrap();
    drop(conn);
    let store = Store::open(&path, &StoreOptions::default()).unwrap();
    (Engine::new(store), rows as u64)
}

/// Gives every address of IPv4 block `id` a row and moves its frontier to
/// the end: the table holds every address, as when blocks were enumerated
/// whole (the worst case for the allocation queries).
fn populate(conn: &rusqlite::Connection, id: i64, cidr: &Cidr) {
    let base = metis::cidr::to_u128(cidr.base()) as i64;
    let size = cidr.size() as i64;
    conn.execute(
        "WITH RECURSIVE n(i) AS (SELECT ?3 UNION ALL SELECT i + 1 FROM n WHERE i < ?3 + ?2 - 1) \
         INSERT OR IGNORE INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) \
         SELECT (i >> 24) || '.' || ((i >> 16) & 255) || '.' || ((i >> 8) & 255) || '.' || (i & 255), \
         ?1, '', '', 0 FROM n",
        rusqlite::params![id, size, base],
    )
    .unwrap();
    conn.execute(
        "UPDATE metis_blocks SET frontier = ?2 WHERE block_id = ?1",
        rusqlite::params![id, size.to_string()],
    )
    .unwrap();
}

/// `samples` allocate latencies, each followed by the release of the pod.
fn pairs(engine: &mut Engine, ranges: &[&str], samples: usize, tag: &str) -> Summary {
    let mut latencies = Vec::with_capacity(samples);
    for i in 0..samples {
        let id = format!("bench-scale-{tag}-{i}");
        let start = Instant::now();
        let response = engine
            .handle(&typed(allocate_request(&id, ranges)), metis::log::now_ms())
            .into_response();
        latencies.push(start.elapsed());
        allocated(&response);
        released(
            &engine
                .handle(&typed(release_request(&id)), metis::log::now_ms())
                .into_response(),
        );
    }
    Summary::of(&latencies)
}

fn v4_point(label: &str, blocks: &[Block], samples: usize) -> Point {
    let dir = TempDir::new("scale");
    let start = Instant::now();
    let (mut engine, rows) = build_v4(&dir, blocks);
    let setup = start.elapsed();
    let ranges = bench_ranges(blocks);
    pairs(&mut engine, &ranges, samples / 10, "warm");
    Point {
        label: label.to_string(),
        rows,
        setup,
        latency: pairs(&mut engine, &ranges, samples, "measured"),
    }
}

/// The IPv4 points: 256, 65,536 and (unless `smoke`) 1,048,576 rows.
pub fn v4(samples: usize, smoke: bool) -> Vec<Point> {
    let mut points = vec![
        v4_point(
            "IPv4, 256 addresses (one /24, half allocated)",
            &[Block {
                network: "bench",
                cidr: "198.18.0.0/24",
                fill: 0.5,
            }],
            samples,
        ),
        v4_point(
            "IPv4, 65,536 addresses (one /16, half allocated)",
            &[Block {
                network: "bench",
                cidr: "198.18.0.0/16",
                fill: 0.5,
            }],
            samples,
        ),
    ];
    if !smoke {
        // Sixteen /16 blocks: the measured network's first block full and
        // its second half allocated; seven other networks, each an isolated
        // address space, hold the same two prefixes, half allocated.
        let mut blocks = vec![
            Block {
                network: "bench",
                cidr: "198.18.0.0/16",
                fill: 1.0,
            },
            Block {
                network: "bench",
                cidr: "198.19.0.0/16",
                fill: 0.5,
            },
        ];
        for network in FILLER_NETWORKS {
            for cidr in ["198.18.0.0/16", "198.19.0.0/16"] {
                blocks.push(Block {
                    network,
                    cidr,
                    fill: 0.5,
                });
            }
        }
        points.push(v4_point(
            "IPv4, 1,048,576 addresses (sixteen /16 blocks)",
            &blocks,
            samples,
        ));
    }
    points
}

/// IPv6 in a /64 after `allocations` real allocations: the latency of
/// allocate+release pairs, and of allocations that keep growing the block
/// (one in 64 populates the next batch).
pub fn v6(allocations: usize, samples: usize) -> (Point, Point) {
    let dir = TempDir::new("scale-v6");
    let store = Store::open(&dir.join("metis.sqlite"), &StoreOptions::default()).unwrap();
    let mut engine = Engine::new(store);
    let ranges = [crate::util::RANGE_V6];
    let start = Instant::now();
    for i in 0..allocations {
        let id = format!("bench-v6-fill-{i}");
        allocated(
            &engine
                .handle(&typed(allocate_request(&id, &ranges)), metis::log::now_ms())
                .into_response(),
        );
    }
    let setup = start.elapsed();
    let steady = pairs(&mut engine, &ranges, samples, "v6");
    let mut growth = Vec::with_capacity(samples);
    for i in 0..samples {
        let id = format!("bench-v6-grow-{i}");
        let start = Instant::now();
        let response = engine
            .handle(&typed(allocate_request(&id, &ranges)), metis::log::now_ms())
            .into_response();
        growth.push(start.elapsed());
        allocated(&response);
    }
    let rows = (allocations + samples) as u64;
    (
        Point {
            label: format!("IPv6 /64 after {allocations} allocations, allocate+release"),
            rows,
            setup,
            latency: steady,
        },
        Point {
            label: format!("IPv6 /64 after {allocations} allocations, growing"),
            rows,
            setup,
            latency: Summary::of(&growth),
        },
    )
}

/// Allocate latency as the tables grow, against the smallest point.
pub fn report(bench: &Bench, report: &mut Report) {
    let plan = &bench.plan;
    let mut points = v4(plan.scale_samples, plan.smoke);
    let (v6_steady, v6_growth) = v6(plan.v6_allocations, plan.scale_samples);
    points.push(v6_steady);
    points.push(v6_growth);
    let base = points[0].latency;
    for point in &points[1..] {
        let r = ratio(point.latency.median, base.median);
        report.rows.push(
            Row::plain(
                format!("allocate median in-process, {}", point.label),
                "",
                us(point.latency.median),
            )
            .against(us(base.median), r)
            .target("≤ 1.3×", r <= 1.3),
        );
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
