//! `metis admin check`: verifies a database's invariants read-only and
//! prints a readable report; exit 0 when every invariant holds, 1 when one
//! fails or the database cannot be read, 2 on a usage error.

use std::io::Write;

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

/// Exit status: every invariant holds.
pub const EXIT_OK: u8 = 0;
/// Exit status: an invariant fails or the database cannot be read.
pub const EXIT_PROBLEMS: u8 = 1;
/// Exit status: bad command line (every command's).
pub use crate::flags::EXIT_USAGE;

/// Runs `metis admin check ARGS` and returns the exit status.
pub fn run(args: &[String], out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let parsed = match flags::or_usage(
        flags::parse(FLAGS, args),
        "metis admin check",
        usage,
        out,
        err,
    ) {
        Ok(parsed) => parsed,
        Err(status) => return status,
    };
    let path = flags::db_path(&parsed);
    let depth = if parsed.has("--quick") {
        Depth::Quick
    } else {
        Depth::Full
    };
    match store::check_file(&path, depth) {
        Ok(report) => {
            let _ = write!(out, "{}", report.describe(&path.display().to_string()));
            if report.is_ok() {
                EXIT_OK
            } else {
                EXIT_PROBLEMS
            }
        }
        Err(e) => {
            let _ = writeln!(err, "metis admin check: {e}");
            EXIT_PROBLEMS
        }
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
