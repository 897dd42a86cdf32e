#!/usr/bin/env bash
# Fuzz the host<->agent frame decoder, the API request parsers, image layer
# application (nothing may land outside the root), `space cp`'s unpacking of
# a sandbox's tar (nothing outside the target) and the host's handshake with
# whatever dials the agent socket on a redial (never taken for the agent
# without its key) and the egress gateway's reading of whatever a sandbox
# sends its proxy, and the gateway adding secrets to whatever headers a
# sandbox sends a bound host, and the privileged helper's reading of the
# requests it is sent (space-privsep), for a bounded time each (FUZZ_SECONDS, default 60). Uses cargo-fuzz (installed
# from crates.io when missing) on the default toolchain; RUSTC_BOOTSTRAP lets
# a stable compiler take libFuzzer's flags, and `--sanitizer none` keeps it
# off nightly-only sanitizers. A crash fails the script and leaves its input
# under fuzz/artifacts/.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

SECONDS_EACH="${FUZZ_SECONDS:-60}"
# With FUZZ_RUNS, each target also stops once it has run that many inputs
# (the long run: FUZZ_RUNS=1000000 with a generous FUZZ_SECONDS).
RUNS_EACH="${FUZZ_RUNS:--1}"
if ! cargo fuzz --version >/dev/null 2>&1; then
    say "installing cargo-fuzz"
    cargo install --locked cargo-fuzz
fi
cd "$ROOT/fuzz"
export RUSTC_BOOTSTRAP=1
say "building the fuzz targets"
cargo fuzz build --sanitizer none
mkdir -p "$ROOT/fuzz/artifacts"
for target in frame_decoder api_requests layer_apply sandbox_tar agent_redial egress_request secret_headers privsep_request; do
    say "fuzzing $target for ${SECONDS_EACH}s${FUZZ_RUNS:+ or $FUZZ_RUNS inputs}"
    log="$ROOT/fuzz/artifacts/$target.log"
    corpus=("$ROOT/fuzz/corpus/$target")
    [ -d "$ROOT/fuzz/seeds/$target" ] && corpus+=("$ROOT/fuzz/seeds/$target")
    mkdir -p "${corpus[0]}"
    if ! cargo fuzz run --sanitizer none "$target" "${corpus[@]}" -- -max_total_time="$SECONDS_EACH" -runs="$RUNS_EACH" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "fuzzing $target failed: the input is under fuzz/artifacts/$target/" >&2
        exit 1
    fi
    grep -E "^Done" "$log"
done
