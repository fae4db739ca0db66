//! `CNI_ARGS`: `;`-separated `KEY=VALUE` pairs. Runtimes add keys of their
//! own (containerd's `K8S_POD_UID`, …), so unknown keys are always tolerated,
//! whatever `IgnoreUnknown` says.

use super::error::CniError;
use crate::cidr::Family;
use crate::names;
use std::net::IpAddr;

/// Longest `CNI_ARGS` accepted; real ones are a few hundred bytes, and the
/// cap keeps hostile input from growing the parsed lists.
pub const MAX_CNI_ARGS_LEN: usize = 64 * 1024;

/// The keys Metis understands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    pub pod_name: String,
    pub pod_namespace: String,
    /// `IP=<ip>[/<prefix>][,…]`, the convention host-local follows.
    pub ips: Vec<IpAddr>,
}

/// Parses `CNI_ARGS`. Empty segments (`a=b;;c=d`, a trailing `;`) are
/// skipped; a later duplicate key replaces the earlier value, as Go's
/// `LoadArgs` does.
pub fn parse(cni_args: &str) -> Result<CniArgs, CniError> {
    if cni_args.len() > MAX_CNI_ARGS_LEN {
        return Err(CniError::invalid_env(format!(
            "CNI_ARGS is {} bytes, more than the {MAX_CNI_ARGS_LEN} allowed",
            cni_args.len()
        )));
    }
    let mut args = CniArgs::default();
    for pair in cni_args.split(';').filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .filter(|(key, _)| !key.is_empty())
            .ok_or_else(|| {
                CniError::invalid_env(format!(
                    "invalid CNI_ARGS pair {pair:?}: expected KEY=VALUE"
                ))
            })?;
        match key {
            "K8S_POD_NAME" => args.pod_name = value.to_string(),
            "K8S_POD_NAMESPACE" => args.pod_namespace = value.to_string(),
            "IP" => args.ips = parse_ip_list(value).ok_or_else(|| bad_ip(pair))?,
            _ => {}
        }
    }
    for (key, value) in [
        ("K8S_POD_NAME", &args.pod_name),
        ("K8S_POD_NAMESPACE", &args.pod_namespace),
    ] {
        names::pod_field(value)
            .map_err(|err| CniError::invalid_env(format!("invalid CNI_ARGS {key} {err}")))?;
    }
    Ok(args)
}

fn bad_ip(pair: &str) -> CniError {
    CniError::invalid_env(format!(
        "invalid CNI_ARGS pair {pair:?}: expected IP=<ip>[/<prefix>][,<ip>[/<prefix>]]"
    ))
}

fn parse_ip_list(value: &str) -> Option<Vec<IpAddr>> {
    value
        .split(',')
        .map(|item| parse_ip_maybe_prefix(item).map(|(ip, _)| ip))
        .collect()
}

/// Parses `<ip>` or `<ip>/<prefix>` (host bits may be set: it names an
/// address, not a network). The prefix must be plain decimal within the
/// family's width.
pub fn parse_ip_maybe_prefix(text: &str) -> Option<(IpAddr, Option<u8>)> {
    let (addr, prefix) = match text.split_once('/') {
        Some((addr, prefix)) => (addr, Some(prefix)),
        None => (text, None),
    };
    let ip: IpAddr = addr.parse().ok()?;
    let prefix_len = match prefix {
        None => None,
        Some(p) => Some(parse_prefix_len(p, Family::of(ip))?),
    };
    Some((ip, prefix_len))
}

fn parse_prefix_len(text: &str, family: Family) -> Option<u8> {
    let plain = !text.is_empty()
        && text.len() <= 3
        && text.bytes().all(|b| b.is_ascii_digit())
        && !(text.len() > 1 && text.starts_with('0'));
    let len: u8 = plain.then(|| text.parse().ok()).flatten()?;
    (len <= family.bits()).then_some(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::error::INVALID_ENV;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn empty_gives_defaults() {
        assert_eq!(parse("").unwrap(), CniArgs::default());
    }

    #[test]
    fn parses_containerd_string() {
        let args = parse(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u",
        )
        .unwrap();
        assert_eq!(
            args,
            CniArgs {
                pod_name: "pod".into(),
                pod_namespace: "ns".into(),
                ips: vec![],
            }
        );
    }

    #[test]
    fn unknown_keys_tolerated_without_ignore_unknown() {
        let args = parse("FOO=bar;K8S_POD_NAME=p;IgnoreUnknown=0").unwrap();
        assert_eq!(args.pod_name, "p");
    }

    #[test]
    fn parses_ip_forms() {
        let args = parse("IP=198.18.0.5").unwrap();
        assert_eq!(args.ips, vec![ip("198.18.0.5")]);
        let args = parse("IP=198.18.0.5/24,2001:db8::5/64;K8S_POD_NAME=p").unwrap();
        assert_eq!(args.ips, vec![ip("198.18.0.5"), ip("2001:db8::5")]);
        assert_eq!(args.pod_name, "p");
    }

    #[test]
    fn value_may_contain_equals_and_segments_may_be_empty() {
        let args = parse("K8S_POD_NAME=a=b;;K8S_POD_NAMESPACE=ns;").unwrap();
        assert_eq!(args.pod_name, "a=b");
        assert_eq!(args.pod_namespace, "ns");
    }

    #[test]
    fn later_duplicate_wins() {
        assert_eq!(
            parse("K8S_POD_NAME=a;K8S_POD_NAME=b").unwrap().pod_name,
            "b"
        );
    }

    #[test]
    fn malformed_pairs_name_the_pair() {
        for (input, pair) in [("invalid;format", "invalid"), ("K8S_POD_NAME=p;=v", "=v")] {
            let err = parse(input).unwrap_err();
            assert_eq!(err.code, INVALID_ENV);
            assert_eq!(
                err.msg,
                format!("invalid CNI_ARGS pair {pair:?}: expected KEY=VALUE")
            );
        }
    }

    #[test]
    fn bad_ips_name_the_pair() {
        for bad in [
            "IP=",
            "IP=198.18.0",
            "IP=198.18.0.5/33",
            "IP=198.18.0.5/",
            "IP=198.18.0.5,",
            "IP=2001:db8::1/129",
            "IP=198.18.0.5/024",
        ] {
            let err = parse(bad).unwrap_err();
            assert_eq!(err.code, INVALID_ENV, "{bad}");
            assert!(err.msg.contains("CNI_ARGS"), "{}", err.msg);
            assert!(err.msg.contains(&format!("{bad:?}")), "{}", err.msg);
        }
    }

    #[test]
    fn oversized_input_is_refused() {
        let huge = "A=".to_string() + &"x".repeat(MAX_CNI_ARGS_LEN);
        let err = parse(&huge).unwrap_err();
        assert_eq!(err.code, INVALID_ENV);
        assert!(
            err.msg.starts_with("CNI_ARGS is 65538 bytes"),
            "{}",
            err.msg
        );
    }

    #[test]
    fn pod_fields_are_bounded() {
        let long = format!("K8S_POD_NAME={}", "p".repeat(254));
        let err = parse(&long).unwrap_err();
        assert_eq!(err.code, INVALID_ENV);
        assert!(
            err.msg.starts_with("invalid CNI_ARGS K8S_POD_NAME \""),
            "{}",
            err.msg
        );
        assert!(err.msg.ends_with("is 254 bytes, more than the 253 allowed"));
        assert!(parse("K8S_POD_NAMESPACE=a\u{7}b").is_err());
    }

    #[test]
    fn ip_with_prefix_helper() {
        assert_eq!(
            parse_ip_maybe_prefix("198.18.102.3/24"),
            Some((ip("198.18.102.3"), Some(24)))
        );
        assert_eq!(parse_ip_maybe_prefix("::1"), Some((ip("::1"), None)));
        assert_eq!(
            parse_ip_maybe_prefix("::1/128"),
            Some((ip("::1"), Some(128)))
        );
        assert_eq!(parse_ip_maybe_prefix("198.18.102.3/+4"), None);
        assert_eq!(parse_ip_maybe_prefix("198.18.102.3/24/1"), None);
    }
}
