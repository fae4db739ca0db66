//! The daemon's single-threaded loop: `poll` over the signal fd, the
//! listening socket, the Kubernetes threads' wake pipe and every client.
//! Each request is handled to completion in turn — that serialisation is
//! what keeps the store simple — while slow or hostile clients only ever
//! cost a non-blocking read or write, and a request waiting for new blocks
//! is parked instead of holding the loop. The requests ready in one turn
//! are committed together (group commit), and answered only after that
//! commit.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signalfd::SignalFd;
use nix::sys::socket::{getsockopt, sockopt};
use nix::unistd::Uid;

use super::conn::{Answer, Conn, Limits, State};
use super::handover::Served;
#[cfg(not(feature = "kube"))]
use super::no_cluster::{Adaptive, Delivery};
use super::restore::Keeper;
#[cfg(feature = "kube")]
use crate::adaptive::{Adaptive, Delivery};
use crate::engine::{Engine, Outcome};
use crate::log;
use crate::metrics::Metrics;
use crate::wire::{Code, Request, Response, reason};

/// Longest single `poll` wait, so deadlines are checked at least this often.
const MAX_POLL_WAIT: Duration = Duration::from_secs(1);

/// Most requests committed together: bounds how long the first of a turn
/// waits for its answer. The rest wait, buffered, for the next turn.
const MAX_BATCH: usize = 64;

/// How long shutdown waits for queued responses to drain.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(2);

/// How long a stopping daemon goes on serving the connections it has
/// (a client that connected just before the stop still sends its
/// request), well inside the DaemonSet's 30 s termination grace period.
const STOP_DRAIN: Duration = Duration::from_secs(10);

/// Who may connect, how many at once, and for how long.
pub struct Admission {
    pub max_connections: usize,
    pub limits: Limits,
    /// Users besides root and the daemon's own user.
    pub allowed_uids: Vec<u32>,
}

impl Admission {
    fn permits(&self, uid: u32) -> bool {
        uid == 0 || uid == Uid::effective().as_raw() || self.allowed_uids.contains(&uid)
    }
}

/// What the daemon's start hands the loop: where requests and signals come
/// from, what serves them, and who may ask.
pub struct LoopParts {
    pub listener: Served,
    pub signals: SignalFd,
    pub engine: Engine,
    pub keeper: Keeper,
    pub adaptive: Option<Adaptive>,
    pub metrics: Arc<Metrics>,
    pub admission: Admission,
}

pub struct EventLoop {
    listener: Served,
    signals: SignalFd,
    engine: Engine,
    /// Puts the database back at its path if it goes (and owns the
    /// checkpoint thread, dropped with the loop before the last words).
    keeper: Keeper,
    adaptive: Option<Adaptive>,
    metrics: Arc<Metrics>,
    conns: Vec<Conn>,
    next_conn_id: u64,
    admission: Admission,
}

impl EventLoop {
    pub fn new(parts: LoopParts) -> EventLoop {
        let LoopParts {
            listener,
            signals,
            engine,
            keeper,
            adaptive,
            metrics,
            admission,
        } = parts;
        EventLoop {
            listener,
            signals,
            engine,
            keeper,
            adaptive,
            metrics,
            conns: Vec::new(),
            next_conn_id: 0,
            admission,
        }
    }

    /// Serves until SIGTERM or SIGINT, then stops taking connections and
    /// answers every one it has (see [`EventLoop::begin_stop`]); gives the
    /// engine back for the last words to its store.
    pub fn run(mut self) -> Engine {
        let mut stop_by: Option<Instant> = None;
        loop {
            let ready = match self.wait(Instant::now()) {
                Ok(ready) => ready,
                Err(err) => {
                    log::error("daemon", "poll failed", &[("error", &err)]);
                    continue;
                }
            };
            let now = Instant::now();
            // Before anything touches the store this turn.
            self.keeper.keep(&mut self.engine);
            if ready.signal && self.take_signal() && stop_by.is_none() {
                stop_by = Some(self.begin_stop(now));
            }
            if ready.wake
                && let Some(adaptive) = self.adaptive.as_mut()
            {
                let deliveries = adaptive.on_wake(&mut self.engine, now);
                self.deliver(deliveries, now);
            }
            if ready.listener {
                self.accept_all(now);
            }
            self.serve(&ready.conns, now);
            if let Some(adaptive) = self.adaptive.as_mut() {
                let mut deliveries = adaptive.retry_woken(&mut self.engine);
                deliveries.extend(adaptive.tick(&mut self.engine, now));
                self.deliver(deliveries, now);
            }
            self.expire(now);
            self.metrics
                .handout_passed_over(self.engine.store_mut().take_passed_over_counts());
            if let Some(deadline) = stop_by
                && self.drained(now, deadline)
            {
                break;
            }
        }
        // A file deleted during the last turn is not left to a successor
        // to create empty.
        self.keeper.keep(&mut self.engine);
        self.drain_on_shutdown();
        self.engine
    }

    fn wait(&self, now: Instant) -> nix::Result<Ready> {
        let mut slots = PollSlots::new(
            self.signals.as_fd(),
            self.listener.as_fd(),
            self.adaptive.as_ref().map(Adaptive::wake_fd),
            &self.conns,
        );
        let buffered = self.conns.iter().any(Conn::has_buffered_request);
        let next_deadline = self
            .conns
            .iter()
            .map(Conn::deadline)
            .chain(self.adaptive.as_ref().and_then(Adaptive::next_deadline))
            .min();
        let wait = match (buffered, next_deadline) {
            (true, _) => Duration::ZERO,
            (false, Some(deadline)) => deadline.saturating_duration_since(now).min(MAX_POLL_WAIT),
            (false, None) => MAX_POLL_WAIT,
        };
        let timeout = PollTimeout::try_from(wait).unwrap_or(PollTimeout::ZERO);
        match poll(&mut slots.fds, timeout) {
            Ok(_) | Err(nix::Error::EINTR) => {}
            Err(err) => return Err(err),
        }
        Ok(slots.ready())
    }

    /// The stop: the socket path goes to a successor or away (see
    /// `handover`), so no new connection can reach this daemon; those
    /// already in the backlog are accepted and served like the rest.
    /// Returns when the drain gives up.
    fn begin_stop(&mut self, now: Instant) -> Instant {
        self.listener.retire();
        self.accept_all(now);
        log::info(
            "daemon",
            "no longer accepting; answering the connections already made",
            &[("connections", &self.conns.len())],
        );
        now + STOP_DRAIN
    }

    /// Whether a stopping daemon is done: every connection answered (parked
    /// requests are answered now: no new blocks are waited for while
    /// stopping), or the drain's time is up.
    fn drained(&mut self, now: Instant, deadline: Instant) -> bool {
        if let Some(adaptive) = self.adaptive.as_mut() {
            let deliveries = adaptive.shutdown(now);
            self.deliver(deliveries, now);
        }
        if now < deadline && !self.conns.iter().all(Conn::is_settled) {
            return false;
        }
        let unsettled = self.conns.iter().filter(|c| !c.is_settled()).count();
        if unsettled > 0 {
            log::warn(
                "daemon",
                "stopping with connections that sent no complete request in time",
                &[("connections", &unsettled)],
            );
        }
        true
    }

    /// True when a shutdown signal arrived.
    fn take_signal(&mut self) -> bool {
        match self.signals.read_signal() {
            Ok(Some(info)) => {
                log::info(
                    "daemon",
                    "received signal, shutting down",
                    &[("signal", &info.ssi_signo)],
                );
                true
            }
            Ok(None) => false,
            Err(err) => {
                log::warn("daemon", "reading signal fd failed", &[("error", &err)]);
                false
            }
        }
    }

    fn accept_all(&mut self, now: Instant) {
        loop {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(err) => {
                    // EMFILE and friends: leave the rest in the backlog.
                    log::warn("daemon", "accept failed", &[("error", &err)]);
                    return;
                }
            };
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let peer_uid = getsockopt(&stream, sockopt::PeerCredentials).map(|c| c.uid());
            self.next_conn_id += 1;
            let mut conn = Conn::new(self.next_conn_id, stream, self.admission.limits, now);
            let refusal = match peer_uid {
                _ if self.conns.len() >= self.admission.max_connections => Some((
                    Code::Unavailable,
                    reason::TOO_MANY_CONNECTIONS,
                    format!(
                        "the daemon is at its limit of {} connections; retry later",
                        self.admission.max_connections
                    ),
                )),
                Ok(uid) if self.admission.permits(uid) => None,
                Ok(uid) => Some((
                    Code::PermissionDenied,
                    reason::PERMISSION_DENIED,
                    format!("user {uid} may not use the metis daemon"),
                )),
                Err(err) => Some((
                    Code::PermissionDenied,
                    reason::PERMISSION_DENIED,
                    format!("cannot read peer credentials: {err}"),
                )),
            };
            match refusal {
                None => self.conns.push(conn),
                Some((code, why, message)) => {
                    log::warn("daemon", "refused connection", &[("reason", &message)]);
                    // Best effort: one non-blocking write, then close.
                    let _ = conn.refuse(code, why, message, now);
                }
            }
        }
    }

    /// One turn's requests: every connection with something to do is
    /// served into the batch, the batch is committed, and only then are
    /// the held replies released.
    fn serve(&mut self, fired: &[Fired], now: Instant) {
        let EventLoop {
            engine,
            adaptive,
            metrics,
            conns,
            ..
        } = self;
        let mut batch = Batch {
            engine,
            adaptive: adaptive.as_mut(),
            handled: 0,
            answered: Vec::new(),
            deferred: None,
            now,
        };
        let mut closed = Vec::new();
        let mut index = 0;
        conns.retain_mut(|conn| {
            // A connection accepted this turn was not in the poll set: its
            // client writes its request right after connecting, so it is
            // read now rather than after one more `poll`.
            let events = fired.get(index).copied().unwrap_or(Fired {
                any: true,
                hung_up: false,
            });
            index += 1;
            let state = match batch.serve_conn(conn, events) {
                None => return true,
                Some(state) => state,
            };
            if state == State::Closed {
                closed.push(conn.id());
            }
            state == State::Open
        });
        let deferred = batch.deferred;
        let failure = batch.commit(metrics);
        conns.retain_mut(|conn| {
            if !conn.holds_replies() || conn.release(failure.as_ref(), now) == State::Open {
                return true;
            }
            closed.push(conn.id());
            false
        });
        // The connection the full batch turned away goes first next turn.
        if let Some(at) = deferred.and_then(|id| conns.iter().position(|conn| conn.id() == id)) {
            conns.rotate_left(at);
        }
        self.forget(&closed);
    }

    /// Sends responses of parked requests to their connections.
    fn deliver(&mut self, deliveries: Vec<Delivery>, now: Instant) {
        let mut closed = Vec::new();
        for (conn_id, outcome) in deliveries {
            if let Some(conn) = self.conns.iter_mut().find(|conn| conn.id() == conn_id)
                && conn.deliver(&outcome.into_response(), now) == State::Closed
            {
                closed.push(conn_id);
            }
        }
        self.conns.retain(|conn| !closed.contains(&conn.id()));
        self.forget(&closed);
    }

    fn expire(&mut self, now: Instant) {
        let mut closed = Vec::new();
        self.conns.retain(|conn| {
            let alive = conn.deadline() > now;
            if !alive {
                closed.push(conn.id());
            }
            alive
        });
        if !closed.is_empty() {
            log::debug(
                "daemon",
                "closed connections past their deadline",
                &[("count", &closed.len())],
            );
        }
        self.forget(&closed);
    }

    /// Drops parked requests of connections that are gone.
    fn forget(&mut self, closed: &[u64]) {
        if let Some(adaptive) = self.adaptive.as_mut() {
            for conn_id in closed {
                adaptive.forget(*conn_id);
            }
        }
    }

    /// Responses already queued are delivered before the daemon exits.
    fn drain_on_shutdown(&mut self) {
        let give_up = Instant::now() + SHUTDOWN_FLUSH;
        self.conns.retain(Conn::wants_write);
        while !self.conns.is_empty() && Instant::now() < give_up {
            let mut fds: Vec<PollFd> = self
                .conns
                .iter()
                .map(|conn| PollFd::new(conn.stream().as_fd(), PollFlags::POLLOUT))
                .collect();
            let timeout =
                PollTimeout::try_from(Duration::from_millis(100)).unwrap_or(PollTimeout::ZERO);
            if poll(&mut fds, timeout).is_err() {
                break;
            }
            drop(fds);
            let now = Instant::now();
            self.conns
                .retain_mut(|conn| conn.flush(now) == State::Open && conn.wants_write());
        }
    }
}

struct Ready {
    signal: bool,
    listener: bool,
    wake: bool,
    conns: Vec<Fired>,
}

/// What `poll` reported for one connection.
#[derive(Debug, Clone, Copy, Default)]
struct Fired {
    /// Anything at all.
    any: bool,
    /// The client closed its end (`POLLHUP`): gone, not only done sending.
    hung_up: bool,
}

/// The poll set: the signal fd, the listener and (with a cluster) the
/// wake pipe in slots of their own, then one slot per connection, in the
/// order of `EventLoop::conns`.
struct PollSlots<'fd> {
    fds: Vec<PollFd<'fd>>,
    signal: usize,
    listener: usize,
    wake: Option<usize>,
    first_conn: usize,
}

impl<'fd> PollSlots<'fd> {
    fn new(
        signals: BorrowedFd<'fd>,
        listener: BorrowedFd<'fd>,
        wake: Option<BorrowedFd<'fd>>,
        conns: &'fd [Conn],
    ) -> PollSlots<'fd> {
        let mut fds = Vec::with_capacity(3 + conns.len());
        let mut slot = |fd: BorrowedFd<'fd>, interest: PollFlags| {
            fds.push(PollFd::new(fd, interest));
            fds.len() - 1
        };
        let signal = slot(signals, PollFlags::POLLIN);
        let listener = slot(listener, PollFlags::POLLIN);
        let wake = wake.map(|fd| slot(fd, PollFlags::POLLIN));
        let first_conn = fds.len();
        for conn in conns {
            fds.push(PollFd::new(conn.stream().as_fd(), conn.interest()));
        }
        PollSlots {
            fds,
            signal,
            listener,
            wake,
            first_conn,
        }
    }

    /// What `poll` reported, slot by slot.
    fn ready(&self) -> Ready {
        let events = |slot: usize| {
            self.fds
                .get(slot)
                .and_then(PollFd::revents)
                .unwrap_or(PollFlags::empty())
        };
        let fired = |slot: usize| !events(slot).is_empty();
        Ready {
            signal: fired(self.signal),
            listener: fired(self.listener),
            wake: self.wake.is_some_and(fired),
            conns: (self.first_conn..self.fds.len())
                .map(|slot| Fired {
                    any: fired(slot),
                    hung_up: events(slot).contains(PollFlags::POLLHUP),
                })
                .collect(),
        }
    }
}

/// The requests of one loop turn, run in the engine's open batch.
struct Batch<'a> {
    engine: &'a mut Engine,
    adaptive: Option<&'a mut Adaptive>,
    /// Every request of the turn counts towards [`MAX_BATCH`], parked ones
    /// included.
    handled: usize,
    /// The answered ones, counted in the metrics once the commit decided
    /// their code.
    answered: Vec<(&'static str, Instant, Code)>,
    /// The connection whose request the full batch turned away.
    deferred: Option<u64>,
    now: Instant,
}

impl Batch<'_> {
    /// Serves what a connection has: its buffered requests first, else what
    /// `poll` reported for it. `None` when it had nothing to do.
    fn serve_conn(&mut self, conn: &mut Conn, events: Fired) -> Option<State> {
        let now = self.now;
        if conn.has_buffered_request() {
            Some(conn.process(now, &mut |id, request| self.answer(id, request)))
        } else if !events.any {
            None
        } else if conn.wants_write() {
            Some(conn.flush(now))
        } else {
            Some(conn.on_readable(now, events.hung_up, &mut |id, request| {
                self.answer(id, request)
            }))
        }
    }

    /// Runs one request in the batch, unless the batch is full; the
    /// adaptive side may park it.
    fn answer(&mut self, conn_id: u64, request: Request) -> Answer {
        if self.handled >= MAX_BATCH {
            self.deferred.get_or_insert(conn_id);
            return Answer::Later;
        }
        self.handled += 1;
        let started = Instant::now();
        let method = request.method();
        let outcome = match crate::decode::decode(request) {
            Err(failure) => Some(Outcome::from(failure)),
            Ok(command) => {
                let outcome = self.engine.handle_in_batch(&command, log::now_ms());
                match self.adaptive.as_deref_mut() {
                    None => Some(outcome),
                    Some(adaptive) => adaptive.intercept(conn_id, command, outcome, self.now),
                }
            }
        };
        match outcome {
            Some(outcome) => {
                self.answered.push((method, started, outcome.code()));
                Answer::Reply(Box::new(outcome.into_response()))
            }
            None => Answer::Parked,
        }
    }

    /// Commits the batch and counts its answered requests; on failure,
    /// returns the reply each of them gets instead of its own.
    fn commit(self, metrics: &Metrics) -> Option<Response> {
        let failure = self.engine.commit_batch();
        if let Some(failure) = &failure {
            log::error(
                "daemon",
                "committing a batch of requests failed; each is answered with the error",
                &[("requests", &self.handled), ("error", &failure.message)],
            );
        }
        for (method, started, code) in self.answered {
            let code = failure.as_ref().map_or(code, |failure| failure.code);
            metrics.observe_request(method, code.as_str_name(), started.elapsed());
        }
        failure.map(|failure| Outcome::from(failure).into_response())
    }
}
