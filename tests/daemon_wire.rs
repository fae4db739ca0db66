//! The daemon over a real socket: framing abuse, unknown messages, the
//! request rules, concurrency, and shutdown.

use crate::common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::node::holdings;
use common::{TestDaemon, TestDir, allocated_v4};
use metis::wire::client::Client;
use metis::wire::frame::{self, MAX_REQUEST_FRAME, MAX_RESPONSE_FRAME};
use metis::wire::{Code, Request, Response, ipam, reason, request};
use prost::Message;

fn client(daemon: &TestDaemon) -> Client {
    Client::connect(
        &daemon.socket,
        Duration::from_secs(2),
        Duration::from_secs(10),
    )
    .unwrap()
}

fn allocate(container: &str, cidr: &str) -> Request {
    common::v4_add_request("", container, cidr)
}

fn raw_exchange(daemon: &TestDaemon, bytes: &[u8]) -> Option<Response> {
    let mut stream = UnixStream::connect(&daemon.socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(bytes).unwrap();
    frame::read_frame(&mut stream, MAX_RESPONSE_FRAME)
        .ok()
        .map(|payload| Response::decode(payload.as_slice()).unwrap())
}

#[test]
fn socket_is_private_and_serves_allocations() {
    let dir = TestDir::new("wire-basic");
    let daemon = TestDaemon::start(&dir, &[]);
    let mode = std::fs::metadata(&daemon.socket)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    let mut c = client(&daemon);
    assert_eq!(
        allocated_v4(&c.call(&allocate("c1", "198.18.0.0/24")).unwrap()),
        "198.18.0.2"
    );
    assert_eq!(
        allocated_v4(&c.call(&allocate("c2", "198.18.0.0/24")).unwrap()),
        "198.18.0.3"
    );
    // Idempotent repeat on the same connection.
    assert_eq!(
        allocated_v4(&c.call(&allocate("c1", "198.18.0.0/24")).unwrap()),
        "198.18.0.2"
    );

    let rows = holdings(&daemon.db).len();
    assert_eq!(rows, 2);
}

#[test]
fn request_rules_match_upstream() {
    let dir = TestDir::new("wire-rules");
    let daemon = TestDaemon::start(&dir, &[]);
    let mut c = client(&daemon);

    let none = Request {
        kind: Some(request::Kind::Allocate(
            ipam::AllocatePodIpRequest::default(),
        )),
    };
    let reply = c.call(&none).unwrap();
    assert_eq!(reply.code(), Code::InvalidArgument);
    assert!(
        reply
            .status
            .unwrap()
            .message
            .contains("both ipv4_config and ipv6_config are missing")
    );

    let empty_owner = allocate("", "198.18.0.0/24");
    assert_eq!(c.call(&empty_owner).unwrap().code(), Code::InvalidArgument);

    let tiny = allocate("c1", "198.18.0.0/30");
    assert_eq!(allocated_v4(&c.call(&tiny).unwrap()), "198.18.0.2");
    let exhausted = c.call(&allocate("c2", "198.18.0.0/30")).unwrap();
    assert_eq!(exhausted.code(), Code::ResourceExhausted);
    let status = exhausted.status.unwrap();
    assert_eq!(status.reason, reason::IP_POOL_EXHAUSTED);
    assert!(
        status.message.contains("no available IPs in store"),
        "{}",
        status.message
    );

    let check = |container: &str| Request {
        kind: Some(request::Kind::Check(ipam::CheckPodIpRequest {
            interface_name: "eth0".into(),
            container_id: container.into(),
            ..Default::default()
        })),
    };
    assert_eq!(c.call(&check("c1")).unwrap().code(), Code::Ok);
    let missing = c.call(&check("nope")).unwrap();
    assert_eq!(missing.code(), Code::NotFound);

    let release = |container: &str| Request {
        kind: Some(request::Kind::Deallocate(ipam::DeallocatePodIpRequest {
            interface_name: "eth0".into(),
            container_id: container.into(),
            ..Default::default()
        })),
    };
    assert_eq!(c.call(&release("c1")).unwrap().code(), Code::Ok);
    assert_eq!(
        c.call(&release("c1")).unwrap().code(),
        Code::Ok,
        "release is idempotent"
    );
    assert_eq!(c.call(&check("c1")).unwrap().code(), Code::NotFound);
}

#[test]
fn malformed_frames_get_errors_and_daemon_keeps_serving() {
    let dir = TestDir::new("wire-malformed");
    let daemon = TestDaemon::start(&dir, &[]);

    // Garbage inside a well-formed frame: an error reply.
    let garbage = frame::encode(&[0xff, 0xff, 0xff, 0xff, 0x0f], MAX_REQUEST_FRAME).unwrap();
    let reply = raw_exchange(&daemon, &garbage).expect("an error reply");
    assert_eq!(reply.code(), Code::InvalidArgument);
    assert_eq!(reply.status.unwrap().reason, reason::MALFORMED_REQUEST);

    // An empty frame decodes as a request with no kind: unknown message.
    let empty = frame::encode(&[], MAX_REQUEST_FRAME).unwrap();
    let reply = raw_exchange(&daemon, &empty).expect("an error reply");
    assert_eq!(reply.code(), Code::Unimplemented);

    // A message of an unknown oneof field (tag 99) is unknown too.
    let unknown = frame::encode(&[0x9a, 0x06, 0x00], MAX_REQUEST_FRAME).unwrap();
    let reply = raw_exchange(&daemon, &unknown).expect("an error reply");
    assert_eq!(reply.code(), Code::Unimplemented);

    // An oversized length prefix: error reply, then the connection closes.
    let mut stream = UnixStream::connect(&daemon.socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(&u32::MAX.to_be_bytes()).unwrap();
    let payload = frame::read_frame(&mut stream, MAX_RESPONSE_FRAME).unwrap();
    let reply = Response::decode(payload.as_slice()).unwrap();
    assert_eq!(reply.status.unwrap().reason, reason::MALFORMED_REQUEST);
    let mut rest = Vec::new();
    assert_eq!(
        stream.read_to_end(&mut rest).unwrap(),
        0,
        "connection closed"
    );

    // Half a frame then hang-up: nothing breaks.
    let mut half = UnixStream::connect(&daemon.socket).unwrap();
    half.write_all(&[0, 0, 0, 50, 1, 2]).unwrap();
    drop(half);

    let mut c = client(&daemon);
    assert_eq!(
        allocated_v4(&c.call(&allocate("after", "198.18.0.0/24")).unwrap()),
        "198.18.0.2"
    );
}

#[test]
fn concurrent_clients_get_distinct_addresses() {
    let dir = TestDir::new("wire-concurrent");
    let daemon = TestDaemon::start(&dir, &[]);
    let socket = daemon.socket.clone();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let mut c =
                    Client::connect(&socket, Duration::from_secs(2), Duration::from_secs(10))
                        .unwrap();
                (0..25)
                    .map(|i| {
                        allocated_v4(
                            &c.call(&allocate(&format!("c{t}-{i}"), "198.18.0.0/24"))
                                .unwrap(),
                        )
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all: Vec<String> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    assert_eq!(all.len(), 200);
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 200, "duplicate addresses handed out");
}

#[test]
fn sigterm_removes_socket_and_exits_zero() {
    let dir = TestDir::new("wire-sigterm");
    let daemon = TestDaemon::start(&dir, &[]);
    let socket = daemon.socket.clone();
    let status = daemon.stop();
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists());
}

#[test]
fn refuses_unsafe_socket_paths_and_bad_flags() {
    let dir = TestDir::new("wire-unsafe");
    // A symlink where the socket should go.
    let target = dir.join("elsewhere");
    std::fs::write(&target, b"").unwrap();
    std::os::unix::fs::symlink(&target, dir.join("metis.sock")).unwrap();
    let output = std::process::Command::new(common::METIS)
        .args(["daemon", "--socket-path"])
        .arg(dir.join("metis.sock"))
        .arg("--db-path")
        .arg(dir.join("metis.sqlite"))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("symbolic link"));

    for bad in [
        vec!["--no-such-flag"],
        vec!["--release-cooldown", "soon"],
        vec!["--cidr", "198.18.0.1/24"],
        vec!["--cidr", "default=198.18.0.1/24"],
        vec!["--reserve", "some"],
        vec!["--socket-path", "relative.sock"],
    ] {
        let output = std::process::Command::new(common::METIS)
            .arg("daemon")
            .args(&bad)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{bad:?}");
        assert!(!output.stderr.is_empty(), "{bad:?}");
    }
    let help = std::process::Command::new(common::METIS)
        .args(["daemon", "--help"])
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--socket-path",
        "--db-path",
        "--release-cooldown",
        "--cidr",
        "--reserve",
        "-v",
    ] {
        assert!(text.contains(flag), "help lacks {flag}");
    }
}
