//! Issue 21, many writers: plugins in direct mode (no daemon, or one that
//! restarts under them) with conflicting conflists for one network decide
//! each ADD in one write transaction, and every address they hand out is
//! checked against the conflist that ADD was given, whatever rows another
//! writer left in the database. Real binary, parallel processes.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};

use crate::common;

use common::node::{Block, Node, held_twice, number, strip_prefix};
use common::{Plugin, TestDaemon, TestDir};

/// The network every conflist of these tests names (`ipam.network`).
const NETWORK: &str = "shared";

/// One range of a conflist, as host-local spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    subnet: &'static str,
    start: Option<&'static str>,
    end: Option<&'static str>,
    gateway: Option<&'static str>,
}

impl Range {
    fn subnet(subnet: &'static str) -> Range {
        Range {
            subnet,
            start: None,
            end: None,
            gateway: None,
        }
    }

    fn bounded(subnet: &'static str, start: &'static str, end: &'static str) -> Range {
        Range {
            start: Some(start),
            end: Some(end),
            ..Range::subnet(subnet)
        }
    }

    fn block(self) -> Block {
        Block::parse(self.subnet)
    }

    /// The gateway a result names: the configured one, else the subnet's
    /// first address.
    fn gateway(self) -> IpAddr {
        self.gateway
            .map_or_else(|| self.block().nth(1), |g| g.parse().unwrap())
    }

    /// Whether Metis may hand `ip` out under this range: inside the
    /// subnet and `rangeStart`..`rangeEnd` (host-local's defaults), not the
    /// gateway, and not a reserved address when no bound is set.
    fn admits(self, ip: IpAddr) -> bool {
        let block = self.block();
        let bounded = self.start.is_some() || self.end.is_some() || self.gateway.is_some();
        let start = self
            .start
            .map_or(block.base + 1, |s| number(s.parse().unwrap()));
        let end = self.end.map_or(block.base + block.size() - 2, |e| {
            number(e.parse().unwrap())
        });
        block.contains(ip)
            && (start..=end).contains(&number(ip))
            && ip != self.gateway()
            && (bounded || !block.reserves(ip))
    }

    fn to_json(self) -> Value {
        let mut range = json!({"subnet": self.subnet});
        for (key, value) in [
            ("rangeStart", self.start),
            ("rangeEnd", self.end),
            ("gateway", self.gateway),
        ] {
            if let Some(value) = value {
                range[key] = json!(value);
            }
        }
        range
    }
}

/// A conflist for network [`NETWORK`] on the node in `dir` with one IPv4
/// range.
fn conflist(dir: &TestDir, name: &str, range: Range) -> String {
    json!({
        "cniVersion": "1.0.0",
        "name": name,
        "type": "metis",
        "ipam": {
            "type": "metis",
            "network": NETWORK,
            "ranges": [[range.to_json()]],
            "daemonSocket": dir.join("metis.sock"),
            "dbPath": dir.join("metis.sqlite"),
            "logFile": dir.join("cni.log"),
        },
    })
    .to_string()
}

/// What one ADD answered: the result, or the error's code and message.
type Answer = Result<Value, (u64, String)>;

fn add(config: &str, container: &str, args: &str) -> Answer {
    let plugin = Plugin {
        args,
        ..Plugin::new("ADD", container)
    };
    let output = plugin.run(config);
    let parsed: Value =
        serde_json::from_slice(&output.stdout).unwrap_or_else(|err| panic!("{err}: {output:?}"));
    if output.status.success() {
        Ok(parsed)
    } else {
        Err((
            parsed["code"].as_u64().unwrap_or_default(),
            format!("{} {}", parsed["msg"], parsed["details"]),
        ))
    }
}

/// One ADD of a burst: the range the conflist it was given had, its
/// container, and its answer.
struct Done {
    range: Range,
    container: String,
    answer: Answer,
}

/// `threads` parallel plugin loops of `per_thread` ADDs each; `pick` gives
/// the range of the conflist the ADD number `n` (in start order) is given,
/// as a runtime reads the conflist file at each ADD.
fn burst(
    dir: &TestDir,
    threads: usize,
    per_thread: usize,
    pick: &(dyn Fn(usize) -> Range + Sync),
) -> Vec<Done> {
    burst_counting(dir, threads, per_thread, pick, &AtomicUsize::new(0))
}

/// [`burst`], counting the ADDs answered in `finished`.
fn burst_counting(
    dir: &TestDir,
    threads: usize,
    per_thread: usize,
    pick: &(dyn Fn(usize) -> Range + Sync),
    finished: &AtomicUsize,
) -> Vec<Done> {
    let started = AtomicUsize::new(0);
    let done = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let (started, done) = (&started, &done);
            scope.spawn(move || {
                for i in 0..per_thread {
                    let range = pick(started.fetch_add(1, Ordering::SeqCst));
                    let container = format!("burst-{thread}-{i}");
                    let answer = add(
                        &conflist(
                            dir,
                            &format!("conf-{}", range.subnet.replace('/', "-")),
                            range,
                        ),
                        &container,
                        "K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod",
                    );
                    done.lock().unwrap().push(Done {
                        range,
                        container,
                        answer,
                    });
                    finished.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    done.into_inner().unwrap()
}

/// The first law after a burst: every address handed out lies in the range
/// of the conflist its ADD was given, is not the gateway its result names
/// (that conflist's, or a stand-in while a pod holds it), is held by its
/// container alone, and no ADD failed on a UNIQUE constraint. Returns the
/// failures (code, message).
fn assert_first_law(node: &Node, done: &[Done]) -> Vec<(u64, String)> {
    let holdings = node.holdings();
    let twice = held_twice(&holdings, |_| true);
    assert!(twice.is_empty(), "held twice: {twice:?}");
    let mut failures = Vec::new();
    for Done {
        range,
        container,
        answer,
    } in done
    {
        let result = match answer {
            Ok(result) => result,
            Err((code, msg)) => {
                assert!(!msg.contains("UNIQUE"), "{container}: {code} {msg}");
                failures.push((*code, msg.clone()));
                continue;
            }
        };
        let ip = &result["ips"][0];
        let address = strip_prefix(ip["address"].as_str().unwrap());
        let gateway: IpAddr = ip["gateway"].as_str().unwrap().parse().unwrap();
        assert!(
            range.admits(address),
            "{container} got {address} outside its conflist's {range:?}: {result}"
        );
        // The conflist's gateway, or a stand-in while a pod holds it.
        let conflists = range.gateway();
        assert!(
            gateway == conflists || holdings.iter().any(|h| h.address == conflists),
            "{container}: {result}"
        );
        assert_ne!(address, gateway, "{container}: {result}");
        let held: Vec<IpAddr> = holdings
            .iter()
            .filter(|h| h.container == *container)
            .map(|h| h.address)
            .collect();
        assert_eq!(held, [address], "{container}: {result}");
    }
    failures
}

/// Two conflists for one `ipam.network`, 16 plugins in parallel in direct
/// mode, each ADD alternating between them: once with one subnet and
/// another, once with one subnet and disjoint `rangeStart`..`rangeEnd`.
#[test]
fn two_conflists_for_one_network_never_hand_out_each_others_range() {
    let cases = [
        [
            Range::subnet("198.18.160.0/25"),
            Range::subnet("198.18.161.0/25"),
        ],
        [
            Range::bounded("198.18.162.0/24", "198.18.162.10", "198.18.162.119"),
            Range::bounded("198.18.162.0/24", "198.18.162.130", "198.18.162.239"),
        ],
    ];
    for ranges in cases {
        let node = Node::new("direct-two-conflists", "0s");
        let done = burst(&node.dir, 16, 12, &|n| ranges[n % 2]);
        assert_eq!(done.len(), 192);
        let failures = assert_first_law(&node, &done);
        assert!(failures.is_empty(), "{ranges:?}: {failures:?}");
        for range in ranges {
            let served = done.iter().filter(|d| d.range == range).count();
            assert_eq!(served, 96, "{range:?}");
        }
    }
}

/// The conflist file is rewritten twice during a burst (its range moved
/// to another subnet and back): every ADD's address lies in the range of
/// the conflist that ADD read.
#[test]
fn a_range_moved_mid_burst_hands_out_only_the_range_each_add_read() {
    let node = Node::new("direct-moved", "0s");
    let (before, after) = (
        Range::subnet("198.18.164.0/24"),
        Range::bounded("198.18.165.0/24", "198.18.165.20", "198.18.165.200"),
    );
    // The file as the runtime reads it: moved after the 60th ADD started,
    // back after the 130th.
    let pick = |n: usize| {
        if (60..130).contains(&n) {
            after
        } else {
            before
        }
    };
    let done = burst(&node.dir, 16, 12, &pick);
    let failures = assert_first_law(&node, &done);
    assert!(failures.is_empty(), "{failures:?}");
    assert!(done.iter().any(|d| d.range == after));
    assert!(done.iter().any(|d| d.range == before));
}

/// Two conflists on one subnet with different gateways, in parallel: no
/// result's address is the gateway that result names, no result names a
/// gateway a pod holds — once a pod of one holds the other's gateway, the
/// other's results name a stand-in (a result naming it would make the host
/// take that pod's address).
#[test]
fn two_gateways_on_one_subnet_never_hand_out_the_gateway_in_force() {
    let node = Node::new("direct-gateways", "0s");
    let ranges = [
        Range {
            gateway: Some("198.18.166.2"),
            ..Range::subnet("198.18.166.0/24")
        },
        Range {
            gateway: Some("198.18.166.3"),
            ..Range::subnet("198.18.166.0/24")
        },
    ];
    let done = burst(&node.dir, 16, 12, &|n| ranges[n % 2]);
    assert_no_gateway_is_a_pods(&node, &done, &ranges);
}

/// Two conflists of one network on one subnet, one with the computed
/// gateway (.1, which the other hands out as an ordinary address), one
/// with `gateway` .6, ADDs alternating among 16 parallel plugins — in
/// direct mode, then all through the daemon: the same invariants
/// (`metis_gateways` keeps each live result's gateway from every later
/// hand-out).
#[test]
fn a_computed_and_an_explicit_gateway_are_never_a_pods_address_in_either_mode() {
    for (subnet, gateway, daemon) in [
        ("198.18.174.0/24", "198.18.174.6", false),
        ("198.18.175.0/24", "198.18.175.6", true),
    ] {
        let node = Node::new("direct-named-gateways", "0s");
        let ranges = [
            Range::subnet(subnet),
            Range {
                gateway: Some(gateway),
                ..Range::subnet(subnet)
            },
        ];
        let running = daemon.then(|| TestDaemon::start(&node.dir, &["--release-cooldown", "0s"]));
        let done = burst(&node.dir, 16, 12, &|n| ranges[n % 2]);
        if let Some(running) = running {
            running.stop();
        }
        let log = std::fs::read_to_string(node.dir.join("cni.log")).unwrap_or_default();
        let direct = log.matches("using direct mode").count();
        if daemon {
            assert_eq!(direct, 0, "every ADD through the daemon");
        } else {
            assert_eq!(direct, done.len(), "every ADD in direct mode");
        }
        assert_no_gateway_is_a_pods(&node, &done, &ranges);
    }
}

/// [`assert_first_law`], and every pair: no result names as its gateway
/// an address a pod holds (every ADD's pod still lives), some ADD was
/// served, and every refusal is code 11 naming one of `ranges`' gateways,
/// which a pod holds (with no address left to stand in).
fn assert_no_gateway_is_a_pods(node: &Node, done: &[Done], ranges: &[Range]) {
    let failures = assert_first_law(node, done);
    assert!(failures.len() < done.len(), "nothing served: {failures:?}");
    let holdings = node.holdings();
    for Done {
        container, answer, ..
    } in done
    {
        let Ok(result) = answer else { continue };
        let gateway: IpAddr = result["ips"][0]["gateway"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let holder = holdings.iter().find(|h| h.address == gateway);
        assert!(
            holder.is_none(),
            "{container}'s result names gateway {gateway}, which {holder:?} holds"
        );
    }
    let held: Vec<IpAddr> = holdings.iter().map(|h| h.address).collect();
    for (code, msg) in &failures {
        assert_eq!(*code, 11, "{msg}");
        let named = ranges
            .iter()
            .map(|r| r.gateway())
            .find(|g| msg.contains(&format!("its gateway {g} is held")));
        assert!(
            named.is_some_and(|g| held.contains(&g)),
            "a refusal must name a gateway a pod holds: {msg}"
        );
    }
}

/// The same invariants while a daemon is restarted under the burst
/// (SIGTERM and SIGKILL in turn, each after another 30 ADDs finished, the
/// next started only after a pause of another 10): some ADDs are served by
/// the daemon, the others in direct mode, with two conflists for one
/// network alternating.
#[test]
fn a_daemon_restarting_during_the_burst_keeps_the_first_law() {
    let node = Node::new("direct-restarts", "0s");
    let ranges = [
        Range::subnet("198.18.167.0/25"),
        Range::bounded("198.18.168.0/24", "198.18.168.5", "198.18.168.250"),
    ];
    const ADDS: usize = 16 * 12;
    let finished = AtomicUsize::new(0);
    let kills = AtomicUsize::new(0);
    let done = std::thread::scope(|scope| {
        scope.spawn(|| {
            let args = ["--release-cooldown", "0s"];
            let reached = |count: usize| {
                common::wait_for("the burst", std::time::Duration::from_secs(120), || {
                    finished.load(Ordering::SeqCst) >= count.min(ADDS)
                });
            };
            for round in 0..4 {
                let mut daemon = TestDaemon::start(&node.dir, &args);
                reached(round * 40 + 30);
                if round % 2 == 0 {
                    daemon.stop();
                } else {
                    kills.fetch_add(1, Ordering::SeqCst);
                    daemon.child.kill().unwrap();
                    daemon.child.wait().unwrap();
                }
                reached(round * 40 + 40);
            }
        });
        burst_counting(&node.dir, 16, 12, &|n| ranges[n % 2], &finished)
    });
    let failures = assert_first_law(&node, &done);
    // A plugin whose daemon was SIGKILLed after it sent its request is
    // told to retry (code 11): the only failure allowed.
    assert!(
        failures
            .iter()
            .all(|(code, msg)| *code == 11 && msg.contains("no response")),
        "{failures:?}"
    );
    assert!(
        failures.len() <= 16 * kills.load(Ordering::SeqCst),
        "{failures:?}"
    );
    let log = std::fs::read_to_string(node.dir.join("cni.log")).unwrap();
    let direct = log.matches("using direct mode").count();
    assert!(
        direct > 0 && direct < done.len(),
        "{direct} of {} direct",
        done.len()
    );
}

/// Every row of every table of the database at `path`, sorted.
fn every_row(path: &std::path::Path) -> BTreeMap<String, Vec<String>> {
    let conn = common::db(path);
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    tables
        .into_iter()
        .map(|table| {
            let mut stmt = conn.prepare(&format!("SELECT * FROM \"{table}\"")).unwrap();
            let columns = stmt.column_count();
            let mut rows: Vec<String> = stmt
                .query_map([], |r| {
                    Ok((0..columns)
                        .map(|i| format!("{:?}", r.get_ref(i).unwrap()))
                        .collect::<Vec<_>>()
                        .join("|"))
                })
                .unwrap()
                .map(Result::unwrap)
                .collect();
            rows.sort();
            (table, rows)
        })
        .collect()
}

/// An ADD that fails (code 100) after it laid the network out anew (its
/// IPv4 range moved, so a block is added and the old one retired) and
/// took its IPv4 address leaves every row of every table as it was — in
/// direct mode and through the daemon alike.
#[test]
fn a_failed_add_after_its_layout_step_leaves_every_row_as_it_was() {
    for daemon in [false, true] {
        let mut node = Node::served("direct-failed-add", "0s", daemon);
        let dual = |v4: &str| {
            json!({
                "cniVersion": "1.0.0",
                "name": "dual",
                "type": "metis",
                "ipam": {
                    "type": "metis",
                    "network": NETWORK,
                    "ranges": [[{"subnet": v4}], [{"subnet": "2001:db8:180::/120"}]],
                    "daemonSocket": node.dir.join("metis.sock"),
                    "dbPath": node.dir.join("metis.sqlite"),
                    "logFile": node.dir.join("cni.log"),
                },
            })
            .to_string()
        };
        let asking = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod;IP=2001:db8:180::10";
        let first = add(&dual("198.18.180.0/28"), "holder", asking).unwrap();
        assert!(first.to_string().contains("2001:db8:180::10"), "{first}");
        // A write that changes nothing settles what opening the file does.
        let del = Plugin::new("DEL", "nobody").run(&dual("198.18.180.0/28"));
        assert!(del.status.success(), "{del:?}");
        let before = every_row(&node.db_path());
        let (code, msg) = add(&dual("198.18.181.0/28"), "late", asking).unwrap_err();
        assert_eq!(code, 100, "{msg}");
        assert!(msg.contains("holder"), "{msg}");
        assert_eq!(every_row(&node.db_path()), before, "daemon: {daemon}");
        assert!(node.held_by(NETWORK, "late").is_empty());
        node.stop();
    }
}

/// Rows planted by another writer are never handed out: a free row
/// outside `rangeEnd` and one outside its block, a frontier pointing past
/// the range, a block Metis retired that says Ready again (a pod holds an
/// address in it, so the layout keeps it), and a Ready block outside the
/// conflist's subnet recorded as the conflist's (the layout's fast path
/// does not look at it). Once the range is full the ADD fails with code
/// 11 naming what it passed over. In direct mode and through the daemon
/// (the rows planted while it runs).
#[test]
fn rows_planted_by_someone_else_are_never_handed_out() {
    for daemon in [false, true] {
        let mut node = Node::served("direct-planted", "0s", daemon);
        planted_rows_are_passed_over(&node);
        let log = match daemon {
            false => std::fs::read_to_string(node.dir.join("cni.log")).unwrap(),
            true => node.log(),
        };
        assert!(log.contains("passed over"), "daemon {daemon}: {log}");
        node.stop();
    }
}

/// The body of [`rows_planted_by_someone_else_are_never_handed_out`] on
/// `node`, with or without its daemon.
fn planted_rows_are_passed_over(node: &Node) {
    let range = Range::bounded("198.18.170.0/24", "198.18.170.10", "198.18.170.20");
    let config = conflist(&node.dir, "planted", range);
    let args = "K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod";
    let first = add(&config, "first", args).unwrap();
    assert!(first.to_string().contains("198.18.170.10/24"), "{first}");
    {
        let conn = rusqlite::Connection::open(node.db_path()).unwrap();
        conn.execute_batch(
            "INSERT OR IGNORE INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) \
               VALUES ('198.18.170.33', 1, '', '', 0), ('198.18.171.7', 1, '', '', 0);
             UPDATE ip_addresses SET is_allocated = 0 WHERE address = '198.18.170.33';
             UPDATE metis_blocks SET frontier = '200' WHERE block_id = 1;
             INSERT INTO cidr_blocks (id, cidr, network, ip_family, total_ips, allocated_ips, state) \
               VALUES (7, '198.18.172.0/28', 'shared', 'ipv4', 16, 0, 'Ready'), \
                      (8, '198.18.173.0/28', 'shared', 'ipv4', 16, 0, 'Ready');
             INSERT INTO metis_blocks (block_id, sources, retired) VALUES (7, 'cni', 0), (8, '', 1);
             INSERT INTO ip_addresses (address, cidr_block_id, container_id, interface_name, is_allocated) \
               VALUES ('198.18.172.2', 7, '', '', 0), ('198.18.173.2', 8, '', '', 0), \
                      ('198.18.173.3', 8, 'upstream-pod', 'eth0', 1);",
        )
        .unwrap();
    }
    let mut handed = vec![strip_prefix(first["ips"][0]["address"].as_str().unwrap())];
    let failure = loop {
        let container = format!("pod-{}", handed.len());
        match add(&config, &container, args) {
            Ok(result) => {
                handed.push(strip_prefix(result["ips"][0]["address"].as_str().unwrap()));
                assert!(handed.len() <= 11, "more than the range holds: {handed:?}");
            }
            Err(failure) => break failure,
        }
    };
    assert!(handed.iter().all(|ip| range.admits(*ip)), "{handed:?}");
    assert_eq!(handed.len(), 11, "{handed:?}");
    let (code, msg) = failure;
    assert_eq!(code, 11, "{msg}");
    for named in [
        "passed over",
        "outside rangeStart..rangeEnd",
        "outside the configured ranges",
    ] {
        assert!(msg.contains(named), "{named:?} not in {msg}");
    }
}
