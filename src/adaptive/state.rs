//! The adaptive side as the daemon's loop runs it: parked requests
//! waiting for addresses, events from the Kubernetes threads, and the
//! periodic monitor pass. Nothing here blocks: HTTP happens on the kube
//! threads, and every store change happens here, on the loop.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cluster::{Applied, Cluster};
use super::monitor::{self, MonitorConfig};
use crate::cidr::Family;
use crate::engine::request::{Command, Del};
use crate::engine::{Engine, Failure, Outcome, Readiness, Reply};
use crate::kube::nnc::{Kind, QuotaEnd};
use crate::kube::worker::{self, KubeEvent, KubeLink};
use crate::log;
use crate::metrics::Metrics;
use crate::wire::{Code, reason};

/// Settings of the adaptive side.
#[derive(Debug, Clone)]
pub struct AdaptiveConfig {
    /// NodeNetworkConfig (scale up and down) or Node podCIDRs (fixed).
    pub source: Kind,
    /// The network that Node podCIDRs are added to.
    pub node_network: String,
    pub monitor: MonitorConfig,
    pub monitor_interval: Duration,
    /// How long a request waits for new blocks before it is told the pool
    /// is exhausted (upstream's 9 s, under the runtime's 10 s).
    pub pending_timeout: Duration,
}

/// Retry a little after a cooling address's release time, not before it
/// (clock rounding would otherwise make the retry miss by a millisecond).
const COOLED_MARGIN: Duration = Duration::from_millis(5);

/// An outcome owed to a connection.
pub type Delivery = (u64, Outcome);

struct Parked {
    conn_id: u64,
    command: Command,
    network: String,
    parked_at: Instant,
    deadline: Instant,
}

pub struct Adaptive {
    link: KubeLink,
    metrics: Arc<Metrics>,
    config: AdaptiveConfig,
    /// What the cluster grants, as last applied.
    cluster: Cluster,
    /// Why changes from the cluster do not reach us (cleared when a watch
    /// is open again, not by any one successful request).
    watch_problem: Option<String>,
    /// Why our requests for more addresses do not reach the cluster
    /// (cleared by a patch that is applied).
    patch_problem: Option<String>,
    parked: Vec<Parked>,
    /// Networks whose waiters should be retried (addresses were released).
    woken: Vec<String>,
    /// When a cooling address of a network with waiters comes free: its
    /// waiters are retried then, before any new block arrives.
    cooling_wake: BTreeMap<String, Instant>,
    /// Parked ADDs cancelled by a DEL of their owner, answered next round.
    cancelled: Vec<Delivery>,
    next_pass: Instant,
    /// The resource version a patch is in flight for: no second patch is
    /// computed from the same version until the first one is answered.
    patching: Option<String>,
    /// The cluster's last QuotaExceeded answer: the demand it refused
    /// (pods per network) and why. It stands while the demand is no
    /// larger and no other answer came.
    refused: Option<Refusal>,
}

/// The cluster's QuotaExceeded answer to a demand.
struct Refusal {
    /// The demand refused: pods per network.
    asked: Vec<(String, i64)>,
    why: String,
    /// When a released block comes free (the refusal ends then).
    until: QuotaEnd,
}

impl Refusal {
    /// The refusal that stands once the newest copy `nnc` is read: its own
    /// QuotaExceeded for its current generation replaces `before`; a
    /// QuotaExceeded of an older generation keeps `before` (it answered a
    /// demand this node still has, or a larger one); any other answer, or
    /// none (a cleared condition), ends it.
    fn after(before: Option<Refusal>, nnc: &crate::kube::nnc::Nnc) -> Option<Refusal> {
        match (&nnc.quota_exceeded, nnc.ready_reason.as_deref()) {
            (Some(why), _) => Some(Refusal {
                asked: nnc.allocations.clone(),
                why: why.clone(),
                until: nnc.quota_until,
            }),
            (None, Some(crate::kube::nnc::QUOTA_EXCEEDED)) => before,
            (None, _) => None,
        }
    }

    /// Whether it answers the demand `asked` (no network asks more pods
    /// than were refused) and has not ended at `now_ms`.
    fn stands(&self, asked: &[(String, i64)], now_ms: i64) -> bool {
        self.until.stands_at(now_ms)
            && asked.iter().all(|(network, pods)| {
                self.asked
                    .iter()
                    .any(|(n, most)| n == network && pods <= most)
            })
    }
}

impl Adaptive {
    pub fn new(
        link: KubeLink,
        config: AdaptiveConfig,
        metrics: Arc<Metrics>,
        now: Instant,
    ) -> Adaptive {
        Adaptive {
            link,
            metrics,
            cluster: Cluster::new(config.source, &config.node_network),
            config,
            watch_problem: None,
            patch_problem: None,
            parked: Vec::new(),
            woken: Vec::new(),
            cooling_wake: BTreeMap::new(),
            cancelled: Vec::new(),
            next_pass: now,
            patching: None,
            refused: None,
        }
    }

    pub fn wake_fd(&self) -> BorrowedFd<'_> {
        self.link.wake_fd.as_fd()
    }

    /// When `tick` next has work: a parked deadline, the monitor pass, a
    /// cooling address waiters wait for, or the end of the cooldown of a
    /// taken-back block no pod holds.
    pub fn next_deadline(&self) -> Option<Instant> {
        let parked = self.parked.iter().map(|p| p.deadline).min();
        let pass = (self.config.source == Kind::Nnc).then_some(self.next_pass);
        let cooling = self.cooling_wake.values().min().copied();
        let sweep = self.cluster.next_sweep_ms().map(|at_ms| {
            let wait = u64::try_from(at_ms.saturating_sub(log::now_ms())).unwrap_or(0);
            Instant::now() + Duration::from_millis(wait) + COOLED_MARGIN
        });
        parked
            .into_iter()
            .chain(pass)
            .chain(cooling)
            .chain(sweep)
            .min()
    }

    /// Parked requests of a network (the monitor's "pending").
    pub fn pending(&self, network: &str) -> i64 {
        let count = self.parked.iter().filter(|p| p.network == network).count();
        i64::try_from(count).unwrap_or(i64::MAX)
    }

    /// Looks at an outcome before it is sent: an IPv4 exhaustion with a
    /// cluster that can add blocks parks the request (returns `None`); a
    /// successful release wakes waiters; health and STATUS report what the
    /// cluster link allows. Every request kind is named (no wildcard): a new
    /// one decides here whether the adaptive side must see it.
    pub fn intercept(
        &mut self,
        conn_id: u64,
        command: Command,
        outcome: Outcome,
        now: Instant,
    ) -> Option<Outcome> {
        match &command {
            Command::Add(_) => match outcome {
                Outcome::Exhausted {
                    network,
                    family: Family::V4,
                    ..
                } if self.config.source == Kind::Nnc => match self.quota_exceeded() {
                    // The cluster already said no to this very demand.
                    Some(why) => Some(Outcome::Exhausted {
                        message: quota_message(&network, &why),
                        network,
                        family: Family::V4,
                    }),
                    None => {
                        self.park(conn_id, command, network, now);
                        None
                    }
                },
                other => Some(other),
            },
            Command::Del(del) => {
                self.cancel_parked(del, now);
                if matches!(&outcome, Outcome::Done(Reply::Released(released)) if !released.is_empty())
                {
                    self.woken.push(del.network.clone());
                }
                Some(outcome)
            }
            Command::Health => Some(self.annotate_health(outcome)),
            Command::Status(_) => Some(self.status_with_cluster(outcome)),
            Command::Check(_)
            | Command::ListBlocks(_)
            | Command::ListAddresses(_)
            | Command::Usage(_)
            | Command::Gc(_) => Some(outcome),
        }
    }

    /// A DEL overtook its owner's parked ADD: the ADD must not allocate
    /// after the DEL has returned, so it is taken out of the queue before
    /// the DEL is answered and told why.
    fn cancel_parked(&mut self, del: &Del, now: Instant) {
        let network = del.network.as_str();
        let (cancelled, waiting): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|p| p.network == network && same_owner(&p.command, del));
        self.parked = waiting;
        if cancelled.is_empty() {
            return;
        }
        self.publish_parked();
        for parked in cancelled {
            log::info(
                "daemon",
                "DEL arrived for a waiting ADD; cancelling the ADD",
                &[
                    ("network", &network),
                    ("container", &del.owner.container_id()),
                ],
            );
            let reply = Outcome::Failed(Failure {
                code: Code::Unavailable,
                reason: reason::ADD_CANCELLED,
                message: format!(
                    "ADD cancelled: a DEL for container {} arrived while it waited for addresses",
                    del.owner.container_id()
                ),
                scope: None,
                busy: false,
            });
            self.observe(&parked, reply.code(), now);
            self.cancelled.push((parked.conn_id, reply));
        }
    }

    fn park(&mut self, conn_id: u64, command: Command, network: String, now: Instant) {
        log::info(
            "daemon",
            "Local store IP exhaustion detected, requesting scale up",
            &[("network", &network), ("conn", &conn_id)],
        );
        self.parked.push(Parked {
            conn_id,
            command,
            network,
            parked_at: now,
            deadline: now + self.config.pending_timeout,
        });
        self.publish_parked();
        self.next_pass = now;
    }

    /// STATUS with the cluster in view: an exhausted IPv4 pool can still
    /// grow while the API server answers (an ADD waits for the new block),
    /// and cannot while it is unreachable — the degraded state, reported.
    fn status_with_cluster(&self, mut outcome: Outcome) -> Outcome {
        if self.config.source != Kind::Nnc {
            return outcome;
        }
        if let Outcome::Done(Reply::Readiness(readiness)) = &mut outcome
            && let Readiness::Full {
                family: Family::V4,
                cluster_problem,
                ..
            } = readiness
        {
            match self.problem() {
                None => *readiness = Readiness::Ready,
                Some(why) => *cluster_problem = Some(why),
            }
        }
        outcome
    }

    /// Every failure that stops the node from growing, in words.
    fn problem(&self) -> Option<String> {
        let quota = self
            .quota_exceeded()
            .map(|why| format!("the cluster has no block for this node: {why}"));
        let problems: Vec<&String> = [&self.watch_problem, &self.patch_problem, &quota]
            .into_iter()
            .flatten()
            .collect();
        (!problems.is_empty()).then(|| {
            problems
                .iter()
                .map(|p| p.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        })
    }

    /// The cluster's QuotaExceeded answer to the demand this node has now
    /// (no patch of a newer one in flight), if it gave one.
    fn quota_exceeded(&self) -> Option<String> {
        if self.patching.is_some() {
            return None;
        }
        let refusal = self.refused.as_ref()?;
        let asked = &self.cluster.latest()?.allocations;
        refusal
            .stands(asked, log::now_ms())
            .then(|| refusal.why.clone())
    }

    /// Remembers the answer the newest copy carries. Not the copy an event
    /// brought: a PATCH's response can arrive after the watch delivered the
    /// controller's answer to that patch, and its older Ready condition
    /// must not erase the refusal (the ADDs would wait out --scale-up-wait).
    fn note_latest_answer(&mut self) {
        if let Some(nnc) = self.cluster.latest().cloned() {
            self.note_answer(&nnc);
        }
    }

    /// Remembers the cluster's answer a copy carries.
    fn note_answer(&mut self, nnc: &crate::kube::nnc::Nnc) {
        self.refused = Refusal::after(self.refused.take(), nnc);
    }

    fn annotate_health(&self, mut outcome: Outcome) -> Outcome {
        if let Outcome::Done(Reply::Health(health)) = &mut outcome {
            health.cluster_problem = self.problem();
            health.not_granted = self.cluster.not_granted();
        }
        outcome
    }

    /// Handles everything the kube threads sent since the last wake-up,
    /// then retries the waiters of every network that gained blocks.
    pub fn on_wake(&mut self, engine: &mut Engine, now: Instant) -> Vec<Delivery> {
        worker::drain_wakeups(&self.link.wake_fd);
        let mut grown = Vec::new();
        while let Ok(event) = self.link.events.try_recv() {
            grown.extend(self.on_event(event, engine, now));
        }
        grown.dedup();
        let mut deliveries = Vec::new();
        if let Some(why) = self.quota_exceeded() {
            // Waiting out --scale-up-wait would only delay the same answer.
            let refused = self.give_up(|_| true, &why, now);
            if !refused.is_empty() {
                log::warn(
                    "daemon",
                    "the cluster has no block for this node; failing waiting ADDs now",
                    &[("reason", &why), ("requests", &refused.len())],
                );
            }
            deliveries.extend(refused.into_iter().map(|(conn, outcome)| match outcome {
                Outcome::Exhausted {
                    network, family, ..
                } => (
                    conn,
                    Outcome::Exhausted {
                        message: quota_message(&network, &why),
                        network,
                        family,
                    },
                ),
                other => (conn, other),
            }));
        }
        for network in grown {
            log::info(
                "daemon",
                "Woken up by CIDR watcher, retrying local allocation",
                &[("network", &network)],
            );
            deliveries.extend(self.retry(&network, engine));
        }
        deliveries
    }

    /// One event of the kube threads; returns the networks that gained
    /// blocks.
    fn on_event(&mut self, event: KubeEvent, engine: &mut Engine, now: Instant) -> Vec<String> {
        let store = engine.store_mut();
        let applied = match event {
            KubeEvent::Nnc { nnc, epoch } => {
                let applied = self.cluster.on_nnc(store, &self.metrics, nnc, epoch);
                self.note_latest_answer();
                applied
            }
            KubeEvent::Node { node, epoch } => {
                self.cluster.on_node(store, &self.metrics, node, epoch)
            }
            KubeEvent::Gone { epoch } => {
                self.refused = None;
                self.cluster.on_gone(store, &self.metrics, epoch)
            }
            KubeEvent::Patched { base, nnc } => {
                self.patching = None;
                self.patch_problem = None;
                log::info("daemon", "Successfully patched NodeNetworkConfig", &[]);
                let applied = self.cluster.on_answer(store, &self.metrics, &base, *nnc);
                self.note_latest_answer();
                applied
            }
            KubeEvent::Refetched { base, nnc, streak } => {
                self.on_conflict(streak, now);
                let applied = self.cluster.on_answer(store, &self.metrics, &base, *nnc);
                self.note_latest_answer();
                applied
            }
            KubeEvent::Replayed => {
                self.metrics.stale_version();
                return Vec::new();
            }
            KubeEvent::Unreachable(why) => {
                self.metrics.api_error();
                self.watch_problem = Some(format!("watch: {why}"));
                return Vec::new();
            }
            KubeEvent::Watching => {
                self.watch_problem = None;
                return Vec::new();
            }
            KubeEvent::Conflict { streak } => {
                self.on_conflict(streak, now);
                return Vec::new();
            }
            KubeEvent::PatchFailed(why) => {
                // The patcher logged it and waits before the next one.
                self.metrics.api_error();
                self.patching = None;
                self.patch_problem = Some(format!("patch: {why}"));
                return Vec::new();
            }
        };
        self.publish_serving(engine);
        self.take(applied)
    }

    /// Hands the blocks this node serves now to the watch thread, which
    /// creates the NodeNetworkConfig with them if it must (again).
    fn publish_serving(&self, engine: &Engine) {
        match monitor::serving(engine.store()) {
            Ok(cidrs) => self.link.set_serving(monitor::serving_text(&cidrs)),
            Err(err) => log::error(
                "daemon",
                "reading the blocks this node serves failed",
                &[("error", &err)],
            ),
        }
    }

    /// Takes in what applying a copy did: a new object, from which no
    /// in-flight patch was computed; returns the networks to retry.
    fn take(&mut self, applied: Applied) -> Vec<String> {
        if applied.new_object {
            self.patching = None;
        }
        applied.grown
    }

    /// A patch lost a race: it is decided again now from the copy there is
    /// (the one read after the 409, or the watch's if the read failed; the
    /// patcher paces what is sent).
    fn on_conflict(&mut self, streak: u32, now: Instant) {
        self.patching = None;
        self.next_pass = now;
        if streak >= worker::CONFLICT_STORM {
            self.metrics.api_error();
            self.patch_problem = Some(format!("patch: {streak} conflicts in a row"));
        }
    }

    /// Retries waiters of networks where addresses were just released
    /// (upstream leaves them waiting for a block that may never come).
    /// Also answers the ADDs cancelled by a DEL.
    pub fn retry_woken(&mut self, engine: &mut Engine) -> Vec<Delivery> {
        let mut deliveries = std::mem::take(&mut self.cancelled);
        if !self.woken.is_empty() {
            // A DEL may have freed the last address of a taken-back block.
            self.cluster.refresh(engine.store_mut(), &self.metrics);
        }
        let mut networks = std::mem::take(&mut self.woken);
        networks.sort();
        networks.dedup();
        for network in &networks {
            deliveries.extend(self.retry(network, engine));
        }
        deliveries
    }

    /// Answers parked requests whose time is up, deletes taken-back blocks
    /// whose cooldown ended, and runs the monitor pass when due.
    pub fn tick(&mut self, engine: &mut Engine, now: Instant) -> Vec<Delivery> {
        let mut deliveries = self.give_up(|p| p.deadline <= now, "timed out waiting", now);
        deliveries.extend(self.retry_cooled(engine, now));
        if self
            .cluster
            .next_sweep_ms()
            .is_some_and(|at_ms| at_ms <= log::now_ms())
        {
            self.cluster.refresh(engine.store_mut(), &self.metrics);
        }
        if self.config.source == Kind::Nnc && now >= self.next_pass {
            self.run_pass(engine, now);
        }
        deliveries
    }

    /// Retries the waiters of networks whose first cooling address is free
    /// now, and schedules the next such retry for every network that still
    /// has waiters.
    fn retry_cooled(&mut self, engine: &mut Engine, now: Instant) -> Vec<Delivery> {
        let due: Vec<String> = self
            .cooling_wake
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(network, _)| network.clone())
            .collect();
        let mut deliveries = Vec::new();
        for network in due {
            self.cooling_wake.remove(&network);
            deliveries.extend(self.retry(&network, engine));
        }
        // Read both clocks together: release times are wall-clock ms.
        let (instant, now_ms) = (Instant::now(), log::now_ms());
        let mut waiting: Vec<String> = self.parked.iter().map(|p| p.network.clone()).collect();
        waiting.sort();
        waiting.dedup();
        self.cooling_wake
            .retain(|network, _| waiting.contains(network));
        for network in waiting {
            if self.cooling_wake.contains_key(&network) {
                continue;
            }
            match engine.store().cooling(&network, Family::V4, now_ms, now_ms) {
                Ok(cooling) => {
                    if let Some(first) = cooling.first_free_ms {
                        let wait = u64::try_from(first.saturating_sub(now_ms)).unwrap_or(0);
                        log::debug(
                            "daemon",
                            "waiters retry when a cooling address comes free",
                            &[("network", &network), ("in_ms", &wait)],
                        );
                        self.cooling_wake.insert(
                            network,
                            instant + Duration::from_millis(wait) + COOLED_MARGIN,
                        );
                    }
                }
                Err(err) => log::warn(
                    "daemon",
                    "cannot read cooling addresses",
                    &[("network", &network), ("error", &err)],
                ),
            }
        }
        deliveries
    }

    /// Answers every parked request at shutdown, so its plugin reports a
    /// clean "try again later" instead of a dropped connection.
    pub fn shutdown(&mut self, now: Instant) -> Vec<Delivery> {
        self.give_up(|_| true, "the daemon stopped while waiting", now)
    }

    /// Answers the parked requests matching `which` with exhaustion.
    fn give_up(
        &mut self,
        which: impl Fn(&Parked) -> bool,
        why: &str,
        now: Instant,
    ) -> Vec<Delivery> {
        let (done, waiting): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|p| which(p));
        self.parked = waiting;
        if done.is_empty() {
            return Vec::new();
        }
        self.publish_parked();
        done.into_iter()
            .map(|parked| {
                self.observe(&parked, Code::ResourceExhausted, now);
                let message = format!(
                    "no available IPs in store for network {} ({why} {} s for new blocks)",
                    parked.network,
                    now.saturating_duration_since(parked.parked_at).as_secs()
                );
                let reply = Outcome::Exhausted {
                    network: parked.network,
                    family: Family::V4,
                    message,
                };
                (parked.conn_id, reply)
            })
            .collect()
    }

    /// Drops the parked requests of a connection that went away.
    pub fn forget(&mut self, conn_id: u64) {
        let before = self.parked.len();
        self.parked.retain(|p| p.conn_id != conn_id);
        if self.parked.len() != before {
            self.publish_parked();
        }
    }

    fn run_pass(&mut self, engine: &mut Engine, now: Instant) {
        self.next_pass = now + self.config.monitor_interval;
        // Waiters are also retried every pass, so none waits past a free
        // address whatever freed it (a missed wake-up costs one interval).
        self.woken
            .extend(self.parked.iter().map(|p| p.network.clone()));
        self.cluster.refresh(engine.store_mut(), &self.metrics);
        let Some(nnc) = self.cluster.latest() else {
            self.publish_serving(engine);
            return;
        };
        if self.patching.as_deref() == Some(nnc.meta.resource_version.as_str()) {
            return;
        }
        let pending = |network: &str| self.pending(network);
        let outcome = monitor::pass(
            engine.store_mut(),
            nnc,
            &pending,
            self.config.monitor,
            log::now_ms(),
        );
        let version = nnc.meta.resource_version.clone();
        match outcome {
            Ok(outcome) => {
                for (action, network) in &outcome.actions {
                    self.metrics.monitor_action(action, network);
                }
                self.link
                    .set_serving(monitor::serving_text(&outcome.serving));
                match outcome.patch {
                    Some(patch) => {
                        self.cluster.patch_sent(&version);
                        self.patching = Some(version);
                        self.link.patch(patch);
                    }
                    None => log::trace(
                        "monitor",
                        "pass complete, nothing to change",
                        &[("version", &version)],
                    ),
                }
            }
            Err(err) => log::error("daemon", "monitor pass failed", &[("error", &err)]),
        }
    }

    /// Retries the waiters of a network in arrival order until one still
    /// finds no address.
    fn retry(&mut self, network: &str, engine: &mut Engine) -> Vec<Delivery> {
        let mut deliveries = Vec::new();
        while let Some(index) = self.parked.iter().position(|p| p.network == network) {
            let Some(parked) = self.parked.get(index) else {
                break;
            };
            let outcome = engine.handle_alone(&parked.command, log::now_ms());
            if let Outcome::Exhausted {
                family: Family::V4, ..
            } = outcome
            {
                log::debug(
                    "daemon",
                    "retried a waiting request; still no address",
                    &[("network", &network)],
                );
                break;
            }
            let parked = self.parked.remove(index);
            self.observe(&parked, outcome.code(), Instant::now());
            deliveries.push((parked.conn_id, outcome));
        }
        self.publish_parked();
        deliveries
    }

    /// Records a parked request's outcome, its latency including the wait.
    fn observe(&self, parked: &Parked, code: Code, now: Instant) {
        self.metrics.observe_request(
            "allocate",
            code.as_str_name(),
            now.saturating_duration_since(parked.parked_at),
        );
    }

    /// Publishes the parked counts per network for metrics.
    fn publish_parked(&self) {
        let mut counts: BTreeMap<String, i64> = BTreeMap::new();
        for parked in &self.parked {
            *counts.entry(parked.network.clone()).or_default() += 1;
        }
        self.metrics.set_parked(counts);
    }
}

/// An exhausted ADD's message when the cluster refused more blocks.
fn quota_message(network: &str, why: &str) -> String {
    format!(
        "no available IPs in store for network {network}, and the cluster has no block for this node (QuotaExceeded: {why})"
    )
}

/// Whether a parked request is an ADD of the DEL's owner (container and
/// interface, either family).
fn same_owner(parked: &Command, del: &Del) -> bool {
    let Command::Add(add) = parked else {
        return false;
    };
    add.families()
        .into_iter()
        .filter_map(|(_, part)| part)
        .any(|part| part.owner == del.owner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::nnc::{Nnc, QUOTA_EXCEEDED, QUOTA_UNTIL};
    use serde_json::{Value, json};

    const NOW: i64 = 1_796_126_400_000;

    /// A copy of generation `generation` asking `pods`, whose Ready
    /// condition is `ready` (reason, observedGeneration, message).
    fn copy(generation: i64, pods: i64, ready: Option<(&str, i64, &str)>) -> Nnc {
        let conditions: Vec<Value> = ready
            .map(|(reason, observed, message)| {
                json!({"type": "Ready", "status": if reason == QUOTA_EXCEEDED { "False" } else { "True" },
                       "reason": reason, "observedGeneration": observed, "message": message})
            })
            .into_iter()
            .collect();
        Nnc::parse(&json!({
            "metadata": {"generation": generation, "resourceVersion": generation.to_string()},
            "spec": {"allocations": [{"network": "default", "pods": pods}]},
            "status": {"conditions": conditions},
        }))
    }

    fn asked(pods: i64) -> Vec<(String, i64)> {
        vec![("default".to_string(), pods)]
    }

    #[test]
    fn a_refusal_of_the_current_demand_fails_waiting_adds_at_once() {
        let refused = Refusal::after(
            None,
            &copy(3, 20, Some((QUOTA_EXCEEDED, 3, "pool p has no free block"))),
        )
        .expect("a refusal of this generation");
        assert_eq!(refused.why, "pool p has no free block");
        assert!(refused.stands(&asked(20), NOW));
        assert!(
            refused.stands(&asked(16), NOW),
            "a smaller demand is refused too"
        );
        assert!(
            !refused.stands(&asked(21), NOW),
            "a larger demand waits for its answer"
        );
        assert!(
            !refused.stands(&[("default".into(), 20), ("other".into(), 1)], NOW),
            "a network it did not answer"
        );
    }

    #[test]
    fn an_older_generations_refusal_or_a_cleared_condition_makes_adds_wait_again() {
        // An older generation's refusal alone is no answer to this demand.
        assert!(
            Refusal::after(None, &copy(4, 20, Some((QUOTA_EXCEEDED, 3, "no block")))).is_none()
        );
        let refused = Refusal::after(None, &copy(3, 20, Some((QUOTA_EXCEEDED, 3, "no block"))));
        // The node asked again (generation 4, more pods): the refusal of
        // generation 3 is kept but does not stand for the larger demand.
        let kept = Refusal::after(refused, &copy(4, 24, Some((QUOTA_EXCEEDED, 3, "no block"))))
            .expect("kept until the answer to generation 4");
        assert!(!kept.stands(&asked(24), NOW));
        // Granted, or the condition cleared: the refusal ends.
        let ready = copy(4, 24, Some(("NodeNetworkConfigReady", 4, "covered")));
        assert!(Refusal::after(Some(kept), &ready).is_none());
        let refused = Refusal::after(None, &copy(5, 30, Some((QUOTA_EXCEEDED, 5, "no block"))));
        assert!(
            Refusal::after(refused, &copy(5, 30, None)).is_none(),
            "a cleared condition"
        );
    }

    #[test]
    fn a_late_patch_answer_does_not_erase_a_newer_refusal() {
        // The stream brought the refusal of generation 6; the PATCH that
        // made generation 6 is answered afterwards with its own copy, whose
        // Ready condition still answers generation 5. The daemon reads the
        // answer from the newest copy (Cluster::latest: the late PATCH
        // answer is not applied over the stream's newer copy), and even
        // that older copy alone keeps the refusal.
        let refused = Refusal::after(None, &copy(6, 40, Some((QUOTA_EXCEEDED, 6, "no block"))));
        let late = copy(6, 40, Some((QUOTA_EXCEEDED, 5, "no block")));
        let kept = Refusal::after(refused, &late).expect("not erased by an older answer");
        assert!(kept.stands(&asked(40), NOW));
    }

    #[test]
    fn a_refusal_ends_at_the_time_its_message_gives() {
        let at = |message: &str| {
            Refusal::after(None, &copy(2, 20, Some((QUOTA_EXCEEDED, 2, message)))).unwrap()
        };
        let until = at(&format!("no block; {QUOTA_UNTIL}2026-12-01T12:00:01Z"));
        assert!(until.stands(&asked(20), NOW));
        assert!(
            !until.stands(&asked(20), NOW + 1000),
            "the time passed: ADDs wait again"
        );
        let past = at(&format!("no block; {QUOTA_UNTIL}2020-01-01T00:00:00Z"));
        assert!(!past.stands(&asked(20), NOW));
        let far = at(&format!("no block; {QUOTA_UNTIL}9999-12-31T23:59:59Z"));
        assert!(
            far.stands(&asked(20), NOW),
            "far future: stands until the next answer"
        );
        let garbled = at(&format!("no block; {QUOTA_UNTIL}tomorrow"));
        assert!(!garbled.stands(&asked(20), NOW), "unreadable: not trusted");
        assert!(
            at("no block").stands(&asked(20), NOW),
            "no time: until the next answer"
        );
    }
}
