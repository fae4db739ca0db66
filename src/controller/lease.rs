//! Leader election with a `coordination.k8s.io/v1` Lease, as client-go's
//! `leaderelection` does it: a candidate takes the Lease when it is free or
//! its record has not changed for a lease duration (measured on this
//! machine's boot clock, monotonic and counting suspends, from when the
//! change was seen, never by comparing clocks); the holder renews every
//! retry period; a holder that
//! has not renewed for the renew deadline stops writing, which is before
//! anyone else may take the Lease (renew deadline < lease duration, and
//! the time counts from before the renewal was sent). On SIGTERM the
//! holder gives the Lease up (`holderIdentity` emptied, as
//! `ReleaseOnCancel`). Writes carry the Lease's resourceVersion: of two
//! candidates only one wins (409 for the other).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

use serde_json::Value;

use super::clock::BootInstant;
use crate::kube::client::{ApiClient, KubeError};
use crate::kube::objects::{Lease, ObjectMeta, lenient};
use crate::log::{self, now_ms, rfc3339_seconds};
use crate::metrics::ControllerMetrics;

/// Lease timing, as client-go names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    pub duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

/// The Lease as last read, and when (locally) its record last changed.
struct Observed {
    record: crate::kube::objects::LeaseSpec,
    resource_version: String,
    at: BootInstant,
}

/// Whether this process may write, shared by the lease thread and the
/// controller's loop.
#[derive(Debug)]
pub struct Leadership {
    renew_deadline: Duration,
    /// When the last successful acquire or renew was sent.
    renewed: Mutex<Option<BootInstant>>,
    stopping: AtomicBool,
    /// The loop found this candidate not leading and sleeps: the next
    /// renewal that finds it leading wakes the loop.
    call_back: AtomicBool,
    /// How often this candidate took the Lease from another holder (or
    /// from none): each time, another may have written since its view.
    acquisitions: AtomicU64,
}

impl Leadership {
    pub fn new(renew_deadline: Duration) -> Leadership {
        Leadership {
            renew_deadline,
            renewed: Mutex::new(None),
            stopping: AtomicBool::new(false),
            call_back: AtomicBool::new(false),
            acquisitions: AtomicU64::new(0),
        }
    }

    /// How often this candidate acquired the Lease (renewals not counted).
    pub fn acquisitions(&self) -> u64 {
        self.acquisitions.load(Ordering::SeqCst)
    }

    /// Asks for an `Update::Leadership(true)` at the next renewal that
    /// finds this candidate leading (a renewal late past the deadline but
    /// then successful changes nothing the lease thread would report).
    pub fn call_back(&self) {
        self.call_back.store(true, Ordering::SeqCst);
    }

    /// Whether this candidate may write now: it renewed within the renew
    /// deadline and is not stopping.
    pub fn leading(&self) -> bool {
        let renewed = self.renewed.lock().unwrap_or_else(PoisonError::into_inner);
        !self.stopping.load(Ordering::SeqCst)
            && renewed.is_some_and(|at| at.elapsed() < self.renew_deadline)
    }

    fn renewed_at(&self, sent: BootInstant) {
        *self.renewed.lock().unwrap_or_else(PoisonError::into_inner) = Some(sent);
    }

    /// Stops writing and renewing for good (SIGTERM).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        *self.renewed.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

/// One candidate.
pub struct Elector {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub timing: LeaseTiming,
    observed: Option<Observed>,
    pub leadership: Arc<Leadership>,
}

impl Elector {
    pub fn new(namespace: &str, name: &str, identity: &str, timing: LeaseTiming) -> Elector {
        Elector {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            timing,
            observed: None,
            leadership: Arc::new(Leadership::new(timing.renew_deadline)),
        }
    }

    fn path(&self) -> String {
        format!(
            "/apis/coordination.k8s.io/v1/namespaces/{}/leases/{}",
            self.namespace, self.name
        )
    }

    /// One attempt to acquire or renew; `Ok(true)` when this candidate
    /// holds the Lease now.
    pub fn try_acquire_or_renew(
        &mut self,
        client: &ApiClient,
        metrics: &ControllerMetrics,
    ) -> Result<bool, KubeError> {
        let sent = BootInstant::now();
        metrics.api_request("get", "leases");
        let current: Lease = match client.get(&self.path()) {
            Ok(lease) => lenient(&lease),
            Err(err) if err.is_status(404) => {
                metrics.api_request("post", "leases");
                let body = self.hold(self.new_lease(), 0, None);
                let collection = format!(
                    "/apis/coordination.k8s.io/v1/namespaces/{}/leases",
                    self.namespace
                );
                return match client.post(&collection, &body) {
                    Ok(created) => {
                        self.observe(&lenient(&created), sent);
                        self.leadership.acquisitions.fetch_add(1, Ordering::SeqCst);
                        self.renewed_at(sent);
                        Ok(true)
                    }
                    Err(err) if err.is_status(409) => Ok(false),
                    Err(err) => Err(err),
                };
            }
            Err(err) => return Err(err),
        };
        self.observe(&current, BootInstant::now());
        let holder = current.spec.holder_identity.clone();
        let mine = holder == self.identity;
        if !mine && !holder.is_empty() && !self.expired(&current) {
            return Ok(false);
        }
        let transitions = current.spec.lease_transitions.unwrap_or(0) + i64::from(!mine);
        let acquired = if mine {
            current.spec.acquire_time.clone()
        } else {
            None
        };
        let body = self.hold(current, transitions, acquired);
        metrics.api_request("put", "leases");
        match client.put(&self.path(), &body) {
            Ok(updated) => {
                if !mine {
                    log::info(
                        "controller",
                        "acquired the lease",
                        &[("identity", &self.identity), ("previous", &holder)],
                    );
                }
                self.observe(&lenient(&updated), sent);
                if !mine {
                    self.leadership.acquisitions.fetch_add(1, Ordering::SeqCst);
                }
                self.renewed_at(sent);
                Ok(true)
            }
            Err(err) if err.is_status(409) => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// Gives the Lease up if this candidate holds it (SIGTERM): it stops
    /// writing first.
    pub fn release(&self, client: &ApiClient, metrics: &ControllerMetrics) {
        self.leadership.stop();
        metrics.api_request("get", "leases");
        let Ok(current) = client.get(&self.path()) else {
            return;
        };
        let mut body: Lease = lenient(&current);
        if body.spec.holder_identity != self.identity {
            return;
        }
        body.spec.holder_identity.clear();
        body.spec.lease_duration_seconds = Some(1);
        metrics.api_request("put", "leases");
        match client.put(&self.path(), &body) {
            Ok(_) => log::info(
                "controller",
                "gave the lease up",
                &[("identity", &self.identity)],
            ),
            Err(err) => log::warn(
                "controller",
                "could not give the lease up",
                &[("error", &err)],
            ),
        }
    }

    fn renewed_at(&self, sent: BootInstant) {
        self.leadership.renewed_at(sent);
    }

    /// Remembers the Lease; a changed record restarts its clock.
    fn observe(&mut self, lease: &Lease, at: BootInstant) {
        let record = lease.spec.clone();
        let resource_version = lease.metadata.resource_version.clone();
        let changed = self.observed.as_ref().is_none_or(|o| o.record != record);
        if changed {
            self.observed = Some(Observed {
                record,
                resource_version,
                at,
            });
        } else if let Some(o) = self.observed.as_mut() {
            o.resource_version = resource_version;
        }
    }

    /// Another holder's record has not changed for its lease duration.
    fn expired(&self, lease: &Lease) -> bool {
        let duration = lease
            .spec
            .lease_duration_seconds
            .filter(|s| *s > 0)
            .map_or(self.timing.duration, Duration::from_secs);
        self.observed
            .as_ref()
            .is_some_and(|o| o.at.elapsed() >= duration)
    }

    /// A Lease not yet created: its name, namespace, group and kind.
    fn new_lease(&self) -> Lease {
        let mut lease = Lease {
            metadata: ObjectMeta {
                name: self.name.clone(),
                namespace: self.namespace.clone(),
                ..ObjectMeta::default()
            },
            ..Lease::default()
        };
        for (key, value) in [("apiVersion", "coordination.k8s.io/v1"), ("kind", "Lease")] {
            lease.rest.insert(key.into(), Value::from(value));
        }
        lease
    }

    /// `lease` (its version and unknown fields kept) held by this
    /// candidate, renewed now, acquired at `acquired` (now when `None`).
    fn hold(&self, mut lease: Lease, transitions: i64, acquired: Option<String>) -> Lease {
        let now = micro_time(now_ms());
        let spec = &mut lease.spec;
        spec.holder_identity.clone_from(&self.identity);
        // Whole seconds: parse_config refuses a fraction.
        spec.lease_duration_seconds = Some(self.timing.duration.as_secs());
        spec.acquire_time = Some(acquired.unwrap_or_else(|| now.clone()));
        spec.renew_time = Some(now);
        spec.lease_transitions = Some(transitions);
        lease
    }
}

/// Runs the election forever on a thread of its own: an attempt every
/// retry period; each change of leadership is sent to the loop.
pub fn spawn(
    mut elector: Elector,
    client: Arc<ApiClient>,
    metrics: Arc<ControllerMetrics>,
    updates: Sender<super::informer::Update>,
) -> std::io::Result<()> {
    thread::Builder::new().name("lease".into()).spawn(move || {
        let mut was = false;
        while !elector.leadership.stopping.load(Ordering::SeqCst) {
            let result = elector.try_acquire_or_renew(&client, &metrics);
            if let Err(err) = &result {
                log::warn("controller", "lease request failed", &[("error", err)]);
            }
            let leading = elector.leadership.leading();
            let called = leading && elector.leadership.call_back.swap(false, Ordering::SeqCst);
            if leading != was || called {
                if !leading {
                    log::warn(
                        "controller",
                        "not leading: stopped writing",
                        &[("identity", &elector.identity)],
                    );
                }
                metrics.set_leader(leading);
                if updates
                    .send(super::informer::Update::Leadership(leading))
                    .is_err()
                {
                    return;
                }
                was = leading;
            }
            thread::sleep(elector.timing.retry_period);
        }
    })?;
    Ok(())
}

/// A `metav1.MicroTime`: RFC 3339 with microseconds.
fn micro_time(ms: i64) -> String {
    let seconds = rfc3339_seconds(ms).to_string();
    format!(
        "{}.{:06}Z",
        seconds.trim_end_matches('Z'),
        ms.rem_euclid(1000) * 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn elector() -> Elector {
        let timing = LeaseTiming {
            duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        };
        Elector::new("kube-system", "metis-controller", "a", timing)
    }

    #[test]
    fn another_holder_expires_only_after_its_record_stood_still_a_lease_duration() {
        let mut e = elector();
        let lease: Lease = lenient(
            &json!({"metadata": {"resourceVersion": "1"}, "spec": {"holderIdentity": "b", "leaseDurationSeconds": 15}}),
        );
        let long_ago = BootInstant::now()
            .checked_sub(Duration::from_secs(16))
            .unwrap();
        e.observe(&lease, long_ago);
        assert!(e.expired(&lease));
        // The same record seen again later does not restart the clock...
        e.observe(&lease, BootInstant::now());
        assert!(e.expired(&lease));
        // ...a renewal (a changed record) does.
        let renewed: Lease = lenient(
            &json!({"metadata": {"resourceVersion": "2"}, "spec": {"holderIdentity": "b", "leaseDurationSeconds": 15, "renewTime": "x"}}),
        );
        e.observe(&renewed, BootInstant::now());
        assert!(!e.expired(&renewed));
    }

    #[test]
    fn a_holder_that_cannot_renew_stops_before_the_lease_can_expire() {
        let e = elector();
        let l = &e.leadership;
        assert!(!l.leading());
        e.renewed_at(BootInstant::now());
        assert!(l.leading());
        e.renewed_at(
            BootInstant::now()
                .checked_sub(Duration::from_secs(10))
                .unwrap(),
        );
        assert!(!l.leading(), "past the renew deadline (10 s < 15 s lease)");
        e.renewed_at(BootInstant::now());
        l.stop();
        assert!(!l.leading(), "stopping");
    }

    #[test]
    fn lease_bodies_carry_the_version_and_micro_times() {
        let e = elector();
        let mut read = e.new_lease();
        read.metadata.resource_version = "7".into();
        read.spec.rest.insert("preferredHolder".into(), json!("b"));
        let body = serde_json::to_value(e.hold(read, 3, None)).unwrap();
        assert_eq!(body["apiVersion"], "coordination.k8s.io/v1");
        assert_eq!(body["metadata"]["resourceVersion"], "7");
        assert_eq!(body["spec"]["preferredHolder"], "b", "unknown fields kept");
        assert_eq!(body["spec"]["holderIdentity"], "a");
        assert_eq!(body["spec"]["leaseDurationSeconds"], 15);
        assert_eq!(body["spec"]["leaseTransitions"], 3);
        assert_eq!(micro_time(1_795_971_684_123), "2026-11-29T17:01:24.123000Z");
    }

    #[test]
    fn the_lease_carries_the_duration_the_process_obeys() {
        let timing = LeaseTiming {
            duration: Duration::from_secs(2),
            renew_deadline: Duration::from_millis(1500),
            retry_period: Duration::from_millis(500),
        };
        let e = Elector::new("kube-system", "metis-controller", "a", timing);
        let body = e.hold(e.new_lease(), 0, None);
        assert_eq!(body.spec.lease_duration_seconds, Some(2));
        // Another holder's record with that body expires after exactly it.
        let seen = |ago_ms| {
            let mut other = elector();
            other.observe(
                &body,
                BootInstant::now()
                    .checked_sub(Duration::from_millis(ago_ms))
                    .unwrap(),
            );
            other.expired(&body)
        };
        assert!(!seen(1900), "1.9 s < 2 s");
        assert!(seen(2000));
    }
}
