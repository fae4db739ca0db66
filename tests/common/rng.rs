//! A small seeded pseudo-random generator for randomized tests (xorshift64*):
//! no dependency, and a failing run can be replayed from its printed seed.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{SystemTime, UNIX_EPOCH};

pub struct Rng(u64);

impl Rng {
    /// Seeded from `var` in the environment if set, else from the clock;
    /// the seed is printed so a failure can be replayed.
    pub fn from_env(var: &str) -> Rng {
        let seed = std::env::var(var)
            .ok()
            .and_then(|text| text.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs() ^ u64::from(d.subsec_nanos()) << 20)
                    .unwrap_or(1)
            });
        eprintln!("{var}={seed}");
        Rng::new(seed)
    }

    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `0..n` (`n` > 0), as an index.
    pub fn index(&mut self, n: usize) -> usize {
        let n = u64::try_from(n).unwrap_or(u64::MAX);
        usize::try_from(self.below(n)).unwrap_or(0)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64().to_le_bytes()[0]).collect()
    }

    /// An independent generator for another thread.
    pub fn fork(&mut self) -> Rng {
        Rng::new(self.next_u64())
    }
}

/// A number from the environment, or `default`.
pub fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(default)
}

/// Runs seeded sequences of a model-based test: `{prefix}_SEQUENCES` of
/// `{prefix}_STEPS` steps (`defaults` when unset), every sequence's seed
/// derived from `{prefix}_SEED` (printed), starting at sequence
/// `{prefix}_FIRST`. `run(seed, steps, trace)` runs one, appending what it
/// did to `trace`; the first failure (an `Err` or a panic) panics with the
/// command that replays that sequence alone (`test`: its path, e.g.
/// `model::name`) and the trace. Returns what every sequence returned.
pub fn run_sequences<T>(
    prefix: &str,
    test: &str,
    defaults: (u64, u64),
    run: impl Fn(u64, u64, &mut Vec<String>) -> Result<T, String>,
) -> Vec<T> {
    let sequences = env_number(&format!("{prefix}_SEQUENCES"), defaults.0);
    let steps = env_number(&format!("{prefix}_STEPS"), defaults.1);
    let first = env_number(&format!("{prefix}_FIRST"), 0);
    let mut seeds = Rng::from_env(&format!("{prefix}_SEED"));
    let mut done = Vec::new();
    for i in 0..first + sequences {
        let seed = seeds.next_u64();
        if i < first {
            continue;
        }
        let mut trace = Vec::new();
        let failure = match catch_unwind(AssertUnwindSafe(|| run(seed, steps, &mut trace))) {
            Ok(Ok(value)) => {
                done.push(value);
                continue;
            }
            Ok(Err(failure)) => failure,
            Err(payload) => panic_text(payload.as_ref()),
        };
        panic!(
            "sequence {i} failed after {} steps: {failure}\n\
             replay: {prefix}_SEED=<printed above> {prefix}_FIRST={i} {prefix}_SEQUENCES=1 \
             {prefix}_STEPS={steps} cargo test --locked --test integration {test}\nsteps:\n  {}",
            trace.len().saturating_sub(2),
            trace.join("\n  ")
        );
    }
    done
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}
