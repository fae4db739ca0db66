//! The CNI error object and the codes Metis reports. Codes below 100 are the
//! spec's well-known ones; 100 and up are Metis-specific (the spec reserves
//! 0–99 and leaves 100+ to plugins). Of the spec's codes, Metis never
//! returns 2 (unsupported field: unknown keys are ignored, as a delegated
//! IPAM must, and a known key's bad value is 7), 3 (unknown container: DEL
//! of one succeeds, CHECK of one is 101) or 51 (limited connectivity: an
//! IPAM's state never limits existing containers), so they have no constant
//! here. docs/cni.md's code table lists exactly these constants (a test
//! checks).

use serde::Serialize;
use std::fmt;
use std::path::Path;

use crate::store::StoreError;
use crate::wire::client::ClientError;
use crate::wire::{Code, Status, reason};

/// Incompatible CNI version.
pub const INCOMPATIBLE_VERSION: u32 = 1;
/// Invalid necessary environment variables; the message names them.
pub const INVALID_ENV: u32 = 4;
/// I/O failure, e.g. reading the configuration from stdin.
pub const IO_FAILURE: u32 = 5;
/// Failed to decode content (configuration or version info).
pub const DECODE_FAILURE: u32 = 6;
/// Invalid network configuration.
pub const INVALID_CONFIG: u32 = 7;
/// Transient condition; the runtime should retry.
pub const TRY_AGAIN_LATER: u32 = 11;
/// STATUS: the plugin cannot service ADD.
pub const PLUGIN_NOT_AVAILABLE: u32 = 50;
/// Metis: the address requested via `runtimeConfig.ips`, `args.cni.ips` or
/// `CNI_ARGS` `IP` is taken or outside every block of the network.
pub const ADDRESS_UNAVAILABLE: u32 = 100;
/// Metis, CHECK: no allocation exists for (network, container, interface).
pub const NO_ALLOCATION: u32 = 101;
/// Metis, CHECK: the stored allocation differs from the addresses in `prevResult`.
pub const ALLOCATION_DIFFERS: u32 = 102;
/// Metis: the daemon rejected the request or failed internally.
pub const DAEMON_ERROR: u32 = 103;
/// Metis: the local store is corrupt or unusable (direct mode).
pub const STORE_FAILURE: u32 = 104;

/// A CNI error: printed as JSON on stdout before a non-zero exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> CniError {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    /// Adds the optional longer explanation.
    pub fn with_details(mut self, details: impl Into<String>) -> CniError {
        self.details = details.into();
        self
    }

    pub fn incompatible_version(msg: impl Into<String>) -> CniError {
        CniError::new(INCOMPATIBLE_VERSION, msg)
    }

    pub fn invalid_env(msg: impl Into<String>) -> CniError {
        CniError::new(INVALID_ENV, msg)
    }

    pub fn io(msg: impl Into<String>) -> CniError {
        CniError::new(IO_FAILURE, msg)
    }

    pub fn decode(msg: impl Into<String>) -> CniError {
        CniError::new(DECODE_FAILURE, msg)
    }

    pub fn invalid_config(msg: impl Into<String>) -> CniError {
        CniError::new(INVALID_CONFIG, msg)
    }

    pub fn try_again_later(msg: impl Into<String>) -> CniError {
        CniError::new(TRY_AGAIN_LATER, msg)
    }

    pub fn plugin_not_available(msg: impl Into<String>) -> CniError {
        CniError::new(PLUGIN_NOT_AVAILABLE, msg)
    }

    pub fn address_unavailable(msg: impl Into<String>) -> CniError {
        CniError::new(ADDRESS_UNAVAILABLE, msg)
    }

    pub fn no_allocation(msg: impl Into<String>) -> CniError {
        CniError::new(NO_ALLOCATION, msg)
    }

    pub fn allocation_differs(msg: impl Into<String>) -> CniError {
        CniError::new(ALLOCATION_DIFFERS, msg)
    }

    pub fn daemon(msg: impl Into<String>) -> CniError {
        CniError::new(DAEMON_ERROR, msg)
    }

    pub fn store(msg: impl Into<String>) -> CniError {
        CniError::new(STORE_FAILURE, msg)
    }

    /// The spec's error object, pretty-printed like Go's `types.PrettyPrint`.
    /// `cniVersion` is included (the spec has it, Go omits it) unless
    /// `cni_version` is empty, e.g. when the config could not be read.
    pub fn to_json(&self, cni_version: &str) -> String {
        #[derive(Serialize)]
        struct Wire<'a> {
            #[serde(rename = "cniVersion", skip_serializing_if = "str::is_empty")]
            cni_version: &'a str,
            code: u32,
            msg: &'a str,
            #[serde(skip_serializing_if = "str::is_empty")]
            details: &'a str,
        }
        pretty_json(&Wire {
            cni_version,
            code: self.code,
            msg: &self.msg,
            details: &self.details,
        })
    }
}

/// Where Metis's own failures become CNI codes: daemon statuses, socket
/// failures and direct-mode store failures are mapped here and nowhere else.
impl CniError {
    /// An error status from the daemon (or the in-process engine).
    pub fn from_status(status: Option<&Status>) -> CniError {
        let Some(status) = status else {
            return CniError::daemon("the daemon answered without a status");
        };
        let code = Code::try_from(status.code).unwrap_or(Code::Internal);
        let message = status.message.clone();
        match (code, status.reason.as_str()) {
            (_, reason::IP_POOL_EXHAUSTED) => {
                CniError::try_again_later("IP address pool exhausted").with_details(message)
            }
            (_, reason::REQUESTED_IP_UNAVAILABLE) => CniError::address_unavailable(message),
            (_, reason::STORE_CORRUPT) => CniError::store(message),
            (_, reason::STORE_UNAVAILABLE | reason::TOO_MANY_CONNECTIONS)
            | (Code::Unavailable, _) => CniError::try_again_later(message),
            (Code::NotFound, _) => CniError::no_allocation(message),
            (Code::InvalidArgument, _) => CniError::invalid_config(message),
            _ => CniError::daemon(message).with_details(format!(
                "status {}, reason {}",
                code.as_str_name(),
                status.reason
            )),
        }
    }

    /// The daemon was reached but no valid response came back: the outcome is
    /// unknown, and every verb is idempotent, so the runtime should retry.
    /// A request too large to send is the exception: retrying cannot help.
    pub fn from_client(err: &ClientError) -> CniError {
        match err {
            ClientError::TooLarge { .. } => CniError::invalid_config(err.to_string()),
            _ => CniError::try_again_later(err.to_string()),
        }
    }

    /// Direct mode could not open the database.
    pub fn from_store_open(path: &Path, err: &StoreError) -> CniError {
        let message = format!(
            "the metis daemon is unreachable and the database {} cannot be used: {err}",
            path.display()
        );
        if err.is_transient() {
            CniError::try_again_later(message)
        } else {
            CniError::store(message)
        }
    }

    /// Direct mode has no database and could not create one (its directory
    /// is missing or not writable): transient, an operator can fix it.
    pub fn db_not_creatable(path: &Path) -> CniError {
        CniError::try_again_later(format!(
            "the metis daemon is unreachable and the database {} cannot be created",
            path.display()
        ))
    }

    /// A response of the wrong kind for the request: a daemon bug or a
    /// version mismatch between plugin and daemon.
    pub fn unexpected_response(verb: &str) -> CniError {
        CniError::daemon(format!("the daemon sent an unexpected reply to {verb}"))
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.details.is_empty() {
            write!(f, "{}", self.msg)
        } else {
            write!(f, "{}: {}", self.msg, self.details)
        }
    }
}

impl std::error::Error for CniError {}

/// JSON with a 4-space indent and no trailing newline, as Go's
/// `json.MarshalIndent(v, "", "    ")`. Only used on structs with string
/// keys, for which serialization cannot fail; the fallback keeps stdout
/// parseable should that ever change.
pub(crate) fn pretty_json<T: Serialize>(value: &T) -> String {
    let mut out = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    match value.serialize(&mut ser) {
        Ok(()) => String::from_utf8(out).unwrap_or_else(|_| "{}".to_string()),
        Err(_) => "{}".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_spec_error_object_in_key_order() {
        let err = CniError::invalid_config("invalid configuration")
            .with_details("network 198.19.0.0/31 too small");
        assert_eq!(
            err.to_json("1.1.0"),
            r#"{
    "cniVersion": "1.1.0",
    "code": 7,
    "msg": "invalid configuration",
    "details": "network 198.19.0.0/31 too small"
}"#
        );
    }

    #[test]
    fn omits_empty_details_and_version() {
        let err = CniError::invalid_env("required environment variables missing: CNI_NETNS");
        assert_eq!(
            err.to_json(""),
            r#"{
    "code": 4,
    "msg": "required environment variables missing: CNI_NETNS"
}"#
        );
    }

    #[test]
    fn escapes_strings() {
        let err = CniError::decode("bad \"quote\"\n");
        assert!(err.to_json("0.4.0").contains(r#""msg": "bad \"quote\"\n""#));
    }

    #[test]
    fn constructors_pick_codes() {
        let cases = [
            (CniError::incompatible_version("x"), 1),
            (CniError::invalid_env("x"), 4),
            (CniError::io("x"), 5),
            (CniError::decode("x"), 6),
            (CniError::invalid_config("x"), 7),
            (CniError::try_again_later("x"), 11),
            (CniError::plugin_not_available("x"), 50),
            (CniError::address_unavailable("x"), 100),
            (CniError::no_allocation("x"), 101),
            (CniError::allocation_differs("x"), 102),
            (CniError::daemon("x"), 103),
            (CniError::store("x"), 104),
        ];
        for (err, code) in cases {
            assert_eq!(err.code, code, "{err:?}");
        }
    }

    /// The codes this file defines, from its `pub const NAME: u32 = N;` lines.
    fn defined_codes() -> Vec<u32> {
        include_str!("error.rs")
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix("pub const ")?;
                let (_, value) = rest.split_once(": u32 = ")?;
                value.strip_suffix(';')?.parse().ok()
            })
            .collect()
    }

    /// The codes of docs/cni.md's table, from its `| N | when |` rows.
    fn documented_codes() -> Vec<u32> {
        include_str!("../../docs/cni.md")
            .lines()
            .filter_map(|line| line.strip_prefix("| ")?.split(" | ").next()?.parse().ok())
            .collect()
    }

    #[test]
    fn docs_list_exactly_the_codes_metis_returns() {
        let defined = defined_codes();
        assert!(defined.contains(&INCOMPATIBLE_VERSION) && defined.contains(&STORE_FAILURE));
        assert_eq!(
            documented_codes(),
            defined,
            "docs/cni.md's code table vs src/cni/error.rs"
        );
    }

    #[test]
    fn a_request_too_large_to_send_is_not_retryable() {
        let too_large = ClientError::TooLarge {
            len: 2_000_000,
            max: 1_000_000,
        };
        let err = CniError::from_client(&too_large);
        assert_eq!(err.code, INVALID_CONFIG);
        assert!(err.msg.contains("2000000 bytes"), "{}", err.msg);
        let lost = ClientError::Exchange {
            path: "/run/metis.sock".into(),
            source: crate::wire::frame::FrameError::Truncated,
        };
        assert_eq!(CniError::from_client(&lost).code, TRY_AGAIN_LATER);
    }

    #[test]
    fn display_joins_details() {
        assert_eq!(CniError::io("read stdin").to_string(), "read stdin");
        assert_eq!(
            CniError::io("read stdin")
                .with_details("broken pipe")
                .to_string(),
            "read stdin: broken pipe"
        );
    }
}
