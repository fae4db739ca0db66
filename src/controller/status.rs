//! A NodeNetworkConfig's status as the controller keeps it between passes:
//! compact JSON text plus the few fields the decision reads, instead of the
//! parsed tree (a `serde_json::Value` of one granted status is several KiB).
//! A part exactly as this controller writes it (a granted entry, the Ready
//! condition of a covered node) is kept as the few values that make it, and
//! made again when asked: most of thousands of statuses are that. Text is
//! serde_json's compact form, whose object keys come out sorted, so two
//! parts are equal exactly when their texts are: the decision compares
//! texts, and parses only the small part it rewrites (the conditions) and
//! the statuses it writes.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use serde_json::{Map, Value};

use super::short_text::ShortText;
use super::small_set::SmallSet;
use crate::cidr::{Cidr, to_u128};
use crate::defaults::DEFAULT_NETWORK;
use crate::kube::nnc::{QUOTA_EXCEEDED, QuotaEnd};
use crate::kube::objects::{Condition, Metadata, entries, lenient, lenient_field};
use crate::log::{parse_rfc3339_ms, rfc3339_millis, rfc3339_seconds};

/// The end of the Ready message that says the Node is gone past the grace
/// and its blocks were taken back.
pub const GONE_TOLD: &str = "is gone: its blocks were taken back";

/// The reason of the Ready condition the controller writes (whatever its
/// status), and the message of one whose node's demand is covered.
pub const READY: &str = "NodeNetworkConfigReady";
pub const COVERED: &str = "the granted blocks cover the demand";
/// Begins the message of a granted entry's condition; the pool's name
/// follows.
const GRANTED_FROM: &str = "granted from MetisPool ";

/// A `status.podCIDRs` entry, kept whole (it is written back as read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its `cidr` field parsed (as written, when that is not the parsed
    /// CIDR's own spelling, in `Whole::Text`: the usual one is not kept
    /// twice).
    pub cidr: Option<Cidr>,
    /// Its `network` (the default one when empty or missing).
    network: ShortText,
    /// `type` is not `NonReusable`.
    pub reusable: bool,
    whole: Whole,
}

/// An entry whole: what makes one exactly as this controller grants it
/// (most of thousands, whose text is then not kept), or its compact text
/// and its `cidr` field as written if that is not its CIDR's own spelling
/// (this controller grants none so).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Whole {
    /// [`granted_entry`] of the entry's CIDR and network from `pool` at
    /// `since_ms` (whole seconds).
    Granted { pool: ShortText, since_ms: i64 },
    Text {
        text: Box<str>,
        odd_cidr: Option<Box<str>>,
    },
}

impl Whole {
    /// The entry's `cidr` field as written, when not its CIDR's spelling.
    fn odd_cidr(&self) -> Option<&str> {
        match self {
            Whole::Text { odd_cidr, .. } => odd_cidr.as_deref(),
            Whole::Granted { .. } => None,
        }
    }
}

impl Entry {
    pub fn parse(entry: &Value) -> Entry {
        let read: EntryFields = lenient(entry);
        let cidr_text = read.cidr.as_deref();
        let cidr: Option<Cidr> = cidr_text.and_then(|c| c.parse().ok());
        let canonical = cidr.map(|c| c.to_string());
        let network = (read.network.as_deref())
            .filter(|n| !n.is_empty())
            .unwrap_or(DEFAULT_NETWORK);
        let odd_cidr = cidr_text.filter(|t| canonical.as_deref() != Some(*t));
        let mut parsed = Entry {
            cidr,
            network: network.into(),
            reusable: read.kind.as_deref() != Some("NonReusable"),
            whole: Whole::Text {
                text: Box::default(),
                odd_cidr: None,
            },
        };
        parsed.whole = match parsed.as_granted(entry) {
            Some(granted) => granted,
            None => Whole::Text {
                text: entry.to_string().into(),
                odd_cidr: odd_cidr.map(Box::from),
            },
        };
        parsed
    }

    /// `entry` (this entry as read) as the few values it is made of, when
    /// [`granted_entry`] makes exactly it from them.
    fn as_granted(&self, entry: &Value) -> Option<Whole> {
        let condition = &entry["condition"];
        let pool = condition["message"].as_str()?.strip_prefix(GRANTED_FROM)?;
        let since = condition["lastTransitionTime"].as_str()?;
        let since_ms = parse_rfc3339_ms(since)?;
        let cidr = self.cidr.as_ref()?;
        (granted_entry(pool, self.network(), cidr, since_ms) == *entry).then(|| Whole::Granted {
            pool: pool.into(),
            since_ms,
        })
    }

    /// The entry of `cidr` in `network` as this controller grants it from
    /// `pool` at `now` (Unix ms).
    pub fn granted(pool: &str, network: &str, cidr: &Cidr, now: i64) -> Entry {
        Entry::parse(&granted_entry(pool, network, cidr, now))
    }

    /// Its `cidr` field as written.
    pub fn cidr_text(&self) -> Option<Cow<'_, str>> {
        match self.whole.odd_cidr() {
            Some(text) => Some(Cow::Borrowed(text)),
            None => self.cidr.map(|c| Cow::Owned(c.to_string())),
        }
    }

    /// Its `network` (the default network when empty or missing).
    pub fn network(&self) -> &str {
        &self.network
    }

    pub fn to_value(&self) -> Value {
        match (&self.whole, &self.cidr) {
            (Whole::Granted { pool, since_ms }, Some(cidr)) => {
                granted_entry(pool, self.network(), cidr, *since_ms)
            }
            (Whole::Text { text, .. }, _) => serde_json::from_str(text).unwrap_or(Value::Null),
            (Whole::Granted { .. }, None) => Value::Null,
        }
    }
}

/// The `podCIDRs` entry of `cidr` in `network` that this controller writes
/// when it grants the block from `pool` at `now` (Unix ms; written to the
/// second).
fn granted_entry(pool: &str, network: &str, cidr: &Cidr, now: i64) -> Value {
    let id: String = format!("{pool}-{cidr}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .collect();
    serde_json::json!({
        "id": id,
        "network": network,
        "cidr": cidr.to_string(),
        "condition": {
            "type": "Ready",
            "status": "True",
            "reason": "PodCIDRReady",
            "message": format!("{GRANTED_FROM}{pool}"),
            "lastTransitionTime": rfc3339_seconds(now).to_string(),
        },
    })
}

/// A status as read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Status {
    /// `podCIDRs`, when it is a list (read once and never grown: no
    /// spare capacity, and the status a word smaller).
    pub entries: Box<[Entry]>,
    /// `podCIDRs` is a list (an absent or malformed one is rewritten).
    pub listed: bool,
    /// The rest of the status (conditions, fields unknown here); `None`
    /// when the status is not an object.
    rest: Option<Rest>,
    /// The time a `QuotaExceeded` Ready condition says the refusal stands
    /// until (Unix ms), if it says.
    pub told_until: Option<i64>,
    /// When a `QuotaExceeded` Ready=False condition began (its
    /// `lastTransitionTime`, Unix ms): refused nodes are served first come,
    /// first served.
    pub refused_since: Option<i64>,
    /// The blocks the node says it still serves (its
    /// `metis.x-k8s.io/serving` annotation, read with the status: the
    /// controller reads both from one object).
    pub serving: SmallSet<Cidr>,
    /// Its Ready condition says the Node is gone and its blocks were taken
    /// back ([`GONE_TOLD`]): that write landed.
    pub gone_told: bool,
}

/// A status without `podCIDRs`: the two values of one whose only content
/// is the Ready condition this controller writes for a node whose demand
/// is covered (most of thousands, whose text is then not kept), or its
/// compact text.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rest {
    /// [`covered_rest`] of these values.
    Covered {
        since_ms: i64,
        generation: i64,
    },
    Text(Box<str>),
}

impl Rest {
    fn parse(rest: &Value) -> Rest {
        let ready = &rest["conditions"][0];
        let since = ready["lastTransitionTime"]
            .as_str()
            .and_then(parse_rfc3339_ms);
        let generation = ready["observedGeneration"].as_i64();
        match (since, generation) {
            (Some(since_ms), Some(generation)) if covered_rest(since_ms, generation) == *rest => {
                Rest::Covered {
                    since_ms,
                    generation,
                }
            }
            _ => Rest::Text(rest.to_string().into()),
        }
    }

    fn to_value(&self) -> Value {
        match self {
            Rest::Covered {
                since_ms,
                generation,
            } => covered_rest(*since_ms, *generation),
            Rest::Text(text) => serde_json::from_str(text).unwrap_or(Value::Null),
        }
    }
}

/// A status without `podCIDRs` that holds only the Ready condition this
/// controller writes for a node whose demand is covered: since `since_ms`
/// (Unix ms), answering `generation`.
fn covered_rest(since_ms: i64, generation: i64) -> Value {
    let ready = Condition {
        kind: Some("Ready".into()),
        status: Some("True".into()),
        reason: Some(READY.into()),
        message: Some(COVERED.into()),
        last_transition_time: Some(rfc3339_millis(since_ms).to_string()),
        observed_generation: Some(generation),
        rest: Map::new(),
    };
    serde_json::json!({ "conditions": [ready] })
}

/// The fields of a Ready condition the controller decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyRead {
    pub status: Box<str>,
    pub reason: Box<str>,
    pub message: Box<str>,
    pub observed_generation: i64,
}

/// The annotation in which a node lists the cluster's blocks it still
/// serves or drains (comma-separated canonical CIDRs).
pub const SERVING_ANNOTATION: &str = "metis.x-k8s.io/serving";
/// CIDRs read from it: more is not a node's (4096 blocks of 64 per pool).
const MAX_SERVING: usize = 4096;

/// The CIDRs an NNC's `serving` annotation lists; what is not a
/// canonical CIDR is skipped (the rest still count).
pub fn serving(object: &Value) -> SmallSet<Cidr> {
    let Metadata { metadata } = lenient(object);
    let text = metadata
        .annotations
        .get(SERVING_ANNOTATION)
        .and_then(Value::as_str)
        .unwrap_or_default();
    text.split(',')
        .filter_map(|item| {
            let cidr: Cidr = item.trim().parse().ok()?;
            (cidr.to_string() == item.trim()).then_some(cidr)
        })
        .take(MAX_SERVING)
        .collect()
}

/// The fields of a `podCIDRs` entry the decision reads, field by field:
/// a malformed one costs that field (the entry itself is kept as text).
#[derive(Default, Deserialize)]
struct EntryFields {
    #[serde(default, deserialize_with = "lenient_field")]
    cidr: Option<String>,
    #[serde(default, deserialize_with = "lenient_field")]
    network: Option<String>,
    #[serde(rename = "type", default, deserialize_with = "lenient_field")]
    kind: Option<String>,
}

/// The conditions of a status; one that is no condition is skipped.
#[derive(Default, Deserialize)]
struct Conditions {
    #[serde(default)]
    conditions: Value,
}

/// The conditions of `status` (an object's status, or `null`), decoded;
/// an entry that is no condition is skipped (and dropped when they are
/// written back).
pub fn conditions(status: &Value) -> Vec<Condition> {
    let Conditions { conditions } = lenient(status);
    entries(&conditions, usize::MAX).0
}

impl Status {
    /// Reads `status` (taken: its parts are turned into text).
    pub fn parse(mut status: Value) -> Status {
        let Some(object) = status.as_object_mut() else {
            return Status::default();
        };
        let pod_cidrs = object.remove(POD_CIDRS);
        let conditions = conditions(&status);
        let told_until = told_until(&conditions);
        let refused_since = refused_since(&conditions);
        let gone_told = conditions.iter().any(|c| {
            is_ready(c, "False") && c.message.as_deref().is_some_and(|m| m.ends_with(GONE_TOLD))
        });
        let entries: Box<[Entry]> = pod_cidrs
            .as_ref()
            .and_then(Value::as_array)
            .map(|list| list.iter().map(Entry::parse).collect())
            .unwrap_or_default();
        Status {
            listed: pod_cidrs.as_ref().is_some_and(Value::is_array),
            entries,
            rest: Some(Rest::parse(&status)),
            told_until,
            refused_since,
            serving: SmallSet::default(),
            gone_told,
        }
    }

    /// Its Ready condition, when it is exactly as the controller writes one
    /// and putting it back changes no condition: a pass that would write the
    /// same skips rebuilding the status. Read from `rest` when a pass asks
    /// (for a node it decides), not kept for every node.
    pub fn ready(&self) -> Option<ReadyRead> {
        let rest = self.rest();
        ready_read(&rest["conditions"], &conditions(&rest))
    }

    /// The status without `podCIDRs` (`Null` when it is not an object).
    pub fn rest(&self) -> Value {
        self.rest.as_ref().map_or(Value::Null, Rest::to_value)
    }

    /// Whether `rest` (without `podCIDRs`) and `entries` are this status.
    pub fn is(&self, rest: &Value, entries: &[&Entry]) -> bool {
        self.listed
            && self.entries.len() == entries.len()
            && self.entries.iter().zip(entries).all(|(a, b)| a == *b)
            && match &self.rest {
                Some(Rest::Text(text)) => *rest.to_string() == **text,
                Some(covered) => covered.to_value() == *rest,
                None => false,
            }
    }
}

/// `condition` is the Ready condition with `status`.
fn is_ready(condition: &Condition, status: &str) -> bool {
    condition.kind.as_deref() == Some("Ready") && condition.status.as_deref() == Some(status)
}

/// The Ready condition among `conditions` (`read`: as decoded) when it has
/// exactly the keys the controller writes and merging it back leaves
/// `conditions` as they are (so it is the list's only Ready condition).
fn ready_read(conditions: &Value, read: &[Condition]) -> Option<ReadyRead> {
    let ready = read.iter().find(|c| c.kind.as_deref() == Some("Ready"))?;
    let Condition {
        status: Some(status),
        reason: Some(reason),
        message: Some(message),
        observed_generation: Some(observed_generation),
        last_transition_time: Some(_),
        rest,
        ..
    } = ready
    else {
        return None;
    };
    let merged = merge_condition(read.to_vec(), ready.clone());
    if !rest.is_empty() || serde_json::to_value(merged).ok()? != *conditions {
        return None;
    }
    Some(ReadyRead {
        status: status.as_str().into(),
        reason: reason.as_str().into(),
        message: message.as_str().into(),
        observed_generation: *observed_generation,
    })
}

/// `conditions` with the one of `condition`'s type replaced (others kept),
/// sorted by type.
pub fn merge_condition(mut conditions: Vec<Condition>, condition: Condition) -> Vec<Condition> {
    conditions.retain(|c| c.kind != condition.kind);
    conditions.push(condition);
    conditions.sort_by(|a, b| a.kind.cmp(&b.kind));
    conditions
}

/// When a `QuotaExceeded` Ready condition among `conditions` says its
/// refusal ends (the time after `QUOTA_UNTIL` in its message).
fn told_until(conditions: &[Condition]) -> Option<i64> {
    let ready = conditions.iter().find(|c| {
        c.kind.as_deref() == Some("Ready") && c.reason.as_deref() == Some(QUOTA_EXCEEDED)
    })?;
    match QuotaEnd::of(ready.message.as_deref()?) {
        QuotaEnd::At(until) => Some(until),
        QuotaEnd::Unsaid | QuotaEnd::Unreadable => None,
    }
}

/// When the `QuotaExceeded` Ready=False condition among `conditions` began.
fn refused_since(conditions: &[Condition]) -> Option<i64> {
    let ready = conditions.iter().find(|c| is_ready(c, "False"))?;
    (ready.reason.as_deref() == Some(QUOTA_EXCEEDED))
        .then_some(ready.last_transition_time.as_deref())
        .flatten()
        .and_then(crate::log::parse_rfc3339_ms)
}

/// The nodes named for one block in a [`StatusIndex`], sorted and
/// distinct (almost always one).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Names(SmallSet<ShortText>);

impl Names {
    pub fn insert(&mut self, name: &ShortText) {
        if !self.0.contains(name.as_str()) {
            self.0.insert(name.clone());
        }
    }

    pub fn remove(&mut self, name: &str) {
        self.0.remove(name);
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }

    /// The first name in name order.
    pub fn first(&self) -> Option<&str> {
        self.iter().next()
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.into_iter()
    }

    /// The names as kept: a clone shares a long name's text.
    pub fn kept(&self) -> &[ShortText] {
        self.0.as_slice()
    }
}

impl<'a> IntoIterator for &'a Names {
    type Item = &'a str;
    type IntoIter = std::iter::Map<std::slice::Iter<'a, ShortText>, fn(&ShortText) -> &str>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.as_slice().iter().map(ShortText::as_str)
    }
}

/// What the statuses say that a pass looks up by block or node, kept by
/// the cache status by status ([`StatusIndex::add`], [`StatusIndex::remove`])
/// or built whole ([`StatusIndex::of`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatusIndex {
    /// Which nodes' statuses hold each block.
    pub held: BTreeMap<Cidr, Names>,
    /// Which nodes say they still serve each block (`serving`): a change
    /// to the block decides them again.
    pub serving: BTreeMap<Cidr, Names>,
    /// The time (wall ms) each refused node was told its refusal stands
    /// until.
    pub told: BTreeMap<String, i64>,
}

impl StatusIndex {
    /// Its maps rebuilt with full nodes ([`super::refill`]).
    pub fn refill(&mut self) {
        super::refill::map(&mut self.held);
        super::refill::map(&mut self.serving);
        super::refill::map(&mut self.told);
    }

    pub fn of(statuses: &BTreeMap<ShortText, Box<Status>>) -> StatusIndex {
        let mut index = StatusIndex::default();
        for (name, status) in statuses {
            index.add(name, status);
        }
        index
    }

    /// Node `name`'s status is `status`.
    pub fn add(&mut self, name: &ShortText, status: &Status) {
        for cidr in status.entries.iter().filter_map(|e| e.cidr) {
            self.held.entry(cidr).or_default().insert(name);
        }
        self.serve(name, status.serving.as_slice());
        if let Some(until) = status.told_until {
            self.told.insert(name.to_string(), until);
        }
    }

    /// The nodes that say they serve a block overlapping `cidr`: one
    /// inside it, or one holding it (a block of another size).
    pub fn serving_overlapping(&self, cidr: &Cidr) -> BTreeSet<&ShortText> {
        let family = cidr.family();
        let (_, hi) = super::taken::span(cidr);
        let inside = (self.serving.range(*cidr..))
            .take_while(|(c, _)| c.family() == family && to_u128(c.base()) <= hi);
        let mut found: BTreeSet<&ShortText> = inside.flat_map(|(_, nodes)| nodes.kept()).collect();
        for length in 0..cidr.prefix_len() {
            let wider = cidr.widened(length).and_then(|w| self.serving.get(&w));
            found.extend(wider.into_iter().flat_map(Names::kept));
        }
        found
    }

    /// Node `name`'s status is `status` no more.
    pub fn remove(&mut self, name: &str, status: &Status) {
        let entries = status.entries.iter().filter_map(|e| e.cidr);
        unindex(&mut self.held, entries, name);
        self.unserve(name, status.serving.as_slice());
        self.told.remove(name);
    }

    /// Node `name`'s machine says it serves `cidrs`.
    pub fn serve(&mut self, name: &ShortText, cidrs: &[Cidr]) {
        for cidr in cidrs {
            self.serving.entry(*cidr).or_default().insert(name);
        }
    }

    /// Node `name`'s machine says so of `cidrs` no more.
    pub fn unserve(&mut self, name: &str, cidrs: &[Cidr]) {
        unindex(&mut self.serving, cidrs.iter().copied(), name);
    }
}

/// `name` no longer stands for `cidrs` in `index`.
fn unindex(index: &mut BTreeMap<Cidr, Names>, cidrs: impl Iterator<Item = Cidr>, name: &str) {
    for cidr in cidrs {
        if let Some(nodes) = index.get_mut(&cidr) {
            nodes.remove(name);
            if nodes.is_empty() {
                index.remove(&cidr);
            }
        }
    }
}

/// The status field holding the granted blocks.
const POD_CIDRS: &str = "podCIDRs";

/// `rest` with `entries` as its `podCIDRs`: the status to write.
pub fn assemble(rest: Value, entries: &[&Entry]) -> Value {
    let mut rest = match rest {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    let pod_cidrs = entries.iter().map(|e| e.to_value()).collect();
    rest.insert(POD_CIDRS.into(), Value::Array(pod_cidrs));
    Value::Object(rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::nnc::QUOTA_UNTIL;
    use serde_json::json;

    /// A block's names stay sorted and distinct through inserts and
    /// removes, whatever their order.
    #[test]
    fn names_are_a_sorted_set() {
        let mut names = Names::default();
        for name in ["n2", "n0", "n2", "n1"] {
            names.insert(&name.into());
        }
        assert_eq!(names.iter().collect::<Vec<_>>(), ["n0", "n1", "n2"]);
        assert_eq!(names.first(), Some("n0"));
        assert!(names.contains("n1") && !names.contains("n3"));
        names.remove("n1");
        names.remove("n3");
        assert_eq!((&names).into_iter().collect::<Vec<_>>(), ["n0", "n2"]);
        names.remove("n0");
        names.remove("n2");
        assert!(names.is_empty() && names.first().is_none());
    }

    /// The nodes serving a block overlapping one: inside it, holding it
    /// or the same; neither a neighbour nor the other family.
    #[test]
    fn serving_overlapping_finds_blocks_inside_and_around() {
        let serving = |cidrs: &[&str]| {
            Box::new(Status {
                serving: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
                ..Status::default()
            })
        };
        let statuses = BTreeMap::from([
            ("wider".into(), serving(&["198.18.0.0/26"])),
            ("same".into(), serving(&["198.18.0.32/28"])),
            ("inside".into(), serving(&["198.18.0.40/29"])),
            (
                "beside".into(),
                serving(&["198.18.0.48/28", "198.18.0.16/28"]),
            ),
            ("v6".into(), serving(&["2001:db8::/120"])),
        ]);
        let index = StatusIndex::of(&statuses);
        let found = |cidr: &str| -> Vec<&str> {
            let found = index.serving_overlapping(&cidr.parse().unwrap());
            found.into_iter().map(ShortText::as_str).collect()
        };
        assert_eq!(found("198.18.0.32/28"), ["inside", "same", "wider"]);
        assert_eq!(found("198.18.0.32/29"), ["same", "wider"]);
        assert_eq!(found("198.18.1.0/24"), Vec::<&str>::new());
        assert_eq!(found("2001:db8::10/124"), ["v6"]);
    }

    /// An entry's `cidr` reads back as written, spelled otherwise or not
    /// a CIDR at all; the usual spelling is not kept twice.
    #[test]
    fn an_entry_gives_its_cidr_back_as_written() {
        for written in ["198.18.0.0/28", "2001:DB8::/120", "198.18.0.1/28", "x"] {
            let entry = Entry::parse(&json!({"cidr": written}));
            assert_eq!(entry.cidr_text().as_deref(), Some(written));
            let canonical = entry.cidr.is_some_and(|c| c.to_string() == written);
            let odd = entry.whole.odd_cidr().is_some();
            assert_eq!(!odd, canonical, "{written}");
        }
        assert_eq!(Entry::parse(&json!({})).cidr_text(), None);
        // The odd spelling is kept with the entry's text, never beside a
        // granted one: an entry is 88 bytes (96 with a field of its own).
        assert_eq!(std::mem::size_of::<Entry>(), 88);
    }

    #[test]
    fn a_status_keeps_what_it_read_in_text_and_compares_by_it() {
        let read = json!({
            "podCIDRs": [
                {"id": "a", "cidr": "198.18.0.0/28", "network": "", "condition": {"type": "Ready", "status": "True"}},
                {"cidr": "198.18.0.16/28", "network": "blue", "type": "NonReusable"},
                {"cidr": "not a cidr"},
                {"id": "no cidr"}
            ],
            "conditions": [{"type": "Ready", "status": "False", "reason": QUOTA_EXCEEDED,
                "message": format!("pool p has no free block; {QUOTA_UNTIL}2026-01-02T03:04:05.678Z")}],
            "somethingElse": {"kept": true}
        });
        let status = Status::parse(read.clone());
        let cidrs: Vec<_> = status.entries.iter().map(|e| e.cidr).collect();
        assert_eq!(
            cidrs,
            [
                Some("198.18.0.0/28".parse().unwrap()),
                Some("198.18.0.16/28".parse().unwrap()),
                None,
                None
            ]
        );
        let texts: Vec<_> = status.entries.iter().map(Entry::cidr_text).collect();
        let texts: Vec<Option<&str>> = texts.iter().map(Option::as_deref).collect();
        assert_eq!(
            texts,
            [
                Some("198.18.0.0/28"),
                Some("198.18.0.16/28"),
                Some("not a cidr"),
                None
            ]
        );
        assert_eq!(status.entries[0].network(), DEFAULT_NETWORK);
        assert_eq!(status.entries[1].network(), "blue");
        let reusable: Vec<bool> = status.entries.iter().map(|e| e.reusable).collect();
        assert_eq!(reusable, [true, false, true, true]);
        assert_eq!(
            status.told_until,
            crate::log::parse_rfc3339_ms("2026-01-02T03:04:05.678Z")
        );
        // Rebuilt exactly; equal to itself, not to a changed copy.
        let entries: Vec<&Entry> = status.entries.iter().collect();
        assert_eq!(assemble(status.rest(), &entries), read);
        assert!(status.is(&status.rest(), &entries));
        assert!(!status.is(&status.rest(), &entries[1..]));
        let mut rest = status.rest();
        rest["conditions"][0]["status"] = json!("True");
        assert!(!status.is(&rest, &entries));
        // Key order of what was read does not matter (the text is sorted).
        let reordered: Value = serde_json::from_str(
            r#"{"network":"blue","type":"NonReusable","cidr":"198.18.0.16/28"}"#,
        )
        .unwrap();
        assert_eq!(Entry::parse(&reordered), status.entries[1]);
    }

    /// An entry as this controller grants one, and a status whose only
    /// condition is the Ready one of a covered node, are kept as their
    /// few values and give back exactly what was read; any difference
    /// keeps the text, which gives it back as exactly.
    #[test]
    fn what_the_controller_writes_is_kept_as_values_and_given_back_exactly() {
        let cidr: Cidr = "198.18.0.8/29".parse().unwrap();
        let at = 1_765_000_000_000;
        let granted = granted_entry("bench", "default", &cidr, at);
        let covered = covered_rest(at + 123, 4);
        let entry_variants: [fn(&mut Value); 5] = [
            |e| e["id"] = json!("x"),
            |e| e["network"] = json!(""),
            |e| e["condition"]["lastTransitionTime"] = json!("2025-12-06T05:46:40.5Z"),
            |e| e["extra"] = json!(1),
            |e| e["condition"]["message"] = json!("granted from MetisPool "),
        ];
        let rest_variants: [fn(&mut Value); 5] = [
            |r| r["note"] = json!({"kept": 1}),
            |r| r["conditions"][0]["message"] = json!("other"),
            |r| r["conditions"][0]["lastTransitionTime"] = json!("2025-12-06T05:46:40Z"),
            |r| {
                let other = json!({"type": "Other", "status": "True"});
                if let Some(c) = r["conditions"].as_array_mut() {
                    c.push(other);
                }
            },
            |r| {
                drop(
                    r["conditions"][0]
                        .as_object_mut()
                        .map(|c| c.remove("observedGeneration")),
                )
            },
        ];
        let whole = |entry: Value, rest: Value| {
            let mut read = rest.clone();
            read["podCIDRs"] = json!([entry]);
            let status = Status::parse(read.clone());
            let entries: Vec<&Entry> = status.entries.iter().collect();
            assert_eq!(assemble(status.rest(), &entries), read);
            assert!(status.is(&rest, &entries));
            status
        };
        let status = whole(granted.clone(), covered.clone());
        assert!(matches!(status.entries[0].whole, Whole::Granted { .. }));
        assert!(matches!(status.rest, Some(Rest::Covered { .. })));
        // The same second's grant is the same entry.
        let again = Entry::granted("bench", "default", &cidr, at + 999);
        assert_eq!(status.entries[0], again);
        for change in entry_variants {
            let mut entry = granted.clone();
            change(&mut entry);
            let status = whole(entry.clone(), covered.clone());
            assert!(
                matches!(status.entries[0].whole, Whole::Text { .. }),
                "{entry}"
            );
            assert_ne!(status.entries[0], again);
        }
        for change in rest_variants {
            let mut rest = covered.clone();
            change(&mut rest);
            let status = whole(granted.clone(), rest.clone());
            assert!(matches!(status.rest, Some(Rest::Text(_))), "{rest}");
            let entries: Vec<&Entry> = status.entries.iter().collect();
            assert!(!status.is(&covered, &entries), "{rest}");
        }
    }

    /// Only a Ready condition exactly as the controller writes it, in a
    /// list that merging it back leaves as it is, is read as one that can
    /// stand: anything else makes the pass rebuild the status.
    #[test]
    fn a_ready_condition_is_read_only_when_rewriting_it_changes_nothing() {
        let ready = json!({"type": "Ready", "status": "True", "reason": "R", "message": "m",
            "lastTransitionTime": "2026-01-01T00:00:00.000Z", "observedGeneration": 2});
        let other = json!({"type": "Other", "status": "True"});
        let read = |conditions: Value| {
            Status::parse(json!({"podCIDRs": [], "conditions": conditions})).ready()
        };
        let expected = ReadyRead {
            status: "True".into(),
            reason: "R".into(),
            message: "m".into(),
            observed_generation: 2,
        };
        assert_eq!(read(json!([other.clone(), ready.clone()])), Some(expected));
        // Unsorted, doubled, with a field more or a generation not a number.
        assert_eq!(read(json!([ready.clone(), other])), None);
        assert_eq!(read(json!([ready.clone(), ready.clone()])), None);
        let mut extra = ready.clone();
        extra["note"] = json!(1);
        assert_eq!(read(json!([extra])), None);
        let mut text = ready;
        text["observedGeneration"] = json!("2");
        assert_eq!(read(json!([text])), None);
    }

    #[test]
    fn a_malformed_condition_is_skipped_not_the_status() {
        let read = json!({"conditions": [
            "text", {"type": 7}, {"type": "Other", "status": "False"},
            {"type": "Ready", "status": "False", "reason": QUOTA_EXCEEDED,
             "lastTransitionTime": "2026-01-02T03:04:05Z", "message": "node n1 is gone: its blocks were taken back"}],
            "podCIDRs": [{"cidr": "198.18.0.0/28", "type": 5}]});
        let status = Status::parse(read.clone());
        assert_eq!(
            status.refused_since,
            crate::log::parse_rfc3339_ms("2026-01-02T03:04:05Z")
        );
        assert!(status.gone_told);
        assert_eq!(status.told_until, None, "the message says no end");
        // A malformed entry field costs that field; the entry is kept as read.
        assert_eq!(
            status.entries[0].cidr,
            Some("198.18.0.0/28".parse().unwrap())
        );
        assert!(status.entries[0].reusable);
        let entries: Vec<&Entry> = status.entries.iter().collect();
        assert_eq!(assemble(status.rest(), &entries), read);
    }

    #[test]
    fn the_serving_annotation_lists_canonical_cidrs_only() {
        let object = json!({"metadata": {"annotations": {SERVING_ANNOTATION:
            "198.18.0.16/28,198.18.0.0/28, 198.18.0.32/28,198.18.0.1/28,junk,,2001:db8::10/124,198.18.0.0/28"}}});
        let listed: Vec<String> = serving(&object)
            .as_slice()
            .iter()
            .map(Cidr::to_string)
            .collect();
        assert_eq!(
            listed,
            [
                "198.18.0.0/28",
                "198.18.0.16/28",
                "198.18.0.32/28",
                "2001:db8::10/124"
            ]
        );
        assert!(serving(&json!({"metadata": {}})).is_empty());
        assert!(serving(&json!({"metadata": {"annotations": {SERVING_ANNOTATION: 7}}})).is_empty());
    }

    #[test]
    fn a_status_that_is_not_an_object_or_lacks_its_list_is_rewritten() {
        for read in [
            json!(null),
            json!("text"),
            json!({}),
            json!({"podCIDRs": {"a": 1}}),
        ] {
            let status = Status::parse(read.clone());
            assert!(status.entries.is_empty());
            let rest = json!({"conditions": []});
            assert!(!status.is(&rest, &[]), "{read}");
            assert_eq!(status.told_until, None);
        }
        assert_eq!(Status::parse(json!(null)).rest(), Value::Null);
        assert!(Status::parse(json!({"podCIDRs": []})).is(&json!({}), &[]));
        assert_eq!(assemble(Value::Null, &[]), json!({"podCIDRs": []}));
    }
}
