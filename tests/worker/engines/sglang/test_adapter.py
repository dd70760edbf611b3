"""The SGLang adapter: its command line (app-owned flags last, no key, TCP only), environment,
memory share, install finding and releases."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.engines import registry, sglang
from worker.engines.base import Launch
from worker.engines.sglang.launcher import KEY_VARIABLE
from worker.engines.sglang.planning import ACTIVATION_HEADROOM, serves_group, static_fraction
from worker.hardware.model import GpuGroup

LAUNCH = Launch(("/venv/bin/python3",), "/models/Qwen3-8B", ("--context-length", "8192", "--tp-size", "4"), "qwen3-8b",
                18100, tensor_parallel=2, memory_utilization=0.9)


def test_the_launcher_runs_with_the_app_owned_flags_after_the_assignments() -> None:
    argv = sglang.command(LAUNCH)
    assert argv[:4] == ["/venv/bin/python3", str(sglang.LAUNCHER), "--model-path", "/models/Qwen3-8B"]
    assert Path(argv[1]).is_file() and argv[1].endswith("worker/engines/sglang/launcher.py")
    owned = argv[4 + len(LAUNCH.args):]  # the assignment's own --tp-size 4 comes before, and loses
    assert owned == ["--tp-size", "2", "--dp-size", "1", "--mem-fraction-static", "0.75", "--host", "127.0.0.1",
                     "--port", "18100", "--served-model-name", "qwen3-8b", "--enable-metrics"]
    assert not any(arg.startswith("--api-key") for arg in argv)


def test_no_share_no_memory_flag() -> None:
    argv = sglang.command(Launch(("python3",), "m", (), "m", 1))
    assert "--mem-fraction-static" not in argv


def test_a_unix_socket_is_refused_as_sglang_has_no_such_listener() -> None:
    with pytest.raises(ValueError, match="TCP port only"):
        sglang.command(Launch(("python3",), "m", (), "m", 1, socket_path="/run/e0.sock"))


@pytest.mark.parametrize(("share", "fraction"), [(0.9, 0.75), (0.771, 0.621), (0.5, 0.35), (0.16, 0.05), (0.1, 0.05)])
def test_the_static_share_is_the_usable_share_less_the_headroom(share: float, fraction: float) -> None:
    assert static_fraction(share) == fraction
    assert ACTIVATION_HEADROOM == 0.15


def test_the_key_travels_in_the_launchers_variable_and_nothing_inherited_sets_sglang() -> None:
    base = {"PATH": "/usr/bin", KEY_VARIABLE: "planted", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1",
            "SGLANG_ENABLE_JIT_DEEPGEMM": "1", "GPU_PROVIDER_TOKEN": "t", "CUDA_VISIBLE_DEVICES": "0,1,2"}
    env = sglang.environment(base, [1], api_key="run-key", config_home="/home/u/.gpu-provider/config")
    assert env[KEY_VARIABLE] == "run-key" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert not any(k.startswith("SGLANG_") for k in env) and "GPU_PROVIDER_TOKEN" not in env
    assert env["XDG_CONFIG_HOME"] == "/home/u/.gpu-provider/config" and env["PATH"] == "/usr/bin"
    assert KEY_VARIABLE not in sglang.environment(base, [0])


@pytest.mark.parametrize(("capability", "served"), [("8.0", True), ("9.0", True), ("12.0", True), ("7.5", False),
                                                    (None, False)])
def test_sglang_needs_compute_capability_8(capability: str | None, served: bool) -> None:
    assert serves_group(GpuGroup((0,), "card", 20000, compute_capability=capability)) is served


def test_registered_between_vllm_and_llamacpp_for_gpus_only() -> None:
    assert registry.names().index("sglang") == registry.names().index("vllm") + 1
    assert [a.NAME for a in registry.for_runtime("native")] == ["vllm", "sglang"]
    assert "sglang" not in [a.NAME for a in registry.for_runtime("cpu")]


def test_found_in_a_venv_by_its_package_record(tmp_path: Path) -> None:
    site = tmp_path / "lib" / "python3.12" / "site-packages"
    (site / "sglang-0.5.23.dist-info").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text("")
    found = sglang.find_installed("Linux", str(tmp_path), lambda argv, timeout, env: None)
    assert (found.version, found.path) == ("0.5.23", str(tmp_path / "bin" / "python3"))
    assert sglang.find_installed("Linux", str(tmp_path / "bin" / "python3"), lambda *a: None).version == "0.5.23"


def test_not_found_without_a_venv(tmp_path: Path) -> None:
    asked: list[list[str]] = []

    def run(argv: list[str], timeout: float, env: object) -> str | None:
        asked.append(argv)
        return "0.5.23\n"

    assert sglang.find_installed("Linux", None, run).version is None and asked == []
    assert sglang.find_installed("Linux", str(tmp_path), run).version is None


def test_the_shipped_release_and_its_spellings() -> None:
    assert sglang.RELEASES.versions(None) == ("0.5.23",) == sglang.RELEASES.versions("wsl2")
    assert sglang.RELEASES.versions("cpu") == () and sglang.RELEASES.normalise("v0.5.23") == "0.5.23"
    assert sglang.RELEASES.runtime_problem("0.5.23", "native") is None
    assert "NVIDIA" in (sglang.RELEASES.runtime_problem("0.5.23", "apple-silicon") or "")


def test_the_allowlist_refuses_what_the_app_owns_and_paths() -> None:
    allowed = {spelling for flag in sglang.ALLOWED_ARGS.flags for spelling in flag.all_spellings()}
    assert {"--context-length", "--max-running-requests", "--speculative-algorithm"} <= allowed
    assert allowed.isdisjoint({"--api-key", "--mem-fraction-static", "--tp-size", "--dp-size", "--host", "--port",
                               "--speculative-draft-model-path", "--model-path", "--enable-metrics"})


def test_it_has_every_constant_and_function_the_adapter_protocol_names() -> None:
    from worker.engines.base import EngineAdapter

    names = [name for name in EngineAdapter.__annotations__] + [
        name for name in vars(EngineAdapter) if not name.startswith("_") and callable(getattr(EngineAdapter, name))]
    assert [name for name in names if not hasattr(sglang, name)] == []
    assert sglang.FALLBACK_RUNTIMES <= sglang.RUNTIMES and sglang.PRIVATE_ENV_PREFIXES == ("SGLANG_",)
