"""What a person reads when an engine failed: each engine's real failure lines (vLLM 0.33,
llama.cpp), told by its own adapter's hints, turned into a short title, a cause with advice in
their terms, and the lines themselves under Details."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import toy_engine
from worker.contract.events import Problem
from worker.engines import registry
from worker.serve.diagnosis import engine_problem
from worker.serve.restart_policy import AttemptFacts, Ended
from worker.serve.wsl_engine import LAUNCHER_PREFIX

VLLM_OOM = ("(EngineCore pid=4242) ERROR 11-29 11:50:12 [gpu_model_runner.py:5087] Failed to load model - not "
            "enough GPU memory. Try lowering --gpu-memory-utilization to free memory for weights, increasing "
            "--tensor-parallel-size, or using --quantization. See https://docs.vllm.ai/en/latest/configuration/"
            "conserving_memory/ for more tips. (original error: CUDA out of memory. Tried to allocate 2.00 GiB.)")
VLLM_TRACEBACK = [
    "(EngineCore pid=4242) ERROR 11-29 11:50:12 [core.py:1584] EngineCore failed to start.",
    "(EngineCore pid=4242) ERROR 11-29 11:50:12 [core.py:1584] Traceback (most recent call last):",
    "(EngineCore pid=4242) ERROR 11-29 11:50:12 [core.py:1584] torch.OutOfMemoryError: CUDA out of memory. Tried "
    "to allocate 20.00 MiB. GPU 0 has a total capacity of 23.99 GiB of which 11.31 MiB is free.",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
]
LLAMA_OOM = [
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 16384.00 MiB on device 0: cudaMalloc failed: out of memory",
    "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
    "srv    load_model: failed to load model, '/models/big.gguf'",
    "main: exiting due to model loading error",
]
FLAGS = ("--gpu-memory-utilization", "--tensor-parallel-size", "--max-model-len", "gpu_memory_utilization", "tier")


def crashed(lines: list[str], status: int = 1) -> Ended:
    return AttemptFacts().ending(status, lines, 3.0, False)


def shown(problem: Problem) -> str:
    return f"{problem.title}\n{problem.message}"


def test_vllm_running_out_of_memory_says_so_and_what_to_do_never_a_flag() -> None:
    problem = engine_problem("vllm", Ended("oom", VLLM_OOM, 3.0, False, ("loading", VLLM_OOM)), gave_up=True)
    assert problem.title == "Not enough GPU memory for this model"
    assert problem.message.endswith("Close games or other programs using the GPU if any are open, or lend the GPU "
                                    "more of its memory in Settings, then Retry.")  # advice for an empty card too
    assert problem.action == "retry" and problem.retry_at is None
    assert VLLM_OOM in problem.details and problem.title not in problem.details
    assert not any(flag in shown(problem) for flag in FLAGS)


@pytest.mark.parametrize("lines", [VLLM_TRACEBACK, LLAMA_OOM])
def test_an_out_of_memory_crash_is_told_by_its_lines_not_its_exit_status(lines: list[str]) -> None:
    problem = engine_problem("llamacpp", crashed(lines), gave_up=True)
    assert problem.title == "Not enough GPU memory for this model"
    assert "status" not in shown(problem) and "Traceback" not in shown(problem)
    assert problem.details[-len(lines):] == tuple(lines)


@pytest.mark.parametrize(("engine", "line", "title"), [
    ("llamacpp", "couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 18100",
     "Another program took the engine's port"),
    ("vllm", "OSError: [Errno 98] Address already in use", "Another program took the engine's port"),
    ("vllm", "ValueError: Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your Tesla T4 "
     "GPU has compute capability 7.5. You can use float16 instead by explicitly setting the `dtype` flag in CLI, "
     "for example: --dtype=half.", "This GPU is too old for this model"),
    ("vllm", "RuntimeError: UVA is not available", "WSL needs an update"),
    ("llamacpp", "ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for CUDA runtime "
     "version", "The graphics driver is too old"),
    ("llamacpp", "srv    load_model: failed to load model, '/models/m.gguf'", "The model could not be loaded"),
    ("vllm", "segmentation fault", "The model stopped unexpectedly"),
])
def test_each_known_failure_line_has_its_own_title(engine: str, line: str, title: str) -> None:
    problem = engine_problem(engine, crashed(["starting", line]), gave_up=True)
    assert problem.title == title and "--dtype" not in shown(problem)


def test_a_crash_gives_advice_any_computer_can_follow() -> None:
    """A crash with no line naming its cause says nothing of a graphics driver: a computer serving on
    its CPU has none (the driver is named only where the engine's own lines blame it)."""
    problem = engine_problem("llamacpp", crashed(["segmentation fault"]), gave_up=True)
    assert "driver" not in problem.message and problem.message.endswith("restart the computer, then Retry.")


def test_a_llama_cpp_crash_is_not_blamed_on_the_card_its_device_line_names() -> None:
    """llama-server names each card's compute capability at every start: that line is no sign of
    a card too old (vLLM's refusal says so in those words, llama.cpp's does not)."""
    lines = ["ggml_cuda_init: found 1 CUDA devices:",
             "  Device 0: NVIDIA GeForce RTX 4090, compute capability 8.9, VMM: yes",
             "Segmentation fault (core dumped)"]
    assert engine_problem("llamacpp", crashed(lines), gave_up=True).title == "The model stopped unexpectedly"


@pytest.fixture
def toy() -> Iterator[None]:
    registry.register(toy_engine)
    try:
        yield
    finally:
        registry.unregister(toy_engine.NAME)


def test_an_engines_own_failure_lines_are_read_through_its_adapter(toy: None) -> None:
    """A third engine's failure line is worded as the built-in ones are, with no change here; an
    engine this app does not have is told by its exit alone."""
    problem = engine_problem("toy", crashed(["toy: no room for 5 slots"]), gave_up=True)
    assert problem.title == "Not enough GPU memory for this model" and "Toy engine ran out" in problem.message
    assert engine_problem("gone", crashed(["toy: no room for 5 slots"]), gave_up=True).title == (
        "The model stopped unexpectedly")


def test_a_context_that_does_not_fit_speaks_of_memory_not_of_max_model_len() -> None:
    ended = Ended("context", "The engine refused max model len 32768: … Lower --max-model-len to 8192 or less, "
                             "or free GPU memory.", 1.0, False)
    problem = engine_problem("vllm", ended, gave_up=True)
    assert "GPU memory" in problem.title and not any(flag in shown(problem) for flag in FLAGS)
    assert "--max-model-len" in "\n".join(problem.details)


def test_while_restarting_it_says_the_app_tries_again_and_when() -> None:
    problem = engine_problem("vllm", crashed(VLLM_TRACEBACK), gave_up=False, retry_at=1234.0)
    assert problem.retry_at == 1234.0 and "trying again by itself" in problem.message
    assert "Retry." not in problem.message
    gave_up = engine_problem("vllm", crashed(VLLM_TRACEBACK), gave_up=True, retry_at=1234.0)
    assert gave_up.retry_at is None and gave_up.message.endswith("then Retry.")


def test_the_message_says_last_error_never_and_names_the_engine_for_people() -> None:
    problem = engine_problem("llamacpp", crashed(["boom"], status=3), gave_up=True)
    assert "Last error" not in problem.message and "llama.cpp" in problem.message
    assert problem.details == ("boom",)


def test_another_program_holding_the_memory_waits_by_itself() -> None:
    ended = Ended("free_memory", "ValueError: Free memory on device cuda:0 (2.1/23.99 GiB) on startup is less than "
                                 "desired GPU memory utilization (0.9, 21.59 GiB).", 0.5, False)
    problem = engine_problem("vllm", ended, gave_up=False, retry_at=99.0)
    assert problem.title == "Another program is using the GPU" and problem.retry_at == 99.0
    assert "GPU memory utilization" not in shown(problem)


def test_the_cpu_build_waiting_for_ram_speaks_of_the_computers_memory_not_a_gpu() -> None:
    """vLLM's CPU build refuses when its share of RAM is not free: nothing about a GPU applies."""
    ended = Ended("free_memory", "ValueError: Available memory on node 0 (6.9/8.71 GiB) on startup is less than "
                                 "desired CPU memory utilization (0.92, 8.02 GiB).", 0.5, False, in_ram=True)
    problem = engine_problem("vllm", ended, gave_up=False, retry_at=99.0)
    assert problem.title == "Other programs are using the computer's memory" and problem.retry_at == 99.0
    assert "GPU" not in shown(problem) and "memory (RAM)" in problem.message


def test_pinned_memory_missing_under_wsl2_tells_how_to_update_wsl() -> None:
    problem = engine_problem("vllm", crashed(["starting", "RuntimeError: UVA is not available"]), gave_up=True)
    assert "wsl --update" in problem.message and "restart the computer" in problem.message
    assert "UVA" not in shown(problem) and "pin" not in shown(problem).lower()


def _killed(free_mib: int, oom_kills: int) -> list[str]:
    return ["INFO loading weights", f"{LAUNCHER_PREFIX} engine ended by signal 9 (SIGKILL, not stopped by the app); "
            f"oom kills {oom_kills}; lowest free memory {free_mib} of 7800 MiB"]


@pytest.mark.parametrize(("free_mib", "oom_kills"), [(3000, 1), (200, 0)])
def test_an_engine_linux_killed_for_memory_inside_wsl2_says_how_to_give_wsl2_more(free_mib: int,
                                                                                   oom_kills: int) -> None:
    problem = engine_problem("vllm", crashed(_killed(free_mib, oom_kills), status=137), gave_up=True)
    assert problem.title == "WSL2 ran out of memory"
    assert "only half of this PC's memory" in problem.message
    assert "memory= under [wsl2] in %UserProfile%\\.wslconfig" in problem.message
    assert problem.message.endswith("then Retry.") and "signal" not in shown(problem)


def test_a_sigkill_with_memory_to_spare_is_no_memory_problem() -> None:
    problem = engine_problem("vllm", crashed(_killed(3000, 0), status=137), gave_up=True)
    assert problem.title == "The model stopped unexpectedly"
