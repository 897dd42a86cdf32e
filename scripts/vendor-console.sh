#!/usr/bin/env bash
# Refreshes the web console's vendored xterm.js from the npm registry.
# The copies drop the source-map comment and the web addresses of the
# license comments (no address but XML namespaces remains); nothing else
# is changed. Run it after changing a version below, and commit the result.
set -euo pipefail
XTERM=6.0.0
FIT=0.11.0
dest="$(cd "$(dirname "$0")/.." && pwd)/crates/space-http/console/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm pack --silent "@xterm/xterm@$XTERM" "@xterm/addon-fit@$FIT" >/dev/null
mkdir xterm fit
tar xzf "xterm-xterm-$XTERM.tgz" -C xterm
tar xzf "xterm-addon-fit-$FIT.tgz" -C fit
clean() {
    grep -v 'sourceMappingURL' "$1" | sed -E 's# ?\(?https?://[^ )"]*\)?##g' >"$2"
}
# In code, only comment lines: XML namespace identifiers stay.
clean_code() {
    grep -v 'sourceMappingURL' "$1" | sed -E '/^ *\*|^\/\*/ s# ?\(?https?://[^ )"]*\)?##g' >"$2"
}
clean_code xterm/package/lib/xterm.mjs "$dest/xterm.mjs"
clean_code fit/package/lib/addon-fit.mjs "$dest/addon-fit.mjs"
clean xterm/package/css/xterm.css "$dest/xterm.css"
clean xterm/package/LICENSE "$dest/LICENSE-xterm"
echo "vendored @xterm/xterm $XTERM and @xterm/addon-fit $FIT into $dest"
