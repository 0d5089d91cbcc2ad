#!/usr/bin/env bash
# One command to train, one to test, on a fresh machine with Python: what requirements.txt names is installed
# first when any of it is missing.
#   ./run.sh [flags]          train: the record config on every CUDA GPU here (fetching the FineWeb shards when
#                             they are missing), else the cpu preset on the embedded data; flags go to train_gpt.py
#   ./run.sh test [args]      the test suite (CI runs exactly this); args go to pytest
set -euo pipefail
cd "$(dirname "$0")"

python - <<'CHECK' || python -m pip install -r requirements.txt
import importlib.metadata, sys
for line in open("requirements.txt"):
    requirement = line.split("#")[0].strip()
    if requirement:
        name, _, pinned = requirement.partition("==")
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            sys.exit(1)
        if pinned and installed.split("+")[0] != pinned:
            sys.exit(1)
CHECK

if [ "${1:-}" = "test" ]; then
    shift
    # the tests write checkpoints of over 100 MiB: keep only a failed session's folders, and only the last one's
    exec python -m pytest -q --durations=10 -o tmp_path_retention_policy=failed -o tmp_path_retention_count=1 tests "$@"
fi
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -gt 0 ]; then
    if ! ls data/fineweb10B/fineweb_train_*.bin >/dev/null 2>&1 || ! ls data/fineweb10B/fineweb_val_*.bin >/dev/null 2>&1; then
        echo "The record config trains on FineWeb shards in data/fineweb10B/; fetching them (about 1.9 GB)."
        python data/cached_fineweb10B.py
    fi
    exec torchrun --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
fi
echo "No CUDA GPU: training the CPU preset on the embedded Shakespeare shards."
exec python train_gpt.py --preset cpu "$@"
