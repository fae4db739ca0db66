//! A few values, sorted and distinct, in one boxed slice: the sets the
//! controller keeps per block or per node (the nodes naming a block, the
//! blocks granted to a node) hold one value almost always, and a
//! `BTreeSet` spends a whole tree node (about 200–300 B) on it.

use std::borrow::Borrow;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmallSet<T>(Box<[T]>);

impl<T> Default for SmallSet<T> {
    fn default() -> Self {
        SmallSet(Box::default())
    }
}

impl<T: Ord> SmallSet<T> {
    /// Where `value` is (`Ok`) or would go (`Err`).
    fn find<Q: Ord + ?Sized>(&self, value: &Q) -> Result<usize, usize>
    where
        T: Borrow<Q>,
    {
        self.0.binary_search_by(|v| v.borrow().cmp(value))
    }

    pub fn insert(&mut self, value: T) {
        if let Err(at) = self.find(value.borrow()) {
            let mut values = std::mem::take(&mut self.0).into_vec();
            values.insert(at, value);
            self.0 = values.into_boxed_slice();
        }
    }

    pub fn remove<Q: Ord + ?Sized>(&mut self, value: &Q)
    where
        T: Borrow<Q>,
    {
        if let Ok(at) = self.find(value) {
            let mut values = std::mem::take(&mut self.0).into_vec();
            values.remove(at);
            self.0 = values.into_boxed_slice();
        }
    }

    pub fn contains<Q: Ord + ?Sized>(&self, value: &Q) -> bool
    where
        T: Borrow<Q>,
    {
        self.find(value).is_ok()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The values in order.
    pub fn as_slice(&self) -> &[T] {
        &self.0
    }
}

impl<'a, T> IntoIterator for &'a SmallSet<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values stay sorted and distinct through inserts and removes,
    /// whatever their order; a value absent is removed as a no-op.
    #[test]
    fn a_small_set_is_a_sorted_set() {
        let mut set = SmallSet::default();
        for value in [2, 0, 2, 1] {
            set.insert(value);
        }
        assert_eq!(set.as_slice(), [0, 1, 2]);
        assert!(set.contains(&1) && !set.contains(&3));
        set.remove(&1);
        set.remove(&3);
        assert_eq!((&set).into_iter().copied().collect::<Vec<_>>(), [0, 2]);
        set.remove(&0);
        set.remove(&2);
        assert!(set.is_empty());
    }
}
