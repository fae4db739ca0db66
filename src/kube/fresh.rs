//! The freshness rule, one for the node and the controller: a copy of an
//! object from a watch or a list never replaces a copy this process read
//! or wrote later. Resource versions are opaque (compared for equality,
//! never ordered), so the order comes from the stream and from the API
//! server's linearizable answers: a GET, or the answer to a write, is at
//! least as new as every copy the stream delivered before it arrived,
//! unless the stream already delivered that very version (then the
//! stream's later copies are newer). After adopting such a copy the
//! stream's copies are skipped until it delivers that version; a relist
//! (a new epoch) or a deletion ends the wait.

use std::collections::VecDeque;

/// Versions of one epoch remembered as delivered. A node's object changes
/// a few times a minute; an answer is handled within seconds.
const REMEMBERED: usize = 256;

/// Whether a copy is the newest this process knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fresh {
    /// Newer than the copy held: adopt it.
    Newer,
    /// Not newer than the copy held (an older one, or the same): skip it.
    Stale,
}

/// What one process knows of one object's versions.
#[derive(Debug, Default)]
pub struct Freshness {
    epoch: u64,
    /// Versions the stream delivered in this epoch, oldest first.
    delivered: VecDeque<String>,
    /// A version read or written outside the stream that the stream has
    /// not delivered yet: its copies before it are older.
    awaiting: Option<String>,
}

impl Freshness {
    /// A copy the stream delivered (a list starts epoch `epoch`, its watch
    /// continues it).
    pub fn streamed(&mut self, epoch: u64, version: &str) -> Fresh {
        self.enter(epoch);
        if self.delivered.len() == REMEMBERED {
            self.delivered.pop_front();
        }
        self.delivered.push_back(version.to_string());
        match self.awaiting.as_deref() {
            None => Fresh::Newer,
            Some(awaited) => {
                if awaited == version {
                    // Caught up: what follows is newer than the copy held.
                    self.awaiting = None;
                }
                Fresh::Stale
            }
        }
    }

    /// A copy read (GET) or written (a write's answer) outside the stream,
    /// by a request sent in stream epoch `epoch`.
    pub fn fetched(&mut self, epoch: u64, version: &str) -> Fresh {
        if epoch != self.epoch || self.delivered.iter().any(|v| v == version) {
            // A relist came in between (its copy is as new), or the stream
            // already delivered this version and maybe later ones.
            return Fresh::Stale;
        }
        self.awaiting = Some(version.to_string());
        Fresh::Newer
    }

    /// The stream (of epoch `epoch`) says the object was deleted, or a
    /// list found none: nothing is awaited from it.
    pub fn gone(&mut self, epoch: u64) {
        self.enter(epoch);
        self.awaiting = None;
    }

    /// A new epoch forgets the versions of the last (after an etcd restore
    /// the same versions come again) and ends any wait.
    fn enter(&mut self, epoch: u64) {
        if epoch != self.epoch {
            self.epoch = epoch;
            self.delivered.clear();
            self.awaiting = None;
        }
    }

    /// The stream epoch of the copies seen last.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lagging_watch_never_replaces_a_copy_read_or_written_later() {
        let mut fresh = Freshness::default();
        assert_eq!(fresh.streamed(1, "105"), Fresh::Newer);
        // A PATCH from 105 answered 107 (the controller wrote 106 and 107
        // in between... or our write was 106 and the controller's 107).
        assert_eq!(fresh.fetched(1, "107"), Fresh::Newer);
        // The watch lags: 106, then 107 itself, are not news.
        assert_eq!(fresh.streamed(1, "106"), Fresh::Stale);
        assert_eq!(fresh.streamed(1, "107"), Fresh::Stale);
        // Caught up: the stream's copies are the truth again.
        assert_eq!(fresh.streamed(1, "108"), Fresh::Newer);
    }

    #[test]
    fn versions_are_never_ordered() {
        let mut fresh = Freshness::default();
        fresh.streamed(1, "zz");
        assert_eq!(
            fresh.fetched(1, "aa"),
            Fresh::Newer,
            "not sorted: equal only"
        );
        assert_eq!(fresh.streamed(1, "b"), Fresh::Stale);
        assert_eq!(fresh.streamed(1, "aa"), Fresh::Stale);
        assert_eq!(fresh.streamed(1, "0"), Fresh::Newer);
    }

    #[test]
    fn a_copy_the_stream_already_delivered_is_not_news() {
        let mut fresh = Freshness::default();
        fresh.streamed(1, "5");
        fresh.streamed(1, "6");
        // A GET answered 5, handled after the stream brought 6.
        assert_eq!(fresh.fetched(1, "5"), Fresh::Stale);
        assert_eq!(fresh.fetched(1, "6"), Fresh::Stale, "the same copy");
        assert_eq!(fresh.streamed(1, "7"), Fresh::Newer, "nothing awaited");
    }

    #[test]
    fn a_relist_or_a_deletion_ends_the_wait() {
        let mut fresh = Freshness::default();
        fresh.streamed(1, "5");
        assert_eq!(fresh.fetched(1, "9"), Fresh::Newer);
        // A relist: its copy is a read of what is true now.
        assert_eq!(fresh.streamed(2, "8"), Fresh::Newer);
        assert_eq!(fresh.epoch(), 2);
        // An answer to a request sent before the relist is not adopted
        // (after an etcd restore the same version names another content).
        assert_eq!(fresh.fetched(1, "10"), Fresh::Stale);
        assert_eq!(fresh.fetched(2, "10"), Fresh::Newer);
        fresh.gone(2);
        assert_eq!(fresh.streamed(2, "11"), Fresh::Newer);
    }

    #[test]
    fn memory_is_bounded() {
        let mut fresh = Freshness::default();
        for i in 0..(REMEMBERED + 10) {
            fresh.streamed(1, &i.to_string());
        }
        assert_eq!(fresh.delivered.len(), REMEMBERED);
        let last = (REMEMBERED + 9).to_string();
        assert_eq!(fresh.fetched(1, &last), Fresh::Stale);
    }
}
