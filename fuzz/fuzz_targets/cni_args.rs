//! `CNI_ARGS` parsing: any string is parsed or refused with code 4 (invalid
//! environment), never a panic; pod name and namespace are taken verbatim.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metis::cni::args;

fuzz_target!(|text: &str| {
    match args::parse(text) {
        Ok(parsed) => {
            assert!(parsed.pod_name.len() <= text.len());
            assert!(parsed.pod_namespace.len() <= text.len());
        }
        Err(err) => assert_eq!(err.code, 4),
    }
    let _ = args::parse_ip_maybe_prefix(text);
});
