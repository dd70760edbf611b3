"""The two file attacks of issue 12, against a real node serving a real llama-server on CPU.

Before the allowlist, `--log-file ~/.ssh/authorized_keys -v` with an inline chat template that
printed a public key truncated the file to the engine's log (one line of it the attacker's key),
and `--chat-template-file ~/.ssh/id_ed25519 -v` followed by one ordinary completion returned the
private key in `__verbose.prompt`. Here both arrive as a replacement for a serving assignment and
as the first assignment of an idle node: the target file keeps its bytes and its mtime, and no
relayed answer holds the secret.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_node import STATE_TIMEOUT_S, running_node
from tests.support.engines import LlamaServer
from worker import protocol

pytestmark = pytest.mark.integration

ATTACKER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAttackerAttackerAttackerAttacker attacker@evil"
SECRET = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA-SECRET-MARKER-7f3a\n-----END OPENSSH PRIVATE KEY-----\n"
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def assign(model: Path, assignment_id: str, extra: list[str]) -> protocol.Assign:
    spec = protocol.EngineModel(source=str(model), weights_mib=1,
                                base_args=["--ctx-size", "1024", "--threads", "1", *extra])
    return protocol.Assign(assignment_id=assignment_id, model=protocol.ModelSpec(name="tiny-llama", llamacpp=spec))


def attacks(home: Path) -> list[list[str]]:
    keys, private = home / ".ssh" / "authorized_keys", home / ".ssh" / "id_ed25519"
    return [
        ["--log-file", str(keys), "-v", "--chat-template", "{{ '" + ATTACKER_KEY + "' }}"],
        ["--chat-template-file", str(private), "-v"],
    ]


def plant(home: Path) -> dict[Path, tuple[bytes, int]]:
    ssh = home / ".ssh"
    ssh.mkdir(parents=True)
    (ssh / "authorized_keys").write_text("ssh-ed25519 AAAAC3Nza-owner owner@home\n", encoding="utf-8")
    (ssh / "id_ed25519").write_text(SECRET, encoding="utf-8")
    return {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in ssh.iterdir()}


def unchanged(before: dict[Path, tuple[bytes, int]]) -> bool:
    return all((p.read_bytes(), p.stat().st_mtime_ns) == seen for p, seen in before.items())


async def test_file_attacks_refused_while_serving_and_the_engine_answers_without_the_secret(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    before = plant(home)
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assign(tiny_gguf, "ok-1", [])) as run:
        ready = await run.status("ready", "failed")
        assert ready.state == "ready", ready.last_error
        [serving] = run.node.snapshot().engines
        for number, extra in enumerate(attacks(home), start=2):
            mark = run.mark()
            await run.coordinator.send(assign(tiny_gguf, f"evil-{number}", extra))
            status = await run.coordinator.wait_for(
                lambda m, n=number: isinstance(m, protocol.Status) and m.refused is not None
                and m.refused.assignment_id == f"evil-{n}", after=mark, timeout=STATE_TIMEOUT_S)
            assert status.refused is not None
            assert status.refused.reason.startswith(f"argument not allowed: {extra[0]}")
            assert status.state == "ready" and status.assignment_id == "ok-1"
            answer = await run.ask(CHAT)
            assert answer.error is None and answer.end is not None
            assert "SECRET-MARKER" not in answer.data and "__verbose" not in answer.data
        assert run.node.snapshot().engines[0].pid == serving.pid
        argv = " ".join(run.node.snapshot().engines[0].argv)
        assert "--log-file" not in argv and "--chat-template" not in argv
    assert unchanged(before)


@pytest.mark.parametrize("which", [0, 1])
async def test_file_attacks_refused_on_an_idle_node_and_nothing_starts(
    llama_server_bin: LlamaServer, tiny_gguf: Path, tmp_path: Path, which: int
) -> None:
    home = tmp_path / "home"
    before = plant(home)
    extra = attacks(home)[which]
    bins = {"llamacpp": str(llama_server_bin.executable)}
    async with running_node(tmp_path, bins, fixture="no-gpu.json", assign=assign(tiny_gguf, "evil-1", extra)) as run:
        failed = await run.status("failed", "ready")
        assert failed.state == "failed" and failed.engines == []
        assert failed.last_error is not None and failed.last_error.startswith(f"argument not allowed: {extra[0]}")
        assert failed.refused is not None and failed.refused.assignment_id == "evil-1"
        answer = await run.ask(CHAT)
        assert answer.error is not None and answer.error.code == "not_ready"
        assert run.engine_pids == set()
        assert "SECRET-MARKER" not in json.dumps([m.model_dump() for m in run.coordinator.received])
    assert unchanged(before)
