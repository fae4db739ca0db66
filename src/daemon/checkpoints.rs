//! The daemon's checkpoint thread, started at start-up and again after a
//! restore reopens the database.

use std::path::Path;

use crate::log;
use crate::store::{Checkpointer, Store};

/// Moves WAL checkpoints off the loop (see `store::checkpoint`). Without
/// the thread, SQLite's own checkpoints in the loop go on, as in direct mode.
pub(super) fn defer_checkpoints(store: &Store, db_path: &Path) -> Option<Checkpointer> {
    let checkpointer = match Checkpointer::start(db_path) {
        Ok(checkpointer) => checkpointer,
        Err(err) => {
            log::warn(
                "daemon",
                "no checkpoint thread; requests checkpoint the WAL themselves",
                &[("error", &err)],
            );
            return None;
        }
    };
    if let Err(err) = store.defer_checkpoints() {
        log::warn(
            "daemon",
            "could not raise the loop's checkpoint threshold",
            &[("error", &err)],
        );
    }
    Some(checkpointer)
}
