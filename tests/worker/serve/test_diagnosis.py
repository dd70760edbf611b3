"""What a person reads when an engine or a download failed: the engines' real failure lines
(vLLM 0.33, llama.cpp) turned into a short title, a cause with advice in their terms, and the
lines themselves under Details."""

from __future__ import annotations

import errno
import socket
import time
from pathlib import Path

import httpx
import pytest

from worker.provision import fetch as download
from worker.serve.diagnosis import engine_problem, network_failure, offline_problem, provision_problem
from worker.contract.events import Problem
from worker.provision.errors import ProvisionError
from worker.serve.restart_policy import AttemptFacts, Ended

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
    assert "Close games or other programs using the GPU, then Retry." in problem.message
    assert problem.action == "retry" and problem.retry_at is None
    assert VLLM_OOM in problem.details and problem.title not in problem.details
    assert not any(flag in shown(problem) for flag in FLAGS)


@pytest.mark.parametrize("lines", [VLLM_TRACEBACK, LLAMA_OOM])
def test_an_out_of_memory_crash_is_told_by_its_lines_not_its_exit_status(lines: list[str]) -> None:
    problem = engine_problem("llamacpp", crashed(lines), gave_up=True)
    assert problem.title == "Not enough GPU memory for this model"
    assert "status" not in shown(problem) and "Traceback" not in shown(problem)
    assert problem.details[-len(lines):] == tuple(lines)


@pytest.mark.parametrize(("line", "title"), [
    ("couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 18100", "Another program took the engine's port"),
    ("OSError: [Errno 98] Address already in use", "Another program took the engine's port"),
    ("ValueError: Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your Tesla T4 GPU "
     "has compute capability 7.5. You can use float16 instead by explicitly setting the `dtype` flag in CLI, "
     "for example: --dtype=half.", "This GPU is too old for this model"),
    ("RuntimeError: UVA is not available", "This engine version does not run in WSL2"),
    ("segmentation fault", "The model stopped unexpectedly"),
])
def test_each_known_failure_line_has_its_own_title(line: str, title: str) -> None:
    problem = engine_problem("vllm", crashed(["starting", line]), gave_up=True)
    assert problem.title == title and "--dtype" not in shown(problem)


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


# --- provisioning ------------------------------------------------------------------------------


def raised_from(cause: BaseException, problem: Problem | None = None) -> ProvisionError:
    """A ProvisionError as provisioning raises it: `from` the cause, or `from None` while handling it."""
    problem = problem or Problem("Cannot reach the llama.cpp releases", "Reading https://x failed.", "check_network")
    try:
        try:
            raise cause
        except BaseException:
            raise ProvisionError(problem) from None
    except ProvisionError as exc:
        return exc


@pytest.mark.parametrize("cause", [
    httpx.ConnectError("[Errno -3] Temporary failure in name resolution"),
    httpx.ReadTimeout("timed out"),
    socket.gaierror(-3, "Temporary failure in name resolution"),
    OSError(errno.ENETUNREACH, "Network is unreachable"),
    download.GaveUp(attempts=5, reason="ConnectError", kept_bytes=1024),
    download.Refused(status=503),
])
def test_offline_dns_timeouts_and_server_errors_are_the_networks(cause: BaseException) -> None:
    assert network_failure(raised_from(cause))


@pytest.mark.parametrize("cause", [
    download.Damaged(actual="ab", expected="cd"),
    download.NoSpace(folder=Path("/models"), need_bytes=10, free_bytes=1),
    download.Refused(status=404),
    OSError(errno.ENOSPC, "No space left on device"),
])
def test_a_damaged_file_a_full_disk_or_a_missing_file_are_not(cause: BaseException) -> None:
    assert not network_failure(raised_from(cause))


def test_a_pip_install_that_could_not_resolve_its_index_is_the_networks() -> None:
    problem = Problem("Could not install vLLM 0.33.0", "… exit 1. The last lines were:\nWARNING: Retrying after "
                      "connection broken by 'NewConnectionError(\"Failed to establish a new connection: [Errno -3] "
                      "Temporary failure in name resolution\")'", "check_network")
    assert network_failure(ProvisionError(problem))
    assert not network_failure(ProvisionError(Problem("Could not install vLLM 0.33.0", "exit 1: no matching "
                                                      "distribution", "check_network")))


def test_offline_says_when_it_tries_again_and_keeps_the_address_for_details() -> None:
    original = Problem("Cannot reach the llama.cpp releases",
                       "Reading https://api.github.com/repos/ggml-org/llama.cpp/releases/tags/b1 failed "
                       "([Errno -3] Temporary failure in name resolution). Check the network.", "check_network")
    at = time.time() + 15
    problem = offline_problem(original, at)
    assert problem.retry_at == at and "tries again by itself" in problem.message
    assert "https://" not in shown(problem) and "Errno" not in shown(problem)
    assert original.message in problem.details and problem.action == "retry"


def test_a_failure_retrying_cannot_cure_is_shown_as_it_is_with_retry() -> None:
    plain = Problem("Model source not usable", "not a model")
    assert provision_problem(plain) == Problem("Model source not usable", "not a model", "retry")
    disk = Problem("Not enough disk space", "free some", "free_disk")
    assert provision_problem(disk) is disk
