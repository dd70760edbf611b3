#!/usr/bin/env bash
# Smoke-test a built .deb as installed: unpack it into a scratch root, check its layout, and run
# `gpu-provider --version`, `gpu-provider detect` (valid JSON) and the app offscreen for a few
# seconds. Any problem fails loudly with a non-zero exit status.
#
#   installer/linux/smoke-test.sh dist/gpu-provider_<version>_<arch>.deb
set -euo pipefail

DEB="${1:?usage: smoke-test.sh PATH.deb}"
APP_SECONDS="${SMOKE_APP_SECONDS:-5}"
[ -f "$DEB" ] || { echo "smoke-test: no such file: $DEB" >&2; exit 1; }

SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
ROOTFS="$SCRATCH/root"
DATA="$SCRATCH/data"
FAILURES=0

fail() { echo "FAIL: $*" >&2; FAILURES=$((FAILURES + 1)); }
pass() { echo "ok:   $*"; }

dpkg-deb -x "$DEB" "$ROOTFS"
VERSION="$(dpkg-deb -f "$DEB" Version)"
BIN="$ROOTFS/opt/gpu-provider/gpu-provider"

# The layout the desktop relies on.
for path in usr/bin/gpu-provider usr/share/applications/gpu-provider.desktop \
    usr/share/icons/hicolor/512x512/apps/gpu-provider.png opt/gpu-provider/gpu-provider; do
    [ -e "$ROOTFS/$path" ] && pass "/$path is in the package" || fail "/$path is missing from the package"
done
grep -q '^exec /opt/gpu-provider/gpu-provider "\$@"$' "$ROOTFS/usr/bin/gpu-provider" \
    && pass "/usr/bin/gpu-provider runs /opt/gpu-provider/gpu-provider" \
    || fail "/usr/bin/gpu-provider does not run /opt/gpu-provider/gpu-provider"
if command -v desktop-file-validate >/dev/null; then
    desktop-file-validate "$ROOTFS/usr/share/applications/gpu-provider.desktop" \
        && pass "the desktop entry is valid" || fail "the desktop entry is not valid"
fi

# Run as a stranger to this machine: own home, own data folder, no display.
export HOME="$SCRATCH/home" XDG_RUNTIME_DIR="$SCRATCH/run" QT_QPA_PLATFORM=offscreen
mkdir -p "$HOME" "$XDG_RUNTIME_DIR" && chmod 0700 "$XDG_RUNTIME_DIR"
unset GPU_PROVIDER_TOKEN GPU_PROVIDER_DATA_DIR

if output="$(timeout 60 "$BIN" --version 2>&1)"; then
    [ "$output" = "gpu-provider $VERSION" ] && pass "--version says $output" \
        || fail "--version says '$output', the package is $VERSION"
else
    fail "--version exited with $?: $output"
fi

if timeout 120 "$BIN" --data-dir "$DATA" detect >"$SCRATCH/detect.json" 2>"$SCRATCH/detect.err"; then
    if python3 - "$SCRATCH/detect.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
missing = {"platform", "hardware", "engines"} - set(data)
sys.exit(f"detect output lacks {sorted(missing)}" if missing else 0)
PY
    then pass "detect printed valid JSON"; else fail "detect did not print the expected JSON: $(head -c 500 "$SCRATCH/detect.json")"; fi
else
    fail "detect exited with $?: $(tail -n 20 "$SCRATCH/detect.err")"
fi

# The desktop app, offscreen: it must start, run, and quit by itself with status 0.
if timeout $((APP_SECONDS + 60)) "$BIN" --data-dir "$DATA" --quit-after "$APP_SECONDS" >"$SCRATCH/app.log" 2>&1; then
    pass "the app ran offscreen for $APP_SECONDS s and quit cleanly"
else
    fail "the app exited with $? (124 = still running after $((APP_SECONDS + 60)) s): $(tail -n 30 "$SCRATCH/app.log")"
fi

if [ "$FAILURES" -ne 0 ]; then
    echo "smoke test of $DEB: $FAILURES problem(s)" >&2
    exit 1
fi
echo "smoke test of $DEB passed"
