"""Small synthetic token shards (documents of random length, each starting with EOT) for trainer tests, and flags
that make a preset's model small."""
import numpy as np

from train_gpt import EOT_TOKEN, write_data_shard


def write_synthetic_shards(directory, train_tokens=150_000, val_tokens=6_000, seed=0):
    """Token streams with learnable structure (a noisy repeating pattern), so loss can fall in a few steps."""
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, 2000, 97)

    def stream(n):
        out = []
        while sum(map(len, out)) < n:
            length = int(rng.integers(60, 400))
            doc = pattern[(np.arange(length) + rng.integers(0, 97)) % 97].copy()
            noise = rng.random(length) < 0.1
            doc[noise] = rng.integers(0, 2000, int(noise.sum()))
            out.append(np.concatenate([[EOT_TOKEN], doc]))
        return np.concatenate(out)[:n]

    write_data_shard(f"{directory}/synth_val_000000.bin", stream(val_tokens))
    write_data_shard(f"{directory}/synth_train_000001.bin", stream(train_tokens))
    return dict(train_files=f"{directory}/synth_train_*.bin", val_files=f"{directory}/synth_val_*.bin")


def tiny_flags(files, **overrides):
    """Flags for a seconds-long CPU run on the synthetic shards, their sequences made of documents as the record's."""
    values = dict(preset="tiny", train_files=files["train_files"], val_files=files["val_files"], train_seq_len=128,
                  seqs_per_step=4, val_seq_len=128, val_tokens=512, doc_max_tokens=256)
    values.update(overrides)
    return [f"--{k}={v}" for k, v in values.items()]


# a preset's model cut to two layers (every layer-index flag emptied, one value table, no MUDD): for tests that plan
# it many times, whose point is not its layers
TWO_LAYERS = ["--num_layers", "2", "--long_window_layers", "1", "--key_offset_layers", "1", "--value_embed_layers", "1",
              "--mudd", "false"] + [f"--{name}=" for name in ("attention_free_layers", "paired_head_layers", "dc_layers",
                                                             "gate_network_layers", "xsa_layers", "output_gate_layers",
                                                             "skip_layers", "attend_over_layer")]
