//! Read-only verification of the invariants an IPAM database must keep:
//! SQLite's own integrity, the schema version, block counters equal to
//! their allocated rows, no address held twice, one allocation per owner,
//! network and family, rows inside their block, and reservations in line
//! with the reservation mode. Used by `metis admin check` on any database
//! file and by the daemon before it serves — there in O(blocks) when the
//! file is as the daemon left it at its last clean stop (see
//! [`Store::verify_at_start`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use rusqlite::{Connection, OpenFlags};

use super::block::{Reserved, block_reserved, counter_mismatches, quarantined};
use super::free::pod_held;
use super::{
    ReserveMode, SCHEMA_VERSION, Store, StoreError, get_setting, parse_addr, parse_cidr,
    parse_family, parse_state, schema, total_ips,
};
use crate::cidr::Cidr;

/// How much of SQLite's own verification to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// `PRAGMA quick_check`: structure only, linear in the file size.
    Quick,
    /// `PRAGMA integrity_check`: also every index against its table.
    Full,
}

/// What a check found: each violated invariant in words, and what was
/// looked at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub problems: Vec<String>,
    pub blocks: u64,
    /// Addresses pods hold (counted by a row-level check only).
    pub allocations: u64,
    /// Blocks a problem was found in (id → the problem): what the daemon
    /// quarantines instead of refusing to start.
    pub suspects: BTreeMap<i64, String>,
    /// SQLite's own check failed or upstream's tables are missing: nothing
    /// read from the file can be trusted, so nothing can be isolated.
    pub damaged: bool,
    /// The check read the address rows (counters recounted, owners and
    /// reservations checked), not only the blocks.
    pub row_level: bool,
    /// Address rows the check read one by one.
    pub rows_read: u64,
}

impl Report {
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// The report as `metis admin check` prints it (and the daemon logs it).
    pub fn describe(&self, path: &str) -> String {
        let summary = format!(
            "{path}: {} blocks, {} allocated addresses",
            self.blocks, self.allocations
        );
        if self.is_ok() {
            return format!("{summary}: ok, every invariant holds\n");
        }
        let mut text = format!("{summary}: {} problems\n", self.problems.len());
        for problem in &self.problems {
            text.push_str("  - ");
            text.push_str(problem);
            text.push('\n');
        }
        text
    }
}

/// Said of every problem the daemon isolates instead of refusing to start.
const QUARANTINED: &str = "; the daemon quarantines the block(s) at start";

/// Most problems of one kind listed before the rest are only counted.
const MAX_LISTED: usize = 20;

impl Store {
    /// Checks this store's database (see the module documentation).
    pub fn verify(&self, depth: Depth) -> Result<Report, StoreError> {
        check_connection(&self.conn, depth)
    }

    /// The daemon's check before it serves. When the file is exactly as
    /// this daemon's last clean stop left it ([`Store::mark_clean_stop`]),
    /// only what can be checked per block runs: SQLite's check of every
    /// table but `ip_addresses`, and the block checks (parse, family,
    /// total, counter within 0..=total). Otherwise — first start, a crash,
    /// or any write since by another process (the plugin in direct mode,
    /// upstream, a hand edit of `cidr_blocks`) — the whole
    /// [`Depth::Quick`] check, which reads every row. The marker is
    /// consumed either way: a crash from here on means a full check next.
    pub fn verify_at_start(&mut self) -> Result<Report, StoreError> {
        let recorded = get_setting(&self.conn, schema::KEY_CLEAN_STOP)?;
        let as_left = recorded.is_some() && recorded == Some(fingerprint(&self.conn)?);
        self.put_setting(schema::KEY_CLEAN_STOP, None)?;
        if as_left {
            check_blocks_only(&self.conn)
        } else {
            check_connection(&self.conn, Depth::Quick)
        }
    }

    /// Records, as the daemon stops cleanly, what the file looks like, so
    /// the next start can tell it was left alone.
    pub fn mark_clean_stop(&mut self) -> Result<(), StoreError> {
        // Written in two steps: writing the marker changes nothing the
        // fingerprint covers (settings are not part of it).
        let print = fingerprint(&self.conn)?;
        self.put_setting(schema::KEY_CLEAN_STOP, Some(&print))
    }
}

/// What any write to the file by anyone changes, read in O(blocks): the
/// schema cookie (any schema change), the AUTOINCREMENT counters (any row
/// or block inserted) and every block row — whose `updated_at` upstream's
/// trigger bumps on each update, and whose counter every allocation and
/// release moves. A hand edit of `ip_addresses` alone that inserts nothing
/// is not seen; `metis admin check` reads every row.
fn fingerprint(conn: &Connection) -> Result<String, StoreError> {
    let mut hash = Fnv::default();
    let cookie: i64 = conn.pragma_query_value(None, "schema_version", |r| r.get(0))?;
    hash.add(&cookie.to_string());
    let mut stmt = conn.prepare_cached("SELECT name, seq FROM sqlite_sequence ORDER BY name")?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        hash.add(&row.get::<_, String>(0)?);
        hash.add(&row.get::<_, i64>(1)?.to_string());
    }
    let mut stmt = conn.prepare_cached(
        "SELECT id, cidr, network, ip_family, total_ips, COALESCE(allocated_ips, -1), state, \
         COALESCE(updated_at, -1) FROM cidr_blocks ORDER BY id",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        for column in 0..8 {
            let value: rusqlite::types::Value = row.get(column)?;
            hash.add(&format!("{value:?}"));
        }
    }
    Ok(format!("v1:{:016x}", hash.0))
}

/// FNV-1a (64 bits): stable across builds, unlike the standard hasher.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn add(&mut self, text: &str) {
        // A separator keeps ("ab", "c") apart from ("a", "bc").
        for byte in text.bytes().chain([0xff]) {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// The start check of a file as the daemon left it: no address row read.
fn check_blocks_only(conn: &Connection) -> Result<Report, StoreError> {
    let mut report = Report::default();
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'ip_addresses'")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for table in &tables {
        let pragma = format!("quick_check(\"{}\")", table.replace('"', "\"\""));
        if !sqlite_verdict(conn, &pragma, &format!("quick_check({table})"), &mut report)? {
            return Ok(report);
        }
    }
    let mode = get_setting(conn, schema::KEY_RESERVE_MODE)?
        .and_then(|text| ReserveMode::parse(&text))
        .unwrap_or_default();
    check_blocks(conn, mode, &mut report)?;
    // What a row-level check found stays quarantined: nothing has changed
    // since (else the fingerprint would differ and the rows be read).
    for q in quarantined(conn)? {
        report.suspects.entry(q.block_id).or_insert(q.why);
    }
    list_quarantined(conn, &mut report)?;
    Ok(report)
}

/// Runs SQLite's own check `PRAGMA {pragma}`; false when it finds damage,
/// which is then in `report` (named `label`), marked damaged: nothing read
/// from a damaged file can be trusted.
fn sqlite_verdict(
    conn: &Connection,
    pragma: &str,
    label: &str,
    report: &mut Report,
) -> Result<bool, StoreError> {
    let verdicts = conn
        .prepare(&format!("PRAGMA {pragma}"))?
        .query_map([], |r| r.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    if verdicts == ["ok"] {
        return Ok(true);
    }
    report.problems.extend(
        verdicts
            .into_iter()
            .take(MAX_LISTED)
            .map(|line| format!("sqlite {label}: {line}")),
    );
    report.damaged = true;
    Ok(false)
}

/// Opens the database at `path` read-only — nothing is created, repaired or
/// migrated — and checks it.
pub fn check_file(path: &Path, depth: Depth) -> Result<Report, StoreError> {
    if !path.is_file() {
        return Err(StoreError::Open {
            path: path.to_path_buf(),
            source: format!("{} is not a file", path.display()).into(),
        });
    }
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| StoreError::Open {
        path: path.to_path_buf(),
        source: Box::new(e),
    })?;
    conn.busy_timeout(std::time::Duration::from_millis(5000))?;
    super::schema::shadow_missing_tables(&conn)?;
    check_connection(&conn, depth)
}

fn check_connection(conn: &Connection, depth: Depth) -> Result<Report, StoreError> {
    let mut report = Report {
        row_level: true,
        ..Report::default()
    };
    let pragma = match depth {
        Depth::Quick => "quick_check",
        Depth::Full => "integrity_check",
    };
    if !sqlite_verdict(conn, pragma, pragma, &mut report)? {
        return Ok(report);
    }
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    if version != SCHEMA_VERSION {
        report.problems.push(format!(
            "schema: user_version is {version}, expected {SCHEMA_VERSION}"
        ));
    }
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    let missing: Vec<&str> = ["cidr_blocks", "ip_addresses"]
        .into_iter()
        .filter(|name| !tables.iter().any(|t| t == name))
        .collect();
    if !missing.is_empty() {
        report
            .problems
            .push(format!("schema: missing tables {}", missing.join(", ")));
        report.damaged = true;
        return Ok(report);
    }
    let has = |name: &str| tables.iter().any(|t| t == name);
    let mode = match has("metis_settings") {
        true => get_setting(conn, schema::KEY_RESERVE_MODE)?
            .and_then(|text| ReserveMode::parse(&text))
            .unwrap_or_default(),
        false => ReserveMode::default(),
    };
    let blocks = check_blocks(conn, mode, &mut report)?;
    check_counters(conn, &mut report)?;
    check_owners(conn, isolation_space(&has), &mut report)?;
    check_rows(conn, mode, &blocks, &mut report)?;
    check_metis_tables(conn, &has, &mut report)?;
    check_upstream_leftovers(conn, mode, &has, &mut report)?;
    Ok(report)
}

/// What upstream's store left that Metis heals at open or refuses to
/// serve (see `rollback` and `gateway`). Not suspects: nothing here is
/// quarantined.
fn check_upstream_leftovers(
    conn: &Connection,
    mode: ReserveMode,
    has: &dyn Fn(&str) -> bool,
    report: &mut Report,
) -> Result<(), StoreError> {
    if has("metis_blocks") && has("metis_bounds") {
        // Rows outside their prefix are `check_rows`'s to name.
        let found = super::rollback::Leftovers {
            outside_prefix: Vec::new(),
            ..super::rollback::find(conn)?
        };
        push_limited(report, found.describe(false), |line| line);
    }
    // A read-only open of a file only upstream wrote reads empty stand-ins
    // for Metis's tables (`schema::shadow_missing_tables`).
    if conn.prepare("SELECT 1 FROM metis_bounds LIMIT 0").is_ok() {
        let held = super::gateway::all_held(conn, mode)?;
        push_limited(report, held, |g| g.describe());
    }
    Ok(())
}

/// Metis's own tables: the state of an earlier release not yet moved into
/// typed columns (see `migrate`), and the quarantined blocks.
fn check_metis_tables(
    conn: &Connection,
    has: &dyn Fn(&str) -> bool,
    report: &mut Report,
) -> Result<(), StoreError> {
    if has("metis_settings") && has("metis_blocks") {
        for left in super::migrate::leftovers(conn)? {
            report.problems.push(format!(
                "metis tables: {left} (state of an earlier release, not yet moved into typed \
                 columns); the next open by the daemon or the plugin moves it"
            ));
        }
    }
    if has("metis_blocks") {
        list_quarantined(conn, report)?;
    }
    Ok(())
}

/// SQL naming the address space of block `b`'s network: its name when the
/// network is isolated, else '' (shared by every other network). A
/// database of an earlier release keeps isolation in `metis_settings`.
fn isolation_space(has: &dyn Fn(&str) -> bool) -> &'static str {
    if has("metis_networks") {
        "CASE WHEN EXISTS (SELECT 1 FROM metis_networks n WHERE n.network = b.network \
         AND n.isolated = 1) THEN b.network ELSE '' END"
    } else if has("metis_settings") {
        "CASE WHEN EXISTS (SELECT 1 FROM metis_settings s WHERE s.key = 'isolated/' || b.network \
         AND s.value = '1') THEN b.network ELSE '' END"
    } else {
        "''"
    }
}

/// A block as the row checks need it.
struct Block {
    cidr: Cidr,
    network: String,
    /// Reserved offsets under the mode in force; `None` for Deleting
    /// blocks, which the repair leaves alone.
    reserved: Option<Reserved>,
}

fn check_blocks(
    conn: &Connection,
    mode: ReserveMode,
    report: &mut Report,
) -> Result<HashMap<i64, Block>, StoreError> {
    let mut stmt = conn.prepare(
        "SELECT id, cidr, network, ip_family, total_ips, COALESCE(allocated_ips, 0), state \
         FROM cidr_blocks ORDER BY id",
    )?;
    let mut rows = stmt.query([])?;
    let mut blocks = HashMap::new();
    while let Some(row) = rows.next()? {
        report.blocks += 1;
        let id: i64 = row.get(0)?;
        let cidr_text: String = row.get(1)?;
        let network: String = row.get(2)?;
        let family_text: String = row.get(3)?;
        let total: i64 = row.get(4)?;
        let allocated: i64 = row.get(5)?;
        let state_text: String = row.get(6)?;
        let mut fail = |what: String| {
            report
                .problems
                .push(format!("block {id}: {what}{QUARANTINED}"));
            report.suspects.entry(id).or_insert(what);
        };
        let parsed = (
            parse_cidr(&cidr_text),
            parse_family(&family_text),
            parse_state(&state_text),
        );
        let (cidr, family, state) = match parsed {
            (Ok(cidr), Ok(family), Ok(state)) => (cidr, family, state),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                fail(e.to_string());
                continue;
            }
        };
        if cidr.family() != family {
            fail(format!("{cidr} is recorded as {family}"));
        }
        if total != total_ips(&cidr) {
            fail(format!(
                "total_ips is {total}, {cidr} has {}",
                total_ips(&cidr)
            ));
        }
        if allocated < 0 || allocated > total {
            fail(format!("allocated_ips {allocated} is outside 0..={total}"));
        }
        let reserved = match state {
            super::BlockState::Deleting => None,
            _ => Some(block_reserved(conn, mode, id, &network, &cidr)?),
        };
        blocks.insert(
            id,
            Block {
                cidr,
                network,
                reserved,
            },
        );
    }
    Ok(blocks)
}

fn check_counters(conn: &Connection, report: &mut Report) -> Result<(), StoreError> {
    for (id, counter, actual) in counter_mismatches(conn)? {
        report.problems.push(format!(
            "block {id}: allocated_ips is {counter} but {actual} rows are allocated"
        ));
    }
    Ok(())
}

/// No address held twice on the node (networks that are isolated are each
/// an address space of their own); no owner holding two addresses of one
/// family in a network.
fn check_owners(conn: &Connection, space: &str, report: &mut Report) -> Result<(), StoreError> {
    let listed = |sql: &str| -> Result<Vec<(String, String, i64)>, StoreError> {
        let mut stmt = conn.prepare(sql)?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    };
    const POD_ROW: &str = pod_held!("a.");
    let mut stmt = conn.prepare(&format!(
        "SELECT {space} AS space, a.address, COUNT(*), group_concat(DISTINCT b.network), \
                group_concat(b.id) FROM ip_addresses a \
         JOIN cidr_blocks b ON b.id = a.cidr_block_id WHERE {POD_ROW} \
         GROUP BY space, a.address HAVING COUNT(*) > 1 ORDER BY space, a.address"
    ))?;
    let shared = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    for (address, _, networks, ids) in &shared {
        for id in ids.split(',').filter_map(|id| id.parse::<i64>().ok()) {
            report.suspects.entry(id).or_insert_with(|| {
                format!("address {address} is held twice (networks {networks})")
            });
        }
    }
    push_limited(report, shared, |(address, n, networks, _)| {
        let networks: Vec<String> = networks.split(',').map(|n| format!("{n:?}")).collect();
        format!(
            "network {}: address {address} is allocated {n} times{QUARANTINED}",
            networks.join(", ")
        )
    });
    let doubled = listed(&format!(
        "SELECT b.network, a.container_id || ' ' || COALESCE(a.interface_name, '') || ' ' || b.ip_family, \
                COUNT(*) FROM ip_addresses a \
         JOIN cidr_blocks b ON b.id = a.cidr_block_id WHERE {POD_ROW} \
         GROUP BY b.network, b.ip_family, a.container_id, a.interface_name HAVING COUNT(*) > 1 \
         ORDER BY 1, 2"
    ))?;
    push_limited(report, doubled, |(network, owner, n)| {
        format!(
            "network {network:?}: owner (container, interface, family) {owner} holds {n} addresses"
        )
    });
    let total: i64 = conn.query_row(
        &format!("SELECT COUNT(*) FROM ip_addresses a WHERE {POD_ROW}"),
        [],
        |r| r.get(0),
    )?;
    report.allocations = u64::try_from(total).unwrap_or_default();
    Ok(())
}

/// Every row inside its block; reserved rows exactly at reserved offsets.
fn check_rows(
    conn: &Connection,
    mode: ReserveMode,
    blocks: &HashMap<i64, Block>,
    report: &mut Report,
) -> Result<(), StoreError> {
    let mut stmt = conn.prepare(
        "SELECT id, address, cidr_block_id, COALESCE(is_allocated, 0), COALESCE(container_id, '') \
         FROM ip_addresses ORDER BY id",
    )?;
    let mut rows = stmt.query([])?;
    let mut found = Vec::new();
    while let Some(row) = rows.next()? {
        let id: i64 = row.get(0)?;
        let address: String = row.get(1)?;
        let block_id: i64 = row.get(2)?;
        let allocated: bool = row.get(3)?;
        let container: String = row.get(4)?;
        report.rows_read += 1;
        let Some(block) = blocks.get(&block_id) else {
            found.push(format!(
                "address row {id} ({address}): block {block_id} is missing or unreadable"
            ));
            continue;
        };
        let offset = match parse_addr(&address) {
            Ok(addr) => block.cidr.offset_of(addr),
            Err(e) => {
                found.push(format!("address row {id}: {e}"));
                continue;
            }
        };
        let Some(offset) = offset else {
            found.push(format!(
                "address row {id}: {address} is outside its block {} (network {:?}){QUARANTINED}",
                block.cidr, block.network
            ));
            report
                .suspects
                .entry(block_id)
                .or_insert_with(|| format!("row {address} lies outside the prefix"));
            continue;
        };
        let Some(reserved) = &block.reserved else {
            continue;
        };
        let at_reserved = reserved.contains(&offset);
        match (at_reserved, allocated, container.is_empty()) {
            (true, false, _) => found.push(format!(
                "address row {id}: {address} of block {} is free but reserved ({} mode)",
                block.cidr,
                mode.as_str()
            )),
            (false, true, true) => found.push(format!(
                "address row {id}: {address} of block {} is held by no one but is not a reserved address ({} mode)",
                block.cidr,
                mode.as_str()
            )),
            // A pod at a reserved position is left alone and logged at open.
            _ => {}
        }
    }
    push_limited(report, found, |line| line);
    Ok(())
}

/// Quarantined blocks are problems an operator must look at.
fn list_quarantined(conn: &Connection, report: &mut Report) -> Result<(), StoreError> {
    let found: Vec<String> = quarantined(conn)?
        .into_iter()
        .map(|q| {
            format!(
                "block {} ({}, network {:?}) is quarantined: {}; nothing new is \
                 allocated from it until the problem is gone and the daemon restarts",
                q.block_id, q.cidr, q.network, q.why
            )
        })
        .collect();
    push_limited(report, found, |line| line);
    Ok(())
}

fn push_limited<T>(report: &mut Report, found: Vec<T>, describe: impl Fn(T) -> String) {
    let extra = found.len().saturating_sub(MAX_LISTED);
    report
        .problems
        .extend(found.into_iter().take(MAX_LISTED).map(describe));
    if extra > 0 {
        report
            .problems
            .push(format!("… and {extra} more of the kind above"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::Family;
    use crate::testutil::{TempDir, owner};

    /// A store with a v4 and a v6 block and three pods.
    fn populated(dir: &TempDir) -> Store {
        let mut store = dir.store();
        for cidr in ["198.18.0.0/28", "2001:db8::/120"] {
            store
                .add_cidr_block("pods", &cidr.parse().unwrap())
                .unwrap();
        }
        for pod in ["a", "b", "c"] {
            store.allocate(&owner(pod), Family::V4, 1).unwrap();
            store.allocate(&owner(pod), Family::V6, 1).unwrap();
        }
        store
    }

    fn problems_after(sql: &str) -> Vec<String> {
        let dir = TempDir::new();
        let store = populated(&dir);
        assert_eq!(
            store.verify(Depth::Full).unwrap().problems,
            Vec::<String>::new()
        );
        store.conn.execute_batch(sql).unwrap();
        let report = check_file(&dir.db(), Depth::Full).unwrap();
        assert_eq!(report, store.verify(Depth::Full).unwrap());
        report.problems
    }

    #[test]
    fn a_healthy_database_passes_and_is_counted() {
        let dir = TempDir::new();
        let store = populated(&dir);
        let report = store.verify(Depth::Full).unwrap();
        assert!(report.is_ok(), "{report:?}");
        assert_eq!((report.blocks, report.allocations), (2, 6));
    }

    #[test]
    fn each_broken_invariant_is_named() {
        let cases = [
            (
                "UPDATE cidr_blocks SET allocated_ips = allocated_ips + 1 WHERE ip_family = 'ipv4'",
                "allocated_ips is 7 but 6 rows are allocated",
            ),
            (
                "INSERT INTO cidr_blocks (cidr, network, ip_family, total_ips, allocated_ips) \
                 VALUES ('198.18.0.0/27', 'pods', 'ipv4', 32, 1); \
                 INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) \
                 VALUES ('198.18.0.2', last_insert_rowid(), 'z', 'eth0', 1)",
                "address 198.18.0.2 is allocated 2 times",
            ),
            (
                "UPDATE ip_addresses SET container_id = 'a' WHERE container_id = 'b' AND address LIKE '198.%'",
                "owner (container, interface, family) a eth0 ipv4 holds 2 addresses",
            ),
            (
                "UPDATE ip_addresses SET address = '198.18.1.9' WHERE container_id = 'c' AND address LIKE '198.%'",
                "198.18.1.9 is outside its block 198.18.0.0/28",
            ),
            (
                "UPDATE ip_addresses SET is_allocated = 0 WHERE address = '198.18.0.15'; \
                 UPDATE cidr_blocks SET allocated_ips = allocated_ips - 1 WHERE ip_family = 'ipv4'",
                "198.18.0.15 of block 198.18.0.0/28 is free but reserved",
            ),
            (
                "UPDATE ip_addresses SET is_allocated = 1 WHERE address = '198.18.0.9'; \
                 UPDATE cidr_blocks SET allocated_ips = allocated_ips + 1 WHERE ip_family = 'ipv4'",
                "198.18.0.9 of block 198.18.0.0/28 is held by no one",
            ),
            ("PRAGMA user_version = 7", "user_version is 7, expected 1"),
            (
                "UPDATE cidr_blocks SET total_ips = 3 WHERE ip_family = 'ipv4'",
                "total_ips is 3, 198.18.0.0/28 has 16",
            ),
            (
                "UPDATE cidr_blocks SET state = 'Gone' WHERE ip_family = 'ipv6'",
                "unknown block state \"Gone\"",
            ),
        ];
        for (sql, expected) in cases {
            let problems = problems_after(sql);
            assert!(
                problems.iter().any(|p| p.contains(expected)),
                "{sql}: {problems:?} lacks {expected:?}"
            );
        }
    }

    #[test]
    fn a_start_after_a_clean_stop_reads_no_address_row() {
        let dir = TempDir::new();
        let mut store = populated(&dir);
        let rows: i64 = store
            .conn
            .query_row("SELECT COUNT(*) FROM ip_addresses", [], |r| r.get(0))
            .unwrap();
        // No marker (first start, or after a crash): every row is read.
        let first = store.verify_at_start().unwrap();
        assert!(first.row_level && first.is_ok(), "{first:?}");
        assert_eq!(i64::try_from(first.rows_read).unwrap(), rows);
        // As the daemon left it: blocks only.
        store.mark_clean_stop().unwrap();
        let quick = store.verify_at_start().unwrap();
        assert!(!quick.row_level && quick.is_ok(), "{quick:?}");
        assert_eq!((quick.rows_read, quick.blocks), (0, 2));
        // The marker is consumed: a crash now means a full check next.
        assert!(store.verify_at_start().unwrap().row_level);
    }

    #[test]
    fn any_write_behind_the_daemons_back_brings_the_row_check_back() {
        let writes = [
            // upstream allocating: the counter moves, the trigger stamps
            "UPDATE ip_addresses SET is_allocated = 1, container_id = 'x', interface_name = 'eth0' \
             WHERE address = '198.18.0.9'; \
             UPDATE cidr_blocks SET allocated_ips = allocated_ips + 1 WHERE ip_family = 'ipv4'",
            // a row inserted by hand
            "INSERT INTO ip_addresses (address, cidr_block_id, is_allocated) VALUES ('198.18.0.77', 1, 1)",
            // a block edited by hand
            "UPDATE cidr_blocks SET state = 'Draining' WHERE id = 1",
            // the schema touched
            "CREATE INDEX extra ON ip_addresses(pod_name)",
        ];
        for sql in writes {
            let dir = TempDir::new();
            let mut store = populated(&dir);
            store.mark_clean_stop().unwrap();
            Connection::open(dir.db())
                .unwrap()
                .execute_batch(sql)
                .unwrap();
            let report = store.verify_at_start().unwrap();
            assert!(report.row_level, "{sql}: {report:?}");
        }
    }

    #[test]
    fn a_quarantine_survives_a_start_that_reads_no_row() {
        let dir = TempDir::new();
        let mut store = populated(&dir);
        store
            .conn
            .execute_batch(
                "UPDATE ip_addresses SET address = '198.18.1.9' \
                 WHERE container_id = 'c' AND address LIKE '198.%'",
            )
            .unwrap();
        let full = store.verify_at_start().unwrap();
        store.isolate_problems(&full, 1).unwrap();
        assert_eq!(store.quarantined().unwrap().len(), 1);
        store.mark_clean_stop().unwrap();
        let quick = store.verify_at_start().unwrap();
        assert!(!quick.row_level);
        store.isolate_problems(&quick, 1).unwrap();
        assert_eq!(store.quarantined().unwrap().len(), 1);
    }

    #[test]
    fn damaged_files_fail_sqlite_integrity_check() {
        let dir = TempDir::new();
        drop(populated(&dir));
        {
            // Fold the WAL in so the file alone holds the data.
            let conn = Connection::open(dir.db()).unwrap();
            conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
                .unwrap();
        }
        let mut bytes = std::fs::read(dir.db()).unwrap();
        assert!(bytes.len() > 8192);
        // Scribble over the second page (the first table's b-tree).
        for byte in bytes.iter_mut().skip(4096).take(200) {
            *byte = 0x5a;
        }
        let copy = dir.0.join("corrupt.sqlite");
        std::fs::write(&copy, &bytes).unwrap();
        let outcome = check_file(&copy, Depth::Quick);
        match outcome {
            Ok(report) => assert!(
                report
                    .problems
                    .iter()
                    .any(|p| p.starts_with("sqlite quick_check")),
                "{report:?}"
            ),
            Err(err) => assert!(err.to_string().contains("malformed"), "{err}"),
        }
        assert!(check_file(&dir.0.join("missing.sqlite"), Depth::Quick).is_err());
    }
}
