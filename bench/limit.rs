//! The design's limit: the plugin against a daemon that answers at once.
//! A thread of the bench listens on a Unix socket and answers every request
//! with the frame a real daemon of the same build sent to the same kind of
//! request (recorded at the start), so the plugin's whole path is timed
//! with none of the daemon's work.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use metis::wire::frame::{self, MAX_REQUEST_FRAME, MAX_RESPONSE_FRAME};
use metis::wire::{Request, request};
use prost::Message;

use crate::util::{
    Build, RANGE_V4, TempDir, allocate_request, allocated, client, release_request, released,
};

/// The frames a real daemon answered an ADD and a DEL with.
struct Answers {
    allocate: Vec<u8>,
    release: Vec<u8>,
}

impl Answers {
    fn record(build: &Build) -> Answers {
        let dir = TempDir::new(&format!("limit-record-{}", build.name()));
        let daemon = build.daemon(&dir, &[]);
        let mut client = client(&daemon);
        let allocate = client
            .call(&allocate_request("bench-limit", &[RANGE_V4]))
            .unwrap();
        allocated(&allocate);
        let release = client.call(&release_request("bench-limit")).unwrap();
        released(&release);
        let framed = |payload: Vec<u8>| frame::encode(&payload, MAX_RESPONSE_FRAME).unwrap();
        Answers {
            allocate: framed(allocate.encode_to_vec()),
            release: framed(release.encode_to_vec()),
        }
    }

    /// The recorded answer to one connection's request.
    fn answer(&self, stream: &mut UnixStream) {
        let Ok(payload) = frame::read_frame(stream, MAX_REQUEST_FRAME) else {
            return;
        };
        let kind = Request::decode(payload.as_slice())
            .ok()
            .and_then(|r| r.kind);
        let answer = match kind {
            Some(request::Kind::Allocate(_)) => &self.allocate,
            Some(request::Kind::Deallocate(_)) => &self.release,
            // Nothing recorded for it: closing unanswered fails the plugin,
            // and with it the bench, on the exec that sent it.
            _ => return,
        };
        let _ = stream.write_all(answer);
    }
}

/// A replaying daemon on `dir`'s `metis.sock`, the one the bench's
/// configuration for `dir` names.
pub struct Replay {
    socket: std::path::PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Replay {
    pub fn start(build: &Build, dir: &TempDir) -> Replay {
        let answers = Answers::record(build);
        let socket = dir.join("metis.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::Relaxed) {
                    return;
                }
                if let Ok(mut stream) = stream {
                    answers.answer(&mut stream);
                }
            }
        });
        Replay {
            socket,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop to see the flag.
        let _ = UnixStream::connect(&self.socket);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
