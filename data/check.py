"""Check `.bin` token shards: header, size, documents, token ids and SHA-256.

    python data/check.py "data/fineweb10B/*.bin"
    python data/check.py data/shakespeare/*.bin --manifest data/manifest.json

For each file: the header (magic, version, token count) and the file size, checked by the trainer's own
`read_shard_header`; the number of documents (tokens 50256); the largest token id, which must be below 50257;
and the SHA-256, which must equal the manifest's when the manifest lists the file under '<folder>/<file>'.
Exits 1, naming every bad file, when any check fails.
"""
import argparse
import glob
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.common import MANIFEST_FILE, Manifest, UserError, run_script, scan_shard
from train_gpt import SHARD_MAGIC, SHARD_VERSION


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="+", metavar="PATTERN", help="shard files or glob patterns (quoted)")
    parser.add_argument("--manifest", type=Path, default=MANIFEST_FILE, help="expected SHA-256 per '<folder>/<file>'")
    args = parser.parse_args(argv)
    manifest = Manifest(args.manifest)
    files = []
    for pattern in args.patterns:
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise UserError(f"{pattern!r} matches no file; give shard paths or a quoted glob such as "
                            "'data/fineweb10B/*.bin'")
        files += [Path(m) for m in matches]
    bad = []
    for path in files:
        try:
            s = scan_shard(path, manifest)
        except UserError as e:
            print(f"BAD {e}")
            bad.append(str(path))
            continue
        verdict = "matches the manifest" if s.manifest_sha256 else "not in the manifest"
        print(f"ok  {path}: magic {SHARD_MAGIC}, version {SHARD_VERSION}, {s.num_tokens} tokens "
              f"({path.stat().st_size} bytes), {s.num_docs} documents, max token id {s.max_token}, "
              f"sha256 {s.sha256} ({verdict})")
    if bad:
        raise UserError(f"{len(bad)} of {len(files)} shards failed the check: {', '.join(bad)}")
    print(f"all {len(files)} shards passed")
    return 0


if __name__ == "__main__":
    run_script(main)
