//! host-local bounds (`rangeStart`, `rangeEnd`, `gateway`): recording a
//! network's bounds and re-reserving the blocks whose bounds changed.

use rusqlite::{Connection, OptionalExtension, params};

use crate::cidr::{Bounds, Cidr, Family};
use crate::store::db::{ReserveMode, Store, StoreError, parse_cidr};
use crate::store::rows::block::{block_reserved, bounds_of, frontier, set_frontier, settle};

/// After a block's bounds changed: rows exist from the old range start up
/// to the frontier, so a range that now starts lower needs growth from its
/// new start (rows already there are passed over once, at the next growth).
fn rewind_frontier(
    conn: &Connection,
    mode: ReserveMode,
    id: i64,
    network: &str,
    cidr: &Cidr,
) -> Result<(), StoreError> {
    let start = block_reserved(conn, mode, id, network, cidr)?
        .usable(cidr.size())
        .start;
    if start < frontier(conn, id, cidr)? {
        set_frontier(conn, id, start)?;
    }
    Ok(())
}

/// A network's recorded bounds of one family, by block prefix.
fn recorded_bounds(
    conn: &Connection,
    network: &str,
    family: Family,
) -> Result<Vec<(String, Bounds)>, StoreError> {
    let rows: Vec<String> = conn
        .prepare_cached("SELECT cidr FROM metis_bounds WHERE network = ?1 ORDER BY cidr")?
        .query_map([network], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    let mut recorded = Vec::new();
    for text in rows {
        let cidr = parse_cidr(&text)?;
        if cidr.family() != family {
            continue;
        }
        if let Some(bounds) = bounds_of(conn, network, &cidr)? {
            recorded.push((text, bounds));
        }
    }
    Ok(recorded)
}

impl Store {
    /// Records the host-local bounds of `network`'s `family` blocks (the
    /// CNI ranges that have some; the others lose theirs) and re-reserves
    /// every block whose bounds changed, pods keeping their addresses.
    /// Reads only when nothing changed, so it runs on every ADD. Returns
    /// the prefixes whose reservation changed.
    pub fn set_bounds(
        &mut self,
        network: &str,
        family: Family,
        wanted: &[(Cidr, Bounds)],
    ) -> Result<Vec<String>, StoreError> {
        let mut want: Vec<(String, Bounds)> = wanted
            .iter()
            .filter(|(cidr, _)| cidr.family() == family)
            .map(|(cidr, bounds)| (cidr.to_string(), *bounds))
            .collect();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        let have = recorded_bounds(&self.conn, network, family)?;
        if have == want {
            return Ok(Vec::new());
        }
        let mut changed: Vec<String> = have
            .iter()
            .filter(|entry| !want.contains(entry))
            .chain(want.iter().filter(|entry| !have.contains(entry)))
            .map(|(cidr, _)| cidr.clone())
            .collect();
        changed.sort();
        changed.dedup();
        let mode = self.reserve;
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        for (cidr, _) in &have {
            tx.prepare_cached("DELETE FROM metis_bounds WHERE network = ?1 AND cidr = ?2")?
                .execute(params![network, cidr])?;
        }
        for (cidr, bounds) in &want {
            tx.prepare_cached(
                "INSERT INTO metis_bounds (network, cidr, range_start, range_end, gateway) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                network,
                cidr,
                bounds.start.to_string(),
                bounds.end.to_string(),
                bounds.gateway.to_string()
            ])?;
        }
        for text in &changed {
            let block: Option<i64> = tx
                .prepare_cached(
                    "SELECT id FROM cidr_blocks WHERE network = ?1 AND cidr = ?2 \
                     AND state != 'Deleting'",
                )?
                .query_row(params![network, text], |r| r.get(0))
                .optional()?;
            if let Some(id) = block {
                let cidr = parse_cidr(text)?;
                rewind_frontier(&tx, mode, id, network, &cidr)?;
                settle(&tx, mode, id, network, &cidr)?;
            }
        }
        tx.commit()?;
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Source;
    use crate::store::rows::block::Reserved;
    use crate::testutil::{TempDir, assert_sound, cidr, owner};

    const NOW: i64 = 1_000_000;

    fn bounded(
        store: &mut Store,
        subnet: &str,
        start: &str,
        end: &str,
        gateway: &str,
    ) -> Vec<String> {
        let net = cidr(subnet);
        store
            .configure(
                &crate::store::Wish {
                    source: Source::Cni,
                    network: "pods",
                    family: net.family(),
                    ranges: &[net],
                    isolated: false,
                },
                NOW,
            )
            .unwrap();
        let bounds = Bounds::new(
            &net,
            Some(start.parse().unwrap()),
            Some(end.parse().unwrap()),
            Some(gateway.parse().unwrap()),
        )
        .unwrap();
        store
            .set_bounds("pods", net.family(), &[(net, bounds)])
            .unwrap()
    }

    fn take_all(store: &mut Store, family: Family) -> Vec<String> {
        (0..)
            .map(|i| format!("c{i}"))
            .map_while(|id| store.allocate(&owner(&id), family, NOW).ok())
            .map(|a| a.address.to_string())
            .collect()
    }

    #[test]
    fn a_bounded_block_hands_out_only_its_range_and_never_its_gateway() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let changed = bounded(
            &mut store,
            "198.18.0.0/28",
            "198.18.0.4",
            "198.18.0.8",
            "198.18.0.6",
        );
        assert_eq!(changed, ["198.18.0.0/28"]);
        assert_eq!(
            take_all(&mut store, Family::V4),
            ["198.18.0.4", "198.18.0.5", "198.18.0.7", "198.18.0.8"]
        );
        assert_sound(&store);
        // The same bounds again: nothing to do, nothing written.
        assert!(
            bounded(
                &mut store,
                "198.18.0.0/28",
                "198.18.0.4",
                "198.18.0.8",
                "198.18.0.6"
            )
            .is_empty()
        );
        // A gateway outside the block reserves nothing in it.
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "198.18.1.0/29",
            "198.18.1.0",
            "198.18.1.7",
            "198.19.0.1",
        );
        assert_eq!(take_all(&mut store, Family::V4).len(), 8);
        assert_sound(&store);
    }

    #[test]
    fn requested_addresses_outside_the_range_are_refused() {
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "198.18.0.0/28",
            "198.18.0.4",
            "198.18.0.8",
            "198.18.0.6",
        );
        for refused in ["198.18.0.3", "198.18.0.6", "198.18.0.9"] {
            let err = store
                .allocate_requested(&owner("r"), refused.parse().unwrap(), NOW)
                .unwrap_err();
            assert!(
                matches!(err, StoreError::RequestedIpUnavailable { .. }),
                "{refused}: {err}"
            );
        }
        let got = store
            .allocate_requested(&owner("r"), "198.18.0.8".parse().unwrap(), NOW)
            .unwrap();
        assert_eq!(got.address.to_string(), "198.18.0.8");
    }

    #[test]
    fn narrowing_the_range_keeps_pods_and_takes_back_their_addresses_on_release() {
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "198.18.0.0/28",
            "198.18.0.2",
            "198.18.0.14",
            "198.18.0.1",
        );
        let first = store.allocate(&owner("a"), Family::V4, NOW).unwrap();
        assert_eq!(first.address.to_string(), "198.18.0.2");
        // .2 leaves the range while pod "a" holds it.
        bounded(
            &mut store,
            "198.18.0.0/28",
            "198.18.0.10",
            "198.18.0.14",
            "198.18.0.1",
        );
        assert_sound(&store);
        assert_eq!(
            take_all(&mut store, Family::V4),
            [
                "198.18.0.10",
                "198.18.0.11",
                "198.18.0.12",
                "198.18.0.13",
                "198.18.0.14"
            ]
        );
        store.release("pods", "a", "eth0", NOW).unwrap();
        assert_sound(&store);
        assert!(store.allocate(&owner("late"), Family::V4, NOW).is_err());
        // Bounds dropped: Metis's own reservation again (.2-.9 free).
        let net = cidr("198.18.0.0/28");
        assert_eq!(
            store.set_bounds("pods", Family::V4, &[]).unwrap(),
            ["198.18.0.0/28"]
        );
        assert_eq!(
            store
                .allocate(&owner("late"), Family::V4, NOW)
                .unwrap()
                .address
                .to_string(),
            "198.18.0.2"
        );
        assert_eq!(bounds_of(&store.conn, "pods", &net).unwrap(), None);
        assert_sound(&store);
    }

    fn row_count(store: &Store) -> i64 {
        store
            .conn
            .query_row("SELECT COUNT(*) FROM ip_addresses", [], |r| r.get(0))
            .unwrap()
    }

    #[test]
    fn a_bounded_big_ipv4_block_writes_rows_only_inside_its_range() {
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "198.16.0.0/12",
            "198.16.1.0",
            "198.16.1.9",
            "198.16.1.1",
        );
        let first = take_all(&mut store, Family::V4);
        assert_eq!(first.len(), 9);
        assert_eq!(first[0], "198.16.1.0");
        assert!(!first.contains(&"198.16.1.1".to_string()));
        // The first batch, the broadcast and the range: never the /12.
        assert!(row_count(&store) < 200, "{}", row_count(&store));
        assert!(
            store
                .can_allocate(
                    "pods",
                    Family::V4,
                    &crate::store::InForce {
                        ranges: [].to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_err()
        );
        assert_sound(&store);

        // A range that now starts lower grows from its new start.
        let net = cidr("198.16.0.0/12");
        let lower = Bounds::new(
            &net,
            Some("198.16.0.250".parse().unwrap()),
            Some("198.16.1.9".parse().unwrap()),
            Some("198.16.1.1".parse().unwrap()),
        )
        .unwrap();
        store
            .set_bounds("pods", Family::V4, &[(net, lower)])
            .unwrap();
        assert!(
            store
                .can_allocate(
                    "pods",
                    Family::V4,
                    &crate::store::InForce {
                        ranges: [].to_vec(),
                        bounds: [].to_vec()
                    },
                    false,
                    NOW
                )
                .unwrap()
                .is_ok()
        );
        let more: Vec<String> = (0..)
            .map(|i| format!("d{i}"))
            .map_while(|id| store.allocate(&owner(&id), Family::V4, NOW).ok())
            .map(|a| a.address.to_string())
            .collect();
        assert_eq!(
            more,
            [
                "198.16.0.250",
                "198.16.0.251",
                "198.16.0.252",
                "198.16.0.253",
                "198.16.0.254",
                "198.16.0.255"
            ]
        );
        assert_sound(&store);
    }

    #[test]
    fn a_block_narrowed_out_of_its_bounds_grows_every_address_it_skipped() {
        let dir = TempDir::new();
        let mut store = dir.store();
        // Rows: the first batch, then the range far beyond it.
        bounded(
            &mut store,
            "198.18.0.0/24",
            "198.18.0.100",
            "198.18.0.101",
            "198.18.0.1",
        );
        assert_eq!(take_all(&mut store, Family::V4).len(), 2);
        let half = cidr("198.18.0.0/25");
        store
            .configure(
                &crate::store::Wish {
                    source: Source::Cni,
                    network: "pods",
                    family: Family::V4,
                    ranges: &[half],
                    isolated: false,
                },
                NOW,
            )
            .unwrap();
        store.set_bounds("pods", Family::V4, &[]).unwrap();
        let rest: Vec<String> = (0..)
            .map(|i| format!("d{i}"))
            .map_while(|id| store.allocate(&owner(&id), Family::V4, NOW).ok())
            .map(|a| a.address.to_string())
            .collect();
        // 128 addresses: network, gateway, broadcast reserved, two held.
        assert_eq!(rest.len(), 128 - 3 - 2, "{rest:?}");
        assert!(rest.contains(&"198.18.0.64".to_string()));
        assert_sound(&store);
    }

    #[test]
    fn a_bounded_ipv6_block_grows_lazily_inside_its_range() {
        let dir = TempDir::new();
        let mut store = dir.store();
        bounded(
            &mut store,
            "2001:db8::/64",
            "2001:db8::ffff:ffff:ffff:fffe",
            "2001:db8::ffff:ffff:ffff:ffff",
            "2001:db8::1",
        );
        assert_eq!(
            take_all(&mut store, Family::V6),
            [
                "2001:db8::ffff:ffff:ffff:fffe",
                "2001:db8::ffff:ffff:ffff:ffff"
            ]
        );
        let reserved = Reserved::bounded(
            &cidr("2001:db8::/64"),
            &Bounds::new(
                &cidr("2001:db8::/64"),
                None,
                Some("2001:db8::ff".parse().unwrap()),
                None,
            )
            .unwrap(),
        );
        assert_eq!(reserved.count(1 << 64), (1u128 << 64) - 255 + 1);
    }
}
