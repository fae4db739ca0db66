//! A blocking client over a Unix stream socket with connect, read and write
//! deadlines: one framed request, one framed response.

use std::fmt;
use std::io::{self, BufReader};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr, sockopt};
use nix::sys::time::TimeVal;
use prost::Message;

use super::frame::{self, FrameError, MAX_REQUEST_FRAME, MAX_RESPONSE_FRAME};
use super::{Code, Request, Response, response, starting};
use crate::log;

/// Pause between connection attempts while waiting.
const CONNECT_RETRY_PAUSE: Duration = Duration::from_millis(10);
/// Bytes asked for by the first read of a response: an ADD's answer is
/// about 40.
const RESPONSE_READ: usize = 4096;

/// Why a call did not produce a response.
#[derive(Debug)]
pub enum ClientError {
    /// The daemon could not be reached at all: nothing was sent, so the
    /// caller may safely do the work another way (direct mode).
    Connect { path: PathBuf, source: io::Error },
    /// The request is larger than the daemon accepts: nothing was sent,
    /// and sending it again cannot help.
    TooLarge { len: usize, max: usize },
    /// The request was (possibly) sent but no complete response came back.
    Exchange { path: PathBuf, source: FrameError },
    /// The response bytes are not a valid message.
    Decode {
        path: PathBuf,
        source: prost::DecodeError,
    },
}

impl ClientError {
    /// True when the failure happened before anything was sent.
    pub fn is_connect(&self) -> bool {
        matches!(self, ClientError::Connect { .. })
    }

    /// True when nothing listens on the socket (no file there, or a socket
    /// left by a daemon that is gone): waiting helps only if a daemon is
    /// starting (see [`super::starting`]).
    pub fn nothing_listens(&self) -> bool {
        self.connect_failed_with(&[io::ErrorKind::NotFound, io::ErrorKind::ConnectionRefused])
    }

    /// True when a daemon listens but its backlog stayed full for the whole
    /// connect timeout.
    pub fn listener_busy(&self) -> bool {
        self.connect_failed_with(&[io::ErrorKind::WouldBlock, io::ErrorKind::TimedOut])
    }

    fn connect_failed_with(&self, kinds: &[io::ErrorKind]) -> bool {
        matches!(self, ClientError::Connect { source, .. } if kinds.contains(&source.kind()))
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Connect { path, source } => {
                write!(
                    f,
                    "cannot connect to the metis daemon at {}: {source}",
                    path.display()
                )
            }
            ClientError::TooLarge { len, max } => write!(
                f,
                "the request is {len} bytes, more than the {max} the metis daemon accepts; nothing was sent"
            ),
            ClientError::Exchange { path, source } => {
                write!(
                    f,
                    "no response from the metis daemon at {}: {source}",
                    path.display()
                )
            }
            ClientError::Decode { path, source } => write!(
                f,
                "undecodable response from the metis daemon at {}: {source}",
                path.display()
            ),
        }
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ClientError::Connect { source, .. } => Some(source),
            ClientError::Exchange { source, .. } => Some(source),
            ClientError::Decode { source, .. } => Some(source),
            ClientError::TooLarge { .. } => None,
        }
    }
}

/// A connection to the daemon.
pub struct Client {
    stream: UnixStream,
    path: PathBuf,
}

impl Client {
    /// Connects within `connect_timeout`; every later read and write must
    /// finish within `io_timeout`.
    pub fn connect(
        path: &Path,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Result<Client, ClientError> {
        let connect_err = |source: io::Error| ClientError::Connect {
            path: path.to_path_buf(),
            source,
        };
        let stream = connect_with_timeout(path, connect_timeout).map_err(connect_err)?;
        stream
            .set_read_timeout(Some(io_timeout))
            .and_then(|()| stream.set_write_timeout(Some(io_timeout)))
            .map_err(connect_err)?;
        Ok(Client {
            stream,
            path: path.to_path_buf(),
        })
    }

    /// Sends one request and waits for its response; the connection stays
    /// open for another.
    pub fn call(&mut self, request: &Request) -> Result<Response, ClientError> {
        self.exchange(request, false)
    }

    /// Sends the connection's only request, shuts the sending side (the
    /// daemon sees the end of the stream with the request, answers, then
    /// closes without waiting to be woken by a hang-up), and waits for the
    /// response.
    pub fn call_once(mut self, request: &Request) -> Result<Response, ClientError> {
        self.exchange(request, true)
    }

    fn exchange(&mut self, request: &Request, last: bool) -> Result<Response, ClientError> {
        let exchange_err = |source: FrameError| ClientError::Exchange {
            path: self.path.clone(),
            source,
        };
        let payload = request.encode_to_vec();
        if payload.len() > MAX_REQUEST_FRAME {
            return Err(ClientError::TooLarge {
                len: payload.len(),
                max: MAX_REQUEST_FRAME,
            });
        }
        let sent = frame::write_frame(&mut self.stream, &payload, MAX_REQUEST_FRAME);
        if last && sent.is_ok() {
            // Only saves the daemon a wake-up: if it fails, the daemon
            // answers all the same and sees the hang-up later.
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        // The daemon writes a response in one piece: read its prefix and a
        // small payload in one call. Only this response can be in flight,
        // so the buffer never takes bytes of another.
        let mut input = BufReader::with_capacity(RESPONSE_READ, &self.stream);
        let payload = match sent {
            Ok(()) => frame::read_frame(&mut input, MAX_RESPONSE_FRAME).map_err(exchange_err)?,
            // A daemon that refuses a connection (a user it does not admit,
            // its connection cap) answers and closes before reading: the
            // write fails, but the refusal is waiting to be read.
            Err(FrameError::Io(err))
                if matches!(
                    err.kind(),
                    io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                ) =>
            {
                frame::read_frame(&mut input, MAX_RESPONSE_FRAME)
                    .map_err(|_| exchange_err(FrameError::Io(err)))?
            }
            Err(err) => return Err(exchange_err(err)),
        };
        Response::decode(payload.as_slice()).map_err(|source| ClientError::Decode {
            path: self.path.clone(),
            source,
        })
    }
}

/// A Unix stream connect bounded in time: Linux applies the socket's send
/// timeout to a connect that waits for room in a busy listener's backlog.
fn connect_with_timeout(path: &Path, timeout: Duration) -> io::Result<UnixStream> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let address = UnixAddr::new(path)?;
    socket::setsockopt(&fd, sockopt::SendTimeout, &timeval(timeout))?;
    socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &address)?;
    Ok(UnixStream::from(fd))
}

fn timeval(duration: Duration) -> TimeVal {
    let secs = nix::libc::time_t::try_from(duration.as_secs()).unwrap_or(nix::libc::time_t::MAX);
    let micros = nix::libc::suseconds_t::from(duration.subsec_micros());
    TimeVal::new(secs, micros)
}

/// The daemon's socket and how patiently to reach it.
pub struct Daemon {
    pub socket: PathBuf,
    pub connect_timeout: Duration,
    pub call_timeout: Duration,
    /// How long to keep trying while a daemon is there but not accepting
    /// yet (zero: one attempt).
    pub wait: Duration,
}

impl Daemon {
    /// One request, one response. A [`ClientError::is_connect`] error means
    /// nothing was sent.
    pub fn exchange(&self, request: &Request) -> Result<Response, ClientError> {
        let deadline = Instant::now() + self.wait;
        let mut waiting = false;
        loop {
            let err = match Client::connect(&self.socket, self.connect_timeout, self.call_timeout) {
                Ok(client) => return client.call_once(request),
                Err(err) => err,
            };
            let may_answer_soon = err.listener_busy()
                || (err.nothing_listens() && starting::daemon_starting(&self.socket));
            if !may_answer_soon || Instant::now() >= deadline {
                return Err(err);
            }
            if !waiting {
                waiting = true;
                log::info("cni", "waiting for the daemon", &[("error", &err)]);
            }
            log::debug("cni", "connect failed, retrying", &[("error", &err)]);
            std::thread::sleep(CONNECT_RETRY_PAUSE);
        }
    }
}

/// The payload of an OK answer, or the error `refused` makes of a refusal.
pub fn accepted<E>(
    response: Response,
    refused: impl FnOnce(Response) -> E,
) -> Result<Option<response::Kind>, E> {
    if response.code() == Code::Ok {
        Ok(response.kind)
    } else {
        Err(refused(response))
    }
}
