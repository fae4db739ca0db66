//! `metis admin downgrade`: readies a database for upstream Metis (the
//! rollback step in docs/operations.md). Refuses while a daemon holds the
//! database, and changes nothing on a file it cannot vouch for (missing,
//! not a database, a newer schema, read-only). Idempotent: a second run
//! says there is nothing to do. Exit 0 when the file is ready, 1 when it
//! was refused or failed, 2 on a usage error.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{ArgsError, CommandError};

use crate::flags::{self, FlagSpec};
use crate::store::upkeep::downgrade::{self, FileKind};
use crate::store::{Store, StoreOptions};

const FLAGS: &[FlagSpec] = &[flags::db_path_flag(
    "the database to ready for upstream (no daemon may hold it)",
)];

/// The database to ready.
#[derive(Debug)]
pub struct Options {
    path: PathBuf,
}

pub fn parse(args: &[String]) -> Result<Options, ArgsError> {
    let parsed = flags::parse(FLAGS, args).map_err(|err| ArgsError::from_flags(err, usage()))?;
    Ok(Options {
        path: flags::db_path(&parsed),
    })
}

pub fn run(options: &Options, out: &mut dyn Write) -> Result<(), CommandError> {
    downgrade_file(&options.path, out)
        .map_err(|why| CommandError::failed(format!("{}: {why}", options.path.display())))
}

fn downgrade_file(path: &Path, out: &mut dyn Write) -> Result<(), String> {
    let shown = path.display();
    match downgrade::inspect(path).map_err(|r| r.to_string())? {
        FileKind::UpstreamOnly => {
            let _ = writeln!(
                out,
                "{shown}: only upstream has written this database; nothing to do"
            );
            return Ok(());
        }
        FileKind::Metis => {}
    }
    // Held until the end: a daemon started meanwhile waits for it.
    let _ownership = crate::store::db::ownership::try_hold(path)
        .map_err(|e| format!("cannot lock {}: {e}", crate::store::db::ownership::lock_path(path).display()))?
        .ok_or_else(|| {
            format!(
                "a daemon holds this database (its lock {} is taken); stop the daemon \
                 (remove the DaemonSet's pod from the node) and run this again; nothing was changed",
                crate::store::db::ownership::lock_path(path).display()
            )
        })?;
    let mut store = Store::open(path, &StoreOptions::default()).map_err(|e| e.to_string())?;
    for line in store.open_warnings() {
        let _ = writeln!(out, "{shown}: {line}");
    }
    let done = store
        .downgrade(crate::log::now_ms())
        .map_err(|e| e.to_string())?;
    for line in &done.done {
        let _ = writeln!(out, "{shown}: {line}");
    }
    for line in &done.warnings {
        let _ = writeln!(out, "{shown}: warning: {line}");
    }
    let verdict = match done.done.is_empty() {
        true => "already ready for upstream Metis; nothing to do",
        false => "ready for upstream Metis",
    };
    let _ = writeln!(out, "{shown}: {verdict}");
    Ok(())
}

fn usage() -> String {
    flags::usage(
        "metis admin downgrade",
        "Ready a Metis database for upstream Metis (a rollback): write every row of its IPv4 \
         blocks, keep retired and quarantined blocks out of upstream's reach, keep host-local \
         bounds as reserved rows, and stop upstream's IPv6 expansion past rangeEnd. Stop the \
         daemon first. Idempotent.",
        FLAGS,
    )
}
