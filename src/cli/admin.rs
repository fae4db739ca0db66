//! `metis admin cidr-blocks|ip-addresses|usage`: read-only listings from the
//! daemon over its socket. Filters are typed: each is validated here and
//! bound as a query parameter by the store, so nothing typed on the command
//! line reaches SQL text.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::render::{Cell, Rows};
use super::{ArgsError, CallError, call, socket_path};
use crate::cidr::Family;
use crate::defaults::DEFAULT_SOCKET_PATH;
use crate::flags::{self, FlagSpec, Parsed};
use crate::store::BlockState;
use crate::wire::admin::v1::{ListCidrBlocksRequest, ListIpAddressesRequest};
use crate::wire::envelope::v1::{UsageRequest, UsageResponse};
use crate::wire::{request, response};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Large tables take a while to encode and send.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

const NETWORK: FlagSpec = FlagSpec {
    name: "--network",
    value: Some("NAME"),
    repeatable: false,
    default: "",
    help: "only this network",
};
const STATE: FlagSpec = FlagSpec {
    name: "--state",
    value: Some("Ready|Draining|Deleting|Withheld"),
    repeatable: false,
    default: "",
    help: "only blocks (or addresses in blocks) in this state",
};
const FAMILY: FlagSpec = FlagSpec {
    name: "--family",
    value: Some("ipv4|ipv6"),
    repeatable: false,
    default: "",
    help: "only this address family",
};
const CONTAINER_ID: FlagSpec = FlagSpec {
    name: "--container-id",
    value: Some("ID"),
    repeatable: false,
    default: "",
    help: "only addresses whose (last) owner is this container",
};
const ALLOCATED: FlagSpec = FlagSpec {
    name: "--allocated",
    value: Some("true|false"),
    repeatable: false,
    default: "",
    help: "only allocated (or reserved) addresses, or only free ones",
};
const OUTPUT: FlagSpec = FlagSpec {
    name: "-o",
    value: Some("table|json"),
    repeatable: false,
    default: "table",
    help: "output format",
};
const SOCKET: FlagSpec = FlagSpec {
    name: "--socket-path",
    value: Some("PATH"),
    repeatable: false,
    default: DEFAULT_SOCKET_PATH,
    help: "the daemon's Unix socket",
};

const BLOCK_FLAGS: &[FlagSpec] = &[NETWORK, STATE, FAMILY, OUTPUT, SOCKET];
const ADDRESS_FLAGS: &[FlagSpec] = &[
    NETWORK,
    STATE,
    FAMILY,
    CONTAINER_ID,
    ALLOCATED,
    OUTPUT,
    SOCKET,
];
const USAGE_FLAGS: &[FlagSpec] = &[NETWORK, FAMILY, OUTPUT, SOCKET];

const ABOUT: &str = "Usage: metis admin cidr-blocks|ip-addresses|usage [flags]

Reads the daemon's tables over its socket (read-only).

  cidr-blocks   the cidr_blocks table: one row per block
  ip-addresses  the ip_addresses table: one row per known address
  usage         addresses per network and family: total, allocated, cooldown, draining

Tables print with upper-cased headers and RFC 3339 UTC times; `-o json` prints an
array of objects keyed by the database column names. Run
`metis admin cidr-blocks --help` (and so on) for each listing's filters.
";

/// Which listing, with its filters.
#[derive(Debug, Clone, PartialEq)]
pub enum Listing {
    CidrBlocks(ListCidrBlocksRequest),
    IpAddresses(ListIpAddressesRequest),
    Usage(UsageRequest),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Table,
    Json,
}

/// A parsed `metis admin` command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub listing: Listing,
    pub format: Format,
    pub socket_path: PathBuf,
}

/// Why a listing could not be shown.
#[derive(Debug)]
pub enum AdminError {
    /// No answer, or an error status.
    Call(CallError),
    /// The daemon answered with something other than the listing asked for.
    Unexpected,
}

impl fmt::Display for AdminError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdminError::Call(err) => write!(f, "{err}"),
            AdminError::Unexpected => f.write_str("the daemon sent an unexpected reply"),
        }
    }
}

impl std::error::Error for AdminError {}

/// The overview printed by `metis admin --help`.
pub fn about() -> &'static str {
    ABOUT
}

fn listing_usage(listing: &str, specs: &[FlagSpec]) -> String {
    flags::usage(
        &format!("metis admin {listing}"),
        "Reads one listing from the daemon; every filter given must match.",
        specs,
    )
}

/// Parses `<listing> [list] [flags]` (`list` is accepted for upstream's
/// spelling, `metis admin cidr-blocks list`).
pub fn parse(args: &[String]) -> Result<Options, ArgsError> {
    let Some((listing, rest)) = args.split_first() else {
        return Err(ArgsError::Usage {
            message: "missing listing: cidr-blocks, ip-addresses or usage".to_string(),
            usage: ABOUT.to_string(),
        });
    };
    let specs = match listing.as_str() {
        "cidr-blocks" => BLOCK_FLAGS,
        "ip-addresses" => ADDRESS_FLAGS,
        "usage" => USAGE_FLAGS,
        "-h" | "--help" | "help" => return Err(ArgsError::Help(ABOUT.to_string())),
        other => {
            return Err(ArgsError::Usage {
                message: format!(
                    "unknown listing {other:?}: expected cidr-blocks, ip-addresses or usage"
                ),
                usage: ABOUT.to_string(),
            });
        }
    };
    let rest = match rest.split_first() {
        Some((word, tail)) if word == "list" => tail,
        _ => rest,
    };
    let usage = || listing_usage(listing, specs);
    // Upstream's CLI passed a raw SQL WHERE clause; say why it is gone
    // rather than just "unknown flag".
    if rest
        .iter()
        .any(|arg| arg == "--filter" || arg.starts_with("--filter="))
    {
        return Err(ArgsError::Usage {
            message: "--filter (upstream's raw SQL WHERE clause) is not supported: \
                      Metis never runs caller text as SQL; use the typed flags below"
                .to_string(),
            usage: usage(),
        });
    }
    let parsed = flags::parse(specs, rest).map_err(|err| ArgsError::from_flags(err, usage()))?;
    options(listing, &parsed).map_err(|err| ArgsError::from_flags(err, usage()))
}

fn options(listing: &str, parsed: &Parsed) -> Result<Options, flags::FlagError> {
    let network = text(parsed, "--network")?;
    let ip_family = checked(
        parsed,
        "--family",
        |v| Family::parse(v).is_some(),
        "ipv4 or ipv6",
    )?;
    let state = checked(
        parsed,
        "--state",
        |v| BlockState::parse(v).is_some(),
        "Ready, Draining, Deleting or Withheld",
    )?;
    let listing = match listing {
        "cidr-blocks" => Listing::CidrBlocks(ListCidrBlocksRequest {
            network,
            state,
            ip_family,
            filter: String::new(),
        }),
        "ip-addresses" => Listing::IpAddresses(ListIpAddressesRequest {
            network,
            state,
            ip_family,
            container_id: text(parsed, "--container-id")?,
            allocated: match parsed.get("--allocated") {
                None => None,
                Some("true") => Some(true),
                Some("false") => Some(false),
                Some(other) => return Err(bad("--allocated", other, "true or false")),
            },
            filter: String::new(),
        }),
        _ => Listing::Usage(UsageRequest { network, ip_family }),
    };
    let format = match parsed.get("-o").unwrap_or("table") {
        "table" => Format::Table,
        "json" => Format::Json,
        other => return Err(bad("-o", other, "table or json")),
    };
    let socket_path = socket_path(parsed)?;
    Ok(Options {
        listing,
        format,
        socket_path,
    })
}

fn bad(flag: &'static str, value: &str, expected: &str) -> flags::FlagError {
    flags::FlagError::BadValue(flag, format!("{value:?} is not {expected}"))
}

/// A filter's value; empty when not given, an error when given empty (the
/// wire reads empty as "any", which is not what `--network ''` asks).
fn text(parsed: &Parsed, flag: &'static str) -> Result<String, flags::FlagError> {
    match parsed.get(flag) {
        None => Ok(String::new()),
        Some("") => Err(flags::FlagError::BadValue(flag, "must not be empty".into())),
        Some(value) => Ok(value.to_string()),
    }
}

fn checked(
    parsed: &Parsed,
    flag: &'static str,
    valid: impl Fn(&str) -> bool,
    expected: &str,
) -> Result<String, flags::FlagError> {
    match parsed.get(flag) {
        Some(value) if !valid(value) => Err(bad(flag, value, expected)),
        _ => text(parsed, flag),
    }
}

/// Fetches the listing and renders it.
pub fn run(options: &Options) -> Result<String, AdminError> {
    let rows = fetch(options)?;
    Ok(match options.format {
        Format::Table => rows.table(),
        Format::Json => rows.json(),
    })
}

fn fetch(options: &Options) -> Result<Rows, AdminError> {
    let kind = match options.listing.clone() {
        Listing::CidrBlocks(req) => request::Kind::ListCidrBlocks(req),
        Listing::IpAddresses(req) => request::Kind::ListIpAddresses(req),
        Listing::Usage(req) => request::Kind::Usage(req),
    };
    let reply = call(&options.socket_path, CONNECT_TIMEOUT, CALL_TIMEOUT, kind)
        .map_err(AdminError::Call)?;
    match (&options.listing, reply) {
        (Listing::Usage(_), Some(response::Kind::Usage(usage))) => Ok(usage_rows(usage)),
        (Listing::CidrBlocks(_) | Listing::IpAddresses(_), Some(response::Kind::Table(dump))) => {
            Ok(Rows::from_text(
                dump.headers,
                dump.rows.into_iter().map(|row| row.values).collect(),
            ))
        }
        _ => Err(AdminError::Unexpected),
    }
}

fn usage_rows(usage: UsageResponse) -> Rows {
    Rows {
        columns: [
            "network",
            "ip_family",
            "total",
            "allocated",
            "reserved",
            "cooldown",
            "draining",
        ]
        .map(str::to_string)
        .to_vec(),
        rows: usage
            .usage
            .into_iter()
            .map(|u| {
                vec![
                    Cell::Text(u.network),
                    Cell::Text(u.ip_family),
                    // A daemon older than `total_exact` sends only `total`.
                    u.total_exact
                        .parse::<u128>()
                        .map_or(Cell::Int(u.total), Cell::Count),
                    Cell::Int(u.allocated),
                    Cell::Int(u.reserved),
                    Cell::Int(u.cooldown),
                    Cell::Int(u.draining),
                ]
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn usage_error(list: &[&str]) -> String {
        match parse(&args(list)) {
            Err(ArgsError::Usage { message, .. }) => message,
            other => panic!("{list:?}: expected a usage error, got {other:?}"),
        }
    }

    #[test]
    fn parses_typed_filters() {
        let options = parse(&args(&[
            "ip-addresses",
            "--network",
            "pods",
            "--state=Ready",
            "--family",
            "ipv6",
            "--container-id",
            "c1",
            "--allocated",
            "false",
            "-o",
            "json",
        ]))
        .unwrap();
        assert_eq!(options.format, Format::Json);
        assert_eq!(
            options.listing,
            Listing::IpAddresses(ListIpAddressesRequest {
                network: "pods".into(),
                state: "Ready".into(),
                ip_family: "ipv6".into(),
                container_id: "c1".into(),
                allocated: Some(false),
                filter: String::new(),
            })
        );
        assert_eq!(options.socket_path, PathBuf::from(DEFAULT_SOCKET_PATH));
        let upstream = parse(&args(&["cidr-blocks", "list"])).unwrap();
        assert_eq!(upstream.format, Format::Table);
        assert!(matches!(upstream.listing, Listing::CidrBlocks(_)));
    }

    #[test]
    fn rejects_misuse_with_a_reason() {
        assert!(usage_error(&[]).contains("missing listing"));
        assert!(usage_error(&["cidr-block"]).contains("unknown listing"));
        assert!(usage_error(&["cidr-blocks", "--container-id", "c"]).contains("unknown flag"));
        assert!(usage_error(&["usage", "--state", "Ready"]).contains("unknown flag"));
        for filter in [
            &["cidr-blocks", "list", "--filter", "1=1"][..],
            &["ip-addresses", "--filter=x"],
        ] {
            assert!(usage_error(filter).starts_with("--filter (upstream's raw SQL"));
        }
        assert!(usage_error(&["cidr-blocks", "--state", "ready"]).contains("Ready, Draining"));
        assert!(usage_error(&["cidr-blocks", "--family", "v4"]).contains("ipv4 or ipv6"));
        assert!(usage_error(&["ip-addresses", "--allocated", "1"]).contains("true or false"));
        assert!(usage_error(&["usage", "-o", "yaml"]).contains("table or json"));
        assert!(usage_error(&["usage", "--network="]).contains("must not be empty"));
        assert!(matches!(
            parse(&args(&["usage", "--help"])),
            Err(ArgsError::Help(text)) if text.contains("--network")
        ));
        assert!(matches!(parse(&args(&["--help"])), Err(ArgsError::Help(_))));
    }
}
