from __future__ import annotations

from pathlib import Path

import pytest

from worker.engines import get_adapter, llamacpp
from worker.engines.base import (
    ContextSize,
    EngineVersion,
    KvCacheSize,
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
        KvCacheSize(tokens=2048, mib=2.0),
        Slots(n_slots=4, n_ctx_slot=512, kv_unified=True),
        PhaseReached("warming"),
        Listening("http://127.0.0.1:18788"),
    ]


@pytest.mark.parametrize(
    ("line", "fact"),
    [
        ("llama_kv_cache: size =  354.75 MiB (  8448 cells,  43 layers,  1/1 seqs), K (f16):  354.75 MiB, V (f16):    0.00 MiB", KvCacheSize(8448, 354.75)),
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


def test_command():
    argv = llamacpp.command(
        ["/opt/llama/llama-server"], "/models/q.gguf", ["--ctx-size", "32768"],
        port=18101, api_key="k-9", served_name="qwen", tensor_parallel=2,
    )
    assert argv == [
        "/opt/llama/llama-server", "-m", "/models/q.gguf", "--ctx-size", "32768", "--host", "127.0.0.1",
        "--port", "18101", "--alias", "qwen", "--metrics",
    ]  # the key is never on the command line: any local user can read it there


def test_command_on_a_unix_socket():
    argv = llamacpp.command(["llama-server"], "/m.gguf", [], port=18101, api_key="k-9", served_name="qwen",
                            socket_path="/run/engines/e0.sock")
    assert argv == ["llama-server", "-m", "/m.gguf", "--host", "/run/engines/e0.sock", "--alias", "qwen", "--metrics"]


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


def test_mask_argv():
    assert llamacpp.mask_argv(["llama-server", "--api-key", "k", "--alias", "n"]) == [
        "llama-server", "--api-key", "***", "--alias", "n"
    ]


def test_endpoints_that_need_the_key():
    needs = {name for name, endpoint in llamacpp.ENDPOINTS.items() if endpoint.needs_api_key}
    assert needs == {"metrics", "props", "slots"}
    assert get_adapter("llamacpp") is llamacpp
