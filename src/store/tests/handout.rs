//! The hand-out check over plain data: no database, no I/O.

use super::*;
use crate::cidr::Bounds;

fn record(block: &str) -> BlockRecord {
    let cidr = cidr(block);
    BlockRecord {
        cidr,
        fixed: reserved_offsets(&cidr, ReserveMode::EveryBlock, false),
        retired: false,
        quarantined: false,
        granted: false,
    }
}

fn bounded(subnet: &str, start: &str, end: &str, gateway: &str) -> InForce {
    let subnet = cidr(subnet);
    let bounds = Bounds::new(
        &subnet,
        Some(start.parse().unwrap()),
        Some(end.parse().unwrap()),
        Some(gateway.parse().unwrap()),
    )
    .unwrap();
    InForce {
        ranges: vec![subnet],
        bounds: vec![(subnet, bounds)],
    }
}

fn verdict(address: &str, block: &BlockRecord, conf: &InForce) -> Result<(), Unfit> {
    address_fit(address.parse().unwrap(), block, conf)
}

#[test]
fn an_address_fits_only_inside_the_ranges_bounds_and_off_the_gateway() {
    let block = record("198.18.0.0/24");
    let conf = bounded("198.18.0.0/24", "198.18.0.10", "198.18.0.20", "198.18.0.15");
    assert_eq!(verdict("198.18.0.10", &block, &conf), Ok(()));
    assert_eq!(verdict("198.18.0.20", &block, &conf), Ok(()));
    assert_eq!(
        verdict("198.18.0.21", &block, &conf),
        Err(Unfit::OutsideBounds {
            start: "198.18.0.10".parse().unwrap(),
            end: "198.18.0.20".parse().unwrap()
        })
    );
    assert!(matches!(
        verdict("198.18.0.9", &block, &conf),
        Err(Unfit::OutsideBounds { .. })
    ));
    assert_eq!(
        verdict("198.18.0.15", &block, &conf),
        Err(Unfit::Gateway("198.18.0.15".parse().unwrap()))
    );
    // A row that does not lie in its own block.
    assert_eq!(
        verdict("198.18.1.12", &block, &conf),
        Err(Unfit::OutsideBlock)
    );
}

#[test]
fn without_bounds_the_blocks_reservation_and_the_results_gateway_are_kept_out() {
    let block = record("198.18.0.0/28");
    let conf = InForce {
        ranges: vec![cidr("198.18.0.0/28")],
        bounds: Vec::new(),
    };
    assert_eq!(
        verdict("198.18.0.1", &block, &conf),
        Err(Unfit::Gateway("198.18.0.1".parse().unwrap()))
    );
    assert_eq!(verdict("198.18.0.0", &block, &conf), Err(Unfit::Reserved));
    assert_eq!(verdict("198.18.0.15", &block, &conf), Err(Unfit::Reserved));
    assert_eq!(verdict("198.18.0.2", &block, &conf), Ok(()));
    // Under first-block a later block reserves nothing, but a result for
    // it still names its .1 as the gateway.
    let later = BlockRecord {
        fixed: Vec::new(),
        ..record("198.18.0.0/28")
    };
    assert_eq!(verdict("198.18.0.0", &later, &conf), Ok(()));
    assert!(matches!(
        verdict("198.18.0.1", &later, &conf),
        Err(Unfit::Gateway(_))
    ));
}

#[test]
fn a_block_the_configuration_does_not_name_is_passed_over_unless_granted() {
    let conf = InForce {
        ranges: vec![cidr("198.18.0.0/24")],
        bounds: Vec::new(),
    };
    let other = record("198.18.5.0/28");
    assert!(matches!(
        block_fit(&other, &conf),
        Err(Unfit::BlockOutsideRanges { .. })
    ));
    assert!(matches!(
        verdict("198.18.5.2", &other, &conf),
        Err(Unfit::BlockOutsideRanges { .. })
    ));
    // The cluster's or the flags' block is served beside the ranges.
    let granted = BlockRecord {
        granted: true,
        ..other.clone()
    };
    assert_eq!(verdict("198.18.5.2", &granted, &conf), Ok(()));
    // A block that overlaps a range (a wider granted one, a narrowed
    // piece) is looked at address by address.
    let wider = record("198.18.0.0/23");
    assert_eq!(block_fit(&wider, &conf), Ok(()));
    assert!(matches!(
        verdict("198.18.1.7", &wider, &conf),
        Err(Unfit::OutsideRanges { .. })
    ));
    // Metis's record wins over whatever state the row says.
    let retired = BlockRecord {
        retired: true,
        ..record("198.18.0.0/24")
    };
    assert_eq!(block_fit(&retired, &conf), Err(Unfit::Retired));
    let quarantined = BlockRecord {
        quarantined: true,
        granted: true,
        ..record("198.18.0.0/24")
    };
    assert_eq!(
        verdict("198.18.0.9", &quarantined, &conf),
        Err(Unfit::Quarantined)
    );
    // No configuration (the store's own callers): every block as laid out.
    assert_eq!(verdict("198.18.5.2", &other, &InForce::default()), Ok(()));
}
