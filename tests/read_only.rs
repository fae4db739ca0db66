//! Direct-mode STATUS and `metis admin check` on a database of every shape
//! a node may hold, through the real binary: one an earlier Metis release
//! left (its state in other tables and keys, not yet moved because no
//! writable open came since), one that is not SQLite, an empty file, and
//! one with upstream's tables only. Each gives the answer the next ADD
//! bears out, or a clear error, and neither writes to the file: a read-only
//! look may not migrate.

use crate::common;

use std::path::Path;

use common::node::{NetConf, Node, Outcome, Request};
use common::upstream::{Upstream, allocate_like_upstream};
use common::{admin_check, out_err};

/// Rewrites a database of today's Metis in the shape of the release before
/// typed state (the oldest the migration knows): `metis_blocks` without a
/// frontier column and only for blocks with sources, the IPv6 frontiers
/// and isolation as `metis_settings` keys, and none of the tables added
/// since (`metis_networks`, `metis_taken_back`, `metis_released`,
/// `metis_gateways`), nor the healed-state stamp.
fn age_to_the_oldest_shape(db: &Path) {
    rusqlite::Connection::open(db)
        .unwrap()
        .execute_batch(
            "BEGIN;
             INSERT INTO metis_settings (key, value) SELECT 'ipv6_frontier/' || b.block_id, \
               b.frontier FROM metis_blocks b JOIN cidr_blocks c ON c.id = b.block_id \
               WHERE b.frontier IS NOT NULL AND c.ip_family = 'IPv6';
             INSERT INTO metis_settings (key, value) SELECT 'isolated/' || network, '1' \
               FROM metis_networks WHERE isolated = 1;
             CREATE TABLE metis_blocks_old (block_id INTEGER PRIMARY KEY, \
               sources TEXT NOT NULL DEFAULT '', retired INTEGER NOT NULL DEFAULT 0, quarantine TEXT);
             INSERT INTO metis_blocks_old SELECT block_id, sources, retired, quarantine \
               FROM metis_blocks WHERE sources IS NOT NULL;
             DROP TABLE metis_blocks;
             ALTER TABLE metis_blocks_old RENAME TO metis_blocks;
             DROP TABLE metis_networks;
             DROP TABLE metis_taken_back;
             DROP TABLE metis_released;
             DROP TABLE metis_gateways;
             DELETE FROM metis_settings WHERE key = 'healed_state';
             COMMIT;",
        )
        .unwrap();
}

/// The database file's bytes, and the length of its WAL (SQLite may leave
/// an empty one beside a file a reader opened).
fn snapshot(db: &Path) -> (Vec<u8>, u64) {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    let wal_len = std::fs::metadata(Path::new(&wal)).map_or(0, |m| m.len());
    (std::fs::read(db).unwrap(), wal_len)
}

/// The text no answer may carry: SQLite's own words about the schema.
fn no_sql_error(text: &str) {
    for sqlite_says in ["no such column", "no such table", "SQL logic"] {
        assert!(!text.contains(sqlite_says), "{text}");
    }
}

/// A node whose database the first releases of typed state would have
/// written: STATUS in direct mode reads it as the next writable open will
/// (the isolation its key records refuses a conflist that drops
/// `isolated`, as that ADD is refused), `admin check` names what is left
/// to move, and neither changes a byte; after one ADD moved it, the same
/// STATUS answers the same, and the pool's last address is honoured.
#[test]
fn status_in_direct_mode_reads_an_earlier_releases_database_as_its_next_open_will() {
    let node = Node::new("read-only-earlier", "0s");
    let db = node.db_path();
    let pods = NetConf::new("pods", &["198.18.90.0/29"]);
    let pods6 = NetConf::new("pods6", &["2001:db8:90::/120"]);
    let y = NetConf::new("net-y", &["198.18.91.0/28"]);
    let x = NetConf {
        isolated: true,
        ..NetConf::new("net-x", &["198.18.91.0/28"])
    };
    let plain_x = NetConf {
        isolated: false,
        ..x.clone()
    };
    // .2 to .6 of the /29: four taken, one left.
    for (conf, pod) in [
        (&pods, "p1"),
        (&pods, "p2"),
        (&pods, "p3"),
        (&pods, "p4"),
        (&pods6, "v1"),
        (&y, "y1"),
        (&x, "x1"),
    ] {
        match node.add(conf, pod, Request::None) {
            Outcome::Ok(_) => {}
            other => panic!("ADD {pod}: {other:?}"),
        }
    }
    age_to_the_oldest_shape(&db);
    let before = snapshot(&db);

    let answers = || {
        let answers: Vec<Result<(), (u64, String)>> = [&pods, &pods6, &x, &plain_x, &y]
            .iter()
            .map(|conf| node.status(conf))
            .collect();
        for answer in &answers {
            if let Err((_, msg)) = answer {
                no_sql_error(msg);
            }
        }
        answers
    };
    let unmoved = answers();
    assert_eq!(unmoved[..3], [Ok(()), Ok(()), Ok(())]);
    assert_eq!(unmoved[4], Ok(()));
    // Isolation lives in the `isolated/net-x` key: dropping it is refused.
    match &unmoved[3] {
        Err((50, msg)) => assert!(
            msg.contains("overlaps block 198.18.91.0/28 of network \\\"net-y\\\""),
            "{msg}"
        ),
        other => panic!("STATUS of net-x without isolated: {other:?}"),
    }
    let check = admin_check(&db);
    let (out, err) = out_err(&check);
    no_sql_error(&out);
    no_sql_error(&err);
    assert_eq!(check.status.code(), Some(1), "{out}{err}");
    assert!(out.contains("metis_blocks has no frontier column"), "{out}");
    assert!(out.contains("metis_settings holds 1 isolated/"), "{out}");
    assert_eq!(snapshot(&db), before, "a read-only look wrote");

    // The ADD the STATUS promised moves the file and takes the last one.
    match node.add(&pods, "p5", Request::None) {
        Outcome::Ok(ips) => assert_eq!(ips, ["198.18.90.6/29"]),
        other => panic!("ADD p5: {other:?}"),
    }
    assert_eq!(node.add(&plain_x, "x2", Request::None).code(), Some(7));
    let check = admin_check(&db);
    assert!(check.status.success(), "{:?}", out_err(&check));
    let moved = answers();
    assert_eq!(moved[1..], unmoved[1..], "the move changed an answer");
    match &moved[0] {
        Err((50, msg)) => assert!(msg.contains("pods"), "{msg}"),
        other => panic!("STATUS of a full pool: {other:?}"),
    }
}

/// A file at the database path that is not SQLite, an empty one and one
/// with upstream's tables only: STATUS in direct mode and `admin check`
/// each give a clear answer and leave the file as it was. Not SQLite:
/// both name the file as no database (and ADD refuses it too, writing
/// nothing). Empty: ready, as the ADD that then creates the schema in it
/// bears out. Upstream's: ready while its block has room, not once its
/// writer took the last address.
#[test]
fn status_and_check_on_a_file_no_metis_wrote_answer_clearly_and_write_nothing() {
    let pods = NetConf::new("pods", &["198.18.92.0/29"]);

    let node = Node::new("read-only-garbage", "0s");
    let db = node.db_path();
    let garbage: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&db, &garbage).unwrap();
    match node.status(&pods) {
        Err((50, msg)) => {
            assert!(msg.contains("file is not a database"), "{msg}");
            assert!(msg.contains(&db.display().to_string()), "{msg}");
        }
        other => panic!("STATUS on a file that is not SQLite: {other:?}"),
    }
    let check = admin_check(&db);
    let (out, err) = out_err(&check);
    assert!(!check.status.success(), "{out}{err}");
    assert!(err.contains("file is not a database"), "{out}{err}");
    match node.add(&pods, "p1", Request::None) {
        Outcome::Error { msg, .. } => assert!(msg.contains("not a database"), "{msg}"),
        other => panic!("ADD on a file that is not SQLite: {other:?}"),
    }
    assert_eq!(std::fs::read(&db).unwrap(), garbage, "the file was written");

    let node = Node::new("read-only-empty", "0s");
    let db = node.db_path();
    std::fs::write(&db, b"").unwrap();
    assert_eq!(node.status(&pods), Ok(()));
    let check = admin_check(&db);
    let (out, err) = out_err(&check);
    assert_eq!(check.status.code(), Some(1), "{out}{err}");
    assert!(out.contains("user_version is 0"), "{out}");
    assert_eq!(
        std::fs::metadata(&db).unwrap().len(),
        0,
        "the file was written"
    );
    match node.add(&pods, "p1", Request::None) {
        Outcome::Ok(ips) => assert_eq!(ips, ["198.18.92.2/29"]),
        other => panic!("ADD on an empty file: {other:?}"),
    }

    let node = Node::new("read-only-upstream", "0s");
    let db = node.db_path();
    Upstream::create(&db)
        .add_cidr("pods", "198.18.92.0/29")
        .unwrap();
    for pod in ["u1", "u2", "u3", "u4"] {
        assert!(allocate_like_upstream(&db, "pods", "ipv4", pod).is_some());
    }
    let before = snapshot(&db);
    assert_eq!(node.status(&pods), Ok(()));
    let check = admin_check(&db);
    let (out, err) = out_err(&check);
    no_sql_error(&out);
    no_sql_error(&err);
    assert!(check.status.success(), "{out}{err}");
    assert_eq!(snapshot(&db), before, "a read-only look wrote");
    assert_eq!(
        allocate_like_upstream(&db, "pods", "ipv4", "u5").as_deref(),
        Some("198.18.92.6")
    );
    match node.status(&pods) {
        Err((50, msg)) => no_sql_error(&msg),
        other => panic!("STATUS of upstream's full block: {other:?}"),
    }
    match node.add(&pods, "p1", Request::None) {
        Outcome::Error { code: 11, .. } => {}
        other => panic!("ADD on upstream's full block: {other:?}"),
    }
}
