//! Applies a decision: pool statuses first (each a compare-and-swap on the
//! pool's resourceVersion), then the node statuses that rely on them, then
//! the Events. Every write is a PUT of the status subresource carrying the
//! resourceVersion the decision was computed from; a 409 means someone
//! wrote first: the object is read again (a GET, as client-go's
//! RetryOnConflict) and the next pass, after the backoff, decides anew
//! from that copy (if the GET failed, from the same one: at worst one more
//! 409). The stream may never
//! bring a newer one (the 409 may be the only news), and its older copies
//! do not replace the one read (`Cache::put_fetched`). Nothing is written
//! unless this process leads at that moment.

use std::collections::BTreeSet;

use serde_json::{Value, json};

use super::cache::Cache;
use super::decide::{Decision, NodeEvent, Write};
use super::informer::{Item, Resource};
use crate::kube::client::{ApiClient, KubeError};
use crate::log::{self, now_ms, rfc3339_seconds};
use crate::metrics::ControllerMetrics;

/// The namespace of the Events about Nodes (cluster-scoped objects).
pub const EVENT_NAMESPACE: &str = "default";

/// What applying a decision came to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub written: usize,
    /// Objects refused with 409: read again, decided again next pass.
    pub conflicts: usize,
    /// Other failures: decide again after the backoff.
    pub failures: usize,
    /// Leadership ended midway: nothing more was written.
    pub stopped: bool,
}

pub fn apply(
    client: &ApiClient,
    cache: &mut Cache,
    decision: &Decision,
    leading: &dyn Fn() -> bool,
    metrics: &ControllerMetrics,
    identity: &str,
) -> Applied {
    let mut applied = Applied::default();
    let mut pools_written = BTreeSet::new();
    for write in &decision.pool_writes {
        if !leading() {
            applied.stopped = true;
            return applied;
        }
        if put(client, cache, Resource::Pool, write, metrics, &mut applied) {
            pools_written.insert(write.name.as_str());
        }
    }
    let mut nodes_written = BTreeSet::new();
    for write in &decision.nnc_writes {
        if !write
            .after_pools
            .iter()
            .all(|p| pools_written.contains(p.as_str()))
        {
            continue;
        }
        if !leading() {
            applied.stopped = true;
            return applied;
        }
        if put(client, cache, Resource::Nnc, write, metrics, &mut applied) {
            nodes_written.insert(write.name.as_str());
        }
    }
    for event in decision
        .events
        .iter()
        .filter(|e| nodes_written.contains(e.node.as_str()))
    {
        if event.reason == super::decide::QUOTA_EVENT {
            metrics.exhausted();
        } else {
            metrics.conflict();
        }
        post_event(client, event, metrics, identity);
    }
    applied
}

/// One status PUT; true when it succeeded.
fn put(
    client: &ApiClient,
    cache: &mut Cache,
    kind: Resource,
    write: &Write,
    metrics: &ControllerMetrics,
    applied: &mut Applied,
) -> bool {
    let (api_version, object_kind) = match kind {
        Resource::Pool => ("metis.x-k8s.io/v1alpha1", "MetisPool"),
        _ => ("networking.gke.io/v1", "NodeNetworkConfig"),
    };
    // The status goes as the text the decision made (a pool's can be
    // thousands of claims): only the envelope is built here.
    let envelope = json!({
        "apiVersion": api_version,
        "kind": object_kind,
        "metadata": {"name": write.name, "resourceVersion": write.resource_version},
    })
    .to_string();
    let body = format!(
        "{},\"status\":{}}}",
        envelope.strip_suffix('}').unwrap_or(&envelope),
        write.status
    );
    let item = format!("{}/{}", kind.collection(), write.name);
    metrics.api_request("put", kind.plural());
    match client.put_text(&format!("{item}/status"), body) {
        Ok(object) => {
            cache.put_fetched(kind, Item::parse(kind, object));
            applied.written += 1;
            true
        }
        Err(err) if err.is_status(409) => {
            metrics.conflict();
            applied.conflicts += 1;
            log::debug(
                "controller",
                "someone wrote first (409): reading it again and deciding again",
                &[("object", &item), ("version", &write.resource_version)],
            );
            metrics.api_request("get", kind.plural());
            match client.get(&item) {
                Ok(object) => cache.put_fetched(kind, Item::parse(kind, object)),
                // Deleted meanwhile, or unreachable: the stream tells.
                Err(err) => log::debug(
                    "controller",
                    "reading it again failed",
                    &[("object", &item), ("error", &err)],
                ),
            }
            false
        }
        Err(err) => {
            applied.failures += 1;
            log::warn(
                "controller",
                "status write failed",
                &[("object", &item), ("error", &err)],
            );
            false
        }
    }
}

fn post_event(client: &ApiClient, event: &NodeEvent, metrics: &ControllerMetrics, identity: &str) {
    let now = rfc3339_seconds(now_ms()).to_string();
    let body: Value = json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": format!("{}.", event.node), "namespace": EVENT_NAMESPACE},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": event.node},
        "reason": event.reason,
        "message": event.message,
        "type": "Warning",
        "source": {"component": "metis-controller"},
        "reportingComponent": "metis-controller",
        "reportingInstance": identity,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    });
    log::warn(
        "controller",
        &event.message,
        &[("node", &event.node), ("reason", &event.reason)],
    );
    metrics.api_request("post", "events");
    let path = format!("/api/v1/namespaces/{EVENT_NAMESPACE}/events");
    if let Err(err) = client.post(&path, &body) {
        log_failed_event(&err, event);
    }
}

fn log_failed_event(err: &KubeError, event: &NodeEvent) {
    log::warn(
        "controller",
        "posting an Event failed",
        &[
            ("node", &event.node),
            ("reason", &event.reason),
            ("error", err),
        ],
    );
}
