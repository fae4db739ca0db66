//! The IPAM engine: one request in, one outcome out, against the store.
//! The daemon runs it for every client; the plugin runs the very same code
//! in-process in direct mode, so both paths share every rule. Outcomes are
//! domain values; `crate::encode` turns them into wire responses at the
//! edge, so the adaptive side can amend them without parsing text.

use std::collections::HashSet;
use std::net::IpAddr;

use crate::cidr::{Bounds, Cidr, Family};
use crate::defaults::DEFAULT_NETWORK;
use crate::names;
use crate::store::Usage;
use crate::store::{
    AddressFilter, Allocation, BlockFilter, BlockState, InForce, Owner, Source, Store, StoreError,
    Table, TakenBack,
};
use crate::wire::admin::v1 as admin;
use crate::wire::envelope::v1 as envelope;
use crate::wire::envelope::v1::UsageRequest;
use crate::wire::ipam;
use crate::wire::{Code, Request, reason, request};

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
    fn invalid(message: impl Into<String>) -> Failure {
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
    pub fn handle(&mut self, request: &Request, now_ms: i64) -> Outcome {
        if let Err(err) = self.store.ensure_file_unchanged() {
            return Failure::from_store("database", &err).into();
        }
        let result = match &request.kind {
            Some(request::Kind::Allocate(req)) => self.allocate(req, now_ms).map(Reply::Allocated),
            Some(request::Kind::Deallocate(req)) => {
                self.deallocate(req, now_ms).map(Reply::Released)
            }
            Some(request::Kind::Check(req)) => self.check(req).map(Reply::Held),
            Some(request::Kind::ListCidrBlocks(req)) => self.list_blocks(req).map(Reply::Table),
            Some(request::Kind::ListIpAddresses(req)) => self.list_addresses(req).map(Reply::Table),
            Some(request::Kind::Health(_)) => self.health().map(Reply::Health),
            Some(request::Kind::Usage(req)) => self.usage(req, now_ms).map(Reply::Usage),
            Some(request::Kind::Gc(req)) => self.gc(req, now_ms).map(Reply::Collected),
            Some(request::Kind::NetworkStatus(req)) => {
                self.network_status(req, now_ms).map(Reply::Readiness)
            }
            None => Err(Failure {
                code: Code::Unimplemented,
                reason: reason::UNKNOWN_REQUEST,
                message: "request carries no known message".to_string(),
                scope: None,
                busy: false,
            }),
        };
        match result {
            Ok(reply) => Outcome::Done(reply),
            Err(failure) => failure.into(),
        }
    }

    /// Handles one request of the daemon's group commit: in a savepoint of
    /// the batch's transaction, kept only when the request succeeded, so a
    /// failed request leaves nothing and never undoes another. Nothing is
    /// durable, so nothing may be answered, before [`Engine::commit_batch`].
    pub fn handle_in_batch(&mut self, request: &Request, now_ms: i64) -> Outcome {
        // Reads take no write lock, as alone: a health probe never waits
        // for another process's writer. In an open batch they see its
        // writes, which is why their answers wait for the commit too.
        if !request.writes() {
            return self.handle(request, now_ms);
        }
        if let Err(err) = self.store.begin_request() {
            return Failure::from_store("database", &err).into();
        }
        let outcome = self.handle(request, now_ms);
        let succeeded = matches!(outcome, Outcome::Done(_));
        match self.store.end_request(succeeded) {
            Ok(()) => outcome,
            Err(err) => Failure::from_store("database", &err).into(),
        }
    }

    /// Handles one request in a write transaction of its own: a batch of
    /// one ([`Engine::handle_in_batch`], then [`Engine::commit_batch`]).
    /// Direct mode and the daemon's retries of parked ADDs serve this way,
    /// so every decision a write takes — laying the network out, its
    /// bounds, the address — is made under one `BEGIN IMMEDIATE` lock on
    /// what is true then, and a failed request leaves nothing, exactly as
    /// in the daemon's group commit. Never called with a batch open.
    pub fn handle_alone(&mut self, request: &Request, now_ms: i64) -> Outcome {
        let outcome = self.handle_in_batch(request, now_ms);
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
    pub fn allocate(
        &mut self,
        req: &ipam::AllocatePodIpRequest,
        now_ms: i64,
    ) -> Result<Allocated, Failure> {
        let network = network_or_default(&req.network)?;
        let configs = [
            (Family::V4, req.ipv4_config.as_ref()),
            (Family::V6, req.ipv6_config.as_ref()),
        ];
        if configs.iter().all(|(_, config)| config.is_none()) {
            return Err(Failure::invalid(
                "both ipv4_config and ipv6_config are missing",
            ));
        }
        require_pod_fields(&req.pod_namespace, &req.pod_name)?;
        let mut reply = Allocated::default();
        // Families this request newly took: only those are undone when a
        // later family fails. What the owner held before (a repeated ADD)
        // stays untouched, whatever this request's outcome.
        let mut taken: Vec<(Family, &ipam::IpConfig)> = Vec::new();
        for (at, (family, config)) in configs.iter().enumerate() {
            let (family, Some(config)) = (*family, *config) else {
                continue;
            };
            // Only a later family's failure undoes this one: without one,
            // the lookup is not needed (the store makes its own).
            let later = configs[at + 1..].iter().any(|(_, later)| later.is_some());
            let held_before = later && self.holds(network, family, config)?;
            match self.allocate_family(network, family, config, req, now_ms) {
                Ok(allocation) => {
                    match family {
                        Family::V4 => reply.ipv4 = Some(allocation),
                        Family::V6 => reply.ipv6 = Some(allocation),
                    }
                    if !held_before {
                        taken.push((family, config));
                    }
                }
                Err(failure) => {
                    for (family, config) in taken {
                        self.roll_back(network, family, config);
                    }
                    return Err(failure);
                }
            }
        }
        // The conflist that served the network last: its GC covers the
        // network after a rename of `ipam.network`.
        self.store
            .note_served_by(network, &req.conf_name)
            .map_err(|err| Failure::from_store(&format!("network {network:?}"), &err))?;
        Ok(reply)
    }

    /// Whether the owner named by `config` already holds a `family` address
    /// in `network` (one indexed read).
    fn holds(
        &self,
        network: &str,
        family: Family,
        config: &ipam::IpConfig,
    ) -> Result<bool, Failure> {
        if config.container_id.is_empty() || config.interface_name.is_empty() {
            return Ok(false);
        }
        let held = self
            .store
            .check(network, &config.container_id, &config.interface_name)
            .map_err(|err| Failure::from_store("allocation lookup failed", &err))?;
        Ok(held
            .iter()
            .any(|allocation| Family::of(allocation.address) == family))
    }

    fn allocate_family(
        &mut self,
        network: &str,
        family: Family,
        config: &ipam::IpConfig,
        req: &ipam::AllocatePodIpRequest,
        now_ms: i64,
    ) -> Result<Allocation, Failure> {
        require_owner(&config.container_id, &config.interface_name)?;
        let in_force = self.ensure_initial_blocks(network, family, config, req.isolated, now_ms)?;
        let in_force = in_force.as_ref();
        let owner = Owner {
            network,
            container_id: &config.container_id,
            interface_name: &config.interface_name,
            pod_name: &req.pod_name,
            pod_namespace: &req.pod_namespace,
        };
        let context = format!(
            "failed to allocate {family} for {}",
            names::describe_owner(&req.pod_namespace, &req.pod_name, &config.container_id)
        );
        if !config.requested_ip.is_empty() {
            let address: IpAddr = config.requested_ip.parse().map_err(|_| {
                Failure::invalid(format!(
                    "requested_ip {:?} is not an IP address",
                    config.requested_ip
                ))
            })?;
            if Family::of(address) != family {
                return Err(Failure::invalid(format!(
                    "requested_ip {address} is not an {family} address"
                )));
            }
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
    fn ensure_initial_blocks(
        &mut self,
        network: &str,
        family: Family,
        config: &ipam::IpConfig,
        isolated: bool,
        now_ms: i64,
    ) -> Result<Option<InForce>, Failure> {
        let ranges = std::iter::once(&config.initial_pod_cidr)
            .filter(|cidr| !cidr.is_empty())
            .chain(config.additional_pod_cidrs.iter())
            .map(|text| {
                let cidr: Cidr = text
                    .parse()
                    .map_err(|err| Failure::invalid(format!("initial pod CIDR: {err}")))?;
                if cidr.family() != family {
                    return Err(Failure::invalid(format!(
                        "initial pod CIDR {cidr} is not an {family} block"
                    )));
                }
                Ok(cidr)
            })
            .collect::<Result<Vec<Cidr>, Failure>>()?;
        if ranges.is_empty() {
            return Ok(None);
        }
        let changes = self
            .store
            .configure(Source::Cni, network, family, &ranges, isolated, now_ms)
            .map_err(|err| Failure::from_store(&format!("ranges of network {network:?}"), &err))?;
        for line in &changes.lines {
            crate::log::info("engine", line, &[("network", &network)]);
        }
        let bounds = range_bounds(family, &ranges, &config.bounds)?;
        let rebounded = self
            .store
            .set_bounds(network, family, &bounds)
            .map_err(|err| Failure::from_store(&format!("ranges of network {network:?}"), &err))?;
        for cidr in &rebounded {
            crate::log::info(
                "engine",
                "usable range or gateway of a block changed",
                &[("network", &network), ("cidr", cidr)],
            );
        }
        Ok(Some(InForce { ranges, bounds }))
    }

    /// Undoes what this request took of `family`. No cooldown: the address
    /// never reached a pod.
    fn roll_back(&mut self, network: &str, family: Family, config: &ipam::IpConfig) {
        if let Err(err) = self.store.roll_back(
            network,
            &config.container_id,
            &config.interface_name,
            family,
        ) {
            crate::log::error(
                "engine",
                "failed to roll back a partial allocation",
                &[
                    ("network", &network),
                    ("container_id", &config.container_id),
                    ("error", &err),
                ],
            );
        }
    }

    pub fn deallocate(
        &mut self,
        req: &ipam::DeallocatePodIpRequest,
        now_ms: i64,
    ) -> Result<Vec<Allocation>, Failure> {
        let network = network_or_default(&req.network)?;
        require_owner(&req.container_id, &req.interface_name)?;
        require_pod_fields(&req.pod_namespace, &req.pod_name)?;
        let released = self
            .store
            .release(network, &req.container_id, &req.interface_name, now_ms)
            .map_err(|err| {
                Failure::from_store(
                    &format!(
                        "failed to deallocate ips for {}",
                        names::describe_owner(&req.pod_namespace, &req.pod_name, &req.container_id)
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
                    ("container_id", &req.container_id),
                    ("interface_name", &req.interface_name),
                ],
            );
        }
        Ok(released.addresses)
    }

    pub fn check(&self, req: &ipam::CheckPodIpRequest) -> Result<Vec<Allocation>, Failure> {
        let network = network_or_default(&req.network)?;
        require_owner(&req.container_id, &req.interface_name)?;
        let allocated = self
            .store
            .check(network, &req.container_id, &req.interface_name)
            .map_err(|err| Failure::from_store("allocation check failed", &err))?;
        if allocated.is_empty() {
            return Err(Failure {
                code: Code::NotFound,
                reason: reason::ALLOCATION_NOT_FOUND,
                message: format!(
                    "no active allocation found for container {} interface {} on network {network}",
                    req.container_id, req.interface_name
                ),
                scope: None,
                busy: false,
            });
        }
        Ok(allocated)
    }

    /// CNI GC: releases the network's allocations whose owners the runtime
    /// no longer lists, sparing those younger than the grace period.
    pub fn gc(
        &mut self,
        req: &envelope::GcRequest,
        now_ms: i64,
    ) -> Result<Vec<Allocation>, Failure> {
        let network = network_or_default(&req.network)?;
        if req.grace_period_ms < 0 {
            return Err(Failure::invalid(format!(
                "grace_period_ms {} is negative",
                req.grace_period_ms
            )));
        }
        let valid: HashSet<(&str, &str)> = req
            .valid
            .iter()
            .map(|a| (a.container_id.as_str(), a.interface_name.as_str()))
            .collect();
        let released = self
            .store
            .gc(
                network,
                &req.conf_name,
                &valid,
                now_ms.saturating_sub(req.grace_period_ms),
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
    pub fn network_status(
        &self,
        req: &envelope::NetworkStatusRequest,
        now_ms: i64,
    ) -> Result<Readiness, Failure> {
        let network = network_or_default(&req.network)?;
        for (family, texts) in [
            (Family::V4, &req.ipv4_ranges),
            (Family::V6, &req.ipv6_ranges),
        ] {
            if texts.is_empty() {
                continue;
            }
            let ranges = texts
                .iter()
                .map(|text| text.parse::<Cidr>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|err| Failure::invalid(format!("range: {err}")))?;
            let bounds = range_bounds(family, &ranges, &req.bounds)?;
            let context = format!("status of network {network:?}");
            let room = self
                .store
                .can_allocate(network, family, &ranges, &bounds, req.isolated, now_ms)
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

    fn list_blocks(&self, req: &admin::ListCidrBlocksRequest) -> Result<Table, Failure> {
        refuse_sql_filter(&req.filter)?;
        let filter = BlockFilter {
            network: non_empty(&req.network),
            state: parse_state(&req.state)?,
            family: parse_family(&req.ip_family)?,
        };
        self.store
            .list_blocks(&filter)
            .map_err(|err| Failure::from_store("failed to list CIDR blocks", &err))
    }

    fn list_addresses(&self, req: &admin::ListIpAddressesRequest) -> Result<Table, Failure> {
        refuse_sql_filter(&req.filter)?;
        let filter = AddressFilter {
            network: non_empty(&req.network),
            state: parse_state(&req.state)?,
            family: parse_family(&req.ip_family)?,
            container_id: non_empty(&req.container_id),
            allocated: req.allocated,
        };
        self.store
            .list_addresses(&filter)
            .map_err(|err| Failure::from_store("failed to list IP addresses", &err))
    }

    /// Usage of every network (or the one asked for) and family that has
    /// non-Deleting blocks.
    fn usage(&self, req: &UsageRequest, now_ms: i64) -> Result<Vec<NetworkUsage>, Failure> {
        let families = match parse_family(&req.ip_family)? {
            Some(family) => vec![family],
            None => vec![Family::V4, Family::V6],
        };
        let failed = |err: StoreError| Failure::from_store("failed to compute usage", &err);
        let mut usage = Vec::new();
        for network in self.store.networks().map_err(failed)? {
            if !req.network.is_empty() && req.network != network {
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

/// The request's network, or the default; refused unless it meets the
/// bounds the plugin applies to `name` and `ipam.network` ([`names`]).
fn network_or_default(network: &str) -> Result<&str, Failure> {
    if network.is_empty() {
        return Ok(DEFAULT_NETWORK);
    }
    names::network(network).map_err(|err| Failure::invalid(format!("invalid network {err}")))?;
    Ok(network)
}

/// The plugin's edge bounds ([`names`]), applied again here: a client that
/// bypasses the plugin must not store an owner no DEL could name.
fn require_owner(container_id: &str, interface_name: &str) -> Result<(), Failure> {
    names::container_id(container_id)
        .map_err(|err| Failure::invalid(format!("invalid container_id {err}")))?;
    names::interface(interface_name)
        .map_err(|err| Failure::invalid(format!("invalid interface_name {err}")))
}

/// Pod name and namespace only label rows and messages; bounded all the same.
fn require_pod_fields(namespace: &str, pod: &str) -> Result<(), Failure> {
    for (field, value) in [("pod_namespace", namespace), ("pod_name", pod)] {
        names::pod_field(value)
            .map_err(|err| Failure::invalid(format!("invalid {field} {err}")))?;
    }
    Ok(())
}

/// Upstream's admin requests carried a raw SQL WHERE clause. Metis never
/// runs caller text as SQL; answering with the unfiltered table would look
/// like an answer to the question asked, so the request is refused.
fn refuse_sql_filter(filter: &str) -> Result<(), Failure> {
    if filter.is_empty() {
        return Ok(());
    }
    Err(Failure::invalid(
        "the raw SQL `filter` of upstream's admin API is not supported; \
         use the typed fields network, state, ip_family, container_id and allocated",
    ))
}

fn non_empty(text: &str) -> Option<String> {
    (!text.is_empty()).then(|| text.to_string())
}

fn parse_state(text: &str) -> Result<Option<BlockState>, Failure> {
    if text.is_empty() {
        return Ok(None);
    }
    BlockState::parse(text).map(Some).ok_or_else(|| {
        Failure::invalid(format!(
            "unknown block state {text:?} (Ready, Draining, Deleting or Withheld)"
        ))
    })
}

fn parse_family(text: &str) -> Result<Option<Family>, Failure> {
    if text.is_empty() {
        return Ok(None);
    }
    Family::parse(text)
        .map(Some)
        .ok_or_else(|| Failure::invalid(format!("unknown IP family {text:?} (ipv4 or ipv6)")))
}

/// The request's host-local bounds, each checked as the plugin checks it
/// (the wire is not trusted): of a range of the request, canonical.
fn range_bounds(
    family: Family,
    ranges: &[Cidr],
    wire: &[ipam::RangeBounds],
) -> Result<Vec<(Cidr, Bounds)>, Failure> {
    wire.iter()
        .map(|entry| {
            let cidr: Cidr = entry
                .subnet
                .parse()
                .map_err(|err| Failure::invalid(format!("range bounds: {err}")))?;
            if cidr.family() != family || !ranges.contains(&cidr) {
                return Err(Failure::invalid(format!(
                    "range bounds of {cidr}: not an {family} range of the request"
                )));
            }
            let ip = |text: &str| -> Result<IpAddr, Failure> {
                text.parse().map_err(|_| {
                    Failure::invalid(format!(
                        "range bounds of {cidr}: {text:?} is not an address"
                    ))
                })
            };
            let bounds = Bounds::new(
                &cidr,
                Some(ip(&entry.range_start)?),
                Some(ip(&entry.range_end)?),
                Some(ip(&entry.gateway)?),
            )
            .map_err(|err| Failure::invalid(format!("range bounds of {cidr}: {err}")))?;
            Ok((cidr, bounds))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::TempDir;

    fn config(container: &str, cidr: &str) -> Option<ipam::IpConfig> {
        Some(ipam::IpConfig {
            interface_name: "eth0".into(),
            container_id: container.into(),
            initial_pod_cidr: cidr.into(),
            ..Default::default()
        })
    }

    fn request(container: &str, v4: &str, v6: &str) -> ipam::AllocatePodIpRequest {
        ipam::AllocatePodIpRequest {
            network: "net".into(),
            ipv4_config: (!v4.is_empty()).then(|| config(container, v4)).flatten(),
            ipv6_config: (!v6.is_empty()).then(|| config(container, v6)).flatten(),
            pod_name: "p".into(),
            pod_namespace: "ns".into(),
            isolated: false,
            conf_name: String::new(),
        }
    }

    #[test]
    fn bounds_from_the_wire_are_checked_and_applied() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store_with_cooldown(60_000));
        let now = crate::log::now_ms();
        let bounded = |container: &str, subnet: &str, start: &str, end: &str, gateway: &str| {
            let mut wanted = request(container, "198.18.0.0/24", "");
            if let Some(c) = wanted.ipv4_config.as_mut() {
                c.bounds = vec![ipam::RangeBounds {
                    subnet: subnet.into(),
                    range_start: start.into(),
                    range_end: end.into(),
                    gateway: gateway.into(),
                }];
            }
            wanted
        };
        let hostile = [
            ("198.18.9.0/24", "198.18.9.10", "198.18.9.20", "198.18.9.1"),
            ("2001:db8::/64", "2001:db8::1", "2001:db8::2", "2001:db8::1"),
            ("nope", "198.18.0.10", "198.18.0.20", "198.18.0.1"),
            ("198.18.0.0/24", "", "198.18.0.20", "198.18.0.1"),
            ("198.18.0.0/24", "198.18.0.30", "198.18.0.20", "198.18.0.1"),
            ("198.18.0.0/24", "198.18.1.30", "198.18.0.20", "198.18.0.1"),
            ("198.18.0.0/24", "198.18.0.10", "198.18.0.20", "2001:db8::1"),
        ];
        for (subnet, start, end, gateway) in hostile {
            let failure = engine
                .allocate(&bounded("h", subnet, start, end, gateway), now)
                .unwrap_err();
            assert_eq!(
                failure.code,
                Code::InvalidArgument,
                "{subnet} {start} {end} {gateway}"
            );
        }
        let got = engine
            .allocate(
                &bounded(
                    "a",
                    "198.18.0.0/24",
                    "198.18.0.10",
                    "198.18.0.20",
                    "198.18.0.10",
                ),
                now,
            )
            .unwrap();
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
        let mut repeat = request("a", "198.18.0.0/24", "2001:db8::/120");
        if let Some(c) = repeat.ipv6_config.as_mut() {
            c.requested_ip = "2001:db8:1::9".into();
        }
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
        let asking = |container: &str| {
            let mut wanted = request(container, "198.18.0.0/24", "");
            if let Some(c) = wanted.ipv4_config.as_mut() {
                c.requested_ip = "198.18.0.2".into();
            }
            wanted
        };
        engine
            .allocate(&request("a", "198.18.0.0/24", ""), now)
            .unwrap();
        engine
            .deallocate(
                &ipam::DeallocatePodIpRequest {
                    network: "net".into(),
                    container_id: "a".into(),
                    interface_name: "eth0".into(),
                    ..Default::default()
                },
                now,
            )
            .unwrap();
        assert_eq!(
            engine.allocate(&asking("b"), now).unwrap_err().reason,
            reason::REQUESTED_IP_UNAVAILABLE,
            "another container waits out the cooldown"
        );
        let back = engine.allocate(&asking("a"), now).unwrap();
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
        let add = |container: &str| Request {
            kind: Some(request::Kind::Allocate(request(
                container,
                "",
                "2001:db8::1/128",
            ))),
        };
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
    fn requested_addresses_and_bad_requests() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store());
        let now = crate::log::now_ms();
        let mut wanted = request("a", "198.18.0.0/24", "");
        if let Some(c) = wanted.ipv4_config.as_mut() {
            c.requested_ip = "198.18.0.77".into();
        }
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
        let mut taken = request("b", "198.18.0.0/24", "");
        if let Some(c) = taken.ipv4_config.as_mut() {
            c.requested_ip = "198.18.0.77".into();
        }
        assert_eq!(
            engine.allocate(&taken, now).unwrap_err().reason,
            reason::REQUESTED_IP_UNAVAILABLE
        );
        for bad in ["not-an-ip", "2001:db8::1"] {
            let mut wrong = request("c", "198.18.0.0/24", "");
            if let Some(c) = wrong.ipv4_config.as_mut() {
                c.requested_ip = bad.into();
            }
            assert_eq!(
                engine.allocate(&wrong, now).unwrap_err().code,
                Code::InvalidArgument,
                "{bad}"
            );
        }
        let wrong_family = request("d", "2001:db8::/64", "");
        assert_eq!(
            engine.allocate(&wrong_family, now).unwrap_err().code,
            Code::InvalidArgument
        );
        let host_bits = request("e", "198.18.0.1/24", "");
        assert_eq!(
            engine.allocate(&host_bits, now).unwrap_err().code,
            Code::InvalidArgument
        );
    }

    #[test]
    fn a_request_alone_decides_in_one_transaction_and_a_failed_one_leaves_nothing() {
        let dir = TempDir::new();
        let mut engine = Engine::new(dir.store());
        let now = crate::log::now_ms();
        let add = |req| Request {
            kind: Some(request::Kind::Allocate(req)),
        };
        let held = engine.handle_alone(&add(request("a", "198.18.0.0/24", "")), now);
        assert_eq!(held.into_response().code(), Code::Ok);
        // The range moves (a block added, the old one retired) and the
        // IPv4 address is taken before the IPv6 request fails.
        let mut failing = request("b", "198.18.1.0/24", "2001:db8::/64");
        if let Some(config) = failing.ipv6_config.as_mut() {
            config.requested_ip = "2001:db8:1::1".into();
        }
        let before = engine.store().blocks(&BlockFilter::default()).unwrap();
        let failed = engine.handle_alone(&add(failing), now).into_response();
        assert_eq!(failed.reason(), reason::REQUESTED_IP_UNAVAILABLE);
        assert_eq!(
            engine.store().blocks(&BlockFilter::default()).unwrap(),
            before
        );
        assert!(engine.store().check("net", "b", "eth0").unwrap().is_empty());
        // Nothing is left open: the next request commits on its own.
        let next = engine.handle_alone(&add(request("c", "198.18.0.0/24", "")), now);
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
        let add = |req| Request {
            kind: Some(request::Kind::Allocate(req)),
        };
        let first = engine.handle_in_batch(&add(request("a", "198.18.0.0/24", "")), now);
        assert_eq!(first.into_response().code(), Code::Ok);
        // Its IPv6 range is new, so this request adds that block before its
        // requested address turns out to lie outside it.
        let mut failing = request("b", "198.18.0.0/24", "2001:db8::/64");
        if let Some(config) = failing.ipv6_config.as_mut() {
            config.requested_ip = "2001:db8:1::1".into();
        }
        let failed = engine.handle_in_batch(&add(failing), now).into_response();
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
