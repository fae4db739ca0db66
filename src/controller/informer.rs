//! One LIST and then one WATCH per kind, informer style: NodeNetworkConfigs,
//! Nodes and MetisPools each have a thread that lists the collection,
//! watches it from the list's resourceVersion with bookmarks, resumes a
//! watch the server ended and lists again after `410 Gone`. Objects are cut
//! down on the thread to what the controller reads (a Node is only its
//! name), so 5,000 Nodes cost little memory. Paced by `kube::backoff`.

use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::thread;

use serde_json::Value;

use super::pool::POOL_PATH;
use crate::kube::backoff::{ApiTiming, Backoff};
use crate::kube::client::{ApiClient, KubeError};
use crate::kube::nnc::{Meta, Nnc, resource_version};
use crate::kube::worker::needs_relist;
use crate::log;
use crate::metrics::ControllerMetrics;

pub const NNC_PATH: &str = "/apis/networking.gke.io/v1/nodenetworkconfigs";
pub const NODE_PATH: &str = "/api/v1/nodes";

/// A kind the controller follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Resource {
    Nnc,
    Node,
    Pool,
}

impl Resource {
    pub const ALL: [Resource; 3] = [Resource::Nnc, Resource::Node, Resource::Pool];

    pub fn collection(self) -> &'static str {
        match self {
            Resource::Nnc => NNC_PATH,
            Resource::Node => NODE_PATH,
            Resource::Pool => POOL_PATH,
        }
    }

    /// The plural, as metrics and RBAC name it.
    pub fn plural(self) -> &'static str {
        match self {
            Resource::Nnc => "nodenetworkconfigs",
            Resource::Node => "nodes",
            Resource::Pool => "metispools",
        }
    }

    pub fn watch_path(self, version: &str, seconds: u64) -> String {
        format!(
            "{}?watch=1&resourceVersion={version}&allowWatchBookmarks=true&timeoutSeconds={seconds}",
            self.collection()
        )
    }
}

/// An object as the controller keeps it.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// The parsed object and its status as read.
    Nnc(Box<Nnc>, Value),
    Node(String),
    Pool(Value),
}

impl Item {
    pub fn parse(kind: Resource, object: &Value) -> Item {
        match kind {
            Resource::Nnc => Item::Nnc(Box::new(Nnc::parse(object)), object["status"].clone()),
            Resource::Node => Item::Node(Meta::parse(object).name),
            Resource::Pool => Item::Pool(object.clone()),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Item::Nnc(nnc, _) => &nnc.meta.name,
            Item::Node(name) => name,
            Item::Pool(object) => object["metadata"]["name"].as_str().unwrap_or_default(),
        }
    }
}

/// What the informers tell the controller's loop.
#[derive(Debug)]
pub enum Update {
    /// A full list: the kind's objects now (replaces what was known).
    Listed(Resource, Vec<Item>),
    Changed(Resource, Item),
    Deleted(Resource, String),
    /// The lease thread's news (see `lease`).
    Leadership(bool),
    /// SIGTERM or SIGINT.
    Stop,
}

/// Starts the informer of `kind`.
pub fn spawn(
    client: Arc<ApiClient>,
    kind: Resource,
    timing: ApiTiming,
    updates: Sender<Update>,
    metrics: Arc<ControllerMetrics>,
) -> std::io::Result<()> {
    thread::Builder::new()
        .name(format!("watch-{}", kind.plural()))
        .spawn(move || follow(&client, kind, timing, &updates, &metrics))?;
    Ok(())
}

fn follow(
    client: &ApiClient,
    kind: Resource,
    timing: ApiTiming,
    updates: &Sender<Update>,
    metrics: &ControllerMetrics,
) {
    let mut backoff = Backoff::new(timing.max_backoff);
    let mut resume: Option<String> = None;
    loop {
        match cycle(
            client,
            kind,
            timing,
            updates,
            metrics,
            &mut backoff,
            &mut resume,
        ) {
            Ok(true) => {}
            Ok(false) => return,
            Err(err) => {
                let pause = backoff.next(err.retry_after());
                log::warn(
                    "controller",
                    "list or watch failed, retrying",
                    &[
                        ("resource", &kind.plural()),
                        ("error", &err),
                        ("retry_in_ms", &pause.as_millis()),
                        ("relist", &resume.is_none()),
                    ],
                );
                thread::sleep(pause);
            }
        }
    }
}

/// One list (unless resuming) and one watch; `Ok(false)` once the loop is gone.
fn cycle(
    client: &ApiClient,
    kind: Resource,
    timing: ApiTiming,
    updates: &Sender<Update>,
    metrics: &ControllerMetrics,
    backoff: &mut Backoff,
    resume: &mut Option<String>,
) -> Result<bool, KubeError> {
    let mut version = match resume.take() {
        Some(version) => version,
        None => {
            metrics.api_request("list", kind.plural());
            let list = client.get(kind.collection())?;
            let items = list["items"]
                .as_array()
                .map(|items| items.iter().map(|o| Item::parse(kind, o)).collect())
                .unwrap_or_default();
            if updates.send(Update::Listed(kind, items)).is_err() {
                return Ok(false);
            }
            resource_version(&list)
        }
    };
    let seconds = backoff.watch_seconds(timing.watch_timeout);
    metrics.api_request("watch", kind.plural());
    let events = match client.watch(&kind.watch_path(&version, seconds)) {
        Ok(events) => events,
        Err(err) => {
            if !needs_relist(&err) {
                *resume = Some(version);
            }
            return Err(err);
        }
    };
    for event in events {
        let event = match event {
            Ok(event) => event,
            Err(err) => {
                *resume = Some(version);
                return Err(err);
            }
        };
        let update = match event.kind.as_str() {
            "ADDED" | "MODIFIED" => Update::Changed(kind, Item::parse(kind, &event.object)),
            "DELETED" => Update::Deleted(kind, Meta::parse(&event.object).name),
            "BOOKMARK" => {
                version = resource_version(&event.object);
                continue;
            }
            _ => {
                let err = KubeError::Status {
                    code: u16::try_from(event.object["code"].as_u64().unwrap_or(0)).unwrap_or(0),
                    body: event.object.to_string(),
                    retry_after: None,
                };
                if !needs_relist(&err) {
                    *resume = Some(version);
                }
                return Err(err);
            }
        };
        let next = resource_version(&event.object);
        if !next.is_empty() {
            version = next;
        }
        if updates.send(update).is_err() {
            return Ok(false);
        }
    }
    backoff.reset();
    *resume = Some(version);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_are_cut_down_to_what_the_controller_reads() {
        let node = json!({"metadata": {"name": "n1", "resourceVersion": "4"}, "status": {"images": ["big"]}});
        assert_eq!(Item::parse(Resource::Node, &node), Item::Node("n1".into()));
        let nnc = json!({"metadata": {"name": "n1", "uid": "u"}, "spec": {"allocations": [{"pods": 3}]}, "status": {"podCIDRs": []}});
        let Item::Nnc(parsed, status) = Item::parse(Resource::Nnc, &nnc) else {
            panic!()
        };
        assert_eq!(parsed.pods("default"), Some(3));
        assert_eq!(status, json!({"podCIDRs": []}));
        assert_eq!(Item::parse(Resource::Pool, &nnc).name(), "n1");
        assert_eq!(
            Resource::Pool.watch_path("7", 300),
            "/apis/metis.x-k8s.io/v1alpha1/metispools?watch=1&resourceVersion=7&allowWatchBookmarks=true&timeoutSeconds=300"
        );
    }
}
