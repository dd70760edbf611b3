"""`python -m worker.hardware.record > reading.json`: record this machine's readings as a fixture.

Run it on a real GPU machine; the file replays through `detect` exactly as the live NVML would
(it records what `detect` reads: `read_nvidia`), telemetry, process lists and per-process
utilisation included.
"""

from __future__ import annotations

import json
import sys

from worker.hardware.host import read_host
from worker.hardware.nvml import PynvmlSource, find_wsl_nvml_library, gpu_processes, read_nvidia, sample_gpus
from worker.hardware.replay import RecordingSource, reading_to_json


def main() -> int:
    host = read_host()
    recorder = RecordingSource(PynvmlSource(library=find_wsl_nvml_library() if host.is_wsl2 else None))
    read_nvidia(recorder)
    sample_gpus(recorder)
    gpu_processes(recorder)
    json.dump(reading_to_json(host, recorder), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
