"""The WSL command line and environment: no shell, secrets only through `WSLENV`."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from worker.system import children, wsl


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


# --- the listing ----------------------------------------------------------------------------------

LISTING = (
    "  NAME                   STATE           VERSION\r\n"
    "  docker-desktop         Running         2\r\n"
    "  Legacy                 Stopped         1\r\n"
    "* Debian                 Running         2\r\n"
    "  Ubuntu-24.04           Stopped         2\r\n"
    "  docker-desktop-data    Stopped         2\r\n"
)


class _Listing:
    """`children.run_bytes` answering as wsl.exe would; records how it was asked."""

    def __init__(self, stdout: bytes, returncode: int = 0) -> None:
        self.stdout, self.returncode = stdout, returncode
        self.calls: list[tuple[list[str], float, dict[str, str]]] = []

    def __call__(self, argv, *, timeout_s, env=None):
        self.calls.append((list(argv), timeout_s, dict(env or {})))
        return subprocess.CompletedProcess(argv, self.returncode, self.stdout, b"")


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-8"])
def test_the_listing_keeps_version_2_and_no_docker_distribution_default_first(monkeypatch, encoding) -> None:
    listing = _Listing(("\ufeff" if encoding == "utf-16-le" else "").encode(encoding) + LISTING.encode(encoding))
    monkeypatch.setattr(children, "run_bytes", listing)
    found = wsl.list_distros(base={"PATH": "C:\\Windows"})
    assert [(d.name, d.state, d.default) for d in found] == [("Debian", "Running", True),
                                                             ("Ubuntu-24.04", "Stopped", False)]
    (argv, timeout_s, env), = listing.calls
    assert argv == ["wsl.exe", "-l", "-v"] and env["WSL_UTF8"] == "1" and timeout_s >= 30


def test_utf16_without_a_bom_is_still_read() -> None:
    assert wsl.decode("* Ubuntu  Stopped  2\n".encode("utf-16-le")) == "* Ubuntu  Stopped  2\n"


@pytest.mark.parametrize(("stdout", "returncode"), [
    ("Windows Subsystem for Linux has no installed distributions.\r\n".encode("utf-16-le"), 4294967295),
    (b"", 1),
    (LISTING.encode() + b" " * wsl.MAX_OUTPUT_BYTES, 0),  # more than a listing is no answer
])
def test_no_distribution_no_wsl_or_too_much_output_is_none(monkeypatch, stdout, returncode) -> None:
    monkeypatch.setattr(children, "run_bytes", _Listing(stdout, returncode))
    assert wsl.list_distros(base={}) == ()


@pytest.mark.parametrize("error", [OSError(2, "not found"), subprocess.TimeoutExpired(["wsl.exe"], 30)])
def test_a_missing_or_hanging_wsl_is_no_distribution(monkeypatch, error) -> None:
    def fails(argv, *, timeout_s, env=None):
        raise error

    monkeypatch.setattr(children, "run_bytes", fails)
    assert wsl.list_distros(base={}) == ()


@pytest.mark.parametrize("row", ["* -rf  Running  2", "  Ubuntu;calc  Stopped  2", "  $(x)  Running  2"])
def test_a_name_that_is_no_distribution_name_is_skipped(row) -> None:
    assert wsl.parse_listing(row) == ()


def test_a_localised_state_of_several_words_is_kept() -> None:
    assert wsl.parse_listing("* Ubuntu    Wird ausgeführt    2") == (wsl.Distro("Ubuntu", "Wird ausgeführt", 2, True),)


# --- paths inside ---------------------------------------------------------------------------------


class _Inside:
    """`children.run` answering for wsl.exe -e PROGRAM: stdout per program."""

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv, *, timeout_s, env=None, cwd=None):
        self.calls.append(list(argv))
        program = argv[argv.index("-e") + 1]
        rc, out = self.answers[program]
        return subprocess.CompletedProcess(argv, rc, out, "" if rc == 0 else "boom")


def test_the_host_folder_of_a_linux_folder_is_made_then_asked_of_wslpath(monkeypatch, tmp_path) -> None:
    inside = _Inside({"printenv": (0, "/home/lender\n"), "mkdir": (0, ""), "wslpath": (0, f"{tmp_path}\n")})
    monkeypatch.setattr(children, "run", inside)
    home = wsl.home("Ubuntu")
    assert home == PurePosixPath("/home/lender")
    assert wsl.host_folder(home / ".cache/gpu-provider/models", distro="Ubuntu") == tmp_path
    assert [c[c.index("-e") + 1:] for c in inside.calls] == [
        ["printenv", "HOME"], ["mkdir", "-p", "--", "/home/lender/.cache/gpu-provider/models"],
        ["wslpath", "-w", "/home/lender/.cache/gpu-provider/models"]]
    assert all(c[:5] == ["wsl.exe", "-d", "Ubuntu", "--cd", "~"] and "--" not in c[:c.index("-e")]
               for c in inside.calls)


def test_a_failing_command_inside_is_an_error(monkeypatch) -> None:
    monkeypatch.setattr(children, "run", _Inside({"printenv": (1, "")}))
    with pytest.raises(wsl.WslError):
        wsl.home(None)
    with pytest.raises(ValueError):
        wsl.host_folder(PurePosixPath("relative/x"), distro=None)


# --- the lint: one place builds a WSL command line ---------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
_WSL_WORDS = {"wsl.exe", "--cd"}  # what a command line into WSL2 cannot be built without


def _wsl_words_in(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in _WSL_WORDS]


def test_every_wsl_command_line_is_built_by_wsl_command() -> None:
    """So none takes the `--` form (the distribution's shell re-parses that one): `command` is
    the one builder, and it has no `--`."""
    sources = sorted((ROOT / "worker").rglob("*.py")) + sorted((ROOT / "app").rglob("*.py"))
    builder = ROOT / "worker" / "system" / "wsl.py"
    assert [word for path in sources if path != builder for word in _wsl_words_in(path)] == []
    assert _wsl_words_in(builder)  # the lint sees the words where they are


def test_wslenv_carries_names_only_never_a_value() -> None:
    env = wsl.with_wslenv({}, {"VLLM_API_KEY": "k-secret-123", "HF_TOKEN": "hf_abc"})
    assert all("/" in entry and entry.split("/")[0].isidentifier() for entry in env["WSLENV"].split(":"))
    assert "k-secret-123" not in env["WSLENV"] and "hf_abc" not in env["WSLENV"]


def test_the_listing_never_hands_wsl_the_provider_token(monkeypatch) -> None:
    listing = _Listing(b"* Ubuntu  Running  2\n")
    monkeypatch.setattr(children, "run_bytes", listing)
    assert [d.name for d in wsl.list_distros(base={"GPU_PROVIDER_TOKEN": "tok", "PATH": "/bin"})] == ["Ubuntu"]
    assert "GPU_PROVIDER_TOKEN" not in listing.calls[0][2] and listing.calls[0][2]["PATH"] == "/bin"
