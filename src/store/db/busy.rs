//! Lock contention between the processes that share the database: what
//! SQLite said and at which step, and waiting it out.
//!
//! The 5 s busy timeout covers most waits: SQLite calls its handler while
//! another connection holds a lock this one needs. Where it does not — a
//! connection holding a read lock that needs the write lock (SQLite answers
//! at once rather than deadlock), as `PRAGMA journal_mode=WAL` does on a
//! file no process has made a database yet — and where a wait outlasts the
//! timeout on a loaded node, the whole step is tried again ([`patiently`]):
//! each is an open, or one request's transaction, and leaves nothing when
//! it fails.

use std::time::{Duration, Instant};

use super::types::StoreError;
use crate::log;

/// First pause between attempts; doubles up to [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(2);
const LONGEST_PAUSE: Duration = Duration::from_millis(100);

/// Names the step a busy error struck, where it is not named yet.
pub(crate) trait During<T> {
    fn during(self, step: &'static str) -> Result<T, StoreError>;
}

impl<T, E: Into<StoreError>> During<T> for Result<T, E> {
    fn during(self, step: &'static str) -> Result<T, StoreError> {
        self.map_err(|err| match err.into() {
            StoreError::Busy { during: "", source } => StoreError::Busy {
                during: step,
                source,
            },
            other => other,
        })
    }
}

/// An error that may mean only that another process held the lock: the
/// attempt that met it left nothing and may be made again as a whole.
pub trait Contended {
    fn contended(&self) -> bool;
}

impl Contended for StoreError {
    fn contended(&self) -> bool {
        matches!(self, StoreError::Busy { .. })
    }
}

/// Runs `attempt` again while it fails with a busy error, pausing a little
/// longer each time (with jitter, so that processes that collided do not
/// collide again), until `patience` has passed; then returns the last
/// error. Each retry is logged (`what` names the attempt): the first at
/// info, the rest at debug.
pub fn patiently<T, E: Contended + std::fmt::Display>(
    what: &str,
    patience: Duration,
    mut attempt: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = Instant::now() + patience;
    let mut pause = FIRST_PAUSE;
    let mut tries: u32 = 1;
    loop {
        let err = match attempt() {
            Err(err) if err.contended() => err,
            done => return done,
        };
        let wait = jitter(pause);
        if Instant::now() + wait >= deadline {
            if tries > 1 {
                log::warn(
                    "store",
                    "database still busy; giving up",
                    &[("what", &what), ("tries", &tries), ("error", &err)],
                );
            }
            return Err(err);
        }
        let fields: [(&str, &dyn std::fmt::Display); 3] =
            [("what", &what), ("try", &tries), ("error", &err)];
        match tries {
            1 => log::info("store", "database busy; trying again", &fields),
            _ => log::debug("store", "database busy; trying again", &fields),
        }
        std::thread::sleep(wait);
        pause = pause.saturating_mul(2).min(LONGEST_PAUSE);
        tries = tries.saturating_add(1);
    }
}

/// `pause` ± up to half of it, drawn from the clock and the process id.
fn jitter(pause: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.subsec_nanos());
    let seed = u64::from(nanos ^ std::process::id().rotate_left(16));
    let micros = u64::try_from(pause.as_micros()).unwrap_or(u64::MAX / 4);
    let half = micros / 2;
    if half == 0 {
        return pause;
    }
    Duration::from_micros(micros - half + seed % (2 * half + 1))
}

#[cfg(test)]
mod tests {
    use rusqlite::ffi;

    use super::*;

    fn busy(extended: i32) -> StoreError {
        StoreError::from(rusqlite::Error::SqliteFailure(
            ffi::Error::new(extended),
            None,
        ))
    }

    #[test]
    fn a_busy_error_names_its_extended_code_and_step() {
        let err = Err::<(), _>(busy(ffi::SQLITE_BUSY_SNAPSHOT))
            .during("BEGIN IMMEDIATE")
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("database is busy"), "{text}");
        assert!(text.contains("SQLITE_BUSY_SNAPSHOT"), "{text}");
        assert!(text.contains("at BEGIN IMMEDIATE"), "{text}");
        // The innermost step is kept.
        let outer = Err::<(), _>(err).during("open").unwrap_err().to_string();
        assert!(outer.contains("at BEGIN IMMEDIATE"), "{outer}");
        let plain = busy(ffi::SQLITE_LOCKED).to_string();
        assert!(plain.contains("(SQLITE_LOCKED)"), "{plain}");
        let other = super::super::types::code_name(&rusqlite::Error::SqliteFailure(
            ffi::Error::new(1234),
            None,
        ));
        assert_eq!(other, "SQLite result 1234");
        // Other errors pass through unnamed.
        let full = Err::<(), _>(busy(ffi::SQLITE_FULL)).during("COMMIT");
        assert!(matches!(full, Err(StoreError::Sqlite(_))));
    }

    #[test]
    fn busy_attempts_are_retried_until_one_answers() {
        let mut left = 3;
        let done = patiently::<_, StoreError>("test", Duration::from_secs(60), || {
            left -= 1;
            match left {
                0 => Ok("served"),
                _ => Err(busy(ffi::SQLITE_BUSY)),
            }
        });
        assert_eq!(done.unwrap(), "served");
        assert_eq!(left, 0);
    }

    #[test]
    fn other_errors_are_not_retried_and_patience_ends() {
        let mut tries = 0;
        let err = patiently::<(), _>("test", Duration::from_secs(60), || {
            tries += 1;
            Err(StoreError::EmptyOwner)
        });
        assert!(matches!(err, Err(StoreError::EmptyOwner)));
        assert_eq!(tries, 1);
        let mut tries = 0;
        let err = patiently::<(), _>("test", Duration::from_millis(30), || {
            tries += 1;
            Err(busy(ffi::SQLITE_BUSY_RECOVERY))
        });
        assert!(
            err.unwrap_err()
                .to_string()
                .contains("SQLITE_BUSY_RECOVERY")
        );
        assert!(tries > 1, "{tries}");
    }

    #[test]
    fn jitter_stays_within_half_the_pause() {
        let pauses = [FIRST_PAUSE, LONGEST_PAUSE, Duration::from_micros(1)];
        for pause in pauses.into_iter().cycle().take(3000) {
            let wait = jitter(pause);
            assert!(
                wait >= pause / 2 && wait <= pause + pause / 2,
                "{pause:?} {wait:?}"
            );
        }
    }
}
