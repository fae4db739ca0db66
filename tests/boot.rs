//! Reboot-aware leak recovery through the real daemon, with the boot id
//! faked by `METIS_BOOT_ID_FILE`: a new boot id releases the previous
//! boot's allocations (with the cooldown) before serving, once;
//! `--no-boot-recovery` keeps them.

use crate::common;

use common::{Plugin, TestDaemon, TestDir, assert_ok, conf, db, json};

const V4: &str = r#"[[{"subnet":"198.18.0.0/24"}]]"#;

struct Node {
    dir: TestDir,
    boot_id: std::path::PathBuf,
}

impl Node {
    fn new() -> Node {
        let dir = TestDir::new("boot");
        let boot_id = dir.join("boot_id");
        Node { dir, boot_id }
    }

    /// Starts the daemon as if the machine had booted with `id`.
    fn boot(&self, id: &str, extra: &[&str]) -> TestDaemon {
        std::fs::write(&self.boot_id, format!("{id}\n")).unwrap();
        let file = self.boot_id.to_str().unwrap();
        TestDaemon::start_with_env(&self.dir, extra, &[("METIS_BOOT_ID_FILE", file)])
    }

    fn add(&self, container: &str) -> String {
        let output = Plugin::new("ADD", container).run(&conf(&self.dir, "1.0.0", V4, ""));
        assert_ok(&output);
        json(&output)["ips"][0]["address"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// (allocated, cooling down) rows of `container`.
    fn rows(&self, container: &str) -> (i64, i64) {
        db(&self.dir.join("metis.sqlite"))
            .query_row(
                "SELECT COALESCE(SUM(is_allocated = 1), 0), \
                        COALESCE(SUM(is_allocated = 0 AND release_at IS NOT NULL), 0) \
                 FROM ip_addresses WHERE container_id = ?1",
                [container],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
    }
}

#[test]
fn a_new_boot_releases_the_previous_boots_addresses_once() {
    let node = Node::new();
    let first = node.boot("boot-1", &[]);
    let a = node.add("a");
    let b = node.add("b");
    assert!(first.stop().success());

    // Reboot: both pods are gone, their addresses rest, then come back.
    let second = node.boot("boot-2", &[]);
    let log = second.log();
    assert!(
        log.contains("released the allocations of the previous boot") && log.contains("released=2"),
        "{log}"
    );
    assert_eq!(node.rows("a"), (0, 1));
    assert_eq!(node.rows("b"), (0, 1));
    let c = node.add("c");
    assert!(c != a && c != b, "{c} was handed out during its cooldown");
    // A daemon restart within the same boot releases nothing.
    assert!(second.stop().success());
    let again = node.boot("boot-2", &[]);
    assert_eq!(node.rows("c"), (1, 0));
    assert_eq!(again.log().matches("released=").count(), 1);
    drop(again);

    // Disabled: the next boot keeps what it finds.
    let kept = node.boot("boot-3", &["--no-boot-recovery"]);
    assert!(
        kept.log()
            .contains("keeping the previous boot's allocations")
    );
    assert_eq!(node.rows("c"), (1, 0));
    drop(kept);
    // An unreadable boot id releases nothing, and says so.
    std::fs::remove_file(&node.boot_id).unwrap();
    let file = node.boot_id.to_str().unwrap();
    let blind = TestDaemon::start_with_env(&node.dir, &[], &[("METIS_BOOT_ID_FILE", file)]);
    assert!(blind.log().contains("cannot read the boot id"));
    assert_eq!(node.rows("c"), (1, 0));
}
