"""Record #91's canonical token mask: the pairs (previous token, next token) GPT-2's tokenizer never writes. Its size
against the count #91's own builder gives on GPT-2's ranks, each masked pair against the tokenizer itself (the two
tokens' text re-encoded), and text the tokenizer wrote (the embedded Shakespeare) against the mask."""
import errno
import os
import re
import signal
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt
from conftest import REPO_ROOT

VOCAB_ROWS = 50304  # GPT-2's 50,257 tokens padded to a multiple of 128
# by hand: (previous, next) pairs that GPT-2 re-encodes as one token or splits elsewhere, and pairs it writes
MASKED = {(220, 1169): "' ' 'the'", (400, 68): "'th' 'e'", (82, 403): "'s' 'un'", (16, 17): "'1' '2'",
          (1065, 18): "'12' '3'", (13, 13): "'.' '.'", (262, 260): "' the' 're'", (220, 16): "' ' '1'",
          (220, 13): "' ' '.'"}
WRITTEN = {(6, 82): "\"'\" 's' (a contraction: split off by the pre-tokenizer)", (338, 403): "\"'s\" 'un'",
           (198, 198): "'\\n' '\\n' (whitespace runs split by what follows)", (220, 220): "' ' ' '",
           (15496, 995): "'Hello' ' world'", (198, 464): "'\\n' 'The'", (16, 64): "'1' 'a'",
           (447, 247): "b'\\xe2\\x80' b'\\x99' (a character cut in two)"}


@pytest.fixture(scope="module")
def encoding(gpt2_ranks):
    return train_gpt.gpt2_encoding_from(gpt2_ranks)


@pytest.fixture(scope="module")
def packed(encoding):
    return train_gpt.canonical_mask_bits(encoding._mergeable_ranks, VOCAB_ROWS)


def never_after(packed, previous, following):
    """1 where GPT-2 never writes `following` after `previous` (arrays or ints): the bit of the previous token, its
    bits little-endian, in the next token's row (unpacked whole, the mask would be 2.5 GB)."""
    return packed[following, previous >> 3] >> (previous & 7) & 1


def test_the_mask_has_the_pairs_91s_builder_finds_and_none_beyond_gpt2s_tokens(packed):
    assert packed.shape == (VOCAB_ROWS, VOCAB_ROWS // 8) and packed.dtype == np.uint8
    # counts from #91's own function run on the same ranks file: in all, after token 220 and before token 82
    every = np.arange(VOCAB_ROWS)
    assert np.bitwise_count(packed).sum() == 70_889_701 and never_after(packed, 220, every).sum() == 16_185 and \
        np.bitwise_count(packed[82]).sum() == 34_162
    # end-of-text (50256, a whole byte's first bit) and the padding: never masked, before or after
    assert not packed[50256:].any() and not packed[:, 50256 // 8:].any()
    for (p, x), pair in MASKED.items():
        assert never_after(packed, p, x), pair
    for (p, x), pair in WRITTEN.items():
        assert not never_after(packed, p, x), pair


def test_every_masked_pair_sampled_re_encodes_otherwise(packed, encoding):
    """The two tokens' text encoded again is never the pair itself (where the two make whole UTF-8 text): 10 masked
    previous tokens of each of 500 next tokens drawn from those masked after some token."""
    words = {token: word for word, token in encoding._mergeable_ranks.items()}
    rng = np.random.default_rng(0)
    checked = 0
    for b in rng.choice(np.flatnonzero(packed.any(axis=1)), 500, replace=False).tolist():
        before = np.flatnonzero(np.unpackbits(packed[b], bitorder="little"))
        for a in rng.choice(before, min(10, len(before)), replace=False).tolist():
            try:
                text = (words[a] + words[b]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            assert encoding.encode_ordinary(text) != [a, b], (words[a], words[b])
            checked += 1
    assert checked > 4_000


def test_no_pair_of_the_embedded_shakespeare_is_masked(packed):
    """Text GPT-2's tokenizer wrote: every pair inside a document is one the mask lets through."""
    tokens = np.concatenate([train_gpt.load_data_shard(f).numpy().astype(np.int64)
                             for f in sorted((REPO_ROOT / "data" / "shakespeare").glob("*.bin"))])
    assert len(tokens) > 100_000
    previous, following = tokens[:-1], tokens[1:]
    inside = (previous != train_gpt.EOT_TOKEN) & (following != train_gpt.EOT_TOKEN)
    assert not never_after(packed, previous[inside], following[inside]).any()
    assert never_after(packed, np.full(1, 220), np.full(1, 1169)).all()  # (the lookup reads the mask it is given)


def head_loss(head, x, targets, previous):
    """The validation loss GPT.forward builds from the head's statistics."""
    stats = head(x, targets[:, None], previous=previous)
    return train_gpt.summed_loss(stats.log_probs(), stats.found)


def test_the_head_sets_the_masked_logits_after_the_soft_cap_in_every_row_chunk_as_an_fp64_reference():
    """LMHead in evaluation, masking: each row's logits of the next tokens never written after its previous token are
    -60 after the soft cap (#91's order), over chunks of rows; the loss against a dense float64 computation."""
    torch.manual_seed(0)
    vocab, tokens = 256, 13
    head = train_gpt.LMHead(16, vocab, soft_cap=(30.0, 5.0, 7.5), canonical_mask=True).eval()
    head.weight.data.normal_()
    x, previous, targets = torch.randn(tokens, 16), *torch.randint(0, vocab, (2, tokens))
    never = torch.rand(vocab, vocab) < 0.3  # [previous, next]
    never[previous, targets] = False  # (as in text the tokenizer wrote: a masked target would cost ~70 nats)
    head.canonical_mask.copy_(torch.from_numpy(np.packbits(never.T.numpy(), axis=1, bitorder="little")))
    logits = 30 * torch.sigmoid((x.double() @ head.weight.double().T + 5) / 7.5)
    expected = F.cross_entropy(logits.masked_fill(never[previous], -60.0), targets, reduction="sum")
    unmasked = F.cross_entropy(logits, targets, reduction="sum")
    head.EVAL_ROWS = 5  # three chunks, the last short
    with torch.no_grad():
        assert torch.isclose(head_loss(head, x, targets, previous).double(), unmasked, rtol=1e-5)  # not yet switched on
        head.masking = True
        got = head_loss(head, x, targets, previous).double()
    assert unmasked - expected > 1.0  # the mask matters here
    assert torch.isclose(got, expected, rtol=1e-5), (got, expected)


def train_steps_with_the_mask(rank, world_size, mask_file, flags, steps):
    """train_gpt.train_steps, the first rank reading the canonical mask from mask_file rather than building it (7 s)."""
    train_gpt.canonical_mask_bits = lambda ranks, rows: np.load(mask_file)
    return train_gpt.train_steps(rank, world_size, flags, steps)


def test_the_final_validation_is_masked_and_two_tensor_parallel_ranks_each_masking_their_part_agree_with_one(
        packed, monkeypatch, tmp_path):
    """The tiny model's final validation with --canonical_mask, on the embedded Shakespeare: below the same run's
    unmasked one (every masked column lowers the softmax's sum, and no target there is masked), and the same under
    --tp 2, where each rank holds the mask's rows of its half of the vocabulary (the mask the first rank sends is the
    fixture's, not built again)."""
    monkeypatch.setattr(train_gpt, "canonical_mask_bits", lambda ranks, rows: packed)
    shards = REPO_ROOT / "data" / "shakespeare"
    flags = ["--preset=tiny", "--num_iterations=1", "--adam_every=1", f"--train_files={shards}/shakespeare_train_*.bin",
             f"--val_files={shards}/shakespeare_val_*.bin"]
    masked = train_gpt.train_steps(0, 1, flags + ["--canonical_mask=true"], 1)["val_loss"]
    unmasked = train_gpt.train_steps(0, 1, flags, 1)["val_loss"]
    flags += ["--canonical_mask=true"]
    np.save(tmp_path / "mask.npy", packed)
    split = [rank["val_loss"] for rank in train_gpt.run_on_ranks(train_steps_with_the_mask, 2, tmp_path / "mask.npy",
                                                                 flags + ["--tp=2"], 1)]
    assert unmasked - masked > 1e-3, (masked, unmasked)
    assert split[0] == split[1] and abs(split[0] - masked) < 1e-5, (split, masked)


def test_the_first_rank_builds_the_mask_in_a_child_while_training_runs_and_builds_it_itself_if_the_child_fails(
        encoding, monkeypatch):
    """CanonicalMaskBuild (#92's overlap): the mask comes from a forked child, through shared memory; where the child
    fails, the final validation builds it in the rank itself. The builder stands in for the 7 s one, writing the id of
    the process it ran in."""
    parent = os.getpid()

    def signed(rows):  # a mask whose first row holds the id of the process that made it
        mask = np.zeros((rows, rows // 8), dtype=np.uint8)
        mask[0, :4] = np.frombuffer(np.int32(os.getpid()).tobytes(), dtype=np.uint8)
        return mask
    maker = lambda build: int(build.result()[0, :4].numpy().view(np.int32)[0])

    def fails_in_a_child(ranks, rows):
        if os.getpid() != parent:
            raise MemoryError("the child's build failed")
        return signed(rows)
    monkeypatch.setattr(train_gpt, "canonical_mask_bits", lambda ranks, rows: signed(rows))
    build = train_gpt.CanonicalMaskBuild(vocab_size=300)
    child = build.child
    assert child != parent and build.result().shape == (384, 48)
    assert maker(build) == child and maker(build) == child  # (asked twice: the same)
    monkeypatch.setattr(train_gpt, "canonical_mask_bits", fails_in_a_child)
    assert maker(train_gpt.CanonicalMaskBuild(vocab_size=300)) == parent


def test_a_stopped_child_is_ended_at_its_deadline_and_no_memory_to_share_builds_the_mask_in_the_process(
        encoding, monkeypatch, capsys):
    # a child stopped (SIGSTOP) never ends by itself: past CanonicalMaskBuild.DEADLINE_S from its start (here 1 s)
    # it is killed and the rank builds the mask; where no memory can be shared (a container's /dev/shm would not
    # have held it; here the mapping refused), the rank builds it too, each saying so in one line
    parent = os.getpid()

    def slow_in_a_child(ranks, rows):
        if os.getpid() != parent:
            time.sleep(30)
        return np.full((rows, rows // 8), 7, dtype=np.uint8)
    monkeypatch.setattr(train_gpt, "canonical_mask_bits", slow_in_a_child)
    monkeypatch.setattr(train_gpt.CanonicalMaskBuild, "DEADLINE_S", 1.0)
    build = train_gpt.CanonicalMaskBuild(vocab_size=300)
    os.kill(build.child, signal.SIGSTOP)
    child, started = build.child, time.monotonic()
    assert (build.result() == 7).all() and time.monotonic() - started < 5
    with pytest.raises(ChildProcessError):  # (ended, and waited for)
        os.waitpid(child, os.WNOHANG)
    assert "had not ended" in capsys.readouterr().err

    def no_mapping(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(train_gpt.mmap, "mmap", no_mapping)
    build = train_gpt.CanonicalMaskBuild(vocab_size=300)
    assert build.child is None and (build.result() == 7).all()
    assert "no memory to share with a child (No space left on device)" in capsys.readouterr().err


def test_a_run_masks_only_its_final_validation_with_the_mask_its_child_built(packed, monkeypatch, tmp_path):
    """train_gpt.main with --canonical_mask on the Shakespeare: the validation at step 0 is the unmasked run's, the
    final one below it (the child's build, here the fixture's mask handed to it, arrives through shared memory)."""
    monkeypatch.setattr(train_gpt, "canonical_mask_bits", lambda ranks, rows: packed)
    shards = REPO_ROOT / "data" / "shakespeare"
    flags = ["--preset=tiny", "--num_iterations=2", "--adam_every=1", "--val_loss_every=1",
             f"--train_files={shards}/shakespeare_train_*.bin", f"--val_files={shards}/shakespeare_val_*.bin",
             f"--log_dir={tmp_path}"]
    vals = {}
    for masked in ("true", "false"):
        train_gpt.main(flags + [f"--run_id={masked}", f"--canonical_mask={masked}"])
        log = (tmp_path / f"{masked}.txt").read_text()
        vals[masked] = [float(v) for v in re.findall(r"(?m)^step:\d+/2 val_loss:(\S+)", log)]
    assert vals["true"][:2] == vals["false"][:2] and len(vals["true"]) == 3  # steps 0 and 1: no mask
    assert vals["false"][2] - vals["true"][2] > 1e-3, vals


def test_a_run_with_the_mask_and_no_gpt2_ranks_is_refused_before_any_step(monkeypatch, tmp_path):
    """The first rank builds the mask from GPT-2's ranks: where they are missing the run is refused among its inputs,
    before the model is built, its log holding no step."""
    monkeypatch.setenv(train_gpt.GPT2_RANKS_ENV, str(tmp_path / "nowhere.tiktoken"))
    shards = REPO_ROOT / "data" / "shakespeare"
    flags = ["--preset=tiny", "--num_iterations=2", "--adam_every=1", "--canonical_mask=true", f"--log_dir={tmp_path}",
             f"--train_files={shards}/shakespeare_train_*.bin", f"--val_files={shards}/shakespeare_val_*.bin"]
    with pytest.raises(train_gpt.UserError, match=f"GPT2_TIKTOKEN_FILE names {tmp_path / 'nowhere.tiktoken'}"):
        train_gpt.main(flags)
    assert not list(tmp_path.glob("*.txt"))
