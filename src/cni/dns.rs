//! `ipam.resolvConf`: the DNS settings of a resolv.conf file, read as
//! host-local reads them, for the result's `dns`.

use serde::Serialize;

/// The result's `dns` object; empty fields are omitted, as Go omits them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Dns {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nameservers: Vec<String>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub domain: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// resolv.conf files are small; a bigger one is a mistake, not DNS.
pub const MAX_RESOLV_CONF_BYTES: u64 = 64 * 1024;

impl Dns {
    pub fn is_empty(&self) -> bool {
        *self == Dns::default()
    }

    /// host-local's rule: comments (`#`, `;`) and lines of fewer than two
    /// words are skipped; `nameserver` adds one address, `domain` sets the
    /// domain (the last one wins), `search` and `options` add every word.
    /// Other keywords are ignored.
    pub fn parse(text: &str) -> Dns {
        let mut dns = Dns::default();
        for line in text.lines().map(str::trim) {
            if line.starts_with('#') || line.starts_with(';') {
                continue;
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            let [keyword, first, ..] = words.as_slice() else {
                continue;
            };
            let rest = || words.iter().skip(1).map(|w| (*w).to_string());
            match *keyword {
                "nameserver" => dns.nameservers.push((*first).to_string()),
                "domain" => dns.domain = (*first).to_string(),
                "search" => dns.search.extend(rest()),
                "options" => dns.options.extend(rest()),
                _ => {}
            }
        }
        dns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_as_host_local_does() {
        let dns = Dns::parse(
            "# comment\n; other\nnameserver 198.18.9.9\n  nameserver   2001:db8::53 \n\
             domain a.example\ndomain x.example\nsearch a.example b.example\nsearch c.example\n\
             options ndots:5 edns0\nnameserver\nsortlist 198.18.0.0\n",
        );
        assert_eq!(
            dns,
            Dns {
                nameservers: vec!["198.18.9.9".into(), "2001:db8::53".into()],
                domain: "x.example".into(),
                search: vec!["a.example".into(), "b.example".into(), "c.example".into()],
                options: vec!["ndots:5".into(), "edns0".into()],
            }
        );
        assert!(Dns::parse("").is_empty());
        assert!(Dns::parse("\u{0}\u{ffff} garbage\n\n").is_empty());
    }
}
