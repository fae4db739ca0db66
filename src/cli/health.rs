//! `metis health`: one health round trip to the daemon within two seconds,
//! for an exec liveness probe (`Healthy: …`, exit 0; `Unhealthy: …`, exit 1).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use super::{ArgsError, CallError, call, socket_path};
use crate::defaults::DEFAULT_SOCKET_PATH;
use crate::flags::{self, FlagSpec};
use crate::wire::client::ClientError;
use crate::wire::envelope::v1::health_check_response::ServingStatus;
use crate::wire::frame::FrameError;
use crate::wire::{HealthCheckRequest, request, response};

/// The whole check (connect, send, answer) must finish within this.
pub const DEADLINE: Duration = Duration::from_secs(2);

const FLAGS: &[FlagSpec] = &[FlagSpec {
    name: "--socket-path",
    value: Some("PATH"),
    repeatable: false,
    default: DEFAULT_SOCKET_PATH,
    help: "the daemon's Unix socket",
}];

/// What to check.
#[derive(Debug, PartialEq, Eq)]
pub struct Options {
    pub socket_path: PathBuf,
}

/// Why the daemon is not healthy.
#[derive(Debug)]
pub enum HealthError {
    /// No answer, or an error status.
    Call(CallError),
    /// The daemon answered but says it is not serving.
    NotServing(String),
    /// The daemon answered something other than a health reply.
    Unexpected,
    /// No answer within [`DEADLINE`].
    TimedOut,
}

impl fmt::Display for HealthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HealthError::Call(err) => write!(f, "{err}"),
            HealthError::NotServing(detail) => write!(f, "the daemon is not serving: {detail}"),
            HealthError::Unexpected => f.write_str("the daemon sent no health reply"),
            HealthError::TimedOut => write!(f, "no answer from the daemon within {DEADLINE:?}"),
        }
    }
}

impl std::error::Error for HealthError {}

pub fn usage() -> String {
    flags::usage(
        "metis health",
        "Asks the daemon whether it is serving, within 2 s. Prints \"Healthy: …\" and exits 0,\n\
         or prints \"Unhealthy: <reason>\" on stderr and exits 1 (for exec liveness probes).",
        FLAGS,
    )
}

pub fn parse(args: &[String]) -> Result<Options, ArgsError> {
    let socket_path = flags::parse(FLAGS, args)
        .and_then(|parsed| socket_path(&parsed))
        .map_err(|err| ArgsError::from_flags(err, usage()))?;
    Ok(Options { socket_path })
}

/// Runs the check; `Ok` carries the daemon's own description of its state.
/// The round trip runs on its own thread so the deadline holds however the
/// daemon dribbles its answer; the thread dies with the process.
pub fn check(options: &Options) -> Result<String, HealthError> {
    let (sender, receiver) = mpsc::channel();
    let socket_path = options.socket_path.clone();
    std::thread::spawn(move || {
        let _ = sender.send(round_trip(&socket_path));
    });
    receiver
        .recv_timeout(DEADLINE)
        .unwrap_or(Err(HealthError::TimedOut))
}

fn round_trip(socket_path: &Path) -> Result<String, HealthError> {
    let kind = request::Kind::Health(HealthCheckRequest {});
    match call(socket_path, DEADLINE, DEADLINE, kind).map_err(from_call)? {
        Some(response::Kind::Health(health)) if health.status == ServingStatus::Serving as i32 => {
            Ok(health.detail)
        }
        Some(response::Kind::Health(health)) => Err(HealthError::NotServing(health.detail)),
        _ => Err(HealthError::Unexpected),
    }
}

/// A read that timed out is the deadline passing, whichever of the two
/// clocks (the socket's or [`check`]'s) noticed first.
fn from_call(err: CallError) -> HealthError {
    match &err {
        CallError::Unreachable(ClientError::Exchange {
            source: FrameError::Io(io),
            ..
        }) if matches!(
            io.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) =>
        {
            HealthError::TimedOut
        }
        _ => HealthError::Call(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn socket_defaults_to_the_daemons() {
        assert_eq!(
            parse(&[]).unwrap().socket_path,
            PathBuf::from(DEFAULT_SOCKET_PATH)
        );
        assert_eq!(
            parse(&args(&["--socket-path=/tmp/x.sock"]))
                .unwrap()
                .socket_path,
            PathBuf::from("/tmp/x.sock")
        );
    }

    #[test]
    fn misuse_and_help_are_told_apart() {
        assert!(matches!(parse(&args(&["--help"])), Err(ArgsError::Help(_))));
        assert!(matches!(
            parse(&args(&["--sockett", "x"])),
            Err(ArgsError::Usage { .. })
        ));
        assert!(matches!(
            parse(&args(&["--socket-path"])),
            Err(ArgsError::Usage { .. })
        ));
    }
}
