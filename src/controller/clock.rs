//! The clock the controller's fences and delays count on: the Lease's
//! renew deadline and lease duration, reclaim delays and the node grace.
//! It is `CLOCK_BOOTTIME`, which keeps counting while the machine is
//! suspended; std's `Instant` (`CLOCK_MONOTONIC` on Linux) stands still
//! then, so a leader resumed after a long suspend would still believe it
//! renewed a moment ago and write beside its successor.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nix::time::{ClockId, clock_gettime};

/// A point on the boot clock (time since boot, suspends included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BootInstant(Duration);

impl BootInstant {
    pub fn now() -> BootInstant {
        match clock_gettime(ClockId::CLOCK_BOOTTIME) {
            Ok(now) => BootInstant(Duration::from(now)),
            // Kernels before 2.6.39 lack it: a suspend is then not counted,
            // as with std's clock.
            Err(_) => BootInstant(process_origin().elapsed()),
        }
    }

    /// The time since this instant (zero for one ahead of now).
    pub fn elapsed(&self) -> Duration {
        BootInstant::now().0.saturating_sub(self.0)
    }

    pub fn checked_sub(&self, earlier: Duration) -> Option<BootInstant> {
        self.0.checked_sub(earlier).map(BootInstant)
    }
}

/// The fallback clock's origin: the first time it was read.
fn process_origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock is the kernel's boot clock, not the fallback's count
    /// from this process's first reading.
    #[test]
    fn the_clock_read_is_the_boot_clock() {
        let before = Duration::from(clock_gettime(ClockId::CLOCK_BOOTTIME).unwrap());
        let read = BootInstant::now().0;
        let after = Duration::from(clock_gettime(ClockId::CLOCK_BOOTTIME).unwrap());
        assert!(
            before <= read && read <= after,
            "{before:?} {read:?} {after:?}"
        );
    }

    #[test]
    fn elapsed_follows_the_clock_and_never_goes_negative() {
        let before = BootInstant::now();
        let later = before.checked_sub(Duration::from_secs(5)).unwrap();
        assert!(later.elapsed() >= Duration::from_secs(5));
        assert!(before <= BootInstant::now());
        let ahead = BootInstant(before.0 + Duration::from_secs(60));
        assert_eq!(ahead.elapsed(), Duration::ZERO);
    }
}
