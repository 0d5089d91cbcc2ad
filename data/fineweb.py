"""Build GPT-2 token shards (the trainer's .bin format) from raw FineWeb text, instead of downloading them.

    python data/fineweb.py                           # FineWeb sample-10BT from the hub -> data/fineweb10B_local/
    python data/fineweb.py --sample 100BT            # sample-100BT -> data/fineweb100B_local/
    python data/fineweb.py --dataset fineweb-edu     # FineWeb-Edu sample-10BT -> data/finewebedu10B_local/
    python data/fineweb.py --input a.parquet b.jsonl --out_dir out/ --shard_size 1000000   # local files

Documents are read in a fixed order: the --input files as given (rows in file order), or the sample's parquet
files in sorted name order. Worker processes (--workers) encode each document's "text" as [50256] + its GPT-2
tokens; the results are taken back in input order and the token stream is cut into shards of exactly
--shard_size tokens (the last one shorter), so a document may straddle two shards. Shard 0 is validation:
<prefix>_val_000000.bin, then <prefix>_train_000001.bin, ... The output depends only on the input: it is
identical byte for byte across runs and worker counts. Hub parquet files go to huggingface_hub's cache.
"""
import argparse
import itertools
import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import pyarrow
import pyarrow.parquet
from huggingface_hub import HfApi, hf_hub_download
from tqdm import tqdm

from data.common import DATA_DIR, FlagError, UserError, check_out_dir, run_script, shard_name, write_shard
from data.gpt2_tokenizer import get_gpt2_encoding
from data.hub import HUB_ERRORS, hub_error, probe
from train_gpt import EOT_TOKEN

DATASETS = {"fineweb": ("HuggingFaceFW/fineweb", "fineweb"), "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "finewebedu")}
SAMPLES = ("10BT", "100BT")
DEFAULT_SHARD_SIZE = 100_000_000
DOCS_PER_TASK = 256  # documents per worker task: amortises the inter-process traffic


def read_parquet(path: Path):
    try:
        parquet = pyarrow.parquet.ParquetFile(path)
        if "text" not in parquet.schema_arrow.names:
            raise UserError(f"the parquet file {path} has no 'text' column (it has {parquet.schema_arrow.names})")
        for batch in parquet.iter_batches(columns=["text"], batch_size=1024):
            yield from batch.column(0).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise UserError(f"cannot read the parquet file {path} ({e}); give FineWeb parquet files, or jsonl with "
                        "a 'text' field per line") from None


def read_jsonl(path: Path):
    with open(path, encoding="utf-8") as f:
        try:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    text = None
                if not isinstance(text, str):
                    raise UserError(f"{path} line {line_number} is not a JSON object with a string 'text' field")
                yield text
        except UnicodeDecodeError as e:
            raise UserError(f"{path} is not UTF-8 text ({e.reason}); jsonl must be UTF-8") from None


def read_documents(paths):
    """Every document's text, in file order then row order."""
    for path in paths:
        if path.suffix == ".parquet":
            yield from read_parquet(path)
        elif path.suffix == ".jsonl":
            yield from read_jsonl(path)
        else:
            raise UserError(f"--input {path}: expected a .parquet or .jsonl file")


def hub_parquet_names(repo_id: str, sample: str) -> list[str]:
    folder = f"sample/{sample}"
    probe(repo_id, "README.md")
    try:
        names = sorted(entry.path for entry in HfApi().list_repo_tree(repo_id, folder, repo_type="dataset")
                       if entry.path.endswith(".parquet"))
    except HUB_ERRORS as e:
        raise hub_error(e, repo_id, folder) from None
    if not names:
        raise UserError(f"the dataset {repo_id} has no parquet files under {folder}/")
    return names


def hub_parquet_files(repo_id: str, names: list[str]):
    """Each parquet file, downloaded (resumably, into the hub cache) only when the previous one is read."""
    for name in names:
        print(f"reading {repo_id}/{name}", flush=True)
        try:
            yield Path(hf_hub_download(repo_id, name, repo_type="dataset"))
        except HUB_ERRORS as e:
            raise hub_error(e, repo_id, name) from None


def encode_documents(texts: list[str]) -> np.ndarray:
    """[50256] + GPT-2 tokens of each text, concatenated."""
    encoding = get_gpt2_encoding()  # cached: built once per process
    tokens = []
    for text in texts:
        tokens.append(EOT_TOKEN)
        tokens += encoding.encode_ordinary(text)  # ordinary: text that looks like a special token stays text
    return np.array(tokens, dtype=np.uint16)


def token_stream(texts, workers: int):
    """Encoded batches of documents, always in input order (Pool.imap keeps it), whatever the worker count."""
    batches = iter(lambda: list(itertools.islice(texts, DOCS_PER_TASK)), [])
    if workers == 1:
        yield from map(encode_documents, batches)
        return
    # a worker leaves SIGTERM as it was (run_script's handler is the main process's): Pool.terminate() ends it at once
    with multiprocessing.Pool(workers, signal.signal, (signal.SIGTERM, signal.SIG_DFL)) as pool:
        yield from pool.imap(encode_documents, batches)


class ShardWriter:
    """Cuts a token stream into shards of exactly shard_size tokens; close() writes the shorter last one."""

    def __init__(self, out_dir: Path, prefix: str, shard_size: int):
        self.out_dir, self.prefix = out_dir, prefix
        self.buffer = np.empty(shard_size, dtype=np.uint16)
        self.filled = 0
        self.written: list[tuple[Path, int]] = []

    def add(self, tokens: np.ndarray) -> None:
        while len(tokens):
            take = min(len(tokens), len(self.buffer) - self.filled)
            self.buffer[self.filled:self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == len(self.buffer):
                self._write()

    def close(self) -> None:
        if self.filled:
            self._write()

    def _write(self) -> None:
        path = self.out_dir / shard_name(self.prefix, len(self.written))
        write_shard(path, self.buffer[:self.filled])
        self.written.append((path, self.filled))
        self.filled = 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, nargs="+", help="local .parquet or .jsonl files (default: the hub)")
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="fineweb")
    parser.add_argument("--sample", choices=SAMPLES, default="10BT", help="the hub sample to read")
    parser.add_argument("--out_dir", type=Path, help="default: data/<prefix><sample>_local for the hub; "
                                                     "required with --input")
    parser.add_argument("--prefix", help="shard file name prefix (default: fineweb, or finewebedu)")
    parser.add_argument("--shard_size", type=int, default=DEFAULT_SHARD_SIZE, help="tokens per shard")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes")
    args = parser.parse_args(argv)
    if not 1 <= args.shard_size < 2**31:
        raise FlagError(f"--shard_size {args.shard_size}: a shard holds from 1 token to 2**31 - 1 (its header counts "
                        "them in 32 bits)")
    if args.workers < 1:
        raise FlagError(f"--workers {args.workers}: need at least 1")
    prefix = args.prefix or DATASETS[args.dataset][1]
    if args.input:
        if args.out_dir is None:
            raise FlagError("--input needs --out_dir: say where the shards of your own text go")
        missing = [str(p) for p in args.input if not p.is_file()]
        if missing:
            raise FlagError(f"--input: no such file {', '.join(missing)}")
    out_dir = args.out_dir or DATA_DIR / f"{prefix}{args.sample.removesuffix('T')}_local"
    check_out_dir(out_dir)
    existing = sorted(out_dir.glob(f"{prefix}_*.bin"))
    if existing:
        raise FlagError(f"{out_dir} already holds {prefix} shards ({existing[0].name}, ...): a new build would mix "
                        "with them; delete them or choose another --out_dir")
    if args.input:
        files = args.input
    else:
        repo_id = DATASETS[args.dataset][0]
        files = hub_parquet_files(repo_id, hub_parquet_names(repo_id, args.sample))
    get_gpt2_encoding()  # fail now, not in a worker, when the tokenizer is unavailable
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out_dir, prefix, args.shard_size)
    with tqdm(unit="tok", unit_scale=True, desc="tokenizing", disable=None) as progress:
        for tokens in token_stream(read_documents(files), args.workers):
            writer.add(tokens)
            progress.update(len(tokens))
    writer.close()
    for path, count in writer.written:
        print(f"{path}: {count} tokens")
    if not writer.written:
        raise UserError("the input holds no documents: no shard was written")
    return 0


if __name__ == "__main__":
    run_script(main)
