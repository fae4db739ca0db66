//! The adaptive policy: how many pod addresses to ask the cluster for, and
//! which blocks to give back. Plain functions over plain numbers, so every
//! rule is tested without a store, a clock or an API server. Thresholds are
//! upstream's (0.75 target after scale-up, 0.50 low-utilisation mark);
//! cooling addresses count differently (see [`scale_up`]). Ratios are
//! computed in exact integer arithmetic.

/// Address counts of one network and family, as the monitor sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Load {
    /// Pods' addresses, in every block, and the rows the cluster's blocks
    /// reserve (upstream counts every block's reserved rows; the node's own
    /// ranges' are no business of the cluster's).
    pub allocated: i64,
    /// Requests waiting for an address.
    pub pending: i64,
    /// Addresses in non-Deleting blocks.
    pub total: i64,
    /// The part of `total` in the cluster's blocks that the status lists:
    /// what the controller counts against the request. The node's own
    /// ranges (CNI `ranges`, `--cidr`) are left out — the controller never
    /// sees them, so counting them would make every pass ask one range
    /// more than it was given — and so are local blocks the status no
    /// longer lists (a deleted and re-created object).
    pub from_cluster: i64,
    /// Free addresses of Ready blocks whose release cooldown ends within
    /// `--scale-up-wait`: capacity that is coming for a waiter in time.
    pub cooling_soon: i64,
}

/// The pod count to ask for. Upstream's rule: enough that everything held
/// plus every waiter sits at 75 % utilisation, never less than what is
/// held plus the waiters, never less than the current request. Two
/// differences:
///
/// - "held" is what the cluster's status grants, not the local total: the
///   node's own ranges and local leftovers would make the request exceed
///   what the controller counts forever, and it would add a block on
///   every pass (the request covers the pods' need from the cluster's
///   blocks alone, whatever the node's own ranges hold);
/// - waiters that cooling addresses will serve within `--scale-up-wait`
///   are not waiting for the cloud. Upstream instead asks for nothing at
///   all while more than 10 addresses cool, however far off their release
///   and however many wait: under churn, waiters then time out next to
///   capacity that comes too late, and nothing new is asked for. Here each
///   waiter is counted once, either against an address that frees in time
///   or against the request.
pub fn scale_up(load: Load, current_pods: i64) -> i64 {
    let unserved = load.pending.saturating_sub(load.cooling_soon.max(0)).max(0);
    let used = load.allocated.saturating_add(unserved).max(0);
    // ceil(used / 0.75) == ceil(4 * used / 3), exactly.
    let at_target = used.saturating_mul(4).saturating_add(2) / 3;
    let held = load.from_cluster.saturating_add(unserved);
    at_target.max(held).max(current_pods)
}

/// Whether utilisation, (allocated + pending) / total, is below one half.
/// An empty network is not "low": there is nothing to give back.
pub fn is_low_utilization(load: Load) -> bool {
    let used = load.allocated.saturating_add(load.pending);
    load.total > 0 && used.saturating_mul(2) < load.total
}

/// A Ready block as the drain step sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLoad {
    pub id: i64,
    pub total: i64,
    pub allocated: i64,
}

/// Upstream's drain step, run after utilisation stayed low long enough.
/// `ready_newest_first` lists the network's Ready blocks newest first; the
/// oldest (last) is never drained. Blocks are drained newest first until
/// the simulated utilisation reaches one half: each drained block's free
/// addresses count as used from then on. Returns the block ids to drain.
pub fn blocks_to_drain(ready_newest_first: &[BlockLoad], load: Load) -> Vec<i64> {
    let Some((_oldest, candidates)) = ready_newest_first.split_last() else {
        return Vec::new();
    };
    let target = load.total.saturating_add(load.pending) / 2;
    let mut running = load.allocated.saturating_add(load.pending);
    let mut drained = Vec::new();
    for block in candidates {
        if running >= target {
            break;
        }
        drained.push(block.id);
        running = running.saturating_add((block.total - block.allocated).max(0));
    }
    drained
}

/// The low-utilisation timer's next state and whether to drain now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LowUtilization {
    /// Utilisation is fine: forget any start time.
    Clear,
    /// Low since this time (Unix ms); not long enough yet.
    Since(i64),
    /// Low for longer than the sustained duration: drain now.
    Drain,
}

/// Advances the low-utilisation timer of a network.
pub fn low_utilization(
    load: Load,
    since_ms: Option<i64>,
    now_ms: i64,
    sustained_ms: i64,
) -> LowUtilization {
    if !is_low_utilization(load) {
        return LowUtilization::Clear;
    }
    match since_ms {
        Some(since) if now_ms.saturating_sub(since) > sustained_ms => LowUtilization::Drain,
        Some(since) => LowUtilization::Since(since),
        None => LowUtilization::Since(now_ms),
    }
}

/// The pod count to request after giving `released` addresses back.
pub fn final_pods(desired: i64, released: i64) -> i64 {
    desired.saturating_sub(released).max(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A load whose blocks are all granted and none of whose addresses
    /// free up within the wait.
    fn granted_load(allocated: i64, pending: i64, total: i64) -> Load {
        Load {
            allocated,
            pending,
            total,
            from_cluster: total,
            cooling_soon: 0,
        }
    }

    // The worked examples of upstream's monitor tests (upstream-metis.md §6.1).
    #[test]
    fn scale_up_worked_example_74() {
        // /28 + /27 (total 48); 42 allocated + 3 reserved; 10 waiting; current 32.
        let load = granted_load(45, 10, 48);
        assert_eq!(scale_up(load, 32), 74);
    }

    #[test]
    fn scale_up_worked_example_90_with_draining_block() {
        // + a draining /27 (total 80); 40 + 3 allocated; 10 waiting; current 64.
        let load = granted_load(43, 10, 80);
        assert_eq!(scale_up(load, 64), 90);
    }

    #[test]
    fn cooling_addresses_serve_waiters_before_the_cloud_does() {
        // 45 held of 48, 10 waiting, current 32 (the worked example).
        let load = granted_load(45, 10, 48);
        assert_eq!(scale_up(load, 32), 74);
        // 11 addresses free up within the wait: upstream would ask for
        // nothing at all; here no waiter needs the cloud, and only the 75 %
        // headroom over what is held remains: ceil(45 / 0.75) = 60.
        let soon = Load {
            cooling_soon: 11,
            ..load
        };
        assert_eq!(scale_up(soon, 32), 60);
        // 4 free up in time: the other 6 waiters count.
        // ceil((45 + 6) / 0.75) = 68.
        let some = Load {
            cooling_soon: 4,
            ..load
        };
        assert_eq!(scale_up(some, 32), 68);
        // Addresses cooling for longer than the wait do not count at all
        // (the caller leaves them out of `cooling_soon`): 74 as without any.
        // The churn case of the issue: 48 addresses, 20 allocated, 28 cool
        // for a minute, 10 waiters, a 9 s wait: upstream asks for nothing
        // (28 > 10) and the waiters fail; here they are asked for.
        let churn = granted_load(20, 10, 48);
        assert_eq!(scale_up(churn, 48), 58);
    }

    #[test]
    fn scale_up_never_lowers_the_request() {
        let load = granted_load(3, 0, 16);
        assert_eq!(scale_up(load, 100), 100);
        assert_eq!(scale_up(load, 0), 16);
    }

    #[test]
    fn ceil_is_exact() {
        for used in 0..200 {
            let load = granted_load(used, 0, 0);
            let expected = (used * 4 + 2) / 3;
            assert_eq!(scale_up(load, 0), expected);
            assert!(expected * 3 >= used * 4 && (expected - 1) * 3 < used * 4 || used == 0);
        }
    }

    #[test]
    fn drain_worked_example() {
        // /28 (oldest) + /27 (total 48); 2 active + 3 reserved = 5 used, 20 cooling.
        let blocks = [
            BlockLoad {
                id: 2,
                total: 32,
                allocated: 2,
            },
            BlockLoad {
                id: 1,
                total: 16,
                allocated: 3,
            },
        ];
        let load = Load {
            allocated: 5,
            pending: 0,
            total: 48,
            from_cluster: 48,
            cooling_soon: 20,
        };
        assert_eq!(blocks_to_drain(&blocks, load), vec![2]);
        // 25 active + 3 reserved = 28 >= 24: nothing to drain.
        let busy = Load {
            allocated: 28,
            ..load
        };
        assert!(blocks_to_drain(&blocks, busy).is_empty());
    }

    #[test]
    fn drain_never_takes_the_oldest_block() {
        let only = [BlockLoad {
            id: 1,
            total: 256,
            allocated: 3,
        }];
        let load = granted_load(3, 0, 256);
        assert!(blocks_to_drain(&only, load).is_empty());
        let three = [
            BlockLoad {
                id: 3,
                total: 16,
                allocated: 0,
            },
            BlockLoad {
                id: 2,
                total: 16,
                allocated: 0,
            },
            BlockLoad {
                id: 1,
                total: 16,
                allocated: 3,
            },
        ];
        let load = granted_load(3, 0, 48);
        // Both newer blocks drain (3 → 19 → 35 ≥ 24 would stop after two).
        assert_eq!(blocks_to_drain(&three, load), vec![3, 2]);
    }

    #[test]
    fn drain_stops_once_simulated_utilization_reaches_half() {
        let blocks = [
            BlockLoad {
                id: 4,
                total: 16,
                allocated: 0,
            },
            BlockLoad {
                id: 3,
                total: 16,
                allocated: 0,
            },
            BlockLoad {
                id: 2,
                total: 16,
                allocated: 0,
            },
            BlockLoad {
                id: 1,
                total: 64,
                allocated: 40,
            },
        ];
        // total 112, target 56; running 40 → 56 after one block: stop.
        let load = granted_load(40, 0, 112);
        assert_eq!(blocks_to_drain(&blocks, load), vec![4]);
    }

    #[test]
    fn low_utilization_timer() {
        let low = granted_load(5, 0, 48);
        let high = Load {
            allocated: 24,
            ..low
        };
        let hour = 3_600_000;
        assert_eq!(
            low_utilization(high, Some(0), 9 * hour, 8 * hour),
            LowUtilization::Clear
        );
        assert_eq!(
            low_utilization(low, None, hour, 8 * hour),
            LowUtilization::Since(hour)
        );
        assert_eq!(
            low_utilization(low, Some(hour), 9 * hour, 8 * hour),
            LowUtilization::Since(hour)
        );
        assert_eq!(
            low_utilization(low, Some(hour), 9 * hour + 1, 8 * hour),
            LowUtilization::Drain
        );
        let empty = Load::default();
        assert_eq!(
            low_utilization(empty, Some(0), 9 * hour, 8 * hour),
            LowUtilization::Clear
        );
        // Waiters count as used.
        let waiting = Load { pending: 20, ..low };
        assert_eq!(
            low_utilization(waiting, Some(0), 9 * hour, 8 * hour),
            LowUtilization::Clear
        );
    }

    #[test]
    fn blocks_the_status_no_longer_lists_are_not_asked_for_again() {
        // A re-created object: a local /28 CNI range and three /28s from
        // the old object, none of which the new status lists. 3 reserved.
        let load = Load {
            allocated: 3,
            pending: 0,
            total: 64,
            from_cluster: 0,
            cooling_soon: 0,
        };
        assert_eq!(scale_up(load, 0), 4);
        // Applied to the next pass (nothing changed): a fixed point, so
        // the cloud is never asked for another block.
        assert_eq!(scale_up(load, 4), 4);
        // Pods on the old blocks still count as used.
        let busy = Load {
            allocated: 40,
            ..load
        };
        assert_eq!(scale_up(busy, 4), 54);
    }

    /// The request and blocks of `passes` monitor passes of a node with
    /// `allocated` addresses in use and a static range of `own` addresses,
    /// against a controller that covers each request with /28s of its
    /// status alone (the contract: neither side counts the node's ranges).
    fn passes(allocated: i64, own: i64, count: usize) -> Vec<(i64, i64)> {
        let mut asked = 0i64;
        let mut blocks = 0i64;
        let mut seen = Vec::new();
        for _ in 0..count {
            let load = Load {
                allocated,
                pending: 0,
                total: own + 16 * blocks,
                from_cluster: 16 * blocks,
                cooling_soon: 0,
            };
            asked = scale_up(load, asked);
            blocks = blocks.max((asked + 15) / 16);
            seen.push((asked, blocks));
        }
        seen
    }

    #[test]
    fn a_static_range_does_not_make_the_request_run_away() {
        // A static /24 with 10 pods (its reserved rows are its own): asked
        // for ceil(10 / 0.75) = 14, one /28 granted; from then on the
        // request is what the cluster holds (16) and nothing more is
        // granted. Before, the /24 counted as held and each pass asked one
        // /24 more than the controller gave: (12, 1) (40, 3) (88, 6) ...
        let seen = passes(10, 256, 8);
        assert_eq!(seen[0], (14, 1));
        assert!(
            seen[1..].iter().all(|step| *step == (16, 1)),
            "settles: {seen:?}"
        );
        // Whatever the static range: the same demand, the same answer.
        assert_eq!(passes(10, 16, 8), seen);
        assert_eq!(passes(10, 65_536, 8), seen);
        // More pods: more blocks, settling again.
        let busy = passes(40, 256, 8);
        assert_eq!(busy[0], (54, 4));
        assert!(busy[1..].iter().all(|step| *step == (64, 4)), "{busy:?}");
    }

    #[test]
    fn released_blocks_come_off_the_request() {
        assert_eq!(final_pods(90, 32), 58);
        assert_eq!(final_pods(10, 32), 0);
    }
}
