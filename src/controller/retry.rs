//! Backoff per object and cause, as client-go's workqueue rate-limits per
//! item: a write refused for one object delays that object only, never
//! the others' grants. Pure: times are passed in.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::informer::Resource;

/// First pause after a 409 (the object was read again: decide again
/// soon) and after any other refusal (the server may be struggling).
const FIRST_CONFLICT_PAUSE: Duration = Duration::from_millis(5);
const FIRST_FAILURE_PAUSE: Duration = Duration::from_millis(500);

/// Why an object's write did not land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    Conflict,
    Failure,
}

#[derive(Debug)]
struct Pause {
    until: Instant,
    cause: Cause,
    /// Refusals in a row for this cause.
    times: u32,
}

/// Objects whose next write waits, by (kind, name).
#[derive(Debug)]
pub struct Retries {
    paused: BTreeMap<(Resource, String), Pause>,
    max: Duration,
}

impl Retries {
    pub fn new(max: Duration) -> Retries {
        Retries {
            paused: BTreeMap::new(),
            max,
        }
    }

    /// Whether the object may be written at `now`.
    pub fn ready(&self, kind: Resource, name: &str, now: Instant) -> bool {
        self.paused
            .get(&(kind, name.to_string()))
            .is_none_or(|p| p.until <= now)
    }

    /// A write of the object was refused for `cause`: it waits twice as
    /// long as after the last refusal of that cause (the first pause of
    /// the cause after another), at most the cap, at least `retry_after`.
    /// Returns whether this is the first refusal in a row (to report once).
    pub fn refused(
        &mut self,
        (kind, name): (Resource, &str),
        cause: Cause,
        now: Instant,
        retry_after: Option<Duration>,
    ) -> bool {
        let key = (kind, name.to_string());
        let times = match self.paused.get(&key) {
            Some(p) if p.cause == cause => p.times.saturating_add(1),
            _ => 1,
        };
        let first = match cause {
            Cause::Conflict => FIRST_CONFLICT_PAUSE,
            Cause::Failure => FIRST_FAILURE_PAUSE,
        };
        let pause = first
            .saturating_mul(1u32.checked_shl(times - 1).unwrap_or(u32::MAX))
            .min(self.max)
            .max(retry_after.unwrap_or_default().min(self.max));
        let until = now + pause;
        self.paused.insert(
            key,
            Pause {
                until,
                cause,
                times,
            },
        );
        times == 1
    }

    /// A write of the object landed: no pause any more.
    pub fn written(&mut self, kind: Resource, name: &str) {
        self.paused.remove(&(kind, name.to_string()));
    }

    /// The first time a paused object may be written again, after `now`.
    pub fn next_due(&self, now: Instant) -> Option<Instant> {
        self.paused
            .values()
            .map(|p| p.until)
            .filter(|at| *at > now)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_objects_refusals_pause_it_alone_and_double() {
        let mut retries = Retries::new(Duration::from_secs(30));
        let t0 = Instant::now();
        let bad = (Resource::Nnc, "bad");
        assert!(retries.refused(bad, Cause::Failure, t0, None));
        assert!(!retries.ready(Resource::Nnc, "bad", t0));
        assert!(retries.ready(Resource::Nnc, "good", t0));
        assert_eq!(retries.next_due(t0), Some(t0 + FIRST_FAILURE_PAUSE));
        assert!(!retries.refused(bad, Cause::Failure, t0, None));
        assert_eq!(retries.next_due(t0), Some(t0 + 2 * FIRST_FAILURE_PAUSE));
        for _ in 0..20 {
            retries.refused(bad, Cause::Failure, t0, None);
        }
        assert_eq!(retries.next_due(t0), Some(t0 + Duration::from_secs(30)));
        // A conflict is its own cause: it starts small.
        assert!(retries.refused(bad, Cause::Conflict, t0, None));
        assert_eq!(retries.next_due(t0), Some(t0 + FIRST_CONFLICT_PAUSE));
        // The server's Retry-After is obeyed, within the cap.
        retries.refused(bad, Cause::Failure, t0, Some(Duration::from_secs(7)));
        assert_eq!(retries.next_due(t0), Some(t0 + Duration::from_secs(7)));
        retries.written(Resource::Nnc, "bad");
        assert!(retries.ready(Resource::Nnc, "bad", t0));
        assert_eq!(retries.next_due(t0), None);
    }
}
