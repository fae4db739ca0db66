//! One client connection of the daemon: non-blocking buffers and deadlines,
//! so no client can hold the single-threaded loop. Replies of a loop turn
//! are held until the loop has committed the turn's requests.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::poll::PollFlags;
use prost::Message;

use crate::wire::frame::{self, MAX_REQUEST_FRAME, MAX_RESPONSE_FRAME};
use crate::wire::{Code, Request, Response, reason};

/// Room made in a connection's input before reading: a plugin's request
/// is a few hundred bytes; larger ones grow the buffer as they arrive.
const READ_RESERVE: usize = 1024;

/// Timing limits applied to every connection.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A connection with nothing in flight is closed after this long.
    pub idle: Duration,
    /// A started request must fully arrive, and a response fully drain,
    /// within this; a client trickling bytes is cut off here.
    pub request: Duration,
}

/// What became of one request handed to the loop.
pub enum Answer {
    /// Its reply, to be sent once the loop's batch is committed (boxed: a
    /// reply is ten times the size of the other answers).
    Reply(Box<Response>),
    /// Parked: the reply comes later through [`Conn::deliver`].
    Parked,
    /// The batch is full: the request stays buffered for the next turn.
    Later,
}

/// Answers one request of a connection (by id).
pub type Handler<'a> = dyn FnMut(u64, Request) -> Answer + 'a;

/// What the loop should do with a connection after an event.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum State {
    Open,
    Closed,
}

/// How long a connection waiting for a parked request may stay silent; the
/// parked request's own deadline answers it long before.
const AWAITING_IDLE: Duration = Duration::from_secs(3600);

pub struct Conn {
    id: u64,
    stream: UnixStream,
    limits: Limits,
    input: Vec<u8>,
    output: Vec<u8>,
    written: usize,
    last_activity: Instant,
    /// When the first byte of the request still being received arrived.
    partial_since: Option<Instant>,
    /// When the oldest unsent response byte was queued.
    write_since: Option<Instant>,
    /// Set after a fatal protocol error: flush the reply, then close.
    closing: bool,
    /// A response was queued: the client has had an answer.
    answered: bool,
    peer_closed: bool,
    /// A request of this connection is parked; nothing more is processed
    /// until its response is delivered.
    awaiting: bool,
    /// Replies of this turn, in request order, not sent before the loop's
    /// commit: `true` marks those of the batch, which a failed commit
    /// replaces; protocol errors (`false`) stand either way.
    held: Vec<(Response, bool)>,
}

impl Conn {
    pub fn new(id: u64, stream: UnixStream, limits: Limits, now: Instant) -> Conn {
        Conn {
            id,
            stream,
            limits,
            input: Vec::new(),
            output: Vec::new(),
            written: 0,
            last_activity: now,
            partial_since: None,
            write_since: None,
            closing: false,
            answered: false,
            peer_closed: false,
            awaiting: false,
            held: Vec::new(),
        }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// When this connection is closed unless something happens first.
    pub fn deadline(&self) -> Instant {
        if self.awaiting {
            return self.last_activity + AWAITING_IDLE;
        }
        match (self.write_since, self.partial_since) {
            (Some(since), _) | (None, Some(since)) => since + self.limits.request,
            (None, None) => self.last_activity + self.limits.idle,
        }
    }

    /// Whether there are response bytes waiting for the socket.
    pub fn wants_write(&self) -> bool {
        self.written < self.output.len()
    }

    /// What `poll` should watch for: room to write while a response is
    /// unsent; else input — except from a client that shut its sending
    /// side after a request now parked, which stays readable (the end of
    /// the stream) and would wake every turn: then only its hang-up
    /// (`POLLHUP`, reported whatever is asked) matters.
    pub fn interest(&self) -> PollFlags {
        if self.wants_write() {
            PollFlags::POLLOUT
        } else if self.awaiting && self.peer_closed {
            PollFlags::empty()
        } else {
            PollFlags::POLLIN
        }
    }

    /// Queues a response that ends the connection (cap reached, peer
    /// refused, protocol error): it is flushed, then the socket closed.
    pub fn refuse(&mut self, code: Code, why: &str, message: String, now: Instant) -> State {
        self.queue(&Response::error(code, why, message), now);
        self.closing = true;
        self.flush(now)
    }

    /// Whether a complete request is buffered and may be processed now
    /// (left over after a parked request was answered).
    pub fn has_buffered_request(&self) -> bool {
        !self.awaiting
            && !self.closing
            && matches!(frame::split(&self.input, MAX_REQUEST_FRAME), Ok(Some(_)))
    }

    /// Reads what the socket has, then answers every complete request with
    /// `handle`, which returns `None` when it parked the request.
    /// `hung_up`: `poll` reported the client's end closed.
    pub fn on_readable(&mut self, now: Instant, hung_up: bool, handle: &mut Handler<'_>) -> State {
        if self.fill_input(now) == State::Closed {
            return State::Closed;
        }
        if self.awaiting {
            // Only a hang-up matters while the answer is pending: the end
            // of the stream alone is a client that shut its sending side
            // after its request (`Client::call_once`) and waits for the
            // answer.
            return if hung_up { State::Closed } else { State::Open };
        }
        self.process(now, handle)
    }

    /// Delivers the response of a parked request, then serves anything
    /// buffered behind it.
    pub fn deliver(&mut self, reply: &Response, now: Instant) -> State {
        self.awaiting = false;
        self.queue(reply, now);
        self.flush(now)
    }

    /// Answers the complete requests already buffered, until the batch is
    /// full; the replies are held until [`Conn::release`].
    pub fn process(&mut self, now: Instant, handle: &mut Handler<'_>) -> State {
        while !self.closing && !self.awaiting {
            match frame::split(&self.input, MAX_REQUEST_FRAME) {
                Ok(Some((payload, used))) => {
                    let decoded = self.input.get(payload).map(Request::decode);
                    let answer = match decoded {
                        Some(Ok(request)) => handle(self.id, request),
                        Some(Err(err)) => {
                            self.held.push((
                                Response::error(
                                    Code::InvalidArgument,
                                    reason::MALFORMED_REQUEST,
                                    format!("undecodable request: {err}"),
                                ),
                                false,
                            ));
                            self.input.drain(..used);
                            continue;
                        }
                        None => break,
                    };
                    match answer {
                        Answer::Reply(reply) => self.held.push((*reply, true)),
                        Answer::Parked => self.awaiting = true,
                        Answer::Later => break,
                    }
                    self.input.drain(..used);
                }
                Ok(None) => break,
                Err(err) => {
                    self.input.clear();
                    let refusal = Response::error(
                        Code::InvalidArgument,
                        reason::MALFORMED_REQUEST,
                        err.to_string(),
                    );
                    self.held.push((refusal, false));
                    self.closing = true;
                }
            }
        }
        // (A complete request left for the next turn, the batch being
        // full, is not cut.)
        if self.peer_closed
            && !self.input.is_empty()
            && !self.awaiting
            && !self.closing
            && matches!(frame::split(&self.input, MAX_REQUEST_FRAME), Ok(None))
        {
            // The client shut its sending side in the middle of a frame:
            // nothing more can come, so it is told (after the replies to
            // what it sent complete).
            self.input.clear();
            let refusal = Response::error(
                Code::InvalidArgument,
                reason::MALFORMED_REQUEST,
                "the request ended in the middle of its frame".to_string(),
            );
            self.held.push((refusal, false));
            self.closing = true;
        }
        self.partial_since = match (self.input.is_empty(), self.partial_since) {
            (true, _) => None,
            (false, Some(since)) => Some(since),
            (false, None) => Some(now),
        };
        self.flush(now)
    }

    /// Whether a stopping daemon may close the connection: nothing
    /// received, held, parked or unsent, and the client has had its answer
    /// (or hung up). One that connected but has not sent its request yet is
    /// waited for.
    pub fn is_settled(&self) -> bool {
        self.input.is_empty()
            && !self.wants_write()
            && self.held.is_empty()
            && !self.awaiting
            && (self.answered || self.peer_closed)
    }

    /// Whether replies wait for the loop's commit.
    pub fn holds_replies(&self) -> bool {
        !self.held.is_empty()
    }

    /// Sends the held replies once the loop's commit is decided: with
    /// `failure`, each reply of the batch is replaced by it, since nothing
    /// the request did was kept.
    pub fn release(&mut self, failure: Option<&Response>, now: Instant) -> State {
        for (reply, batched) in std::mem::take(&mut self.held) {
            match failure {
                Some(failure) if batched => self.queue(failure, now),
                _ => self.queue(&reply, now),
            }
        }
        let state = self.flush(now);
        if state == State::Closed || self.wants_write() || self.awaiting || self.peer_closed {
            return state;
        }
        // A plugin shuts its sending side right after its request; when the
        // request was read before that, the end of the stream has usually
        // arrived while the turn committed: one read now saves a wake-up.
        if self.fill_input(now) == State::Closed || (self.peer_closed && self.input.is_empty()) {
            return State::Closed;
        }
        State::Open
    }

    /// Writes queued response bytes until the socket would block; nothing
    /// while replies are held, so no reply overtakes an earlier one.
    pub fn flush(&mut self, now: Instant) -> State {
        if self.holds_replies() {
            return State::Open;
        }
        while self.wants_write() {
            let pending = self.output.get(self.written..).unwrap_or_default();
            match self.stream.write(pending) {
                Ok(0) => return State::Closed,
                Ok(n) => {
                    self.written += n;
                    self.last_activity = now;
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return State::Open,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return State::Closed,
            }
        }
        self.output.clear();
        self.written = 0;
        self.write_since = None;
        // A client that shut its sending side is done once nothing it sent
        // waits: a request the full batch left for the next turn still does.
        if self.closing || (self.peer_closed && !self.awaiting && self.input.is_empty()) {
            return State::Closed;
        }
        State::Open
    }

    /// Reads what the socket has straight into `input` (no zeroed scratch
    /// buffer per read: that was most of a small request's work here).
    fn fill_input(&mut self, now: Instant) -> State {
        // Never buffer more than one maximal frame; the prefix check in
        // `frame::split` refuses anything larger as soon as it is readable.
        let cap = MAX_REQUEST_FRAME + frame::PREFIX_LEN;
        let room = cap.saturating_sub(self.input.len());
        if room == 0 {
            return State::Open;
        }
        self.input.reserve(READ_RESERVE.min(room));
        let before = self.input.len();
        let limit = u64::try_from(room).unwrap_or(u64::MAX);
        // Bytes read before an error stay appended (`Read::read_to_end`).
        let read = (&self.stream).take(limit).read_to_end(&mut self.input);
        if self.input.len() > before {
            self.last_activity = now;
        }
        match read {
            // The end of the stream, unless the limit ended the read.
            Ok(_) if self.input.len() < cap => {
                self.peer_closed = true;
                State::Open
            }
            Ok(_) => State::Open,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => State::Open,
            Err(_) => State::Closed,
        }
    }

    fn queue(&mut self, reply: &Response, now: Instant) {
        let frame = frame::encode(&reply.encode_to_vec(), MAX_RESPONSE_FRAME).or_else(|err| {
            let refusal = Response::error(
                Code::ResourceExhausted,
                reason::MALFORMED_REQUEST,
                format!("response not sent: {err}; narrow the request with filters"),
            );
            frame::encode(&refusal.encode_to_vec(), MAX_RESPONSE_FRAME)
        });
        if let Ok(frame) = frame {
            self.output.extend_from_slice(&frame);
            self.write_since.get_or_insert(now);
            self.answered = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::Shutdown;
    use std::os::fd::AsFd;

    use nix::poll::{PollFd, PollTimeout, poll};

    use super::*;
    use crate::wire::{HealthCheckRequest, request};

    const LIMITS: Limits = Limits {
        idle: Duration::from_secs(60),
        request: Duration::from_secs(60),
    };

    fn health() -> Vec<u8> {
        let request = Request {
            kind: Some(request::Kind::Health(HealthCheckRequest {})),
        };
        frame::encode(&request.encode_to_vec(), MAX_REQUEST_FRAME).unwrap()
    }

    /// A connection on one end of a socket pair, the client on the other.
    fn pair() -> (Conn, UnixStream) {
        let (daemon, client) = UnixStream::pair().unwrap();
        daemon.set_nonblocking(true).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        (Conn::new(1, daemon, LIMITS, Instant::now()), client)
    }

    /// What `poll` reports for the connection now, asking what it asks.
    fn events(conn: &Conn) -> PollFlags {
        let mut fds = [PollFd::new(conn.stream().as_fd(), conn.interest())];
        poll(&mut fds, PollTimeout::ZERO).unwrap();
        fds[0].revents().unwrap()
    }

    fn answer(code: Code) -> Response {
        Response::error(code, "test", "answer".to_string())
    }

    /// The responses the client reads, then whether the stream ended.
    fn read_all(client: &mut UnixStream) -> (Vec<Code>, bool) {
        let mut bytes = Vec::new();
        let ended = client.read_to_end(&mut bytes).is_ok();
        let mut codes = Vec::new();
        let mut rest = bytes.as_slice();
        while let Ok(Some((payload, used))) = frame::split(rest, MAX_RESPONSE_FRAME) {
            codes.push(Response::decode(&rest[payload]).unwrap().code());
            rest = &rest[used..];
        }
        (codes, ended)
    }

    #[test]
    fn a_request_then_a_half_close_is_answered_and_the_daemon_closes() {
        let (mut conn, mut client) = pair();
        client.write_all(&health()).unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let now = Instant::now();
        let state = conn.on_readable(now, false, &mut |_, _| {
            Answer::Reply(Box::new(answer(Code::Ok)))
        });
        assert_eq!(state, State::Open, "the reply waits for the commit");
        // Sent, then closed: no wake-up for a hang-up is needed.
        assert_eq!(conn.release(None, now), State::Closed);
        drop(conn);
        assert_eq!(read_all(&mut client), (vec![Code::Ok], true));
    }

    #[test]
    fn a_half_close_that_came_during_the_commit_is_seen_as_the_reply_goes() {
        let (mut conn, mut client) = pair();
        client.write_all(&health()).unwrap();
        let now = Instant::now();
        let reply = &mut |_, _| Answer::Reply(Box::new(answer(Code::Ok)));
        assert_eq!(conn.on_readable(now, false, reply), State::Open);
        client.shutdown(Shutdown::Write).unwrap();
        assert_eq!(conn.release(None, now), State::Closed);
        drop(conn);
        assert_eq!(read_all(&mut client), (vec![Code::Ok], true));
        // A client that stays for another request keeps its connection.
        let (mut conn, client) = pair();
        (&client).write_all(&health()).unwrap();
        assert_eq!(conn.on_readable(now, false, reply), State::Open);
        assert_eq!(conn.release(None, now), State::Open);
        (&client).write_all(&health()).unwrap();
        assert_eq!(conn.on_readable(now, false, reply), State::Open);
        assert_eq!(conn.release(None, now), State::Open);
    }

    #[test]
    fn a_parked_request_waits_through_a_half_close_and_ends_on_a_hang_up() {
        let (mut conn, mut client) = pair();
        client.write_all(&health()).unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let now = Instant::now();
        assert_eq!(
            conn.on_readable(now, false, &mut |_, _| Answer::Parked),
            State::Open
        );
        // The end of the stream stays readable; it is not asked for, so
        // the parked connection does not wake the loop every turn.
        assert_eq!(conn.interest(), PollFlags::empty());
        assert_eq!(events(&conn), PollFlags::empty());
        // Answered later: delivered, then closed.
        assert_eq!(conn.deliver(&answer(Code::Ok), now), State::Closed);
        drop(conn);
        assert_eq!(read_all(&mut client), (vec![Code::Ok], true));

        let (mut conn, client) = pair();
        let mut sending = client.try_clone().unwrap();
        sending.write_all(&health()).unwrap();
        sending.shutdown(Shutdown::Write).unwrap();
        assert_eq!(
            conn.on_readable(now, false, &mut |_, _| Answer::Parked),
            State::Open
        );
        drop((client, sending));
        // The hang-up is reported although nothing is asked for.
        let fired = events(&conn);
        assert!(fired.contains(PollFlags::POLLHUP), "{fired:?}");
        let mut handled = false;
        let state = conn.on_readable(now, true, &mut |_, _| {
            handled = true;
            Answer::Parked
        });
        assert_eq!(state, State::Closed);
        assert!(!handled);
    }

    #[test]
    fn a_parked_request_of_a_client_that_keeps_sending_waits_for_a_hang_up() {
        let (mut conn, client) = pair();
        (&client).write_all(&health()).unwrap();
        let now = Instant::now();
        assert_eq!(
            conn.on_readable(now, false, &mut |_, _| Answer::Parked),
            State::Open
        );
        assert_eq!(conn.interest(), PollFlags::POLLIN);
        // A second request behind the parked one is buffered, not served.
        (&client).write_all(&health()).unwrap();
        let mut handled = false;
        let state = conn.on_readable(now, false, &mut |_, _| {
            handled = true;
            Answer::Parked
        });
        assert_eq!((state, handled), (State::Open, false));
        drop(client);
        assert!(events(&conn).contains(PollFlags::POLLHUP));
        assert_eq!(
            conn.on_readable(now, true, &mut |_, _| Answer::Parked),
            State::Closed
        );
    }

    #[test]
    fn a_half_close_in_the_middle_of_a_frame_is_refused() {
        let (mut conn, mut client) = pair();
        let request = health();
        client.write_all(&request[..request.len() - 1]).unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let now = Instant::now();
        let mut handled = false;
        let state = conn.on_readable(now, false, &mut |_, _| {
            handled = true;
            Answer::Reply(Box::new(answer(Code::Ok)))
        });
        assert!(!handled);
        assert_eq!(state, State::Open, "the refusal waits behind the commit");
        assert_eq!(conn.release(None, now), State::Closed);
        drop(conn);
        assert_eq!(read_all(&mut client), (vec![Code::InvalidArgument], true));
    }

    #[test]
    fn a_request_left_for_the_next_turn_by_a_full_batch_survives_a_half_close() {
        let (mut conn, mut client) = pair();
        client.write_all(&health()).unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let now = Instant::now();
        assert_eq!(
            conn.on_readable(now, false, &mut |_, _| Answer::Later),
            State::Open
        );
        assert!(conn.has_buffered_request());
        let state = conn.process(now, &mut |_, _| Answer::Reply(Box::new(answer(Code::Ok))));
        assert_eq!(state, State::Open);
        assert_eq!(conn.release(None, now), State::Closed);
        drop(conn);
        assert_eq!(read_all(&mut client), (vec![Code::Ok], true));
    }

    #[test]
    fn a_half_close_before_any_request_ends_the_connection() {
        let (mut conn, mut client) = pair();
        client.shutdown(Shutdown::Write).unwrap();
        let state = conn.on_readable(Instant::now(), false, &mut |_, _| {
            Answer::Reply(Box::new(answer(Code::Ok)))
        });
        assert_eq!(state, State::Closed);
        assert!(conn.is_settled());
        drop(conn);
        assert_eq!(read_all(&mut client), (vec![], true));
    }
}
