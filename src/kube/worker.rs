//! The threads that talk to the API server. The watcher lists and watches
//! this node's object and forwards every new version; the patcher applies
//! the monitor's patches. Neither touches SQLite: the daemon's loop stays
//! the only writer of the store and receives everything as [`KubeEvent`]s.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;

use serde_json::Value;

use super::backoff::{ApiTiming, Backoff};
use super::client::{ApiClient, KubeError};
use super::nnc::{self, Kind, Nnc, NncPatch};
use crate::log;

/// What the API threads tell the loop.
#[derive(Debug)]
pub enum KubeEvent {
    /// A (new version of) this node's NodeNetworkConfig.
    Nnc(Nnc),
    /// This node's `spec.podCIDRs`.
    NodePodCidrs(Vec<String>),
    /// The API server could not be reached or refused us.
    Unreachable(String),
    /// A list and a watch both succeeded: changes reach the daemon again.
    Watching,
    /// A patch was applied.
    Patched,
    /// A patch lost an optimistic-concurrency race (409), the `streak`-th
    /// in a row; a fresh object came just before as an `Nnc` event.
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
}

impl KubeLink {
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
    {
        let client = Arc::clone(&client);
        let node = node.clone();
        let send = send.clone();
        thread::Builder::new()
            .name("kube-watch".into())
            .spawn(move || watch_forever(&client, &node, kind, timing, &send))?;
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
/// last version seen; only a `410 Gone`, a deleted object or a failed list
/// costs a new list. The backoff is reset only by a watch the server ended
/// normally (a full successful cycle), never by a list alone: a watch that
/// keeps failing after good lists still backs off to the cap.
fn watch_forever(client: &ApiClient, node: &str, kind: Kind, timing: ApiTiming, send: &Notifier) {
    let mut backoff = Backoff::new(timing.max_backoff);
    let mut resume: Option<String> = None;
    loop {
        match watch_once(client, node, kind, timing, send, &mut backoff, &mut resume) {
            Ok(Flow::Stop) => return,
            Ok(Flow::Again) => {}
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
    Stop,
}

/// One list (unless resuming) and one watch. `resume` is where the next
/// watch starts (`None`: list again).
fn watch_once(
    client: &ApiClient,
    node: &str,
    kind: Kind,
    timing: ApiTiming,
    send: &Notifier,
    backoff: &mut Backoff,
    resume: &mut Option<String>,
) -> Result<Flow, KubeError> {
    let mut version = match resume.take() {
        Some(version) => version,
        None => match list(client, node, kind, send)? {
            Some(version) => version,
            None => return Ok(Flow::Stop),
        },
    };
    let seconds = backoff.watch_seconds(timing.watch_timeout);
    let stream = match client.watch(&kind.watch_path(node, &version, seconds)) {
        Ok(stream) => stream,
        Err(err) => {
            *resume = Some(version);
            return Err(err);
        }
    };
    if !send.send(KubeEvent::Watching) {
        return Ok(Flow::Stop);
    }
    for event in stream {
        let event = match event {
            Ok(event) => event,
            Err(err) => {
                *resume = Some(version);
                return Err(err);
            }
        };
        match event.kind.as_str() {
            "ADDED" | "MODIFIED" => {
                version = nnc::resource_version(&event.object);
                if !forward(kind, &event.object, send) {
                    return Ok(Flow::Stop);
                }
            }
            "BOOKMARK" => version = nnc::resource_version(&event.object),
            // Relist, which re-creates the object.
            "DELETED" => return Err(KubeError::Decode("object deleted; re-creating".into())),
            _ => {
                let code = event.object["code"].as_u64().unwrap_or(0);
                // 410 Gone: the version is too old; relist. Other errors
                // resume from the same version.
                if code != 410 {
                    *resume = Some(version);
                }
                return Err(KubeError::Status {
                    code: u16::try_from(code).unwrap_or(0),
                    body: event.object.to_string(),
                    retry_after: None,
                });
            }
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

/// Lists the object and forwards it; for the NodeNetworkConfig, creates it
/// first if it is missing. Returns the version to watch from (`None`: the
/// loop is gone).
fn list(
    client: &ApiClient,
    node: &str,
    kind: Kind,
    send: &Notifier,
) -> Result<Option<String>, KubeError> {
    let mut list = client.get(&kind.list_path(node))?;
    if kind == Kind::Nnc && items(&list).is_empty() {
        nnc::ensure(client, node)?;
        list = client.get(&kind.list_path(node))?;
        if items(&list).is_empty() {
            return Err(KubeError::Decode("NodeNetworkConfig vanished".into()));
        }
    }
    for item in items(&list) {
        if !forward(kind, item, send) {
            return Ok(None);
        }
    }
    Ok(Some(nnc::resource_version(&list)))
}

fn items(list: &Value) -> &[Value] {
    list["items"].as_array().map_or(&[], Vec::as_slice)
}

fn forward(kind: Kind, object: &Value, send: &Notifier) -> bool {
    match kind {
        Kind::Nnc => send.send(KubeEvent::Nnc(Nnc::parse(object))),
        Kind::Node => send.send(KubeEvent::NodePodCidrs(nnc::node_pod_cidrs(object))),
    }
}

/// Consecutive conflicts after which a 409 storm is reported (health
/// degraded, a warning per conflict).
pub const CONFLICT_STORM: u32 = 3;

/// Sends the monitor's patches. Every failure — a 409 included, whose
/// re-read also costs a request — is followed by the backoff before the
/// next patch goes out, so a failing or racing API server sees at most two
/// requests per pause from this thread.
fn patch_forever(
    client: &ApiClient,
    node: &str,
    timing: ApiTiming,
    patches: &Receiver<NncPatch>,
    send: &Notifier,
) {
    let path = Kind::Nnc.item_path(node);
    let mut backoff = Backoff::new(timing.max_backoff);
    while let Ok(mut patch) = patches.recv() {
        // Only the newest queued patch matters: each carries the full lists.
        while let Ok(newer) = patches.try_recv() {
            patch = newer;
        }
        let (event, pause) = match client.merge_patch(&path, &patch.to_json()) {
            Ok(_) => {
                backoff.reset();
                (KubeEvent::Patched, None)
            }
            Err(err) if err.is_status(409) => {
                let pause = backoff.next(err.retry_after());
                let streak = backoff.failures();
                if streak >= CONFLICT_STORM {
                    log::warn(
                        "kube",
                        "NodeNetworkConfig patches keep conflicting; slowing down",
                        &[("conflicts", &streak), ("retry_in_ms", &pause.as_millis())],
                    );
                }
                match client.get(&path) {
                    Ok(fresh) => {
                        if !send.send(KubeEvent::Nnc(Nnc::parse(&fresh))) {
                            return;
                        }
                        (KubeEvent::Conflict { streak }, Some(pause))
                    }
                    Err(err) => (KubeEvent::PatchFailed(err.to_string()), Some(pause)),
                }
            }
            Err(err) => {
                let pause = backoff.next(err.retry_after());
                log::warn(
                    "kube",
                    "patching the NodeNetworkConfig failed",
                    &[
                        ("error", &err),
                        ("failures", &backoff.failures()),
                        ("retry_in_ms", &pause.as_millis()),
                    ],
                );
                (KubeEvent::PatchFailed(err.to_string()), Some(pause))
            }
        };
        if !send.send(event) {
            return;
        }
        if let Some(pause) = pause {
            thread::sleep(pause);
        }
    }
}
