//! `metis import host-local` and `metis export host-local`: move a live
//! node's allocations from host-local's directory into Metis's database
//! and back, so no pod's address is ever handed out twice.
//!
//! Both write directly: import through the same engine a plugin in direct
//! mode uses (SQLite's WAL, the 5 s busy timeout and `BEGIN IMMEDIATE`
//! make that safe while the daemon runs, exactly as direct mode is), export
//! by reading the database read-only. Going through the daemon would add a
//! wire message for a one-off operation and fail when the daemon is down,
//! which is exactly when an operator may want to import.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use super::host_local_dir::{self, Held};
use crate::cidr::{Cidr, Family};
use crate::cni::conf::{self, NetConf};
use crate::cni::plugin::ip_config;
use crate::engine::Engine;
use crate::flags::{self, FlagError, FlagSpec};
use crate::store::{self, AddressFilter, Source, Store, StoreOptions};
use crate::wire::ipam;

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

/// Exit status: done (or, with `--dry-run`, it would succeed).
pub const EXIT_OK: u8 = 0;
/// Exit status: refused (a conflict) or failed; nothing was written.
pub const EXIT_FAILED: u8 = 1;
/// Exit status: bad command line.
pub const EXIT_USAGE: u8 = 2;

/// Config files are small; a bigger one is a mistake.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Which way the addresses go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Import,
    Export,
}

impl Direction {
    fn command(self) -> &'static str {
        match self {
            Direction::Import => "metis import host-local",
            Direction::Export => "metis export host-local",
        }
    }
}

/// Runs `metis import|export host-local ARGS` and returns the exit status.
pub fn run(direction: Direction, args: &[String], out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let command = direction.command();
    let (first, rest) = args
        .split_first()
        .map_or(("", args), |(f, r)| (f.as_str(), r));
    if first != "host-local" {
        let _ = writeln!(
            err,
            "{command}: the only source is `host-local`\n\n{}",
            usage(direction)
        );
        return EXIT_USAGE;
    }
    let parsed = match flags::parse(FLAGS, rest) {
        Ok(parsed) => parsed,
        Err(FlagError::Help) => {
            let _ = write!(out, "{}", usage(direction));
            return EXIT_OK;
        }
        Err(e) => {
            let _ = writeln!(err, "{command}: {e}\n\n{}", usage(direction));
            return EXIT_USAGE;
        }
    };
    let Some(config) = parsed.get("--config").filter(|c| !c.is_empty()) else {
        let _ = writeln!(
            err,
            "{command}: --config FILE is required\n\n{}",
            usage(direction)
        );
        return EXIT_USAGE;
    };
    if direction == Direction::Export && parsed.has("--dry-run") {
        let _ = writeln!(
            err,
            "{command}: --dry-run is for import\n\n{}",
            usage(direction)
        );
        return EXIT_USAGE;
    }
    let result = load_config(Path::new(config)).and_then(|conf| {
        let data_dir = parsed
            .get("--data-dir")
            .map_or_else(|| conf.data_dir.clone(), PathBuf::from)
            .join(&conf.name);
        let db = parsed
            .get("--db-path")
            .map_or_else(|| conf.db_path.clone(), PathBuf::from);
        match direction {
            Direction::Import => import(&conf, &data_dir, &db, parsed.has("--dry-run")),
            Direction::Export => export(&conf, &data_dir, &db),
        }
    });
    match result {
        Ok(lines) => {
            for line in lines {
                let _ = writeln!(out, "{line}");
            }
            EXIT_OK
        }
        Err(lines) => {
            for line in lines {
                let _ = writeln!(err, "{command}: {line}");
            }
            EXIT_FAILED
        }
    }
}

fn usage(direction: Direction) -> String {
    let about = match direction {
        Direction::Import => {
            "Record every address host-local holds for the config's network in Metis's database \
             (creating the config's blocks), so Metis never hands them out and DEL/CHECK work for \
             those pods. Refuses, writing nothing, when an address is held by another owner in \
             Metis. Running it again changes nothing."
        }
        Direction::Export => {
            "Write Metis's allocations of the config's network in host-local's format, so \
             host-local can serve the node again without re-issuing a held address. Refuses, \
             writing nothing, when host-local's directory already records an address for another \
             owner."
        }
    };
    flags::usage(direction.command(), about, FLAGS)
}

/// Failure lines, each one problem.
type Lines = Vec<String>;

/// The config (a network config, or a list whose first plugin with an
/// `ipam` object is the one served), validated as the plugin validates it.
fn load_config(path: &Path) -> Result<NetConf, Lines> {
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
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| fail(&e))?;
    let plugin = match value.get("plugins").and_then(|p| p.as_array()) {
        None => value.clone(),
        Some(plugins) => {
            let mut plugin = plugins
                .iter()
                .find(|p| p.get("ipam").is_some())
                .cloned()
                .ok_or_else(|| fail(&"no plugin of the list has an ipam object"))?;
            plugin["cniVersion"] = value["cniVersion"].clone();
            plugin["name"] = value["name"].clone();
            plugin
        }
    };
    let conf = conf::parse(plugin.to_string().as_bytes()).map_err(|e| fail(&e.msg))?;
    conf.require_ranges().map_err(|e| fail(&e.msg))?;
    Ok(conf)
}

/// The addresses of one owner (container and interface), by family.
type ByOwner = BTreeMap<(String, String), BTreeMap<Family, IpAddr>>;

/// Groups host-local's entries by owner; refuses what Metis cannot hold
/// (two addresses of a family for one owner, an address outside every
/// range of the config).
fn by_owner(conf: &NetConf, held: &[Held]) -> Result<ByOwner, Lines> {
    let mut owners = ByOwner::new();
    let mut problems = Vec::new();
    for entry in held {
        let family = Family::of(entry.address);
        let ranges = ranges_of(conf, family);
        if !ranges.iter().any(|r| r.contains(entry.address)) {
            problems.push(format!(
                "{} (container {:?}) is outside every range of network {:?}",
                entry.address, entry.container_id, conf.network
            ));
            continue;
        }
        let key = (entry.container_id.clone(), entry.ifname.clone());
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

/// Rehearses on a copy of the database; writes the real one only when the
/// rehearsal found no conflict.
fn import(conf: &NetConf, data_dir: &Path, db: &Path, dry_run: bool) -> Result<Lines, Lines> {
    let held = host_local_dir::read(data_dir).map_err(|e| vec![e.0])?;
    let owners = by_owner(conf, &held)?;
    let rehearsal = Rehearsal::new(db)?;
    let planned = apply(conf, &owners, &rehearsal.path)?;
    let mut lines = vec![format!(
        "{} address(es) of {} pod(s) in {} for network {:?}",
        held.len(),
        owners.len(),
        data_dir.display(),
        conf.network
    )];
    if dry_run {
        lines.extend(planned.into_iter().map(|line| format!("would: {line}")));
        lines.push(format!("dry run: {} not changed", db.display()));
        return Ok(lines);
    }
    lines.extend(apply(conf, &owners, db)?);
    Ok(lines)
}

/// A private copy of the database (or nothing, for a new one), removed
/// with its WAL files when dropped.
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
        if let Some(store) =
            Store::open_read_only(db).map_err(|e| vec![format!("{}: {e}", db.display())])?
        {
            store
                .copy_to(&rehearsal.path)
                .map_err(|e| vec![format!("cannot copy {}: {e}", db.display())])?;
        }
        Ok(rehearsal)
    }
}

impl Drop for Rehearsal {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Lays out the config's blocks and records every owner's addresses, as
/// each pod's ADD with `IP=` would; returns what was done per owner, or
/// every conflict.
fn apply(conf: &NetConf, owners: &ByOwner, db: &Path) -> Result<Lines, Lines> {
    let fail = |e: &dyn std::fmt::Display| vec![format!("{}: {e}", db.display())];
    let mut store = Store::open(db, &StoreOptions::default()).map_err(|e| fail(&e))?;
    let now = crate::log::now_ms();
    let mut done = Vec::new();
    // As a plugin in direct mode does before allocating: were the boot's
    // recovery left to the daemon, it would release what we record now.
    let boot_id_path = store::boot_id_path(&|name| std::env::var(name).ok());
    if let Some(boot_id) = store::read_boot_id(&boot_id_path) {
        let recovered = store
            .recover_after_reboot(&boot_id, None, now)
            .map_err(|e| fail(&e))?;
        if recovered.released() > 0 {
            done.push(format!(
                "released {} allocation(s) of the previous boot first",
                recovered.released()
            ));
        }
    }
    let mut engine = Engine::new(store);
    for family in [Family::V4, Family::V6] {
        let ranges = ranges_of(conf, family);
        if ranges.is_empty() {
            continue;
        }
        let store = engine.store_mut();
        store
            .configure(
                Source::Cni,
                &conf.network,
                family,
                ranges,
                conf.isolated,
                now,
            )
            .map_err(|e| fail(&e))?;
        store
            .set_bounds(&conf.network, family, &conf.bounds)
            .map_err(|e| fail(&e))?;
    }
    let mut conflicts = Vec::new();
    for ((container, ifname), addresses) in owners {
        let held: Vec<IpAddr> = engine
            .store()
            .check(&conf.network, container, ifname)
            .map_err(|e| fail(&e))?
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
        match engine.allocate(&request(conf, container, ifname, addresses), now) {
            Ok(_) => done.push(format!(
                "recorded {list} for container {container:?} interface {ifname:?}"
            )),
            Err(failure) => conflicts.push(format!(
                "{list} of container {container:?} interface {ifname:?}: {}",
                failure.message
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

/// The ADD an owner's pod would have sent, asking for its addresses.
fn request(
    conf: &NetConf,
    container: &str,
    ifname: &str,
    addresses: &BTreeMap<Family, IpAddr>,
) -> ipam::AllocatePodIpRequest {
    let wanted: Vec<IpAddr> = addresses.values().copied().collect();
    let config = |family: Family| {
        addresses
            .contains_key(&family)
            .then(|| ip_config(conf, family, container, ifname, &wanted))
            .flatten()
    };
    ipam::AllocatePodIpRequest {
        network: conf.network.clone(),
        ipv4_config: config(Family::V4),
        ipv6_config: config(Family::V6),
        pod_name: String::new(),
        pod_namespace: String::new(),
        isolated: conf.isolated,
    }
}

/// Writes every pod allocation of the network inside the config's ranges
/// as a host-local file; refuses, writing nothing, when a file records
/// another owner or an allocation lies outside the config's ranges.
fn export(conf: &NetConf, data_dir: &Path, db: &Path) -> Result<Lines, Lines> {
    let fail = |e: &dyn std::fmt::Display| vec![format!("{}: {e}", db.display())];
    let Some(store) = Store::open_read_only(db).map_err(|e| fail(&e))? else {
        return Err(fail(&"no Metis database here"));
    };
    let table = store
        .list_addresses(&AddressFilter {
            network: Some(conf.network.clone()),
            allocated: Some(true),
            ..AddressFilter::default()
        })
        .map_err(|e| fail(&e))?;
    let column = |name: &str| table.headers.iter().position(|h| h == name);
    let (Some(address_at), Some(container_at), Some(ifname_at)) = (
        column("address"),
        column("container_id"),
        column("interface_name"),
    ) else {
        return Err(fail(
            &"ip_addresses lacks address, container_id or interface_name",
        ));
    };
    let existing = host_local_dir::read(data_dir).map_err(|e| vec![e.0])?;
    let mut to_write = Vec::new();
    let mut lines = Vec::new();
    let mut problems = Vec::new();
    for row in &table.rows {
        let container = &row[container_at];
        if container.is_empty() {
            continue; // a reserved position, not a pod
        }
        let Ok(address) = row[address_at].parse::<IpAddr>() else {
            problems.push(format!("unreadable address {:?}", row[address_at]));
            continue;
        };
        let held = Held {
            address,
            container_id: container.clone(),
            ifname: row[ifname_at].clone(),
        };
        if !ranges_of(conf, Family::of(address))
            .iter()
            .any(|r| r.contains(address))
        {
            problems.push(format!(
                "{address} (container {container:?}) is outside every range of the config: host-local could not hold it"
            ));
        } else if let Some(other) = existing.iter().find(|e| e.address == address) {
            if *other == held {
                lines.push(format!("unchanged {address} container {container:?}"));
            } else {
                problems.push(format!(
                    "{address}: host-local records container {:?} interface {:?}, metis container {container:?} interface {:?}",
                    other.container_id, other.ifname, held.ifname
                ));
            }
        } else {
            to_write.push(held);
        }
    }
    if !problems.is_empty() {
        problems.push("nothing was exported".to_string());
        return Err(problems);
    }
    for held in &to_write {
        host_local_dir::write(data_dir, held).map_err(|e| vec![e.0])?;
        lines.push(format!(
            "wrote {} for container {:?} interface {:?}",
            host_local_dir::path_of(data_dir, held.address).display(),
            held.container_id,
            held.ifname
        ));
    }
    // Durable before the operator swaps the conflist back.
    if !to_write.is_empty() {
        host_local_dir::sync(data_dir).map_err(|e| vec![e.0])?;
    }
    Ok(lines)
}
