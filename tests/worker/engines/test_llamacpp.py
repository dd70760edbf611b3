from __future__ import annotations

from pathlib import Path

import pytest

from worker.engines import get_adapter, llamacpp
from worker.engines.base import (
    Launch,
    ContextSize,
    EngineVersion,
    KvCachePart,
    Listening,
    OutOfMemory,
    PhaseReached,
    Slots,
    StartFailed,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"


def test_startup_log():
    lines = (FIXTURES / "startup.log").read_text(encoding="utf-8").splitlines()
    assert [f for f in map(llamacpp.parse_line, lines) if f is not None] == [
        EngineVersion("b0"),
        PhaseReached("loading"),
        ContextSize(2048),
        KvCachePart(mib=2.0, cells=2048),
        Slots(n_slots=4, n_ctx_slot=512, kv_unified=True),
        PhaseReached("warming"),
        Listening("http://127.0.0.1:18788"),
    ]


@pytest.mark.parametrize(
    ("line", "fact"),
    [
        ("llama_kv_cache: size =  354.75 MiB (  8448 cells,  43 layers,  1/1 seqs), K (f16):  354.75 MiB, V (f16):    0.00 MiB", KvCachePart(354.75, 8448)),
        ("main: server is listening on http://127.0.0.1:8080 - starting the main loop", Listening("http://127.0.0.1:8080")),
        ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9120.00 MiB on device 0: cudaMalloc failed: out of memory", OutOfMemory("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9120.00 MiB on device 0: cudaMalloc failed: out of memory")),
        ("E srv    load_model: exiting due to model loading error", StartFailed("srv    load_model: exiting due to model loading error")),
        ("srv  llama_server: start the HTTP server before loading the model to be able to serve /health requests", None),
        ("srv    load_model: initializing, n_slots = 4, n_ctx_slot = 1024, kv_unified = 'false'", Slots(4, 1024, False)),
        ("srv    load_model: initializing, n_slots = 2, n_ctx_slot = 4096", Slots(2, 4096, None)),
    ],
)
def test_single_lines(line, fact):
    assert llamacpp.parse_line(line) == fact


@pytest.mark.parametrize(
    ("line", "fact"),
    [
        # up to b5400: memory only, no cells on the line
        ("llama_kv_cache_unified: KV self size  =  448.00 MiB, K (f16):  224.00 MiB, V (f16):  224.00 MiB", KvCachePart(448.0, None)),
        # b5600: `%2u seqs`; later `%2u/%2u seqs`; now `%2u/%u seqs`
        ("llama_kv_cache_unified: size =  448.00 MiB (  4096 cells,  28 layers,  1 seqs), K (f16):  224.00 MiB, V (f16):  224.00 MiB", KvCachePart(448.0, 4096)),
        ("llama_kv_cache_unified: size =  896.00 MiB (  8192 cells,  28 layers,  1/ 1 seqs), K (f16):  448.00 MiB, V (f16):  448.00 MiB", KvCachePart(896.0, 8192)),
        ("0.03.104.560 I llama_kv_cache: size =    0.00 MiB (  4608 cells,   0 layers,  4/1 seqs), K (f16):    0.00 MiB, V (f16):    0.00 MiB", KvCachePart(0.0, 4608)),
        # recurrent state counts sequences, not tokens: never a KV cache, old form or new
        ("llama_memory_recurrent: size =  201.00 MiB (     4 cells,  36 layers,  4 seqs  0 rs_seq), R (f32):    9.00 MiB, S (f32):  192.00 MiB", None),
        ("I llama_memory_recurrent: size =   50.25 MiB (     1 cells,  32 layers,  1 seqs), R (f32):    2.25 MiB, S (f32):   48.00 MiB", None),
        # per-buffer lines repeat the same memory: counting them too would double it
        ("llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB", None),
        ("llama_kv_cache_unified:        CPU KV buffer size =   512.00 MiB", None),
        ("llama_memory_recurrent:      CUDA0 RS buffer size =   201.00 MiB", None),
        ("llama_kv_cache_iswa: creating non-SWA KV cache, size = 8192 cells", None),
    ],
)
def test_kv_cache_lines_are_told_apart_by_their_function(line, fact):
    assert llamacpp.parse_line(line) == fact


@pytest.mark.parametrize(("fixture", "parts"), [
    ("startup-iswa.log", [KvCachePart(512.0, 8192), KvCachePart(0.0, 4608)]),
    ("startup-hybrid.log", [KvCachePart(2048.0, 131072)]),
])
def test_every_kv_cache_of_a_start_is_reported(fixture, parts):
    lines = (FIXTURES / fixture).read_text(encoding="utf-8").splitlines()
    assert [f for f in map(llamacpp.parse_line, lines) if isinstance(f, KvCachePart)] == parts


def test_command():
    argv = llamacpp.command(Launch(
        ["/opt/llama/llama-server"], "/models/q.gguf", ["--ctx-size", "32768"],
        port=18101, served_name="qwen", tensor_parallel=2,
    ))
    assert argv == [
        "/opt/llama/llama-server", "-m", "/models/q.gguf", "--ctx-size", "32768", "--fit", "off",
        "--host", "127.0.0.1", "--port", "18101", "--alias", "qwen", "--metrics",
    ]  # --fit off: a context that does not fit fails (and falls back a tier); no key: it travels in the environment


def test_command_on_a_unix_socket():
    argv = llamacpp.command(Launch(["llama-server"], "/m.gguf", [], port=18101, served_name="qwen",
                            socket_path="/run/engines/e0.sock"))
    assert argv == ["llama-server", "-m", "/m.gguf", "--fit", "off", "--host", "/run/engines/e0.sock",
                    "--alias", "qwen", "--metrics"]


def test_a_memory_share_changes_nothing_for_llama_cpp():
    plain = llamacpp.command(Launch(["llama-server"], "/m.gguf", ["-c", "4096"], port=1, served_name="q"))
    told = llamacpp.command(Launch(["llama-server"], "/m.gguf", ["-c", "4096"], port=1, served_name="q",
                            memory_utilization=0.8))
    assert told == plain and "--gpu-memory-utilization" not in told


def test_environment_scrubs_llama_settings_and_the_token():
    env = llamacpp.environment(
        {"HOME": "/h", "LLAMA_ARG_HOST": "0.0.0.0", "LLAMA_API_KEY": "x", "GPU_PROVIDER_TOKEN": "t",
         "AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9"}, []
    )
    assert env == {"HOME": "/h", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ""}


def test_environment_carries_the_key_and_points_config_lookup_at_the_apps_folder():
    env = llamacpp.environment({"HOME": "/h", "XDG_CONFIG_HOME": "/h/.config"}, [0], api_key="k-9",
                               config_home="/data/run/engines")
    assert env["LLAMA_API_KEY"] == "k-9" and env["XDG_CONFIG_HOME"] == "/data/run/engines" and "APPDATA" not in env
    windows = llamacpp.environment({"APPDATA": r"C:\Users\u\AppData\Roaming"}, [0], config_home=r"C:\gp\run\engines")
    assert windows["APPDATA"] == r"C:\gp\run\engines"


def test_endpoints_that_need_the_key():
    needs = {name for name, endpoint in llamacpp.ENDPOINTS.items() if endpoint.needs_api_key}
    assert needs == {"metrics", "props", "slots"}
    assert get_adapter("llamacpp") is llamacpp
