//! `metis admin downgrade`: readies a database for upstream Metis (the
//! rollback step in docs/operations.md). Refuses while a daemon holds the
//! database, and changes nothing on a file it cannot vouch for (missing,
//! not a database, a newer schema, read-only). Idempotent: a second run
//! says there is nothing to do. Exit 0 when the file is ready, 1 when it
//! was refused or failed, 2 on a usage error.

use std::io::Write;
use std::path::Path;

use crate::flags::{self, FlagSpec};
use crate::store::upkeep::downgrade::{self, FileKind};
use crate::store::{Store, StoreOptions};

const FLAGS: &[FlagSpec] = &[flags::db_path_flag(
    "the database to ready for upstream (no daemon may hold it)",
)];

/// Exit status: the database is ready for upstream.
pub const EXIT_OK: u8 = 0;
/// Exit status: refused (a daemon holds it, bad file) or failed.
pub const EXIT_REFUSED: u8 = 1;
/// Exit status: bad command line (every command's).
pub use crate::flags::EXIT_USAGE;

/// Runs `metis admin downgrade ARGS` and returns the exit status.
pub fn run(args: &[String], out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let parsed = match flags::or_usage(
        flags::parse(FLAGS, args),
        "metis admin downgrade",
        usage,
        out,
        err,
    ) {
        Ok(parsed) => parsed,
        Err(status) => return status,
    };
    let path = flags::db_path(&parsed);
    match downgrade_file(&path, out) {
        Ok(()) => EXIT_OK,
        Err(why) => {
            let _ = writeln!(err, "metis admin downgrade: {}: {why}", path.display());
            EXIT_REFUSED
        }
    }
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
