//! Blocks Metis withholds — retired (no source wants them) or quarantined
//! (the database broke an invariant in them) — are recorded in Metis's own
//! `metis_blocks`, which upstream's store never reads. So that upstream
//! cannot hand out their addresses either (after a rollback), every such
//! block also carries `cidr_blocks.state = 'Withheld'`: a value no query of
//! upstream's store selects. `AllocateIP` and `expandIPv6Block` take only
//! `Ready` blocks, `UndrainOneCIDRBlock` and `ExpireDrainingCIDRBlocks`
//! only `Draining` ones, `DeleteCIDRBlock` (and the watcher that calls it)
//! only `Deleting` ones; `DrainCIDRBlock` is given only ids
//! `GetReadyCIDRBlocksSorted` returned. A withheld block's pods therefore
//! keep their addresses until their DEL, whoever serves it.
//!
//! The state follows the record, level-triggered: [`settle`] brings every
//! block in line (withheld when retired or quarantined, `Ready` again when
//! neither), and [`misaligned`] says, read only, what it would change.

use rusqlite::{Connection, params};

use crate::store::db::{BlockState, StoreError};

/// Blocks Metis retired or quarantined (`metis_blocks` rows), as a subquery.
macro_rules! withheld_ids {
    () => {
        "SELECT block_id FROM metis_blocks WHERE retired = 1 OR quarantine IS NOT NULL"
    };
}

/// A block whose `cidr_blocks.state` does not say what Metis recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Misaligned {
    pub block_id: i64,
    pub cidr: String,
    pub network: String,
    /// The state found.
    pub state: String,
    /// Whether Metis retired it (else it is quarantined, or neither).
    pub retired: bool,
    /// The state it gets.
    pub to: BlockState,
}

impl Misaligned {
    /// A block Metis retired that someone else (upstream's
    /// `UndrainOneCIDRBlock`) made `Ready` again.
    pub fn revived(&self) -> bool {
        self.retired && self.state == BlockState::Ready.as_str()
    }

    /// In words, for the log and `admin check`.
    pub fn describe(&self) -> String {
        let what = match (self.revived(), self.to) {
            (true, _) => "was retired by Metis but is Ready again (upstream's undrain); \
                          retired again, its pods keep their addresses until DEL"
                .to_string(),
            (false, BlockState::Withheld) => format!(
                "is {} by Metis but its state is {}; withheld from every allocator",
                if self.retired {
                    "retired"
                } else {
                    "quarantined"
                },
                self.state
            ),
            (false, to) => format!("is withheld with no reason recorded; {to} again"),
        };
        format!(
            "block {} ({}, network {:?}) {what}",
            self.block_id, self.cidr, self.network
        )
    }
}

/// Blocks whose state [`settle`] would change; one indexed read of
/// Metis's block records (cheap on every open).
pub(in crate::store) fn misaligned(conn: &Connection) -> Result<Vec<Misaligned>, StoreError> {
    let mut stmt = conn.prepare_cached(concat!(
        "SELECT b.id, b.cidr, b.network, b.state, COALESCE(m.retired, 0), \
                b.id IN (",
        withheld_ids!(),
        ") FROM cidr_blocks b LEFT JOIN metis_blocks m ON m.block_id = b.id \
         WHERE (b.state IN ('Ready', 'Draining') AND b.id IN (",
        withheld_ids!(),
        ")) OR (b.state = 'Withheld' AND b.id NOT IN (",
        withheld_ids!(),
        ")) ORDER BY b.id"
    ))?;
    let rows = stmt
        .query_map([], |r| {
            let withheld: bool = r.get(5)?;
            Ok(Misaligned {
                block_id: r.get(0)?,
                cidr: r.get(1)?,
                network: r.get(2)?,
                state: r.get(3)?,
                retired: r.get(4)?,
                to: match withheld {
                    true => BlockState::Withheld,
                    false => BlockState::Ready,
                },
            })
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

/// Brings every block's state in line with Metis's record (inside the
/// caller's write transaction); returns what it changed. A block already
/// in line is not written (its `updated_at`, which upstream's draining
/// expiry reads, stays).
pub(in crate::store) fn settle(
    conn: &Connection,
    now_ms: i64,
) -> Result<Vec<Misaligned>, StoreError> {
    let found = misaligned(conn)?;
    let mut update =
        conn.prepare_cached("UPDATE cidr_blocks SET state = ?2, updated_at = ?3 WHERE id = ?1")?;
    for block in &found {
        update.execute(params![block.block_id, block.to.as_str(), now_ms])?;
    }
    Ok(found)
}

/// The state block `id` gets from Metis's record: withheld while retired
/// or quarantined, else `Ready`.
pub(in crate::store) fn settle_block(
    conn: &Connection,
    id: i64,
    now_ms: i64,
) -> Result<(), StoreError> {
    let withheld: bool = conn
        .prepare_cached(concat!("SELECT ?1 IN (", withheld_ids!(), ")"))?
        .query_row([id], |r| r.get(0))?;
    let state = match withheld {
        true => BlockState::Withheld,
        false => BlockState::Ready,
    };
    conn.prepare_cached(
        "UPDATE cidr_blocks SET state = ?2, updated_at = ?3 WHERE id = ?1 AND state != ?2",
    )?
    .execute(params![id, state.as_str(), now_ms])?;
    Ok(())
}
