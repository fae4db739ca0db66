//! CNI network configuration parsing: any stdin is a configuration or a CNI
//! error with a code from the spec's table, never a panic; a parsed
//! configuration's ranges are canonical and its derived lookups succeed or
//! fail cleanly too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metis::cni::{args::CniArgs, conf};

fuzz_target!(|data: &[u8]| {
    match conf::parse(data) {
        Ok(net_conf) => {
            for cidr in net_conf.ipv4_ranges.iter().chain(&net_conf.ipv6_ranges) {
                assert_eq!(cidr.to_string().parse::<metis::cidr::Cidr>().ok(), Some(*cidr));
            }
            let _ = net_conf.require_ranges();
            let _ = net_conf.requested_addresses(&CniArgs::default());
            let _ = net_conf.prev_result_ips();
        }
        Err(err) => assert!(matches!(err.code, 1..=7), "unexpected code {}", err.code),
    }
});
