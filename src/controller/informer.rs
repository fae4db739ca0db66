//! One LIST and then one WATCH per kind, informer style: NodeNetworkConfigs,
//! Nodes, MetisPools and MetisBlocks each have a thread that lists the collection,
//! watches it from the list's resourceVersion with bookmarks, resumes a
//! watch the server ended and lists again after `410 Gone`. Objects are cut
//! down on the thread to what the controller reads (a Node is only its
//! name), so 5,000 Nodes cost little memory. Paced by `kube::backoff`.

use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::thread;

use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::block::{BLOCK_PATH, Block};
use super::demand::Demand;
use super::pool::{POOL_PATH, Pool};
use super::status::Status;
use crate::kube::backoff::{ApiTiming, Backoff};
use crate::kube::client::{ApiClient, KubeError};
use crate::kube::nnc::{Meta, resource_version};
use crate::kube::worker::{needs_relist, watch_error};
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
    Block,
}

impl Resource {
    pub const ALL: [Resource; 4] = [
        Resource::Nnc,
        Resource::Node,
        Resource::Pool,
        Resource::Block,
    ];

    pub fn collection(self) -> &'static str {
        match self {
            Resource::Nnc => NNC_PATH,
            Resource::Node => NODE_PATH,
            Resource::Pool => POOL_PATH,
            Resource::Block => BLOCK_PATH,
        }
    }

    /// The plural, as metrics and RBAC name it.
    pub fn plural(self) -> &'static str {
        match self {
            Resource::Nnc => "nodenetworkconfigs",
            Resource::Node => "nodes",
            Resource::Pool => "metispools",
            Resource::Block => "metisblocks",
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
    /// The name, what the node asks, and the status as read (compact).
    Nnc(String, Box<Demand>, Status),
    Node(String),
    Pool(Box<Pool>),
    /// The name, and the block.
    Block(String, Box<Block>),
}

impl Item {
    /// Cuts `object` down (taken: no copy of it is made).
    pub fn parse(kind: Resource, mut object: Value) -> Item {
        match kind {
            Resource::Nnc => {
                // The status is kept once, as `Status`: the spec's parse
                // does not see it (the node's reading of it is not needed).
                let status = object.get_mut("status").map(Value::take);
                let mut status = Status::parse(status.unwrap_or_default());
                status.serving = super::status::serving(&object);
                let (name, demand) = Demand::parse(&object);
                Item::Nnc(name, Box::new(demand), status)
            }
            Resource::Node => Item::Node(Meta::parse(&object).name),
            Resource::Pool => Item::Pool(Box::new(Pool::parse(&object))),
            Resource::Block => {
                let (name, block) = Block::parse(object);
                Item::Block(name, Box::new(block))
            }
        }
    }

    pub fn resource_version(&self) -> &str {
        match self {
            Item::Nnc(_, demand, _) => &demand.resource_version,
            Item::Node(_) => "",
            Item::Pool(pool) => &pool.resource_version,
            Item::Block(_, block) => &block.resource_version,
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Item::Nnc(name, _, _) => name,
            Item::Node(name) => name,
            Item::Pool(pool) => &pool.name,
            Item::Block(name, _) => name,
        }
    }
}

/// Objects asked for per LIST page, as client-go's reflector does: a LIST
/// of 5,000 NodeNetworkConfigs is ten requests, each read as it arrives.
pub const PAGE_SIZE: usize = 500;

/// One LIST page, read as it arrives: each item is cut down to an [`Item`]
/// as soon as it is parsed, so only one object's tree is alive at a time.
struct Page {
    items: Vec<Item>,
    resource_version: String,
    next: Option<String>,
}

struct PageSeed(Resource);

impl<'de> DeserializeSeed<'de> for PageSeed {
    type Value = Page;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Page, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for PageSeed {
    type Value = Page;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Page, A::Error> {
        #[derive(Deserialize, Default)]
        struct ListMeta {
            #[serde(rename = "resourceVersion", default)]
            resource_version: String,
            #[serde(rename = "continue", default)]
            next: Option<String>,
        }
        let mut page = Page {
            items: Vec::new(),
            resource_version: String::new(),
            next: None,
        };
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "metadata" => {
                    let meta: ListMeta = map.next_value()?;
                    page.resource_version = meta.resource_version;
                    page.next = meta.next.filter(|t| !t.is_empty());
                }
                "items" => page.items = map.next_value_seed(ItemsSeed(self.0))?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(page)
    }
}

struct ItemsSeed(Resource);

impl<'de> DeserializeSeed<'de> for ItemsSeed {
    type Value = Vec<Item>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<Item>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemsSeed {
    type Value = Vec<Item>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of objects")
    }

    fn visit_unit<E>(self) -> Result<Vec<Item>, E> {
        Ok(Vec::new())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Item>, A::Error> {
        let mut items = Vec::new();
        while let Some(object) = seq.next_element::<Value>()? {
            items.push(Item::parse(self.0, object));
        }
        Ok(items)
    }
}

/// The whole collection, page by page, and the resourceVersion the pages
/// were served at. A continue token that expired (410) fails the list: the
/// caller lists again from the first page.
fn list(
    client: &ApiClient,
    kind: Resource,
    metrics: &ControllerMetrics,
) -> Result<(Vec<Item>, String), KubeError> {
    let mut items = Vec::new();
    let version = list_pages(client, kind, metrics, |page| items.extend(page))?;
    Ok((items, version))
}

/// Each object's name and version, as a LIST reads them now: the versions
/// a view must reach before it decides ([`super::cache::Cache::reach`]).
/// Page by page, so that only one page's objects are alive at a time.
pub fn list_versions(
    client: &ApiClient,
    kind: Resource,
    metrics: &ControllerMetrics,
) -> Result<Vec<(String, String)>, KubeError> {
    let mut versions = Vec::new();
    list_pages(client, kind, metrics, |page| {
        let named = page
            .iter()
            .map(|item| (item.name().to_string(), item.resource_version().to_string()));
        versions.extend(named);
    })?;
    Ok(versions)
}

/// Lists `kind` page by page into `each_page`; the resourceVersion the
/// pages were served at.
fn list_pages(
    client: &ApiClient,
    kind: Resource,
    metrics: &ControllerMetrics,
    mut each_page: impl FnMut(Vec<Item>),
) -> Result<String, KubeError> {
    let mut next: Option<String> = None;
    loop {
        let mut path = format!("{}?limit={PAGE_SIZE}", kind.collection());
        if let Some(token) = &next {
            path.push_str("&continue=");
            path.push_str(&percent_encode(token));
        }
        metrics.api_request("list", kind.plural());
        let page = client.get_streamed(&path, PageSeed(kind))?;
        each_page(page.items);
        match page.next {
            Some(token) => next = Some(token),
            None => return Ok(page.resource_version),
        }
    }
}

/// A query value, percent-encoded (continue tokens are base64: `=`, `+`, `/`).
fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
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

/// What one informer's thread follows: `kind` from `client`, into `updates`.
struct Follower<'f> {
    client: &'f ApiClient,
    kind: Resource,
    timing: ApiTiming,
    updates: &'f Sender<Update>,
    metrics: &'f ControllerMetrics,
}

fn follow(
    client: &ApiClient,
    kind: Resource,
    timing: ApiTiming,
    updates: &Sender<Update>,
    metrics: &ControllerMetrics,
) {
    let follower = Follower {
        client,
        kind,
        timing,
        updates,
        metrics,
    };
    let mut backoff = Backoff::new(timing.max_backoff);
    let mut resume: Option<String> = None;
    loop {
        match follower.cycle(&mut backoff, &mut resume) {
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

impl Follower<'_> {
    /// One list (unless resuming) and one watch; `Ok(false)` once the loop is gone.
    fn cycle(&self, backoff: &mut Backoff, resume: &mut Option<String>) -> Result<bool, KubeError> {
        let Follower {
            client,
            kind,
            timing,
            updates,
            metrics,
        } = *self;
        let mut version = match resume.take() {
            Some(version) => version,
            None => {
                let (items, version) = list(client, kind, metrics)?;
                if updates.send(Update::Listed(kind, items)).is_err() {
                    return Ok(false);
                }
                version
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
            let next = resource_version(&event.object);
            let update = match event.kind.as_str() {
                "ADDED" | "MODIFIED" => Update::Changed(kind, Item::parse(kind, event.object)),
                "DELETED" => Update::Deleted(kind, Meta::parse(&event.object).name),
                "BOOKMARK" => {
                    version = resource_version(&event.object);
                    continue;
                }
                _ => {
                    let err = watch_error(&event.object);
                    if !needs_relist(&err) {
                        *resume = Some(version);
                    }
                    return Err(err);
                }
            };
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_are_cut_down_to_what_the_controller_reads() {
        let node = json!({"metadata": {"name": "n1", "resourceVersion": "4"}, "status": {"images": ["big"]}});
        assert_eq!(Item::parse(Resource::Node, node), Item::Node("n1".into()));
        let nnc = json!({"metadata": {"name": "n1", "uid": "u"}, "spec": {"allocations": [{"pods": 3}]}, "status": {"podCIDRs": []}});
        let Item::Nnc(name, parsed, status) = Item::parse(Resource::Nnc, nnc.clone()) else {
            panic!()
        };
        assert_eq!(name, "n1");
        let asked = &parsed.allocations[0];
        assert_eq!((asked.network(), asked.pods), ("default", 3));
        assert_eq!(status, Status::parse(json!({"podCIDRs": []})));
        assert_eq!(Item::parse(Resource::Pool, nnc).name(), "n1");
        assert_eq!(
            Resource::Pool.watch_path("7", 300),
            "/apis/metis.x-k8s.io/v1alpha1/metispools?watch=1&resourceVersion=7&allowWatchBookmarks=true&timeoutSeconds=300"
        );
    }

    #[test]
    fn a_list_page_is_read_item_by_item() {
        let page = |text: &str| {
            let mut json = serde_json::Deserializer::from_str(text);
            PageSeed(Resource::Node).deserialize(&mut json)
        };
        let read = page(
            r#"{"kind": "NodeList", "items": [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}, "status": {"x": [1, 2]}}],
                "metadata": {"resourceVersion": "17", "continue": "eyJydiI6MTd9=", "remainingItemCount": 3}}"#,
        )
        .unwrap();
        assert_eq!(read.items, [Item::Node("a".into()), Item::Node("b".into())]);
        assert_eq!(read.resource_version, "17");
        assert_eq!(read.next.as_deref(), Some("eyJydiI6MTd9="));
        let last =
            page(r#"{"metadata": {"resourceVersion": "17", "continue": ""}, "items": null}"#)
                .unwrap();
        assert!(last.items.is_empty() && last.next.is_none());
        assert!(page(r#"{"items": 5}"#).is_err());
        assert!(page("[]").is_err());
        assert_eq!(percent_encode("eyJ+/9=.a-_~"), "eyJ%2B%2F9%3D.a-_~");
    }
}
