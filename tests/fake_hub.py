"""A small in-memory Hugging Face Hub for tests: enough of the HTTP API for `HfApi.create_repo`, `upload_folder`
(regular, non-LFS uploads) and `from_pretrained("user/name")`. Standard library only; loopback only.

    hub = FakeHub().start()           # hub.endpoint -> "http://127.0.0.1:PORT"
    ... HF_ENDPOINT=hub.endpoint in a subprocess ...
    hub.files("fake-user/model")      # {path: bytes} of the main branch
    hub.stop()

It answers every preupload with `uploadMode: "regular"`, so commits carry base64 file contents in their NDJSON body
and no LFS or Xet server is needed. Authentication is not checked.
"""

import base64
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

USER = "fake-user"


class _Repo:
    def __init__(self, repo_id: str) -> None:
        self.repo_id = repo_id
        self.files: dict[str, bytes] = {}
        self.sha = hashlib.sha1(repo_id.encode()).hexdigest()  # the empty repo's commit
        self.commits: list[str] = []


class FakeHub:
    """The server and its repositories; `start()` serves on a free loopback port in a daemon thread."""

    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            state = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def files(self, repo_id: str) -> dict[str, bytes]:
        return dict(self.repos[repo_id].files)


class _Handler(BaseHTTPRequestHandler):
    state: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    # --- plumbing
    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload=None, headers: dict | None = None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(payload if payload is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if raw is not None else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _missing(self, code: str, message: str) -> None:
        self._send(404, {"error": message}, headers={"X-Error-Code": code, "X-Error-Message": message})

    def _repo(self, repo_id: str) -> _Repo | None:
        return self.state.repos.get(repo_id)

    def _info(self, repo: _Repo) -> dict:
        return {
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": repo.sha,
            "private": False,
            "tags": [],
            "siblings": [{"rfilename": name} for name in sorted(repo.files)],
            "xetEnabled": False,
        }

    # --- verbs
    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        path = unquote(urlparse(self.path).path)
        self.state.requests.append((method, path))
        body = self._body() if method == "POST" else b""
        with self.state.lock:
            if path == "/api/whoami-v2":
                return self._send(
                    200,
                    {
                        "type": "user",
                        "name": USER,
                        "orgs": [],
                        "auth": {"accessToken": {"displayName": "t", "role": "write"}},
                    },
                )
            if method == "POST" and path == "/api/repos/create":
                request = json.loads(body or b"{}")
                repo_id = (
                    f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
                )
                if "/" not in repo_id:
                    repo_id = f"{USER}/{repo_id}"
                self.state.repos.setdefault(repo_id, _Repo(repo_id))
                return self._send(200, {"url": f"{self.state.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})
            if method == "POST" and path == "/api/validate-yaml":
                return self._send(200, {"errors": [], "warnings": []})
            match = re.fullmatch(r"/api/models/(.+?)/preupload/([^/]+)", path)
            if method == "POST" and match:
                files = json.loads(body or b"{}").get("files", [])
                return self._send(
                    200,
                    {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
                )
            match = re.fullmatch(r"/api/models/(.+?)/commit/([^/]+)", path)
            if method == "POST" and match:
                return self._commit(match.group(1), body)
            match = re.fullmatch(r"/api/models/(.+?)/tree/([^/]+)(?:/(.*))?", path)
            if match:
                repo = self._repo(match.group(1))
                if repo is None:
                    return self._missing("RepoNotFound", "Repository not found")
                prefix = (match.group(3) or "").strip("/")
                entries = [
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in sorted(repo.files.items())
                    if not prefix or name.startswith(prefix + "/")
                ]
                if prefix and not entries:
                    return self._missing("EntryNotFound", f"{prefix} does not exist")
                return self._send(200, entries)
            match = re.fullmatch(r"/api/models/(.+?)(?:/revision/([^/]+))?", path)
            if match:
                repo = self._repo(match.group(1))
                if repo is None:
                    return self._missing("RepoNotFound", "Repository not found")
                return self._send(200, self._info(repo))
            match = re.fullmatch(r"/(.+?/.+?)/resolve/([^/]+)/(.+)", path)
            if match:
                return self._resolve(*match.groups())
        return self._missing("NotFound", f"no route for {method} {path}")

    def _commit(self, repo_id: str, body: bytes) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return self._missing("RepoNotFound", "Repository not found")
        for line in body.decode().splitlines():
            if not line.strip():
                continue
            entry = json.loads(line)
            value = entry.get("value", {})
            if entry.get("key") == "file":
                content = value["content"]
                repo.files[value["path"]] = (
                    base64.b64decode(content) if value.get("encoding") == "base64" else content.encode()
                )
            elif entry.get("key") == "deletedFile":
                repo.files.pop(value["path"], None)
        repo.sha = hashlib.sha1(f"{repo_id}{time.time()}{len(repo.commits)}".encode()).hexdigest()
        repo.commits.append(repo.sha)
        return self._send(
            200,
            {
                "commitUrl": f"{self.state.endpoint}/{repo_id}/commit/{repo.sha}",
                "commitOid": repo.sha,
                "pullRequestUrl": None,
            },
        )

    def _resolve(self, repo_id: str, revision: str, filename: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return self._missing("RepoNotFound", "Repository not found")
        if filename not in repo.files:
            return self._missing("EntryNotFound", f"{filename} does not exist")
        data = repo.files[filename]
        headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": repo.sha}
        return self._send(200, raw=data, headers=headers)


if __name__ == "__main__":  # manual use: python tests/fake_hub.py, then HF_ENDPOINT=<printed url>
    hub = FakeHub().start()
    print(hub.endpoint, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        hub.stop()
