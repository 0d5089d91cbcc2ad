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
TWO_LAYERS = ["--num_layers", "2", "--window_pattern", "SL", "--value_embed_layers", "1", "--mudd", "false"] + [
    f"--{name}=" for name in ("attention_free_layers", "paired_head_layers", "dc_layers", "gate_network_layers",
                              "xsa_layers", "output_gate_layers", "skip_layers", "attend_over_layer")]


# record #92's model as this file's flags, over the record preset (#89's): its layer geometry, where x0 and the n-gram
# embedding join, its head's ten states and its n-gram table (its gates and value embeddings follow from these)
RECORD_92_MODEL = ["--attention_free_layers", "4,6,7,9", "--narrow_qk_layers", "0,1,2,5,8", "--narrow_v_layers", "1,8",
                   "--mlp_hidden", "2816", "--mlp_free_layers", "7", "--double_mlp_layers", "8",
                   "--attention_scale", "0.085", "--narrow_attention_scale", "0.13", "--rotary_follows", "own",
                   "--xsa_layers", "1,3", "--paired_head_layers", "0,2,5", "--value_embed_layers", "1,2,8,10",
                   "--dc_layers=", "--x0_layers", "0,1,2,4,5,7,10", "--bigram_layers", "0,1,4,5,9,10",
                   "--mudd_head", "92", "--trigrams", "true", "--bigram_rows", "84602880"]

# record #92's schedule as this file's flags (its package's config.py and schedule.py; its log prints these stage
# ends): 1,122 steps in three stages, 52 more in the third, its last 67 a taper to 20/24 of the batch at lr x the root
# of that, then 20 at a batch of 8 sequences; documents cut at 3072 tokens, attention at 2560; its sampled softmax's
# counts by step
RECORD_92_SCHEDULE = ["--num_iterations", "1194", "--extension_steps", "20", "--stage_steps", "320,681,1107",
                      "--train_seq_len", "16384,32768,49152,40960,16384", "--doc_max_tokens", "896,2048,3072,3072,3072",
                      "--attention_max_tokens", "2560", "--stage_lr", f"1,1.52,1.73,{1.73 * (20 / 24) ** 0.5!r}",
                      "--window_blocks", "1:3,3:7,5:11,5:11,6:13", "--cooldown_frac", "0.8", "--lr_final", "0.3",
                      "--tied_stages", "4", "--prefix_quarters", "true",
                      "--sampled_softmax", "0:10240,681:14336,965:24576,1107:0"]

# record #92's optimizers as this file's flags: ANVIL for the hidden matrices; its n-gram table stepped by rows and,
# with its value embeddings, on odd steps, then every fourth from step 336, at 70 x its base Adam lr 0.008
RECORD_92_OPTIMIZER = ["--matrix_optimizer", "anvil", "--muon_weight_decay", "2.25", "--muon_momentum_peak", "0.93",
                       "--muon_momentum_warmup_steps", "240", "--table_cadence", "0:2,336:4",
                       "--bigram_optimizer", "rows", "--lr_embed", "0.56"]
