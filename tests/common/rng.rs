//! A small seeded pseudo-random generator for randomized tests (xorshift64*):
//! no dependency, and a failing run can be replayed from its printed seed.

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
