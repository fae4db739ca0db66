//! What the controller keeps of a NodeNetworkConfig besides its status, for
//! every node of the cluster: what the node asks and releases, and the
//! version its status is written against. The daemon's `Nnc` reads more of
//! its one object (its own status, its uid, the annotation as text); this
//! is that read cut down to what the passes use, kept by name.

use std::ops::Deref;

use serde_json::Value;

use super::short_text::ShortText;
use crate::cidr::Cidr;
use crate::kube::nnc::{Nnc, PodCidr};

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Demand {
    pub resource_version: ShortText,
    /// `metadata.generation`: counts changes of the spec.
    pub generation: i64,
    /// `spec.allocations`, in order.
    pub allocations: Allocations,
    /// `spec.releasableCIDRs`, whole objects.
    pub releasable: Box<[PodCidr]>,
}

/// One `spec.allocations` entry: the pods asked of a network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    network: ShortText,
    pub pods: i64,
}

impl Allocation {
    pub fn new(network: &str, pods: i64) -> Allocation {
        Allocation {
            network: network.into(),
            pods,
        }
    }

    pub fn network(&self) -> &str {
        &self.network
    }
}

/// `spec.allocations`: the one network nearly every node asks of, kept in
/// the demand itself (a slice of one would cost an allocation per node),
/// or any other number of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allocations {
    One(Allocation),
    /// None, or two and more.
    Many(Box<[Allocation]>),
}

impl Default for Allocations {
    fn default() -> Self {
        Allocations::Many(Box::default())
    }
}

impl Deref for Allocations {
    type Target = [Allocation];

    fn deref(&self) -> &[Allocation] {
        match self {
            Allocations::One(one) => std::slice::from_ref(one),
            Allocations::Many(all) => all,
        }
    }
}

impl FromIterator<Allocation> for Allocations {
    fn from_iter<I: IntoIterator<Item = Allocation>>(iter: I) -> Self {
        let all: Vec<Allocation> = iter.into_iter().collect();
        match <[Allocation; 1]>::try_from(all) {
            Ok([one]) => Allocations::One(one),
            Err(all) => Allocations::Many(all.into_boxed_slice()),
        }
    }
}

impl Demand {
    /// The object's name and its demand (`object` without its status: the
    /// controller keeps that apart).
    pub fn parse(object: &Value) -> (String, Demand) {
        Demand::of(Nnc::parse(object))
    }

    /// `nnc` cut down, and its name.
    pub fn of(nnc: Nnc) -> (String, Demand) {
        let allocations = (nnc.allocations.iter())
            .map(|(network, pods)| Allocation::new(network, *pods))
            .collect();
        let demand = Demand {
            resource_version: nnc.meta.resource_version.into(),
            generation: nnc.generation,
            allocations,
            releasable: nnc.releasable.into(),
        };
        (nnc.meta.name, demand)
    }

    /// Whether `spec.releasableCIDRs` lists `cidr` (as written).
    pub fn lists_releasable(&self, cidr: &str) -> bool {
        self.releasable.iter().any(|r| r.cidr() == Some(cidr))
    }

    /// [`Demand::lists_releasable`] of a parsed block: its text is made
    /// only when the node lists something (a grant asks it of every
    /// candidate block).
    pub fn lists_releasable_block(&self, cidr: &Cidr) -> bool {
        !self.releasable.is_empty() && self.lists_releasable(&cidr.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The demand is read as the daemon's `Nnc` reads it, the default
    /// network spelled or not; one network's allocation is kept inline.
    #[test]
    fn a_demand_is_the_spec_as_the_node_wrote_it() {
        let object = json!({
            "metadata": {"name": "n1", "uid": "u", "resourceVersion": "7", "generation": 3},
            "spec": {"allocations": [{"network": "default", "pods": 5},
                                     {"network": "", "pods": 1},
                                     {"network": "blue", "pods": 2}],
                     "releasableCIDRs": [{"cidr": "198.18.0.0/28", "network": "blue"}]}});
        let (name, demand) = Demand::parse(&object);
        assert_eq!(name, "n1");
        assert_eq!(&*demand.resource_version, "7");
        assert_eq!(demand.generation, 3);
        let asked: Vec<(&str, i64)> = (demand.allocations.iter())
            .map(|a| (a.network(), a.pods))
            .collect();
        assert_eq!(asked, [("default", 5), ("default", 1), ("blue", 2)]);
        assert!(demand.lists_releasable("198.18.0.0/28"));
        assert!(!demand.lists_releasable("198.18.0.16/28"));
        let block = |cidr: &str| cidr.parse::<Cidr>().unwrap();
        assert!(demand.lists_releasable_block(&block("198.18.0.0/28")));
        assert!(!demand.lists_releasable_block(&block("198.18.0.16/28")));
        let (_, empty) = Demand::parse(&json!({"metadata": {"name": "n2"}, "spec": 7}));
        assert!(empty.allocations.is_empty() && empty.releasable.is_empty());
        let (_, one) = Demand::parse(&json!({"metadata": {"name": "n3"},
            "spec": {"allocations": [{"network": "default", "pods": 4}]}}));
        assert_eq!(
            one.allocations,
            Allocations::One(Allocation::new("default", 4))
        );
        assert_eq!(one.allocations.len(), 1);
        assert_eq!(demand.allocations.len(), 3);
        assert_eq!(std::mem::size_of::<Allocations>(), 32);
    }
}
