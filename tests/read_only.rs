//! Direct-mode STATUS and `metis admin check` on a database of every shape
//! a node may hold, through the real binary: one that is not SQLite, an
//! empty file, and one with upstream's tables only. Each gives the answer
//! the next ADD bears out, or a clear error, and neither writes to the
//! file: a read-only look may not create anything.

use crate::common;

use std::path::Path;

use common::node::{NetConf, Node, Outcome, Request};
use common::upstream::{Upstream, allocate_like_upstream};
use common::{admin_check, out_err};

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
