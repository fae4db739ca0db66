//! The operator's subcommands: `health` (an exec liveness probe), `install`
//! (put the plugin and a network config on a node), `admin` (read the
//! daemon's tables) `admin check` (verify a database's invariants), `admin downgrade` (ready a database for upstream), `import`/`export host-local` (move a
//! node's allocations from and to host-local). Each parses its own flags with [`crate::flags`]
//! (`parse`, an [`ArgsError`]) and runs (`run`, a [`CommandError`]); `main` alone turns them
//! into exit codes.

pub mod admin;
pub mod check;
pub mod downgrade;
pub mod health;
pub mod host_local;
pub mod install;
pub mod render;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::defaults::DEFAULT_SOCKET_PATH;
use crate::flags::{FlagError, Parsed};
use crate::wire::client::ClientError;
use crate::wire::client::{self, Daemon};
use crate::wire::{Code, Request, request, response};

/// Why a subcommand's command line was not run.
#[derive(Debug, PartialEq, Eq)]
pub enum ArgsError {
    /// `--help` was given: this text belongs on stdout.
    Help(String),
    /// The command line is wrong: the message, then the usage text.
    Usage { message: String, usage: String },
}

impl ArgsError {
    /// Wraps a flag error with the usage text of the command it came from.
    pub fn from_flags(err: FlagError, usage: String) -> ArgsError {
        match err {
            FlagError::Help => ArgsError::Help(usage),
            other => ArgsError::Usage {
                message: other.to_string(),
                usage,
            },
        }
    }
}

impl fmt::Display for ArgsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgsError::Help(_) => f.write_str("help requested"),
            ArgsError::Usage { message, .. } => f.write_str(message),
        }
    }
}

impl std::error::Error for ArgsError {}

/// How a subcommand ended short of success. Every subcommand is a `parse`
/// giving [`ArgsError`] and a `run` giving this; `main` alone turns it into
/// an exit status: help 0, a wrong command line 2, a failure 1.
#[derive(Debug, PartialEq, Eq)]
pub enum CommandError {
    Args(ArgsError),
    /// The command ran and failed, or found what it looks for (a check's
    /// problems). Each line goes to stderr after the command's name; none
    /// when the command reported it already.
    Failed(Vec<String>),
}

impl CommandError {
    pub fn failed(why: impl fmt::Display) -> CommandError {
        CommandError::Failed(vec![why.to_string()])
    }
}

impl From<ArgsError> for CommandError {
    fn from(err: ArgsError) -> CommandError {
        CommandError::Args(err)
    }
}

/// `--socket-path`, defaulting to the daemon's; an empty one is refused.
pub fn socket_path(parsed: &Parsed) -> Result<PathBuf, FlagError> {
    match parsed.get("--socket-path") {
        None => Ok(PathBuf::from(DEFAULT_SOCKET_PATH)),
        Some("") => Err(FlagError::BadValue(
            "--socket-path",
            "must not be empty".into(),
        )),
        Some(path) => Ok(PathBuf::from(path)),
    }
}

/// Why a request to the daemon got no successful answer.
#[derive(Debug)]
pub enum CallError {
    /// Not listening, or the exchange failed or timed out.
    Unreachable(ClientError),
    /// The daemon answered with an error status.
    Refused { code: Code, message: String },
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Unreachable(err) => write!(f, "{err}"),
            CallError::Refused { code, message } => {
                write!(f, "the daemon refused the request ({code:?}): {message}")
            }
        }
    }
}

impl std::error::Error for CallError {}

/// One request to the daemon at `socket`; the payload of an OK answer.
pub fn call(
    socket: &Path,
    connect_timeout: Duration,
    io_timeout: Duration,
    kind: request::Kind,
) -> Result<Option<response::Kind>, CallError> {
    let daemon = Daemon {
        socket: socket.to_path_buf(),
        connect_timeout,
        call_timeout: io_timeout,
        wait: Duration::ZERO,
    };
    let response = daemon
        .exchange(&Request { kind: Some(kind) })
        .map_err(CallError::Unreachable)?;
    client::accepted(response, |refused| CallError::Refused {
        code: refused.code(),
        message: refused.status.map(|s| s.message).unwrap_or_default(),
    })
}
