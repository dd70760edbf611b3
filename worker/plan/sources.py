"""What an assignment's `source` string names, decided before anything touches the disk or net.

Pure, and a closed world: a source is a Hugging Face repo id (`org/name`), an `https://` URL of a
plainly named `.gguf` file (with the sha256 it must have), or an absolute local path. Anything
else — other schemes, backslashes in a URL, `..`, UNC or `\\\\?\\` paths, system folders — is
refused with a reason a person can act on. Whether a local path really holds a model is checked
on disk when the model is provisioned (`worker.provision.models`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath
from typing import Literal
from urllib.parse import SplitResult, unquote, urlsplit

from worker.engines import registry

_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_GGUF_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,250}\.gguf", re.IGNORECASE)
_HOST = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*")
_DRIVE_PATH = re.compile(r"[A-Za-z]:[\\/]")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SYSTEM_FOLDERS = frozenset({"dev", "proc", "sys"})  # a model never lives there; their files are not models
MAX_SOURCE_CHARS = 2048


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "https", "local"]
    value: str  # the repo id, the URL, or the normalised absolute path
    sha256: str | None = None  # lower-case hex; always set for an https source that passed `check_source`

    @property
    def file_name(self) -> str:
        """The app's own name for the model; for a download never taken from the URL's path.

        A download is saved as `<sha256>.gguf` (or, before its sha256 is known, named by a hash
        of the URL), so no server or coordinator chooses where a file lands.
        """
        if self.kind == "https":
            return f"{self.sha256}.gguf" if self.sha256 else f"url-{_text_hash(self.value)}.gguf"
        return self.label

    @property
    def label(self) -> str:
        """A short name to show a person: the URL's (checked, plain) file name, the repo's or path's last part."""
        if self.kind == "https":
            return unquote(urlsplit(self.value).path.rsplit("/", 1)[-1])
        return self.value.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


class BadSource(ValueError):
    """The source cannot be used; the message says why."""


def check_source(source: str, sha256: str | None, engine: str) -> ModelSource:
    """The source `engine` is to load, or `BadSource` saying why it is refused.

    On top of `parse_source`: an https URL must come with its sha256, and an engine that loads a
    model folder (`MODEL_FORMAT` "folder") takes a folder or a Hugging Face repo, not a single GGUF file.
    """
    if engine not in registry.names():
        raise BadSource(registry.refusal(engine))
    adapter = registry.get(engine)
    parsed = parse_source(source)
    digest = _digest(sha256)
    if parsed.kind == "https":
        if adapter.MODEL_FORMAT == "folder":
            raise BadSource(
                f"model source {_shown(source)} is a single GGUF file; {adapter.DISPLAY_NAME} needs a Hugging Face "
                "repo id (org/name) or a model folder"
            )
        if digest is None:
            raise BadSource(
                f"model source {_shown(source)} is a download without a sha256; the assignment must give the "
                "file's sha256 so the app can check what it downloads"
            )
    return ModelSource(parsed.kind, parsed.value, digest)


def parse_source(source: str) -> ModelSource:
    """The kind of source `source` is, by its form alone (no sha256 or engine rules; see `check_source`)."""
    if not source or source != source.strip() or _CONTROL.search(source):
        raise BadSource(
            f"model source {_shown(source)} is empty or has control characters or spaces around it"
        )
    if len(source) > MAX_SOURCE_CHARS:
        raise BadSource(f"model source {_shown(source)} is longer than {MAX_SOURCE_CHARS} characters")
    if "://" in source:
        return _url(source)
    if source.startswith(("\\\\", "//")):
        raise BadSource(
            f"model path {_shown(source)} is a network (UNC) or device path; give a path on this machine's "
            "own disk, such as C:\\models\\m.gguf or /home/me/models/m.gguf"
        )
    if _DRIVE_PATH.match(source):
        return _windows_path(source)
    if source.startswith("/"):
        return _posix_path(source)
    if _REPO_ID.match(source) and ".." not in source:
        return ModelSource("hf", source)
    raise BadSource(
        f"model source {_shown(source)} is neither a Hugging Face repo id (org/name), "
        "an https:// URL of a .gguf file, nor an absolute path"
    )


def under_system_folder(path: PurePosixPath) -> bool:
    """Whether an absolute POSIX path lies in /dev, /proc or /sys (devices and kernel files, never models)."""
    return len(path.parts) > 1 and path.parts[1] in _SYSTEM_FOLDERS


def _url(source: str) -> ModelSource:
    if not source.isascii() or "\\" in source:
        raise BadSource(
            f"model source {_shown(source)} has a backslash or characters outside ASCII; "
            "give the URL with those percent-encoded"
        )
    parts = urlsplit(source)
    if parts.scheme.lower() != "https":
        raise BadSource(
            f"model source {_shown(source)} uses {parts.scheme}://; only https:// downloads are allowed"
        )
    _check_host(source, parts)
    if parts.fragment or _CONTROL.search(unquote(parts.query)):
        raise BadSource(f"model source {_shown(source)} has a #fragment or control characters in its query")
    _check_path(source, parts.path)
    return ModelSource("https", source)


def _check_host(source: str, parts: SplitResult) -> None:
    if "@" in parts.netloc:
        raise BadSource(f"model source {_shown(source)} has credentials in it; give a URL without user@")
    try:
        port = parts.port
    except ValueError:
        port = -1
    host = parts.hostname or ""
    expected = host if port is None else f"{host}:{port}"
    if not _HOST.fullmatch(host) or port == -1 or parts.netloc.lower() != expected:
        raise BadSource(f"model source {_shown(source)} has no usable host name (letters, digits, '.', '-')")


def _check_path(source: str, path: str) -> None:
    """Every segment plain (nothing that decodes to `/`, `\\`, `%`, `.` or `..`); the last a `.gguf` name."""
    segments = path.split("/")[1:]
    for raw in segments:
        segment = unquote(raw)
        if segment in ("", ".", "..") or any(c in segment for c in "/\\%") or _CONTROL.search(segment):
            raise BadSource(
                f"model source {_shown(source)} has an empty, '.' or '..' path segment, or one that encodes "
                "a '/', a backslash or a '%'; give the file's plain URL"
            )
    if not segments or not _GGUF_NAME.fullmatch(unquote(segments[-1])):
        raise BadSource(
            f"model source {_shown(source)} does not end in a plain .gguf file name "
            "(letters, digits, '.', '_' and '-'); only GGUF files are downloaded by URL"
        )


def _windows_path(source: str) -> ModelSource:
    path = PureWindowsPath(source)
    if ".." in path.parts:
        raise BadSource(f"model path {_shown(source)} has '..' in it; give the path without it")
    if ":" in source[2:]:
        raise BadSource(f"model path {_shown(source)} has a ':' after the drive (a stream or device name)")
    return ModelSource("local", str(path))


def _posix_path(source: str) -> ModelSource:
    path = PurePosixPath(source)
    if ".." in path.parts or "\\" in source:
        raise BadSource(f"model path {_shown(source)} has '..' or a backslash in it; give the plain path")
    if under_system_folder(path):
        raise BadSource(f"model path {_shown(source)} is in /dev, /proc or /sys, where no model lives")
    return ModelSource("local", str(path))


def _digest(sha256: str | None) -> str | None:
    if not sha256:
        return None
    value = sha256.lower()
    if not _SHA256.fullmatch(value):
        raise BadSource("the model's sha256 must be 64 hexadecimal digits")
    return value


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _shown(source: str) -> str:
    """The source as a message quotes it: repr (so control characters show), cut short if long."""
    return repr(source if len(source) <= 200 else source[:200] + "…")
