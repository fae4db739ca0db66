//! The `CNI_*` environment: which verb, for which attachment. Requirements
//! follow the spec's table, not Go skel's stricter one (skel also demands
//! `CNI_PATH`), because a plugin stricter than the spec breaks runtimes that
//! follow it.

use super::error::CniError;
use crate::names::{Attachment, AttachmentError};

/// The operation requested by `CNI_COMMAND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Add,
    Del,
    Check,
    Gc,
    Status,
    Version,
}

impl Verb {
    /// Parses the exact, uppercase spelling the spec uses.
    pub fn parse(text: &str) -> Option<Verb> {
        match text {
            "ADD" => Some(Verb::Add),
            "DEL" => Some(Verb::Del),
            "CHECK" => Some(Verb::Check),
            "GC" => Some(Verb::Gc),
            "STATUS" => Some(Verb::Status),
            "VERSION" => Some(Verb::Version),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Add => "ADD",
            Verb::Del => "DEL",
            Verb::Check => "CHECK",
            Verb::Gc => "GC",
            Verb::Status => "STATUS",
            Verb::Version => "VERSION",
        }
    }

    /// The variables besides `CNI_COMMAND` this verb cannot run without.
    fn required(self) -> &'static [&'static str] {
        match self {
            Verb::Add | Verb::Check => &[CONTAINER_ID, NETNS, IFNAME],
            // DEL must work after the netns is gone.
            Verb::Del => &[CONTAINER_ID, IFNAME],
            Verb::Gc | Verb::Status | Verb::Version => &[],
        }
    }
}

const COMMAND: &str = "CNI_COMMAND";
const CONTAINER_ID: &str = "CNI_CONTAINERID";
const NETNS: &str = "CNI_NETNS";
const IFNAME: &str = "CNI_IFNAME";
const ARGS: &str = "CNI_ARGS";
const PATH: &str = "CNI_PATH";

/// The validated environment. Variables a verb does not require are passed
/// through unvalidated (empty when unset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniEnv {
    pub verb: Verb,
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    /// `CNI_CONTAINERID` and `CNI_IFNAME`, checked, for the verbs that
    /// require them (ADD, CHECK, DEL).
    pub attachment: Option<Attachment>,
    pub args: String,
    pub path: Option<String>,
}

/// Reads the environment through `get` (e.g. `|k| std::env::var(k).ok()`).
///
/// Returns `Ok(None)` when `CNI_COMMAND` is unset or empty, the case in
/// which a plugin prints its "about" text instead of acting. An unknown verb,
/// a missing required variable, an empty or malformed `CNI_CONTAINERID` (skel
/// uses code 3 for an empty one; an empty variable is simply invalid here) or
/// a bad `CNI_IFNAME` give code 4 naming the variable.
pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<CniEnv>, CniError> {
    // Go's getenv cannot tell unset from empty, so neither do we.
    let read = |key: &str| get(key).unwrap_or_default();
    let command = read(COMMAND);
    if command.is_empty() {
        return Ok(None);
    }
    let verb = Verb::parse(&command)
        .ok_or_else(|| CniError::invalid_env(format!("unknown CNI_COMMAND: {command}")))?;
    let mut env = CniEnv {
        verb,
        container_id: read(CONTAINER_ID),
        netns: read(NETNS),
        ifname: read(IFNAME),
        attachment: None,
        args: read(ARGS),
        path: get(PATH).filter(|p| !p.is_empty()),
    };
    env.attachment = check_required(&env)?;
    Ok(Some(env))
}

/// The attachment of a verb that requires one (every verb requiring
/// `CNI_CONTAINERID` also requires `CNI_IFNAME`).
fn check_required(env: &CniEnv) -> Result<Option<Attachment>, CniError> {
    let required = env.verb.required();
    let missing: Vec<&str> = required
        .iter()
        .copied()
        .filter(|key| value_of(env, key).is_empty())
        .collect();
    if !missing.is_empty() {
        return Err(CniError::invalid_env(format!(
            "required environment variables missing for {}: {}",
            env.verb.as_str(),
            missing.join(", ")
        )));
    }
    if !required.contains(&CONTAINER_ID) {
        return Ok(None);
    }
    Attachment::new(&env.container_id, &env.ifname)
        .map(Some)
        .map_err(|err| match err {
            AttachmentError::ContainerId(err) => {
                CniError::invalid_env(format!("invalid CNI_CONTAINERID {err}"))
            }
            AttachmentError::Interface(err) => {
                CniError::invalid_env(format!("invalid CNI_IFNAME {err}"))
            }
        })
}

fn value_of<'a>(env: &'a CniEnv, key: &str) -> &'a str {
    match key {
        CONTAINER_ID => &env.container_id,
        NETNS => &env.netns,
        IFNAME => &env.ifname,
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::error::INVALID_ENV;
    use crate::names;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> Result<Option<CniEnv>, CniError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_lookup(|k| map.get(k).cloned())
    }

    fn full(verb: &'static str) -> Vec<(&'static str, &'static str)> {
        vec![
            ("CNI_COMMAND", verb),
            ("CNI_CONTAINERID", "abc123"),
            ("CNI_NETNS", "/var/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", "K8S_POD_NAME=p"),
            ("CNI_PATH", "/opt/cni/bin"),
        ]
    }

    fn without(
        mut pairs: Vec<(&'static str, &'static str)>,
        key: &str,
    ) -> Vec<(&'static str, &'static str)> {
        pairs.retain(|(k, _)| *k != key);
        pairs
    }

    fn with(
        mut pairs: Vec<(&'static str, &'static str)>,
        key: &'static str,
        value: &'static str,
    ) -> Vec<(&'static str, &'static str)> {
        pairs.retain(|(k, _)| *k != key);
        pairs.push((key, value));
        pairs
    }

    fn env_error(pairs: &[(&str, &str)]) -> CniError {
        match lookup(pairs) {
            Err(err) => err,
            Ok(env) => panic!("expected an error, got {env:?}"),
        }
    }

    #[test]
    fn add_reads_everything() {
        let env = lookup(&full("ADD")).unwrap().unwrap();
        assert_eq!(
            env,
            CniEnv {
                verb: Verb::Add,
                container_id: "abc123".into(),
                netns: "/var/run/netns/x".into(),
                ifname: "eth0".into(),
                attachment: Attachment::new("abc123", "eth0").ok(),
                args: "K8S_POD_NAME=p".into(),
                path: Some("/opt/cni/bin".into()),
            }
        );
    }

    #[test]
    fn absent_or_empty_command_is_none() {
        assert_eq!(lookup(&[]).unwrap(), None);
        assert_eq!(lookup(&[("CNI_COMMAND", "")]).unwrap(), None);
    }

    #[test]
    fn unknown_command_is_code_4() {
        for bad in ["add", "FOO", "Add", " ADD"] {
            let err = env_error(&with(full("ADD"), "CNI_COMMAND", bad));
            assert_eq!(err.code, INVALID_ENV);
            assert_eq!(err.msg, format!("unknown CNI_COMMAND: {bad}"));
        }
    }

    #[test]
    fn del_without_netns_is_ok() {
        let env = lookup(&without(full("DEL"), "CNI_NETNS")).unwrap().unwrap();
        assert_eq!(env.verb, Verb::Del);
        assert_eq!(env.netns, "");
    }

    #[test]
    fn add_and_check_need_netns() {
        for verb in ["ADD", "CHECK"] {
            let err = env_error(&without(full(verb), "CNI_NETNS"));
            assert_eq!(err.code, INVALID_ENV);
            assert_eq!(
                err.msg,
                format!("required environment variables missing for {verb}: CNI_NETNS")
            );
        }
    }

    #[test]
    fn missing_variables_are_all_named() {
        let err = env_error(&[("CNI_COMMAND", "ADD")]);
        assert_eq!(
            err.msg,
            "required environment variables missing for ADD: CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME"
        );
        let err = env_error(&[("CNI_COMMAND", "DEL"), ("CNI_CONTAINERID", "")]);
        assert_eq!(
            err.msg,
            "required environment variables missing for DEL: CNI_CONTAINERID, CNI_IFNAME"
        );
    }

    #[test]
    fn gc_status_version_need_only_the_command() {
        for (verb, want) in [
            ("GC", Verb::Gc),
            ("STATUS", Verb::Status),
            ("VERSION", Verb::Version),
        ] {
            let env = lookup(&[("CNI_COMMAND", verb)]).unwrap().unwrap();
            assert_eq!(env.verb, want);
            assert_eq!(env.path, None);
        }
        // Not validated when not required: libcni sends "dummy" values.
        let env = lookup(&[
            ("CNI_COMMAND", "VERSION"),
            ("CNI_IFNAME", "way-too-long-ifname"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(env.ifname, "way-too-long-ifname");
    }

    #[test]
    fn path_is_optional() {
        let env = lookup(&without(full("ADD"), "CNI_PATH")).unwrap().unwrap();
        assert_eq!(env.path, None);
    }

    #[test]
    fn bad_container_ids() {
        for bad in ["-abc", "_abc", ".abc", "abc/def", "abc def", "ab:c", "é"] {
            let err = env_error(&with(full("ADD"), "CNI_CONTAINERID", bad));
            assert_eq!(err.code, INVALID_ENV, "{bad}");
            assert!(
                err.msg.starts_with("invalid CNI_CONTAINERID"),
                "{}",
                err.msg
            );
            assert!(err.msg.contains(&format!("{bad:?}")), "{}", err.msg);
        }
        let long: &'static str = "a".repeat(70_000).leak();
        let err = env_error(&with(full("DEL"), "CNI_CONTAINERID", long));
        assert_eq!(err.code, INVALID_ENV);
        assert!(
            err.msg
                .ends_with("is 70000 bytes, more than the 256 allowed")
        );
        let err = env_error(&with(full("DEL"), "CNI_CONTAINERID", ""));
        assert_eq!(err.code, INVALID_ENV);
        assert!(err.msg.contains("CNI_CONTAINERID"));
    }

    #[test]
    fn good_container_ids() {
        for good in ["a", "0", "abc-DEF_1.2", "9f86d081884c7d659a2feaa0c55ad015"] {
            assert!(names::container_id(good).is_ok(), "{good}");
        }
        assert!(names::container_id("").is_err());
    }

    #[test]
    fn bad_ifnames() {
        for bad in [
            ".",
            "..",
            "eth/0",
            "eth:0",
            "eth 0",
            "eth\t0",
            "sixteen-chars-xx",
        ] {
            let err = env_error(&with(full("CHECK"), "CNI_IFNAME", bad));
            assert_eq!(err.code, INVALID_ENV, "{bad}");
            assert!(
                err.msg.starts_with(&format!("invalid CNI_IFNAME {bad:?}")),
                "{}",
                err.msg
            );
        }
    }

    #[test]
    fn good_ifnames() {
        for good in ["eth0", "net1", "fifteen-chars-x", "a.b", "..."] {
            assert!(names::interface(good).is_ok(), "{good}");
        }
    }

    #[test]
    fn verb_round_trips() {
        for verb in [
            Verb::Add,
            Verb::Del,
            Verb::Check,
            Verb::Gc,
            Verb::Status,
            Verb::Version,
        ] {
            assert_eq!(Verb::parse(verb.as_str()), Some(verb));
        }
    }
}
