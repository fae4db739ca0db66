//! Big blocks through the real binary: adding one is constant work (other
//! networks' ADDs go on), an answer its client never read is recoverable,
//! and a restart after a clean stop checks blocks, not every address row.
//! How long each takes is measured by `make bench`, not asserted here.

use crate::common;

use std::time::Duration;

use common::{Plugin, TestDaemon, TestDir, assert_ok, db, json, metis, node, wait_for};
use metis::wire::frame::{self, MAX_REQUEST_FRAME};
use prost::Message;

/// A configuration of network `name` over one IPv4 subnet.
fn net(dir: &TestDir, name: &str, subnet: &str, isolated: bool) -> String {
    format!(
        r#"{{"cniVersion":"1.1.0","name":"{name}","type":"metis","ipam":{{"type":"metis","ranges":[[{{"subnet":"{subnet}"}}]],"isolated":{isolated},"daemonSocket":"{}","dbPath":"{}","logFile":"{}"}}}}"#,
        dir.join("metis.sock").display(),
        dir.join("metis.sqlite").display(),
        dir.join("cni.log").display(),
    )
}

fn address(output: &std::process::Output) -> String {
    assert_ok(output);
    json(output)["ips"][0]["address"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn small_adds_in_another_network_succeed_while_big_blocks_are_added() {
    let dir = TestDir::new("big-add");
    let daemon = TestDaemon::start(&dir, &[]);
    // Eight first ADDs, each adding a /15 (the largest prefix tests may
    // use) in its own network, race twenty ADDs of a small network.
    let big: Vec<_> = (0..8)
        .map(|n| {
            let conf = net(&dir, &format!("big{n}"), "198.18.0.0/15", true);
            std::thread::spawn(move || address(&Plugin::new("ADD", &format!("big-{n}")).run(&conf)))
        })
        .collect();
    let small_conf = net(&dir, "small", "198.18.0.0/24", false);
    let small: Vec<_> = (0..20)
        .map(|n| {
            let conf = small_conf.clone();
            std::thread::spawn(move || {
                address(&Plugin::new("ADD", &format!("small-{n}")).run(&conf))
            })
        })
        .collect();
    for handle in big {
        assert_eq!(handle.join().unwrap(), "198.18.0.2/15");
    }
    let mut got: Vec<String> = small.into_iter().map(|h| h.join().unwrap()).collect();
    got.sort();
    got.dedup();
    assert_eq!(got.len(), 20);
    // Each /15 holds its first batch and its reserved last address: what
    // was written does not depend on the block's size.
    let conn = db(&daemon.db);
    let rows: Vec<(String, i64, i64, i64)> = conn
        .prepare(
            "SELECT b.network, b.total_ips, b.allocated_ips, COUNT(a.id) FROM cidr_blocks b \
             JOIN ip_addresses a ON a.cidr_block_id = b.id \
             WHERE b.network LIKE 'big%' GROUP BY b.id ORDER BY b.network",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(rows.len(), 8);
    for (network, total, allocated, count) in rows {
        assert_eq!((total, allocated, count), (131_072, 4, 65), "{network}");
    }
    assert!(daemon.stop().success());
}

/// An ADD sent straight to the daemon by a client that hangs up before
/// reading the answer, as a plugin whose deadline passed does.
fn add_and_hang_up(daemon: &TestDaemon, container: &str) {
    let request = common::v4_add_request("late", container, "198.18.0.0/24");
    let mut stream = std::os::unix::net::UnixStream::connect(&daemon.socket).unwrap();
    frame::write_frame(&mut stream, &request.encode_to_vec(), MAX_REQUEST_FRAME).unwrap();
}

/// The first address `container` holds, from the database.
fn held(daemon: &TestDaemon, container: &str) -> Option<String> {
    node::held(&daemon.db, container).into_iter().next()
}

#[test]
fn an_answer_its_client_never_read_is_returned_by_a_retry_and_released_by_del() {
    let dir = TestDir::new("big-late");
    let daemon = TestDaemon::start(&dir, &["--release-cooldown", "0s"]);
    let conf = net(&dir, "late", "198.18.0.0/24", false);
    add_and_hang_up(&daemon, "gone");
    wait_for("the unread ADD to commit", Duration::from_secs(10), || {
        held(&daemon, "gone").is_some()
    });
    assert_eq!(held(&daemon, "gone").as_deref(), Some("198.18.0.2"));
    // The runtime retries: the same address, nothing new taken.
    let retried = Plugin::new("ADD", "gone").run(&conf);
    assert_eq!(address(&retried), "198.18.0.2/24");
    assert_eq!(
        address(&Plugin::new("ADD", "next").run(&conf)),
        "198.18.0.3/24"
    );
    // Or it gives up and deletes: the address is free again.
    add_and_hang_up(&daemon, "abandoned");
    wait_for("the second unread ADD", Duration::from_secs(10), || {
        held(&daemon, "abandoned").is_some()
    });
    assert_ok(&Plugin::new("DEL", "abandoned").run(&conf));
    assert_eq!(held(&daemon, "abandoned"), None);
    assert_eq!(
        address(&Plugin::new("ADD", "after").run(&conf)),
        "198.18.0.4/24"
    );
    assert!(daemon.stop().success());
}

fn healthy(dir: &TestDir) {
    let socket = dir.join("metis.sock");
    assert_ok(&metis(&[
        "health",
        "--socket-path",
        socket.to_str().unwrap(),
    ]));
}

#[test]
fn a_restart_after_a_clean_stop_reads_no_address_row() {
    let dir = TestDir::new("big-restart");
    let flags = ["--cidr", "pods=198.18.0.0/15"];
    let conf = net(&dir, "pods", "198.18.0.0/15", false);
    let daemon = TestDaemon::start(&dir, &flags);
    for n in 0..100 {
        address(&Plugin::new("ADD", &format!("pod-{n}")).run(&conf));
    }
    let rows: i64 = db(&daemon.db)
        .query_row("SELECT COUNT(*) FROM ip_addresses", [], |r| r.get(0))
        .unwrap();
    let rows = u64::try_from(rows).unwrap();
    assert!(daemon.stop().success());

    // As the daemon left it: health answers after a check of blocks only.
    let daemon = TestDaemon::start(&dir, &flags);
    healthy(&dir);
    assert_eq!(daemon.last_start_check(), ("blocks".to_string(), 0));
    assert!(daemon.stop().success());

    // Written behind its back (upstream allocating): every row is read.
    rusqlite::Connection::open(dir.join("metis.sqlite"))
        .unwrap()
        .execute_batch(
            "UPDATE ip_addresses SET is_allocated = 1, container_id = 'up', interface_name = 'eth0' \
             WHERE id = (SELECT MAX(id) FROM ip_addresses WHERE is_allocated = 0); \
             UPDATE cidr_blocks SET allocated_ips = allocated_ips + 1",
        )
        .unwrap();
    let daemon = TestDaemon::start(&dir, &flags);
    healthy(&dir);
    assert_eq!(daemon.last_start_check(), ("rows".to_string(), rows));

    // A crash leaves no marker: the next start reads the rows again, those
    // written since the last sound check one by one (here all of them:
    // written within the last minute).
    drop(daemon);
    let daemon = TestDaemon::start(&dir, &flags);
    healthy(&dir);
    assert_eq!(daemon.last_start_check(), ("changed".to_string(), rows));
    assert_ok(&common::admin_check(&daemon.db));
    assert!(daemon.stop().success());
}
