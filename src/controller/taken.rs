//! What the statuses and the ledgers take, kept as objects come and go:
//! every CIDR counted once per status entry or ledger block naming it, and
//! the address intervals they cover, merged. A pass finds a free block and
//! what overlaps an entry in a few lookups instead of a walk over every
//! entry and block; it applies its own changes and takes them back after
//! ([`Applied`]).

use std::collections::BTreeMap;

use super::pool::Ledger;
use super::short_text::ShortText;
use super::status::Status;
use crate::cidr::{Cidr, Family, from_u128, to_u128};

/// The CIDRs taken, counted, and their intervals merged.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TakenIndex {
    /// By CIDR, whose order (family, first address, prefix length) makes
    /// the CIDRs starting inside an interval one range.
    count: BTreeMap<Cidr, u32>,
    /// How many counted CIDRs have each (IPv6, prefix length): the lengths
    /// a CIDR containing another can have.
    lengths: BTreeMap<(bool, u8), u32>,
    /// Per family (IPv4, IPv6): first address → last, disjoint and not
    /// adjacent.
    merged: [BTreeMap<u128, u128>; 2],
}

/// The key of `lengths`: (IPv6, prefix length).
fn length_of(cidr: &Cidr) -> (bool, u8) {
    (cidr.family() == Family::V6, cidr.prefix_len())
}

/// The first and last address of `cidr`.
pub fn span(cidr: &Cidr) -> (u128, u128) {
    let lo = to_u128(cidr.base());
    (lo, lo.saturating_add(cidr.size().saturating_sub(1)))
}

fn slot(family: Family) -> usize {
    usize::from(family == Family::V6)
}

impl TakenIndex {
    /// Its maps rebuilt with full nodes ([`super::refill`]).
    pub fn refill(&mut self) {
        super::refill::map(&mut self.count);
        for merged in &mut self.merged {
            super::refill::map(merged);
        }
    }

    /// What `statuses` and `ledgers` take.
    pub fn of<'l>(
        statuses: &BTreeMap<ShortText, Box<Status>>,
        ledgers: impl IntoIterator<Item = &'l Ledger>,
    ) -> TakenIndex {
        let mut index = TakenIndex::default();
        for status in statuses.values() {
            index.add_status(status);
        }
        for ledger in ledgers {
            let blocks = ledger.claims.keys().chain(ledger.cooling.keys());
            for cidr in blocks.chain(&ledger.non_reusable) {
                index.add(*cidr);
            }
        }
        index
    }

    pub fn add_status(&mut self, status: &Status) {
        for cidr in status.entries.iter().filter_map(|e| e.cidr) {
            self.add(cidr);
        }
    }

    pub fn remove_status(&mut self, status: &Status) {
        for cidr in status.entries.iter().filter_map(|e| e.cidr) {
            self.remove(cidr);
        }
    }

    /// One taker more of `cidr`.
    pub fn add(&mut self, cidr: Cidr) {
        let count = self.count.entry(cidr).or_insert(0);
        *count += 1;
        if *count > 1 {
            return;
        }
        *self.lengths.entry(length_of(&cidr)).or_default() += 1;
        let (lo, hi) = span(&cidr);
        self.merge(slot(cidr.family()), lo, hi);
    }

    /// One taker less of `cidr` (none counted: nothing).
    pub fn remove(&mut self, cidr: Cidr) {
        let Some(count) = self.count.get_mut(&cidr) else {
            return;
        };
        *count -= 1;
        if *count > 0 {
            return;
        }
        self.count.remove(&cidr);
        let length = length_of(&cidr);
        if let Some(n) = self.lengths.get_mut(&length) {
            *n -= 1;
            if *n == 0 {
                self.lengths.remove(&length);
            }
        }
        self.uncover(cidr);
    }

    /// Takes `cidr`, counted no more, out of the merged intervals. Two
    /// prefixes overlap only when one holds the other, so the interval
    /// loses at most what of `cidr` the prefixes inside it do not cover
    /// (nothing, when one holding it is still counted).
    fn uncover(&mut self, cidr: Cidr) {
        let rest = self.overlapping(&cidr);
        if rest.iter().any(|c| c.prefix_len() <= cidr.prefix_len()) {
            return;
        }
        let merged = &mut self.merged[slot(cidr.family())];
        let (lo, hi) = span(&cidr);
        let Some((&start, &end)) = merged.range(..=lo).next_back() else {
            return;
        };
        merged.remove(&start);
        let mut pieces: Vec<(u128, u128)> = rest.iter().map(span).collect();
        pieces.sort_unstable();
        if start < lo {
            pieces.insert(0, (start, lo - 1));
        }
        if hi < end {
            pieces.push((hi + 1, end));
        }
        let mut run: Option<(u128, u128)> = None;
        for (piece_lo, piece_hi) in pieces {
            match &mut run {
                Some((_, run_hi)) if run_hi.saturating_add(1) >= piece_lo => {
                    *run_hi = (*run_hi).max(piece_hi);
                }
                _ => {
                    if let Some((run_lo, run_hi)) = run {
                        merged.insert(run_lo, run_hi);
                    }
                    run = Some((piece_lo, piece_hi));
                }
            }
        }
        if let Some((run_lo, run_hi)) = run {
            merged.insert(run_lo, run_hi);
        }
    }

    fn merge(&mut self, family: usize, lo: u128, hi: u128) {
        let merged = &mut self.merged[family];
        let (mut lo, mut hi) = (lo, hi);
        if let Some((&start, &end)) = merged.range(..=lo).next_back()
            && end.saturating_add(1) >= lo
        {
            lo = start;
            hi = hi.max(end);
            merged.remove(&start);
        }
        while let Some((&start, &end)) = merged.range(lo..).next() {
            if start > hi.saturating_add(1) {
                break;
            }
            hi = hi.max(end);
            merged.remove(&start);
        }
        merged.insert(lo, hi);
    }

    /// The end of the first taken interval overlapping `lo..=hi`.
    pub fn overlap(&self, family: Family, lo: u128, hi: u128) -> Option<u128> {
        let merged = &self.merged[slot(family)];
        if let Some((_, &end)) = merged.range(..=lo).next_back()
            && end >= lo
        {
            return Some(end);
        }
        merged.range(lo..=hi).next().map(|(_, &end)| end)
    }

    /// The counted CIDRs overlapping `cidr`: those starting inside it, and
    /// those containing it (looked up by the lengths counted).
    pub fn overlapping(&self, cidr: &Cidr) -> Vec<Cidr> {
        let (v6, len) = length_of(cidr);
        let (lo, hi) = span(cidr);
        let mut found: Vec<Cidr> = match starting_in(cidr, hi) {
            Some(range) => self.count.range(range).map(|(c, _)| *c).collect(),
            // Not reached (both bounds are prefixes of the family); a walk
            // finds the same, in the same order.
            None => (self.count.keys())
                .filter(|c| c.family() == cidr.family() && (lo..=hi).contains(&to_u128(c.base())))
                .copied()
                .collect(),
        };
        let wider = self.lengths.range((v6, 0)..(v6, len)).map(|((_, l), _)| *l);
        for length in wider {
            let Some(holder) = cidr.widened(length) else {
                continue;
            };
            // One starting where `cidr` does is among those inside.
            if to_u128(holder.base()) < lo && self.count.contains_key(&holder) {
                found.push(holder);
            }
        }
        found
    }
}

/// The CIDRs of `cidr`'s family starting from its first address to `hi`,
/// as bounds in the count's order: the shortest prefix at that address
/// (its trailing zero bits), then the host prefix at `hi`.
fn starting_in(cidr: &Cidr, hi: u128) -> Option<std::ops::RangeInclusive<Cidr>> {
    let family = cidr.family();
    let zeros = to_u128(cidr.base()).trailing_zeros();
    let shortest = u32::from(family.bits()).saturating_sub(zeros);
    let first = cidr.widened(u8::try_from(shortest).ok()?)?;
    let last = Cidr::new(from_u128(family, hi), family.bits()).ok()?;
    Some(first..=last)
}

/// Changes applied to an index for one pass, taken back when dropped (the
/// index is then exactly as before: it is a function of its counts).
pub struct Applied<'t> {
    index: &'t mut TakenIndex,
    /// Each change: the CIDR, and whether it was added.
    done: Vec<(Cidr, bool)>,
}

impl<'t> Applied<'t> {
    pub fn new(index: &'t mut TakenIndex) -> Applied<'t> {
        Applied {
            index,
            done: Vec::new(),
        }
    }

    pub fn add(&mut self, cidr: Cidr) {
        self.index.add(cidr);
        self.done.push((cidr, true));
    }

    /// One taker less (only of a CIDR counted).
    pub fn remove(&mut self, cidr: Cidr) {
        if self.index.count.contains_key(&cidr) {
            self.index.remove(cidr);
            self.done.push((cidr, false));
        }
    }

    pub fn index(&self) -> &TakenIndex {
        self.index
    }
}

impl Drop for Applied<'_> {
    fn drop(&mut self) {
        for (cidr, added) in self.done.drain(..).rev() {
            match added {
                true => self.index.remove(cidr),
                false => self.index.add(cidr),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Rng;
    use std::collections::BTreeSet;

    /// The union of the counted spans, merged by a sort.
    fn merged_of(index: &TakenIndex) -> [BTreeMap<u128, u128>; 2] {
        let mut spans: Vec<(usize, u128, u128)> = index
            .count
            .keys()
            .map(|c| (slot(c.family()), span(c).0, span(c).1))
            .collect();
        spans.sort_unstable();
        let mut merged: [BTreeMap<u128, u128>; 2] = Default::default();
        let mut last: Option<(usize, u128, u128)> = None;
        for (family, lo, hi) in spans {
            match &mut last {
                Some((f, _, end)) if *f == family && end.saturating_add(1) >= lo => {
                    *end = (*end).max(hi)
                }
                _ => {
                    if let Some((f, start, end)) = last {
                        merged[f].insert(start, end);
                    }
                    last = Some((family, lo, hi));
                }
            }
        }
        if let Some((f, start, end)) = last {
            merged[f].insert(start, end);
        }
        merged
    }

    fn overlapping_by_walk(index: &TakenIndex, cidr: &Cidr) -> BTreeSet<Cidr> {
        let all = index.count.keys().copied();
        all.filter(|c| c.overlaps(cidr)).collect()
    }

    /// Random adds and removes of nested and adjacent CIDRs of both
    /// families: after each, the merged intervals are those a fresh index
    /// makes, overlaps are those a walk finds, and taking an [`Applied`]'s
    /// changes back leaves the index as it was.
    #[test]
    fn kept_change_by_change_it_is_what_a_fresh_count_makes() {
        let mut rng = Rng(7);
        // Nested, adjacent and overlapping prefixes of 198.18.0.0/22 and
        // 2001:db8::/116.
        let pick = |rng: &mut Rng| -> Cidr {
            let below = |rng: &mut Rng, n: u64| u128::from(rng.below(n));
            let (family, bits, len, address) = match rng.below(4) {
                0 => (
                    Family::V6,
                    128,
                    120 + below(rng, 9),
                    (0x2001_0db8 << 96) | below(rng, 4096),
                ),
                _ => (
                    Family::V4,
                    32,
                    22 + below(rng, 11),
                    0xc612_0000 | below(rng, 1024),
                ),
            };
            let host = bits - len;
            let base = crate::cidr::from_u128(family, address >> host << host);
            Cidr::new(base, u8::try_from(len).unwrap()).unwrap()
        };
        let mut index = TakenIndex::default();
        let mut held: Vec<Cidr> = Vec::new();
        for step in 0..3000 {
            if held.is_empty() || rng.below(3) > 0 {
                let cidr = pick(&mut rng);
                index.add(cidr);
                held.push(cidr);
            } else {
                let at = rng.below(u64::try_from(held.len()).unwrap());
                let cidr = held.swap_remove(usize::try_from(at).unwrap());
                index.remove(cidr);
            }
            assert_eq!(index.merged, merged_of(&index), "step {step}");
            let probe = pick(&mut rng);
            let found: BTreeSet<Cidr> = index.overlapping(&probe).into_iter().collect();
            let walked = overlapping_by_walk(&index, &probe);
            assert_eq!(found, walked, "step {step}");
            // The first interval overlapping the probe ends where the
            // merged union says.
            let (lo, hi) = span(&probe);
            let union = &merged_of(&index)[slot(probe.family())];
            let first = union.iter().find(|(s, e)| **e >= lo && **s <= hi);
            let end = index.overlap(probe.family(), lo, hi);
            assert_eq!(end, first.map(|(_, e)| *e), "step {step}");
            if step % 100 == 0 {
                let before = index.clone();
                let mut applied = Applied::new(&mut index);
                for cidr in held.iter().take(5) {
                    applied.remove(*cidr);
                }
                applied.add(pick(&mut rng));
                drop(applied);
                assert_eq!(index, before, "step {step}");
            }
        }
    }
}
