//! Envelope decoding: any payload decodes to a request/response or an
//! error, never a panic; whatever decodes re-encodes to bytes that decode
//! to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metis::wire::{Request, Response};
use prost::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = Request::decode(data) {
        let again = Request::decode(request.encode_to_vec().as_slice()).expect("re-decodes");
        assert_eq!(again, request);
    }
    if let Ok(response) = Response::decode(data) {
        let again = Response::decode(response.encode_to_vec().as_slice()).expect("re-decodes");
        assert_eq!(again, response);
        let _ = response.code();
        let _ = response.reason();
    }
});
