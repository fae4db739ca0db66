//! host-local's on-disk state and config, as `metis import|export
//! host-local` read them: any file name is host-local's own spelling of an
//! address (which prints back to itself), its bookkeeping, or refused; every
//! address's spelling reads back as that address; any file content is an
//! owner or refused with a message that never quotes it; any config is a
//! served network or an error, never a panic.
#![no_main]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use libfuzzer_sys::fuzz_target;
use metis::cli::host_local::parse_config;
use metis::host_local_dir::{file_name, parse_entry, parse_name};

fuzz_target!(|data: (&str, [u8; 16], &[u8])| {
    let (name, raw, bytes) = data;
    if let Ok(Some(address)) = parse_name(name) {
        assert_eq!(file_name(address), name);
    }
    let v6 = Ipv6Addr::from(raw);
    let v4 = Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3]);
    for address in [IpAddr::V6(v6), IpAddr::V4(v4)] {
        let canonical = match address {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
            v4 => v4,
        };
        assert_eq!(parse_name(&file_name(address)), Ok(Some(canonical)));
        match parse_entry(address, bytes) {
            Ok(held) => {
                for field in [&held.container_id, &held.ifname] {
                    assert!(!field.is_empty() && field.bytes().all(|b| b.is_ascii_graphic()));
                }
            }
            Err(message) => assert_eq!(
                message,
                format!(
                    "{address}: not host-local's \"CONTAINER\\r\\nIFNAME\" ({} bytes, content not shown)",
                    bytes.len()
                )
            ),
        }
    }
    if let Ok((conf, _notes)) = parse_config(bytes) {
        assert!(!conf.ipv4_ranges.is_empty() || !conf.ipv6_ranges.is_empty());
    }
});
