//! The daemon's frame decoder: any byte stream, split into frames the way a
//! connection buffer is, never panics, never yields a range outside the
//! buffer or a frame over the limit, and agrees with the blocking reader.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metis::wire::frame::{self, MAX_REQUEST_FRAME, PREFIX_LEN};

fuzz_target!(|data: &[u8]| {
    // A small limit as well as the real one, so the "too large" path is hit.
    for max in [MAX_REQUEST_FRAME, 16] {
        let mut rest = data;
        loop {
            match frame::split(rest, max) {
                Ok(Some((payload, used))) => {
                    assert!(payload.end == used && used <= rest.len());
                    assert!(payload.len() <= max && payload.start == PREFIX_LEN);
                    let mut reader = rest;
                    let read = frame::read_frame(&mut reader, max).expect("reader agrees");
                    assert_eq!(Some(read.as_slice()), rest.get(payload));
                    rest = rest.get(used..).unwrap_or_default();
                }
                Ok(None) => {
                    let mut reader = rest;
                    assert!(frame::read_frame(&mut reader, max).is_err());
                    break;
                }
                Err(_) => {
                    let mut reader = rest;
                    assert!(frame::read_frame(&mut reader, max).is_err());
                    break;
                }
            }
        }
    }
});
