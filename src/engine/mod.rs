//! The IPAM engine: one request in, one outcome out, against the store.
//! The daemon runs it for every client; the plugin runs the very same code
//! in-process in direct mode, so both paths share every rule. Outcomes are
//! domain values; `crate::encode` turns them into wire responses at the
//! edge, so the adaptive side can amend them without parsing text.
//! Requests come in typed ([`request::Command`]); `crate::decode` reads
//! them off the wire.

pub mod request;

use std::collections::HashSet;

use crate::cidr::Family;
use crate::names::{self, Attachment};
use crate::store::Usage;
use crate::store::{
    AddressFilter, Allocation, BlockFilter, InForce, Owner, Source, Store, StoreError, Table,
    TakenBack,
};
use crate::wire::{Code, reason};
use request::{Add, Check, Command, Del, FamilyAdd, Gc, StatusQuery, UsageQuery};

/// A request-level failure: what the client is told.
#[derive(Debug, PartialEq, Eq)]
pub struct Failure {
    pub code: Code,
    pub reason: &'static str,
    pub message: String,
    /// The network and family the failure concerns, when there is one.
    pub scope: Option<(String, Family)>,
    /// The database was busy (another process held its lock): the request
    /// left nothing and may be tried again as a whole.
    pub busy: bool,
}

impl crate::store::Contended for Failure {
    fn contended(&self) -> bool {
        self.busy
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Failure {
    /// A request that is malformed, whatever the store holds.
    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure {
            code: Code::InvalidArgument,
            reason: reason::INVALID_REQUEST,
            message: message.into(),
            scope: None,
            busy: false,
        }
    }

    /// What a store error means for the client. This is the one place where
    /// store failures become wire statuses.
    fn from_store(context: &str, err: &StoreError) -> Failure {
        let (code, reason) = match err {
            StoreError::NoAvailableIps { .. } => {
                (Code::ResourceExhausted, reason::IP_POOL_EXHAUSTED)
            }
            StoreError::RequestedIpUnavailable { .. }
            | StoreError::RequestedIpOutsideBlocks { .. }
            | StoreError::HeldUnfit { .. } => {
                (Code::InvalidArgument, reason::REQUESTED_IP_UNAVAILABLE)
            }
            StoreError::EmptyOwner | StoreError::BadCidr(_) | StoreError::Overlap { .. } => {
                (Code::InvalidArgument, reason::INVALID_REQUEST)
            }
            _ if err.is_corrupt() => (Code::Internal, reason::STORE_CORRUPT),
            _ => (Code::Unavailable, reason::STORE_UNAVAILABLE),
        };
        let scope = match err {
            StoreError::NoAvailableIps {
                network, family, ..
            } => Some((network.clone(), *family)),
            _ => None,
        };
        Failure {
            code,
            reason,
            message: format!("{context}: {err}"),
            scope,
            busy: crate::store::Contended::contended(err),
        }
    }
}

impl From<Failure> for Outcome {
    fn from(failure: Failure) -> Outcome {
        match failure.scope {
            Some((network, family)) => Outcome::Exhausted {
                network,
                family,
                message: failure.message,
            },
            None => Outcome::Failed(failure),
        }
    }
}

/// What a request came to. Exhaustion stays typed so the daemon can park
/// the request and wait for new blocks without reading the reply back.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    Done(Reply),
    Failed(Failure),
    /// No free address of `family` in the network's blocks.
    Exhausted {
        network: String,
        family: Family,
        message: String,
    },
}

impl Outcome {
    /// The status code the client is told.
    pub fn code(&self) -> Code {
        match self {
            Outcome::Done(_) => Code::Ok,
            Outcome::Failed(failure) => failure.code,
            Outcome::Exhausted { .. } => Code::ResourceExhausted,
        }
    }
}

/// What a successful request returned.
#[derive(Debug, PartialEq)]
pub enum Reply {
    /// ADD: the address of each requested family.
    Allocated(Allocated),
    /// DEL: the addresses released.
    Released(Vec<Allocation>),
    /// CHECK: what the owner holds (never empty).
    Held(Vec<Allocation>),
    /// An admin listing of blocks or addresses.
    Table(Table),
    Health(Health),
    Usage(Vec<NetworkUsage>),
    /// GC: the stale allocations released.
    Collected(Vec<Allocation>),
    /// STATUS.
    Readiness(Readiness),
}

/// An ADD's addresses, one per requested family.
#[derive(Debug, Default, PartialEq)]
pub struct Allocated {
    pub ipv4: Option<Allocation>,
    pub ipv6: Option<Allocation>,
}

/// The daemon serves; these say what limits it.
#[derive(Debug, PartialEq)]
pub struct Health {
    /// Blocks nothing new is allocated from.
    pub quarantined: usize,
    /// Why the node cannot grow through the cluster, when it cannot (the
    /// adaptive side knows; the engine leaves it empty).
    pub cluster_problem: Option<String>,
    /// Blocks the cluster no longer grants that pods still hold addresses
    /// in (the adaptive side knows; the engine leaves it empty).
    pub not_granted: Vec<TakenBack>,
}

/// Whether an ADD with a STATUS request's ranges could be served now.
#[derive(Debug, PartialEq)]
pub enum Readiness {
    Ready,
    /// No free `family` address, and every configured range is added.
    Full {
        network: String,
        family: Family,
        /// Why some of the network's addresses cannot be served, in words:
        /// quarantined blocks, bounds that leave no address.
        blocked: Vec<String>,
        /// Why the cluster cannot add blocks either, when the adaptive side
        /// knows it could otherwise.
        cluster_problem: Option<String>,
    },
}

/// One network and family's usage.
#[derive(Debug, PartialEq)]
pub struct NetworkUsage {
    pub network: String,
    pub family: Family,
    pub usage: Usage,
}

/// Serves requests against one store.
pub struct Engine {
    store: Store,
}

impl Engine {
    pub fn new(store: Store) -> Engine {
        Engine { store }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut Store {
        &mut self.store
    }

    /// Handles one request at time `now_ms`. Never panics on input: every
    /// failure becomes an error status.
    pub fn handle(&mut self, command: &Command, now_ms: i64) -> Outcome {
        if let Err(err) = self.store.ensure_file_unchanged() {
            return Failure::from_store("database", &err).into();
        }
        let result = match command {
            Command::Add(add) => self.allocate(add, now_ms).map(Reply::Allocated),
            Command::Del(del) => self.deallocate(del, now_ms).map(Reply::Released),
            Command::Check(check) => self.check(check).map(Reply::Held),
            Command::ListBlocks(filter) => self.list_blocks(filter).map(Reply::Table),
            Command::ListAddresses(filter) => self.list_addresses(filter).map(Reply::Table),
            Command::Health => self.health().map(Reply::Health),
            Command::Usage(query) => self.usage(query, now_ms).map(Reply::Usage),
            Command::Gc(gc) => self.gc(gc, now_ms).map(Reply::Collected),
            Command::Status(query) => self.network_status(query, now_ms).map(Reply::Readiness),
        };
        match result {
            Ok(reply) => Outcome::Done(reply),
            Err(failure) => failure.into(),
        }
    }

    /// Handles one request of the daemon's group commit: in a savepoint of
    /// the batch's transaction, kept only when the request succeeded, so a
    /// failed request leaves nothing and never undoes another. The turn's
    /// first write shares the transaction with nothing yet, so it runs
    /// without savepoints ([`Engine::opening`]). Nothing is durable, so
    /// nothing may be answered, before [`Engine::commit_batch`].
    pub fn handle_in_batch(&mut self, command: &Command, now_ms: i64) -> Outcome {
        // Reads take no write lock, as alone: a health probe never waits
        // for another process's writer. In an open batch they see its
        // writes, which is why their answers wait for the commit too.
        if !command.writes() {
            return self.handle(command, now_ms);
        }
        if !self.store.holds_batch() {
            return self.opening(command, now_ms);
        }
        self.in_savepoint(command, now_ms)
    }

    /// A write request in a savepoint of the open batch.
    fn in_savepoint(&mut self, command: &Command, now_ms: i64) -> Outcome {
        if let Err(err) = self.store.begin_request() {
            return Failure::from_store("database", &err).into();
        }
        let outcome = self.handle(command, now_ms);
        let succeeded = matches!(outcome, Outcome::Done(_));
        match self.store.end_request(succeeded) {
            Ok(()) => outcome,
            Err(err) => Failure::from_store("database", &err).into(),
        }
    }

    /// Handles one request in a write transaction of its own, without
    /// savepoints, then [`Engine::commit_batch`] (served again in a
    /// savepoint if a write could not finish, see [`Engine::opening`]).
    /// Direct mode and the daemon's retries of parked ADDs serve this way,
    /// so every decision a write takes — laying the network out, its
    /// bounds, the address — is made under one `BEGIN IMMEDIATE` lock on
    /// what is true then, and a failed request leaves nothing, exactly as
    /// in the daemon's group commit. Never called with a batch open.
    pub fn handle_alone(&mut self, command: &Command, now_ms: i64) -> Outcome {
        if !command.writes() {
            return self.handle(command, now_ms);
        }
        let outcome = self.opening(command, now_ms);
        self.committed(outcome)
    }

    /// A write request that opens the transaction: alone in it, the request
    /// needs no savepoints (a failure rolls the transaction back), and
    /// prepares and runs four statements fewer. Succeeded, it leaves the
    /// transaction open for the commit, and for later requests of the batch
    /// in savepoints of their own.
    fn opening(&mut self, command: &Command, now_ms: i64) -> Outcome {
        if let Err(err) = self.store.begin_alone() {
            return Failure::from_store("database", &err).into();
        }
        let outcome = self.handle(command, now_ms);
        if self.store.alone_ended() {
            // A write was dropped unfinished, which only a savepoint undoes
            // alone: the attempt left nothing, and is made again with them.
            if let Err(err) = self.store.abandon_batch() {
                return Failure::from_store("database", &err).into();
            }
            return self.in_savepoint(command, now_ms);
        }
        if !matches!(outcome, Outcome::Done(_)) {
            return match self.store.abandon_batch() {
                Ok(()) => outcome,
                Err(err) => Failure::from_store("database", &err).into(),
            };
        }
        outcome
    }

    /// `outcome` once the transaction is committed, or what a failed
    /// commit tells instead.
    fn committed(&mut self, outcome: Outcome) -> Outcome {
        match self.commit_batch() {
            None => outcome,
            Some(failure) => failure.into(),
        }
    }

    /// Commits the requests [`Engine::handle_in_batch`] ran since the last
    /// commit. On failure, returns what every one of them is told instead
    /// of its own outcome: what a request alone is told when its commit
    /// fails.
    pub fn commit_batch(&mut self) -> Option<Failure> {
        let err = self.store.commit_batch().err()?;
        Some(Failure::from_store("commit", &err))
    }

    /// Serving, and degraded while blocks are quarantined.
    fn health(&self) -> Result<Health, Failure> {
        let quarantined = self
            .store
            .quarantined()
            .map_err(|err| Failure::from_store("health", &err))?;
        Ok(Health {
            quarantined: quarantined.len(),
            cluster_problem: None,
            not_granted: Vec::new(),
        })
    }

    /// Allocates one address per requested family, IPv4 first. Served as
    /// a request ([`Engine::handle_in_batch`], [`Engine::handle_alone`]), a
    /// failed ADD leaves nothing in the database, its layout and bounds
    /// included: its savepoint is rolled back, in the daemon and in direct
    /// mode alike. The earlier families are also released here when a
    /// later one fails: a co-written host-local file is not in the
    /// database, and that release is what removes it.
    pub fn allocate(&mut self, add: &Add, now_ms: i64) -> Result<Allocated, Failure> {
        let network = add.network.as_str();
        let parts = add.families();
        let mut reply = Allocated::default();
        // Families this request newly took: only those are undone when a
        // later family fails. What the owner held before (a repeated ADD)
        // stays untouched, whatever this request's outcome.
        let mut taken: Vec<(Family, &Attachment)> = Vec::new();
        for (at, (family, part)) in parts.iter().enumerate() {
            let (family, Some(part)) = (*family, *part) else {
                continue;
            };
            // Only a later family's failure undoes this one: without one,
            // the lookup is not needed (the store makes its own).
            let later = parts[at + 1..].iter().any(|(_, later)| later.is_some());
            let held_before = later && self.holds(network, family, &part.owner)?;
            match self.allocate_family(add, family, part, now_ms) {
                Ok(allocation) => {
                    match family {
                        Family::V4 => reply.ipv4 = Some(allocation),
                        Family::V6 => reply.ipv6 = Some(allocation),
                    }
                    if !held_before {
                        taken.push((family, &part.owner));
                    }
                }
                Err(failure) => {
                    for (family, owner) in taken {
                        self.roll_back(network, family, owner);
                    }
                    return Err(failure);
                }
            }
        }
        // The conflist that served the network last: its GC covers the
        // network after a rename of `ipam.network`.
        self.store
            .note_served_by(network, &add.conf_name)
            .map_err(|err| Failure::from_store(&format!("network {network:?}"), &err))?;
        Ok(reply)
    }

    /// Whether `owner` already holds a `family` address in `network` (one
    /// indexed read).
    fn holds(&self, network: &str, family: Family, owner: &Attachment) -> Result<bool, Failure> {
        let held = self
            .store
            .check(network, owner.container_id(), owner.interface())
            .map_err(|err| Failure::from_store("allocation lookup failed", &err))?;
        Ok(held
            .iter()
            .any(|allocation| Family::of(allocation.address) == family))
    }

    fn allocate_family(
        &mut self,
        add: &Add,
        family: Family,
        part: &FamilyAdd,
        now_ms: i64,
    ) -> Result<Allocation, Failure> {
        let network = add.network.as_str();
        let in_force =
            self.ensure_initial_blocks(network, family, &part.ranges, add.isolated, now_ms)?;
        let owner = Owner {
            network,
            container_id: part.owner.container_id(),
            interface_name: part.owner.interface(),
            pod_name: &add.pod.name,
            pod_namespace: &add.pod.namespace,
        };
        let context = format!(
            "failed to allocate {family} for {}",
            names::describe_owner(&add.pod.namespace, &add.pod.name, part.owner.container_id())
        );
        if let Some(address) = part.requested {
            return self
                .store
                .allocate_requested_under(&owner, address, in_force, now_ms)
                .map_err(|err| Failure::from_store(&context, &err));
        }
        match self.store.allocate_under(&owner, family, in_force, now_ms) {
            Err(StoreError::NoAvailableIps { .. }) if family == Family::V4 => {
                // A Draining block still holds addresses: take it back before
                // reporting exhaustion (upstream's first scale-up step).
                let undrained = self
                    .store
                    .undrain_one(network, family, now_ms)
                    .map_err(|err| Failure::from_store(&context, &err))?;
                if undrained.is_some() {
                    crate::log::info(
                        "engine",
                        "undrained a block to serve an allocation",
                        &[("network", &network)],
                    );
                }
                self.store
                    .allocate_under(&owner, family, in_force, now_ms)
                    .map_err(|err| Failure::from_store(&context, &err))
            }
            other => other.map_err(|err| Failure::from_store(&context, &err)),
        }
    }

    /// Declares the request's CNI ranges of a family as the network's
    /// ranges; the store grows, narrows, adds or retires blocks to match
    /// (reads only when nothing changed: this runs on every ADD). Returns
    /// the configuration in force that every address handed out for the
    /// request is checked against (`None`: the request names no ranges).
    fn ensure_initial_blocks<'a>(
        &mut self,
        network: &str,
        family: Family,
        ranges: &'a InForce,
        isolated: bool,
        now_ms: i64,
    ) -> Result<Option<&'a InForce>, Failure> {
        if ranges.ranges.is_empty() {
            return Ok(None);
        }
        let failed =
            |err: StoreError| Failure::from_store(&format!("ranges of network {network:?}"), &err);
        let changes = self
            .store
            .configure(
                &crate::store::Wish {
                    source: Source::Cni,
                    network,
                    family,
                    ranges: &ranges.ranges,
                    isolated,
                },
                now_ms,
            )
            .map_err(failed)?;
        for line in &changes.lines {
            crate::log::info("engine", line, &[("network", &network)]);
        }
        let rebounded = self
            .store
            .set_bounds(network, family, &ranges.bounds)
            .map_err(failed)?;
        for cidr in &rebounded {
            crate::log::info(
                "engine",
                "usable range or gateway of a block changed",
                &[("network", &network), ("cidr", cidr)],
            );
        }
        Ok(Some(ranges))
    }

    /// Undoes what this request took of `family`. No cooldown: the address
    /// never reached a pod.
    fn roll_back(&mut self, network: &str, family: Family, owner: &Attachment) {
        if let Err(err) =
            self.store
                .roll_back(network, owner.container_id(), owner.interface(), family)
        {
            crate::log::error(
                "engine",
                "failed to roll back a partial allocation",
                &[
                    ("network", &network),
                    ("container_id", &owner.container_id()),
                    ("error", &err),
                ],
            );
        }
    }

    pub fn deallocate(&mut self, del: &Del, now_ms: i64) -> Result<Vec<Allocation>, Failure> {
        let network = del.network.as_str();
        let owner = &del.owner;
        let released = self
            .store
            .release(network, owner.container_id(), owner.interface(), now_ms)
            .map_err(|err| {
                Failure::from_store(
                    &format!(
                        "failed to deallocate ips for {}",
                        names::describe_owner(
                            &del.pod.namespace,
                            &del.pod.name,
                            owner.container_id()
                        )
                    ),
                    &err,
                )
            })?;
        for held_in in &released.elsewhere {
            crate::log::warn(
                "engine",
                "DEL released what another network held for this container and interface (the configuration's ipam.network was renamed under the pod)",
                &[
                    ("network", &network),
                    ("held_in", held_in),
                    ("container_id", &owner.container_id()),
                    ("interface_name", &owner.interface()),
                ],
            );
        }
        Ok(released.addresses)
    }

    pub fn check(&self, check: &Check) -> Result<Vec<Allocation>, Failure> {
        let (network, owner) = (&check.network, &check.owner);
        let allocated = self
            .store
            .check(network, owner.container_id(), owner.interface())
            .map_err(|err| Failure::from_store("allocation check failed", &err))?;
        if allocated.is_empty() {
            return Err(Failure {
                code: Code::NotFound,
                reason: reason::ALLOCATION_NOT_FOUND,
                message: format!(
                    "no active allocation found for container {} interface {} on network {network}",
                    owner.container_id(),
                    owner.interface()
                ),
                scope: None,
                busy: false,
            });
        }
        Ok(allocated)
    }

    /// CNI GC: releases the network's allocations whose owners the runtime
    /// no longer lists, sparing those younger than the grace period.
    pub fn gc(&mut self, gc: &Gc, now_ms: i64) -> Result<Vec<Allocation>, Failure> {
        let network = gc.network.as_str();
        let valid: HashSet<(&str, &str)> = gc
            .valid
            .iter()
            .map(|(container_id, interface)| (container_id.as_str(), interface.as_str()))
            .collect();
        let released = self
            .store
            .gc(
                network,
                &gc.conf_name,
                &valid,
                now_ms.saturating_sub(gc.grace_ms),
                now_ms,
            )
            .map_err(|err| Failure::from_store(&format!("GC of network {network:?}"), &err))?;
        for (held_in, allocation) in &released {
            let message = match held_in == network {
                true => "GC released a stale allocation",
                false => {
                    "GC released a stale allocation another network held, served last by this conflist"
                }
            };
            crate::log::info(
                "engine",
                message,
                &[
                    ("network", &held_in.as_str()),
                    ("address", &allocation.address),
                ],
            );
        }
        Ok(released
            .into_iter()
            .map(|(_, allocation)| allocation)
            .collect())
    }

    /// CNI STATUS: whether an ADD with these ranges could be served now.
    /// Reads only, so it is cheap enough for a 5-second poll.
    pub fn network_status(&self, query: &StatusQuery, now_ms: i64) -> Result<Readiness, Failure> {
        let network = query.network.as_str();
        for (family, in_force) in [(Family::V4, &query.ipv4), (Family::V6, &query.ipv6)] {
            if in_force.ranges.is_empty() {
                continue;
            }
            let context = format!("status of network {network:?}");
            let room = self
                .store
                .can_allocate(network, family, in_force, query.isolated, now_ms)
                .map_err(|err| Failure::from_store(&context, &err))?;
            if let Err(blocked) = room {
                return Ok(Readiness::Full {
                    network: network.to_string(),
                    family,
                    blocked,
                    cluster_problem: None,
                });
            }
        }
        Ok(Readiness::Ready)
    }

    fn list_blocks(&self, filter: &BlockFilter) -> Result<Table, Failure> {
        self.store
            .list_blocks(filter)
            .map_err(|err| Failure::from_store("failed to list CIDR blocks", &err))
    }

    fn list_addresses(&self, filter: &AddressFilter) -> Result<Table, Failure> {
        self.store
            .list_addresses(filter)
            .map_err(|err| Failure::from_store("failed to list IP addresses", &err))
    }

    /// Usage of every network (or the one asked for) and family that has
    /// non-Deleting blocks.
    fn usage(&self, query: &UsageQuery, now_ms: i64) -> Result<Vec<NetworkUsage>, Failure> {
        let families = match query.family {
            Some(family) => vec![family],
            None => vec![Family::V4, Family::V6],
        };
        let failed = |err: StoreError| Failure::from_store("failed to compute usage", &err);
        let mut usage = Vec::new();
        for network in self.store.networks().map_err(failed)? {
            if query
                .network
                .as_ref()
                .is_some_and(|wanted| *wanted != network)
            {
                continue;
            }
            for &family in &families {
                let counts = self.store.usage(&network, family, now_ms).map_err(failed)?;
                if counts.total > 0 {
                    usage.push(NetworkUsage {
                        network: network.clone(),
                        family,
                        usage: counts,
                    });
                }
            }
        }
        Ok(usage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::{Bounds, Cidr};
    use crate::engine::request::Pod;
    use crate::testutil::TempDir;

    fn owner(container: &str) -> Attachment {
        Attachment::new(container, "eth0").unwrap()
    }

    fn part(container: &str, cidr: &str) -> Option<FamilyAdd> {
        (!cidr.is_empty()).then(|| FamilyAdd {
            owner: owner(container),
            ranges: InForce {
                ranges: vec![cidr.parse().unwrap()],
                bounds: Vec::new(),
            },
            requested: None,
        })
    }

    fn request(container: &str, v4: &str, v6: &str) -> Add {
        Add {
            network: "net".into(),
            pod: Pod {
                namespace: "ns".into(),
                name: "p".into(),
            },
            ipv4: part(container, v4),
            ipv6: part(container, v6),
            isolated: false,
            conf_name: String::new(),
        }
    }

    fn asking(container: &str, v4: &str, v6: &str, address: &str) -> Add {
        let mut wanted = request(container, v4, v6);
        let address: std::net::IpAddr = address.parse().unwrap();
        let part = match Family::of(address) {
            Family::V4 => wanted.ipv4.as_mut(),
            Family::V6 => wanted.ipv6.as_mut(),
        };
        part.unwrap().requested = Some(address);
        wanted
    }

    #[test]
    fn bounds_of_a_range_are_applied() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store_with_cooldown(60_000));
        let now = crate::log::now_ms();
        let mut bounded = request("a", "198.18.0.0/24", "");
        let subnet: Cidr = "198.18.0.0/24".parse().unwrap();
        let ip = |text: &str| Some(text.parse().unwrap());
        let bounds = Bounds::new(
            &subnet,
            ip("198.18.0.10"),
            ip("198.18.0.20"),
            ip("198.18.0.10"),
        )
        .unwrap();
        bounded.ipv4.as_mut().unwrap().ranges.bounds = vec![(subnet, bounds)];
        let got = engine.allocate(&bounded, now).unwrap();
        assert_eq!(got.ipv4.unwrap().address.to_string(), "198.18.0.11");
    }

    #[test]
    fn failed_second_family_releases_the_first() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store_with_cooldown(60_000));
        let now = crate::log::now_ms();
        // A /128 has one address: the first pod takes it.
        engine
            .allocate(&request("a", "198.18.0.0/24", "2001:db8::1/128"), now)
            .unwrap();
        let failure = engine
            .allocate(&request("b", "198.18.0.0/24", "2001:db8::1/128"), now)
            .unwrap_err();
        assert_eq!(failure.code, Code::ResourceExhausted);
        assert_eq!(failure.scope, Some(("net".to_string(), Family::V6)));
        let held = engine.store().check("net", "b", "eth0").unwrap();
        assert!(held.is_empty(), "IPv4 address leaked: {held:?}");
        // Rolled back without cooldown: the next pod gets that same address.
        let next = engine
            .allocate(&request("c", "198.18.0.0/24", ""), now)
            .unwrap();
        assert_eq!(next.ipv4.unwrap().address.to_string(), "198.18.0.3");
    }

    #[test]
    fn a_failed_repeat_add_keeps_what_the_owner_held() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store_with_cooldown(60_000));
        let now = crate::log::now_ms();
        let first = engine
            .allocate(&request("a", "198.18.0.0/24", "2001:db8::/120"), now)
            .unwrap();
        // The same owner asks again, now for a v6 address it cannot have.
        let repeat = asking("a", "198.18.0.0/24", "2001:db8::/120", "2001:db8:1::9");
        let failure = engine.allocate(&repeat, now).unwrap_err();
        assert_eq!(failure.reason, reason::REQUESTED_IP_UNAVAILABLE);
        let held: Vec<String> = engine
            .store()
            .check("net", "a", "eth0")
            .unwrap()
            .iter()
            .map(|a| a.address.to_string())
            .collect();
        assert_eq!(
            held,
            [
                first.ipv4.unwrap().address.to_string(),
                first.ipv6.unwrap().address.to_string()
            ]
        );
        // Nothing was freed: the next pod gets fresh addresses.
        let next = engine
            .allocate(&request("b", "198.18.0.0/24", "2001:db8::/120"), now)
            .unwrap();
        assert_eq!(next.ipv4.unwrap().address.to_string(), "198.18.0.3");
        assert_eq!(next.ipv6.unwrap().address.to_string(), "2001:db8::3");
    }

    #[test]
    fn only_the_last_owner_takes_back_a_cooling_address() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store_with_cooldown(60_000));
        let now = crate::log::now_ms();
        engine
            .allocate(&request("a", "198.18.0.0/24", ""), now)
            .unwrap();
        let del = Del {
            network: "net".into(),
            owner: owner("a"),
            pod: Pod::default(),
        };
        engine.deallocate(&del, now).unwrap();
        assert_eq!(
            engine
                .allocate(&asking("b", "198.18.0.0/24", "", "198.18.0.2"), now)
                .unwrap_err()
                .reason,
            reason::REQUESTED_IP_UNAVAILABLE,
            "another container waits out the cooldown"
        );
        let back = engine
            .allocate(&asking("a", "198.18.0.0/24", "", "198.18.0.2"), now)
            .unwrap();
        assert_eq!(back.ipv4.unwrap().address.to_string(), "198.18.0.2");
    }

    #[test]
    fn exhaustion_takes_back_a_draining_block_first() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store());
        let now = crate::log::now_ms();
        engine
            .allocate(&request("a", "198.18.0.0/30", ""), now)
            .unwrap();
        let extra = engine
            .store_mut()
            .add_cidr_block("net", &"198.18.1.0/30".parse().unwrap())
            .unwrap();
        let crate::store::AddOutcome::Added(id) = extra else {
            panic!("{extra:?}")
        };
        engine.store_mut().drain_block(id, now).unwrap();
        let reply = engine
            .allocate(&request("b", "198.18.0.0/30", ""), now)
            .unwrap();
        assert_eq!(reply.ipv4.unwrap().address.to_string(), "198.18.1.2");
        let failure = engine
            .allocate(&request("c", "198.18.0.0/30", ""), now)
            .unwrap_err();
        assert_eq!(failure.reason, reason::IP_POOL_EXHAUSTED);
        assert_eq!(failure.scope, Some(("net".to_string(), Family::V4)));
    }

    #[test]
    fn exhaustion_stays_typed_until_encoded() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store());
        let now = crate::log::now_ms();
        let add =
            |container: &str| Command::Add(Box::new(request(container, "", "2001:db8::1/128")));
        let first = engine.handle(&add("a"), now);
        assert!(matches!(first, Outcome::Done(_)), "{first:?}");
        let outcome = engine.handle(&add("b"), now);
        let Outcome::Exhausted {
            network, family, ..
        } = &outcome
        else {
            panic!("{outcome:?}")
        };
        assert_eq!((network.as_str(), *family), ("net", Family::V6));
        let reply = outcome.into_response();
        assert_eq!(reply.code(), Code::ResourceExhausted);
        assert_eq!(reply.reason(), reason::IP_POOL_EXHAUSTED);
        assert_eq!(reply.metadata(reason::META_NETWORK), Some("net"));
        assert_eq!(reply.metadata(reason::META_IP_FAMILY), Some("ipv6"));
    }

    #[test]
    fn requested_addresses() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store());
        let now = crate::log::now_ms();
        let wanted = asking("a", "198.18.0.0/24", "", "198.18.0.77");
        assert_eq!(
            engine
                .allocate(&wanted, now)
                .unwrap()
                .ipv4
                .unwrap()
                .address
                .to_string(),
            "198.18.0.77"
        );
        let taken = asking("b", "198.18.0.0/24", "", "198.18.0.77");
        assert_eq!(
            engine.allocate(&taken, now).unwrap_err().reason,
            reason::REQUESTED_IP_UNAVAILABLE
        );
    }

    #[test]
    fn a_request_alone_decides_in_one_transaction_and_a_failed_one_leaves_nothing() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store());
        let now = crate::log::now_ms();
        let held = engine.handle_alone(
            &Command::Add(Box::new(request("a", "198.18.0.0/24", ""))),
            now,
        );
        assert_eq!(held.into_response().code(), Code::Ok);
        // The range moves (a block added, the old one retired) and the
        // IPv4 address is taken before the IPv6 request fails.
        let failing = asking("b", "198.18.1.0/24", "2001:db8::/64", "2001:db8:1::1");
        let before = engine.store().blocks(&BlockFilter::default()).unwrap();
        let failed = engine
            .handle_alone(&Command::Add(Box::new(failing)), now)
            .into_response();
        assert_eq!(failed.reason(), reason::REQUESTED_IP_UNAVAILABLE);
        assert_eq!(
            engine.store().blocks(&BlockFilter::default()).unwrap(),
            before
        );
        assert!(engine.store().check("net", "b", "eth0").unwrap().is_empty());
        // Nothing is left open: the next request commits on its own.
        let next = engine.handle_alone(
            &Command::Add(Box::new(request("c", "198.18.0.0/24", ""))),
            now,
        );
        assert_eq!(next.into_response().code(), Code::Ok);
        drop(engine);
        let reopened = dir.store();
        assert_eq!(reopened.check("net", "c", "eth0").unwrap().len(), 1);
    }

    #[test]
    fn a_failed_request_of_a_batch_leaves_nothing_and_keeps_the_others() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store());
        let now = crate::log::now_ms();
        let first = engine.handle_in_batch(
            &Command::Add(Box::new(request("a", "198.18.0.0/24", ""))),
            now,
        );
        assert_eq!(first.into_response().code(), Code::Ok);
        // Its IPv6 range is new, so this request adds that block before its
        // requested address turns out to lie outside it.
        let failing = asking("b", "198.18.0.0/24", "2001:db8::/64", "2001:db8:1::1");
        let failed = engine
            .handle_in_batch(&Command::Add(Box::new(failing)), now)
            .into_response();
        assert_eq!(failed.code(), Code::InvalidArgument, "{failed:?}");
        assert_eq!(failed.reason(), reason::REQUESTED_IP_UNAVAILABLE);
        assert_eq!(engine.commit_batch(), None);

        let v6_blocks = BlockFilter {
            family: Some(Family::V6),
            ..BlockFilter::default()
        };
        assert!(engine.store().blocks(&v6_blocks).unwrap().is_empty());
        assert!(engine.store().check("net", "b", "eth0").unwrap().is_empty());
        let held = engine.store().check("net", "a", "eth0").unwrap();
        assert_eq!(held.len(), 1, "{held:?}");
    }
}
