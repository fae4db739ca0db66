//! What CNI 1.1.0 adds: GC (release what the runtime no longer knows) and
//! the read-only questions STATUS asks (can an ADD on this network be
//! served?), plus the read-only open STATUS needs in direct mode so that
//! polling it never creates or modifies a database.

use std::collections::HashSet;

use rusqlite::{Connection, params};

use crate::cidr::{Cidr, Family};
use crate::store::db::{Allocation, Store, StoreError, parse_addr, parse_cidr};
use crate::store::rows::block::{HeldRow, bounds_of, give_back, quarantined_in};
use crate::store::rows::free::pod_held;
use crate::store::rows::handout::InForce;

/// An allocated row GC may release.
struct Candidate {
    container_id: String,
    interface_name: String,
    row: HeldRow,
}

impl Store {
    /// Releases, in one transaction, every address of `network` held by an
    /// owner (container, interface) not in `valid` and allocated at or
    /// before `allocated_until_ms` (younger ones may belong to an ADD still
    /// in flight); and so in every other network the conflist named
    /// `conf_name` served last ([`Store::note_served_by`]): the one its
    /// `ipam.network` named before a rename, whose pods the runtime lists
    /// in this GC's `valid` too. Rows without `allocated_at` (never written
    /// by Metis) count as old. Released addresses rest for the release
    /// cooldown as on DEL, by the same give-back; reserved rows and
    /// networks another conflist served last are never touched. Returns
    /// each address with the network it was released from.
    pub fn gc(
        &mut self,
        network: &str,
        conf_name: &str,
        valid: &HashSet<(&str, &str)>,
        allocated_until_ms: i64,
        now_ms: i64,
    ) -> Result<Vec<(String, Allocation)>, StoreError> {
        let mode = self.reserve;
        let release_at = self.release_at(now_ms);
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let mut released = Vec::new();
        for covered in covered_networks(&tx, network, conf_name)? {
            let files =
                crate::store::db::co_writer::before_gc(&tx, &covered, valid, allocated_until_ms)?;
            if !files.is_empty() {
                crate::log::info(
                    "gc",
                    "released host-local's files of attachments the runtime no longer lists",
                    &[("network", &covered), ("addresses", &files.len())],
                );
            }
            let stale = gc_candidates(&tx, &covered, allocated_until_ms)?
                .into_iter()
                .filter(|c| !valid.contains(&(c.container_id.as_str(), c.interface_name.as_str())));
            let mut owners_released = HashSet::new();
            for candidate in stale {
                // Its host-local files too, whenever they were written.
                if owners_released.insert((
                    candidate.container_id.clone(),
                    candidate.interface_name.clone(),
                )) {
                    crate::store::db::co_writer::before_release(
                        &tx,
                        &covered,
                        &candidate.container_id,
                        &candidate.interface_name,
                        None,
                    )?;
                }
                give_back(&tx, mode, &covered, &candidate.row, release_at)?;
                released.push((covered.clone(), candidate.row.allocation));
            }
        }
        tx.commit()?;
        Ok(released)
    }

    /// Whether an ADD of `ranges` (with their host-local `bounds` and
    /// `isolated`) could get an address of `family` in `network` now,
    /// read-only: a configured range the ADD would add or grow into (not
    /// quarantined, with an address its bounds leave) or re-bound, or an
    /// address of the blocks it has that the ADD's own hand-out check would
    /// pass — a free row, one its growth would add, or (IPv4) one of the
    /// Draining block an allocation would take back ([`Store::first_fit`]).
    /// Quarantined blocks, and rows the check passes over (the gateway a
    /// live result names, an address held in an overlapping block), count
    /// for nothing. When it could not, the refusal's lines, in words: the
    /// quarantined blocks, the blocks whose gateway a pod holds, what the
    /// hand-out check passed over, and the bounds that leave no address
    /// (empty when there was simply nothing free). An ADD the layout would
    /// refuse is that refusal ([`StoreError::Overlap`]).
    pub fn can_allocate(
        &self,
        network: &str,
        family: Family,
        conf: &InForce,
        isolated: bool,
        now_ms: i64,
    ) -> Result<Result<(), Vec<String>>, StoreError> {
        let InForce { ranges, bounds } = conf;
        let leaves_an_address = |range: &Cidr| {
            bounds
                .iter()
                .all(|(cidr, b)| cidr != range || !b.leaves_no_address(range))
        };
        let new_room = self.would_lay_out(network, family, ranges, isolated)?;
        if new_room.iter().any(leaves_an_address) {
            return Ok(Ok(()));
        }
        // Ready blocks whose gateway a pod holds, with no address to stand
        // in for it, serve nothing, re-bounded or not (see `gateway`); the
        // gateway is the one a result would name under these bounds (the
        // explicit `gateway`, else computed).
        let held = crate::store::layout::gateway::refused_in(
            &self.conn,
            self.reserve,
            network,
            family,
            Some(bounds),
        )?;
        let unserved: HashSet<i64> = held.iter().map(|g| g.block_id).collect();
        // The ADD re-bounds a block whose bounds the configuration changed:
        // counted as room, as a range not yet added is.
        for range in ranges.iter().filter(|range| leaves_an_address(range)) {
            let asked = bounds
                .iter()
                .find(|(cidr, _)| cidr == range)
                .map(|(_, b)| *b);
            if self
                .find_block(network, range)?
                .is_some_and(|id| !unserved.contains(&id))
                && bounds_of(&self.conn, network, range)? != asked
            {
                return Ok(Ok(()));
            }
        }
        let conf = InForce {
            ranges: ranges.to_vec(),
            bounds: bounds.to_vec(),
        };
        let Err(passed_over) = self.first_fit(network, family, &conf, now_ms)? else {
            return Ok(Ok(()));
        };
        let mut lines = quarantined_in(&self.conn, network, family)?;
        lines.extend(held.iter().map(|g| g.describe()));
        lines.extend(
            passed_over
                .iter()
                .map(|line| format!("passed over, not fitting the configuration in force: {line}")),
        );
        lines.extend(
            bounds
                .iter()
                .filter(|(cidr, b)| b.leaves_no_address(cidr))
                .map(|(cidr, b)| {
                    format!(
                        "rangeStart..rangeEnd of {cidr} leaves no address but the gateway {}",
                        b.gateway
                    )
                }),
        );
        Ok(Err(lines))
    }
}

/// `network`, then every other network the conflist named `conf_name`
/// served last (none when the name is empty).
fn covered_networks(
    conn: &Connection,
    network: &str,
    conf_name: &str,
) -> Result<Vec<String>, StoreError> {
    let mut covered = vec![network.to_string()];
    if conf_name.is_empty() {
        return Ok(covered);
    }
    let mut stmt = conn.prepare_cached(
        "SELECT network FROM metis_networks WHERE conf_name = ?1 AND network != ?2 \
         ORDER BY network",
    )?;
    for other in stmt.query_map(params![conf_name, network], |r| r.get(0))? {
        covered.push(other?);
    }
    Ok(covered)
}

/// Allocated, owned rows of `network` allocated at or before the cutoff.
fn gc_candidates(
    conn: &Connection,
    network: &str,
    allocated_until_ms: i64,
) -> Result<Vec<Candidate>, StoreError> {
    let mut stmt = conn.prepare_cached(concat!(
        "SELECT a.id, b.id, a.container_id, COALESCE(a.interface_name, ''), a.address, b.cidr \
             FROM ip_addresses a JOIN cidr_blocks b ON b.id = a.cidr_block_id \
             WHERE b.network = ?1 AND ",
        pod_held!("a."),
        " AND (a.allocated_at IS NULL OR a.allocated_at <= ?2) ORDER BY b.ip_family, a.id"
    ))?;
    let mut rows = stmt.query(params![network, allocated_until_ms])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push(Candidate {
            container_id: row.get(2)?,
            interface_name: row.get(3)?,
            row: HeldRow {
                row_id: row.get(0)?,
                block_id: row.get(1)?,
                allocation: Allocation {
                    address: parse_addr(&row.get::<_, String>(4)?)?,
                    block: parse_cidr(&row.get::<_, String>(5)?)?,
                    gateway: None,
                },
            },
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cidr::Bounds;
    use crate::store::{Owner, Source};
    use crate::testutil::{TempDir, cidr};
    use rusqlite::OptionalExtension;

    const NOW: i64 = 1_700_000_000_000;

    fn take(
        store: &mut Store,
        network: &str,
        container_id: &str,
        family: Family,
        at: i64,
    ) -> String {
        let owner = Owner {
            network,
            container_id,
            interface_name: "eth0",
            pod_name: "p",
            pod_namespace: "ns",
        };
        store
            .allocate(&owner, family, at)
            .unwrap()
            .address
            .to_string()
    }

    fn owner_rows(store: &Store) -> Vec<(String, String, bool, Option<i64>)> {
        let mut stmt = store
            .conn
            .prepare(
                "SELECT address, COALESCE(container_id, ''), is_allocated, release_at \
                 FROM ip_addresses WHERE COALESCE(container_id, '') != '' ORDER BY id",
            )
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    #[test]
    fn gc_releases_unlisted_old_allocations_of_this_network_only() {
        let dir = TempDir::new();
        let mut store = dir.store_with_cooldown(60_000);
        store.add_cidr_block("net", &cidr("198.18.0.0/29")).unwrap();
        store
            .add_cidr_block("net", &cidr("2001:db8::/120"))
            .unwrap();
        store
            .add_cidr_block("other", &cidr("198.18.1.0/29"))
            .unwrap();
        take(&mut store, "net", "kept", Family::V4, NOW - 600_000);
        take(&mut store, "net", "stale", Family::V4, NOW - 600_000);
        take(&mut store, "net", "stale", Family::V6, NOW - 600_000);
        take(&mut store, "net", "young", Family::V4, NOW - 1_000);
        take(&mut store, "other", "stale", Family::V4, NOW - 600_000);

        let valid = HashSet::from([("kept", "eth0"), ("stale", "net1")]);
        let released = store.gc("net", "", &valid, NOW - 300_000, NOW).unwrap();

        let addresses: Vec<String> = released
            .iter()
            .map(|(_, a)| a.address.to_string())
            .collect();
        assert_eq!(addresses, ["198.18.0.3", "2001:db8::2"]);
        assert_eq!(
            owner_rows(&store),
            [
                ("198.18.0.2".into(), "kept".into(), true, None),
                (
                    "198.18.0.3".into(),
                    "stale".into(),
                    false,
                    Some(NOW + 60_000)
                ),
                ("198.18.0.4".into(), "young".into(), true, None),
                (
                    "2001:db8::2".into(),
                    "stale".into(),
                    false,
                    Some(NOW + 60_000)
                ),
                ("198.18.1.2".into(), "stale".into(), true, None),
            ]
        );
        assert_eq!(store.counter_mismatches().unwrap(), []);
        // Once past the grace period the young allocation goes too.
        assert_eq!(store.gc("net", "", &valid, NOW, NOW).unwrap().len(), 1);
        assert_eq!(store.counter_mismatches().unwrap(), []);
    }

    /// `ipam.network` renamed from "old" to "new" under conflist "pods":
    /// its GC also releases what "old" holds for attachments it does not
    /// list, and leaves alone what it lists and a network another conflist
    /// served last.
    #[test]
    fn gc_covers_the_networks_its_conflist_served_last() {
        let dir = TempDir::new();
        let mut store = dir.store();
        for (network, block) in [
            ("old", "198.18.0.0/29"),
            ("new", "198.18.1.0/29"),
            ("else", "198.18.2.0/29"),
        ] {
            store.add_cidr_block(network, &cidr(block)).unwrap();
        }
        take(&mut store, "old", "stranded", Family::V4, NOW - 600_000);
        take(&mut store, "old", "live", Family::V4, NOW - 600_000);
        take(&mut store, "new", "fresh", Family::V4, NOW - 600_000);
        take(&mut store, "else", "theirs", Family::V4, NOW - 600_000);
        store.note_served_by("old", "pods").unwrap();
        store.note_served_by("new", "pods").unwrap();
        store.note_served_by("else", "multus").unwrap();

        let valid = HashSet::from([("live", "eth0"), ("fresh", "eth0")]);
        let released = store.gc("new", "pods", &valid, NOW, NOW).unwrap();
        let released: Vec<(String, String)> = released
            .into_iter()
            .map(|(network, a)| (network, a.address.to_string()))
            .collect();
        assert_eq!(released, [("old".to_string(), "198.18.0.2".to_string())]);
        let held: Vec<String> = owner_rows(&store)
            .into_iter()
            .filter(|(_, _, allocated, _)| *allocated)
            .map(|(_, container, _, _)| container)
            .collect();
        assert_eq!(held, ["live", "fresh", "theirs"]);
        // Without a conflist name GC stays in its network.
        assert!(
            store
                .gc("new", "", &HashSet::new(), NOW, NOW)
                .unwrap()
                .len()
                == 1
        );
        assert_eq!(store.check("old", "live", "eth0").unwrap().len(), 1);
    }

    /// The record follows the conflist's last ADD; an empty name or the
    /// same name again writes nothing.
    #[test]
    fn the_last_conflist_to_serve_a_network_is_recorded() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let recorded = |store: &Store| -> Option<String> {
            store
                .conn
                .query_row(
                    "SELECT conf_name FROM metis_networks WHERE network = 'net'",
                    [],
                    |r| r.get(0),
                )
                .optional()
                .unwrap()
                .flatten()
        };
        store.note_served_by("net", "").unwrap();
        assert_eq!(recorded(&store), None);
        store.note_served_by("net", "a").unwrap();
        store.note_served_by("net", "b").unwrap();
        assert_eq!(recorded(&store).as_deref(), Some("b"));
        let changes = store.conn.total_changes();
        store.note_served_by("net", "b").unwrap();
        store.note_served_by("net", "").unwrap();
        assert_eq!(store.conn.total_changes(), changes);
        assert_eq!(recorded(&store).as_deref(), Some("b"));
    }

    #[test]
    fn gc_with_nothing_valid_and_no_grace_empties_the_network_but_keeps_reservations() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store.add_cidr_block("net", &cidr("198.18.0.0/30")).unwrap();
        take(&mut store, "net", "a", Family::V4, NOW);
        let released = store.gc("net", "", &HashSet::new(), NOW, NOW).unwrap();
        assert_eq!(released.len(), 1);
        let reserved: i64 = store
            .conn
            .query_row(
                "SELECT COUNT(*) FROM ip_addresses WHERE is_allocated = 1",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(reserved, 3, "network, gateway and broadcast stay reserved");
        assert_eq!(owner_rows(&store)[0].3, None, "no cooldown asked for");
        assert_eq!(store.counter_mismatches().unwrap(), []);
    }

    #[test]
    fn can_allocate_until_full_then_after_cooldown() {
        let dir = TempDir::new();
        let mut store = dir.store_with_cooldown(60_000);
        let range = [cidr("198.18.0.0/30")];
        assert!(
            store
                .can_allocate(
                    "net",
                    Family::V4,
                    &crate::store::InForce {
                        ranges: range.to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_ok(),
            "range not added yet"
        );
        store.add_cidr_block("net", &range[0]).unwrap();
        assert!(
            store
                .can_allocate(
                    "net",
                    Family::V4,
                    &crate::store::InForce {
                        ranges: range.to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_ok()
        );
        take(&mut store, "net", "a", Family::V4, NOW);
        assert!(
            store
                .can_allocate(
                    "net",
                    Family::V4,
                    &crate::store::InForce {
                        ranges: range.to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_err()
        );
        store.release("net", "a", "eth0", NOW).unwrap();
        assert!(
            store
                .can_allocate(
                    "net",
                    Family::V4,
                    &crate::store::InForce {
                        ranges: range.to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_err(),
            "cooling down"
        );
        assert!(
            store
                .can_allocate(
                    "net",
                    Family::V4,
                    &crate::store::InForce {
                        ranges: range.to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW + 60_000
                )
                .unwrap()
                .is_ok()
        );
        let more = [range[0], cidr("198.18.0.4/30")];
        assert!(
            store
                .can_allocate(
                    "net",
                    Family::V4,
                    &crate::store::InForce {
                        ranges: more.to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_ok(),
            "a range left to add"
        );
    }

    #[test]
    fn can_allocate_is_false_or_the_refusal_whenever_an_add_would_fail() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let range = [cidr("198.18.70.0/28")];
        let can = |store: &Store, network, isolated, bounds: &[(Cidr, Bounds)]| {
            store.can_allocate(
                network,
                Family::V4,
                &crate::store::InForce {
                    ranges: range.to_vec(),
                    bounds: (bounds).to_vec(),
                },
                isolated,
                NOW,
            )
        };
        store
            .configure(
                &crate::store::Wish {
                    source: Source::Cni,
                    network: "net-y",
                    family: Family::V4,
                    ranges: &range,
                    isolated: false,
                },
                NOW,
            )
            .unwrap();
        // Another network over Y's block: ADD gets code 7, so does STATUS.
        let refused = can(&store, "net-x", false, &[]);
        assert!(
            matches!(refused, Err(StoreError::Overlap { .. })),
            "{refused:?}"
        );
        assert_eq!(
            can(&store, "net-x", true, &[]).unwrap(),
            Ok(()),
            "isolated, it may"
        );
        // Isolated, then the conflist drops `isolated`: refused likewise.
        store
            .configure(
                &crate::store::Wish {
                    source: Source::Cni,
                    network: "net-x",
                    family: Family::V4,
                    ranges: &range,
                    isolated: true,
                },
                NOW,
            )
            .unwrap();
        let refused = can(&store, "net-x", false, &[]);
        assert!(
            matches!(refused, Err(StoreError::Overlap { .. })),
            "{refused:?}"
        );
        assert_eq!(can(&store, "net-x", true, &[]).unwrap(), Ok(()));
        // Every block quarantined: nothing to hand out, and it is named.
        let id = store.find_block("net-y", &range[0]).unwrap().unwrap();
        crate::store::rows::block::quarantine(&store.conn, id, "a test said so").unwrap();
        assert_eq!(
            can(&store, "net-y", false, &[]).unwrap(),
            Err(vec![
                "quarantined block 198.18.70.0/28 (a test said so)".to_string()
            ])
        );
        assert!(
            quarantined_in(&store.conn, "net-y", Family::V6)
                .unwrap()
                .is_empty()
        );
        // A range not yet a block whose bounds leave only the gateway.
        let small = cidr("198.18.72.0/29");
        let gateway = "198.18.72.1".parse().unwrap();
        let empty = Bounds::new(&small, Some(gateway), Some(gateway), Some(gateway)).unwrap();
        let fine = Bounds::new(&small, Some(gateway), None, Some(gateway)).unwrap();
        let status = |bounds: Bounds| {
            store.can_allocate(
                "net-z",
                Family::V4,
                &crate::store::InForce {
                    ranges: [small].to_vec(),
                    bounds: [(small, bounds)].to_vec(),
                },
                false,
                NOW,
            )
        };
        assert_eq!(
            status(empty).unwrap(),
            Err(vec![
                "rangeStart..rangeEnd of 198.18.72.0/29 leaves no address but the gateway 198.18.72.1"
                    .to_string()
            ])
        );
        assert_eq!(status(fine).unwrap(), Ok(()));
    }

    #[test]
    fn can_allocate_v6_while_the_block_can_grow() {
        let dir = TempDir::new();
        let mut store = dir.store();
        // 128 addresses, 64 populated at first: full rows, but room to grow.
        let range = [cidr("2001:db8::/121")];
        store.add_cidr_block("net", &range[0]).unwrap();
        for i in 0..62 {
            take(&mut store, "net", &format!("c{i}"), Family::V6, NOW);
        }
        assert!(
            store
                .can_allocate(
                    "net",
                    Family::V6,
                    &crate::store::InForce {
                        ranges: range.to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_ok()
        );
        for i in 62..126 {
            take(&mut store, "net", &format!("c{i}"), Family::V6, NOW);
        }
        assert!(
            store
                .can_allocate(
                    "net",
                    Family::V6,
                    &crate::store::InForce {
                        ranges: range.to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_err()
        );
    }

    #[test]
    fn read_only_open_never_creates_or_writes() {
        let dir = TempDir::new();
        assert!(Store::open_read_only(&dir.db()).unwrap().is_none());
        assert!(!dir.db().exists());
        std::fs::write(dir.db(), b"").unwrap();
        assert!(
            Store::open_read_only(&dir.db()).unwrap().is_none(),
            "no schema yet"
        );
        assert_eq!(std::fs::metadata(dir.db()).unwrap().len(), 0);
        std::fs::remove_file(dir.db()).unwrap();

        let mut store = dir.store();
        store.add_cidr_block("net", &cidr("198.18.0.0/29")).unwrap();
        take(&mut store, "net", "a", Family::V4, NOW);
        drop(store);
        let mut read_only = Store::open_read_only(&dir.db()).unwrap().unwrap();
        let range = [cidr("198.18.0.0/29")];
        assert!(
            read_only
                .can_allocate(
                    "net",
                    Family::V4,
                    &crate::store::InForce {
                        ranges: range.to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_ok()
        );
        assert!(
            read_only.gc("net", "", &HashSet::new(), NOW, NOW).is_err(),
            "cannot write"
        );
    }
}
