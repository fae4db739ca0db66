//! `metis admin check`: verifies a database's invariants read-only and
//! prints a readable report; exit 0 when every invariant holds, 1 when one
//! fails or the database cannot be read, 2 on a usage error.

use std::io::Write;
use std::path::PathBuf;

use super::{ArgsError, CommandError};

use crate::flags::{self, FlagSpec};
use crate::store::{self, Depth};

const FLAGS: &[FlagSpec] = &[
    flags::db_path_flag("the database to check (opened read-only; nothing is changed)"),
    FlagSpec {
        name: "--quick",
        value: None,
        repeatable: false,
        default: "",
        help: "run SQLite's quick_check instead of the full integrity_check",
    },
];

/// What to check, and how deeply.
#[derive(Debug)]
pub struct Options {
    path: PathBuf,
    depth: Depth,
}

pub fn parse(args: &[String]) -> Result<Options, ArgsError> {
    let parsed = flags::parse(FLAGS, args).map_err(|err| ArgsError::from_flags(err, usage()))?;
    Ok(Options {
        path: flags::db_path(&parsed),
        depth: match parsed.has("--quick") {
            true => Depth::Quick,
            false => Depth::Full,
        },
    })
}

/// Prints the report; a failed invariant is a failure already reported.
pub fn run(options: &Options, out: &mut dyn Write) -> Result<(), CommandError> {
    let report = store::check_file(&options.path, options.depth).map_err(CommandError::failed)?;
    let _ = write!(
        out,
        "{}",
        report.describe(&options.path.display().to_string())
    );
    match report.is_ok() {
        true => Ok(()),
        false => Err(CommandError::Failed(Vec::new())),
    }
}

fn usage() -> String {
    flags::usage(
        "metis admin check",
        "Verify a Metis database read-only: SQLite integrity, schema version, block counters, \
         no address held twice, one address per owner and family, rows inside their block, \
         reservations. Exits 1 when a check fails.",
        FLAGS,
    )
}
