"""A small in-process Hugging Face Hub for tests: the real ``huggingface_hub`` client talks HTTP to it.

Nothing in ``huggingface_hub`` is mocked. :func:`running_hub` starts a :class:`HubServer` on 127.0.0.1 (port 0) and
points the client's module-level endpoint and cache constants at it, then restores them. The server speaks the part
of the Hub API that ``huggingface_hub`` 2.4 and ``transformers`` 5 use to create repos, commit, list and download:

    GET  /api/whoami-v2                          POST /api/repos/create        POST /api/validate-yaml
    GET  /api/models/{id}[/revision/{rev}]       GET  /api/models/{id}/tree/{rev}[/{path}]
    GET  /api/models/{id}/refs                   GET  /api/models/{id}/commits/{rev}
    POST /api/models/{id}/preupload/{rev}        POST /api/models/{id}/commit/{rev}
    POST /api/models/{id}/branch/{name}          POST /api/models/{id}/tag/{rev}
    HEAD|GET /{id}/resolve/{rev}/{path}          (Range requests answer 206)

Storage is in memory; model repos only, with namespaced ids ("alice/tiny"). Each commit holds a full snapshot
(path -> bytes; unchanged contents are shared objects). Every file is a regular git blob, never LFS or Xet, so its
ETag is its git blob sha1, as the Hub does for small files. As on the Hub, a new repo starts with one commit that
adds ``.gitattributes``; a private repo is readable by its namespace's owner only.

    with running_hub(tmp_path) as hub:          # or the ``hub`` pytest fixture below
        sha = hub.publish("alice/tiny", {"config.json": "{}"}, tag="v1")
        hf_hub_download("alice/tiny", "config.json", revision="v1")
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import hashlib
import itertools
import json
import re
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

TOKEN = "hf_test_alice"  # registered by running_hub for USER
USER = "alice"
GITATTRIBUTES = b"*.bin filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha(data: bytes) -> str:
    """Git's blob id of ``data``: what the Hub sends as ETag and tree ``oid`` for a regular (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now() -> str:
    # The client's parse_datetime only accepts this exact shape.
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class HubError(Exception):
    """An error answer. ``code`` goes into ``X-Error-Code``, which is what ``hf_raise_for_status`` maps to
    RepositoryNotFoundError / RevisionNotFoundError / RemoteEntryNotFoundError (a bare 401 is only mapped for
    https:// endpoints, so the header is needed here)."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None, **extra):
        super().__init__(message)
        self.status, self.code, self.headers, self.extra = status, code, headers or {}, extra


class Request(NamedTuple):
    """One request as the server saw it, for assertions (``hub.requests``)."""

    method: str
    path: str  # raw path, still percent-encoded
    headers: dict[str, str]


@dataclass
class Commit:
    oid: str
    parent: str | None
    files: dict[str, bytes]
    title: str
    message: str
    author: str
    date: str = field(default_factory=_now)


@dataclass
class Repo:
    repo_id: str
    private: bool
    created_at: str = field(default_factory=_now)
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit:
        """A branch, a tag or a full commit sha."""
        oid = self.branches.get(revision) or self.tags.get(revision) or revision
        if oid not in self.commits:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return self.commits[oid]

    def history(self, commit: Commit):
        while commit is not None:
            yield commit
            commit = self.commits.get(commit.parent) if commit.parent else None


def _json(obj, status: int = 200):
    return status, json.dumps(obj).encode(), {"Content-Type": "application/json"}, None


def _read_files(folder: str | Path | Mapping) -> dict[str, bytes]:
    if isinstance(folder, Mapping):
        return {path: data.encode() if isinstance(data, str) else bytes(data) for path, data in folder.items()}
    root = Path(folder)
    files = {}
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root)
        # Same default exclusions as upload_folder: git internals and the local_dir download metadata.
        if ".git" not in rel.parts and rel.parts[:2] != (".cache", "huggingface"):
            files[rel.as_posix()] = file.read_bytes()
    return files


class HubServer:
    """The Hub: repos, tokens, a request log and download fault injection. Use as a context manager, or via
    :func:`running_hub`, which also points the client at it."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.tokens: dict[str, str] = {}  # token -> user name
        self.requests: list[Request] = []
        self._faults: list[list] = []  # [glob, times left, bytes to send before dropping the connection]
        self._lock = threading.RLock()  # handler threads run concurrently (snapshot_download uses 8 workers)
        self._counter = itertools.count()
        self._httpd: ThreadingHTTPServer | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        # ThreadingHTTPServer uses daemon threads: a keep-alive connection left open never blocks exit.
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.hub = self
        # A short poll interval: stop() waits for one poll, once per test.
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="hub-server", daemon=True).start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- server-side setup helpers (no HTTP) ----------------------------------------------------------------------

    def add_token(self, token: str, user: str) -> None:
        """Accept ``Authorization: Bearer <token>`` as ``user``, who owns the ``user/...`` namespace."""
        self.tokens[token] = user

    def create_repo(self, repo_id: str, private: bool = False) -> Repo:
        with self._lock:
            if repo_id in self.repos:
                # create_repo(exist_ok=True) reads "url" from this 409's body.
                raise HubError(409, "You already created this model repo", url=f"{self.url}/{repo_id}")
            repo = self.repos[repo_id] = Repo(repo_id, private)
            self._commit(repo, "main", {".gitattributes": GITATTRIBUTES}, "initial commit", repo_id.split("/")[0])
            return repo

    def publish(self, repo_id: str, folder, revision: str = "main", private: bool = False, tag: str | None = None,
                message: str = "Upload folder") -> str:
        """Commit ``folder`` (a directory, or a mapping path -> bytes/str) on branch ``revision`` and return the
        commit sha. Like upload_folder, files are added or overwritten, never deleted. The repo is created (with
        ``private``) if missing, and the branch from main's head if missing; ``tag`` tags the new commit."""
        files = _read_files(folder)
        with self._lock:
            repo = self.repos.get(repo_id) or self.create_repo(repo_id, private=private)
            repo.branches.setdefault(revision, repo.branches["main"])
            head = repo.commits[repo.branches[revision]]
            commit = self._commit(repo, revision, {**head.files, **files}, message, repo_id.split("/")[0])
            if tag is not None:
                repo.tags[tag] = commit.oid
            return commit.oid

    def fail_next_downloads(self, pattern: str = "*", times: int = 1, after_bytes: int = 0) -> None:
        """The next ``times`` GETs of /resolve/ for a file whose path in the repo matches the glob ``pattern`` send
        the usual headers (full Content-Length) but only ``after_bytes`` bytes of the body, then close the
        connection, as a network cut would. HEAD requests are never failed."""
        with self._lock:
            self._faults.append([pattern, times, after_bytes])

    def _take_fault(self, path: str) -> int | None:
        with self._lock:
            for fault in self._faults:
                if fault[1] > 0 and fnmatch.fnmatchcase(path, fault[0]):
                    fault[1] -= 1
                    return fault[2]
        return None

    def _commit(self, repo: Repo, branch: str, files: dict, title: str, author: str, message: str = "") -> Commit:
        parent = repo.branches.get(branch)
        seed = f"{repo.repo_id}\n{parent}\n{title}\n{next(self._counter)}"  # the counter keeps shas unique
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), parent, files, title, message, author)
        repo.commits[commit.oid] = commit
        repo.branches[branch] = commit.oid
        return commit

    # -- access control -------------------------------------------------------------------------------------------

    def _user(self, authorization: str | None) -> str | None:
        if not authorization:
            return None
        token = authorization.removeprefix("Bearer ").strip()
        if token not in self.tokens:
            # The Hub's wording: the client then raises a plain HfHubHTTPError (401), not RepositoryNotFound.
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.tokens[token]

    def _readable(self, repo_id: str, user: str | None) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        if repo.private and not _owns(user, repo_id):
            # The Hub does not reveal that a private repo exists: 401 (or 404 when logged in) + RepoNotFound.
            raise HubError(404 if user else 401, "Repository not found", "RepoNotFound")
        return repo

    def _writable(self, repo_id: str, user: str | None) -> Repo:
        repo = self._readable(repo_id, user)
        if not _owns(user, repo_id):
            raise HubError(403 if user else 401, f"You don't have the rights to write to {repo_id}")
        return repo

    # -- routing --------------------------------------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, headers, body: bytes):
        """-> (status, body, headers, cut_after): cut_after is None, or a byte count to drop the connection at."""
        url = urlsplit(raw_path)
        self.requests.append(Request(method, url.path, dict(headers)))
        # Split before unquoting: the client percent-encodes "/" inside revisions and tree paths.
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        user = self._user(headers.get("Authorization"))
        if parts[0] == "api":
            if parts[1:] == ["whoami-v2"]:
                if user is None:
                    raise HubError(401, "Invalid username or password.")
                token = {"displayName": "test", "role": "write"}
                return _json({"type": "user", "name": user, "fullname": user, "orgs": [],
                              "auth": {"type": "access_token", "accessToken": token}})
            if parts[1:] == ["validate-yaml"]:
                return _json({"errors": [], "warnings": []})
            if parts[1:] == ["repos", "create"] and method == "POST":
                return self._create_repo_api(user, json.loads(body or b"{}"))
            if parts[1:2] == ["models"] and len(parts) >= 4:
                return self._repo_api(method, user, "/".join(parts[2:4]), parts[4:], query, body)
        elif parts[2:3] == ["resolve"] and len(parts) >= 5 and method in ("GET", "HEAD"):
            repo_id, revision, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            return self._resolve(method, user, repo_id, revision, path, headers.get("Range"))
        raise HubError(404, f"Not found: {method} {url.path}")

    def _create_repo_api(self, user, payload):
        if user is None:
            raise HubError(401, "You must be authenticated to create a repo")
        if payload.get("type", "model") != "model":
            raise HubError(400, "This test Hub only hosts model repos")
        name = payload["name"]
        repo_id = name if "/" in name else f"{payload.get('organization') or user}/{name}"
        if not _owns(user, repo_id):
            raise HubError(403, f"You don't have the rights to create a repo under {repo_id.split('/')[0]}")
        private = payload.get("visibility") == "private" or bool(payload.get("private"))  # 2.4 sends "visibility"
        self.create_repo(repo_id, private=private)
        return _json({"url": f"{self.url}/{repo_id}", "name": repo_id})

    def _repo_api(self, method, user, repo_id, rest, query, body):
        sub, args = (rest[0], rest[1:]) if rest else ("", [])
        if method == "GET":
            repo = self._readable(repo_id, user)
            with self._lock:
                if sub == "" or (sub == "revision" and args):
                    return self._info(repo, args[0] if args else "main", query.get("blobs") == "true")
                if sub == "tree" and args:
                    return self._tree(repo, args[0], "/".join(args[1:]), query)
                if sub == "refs":
                    return _json({"branches": _refs(repo.branches, "heads"), "tags": _refs(repo.tags, "tags"),
                                  "converts": []})
                if sub == "commits" and args:
                    return _json([{"id": c.oid, "title": c.title, "message": c.message, "date": c.date,
                                   "authors": [{"user": c.author}]} for c in repo.history(repo.resolve(args[0]))])
        elif method == "POST" and args:
            repo = self._writable(repo_id, user)
            payload = json.loads(body) if body and sub != "commit" else {}
            name = "/".join(args)
            with self._lock:
                if sub == "preupload":
                    return self._preupload(repo, name, payload)
                if sub == "commit":
                    return self._commit_api(repo, name, user, query, body)
                if sub in ("branch", "tag"):  # /branch/{new branch} {startingPoint}, /tag/{revision} {tag}
                    refs, new = (repo.branches, name) if sub == "branch" else (repo.tags, payload["tag"])
                    if new in refs:
                        raise HubError(409, f"Reference already exists: {new}")
                    refs[new] = repo.resolve(payload.get("startingPoint", "main") if sub == "branch" else name).oid
                    return _json({})
        raise HubError(404, f"Not found: {method} /api/models/{repo_id}/{'/'.join(rest)}")

    # -- endpoints ------------------------------------------------------------------------------------------------

    def _info(self, repo: Repo, revision: str, blobs: bool):
        commit = repo.resolve(revision)
        siblings = [{"rfilename": path, **({"size": len(data), "blobId": git_blob_sha(data)} if blobs else {})}
                    for path, data in sorted(commit.files.items())]
        return _json({"_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id,
                      "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": commit.oid,
                      "lastModified": commit.date, "createdAt": repo.created_at, "private": repo.private,
                      "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                      "siblings": siblings, "usedStorage": sum(len(d) for d in commit.files.values())})

    def _tree(self, repo: Repo, revision: str, path: str, query: dict):
        commit = repo.resolve(revision)
        recursive, expand = query.get("recursive") == "true", query.get("expand") == "true"
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        entries = {}
        for file, data in sorted(commit.files.items()):
            if not file.startswith(prefix):
                continue
            segments = file[len(prefix):].split("/")
            # Folders between `path` and the file: all of them if recursive, else only the first level.
            for i in range(1, len(segments) if recursive else min(len(segments), 2)):
                folder = prefix + "/".join(segments[:i])
                # A folder's oid only has to look like a git tree id; nothing in the client checks it.
                oid = hashlib.sha1(f"{commit.oid}:{folder}".encode()).hexdigest()
                entries.setdefault(folder, {"type": "directory", "oid": oid, "size": 0, "path": folder})
            if recursive or len(segments) == 1:
                entries[file] = {"type": "file", "oid": git_blob_sha(data), "size": len(data), "path": file}
                if expand:
                    last = _last_commit(repo, commit, file)
                    entries[file]["lastCommit"] = {"id": last.oid, "title": last.title, "date": last.date}
        if prefix and not entries:
            raise HubError(404, f"{path} does not exist on {revision}", "EntryNotFound")
        return _json(list(entries.values()))

    def _preupload(self, repo: Repo, branch: str, payload: dict):
        existing = repo.commits[repo.branches[branch]].files if branch in repo.branches else {}
        files = []
        for file in payload.get("files", []):
            answer = {"path": file["path"], "uploadMode": "regular", "shouldIgnore": False}
            if file["path"] in existing:  # like the Hub: lets the client skip files that did not change
                answer["oid"] = git_blob_sha(existing[file["path"]])
            files.append(answer)
        return _json({"files": files})

    def _commit_api(self, repo: Repo, branch: str, user: str, query: dict, body: bytes):
        if query.get("create_pr"):
            raise HubError(400, "This test Hub does not support pull requests")
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = lines[0]["value"] if lines and lines[0]["key"] == "header" else {}
        head = repo.commits[repo.branches[branch]]
        if header.get("parentCommit") not in (None, head.oid):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(head.files)
        for op in lines[1:]:
            key, value = op["key"], op["value"]
            if key == "file":
                data = value["content"]
                files[value["path"]] = base64.b64decode(data) if value.get("encoding") == "base64" else data.encode()
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                files = {p: d for p, d in files.items() if not p.startswith(folder)}
            else:  # lfsFile: never requested, since preupload answers "regular" for everything
                raise HubError(400, f"Unsupported commit operation {key!r}: this test Hub has no LFS storage")
        commit = self._commit(repo, branch, files, header.get("summary", ""), user, header.get("description", ""))
        return _json({"commitUrl": f"{self.url}/{repo.repo_id}/commit/{commit.oid}", "commitOid": commit.oid,
                      "success": True, "pullRequestUrl": None})

    def _resolve(self, method, user, repo_id, revision, path, range_header):
        with self._lock:
            commit = self._readable(repo_id, user).resolve(revision)
        # X-Repo-Commit on the 404 too: the client records the file's absence in its cache (.no_exist).
        headers = {"X-Repo-Commit": commit.oid}
        if path not in commit.files:
            raise HubError(404, "Entry not found", "EntryNotFound", headers)
        data = commit.files[path]
        headers.update({"ETag": f'"{git_blob_sha(data)}"', "Accept-Ranges": "bytes",
                        "Content-Type": "application/octet-stream"})
        status, size = 200, len(data)
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", (range_header or "").strip())
        if match and match.group(0) != "bytes=-":
            first, last = match.groups()
            start = int(first) if first else max(size - int(last), 0)
            end = min(int(last) + 1, size) if first and last else size
            if start >= size:
                raise HubError(416, "Requested range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            status, data = 206, data[start:end]
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        return status, data, headers, self._take_fault(path) if method == "GET" else None


def _owns(user: str | None, repo_id: str) -> bool:
    return user is not None and repo_id.split("/")[0] == user


def _refs(refs: dict[str, str], kind: str) -> list[dict]:
    return [{"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": oid} for name, oid in refs.items()]


def _last_commit(repo: Repo, commit: Commit, path: str) -> Commit:
    """The oldest commit in the unbroken run of first-parent ancestors holding this very version of ``path``."""
    last = commit
    for older in itertools.islice(repo.history(commit), 1, None):
        if older.files.get(path) != commit.files[path]:
            break
        last = older
    return last


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keep-alive, like the Hub: httpx reuses connections, so every response must carry a Content-Length
    # and every request body must be read to its end, even by routes that ignore it.
    protocol_version = "HTTP/1.1"
    timeout = 30  # an idle keep-alive connection frees its thread eventually

    def log_message(self, format, *args):  # keep test output quiet
        pass

    def _dispatch(self):
        hub: HubServer = self.server.hub
        # The client always sends a Content-Length (its bodies are bytes or JSON, never streamed).
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            status, payload, headers, cut_after = hub.handle(self.command, self.path, self.headers, body)
        except HubError as error:
            headers = {**error.headers, "Content-Type": "application/json", "X-Error-Message": str(error)}
            if error.code:
                headers["X-Error-Code"] = error.code
            status, payload, cut_after = error.status, json.dumps({"error": str(error), **error.extra}).encode(), None
        except Exception as error:  # a bug in this file: say so loudly rather than hang the client
            traceback.print_exc(file=sys.stderr)
            status, payload, headers, cut_after = 500, json.dumps({"error": repr(error)}).encode(), {}, None
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload if cut_after is None else payload[:cut_after])
        if cut_after is not None:
            self.close_connection = True  # the body is short of its Content-Length: the client sees a cut

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _dispatch


def _forget_transformers_api(endpoint: str) -> None:
    """transformers.utils.hub caches one HfApi, whose endpoint was fixed when it was built: drop it if it points at
    ``endpoint`` (a server about to stop), so the next call builds one from the current constants."""
    module = sys.modules.get("transformers.utils.hub")
    if getattr(getattr(module, "_hf_api", None), "endpoint", None) == endpoint:
        module._hf_api = None


@contextlib.contextmanager
def running_hub(tmp_path: str | Path | None = None):
    """Start a :class:`HubServer` (with ``TOKEN`` registered for ``USER``), point huggingface_hub and transformers
    at it with a fresh cache under ``tmp_path`` (a temporary directory if None), and undo it all on exit.

    huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE, ... once, at import, into ``constants``, and every
    call reads the constants module at call time, so those attributes are what gets patched. The environment
    variables are set too, for subprocesses."""
    from huggingface_hub import constants, hf_api
    from huggingface_hub.utils._http import close_session

    with contextlib.ExitStack() as stack:
        if tmp_path is None:
            tmp_path = stack.enter_context(tempfile.TemporaryDirectory(prefix="hub-"))
        hub = stack.enter_context(HubServer())
        hub.add_token(TOKEN, USER)
        stack.callback(_forget_transformers_api, hub.url)  # runs last: an HfApi built inside the block
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        # Drop pooled keep-alive connections now and on exit, so none outlives (or predates) this server.
        close_session()
        stack.callback(close_session)

        home = Path(tmp_path) / "hf_home"
        mp.setattr(constants, "ENDPOINT", hub.url)
        # hf_hub_url() formats this template (built from ENDPOINT at import), it does not read ENDPOINT.
        mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        # The module-level HfApi behind huggingface_hub.model_info, create_repo, upload_folder, ... fixed its
        # endpoint at import.
        mp.setattr(hf_api.api, "endpoint", hub.url)
        for name, value in {
            "HF_HOME": home, "HF_HUB_CACHE": home / "hub", "HUGGINGFACE_HUB_CACHE": home / "hub",
            "HF_ASSETS_CACHE": home / "assets", "HUGGINGFACE_ASSETS_CACHE": home / "assets",
            "HF_XET_CACHE": home / "xet", "HF_TOKEN_PATH": home / "token",  # no real token leaks into requests
            "HF_STORED_TOKENS_PATH": home / "stored_tokens", "AGENT_HARNESSES_PATH": home / "agent_harnesses.json",
        }.items():
            mp.setattr(constants, name, str(value))
        mp.setattr(constants, "HF_HUB_OFFLINE", False)
        # Telemetry on means a one-off GET /api/agent-harnesses from build_hf_headers; keep requests to the API.
        mp.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                     "HF_OIDC_RESOURCE"):
            mp.delenv(name, raising=False)
        mp.setenv("HF_ENDPOINT", hub.url)
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_HUB_CACHE", str(home / "hub"))
        if "transformers.utils.hub" in sys.modules:
            mp.setattr(sys.modules["transformers.utils.hub"], "_hf_api", None)
        yield hub


@pytest.fixture
def hub(tmp_path):
    """A running :class:`HubServer` the real client points at. Use it from another test module with
    ``from hub_server import hub  # noqa: F401, F811``."""
    with running_hub(tmp_path) as server:
        yield server
