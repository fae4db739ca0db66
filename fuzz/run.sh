#!/usr/bin/env bash
# Builds the fuzz targets with libFuzzer coverage instrumentation on the
# stable toolchain and runs each for FUZZ_SECONDS (default 600). Usage:
#   fuzz/run.sh [TARGET...]        (default: every target, one after another)
# A finding stops the run with libFuzzer's report and a crash-* input under
# fuzz/artifacts/TARGET/; the corpus grows under fuzz/corpus/TARGET/.
set -euo pipefail
cd "$(dirname "$0")"
seconds=${FUZZ_SECONDS:-600}
host=$(rustc -vV | sed -n 's/^host: //p')
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(wire envelope cni_config cni_args cidr host_local nnc_object watch_event kubeconfig)
fi
# The instrumentation cargo-fuzz uses, minus the sanitizer (which needs
# nightly): all of it is stable rustc. --target keeps it off build scripts.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
cargo build --release --locked --target "$host" --bins
for target in "${targets[@]}"; do
  mkdir -p "corpus/$target" "artifacts/$target"
  echo "== fuzzing $target for ${seconds}s"
  "${CARGO_TARGET_DIR:-target}/$host/release/$target" "corpus/$target" "seeds/$target" \
    -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="artifacts/$target/" -print_final_stats=1
done
