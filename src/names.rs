//! Bounds on the identifiers that key allocations and appear in messages:
//! container ids, interface names, network names and pod names. The plugin,
//! direct mode and the daemon apply these same checks, so an owner accepted
//! at one edge can always be released through another, and no identifier
//! can grow a request past the wire's frame cap.

use std::fmt;

/// Longest container id. Kubelet and Podman ids are 64 hex characters; the
/// room above that is for runtimes that prefix or suffix them.
pub const MAX_CONTAINER_ID_LEN: usize = 256;
/// Longest network name (`name`, `ipam.network`, `--cidr NAME=`): a DNS
/// subdomain, the longest name Kubernetes gives any object.
pub const MAX_NETWORK_NAME_LEN: usize = 253;
/// Linux `IFNAMSIZ` minus the terminating NUL.
pub const MAX_IFNAME_LEN: usize = 15;
/// Longest pod name or namespace taken from `CNI_ARGS` (a DNS subdomain).
pub const MAX_POD_FIELD_LEN: usize = 253;

/// What [`container_id`] and [`network`] accept besides the length, for
/// error messages.
pub const NAME_RULE: &str =
    "must start with a letter or digit and contain only letters, digits, '_', '.' and '-'";

/// Characters of a refused value echoed in a message: enough to recognise
/// it, never the whole of a hostile one.
const ECHO_LEN: usize = 64;

/// Why an identifier was refused. `Display` gives the value (shortened)
/// and the reason; callers prefix the field's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameError {
    value: String,
    why: String,
}

impl fmt::Display for NameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.value, self.why)
    }
}

impl NameError {
    fn new(value: &str, why: impl Into<String>) -> NameError {
        let shown: String = value.chars().take(ECHO_LEN).collect();
        let value = if shown.len() < value.len() {
            format!("{shown}…")
        } else {
            shown
        };
        NameError {
            value,
            why: why.into(),
        }
    }
}

/// A container id: the spec's `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`, at most
/// [`MAX_CONTAINER_ID_LEN`] bytes.
pub fn container_id(text: &str) -> Result<(), NameError> {
    spec_name(text, MAX_CONTAINER_ID_LEN)
}

/// A network name: the same rule skel applies to `name`, at most
/// [`MAX_NETWORK_NAME_LEN`] bytes.
pub fn network(text: &str) -> Result<(), NameError> {
    spec_name(text, MAX_NETWORK_NAME_LEN)
}

fn spec_name(text: &str, max: usize) -> Result<(), NameError> {
    if text.len() > max {
        return Err(NameError::new(
            text,
            format!("is {} bytes, more than the {max} allowed", text.len()),
        ));
    }
    let mut bytes = text.bytes();
    let valid = match bytes.next() {
        Some(first) if first.is_ascii_alphanumeric() => {
            bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        }
        _ => false,
    };
    if valid {
        Ok(())
    } else {
        Err(NameError::new(text, NAME_RULE))
    }
}

/// The reference library's interface-name rule: what the kernel accepts.
pub fn interface(name: &str) -> Result<(), NameError> {
    let why = if name.is_empty() {
        "is empty".to_string()
    } else if name.len() > MAX_IFNAME_LEN {
        format!("is longer than {MAX_IFNAME_LEN} bytes")
    } else if name == "." || name == ".." {
        "is not a valid interface name".to_string()
    } else if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control())
    {
        "contains '/', ':', whitespace or a control character".to_string()
    } else {
        return Ok(());
    };
    Err(NameError::new(name, why))
}

/// A pod name or namespace: only used in messages and the `pod_name`
/// column, so any printable text up to [`MAX_POD_FIELD_LEN`] bytes.
pub fn pod_field(text: &str) -> Result<(), NameError> {
    if text.len() > MAX_POD_FIELD_LEN {
        Err(NameError::new(
            text,
            format!(
                "is {} bytes, more than the {MAX_POD_FIELD_LEN} allowed",
                text.len()
            ),
        ))
    } else if text.chars().any(char::is_control) {
        Err(NameError::new(text, "contains a control character"))
    } else {
        Ok(())
    }
}

/// What an allocation is keyed by besides its network: a container and the
/// interface inside it (the CNI spec's attachment). Made only through
/// [`Attachment::new`], so holding one means both names were checked, once,
/// at whichever edge the request came in by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Attachment {
    container_id: String,
    interface: String,
}

/// Which name of an attachment was refused, and why; callers name the field
/// as their input spells it (`CNI_CONTAINERID`, `container_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttachmentError {
    ContainerId(NameError),
    Interface(NameError),
}

impl Attachment {
    pub fn new(container_id: &str, interface: &str) -> Result<Attachment, AttachmentError> {
        self::container_id(container_id).map_err(AttachmentError::ContainerId)?;
        self::interface(interface).map_err(AttachmentError::Interface)?;
        Ok(Attachment {
            container_id: container_id.to_string(),
            interface: interface.to_string(),
        })
    }

    pub fn container_id(&self) -> &str {
        &self.container_id
    }

    pub fn interface(&self) -> &str {
        &self.interface
    }
}

/// `namespace/name` for messages, or `container <id>` when the runtime sent
/// no pod name (Podman never does).
pub fn describe_owner(namespace: &str, pod: &str, container_id: &str) -> String {
    match (namespace.is_empty(), pod.is_empty()) {
        (_, false) if !namespace.is_empty() => format!("pod {namespace}/{pod}"),
        (_, false) => format!("pod {pod}"),
        _ => format!("container {container_id}"),
    }
}

/// A Kubernetes object name (RFC 1123 subdomain): it is placed in URL paths.
pub fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubelet_ids_and_bounds() {
        let kubelet = "0123456789abcdef".repeat(4);
        assert_eq!(container_id(&kubelet), Ok(()));
        assert_eq!(container_id(&"a".repeat(MAX_CONTAINER_ID_LEN)), Ok(()));
        let err = container_id(&"a".repeat(70_000)).unwrap_err().to_string();
        assert!(
            err.ends_with("…\": is 70000 bytes, more than the 256 allowed"),
            "{err}"
        );
        assert!(err.len() < 200, "{err}");
        for bad in ["", "-a", "a/b", "a\0b", "a b", "é"] {
            assert!(container_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn network_names() {
        assert_eq!(network("pods"), Ok(()));
        assert_eq!(network(&"n".repeat(MAX_NETWORK_NAME_LEN)), Ok(()));
        assert!(network(&"n".repeat(MAX_NETWORK_NAME_LEN + 1)).is_err());
        assert_eq!(
            network("my net").unwrap_err().to_string(),
            format!("\"my net\": {NAME_RULE}")
        );
    }

    #[test]
    fn interfaces() {
        assert_eq!(interface("eth0"), Ok(()));
        assert_eq!(interface(&"e".repeat(15)), Ok(()));
        for bad in [
            "",
            ".",
            "..",
            "eth/0",
            "eth:0",
            "eth 0",
            "eth\u{0}0",
            &"e".repeat(16),
        ] {
            assert!(interface(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn pod_fields() {
        assert_eq!(pod_field(""), Ok(()));
        assert_eq!(pod_field("web-0"), Ok(()));
        assert!(pod_field(&"p".repeat(MAX_POD_FIELD_LEN + 1)).is_err());
        assert!(pod_field("a\nb").is_err());
    }

    #[test]
    fn owners_are_described_without_empty_slashes() {
        assert_eq!(describe_owner("ns", "web", "c1"), "pod ns/web");
        assert_eq!(describe_owner("", "web", "c1"), "pod web");
        assert_eq!(describe_owner("", "", "c1"), "container c1");
        assert_eq!(describe_owner("ns", "", "c1"), "container c1");
    }
}
