# Shared by the scripts: where things are, and how they are built.
# shellcheck shell=bash

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOST_TARGET="x86_64-unknown-linux-gnu"
# Where cargo builds (CARGO_TARGET_DIR moves it); tools built from crates.io
# stay in the checkout's target/tools, where the tests look for them.
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
TOOLS="$ROOT/target/tools"
AGENT_BIN="$TARGET_DIR/$HOST_TARGET/release/space-agent"
export SPACE_AGENT_BIN="$AGENT_BIN"

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

# Root is needed (apt-get, mounts, runsc). As root (a fresh Debian may have
# no sudo) the script just goes on; otherwise it runs itself again through
# sudo, keeping the caller's Rust toolchain (sudo resets PATH).
# Usage: need_root "$@" at the top of a script.
need_root() {
    [ "$(id -u)" -eq 0 ] && return 0
    if ! command -v sudo >/dev/null; then
        echo "this needs root (apt-get, mounts, runsc), and there is no sudo: run it as root" >&2
        exit 1
    fi
    say "re-running as root through sudo"
    exec sudo env "PATH=$PATH" "CARGO_HOME=${CARGO_HOME:-$HOME/.cargo}" "RUSTUP_HOME=${RUSTUP_HOME:-$HOME/.rustup}" \
        ${CI:+CI=$CI} ${FUZZ_SECONDS:+FUZZ_SECONDS=$FUZZ_SECONDS} ${SPACE_TEST_DATA_DIR:+SPACE_TEST_DATA_DIR=$SPACE_TEST_DATA_DIR} \
        ${SPACE_DATA_DIR:+SPACE_DATA_DIR=$SPACE_DATA_DIR} ${FIRECRACKER_BIN:+FIRECRACKER_BIN=$FIRECRACKER_BIN} \
        ${CARGO_TARGET_DIR:+CARGO_TARGET_DIR=$CARGO_TARGET_DIR} \
        bash "$0" "$@"
}

# Installs the Debian packages named after WHAT that are missing, saying
# "installing WHAT: ...".
install_missing() {
    local what="$1" missing=()
    shift
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing $what: ${missing[*]}"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    fi
}

# Says how much disk is free where the build goes, and warns loudly when
# it is less than a whole test run takes (builds, templates, sandboxes):
# a full disk fails a run far from its cause.
say_free_disk() {
    local need_gib=25 free_gib
    free_gib=$(df --output=avail -BG "$ROOT" | tail -n 1 | tr -dc '0-9')
    say "free disk for the build: ${free_gib} GiB"
    if [ "$free_gib" -lt "$need_gib" ]; then
        echo "WARNING: only ${free_gib} GiB free on $(df --output=target "$ROOT" | tail -n 1); a whole test run takes about ${need_gib} GiB" >&2
    fi
}

# Build tools from Debian, installed only when missing.
# jq: the README's tour, which a reader runs after scripts/run.sh, reads
# the API's answers with it.
ensure_build_deps() {
    install_missing "build tools" gcc libc6-dev curl openssl e2fsprogs python3 python3-venv git jq
    if ! command -v cargo >/dev/null; then
        echo "cargo is missing: install a Rust toolchain (1.85 or newer) first" >&2
        exit 1
    fi
}

# The console's tests drive Debian's Chromium over WebDriver (chromedriver);
# the PostgreSQL store's tests run throwaway clusters of Debian's postgresql;
# the cluster test puts each node in a network namespace of its own (ip);
# the README's tour, which a test runs, reads answers with jq; the registry
# tests run Debian's docker-registry on loopback and push to it with skopeo;
# E2B's npm SDK test runs its packages with Node.js and npm.
ensure_test_packages() {
    local had_registry=yes
    dpkg-query -W -f='${Status}' docker-registry 2>/dev/null | grep -q "install ok installed" || had_registry=no
    install_missing "what the tests use" chromium chromium-driver postgresql iproute2 jq docker-registry skopeo curl
    # E2B's npm packages run under Node.js (Debian's, unless one is there).
    command -v npm >/dev/null || install_missing "the npm SDK test" nodejs npm
    # Under systemd the package starts a registry of its own on :5000 of
    # every interface, with no auth: an open registry on the test machine's
    # network. The tests run theirs on loopback with their own configs, so
    # one this script installed is stopped and disabled (a package upgrade
    # keeps it disabled); one that was there before is left as it was.
    if [ "$had_registry" = no ] && [ -d /run/systemd/system ]; then
        systemctl disable --now docker-registry.service || true
    fi
}

# The guest agent is linked statically so it runs in any root filesystem.
# An explicit --target keeps the static flag away from build scripts and
# proc macros.
build_agent() {
    say "building the static guest agent"
    RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked -p space-agent --target "$HOST_TARGET"
}

# The guest test boots the microVM guest (Debian's kernel, the initramfs,
# the agent as /init) under QEMU in software emulation, with a vhost-user
# vsock device: Debian's QEMU (from bookworm-backports when apt has it, as
# runsc: the host's qemu-utils may come from there), and vhost-device-vsock
# from crates.io, built into target/tools.
ensure_guest_test_tools() {
    if ! command -v qemu-system-x86_64 >/dev/null; then
        say "installing qemu-system-x86 (for the guest test)"
        local release=()
        if apt-cache policy | grep -q bookworm-backports; then
            release=(-t bookworm-backports)
        fi
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${release[@]}" qemu-system-x86
    fi
    if [ ! -x "$TOOLS/bin/vhost-device-vsock" ]; then
        say "building vhost-device-vsock (for the guest test)"
        cargo install --locked --version 0.3.0 --root "$TOOLS" vhost-device-vsock
    fi
}

# The test runner: cargo-nextest runs each test in a process of its own
# under a watchdog (.config/nextest.toml). One on PATH will do if it is at
# least the version the config asks for; otherwise it is built from
# crates.io into target/tools (0.9.100: the last release that builds with
# the workspace's Rust 1.85; 19 minutes on 2 cores with the CPU loaded
# beside it, once).
NEXTEST_VERSION=0.9.100
ensure_nextest() {
    export PATH="$TOOLS/bin:$PATH"
    local have
    have=$(cargo nextest --version 2>/dev/null | head -n 1 | cut -d' ' -f2 || true)
    if [ -z "$have" ] || [ "$(printf '%s\n%s\n' "$NEXTEST_VERSION" "$have" | sort -V | head -n 1)" != "$NEXTEST_VERSION" ]; then
        say "building cargo-nextest $NEXTEST_VERSION (the test runner)"
        # Without self-update: it fetches releases from a host CI cannot reach,
        # and it is most of what there is to build.
        cargo install --locked --version "$NEXTEST_VERSION" --root "$TOOLS" \
            --no-default-features --features default-no-update cargo-nextest
    fi
}

# The book (docs/book) is built by mdBook, from crates.io into
# target/tools when the right one is not on PATH (0.4.52: the last
# release that builds with the workspace's Rust 1.85; without its
# development server and file watcher, which the build does not use).
MDBOOK_VERSION=0.4.52
ensure_mdbook() {
    export PATH="$TOOLS/bin:$PATH"
    if [ "$(mdbook --version 2>/dev/null)" != "mdbook v$MDBOOK_VERSION" ]; then
        say "building mdbook $MDBOOK_VERSION (the book)"
        cargo install --locked --version "$MDBOOK_VERSION" --root "$TOOLS" \
            --no-default-features --features search mdbook
    fi
}

# Builds the book into target/book and fails on a link that leads nowhere
# (in the book or the README) or a `space` command or flag the CLI does not
# have. Its API reference is rendered from the OpenAPI document the
# server's own code prints, so it cannot drift.
build_book() {
    ensure_mdbook
    say "building the book (docs/book) and checking its links and commands"
    cargo run --quiet --locked -p space-server --example openapi >"$TARGET_DIR/openapi.json"
    # From the book's directory: mdBook runs its preprocessor from there.
    (cd "$ROOT/docs/book" && SPACE_OPENAPI_JSON="$TARGET_DIR/openapi.json" mdbook build)
    python3 "$ROOT/scripts/check-links.py" "$ROOT/target/book" "$ROOT/README.md"
    cargo build --quiet --locked -p space-cli --bin space
    python3 "$ROOT/scripts/check-cli-docs.py" "$TARGET_DIR/debug/space" "$ROOT/README.md" \
        "$ROOT"/docs/book/src/*.md "$ROOT"/docs/book/src/*/*.md
}

# The control logic's tests over the fake engine (crates/space-server/
# tests/unprivileged), run as nobody: built as the caller, copied where
# nobody can read them (a checkout under /root is not), with a deadline
# around the whole binary (each wait inside has its own; nextest's
# per-test watchdog does not run as nobody, its toolchain being root's).
run_unprivileged_tests() {
    local binary scratch status=0 started=$SECONDS
    binary=$(cargo test --locked -p space-server --test unprivileged --no-run --message-format=json |
        python3 -c 'import json, sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][-1])')
    scratch=$(mktemp -d)
    chmod 755 "$scratch"
    install -m 755 "$binary" "$scratch/unprivileged"
    mkdir -m 1777 "$scratch/tmp"
    timeout 600 runuser -u nobody -- env SPACE_UNPRIVILEGED_TMP="$scratch/tmp" TMPDIR="$scratch/tmp" \
        "$scratch/unprivileged" || status=$?
    say "the unprivileged tests took $((SECONDS - started)) s (exit $status)"
    rm -rf "$scratch"
    return "$status"
}
