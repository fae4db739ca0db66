//! Property tests of everything that parses outside input: the frame
//! decoder, envelope decoding (and the engine behind it), CNI configuration,
//! `CNI_ARGS` and CIDRs. Each property holds for arbitrary input — no
//! panic, errors of the documented kind — and round-trips hold for
//! generated valid input. The same parsers have coverage-guided fuzz
//! targets in `fuzz/` (`make fuzz`).

use crate::common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use metis::cidr::Cidr;
use metis::cni::{args, conf};
use metis::decode::{decode, to_wire};
use metis::engine::{Engine, Outcome};
use metis::store::{Depth, Store, StoreOptions};
use metis::wire::frame::{self, MAX_REQUEST_FRAME, PREFIX_LEN};
use metis::wire::{Request, Response, ipam, request};
use proptest::prelude::*;
use prost::Message;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    // ---- frame decoder ----

    #[test]
    fn frames_round_trip_and_wait_for_every_byte(
        payload in prop::collection::vec(any::<u8>(), 0..2048),
        trailing in prop::collection::vec(any::<u8>(), 0..16),
    ) {
        let encoded = frame::encode(&payload, MAX_REQUEST_FRAME).unwrap();
        for cut in 0..encoded.len() {
            prop_assert!(frame::split(&encoded[..cut], MAX_REQUEST_FRAME).unwrap().is_none());
        }
        let mut stream = encoded.clone();
        stream.extend_from_slice(&trailing);
        let (range, used) = frame::split(&stream, MAX_REQUEST_FRAME).unwrap().unwrap();
        prop_assert_eq!(&stream[range], payload.as_slice());
        prop_assert_eq!(used, encoded.len());
        let mut reader = stream.as_slice();
        prop_assert_eq!(frame::read_frame(&mut reader, MAX_REQUEST_FRAME).unwrap(), payload);
    }

    #[test]
    fn any_bytes_split_safely(bytes in prop::collection::vec(any::<u8>(), 0..256), max in 0usize..128) {
        match frame::split(&bytes, max) {
            Ok(Some((range, used))) => {
                prop_assert_eq!(range.start, PREFIX_LEN);
                prop_assert_eq!(range.end, used);
                prop_assert!(used <= bytes.len() && range.len() <= max);
            }
            Ok(None) => {
                let waiting = bytes.len() < PREFIX_LEN || {
                    let len = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
                    len <= max && bytes.len() < PREFIX_LEN + len
                };
                prop_assert!(waiting);
            }
            Err(_) => {
                let len = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
                prop_assert!(len > max);
            }
        }
        let mut reader = bytes.as_slice();
        let read = frame::read_frame(&mut reader, max);
        let split = frame::split(&bytes, max);
        prop_assert_eq!(read.is_ok(), matches!(split, Ok(Some(_))));
    }

    // ---- envelope ----

    #[test]
    fn any_payload_decodes_or_fails_cleanly(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(request) = Request::decode(bytes.as_slice()) {
            let again = Request::decode(request.encode_to_vec().as_slice()).unwrap();
            prop_assert_eq!(again, request);
        }
        if let Ok(response) = Response::decode(bytes.as_slice()) {
            let again = Response::decode(response.encode_to_vec().as_slice()).unwrap();
            prop_assert_eq!(again, response);
        }
    }

    // ---- CNI configuration ----

    #[test]
    fn any_stdin_is_a_config_or_a_config_error(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Err(err) = conf::parse(&bytes) {
            prop_assert!((1..=7).contains(&err.code), "code {}", err.code);
        }
    }

    #[test]
    fn hostile_field_values_are_config_errors(
        name in ".{0,40}",
        subnet in ".{0,40}",
        gateway in ".{0,20}",
        network in ".{0,20}",
        grace in ".{0,10}",
    ) {
        let text = serde_json::json!({
            "cniVersion": "1.0.0", "name": name, "type": "metis",
            "ipam": {"type": "metis", "network": network, "gcGracePeriod": grace,
                     "ranges": [[{"subnet": subnet, "gateway": gateway}]]}
        })
        .to_string();
        if let Err(err) = conf::parse(text.as_bytes()) {
            prop_assert!((1..=7).contains(&err.code), "code {}", err.code);
        }
    }

    #[test]
    fn valid_configs_parse_to_their_ranges(
        name in "[a-z0-9][a-z0-9-]{0,20}[a-z0-9]",
        block in 0u32..256,
        prefix in 24u8..=30,
        v6 in any::<u16>(),
    ) {
        let v4 = Cidr::new(
            IpAddr::V4(Ipv4Addr::from(0xc612_0000 | (block << 8))),
            prefix,
        ).unwrap();
        let v6 = Cidr::new(
            IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, v6, 0, 0, 0, 0, 0)),
            64,
        ).unwrap();
        let text = format!(
            r#"{{"cniVersion":"1.1.0","name":"{name}","type":"metis","ipam":{{"type":"metis","ranges":[[{{"subnet":"{v4}"}}],[{{"subnet":"{v6}"}}]]}}}}"#
        );
        let parsed = conf::parse(text.as_bytes()).unwrap();
        prop_assert_eq!(parsed.ipv4_ranges, vec![v4]);
        prop_assert_eq!(parsed.ipv6_ranges, vec![v6]);
        prop_assert_eq!(parsed.network, name);
    }

    // ---- CNI_ARGS ----

    #[test]
    fn any_cni_args_parse_or_are_env_errors(text in ".{0,200}") {
        if let Err(err) = args::parse(&text) {
            prop_assert_eq!(err.code, 4);
        }
    }

    #[test]
    fn pod_identity_is_taken_verbatim(
        name in "[^;=\\p{Cc}]{0,30}",
        namespace in "[^;=\\p{Cc}]{0,30}",
        others in prop::collection::vec(("[A-Z_]{1,10}", "[^;]{0,10}"), 0..4),
        swap in any::<bool>(),
    ) {
        let mut pairs: Vec<String> = others
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "K8S_POD_NAME" | "K8S_POD_NAMESPACE" | "IP"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let ours = [format!("K8S_POD_NAME={name}"), format!("K8S_POD_NAMESPACE={namespace}")];
        if swap { pairs.extend(ours.into_iter().rev()) } else { pairs.extend(ours) }
        let parsed = args::parse(&pairs.join(";")).unwrap();
        prop_assert_eq!(parsed.pod_name, name);
        prop_assert_eq!(parsed.pod_namespace, namespace);
    }

    // ---- CIDR ----

    #[test]
    fn any_text_parses_to_a_canonical_cidr_or_fails(text in ".{0,50}") {
        if let Ok(cidr) = text.parse::<Cidr>() {
            prop_assert_eq!(cidr.to_string().parse::<Cidr>().unwrap(), cidr);
        }
    }

    #[test]
    fn v4_prefixes_round_trip_and_index(addr in any::<u32>(), prefix in 0u8..=32, k in any::<u64>()) {
        let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
        let cidr = Cidr::new(IpAddr::V4(Ipv4Addr::from(addr & mask)), prefix).unwrap();
        prop_assert_eq!(cidr.to_string().parse::<Cidr>().unwrap(), cidr);
        let offset = u128::from(k) % cidr.size();
        let nth = cidr.nth(offset).unwrap();
        prop_assert!(cidr.contains(nth));
        prop_assert_eq!(cidr.offset_of(nth), Some(offset));
        prop_assert_eq!(cidr.nth(cidr.size()), None);
        if addr & !mask != 0 {
            let host_bits_set = format!("{}/{prefix}", Ipv4Addr::from(addr));
            prop_assert!(host_bits_set.parse::<Cidr>().is_err());
        }
    }

    #[test]
    fn v6_prefixes_round_trip_and_index(addr in any::<u128>(), prefix in 0u8..=128, k in any::<u128>()) {
        let mask = if prefix == 0 { 0 } else { u128::MAX << (128 - prefix) };
        let cidr = Cidr::new(IpAddr::V6(Ipv6Addr::from(addr & mask)), prefix).unwrap();
        prop_assert_eq!(cidr.to_string().parse::<Cidr>().unwrap(), cidr);
        let offset = if prefix == 0 { k } else { k % cidr.size() };
        let nth = cidr.nth(offset).unwrap();
        prop_assert!(cidr.contains(nth));
        prop_assert_eq!(cidr.offset_of(nth), Some(offset));
    }
}

/// Arbitrary text in every field of an allocation, release and check
/// request: the engine answers each (never panics) and the database keeps
/// every invariant.
#[test]
fn the_engine_survives_hostile_requests_with_its_invariants() {
    let dir = common::TestDir::new("prop-engine");
    let store = Store::open(&dir.join("metis.sqlite"), &StoreOptions::default()).unwrap();
    let engine = std::cell::RefCell::new(Engine::new(store));
    let text = || {
        prop::string::string_regex(".{0,12}|198\\.18\\.[0-9]{1,3}\\.[0-9]{1,3}(/[0-9]{1,3})?|2001:db8::[0-9a-f]{0,4}(/[0-9]{1,3})?").unwrap()
    };
    // host-local bounds from the wire: any text, often addresses.
    let bounds = || {
        prop::collection::vec(
            (text(), text(), text(), text()).prop_map(|(subnet, start, end, gateway)| {
                ipam::RangeBounds {
                    subnet,
                    range_start: start,
                    range_end: end,
                    gateway,
                }
            }),
            0..2,
        )
    };
    let ip_config = || {
        (text(), text(), text(), text(), bounds()).prop_map(
            |(ifname, container, cidr, ip, bounds)| ipam::IpConfig {
                interface_name: ifname,
                container_id: container,
                initial_pod_cidr: cidr,
                requested_ip: ip,
                bounds,
                ..Default::default()
            },
        )
    };
    let kind = prop_oneof![
        (
            text(),
            prop::option::of(ip_config()),
            prop::option::of(ip_config())
        )
            .prop_map(|(network, v4, v6)| request::Kind::Allocate(
                ipam::AllocatePodIpRequest {
                    network,
                    ipv4_config: v4,
                    ipv6_config: v6,
                    pod_name: "p".into(),
                    pod_namespace: "n".into(),
                    isolated: false,
                    conf_name: String::new(),
                }
            )),
        (text(), text(), text()).prop_map(|(network, container_id, interface_name)| {
            request::Kind::Deallocate(ipam::DeallocatePodIpRequest {
                network,
                container_id,
                interface_name,
                ..Default::default()
            })
        }),
        (text(), text(), text()).prop_map(|(network, container_id, interface_name)| {
            request::Kind::Check(ipam::CheckPodIpRequest {
                network,
                container_id,
                interface_name,
                ..Default::default()
            })
        }),
    ];
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&kind, |kind| {
            // Served as the daemon serves it: decoded at the edge, and what
            // decodes goes back on the wire unchanged.
            let outcome = match decode(Request { kind: Some(kind) }) {
                Ok(command) => {
                    prop_assert_eq!(decode(to_wire(&command)), Ok(command.clone()));
                    engine.borrow_mut().handle(&command, 1_700_000_000_000)
                }
                Err(failure) => Outcome::from(failure),
            };
            let response = outcome.into_response();
            prop_assert!(response.status.is_some() || response.kind.is_some());
            Ok(())
        })
        .unwrap();
    let report = engine.borrow().store().verify(Depth::Full).unwrap();
    assert!(report.is_ok(), "{report:?}");
}
