"""The hub side of the data scripts: data/cached_fineweb10B.py, and data/fineweb.py reading the hub's parquet files,
each with a real huggingface_hub client talking to a small hub-like HTTP server the test runs on 127.0.0.1.

The scripts run in subprocesses: huggingface_hub reads HF_ENDPOINT when it is imported.
"""
import contextlib
import hashlib
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

from conftest import REPO_ROOT
from data import fineweb
from train_gpt import EOT_TOKEN, write_data_shard

SCRIPT = REPO_ROOT / "data" / "cached_fineweb10B.py"
REPO = "kjj0/fineweb10B-gpt2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
VAL, TRAIN1, TRAIN2, TRAIN3 = ("fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin",
                               "fineweb_train_000003.bin")
SERVER_WAIT_S = 20  # no handler blocks longer than this


def shard_bytes(tmp_path, seed: int, num_tokens: int) -> bytes:
    """A valid shard: random GPT-2 ids, documents starting with EOT."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, EOT_TOKEN, num_tokens)
    tokens[rng.choice(num_tokens, 5, replace=False)] = EOT_TOKEN
    tokens[0] = EOT_TOKEN
    path = tmp_path / f"made_{seed}.bin"
    write_data_shard(path, tokens)
    return path.read_bytes()


class FakeHub(http.server.ThreadingHTTPServer):
    """One dataset repo, the way the hub serves it: HEAD and GET (with Range) on /datasets/<repo>/resolve/main/<path>,
    and the folder listing /api/datasets/<repo>/tree/main/<folder>."""
    daemon_threads = True

    def __init__(self, files: dict[str, bytes], repo: str = REPO):
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.files, self.repo = dict(files), repo
        self.log: list[tuple[str, str, str | None]] = []  # (method, file, Range header)
        self.cut_after: dict[str, int] = {}  # file -> bytes sent before dropping the connection (next GET only)
        self.stall_after: dict[str, int] = {}  # file -> bytes sent before hanging until `release`
        self.stalled, self.release = threading.Event(), threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def gets(self, name: str) -> list[str | None]:
        return [rng for method, file, rng in self.log if method == "GET" and file == name]


class _HubHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = SERVER_WAIT_S  # socket timeout: a vanished client never holds a thread for long

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _not_found(self):
        self.send_response(404)
        self.send_header("X-Error-Code", "EntryNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _lookup(self):
        match = re.fullmatch(rf"/datasets/{self.server.repo}/resolve/main/([^?]+)", self.path)
        data = self.server.files.get(match.group(1)) if match else None
        if data is None:
            self._not_found()
            return None, None
        return match.group(1), data

    def _list_folder(self, folder: str):
        body = json.dumps([{"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                           for path, data in sorted(self.server.files.items())
                           if path.rpartition("/")[0] == folder]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_headers(self, status: int, data: bytes, start: int):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()

    def do_HEAD(self):
        name, data = self._lookup()
        if name is not None:
            self.server.log.append(("HEAD", name, None))
            self._send_headers(200, data, 0)

    def do_GET(self):
        listing = re.fullmatch(rf"/api/datasets/{self.server.repo}/tree/main/([^?]+)(\?.*)?", self.path)
        if listing:
            self._list_folder(urllib.parse.unquote(listing.group(1)))
            return
        name, data = self._lookup()
        if name is None:
            return
        server = self.server
        range_header = self.headers.get("Range")
        server.log.append(("GET", name, range_header))
        start = int(re.fullmatch(r"bytes=(\d+)-", range_header).group(1)) if range_header else 0
        self._send_headers(206 if start else 200, data, start)
        body = data[start:]
        if name in server.cut_after:
            self.wfile.write(body[:server.cut_after.pop(name)])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # the connection drops mid-file
            self.close_connection = True
        elif name in server.stall_after:
            self.wfile.write(body[:server.stall_after[name]])
            self.wfile.flush()
            server.stalled.set()
            server.release.wait(SERVER_WAIT_S)
            self.close_connection = True
        else:
            self.wfile.write(body)


@contextlib.contextmanager
def running(hub: FakeHub):
    thread = threading.Thread(target=hub.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.release.set()
        hub.shutdown()
        hub.server_close()
        thread.join(SERVER_WAIT_S)


@pytest.fixture
def served(tmp_path):
    files = {VAL: shard_bytes(tmp_path, 0, 1000), TRAIN1: shard_bytes(tmp_path, 1, 3000),
             TRAIN2: shard_bytes(tmp_path, 2, 2000), TRAIN3: shard_bytes(tmp_path, 3, 1500)}
    with running(FakeHub(files)) as hub:
        yield hub


def manifest_for(tmp_path, files: dict[str, bytes]):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"sha256": {f"fineweb10B/{name}": hashlib.sha256(data).hexdigest()
                                           for name, data in files.items()}}))
    return path


def hub_env(tmp_path, endpoint: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k.upper() not in ("HF_TOKEN", "HF_HUB_OFFLINE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_XET="1",
               HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    return env


def downloader_args(tmp_path, n: int, manifest) -> list[str]:
    return [sys.executable, str(SCRIPT), str(n), "--dir", str(tmp_path / "fineweb10B"), "--manifest", str(manifest)]


def download(tmp_path, endpoint: str, n: int, manifest) -> subprocess.CompletedProcess:
    return subprocess.run(downloader_args(tmp_path, n, manifest), env=hub_env(tmp_path, endpoint),
                          capture_output=True, text=True, timeout=90, cwd=REPO_ROOT)


def dead_endpoint() -> str:
    """A 127.0.0.1 URL where nothing listens: connections are refused at once, as with no network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_download_resumes_a_cut_connection_and_rejects_corrupt_files(tmp_path, served):
    # huggingface_hub writes whole 10 MiB chunks, so resuming shows only in a file larger than one chunk
    served.files[TRAIN1] = shard_bytes(tmp_path, 4, DOWNLOAD_CHUNK_SIZE // 2 + 100_000)
    manifest = manifest_for(tmp_path, served.files)  # what the files should be, before corrupting two
    served.cut_after[TRAIN1] = DOWNLOAD_CHUNK_SIZE + 5000  # the connection drops past the first chunk
    bad_header = bytearray(served.files[TRAIN2])
    bad_header[0] ^= 1  # magic number
    served.files[TRAIN2] = bytes(bad_header)
    served.files[TRAIN3] = shard_bytes(tmp_path, 7, 2000)  # a well-formed shard, but not the manifest's
    result = download(tmp_path, served.url, 3, manifest)

    # the second request for TRAIN1 continued where the cut left off instead of starting over
    assert served.gets(TRAIN1) == [None, f"bytes={DOWNLOAD_CHUNK_SIZE}-"]
    out = tmp_path / "fineweb10B"
    assert sorted(p.name for p in out.iterdir()) == sorted([VAL, TRAIN1])  # nothing bad kept, no staging left
    for name in (VAL, TRAIN1):
        assert (out / name).read_bytes() == served.files[name]
        assert re.search(rf"{name}: \d+ tokens, sha256 [0-9a-f]{{64}} \(matches the manifest\)", result.stdout)
    assert re.search(rf"{TRAIN2}: downloaded but bad, deleted: .*magic number", result.stdout)
    assert re.search(rf"{TRAIN3}: downloaded but bad, deleted: .*SHA-256", result.stdout)
    assert result.returncode == 1
    # stderr also holds huggingface_hub's progress bars and its note about the resumed download
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"error: 2 downloaded file(s) failed their check and were deleted: {TRAIN2}, {TRAIN3}")
    assert "Traceback" not in result.stderr


def test_next_run_after_a_crash_keeps_good_files_and_repairs_the_rest(tmp_path, served):
    manifest = manifest_for(tmp_path, served.files)
    served.stall_after[TRAIN1] = 1000
    proc = subprocess.Popen(downloader_args(tmp_path, 3, manifest), env=hub_env(tmp_path, served.url),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT)
    try:
        assert served.stalled.wait(60), "the downloader never reached the middle of the file"
    finally:
        proc.kill()  # as hard as a crash or a power cut: no cleanup runs
        proc.communicate(timeout=30)
        served.release.set()
    out = tmp_path / "fineweb10B"
    assert (out / VAL).read_bytes() == served.files[VAL]
    assert not (out / TRAIN1).exists()  # no half-written file under the final name

    del served.stall_after[TRAIN1]
    (out / TRAIN2).write_bytes(served.files[TRAIN2][:-10])  # truncated: size disagrees with the header
    tampered = bytearray(served.files[TRAIN3])
    tampered[-1] ^= 1  # still a well-formed shard: only the manifest's SHA-256 catches it
    (out / TRAIN3).write_bytes(bytes(tampered))
    result = download(tmp_path, served.url, 3, manifest)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(served.files)  # the crash's leftovers are gone
    for name, data in served.files.items():
        assert (out / name).read_bytes() == data
    assert served.gets(VAL) == [None]  # from the first run only
    assert served.gets(TRAIN1)[1:] == served.gets(TRAIN2) == served.gets(TRAIN3) == [None]
    assert f"{VAL}: present and valid, skipped" in result.stdout
    assert re.search(rf"{TRAIN2}: present but bad.*header says 2000 tokens", result.stdout)
    assert re.search(rf"{TRAIN3}: present but bad.*SHA-256", result.stdout)
    assert "4 shards of fineweb10B ready" in result.stdout


def test_a_link_where_a_shard_or_the_staging_folder_goes_is_refused_before_any_download(tmp_path, served):
    """Issue 53: a link at a shard's name (to a bad shard, or to nothing), or at the staging folder, is named and
    nothing is fetched, written through it or put in its place."""
    manifest = manifest_for(tmp_path, served.files)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("another project's file")
    out = tmp_path / "fineweb10B"
    out.mkdir()
    for name, target, cause in ((TRAIN1, precious / "notes.txt", "to a bad shard"), (TRAIN1, precious / "none", ""),
                                (".download", precious, "")):
        (out / name).symlink_to(target)
        result = download(tmp_path, served.url, 1, manifest)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().startswith(f"error: {out / name} is a symbolic link (to {target})"), result.stderr
        assert cause in result.stderr and "through" in result.stderr and "\n" not in result.stderr.strip()
        assert served.gets(VAL) == [] and (out / name).is_symlink()
        (out / name).unlink()
    assert sorted(precious.iterdir()) == [precious / "notes.txt"]
    assert (precious / "notes.txt").read_text() == "another project's file" and list(out.iterdir()) == []


def test_unreachable_hub_fails_fast_with_one_paragraph(tmp_path, served):
    out = tmp_path / "fineweb10B"
    out.mkdir()
    (out / VAL).write_bytes(served.files[VAL])  # present and valid: needs no hub
    start = time.monotonic()
    result = download(tmp_path, dead_endpoint(), 1, manifest_for(tmp_path, served.files))
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert f"{VAL}: present and valid, skipped" in result.stdout
    message = result.stderr.strip()
    assert message.startswith(f"error: could not reach the Hugging Face hub to download {TRAIN1}")
    assert "\n" not in message and "Traceback" not in message
    assert elapsed < 20  # huggingface_hub's own retries alone take over 20 s
    assert sorted(p.name for p in out.iterdir()) == [VAL]


def test_fineweb_build_from_the_hub_equals_the_build_from_local_files(tmp_path, gpt2_ranks):
    parts = []
    for i in range(2):
        texts = [f"part {i} document {j}: " + "some words here. " * (j % 5) for j in range(120)]
        parts.append(tmp_path / f"{i:03d}_00000.parquet")
        pyarrow.parquet.write_table(pyarrow.table({"text": texts}), parts[-1])
    files = {"README.md": b"# FineWeb\n", "sample/100BT/000_00000.parquet": b"not to be read"}
    files |= {f"sample/10BT/{p.name}": p.read_bytes() for p in parts}
    with running(FakeHub(files, repo="HuggingFaceFW/fineweb")) as hub:
        result = subprocess.run([sys.executable, str(REPO_ROOT / "data" / "fineweb.py"), "--out_dir",
                                 str(tmp_path / "from_hub"), "--shard_size", "1000", "--workers", "2"],
                                env=hub_env(tmp_path, hub.url), capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert [name for method, name, _ in hub.log if method == "GET"] == [f"sample/10BT/{p.name}" for p in parts]
    fineweb.main(["--input", *map(str, parts), "--out_dir", str(tmp_path / "local"), "--shard_size", "1000",
                  "--workers", "1"])
    local = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert len(local) > 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "from_hub").iterdir()} == local
