//! The allocation path's single-table reads and cheap probes against the
//! joins they replaced, kept here as the reference: on a database another
//! writer keeps rewriting — NULLs, empty owners, text where numbers belong,
//! rows of missing blocks, overlapping blocks of two networks, isolated
//! networks, stray records — every answer is the one the join gave.
//!
//! One deliberate difference: a retired block is one whose record's
//! `retired` is not 0, everywhere (the layout, the hand-out check, and now
//! the sweep, which read `retired = 1` alone).

use rusqlite::{OptionalExtension, Row, params};

use super::*;
use crate::store::alloc::allocate::{candidates_of, held, held_in_any_network, taken_elsewhere};
use crate::store::layout::blocks::{Placed, Source, parse_sources, placed, sweepable, wanted};
use crate::store::layout::gateway::{HELD_GATEWAY_IN_NETWORK_SQL, HELD_GATEWAY_SQL};
use crate::store::rows::block::HeldRow;
use crate::store::rows::free::{Holder, allocated_elsewhere};
use crate::store::rows::named_gateway::{NAMED_AT_ALL_SQL, NAMING_SQL, record, record_taken};
use crate::testutil::Rng;

const OLD_HELD_SQL: &str = "SELECT a.id, a.address, b.id, b.cidr FROM ip_addresses a \
     JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE a.container_id = ?1 AND a.interface_name = ?2 AND a.is_allocated = 1 \
       AND b.network = ?3 AND (?4 IS NULL OR b.ip_family = ?4) \
     ORDER BY b.ip_family, a.id";

const OLD_HELD_ANYWHERE_SQL: &str = "SELECT a.id, a.address, b.id, b.cidr, b.network \
     FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE a.container_id = ?1 AND a.interface_name = ?2 AND a.is_allocated = 1 \
     ORDER BY b.network, b.ip_family, a.id";

const OLD_CANDIDATES_SQL: &str = "SELECT id, cidr FROM cidr_blocks \
     WHERE network = ?1 AND ip_family = ?2 AND state = 'Ready' AND total_ips > allocated_ips \
       AND id NOT IN (SELECT block_id FROM metis_blocks WHERE quarantine IS NOT NULL) \
     ORDER BY id";

const OLD_PLACED_SQL: &str = "SELECT b.id, b.cidr, b.state, m.sources IS NOT NULL, \
       COALESCE(m.sources, ''), COALESCE(m.retired, 0), m.quarantine IS NOT NULL \
     FROM cidr_blocks b LEFT JOIN metis_blocks m ON m.block_id = b.id \
     WHERE b.network = ?1 AND b.ip_family = ?2 AND b.state != 'Deleting' ORDER BY b.id";

/// The old sweep's query, with `retired != 0` (see the module's note).
const OLD_SWEEPABLE_SQL: &str = "SELECT b.id FROM cidr_blocks b \
     JOIN metis_blocks m ON m.block_id = b.id \
     WHERE b.network = ?1 AND b.ip_family = ?2 AND m.retired != 0 \
       AND m.quarantine IS NULL AND b.state = 'Withheld' ORDER BY b.id";

const OLD_WANTED_SQL: &str = "SELECT cidr, source FROM metis_ranges \
     WHERE network = ?1 AND (?2 IS NULL OR source = ?2) ORDER BY source, cidr";

const OLD_HELD_ELSEWHERE_SQL: &str = "SELECT a.container_id, COALESCE(a.interface_name, ''), \
       b.network, b.cidr \
     FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
     WHERE a.address = ?1 AND a.cidr_block_id != ?2 AND a.is_allocated = 1 \
       AND (b.network = ?3 OR (?4 = 0 AND b.network NOT IN \
         (SELECT network FROM metis_networks WHERE isolated = 1))) \
     LIMIT 1";

/// Blocks 1–4 of networks `a` and `b` (3 overlaps 1), and the ids a
/// writer may point a row at (5: no block, `'x'`: not an id).
const BLOCKS: [(i64, &str, &str, &str); 4] = [
    (1, "198.18.60.0/29", "a", "ipv4"),
    (2, "198.18.61.0/29", "a", "ipv4"),
    (3, "198.18.60.0/29", "b", "ipv4"),
    (4, "2001:db8:60::/125", "a", "ipv6"),
];
const BLOCK_IDS: [&str; 6] = ["1", "2", "3", "4", "5", "'x'"];

const ADDRESSES: [&str; 7] = [
    "198.18.60.1",
    "198.18.60.2",
    "198.18.60.3",
    "198.18.61.1",
    "198.18.61.2",
    "2001:db8:60::1",
    "2001:db8:60::2",
];

/// SQL literals a writer may put in a column.
const ALLOCATED: [&str; 5] = ["NULL", "0", "1", "2", "'x'"];
const CONTAINERS: [&str; 5] = ["NULL", "''", "'c1'", "'c2'", "7"];
const INTERFACES: [&str; 4] = ["NULL", "''", "'eth0'", "'eth1'"];
const STAMPS: [&str; 3] = ["NULL", "1", "2"];
const STATES: [&str; 6] = [
    "'Ready'",
    "'Draining'",
    "'Withheld'",
    "'Deleting'",
    "'x'",
    "3",
];
const COUNTS: [&str; 5] = ["NULL", "0", "4", "100", "'x'"];
const PREFIXES: [&str; 4] = ["'198.18.60.0/29'", "'198.18.62.0/29'", "'garbage'", "9"];
const SOURCES: [&str; 6] = ["NULL", "'cni'", "'cni,nnc'", "''", "'x'", "5"];
const RETIRED: [&str; 3] = ["0", "1", "2"];
const QUARANTINE: [&str; 2] = ["NULL", "'overlap'"];
const RANGE_SOURCES: [&str; 4] = ["'cni'", "'flag'", "'nnc'", "'x'"];
const RANGES: [&str; 4] = [
    "'198.18.60.0/29'",
    "'198.18.61.0/28'",
    "'2001:db8:60::/125'",
    "'garbage'",
];

/// A store whose blocks and rows the model writes itself, as another
/// writer would, foreign keys off: every block's 8 rows, about half of
/// them held by c1 or c2 (eth0 or eth1), a gateway record for some.
fn model_store(dir: &TempDir, rng: &mut Rng) -> Store {
    let store = dir.store();
    store
        .conn
        .execute_batch("PRAGMA foreign_keys = OFF")
        .unwrap();
    for (id, prefix, network, family) in BLOCKS {
        store
            .conn
            .execute(
                "INSERT INTO cidr_blocks (id, cidr, network, ip_family, total_ips, allocated_ips) \
                 VALUES (?1, ?2, ?3, ?4, 8, 0)",
                params![id, prefix, network, family],
            )
            .unwrap();
    }
    for (id, prefix, _, _) in BLOCKS {
        let block = cidr(prefix);
        for offset in 0..8u128 {
            let address = block.nth(offset).unwrap();
            store
                .conn
                .execute(
                    "INSERT INTO ip_addresses (address, cidr_block_id) VALUES (?1, ?2)",
                    params![address.to_string(), id],
                )
                .unwrap();
            if rng.below(2) == 0 {
                let row = store.conn.last_insert_rowid();
                let (container, interface) = (rng.pick(&["c1", "c2"]), rng.pick(&["eth0", "eth1"]));
                store
                    .conn
                    .execute(
                        "UPDATE ip_addresses SET is_allocated = 1, container_id = ?2, \
                         interface_name = ?3, allocated_at = 1 WHERE id = ?1",
                        params![row, container, interface],
                    )
                    .unwrap();
                if rng.below(3) == 0 {
                    store
                        .conn
                        .execute(
                            "INSERT INTO metis_gateways VALUES (?1, ?2, ?3, ?4, 1)",
                            params![row, rng.pick(&ADDRESSES), container, interface],
                        )
                        .unwrap();
                }
            }
        }
    }
    store
}

/// One write of another writer, as SQL.
fn hostile_write(rng: &mut Rng, rows: i64) -> String {
    let row = 1 + i64::try_from(rng.below(u64::try_from(rows).unwrap())).unwrap();
    let block = 1 + rng.below(4);
    match rng.below(14) {
        0 | 1 => format!(
            "UPDATE ip_addresses SET is_allocated = {} WHERE id = {row}",
            rng.pick(&ALLOCATED)
        ),
        2 | 3 => format!(
            "UPDATE ip_addresses SET container_id = {}, interface_name = {} WHERE id = {row}",
            rng.pick(&CONTAINERS),
            rng.pick(&INTERFACES)
        ),
        4 => format!(
            "UPDATE OR IGNORE ip_addresses SET cidr_block_id = {} WHERE id = {row}",
            rng.pick(&BLOCK_IDS)
        ),
        5 => format!(
            "UPDATE ip_addresses SET allocated_at = {} WHERE id = {row}",
            rng.pick(&STAMPS)
        ),
        6 => format!(
            "UPDATE OR IGNORE ip_addresses SET address = '{}' WHERE id = {row}",
            rng.pick(&ADDRESSES)
        ),
        7 => format!(
            "UPDATE OR IGNORE cidr_blocks SET state = {} WHERE id = {block}",
            rng.pick(&STATES)
        ),
        8 => format!(
            "UPDATE OR IGNORE cidr_blocks SET allocated_ips = {}, total_ips = {} WHERE id = {block}",
            rng.pick(&COUNTS),
            rng.pick(&COUNTS)
        ),
        9 => format!(
            "UPDATE OR IGNORE cidr_blocks SET cidr = {} WHERE id = {block}",
            rng.pick(&PREFIXES)
        ),
        10 => format!(
            "INSERT OR REPLACE INTO metis_blocks (block_id, sources, retired, quarantine) \
             VALUES ({block}, {}, {}, {})",
            rng.pick(&SOURCES),
            rng.pick(&RETIRED),
            rng.pick(&QUARANTINE)
        ),
        11 => format!(
            "INSERT OR REPLACE INTO metis_networks (network, isolated) VALUES ('{}', {})",
            rng.pick(&["a", "b"]),
            rng.pick(&["0", "1", "2"])
        ),
        12 => format!(
            "INSERT OR REPLACE INTO metis_gateways \
             (row_id, gateway, container_id, interface_name, allocated_at) \
             VALUES ({row}, '{}', {}, {}, {})",
            rng.pick(&ADDRESSES),
            rng.pick(&["''", "'c1'", "'c2'"]),
            rng.pick(&["''", "'eth0'"]),
            rng.pick(&STAMPS)
        ),
        _ => match rng.below(3) {
            0 => "DELETE FROM metis_ranges WHERE rowid IN \
                  (SELECT rowid FROM metis_ranges ORDER BY random() LIMIT 1)"
                .to_string(),
            _ => format!(
                "INSERT OR IGNORE INTO metis_ranges (source, network, cidr) VALUES ({}, 'a', {})",
                rng.pick(&RANGE_SOURCES),
                rng.pick(&RANGES)
            ),
        },
    }
}

/// `Ok` answers compared whole; any error counts as the same answer.
fn same<T: PartialEq + std::fmt::Debug>(
    what: &str,
    new: Result<T, StoreError>,
    old: Result<T, StoreError>,
    context: &str,
) {
    match (new, old) {
        (Ok(new), Ok(old)) => assert_eq!(new, old, "{what} after {context}"),
        (Err(_), Err(_)) => {}
        (new, old) => panic!("{what} after {context}: new {new:?}, old {old:?}"),
    }
}

type HeldTuple = (i64, i64, IpAddr, String);

fn tuples(rows: Vec<HeldRow>) -> Vec<HeldTuple> {
    rows.into_iter()
        .map(|r| {
            let block = r.allocation.block.to_string();
            (r.row_id, r.block_id, r.allocation.address, block)
        })
        .collect()
}

fn old_held_row(row: &Row) -> Result<HeldTuple, StoreError> {
    Ok((
        row.get(0)?,
        row.get(2)?,
        parse_addr(&row.get::<_, String>(1)?)?,
        parse_cidr(&row.get::<_, String>(3)?)?.to_string(),
    ))
}

fn old_held(
    conn: &Connection,
    network: &str,
    container: &str,
    interface: &str,
    family: Option<Family>,
) -> Result<Vec<HeldTuple>, StoreError> {
    let mut stmt = conn.prepare(OLD_HELD_SQL)?;
    let mut rows = stmt.query(params![
        container,
        interface,
        network,
        family.map(Family::as_str)
    ])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push(old_held_row(row)?);
    }
    Ok(out)
}

fn old_held_anywhere(
    conn: &Connection,
    container: &str,
    interface: &str,
) -> Result<Vec<(String, HeldTuple)>, StoreError> {
    let mut stmt = conn.prepare(OLD_HELD_ANYWHERE_SQL)?;
    let mut rows = stmt.query(params![container, interface])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push((row.get(4)?, old_held_row(row)?));
    }
    Ok(out)
}

fn old_candidates(
    conn: &Connection,
    network: &str,
    family: Family,
) -> Result<Vec<(i64, Cidr)>, StoreError> {
    let mut stmt = conn.prepare(OLD_CANDIDATES_SQL)?;
    let mut rows = stmt.query(params![network, family.as_str()])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push((row.get(0)?, parse_cidr(&row.get::<_, String>(1)?)?));
    }
    Ok(out)
}

fn old_placed(conn: &Connection, network: &str, family: Family) -> Result<Vec<Placed>, StoreError> {
    let mut stmt = conn.prepare(OLD_PLACED_SQL)?;
    let mut rows = stmt.query(params![network, family.as_str()])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let recorded: bool = row.get(3)?;
        let sources: String = row.get(4)?;
        out.push(Placed {
            id: row.get(0)?,
            cidr: parse_cidr(&row.get::<_, String>(1)?)?,
            state: parse_state(&row.get::<_, String>(2)?)?,
            sources: recorded.then(|| parse_sources(&sources)),
            retired: row.get(5)?,
            quarantined: row.get(6)?,
        });
    }
    Ok(out)
}

fn old_sweepable_ids(conn: &Connection, network: &str, family: Family) -> Vec<i64> {
    conn.prepare(OLD_SWEEPABLE_SQL)
        .unwrap()
        .query_map(params![network, family.as_str()], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .filter(|id| !crate::store::layout::blocks::in_use(conn, *id, NOW).unwrap())
        .collect()
}

fn old_wanted(
    conn: &Connection,
    source: Option<Source>,
    network: &str,
    family: Family,
) -> Result<Vec<(Cidr, Source)>, StoreError> {
    let mut stmt = conn.prepare(OLD_WANTED_SQL)?;
    let mut rows = stmt.query(params![network, source.map(Source::as_str)])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let cidr = parse_cidr(&row.get::<_, String>(0)?)?;
        let source = Source::parse(&row.get::<_, String>(1)?);
        if let (true, Some(source)) = (cidr.family() == family, source) {
            out.push((cidr, source));
        }
    }
    Ok(out)
}

fn old_taken_elsewhere(
    conn: &Connection,
    network: &str,
    isolated: bool,
    block_id: i64,
    address: IpAddr,
) -> Result<Option<crate::store::rows::handout::Unfit>, StoreError> {
    let held = conn
        .query_row(
            OLD_HELD_ELSEWHERE_SQL,
            params![address.to_string(), block_id, network, isolated],
            |r| {
                Ok(crate::store::rows::handout::Unfit::HeldElsewhere {
                    container_id: r.get(0)?,
                    interface_name: r.get(1)?,
                    network: r.get(2)?,
                    block: r.get(3)?,
                })
            },
        )
        .optional()?;
    match held {
        Some(unfit) => Ok(Some(unfit)),
        None => crate::store::rows::named_gateway::naming(conn, network, isolated, address),
    }
}

/// Whether `sql` with `params` finds a row.
fn finds(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> bool {
    conn.prepare(sql)
        .unwrap()
        .query(params)
        .unwrap()
        .next()
        .is_ok_and(|row| row.is_some())
}

fn gateway_records(conn: &Connection) -> Vec<(i64, String, String, String, Option<i64>)> {
    conn.prepare(
        "SELECT row_id, gateway, container_id, interface_name, allocated_at \
         FROM metis_gateways ORDER BY 1, 2",
    )
    .unwrap()
    .query_map([], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// A fresh take of row `row` by (`container`, `interface`) at `at`, as
/// `take_row` writes it, then the gateway recorded the old way and the new
/// way: the same records.
fn check_record_taken(conn: &Connection, row: i64, at: i64, rng: &mut Rng, context: &str) {
    let container = *rng.pick(&["c1", "c2"]);
    let interface = *rng.pick(&["eth0", "eth1"]);
    let gateway: IpAddr = rng.pick(&ADDRESSES).parse().unwrap();
    let take = format!(
        "UPDATE ip_addresses SET is_allocated = 1, container_id = '{container}', \
         interface_name = '{interface}', allocated_at = {at} WHERE id = {row}"
    );
    let mut after = Vec::new();
    for new in [false, true] {
        conn.execute_batch("SAVEPOINT probe").unwrap();
        conn.execute_batch(&take).unwrap();
        match new {
            true => {
                let owner = Owner {
                    network: "",
                    container_id: container,
                    interface_name: interface,
                    pod_name: "",
                    pod_namespace: "",
                };
                record_taken(conn, row, gateway, &owner, at).unwrap()
            }
            false => record(conn, row, gateway).unwrap(),
        }
        after.push(gateway_records(conn));
        conn.execute_batch("ROLLBACK TO probe; RELEASE probe")
            .unwrap();
    }
    assert_eq!(
        after[1], after[0],
        "records after a take of row {row} after {context}"
    );
}

/// Every answer the new reads give, against the old joins'.
fn check(conn: &Connection, rng: &mut Rng, step: i64, context: &str) {
    for network in ["a", "b"] {
        for container in ["c1", "c2", ""] {
            for interface in ["eth0", "eth1", ""] {
                for family in [None, Some(Family::V4), Some(Family::V6)] {
                    same(
                        "held",
                        held(conn, network, container, interface, family).map(tuples),
                        old_held(conn, network, container, interface, family),
                        context,
                    );
                }
            }
        }
        for family in [Family::V4, Family::V6] {
            same(
                "candidates",
                candidates_of(conn, network, family, &mut Default::default()),
                old_candidates(conn, network, family),
                context,
            );
            same(
                "placed",
                placed(conn, network, family),
                old_placed(conn, network, family),
                context,
            );
            if let Ok(blocks) = placed(conn, network, family) {
                let ids: Vec<i64> = sweepable(conn, &blocks, NOW)
                    .unwrap()
                    .into_iter()
                    .map(|(id, _)| id)
                    .collect();
                assert_eq!(
                    ids,
                    old_sweepable_ids(conn, network, family),
                    "sweep after {context}"
                );
            }
            for source in [None, Some(Source::Cni), Some(Source::Flag)] {
                same(
                    "wanted",
                    wanted(conn, source, network, family),
                    old_wanted(conn, source, network, family),
                    context,
                );
            }
        }
        for isolated in [false, true] {
            for address in ADDRESSES {
                let ip: IpAddr = address.parse().unwrap();
                for block in 1..=5 {
                    same(
                        "taken elsewhere",
                        taken_elsewhere(conn, network, isolated, block, ip),
                        old_taken_elsewhere(conn, network, isolated, block, ip),
                        context,
                    );
                    let probe = allocated_elsewhere(conn, address, Some(block), Holder::Any);
                    if finds(
                        conn,
                        OLD_HELD_ELSEWHERE_SQL,
                        params![address, block, network, isolated],
                    ) {
                        assert!(
                            probe.unwrap(),
                            "{address} held beside block {block} after {context}"
                        );
                    }
                }
                let pod = allocated_elsewhere(conn, address, None, Holder::Pod);
                if finds(conn, HELD_GATEWAY_SQL, params![address, network, isolated])
                    || finds(conn, HELD_GATEWAY_IN_NETWORK_SQL, params![address, network])
                {
                    assert!(pod.unwrap(), "{address} held by a pod after {context}");
                }
                if finds(conn, NAMING_SQL, params![address, network, isolated]) {
                    assert!(
                        finds(conn, NAMED_AT_ALL_SQL, [address]),
                        "{address} after {context}"
                    );
                }
            }
        }
    }
    for container in ["c1", "c2", ""] {
        for interface in ["eth0", "eth1", ""] {
            same(
                "held in any network",
                held_in_any_network(conn, container, interface).map(|rows| {
                    rows.into_iter()
                        .map(|(n, r)| (n, tuples(vec![r])))
                        .collect()
                }),
                old_held_anywhere(conn, container, interface).map(|rows| {
                    rows.into_iter()
                        .map(|(n, r)| (n, vec![r]))
                        .collect::<Vec<_>>()
                }),
                context,
            );
        }
    }
    // A stamp no record carries: the old statements kept a record of the
    // row that matched the new allocation to the millisecond, the new ones
    // keep only the gateway its result names.
    let rows = i64::try_from(BLOCKS.len() * 8).unwrap();
    let row = 1 + i64::try_from(rng.below(u64::try_from(rows).unwrap())).unwrap();
    check_record_taken(conn, row, 1_000 + step, rng, context);
}

#[test]
fn the_probes_and_single_table_reads_answer_as_the_joins_did() {
    let seed: u64 = std::env::var("METIS_PROBES_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2026120123);
    for sequence in 0..6u64 {
        let dir = TempDir::new();
        let mut rng = Rng((seed + sequence) | 1);
        let store = model_store(&dir, &mut rng);
        let rows = i64::try_from(BLOCKS.len() * 8).unwrap();
        let mut writes = Vec::new();
        check(&store.conn, &mut rng, 0, "no write");
        for step in 1..=40 {
            let sql = hostile_write(&mut rng, rows);
            store.conn.execute_batch(&sql).unwrap();
            writes.push(sql);
            let context = format!(
                "seed {} step {step}: {}",
                seed + sequence,
                writes.join("; ")
            );
            check(&store.conn, &mut rng, step, &context);
        }
    }
}
