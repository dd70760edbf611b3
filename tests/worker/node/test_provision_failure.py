"""Whether a provisioning failure is the network's (tried again by itself) or one the person
fixes, and how each is shown."""

from __future__ import annotations

import errno
import socket
import time
from pathlib import Path

import httpx
import pytest

from worker.contract.events import Problem
from worker.node.provision_failure import network_failure, offline_problem, provision_problem
from worker.provision import fetch as download
from worker.provision.errors import ProvisionError


def shown(problem: Problem) -> str:
    return f"{problem.title}\n{problem.message}"



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
