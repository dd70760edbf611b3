"""Hostile model sources: every one refused by `check_source`, each with a reason a person can act on.

`check_source` is what `plan()` and provisioning both call, so a source refused here never reaches
the disk or the network. The well-formed sources at the end show the rules are a closed list, not
a refusal of everything.
"""

from __future__ import annotations

import pytest

from worker.plan.sources import BadSource, check_source

SHA = "ab" * 32


@pytest.mark.parametrize(
    ("source", "sha256", "engine", "reason"),
    [
        pytest.param(
            "https://h.example/m/..\\..\\..\\AppData\\Roaming\\Microsoft\\Windows\\Start Menu\\Programs\\Startup\\x.bat",
            SHA,
            "llamacpp",
            "backslash",
            id="backslash-url-into-startup",
        ),
        pytest.param(
            "https://h.example/m/..%5c..%5cStartup%5cx.gguf",
            SHA,
            "llamacpp",
            "backslash",
            id="encoded-backslash",
        ),
        pytest.param(
            "https://h.example/m/..%2f..%2fx.gguf", SHA, "llamacpp", "encodes a '/'", id="encoded-slash"
        ),
        pytest.param(
            "https://h.example/m/%252e%252e/x.gguf", SHA, "llamacpp", "'%'", id="double-encoded-dots"
        ),
        pytest.param(
            "https://h.example/a/../m.gguf", SHA, "llamacpp", "'..' path segment", id="dot-dot-segment"
        ),
        pytest.param(
            "https://h.example/m.gguf", None, "llamacpp", "without a sha256", id="url-without-sha256"
        ),
        pytest.param(
            "https://h.example/m.bat", SHA, "llamacpp", "plain .gguf file name", id="not-a-gguf-name"
        ),
        pytest.param("https://user:pw@h.example/m.gguf", SHA, "llamacpp", "credentials", id="credentials"),
        pytest.param("http://h.example/m.gguf", SHA, "llamacpp", "only https://", id="plain-http"),
        pytest.param("file:///etc/passwd", SHA, "llamacpp", "only https://", id="file-scheme"),
        pytest.param("https://[::1]/m.gguf", SHA, "llamacpp", "host name", id="ipv6-literal"),
        pytest.param(
            "https://h.example/m.gguf?x=%0a", SHA, "llamacpp", "control characters", id="encoded-newline"
        ),
        pytest.param("https://h.example/m.gguf", SHA, "vllm", "vLLM needs", id="gguf-url-for-vllm"),
        pytest.param("\\\\host\\share\\m.gguf", None, "llamacpp", "network (UNC)", id="unc"),
        pytest.param("//host/share/m.gguf", None, "llamacpp", "network (UNC)", id="unc-forward-slashes"),
        pytest.param("\\\\?\\C:\\m.gguf", None, "llamacpp", "device path", id="win32-file-namespace"),
        pytest.param("\\\\.\\PhysicalDrive0", None, "llamacpp", "device path", id="win32-device-namespace"),
        pytest.param(
            "C:\\models\\m.gguf:hidden", None, "llamacpp", "':' after the drive", id="alternate-stream"
        ),
        pytest.param("C:\\models\\..\\..\\Windows\\m.gguf", None, "llamacpp", "'..'", id="windows-dot-dot"),
        pytest.param("/dev/zero", None, "llamacpp", "/dev, /proc or /sys", id="dev-zero"),
        pytest.param("/proc/self/environ", None, "llamacpp", "/dev, /proc or /sys", id="proc-environ"),
        pytest.param("/models/../etc/passwd", None, "llamacpp", "'..'", id="posix-dot-dot"),
        pytest.param("org/../name", None, "vllm", "neither a Hugging Face repo id", id="repo-id-dot-dot"),
        pytest.param("org\\name", None, "vllm", "neither a Hugging Face repo id", id="repo-id-backslash"),
        pytest.param("org/name", SHA + "0", "vllm", "64 hexadecimal digits", id="bad-sha256"),
    ],
)
def test_hostile_source_is_refused_with_its_reason(
    source: str, sha256: str | None, engine: str, reason: str
) -> None:
    with pytest.raises(BadSource) as refused:
        check_source(source, sha256, engine)

    assert reason in str(refused.value)


@pytest.mark.parametrize(
    ("source", "sha256", "engine", "kind"),
    [
        ("org/Model-7B", None, "vllm", "hf"),
        ("org/Model-7B-GGUF", None, "llamacpp", "hf"),
        (
            "https://huggingface.co/org/repo/resolve/main/model-Q4_K_M.gguf?download=true",
            SHA,
            "llamacpp",
            "https",
        ),
        ("/home/me/models/m.gguf", None, "llamacpp", "local"),
        ("C:\\Users\\me\\models\\m.gguf", None, "llamacpp", "local"),
    ],
)
def test_well_formed_sources_are_accepted(source: str, sha256: str | None, engine: str, kind: str) -> None:
    checked = check_source(source, sha256, engine)

    assert checked.kind == kind
    if kind == "https":
        assert checked.file_name == f"{SHA}.gguf" and checked.label == "model-Q4_K_M.gguf"
