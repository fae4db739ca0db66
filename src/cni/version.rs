//! CNI spec versions: which Metis speaks, which verbs each allows, and the
//! VERSION reply.

use super::error::{CniError, pretty_json};
use serde::{Deserialize, Serialize};

/// Every version the reference plugins declare; many conflists still say
/// 0.3.1 or 0.4.0. In the order of [`CniVersion`]'s variants.
pub const SUPPORTED: &[&str] = &[
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// A supported CNI version, read once from the configuration; what each
/// version allows is decided here, by comparison, never by its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CniVersion {
    V0_1_0,
    V0_2_0,
    V0_3_0,
    V0_3_1,
    V0_4_0,
    V1_0_0,
    V1_1_0,
}

const ALL: [CniVersion; 7] = [
    CniVersion::V0_1_0,
    CniVersion::V0_2_0,
    CniVersion::V0_3_0,
    CniVersion::V0_3_1,
    CniVersion::V0_4_0,
    CniVersion::V1_0_0,
    CniVersion::V1_1_0,
];

impl CniVersion {
    /// The newest supported version, used when the input names none we know.
    pub const CURRENT: CniVersion = CniVersion::V1_1_0;
    /// What libcni and host-local read a configuration without
    /// `cniVersion` as: the version before the key existed.
    pub const LEGACY: CniVersion = CniVersion::V0_1_0;

    /// Requires an exact match, as skel's `CheckRaw` does.
    pub fn parse(text: &str) -> Result<CniVersion, CniError> {
        SUPPORTED
            .iter()
            .position(|v| *v == text)
            .map(|at| ALL[at])
            .ok_or_else(|| {
                CniError::incompatible_version(format!(
                    "incompatible CNI version {text:?}: metis supports {}",
                    SUPPORTED.join(", ")
                ))
            })
    }

    pub fn as_str(self) -> &'static str {
        SUPPORTED[self as usize]
    }

    /// CHECK exists from 0.4.0 on.
    pub fn has_check(self) -> bool {
        self >= CniVersion::V0_4_0
    }

    /// GC and STATUS exist from 1.1.0 on.
    pub fn has_gc_and_status(self) -> bool {
        self >= CniVersion::V1_1_0
    }
}

/// The VERSION reply. Echoes the input `cniVersion` as the spec says when it
/// is one we support; otherwise (absent, unreadable, unknown) answers with
/// [`CniVersion::CURRENT`], as skel always does.
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
    let cni_version = CniVersion::parse(&input)
        .unwrap_or(CniVersion::CURRENT)
        .as_str();
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
    fn parse_names_version_and_list() {
        for (at, v) in SUPPORTED.iter().enumerate() {
            let version = CniVersion::parse(v).unwrap();
            assert_eq!((version, version.as_str()), (ALL[at], *v));
        }
        let err = CniVersion::parse("0.5.0").unwrap_err();
        assert_eq!(err.code, INCOMPATIBLE_VERSION);
        assert_eq!(
            err.msg,
            "incompatible CNI version \"0.5.0\": metis supports 0.1.0, 0.2.0, 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"
        );
        for bad in ["1.1", "", "1.0.0.0", "garbage"] {
            assert!(CniVersion::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn verb_predicates() {
        let check: Vec<bool> = ALL.iter().map(|v| v.has_check()).collect();
        assert_eq!(check, [false, false, false, false, true, true, true]);
        let gc: Vec<bool> = ALL.iter().map(|v| v.has_gc_and_status()).collect();
        assert_eq!(gc, [false, false, false, false, false, false, true]);
    }
}
