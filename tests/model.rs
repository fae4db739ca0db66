//! Model-based test of issue 10's invariant, "one node, one address space",
//! through the real binary.
//!
//! Each sequence draws random steps — ADD, DEL and CHECK for a few
//! containers and interfaces, with configurations whose ranges overlap,
//! widen, narrow, move and rename networks (tiny ranges, so exhaustion and
//! reuse happen), requested addresses by `runtimeConfig.ips` and `CNI_ARGS
//! IP=`, the daemon restarted with changing `--cidr` flags, SIGKILLed, or
//! left down so the plugin runs in direct mode — optionally starting from a
//! database written the way upstream writes it. A model records who holds
//! what, and after every step the node must agree with it:
//!
//! - no address is held by two owners (networks that opt in with
//!   `"ipam": {"isolated": true}` only among their own pods);
//! - the database's allocated rows are exactly the model's holdings, so a
//!   failed ADD left the owner's allocation untouched and a DEL released it
//!   (or, when its network held nothing for the container and interface,
//!   what other networks held for exactly that pair);
//! - an ADD that succeeds for a new owner returns one address per configured
//!   family, inside the request's ranges or the daemon's `--cidr` blocks of
//!   that network, and the requested address when one was asked for; a
//!   repeat ADD returns what the owner holds;
//! - refusals are the fixed Metis's legitimate ones only: code 7 when a
//!   block of another (non-isolated) network overlaps the request or, for a
//!   configuration dropping `isolated`, one of the network's blocks, code 11
//!   when the model finds no address surely free in some family, code 100
//!   when the requested address is not surely free (held, cooling for
//!   someone other than its last owner, reserved, or outside the ranges);
//! - `metis admin check` exits 0, or exits 1 listing only quarantined
//!   blocks (the fixed Metis isolates what it cannot repair; any other
//!   problem fails the test);
//! - a started daemon serves: `metis health` answers healthy or degraded.
//!
//! "Surely free" is deliberately conservative (every plausible reservation
//! of every overlapping block is excluded), so a refusal is only reported
//! when the model can name an address the fixed Metis should have given.
//!
//! `METIS_MODEL_SEQUENCES` (default 3) and `METIS_MODEL_STEPS` (default 30)
//! set the size; `METIS_MODEL_SEED` the seed every sequence's seed derives
//! from (printed), `METIS_MODEL_FIRST` the first sequence run. A failure
//! prints the command that replays the failing sequence alone and the
//! steps so far. For a soak, e.g.
//! `METIS_MODEL_SEQUENCES=200 METIS_MODEL_STEPS=200 cargo test --test integration model::`
//! (the `make soak` target is to run that).

use crate::common;

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use common::node::{
    Block, Holding, NetConf, Node, Outcome, Request, check_passes, held_twice, holdings_match,
    serving, strip_prefix,
};
use common::rng::{Rng, run_sequences};
use common::upstream::Upstream;
use serde_json::json;

const CONTAINERS: &[&str] = &["c0", "c1", "c2", "c3", "up-0"];
const IFNAMES: &[&str] = &["eth0", "eth0", "eth0", "net1"];

/// The configurations a sequence draws from; all of `pods` unless named.
fn configs() -> Vec<NetConf> {
    let pinned = |network, conf: NetConf| NetConf {
        network: Some(network),
        ..conf
    };
    vec![
        NetConf::new("pods", &["198.18.20.0/30", "2001:db8:20::/126"]),
        // Widened.
        NetConf::new("pods", &["198.18.20.0/29", "2001:db8:20::/125"]),
        NetConf::new("pods", &["198.18.20.0/28"]),
        // Narrowed inside the wider ones.
        NetConf::new("pods", &["198.18.20.4/30"]),
        // Moved.
        NetConf::new("pods", &["198.18.21.0/29", "2001:db8:21::/126"]),
        // Renamed: a second network over the same subnet.
        NetConf::new("k8s-pod-network", &["198.18.20.0/29"]),
        // Renamed, with the allocations pinned to the old network.
        pinned("pods", NetConf::new("k8s-pod-network", &["198.18.20.0/29"])),
        // The upgrade's way out: upstream stored every pod under `default`.
        pinned(
            "default",
            NetConf::new("k8s-pod-network", &["198.18.20.0/29"]),
        ),
        NetConf {
            isolated: true,
            ..NetConf::new("iso", &["198.18.20.0/30"])
        },
        // Its conflist drops `isolated`: refused while its blocks overlap.
        NetConf::new("iso", &["198.18.20.0/30"]),
        NetConf::new("other", &["198.18.22.0/30"]),
        // host-local bounds over a prefix other configurations use whole.
        NetConf {
            bounds: Some(("198.18.20.2", "198.18.20.3")),
            ..NetConf::new("pods", &["198.18.20.0/29", "2001:db8:20::/126"])
        },
        NetConf {
            bounds: Some(("198.18.20.9", "198.18.20.10")),
            ..NetConf::new("pods", &["198.18.20.0/28"])
        },
        // Bounds where `--cidr other=198.18.22.0/29` may merge its block.
        NetConf {
            bounds: Some(("198.18.22.2", "198.18.22.3")),
            ..NetConf::new("other", &["198.18.22.0/29"])
        },
    ]
}

/// One set of `--cidr` flags (`NETWORK=CIDR`).
type Flags = &'static [&'static str];

/// `--cidr` flag sets the daemon is started with.
const CIDR_FLAGS: &[Flags] = &[
    &[],
    &["pods=198.18.20.0/29"],
    &["pods=198.18.20.8/29"],
    &["other=198.18.22.0/29"],
    &["pods=198.18.23.0/30", "other=198.18.22.0/30"],
];

/// Whether `network` is an address space of its own: "iso" while Metis
/// records it isolated (`iso_shared` false; a configuration of it without
/// `isolated` may turn that off).
fn is_isolated(network: &str, iso_shared: bool) -> bool {
    network == "iso" && !iso_shared
}

/// The address space a network allocates in: its own when isolated, else
/// the node's shared one.
fn space(network: &str, iso_shared: bool) -> String {
    if is_isolated(network, iso_shared) {
        network.to_string()
    } else {
        String::new()
    }
}

/// Whether two networks share the node's address space.
fn conflicts(a: &str, b: &str, iso_shared: bool) -> bool {
    a == b || (!is_isolated(a, iso_shared) && !is_isolated(b, iso_shared))
}

/// (network, container, interface).
type Owner = (String, String, String);

#[derive(Debug, Clone)]
enum Step {
    Add {
        conf: NetConf,
        container: &'static str,
        ifname: &'static str,
        request: Request,
    },
    Del {
        conf: NetConf,
        container: &'static str,
        ifname: &'static str,
    },
    Check {
        conf: NetConf,
        container: &'static str,
        ifname: &'static str,
    },
    /// SIGTERM, then a start with flag set `cidrs`.
    Restart {
        cidrs: Flags,
    },
    /// SIGKILL, then a start with flag set `cidrs`.
    Kill {
        cidrs: Flags,
    },
    /// SIGTERM; the plugin runs in direct mode until `Up`.
    Down,
    Up {
        cidrs: Flags,
    },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let conf = |c: &NetConf| {
            format!(
                "{}{}{} {:?}{}",
                c.name,
                c.network
                    .map(|n| format!("(network {n})"))
                    .unwrap_or_default(),
                if c.isolated { "(isolated)" } else { "" },
                c.ranges,
                c.bounds
                    .map(|(start, end)| format!(" range {start}-{end}"))
                    .unwrap_or_default()
            )
        };
        match self {
            Step::Add {
                conf: c,
                container,
                ifname,
                request,
            } => write!(f, "ADD {container}/{ifname} on {} {request:?}", conf(c)),
            Step::Del {
                conf: c,
                container,
                ifname,
            } => write!(f, "DEL {container}/{ifname} on {}", conf(c)),
            Step::Check {
                conf: c,
                container,
                ifname,
            } => write!(f, "CHECK {container}/{ifname} on {}", conf(c)),
            Step::Restart { cidrs } => write!(f, "restart with --cidr {:?}", cidrs),
            Step::Kill { cidrs } => {
                write!(f, "SIGKILL, start with --cidr {:?}", cidrs)
            }
            Step::Down => write!(f, "daemon down (direct mode)"),
            Step::Up { cidrs } => write!(f, "daemon up with --cidr {:?}", cidrs),
        }
    }
}

/// What the model believes the node holds.
struct Model {
    configs: Vec<NetConf>,
    held: BTreeMap<Owner, Vec<String>>,
    /// Released addresses resting in the cooldown, with their last owner.
    /// Cooling addresses by (address space, address): their last owner.
    cooling: BTreeMap<(String, IpAddr), Owner>,
    /// Whether releases rest (`--release-cooldown 1h`) or not (`0`).
    cools: bool,
    /// Whether Metis records network "iso" as not isolated (read back
    /// after each of its ADDs).
    iso_shared: bool,
    /// The flags of the last daemon start (direct mode keeps its blocks).
    cidrs: Flags,
    /// The flag sets restarts draw from.
    flag_sets: &'static [Flags],
    repeat_requests: bool,
    /// The configuration most calls use; it changes now and then.
    current: usize,
    stats: Stats,
}

#[derive(Default, Debug)]
struct Stats {
    adds_ok: u64,
    refusals: BTreeMap<u64, u64>,
    daemon_events: u64,
    direct_calls: u64,
}

impl Model {
    /// The `--cidr` blocks of the last start, as (network, block).
    fn flag_blocks(&self) -> Vec<(String, Block)> {
        self.cidrs
            .iter()
            .map(|flag| {
                let (network, cidr) = flag.split_once('=').unwrap();
                (network.to_string(), Block::parse(cidr))
            })
            .collect()
    }

    /// Blocks a new allocation of `conf` may come from.
    fn allowed(&self, conf: &NetConf) -> Vec<Block> {
        let mut blocks = conf.blocks();
        blocks.extend(
            self.flag_blocks()
                .into_iter()
                .filter(|(network, _)| network == conf.network())
                .map(|(_, block)| block),
        );
        blocks
    }

    /// A block of another network sharing the address space overlaps the
    /// request: the fixed Metis refuses with code 7.
    fn cross_network_overlap(&self, conf: &NetConf, db_blocks: &[(String, Block)]) -> bool {
        let network = conf.network();
        // The request's isolation is the one Metis lays out with.
        let shared = self.iso_shared || !conf.isolated;
        let mut others = db_blocks.to_vec();
        others.extend(self.flag_blocks());
        let over = |mine: Block| {
            others.iter().any(|(other, block)| {
                other != network && conflicts(other, network, shared) && mine.overlaps(*block)
            })
        };
        // Leaving isolation is refused while any block it has overlaps.
        let leaving = is_isolated(network, self.iso_shared) && !conf.isolated;
        self.allowed(conf).into_iter().any(over)
            || (leaving
                && db_blocks
                    .iter()
                    .any(|(mine, block)| mine == network && over(*block)))
    }

    /// Whether `owner` surely gets `ip` from `conf`: inside its blocks,
    /// reserved by no plausible layout, held by nobody it shares the
    /// address space with, not cooling (unless `reclaim` and `owner` is
    /// the last owner).
    fn surely_free(
        &self,
        ip: IpAddr,
        owner: &Owner,
        conf: &NetConf,
        db_blocks: &[(String, Block)],
        reclaim: bool,
    ) -> bool {
        let network = owner.0.as_str();
        let allowed = self.allowed(conf);
        let every_block = allowed
            .iter()
            .copied()
            .chain(db_blocks.iter().map(|(_, b)| *b))
            .chain(self.flag_blocks().into_iter().map(|(_, b)| b));
        let reserved = every_block.clone().any(|b| b.reserves(ip));
        let held = self.held.iter().any(|(o, ips)| {
            conflicts(&o.0, network, self.iso_shared) && ips.iter().any(|a| strip_prefix(a) == ip)
        });
        let cooling = self
            .cooling
            .get(&(space(network, self.iso_shared), ip))
            .is_some_and(|last| !(reclaim && last == owner));
        allowed.iter().any(|b| b.contains(ip))
            && conf.in_bounds(ip)
            && !reserved
            && !held
            && !cooling
    }

    /// Whether a code-11 message's "its gateway G is held by container C
    /// interface I" is true of the model: Metis serves nothing from a
    /// block whose gateway a pod holds (see `store::gateway`), and the
    /// network's other blocks were full.
    fn gateway_held_as_said(&self, conf: &NetConf, msg: &str) -> bool {
        let Some(rest) = msg.split("its gateway ").nth(1) else {
            return false;
        };
        let mut words = rest.split(' ');
        let gateway = words.next().unwrap_or("");
        let quoted: Vec<&str> = rest.split('"').collect();
        let (Some(container), Some(ifname)) = (quoted.get(1), quoted.get(3)) else {
            return false;
        };
        // The message is JSON-escaped: quotes come as \".
        let (container, ifname) = (
            container.trim_end_matches('\\'),
            ifname.trim_end_matches('\\'),
        );
        self.held.iter().any(|((network, c, i), ips)| {
            network == conf.network()
                && c == container
                && i == ifname
                && ips.iter().any(|ip| strip_prefix(ip).to_string() == gateway)
        })
    }

    /// Some family of `conf` has no surely free address, but for those
    /// the refusal `msg` passed over as the gateway a live result names.
    fn exhausted(
        &self,
        owner: &Owner,
        conf: &NetConf,
        db_blocks: &[(String, Block)],
        msg: &str,
    ) -> bool {
        [false, true]
            .into_iter()
            .filter(|v6| conf.has_family(*v6))
            .any(|v6| {
                !self
                    .allowed(conf)
                    .iter()
                    .filter(|b| b.v6 == v6)
                    .flat_map(|b| (0..b.size()).map(|o| b.nth(o)))
                    .any(|ip| {
                        self.surely_free(ip, owner, conf, db_blocks, false)
                            && !self.named_gateway_as_said(ip, msg, db_blocks)
                    })
            })
    }

    /// Whether `msg` passes `ip` over (or refuses it, requested) as "the
    /// gateway of the result container C interface I holds in network N",
    /// and the model agrees:
    /// (N, C, I) still holds an address, and `ip` is the gateway of a
    /// block of some configuration, `--cidr` flag or the database holding
    /// that address — the result it was handed out with named it, and while
    /// that allocation lives no one else may hold it (`store::named_gateway`).
    /// The gateway is base + 1, or, while a pod held that, a stand-in: an
    /// address of the block above its base (below an IPv4 block's
    /// broadcast; `store::layout::gateway::stand_in` takes the highest free).
    fn named_gateway_as_said(&self, ip: IpAddr, msg: &str, db_blocks: &[(String, Block)]) -> bool {
        // The message is JSON-escaped: quotes come as \".
        let msg = msg.replace("\\\"", "\"");
        let Some(rest) = msg
            .split(&format!("{ip} "))
            .nth(1)
            .and_then(|rest| rest.split_once(": it is the gateway of the result container \""))
            .map(|(_, rest)| rest)
        else {
            return false;
        };
        let quoted: Vec<&str> = rest.split('"').collect();
        let (Some(container), Some(ifname), Some(network)) =
            (quoted.first(), quoted.get(2), quoted.get(4))
        else {
            return false;
        };
        let owner: Owner = ((*network).into(), (*container).into(), (*ifname).into());
        // The result may have come from a `--cidr` block of an earlier start.
        let flag_blocks = self
            .flag_sets
            .iter()
            .flat_map(|set| set.iter())
            .filter_map(|flag| flag.split_once('='))
            .filter(|(net, _)| net == network)
            .map(|(_, cidr)| Block::parse(cidr));
        let stored = db_blocks
            .iter()
            .filter(|(net, _)| net == network)
            .map(|(_, block)| *block);
        let blocks: Vec<Block> = self
            .configs
            .iter()
            .flat_map(NetConf::blocks)
            .chain(flag_blocks)
            .chain(stored)
            .collect();
        // base + 1, or a stand-in anywhere above it.
        let gateway_of =
            |b: &Block| b.contains(ip) && ip != b.nth(0) && (b.v6 || ip != b.nth(b.size() - 1));
        self.held.get(&owner).is_some_and(|ips| {
            ips.iter().any(|held| {
                let held = strip_prefix(held);
                blocks
                    .iter()
                    .any(|b| b.size() >= 4 && b.contains(held) && gateway_of(b))
            })
        })
    }

    fn draw(&mut self, rng: &mut Rng, daemon_up: bool) -> Step {
        if rng.chance(12) {
            self.current = rng.index(self.configs.len());
        }
        let conf = if rng.chance(80) {
            self.configs[self.current].clone()
        } else {
            self.configs[rng.index(self.configs.len())].clone()
        };
        let container = CONTAINERS[rng.index(CONTAINERS.len())];
        let ifname = IFNAMES[rng.index(IFNAMES.len())];
        let cidrs = self.flag_sets[rng.index(self.flag_sets.len())];
        match rng.below(100) {
            0..8 if !daemon_up => Step::Up { cidrs },
            0..3 => Step::Restart { cidrs },
            3..6 => Step::Kill { cidrs },
            6..8 => Step::Down,
            8..55 => Step::Add {
                request: match self.repeat_requests
                    || !self
                        .held
                        .contains_key(&Sequence::owner(&conf, container, ifname))
                {
                    true => self.draw_request(rng, &conf),
                    false => Request::None,
                },
                conf,
                container,
                ifname,
            },
            55..85 => Step::Del {
                conf,
                container,
                ifname,
            },
            _ => Step::Check {
                conf,
                container,
                ifname,
            },
        }
    }

    /// No request most of the time; else an address of the configuration
    /// (reserved ones included) or a cooling one, by either convention.
    fn draw_request(&self, rng: &mut Rng, conf: &NetConf) -> Request {
        if !rng.chance(30) {
            return Request::None;
        }
        let blocks = conf.blocks();
        let cooling: Vec<IpAddr> = self
            .cooling
            .keys()
            .map(|(_, ip)| *ip)
            .filter(|ip| blocks.iter().any(|b| b.contains(*ip)))
            .collect();
        let ip = if !cooling.is_empty() && rng.chance(40) {
            cooling[rng.index(cooling.len())]
        } else {
            let block = blocks[rng.index(blocks.len())];
            block.nth(u128::from(rng.below(u64::try_from(block.size()).unwrap())))
        };
        if rng.chance(50) {
            Request::RuntimeConfig(ip)
        } else {
            Request::CniArgs(ip)
        }
    }
}

/// What a sequence may draw from.
struct World {
    configs: fn() -> Vec<NetConf>,
    flag_sets: &'static [Flags],
    /// Chance (percent) of starting from an upstream-written database.
    upstream: u64,
    cooldowns: &'static [&'static str],
    /// Whether an owner that holds addresses may ask for one (issue 10,
    /// case 5: today a refused repeat ADD releases the allocation).
    repeat_requests: bool,
}

/// Everything issue 10 lists: the fixed Metis must survive it.
const MOVING: World = World {
    configs,
    flag_sets: CIDR_FLAGS,
    upstream: 40,
    cooldowns: &["0", "1h"],
    repeat_requests: true,
};

/// One configuration that never changes, no `--cidr`, no cooldown: the
/// world today's Metis already gets right (restarts, SIGKILL, direct mode,
/// requested addresses). It checks the harness itself: a failure here is
/// a bug of the model, or a regression outside issue 10.
const STILL: World = World {
    configs: || {
        vec![NetConf::new(
            "pods",
            &["198.18.20.0/29", "2001:db8:20::/125"],
        )]
    },
    flag_sets: &[&[]],
    upstream: 0,
    cooldowns: &["0"],
    repeat_requests: false,
};

/// One sequence: the node, its model, and the steps taken.
struct Sequence {
    node: Node,
    model: Model,
}

impl Sequence {
    fn new(rng: &mut Rng, world: &World) -> Sequence {
        let cooldown = world.cooldowns[rng.index(world.cooldowns.len())];
        let node = Node::new("model", cooldown);
        let mut model = Model {
            configs: (world.configs)(),
            held: BTreeMap::new(),
            iso_shared: false,
            cooling: BTreeMap::new(),
            cools: cooldown != "0",
            cidrs: &[],
            flag_sets: world.flag_sets,
            repeat_requests: world.repeat_requests,
            current: 0,
            stats: Stats::default(),
        };
        if rng.chance(world.upstream) {
            // Upstream's layout: every pod under network `default`.
            let upstream = Upstream::create(&node.db_path());
            let id = upstream.block("198.18.20.0/29", "default", true);
            for (container, address) in [("up-0", "198.18.20.2"), ("up-1", "198.18.20.3")] {
                upstream.hold(id, address, container, "eth0");
                model.held.insert(
                    ("default".into(), container.into(), "eth0".into()),
                    vec![format!("{address}/29")],
                );
            }
        }
        Sequence { node, model }
    }

    fn db_blocks(&self) -> Vec<(String, Block)> {
        self.node
            .blocks()
            .into_iter()
            .map(|row| (row.network, row.block))
            .collect()
    }

    fn start(&mut self, cidrs: Flags) {
        let flags: Vec<String> = cidrs.iter().map(|f| f.to_string()).collect();
        self.node.start(&flags);
        self.model.cidrs = cidrs;
    }

    fn run(&mut self, step: &Step) -> Result<(), String> {
        if !self.node.daemon_up()
            && matches!(
                step,
                Step::Add { .. } | Step::Del { .. } | Step::Check { .. }
            )
        {
            self.model.stats.direct_calls += 1;
        }
        match step {
            Step::Add {
                conf,
                container,
                ifname,
                request,
            } => self.add(conf, container, ifname, *request),
            Step::Del {
                conf,
                container,
                ifname,
            } => self.del(conf, container, ifname),
            Step::Check {
                conf,
                container,
                ifname,
            } => self.check(conf, container, ifname),
            Step::Restart { cidrs } => {
                self.node.stop();
                self.start(cidrs);
                self.model.stats.daemon_events += 1;
                Ok(())
            }
            Step::Kill { cidrs } => {
                self.node.kill();
                self.start(cidrs);
                self.model.stats.daemon_events += 1;
                Ok(())
            }
            Step::Down => {
                self.node.stop();
                self.model.stats.daemon_events += 1;
                Ok(())
            }
            Step::Up { cidrs } => {
                self.start(cidrs);
                self.model.stats.daemon_events += 1;
                Ok(())
            }
        }
    }

    fn owner(conf: &NetConf, container: &str, ifname: &str) -> Owner {
        (
            conf.network().to_string(),
            container.to_string(),
            ifname.to_string(),
        )
    }

    /// An ADD, then what Metis now records of "iso"'s isolation.
    fn add(
        &mut self,
        conf: &NetConf,
        container: &str,
        ifname: &str,
        request: Request,
    ) -> Result<(), String> {
        let result = self.add_judged(conf, container, ifname, request);
        if conf.network() == "iso" {
            let recorded: Option<bool> = common::db(&self.node.db_path())
                .query_row(
                    "SELECT isolated FROM metis_networks WHERE network = 'iso'",
                    [],
                    |r| r.get(0),
                )
                .ok();
            self.model.iso_shared = recorded == Some(false);
        }
        result
    }

    fn add_judged(
        &mut self,
        conf: &NetConf,
        container: &str,
        ifname: &str,
        request: Request,
    ) -> Result<(), String> {
        let owner = Self::owner(conf, container, ifname);
        let db_blocks = self.db_blocks();
        let before = self.model.held.get(&owner).cloned();
        let outcome = self
            .node
            .call("ADD", conf, container, ifname, request, None);
        match outcome {
            Outcome::Ok(ips) => {
                self.model.stats.adds_ok += 1;
                let families = [false, true]
                    .iter()
                    .filter(|v6| conf.has_family(**v6))
                    .count();
                if ips.len() != families {
                    return Err(format!("ADD returned {ips:?} for {families} families"));
                }
                // A repeat ADD returns what the owner holds in the families
                // the configuration asks for (the prefix may have grown);
                // a family the configuration gained is a new allocation.
                let before = before.unwrap_or_default();
                let held_before: Vec<IpAddr> = before.iter().map(|a| strip_prefix(a)).collect();
                for ip in &ips {
                    let ip = strip_prefix(ip);
                    let same_family = held_before.iter().find(|h| h.is_ipv6() == ip.is_ipv6());
                    if let Some(held) = same_family {
                        if *held != ip {
                            return Err(format!(
                                "repeat ADD returned {ips:?}, the owner holds {before:?}"
                            ));
                        }
                        continue;
                    }
                    let allowed = self.model.allowed(conf);
                    if !allowed.iter().any(|b| b.contains(ip)) {
                        let allowed: Vec<String> =
                            allowed.iter().map(ToString::to_string).collect();
                        return Err(format!("ADD returned {ip}, outside {allowed:?}"));
                    }
                    // Outside `--cidr` blocks (whose layout may merge with
                    // the range), a bounded range hands out only its bounds.
                    let in_flag_block = self
                        .model
                        .flag_blocks()
                        .iter()
                        .any(|(network, b)| network == conf.network() && b.contains(ip));
                    if !in_flag_block && !conf.in_bounds(ip) {
                        return Err(format!("ADD returned {ip}, outside {:?}", conf.bounds));
                    }
                    self.model
                        .cooling
                        .remove(&(space(&owner.0, self.model.iso_shared), ip));
                }
                if let Some(wanted) = request.address()
                    && !ips.iter().any(|ip| strip_prefix(ip) == wanted)
                {
                    return Err(format!("ADD asked for {wanted} and returned {ips:?}"));
                }
                let kept: Vec<String> = before
                    .into_iter()
                    .filter(|a| !ips.iter().any(|b| strip_prefix(b) == strip_prefix(a)))
                    .collect();
                let mut held = ips;
                held.extend(kept);
                self.model.held.insert(owner, held);
                Ok(())
            }
            Outcome::Error { code, msg } => {
                *self.model.stats.refusals.entry(code).or_default() += 1;
                let overlap = self.model.cross_network_overlap(conf, &db_blocks);
                let legitimate = match code {
                    7 => overlap,
                    11 => {
                        overlap
                            || self.model.exhausted(&owner, conf, &db_blocks, &msg)
                            || self.model.gateway_held_as_said(conf, &msg)
                    }
                    100 => {
                        // A requested address that is not surely free, or an
                        // owner that already holds another address of its
                        // family (a repeat ADD may not move it).
                        let holds_other = |ip: IpAddr| {
                            self.model.held.get(&owner).is_some_and(|held| {
                                held.iter()
                                    .map(|a| strip_prefix(a))
                                    .any(|h| h.is_ipv6() == ip.is_ipv6() && h != ip)
                            })
                        };
                        // A repeat ADD whose held address is the gateway its
                        // result would name under this configuration (a
                        // range narrowed under the pod): no result may carry
                        // it (the hand-out check, issue 21).
                        let flag_blocks = self.model.flag_blocks();
                        let blocks = conf.blocks().into_iter().chain(
                            flag_blocks
                                .iter()
                                .filter(|(network, _)| network == conf.network())
                                .map(|(_, b)| *b),
                        );
                        let gateways: Vec<IpAddr> =
                            blocks.filter(|b| b.size() >= 4).map(|b| b.nth(1)).collect();
                        let holds_gateway = self.model.held.get(&owner).is_some_and(|held| {
                            held.iter()
                                .map(|a| strip_prefix(a))
                                .any(|h| gateways.contains(&h))
                        });
                        overlap
                            || holds_gateway
                            || request.address().is_some_and(|ip| {
                                holds_other(ip)
                                    || !self.model.surely_free(ip, &owner, conf, &db_blocks, true)
                                    || self.model.named_gateway_as_said(ip, &msg, &db_blocks)
                            })
                    }
                    _ => false,
                };
                if legitimate {
                    Ok(())
                } else {
                    Err(format!("ADD refused without cause: code {code}: {msg}"))
                }
            }
            Outcome::Broken(text) => Err(format!("ADD: {text}")),
        }
    }

    fn del(&mut self, conf: &NetConf, container: &str, ifname: &str) -> Result<(), String> {
        let owner = Self::owner(conf, container, ifname);
        let outcome = self
            .node
            .call("DEL", conf, container, ifname, Request::None, None);
        if outcome != Outcome::Ok(Vec::new()) {
            return Err(format!("DEL: {outcome:?}"));
        }
        // Nothing held in the named network: what another network holds
        // for exactly this container and interface is released instead
        // (a network renamed under its pod).
        let released: Vec<Owner> = match self.model.held.contains_key(&owner) {
            true => vec![owner],
            false => self
                .model
                .held
                .keys()
                .filter(|(_, c, i)| c == container && i == ifname)
                .cloned()
                .collect(),
        };
        for who in released {
            for ip in self.model.held.remove(&who).unwrap_or_default() {
                if self.model.cools {
                    self.model.cooling.insert(
                        (space(&who.0, self.model.iso_shared), strip_prefix(&ip)),
                        who.clone(),
                    );
                }
            }
        }
        Ok(())
    }

    fn check(&mut self, conf: &NetConf, container: &str, ifname: &str) -> Result<(), String> {
        let owner = Self::owner(conf, container, ifname);
        let held = self.model.held.get(&owner).cloned();
        let addresses = held.clone().unwrap_or_else(|| {
            let block = conf.blocks()[0];
            vec![format!("{}/{}", block.nth(2), block.prefix)]
        });
        let ips: Vec<_> = addresses.iter().map(|a| json!({"address": a})).collect();
        let prev = json!({"cniVersion": "1.0.0", "ips": ips});
        let outcome = self
            .node
            .call("CHECK", conf, container, ifname, Request::None, Some(&prev));
        match (held, &outcome) {
            (Some(_), Outcome::Ok(_)) | (None, Outcome::Error { code: 101, .. }) => Ok(()),
            (held, _) => Err(format!("CHECK with {held:?} held: {outcome:?}")),
        }
    }

    /// The invariants every step must leave true.
    fn verify(&self) -> Result<(), String> {
        let rows = self.node.holdings();
        let mut twice = held_twice(&rows, |h| !is_isolated(&h.network, self.model.iso_shared));
        twice.extend(held_twice(&rows, |h| h.network == "iso"));
        if !twice.is_empty() {
            return Err(format!("addresses held twice: {twice:?}"));
        }
        let expected = self.model.held.iter().flat_map(|((n, c, i), ips)| {
            ips.iter().map(move |ip| Holding {
                network: n.clone(),
                container: c.clone(),
                ifname: i.clone(),
                address: strip_prefix(ip),
            })
        });
        holdings_match(rows, expected)?;
        if self.node.db_path().exists() {
            let check = self.node.admin_check();
            if !check_passes(&check) {
                return Err(format!(
                    "metis admin check: {}{}",
                    String::from_utf8_lossy(&check.stdout),
                    String::from_utf8_lossy(&check.stderr)
                ));
            }
        }
        if self.node.daemon_up() {
            let health = self.node.health();
            if !serving(&health) {
                return Err(format!("the daemon does not serve: {health:?}"));
            }
        }
        Ok(())
    }
}

/// Runs one sequence, appending each step to `trace`.
fn run_sequence(
    world: &World,
    seed: u64,
    steps: u64,
    trace: &mut Vec<String>,
) -> Result<Stats, String> {
    let mut rng = Rng::new(seed);
    let mut sequence = Sequence::new(&mut rng, world);
    trace.push(format!(
        "start: cooldown {}, upstream database {}",
        sequence.node.cooldown,
        sequence.node.db_path().exists()
    ));
    // The daemon runs first, so the settings direct mode reads exist.
    let cidrs = world.flag_sets[rng.index(world.flag_sets.len())];
    trace.push(Step::Up { cidrs }.to_string());
    sequence.start(cidrs);
    sequence.verify()?;
    for _ in 0..steps {
        let step = sequence.model.draw(&mut rng, sequence.node.daemon_up());
        trace.push(step.to_string());
        sequence.run(&step)?;
        sequence.verify()?;
    }
    Ok(std::mem::take(&mut sequence.model.stats))
}

#[test]
fn no_sequence_of_events_breaks_the_address_space() {
    run_world(&MOVING, "no_sequence_of_events_breaks_the_address_space");
}

#[test]
fn the_harness_accepts_what_metis_already_gets_right() {
    run_world(&STILL, "the_harness_accepts_what_metis_already_gets_right");
}

/// Runs the configured number of sequences of `world`; panics with the
/// failing sequence's seed, replay command and steps.
fn run_world(world: &World, test: &str) {
    let all = run_sequences(
        "METIS_MODEL",
        &format!("model::{test}"),
        (3, 30),
        |seed, steps, trace| run_sequence(world, seed, steps, trace),
    );
    let mut total = Stats::default();
    for stats in all {
        total.adds_ok += stats.adds_ok;
        total.daemon_events += stats.daemon_events;
        total.direct_calls += stats.direct_calls;
        for (code, n) in stats.refusals {
            *total.refusals.entry(code).or_default() += n;
        }
    }
    eprintln!("{total:?}");
    // The harness must have exercised what it claims to.
    assert!(total.adds_ok > 0, "no ADD ever succeeded: {total:?}");
}
