"""The app's SGLang launcher refuses, before SGLang is imported, a key on the command line or no key."""

from __future__ import annotations

import os
import subprocess
import sys

from worker.engines.sglang import launcher


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(launcher.__file__), *argv], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_key_on_the_command_line_is_refused() -> None:
    env = {**os.environ, launcher.KEY_VARIABLE: "k"}
    for argv in (["--model-path", "m", "--api-key", "x"], ["--model-path", "m", "--api-key=x"]):
        done = run(argv, env)
        assert done.returncode == 2 and launcher.KEY_ON_COMMAND_LINE in done.stderr


def test_no_key_in_the_environment_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k != launcher.KEY_VARIABLE}
    done = run(["--model-path", "m"], env)
    assert done.returncode == 2 and launcher.NO_KEY in done.stderr


def test_the_launcher_imports_nothing_of_the_app() -> None:
    """It runs with SGLang venv's Python, which has no copy of the app."""
    text = open(launcher.__file__, encoding="utf-8").read()
    assert "import worker" not in text and "from worker" not in text
