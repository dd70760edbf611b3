"""What an assignment's `source` string names, decided before anything touches the disk or net.

Pure. A source is a Hugging Face repo id, an `https://` URL, or an absolute local path; anything
else (other schemes, `..` segments, relative paths) is refused with a reason a person understands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath, PureWindowsPath
from typing import Literal
from urllib.parse import urlsplit

_REPO_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "https", "local"]
    value: str  # the repo id, the URL, or the normalised absolute path

    @property
    def file_name(self) -> str:
        """A name for the cached file or folder (URL's last segment, repo's name)."""
        if self.kind == "https":
            return PurePosixPath(urlsplit(self.value).path).name or "model.gguf"
        return self.value.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


class BadSource(ValueError):
    """The source cannot be used; the message says why."""


def parse_source(source: str) -> ModelSource:
    if not source or source != source.strip() or _CONTROL.search(source):
        raise BadSource(f"model source {source!r} is empty or has control characters or spaces around it")
    if "://" in source:
        return _url(source)
    if _is_absolute(source):
        return _local(source)
    if _REPO_ID.match(source) and ".." not in source:
        return ModelSource("hf", source)
    raise BadSource(
        f"model source {source!r} is neither a Hugging Face repo id (org/name), "
        "an https:// URL, nor an absolute path"
    )


def _url(source: str) -> ModelSource:
    parts = urlsplit(source)
    if parts.scheme.lower() != "https":
        raise BadSource(f"model source {source!r} uses {parts.scheme}://; only https:// downloads are allowed")
    if not parts.hostname:
        raise BadSource(f"model source {source!r} has no host")
    if ".." in parts.path.split("/") or parts.username or parts.password:
        raise BadSource(f"model source {source!r} has '..' or credentials in it")
    return ModelSource("https", source)


def _is_absolute(source: str) -> bool:
    return PurePosixPath(source).is_absolute() or PureWindowsPath(source).is_absolute()


def _local(source: str) -> ModelSource:
    path = PureWindowsPath(source) if PureWindowsPath(source).drive else PurePosixPath(source)
    if ".." in path.parts:
        raise BadSource(f"model path {source!r} has '..' in it; give the path without it")
    return ModelSource("local", str(path))
