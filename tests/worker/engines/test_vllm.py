from __future__ import annotations

from pathlib import Path

import pytest

from worker.engines import get_adapter, vllm
from worker.engines.base import (
    Launch,
    CompileFinished,
    ContextTooLong,
    EngineVersion,
    FreeMemoryShort,
    GraphsCaptured,
    KvCacheMemory,
    KvCacheSize,
    Listening,
    MaxConcurrency,
    MaxModelLen,
    ModelLoaded,
    OutOfMemory,
    PhaseReached,
    StartFailed,
    StartupComplete,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"


def facts(name: str) -> list:
    lines = (FIXTURES / name).read_text(encoding="utf-8").splitlines()
    return [fact for fact in map(vllm.parse_line, lines) if fact is not None]


def test_startup_033_one_line_kv_form():
    assert facts("startup-0.33.log") == [
        EngineVersion("0.33.0"),
        MaxModelLen(32768),
        PhaseReached("loading"),
        ModelLoaded(15.27, 10.318437),
        PhaseReached("compiling"),
        PhaseReached("compiling"),
        CompileFinished(18.41),
        KvCacheMemory(61.23),
        KvCacheSize(445888, concurrency=MaxConcurrency(32768, 13.61)),
        PhaseReached("capturing"),
        PhaseReached("capturing"),
        GraphsCaptured(7.0, 0.62),
        PhaseReached("warming"),
        Listening("http://127.0.0.1:18001"),
        StartupComplete(),
    ]


def test_startup_011_two_line_kv_form_and_old_wording():
    found = facts("startup-0.11.log")
    assert EngineVersion("0.11.0") in found
    assert ModelLoaded(14.9889, 7.981523) in found
    assert CompileFinished(16.02) in found
    kv = found.index(KvCacheSize(44880))
    assert found[kv + 1] == MaxConcurrency(131072, 0.34)
    assert Listening("http://127.0.0.1:18002") in found
    assert found[-1] == StartupComplete()


def test_oom_log_is_recognised():
    found = facts("oom.log")
    assert [type(f) for f in found if isinstance(f, (OutOfMemory, StartFailed))] == [
        OutOfMemory, StartFailed, OutOfMemory, StartFailed
    ]
    assert "CUDA out of memory" in found[-2].message
    assert not any(isinstance(f, StartupComplete) for f in found)


def test_max_model_len_refusal_names_the_estimate():
    assert ContextTooLong(max_seq_len=131072, estimated_max_len=34480) in facts("max-model-len.log")


def test_older_refusal_wording_and_missing_estimate():
    old = "ValueError: To serve at least one request with the models's max seq len (32768), (4.00 GiB KV cache is needed, which is larger than the available KV cache memory (1.10 GiB). Try increasing `gpu_memory_utilization`"
    assert vllm.parse_line(old) == ContextTooLong(32768, None)


def test_free_memory_refusal_is_its_own_fact_not_out_of_memory():
    found = facts("free-memory.log")
    refusal = [f for f in found if isinstance(f, (FreeMemoryShort, OutOfMemory))]
    assert refusal == [FreeMemoryShort(
        "ValueError: Free memory on device cuda:0 (11.20/23.52 GiB) on startup is less than desired GPU memory "
        "utilization (0.9, 21.17 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")]


@pytest.mark.parametrize(("line", "fact"), [
    ("ValueError: Free memory on device (61.05/119.7 GiB) on startup is less than desired GPU memory utilization (0.52, 62.24 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
     FreeMemoryShort("ValueError: Free memory on device (61.05/119.7 GiB) on startup is less than desired GPU memory utilization (0.52, 62.24 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")),
    # the INFO hint a healthy start prints is no refusal
    ("(EngineCore pid=1) INFO 11-29 11:50:38 [gpu_worker.py:1044] Free memory on device (22.1/23.5 GiB) on startup. Desired GPU memory utilization is (0.9, 21.2 GiB). Actual usage is 15.3 GiB for consumed memory (weights + non-torch), 1.2 GiB for peak activation, and 0.6 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with `--kv-cache-memory=4294967296` (4.0 GiB) to fit into requested memory, or `--kv-cache-memory=5368709120` (5.0 GiB) to fully utilize gpu memory. Current kv cache memory in use is 4.0 GiB.", None),
])
def test_free_memory_lines(line, fact):
    assert vllm.parse_line(line) == fact


@pytest.mark.parametrize(
    ("line", "fact"),
    [
        ("\x1b[32m(EngineCore pid=1) INFO 11-29 11:50:38 [gpu_worker.py:773] Available KV cache memory: 1.71 GiB\x1b[0m\r\n", KvCacheMemory(1.71)),
        ("MYPREFIX (Worker_TP0 pid=9) INFO 11-29 11:50:16 [model_runner.py:429] Model loading took 8.5 GiB memory and 3.1 seconds", ModelLoaded(8.5, 3.1)),
        ("(EngineCore pid=1) INFO 11-29 11:50:36 [decorators.py:716] torch.compile and initial profiling/warmup run together took 20.50 s in total", CompileFinished(20.5)),
        ("(EngineCore pid=1) INFO 11-29 11:50:38 [kv_cache_utils.py:1146] CPU + host KV cache size: 1,048,576 tokens, Maximum concurrency for 32,768 tokens per request: 32.00x", KvCacheSize(1048576, concurrency=MaxConcurrency(32768, 32.0))),
        ("(APIServer pid=1) INFO 11-29 11:50:46 [entry.py:139] Starting vLLM server on http://[::1]:8000", Listening("http://[::1]:8000")),
        ("(EngineCore pid=1) ERROR 11-29 11:50:46 [core.py:1584] ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`", OutOfMemory("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`")),
        ("(APIServer pid=1) INFO 11-29 11:50:46 [launcher.py:207] Route: /health, Methods: GET", None),
    ],
)
def test_single_lines(line, fact):
    assert vllm.parse_line(line) == fact


def test_command_puts_app_owned_flags_last():
    argv = vllm.command(Launch(
        ["/opt/venv/bin/vllm"], "org/Model", ["--max-model-len", "32768", "--host", "0.0.0.0"],
        port=18100, served_name="qwen", tensor_parallel=2,
    ))
    assert argv == [
        "/opt/venv/bin/vllm", "serve", "org/Model", "--max-model-len", "32768", "--host", "0.0.0.0",
        "--tensor-parallel-size", "2", "--host", "127.0.0.1", "--port", "18100", "--served-model-name", "qwen",
    ]  # the key is never on the command line: any local user can read it there
    single = vllm.command(Launch(["vllm"], "m", [], port=1, served_name="n"))
    assert "--tensor-parallel-size" not in single
    on_socket = vllm.command(Launch(["vllm"], "m", [], port=1, served_name="n", socket_path="/r/e0.sock"))
    assert on_socket == ["vllm", "serve", "m", "--host", "127.0.0.1", "--uds", "/r/e0.sock", "--served-model-name", "n"]


def test_the_measured_memory_share_goes_with_the_app_owned_flags_after_the_assignments_args():
    argv = vllm.command(Launch(["vllm"], "m", ["--max-model-len", "8192"], port=1, served_name="n",
                        tensor_parallel=2, socket_path="/r/e0.sock", memory_utilization=0.771))
    assert argv == ["vllm", "serve", "m", "--max-model-len", "8192", "--tensor-parallel-size", "2",
                    "--gpu-memory-utilization", "0.771", "--host", "127.0.0.1", "--uds", "/r/e0.sock",
                    "--served-model-name", "n"]
    assert vllm.command(Launch(["vllm"], "m", [], port=1, served_name="n", memory_utilization=0.7))[3:5] == [
        "--gpu-memory-utilization", "0.7"]


def test_environment_is_deliberate():
    env = vllm.environment(
        {"PATH": "/usr/bin", "GPU_PROVIDER_TOKEN": "secret", "VLLM_API_KEY": "x", "VLLM_LOGGING_CONFIG_PATH": "/x"},
        [0, 1],
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
    assert env["VLLM_LOGGING_COLOR"] == "0" and env["NO_COLOR"] == "1"
    assert env["PATH"] == "/usr/bin"
    assert not {"GPU_PROVIDER_TOKEN", "VLLM_API_KEY", "VLLM_LOGGING_CONFIG_PATH"} & set(env)
    keyed = vllm.environment({"VLLM_API_KEY": "inherited"}, [0], api_key="k-123", config_home="/data/run/engines")
    assert keyed["VLLM_API_KEY"] == "k-123" and keyed["XDG_CONFIG_HOME"] == "/data/run/engines"


def test_endpoints_and_auth():
    assert vllm.ENDPOINTS["health"].path == "/health" and not vllm.ENDPOINTS["health"].needs_api_key
    assert vllm.ENDPOINTS["models"].needs_api_key
    assert not vllm.ENDPOINTS["metrics"].needs_api_key


def test_get_adapter():
    assert get_adapter("vllm") is vllm
    with pytest.raises(ValueError, match="known engines: vllm, sglang, llamacpp"):
        get_adapter("tgi")
