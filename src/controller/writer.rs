//! Applies a decision: the block objects first (a claim is a POST that
//! only one claimer wins; every other write carries the resourceVersion
//! read), then the node statuses that rely on them, then the pools' counts
//! and the Events. Every status write is a PUT of the status subresource
//! carrying the resourceVersion the decision was computed from. A 409
//! means someone wrote first: the object is read again (a GET, as
//! client-go's RetryOnConflict) and the next pass decides anew from that
//! copy — for that object only (`retry`); the stream's older copies do not
//! replace the one read (`Cache::put_fetched`). A write refused otherwise
//! pauses that object alone, is counted in
//! `metis_controller_write_failures_total` and, the first time in a row,
//! said in an Event. Nothing is written unless this process leads at that
//! moment.

use std::collections::BTreeSet;
use std::time::Instant;

use serde_json::{Value, json};

use super::block::{self, BLOCK_PATH};
use super::cache::Cache;
use super::decide::{BlockOp, BlockWrite, Decision, Write};
use super::informer::{Item, Resource};
use super::retry::{Cause, Retries};
use crate::kube::client::{ApiClient, KubeError};
use crate::log::{self, now_ms, rfc3339_seconds};
use crate::metrics::ControllerMetrics;

/// The namespace of the Events about cluster-scoped objects.
pub const EVENT_NAMESPACE: &str = "default";
/// The Event reason of a write the API server refused (not a 409).
pub const WRITE_REFUSED_EVENT: &str = "MetisWriteRefused";

/// What applying a decision came to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub written: usize,
    /// Objects refused with 409: read again, decided again.
    pub conflicts: usize,
    /// Other failures: that object waits (`Retries`).
    pub failures: usize,
    /// Writes left for later: their object waits, or a block they rely on
    /// was not written.
    pub deferred: usize,
    /// Leadership ended midway: nothing more was written.
    pub stopped: bool,
}

/// What every write needs.
pub struct Context<'a> {
    pub client: &'a ApiClient,
    pub metrics: &'a ControllerMetrics,
    pub identity: &'a str,
    pub leading: &'a dyn Fn() -> bool,
    pub now: Instant,
}

pub fn apply(
    ctx: &Context,
    cache: &mut Cache,
    decision: &Decision,
    retries: &mut Retries,
) -> Applied {
    let mut books = Books {
        cache,
        retries,
        applied: Applied::default(),
    };
    let mut blocks_written = BTreeSet::new();
    for write in &decision.block_writes {
        if !books.retries.ready(Resource::Block, &write.name, ctx.now) {
            books.applied.deferred += 1;
            continue;
        }
        if !(ctx.leading)() {
            books.applied.stopped = true;
            return books.applied;
        }
        let result = write_block(ctx, write);
        let key = (Resource::Block, write.name.as_str());
        if landed(ctx, &mut books, key, result) {
            blocks_written.insert(write.name.as_str());
        }
    }
    let mut nodes_written = BTreeSet::new();
    for (kind, write) in decision
        .nnc_writes
        .iter()
        .map(|w| (Resource::Nnc, w))
        .chain(decision.pool_writes.iter().map(|w| (Resource::Pool, w)))
    {
        let relied_on = write
            .after_blocks
            .iter()
            .all(|b| blocks_written.contains(b.as_str()));
        if !relied_on || !books.retries.ready(kind, &write.name, ctx.now) {
            books.applied.deferred += 1;
            continue;
        }
        if !(ctx.leading)() {
            books.applied.stopped = true;
            return books.applied;
        }
        let result = put_status(ctx, kind, write);
        let key = (kind, write.name.as_str());
        if landed(ctx, &mut books, key, result) && kind == Resource::Nnc {
            nodes_written.insert(write.name.as_str());
        }
    }
    for event in decision
        .events
        .iter()
        .filter(|e| nodes_written.contains(e.node.as_str()))
    {
        if event.reason == super::decide::QUOTA_EVENT {
            ctx.metrics.exhausted();
        } else {
            ctx.metrics.conflict();
        }
        post_event(
            ctx,
            ("v1", "Node", &event.node),
            event.reason,
            &event.message,
        );
    }
    books.applied
}

/// What the answers of one decision's writes update: the cache, each
/// object's pause and the tally.
struct Books<'b> {
    cache: &'b mut Cache,
    retries: &'b mut Retries,
    applied: Applied,
}

/// One block write: POST, PUT (protected or let go) or DELETE.
fn write_block(ctx: &Context, write: &BlockWrite) -> Result<Option<Value>, KubeError> {
    let item = format!("{BLOCK_PATH}/{}", write.name);
    match &write.op {
        BlockOp::Create(spec) => {
            ctx.metrics.api_request("post", "metisblocks");
            let body = block::object(spec, &write.name, "", true);
            ctx.client.post(BLOCK_PATH, &body).map(Some)
        }
        BlockOp::Update(version, spec) => {
            ctx.metrics.api_request("put", "metisblocks");
            let body = block::object(spec, &write.name, version, true);
            ctx.client.put(&item, &body).map(Some)
        }
        BlockOp::LetGo(version, spec) => {
            ctx.metrics.api_request("put", "metisblocks");
            let body = block::object(spec, &write.name, version, false);
            let answer = ctx.client.put(&item, &body)?;
            // Marked for deletion, it is gone with its last finalizer.
            Ok((!block::is_gone(&answer)).then_some(answer))
        }
        BlockOp::Delete(version) => {
            ctx.metrics.api_request("delete", "metisblocks");
            let options = json!({
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "preconditions": {"resourceVersion": version},
            });
            ctx.client.delete(&item, &options).map(|_| None)
        }
    }
}

/// One status PUT.
fn put_status(ctx: &Context, kind: Resource, write: &Write) -> Result<Option<Value>, KubeError> {
    let (api_version, object_kind) = match kind {
        Resource::Pool => ("metis.x-k8s.io/v1alpha1", "MetisPool"),
        _ => ("networking.gke.io/v1", "NodeNetworkConfig"),
    };
    // The status goes as the text the decision made: only the envelope
    // is built here.
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
    ctx.metrics.api_request("put", kind.plural());
    let path = format!("{}/{}/status", kind.collection(), write.name);
    ctx.client.put_text(&path, body).map(Some)
}

/// Takes a write's answer in: the object written (or deleted) into the
/// cache; after a 409, the object as it is now; after a 404, none; after
/// any other refusal, a pause for that object alone. True when the write
/// landed.
fn landed(
    ctx: &Context,
    books: &mut Books,
    (kind, name): (Resource, &str),
    result: Result<Option<Value>, KubeError>,
) -> bool {
    let Books {
        cache,
        retries,
        applied,
    } = books;
    match result {
        Ok(object) => {
            match object {
                Some(object) => cache.put_fetched(kind, Item::parse(kind, object)),
                None => {
                    cache.forget(kind, name);
                }
            }
            retries.written(kind, name);
            applied.written += 1;
            true
        }
        Err(err) if err.is_status(409) => {
            ctx.metrics.conflict();
            applied.conflicts += 1;
            retries.refused((kind, name), Cause::Conflict, ctx.now, None);
            read_again(ctx, cache, kind, name);
            false
        }
        // Deleted meanwhile: decide without it (the stream tells too).
        Err(err) if err.is_status(404) => {
            applied.conflicts += 1;
            retries.refused((kind, name), Cause::Conflict, ctx.now, None);
            cache.remove(kind, name);
            false
        }
        Err(err) => {
            applied.failures += 1;
            let code = match &err {
                KubeError::Status { code, .. } => *code,
                _ => 0,
            };
            ctx.metrics.write_failure(kind.plural(), code);
            let first = retries.refused((kind, name), Cause::Failure, ctx.now, err.retry_after());
            log::warn(
                "controller",
                "write refused: this object waits, the others go on",
                &[("object", &name), ("kind", &kind.plural()), ("error", &err)],
            );
            if first {
                let message = format!("writing {} {name} failed: {err}", kind.plural());
                let involved = match kind {
                    Resource::Pool => ("metis.x-k8s.io/v1alpha1", "MetisPool", name),
                    Resource::Block => ("metis.x-k8s.io/v1alpha1", "MetisBlock", name),
                    _ => ("v1", "Node", name),
                };
                post_event(ctx, involved, WRITE_REFUSED_EVENT, &message);
            }
            false
        }
    }
}

/// The object as it is now, after a 409 (someone wrote first): the next
/// pass decides from that copy.
fn read_again(ctx: &Context, cache: &mut Cache, kind: Resource, name: &str) {
    let item = format!("{}/{name}", kind.collection());
    log::debug(
        "controller",
        "someone wrote first (409): reading it again and deciding again",
        &[("object", &item)],
    );
    ctx.metrics.api_request("get", kind.plural());
    match ctx.client.get(&item) {
        Ok(object) => cache.put_fetched(kind, Item::parse(kind, object)),
        Err(err) if err.is_status(404) => {
            cache.remove(kind, name);
        }
        // Unreachable: the stream tells.
        Err(err) => log::debug(
            "controller",
            "reading it again failed",
            &[("object", &item), ("error", &err)],
        ),
    }
}

/// A Warning Event on `(apiVersion, kind, name)`.
fn post_event(
    ctx: &Context,
    (api_version, kind, name): (&str, &str, &str),
    reason: &str,
    message: &str,
) {
    let now = rfc3339_seconds(now_ms()).to_string();
    let body: Value = json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": format!("{name}."), "namespace": EVENT_NAMESPACE},
        "involvedObject": {"apiVersion": api_version, "kind": kind, "name": name},
        "reason": reason,
        "message": message,
        "type": "Warning",
        "source": {"component": "metis-controller"},
        "reportingComponent": "metis-controller",
        "reportingInstance": ctx.identity,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    });
    log::warn(
        "controller",
        message,
        &[("object", &name), ("reason", &reason)],
    );
    ctx.metrics.api_request("post", "events");
    let path = format!("/api/v1/namespaces/{EVENT_NAMESPACE}/events");
    if let Err(err) = ctx.client.post(&path, &body) {
        log::warn(
            "controller",
            "posting an Event failed",
            &[("object", &name), ("reason", &reason), ("error", &err)],
        );
    }
}
