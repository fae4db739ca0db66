//! CIDR parsing and arithmetic: any string parses to a canonical prefix that
//! prints back to itself, or is refused; offsets and membership agree.
#![no_main]

use libfuzzer_sys::fuzz_target;
use metis::cidr::Cidr;

fuzz_target!(|data: (&str, u128)| {
    let (text, offset) = data;
    let Ok(cidr) = text.parse::<Cidr>() else {
        return;
    };
    assert_eq!(cidr.to_string().parse::<Cidr>().ok(), Some(cidr));
    assert_eq!(cidr.nth(0), Some(cidr.base()));
    match cidr.nth(offset) {
        Some(addr) => {
            assert!(cidr.contains(addr));
            assert_eq!(cidr.offset_of(addr), Some(offset));
        }
        None => assert!(offset >= cidr.size() || cidr.size() == 0),
    }
    assert!(cidr.overlaps(&cidr));
});
