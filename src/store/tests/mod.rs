//! The store's unit tests, by concern, and the helpers they share.
//! Convention: a store comes from a `TempDir` (`dir.store()`, `dir.store_with_cooldown(ms)`, `store_mode(&dir, mode)`, or `store_with(blocks)` holding blocks); `Store::open` by hand only where the path or the options are the point; every shared helper lives here.

mod alloc;
mod alone;
mod batch;
mod growth;
mod handout;
mod healing;
mod lifecycle;
mod listings;
mod open;
mod plans;
mod probes;
mod reserve;
mod rollback;
mod statements;
mod upstream;

use std::collections::HashSet;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension};

use super::*;
use crate::cidr::{Cidr, Family};
use crate::cni::conf;
use crate::cni::plugin::family_add;
use crate::engine::request::{Add, Command, Del, Pod};
use crate::names::Attachment;
use crate::store::db::*;

const NOW: i64 = 1_700_000_000_000;

use crate::testutil::{TempDir, cidr};

fn opts(reserve: Option<ReserveMode>, release_cooldown: Option<i64>) -> StoreOptions {
    StoreOptions {
        durability: Durability::Normal,
        reserve,
        release_cooldown,
        one_request: false,
    }
}

/// `dir`'s store opened with reservation mode `mode` (stored if different).
fn store_mode(dir: &TempDir, mode: ReserveMode) -> Store {
    Store::open(&dir.db(), &opts(Some(mode), None)).unwrap()
}

/// Adds blocks (network, cidr) in order: block ids 1, 2, … on a new store.
fn add_blocks(store: &mut Store, blocks: &[(&str, &str)]) {
    for (network, prefix) in blocks {
        store.add_cidr_block(network, &cidr(prefix)).unwrap();
    }
}

/// A new store (default options) holding `blocks`; keep the directory alive.
fn store_with(blocks: &[(&str, &str)]) -> (TempDir, Store) {
    store_opts_with(&opts(None, None), blocks)
}

/// A new store opened with `opts`, holding `blocks`.
fn store_opts_with(opts: &StoreOptions, blocks: &[(&str, &str)]) -> (TempDir, Store) {
    let dir = TempDir::new();
    let mut store = Store::open(&dir.db(), opts).unwrap();
    add_blocks(&mut store, blocks);
    (dir, store)
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn owner<'a>(network: &'a str, container_id: &'a str) -> Owner<'a> {
    Owner {
        network,
        container_id,
        interface_name: "eth0",
        pod_name: "pod",
        pod_namespace: "ns",
    }
}

fn wall_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

fn alloc(store: &mut Store, network: &str, cid: &str, family: Family, now: i64) -> IpAddr {
    store
        .allocate(&owner(network, cid), family, now)
        .unwrap()
        .address
}

fn block(store: &Store, id: i64) -> BlockInfo {
    store
        .blocks(&BlockFilter::default())
        .unwrap()
        .into_iter()
        .find(|b| b.id == id)
        .unwrap()
}

/// (address, is_allocated, container_id, release_at) of a block's rows, id order.
fn rows(store: &Store, block_id: i64) -> Vec<(String, bool, String, Option<i64>)> {
    let mut stmt = store
        .conn
        .prepare(
            "SELECT address, is_allocated, COALESCE(container_id, ''), release_at \
             FROM ip_addresses WHERE cidr_block_id = ?1 ORDER BY id",
        )
        .unwrap();
    stmt.query_map([block_id], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

fn reserved_addrs(store: &Store, block_id: i64) -> Vec<String> {
    rows(store, block_id)
        .into_iter()
        .filter(|r| r.1 && r.2.is_empty())
        .map(|r| r.0)
        .collect()
}

/// Another writer (upstream, a hand edit) puts pod `container` on the row
/// of `address`, whatever it was.
fn give_row_to(store: &Store, address: &str, container: &str) {
    store
        .conn
        .execute(
            "UPDATE ip_addresses SET container_id = ?2, interface_name = 'eth0' WHERE address = ?1",
            [address, container],
        )
        .unwrap();
}

fn assert_counters(store: &Store) {
    assert_eq!(store.counter_mismatches().unwrap(), Vec::new());
}

/// The network the engine-level tests serve (statements, alone).
const CONF: &str = r#"{"cniVersion":"1.0.0","name":"bench","type":"metis","ipam":{"type":"metis","ranges":[[{"subnet":"198.18.0.0/24"}]],"routes":[{"dst":"0.0.0.0/0"}]}}"#;

fn pod() -> Pod {
    Pod {
        namespace: "ns".into(),
        name: "p".into(),
    }
}

/// A CNI ADD of `container` on [`CONF`]'s network.
fn add(container: &str) -> Command {
    let net_conf = conf::parse(CONF.as_bytes()).unwrap();
    let owner = Attachment::new(container, "eth0").unwrap();
    Command::Add(Box::new(Add {
        network: net_conf.network.clone(),
        pod: pod(),
        ipv4: family_add(&net_conf, Family::V4, &owner, &[]),
        ipv6: None,
        isolated: false,
        conf_name: "bench".into(),
    }))
}

/// A CNI DEL of `container` on [`CONF`]'s network.
fn del(container: &str) -> Command {
    Command::Del(Del {
        network: "bench".into(),
        owner: Attachment::new(container, "eth0").unwrap(),
        pod: pod(),
    })
}
