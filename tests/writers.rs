//! Issue 21 through the real binary, in daemon and in direct mode: a
//! configuration change that would give one address two owners is refused
//! and changes nothing.

use crate::common;

use common::node::{NetConf, Node, Outcome, Request, held_twice};

/// Network Y holds a /28; an isolated network X reuses it; X's conflist
/// then drops `isolated`: X's ADD is refused with code 7 naming Y and the
/// way out, X stays isolated, and Y never gets an address X holds.
#[test]
fn isolation_turned_off_over_a_live_overlap_is_refused() {
    for daemon in [true, false] {
        let mut node = Node::new("writers-isolation", "1m");
        if daemon {
            node.start(&[]);
        }
        let y = NetConf::new("net-y", &["198.18.70.0/28"]);
        let x = NetConf {
            isolated: true,
            ..NetConf::new("net-x", &["198.18.70.0/28"])
        };
        let plain_x = NetConf {
            isolated: false,
            ..x.clone()
        };
        assert!(matches!(node.add(&y, "y1", Request::None), Outcome::Ok(_)));
        assert!(matches!(node.add(&x, "x1", Request::None), Outcome::Ok(_)));
        let before = node.holdings();
        match node.add(&plain_x, "x2", Request::None) {
            Outcome::Error { code: 7, msg } => {
                assert!(msg.contains("net-y") && msg.contains("isolated"), "{msg}");
            }
            other => panic!("daemon {daemon}: expected code 7, got {other:?}"),
        }
        assert_eq!(
            node.holdings(),
            before,
            "daemon {daemon}: the refusal changed rows"
        );
        // Y goes on serving addresses only Y holds; X keeps its own space.
        for pod in ["y2", "y3"] {
            assert!(matches!(node.add(&y, pod, Request::None), Outcome::Ok(_)));
        }
        assert!(matches!(node.add(&x, "x3", Request::None), Outcome::Ok(_)));
        let twice = held_twice(&node.holdings(), |h| h.network != "net-x");
        assert!(twice.is_empty(), "daemon {daemon}: {twice:#?}");
        // A restart finds nothing to quarantine: isolation was never lost.
        if daemon {
            node.stop();
            node.start(&[]);
        }
        assert!(matches!(node.add(&y, "y4", Request::None), Outcome::Ok(_)));
        assert!(
            !node.log().contains("block quarantined"),
            "daemon {daemon}: {}",
            node.log()
        );
    }
}
