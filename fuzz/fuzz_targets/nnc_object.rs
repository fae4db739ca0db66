//! NodeNetworkConfig and Node objects as the API server (or anything
//! posing as it) sends them: any JSON parses without a panic, lists stay
//! within their caps, only `Ready=True` IPv4 entries are ever granted, and
//! the patch computed from a copy carries that copy's version.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metis::adaptive::grants::{self, Returns};
use metis::kube::nnc::{MAX_ENTRIES, Nnc, NncPatch, Node};

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let nnc = Nnc::parse(&value);
    assert!(nnc.pod_cidrs.len() <= MAX_ENTRIES);
    assert!(nnc.allocations.len() <= MAX_ENTRIES);
    assert!(nnc.releasable.len() <= MAX_ENTRIES);
    let decided = grants::decide(&nnc, &[], &Returns::default());
    for (network, cidr) in &decided.granted {
        assert_eq!(cidr.family(), metis::cidr::Family::V4);
        assert!(nnc.pod_cidrs.iter().any(|entry| entry.ready
            && &entry.network == network
            && entry.cidr.parse::<metis::cidr::Cidr>().ok().as_ref() == Some(cidr)));
    }
    for withheld in &decided.withheld {
        let _ = withheld.describe();
    }
    let patch = NncPatch {
        resource_version: nnc.meta.resource_version.clone(),
        allocations: nnc.allocations.clone(),
        releasable: nnc.releasable.clone(),
    };
    let body = patch.to_json();
    assert_eq!(
        body["metadata"]["resourceVersion"].as_str(),
        Some(nnc.meta.resource_version.as_str())
    );
    let node = Node::parse(&value);
    assert!(node.pod_cidrs.len() <= MAX_ENTRIES + 1);
    let _ = node.meta.is_of_node("node-a");
});
