//! The freshness rule, one for the node and the controller: a copy of an
//! object from a watch or a list never replaces a copy this process read
//! or wrote later. Resource versions are opaque (compared for equality,
//! never ordered), so the order comes from the stream and from the API
//! server's linearizable answers: a GET, or the answer to a write, is at
//! least as new as every copy the stream delivered before it arrived,
//! unless the stream already delivered that very version (then the
//! stream's later copies are newer). After adopting such a copy the
//! stream's copies are skipped until it delivers that version; a relist
//! (a new epoch) or a deletion ends the wait. An answer at a version the
//! stream delivered before the request went out, other than the one it
//! was sent from, is older than what the server already said: its state
//! went back (etcd restored without new versions); so is one the stream
//! delivered since, while the request's base, an answer, is still awaited
//! (the stream went past it without it). The controller's view
//! shares the stream's side ([`against_awaited`]); it keeps no history of
//! delivered versions for its thousands of objects, so it judges an answer
//! only against the version it holds (`controller::cache`).

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
    /// An answer older than the copy its request was sent from: the
    /// server's state went back. The truth now; the versions the epoch
    /// delivered are forgotten (they may name other contents now).
    Back,
}

/// A copy the stream delivered, against the version `awaited` (read or
/// written outside the stream, not delivered yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Streamed {
    /// Nothing awaited: the truth now.
    News,
    /// Older than the copy held: the stream still catches up.
    Behind,
    /// The awaited version itself: the copy held already; what follows
    /// is newer.
    Reached,
}

/// The stream's side of the rule, for the node ([`Freshness`]) and the
/// controller's view alike.
pub fn against_awaited(awaited: Option<&str>, version: &str) -> Streamed {
    match awaited {
        None => Streamed::News,
        Some(awaited) if awaited == version => Streamed::Reached,
        Some(_) => Streamed::Behind,
    }
}

/// Where a request stood in the stream when it went out: the version it
/// was sent from (the copy held then) and how many copies the epoch had
/// delivered ([`Freshness::position`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    pub base: String,
    pub epoch: u64,
    pub position: u64,
}

/// What one process knows of one object's versions.
#[derive(Debug, Default)]
pub struct Freshness {
    epoch: u64,
    /// Versions the stream delivered in this epoch, oldest first.
    delivered: VecDeque<String>,
    /// How many copies the stream delivered in this epoch (the last of
    /// `delivered` is the `count`-th).
    count: u64,
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
        self.count += 1;
        match against_awaited(self.awaiting.as_deref(), version) {
            Streamed::News => Fresh::Newer,
            Streamed::Behind => Fresh::Stale,
            Streamed::Reached => {
                self.awaiting = None;
                Fresh::Stale
            }
        }
    }

    /// A copy read (GET) or written (a write's answer) outside the stream,
    /// by the request `asked`.
    pub fn fetched(&mut self, asked: &Asked, version: &str) -> Fresh {
        if asked.epoch != self.epoch {
            // A relist came in between: its copy is as new.
            return Fresh::Stale;
        }
        let Some(index) = self.delivered.iter().position(|v| v == version) else {
            self.awaiting = Some(version.to_string());
            return Fresh::Newer;
        };
        let position = self.count - (self.delivered.len() - index) as u64;
        let base_awaited = self.awaiting.as_deref() == Some(asked.base.as_str());
        if version == asked.base || position >= asked.position && !base_awaited {
            // The copy it was sent from, or delivered since the request
            // went out (the stream may be past it).
            return Fresh::Stale;
        }
        // The stream delivered this version before the request's base,
        // which the server had answered or sent already; or after the
        // request went out, yet never that base (an answer this process
        // awaits): either way the server's state went back. Its versions
        // of this epoch may name other contents now.
        self.delivered.clear();
        self.awaiting = None;
        Fresh::Back
    }

    /// How many copies the stream delivered in this epoch: a request sent
    /// now records it ([`Asked`]).
    pub fn position(&self) -> u64 {
        self.count
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
            self.count = 0;
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

    /// A request sent now from `base`.
    fn sent(fresh: &Freshness, base: &str) -> Asked {
        Asked {
            base: base.into(),
            epoch: fresh.epoch(),
            position: fresh.position(),
        }
    }

    #[test]
    fn a_lagging_watch_never_replaces_a_copy_read_or_written_later() {
        let mut fresh = Freshness::default();
        assert_eq!(fresh.streamed(1, "105"), Fresh::Newer);
        // A PATCH from 105 answered 107 (the controller wrote 106 and 107
        // in between... or our write was 106 and the controller's 107).
        let patch = sent(&fresh, "105");
        assert_eq!(fresh.fetched(&patch, "107"), Fresh::Newer);
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
        let patch = sent(&fresh, "zz");
        assert_eq!(
            fresh.fetched(&patch, "aa"),
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
        let patch = sent(&fresh, "5");
        fresh.streamed(1, "6");
        // A GET after the patch's 409 answered 5 or 6, handled after the
        // stream brought 6: the stream is as far.
        assert_eq!(fresh.fetched(&patch, "5"), Fresh::Stale, "its base");
        assert_eq!(fresh.fetched(&patch, "6"), Fresh::Stale, "the same copy");
        assert_eq!(fresh.streamed(1, "7"), Fresh::Newer, "nothing awaited");
    }

    /// Only a server whose state went back answers a request with a
    /// version the stream delivered before the copy it was sent from
    /// (etcd restored without `--bump-revision`): the answer is the truth
    /// now, and the versions delivered before it mean nothing any more.
    #[test]
    fn an_answer_older_than_the_copy_it_was_sent_from_is_the_state_going_back() {
        let mut fresh = Freshness::default();
        fresh.streamed(1, "5");
        fresh.streamed(1, "6");
        let patch = sent(&fresh, "6");
        assert_eq!(fresh.fetched(&patch, "5"), Fresh::Back);
        // The next write lands at a version handed out before: news.
        let patch = sent(&fresh, "5");
        assert_eq!(fresh.fetched(&patch, "6"), Fresh::Newer);
        assert_eq!(fresh.streamed(1, "6"), Fresh::Stale, "awaited");
        assert_eq!(fresh.streamed(1, "7"), Fresh::Newer);
        // Also when the base came from outside the stream.
        let patch = sent(&fresh, "7");
        assert_eq!(fresh.fetched(&patch, "9"), Fresh::Newer);
        let read = sent(&fresh, "9");
        assert_eq!(fresh.fetched(&read, "7"), Fresh::Back);
    }

    /// A restore lost the answer this process awaits: the stream goes on
    /// past it (its copies skipped, as older than the answer), and the
    /// next request's answer is one of those copies. In a history that
    /// never went back the stream would have delivered the answer first.
    #[test]
    fn a_stream_past_an_awaited_answer_it_never_delivered_went_back() {
        let mut fresh = Freshness::default();
        fresh.streamed(1, "5");
        let patch = sent(&fresh, "5");
        assert_eq!(fresh.fetched(&patch, "9"), Fresh::Newer);
        let patch = sent(&fresh, "9");
        assert_eq!(fresh.streamed(1, "12"), Fresh::Stale, "awaiting 9");
        assert_eq!(fresh.fetched(&patch, "12"), Fresh::Back);
        assert_eq!(fresh.streamed(1, "13"), Fresh::Newer);
    }

    #[test]
    fn a_relist_or_a_deletion_ends_the_wait() {
        let mut fresh = Freshness::default();
        fresh.streamed(1, "5");
        let before = sent(&fresh, "5");
        assert_eq!(fresh.fetched(&before, "9"), Fresh::Newer);
        // A relist: its copy is a read of what is true now.
        assert_eq!(fresh.streamed(2, "8"), Fresh::Newer);
        assert_eq!(fresh.epoch(), 2);
        // An answer to a request sent before the relist is not adopted
        // (after an etcd restore the same version names another content).
        assert_eq!(fresh.fetched(&before, "10"), Fresh::Stale);
        let after = sent(&fresh, "8");
        assert_eq!(fresh.fetched(&after, "10"), Fresh::Newer);
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
        let patch = sent(&fresh, &last);
        assert_eq!(fresh.fetched(&patch, &last), Fresh::Stale);
        // Positions still count from the epoch's first copy.
        let first_kept = 10.to_string();
        assert_eq!(fresh.fetched(&patch, &first_kept), Fresh::Back);
    }
}

/// Random interleavings of one object's life against one process: other
/// writers, a watch that lags, requests answered and handled late, and
/// etcd restores (with or without `--bump-revision`; the watch then lists
/// again or resumes silently). Without a restore, no copy ever replaces a
/// newer one and no answer is taken for the state going back; after one,
/// the first request sent in the epoch leaves a copy of the state there
/// is.
#[cfg(test)]
mod model {
    use super::*;
    use crate::testutil::Rng;

    /// The object's versions in order, each with the content it names
    /// (after a restore without a bump, a version may come back with
    /// another content).
    struct Server {
        history: Vec<(u64, u64)>,
        last_version: u64,
        contents: u64,
    }

    impl Server {
        fn write(&mut self) {
            self.last_version += 1;
            self.contents += 1;
            self.history.push((self.last_version, self.contents));
        }

        fn now(&self) -> (u64, u64) {
            self.history[self.history.len() - 1]
        }
    }

    /// A request sent from the copy held, answered by the server at some
    /// later step, handled by the process later still.
    struct Request {
        asked: Asked,
        answer: Option<(u64, u64)>,
        /// How many restores came before it was sent.
        sent_after: u32,
    }

    struct Process {
        fresh: Freshness,
        held: (u64, u64),
        /// The history index of the watch's next copy.
        cursor: usize,
        request: Option<Request>,
    }

    /// The history index of `copy`, when the history holds it.
    fn index_of(server: &Server, copy: (u64, u64)) -> Option<usize> {
        server.history.iter().position(|c| *c == copy)
    }

    fn run(seed: u64, steps: usize) {
        let mut rng = Rng(seed | 1);
        let mut server = Server {
            history: vec![(1, 1)],
            last_version: 1,
            contents: 1,
        };
        let mut p = Process {
            fresh: Freshness::default(),
            held: (1, 1),
            cursor: 1,
            request: None,
        };
        p.fresh.streamed(1, "1");
        let mut epoch = 1;
        let mut restored = false;
        let mut restores = 0;
        for step in 0..steps {
            let before = index_of(&server, p.held);
            match rng.below(20) {
                0..=4 => server.write(),
                5..=9 if p.cursor < server.history.len() => {
                    let (version, content) = server.history[p.cursor];
                    p.cursor += 1;
                    if p.fresh.streamed(epoch, &version.to_string()) == Fresh::Newer {
                        p.held = (version, content);
                    }
                }
                10..=12 if p.request.is_none() => {
                    let asked = Asked {
                        base: p.held.0.to_string(),
                        epoch: p.fresh.epoch(),
                        position: p.fresh.position(),
                    };
                    p.request = Some(Request {
                        asked,
                        answer: None,
                        sent_after: restores,
                    });
                }
                13..=15 => {
                    if let Some(request) = p.request.as_mut().filter(|r| r.answer.is_none()) {
                        // A patch lands on its base; otherwise the 409's read.
                        if server.now().0.to_string() == request.asked.base {
                            server.write();
                        }
                        request.answer = Some(server.now());
                    }
                }
                16..=18 => {
                    if let Some(request) = p.request.take_if(|r| r.answer.is_some()) {
                        let answer = request.answer.unwrap_or_default();
                        let verdict = p.fresh.fetched(&request.asked, &answer.0.to_string());
                        assert!(
                            verdict != Fresh::Back || restored,
                            "seed {seed} step {step}: {answer:?} taken for the state going back"
                        );
                        if verdict != Fresh::Stale {
                            p.held = answer;
                        }
                        // A request sent since the last restore and in
                        // this epoch leaves a copy of the state there is:
                        // its answer, or a newer one the stream delivered.
                        assert!(
                            request.sent_after < restores
                                || request.asked.epoch != p.fresh.epoch()
                                || index_of(&server, p.held).is_some(),
                            "seed {seed} step {step}: {:?} kept over {answer:?}",
                            p.held
                        );
                    }
                }
                19 if server.history.len() > 1 => {
                    restored = true;
                    restores += 1;
                    let versions = u64::try_from(server.history.len()).unwrap_or(u64::MAX);
                    let kept = 1 + usize::try_from(rng.below(versions - 1)).unwrap_or(0);
                    server.history.truncate(kept);
                    p.cursor = kept;
                    match rng.below(3) {
                        // `--bump-revision`: versions go on; watches get 410.
                        0 => {}
                        // No bump, and other objects' writes hand the
                        // versions out again past every one this process
                        // saw: the watch resumes without an error, the
                        // object's own version back to one it delivered.
                        // (Handed out again to this object before that, a
                        // version would name two contents on a silent
                        // stream, which no client can tell apart.)
                        1 => {
                            server.last_version += rng.below(3);
                            continue;
                        }
                        // No bump: a watch from past the server's version
                        // is refused, and lists again.
                        _ => server.last_version = server.now().0,
                    }
                    epoch += 1;
                    let (version, content) = server.now();
                    p.fresh.streamed(epoch, &version.to_string());
                    p.held = (version, content);
                }
                _ => {}
            }
            if !restored {
                let after = index_of(&server, p.held);
                assert!(
                    after >= before,
                    "seed {seed} step {step}: {:?} replaced by an older copy {:?}",
                    before,
                    after
                );
            }
        }
    }

    #[test]
    fn no_copy_goes_back_and_only_a_restore_is_taken_for_one() {
        for seed in 0..2_000 {
            run(seed, 300);
        }
    }
}
