//! Nothing in the daemon panics on input: garbage bytes, frames of random
//! payload, and well-formed requests with random field values are thrown
//! at a live daemon; it answers or closes each connection, keeps serving a
//! normal client, never logs a panic, and its database keeps every
//! invariant. `METIS_HOSTILE_SEED` replays a run.

use crate::common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::rng::Rng;
use common::{TestDaemon, TestDir};
use metis::wire::client::Client;
use metis::wire::frame::{self, MAX_REQUEST_FRAME};
use metis::wire::{Code, Request, admin, ipam, request};
use prost::Message;

const CONNECTIONS: usize = 400;

/// Text that is sometimes an address, a prefix or a name, often nonsense.
fn text(rng: &mut Rng) -> String {
    const PIECES: &[&str] = &[
        "198.18.",
        "0",
        "1",
        "255",
        "256",
        ".",
        "/",
        "24",
        "32",
        "33",
        "2001:db8::",
        ":",
        "::",
        "-",
        "a",
        "eth0",
        "default",
        "%",
        "\u{e9}",
        "\0",
        "'",
        ";",
        "99999999999",
    ];
    let len = rng.index(8);
    (0..len).map(|_| PIECES[rng.index(PIECES.len())]).collect()
}

fn ip_config(rng: &mut Rng) -> Option<ipam::IpConfig> {
    rng.chance(70).then(|| ipam::IpConfig {
        interface_name: text(rng),
        container_id: text(rng),
        initial_pod_cidr: if rng.chance(50) {
            format!("198.18.{}.0/{}", rng.below(300), rng.below(40))
        } else {
            text(rng)
        },
        requested_ip: if rng.chance(30) {
            text(rng)
        } else {
            String::new()
        },
        ..Default::default()
    })
}

/// A well-formed request with random field values.
fn random_request(rng: &mut Rng) -> Request {
    let kind = match rng.below(6) {
        0 | 1 => request::Kind::Allocate(ipam::AllocatePodIpRequest {
            network: text(rng),
            ipv4_config: ip_config(rng),
            ipv6_config: ip_config(rng),
            pod_name: text(rng),
            pod_namespace: text(rng),
            isolated: rng.below(2) == 0,
            conf_name: String::new(),
        }),
        2 => request::Kind::Deallocate(ipam::DeallocatePodIpRequest {
            network: text(rng),
            interface_name: text(rng),
            container_id: text(rng),
            pod_name: text(rng),
            pod_namespace: text(rng),
        }),
        3 => request::Kind::Check(ipam::CheckPodIpRequest {
            network: text(rng),
            interface_name: text(rng),
            container_id: text(rng),
            ..Default::default()
        }),
        4 => request::Kind::ListCidrBlocks(admin::v1::ListCidrBlocksRequest::default()),
        _ => request::Kind::ListIpAddresses(admin::v1::ListIpAddressesRequest::default()),
    };
    Request { kind: Some(kind) }
}

/// One hostile connection's bytes.
fn hostile_bytes(rng: &mut Rng) -> Vec<u8> {
    match rng.below(5) {
        // Pure garbage, any length prefix included.
        0 => {
            let len = rng.index(300);
            rng.bytes(len)
        }
        // A valid frame of random payload.
        1 => {
            let len = rng.index(200);
            frame::encode(&rng.bytes(len), MAX_REQUEST_FRAME).unwrap()
        }
        // A real request with a few bytes flipped.
        2 => {
            let mut payload = random_request(rng).encode_to_vec();
            for _ in 0..=rng.below(3) {
                if !payload.is_empty() {
                    let at = rng.index(payload.len());
                    payload[at] ^= rng.bytes(1)[0] | 1;
                }
            }
            frame::encode(&payload, MAX_REQUEST_FRAME).unwrap()
        }
        // Several well-formed random requests back to back.
        _ => (0..=rng.below(3))
            .flat_map(|_| {
                frame::encode(&random_request(rng).encode_to_vec(), MAX_REQUEST_FRAME).unwrap()
            })
            .collect(),
    }
}

fn normal_add(daemon: &TestDaemon, container: &str) {
    let mut client = Client::connect(
        &daemon.socket,
        Duration::from_secs(2),
        Duration::from_secs(10),
    )
    .unwrap();
    let reply = client
        .call(&Request {
            kind: Some(request::Kind::Allocate(ipam::AllocatePodIpRequest {
                network: "sane".into(),
                ipv4_config: Some(ipam::IpConfig {
                    interface_name: "eth0".into(),
                    container_id: container.into(),
                    initial_pod_cidr: "198.19.0.0/24".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })),
        })
        .unwrap();
    assert_eq!(reply.code(), Code::Ok, "{reply:?}");
}

#[test]
fn garbage_never_stops_the_daemon() {
    let dir = TestDir::new("hostile");
    let mut daemon = TestDaemon::start(&dir, &["--release-cooldown", "0"]);
    let mut rng = Rng::from_env("METIS_HOSTILE_SEED");
    let mut answered = 0;
    for i in 0..CONNECTIONS {
        let bytes = hostile_bytes(&mut rng);
        let mut stream = UnixStream::connect(&daemon.socket).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        // The daemon may close early on a bad prefix: a failed write is fine.
        let _ = stream.write_all(&bytes);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        // Read until the daemon closes: every answer, then EOF (or a reset).
        let mut replies = Vec::new();
        let _ = stream.read_to_end(&mut replies);
        answered += usize::from(!replies.is_empty());
        if i % 50 == 0 {
            normal_add(&daemon, &format!("sane-{i}"));
        }
    }
    assert!(answered > CONNECTIONS / 2, "only {answered} answered");
    normal_add(&daemon, "sane-last");
    assert!(
        daemon.child.try_wait().unwrap().is_none(),
        "daemon died: {}",
        daemon.log()
    );
    assert!(!daemon.log().contains("panicked"), "{}", daemon.log());
    assert!(daemon.stop().success());
    let check = common::admin_check(&dir.join("metis.sqlite"));
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
}
