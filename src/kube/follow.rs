//! Which copies of this node's object are true now. Resource versions are
//! opaque: they are compared for equality, never ordered. Order comes from
//! the stream itself — a list, then its watch, one epoch — and from the
//! API server's answers to our own reads and writes, judged by the
//! freshness rule ([`super::fresh`]). The rule and why it cannot bring
//! back a released block are in docs/design.md, "Following the control
//! plane".

use std::collections::VecDeque;

use super::fresh::{Asked, Fresh, Freshness};
use super::nnc::{Kind, Meta};
use crate::log;

/// Versions of one epoch remembered to recognise a replay. A node's object
/// changes a few times a minute; a replay comes within seconds.
const REMEMBERED_VERSIONS: usize = 256;
/// Foreign objects warned about (each name and version once).
const REMEMBERED_FOREIGN: usize = 64;

/// The watch thread's view of its stream: which objects are this node's,
/// and whether a version was already delivered in this epoch.
#[derive(Debug)]
pub struct StreamGuard {
    node: String,
    kind: Kind,
    epoch: u64,
    seen: VecDeque<String>,
    warned: VecDeque<(String, String, String)>,
}

impl StreamGuard {
    pub fn new(node: &str, kind: Kind) -> StreamGuard {
        StreamGuard {
            node: node.to_string(),
            kind,
            epoch: 0,
            seen: VecDeque::new(),
            warned: VecDeque::new(),
        }
    }

    /// Starts an epoch (a list): versions of earlier epochs mean nothing
    /// in it (after an etcd restore the same versions come again).
    pub fn new_epoch(&mut self) -> u64 {
        self.epoch = self.epoch.wrapping_add(1);
        self.seen.clear();
        self.epoch
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether `meta` is this node's object. Another object (an API server
    /// or proxy that ignores the field selector) is skipped, with one
    /// warning per object and version.
    pub fn is_ours(&mut self, meta: &Meta) -> bool {
        if meta.is_of_node(&self.node) {
            return true;
        }
        let key = (
            meta.name.clone(),
            meta.namespace.clone(),
            meta.resource_version.clone(),
        );
        if !self.warned.contains(&key) {
            log::warn(
                "kube",
                "ignoring an object that is not this node's",
                &[
                    ("kind", &self.kind.name()),
                    ("node", &self.node),
                    ("name", &meta.name),
                    ("namespace", &meta.namespace),
                    ("version", &meta.resource_version),
                ],
            );
            if self.warned.len() == REMEMBERED_FOREIGN {
                self.warned.pop_front();
            }
            self.warned.push_back(key);
        }
        false
    }

    /// Whether any of `items` is this node's object.
    pub fn any_ours(&mut self, items: &[serde_json::Value]) -> bool {
        items
            .iter()
            .any(|item| Meta::parse(item).is_of_node(&self.node))
    }

    /// Whether this epoch already delivered `meta`'s version (a watch never
    /// does; a stream that does cannot be trusted). Records it otherwise.
    pub fn is_replay(&mut self, meta: &Meta) -> bool {
        let version = &meta.resource_version;
        if version.is_empty() {
            return false;
        }
        if self.seen.contains(version) {
            log::warn(
                "kube",
                &format!(
                    "ignoring an older {} version the watch already delivered; listing again",
                    self.kind.name()
                ),
                &[("version", version)],
            );
            return true;
        }
        if self.seen.len() == REMEMBERED_VERSIONS {
            self.seen.pop_front();
        }
        self.seen.push_back(version.clone());
        false
    }
}

/// What the loop does with a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The truth now: apply it.
    Apply,
    /// The truth now, of an object created anew (another `uid`): start
    /// over from it, as after a delete.
    Recreated,
    /// The truth now, of an object this node saw replaced before (an
    /// earlier `uid` back), or an answer older than the copy its request
    /// was sent from: the cluster's state went back (an etcd restore).
    /// What it lists is old, not granted anew.
    WentBack,
    /// Not news (the stream is already past it): ignore it.
    Ignore,
}

/// The loop's view: which object (uid) and version its copy is, and how
/// fresh copies are ([`Freshness`]).
#[derive(Debug, Default)]
pub struct Follower {
    uid: Option<String>,
    version: Option<String>,
    fresh: Freshness,
    /// Where the patch in flight was computed from.
    sent: Option<Asked>,
    /// Uids of this name seen replaced by another, oldest first.
    superseded: VecDeque<String>,
}

/// Replaced uids remembered: an object is re-created a few times in a
/// node's life, and a restore goes back to a recent one.
const SUPERSEDED_UIDS: usize = 16;

impl Follower {
    /// A copy from the stream (list or watch; the watch thread already
    /// dropped replays and foreign objects): the truth now, unless this
    /// process read or wrote a later copy the stream has not reached.
    pub fn stream(&mut self, epoch: u64, meta: &Meta) -> Verdict {
        if self.fresh.streamed(epoch, &meta.resource_version) == Fresh::Stale {
            return Verdict::Ignore;
        }
        self.version = Some(meta.resource_version.clone());
        self.adopt_uid(&meta.uid)
    }

    /// A patch computed from the current copy went out.
    pub fn patch_sent(&mut self, base: &str) {
        self.sent = Some(Asked {
            base: base.to_string(),
            epoch: self.fresh.epoch(),
            position: self.fresh.position(),
        });
    }

    /// A copy read or written outside the stream for the patch computed
    /// from `base`: what a successful PATCH returned, or the GET after its
    /// 409. Adopted when it is newer than the copy held (the freshness
    /// rule) and of the same object; an answer to a patch nobody sent, or
    /// sent before a relist (after an etcd restore the same version names
    /// another object), is not. An answer older than the copy the patch
    /// was sent from is the state going back.
    pub fn answered(&mut self, base: &str, meta: &Meta) -> Verdict {
        let Some(sent) = self.sent.take() else {
            return Verdict::Ignore;
        };
        let same_object = self.uid.as_deref().is_none_or(|uid| uid == meta.uid);
        if sent.base != base || !same_object {
            return Verdict::Ignore;
        }
        let verdict = match self.fresh.fetched(&sent, &meta.resource_version) {
            Fresh::Stale => return Verdict::Ignore,
            Fresh::Newer => Verdict::Apply,
            Fresh::Back => Verdict::WentBack,
        };
        self.version = Some(meta.resource_version.clone());
        verdict
    }

    /// The object is gone (deleted, or a list found none). Its uid is kept:
    /// the next object of that name is a new one.
    pub fn gone(&mut self, epoch: u64) {
        self.fresh.gone(epoch);
        self.version = None;
    }

    /// The stream epoch of the copies seen last.
    pub fn epoch(&self) -> u64 {
        self.fresh.epoch()
    }

    /// The version of the copy applied last (`None` after a delete).
    pub fn version(&self) -> Option<&str> {
        self.version.as_deref()
    }

    /// Picks up where an earlier process left off: `uids` as
    /// [`Follower::uids`] gave them.
    pub fn resume(&mut self, mut uids: Vec<String>) {
        self.uid = uids.pop();
        let first = uids.len().saturating_sub(SUPERSEDED_UIDS);
        self.superseded = uids.split_off(first).into();
    }

    /// The uid of the object followed now.
    pub fn uid(&self) -> Option<&str> {
        self.uid.as_deref()
    }

    /// The uids followed: those replaced, oldest first, then the current.
    pub fn uids(&self) -> Vec<String> {
        self.superseded.iter().chain(&self.uid).cloned().collect()
    }

    fn adopt_uid(&mut self, uid: &str) -> Verdict {
        let went_back = self.superseded.iter().any(|u| u == uid);
        self.superseded.retain(|u| u != uid);
        let changed = match self.uid.replace(uid.to_string()) {
            Some(previous) if previous == uid => return Verdict::Apply,
            Some(previous) => {
                if self.superseded.len() == SUPERSEDED_UIDS {
                    self.superseded.pop_front();
                }
                self.superseded.push_back(previous);
                true
            }
            None => false,
        };
        match (went_back, changed) {
            (true, _) => Verdict::WentBack,
            (false, true) => Verdict::Recreated,
            (false, false) => Verdict::Apply,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str, uid: &str, version: &str) -> Meta {
        Meta {
            name: name.into(),
            uid: uid.into(),
            resource_version: version.into(),
            ..Meta::default()
        }
    }

    #[test]
    fn replays_are_recognised_within_an_epoch_only() {
        let mut guard = StreamGuard::new("n1", Kind::Nnc);
        assert_eq!(guard.new_epoch(), 1);
        assert!(!guard.is_replay(&meta("n1", "u", "b7")));
        assert!(!guard.is_replay(&meta("n1", "u", "a3")), "not ordered: new");
        assert!(guard.is_replay(&meta("n1", "u", "b7")));
        // After a list (an etcd restore hands out the same versions again).
        guard.new_epoch();
        assert!(!guard.is_replay(&meta("n1", "u", "b7")));
    }

    #[test]
    fn only_this_nodes_object_is_ours() {
        let mut guard = StreamGuard::new("n1", Kind::Node);
        assert!(guard.is_ours(&meta("n1", "u", "1")));
        assert!(!guard.is_ours(&meta("n2", "u", "1")));
        let namespaced = Meta {
            namespace: "default".into(),
            ..meta("n1", "u", "1")
        };
        assert!(!guard.is_ours(&namespaced));
        assert!(guard.any_ours(&[serde_json::json!({"metadata": {"name": "n1"}})]));
        assert!(!guard.any_ours(&[serde_json::json!({"metadata": {"name": "n2"}})]));
    }

    #[test]
    fn versions_are_never_ordered() {
        let mut follower = Follower::default();
        assert_eq!(follower.stream(1, &meta("n", "u1", "9")), Verdict::Apply);
        // Lower, non-numeric, anything: the stream's order decides.
        assert_eq!(follower.stream(1, &meta("n", "u1", "5")), Verdict::Apply);
        assert_eq!(follower.stream(2, &meta("n", "u1", "zz")), Verdict::Apply);
        assert_eq!(follower.version(), Some("zz"));
        assert_eq!(follower.epoch(), 2);
    }

    #[test]
    fn a_new_uid_is_a_recreated_object() {
        let mut follower = Follower::default();
        follower.stream(1, &meta("n", "u1", "9"));
        follower.gone(1);
        assert_eq!(follower.version(), None);
        assert_eq!(
            follower.stream(2, &meta("n", "u2", "3")),
            Verdict::Recreated
        );
        assert_eq!(follower.stream(2, &meta("n", "u2", "4")), Verdict::Apply);
    }

    /// An earlier uid back is the state going back, not a new object; a
    /// later process resumed from the recorded uids knows them too, and
    /// at most [`SUPERSEDED_UIDS`] are kept.
    #[test]
    fn an_earlier_uid_back_is_the_state_going_back() {
        let mut follower = Follower::default();
        assert_eq!(follower.stream(1, &meta("n", "u1", "1")), Verdict::Apply);
        assert_eq!(
            follower.stream(1, &meta("n", "u2", "2")),
            Verdict::Recreated
        );
        assert_eq!(follower.stream(2, &meta("n", "u1", "1")), Verdict::WentBack);
        assert_eq!(follower.stream(3, &meta("n", "u2", "3")), Verdict::WentBack);
        assert_eq!(
            follower.stream(3, &meta("n", "u3", "4")),
            Verdict::Recreated
        );
        assert_eq!(follower.uids(), ["u1", "u2", "u3"]);
        let mut later = Follower::default();
        later.resume(follower.uids());
        assert_eq!(later.stream(1, &meta("n", "u3", "4")), Verdict::Apply);
        assert_eq!(later.stream(2, &meta("n", "u1", "1")), Verdict::WentBack);
        assert_eq!(later.uids(), ["u2", "u3", "u1"]);
        for n in 0..2 * SUPERSEDED_UIDS {
            later.stream(3, &meta("n", &format!("x{n}"), "9"));
        }
        assert_eq!(later.uids().len(), SUPERSEDED_UIDS + 1);
        let mut resumed = Follower::default();
        resumed.resume((0..40).map(|n| format!("y{n}")).collect());
        assert_eq!(resumed.uids().len(), SUPERSEDED_UIDS + 1);
        assert_eq!(resumed.uids().last().map(String::as_str), Some("y39"));
    }

    #[test]
    fn an_answer_is_adopted_unless_the_stream_is_already_there() {
        let mut follower = Follower::default();
        follower.stream(1, &meta("n", "u1", "10"));
        follower.patch_sent("10");
        assert_eq!(
            follower.answered("10", &meta("n", "u1", "11")),
            Verdict::Apply
        );
        assert_eq!(follower.version(), Some("11"));
        // The lagging watch brings 11 late: not applied again, nor is
        // anything older.
        assert_eq!(follower.stream(1, &meta("n", "u1", "11")), Verdict::Ignore);
        assert_eq!(follower.stream(1, &meta("n", "u1", "12")), Verdict::Apply);
        // The stream delivered the answer's version before the answer was
        // handled: ignored (the stream's copy is as new or newer).
        follower.patch_sent("12");
        follower.stream(1, &meta("n", "u1", "13"));
        assert_eq!(
            follower.answered("12", &meta("n", "u1", "13")),
            Verdict::Ignore
        );
        // Another object's answer is never adopted.
        follower.patch_sent("13");
        assert_eq!(
            follower.answered("13", &meta("n", "u9", "14")),
            Verdict::Ignore
        );
        assert_eq!(follower.version(), Some("13"));
        // An etcd restore: a relist brings the same version back, naming
        // another object; an answer to a patch of the old one is stale.
        follower.patch_sent("13");
        follower.stream(2, &meta("n", "u1", "13"));
        assert_eq!(
            follower.answered("13", &meta("n", "u1", "14")),
            Verdict::Ignore
        );
        // A patch nobody sent (or answered twice) is not adopted either.
        assert_eq!(
            follower.answered("13", &meta("n", "u1", "14")),
            Verdict::Ignore
        );
    }

    /// etcd restored without new versions while the watch went on: the
    /// patch from 6 conflicts and the read answers 5, which the stream
    /// delivered before 6. Skipped as old, every later patch would go
    /// from 6 and conflict again.
    #[test]
    fn a_read_older_than_the_copy_a_patch_was_sent_from_is_the_state_going_back() {
        let mut follower = Follower::default();
        follower.stream(1, &meta("n", "u1", "5"));
        follower.stream(1, &meta("n", "u1", "6"));
        follower.patch_sent("6");
        assert_eq!(
            follower.answered("6", &meta("n", "u1", "5")),
            Verdict::WentBack
        );
        assert_eq!(follower.version(), Some("5"));
        follower.patch_sent("5");
        assert_eq!(
            follower.answered("5", &meta("n", "u1", "6")),
            Verdict::Apply,
            "a version handed out again"
        );
    }

    #[test]
    fn a_read_after_a_conflict_wins_over_the_lagging_watch() {
        let mut follower = Follower::default();
        follower.stream(1, &meta("n", "u1", "105"));
        follower.patch_sent("105");
        // 409: the GET answers 107; the watch still brings 106 later.
        assert_eq!(
            follower.answered("105", &meta("n", "u1", "107")),
            Verdict::Apply
        );
        assert_eq!(follower.stream(1, &meta("n", "u1", "106")), Verdict::Ignore);
        assert_eq!(follower.version(), Some("107"), "never 107, then 106");
    }
}
