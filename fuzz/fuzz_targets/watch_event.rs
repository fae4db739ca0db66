//! Watch stream lines: any bytes are an event or a decode error, never a
//! panic; an event's object goes through the identity and replay checks of
//! the watch thread and the loop's ordering without one either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metis::kube::client::parse_event;
use metis::kube::follow::{Follower, StreamGuard};
use metis::kube::nnc::{Kind, Meta, Nnc};

fuzz_target!(|data: &[u8]| {
    let mut guard = StreamGuard::new("node-a", Kind::Nnc);
    let mut follower = Follower::default();
    let epoch = guard.new_epoch();
    // Several lines in one input: a stream, in order.
    for line in data.split(|b| *b == b'\n') {
        let Ok(event) = parse_event(line) else {
            continue;
        };
        let meta = Meta::parse(&event.object);
        if !guard.is_ours(&meta) {
            assert!(!meta.is_of_node("node-a"));
            continue;
        }
        if guard.is_replay(&meta) {
            continue;
        }
        let _ = follower.stream(epoch, &meta);
        assert_eq!(follower.version(), Some(meta.resource_version.as_str()));
        let _ = Nnc::parse(&event.object);
    }
});
