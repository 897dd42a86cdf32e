#!/usr/bin/env bash
# Install what is needed and run the whole test suite on real sandboxes:
# format and lints, the book (docs/book, its links checked), every test
# under a per-test watchdog (cargo-nextest, .config/nextest.toml: a stuck
# test fails naming itself and the others still run), the doc tests, and
# fuzzing. The control logic's tests over the fake engine run first, as
# an unprivileged user (nobody). Ends with a summary (passed, failed and skipped tests, the ten
# slowest, total time, free disk) and exits non-zero if anything failed.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
need_root "$@"

export SPACE_TEST_DATA_DIR="${SPACE_TEST_DATA_DIR:-/var/lib/space-test}"

ensure_build_deps
ensure_nextest
cd "$ROOT"
# A CI run builds once: incremental caches would only take disk.
[ -n "${CI:-}" ] && export CARGO_INCREMENTAL=0

# First, and counted like the rest: they need nothing of the host.
say "running the unprivileged tests as nobody (the fake engine: no root, btrfs or runsc)"
unprivileged=passed
run_unprivileged_tests || unprivileged=failed
say_free_disk
build_agent
say "building the test suite"
cargo build --locked -p space-cli -p space-testkit
cargo test --workspace --locked --no-run

say "preparing the test host (packages, btrfs at $SPACE_TEST_DATA_DIR, base and polyglot templates)"
"$TARGET_DIR/debug/space" setup --data-dir "$SPACE_TEST_DATA_DIR" --with-template polyglot --with-template code-interpreter
ensure_guest_test_tools
ensure_test_packages

say "checking format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
build_book

# From here on a failure is counted, not fatal: everything runs, and the
# summary says what failed.
# nextest's store is the checkout's target/nextest (.config/nextest.toml).
results="$ROOT/target/nextest/default"
mkdir -p "$results"
rm -f "$results/junit.xml"
say "running the tests (each in a process of its own, under the watchdog of .config/nextest.toml)"
tests=passed
# The unprivileged tests ran above, as nobody.
cargo nextest run --workspace --locked -E 'not binary_id(space-server::unprivileged)' 2>&1 | tee "$results/run.log" || tests=failed
# A test the watchdog killed left its sandboxes to the next test's
# fixtures; after the last test, nobody else removes them.
"$TARGET_DIR/debug/space-test-sweep" || true

# nextest does not run doc tests.
say "running the doc tests"
doctests=passed
cargo test --doc --workspace --locked || doctests=failed

say "fuzzing (FUZZ_SECONDS=${FUZZ_SECONDS:-60} per target)"
fuzzing=passed
"$ROOT/scripts/fuzz.sh" || fuzzing=failed

python3 "$ROOT/scripts/test-summary.py" --junit "$results/junit.xml" --log "$results/run.log" \
    --tests "$tests" --unprivileged "$unprivileged" --doctests "$doctests" --fuzzing "$fuzzing" --seconds "$SECONDS" \
    --disk "$TARGET_DIR" --disk "$SPACE_TEST_DATA_DIR"
[ "$tests$unprivileged$doctests$fuzzing" = passedpassedpassedpassed ]
