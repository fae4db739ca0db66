//! Read-only verification of the invariants an IPAM database must keep:
//! SQLite's own integrity, the schema version, block counters equal to
//! their allocated rows, no address held twice, one allocation per owner,
//! network and family, rows inside their block, and reservations in line
//! with the reservation mode. Used by `metis admin check` on any database
//! file and by the daemon before it serves — there in O(blocks) when the
//! file is as the daemon left it at its last clean stop (see
//! [`Store::verify_at_start`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use rusqlite::{Connection, OpenFlags};

use crate::cidr::Cidr;
use crate::store::db::schema;
use crate::store::db::{
    ReserveMode, SCHEMA_VERSION, Store, StoreError, get_setting, parse_addr, parse_cidr,
    parse_family, parse_state, total_ips,
};
use crate::store::rows::block::{Reserved, block_reserved, quarantined};

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
    /// Conditions that break no invariant but an operator should know of
    /// (a pod holding a block's gateway, a row upstream left that its pod
    /// still holds): printed, never a failure.
    pub notes: Vec<String>,
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
    /// Set when a row-level check read only the rows pods hold and those
    /// written since this time (Unix ms), the rest having been checked
    /// then (see [`Store::verify_at_start`]).
    pub changed_since: Option<i64>,
    /// Blocks whose `allocated_ips` is not their count of allocated rows
    /// (found by a row-level check only): what the start recounts.
    pub miscounted: Vec<i64>,
}

impl Report {
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// What the check read, as the daemon logs it: `blocks` (no address
    /// row), `changed` (the rows written since the last sound check and
    /// those pods hold) or `rows` (every row).
    pub fn scope(&self) -> &'static str {
        match (self.row_level, self.changed_since) {
            (false, _) => "blocks",
            (true, Some(_)) => "changed",
            (true, None) => "rows",
        }
    }

    /// The report as `metis admin check` prints it (and the daemon logs it).
    pub fn describe(&self, path: &str) -> String {
        let summary = format!(
            "{path}: {} blocks, {} allocated addresses",
            self.blocks, self.allocations
        );
        let mut text = match self.is_ok() {
            true => format!("{summary}: ok, every invariant holds\n"),
            false => format!("{summary}: {} problems\n", self.problems.len()),
        };
        for problem in &self.problems {
            text.push_str("  - ");
            text.push_str(problem);
            text.push('\n');
        }
        for note in &self.notes {
            text.push_str("  note: ");
            text.push_str(note);
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
    /// upstream, a hand edit of `cidr_blocks`) — every row-level invariant
    /// too: when an earlier start found every row sound and recorded its
    /// [`Watermark`], over the rows written since and the allocated ones;
    /// else over every row. Either way one pass reads the whole table
    /// b-tree (a damaged page is reported as damage). Either
    /// way SQLite's structural check of `ip_addresses`' three indexes is
    /// left to `metis admin check`, as after a clean stop: it cost 40 % of
    /// such a start, and SQLite reports a damaged page anyway when a
    /// statement reaches it. The clean-stop marker is consumed: a crash
    /// from here on means a row-level check next.
    pub fn verify_at_start(&mut self) -> Result<Report, StoreError> {
        let recorded = get_setting(&self.conn, schema::KEY_CLEAN_STOP)?;
        let as_left = recorded.is_some() && recorded == Some(fingerprint(&self.conn)?);
        self.put_setting(schema::KEY_CLEAN_STOP, None)?;
        if as_left {
            return check_blocks_only(&self.conn);
        }
        let now_ms = crate::log::now_ms();
        let shape = shape(&self.conn)?;
        // Taken before the check: whatever is written from here on is
        // after the mark, so it is read by the next check that uses it.
        let mark = Watermark::now(&self.conn, now_ms)?;
        let rows = match Watermark::recorded(&self.conn, shape, now_ms)? {
            Some(verified) => Rows::ChangedSince(verified),
            None => Rows::All,
        };
        let report = check_with(&self.conn, Sqlite::AllButAddresses, rows)?;
        // Only a check that found nothing vouches for the rows: anything
        // found is looked at again, in full, at the next start.
        let vouched = report.is_ok().then(|| mark.encode(shape));
        self.put_setting(schema::KEY_ROWS_VERIFIED, vouched.as_deref())?;
        Ok(report)
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
    hash.add_rows(
        conn,
        "SELECT id, cidr, network, ip_family, total_ips, COALESCE(allocated_ips, -1), state, \
         COALESCE(updated_at, -1) FROM cidr_blocks ORDER BY id",
    )?;
    Ok(format!("v1:{:016x}", hash.0))
}

/// How far back from the start check's clock the watermark is put: a
/// clock stepped back by up to this much still leaves every later write
/// after the mark.
const CLOCK_MARGIN_MS: i64 = 60_000;

/// Every address row was checked, and found sound, as of this mark:
/// those with `id <= last_row` whose `updated_at` is before `since_ms`.
/// Any later write to a row moves it past the mark — upstream's trigger
/// stamps `updated_at` on every UPDATE, an INSERT gets a higher id
/// (AUTOINCREMENT never reuses one) and a stamp of now — so a start after
/// a crash need only place the rows past the mark; the checks that relate
/// rows to each other (counters, duplicates) take the allocated rows.
/// Valid while the blocks, the reservation rules and the
/// schema (the trigger) are as they were ([`shape`]). Not seen: a hand
/// edit that inserts a row under an old id with an old stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Watermark {
    since_ms: i64,
    last_row: i64,
}

impl Watermark {
    /// The mark a check starting now vouches for, if it finds nothing.
    fn now(conn: &Connection, now_ms: i64) -> Result<Watermark, StoreError> {
        let last_row: Option<i64> =
            conn.query_row("SELECT MAX(id) FROM ip_addresses", [], |r| r.get(0))?;
        Ok(Watermark {
            since_ms: now_ms.saturating_sub(CLOCK_MARGIN_MS),
            last_row: last_row.unwrap_or(0),
        })
    }

    /// Whether the row `id` stamped `updated_at` was written after the
    /// mark (or cannot be told to be older: no integer stamp).
    fn written_since(self, id: i64, updated_at: Option<i64>) -> bool {
        id > self.last_row || updated_at.is_none_or(|stamp| stamp >= self.since_ms)
    }

    fn encode(self, shape: u64) -> String {
        format!("v1:{}:{}:{shape:016x}", self.since_ms, self.last_row)
    }

    /// The recorded mark, when it still holds: recorded for the blocks
    /// and rules of `shape`, and not after `now_ms` (a clock moved back).
    fn recorded(
        conn: &Connection,
        shape: u64,
        now_ms: i64,
    ) -> Result<Option<Watermark>, StoreError> {
        let Some(text) = get_setting(conn, schema::KEY_ROWS_VERIFIED)? else {
            return Ok(None);
        };
        let mut parts = text.split(':');
        let (Some("v1"), Some(since), Some(last), Some(recorded_shape), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Ok(None);
        };
        let (Ok(since_ms), Ok(last_row)) = (since.parse::<i64>(), last.parse::<i64>()) else {
            return Ok(None);
        };
        let valid = recorded_shape == format!("{shape:016x}") && since_ms <= now_ms;
        Ok(valid.then_some(Watermark { since_ms, last_row }))
    }
}

/// What the placement of a row depends on besides the row, read in
/// O(blocks): the schema cookie (any schema change, the trigger's among
/// them), every block's prefix, network, family, size and state, the
/// reservation mode and host-local bounds. Not the counters, which move
/// with every allocation.
fn shape(conn: &Connection) -> Result<u64, StoreError> {
    let mut hash = Fnv::default();
    let cookie: i64 = conn.pragma_query_value(None, "schema_version", |r| r.get(0))?;
    hash.add(&cookie.to_string());
    hash.add_rows(
        conn,
        "SELECT id, cidr, network, ip_family, total_ips, state FROM cidr_blocks ORDER BY id",
    )?;
    hash.add_rows(
        conn,
        "SELECT key, value FROM metis_settings WHERE key IN ('reserve_mode', 'reserve_layout') ORDER BY key",
    )?;
    hash.add_rows(conn, "SELECT * FROM metis_bounds ORDER BY network, cidr")?;
    Ok(hash.0)
}

/// FNV-1a (64 bits): stable across builds, unlike the standard hasher.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    /// Every value of every row `sql` returns, in order.
    fn add_rows(&mut self, conn: &Connection, sql: &str) -> Result<(), StoreError> {
        let mut stmt = conn.prepare_cached(sql)?;
        let columns = stmt.column_count();
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            for column in 0..columns {
                let value: rusqlite::types::Value = row.get(column)?;
                self.add(&format!("{value:?}"));
            }
        }
        Ok(())
    }

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
    if !check_all_but_addresses(conn, &mut report)? {
        return Ok(report);
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

/// SQLite's `quick_check` of every table but `ip_addresses` (and their
/// indexes); false when it finds damage (then in `report`).
fn check_all_but_addresses(conn: &Connection, report: &mut Report) -> Result<bool, StoreError> {
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'ip_addresses'")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for table in &tables {
        let pragma = format!("quick_check(\"{}\")", table.replace('"', "\"\""));
        if !sqlite_verdict(conn, &pragma, &format!("quick_check({table})"), report)? {
            return Ok(false);
        }
    }
    Ok(true)
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

/// Opens the database at `path` read-only — nothing is created or repaired —
/// and checks it.
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
    crate::store::db::schema::shadow_missing_tables(&conn)?;
    let mut report = check_connection(&conn, depth)?;
    if !report.damaged {
        foresee_overlaps(&conn, &mut report)?;
    }
    Ok(report)
}

/// What the daemon's next start does about overlapping blocks that share
/// an address space (upstream's `AddCIDR` checks nothing): a block it would
/// quarantine is a problem (unless another problem already quarantines it,
/// as the start keeps the first reason), one it would delete (no pod uses
/// it) a note.
fn foresee_overlaps(conn: &Connection, report: &mut Report) -> Result<(), StoreError> {
    let foreseen = crate::store::layout::blocks::foreseen_overlaps(conn, crate::log::now_ms())?;
    for (id, cidr, network, why) in foreseen.quarantined {
        if report.suspects.contains_key(&id) {
            continue;
        }
        report.problems.push(format!(
            "block {cidr} of network {network:?}: {why}{QUARANTINED}"
        ));
    }
    for line in foreseen.deleted {
        report
            .notes
            .push(format!("the next start will log: {line}"));
    }
    Ok(())
}

/// How much SQLite checks of its own structures before the invariants.
#[derive(Debug, Clone, Copy)]
enum Sqlite {
    /// Every table and index, at this depth (`metis admin check`).
    Whole(Depth),
    /// Every table but `ip_addresses`, whose table b-tree the row pass
    /// then reads in full (the daemon's start).
    AllButAddresses,
}

fn check_connection(conn: &Connection, depth: Depth) -> Result<Report, StoreError> {
    check_with(conn, Sqlite::Whole(depth), Rows::All)
}

fn check_with(conn: &Connection, sqlite: Sqlite, rows: Rows) -> Result<Report, StoreError> {
    let mut report = Report {
        row_level: true,
        changed_since: match rows {
            Rows::All => None,
            Rows::ChangedSince(mark) => Some(mark.since_ms),
        },
        ..Report::default()
    };
    let sound = match sqlite {
        Sqlite::Whole(Depth::Quick) => {
            sqlite_verdict(conn, "quick_check", "quick_check", &mut report)?
        }
        Sqlite::Whole(Depth::Full) => {
            sqlite_verdict(conn, "integrity_check", "integrity_check", &mut report)?
        }
        Sqlite::AllButAddresses => check_all_but_addresses(conn, &mut report)?,
    };
    if !sound {
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
    let isolated = isolated_networks(conn)?;
    let named = named_gateways(conn)?;
    let expected = Expected {
        mode,
        blocks: &blocks,
        isolated: &isolated,
        named: &named,
    };
    match check_address_rows(conn, &expected, rows, &mut report) {
        Err(StoreError::Sqlite(err)) if is_corrupt(&err) => {
            report
                .problems
                .push(format!("sqlite: reading ip_addresses: {err}"));
            report.damaged = true;
            return Ok(report);
        }
        other => other?,
    }
    check_metis_tables(conn, &has, &mut report)?;
    check_upstream_leftovers(conn, mode, &has, &mut report)?;
    Ok(report)
}

/// What upstream's store left that Metis heals at open (problems) or
/// leaves to its pods and does not serve from (notes; see `rollback` and
/// `gateway`). Not suspects: nothing here is quarantined.
fn check_upstream_leftovers(
    conn: &Connection,
    mode: ReserveMode,
    has: &dyn Fn(&str) -> bool,
    report: &mut Report,
) -> Result<(), StoreError> {
    if has("metis_blocks") && has("metis_bounds") {
        // Rows outside their prefix are `check_rows`'s to name. What the
        // next open heals is a problem; a row a pod still holds is a note.
        let found = crate::store::upkeep::rollback::find(conn)?;
        let (held, free): (Vec<_>, Vec<_>) = found
            .beyond_bounds
            .into_iter()
            .partition(|stray| stray.holder.is_some());
        let heals = crate::store::upkeep::rollback::Leftovers {
            misaligned: found.misaligned,
            beyond_bounds: free,
            outside_prefix: Vec::new(),
        };
        push_limited(report, heals.describe(false), |line| line);
        let kept = crate::store::upkeep::rollback::Leftovers {
            beyond_bounds: held,
            ..crate::store::upkeep::rollback::Leftovers::default()
        };
        report.notes.extend(kept.describe(false));
    }
    // A read-only open of a file only upstream wrote reads empty stand-ins
    // for Metis's tables (`schema::shadow_missing_tables`).
    if conn.prepare("SELECT 1 FROM metis_bounds LIMIT 0").is_ok() {
        let held = crate::store::layout::gateway::all_held(conn, mode)?;
        report.notes.extend(held.iter().map(|g| g.describe()));
        report.notes.extend(rollback_hazards(conn, mode)?);
        report
            .notes
            .extend(crate::store::upkeep::downgrade::expansion_hazards(
                conn, mode,
            )?);
    }
    Ok(())
}

/// What a rollback to upstream would get wrong here unless `admin
/// downgrade` readies the file first: each gateway live results name whose
/// row upstream would hand out (free, or written free by the downgrade's or
/// upstream's own population).
fn rollback_hazards(conn: &Connection, mode: ReserveMode) -> Result<Vec<String>, StoreError> {
    use crate::store::rows::named_gateway::{GatewayRow, gateway_row, live_by_block};
    let mut out = Vec::new();
    for named in live_by_block(conn)? {
        if matches!(
            gateway_row(conn, mode, &named)?,
            GatewayRow::Free(_) | GatewayRow::Missing
        ) {
            out.push(format!(
                "before a rollback: {} of block {}, the gateway {} live result(s) name, is an \
                 ordinary address to upstream's store; `metis admin downgrade` reserves it",
                named.gateway, named.block_id, named.results
            ));
        }
    }
    Ok(out)
}

/// Metis's own tables: the quarantined blocks.
fn check_metis_tables(
    conn: &Connection,
    has: &dyn Fn(&str) -> bool,
    report: &mut Report,
) -> Result<(), StoreError> {
    if has("metis_blocks") {
        list_quarantined(conn, report)?;
    }
    Ok(())
}

/// Every address a result names as its gateway, live or not (a file
/// without Metis's tables reads an empty stand-in).
fn named_gateways(conn: &Connection) -> Result<HashSet<String>, StoreError> {
    let names = conn
        .prepare("SELECT DISTINCT gateway FROM metis_gateways")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    Ok(names)
}

/// The isolated networks.
fn isolated_networks(conn: &Connection) -> Result<HashSet<String>, StoreError> {
    let names = conn
        .prepare("SELECT network FROM metis_networks WHERE isolated = 1")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    Ok(names)
}

/// A block as the row checks need it.
struct Block {
    /// `None` when the row's prefix, family or state does not parse.
    cidr: Option<Cidr>,
    network: String,
    /// `ip_family` as written.
    family: String,
    /// `allocated_ips` (NULL as 0).
    counter: i64,
    /// Reserved offsets under the mode in force; `None` for Deleting
    /// blocks, which the repair leaves alone, and unparseable ones.
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
        let mut block = Block {
            cidr: None,
            network,
            family: family_text,
            counter: allocated,
            reserved: None,
        };
        let (cidr, family, state) = match parsed {
            (Ok(cidr), Ok(family), Ok(state)) => (cidr, family, state),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                fail(e.to_string());
                blocks.insert(id, block);
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
        block.reserved = match state {
            crate::store::db::BlockState::Deleting => None,
            _ => Some(block_reserved(conn, mode, id, &block.network, &cidr)?),
        };
        block.cidr = Some(cidr);
        blocks.insert(id, block);
    }
    Ok(blocks)
}

/// What the passes over the address rows found, kept apart so that the
/// report lists the kinds in a fixed order.
#[derive(Default)]
struct RowScan {
    /// Allocated rows (`is_allocated = 1`) per block id.
    allocated: HashMap<i64, i64>,
    /// Pod-held rows per (address space, address): the blocks holding it.
    holders: BTreeMap<(String, String), Vec<i64>>,
    /// Pod-held rows per (network, "container interface family").
    owners: BTreeMap<(String, String), i64>,
    /// Rows outside their block or at odds with its reservations.
    misplaced: Vec<String>,
    /// Gateways `admin downgrade` reserved (notes).
    fenced: Vec<String>,
    /// Reserved rows no position explains, by (address space, address):
    /// `admin downgrade`'s fence when a pod holds the address through
    /// another block, misplaced otherwise (told once every row is read).
    reserved_strays: Vec<((String, String), i64, String)>,
}

/// The address space a block's addresses are judged in: its network's
/// own when isolated, else the one its non-isolated networks share.
fn space_of(block: &Block, isolated: &HashSet<String>) -> String {
    match isolated.contains(&block.network) {
        true => block.network.clone(),
        false => String::new(),
    }
}

impl RowScan {
    /// A row held by a pod: remembered for the duplicate checks.
    fn hold(
        &mut self,
        address: &str,
        block_id: i64,
        block: &Block,
        owner: (&str, &str),
        isolated: &HashSet<String>,
    ) {
        self.holders
            .entry((space_of(block, isolated), address.to_string()))
            .or_default()
            .push(block_id);
        let (container, interface) = owner;
        let owner = format!("{container} {interface} {}", block.family);
        *self
            .owners
            .entry((block.network.clone(), owner))
            .or_default() += 1;
    }

    /// Checks a row against its block; a row outside it makes the block a
    /// suspect.
    /// A reserved row no position explains whose address a result names
    /// as its gateway is `admin downgrade`'s doing: a note.
    fn place(
        &mut self,
        fields: (i64, &str, bool, &str),
        block_id: i64,
        block: &Block,
        expected: &Expected,
        report: &mut Report,
    ) {
        let Some((line, suspect)) = misplaced(fields, block_id, block, expected.mode) else {
            return;
        };
        let (_, address, allocated, container) = fields;
        match suspect {
            Some(why) => {
                report.suspects.entry(block_id).or_insert(why);
            }
            None if allocated && container.is_empty() && expected.named.contains(address) => {
                self.fenced.push(format!(
                    "{line}: a gateway live results name, reserved by `metis admin downgrade` \
                     so that upstream never hands it out; Metis's next start frees it"
                ));
                return;
            }
            None if allocated && container.is_empty() => {
                let key = (space_of(block, expected.isolated), address.to_string());
                self.reserved_strays.push((key, block_id, line));
                return;
            }
            None => {}
        }
        self.misplaced.push(line);
    }

    /// The findings, into `report`, in a fixed order.
    fn report(mut self, blocks: &HashMap<i64, Block>, report: &mut Report) {
        for (key, block_id, line) in std::mem::take(&mut self.reserved_strays) {
            let mut held = self.holders.get(&key).into_iter().flatten();
            match held.any(|b| *b != block_id) {
                true => self.fenced.push(format!(
                    "{line}: held by a pod through an overlapping block, reserved by `metis \
                     admin downgrade` so that upstream never hands it out; Metis's next start \
                     frees it"
                )),
                false => self.misplaced.push(line),
            }
        }
        report_counters(blocks, &self.allocated, report);
        report_holders(blocks, self.holders, report);
        push_limited(
            report,
            self.owners.into_iter().filter(|(_, n)| *n > 1).collect(),
            |((network, owner), n)| {
                format!(
                    "network {network:?}: owner (container, interface, family) {owner} holds {n} \
                     addresses"
                )
            },
        );
        push_limited(report, self.misplaced, |line| line);
        report.notes.extend(self.fenced);
    }
}

/// What every address row is checked against: the reservation mode, the
/// blocks as the block pass read them, and the isolated networks.
#[derive(Clone, Copy)]
struct Expected<'a> {
    mode: ReserveMode,
    blocks: &'a HashMap<i64, Block>,
    isolated: &'a HashSet<String>,
    /// Every address a result names as its gateway (`metis_gateways`).
    named: &'a HashSet<String>,
}

/// The blocks of a row-level check, looked up by id; rows come mostly
/// grouped by block, so the last one found is kept.
struct Lookup<'b> {
    blocks: &'b HashMap<i64, Block>,
    last: Option<(i64, &'b Block)>,
}

impl<'b> Lookup<'b> {
    fn get(&mut self, block_id: i64) -> Option<&'b Block> {
        match self.last {
            Some((id, block)) if id == block_id => Some(block),
            _ => {
                let block = self.blocks.get(&block_id)?;
                self.last = Some((block_id, block));
                Some(block)
            }
        }
    }
}

/// Which address rows a row-level check reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// Every row.
    All,
    /// The allocated rows and those written or inserted since a verified
    /// watermark (see [`Watermark`]).
    ChangedSince(Watermark),
}

/// The row-level invariants: counters equal to their allocated rows; no
/// address held twice in one address space; no owner holding two
/// addresses of one family in a network; every row inside its block;
/// reserved rows exactly at reserved offsets. One pass over `ip_addresses`
/// in rowid order (its table b-tree, no sort, no index), which hands over
/// only the rows that matter: every row, or with a watermark the
/// allocated ones (the counters and the duplicate checks relate them to
/// each other) and those written since (the rest were placed then). Only
/// pod-held rows are remembered, so memory follows the pods, not the rows.
fn check_address_rows(
    conn: &Connection,
    expected: &Expected,
    rows: Rows,
    report: &mut Report,
) -> Result<(), StoreError> {
    let Expected {
        blocks, isolated, ..
    } = *expected;
    const COLUMNS: &str = "SELECT id, address, cidr_block_id, is_allocated, container_id, \
                           interface_name, updated_at FROM ip_addresses";
    let (mut stmt, mark) = match rows {
        Rows::All => (conn.prepare(COLUMNS)?, None),
        Rows::ChangedSince(mark) => (
            conn.prepare(&format!(
                "{COLUMNS} WHERE is_allocated = 1 OR id > ?1 OR updated_at IS NULL \
                 OR updated_at >= ?2"
            ))?,
            Some(mark),
        ),
    };
    let mut rows = match mark {
        None => stmt.query([])?,
        Some(mark) => stmt.query(rusqlite::params![mark.last_row, mark.since_ms])?,
    };
    let mut scan = RowScan::default();
    let mut lookup = Lookup { blocks, last: None };
    while let Some(row) = rows.next()? {
        report.rows_read += 1;
        let id: i64 = row.get(0)?;
        let address = text(row, 1)?;
        let block_id: i64 = row.get(2)?;
        let flag = row.get::<_, Option<i64>>(3)?.unwrap_or(0);
        let changed = match mark {
            None => true,
            Some(mark) => mark.written_since(id, row.get_ref(6)?.as_i64_or_null().ok().flatten()),
        };
        let Some(block) = lookup.get(block_id) else {
            // Rows of a block gone since the mark: the shape changed, so
            // there is no mark and every row is read.
            scan.misplaced.push(missing_block(id, address, block_id));
            continue;
        };
        // Free rows (most of them) need neither owner column.
        let container = match flag {
            0 => "",
            _ => text(row, 4)?,
        };
        if flag == 1 {
            *scan.allocated.entry(block_id).or_default() += 1;
            if !container.is_empty() {
                scan.hold(
                    address,
                    block_id,
                    block,
                    (container, text(row, 5)?),
                    isolated,
                );
                report.allocations += 1;
            }
        }
        if changed {
            scan.place(
                (id, address, flag != 0, container),
                block_id,
                block,
                expected,
                report,
            );
        }
    }
    scan.report(blocks, report);
    Ok(())
}

fn missing_block(id: i64, address: &str, block_id: i64) -> String {
    format!("address row {id} ({address}): block {block_id} is missing or unreadable")
}

/// Whether SQLite found the file damaged (a page it cannot read).
fn is_corrupt(err: &rusqlite::Error) -> bool {
    err.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseCorrupt)
}

/// Column `index` of `row` as text, borrowed (no copy per row), NULL as
/// empty.
fn text<'row>(row: &'row rusqlite::Row<'_>, index: usize) -> Result<&'row str, StoreError> {
    let value = row.get_ref(index)?;
    let kind = value.data_type();
    let text = value
        .as_str_or_null()
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(index, kind, Box::new(e)))?;
    Ok(text.unwrap_or(""))
}

/// A row at odds with its block: the line reported, and why the block is
/// quarantined when the row makes it a suspect.
type Misplaced = (String, Option<String>);

/// What is wrong with row `id` at `address` of block `block_id` (allocated
/// or not, held by `container` or no one), if anything.
fn misplaced(
    (id, address, allocated, container): (i64, &str, bool, &str),
    block_id: i64,
    block: &Block,
    mode: ReserveMode,
) -> Option<Misplaced> {
    let Some(cidr) = &block.cidr else {
        return Some((missing_block(id, address, block_id), None));
    };
    let offset = match parse_addr(address) {
        Ok(addr) => cidr.offset_of(addr),
        Err(e) => return Some((format!("address row {id}: {e}"), None)),
    };
    let Some(offset) = offset else {
        return Some((
            format!(
                "address row {id}: {address} is outside its block {cidr} (network {:?}){QUARANTINED}",
                block.network
            ),
            Some(format!("row {address} lies outside the prefix")),
        ));
    };
    let reserved = block.reserved.as_ref()?;
    let line = match (reserved.contains(&offset), allocated, container.is_empty()) {
        (true, false, _) => format!(
            "address row {id}: {address} of block {cidr} is free but reserved ({} mode)",
            mode.as_str()
        ),
        (false, true, true) => format!(
            "address row {id}: {address} of block {cidr} is held by no one but is not a reserved \
             address ({} mode)",
            mode.as_str()
        ),
        // A pod at a reserved position is left alone and logged at open.
        _ => return None,
    };
    Some((line, None))
}

/// Blocks whose counter is not their count of allocated rows, id order;
/// their ids go in `report.miscounted` for the start's recount.
fn report_counters(
    blocks: &HashMap<i64, Block>,
    allocated: &HashMap<i64, i64>,
    report: &mut Report,
) {
    let mut ids: Vec<i64> = blocks.keys().copied().collect();
    ids.sort_unstable();
    for id in ids {
        let counter = blocks.get(&id).map_or(0, |b| b.counter);
        let actual = allocated.get(&id).copied().unwrap_or(0);
        if counter != actual {
            report.miscounted.push(id);
            report.problems.push(format!(
                "block {id}: allocated_ips is {counter} but {actual} rows are allocated"
            ));
        }
    }
}

/// Addresses held by pods more than once in one address space: every block
/// holding one is a suspect.
fn report_holders(
    blocks: &HashMap<i64, Block>,
    holders: BTreeMap<(String, String), Vec<i64>>,
    report: &mut Report,
) {
    let mut shared = Vec::new();
    for ((_, address), ids) in holders.into_iter().filter(|(_, ids)| ids.len() > 1) {
        let mut networks: Vec<&str> = Vec::new();
        for id in &ids {
            let network = blocks.get(id).map_or("", |b| b.network.as_str());
            if !networks.contains(&network) {
                networks.push(network);
            }
        }
        let listed = networks.join(",");
        for id in &ids {
            report
                .suspects
                .entry(*id)
                .or_insert_with(|| format!("address {address} is held twice (networks {listed})"));
        }
        let quoted: Vec<String> = networks.iter().map(|n| format!("{n:?}")).collect();
        shared.push(format!(
            "network {}: address {address} is allocated {} times{QUARANTINED}",
            quoted.join(", "),
            ids.len()
        ));
    }
    push_limited(report, shared, |line| line);
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

    /// Stamps every address row an hour old, as rows left alone since an
    /// earlier start are (the trigger that stamps updates is put back).
    fn backdate_rows(store: &Store) {
        store
            .conn
            .execute_batch(
                "DROP TRIGGER update_ip_addresses_updated_at; \
                 UPDATE ip_addresses SET updated_at = updated_at - 3600000; \
                 CREATE TRIGGER update_ip_addresses_updated_at AFTER UPDATE ON ip_addresses \
                 FOR EACH ROW BEGIN UPDATE ip_addresses SET updated_at = \
                 (CAST(unixepoch('subsec') * 1000 AS INTEGER)) WHERE id = OLD.id; END;",
            )
            .unwrap();
    }

    fn allocated_rows(store: &Store) -> u64 {
        let n: i64 = store
            .conn
            .query_row(
                "SELECT COUNT(*) FROM ip_addresses WHERE is_allocated = 1",
                [],
                |r| r.get(0),
            )
            .unwrap();
        u64::try_from(n).unwrap()
    }

    #[test]
    fn a_start_after_a_sound_check_reads_only_what_was_written_since() {
        let dir = TempDir::new();
        let mut store = populated(&dir);
        backdate_rows(&store);
        let full = store.verify_at_start().unwrap();
        assert!(full.is_ok() && full.scope() == "rows", "{full:?}");
        // A crash (no clean stop): the allocated rows, none written since.
        let again = store.verify_at_start().unwrap();
        assert!(again.is_ok(), "{again:?}");
        assert_eq!(again.scope(), "changed");
        assert_eq!(again.rows_read, allocated_rows(&store));
        assert_eq!((again.blocks, again.allocations), (2, 6));
        // The daemon allocates and releases (two UPDATEs of one row): that
        // row is read at the next start besides the allocated ones.
        store.allocate(&owner("d"), Family::V4, 1).unwrap();
        store.release("pods", "d", "eth0", 1).unwrap();
        let after = store.verify_at_start().unwrap();
        assert!(after.is_ok() && after.scope() == "changed", "{after:?}");
        assert_eq!(after.rows_read, allocated_rows(&store) + 1, "{after:?}");
    }

    #[test]
    fn a_row_written_since_the_watermark_is_checked_in_full() {
        // Each planted fault, behind the daemon's back after a sound check.
        let faults = [
            (
                "UPDATE ip_addresses SET address = '198.18.1.9' WHERE address = '198.18.0.9'",
                "198.18.1.9 is outside its block",
            ),
            (
                "UPDATE ip_addresses SET is_allocated = 0 WHERE address = '198.18.0.15'; \
                 UPDATE cidr_blocks SET allocated_ips = allocated_ips - 1 WHERE ip_family = 'ipv4'",
                "198.18.0.15 of block 198.18.0.0/28 is free but reserved",
            ),
            (
                "UPDATE ip_addresses SET is_allocated = 1 WHERE address = '198.18.0.9'",
                "allocated_ips is 6 but 7 rows are allocated",
            ),
            (
                "UPDATE ip_addresses SET container_id = 'a' WHERE container_id = 'b' AND address LIKE '198.%'",
                "owner (container, interface, family) a eth0 ipv4 holds 2 addresses",
            ),
            (
                // Inserted with an old stamp: its new id gives it away.
                "INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, \
                 is_allocated, updated_at) VALUES ('198.18.9.9', 1, '', '', 0, 0)",
                "198.18.9.9 is outside its block",
            ),
        ];
        for (sql, expected) in faults {
            let dir = TempDir::new();
            let mut store = populated(&dir);
            backdate_rows(&store);
            assert!(store.verify_at_start().unwrap().is_ok());
            assert_eq!(store.verify_at_start().unwrap().scope(), "changed");
            Connection::open(dir.db())
                .unwrap()
                .execute_batch(sql)
                .unwrap();
            let report = store.verify_at_start().unwrap();
            assert!(
                report.problems.iter().any(|p| p.contains(expected)),
                "{sql}: {report:?} lacks {expected:?}"
            );
            // What was found is looked at in full at the next start too.
            assert_eq!(store.verify_at_start().unwrap().scope(), "rows", "{sql}");
        }
    }

    #[test]
    fn a_changed_block_or_schema_or_clock_brings_the_full_row_check_back() {
        let changes = [
            "UPDATE cidr_blocks SET state = 'Draining' WHERE id = 1",
            "CREATE INDEX extra ON ip_addresses(pod_name)",
            "INSERT OR REPLACE INTO metis_settings (key, value) VALUES ('reserve_mode', 'first-block')",
            "UPDATE metis_settings SET value = 'v1:99999999999999:0:0' WHERE key = 'rows_verified'",
        ];
        for sql in changes {
            let dir = TempDir::new();
            let mut store = populated(&dir);
            backdate_rows(&store);
            assert!(store.verify_at_start().unwrap().is_ok());
            Connection::open(dir.db())
                .unwrap()
                .execute_batch(sql)
                .unwrap();
            let report = store.verify_at_start().unwrap();
            assert_eq!(report.scope(), "rows", "{sql}: {report:?}");
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
