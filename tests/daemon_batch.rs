//! Group commit in the daemon: requests that arrive together share one
//! transaction, each in its own savepoint. Requests are pipelined in one
//! write on one connection, so the daemon reads them in one loop turn.

use crate::common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::tmpfs::Tmpfs;
use common::{TestDaemon, TestDir, allocated_v4, node, wait_for};
use metis::wire::frame::{self, MAX_REQUEST_FRAME, MAX_RESPONSE_FRAME};
use metis::wire::{Code, Request, Response, reason, request};
use prost::Message;

const RANGE: &str = "198.18.0.0/24";

fn allocate(network: &str, container: &str, cidr: &str, requested: &str) -> Request {
    common::v4_add_requesting(network, container, cidr, requested)
}

fn frame_of(request: &Request) -> Vec<u8> {
    frame::encode(&request.encode_to_vec(), MAX_REQUEST_FRAME).unwrap()
}

/// Writes `bytes` in one write and reads `replies` responses, in order.
fn pipeline(daemon: &TestDaemon, bytes: &[u8], replies: usize) -> (UnixStream, Vec<Response>) {
    let mut stream = UnixStream::connect(&daemon.socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream.write_all(bytes).unwrap();
    let responses = (0..replies)
        .map(|_| {
            let payload = frame::read_frame(&mut stream, MAX_RESPONSE_FRAME).unwrap();
            Response::decode(payload.as_slice()).unwrap()
        })
        .collect();
    (stream, responses)
}

/// The addresses a container holds, from the database.
fn held(daemon: &TestDaemon, container: &str) -> Vec<String> {
    node::held(&daemon.db, container)
}

fn blocks_of(daemon: &TestDaemon, network: &str) -> usize {
    node::blocks(&daemon.db)
        .iter()
        .filter(|block| block.network == network)
        .count()
}

#[test]
fn a_failed_request_leaves_nothing_and_undoes_no_other() {
    let dir = TestDir::new("batch-mixed");
    let daemon = TestDaemon::start(&dir, &[]);
    let mut bytes = Vec::new();
    for request in [
        allocate("", "first", RANGE, "198.18.0.10"),
        // The same address again: refused, whatever came before it.
        allocate("", "duplicate", RANGE, "198.18.0.10"),
        // A new network whose block this request itself adds, then an
        // address outside it: the block goes with the failed request.
        allocate("other", "outside", "198.19.0.0/24", "198.19.1.5"),
        allocate("", "last", RANGE, ""),
    ] {
        bytes.extend(frame_of(&request));
    }
    // A frame longer than any request: refused, then the connection ends.
    bytes.extend(u32::try_from(MAX_REQUEST_FRAME + 1).unwrap().to_be_bytes());
    let (_stream, replies) = pipeline(&daemon, &bytes, 5);

    assert_eq!(allocated_v4(&replies[0]), "198.18.0.10");
    assert_eq!(replies[1].code(), Code::InvalidArgument, "{:?}", replies[1]);
    assert_eq!(replies[1].reason(), reason::REQUESTED_IP_UNAVAILABLE);
    assert_eq!(replies[2].code(), Code::InvalidArgument, "{:?}", replies[2]);
    assert_eq!(replies[2].reason(), reason::REQUESTED_IP_UNAVAILABLE);
    let last = allocated_v4(&replies[3]);
    assert_eq!(replies[4].reason(), reason::MALFORMED_REQUEST);

    assert_eq!(held(&daemon, "first"), ["198.18.0.10"]);
    assert_eq!(held(&daemon, "last"), [last]);
    assert!(held(&daemon, "duplicate").is_empty());
    assert!(held(&daemon, "outside").is_empty());
    assert_eq!(blocks_of(&daemon, "other"), 0);
    assert_eq!(blocks_of(&daemon, "default"), 1);
}

#[test]
fn more_requests_than_one_batch_are_all_answered_in_order() {
    let dir = TestDir::new("batch-many");
    let daemon = TestDaemon::start(&dir, &[]);
    // Beyond the loop's batch bound (64): the rest wait for the next turns.
    let ids: Vec<String> = (0..150).map(|n| format!("pod-{n}")).collect();
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|id| frame_of(&allocate("", id, RANGE, "")))
        .collect();
    let (_stream, replies) = pipeline(&daemon, &bytes, ids.len());
    let mut seen = std::collections::HashSet::new();
    for (id, reply) in ids.iter().zip(&replies) {
        let address = allocated_v4(reply);
        assert_eq!(held(&daemon, id), std::slice::from_ref(&address));
        assert!(seen.insert(address), "address handed out twice");
    }
}

/// Leaves the next commit on `fs` without room: the WAL emptied (a
/// checkpoint that truncates it, which a daemon between turns allows),
/// then the file system filled. Statements before the commit write nothing
/// to disk, so the batch's commit is the first write that fails.
fn full_at_commit(daemon: &TestDaemon, fs: &Tmpfs) -> std::path::PathBuf {
    let conn = rusqlite::Connection::open(&daemon.db).unwrap();
    let busy: i64 = conn
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))
        .unwrap();
    assert_eq!(busy, 0, "the checkpoint could not truncate the WAL");
    assert_eq!(
        std::fs::metadata(daemon.db.with_extension("sqlite-wal"))
            .unwrap()
            .len(),
        0
    );
    fs.fill("filler")
}

#[test]
fn a_failed_commit_fails_every_request_of_its_batch_and_keeps_none() {
    // Only the database on the small file system: the log must have room.
    let (dir, fs) = (
        TestDir::new("batch-commit"),
        Tmpfs::mount("batch-commit-db", "8m"),
    );
    let daemon = TestDaemon::start_on(&dir, &fs.dir.join("metis.sqlite"));
    let (_stream, warm) = pipeline(&daemon, &frame_of(&allocate("", "warm", RANGE, "")), 1);
    allocated_v4(&warm[0]);
    let filler = full_at_commit(&daemon, &fs);

    let mut bytes = Vec::new();
    bytes.extend(frame_of(&allocate("", "first", RANGE, "")));
    bytes.extend(frame_of(&allocate("", "second", RANGE, "")));
    // Not a request at all: its answer does not depend on the commit.
    bytes.extend(frame::encode(&[0xff, 0xff, 0xff], MAX_REQUEST_FRAME).unwrap());
    bytes.extend(frame_of(&allocate("", "third", RANGE, "")));
    let (_stream, replies) = pipeline(&daemon, &bytes, 4);

    for at in [0, 1, 3] {
        assert_eq!(replies[at].code(), Code::Unavailable, "{:?}", replies[at]);
        assert_eq!(replies[at].reason(), reason::STORE_UNAVAILABLE);
    }
    assert_eq!(replies[2].code(), Code::InvalidArgument);
    assert_eq!(replies[2].reason(), reason::MALFORMED_REQUEST);
    for container in ["first", "second", "third"] {
        assert!(
            held(&daemon, container).is_empty(),
            "{container} kept a row"
        );
    }
    assert!(
        daemon
            .log()
            .contains("committing a batch of requests failed")
    );

    // Once there is room, the next batch starts clean: the requests,
    // retried, succeed.
    std::fs::remove_file(filler).unwrap();
    let mut bytes = frame_of(&allocate("", "first", RANGE, ""));
    bytes.extend(frame_of(&allocate("", "third", RANGE, "")));
    let (_stream, replies) = pipeline(&daemon, &bytes, 2);
    assert_eq!(held(&daemon, "first"), [allocated_v4(&replies[0])]);
    assert_eq!(held(&daemon, "third"), [allocated_v4(&replies[1])]);
    assert!(held(&daemon, "second").is_empty());
}

#[test]
fn reads_are_served_while_another_process_holds_the_write_lock() {
    let dir = TestDir::new("batch-reads");
    let daemon = TestDaemon::start(&dir, &[]);
    let (_stream, warm) = pipeline(&daemon, &frame_of(&allocate("", "warm", RANGE, "")), 1);
    let warm = allocated_v4(&warm[0]);
    // Another process holds the write lock beyond the daemon's busy timeout.
    let holder = rusqlite::Connection::open(&daemon.db).unwrap();
    holder.execute_batch("BEGIN IMMEDIATE").unwrap();

    let health = Request {
        kind: Some(request::Kind::Health(Default::default())),
    };
    let mut bytes = frame_of(&health);
    bytes.extend(frame_of(&allocate("", "blocked", RANGE, "")));
    let (_stream, replies) = pipeline(&daemon, &bytes, 2);
    assert_eq!(replies[0].code(), Code::Ok, "{:?}", replies[0]);
    assert_eq!(replies[1].code(), Code::Unavailable, "{:?}", replies[1]);
    assert_eq!(replies[1].reason(), reason::STORE_UNAVAILABLE);

    holder.execute_batch("ROLLBACK").unwrap();
    assert_eq!(held(&daemon, "warm"), [warm]);
    assert!(held(&daemon, "blocked").is_empty());
}

/// Allocated rows as the database file alone holds them, WAL ignored.
fn allocated_in_file(path: &std::path::Path) -> i64 {
    let uri = format!("file:{}?immutable=1", path.display());
    rusqlite::Connection::open_with_flags(
        uri,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_URI,
    )
    .and_then(|conn| {
        conn.query_row(
            "SELECT COUNT(*) FROM ip_addresses WHERE container_id != ''",
            [],
            |r| r.get(0),
        )
    })
    .unwrap_or(0)
}

#[test]
fn commits_reach_the_database_file_while_the_daemon_runs_without_a_request_checkpointing() {
    let dir = TestDir::new("batch-checkpoint");
    let daemon = TestDaemon::start(&dir, &[]);
    let ids: Vec<String> = (0..20).map(|n| format!("pod-{n}")).collect();
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|id| frame_of(&allocate("", id, RANGE, "")))
        .collect();
    let (_stream, replies) = pipeline(&daemon, &bytes, ids.len());
    assert!(replies.iter().all(|r| r.code() == Code::Ok));
    // A few pages of WAL: far below any threshold a commit checkpoints at,
    // so only the daemon's checkpoint thread copies them into the file.
    wait_for(
        "the allocations in the database file",
        Duration::from_secs(20),
        || allocated_in_file(&daemon.db) == 20,
    );
    assert!(daemon.stop().success());
}
