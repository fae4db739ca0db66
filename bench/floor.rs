//! The floor of `make bench`: the cheapest possible CNI-shaped process. It
//! reads its whole stdin (as a plugin reads its network configuration),
//! prints one short JSON line and exits. It is the `metis-floor` binary of
//! this package, built by the same `make build` / `make edge` command as
//! `metis` and so linked exactly as it is: the gap between the two is the
//! plugin's own work.

use std::io::{Read, Write};

fn main() {
    let mut input = Vec::new();
    let read = std::io::stdin().lock().read_to_end(&mut input);
    let mut out = std::io::stdout().lock();
    let written = writeln!(
        out,
        "{{\"cniVersion\":\"1.0.0\",\"bytes\":{}}}",
        input.len()
    );
    if read.is_err() || written.is_err() {
        std::process::exit(1);
    }
}
