//! CNI spec versions: which Metis speaks, which verbs each allows, and the
//! VERSION reply.

use super::error::{CniError, pretty_json};
use serde::{Deserialize, Serialize};

/// Every version the reference plugins declare; many conflists still say
/// 0.3.1 or 0.4.0.
pub const SUPPORTED: &[&str] = &[
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// The newest supported version, used when the input names none we know.
pub const CURRENT: &str = "1.1.0";

/// Requires an exact match, as skel's `CheckRaw` does.
pub fn check_supported(v: &str) -> Result<(), CniError> {
    if SUPPORTED.contains(&v) {
        Ok(())
    } else {
        Err(CniError::incompatible_version(format!(
            "incompatible CNI version {v:?}: metis supports {}",
            SUPPORTED.join(", ")
        )))
    }
}

/// CHECK exists from 0.4.0 on.
pub fn has_check(v: &str) -> bool {
    at_least(v, (0, 4, 0))
}

/// GC and STATUS exist from 1.1.0 on.
pub fn has_gc_and_status(v: &str) -> bool {
    at_least(v, (1, 1, 0))
}

fn at_least(v: &str, min: (u32, u32, u32)) -> bool {
    parse_triple(v).is_some_and(|t| t >= min)
}

fn parse_triple(v: &str) -> Option<(u32, u32, u32)> {
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    let triple = (parts.next()??, parts.next()??, parts.next()??);
    parts.next().is_none().then_some(triple)
}

/// The VERSION reply. Echoes the input `cniVersion` as the spec says when it
/// is one we support; otherwise (absent, unreadable, unknown) answers with
/// [`CURRENT`], as skel always does.
pub fn version_reply(stdin: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Input {
        #[serde(rename = "cniVersion")]
        cni_version: Option<String>,
    }
    #[derive(Serialize)]
    struct Reply<'a> {
        #[serde(rename = "cniVersion")]
        cni_version: &'a str,
        #[serde(rename = "supportedVersions")]
        supported_versions: &'a [&'a str],
    }
    let input = serde_json::from_slice::<Input>(stdin)
        .ok()
        .and_then(|i| i.cni_version)
        .unwrap_or_default();
    let cni_version = SUPPORTED
        .iter()
        .find(|v| **v == input)
        .copied()
        .unwrap_or(CURRENT);
    pretty_json(&Reply {
        cni_version,
        supported_versions: SUPPORTED,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::error::INCOMPATIBLE_VERSION;

    fn reply(version: &str) -> String {
        format!(
            r#"{{
    "cniVersion": "{version}",
    "supportedVersions": [
        "0.1.0",
        "0.2.0",
        "0.3.0",
        "0.3.1",
        "0.4.0",
        "1.0.0",
        "1.1.0"
    ]
}}"#
        )
    }

    #[test]
    fn version_reply_echoes_supported_input() {
        assert_eq!(version_reply(br#"{"cniVersion":"0.4.0"}"#), reply("0.4.0"));
        assert_eq!(version_reply(br#"{"cniVersion":"1.1.0"}"#), reply("1.1.0"));
    }

    #[test]
    fn version_reply_falls_back_to_current() {
        assert_eq!(version_reply(br#"{"cniVersion":"9.9.9"}"#), reply("1.1.0"));
        assert_eq!(version_reply(b""), reply("1.1.0"));
        assert_eq!(version_reply(b"not json"), reply("1.1.0"));
        assert_eq!(version_reply(br#"{"cniVersion":7}"#), reply("1.1.0"));
        assert_eq!(version_reply(b"{}"), reply("1.1.0"));
    }

    #[test]
    fn check_supported_names_version_and_list() {
        for v in SUPPORTED {
            assert!(check_supported(v).is_ok());
        }
        let err = check_supported("0.5.0").unwrap_err();
        assert_eq!(err.code, INCOMPATIBLE_VERSION);
        assert_eq!(
            err.msg,
            "incompatible CNI version \"0.5.0\": metis supports 0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"
        );
        assert!(check_supported("1.1").is_err());
        assert!(check_supported("").is_err());
    }

    #[test]
    fn verb_predicates() {
        let check: Vec<bool> = SUPPORTED.iter().map(|v| has_check(v)).collect();
        assert_eq!(check, [false, false, false, false, true, true, true]);
        let gc: Vec<bool> = SUPPORTED.iter().map(|v| has_gc_and_status(v)).collect();
        assert_eq!(gc, [false, false, false, false, false, false, true]);
        assert!(!has_check("garbage"));
        assert!(!has_check("1.0"));
        assert!(!has_check("1.0.0.0"));
    }
}
