//! A few values, sorted and distinct: the sets the controller keeps per
//! block or per node (the nodes naming a block, the blocks granted to a
//! node) hold one value almost always. A `BTreeSet` spends a whole tree
//! node (about 200–300 B) on it, a boxed slice an allocation; one value is
//! kept inline.

use std::borrow::Borrow;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SmallSet<T> {
    One(T),
    /// None, or two and more.
    Many(Box<[T]>),
}

impl<T> Default for SmallSet<T> {
    fn default() -> Self {
        SmallSet::Many(Box::default())
    }
}

impl<T> SmallSet<T> {
    pub fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// The values in order.
    pub fn as_slice(&self) -> &[T] {
        match self {
            SmallSet::One(value) => std::slice::from_ref(value),
            SmallSet::Many(values) => values,
        }
    }

    fn from_vec(mut values: Vec<T>) -> Self {
        match (values.len(), values.pop()) {
            (1, Some(value)) => SmallSet::One(value),
            (_, last) => {
                values.extend(last);
                SmallSet::Many(values.into_boxed_slice())
            }
        }
    }

    fn into_vec(self) -> Vec<T> {
        match self {
            SmallSet::One(value) => vec![value],
            SmallSet::Many(values) => values.into_vec(),
        }
    }
}

impl<T: Ord> SmallSet<T> {
    /// Where `value` is (`Ok`) or would go (`Err`).
    fn find<Q: Ord + ?Sized>(&self, value: &Q) -> Result<usize, usize>
    where
        T: Borrow<Q>,
    {
        self.as_slice().binary_search_by(|v| v.borrow().cmp(value))
    }

    pub fn insert(&mut self, value: T) {
        if let Err(at) = self.find(value.borrow()) {
            let mut values = std::mem::take(self).into_vec();
            values.insert(at, value);
            *self = SmallSet::from_vec(values);
        }
    }

    pub fn remove<Q: Ord + ?Sized>(&mut self, value: &Q)
    where
        T: Borrow<Q>,
    {
        if let Ok(at) = self.find(value) {
            let mut values = std::mem::take(self).into_vec();
            values.remove(at);
            *self = SmallSet::from_vec(values);
        }
    }

    pub fn contains<Q: Ord + ?Sized>(&self, value: &Q) -> bool
    where
        T: Borrow<Q>,
    {
        self.find(value).is_ok()
    }
}

impl<T: Ord> FromIterator<T> for SmallSet<T> {
    fn from_iter<I: IntoIterator<Item = T>>(values: I) -> Self {
        let mut values: Vec<T> = values.into_iter().collect();
        values.sort();
        values.dedup();
        SmallSet::from_vec(values)
    }
}

impl<'a, T> IntoIterator for &'a SmallSet<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
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
        assert!(matches!(set, SmallSet::Many(_)));
        assert!(set.contains(&1) && !set.contains(&3));
        set.remove(&1);
        set.remove(&3);
        assert_eq!((&set).into_iter().copied().collect::<Vec<_>>(), [0, 2]);
        set.remove(&0);
        assert_eq!(set, SmallSet::One(2), "one value is kept inline");
        set.remove(&2);
        assert!(set.is_empty());
        set.insert(5);
        assert_eq!(set, SmallSet::One(5));
    }
}
