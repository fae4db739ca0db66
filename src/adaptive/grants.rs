//! What the NodeNetworkConfig grants this node now, as plain data: its
//! Ready IPv4 entries, less what this node released and may not take
//! again. Pure: the store applies the result (`Store::follow_grants`).
//!
//! The memory of releases: a `NonReusable` block this node released is
//! never taken again. A reusable one is taken again only once it came
//! back — listed after a copy of the same stream epoch that did not list
//! it, so the return is ordered by the stream itself and no late or
//! restored copy can fake it (docs/design.md, "Following the control
//! plane"). A re-created object (new uid) starts over: the old object's
//! entries are gone with it.

use crate::cidr::{Cidr, Family};
use crate::kube::nnc::Nnc;
use crate::store::ReleasedBlock;

/// Why a status entry is not granted now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Withheld {
    /// Its condition is not `Ready=True`.
    NotReady { condition: String },
    /// This node released it and it is `NonReusable`.
    NonReusable,
    /// This node released it and it has not left the status since.
    NotBackYet,
    /// Its `cidr` does not parse.
    Unparsable(String),
}

/// One entry that is not granted, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WithheldEntry {
    pub network: String,
    pub cidr: String,
    pub why: Withheld,
}

impl WithheldEntry {
    /// The entry and its reason in words, also the key that keeps a
    /// warning from repeating.
    pub fn describe(&self) -> String {
        let why = match &self.why {
            Withheld::NotReady { condition } => {
                format!("its condition is {condition}, not Ready=True")
            }
            Withheld::NonReusable => {
                "this node released it and it is NonReusable: it is never taken again".to_string()
            }
            Withheld::NotBackYet => {
                "this node released it; it is taken again only after it left the status and came back"
                    .to_string()
            }
            Withheld::Unparsable(err) => format!("its cidr does not parse: {err}"),
        };
        format!(
            "podCIDR {} of network {:?} is not allocated from: {why}",
            self.cidr, self.network
        )
    }
}

/// What the status grants now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    /// (network, prefix) to serve.
    pub granted: Vec<(String, Cidr)>,
    /// Reusable releases that came back: forget them.
    pub returned: Vec<(String, Cidr)>,
    pub withheld: Vec<WithheldEntry>,
}

/// Which released blocks a stream epoch has seen absent from the status.
#[derive(Debug, Default)]
pub struct Returns {
    epoch: u64,
    left: Vec<(String, Cidr)>,
}

impl Returns {
    /// A new object (another uid): every reusable release of the old one
    /// counts as gone from the status.
    pub fn start_over(&mut self, epoch: u64, released: &[ReleasedBlock]) {
        self.epoch = epoch;
        self.left = released
            .iter()
            .filter(|r| r.reusable)
            .map(|r| (r.network.clone(), r.cidr))
            .collect();
    }

    /// Copies from `epoch` on owe nothing to what earlier copies did not
    /// list: a relist, or the object back to an earlier one (an etcd
    /// restore), whose listings of this node's releases are old.
    pub fn new_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.left.clear();
    }

    /// Takes note of a copy of stream `epoch` (`None`: the object is gone)
    /// before [`decide`] reads it.
    pub fn observe(&mut self, epoch: u64, nnc: Option<&Nnc>, released: &[ReleasedBlock]) {
        if epoch != self.epoch {
            self.new_epoch(epoch);
        }
        for release in released {
            let listed = nnc.is_some_and(|nnc| lists(nnc, &release.network, &release.cidr));
            let key = (release.network.clone(), release.cidr);
            if !listed && !self.left.contains(&key) {
                self.left.push(key);
            }
        }
    }

    fn came_back(&self, network: &str, cidr: &Cidr) -> bool {
        self.left.contains(&(network.to_string(), *cidr))
    }
}

/// The IPv4 blocks `nnc` grants now (IPv6 blocks come from the CNI ranges
/// and grow lazily instead).
pub fn decide(nnc: &Nnc, released: &[ReleasedBlock], returns: &Returns) -> Grants {
    let mut grants = Grants::default();
    for entry in &nnc.pod_cidrs {
        let withhold = |why| WithheldEntry {
            network: entry.network.clone(),
            cidr: entry.cidr.clone(),
            why,
        };
        let cidr = match entry.cidr.parse::<Cidr>() {
            Ok(cidr) if cidr.family() == Family::V4 => cidr,
            Ok(_) => continue,
            Err(err) => {
                grants
                    .withheld
                    .push(withhold(Withheld::Unparsable(err.to_string())));
                continue;
            }
        };
        if !entry.ready {
            grants.withheld.push(withhold(Withheld::NotReady {
                condition: entry.condition.clone(),
            }));
            continue;
        }
        let release = released
            .iter()
            .find(|r| r.network == entry.network && r.cidr == cidr);
        match release {
            Some(r) if !r.reusable || !entry.reusable => {
                grants.withheld.push(withhold(Withheld::NonReusable));
                continue;
            }
            Some(_) if !returns.came_back(&entry.network, &cidr) => {
                grants.withheld.push(withhold(Withheld::NotBackYet));
                continue;
            }
            Some(_) => grants.returned.push((entry.network.clone(), cidr)),
            None => {}
        }
        let key = (entry.network.clone(), cidr);
        if !grants.granted.contains(&key) {
            grants.granted.push(key);
        }
    }
    grants
}

/// Whether the status lists `cidr` of `network` (in any condition).
fn lists(nnc: &Nnc, network: &str, cidr: &Cidr) -> bool {
    nnc.pod_cidrs
        .iter()
        .any(|e| e.network == network && e.cidr.parse::<Cidr>().ok().as_ref() == Some(cidr))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::cidr;
    use serde_json::json;

    fn status(entries: &[(&str, &str, &str)]) -> Nnc {
        let entries: Vec<_> = entries
            .iter()
            .map(|(c, ready, kind)| {
                json!({"id": c, "network": "default", "cidr": c, "type": kind,
                       "condition": {"type": "Ready", "status": ready, "reason": "Updating"}})
            })
            .collect();
        Nnc::parse(&json!({"status": {"podCIDRs": entries}}))
    }

    fn released(c: &str, reusable: bool) -> ReleasedBlock {
        ReleasedBlock {
            network: "default".into(),
            cidr: cidr(c),
            reusable,
            released_at: 1,
        }
    }

    fn granted(grants: &Grants) -> Vec<String> {
        grants.granted.iter().map(|(_, c)| c.to_string()).collect()
    }

    #[test]
    fn only_ready_ipv4_entries_are_granted() {
        let nnc = status(&[
            ("198.19.0.0/28", "True", "Reusable"),
            ("198.19.0.16/28", "False", "Reusable"),
            ("2001:db8::/120", "True", "Reusable"),
            ("nonsense", "True", "Reusable"),
        ]);
        let grants = decide(&nnc, &[], &Returns::default());
        assert_eq!(granted(&grants), ["198.19.0.0/28"]);
        assert_eq!(grants.withheld.len(), 2);
        assert!(
            grants.withheld[0]
                .describe()
                .contains("Ready=False (Updating)")
        );
    }

    #[test]
    fn a_non_reusable_release_never_comes_back() {
        let memory = [released("198.19.0.0/28", false)];
        let mut returns = Returns::default();
        let listed = status(&[("198.19.0.0/28", "True", "NonReusable")]);
        let empty = status(&[]);
        for nnc in [&listed, &empty, &listed] {
            returns.observe(1, Some(nnc), &memory);
            assert!(decide(nnc, &memory, &returns).granted.is_empty());
        }
        // Listed as reusable now: the release said otherwise, and wins.
        let relabelled = status(&[("198.19.0.0/28", "True", "Reusable")]);
        returns.start_over(2, &memory);
        assert!(decide(&relabelled, &memory, &returns).granted.is_empty());
    }

    #[test]
    fn a_reusable_release_comes_back_only_after_leaving_in_the_same_epoch() {
        let memory = [released("198.19.0.0/28", true)];
        let listed = status(&[("198.19.0.0/28", "True", "Reusable")]);
        let empty = status(&[]);
        let mut returns = Returns::default();
        returns.observe(1, Some(&listed), &memory);
        let still = decide(&listed, &memory, &returns);
        assert!(still.granted.is_empty());
        assert_eq!(still.withheld[0].why, Withheld::NotBackYet);
        returns.observe(1, Some(&empty), &memory);
        // A new epoch (a relist, an etcd restore) forgets what left before.
        returns.observe(2, Some(&listed), &memory);
        assert!(decide(&listed, &memory, &returns).granted.is_empty());
        returns.observe(2, None, &memory);
        returns.observe(2, Some(&listed), &memory);
        let back = decide(&listed, &memory, &returns);
        assert_eq!(granted(&back), ["198.19.0.0/28"]);
        assert_eq!(
            back.returned,
            [("default".to_string(), cidr("198.19.0.0/28"))]
        );
    }
}
