//! IP prefixes (CIDR blocks): strict parsing, the address arithmetic the
//! store needs and the gateway the CNI result reports. Addresses are handled
//! as `u128` offsets so IPv4 and IPv6 share one code path.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// An address family, spelled as upstream stores it in `cidr_blocks.ip_family`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    /// The database spelling: `ipv4` or `ipv6`.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }

    /// Parses the database spelling.
    pub fn parse(text: &str) -> Option<Family> {
        match text {
            "ipv4" => Some(Family::V4),
            "ipv6" => Some(Family::V6),
            _ => None,
        }
    }

    /// Bits in an address of this family.
    pub fn bits(self) -> u8 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }

    /// The family of an address.
    pub fn of(addr: IpAddr) -> Family {
        match addr {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a prefix did not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CidrError {
    /// No `/` separating address and prefix length.
    MissingPrefixLength(String),
    /// The address part is not an IP address.
    BadAddress(String),
    /// The prefix length is not a number within the family's width.
    BadPrefixLength(String),
    /// Bits below the prefix length are set; the canonical network is given.
    HostBitsSet { given: String, network: String },
    /// An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`): neither family's
    /// block; host-local refuses it too.
    V4Mapped(String),
}

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CidrError::MissingPrefixLength(s) => {
                write!(f, "invalid CIDR {s:?}: missing \"/prefix-length\"")
            }
            CidrError::BadAddress(s) => write!(f, "invalid CIDR {s:?}: not an IP address"),
            CidrError::BadPrefixLength(s) => {
                write!(f, "invalid CIDR {s:?}: prefix length out of range")
            }
            CidrError::HostBitsSet { given, network } => write!(
                f,
                "invalid CIDR {given:?}: host bits set; the network address is {network}"
            ),
            CidrError::V4Mapped(s) => write!(
                f,
                "invalid CIDR {s:?}: an IPv4-mapped IPv6 address; write the IPv4 subnet itself"
            ),
        }
    }
}

impl std::error::Error for CidrError {}

/// A canonical IP prefix: the address has no bits set below the prefix length.
/// Ordered by address (IPv4 before IPv6), then length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    base: IpAddr,
    prefix_len: u8,
}

impl Cidr {
    /// Builds a prefix from its parts, refusing host bits and lengths wider
    /// than the family.
    pub fn new(base: IpAddr, prefix_len: u8) -> Result<Cidr, CidrError> {
        let family = Family::of(base);
        if prefix_len > family.bits() {
            return Err(CidrError::BadPrefixLength(format!("{base}/{prefix_len}")));
        }
        let canonical = Cidr {
            base: from_u128(family, to_u128(base) & mask(family, prefix_len)),
            prefix_len,
        };
        if canonical.base != base {
            return Err(CidrError::HostBitsSet {
                given: format!("{base}/{prefix_len}"),
                network: canonical.to_string(),
            });
        }
        Ok(canonical)
    }

    /// The first address of the prefix.
    pub fn base(&self) -> IpAddr {
        self.base
    }

    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    pub fn family(&self) -> Family {
        Family::of(self.base)
    }

    /// Bits left for hosts: 32 − len or 128 − len.
    pub fn host_bits(&self) -> u8 {
        self.family().bits() - self.prefix_len
    }

    /// Number of addresses, saturating at `u128::MAX` for `::/0`.
    pub fn size(&self) -> u128 {
        1u128
            .checked_shl(u32::from(self.host_bits()))
            .unwrap_or(u128::MAX)
    }

    /// The address `offset` places after the base, if it is inside the prefix.
    pub fn nth(&self, offset: u128) -> Option<IpAddr> {
        if offset >= self.size() {
            return None;
        }
        Some(from_u128(self.family(), to_u128(self.base) + offset))
    }

    /// The offset of `addr` from the base, if `addr` is inside the prefix.
    pub fn offset_of(&self, addr: IpAddr) -> Option<u128> {
        if Family::of(addr) != self.family() {
            return None;
        }
        let offset = to_u128(addr).wrapping_sub(to_u128(self.base));
        (offset < self.size()).then_some(offset)
    }

    pub fn contains(&self, addr: IpAddr) -> bool {
        self.offset_of(addr).is_some()
    }

    /// Whether two prefixes share any address.
    pub fn overlaps(&self, other: &Cidr) -> bool {
        self.contains(other.base) || other.contains(self.base)
    }

    /// The prefix of `prefix_len` that holds this one, when that is no
    /// longer than its own.
    pub fn widened(&self, prefix_len: u8) -> Option<Cidr> {
        let family = self.family();
        (prefix_len <= self.prefix_len).then(|| Cidr {
            base: from_u128(family, to_u128(self.base) & mask(family, prefix_len)),
            prefix_len,
        })
    }

    /// `self` strictly contains `inner`.
    pub fn strictly_contains(&self, inner: &Cidr) -> bool {
        self.prefix_len < inner.prefix_len && self.contains(inner.base)
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(text: &str) -> Result<Cidr, CidrError> {
        let (addr, len) = text
            .split_once('/')
            .ok_or_else(|| CidrError::MissingPrefixLength(text.to_string()))?;
        let base: IpAddr = addr
            .parse()
            .map_err(|_| CidrError::BadAddress(text.to_string()))?;
        if let IpAddr::V6(v6) = base
            && v6.to_ipv4_mapped().is_some()
        {
            return Err(CidrError::V4Mapped(text.to_string()));
        }
        // Only plain decimal digits: "+24", " 24" and "024" are not prefixes.
        let valid_digits = !len.is_empty()
            && len.len() <= 3
            && len.bytes().all(|b| b.is_ascii_digit())
            && !(len.len() > 1 && len.starts_with('0'));
        let prefix_len = valid_digits
            .then(|| len.parse::<u8>().ok())
            .flatten()
            .ok_or_else(|| CidrError::BadPrefixLength(text.to_string()))?;
        Cidr::new(base, prefix_len).map_err(|err| match err {
            CidrError::BadPrefixLength(_) => CidrError::BadPrefixLength(text.to_string()),
            other => other,
        })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // As `write!(f, "{}/{}", ...)` wrote it (no padding), by hand: a
        // block's text is bound to the statements of every request.
        let mut text = address_text(self.base);
        text.push('/');
        push_decimal(&mut text, self.prefix_len);
        f.write_str(&text)
    }
}

/// `address` as text, exactly as its `Display` writes it: IPv4 digit by
/// digit, for every request binds addresses as text (upstream stores them
/// so) and the standard formatter's machinery costs more than the
/// statement's own work; IPv6 by the standard formatter (its `::` rules).
pub fn address_text(address: IpAddr) -> String {
    match address {
        IpAddr::V4(v4) => {
            let mut text = String::with_capacity(15);
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    text.push('.');
                }
                push_decimal(&mut text, octet);
            }
            text
        }
        IpAddr::V6(_) => address.to_string(),
    }
}

/// `n` in decimal, as its `Display` writes it.
fn push_decimal(text: &mut String, n: u8) {
    if n >= 100 {
        text.push(char::from(b'0' + n / 100));
    }
    if n >= 10 {
        text.push(char::from(b'0' + n / 10 % 10));
    }
    text.push(char::from(b'0' + n % 10));
}

/// Upstream's gateway for blocks too small to spare base + 1 (/31, /32,
/// /127, /128): a link-local address the pod reaches on-link.
pub const SMALL_BLOCK_GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 4, 6);
/// The IPv6 counterpart of [`SMALL_BLOCK_GATEWAY_V4`].
pub const SMALL_BLOCK_GATEWAY_V6: Ipv6Addr =
    Ipv6Addr::new(0xfe80, 0, 0, 0, 0x8893, 0xb6ff, 0xfe2c, 0x7a0d);

/// The gateway Metis reports for an address in `block`: base + 1, or the
/// link-local gateway when the block has fewer than 2 host bits.
pub fn gateway_for(block: &Cidr) -> IpAddr {
    match (block.host_bits() >= 2).then(|| block.nth(1)).flatten() {
        Some(gateway) => gateway,
        None => match block.family() {
            Family::V4 => IpAddr::V4(SMALL_BLOCK_GATEWAY_V4),
            Family::V6 => IpAddr::V6(SMALL_BLOCK_GATEWAY_V6),
        },
    }
}

/// host-local's `rangeStart`, `rangeEnd` and `gateway` of a block whose
/// configuration departs from Metis's default reservation: addresses
/// outside `start..=end` and the gateway (when inside the block) are never
/// handed out, and the gateway is what results advertise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub start: IpAddr,
    pub end: IpAddr,
    pub gateway: IpAddr,
}

impl Bounds {
    /// host-local's defaults for `block`: base + 1 up to the last address
    /// (IPv4: the one before broadcast), gateway base + 1.
    pub fn host_local_default(block: &Cidr) -> Bounds {
        let last = block.size().saturating_sub(1);
        let end = match block.family() {
            Family::V4 => last.saturating_sub(1),
            Family::V6 => last,
        };
        let at = |offset: u128| block.nth(offset).unwrap_or(block.base());
        Bounds {
            start: at(1),
            end: at(end),
            gateway: at(1),
        }
    }

    /// host-local's canonicalisation: absent fields take their defaults,
    /// `start` and `end` must lie in the block (the messages are
    /// host-local's) and `start` must not come after `end`. A gateway may
    /// lie anywhere, as in host-local; only one inside the block is
    /// reserved.
    pub fn new(
        block: &Cidr,
        start: Option<IpAddr>,
        end: Option<IpAddr>,
        gateway: Option<IpAddr>,
    ) -> Result<Bounds, String> {
        let default = Bounds::host_local_default(block);
        let inside = |name: &str, addr: Option<IpAddr>, fallback: IpAddr| match addr {
            None => Ok(fallback),
            Some(addr) if block.contains(addr) => Ok(addr),
            Some(addr) => Err(format!("{name} {addr} not in network {block}")),
        };
        let start = inside("RangeStart", start, default.start)?;
        let end = inside("RangeEnd", end, default.end)?;
        if to_u128(start) > to_u128(end) {
            return Err(format!("RangeStart {start} is after RangeEnd {end}"));
        }
        let gateway = gateway.unwrap_or(default.gateway);
        if Family::of(gateway) != block.family() {
            return Err(format!("gateway {gateway} is not of the family of {block}"));
        }
        Ok(Bounds {
            start,
            end,
            gateway,
        })
    }

    /// Whether no address of `block` may be handed out under these bounds:
    /// the one address of `rangeStart`..`rangeEnd` is the gateway.
    pub fn leaves_no_address(&self, block: &Cidr) -> bool {
        let (gateway, start, end) = self.offsets(block);
        end < start || (start == end && gateway == Some(start))
    }

    /// The reserved offsets of `block` under these bounds, as
    /// (gateway offset if inside, first usable offset, last usable offset).
    pub fn offsets(&self, block: &Cidr) -> (Option<u128>, u128, u128) {
        let start = block.offset_of(self.start).unwrap_or(0);
        let end = block
            .offset_of(self.end)
            .unwrap_or(block.size().saturating_sub(1));
        (block.offset_of(self.gateway), start, end)
    }
}

/// The address as an unsigned integer (IPv4 in the low 32 bits).
pub fn to_u128(addr: IpAddr) -> u128 {
    match addr {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// The inverse of [`to_u128`]; IPv4 keeps only the low 32 bits.
pub fn from_u128(family: Family, value: u128) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::from(
            u32::try_from(value & u128::from(u32::MAX)).unwrap_or(u32::MAX),
        )),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(value)),
    }
}

/// The prefixes that are not contained in another of the list, deduplicated,
/// in the list's order.
pub fn maximal(cidrs: &[Cidr]) -> Vec<Cidr> {
    let mut out: Vec<Cidr> = Vec::new();
    for cidr in cidrs {
        if out.contains(cidr) || cidrs.iter().any(|other| other.strictly_contains(cidr)) {
            continue;
        }
        out.push(*cidr);
    }
    out
}

/// `outer` minus `inner` (inside it) as prefixes: one per bit between the
/// two prefix lengths, the sibling of each half that holds `inner`.
pub fn subtract(outer: &Cidr, inner: &Cidr) -> Vec<Cidr> {
    let mut pieces = Vec::new();
    let mut current = *outer;
    while current.prefix_len() < inner.prefix_len() {
        let len = current.prefix_len() + 1;
        let half = 1u128 << (current.family().bits() - len);
        let low = to_u128(current.base());
        let family = current.family();
        let (Ok(lower), Ok(upper)) = (
            Cidr::new(from_u128(family, low), len),
            Cidr::new(from_u128(family, low + half), len),
        ) else {
            break;
        };
        let (keep, piece) = if lower.contains(inner.base()) {
            (lower, upper)
        } else {
            (upper, lower)
        };
        pieces.push(piece);
        current = keep;
    }
    pieces
}

fn mask(family: Family, prefix_len: u8) -> u128 {
    let bits = u32::from(family.bits());
    let host = bits - u32::from(prefix_len);
    let all = if bits == 128 {
        u128::MAX
    } else {
        (1u128 << bits) - 1
    };
    all & !(1u128.checked_shl(host).map_or(u128::MAX, |v| v - 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::cidr;

    #[test]
    fn widened_is_the_holding_prefix_of_a_length_no_longer() {
        let cidr: Cidr = "198.18.0.40/29".parse().unwrap();
        let widened = |len| cidr.widened(len).map(|c| c.to_string());
        assert_eq!(widened(26).as_deref(), Some("198.18.0.0/26"));
        assert_eq!(widened(29).as_deref(), Some("198.18.0.40/29"));
        assert_eq!(widened(0).as_deref(), Some("0.0.0.0/0"));
        assert_eq!(widened(30), None);
        let v6: Cidr = "2001:db8::10/124".parse().unwrap();
        assert_eq!(v6.widened(120).unwrap().to_string(), "2001:db8::/120");
    }

    #[test]
    fn address_text_is_what_display_writes() {
        let samples = [
            0u32,
            1,
            9,
            10,
            99,
            100,
            199,
            255,
            0x0a00_0001,
            0xc612_0005,
            u32::MAX,
        ]
        .into_iter()
        .chain((0..=255u32).map(|octet| octet * 0x0101_0101))
        .chain((0..20_000u32).map(|i| i.wrapping_mul(2_654_435_761)))
        .map(|bits| IpAddr::V4(Ipv4Addr::from(bits)))
        .chain(
            [
                "::",
                "::1",
                "2001:db8::5",
                "fe80::8893:b6ff:fe2c:7a0d",
                "::ffff:1.2.3.4",
            ]
            .map(|text| text.parse::<IpAddr>().unwrap()),
        );
        for address in samples {
            assert_eq!(address_text(address), address.to_string());
        }
        for text in [
            "0.0.0.0/0",
            "198.18.0.0/16",
            "10.0.0.0/8",
            "255.255.255.255/32",
            "2001:db8::/64",
            "::/0",
            "fe80::/128",
        ] {
            let block: Cidr = text.parse().unwrap();
            assert_eq!(block.to_string(), text);
            assert_eq!(
                format!("{block}"),
                format!("{}/{}", block.base, block.prefix_len)
            );
        }
    }

    #[test]
    fn parses_canonical_prefixes() {
        let c = cidr("198.18.0.0/24");
        assert_eq!(c.size(), 256);
        assert_eq!(c.nth(1), Some("198.18.0.1".parse().unwrap()));
        assert_eq!(c.nth(255), Some("198.18.0.255".parse().unwrap()));
        assert_eq!(c.nth(256), None);
        assert_eq!(cidr("0.0.0.0/0").size(), 1 << 32);
        assert_eq!(cidr("2001:db8::/64").host_bits(), 64);
        assert_eq!(cidr("::/0").size(), u128::MAX);
        assert_eq!(cidr("2001:db8::1/128").size(), 1);
        assert_eq!(cidr("198.18.0.7/32").to_string(), "198.18.0.7/32");
    }

    #[test]
    fn rejects_malformed_prefixes() {
        for bad in [
            "198.18.0.0",
            "198.18.0.0/33",
            "198.18.0.0/",
            "198.18.0.0/+8",
            "198.18.0.0/024",
            "198.18.0.0/ 8",
            "2001:db8::/129",
            "nope/24",
            "/24",
            "198.18.0.0/24/1",
            "198.18.0.0/99999999999",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn host_bits_name_the_network() {
        let err = "198.18.0.1/24".parse::<Cidr>().unwrap_err();
        assert_eq!(
            err,
            CidrError::HostBitsSet {
                given: "198.18.0.1/24".into(),
                network: "198.18.0.0/24".into()
            }
        );
        assert!(err.to_string().contains("198.18.0.0/24"));
    }

    #[test]
    fn v4_mapped_subnets_are_refused_as_host_local_does() {
        for text in ["::ffff:198.18.0.0/120", "::ffff:c612:0/120"] {
            assert_eq!(
                text.parse::<Cidr>(),
                Err(CidrError::V4Mapped(text.into())),
                "{text}"
            );
        }
        assert!("2001:db8::ffff:198.18.0.0/120".parse::<Cidr>().is_ok());
    }

    #[test]
    fn offsets_and_overlap() {
        let c = cidr("2001:db8::/120");
        assert_eq!(c.offset_of("2001:db8::ff".parse().unwrap()), Some(255));
        assert_eq!(c.offset_of("2001:db8::100".parse().unwrap()), None);
        assert_eq!(c.offset_of("198.18.0.1".parse().unwrap()), None);
        assert!(cidr("198.18.0.0/16").overlaps(&cidr("198.18.4.0/24")));
        assert!(cidr("198.18.4.0/24").overlaps(&cidr("198.18.0.0/16")));
        assert!(!cidr("198.18.4.0/24").overlaps(&cidr("198.18.5.0/24")));
    }

    #[test]
    fn gateway_table() {
        for (block, gateway) in [
            ("198.19.0.0/24", "198.19.0.1"),
            ("198.19.0.0/30", "198.19.0.1"),
            ("198.19.0.0/31", "169.254.4.6"),
            ("198.19.0.7/32", "169.254.4.6"),
            ("2600:1900:4040:ae7:0:7::/112", "2600:1900:4040:ae7:0:7:0:1"),
            ("2001:db8::/127", "fe80::8893:b6ff:fe2c:7a0d"),
            ("2001:db8::7/128", "fe80::8893:b6ff:fe2c:7a0d"),
        ] {
            assert_eq!(gateway_for(&cidr(block)).to_string(), gateway, "{block}");
        }
    }

    #[test]
    fn subtract_leaves_one_piece_per_bit() {
        let pieces: Vec<String> = subtract(&cidr("198.18.0.0/24"), &cidr("198.18.0.64/26"))
            .iter()
            .map(Cidr::to_string)
            .collect();
        assert_eq!(pieces, ["198.18.0.128/25", "198.18.0.0/26"]);
        assert!(subtract(&cidr("198.18.0.0/24"), &cidr("198.18.0.0/24")).is_empty());
        let v6: Vec<String> = subtract(&cidr("2001:db8::/126"), &cidr("2001:db8::3/128"))
            .iter()
            .map(Cidr::to_string)
            .collect();
        assert_eq!(v6, ["2001:db8::/127", "2001:db8::2/128"]);
    }

    #[test]
    fn maximal_drops_contained_and_repeated_prefixes() {
        let list = [
            cidr("198.18.0.0/29"),
            cidr("198.18.0.0/28"),
            cidr("198.18.1.0/30"),
            cidr("198.18.1.0/30"),
        ];
        assert_eq!(
            maximal(&list),
            [cidr("198.18.0.0/28"), cidr("198.18.1.0/30")]
        );
    }
}
