//! The floor of `make bench`: the cheapest possible CNI-shaped process. It
//! reads its whole stdin (as a plugin reads its network configuration),
//! prints one short JSON line and exits. It is the `metis-floor` binary of
//! this package, built by the same `make build` / `make edge` command as
//! `metis` and so linked exactly as it is, and it starts as `metis` does
//! (`metis::start`): the gap between the two is the plugin's own work.
#![cfg_attr(all(target_os = "linux", target_env = "gnu"), no_main)]

use std::io::{Read, Write};

metis::entry_point!(floor);

fn floor() -> u8 {
    let mut input = Vec::new();
    let read = std::io::stdin().lock().read_to_end(&mut input);
    let mut out = std::io::stdout().lock();
    let written = writeln!(
        out,
        "{{\"cniVersion\":\"1.0.0\",\"bytes\":{}}}",
        input.len()
    );
    u8::from(read.is_err() || written.is_err())
}
