#!/usr/bin/env bash
# Install what is needed and run the whole test suite on real sandboxes.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
need_root "$@"

export SPACE_TEST_DATA_DIR="${SPACE_TEST_DATA_DIR:-/var/lib/space-test}"

ensure_build_deps
cd "$ROOT"
# A CI run builds once: incremental caches would only take disk.
[ -n "${CI:-}" ] && export CARGO_INCREMENTAL=0
say_free_disk
build_agent
say "building the test suite"
cargo build --locked -p space-cli
cargo test --workspace --locked --no-run

say "preparing the test host (packages, btrfs at $SPACE_TEST_DATA_DIR, base and polyglot templates)"
"$ROOT/target/debug/space" setup --data-dir "$SPACE_TEST_DATA_DIR" --with-template polyglot --with-template code-interpreter
ensure_guest_test_tools
ensure_test_packages

say "checking format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings

say "running the tests"
cargo test --workspace --locked

say "fuzzing (FUZZ_SECONDS=${FUZZ_SECONDS:-60} per target)"
"$ROOT/scripts/fuzz.sh"
