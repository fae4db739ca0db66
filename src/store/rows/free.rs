//! The one definition of "is this address free now": a row is free when it
//! is not allocated and its release cooldown (`release_at`, Unix ms) is over
//! or was never set; a free row still resting is *cooling*; an allocated
//! row with an owner is *held by a pod* (an allocated row without one is a
//! reservation). A requested address adds one exception: its last owner
//! (same container and interface) may take it back while it cools — the
//! cooldown protects a new owner from the old one's late traffic, and a
//! runtime re-adding the same container (`podman network reload`) is that
//! old owner.
//!
//! A claim reads the free rows in two tiers, each from Metis's index
//! without walking the rows still cooling: [`unused`] ones (no cooldown
//! recorded) by id, then [`cooled`] ones by the end of their cooldown.
//!
//! The SQL side is made of macros that expand to string literals, so every
//! query stays a `const` prepared once and cached (nothing is formatted on
//! the allocation path). `$row` is the column prefix (`""` or `"a."`) and
//! `$now` the bound parameter holding the time (`"?2"`). The Rust side,
//! [`availability`], is the same rule for one row, and a test holds the two
//! against each other.

use rusqlite::{Connection, params};

use crate::store::db::StoreError;

/// SQL: the row is free but still cooling at `$now`.
macro_rules! cooling {
    ($row:literal, $now:literal) => {
        concat!(
            "(",
            $row,
            "is_allocated = FALSE AND ",
            $row,
            "release_at > ",
            $now,
            ")"
        )
    };
}

/// SQL: the row is free with no cooldown recorded (never released, or
/// released without one). Free now is this or [`cooled`].
macro_rules! unused {
    ($row:literal) => {
        concat!(
            "(",
            $row,
            "is_allocated = FALSE AND ",
            $row,
            "release_at IS NULL)"
        )
    };
}

/// SQL: the row is free and its cooldown is over at `$now`.
macro_rules! cooled {
    ($row:literal, $now:literal) => {
        concat!(
            "(",
            $row,
            "is_allocated = FALSE AND ",
            $row,
            "release_at IS NOT NULL AND ",
            $row,
            "release_at <= ",
            $now,
            ")"
        )
    };
}

/// SQL: a pod holds the row (allocated, with an owner).
macro_rules! pod_held {
    ($row:literal) => {
        concat!(
            "(",
            $row,
            "is_allocated = 1 AND COALESCE(",
            $row,
            "container_id, '') != '')"
        )
    };
}

pub(in crate::store) use {cooled, cooling, pod_held, unused};

/// For each row of address ?1: whether it is allocated in a block other
/// than ?2 (in any block when ?2 is NULL), to a pod only when ?3. One
/// probe of upstream's `(address, cidr_block_id)` UNIQUE index, at most a
/// row per block, the test in the select list (a `WHERE` with it costs a
/// third more to prepare). The questions "who holds it elsewhere" and
/// "who holds a block's gateway" are joins across the blocks, with a
/// subquery for isolated networks, and cost a one-request process (direct
/// mode, which prepares every statement it runs) 3–4 times as much to
/// prepare; they can answer only where this does, which on the allocation
/// path is almost never.
pub(in crate::store) const ALLOCATED_ELSEWHERE_SQL: &str = concat!(
    "SELECT is_allocated = 1 AND cidr_block_id IS NOT ?2 AND (?3 = 0 OR ",
    pod_held!(""),
    ") FROM ip_addresses WHERE address = ?1"
);

/// Whose allocation [`allocated_elsewhere`] looks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::store) enum Holder {
    /// A pod's or a reservation's.
    Any,
    /// A pod's ([`pod_held`]).
    Pod,
}

/// [`ALLOCATED_ELSEWHERE_SQL`]: `address` allocated to `holder` in a block
/// other than `except_block` (any block when `None`).
pub(in crate::store) fn allocated_elsewhere(
    conn: &Connection,
    address: &str,
    except_block: Option<i64>,
    holder: Holder,
) -> Result<bool, StoreError> {
    let mut stmt = conn.prepare_cached(ALLOCATED_ELSEWHERE_SQL)?;
    let mut rows = stmt.query(params![address, except_block, holder == Holder::Pod])?;
    while let Some(row) = rows.next()? {
        // NULL where `is_allocated` is: not allocated.
        if row.get::<_, Option<bool>>(0)? == Some(true) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// What a requested-address check reads of one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::store) struct RowView {
    pub(in crate::store) allocated: bool,
    /// The owner, or the last one of a free row (upstream keeps it).
    pub(in crate::store) container_id: String,
    pub(in crate::store) interface_name: String,
    pub(in crate::store) release_at: Option<i64>,
}

/// Why a row is not free for someone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::store) enum Taken {
    /// Allocated without an owner: network, gateway, broadcast or bounds.
    Reserved,
    /// A pod holds it.
    Held { container_id: String },
    /// Released, resting until `until_ms`.
    Cooling { until_ms: i64 },
}

/// Whether `row` is free at `now_ms` for the owner (`container_id`,
/// `interface_name`): [`free_now`] plus the last owner's exception.
pub(in crate::store) fn availability(
    row: &RowView,
    container_id: &str,
    interface_name: &str,
    now_ms: i64,
) -> Result<(), Taken> {
    if row.allocated {
        return Err(match row.container_id.is_empty() {
            true => Taken::Reserved,
            false => Taken::Held {
                container_id: row.container_id.clone(),
            },
        });
    }
    let last_owner = row.container_id == container_id && row.interface_name == interface_name;
    match row.release_at {
        Some(until_ms) if until_ms > now_ms && !last_owner => Err(Taken::Cooling { until_ms }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::{Connection, params};

    const NOW: i64 = 1_000;

    /// Every kind of row: allocated or not, with an owner or not, and a
    /// cooldown that is unset, over, ending now or still running.
    fn rows() -> Vec<RowView> {
        let mut out = Vec::new();
        for allocated in [false, true] {
            for container in ["", "old"] {
                for release_at in [None, Some(NOW - 1), Some(NOW), Some(NOW + 1)] {
                    out.push(RowView {
                        allocated,
                        container_id: container.to_string(),
                        interface_name: "eth0".to_string(),
                        release_at,
                    });
                }
            }
        }
        out
    }

    /// The SQL predicates evaluated on one row (NULL, as in a WHERE
    /// clause, counts as false).
    fn sql(conn: &Connection, row: &RowView) -> (bool, bool, bool) {
        let truth = |value: Option<bool>| value.unwrap_or(false);
        conn.query_row(
            concat!(
                "SELECT ",
                unused!(""),
                " OR ",
                cooled!("", "?4"),
                ", ",
                cooling!("", "?4"),
                ", ",
                pod_held!(""),
                " FROM (SELECT ?1 AS is_allocated, ?2 AS container_id, ?3 AS release_at)"
            ),
            params![row.allocated, row.container_id, row.release_at, NOW],
            |r| Ok((truth(r.get(0)?), truth(r.get(1)?), truth(r.get(2)?))),
        )
        .unwrap()
    }

    #[test]
    fn the_sql_and_the_rust_rule_agree_on_every_kind_of_row() {
        let conn = Connection::open_in_memory().unwrap();
        for row in rows() {
            let (free, cooling, held) = sql(&conn, &row);
            let for_stranger = availability(&row, "new", "eth0", NOW);
            assert_eq!(free, for_stranger.is_ok(), "{row:?}");
            assert_eq!(
                cooling,
                matches!(for_stranger, Err(Taken::Cooling { .. })),
                "{row:?}"
            );
            assert_eq!(
                held,
                matches!(for_stranger, Err(Taken::Held { .. })),
                "{row:?}"
            );
        }
    }

    #[test]
    fn the_last_owner_may_take_a_cooling_address_back() {
        let cooling = RowView {
            allocated: false,
            container_id: "old".to_string(),
            interface_name: "eth0".to_string(),
            release_at: Some(NOW + 1),
        };
        assert_eq!(availability(&cooling, "old", "eth0", NOW), Ok(()));
        assert_eq!(
            availability(&cooling, "old", "eth1", NOW),
            Err(Taken::Cooling { until_ms: NOW + 1 })
        );
        let held = RowView {
            allocated: true,
            ..cooling
        };
        assert!(matches!(
            availability(&held, "old", "eth0", NOW),
            Err(Taken::Held { .. })
        ));
    }
}
