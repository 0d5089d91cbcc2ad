"""Download FineWeb already tokenized with GPT-2 (the trainer's .bin shards) from the Hugging Face hub.

    python data/cached_fineweb10B.py            # validation shard + 9 training shards: enough for the record
    python data/cached_fineweb10B.py 1          # validation shard + the first training shard
    python data/cached_fineweb10B.py 20 --variant finewebedu10B    # also: fineweb100B

Files go to data/<variant>/ (--dir to change): <prefix>_val_000000.bin, then <prefix>_train_000001.bin, ...,
100M tokens each. A file already there is checked (header, size, token ids, and SHA-256 when data/manifest.json
lists it) and skipped when valid, fetched again when not. Each download is written under a temporary folder,
resumed by huggingface_hub if the connection drops mid-file, checked the same way, and only then moved to its
final name (a file failing the check is deleted and reported); an interrupted run leaves no partial file under
a final name, and the next run starts that file afresh.
"""
import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from huggingface_hub import hf_hub_download

from data.common import DATA_DIR, MANIFEST_FILE, Manifest, UserError, run_script, scan_shard, shard_name
from data.hub import HUB_ERRORS, hub_error, probe


@dataclass(frozen=True)
class Variant:
    repo_id: str
    prefix: str  # of the file names
    train_shards: int  # how many the dataset repo holds


VARIANTS = {
    "fineweb10B": Variant("kjj0/fineweb10B-gpt2", "fineweb", 103),
    "fineweb100B": Variant("kjj0/fineweb100B-gpt2", "fineweb", 1030),
    "finewebedu10B": Variant("kjj0/finewebedu10B-gpt2", "finewebedu", 99),
}
RECORD_TRAIN_SHARDS = 9  # the record reads fewer than 900M training tokens
STAGING = ".download"  # inside the output folder: same file system, so the final move is a rename


def present_and_valid(path: Path, manifest: Manifest, key: str) -> bool:
    """Whether a file already there can be kept; a bad one is deleted so that it is fetched again."""
    if not path.exists():
        return False
    try:
        scan_shard(path, manifest, key)
    except UserError as e:
        if path.is_symlink():  # (a link to a good shard elsewhere is read as it is; a bad one is the user's to fix)
            raise UserError(f"{path} is a symbolic link (to {os.readlink(path)}) to a bad shard ({e}): the download "
                            "never writes through or over a link; remove it") from None
        print(f"{path.name}: present but bad, fetching it again: {e}")
        path.unlink()
        return False
    print(f"{path.name}: present and valid, skipped")
    return True


def download(variant: Variant, name: str, staging: Path) -> Path:
    try:
        return Path(hf_hub_download(variant.repo_id, name, repo_type="dataset", local_dir=staging))
    except HUB_ERRORS as e:
        raise hub_error(e, variant.repo_id, name) from None


def fetch_all(variant: Variant, names: list[str], out_dir: Path, manifest: Manifest, key_folder: str) -> None:
    """Download each file into the staging folder, check it, and only then give it its final name."""
    probe(variant.repo_id, names[0])
    staging = out_dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)  # leftovers of a killed run: start those files afresh
    bad = []
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] downloading {name} from {variant.repo_id}", flush=True)
        staged = download(variant, name, staging)
        try:
            stats = scan_shard(staged, manifest, f"{key_folder}/{name}")
        except UserError as e:  # keep going: the other files may be fine
            staged.unlink()
            print(f"{name}: downloaded but bad, deleted: {e}", flush=True)
            bad.append(name)
            continue
        os.replace(staged, out_dir / name)
        listed = "matches the manifest" if stats.manifest_sha256 else "not in the manifest"
        print(f"{name}: {stats.num_tokens} tokens, sha256 {stats.sha256} ({listed})", flush=True)
    shutil.rmtree(staging)
    if bad:
        raise UserError(f"{len(bad)} downloaded file(s) failed their check and were deleted: {', '.join(bad)} "
                        "(reasons above). Run the command again; if they fail again, the copy on the hub is not "
                        "the expected data")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("num_train_shards", type=int, nargs="?", default=RECORD_TRAIN_SHARDS, metavar="N",
                        help=f"training shards to get after the validation shard (default {RECORD_TRAIN_SHARDS})")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="fineweb10B")
    parser.add_argument("--dir", type=Path, help="output folder (default: data/<variant>)")
    parser.add_argument("--manifest", type=Path, default=MANIFEST_FILE, help="expected SHA-256 per '<variant>/<file>'")
    args = parser.parse_args(argv)
    variant = VARIANTS[args.variant]
    if not 0 <= args.num_train_shards <= variant.train_shards:
        raise UserError(f"N = {args.num_train_shards}: {args.variant} has {variant.train_shards} training shards; "
                        f"ask for 0 to {variant.train_shards}")
    out_dir = args.dir or DATA_DIR / args.variant
    manifest = Manifest(args.manifest)
    names = [shard_name(variant.prefix, i) for i in range(args.num_train_shards + 1)]
    # the manifest is keyed by the variant's folder name, wherever --dir puts the files
    missing = [name for name in names if not present_and_valid(out_dir / name, manifest, f"{args.variant}/{name}")]
    links = [path for path in [out_dir / STAGING, *(out_dir / name for name in missing)] if path.is_symlink()]
    if links:
        raise UserError(f"{links[0]} is a symbolic link (to {os.readlink(links[0])}): the download writes there, and "
                        "never through a link; remove it (a link to the whole folder, --dir, is fine)")
    if missing:
        fetch_all(variant, missing, out_dir, manifest, args.variant)
    print(f"{len(names)} shards of {args.variant} ready in {out_dir}")
    return 0


if __name__ == "__main__":
    run_script(main)
