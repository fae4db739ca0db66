//! The threads that talk to the API server. The watcher lists and watches
//! this node's object and forwards every new version; the patcher applies
//! the monitor's patches. Neither touches SQLite: the daemon's loop stays
//! the only writer of the store and receives everything as [`KubeEvent`]s.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread;
use std::time::Duration;

use serde_json::Value;

use super::client::{ApiClient, KubeError};
use super::nnc::{self, Kind, Nnc, NncPatch};
use crate::log;

/// Pause after the first failure; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What the API threads tell the loop.
#[derive(Debug)]
pub enum KubeEvent {
    /// A (new version of) this node's NodeNetworkConfig.
    Nnc(Nnc),
    /// This node's `spec.podCIDRs`.
    NodePodCidrs(Vec<String>),
    /// The API server could not be reached or refused us.
    Unreachable(String),
    /// A patch was applied.
    Patched,
    /// A patch lost an optimistic-concurrency race (409); a fresh object
    /// follows as an `Nnc` event.
    Conflict,
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
pub fn spawn(client: ApiClient, node: String, kind: Kind) -> std::io::Result<KubeLink> {
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
            .spawn(move || watch_forever(&client, &node, kind, &send))?;
    }
    if kind == Kind::Nnc {
        thread::Builder::new()
            .name("kube-patch".into())
            .spawn(move || patch_forever(&client, &node, &patch_rx, &send))?;
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

fn watch_forever(client: &ApiClient, node: &str, kind: Kind, send: &Notifier) {
    let mut backoff = FIRST_BACKOFF;
    loop {
        match watch_once(client, node, kind, send, &mut backoff) {
            Ok(()) => return,
            Err(err) => {
                log::warn(
                    "kube",
                    "API watch failed, retrying",
                    &[("error", &err), ("retry_in_ms", &backoff.as_millis())],
                );
                if !send.send(KubeEvent::Unreachable(err.to_string())) {
                    return;
                }
                thread::sleep(backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Ensures, lists, then follows the object until the stream fails. Returns
/// `Ok` only when the loop has gone away. A successful list resets the
/// backoff: the server is back.
fn watch_once(
    client: &ApiClient,
    node: &str,
    kind: Kind,
    send: &Notifier,
    backoff: &mut Duration,
) -> Result<(), KubeError> {
    if kind == Kind::Nnc {
        nnc::ensure(client, node)?;
    }
    let mut version = {
        let list = client.get(&kind.list_path(node))?;
        *backoff = FIRST_BACKOFF;
        let version = nnc::resource_version(&list);
        let items = list["items"].as_array().cloned().unwrap_or_default();
        for item in &items {
            if !forward(kind, item, send) {
                return Ok(());
            }
        }
        if items.is_empty() && kind == Kind::Nnc {
            // Deleted between ensure and list: start over.
            return Err(KubeError::Decode("NodeNetworkConfig vanished".into()));
        }
        version
    };
    loop {
        for event in client.watch(&kind.watch_path(node, &version))? {
            let event = event?;
            match event.kind.as_str() {
                "ADDED" | "MODIFIED" => {
                    version = nnc::resource_version(&event.object);
                    if !forward(kind, &event.object, send) {
                        return Ok(());
                    }
                }
                "BOOKMARK" => version = nnc::resource_version(&event.object),
                "DELETED" => return Err(KubeError::Decode("object deleted; re-creating".into())),
                // 410 Gone (or any error): the version is too old; relist.
                _ => {
                    let code = event.object["code"].as_u64().unwrap_or(0);
                    return Err(KubeError::Status {
                        code: u16::try_from(code).unwrap_or(0),
                        body: event.object.to_string(),
                    });
                }
            }
        }
        // The server ended the watch (timeoutSeconds): resume from `version`.
        log::trace(
            "kube",
            "watch ended by the server, resuming",
            &[("version", &version)],
        );
    }
}

fn forward(kind: Kind, object: &Value, send: &Notifier) -> bool {
    match kind {
        Kind::Nnc => send.send(KubeEvent::Nnc(Nnc::parse(object))),
        Kind::Node => send.send(KubeEvent::NodePodCidrs(nnc::node_pod_cidrs(object))),
    }
}

fn patch_forever(client: &ApiClient, node: &str, patches: &Receiver<NncPatch>, send: &Notifier) {
    let path = Kind::Nnc.item_path(node);
    while let Ok(mut patch) = patches.recv() {
        // Only the newest queued patch matters: each carries the full lists.
        while let Ok(newer) = patches.try_recv() {
            patch = newer;
        }
        let event = match client.merge_patch(&path, &patch.to_json()) {
            Ok(_) => KubeEvent::Patched,
            Err(err) if err.is_status(409) => match client.get(&path) {
                Ok(fresh) => {
                    if !send.send(KubeEvent::Nnc(Nnc::parse(&fresh))) {
                        return;
                    }
                    KubeEvent::Conflict
                }
                Err(err) => KubeEvent::PatchFailed(err.to_string()),
            },
            Err(err) => KubeEvent::PatchFailed(err.to_string()),
        };
        if !send.send(event) {
            return;
        }
    }
}
