"""The WSL command line and environment: no shell, secrets only through `WSLENV`."""

from __future__ import annotations

import pytest

from worker.system import wsl


def test_the_program_runs_with_exec_never_through_the_shell() -> None:
    argv = wsl.command(["bin/vllm", "serve", "$(touch /tmp/x)", '{"a": 1}'], distro="Ubuntu-24.04")
    assert argv[:6] == ["wsl.exe", "-d", "Ubuntu-24.04", "--cd", "~", "-e"]
    assert argv[6:] == ["bin/vllm", "serve", "$(touch /tmp/x)", '{"a": 1}']
    assert "--" not in argv


def test_the_default_distribution_is_named_by_leaving_it_out() -> None:
    assert wsl.command(["true"], distro=None) == ["wsl.exe", "--cd", "~", "-e", "true"]
    with pytest.raises(ValueError):
        wsl.command([], distro=None)


def test_variables_cross_only_by_name_in_wslenv() -> None:
    env = wsl.with_wslenv({"PATH": "C:\\Windows", "WSLENV": "USERPROFILE/p:VLLM_API_KEY/p"},
                          {"VLLM_API_KEY": "k-123", "CUDA_VISIBLE_DEVICES": "1"})
    assert env["VLLM_API_KEY"] == "k-123" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["WSLENV"].split(":") == ["USERPROFILE/p", "VLLM_API_KEY/u", "CUDA_VISIBLE_DEVICES/u"]
    assert env["PATH"] == "C:\\Windows"


def test_a_name_that_is_no_variable_is_refused() -> None:
    with pytest.raises(ValueError):
        wsl.with_wslenv({}, {"A:B": "x"})
