//! `metis import host-local` and `metis export host-local`: move a live
//! node's allocations from host-local's directory into Metis's database
//! and back, so no pod's address is ever handed out twice.
//!
//! Both write directly, each in one write transaction of the database
//! (SQLite's WAL, the 5 s busy timeout and `BEGIN IMMEDIATE` make that safe
//! while the daemon runs, exactly as direct mode is) and under host-local's
//! lock, through the same engine a plugin in direct mode uses. Both
//! register host-local's directory, which makes Metis co-write it while it
//! exists (see [`crate::store::db::co_writer`]): so either plugin may serve the
//! network during the switch. Going through the daemon would add a wire
//! message for a one-off operation and fail when the daemon is down, which
//! is exactly when an operator may want to import.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use super::{ArgsError, CommandError};
use crate::cidr::{Bounds, Cidr, Family};
use crate::cni::conf::{self, NetConf};
use crate::cni::plugin::family_add;
use crate::decode;
use crate::engine::Engine;
use crate::engine::request::{Add, Pod};
use crate::flags::{self, FlagSpec};
use crate::host_local_dir::{self, DirError, Held, Lock};
use crate::store::{self, AddressFilter, Source, Store, StoreOptions, db::co_writer};

const FLAGS: &[FlagSpec] = &[
    FlagSpec {
        name: "--config",
        value: Some("FILE"),
        repeatable: false,
        default: "",
        help: "the network config or config list Metis serves (host-local syntax; required)",
    },
    FlagSpec {
        name: "--data-dir",
        value: Some("DIR"),
        repeatable: false,
        default: "the config's ipam.dataDir, else /var/lib/cni/networks",
        help: "host-local's data directory; the network's files are in DIR/NAME",
    },
    FlagSpec {
        name: "--db-path",
        value: Some("PATH"),
        repeatable: false,
        default: "the config's dbPath, else /var/lib/cni/metis/metis.sqlite",
        help: "Metis's database",
    },
    FlagSpec {
        name: "--dry-run",
        value: None,
        repeatable: false,
        default: "",
        help: "import only: print what would be done and change nothing",
    },
];

/// Config files are small; a bigger one is a mistake.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Which way the addresses go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Import,
    Export,
}

impl Direction {
    /// The command's name in messages.
    pub fn command(self) -> &'static str {
        match self {
            Direction::Import => "metis import host-local",
            Direction::Export => "metis export host-local",
        }
    }
}

/// A checked command line of `metis import|export host-local`.
#[derive(Debug)]
pub struct Options {
    direction: Direction,
    config: PathBuf,
    data_dir: Option<PathBuf>,
    db_path: Option<PathBuf>,
    run: Run,
}

pub fn parse(direction: Direction, args: &[String]) -> Result<Options, ArgsError> {
    let misuse = |message: &str| ArgsError::Usage {
        message: message.to_string(),
        usage: usage(direction),
    };
    let (first, rest) = args
        .split_first()
        .map_or(("", args), |(f, r)| (f.as_str(), r));
    if first != "host-local" {
        return Err(misuse("the only source is `host-local`"));
    }
    let parsed =
        flags::parse(FLAGS, rest).map_err(|err| ArgsError::from_flags(err, usage(direction)))?;
    let Some(config) = parsed.get("--config").filter(|c| !c.is_empty()) else {
        return Err(misuse("--config FILE is required"));
    };
    if direction == Direction::Export && parsed.has("--dry-run") {
        return Err(misuse("--dry-run is for import"));
    }
    Ok(Options {
        direction,
        config: PathBuf::from(config),
        data_dir: parsed.get("--data-dir").map(PathBuf::from),
        db_path: parsed.get("--db-path").map(PathBuf::from),
        run: match parsed.has("--dry-run") {
            true => Run::Dry,
            false => Run::Real,
        },
    })
}

/// Imports or exports; what was done goes to `out`, the config's notes to
/// `err`, and a refusal's reasons into the error.
pub fn run(
    options: &Options,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<(), CommandError> {
    let (conf, notes) = load_config(&options.config).map_err(CommandError::Failed)?;
    for note in notes {
        let _ = writeln!(err, "{}: {note}", options.direction.command());
    }
    let data_dir = options
        .data_dir
        .clone()
        .unwrap_or_else(|| conf.data_dir.clone())
        .join(&conf.name);
    // Registered for the daemon, whose working directory is another.
    let data_dir = std::path::absolute(&data_dir).unwrap_or(data_dir);
    let db = options
        .db_path
        .clone()
        .unwrap_or_else(|| conf.db_path.clone());
    let lines = match options.direction {
        Direction::Import => import(&conf, &data_dir, &db, options.run),
        Direction::Export => export(&conf, &data_dir, &db),
    }
    .map_err(CommandError::Failed)?;
    for line in lines {
        let _ = writeln!(out, "{line}");
    }
    Ok(())
}

fn usage(direction: Direction) -> String {
    let about = match direction {
        Direction::Import => {
            "Record every address host-local holds for the config's network in Metis's database \
             (creating the config's blocks), so Metis never hands them out and DEL/CHECK work for \
             those pods, and release the pods host-local released since the last import. From \
             then on, while host-local's directory exists, Metis co-writes it under host-local's \
             lock, so either plugin may serve the network. One transaction: refuses, writing \
             nothing, when an address is held by another owner in Metis."
        }
        Direction::Export => {
            "Write Metis's allocations of the config's network in host-local's format, so \
             host-local can serve the node again without re-issuing a held address, and keep \
             co-writing host-local's directory while it exists. Exits 1 naming each address \
             host-local's directory records for another owner (every other one is written)."
        }
    };
    flags::usage(direction.command(), about, FLAGS)
}

/// Output lines, each one thing done or one problem.
pub type Lines = Vec<String>;

/// The plugin configuration of `value` (a network config, or a list) that
/// host-local or Metis serves: in a chain, the plugin whose `ipam.type` is
/// `host-local` or `metis`, with the list's `cniVersion` and `name`.
fn served_plugin(value: &serde_json::Value) -> Result<serde_json::Value, String> {
    let Some(plugins) = value.get("plugins").and_then(|p| p.as_array()) else {
        return Ok(value.clone());
    };
    let ipam_type = |p: &serde_json::Value| p["ipam"]["type"].as_str().map(str::to_string);
    let mut plugin = plugins
        .iter()
        .find(|p| matches!(ipam_type(p).as_deref(), Some("host-local" | "metis")))
        .cloned()
        .ok_or_else(|| {
            "no plugin of the list has an ipam object of type \"host-local\" or \"metis\""
                .to_string()
        })?;
    plugin["cniVersion"] = value["cniVersion"].clone();
    plugin["name"] = value["name"].clone();
    Ok(plugin)
}

/// host-local's range sets, read by host-local's rules (the single-range
/// form first, several sets of one family allowed from `cniVersion` 0.3.0
/// on), rewritten into the one range set per family Metis serves: each
/// family's ranges in host-local's order. Returns a note for each merge,
/// since after the switch Metis reads the conflist as written.
fn merge_range_sets(plugin: &mut serde_json::Value) -> Result<Lines, String> {
    use serde_json::Value;
    let Some(ipam) = plugin.get_mut("ipam").and_then(Value::as_object_mut) else {
        return Ok(Vec::new());
    };
    let mut sets: Vec<Value> = match ipam.get("ranges") {
        Some(Value::Array(sets)) => sets.clone(),
        None => Vec::new(),
        // Not host-local's syntax: left as written, for conf::parse's message.
        Some(_) => return Ok(Vec::new()),
    };
    if ipam
        .get("subnet")
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty())
    {
        let mut single = serde_json::Map::new();
        for key in ["subnet", "rangeStart", "rangeEnd", "gateway"] {
            if let Some(v) = ipam.remove(key) {
                single.insert(key.to_string(), v);
            }
        }
        sets.insert(0, Value::Array(vec![Value::Object(single)]));
    }
    if sets.is_empty() {
        return Ok(Vec::new());
    }
    // The family of a set is its first subnet's; a set conf::parse would
    // refuse anyway is left as written, for its message.
    let family_of = |set: &Value| -> Option<Family> {
        let subnet = set.get(0)?.get("subnet")?.as_str()?;
        subnet.parse::<Cidr>().ok().map(|c| c.family())
    };
    let mut merged: Vec<(Option<Family>, Vec<usize>, Vec<Value>)> = Vec::new();
    for (index, set) in sets.iter().enumerate() {
        let family = family_of(set);
        let ranges = set.as_array().cloned().unwrap_or_default();
        match merged
            .iter_mut()
            .find(|(f, _, _)| family.is_some() && *f == family)
        {
            Some((_, indices, all)) => {
                indices.push(index);
                all.extend(ranges);
            }
            None => merged.push((family, vec![index], ranges)),
        }
    }
    let mut notes = Vec::new();
    for (family, indices, _) in &merged {
        if indices.len() < 2 {
            continue;
        }
        // host-local: "CNI spec 0.2.0 and below supported only one v4 and v6 address".
        let version = plugin["cniVersion"].as_str().unwrap_or_default();
        if matches!(version, "" | "0.1.0" | "0.2.0") {
            return Err(format!(
                "CNI version {version} does not support more than 1 address per family"
            ));
        }
        let family = family.map_or("", Family::as_str);
        notes.push(format!(
            "note: range sets {indices:?} are all {family}: host-local gives a pod one address of each, \
             metis one address per family from their ranges in order; pods holding more than one are refused. \
             Before switching, write them as one range set in the conflist's ipam.ranges, as metis reads it"
        ));
    }
    let ranges: Vec<Value> = merged
        .into_iter()
        .map(|(_, _, r)| Value::Array(r))
        .collect();
    if let Some(ipam) = plugin.get_mut("ipam").and_then(Value::as_object_mut) {
        ipam.insert("ranges".to_string(), Value::Array(ranges));
    }
    Ok(notes)
}

/// The config file, validated as [`parse_config`] does.
fn load_config(path: &Path) -> Result<(NetConf, Lines), Lines> {
    use std::io::Read;
    let fail = |e: &dyn std::fmt::Display| vec![format!("{}: {e}", path.display())];
    let file = std::fs::File::open(path).map_err(|e| fail(&e))?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(&e))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(fail(&format!("larger than {MAX_CONFIG_BYTES} bytes")));
    }
    parse_config(&bytes).map_err(|e| fail(&e))
}

/// A network config or config list as host-local reads it: the plugin
/// host-local (or Metis) serves, its range sets merged into the one per
/// family Metis serves, then validated as the plugin validates it.
/// Returns the config and a note for each merge.
pub fn parse_config(bytes: &[u8]) -> Result<(NetConf, Lines), String> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let mut plugin = served_plugin(&value)?;
    let notes = merge_range_sets(&mut plugin)?;
    let conf = conf::parse(plugin.to_string().as_bytes()).map_err(|e| e.msg)?;
    conf.require_ranges().map_err(|e| e.msg)?;
    Ok((conf, notes))
}

/// The addresses of one owner (container and interface), by family.
type ByOwner = BTreeMap<(String, String), BTreeMap<Family, IpAddr>>;

/// Why host-local's `address` cannot be one Metis serves under the config,
/// if it cannot: outside every range, or outside its subnet's
/// `rangeStart`/`rangeEnd`, or the subnet's gateway.
fn outside(conf: &NetConf, address: IpAddr) -> Option<String> {
    let family = Family::of(address);
    let Some(subnet) = ranges_of(conf, family).iter().find(|r| r.contains(address)) else {
        return Some(format!(
            "is outside every range of network {:?}",
            conf.network
        ));
    };
    let bounds = conf
        .bounds
        .iter()
        .find(|(c, _)| c == subnet)
        .map_or_else(|| Bounds::host_local_default(subnet), |(_, b)| *b);
    if address < bounds.start || address > bounds.end {
        return Some(format!(
            "is outside rangeStart {}..rangeEnd {} of subnet {subnet}",
            bounds.start, bounds.end
        ));
    }
    (address == bounds.gateway).then(|| format!("is the gateway of subnet {subnet}"))
}

/// Groups host-local's entries by owner; refuses what Metis cannot hold
/// (two addresses of a family for one owner, an address outside the
/// config's ranges or bounds).
fn by_owner(conf: &NetConf, held: &[Held]) -> Result<ByOwner, Lines> {
    let mut owners = ByOwner::new();
    let mut problems = Vec::new();
    for entry in held {
        if let Some(why) = outside(conf, entry.address) {
            problems.push(format!(
                "{} (container {:?}) {why}",
                entry.address, entry.container_id
            ));
            continue;
        }
        let key = (entry.container_id.clone(), entry.ifname.clone());
        let family = Family::of(entry.address);
        if let Some(other) = owners.entry(key).or_default().insert(family, entry.address) {
            problems.push(format!(
                "container {:?} interface {:?} holds {other} and {}: metis holds one address per family",
                entry.container_id, entry.ifname, entry.address
            ));
        }
    }
    if problems.is_empty() {
        Ok(owners)
    } else {
        Err(problems)
    }
}

fn ranges_of(conf: &NetConf, family: Family) -> &[Cidr] {
    match family {
        Family::V4 => &conf.ipv4_ranges,
        Family::V6 => &conf.ipv6_ranges,
    }
}

/// Whether the import writes: a dry run rehearses on a private copy and
/// touches neither host-local's directory nor the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    Real,
    Dry,
}

fn import(conf: &NetConf, data_dir: &Path, db: &Path, run: Run) -> Result<Lines, Lines> {
    // Without a database, what the directory alone refuses is refused
    // before one is created; the import reads it again in its transaction.
    if !db.exists() {
        let fail = |e: DirError| vec![e.0];
        let _lock = match host_local_dir::exists(data_dir).map_err(fail)? {
            true => Lock::take_if_present(data_dir).map_err(fail)?,
            false => None,
        };
        by_owner(conf, &host_local_dir::read(data_dir).map_err(fail)?)?;
    }
    match run {
        Run::Real => in_one_transaction(db, |engine| import_in(engine, conf, data_dir, run)),
        Run::Dry => {
            let rehearsal = Rehearsal::new(db)?;
            let done = in_one_transaction(&rehearsal.path, |engine| {
                import_in(engine, conf, data_dir, run)
            })?;
            let mut lines: Lines = done
                .into_iter()
                .enumerate()
                .map(|(i, line)| {
                    if i == 0 || line.starts_with("warning:") {
                        line
                    } else {
                        format!("would: {line}")
                    }
                })
                .collect();
            lines.push(format!("dry run: {} not changed", db.display()));
            Ok(lines)
        }
    }
}

/// Runs `work` in one write transaction of the database at `db`, committed
/// only when it succeeds: a refused import or export writes nothing.
fn in_one_transaction<T>(
    db: &Path,
    work: impl FnOnce(&mut Engine) -> Result<T, Lines>,
) -> Result<T, Lines> {
    let fail = |e: &dyn std::fmt::Display| vec![format!("{}: {e}", db.display())];
    let store = Store::open(db, &StoreOptions::default()).map_err(|e| fail(&e))?;
    let mut engine = Engine::new(store);
    engine.store_mut().begin_request().map_err(|e| fail(&e))?;
    let result = work(&mut engine);
    let store = engine.store_mut();
    store.end_request(result.is_ok()).map_err(|e| fail(&e))?;
    store.commit_batch().map_err(|e| fail(&e))?;
    result
}

/// The import, inside its transaction and under host-local's lock: first
/// boot recovery (as direct mode runs it), then the config's blocks; then,
/// when the directory was co-written since an earlier import, every pod
/// host-local released meanwhile is released; then every owner's
/// addresses are recorded, and on a first import every address Metis
/// already held gets its host-local file. Lines say what was done, or
/// every conflict.
fn import_in(engine: &mut Engine, conf: &NetConf, dir: &Path, run: Run) -> Result<Lines, Lines> {
    let fail = |e: &dyn std::fmt::Display| vec![e.to_string()];
    let now = crate::log::now_ms();
    let network = conf.network.as_str();
    let co_written =
        co_writer::is_registered(engine.store(), network, dir).map_err(|e| fail(&e))?;
    if run == Run::Dry {
        // The private copy must not act on host-local's directory.
        co_writer::unregister(engine.store_mut(), network).map_err(|e| fail(&e))?;
    }
    let exists = host_local_dir::exists(dir).map_err(|e| fail(&e))?;
    let _lock = match (exists, run) {
        (false, _) => None,
        (true, Run::Real) => Some(Lock::take(dir).map_err(|e| fail(&e))?),
        (true, Run::Dry) => Lock::take_if_present(dir).map_err(|e| fail(&e))?,
    };
    let held = host_local_dir::read(dir).map_err(|e| fail(&e))?;
    let mut owners = by_owner(conf, &held)?;
    let mut done = vec![format!(
        "{} address(es) of {} pod(s) in {} for network {network:?}",
        held.len(),
        owners.len(),
        dir.display(),
    )];
    done.extend(recover_boot(engine.store_mut(), now)?);
    lay_out(engine.store_mut(), conf, now).map_err(|e| fail(&e))?;
    let in_metis = pod_rows(engine.store(), network).map_err(|e| fail(&e))?;
    if co_written {
        let read = HostLocalFiles { dir, files: &held };
        done.extend(release_gone(
            engine.store_mut(),
            network,
            read,
            &in_metis,
            run,
        )?);
    }
    let cooling = cooling(engine.store(), network, now).map_err(|e| fail(&e))?;
    done.extend(defer_cooling(&mut owners, &cooling));
    done.extend(record(engine, conf, &owners, now)?);
    done.extend(dead_containers(&held, dir));
    // Without host-local's directory there is no co-writer to protect
    // from, and none is created.
    if exists && !co_written {
        done.extend(write_missing(&held, &in_metis, dir, run)?);
    }
    if exists && run == Run::Real {
        co_writer::register(engine.store_mut(), network, dir).map_err(|e| fail(&e))?;
    }
    Ok(done)
}

/// As a plugin in direct mode does before allocating: were the boot's
/// recovery left to the daemon, it would release what the import records.
fn recover_boot(store: &mut Store, now: i64) -> Result<Option<String>, Lines> {
    let boot_id_path = store::boot_id_path(&|name| std::env::var(name).ok());
    let Some(boot_id) = store::read_boot_id(&boot_id_path) else {
        return Ok(None);
    };
    let recovered = store
        .recover_after_reboot(&boot_id, None, now)
        .map_err(|e| vec![e.to_string()])?;
    Ok((recovered.released() > 0).then(|| {
        format!(
            "released {} allocation(s) of the previous boot first",
            recovered.released()
        )
    }))
}

/// The config's blocks and bounds, as its ADDs lay them out.
fn lay_out(store: &mut Store, conf: &NetConf, now: i64) -> Result<(), store::StoreError> {
    for family in [Family::V4, Family::V6] {
        let ranges = ranges_of(conf, family);
        if ranges.is_empty() {
            continue;
        }
        let wish = store::Wish {
            source: Source::Cni,
            network: &conf.network,
            family,
            ranges,
            isolated: conf.isolated,
        };
        store.configure(&wish, now)?;
        store.set_bounds(&conf.network, family, &conf.bounds)?;
    }
    Ok(())
}

/// Every pod allocation of `network` in Metis.
fn pod_rows(store: &Store, network: &str) -> Result<Vec<Held>, store::StoreError> {
    let table = store.list_addresses(&AddressFilter {
        network: Some(network.to_string()),
        allocated: Some(true),
        ..AddressFilter::default()
    })?;
    let column = |name: &str| table.headers.iter().position(|h| h == name);
    let (Some(address_at), Some(container_at), Some(ifname_at)) = (
        column("address"),
        column("container_id"),
        column("interface_name"),
    ) else {
        return Err(store::StoreError::Corrupt(
            "ip_addresses lacks address, container_id or interface_name".to_string(),
        ));
    };
    let mut held = Vec::new();
    for row in &table.rows {
        if row[container_at].is_empty() {
            continue; // a reserved position, not a pod
        }
        held.push(Held {
            address: store::parse_addr(&row[address_at])?,
            container_id: row[container_at].clone(),
            ifname: row[ifname_at].clone(),
        });
    }
    Ok(held)
}

/// Addresses of `network` Metis is cooling down at `now` (released, not
/// yet to be handed out again): their last owner and until when.
fn cooling(
    store: &Store,
    network: &str,
    now: i64,
) -> Result<BTreeMap<IpAddr, (Held, i64)>, store::StoreError> {
    let table = store.list_addresses(&AddressFilter {
        network: Some(network.to_string()),
        allocated: Some(false),
        ..AddressFilter::default()
    })?;
    let column = |name: &str| table.headers.iter().position(|h| h == name);
    let (Some(address_at), Some(container_at), Some(ifname_at), Some(until_at)) = (
        column("address"),
        column("container_id"),
        column("interface_name"),
        column("release_at"),
    ) else {
        return Err(store::StoreError::Corrupt(
            "ip_addresses lacks address, container_id, interface_name or release_at".to_string(),
        ));
    };
    let mut cooling = BTreeMap::new();
    for row in &table.rows {
        let Ok(until) = row[until_at].parse::<i64>() else {
            continue; // free, never released
        };
        if until <= now {
            continue;
        }
        let address = store::parse_addr(&row[address_at])?;
        let last = Held {
            address,
            container_id: row[container_at].clone(),
            ifname: row[ifname_at].clone(),
        };
        cooling.insert(address, (last, until));
    }
    Ok(cooling)
}

/// Leaves out, with a note each, the addresses Metis is cooling down that
/// host-local handed to another pod since Metis released them: recording
/// them now would be refused, yet nothing is at risk, since Metis hands an
/// address out neither while it cools nor afterwards while host-local's
/// file names another pod. An import after the cooldown records them.
fn defer_cooling(owners: &mut ByOwner, cooling: &BTreeMap<IpAddr, (Held, i64)>) -> Lines {
    let mut notes = Vec::new();
    for ((container, ifname), addresses) in owners.iter_mut() {
        addresses.retain(|_, address| {
            let Some((last, until)) = cooling.get(address) else {
                return true;
            };
            if last.names(container, ifname) {
                return true; // its last owner may take it back
            }
            notes.push(format!(
                "deferred {address} of container {container:?} interface {ifname:?}: metis cools it down until {} \
                 (last held by container {:?}), and host-local handed it out since; metis does not hand it out, \
                 and an import after that time records it",
                crate::log::rfc3339_millis(*until),
                last.container_id
            ));
            false
        });
    }
    owners.retain(|_, addresses| !addresses.is_empty());
    notes
}

/// Releases every allocation whose host-local file is gone or names
/// another owner: the directory was co-written since the last import, so
/// host-local released those pods (its DEL removed the file). The release
/// removes the owner's files of that family, as a DEL does; one the owner
/// holds now (host-local gave the container another address) is put back.
/// host-local's directory of a network and the files read from it.
struct HostLocalFiles<'a> {
    dir: &'a Path,
    files: &'a [Held],
}

fn release_gone(
    store: &mut Store,
    network: &str,
    host_local: HostLocalFiles<'_>,
    in_metis: &[Held],
    run: Run,
) -> Result<Lines, Lines> {
    let HostLocalFiles { dir, files } = host_local;
    let fail = |e: &dyn std::fmt::Display| vec![e.to_string()];
    let mut lines = Vec::new();
    for row in in_metis {
        if files.contains(row) {
            continue;
        }
        let family = Family::of(row.address);
        store
            .roll_back(network, &row.container_id, &row.ifname, family)
            .map_err(|e| fail(&e))?;
        let current = files
            .iter()
            .filter(|f| f.names(&row.container_id, &row.ifname) && Family::of(f.address) == family);
        for file in current.filter(|_| run == Run::Real) {
            host_local_dir::write(dir, file).map_err(|e| fail(&e))?;
        }
        crate::log::info(
            "host-local",
            "released an allocation host-local released",
            &[
                ("network", &network),
                ("address", &row.address),
                ("container_id", &row.container_id),
                ("interface", &row.ifname),
            ],
        );
        lines.push(format!(
            "released {} of container {:?} interface {:?}: host-local released it (its file {} is gone)",
            row.address,
            row.container_id,
            row.ifname,
            host_local_dir::path_of(dir, row.address).display()
        ));
    }
    Ok(lines)
}

/// Records every owner's addresses, as each pod's ADD with `IP=` would.
fn record(engine: &mut Engine, conf: &NetConf, owners: &ByOwner, now: i64) -> Result<Lines, Lines> {
    let mut done = Vec::new();
    let mut conflicts = Vec::new();
    for ((container, ifname), addresses) in owners {
        let held: Vec<IpAddr> = engine
            .store()
            .check(&conf.network, container, ifname)
            .map_err(|e| vec![e.to_string()])?
            .into_iter()
            .map(|a| a.address)
            .collect();
        let wanted: Vec<IpAddr> = addresses.values().copied().collect();
        let list = wanted
            .iter()
            .map(IpAddr::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        if held == wanted {
            done.push(format!(
                "unchanged {list} container {container:?} interface {ifname:?}"
            ));
            continue;
        }
        let recorded = request(conf, container, ifname, addresses).and_then(|add| {
            engine
                .allocate(&add, now)
                .map_err(|failure| failure.message)
        });
        match recorded {
            Ok(_) => done.push(format!(
                "recorded {list} for container {container:?} interface {ifname:?}"
            )),
            Err(why) => conflicts.push(format!(
                "{list} of container {container:?} interface {ifname:?}: {why}"
            )),
        }
    }
    if conflicts.is_empty() {
        Ok(done)
    } else {
        conflicts.push("nothing was imported".to_string());
        Err(conflicts)
    }
}

/// When the machine booted (seconds since the epoch), from `/proc/stat`.
fn boot_time() -> Option<u64> {
    std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|line| line.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// A warning for each file written before the machine booted: its
/// container is gone (a reboot ends every container), but neither plugin
/// can be sure, so Metis keeps it as host-local does.
fn dead_containers(held: &[Held], dir: &Path) -> Lines {
    let Some(boot) = boot_time() else {
        return Vec::new();
    };
    let boot = std::time::UNIX_EPOCH + std::time::Duration::from_secs(boot);
    held.iter()
        .filter(|h| {
            std::fs::symlink_metadata(host_local_dir::path_of(dir, h.address))
                .and_then(|m| m.modified())
                .is_ok_and(|modified| modified < boot)
        })
        .map(|h| {
            let path = host_local_dir::path_of(dir, h.address);
            format!(
                "warning: {} of container {:?} was written before this boot, so the container is most likely gone; \
                 kept, as host-local keeps it. Once sure: `rm {}` and import again, which releases it",
                h.address,
                h.container_id,
                path.display()
            )
        })
        .collect()
}

/// On a first import, writes host-local's file for every address Metis
/// already holds that has none, so host-local never hands it out.
fn write_missing(files: &[Held], in_metis: &[Held], dir: &Path, run: Run) -> Result<Lines, Lines> {
    let fail = |e: &dyn std::fmt::Display| vec![e.to_string()];
    let mut lines = Vec::new();
    for row in in_metis {
        if files.iter().any(|f| f.address == row.address) {
            continue;
        }
        if run == Run::Real {
            host_local_dir::write(dir, row).map_err(|e| fail(&e))?;
        }
        lines.push(format!(
            "wrote {} for container {:?} interface {:?} (held in metis)",
            host_local_dir::path_of(dir, row.address).display(),
            row.container_id,
            row.ifname
        ));
    }
    if run == Run::Real && !lines.is_empty() {
        host_local_dir::sync(dir).map_err(|e| fail(&e))?;
    }
    Ok(lines)
}

/// A private copy of the database (or nothing, for a new one), removed
/// with its WAL files when dropped. The copy is taken without creating
/// anything next to the database: with no `-wal` file (no connection is
/// open) the file itself is consistent and copied as is; otherwise SQLite
/// copies it through the connections' shared `-shm`, which exists then.
struct Rehearsal {
    dir: PathBuf,
    path: PathBuf,
}

impl Rehearsal {
    fn new(db: &Path) -> Result<Rehearsal, Lines> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("metis-import-{}-{nanos}", std::process::id()));
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| vec![format!("cannot create {}: {e}", dir.display())])?;
        let rehearsal = Rehearsal {
            path: dir.join("rehearsal.sqlite"),
            dir,
        };
        let fail = |e: &dyn std::fmt::Display| vec![format!("cannot copy {}: {e}", db.display())];
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        if !db.exists() {
            return Ok(rehearsal);
        }
        if !Path::new(&wal).exists() {
            std::fs::copy(db, &rehearsal.path).map_err(|e| fail(&e))?;
        } else if let Some(store) = Store::open_read_only(db).map_err(|e| fail(&e))? {
            store.copy_to(&rehearsal.path).map_err(|e| fail(&e))?;
        }
        Ok(rehearsal)
    }
}

impl Drop for Rehearsal {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The ADD an owner's pod would have sent, asking for its addresses.
fn request(
    conf: &NetConf,
    container: &str,
    ifname: &str,
    addresses: &BTreeMap<Family, IpAddr>,
) -> Result<Add, String> {
    let owner = decode::owner(container, ifname).map_err(|failure| failure.message)?;
    let wanted: Vec<IpAddr> = addresses.values().copied().collect();
    let part = |family: Family| {
        addresses
            .contains_key(&family)
            .then(|| family_add(conf, family, &owner, &wanted))
            .flatten()
    };
    Ok(Add {
        network: conf.network.clone(),
        pod: Pod::default(),
        ipv4: part(Family::V4),
        ipv6: part(Family::V6),
        isolated: conf.isolated,
        conf_name: String::new(),
    })
}

fn export(conf: &NetConf, dir: &Path, db: &Path) -> Result<Lines, Lines> {
    let fail = |e: &dyn std::fmt::Display| vec![format!("{}: {e}", db.display())];
    if Store::open_read_only(db).map_err(|e| fail(&e))?.is_none() {
        return Err(fail(&"no Metis database here"));
    }
    let (mut lines, problems) =
        in_one_transaction(db, |engine| export_in(engine.store_mut(), conf, dir))?;
    if problems.is_empty() {
        return Ok(lines);
    }
    lines.extend(problems);
    lines.push(
        "refused: every other address was written, so host-local will not hand those out; \
         resolve each conflict above before switching back"
            .to_string(),
    );
    Err(lines)
}

/// Writes every pod allocation of the network as a host-local file, under
/// host-local's lock, and registers the directory so Metis keeps
/// co-writing it until it is removed. When it was co-written already,
/// every live allocation has its file, and one whose file is gone or names
/// another owner was released by host-local: it is released first, as an
/// import does. A file recording another owner, or an allocation
/// host-local could not hold, is refused by name; every other address is
/// written even then, so switching back anyway cannot hand out an address
/// twice. Files of addresses Metis does not hold are reported with the
/// command that removes them. Returns what was done and the problems.
fn export_in(store: &mut Store, conf: &NetConf, dir: &Path) -> Result<(Lines, Lines), Lines> {
    let fail = |e: &dyn std::fmt::Display| vec![e.to_string()];
    let network = conf.network.as_str();
    host_local_dir::write_dir(dir).map_err(|e| fail(&e))?;
    let co_written = co_writer::is_registered(store, network, dir).map_err(|e| fail(&e))?;
    let _lock = Lock::take(dir).map_err(|e| fail(&e))?;
    let mut in_metis = pod_rows(store, network).map_err(|e| fail(&e))?;
    let files = host_local_dir::read(dir).map_err(|e| fail(&e))?;
    let mut lines = Vec::new();
    if co_written {
        let read = HostLocalFiles { dir, files: &files };
        lines = release_gone(store, network, read, &in_metis, Run::Real)?;
        in_metis.retain(|row| files.contains(row));
    }
    let mut problems = Vec::new();
    for held in &in_metis {
        let address = held.address;
        let container = &held.container_id;
        if let Some(why) = outside(conf, address) {
            problems.push(format!(
                "{address} (container {container:?}) {why}: host-local could not hold it"
            ));
        } else if let Some(other) = files.iter().find(|e| e.address == address) {
            if other == held {
                lines.push(format!("unchanged {address} container {container:?}"));
            } else {
                problems.push(format!(
                    "{address}: host-local records container {:?} interface {:?}, metis container {container:?} interface {:?}",
                    other.container_id, other.ifname, held.ifname
                ));
            }
        } else if host_local_dir::write(dir, held).map_err(|e| fail(&e))? {
            lines.push(format!(
                "wrote {} for container {container:?} interface {:?}",
                host_local_dir::path_of(dir, address).display(),
                held.ifname
            ));
        }
    }
    for file in &files {
        if !in_metis.iter().any(|h| h.address == file.address) {
            lines.push(format!(
                "note: {} names container {:?}, which metis does not hold: host-local keeps the address until that \
                 container's DEL; if the container is gone: rm {}",
                file.address,
                file.container_id,
                host_local_dir::path_of(dir, file.address).display()
            ));
        }
    }
    // Durable before the operator swaps the conflist back.
    host_local_dir::sync(dir).map_err(|e| fail(&e))?;
    co_writer::register(store, network, dir).map_err(|e| fail(&e))?;
    Ok((lines, problems))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(value: serde_json::Value) -> Result<(NetConf, Lines), String> {
        parse_config(value.to_string().as_bytes())
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn the_served_plugin_of_a_chain_and_host_locals_range_sets() {
        let hl = |ranges: serde_json::Value| json!({"type": "bridge", "ipam": {"type": "host-local", "ranges": ranges}});
        let list = |version: &str, plugin: serde_json::Value| {
            json!({"cniVersion": version, "name": "n", "plugins": [
                {"type": "macvlan", "ipam": {"type": "dhcp"}}, plugin]})
        };
        let (conf, notes) =
            parse(list("1.0.0", hl(json!([[{"subnet": "198.18.0.0/24"}]])))).unwrap();
        assert_eq!(conf.ipv4_ranges.len(), 1);
        assert!(notes.is_empty());
        assert_eq!(
            parse(json!({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "macvlan", "ipam": {"type": "dhcp"}}]})).unwrap_err(),
            "no plugin of the list has an ipam object of type \"host-local\" or \"metis\""
        );
        // The single-range form is a set before `ranges`; IPv4 sets merge.
        let mut single = hl(json!([[{"subnet": "198.18.2.0/24"}], [{"subnet": "2001:db8::/64"}]]));
        single["ipam"]["subnet"] = json!("198.18.0.0/24");
        single["ipam"]["rangeStart"] = json!("198.18.0.10");
        let (conf, notes) = parse(list("0.3.0", single.clone())).unwrap();
        assert_eq!(
            conf.ipv4_ranges
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["198.18.0.0/24", "198.18.2.0/24"]
        );
        assert_eq!(conf.ipv6_ranges.len(), 1);
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].starts_with("note: range sets [0, 1] are all ipv4"),
            "{notes:?}"
        );
        assert_eq!(conf.bounds.len(), 1, "rangeStart kept with its subnet");
        assert_eq!(
            parse(list("0.2.0", single)).unwrap_err(),
            "CNI version 0.2.0 does not support more than 1 address per family"
        );
        // Overlaps stay refused, and syntax that is not host-local's is
        // left to the plugin's own message.
        let overlap = hl(json!([[{"subnet": "198.18.0.0/24"}], [{"subnet": "198.18.0.0/25"}]]));
        assert!(
            parse(list("1.0.0", overlap))
                .unwrap_err()
                .contains("overlaps")
        );
        assert!(parse(list("1.0.0", hl(json!("198.18.0.0/24")))).is_err());
    }

    #[test]
    fn addresses_outside_the_bounds_are_named_as_such() {
        let (conf, _) = parse(json!({"cniVersion": "1.0.0", "name": "n", "type": "bridge",
            "ipam": {"type": "host-local", "ranges": [[{"subnet": "198.18.0.0/24",
                "rangeStart": "198.18.0.10", "rangeEnd": "198.18.0.40", "gateway": "198.18.0.50"}]]}}))
        .unwrap();
        assert_eq!(outside(&conf, ip("198.18.0.20")), None);
        assert_eq!(
            outside(&conf, ip("198.18.0.5")).as_deref(),
            Some("is outside rangeStart 198.18.0.10..rangeEnd 198.18.0.40 of subnet 198.18.0.0/24")
        );
        assert!(
            outside(&conf, ip("198.18.1.5"))
                .unwrap()
                .starts_with("is outside every range")
        );
        let (conf, _) = parse(json!({"cniVersion": "1.0.0", "name": "n", "type": "bridge",
            "ipam": {"type": "host-local", "ranges": [[{"subnet": "198.18.0.0/24"}]]}}))
        .unwrap();
        assert_eq!(
            outside(&conf, ip("198.18.0.1")).as_deref(),
            Some("is the gateway of subnet 198.18.0.0/24")
        );
        assert!(outside(&conf, ip("198.18.0.255")).is_some(), "broadcast");
    }
}
