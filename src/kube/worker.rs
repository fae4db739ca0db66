//! The threads that talk to the API server. The watcher lists and watches
//! this node's object and forwards every new version; the patcher applies
//! the monitor's patches. Neither touches SQLite: the daemon's loop stays
//! the only writer of the store and receives everything as [`KubeEvent`]s.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;

use serde_json::Value;

use super::backoff::{ApiTiming, Backoff};
use super::client::{ApiClient, KubeError, WatchEvent};
use super::follow::StreamGuard;
use super::nnc::{self, Kind, Meta, Nnc, NncPatch, Node};
use super::objects::{ApiStatus, ObjectList, lenient};
use crate::log;

/// What the API threads tell the loop.
#[derive(Debug)]
pub enum KubeEvent {
    /// A copy of this node's NodeNetworkConfig, in the order of stream
    /// `epoch` (a list starts a new epoch; its watch continues it).
    Nnc { nnc: Nnc, epoch: u64 },
    /// A copy of this node's Node, in the order of stream `epoch`.
    Node { node: Node, epoch: u64 },
    /// This node's object was deleted, or a list found none: the cluster
    /// grants nothing now.
    Gone { epoch: u64 },
    /// The watch delivered a version it had already delivered (a stream
    /// that breaks the watch rules): ignored, and listed again.
    Replayed,
    /// The API server could not be reached or refused us.
    Unreachable(String),
    /// A list and a watch both succeeded: changes reach the daemon again.
    Watching,
    /// A patch was applied: the object the server returned, and the
    /// version the patch was computed from (its precondition).
    Patched { base: String, nnc: Box<Nnc> },
    /// A patch lost an optimistic-concurrency race (409), the `streak`-th
    /// in a row, and the object was read again: the copy it returned, and
    /// the version the patch was computed from.
    Refetched {
        base: String,
        nnc: Box<Nnc>,
        streak: u32,
    },
    /// A patch lost an optimistic-concurrency race (409), the `streak`-th
    /// in a row, and the object could not be read: the watch brings it.
    Conflict { streak: u32 },
    /// A patch failed otherwise; the monitor retries on its next pass.
    PatchFailed(String),
}

/// Wakes the daemon's `poll` by writing to a non-blocking pipe.
#[derive(Clone)]
pub struct Waker {
    write_end: Arc<OwnedFd>,
}

impl Waker {
    /// The pipe's read end goes into the loop's poll set.
    pub fn new() -> nix::Result<(Waker, OwnedFd)> {
        let (read_end, write_end) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC)?;
        Ok((
            Waker {
                write_end: Arc::new(write_end),
            },
            read_end,
        ))
    }

    pub fn wake(&self) {
        // A full pipe already guarantees a wake-up; nothing else can fail usefully.
        let _ = nix::unistd::write(self.write_end.as_fd(), &[1]);
    }
}

/// Empties the wake pipe (the loop calls this before draining events).
pub fn drain_wakeups(read_end: &OwnedFd) {
    let mut buffer = [0u8; 64];
    while matches!(nix::unistd::read(read_end.as_fd(), &mut buffer), Ok(n) if n > 0) {}
}

/// The loop's ends of the API threads.
pub struct KubeLink {
    pub events: Receiver<KubeEvent>,
    pub wake_fd: OwnedFd,
    patches: Sender<NncPatch>,
    serving: Serving,
}

/// The serving annotation's text as the loop last computed it, for the
/// watch thread to create the NodeNetworkConfig with.
#[derive(Clone, Default)]
struct Serving(Arc<Mutex<String>>);

impl Serving {
    fn get(&self) -> String {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set(&self, text: String) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = text;
    }
}

impl KubeLink {
    /// The blocks this node serves changed (the annotation's text): the
    /// NodeNetworkConfig is created with them if it must be again.
    pub fn set_serving(&self, text: String) {
        self.serving.set(text);
    }

    /// Queues a patch of this node's NodeNetworkConfig.
    pub fn patch(&self, patch: NncPatch) {
        // The patcher lives as long as the process; a send error means it
        // is gone and the next pass will log the failure again.
        let _ = self.patches.send(patch);
    }
}

/// Starts the watcher (of the NNC or of the Node) and, for the NNC, the patcher.
pub fn spawn(
    client: ApiClient,
    node: String,
    kind: Kind,
    timing: ApiTiming,
) -> std::io::Result<KubeLink> {
    let (waker, wake_fd) = Waker::new().map_err(std::io::Error::from)?;
    let (event_tx, events) = mpsc::channel();
    let (patches, patch_rx) = mpsc::channel::<NncPatch>();
    let client = Arc::new(client);
    let send = Notifier {
        events: event_tx,
        waker,
    };
    let serving = Serving::default();
    {
        let client = Arc::clone(&client);
        let node = node.clone();
        let send = send.clone();
        let serving = serving.clone();
        thread::Builder::new()
            .name("kube-watch".into())
            .spawn(move || {
                let watcher = Watcher {
                    client: &client,
                    node: &node,
                    kind,
                    timing,
                    send: &send,
                    serving: &serving,
                };
                watch_forever(&watcher)
            })?;
    }
    if kind == Kind::Nnc {
        thread::Builder::new()
            .name("kube-patch".into())
            .spawn(move || patch_forever(&client, &node, timing, &patch_rx, &send))?;
    }
    Ok(KubeLink {
        events,
        wake_fd,
        patches,
        serving,
    })
}

#[derive(Clone)]
struct Notifier {
    events: Sender<KubeEvent>,
    waker: Waker,
}

impl Notifier {
    /// False once the loop is gone (the thread should end).
    fn send(&self, event: KubeEvent) -> bool {
        let delivered = self.events.send(event).is_ok();
        self.waker.wake();
        delivered
    }
}

/// Lists and watches forever. After a failure the thread waits out the
/// backoff (or the server's `Retry-After`) and resumes the watch from the
/// last version seen; a `410 Gone`, a version the server finds too large
/// (an etcd restore), a replayed version, a deleted object or a failed list
/// cost a new list. The backoff is reset only by a watch the server ended
/// normally (a full successful cycle), never by a list alone: a watch that
/// keeps failing after good lists still backs off to the cap.
fn watch_forever(cycle: &Watcher) {
    let (node, kind, send) = (cycle.node, cycle.kind, cycle.send);
    let mut backoff = Backoff::new(cycle.timing.max_backoff);
    let mut stream = StreamGuard::new(node, kind);
    let mut resume: Option<String> = None;
    loop {
        match cycle.run(&mut backoff, &mut stream, &mut resume) {
            Ok(Flow::Stop) => return,
            Ok(Flow::Again) => {}
            // Paced like a failure: a server that deletes the object or
            // replays versions on every watch gets no list storm.
            Ok(Flow::Relist) => thread::sleep(backoff.next(None)),
            Err(err) => {
                let pause = backoff.next(err.retry_after());
                log::warn(
                    "kube",
                    "API watch failed, retrying",
                    &[
                        ("object", &kind.item_path(node)),
                        ("error", &err),
                        ("failures", &backoff.failures()),
                        ("retry_in_ms", &pause.as_millis()),
                        ("relist", &resume.is_none()),
                    ],
                );
                if !send.send(KubeEvent::Unreachable(err.to_string())) {
                    return;
                }
                thread::sleep(pause);
            }
        }
    }
}

/// Whether the watch thread goes on.
enum Flow {
    Again,
    /// List again, after the backoff.
    Relist,
    Stop,
}

/// What the watch thread works with.
struct Watcher<'a> {
    client: &'a ApiClient,
    node: &'a str,
    kind: Kind,
    timing: ApiTiming,
    send: &'a Notifier,
    serving: &'a Serving,
}

impl Watcher<'_> {
    /// One list (unless resuming) and one watch. `resume` is where the next
    /// watch starts (`None`: list again).
    fn run(
        &self,
        backoff: &mut Backoff,
        stream: &mut StreamGuard,
        resume: &mut Option<String>,
    ) -> Result<Flow, KubeError> {
        let mut version = match resume.take() {
            Some(version) => version,
            None => match self.list(stream)? {
                Some(version) => version,
                None => return Ok(Flow::Stop),
            },
        };
        let seconds = backoff.watch_seconds(self.timing.watch_timeout);
        let path = self.kind.watch_path(self.node, &version, seconds);
        let events = match self.client.watch(&path) {
            Ok(events) => events,
            Err(err) => {
                if !needs_relist(&err) {
                    *resume = Some(version);
                }
                return Err(err);
            }
        };
        if !self.send.send(KubeEvent::Watching) {
            return Ok(Flow::Stop);
        }
        for event in events {
            let event = match event {
                Ok(event) => event,
                Err(err) => {
                    *resume = Some(version);
                    return Err(err);
                }
            };
            if let Some(end) = self.on_watch_event(event, stream, &mut version, resume) {
                return end;
            }
        }
        // The server ended the watch (timeoutSeconds): a full cycle.
        log::trace(
            "kube",
            "watch ended by the server, resuming",
            &[("version", &version)],
        );
        backoff.reset();
        *resume = Some(version);
        Ok(Flow::Again)
    }

    /// One event of the watch: forwarded, or the end of the cycle
    /// (`Some`). `version` is where the watch stands, `resume` where the
    /// next one starts (`None`: list again).
    fn on_watch_event(
        &self,
        event: WatchEvent,
        stream: &mut StreamGuard,
        version: &mut String,
        resume: &mut Option<String>,
    ) -> Option<Result<Flow, KubeError>> {
        match event.kind.as_str() {
            "ADDED" | "MODIFIED" => {
                let meta = Meta::parse(&event.object);
                if !stream.is_ours(&meta) {
                    return None;
                }
                if stream.is_replay(&meta) {
                    // The stream broke the watch rules: only a list can
                    // say what is true now.
                    return Some(Ok(self.relisting(KubeEvent::Replayed)));
                }
                *version = meta.resource_version;
                let delivered = self.forward(&event.object, stream.epoch());
                (!delivered).then_some(Ok(Flow::Stop))
            }
            "BOOKMARK" => {
                *version = nnc::resource_version(&event.object);
                None
            }
            "DELETED" => {
                if !stream.is_ours(&Meta::parse(&event.object)) {
                    return None;
                }
                log::warn(
                    "kube",
                    self.kind.deleted_message(),
                    &[("object", &self.kind.item_path(self.node))],
                );
                let gone = KubeEvent::Gone {
                    epoch: stream.epoch(),
                };
                Some(Ok(self.relisting(gone)))
            }
            _ => {
                let err = watch_error(&event.object);
                // Other errors resume from the same version.
                if !needs_relist(&err) {
                    *resume = Some(version.clone());
                }
                Some(Err(err))
            }
        }
    }

    /// Tells the loop `event` and ends the cycle so that the next lists.
    fn relisting(&self, event: KubeEvent) -> Flow {
        match self.send.send(event) {
            true => Flow::Relist,
            false => Flow::Stop,
        }
    }

    /// Lists the object and forwards it (a new stream epoch); for the
    /// NodeNetworkConfig, creates it first if it is missing. Returns the
    /// version to watch from (`None`: the loop is gone).
    fn list(&self, stream: &mut StreamGuard) -> Result<Option<String>, KubeError> {
        let (client, node, kind) = (self.client, self.node, self.kind);
        let mut list = ObjectList::read(client.get(&kind.list_path(node))?);
        let epoch = stream.new_epoch();
        if kind == Kind::Nnc && !stream.any_ours(&list.items) {
            nnc::ensure(client, node, &self.serving.get())?;
            list = ObjectList::read(client.get(&kind.list_path(node))?);
            if !stream.any_ours(&list.items) {
                return Err(KubeError::Decode("NodeNetworkConfig vanished".into()));
            }
        }
        let mut found = false;
        for item in &list.items {
            let meta = Meta::parse(item);
            if !stream.is_ours(&meta) {
                continue;
            }
            stream.is_replay(&meta);
            found = true;
            if !self.forward(item, epoch) {
                return Ok(None);
            }
        }
        if !found && !self.send.send(KubeEvent::Gone { epoch }) {
            return Ok(None);
        }
        Ok(Some(list.metadata.resource_version))
    }

    fn forward(&self, object: &Value, epoch: u64) -> bool {
        match self.kind {
            Kind::Nnc => self.send.send(KubeEvent::Nnc {
                nnc: Nnc::parse(object),
                epoch,
            }),
            Kind::Node => self.send.send(KubeEvent::Node {
                node: Node::parse(object),
                epoch,
            }),
        }
    }
}

/// Whether a failed watch must start again from a list: `410 Gone` (the
/// version was compacted away) or a version the server has not reached
/// (`ResourceVersionTooLarge`: etcd was restored from a backup, and the
/// versions went back).
pub fn needs_relist(err: &KubeError) -> bool {
    match err {
        KubeError::Status { code: 410, .. } => true,
        KubeError::Status { body, .. } => {
            body.contains("ResourceVersionTooLarge") || body.contains("Too large resource version")
        }
        _ => false,
    }
}

/// The error an `ERROR` event of a watch carries (a `Status` object).
pub fn watch_error(status: &Value) -> KubeError {
    KubeError::Status {
        code: u16::try_from(lenient::<ApiStatus>(status).code).unwrap_or(0),
        body: status.to_string(),
        retry_after: None,
    }
}

/// Consecutive conflicts after which a 409 storm is reported (health
/// degraded, a warning per conflict).
pub const CONFLICT_STORM: u32 = 3;

/// Sends the monitor's patches. Every failure — a 409 included — is
/// followed by the backoff before the next patch goes out, so a failing or
/// racing API server sees at most one request per pause from this thread.
/// After a 409's pause the object is read (GET) and handed to the loop,
/// which decides again from that copy: re-sending from the copy it had
/// would only conflict again while the watch lags (the freshness rule,
/// `kube::fresh`, keeps the watch's older copies from replacing it).
fn patch_forever(
    client: &ApiClient,
    node: &str,
    timing: ApiTiming,
    patches: &Receiver<NncPatch>,
    send: &Notifier,
) {
    let mut patcher = Patcher {
        client,
        node,
        path: Kind::Nnc.item_path(node),
        backoff: Backoff::new(timing.max_backoff),
    };
    let mut queued = patches.recv().ok();
    // The patch that landed last, while the next was already queued.
    let mut landed: Option<Landed> = None;
    while let Some(mut patch) = queued.take() {
        // Only the newest queued patch matters: each carries the full lists.
        while let Ok(newer) = patches.try_recv() {
            patch = newer;
        }
        let bases = carry_over(&mut patch, landed.take());
        let (event, pause) = patcher.send(patch);
        let answer = match &event {
            KubeEvent::Patched { nnc, .. } => Some(nnc.meta.resource_version.clone()),
            _ => None,
        };
        if !send.send(event) {
            return;
        }
        if let Some(pause) = pause {
            thread::sleep(pause);
        }
        // Only a patch queued meanwhile is carried over: one that comes
        // later was decided on the answer (or, after an etcd restore, on a
        // copy whose version may name another state).
        queued = match patches.try_recv() {
            Ok(next) => {
                landed = answer.map(|answer| Landed { bases, answer });
                Some(next)
            }
            Err(mpsc::TryRecvError::Empty) => patches.recv().ok(),
            Err(mpsc::TryRecvError::Disconnected) => None,
        };
    }
}

/// A patch that landed: the versions it was decided on and sent with, and
/// the version its answer carries.
struct Landed {
    bases: Vec<String>,
    answer: String,
}

/// A patch decided on the copy `landed` was sent from goes on `landed`'s
/// answer (this process's own write); sent as it was, it could only
/// conflict. Returns the versions `patch` was decided on and goes with.
fn carry_over(patch: &mut NncPatch, landed: Option<Landed>) -> Vec<String> {
    let mut bases = vec![patch.resource_version.clone()];
    if let Some(landed) = landed
        && landed.bases.contains(&patch.resource_version)
    {
        patch.resource_version = landed.answer;
        bases.push(patch.resource_version.clone());
    }
    bases
}

/// The patcher thread's state.
struct Patcher<'a> {
    client: &'a ApiClient,
    node: &'a str,
    path: String,
    backoff: Backoff,
}

impl Patcher<'_> {
    /// Sends one patch: the event for the loop and the pause before the
    /// next patch.
    fn send(&mut self, patch: NncPatch) -> (KubeEvent, Option<std::time::Duration>) {
        match self.client.merge_patch(&self.path, &patch.to_json()) {
            Ok(object) => {
                self.backoff.reset();
                let nnc = Box::new(Nnc::parse(&object));
                if nnc.meta.is_of_node(self.node) {
                    let base = patch.resource_version;
                    (KubeEvent::Patched { base, nnc }, None)
                } else {
                    let why = format!("the PATCH answer is not {}", self.path);
                    (KubeEvent::PatchFailed(why), Some(self.backoff.next(None)))
                }
            }
            Err(err) if err.is_status(409) => (self.reread(patch.resource_version, &err), None),
            Err(err) => {
                let pause = self.backoff.next(err.retry_after());
                log::warn(
                    "kube",
                    "patching the NodeNetworkConfig failed",
                    &[
                        ("error", &err),
                        ("failures", &self.backoff.failures()),
                        ("retry_in_ms", &pause.as_millis()),
                    ],
                );
                (KubeEvent::PatchFailed(err.to_string()), Some(pause))
            }
        }
    }

    /// After a 409 on the patch computed from `base`: waits out the
    /// backoff, then reads the object, so the next patch is computed from
    /// a copy as fresh as the pause allows.
    fn reread(&mut self, base: String, conflict: &KubeError) -> KubeEvent {
        let pause = self.backoff.next(conflict.retry_after());
        let streak = self.backoff.failures();
        if streak >= CONFLICT_STORM {
            log::warn(
                "kube",
                "NodeNetworkConfig patches keep conflicting; slowing down",
                &[("conflicts", &streak), ("retry_in_ms", &pause.as_millis())],
            );
        }
        thread::sleep(pause);
        match self.client.get(&self.path) {
            Ok(object) => {
                let nnc = Box::new(Nnc::parse(&object));
                match nnc.meta.is_of_node(self.node) {
                    true => KubeEvent::Refetched { base, nnc, streak },
                    false => KubeEvent::Conflict { streak },
                }
            }
            Err(err) => {
                log::warn(
                    "kube",
                    "reading the NodeNetworkConfig after a conflict failed; the watch brings it",
                    &[("error", &err)],
                );
                KubeEvent::Conflict { streak }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patch(version: &str) -> NncPatch {
        NncPatch {
            resource_version: version.into(),
            allocations: vec![("default".into(), 3)],
            releasable: Vec::new(),
            serving: String::new(),
        }
    }

    fn landed(bases: &[&str], answer: &str) -> Option<Landed> {
        Some(Landed {
            bases: bases.iter().map(|b| b.to_string()).collect(),
            answer: answer.into(),
        })
    }

    /// A patch decided on the version the last landed patch was decided
    /// on, or sent with, goes on its answer; any other is sent as decided.
    #[test]
    fn a_patch_queued_behind_one_that_landed_goes_on_its_answer() {
        let mut queued = patch("4");
        assert_eq!(carry_over(&mut queued, landed(&["4"], "5")), ["4", "5"]);
        assert_eq!(queued.resource_version, "5");
        // Queued behind that one, decided on 4 or on 5: onto its answer.
        for base in ["4", "5"] {
            let mut next = patch(base);
            carry_over(&mut next, landed(&["4", "5"], "6"));
            assert_eq!(next.resource_version, "6", "{base}");
        }
        // Decided on another copy, or nothing landed: as decided.
        let mut other = patch("7");
        assert_eq!(carry_over(&mut other, landed(&["4"], "5")), ["7"]);
        assert_eq!(other.resource_version, "7");
        assert_eq!(carry_over(&mut other, None), ["7"]);
    }
}
