//! Pacing of API requests, as client-go paces its informers: exponential
//! backoff with jitter after failures, `Retry-After` honoured, and watches
//! that stay open for a random 1–2× `--api-watch-timeout`. The numbers
//! that bound a node's request rate live here (docs/operations.md derives
//! the cluster-wide budget from them).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Pause after the first failure.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// A server asking for a longer pause than this gets this: growth stops
/// while we wait, so an absurd `Retry-After` must not stop it for hours.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// How the API threads pace themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiTiming {
    /// Each watch asks the server to end it after a random 1–2× this
    /// (client-go: 5–10 min); an idle node sends one request per watch.
    pub watch_timeout: Duration,
    /// The backoff step stops doubling here.
    pub max_backoff: Duration,
}

/// Exponential backoff with jitter. The step starts at [`FIRST_BACKOFF`]
/// (or the cap, if lower) and doubles per failure up to the cap; each
/// pause is the step plus up to half of it again, so after many failures
/// no pause is shorter than the cap. Only [`Backoff::reset`] (a full
/// successful cycle) brings the step back down.
#[derive(Debug)]
pub struct Backoff {
    step: Duration,
    max: Duration,
    failures: u32,
    rng: Rng,
}

impl Backoff {
    pub fn new(max: Duration) -> Backoff {
        Backoff {
            step: FIRST_BACKOFF.min(max),
            max,
            failures: 0,
            rng: Rng::seeded(),
        }
    }

    /// The pause before the next attempt after a failure; a server's
    /// `Retry-After` is a floor.
    pub fn next(&mut self, retry_after: Option<Duration>) -> Duration {
        let jitter = self.step.mul_f64(self.rng.unit() / 2.0);
        let pause = self
            .step
            .saturating_add(jitter)
            .max(retry_after.unwrap_or_default().min(MAX_RETRY_AFTER));
        self.step = self.step.saturating_mul(2).min(self.max);
        self.failures = self.failures.saturating_add(1);
        pause
    }

    /// Failures since the last reset.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn reset(&mut self) {
        self.step = FIRST_BACKOFF.min(self.max);
        self.failures = 0;
    }

    /// A watch timeout in seconds: 1–2× `base`, at least one second.
    pub fn watch_seconds(&mut self, base: Duration) -> u64 {
        let spread = base.mul_f64(self.rng.unit());
        base.saturating_add(spread).as_secs().max(1)
    }
}

/// xorshift64*: jitter needs spread, not secrecy, and no dependency.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn seeded() -> Rng {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let nanos = since_epoch
            .as_secs()
            .wrapping_mul(1_000_000_000)
            .wrapping_add(u64::from(since_epoch.subsec_nanos()));
        // Mix in the pid so nodes started together still spread out.
        let seed = nanos ^ (u64::from(std::process::id()) << 32);
        Rng(seed | 1)
    }

    /// A number in [0, 1).
    fn unit(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        let bits = x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11;
        bits as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_with_jitter_up_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_secs(4));
        let mut floors = Vec::new();
        for _ in 0..6 {
            let pause = backoff.next(None);
            floors.push(pause);
        }
        let steps = [500, 1000, 2000, 4000, 4000, 4000];
        for (pause, step) in floors.iter().zip(steps) {
            let step = Duration::from_millis(step);
            assert!(*pause >= step && *pause < step.mul_f64(1.5), "{pause:?}");
        }
        assert_eq!(backoff.failures(), 6);
        backoff.reset();
        assert!(backoff.next(None) < Duration::from_millis(750));
    }

    #[test]
    fn retry_after_is_a_floor_with_a_cap() {
        let mut backoff = Backoff::new(Duration::from_secs(60));
        assert!(backoff.next(Some(Duration::from_secs(7))) >= Duration::from_secs(7));
        assert_eq!(
            backoff.next(Some(Duration::from_secs(86_400))),
            MAX_RETRY_AFTER
        );
    }

    #[test]
    fn watch_timeouts_spread_between_one_and_two_times() {
        let mut backoff = Backoff::new(Duration::from_secs(60));
        let base = Duration::from_secs(300);
        let seconds: Vec<u64> = (0..200).map(|_| backoff.watch_seconds(base)).collect();
        assert!(seconds.iter().all(|s| (300..600).contains(s)));
        assert!(seconds.iter().any(|s| *s < 400) && seconds.iter().any(|s| *s > 500));
        assert_eq!(backoff.watch_seconds(Duration::ZERO), 1);
    }
}
