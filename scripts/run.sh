#!/usr/bin/env bash
# The main job on a fresh machine: install what is needed, prepare the host,
# start a development server on localhost, create a sandbox from the default
# template and run commands in it. Safe to run again.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
need_root "$@"

DATA_DIR="${SPACE_DATA_DIR:-/var/lib/space}"
LISTEN="${SPACE_LISTEN:-127.0.0.1:7070}"
export SPACE_URL="http://$LISTEN" SPACE_DATA_DIR="$DATA_DIR"
LOG="${SPACE_LOG:-/tmp/space-serve.log}"

ensure_build_deps
cd "$ROOT"
build_agent
say "building space"
cargo build --release --locked -p space-cli
SPACE="$TARGET_DIR/release/space"

say "preparing the host (packages, btrfs data dir, base template, the user space)"
"$SPACE" setup --data-dir "$DATA_DIR"

# Two processes, as in production: the root helper does the engine's root
# work (runsc, roots and quotas, cgroups) and nothing else; the server,
# which reads every byte a tenant or a sandbox sends, runs as the user
# `space` with no capabilities, no_new_privs, a seccomp filter and
# Landlock (`space doctor` shows both).
SOCKET=/run/space/helper.sock
HELPER_LOG="${SPACE_HELPER_LOG:-/tmp/space-helper.log}"
if curl -fsS "$SPACE_URL/v1/health" >/dev/null 2>&1; then
    say "a SPACE server already answers on $SPACE_URL"
else
    if ! [ -S "$SOCKET" ] || ! kill -0 "$(cat /tmp/space-helper.pid 2>/dev/null)" 2>/dev/null; then
        say "starting the root helper on $SOCKET (log: $HELPER_LOG)"
        nohup "$SPACE" helper --data-dir "$DATA_DIR" --socket "$SOCKET" --allow-uid "$(id -u space)" \
            >"$HELPER_LOG" 2>&1 &
        echo $! >/tmp/space-helper.pid
        for _ in $(seq 1 100); do
            [ -S "$SOCKET" ] && break
            sleep 0.1
        done
        [ -S "$SOCKET" ] || { cat "$HELPER_LOG"; exit 1; }
    fi
    say "starting the server on $SPACE_URL as user space (log: $LOG)"
    nohup "$SPACE" serve --dev --data-dir "$DATA_DIR" --listen "$LISTEN" \
        --helper-socket "$SOCKET" --user space >"$LOG" 2>&1 &
    echo $! >/tmp/space-serve.pid
    for _ in $(seq 1 100); do
        curl -fsS "$SPACE_URL/v1/health" >/dev/null 2>&1 && break
        sleep 0.1
    done
    curl -fsS "$SPACE_URL/v1/health" >/dev/null || { cat "$LOG"; exit 1; }
fi

say "creating a sandbox from the base template"
SANDBOX=$("$SPACE" sandbox create --label demo=run.sh --quiet)
echo "sandbox: $SANDBOX"

say "running commands in it"
"$SPACE" exec "$SANDBOX" -- sh -c 'echo "hello from $(hostname), kernel $(uname -r)"; . /etc/os-release; echo "$PRETTY_NAME"'
"$SPACE" exec "$SANDBOX" -- python3 -c 'print("python says", 6*7)'
"$SPACE" exec "$SANDBOX" -- sh -c 'echo state > /root/state.txt'
"$SPACE" exec "$SANDBOX" -- cat /root/state.txt

say "the same through the HTTP API"
cat <<TXT
  export SPACE_API_KEY=\$(cat $DATA_DIR/state/dev-api-key)
  curl -s -H "Authorization: Bearer \$SPACE_API_KEY" -H 'Content-Type: application/json' \\
       $SPACE_URL/v1/sandboxes/$SANDBOX/exec -d '{"cmd": "ls / && id"}'
TXT
KEY=$(cat "$DATA_DIR/state/dev-api-key")
curl -s -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' \
    "$SPACE_URL/v1/sandboxes/$SANDBOX/exec" -d '{"cmd": "ls / && id"}'
echo

say "done: the server keeps running"
echo "  sandbox $SANDBOX is running; delete it with: $SPACE sandbox rm $SANDBOX"
echo "  stop the server with: kill \$(cat /tmp/space-serve.pid); the root helper with: kill \$(cat /tmp/space-helper.pid)"
echo "  each process's user and privileges: $SPACE doctor"
