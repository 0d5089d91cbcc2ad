#!/usr/bin/env bash
# Train: the record config on every CUDA GPU of this machine, or the CPU preset on the embedded data.
# Extra arguments go to train_gpt.py (e.g. ./run.sh --num_iterations 50).
set -euo pipefail
cd "$(dirname "$0")"

gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -gt 0 ]; then
    if ! ls data/fineweb10B/fineweb_train_*.bin >/dev/null 2>&1 || ! ls data/fineweb10B/fineweb_val_*.bin >/dev/null 2>&1; then
        echo "The record config trains on FineWeb shards in data/fineweb10B/, which are missing." >&2
        echo "Fetch them first (about 1.9 GB):  python data/cached_fineweb10B.py" >&2
        exit 1
    fi
    exec torchrun --standalone --nproc_per_node="$gpus" train_gpt.py "$@"
fi
echo "No CUDA GPU: training the CPU preset on the embedded Shakespeare shards."
exec python train_gpt.py --preset cpu "$@"
