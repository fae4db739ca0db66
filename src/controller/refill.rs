//! The cache's maps, rebuilt with full nodes. A `BTreeMap` filled in key
//! order (a list, names in order; blocks granted in address order) splits
//! each full node in two and never fills the left half again: its nodes
//! stay about half empty, nearly doubling what each entry costs. Built
//! from a sorted sequence instead, every node but the last is full.

use std::collections::{BTreeMap, BTreeSet};

/// `map` with the same entries and full nodes, and no second copy of them
/// at any moment: `BTreeMap::append` of two non-empty maps merges them
/// into a tree built from the left, freeing the old one's nodes as it
/// goes (`collect` would gather every entry and sort them first).
pub fn map<K: Ord, V>(map: &mut BTreeMap<K, V>) {
    let Some(first) = map.pop_first() else {
        return;
    };
    let mut refilled = BTreeMap::from([first]);
    refilled.append(map);
    *map = refilled;
}

/// [`map`] for a set.
pub fn set<T: Ord>(set: &mut BTreeSet<T>) {
    let Some(first) = set.pop_first() else {
        return;
    };
    let mut refilled = BTreeSet::from([first]);
    refilled.append(set);
    *set = refilled;
}

/// When a cache that holds `held` objects, `changes` of them put since
/// it was last refilled, is due again: once an eighth of it (and more
/// than a few) came in since, so that a refill's walk costs each change
/// a constant share however large the cluster, and what a burst added
/// is not left half empty for long.
pub fn due(changes: usize, held: usize) -> bool {
    changes > (held / 8).saturating_add(256)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The entries stay as they were; a refill is due once an eighth of
    /// what is held, and more than 256, came in since the last.
    #[test]
    fn a_refilled_map_keeps_its_entries() {
        let mut kept: BTreeMap<u32, u32> = (0..1000).map(|i| (i, i * 2)).collect();
        let before = kept.clone();
        for i in 1000..3000 {
            kept.insert(i, i * 2);
        }
        map(&mut kept);
        assert_eq!(kept.len(), 3000);
        assert!(before.iter().all(|(k, v)| kept.get(k) == Some(v)));
        let mut names: BTreeSet<&str> = ["b", "a", "c"].into_iter().collect();
        set(&mut names);
        assert_eq!(names.into_iter().collect::<Vec<_>>(), ["a", "b", "c"]);
        assert!(!due(256, 0) && due(257, 0));
        assert!(!due(881, 5000) && due(882, 5000));
    }
}
