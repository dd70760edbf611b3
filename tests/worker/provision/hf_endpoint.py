"""The few Hugging Face Hub endpoints huggingface_hub's snapshot_download uses, on the test HTTPS server.

`GET /api/models/{repo}/revision/{rev}` (the commit), `GET /api/models/{repo}/tree/{commit}` (the
files and sizes), and `HEAD`/`GET /{repo}/resolve/{commit}/{file}` with the `X-Repo-Commit`,
`ETag` and `Content-Length` headers it reads.
"""

from __future__ import annotations

import hashlib
import json

from tests.support.https_server import HttpsServer


def serve_repo(
    server: HttpsServer, repo_id: str, files: dict[str, bytes], *, commit: str, revision: str = "main"
) -> None:
    info = {
        "id": repo_id,
        "modelId": repo_id,
        "sha": commit,
        "siblings": [{"rfilename": name} for name in files],
    }
    body = json.dumps(info).encode()
    server.add(f"api/models/{repo_id}/revision/{revision}", body, content_type="application/json")
    server.add(f"api/models/{repo_id}/revision/{commit}", body, content_type="application/json")
    tree = [
        {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
        for name, data in files.items()
    ]
    server.add(
        f"api/models/{repo_id}/tree/{commit}", json.dumps(tree).encode(), content_type="application/json"
    )
    for name, data in files.items():
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        server.add(f"{repo_id}/resolve/{commit}/{name}", data, headers=headers)
        server.add(f"{repo_id}/resolve/{revision}/{name}", data, headers=headers)
