//! The floor of `make bench`: the cheapest possible CNI-shaped process. It
//! reads its whole stdin (as a plugin reads its network configuration),
//! prints one short JSON line and exits. The bench compiles it with `rustc`
//! at run time with the same optimisation settings as the release profile,
//! so the gap between it and a plugin is the plugin's own work.

use std::io::{Read, Write};

fn main() {
    let mut input = Vec::new();
    let read = std::io::stdin().lock().read_to_end(&mut input);
    let mut out = std::io::stdout().lock();
    let written = writeln!(out, "{{\"cniVersion\":\"1.0.0\",\"bytes\":{}}}", input.len());
    if read.is_err() || written.is_err() {
        std::process::exit(1);
    }
}
