//! The cluster's grants, level-triggered: at every sync a source's blocks
//! (the Node's podCIDRs, the NodeNetworkConfig's Ready entries) become
//! exactly what it grants now. A block it no longer grants is retired
//! like a block no configuration wants any more (Draining, never taken
//! back by an exhausted allocation, its pods keep their addresses) and is
//! deleted once no pod holds an address in it and nothing cools in it.
//! Static sources' blocks are never touched. Also the memory of what this
//! node released, which no grant may override for a `NonReusable` block.

use rusqlite::{Connection, params};

use crate::cidr::{Cidr, Family};
use crate::store::db::{ReserveMode, Store, StoreError, parse_cidr};
use crate::store::layout::blocks::{self, Placed, Source};

/// A block the store could not take from the cluster, with the owner of
/// the block it overlaps in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub network: String,
    pub cidr: Cidr,
    pub other_cidr: String,
    pub other_network: String,
    /// Who the overlapped block belongs to (`--cidr`, a CNI configuration,
    /// the cluster, …).
    pub owner: String,
}

/// What following the grants changed: (network, cidr) of each block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrantChanges {
    /// New blocks.
    pub added: Vec<(String, Cidr)>,
    /// Blocks taken back earlier and granted again.
    pub granted_again: Vec<(String, Cidr)>,
    /// Blocks no longer granted (retired; pods keep their addresses).
    pub taken_back: Vec<(String, Cidr)>,
    /// Taken-back blocks deleted: no pod held an address in them.
    pub deleted: Vec<(String, Cidr)>,
    /// Granted blocks this node is releasing (Deleting): left so until
    /// the status drops them.
    pub releasing: Vec<(String, Cidr)>,
    pub refused: Vec<Refusal>,
}

/// A block the cluster no longer grants that pods still use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenBack {
    pub id: i64,
    pub network: String,
    pub cidr: String,
    pub source: String,
    pub since_ms: i64,
    /// Addresses pods hold in it.
    pub pods: i64,
    /// When the last address released in it stops cooling (wall-clock ms):
    /// with no pod left, it is deleted then.
    pub cooled_at_ms: Option<i64>,
}

/// A block this node released (`metis_released`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleasedBlock {
    pub network: String,
    pub cidr: Cidr,
    pub reusable: bool,
    pub released_at: i64,
}

impl Store {
    /// Makes `source`'s blocks of `families` exactly `granted` (network,
    /// prefix): the rest is retired, granted blocks are added (or taken
    /// back from retirement), and retired blocks no pod uses are deleted.
    /// A granted prefix that overlaps another block is refused and
    /// reported; everything else is applied, in one transaction.
    pub fn follow_grants(
        &mut self,
        source: Source,
        families: &[Family],
        granted: &[(String, Cidr)],
        now_ms: i64,
    ) -> Result<GrantChanges, StoreError> {
        let mode = self.reserve;
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let grant = blocks::Grant {
            source,
            at_ms: now_ms,
        };
        let mut changes = GrantChanges {
            taken_back: take_back_ungranted(&tx, grant, families, granted)?,
            ..GrantChanges::default()
        };
        add_granted(&tx, mode, grant, granted, &mut changes)?;
        changes.deleted = sweep(&tx, now_ms)?;
        tx.commit()?;
        Ok(changes)
    }

    /// Deletes taken-back blocks that no pod uses any more (a DEL freed
    /// the last address, or its cooldown ended). Returns them.
    pub fn sweep_taken_back(&mut self, now_ms: i64) -> Result<Vec<(String, Cidr)>, StoreError> {
        if self.taken_back()?.is_empty() {
            return Ok(Vec::new());
        }
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        let deleted = sweep(&tx, now_ms)?;
        tx.commit()?;
        Ok(deleted)
    }

    /// Blocks the cluster no longer grants, oldest first.
    pub fn taken_back(&self) -> Result<Vec<TakenBack>, StoreError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT b.id, b.network, b.cidr, t.source, t.since_ms, \
               (SELECT COUNT(*) FROM ip_addresses a WHERE a.cidr_block_id = b.id \
                  AND a.is_allocated = 1 AND COALESCE(a.container_id, '') != ''), \
               (SELECT MAX(a.release_at) FROM ip_addresses a WHERE a.cidr_block_id = b.id \
                  AND a.is_allocated = FALSE) \
             FROM metis_taken_back t JOIN cidr_blocks b ON b.id = t.block_id ORDER BY b.id",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(TakenBack {
                id: r.get(0)?,
                network: r.get(1)?,
                cidr: r.get(2)?,
                source: r.get(3)?,
                since_ms: r.get(4)?,
                pods: r.get(5)?,
                cooled_at_ms: r.get(6)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Records that this node released a block. A NonReusable release
    /// stays so: it is never recorded reusable again.
    pub fn record_release(
        &mut self,
        network: &str,
        cidr: &Cidr,
        reusable: bool,
        now_ms: i64,
    ) -> Result<(), StoreError> {
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        tx.prepare_cached(
            "INSERT INTO metis_released (network, cidr, reusable, released_at) \
             VALUES (?1, ?2, ?3, ?4) ON CONFLICT (network, cidr) DO UPDATE SET \
             reusable = MIN(reusable, excluded.reusable), released_at = excluded.released_at",
        )?
        .execute(params![network, cidr.to_string(), reusable, now_ms])?;
        tx.commit()?;
        Ok(())
    }

    /// Every block this node released, oldest release first.
    pub fn released(&self) -> Result<Vec<ReleasedBlock>, StoreError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT network, cidr, reusable, released_at FROM metis_released \
             ORDER BY released_at, network, cidr",
        )?;
        let mut rows = stmt.query([])?;
        let mut out = Vec::new();
        while let Some(row) = rows.next()? {
            out.push(ReleasedBlock {
                network: row.get(0)?,
                cidr: parse_cidr(&row.get::<_, String>(1)?)?,
                reusable: row.get(2)?,
                released_at: row.get(3)?,
            });
        }
        Ok(out)
    }

    /// The uids of this node's `kind` object the daemon followed, the
    /// current one last (none recorded: empty).
    pub fn followed_uids(&self, kind: &str) -> Result<Vec<String>, StoreError> {
        let text = self.setting(&followed_uids_key(kind))?.unwrap_or_default();
        Ok(text.split_whitespace().map(str::to_string).collect())
    }

    /// Records [`followed_uids`](Store::followed_uids).
    pub fn set_followed_uids(&mut self, kind: &str, uids: &[String]) -> Result<(), StoreError> {
        // A uid is a UUID; one that could not be read back whole is left out.
        let kept: Vec<&str> = (uids.iter().map(String::as_str))
            .filter(|u| !u.is_empty() && !u.contains(char::is_whitespace))
            .collect();
        self.put_setting(&followed_uids_key(kind), Some(&kept.join(" ")))
    }

    /// Forgets a reusable release: the cluster granted the block again.
    pub fn forget_release(&mut self, network: &str, cidr: &Cidr) -> Result<(), StoreError> {
        let tx = crate::store::db::write(&mut self.conn, self.batch)?;
        tx.prepare_cached(
            "DELETE FROM metis_released WHERE network = ?1 AND cidr = ?2 AND reusable = 1",
        )?
        .execute(params![network, cidr.to_string()])?;
        tx.commit()?;
        Ok(())
    }
}

/// Takes `grant`'s source off every block of `families` it no longer
/// grants; a block left with no source is retired and recorded as taken
/// back. Returns those.
fn take_back_ungranted(
    tx: &Connection,
    grant: blocks::Grant,
    families: &[Family],
    granted: &[(String, Cidr)],
) -> Result<Vec<(String, Cidr)>, StoreError> {
    let blocks::Grant { source, at_ms } = grant;
    let mut taken_back = Vec::new();
    for (network, family) in networks(tx, families)? {
        for block in blocks::placed(tx, &network, family)? {
            let Some(sources) = &block.sources else {
                continue;
            };
            let wanted = granted
                .iter()
                .any(|(n, c)| *n == network && *c == block.cidr);
            if wanted || !sources.contains(&source) {
                continue;
            }
            let mut left = sources.clone();
            left.remove(&source);
            blocks::write_sources(tx, block.id, &left)?;
            if left.is_empty() && !block.quarantined {
                blocks::set_retired(tx, block.id, true, at_ms)?;
                tx.prepare_cached(
                    "INSERT OR REPLACE INTO metis_taken_back (block_id, source, since_ms) \
                     VALUES (?1, ?2, ?3)",
                )?
                .execute(params![block.id, source.as_str(), at_ms])?;
                taken_back.push((network.clone(), block.cidr));
            }
        }
    }
    Ok(taken_back)
}

/// Adds every granted block (or takes it back from retirement); one that
/// overlaps another block is refused and reported with that block's owner.
fn add_granted(
    tx: &Connection,
    mode: ReserveMode,
    grant: blocks::Grant,
    granted: &[(String, Cidr)],
    changes: &mut GrantChanges,
) -> Result<(), StoreError> {
    for (network, cidr) in granted {
        if is_deleting(tx, network, cidr)? {
            changes.releasing.push((network.clone(), *cidr));
            continue;
        }
        let before = blocks::placed(tx, network, cidr.family())?;
        let was_retired = before
            .iter()
            .any(|b| b.cidr == *cidr && b.retired && !b.quarantined);
        match blocks::add_block(tx, mode, network, cidr, Some(grant)) {
            Ok(crate::store::db::AddOutcome::Added(_)) => {
                changes.added.push((network.clone(), *cidr))
            }
            Ok(crate::store::db::AddOutcome::Exists(id)) => {
                tx.prepare_cached("DELETE FROM metis_taken_back WHERE block_id = ?1")?
                    .execute([id])?;
                if was_retired {
                    changes.granted_again.push((network.clone(), *cidr));
                }
            }
            Err(StoreError::Overlap {
                other_cidr,
                other_network,
                ..
            }) => {
                let owner = owner_of(tx, &other_network, &other_cidr)?;
                changes.refused.push(Refusal {
                    network: network.clone(),
                    cidr: *cidr,
                    other_cidr,
                    other_network,
                    owner,
                });
            }
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// (network, family) of every non-Deleting block of `families`.
fn networks(conn: &Connection, families: &[Family]) -> Result<Vec<(String, Family)>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT DISTINCT network, ip_family FROM cidr_blocks WHERE state != 'Deleting' \
         ORDER BY network, ip_family",
    )?;
    let mut rows = stmt.query([])?;
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        let family = crate::store::db::parse_family(&row.get::<_, String>(1)?)?;
        if families.contains(&family) {
            out.push((row.get(0)?, family));
        }
    }
    Ok(out)
}

/// Deletes every taken-back block no pod uses and drops stale records.
fn sweep(conn: &Connection, now_ms: i64) -> Result<Vec<(String, Cidr)>, StoreError> {
    conn.execute(
        "DELETE FROM metis_taken_back WHERE block_id NOT IN \
           (SELECT block_id FROM metis_blocks WHERE retired = 1 AND quarantine IS NULL)",
        [],
    )?;
    let candidates: Vec<(i64, String, String)> = conn
        .prepare_cached(
            "SELECT b.id, b.network, b.cidr FROM metis_taken_back t \
             JOIN cidr_blocks b ON b.id = t.block_id ORDER BY b.id",
        )?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
        .collect::<Result<_, _>>()?;
    let mut deleted = Vec::new();
    for (id, network, cidr) in candidates {
        if blocks::in_use(conn, id, now_ms)? {
            continue;
        }
        crate::store::rows::block::delete_block(conn, id)?;
        conn.prepare_cached("DELETE FROM metis_taken_back WHERE block_id = ?1")?
            .execute([id])?;
        deleted.push((network, parse_cidr(&cidr)?));
    }
    Ok(deleted)
}

/// Whether the block `cidr` of `network` is Deleting (being released).
fn is_deleting(conn: &Connection, network: &str, cidr: &Cidr) -> Result<bool, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM cidr_blocks WHERE network = ?1 AND cidr = ?2 \
             AND state = 'Deleting')",
        )?
        .query_row(params![network, cidr.to_string()], |r| r.get(0))?)
}

/// Who the block `cidr` of `network` belongs to, in words.
fn owner_of(conn: &Connection, network: &str, cidr: &str) -> Result<String, StoreError> {
    let Ok(parsed) = cidr.parse::<Cidr>() else {
        return Ok("an unreadable block".to_string());
    };
    let block: Option<Placed> = blocks::placed(conn, network, parsed.family())?
        .into_iter()
        .find(|b| b.cidr == parsed);
    let Some(block) = block else {
        return Ok("a block being deleted".to_string());
    };
    let taken_back: bool = conn
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM metis_taken_back WHERE block_id = ?1)")?
        .query_row([block.id], |r| r.get(0))?;
    if taken_back {
        return Ok(
            "the cluster, which no longer grants it (kept until its pods are gone)".to_string(),
        );
    }
    let Some(sources) = block.sources else {
        return Ok("no known source (written by upstream Metis or an older Metis)".to_string());
    };
    let words: Vec<String> = sources
        .iter()
        .map(|source| match source {
            Source::Flag => "the daemon's --cidr flag".to_string(),
            Source::Cni => format!("the CNI configuration (conflist) of network {network:?}"),
            Source::Node => "the cluster (the Node's podCIDRs)".to_string(),
            Source::Nnc => "the cluster (the NodeNetworkConfig's status)".to_string(),
        })
        .collect();
    Ok(match words.is_empty() {
        true => "no source any more (retired, kept until its pods are gone)".to_string(),
        false => words.join(" and "),
    })
}

/// The `metis_settings` key of the uids followed of `kind` objects.
fn followed_uids_key(kind: &str) -> String {
    format!("{}{kind}", crate::store::db::schema::KEY_FOLLOWED_UIDS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{TempDir, assert_sound, cidr, owner};

    const NOW: i64 = 1_000_000;

    fn grants(list: &[&str]) -> Vec<(String, Cidr)> {
        list.iter()
            .map(|c| ("default".to_string(), cidr(c)))
            .collect()
    }

    fn take(store: &mut Store, id: &str) -> String {
        let who = crate::store::Owner {
            network: "default",
            ..owner(id)
        };
        store
            .allocate(&who, Family::V4, NOW)
            .unwrap()
            .address
            .to_string()
    }

    #[test]
    fn a_block_taken_back_drains_and_goes_with_its_last_pod() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let v4 = [Family::V4];
        let changes = store
            .follow_grants(Source::Nnc, &v4, &grants(&["198.19.0.0/28"]), NOW)
            .unwrap();
        assert_eq!(changes.added.len(), 1);
        let held = take(&mut store, "a");
        assert!(held.starts_with("198.19.0."), "{held}");
        let changes = store
            .follow_grants(Source::Nnc, &v4, &grants(&["198.19.1.0/28"]), NOW)
            .unwrap();
        assert_eq!(changes.taken_back, grants(&["198.19.0.0/28"]));
        assert!(changes.deleted.is_empty(), "a pod still holds an address");
        // New allocations only from what is granted now; the pod keeps its.
        for pod in ["b", "c", "d"] {
            assert!(take(&mut store, pod).starts_with("198.19.1."));
        }
        assert_eq!(
            store.check("default", "a", "eth0").unwrap()[0]
                .address
                .to_string(),
            held
        );
        let taken = store.taken_back().unwrap();
        assert_eq!((taken.len(), taken[0].pods), (1, 1));
        assert_sound(&store);
        store.release("default", "a", "eth0", NOW).unwrap();
        assert_eq!(
            store.sweep_taken_back(NOW).unwrap(),
            grants(&["198.19.0.0/28"])
        );
        assert!(store.taken_back().unwrap().is_empty());
        assert_sound(&store);
    }

    #[test]
    fn a_block_granted_again_is_served_again() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let v4 = [Family::V4];
        store
            .follow_grants(Source::Nnc, &v4, &grants(&["198.19.0.0/28"]), NOW)
            .unwrap();
        take(&mut store, "a");
        store.follow_grants(Source::Nnc, &v4, &[], NOW).unwrap();
        assert!(matches!(
            store.allocate(
                &crate::store::Owner {
                    network: "default",
                    ..owner("b")
                },
                Family::V4,
                NOW
            ),
            Err(StoreError::NoAvailableIps { .. })
        ));
        let changes = store
            .follow_grants(Source::Nnc, &v4, &grants(&["198.19.0.0/28"]), NOW)
            .unwrap();
        assert_eq!(changes.granted_again, grants(&["198.19.0.0/28"]));
        assert!(store.taken_back().unwrap().is_empty());
        assert!(take(&mut store, "b").starts_with("198.19.0."));
    }

    #[test]
    fn static_blocks_are_untouched_and_named_in_refusals() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store
            .configure_all(
                Source::Flag,
                &[("default".into(), cidr("198.19.0.0/28"))],
                NOW,
            )
            .unwrap();
        let changes = store
            .follow_grants(Source::Nnc, &[Family::V4], &grants(&["198.19.0.0/27"]), NOW)
            .unwrap();
        assert_eq!(changes.refused.len(), 1);
        assert!(
            changes.refused[0].owner.contains("--cidr"),
            "{:?}",
            changes.refused
        );
        let changes = store
            .follow_grants(Source::Nnc, &[Family::V4], &[], NOW)
            .unwrap();
        assert_eq!(changes, GrantChanges::default());
        assert!(take(&mut store, "a").starts_with("198.19.0."));
    }

    #[test]
    fn a_granted_block_being_released_stays_deleting() {
        let dir = TempDir::new();
        let mut store = dir.store();
        let v4 = [Family::V4];
        let granted = grants(&["198.19.0.0/28"]);
        store
            .follow_grants(Source::Nnc, &v4, &granted, NOW)
            .unwrap();
        let id = store.blocks(&crate::store::BlockFilter::default()).unwrap()[0].id;
        store.drain_block(id, NOW).unwrap();
        // The trigger stamps updated_at with the real clock.
        let later = i64::MAX / 2;
        let expired = store
            .expire_draining("default", Family::V4, 0, later)
            .unwrap();
        assert_eq!(expired.len(), 1);
        // Granted again while this node releases it (a re-created object
        // still lists it): neither an error nor served.
        let changes = store
            .follow_grants(Source::Nnc, &v4, &granted, NOW)
            .unwrap();
        assert_eq!(changes.releasing, granted);
        let blocks = store.blocks(&crate::store::BlockFilter::default()).unwrap();
        assert_eq!(blocks.len(), 1);
        assert_eq!(blocks[0].state, crate::store::BlockState::Deleting);
    }

    #[test]
    fn releases_are_remembered() {
        let dir = TempDir::new();
        let mut store = dir.store();
        store
            .record_release("default", &cidr("198.19.0.0/28"), false, 5)
            .unwrap();
        store
            .record_release("default", &cidr("198.19.0.16/28"), true, 6)
            .unwrap();
        // A NonReusable release stays so.
        store
            .record_release("default", &cidr("198.19.0.0/28"), true, 7)
            .unwrap();
        let released = store.released().unwrap();
        assert_eq!(released.len(), 2);
        assert!(!released[1].reusable && released[0].reusable);
        // Only a reusable release is ever forgotten.
        store
            .forget_release("default", &cidr("198.19.0.0/28"))
            .unwrap();
        store
            .forget_release("default", &cidr("198.19.0.16/28"))
            .unwrap();
        assert_eq!(store.released().unwrap().len(), 1);
    }
}
