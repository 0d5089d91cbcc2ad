"""The .bin shard format and the distributed batch generator."""
import numpy as np
import pytest
import torch

from train_gpt import (SHARD_HEADER_BYTES, SHARD_MAGIC, UserError, DistributedDataLoader, load_data_shard,
                       read_shard_header, write_data_shard)

CPU = torch.device("cpu")


def test_shard_round_trip(tmp_path):
    tokens = np.array([50256, 0, 1, 65535, 1234], dtype=np.int64)
    path = tmp_path / "s.bin"
    write_data_shard(path, tokens)
    raw = np.fromfile(path, dtype="<i4", count=3)
    assert raw.tolist() == [SHARD_MAGIC, 1, 5]
    assert path.stat().st_size == SHARD_HEADER_BYTES + 2 * 5
    assert read_shard_header(path) == 5
    assert load_data_shard(path).to(torch.int64).tolist() == tokens.tolist()
    assert not list(tmp_path.glob("*.tmp"))


def corrupt(path, kind):
    data = bytearray(path.read_bytes())
    if kind == "magic":
        data[0:4] = np.int32(12345).tobytes()
    elif kind == "version":
        data[4:8] = np.int32(7).tobytes()
    elif kind == "truncated":
        data = data[:-3]
    elif kind == "header_only":
        data = data[:100]
    elif kind == "count":
        data[8:12] = np.int32(1000).tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind, words", [("magic", "magic number"), ("version", "version 7"),
                                         ("truncated", "truncated"), ("header_only", "shorter than"),
                                         ("count", "1000 tokens")])
def test_bad_shard_is_refused_naming_file(tmp_path, kind, words):
    path = tmp_path / f"bad_{kind}.bin"
    write_data_shard(path, np.arange(100))
    corrupt(path, kind)
    with pytest.raises(UserError, match=words) as err:
        read_shard_header(path)
    assert str(path) in str(err.value)
    # the generator checks every shard before yielding anything
    with pytest.raises(UserError, match=str(path)):
        next(DistributedDataLoader(str(tmp_path / "*.bin"), 8, 2, 0, 1, CPU))


def test_pattern_matching_nothing_is_refused(tmp_path):
    with pytest.raises(UserError, match="matches no file"):
        next(DistributedDataLoader(str(tmp_path / "nothing_*.bin"), 8, 2, 0, 1, CPU))


def write_shards(tmp_path, sizes):
    tokens = np.arange(sum(sizes)) % 50000
    start = 0
    for i, n in enumerate(sizes):
        write_data_shard(tmp_path / f"train_{i:06d}.bin", tokens[start:start + n])
        start += n
    return tokens


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_rank_slices_together_equal_the_single_rank_batch(tmp_path, world_size):
    seq_len, seqs = 16, 8
    write_shards(tmp_path, [300, 200])  # the second batch does not fit shard 0: moves to shard 1
    pattern = str(tmp_path / "train_*.bin")
    single = DistributedDataLoader(pattern, seq_len, seqs, 0, 1, CPU)
    ranks = [DistributedDataLoader(pattern, seq_len, seqs, r, world_size, CPU) for r in range(world_size)]
    for _ in range(3):  # three global batches
        expected = [next(single) for _ in range(seqs)]
        got = [None] * seqs
        for micro in range(seqs // world_size):
            for r in range(world_size):
                got[micro * world_size + r] = next(ranks[r])
        for (ei, et), (gi, gt) in zip(expected, got):
            assert torch.equal(ei, gi) and torch.equal(et, gt)


def test_batches_are_contiguous_and_move_to_the_next_shard(tmp_path):
    write_shards(tmp_path, [300, 200])
    gen = DistributedDataLoader(str(tmp_path / "train_*.bin"), 16, 8, 0, 1, CPU)
    first = [next(gen) for _ in range(8)]
    assert first[0][0].dtype == torch.int32 and first[0][1].dtype == torch.int64
    inputs = torch.cat([x for x, _ in first])
    assert inputs.tolist() == list(range(128))  # shard 0 tokens 0..127
    assert torch.equal(first[3][1], torch.arange(49, 65))  # targets are the inputs shifted by one
    second = [next(gen) for _ in range(8)]
    assert second[0][0][0].item() == 128  # 256 + 1 tokens fit in 300
    third = next(gen)
    assert third[0][0].item() == 300  # 257 + 129 > 300: shard 1 starts the next batch
    with pytest.raises(UserError, match="out of data"):
        for _ in range(20):
            next(gen)


def test_a_loader_resumed_from_its_position_continues_the_same_stream(tmp_path):
    write_shards(tmp_path, [300, 200, 400])
    pattern = str(tmp_path / "train_*.bin")
    loader = DistributedDataLoader(pattern, 16, 8, 1, 2, CPU)  # rank 1 of 2: four micro-batches a batch
    for _ in range(3 * 4):
        next(loader)
    # batches of 128 (+1) tokens start at 0 and 128 of shard 0, then 0 of shard 1; the next starts at 128
    assert loader.position() == {"shard": "train_000001.bin", "offset": 128}
    resumed = DistributedDataLoader(pattern, 16, 8, 1, 2, CPU, position=loader.position())
    for _ in range(2 * 4):  # across the move to shard 2
        (a, b), (c, d) = next(loader), next(resumed)
        assert torch.equal(a, c) and torch.equal(b, d)
    assert resumed.position() == loader.position() == {"shard": "train_000002.bin", "offset": 256}
    with pytest.raises(UserError, match="shard train_000009.bin, which --train_files"):
        DistributedDataLoader(pattern, 16, 8, 1, 2, CPU, position={"shard": "train_000009.bin", "offset": 0})


# Documents aligned to sequences: a shard of documents whose tokens name them (100 x document + position, the
# start being EOT), so each sequence can be read off by hand
EOT = 50256


def write_documents(path, lengths, first_doc=0):
    docs = [[EOT] + [100 * d + i for i in range(1, n)] for d, n in enumerate(lengths, start=first_doc)]
    write_data_shard(path, np.concatenate(docs))


def doc(d, start, end):
    """Tokens start..end-1 of document d, as written by write_documents."""
    return [EOT if i == 0 else 100 * d + i for i in range(start, end)]


DOC_LENGTHS = [5, 3, 12, 4, 2, 9, 6, 8, 20, 3]


def test_aligned_sequences_start_at_a_document_and_cut_long_ones_as_worked_by_hand(tmp_path):
    # sequences of 7 inputs (+1 target) from documents cut after 6 tokens, 2 sequences a batch:
    #   seq 0: doc 0 whole (5), doc 1 whole (3)            -> 8 tokens; next document 2
    #   seq 1: doc 2 cut at 6, doc 3's first 2 (to fill)   -> 8; next document 4 (doc 3's rest is skipped)
    #   seq 2: doc 4 whole (2), doc 5 cut at 6             -> 8; next document 6
    #   seq 3: doc 6 whole (6), doc 7's first 2            -> 8; next document 8
    write_documents(tmp_path / "train_000000.bin", DOC_LENGTHS)
    loader = DistributedDataLoader(str(tmp_path / "train_*.bin"), 7, 2, 0, 1, CPU, doc_max_tokens=6)
    expected = [doc(0, 0, 5) + doc(1, 0, 3), doc(2, 0, 6) + doc(3, 0, 2), doc(4, 0, 2) + doc(5, 0, 6),
                doc(6, 0, 6) + doc(7, 0, 2)]
    for tokens in expected:
        inputs, targets = next(loader)
        assert inputs.tolist() == tokens[:-1] and targets.tolist() == tokens[1:]
        assert inputs[0].item() == EOT
    assert loader.position() == {"shard": "train_000000.bin", "offset": sum(DOC_LENGTHS[:8])}  # document 8's start
    # without a cut the same shard reads as one stream, documents split anywhere
    stream = DistributedDataLoader(str(tmp_path / "train_*.bin"), 7, 2, 0, 1, CPU)
    next(stream)
    assert next(stream)[0].tolist() == (doc(1, 2, 3) + doc(2, 0, 6))  # tokens 7..13


def test_aligned_batches_move_to_the_next_shard_and_resume_from_their_position(tmp_path):
    # shard 0's documents fill two batches of 2 x 8 tokens (and part of a third: skipped); shard 1 continues
    write_documents(tmp_path / "train_000000.bin", DOC_LENGTHS)
    write_documents(tmp_path / "train_000001.bin", [9] * 8, first_doc=20)
    pattern = str(tmp_path / "train_*.bin")
    loader = DistributedDataLoader(pattern, 7, 2, 0, 1, CPU, doc_max_tokens=6)
    for _ in range(4):
        next(loader)
    # documents 8 (cut at 6) and 9 (3) leave 8 - 6 - 3 < 0: one sequence, not two: the batch moves to shard 1
    resumed = DistributedDataLoader(pattern, 7, 2, 0, 1, CPU, doc_max_tokens=6, position=loader.position())
    for a, b in ((next(loader), next(resumed)) for _ in range(4)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    first = DistributedDataLoader(pattern, 7, 2, 0, 1, CPU, doc_max_tokens=6, position={
        "shard": "train_000000.bin", "offset": sum(DOC_LENGTHS[:8])})
    assert next(first)[0].tolist() == (doc(20, 0, 6) + doc(21, 0, 2))[:-1]
    with pytest.raises(UserError, match="doc_max_tokens 6"):
        for _ in range(10):
            next(loader)


def test_a_loader_reshaped_between_batches_reads_on_in_the_new_shape_as_worked_by_hand(tmp_path):
    # the staged batch (#46): one batch of 2 x 4 tokens as a stream (tokens 0..8), then one of 2 x 7 from documents
    # cut at 6 (from document 2, at token 8, as in the test above: next document 6, at 35), then one of 2 x 3 as a
    # stream again (tokens 35..41)
    write_documents(tmp_path / "train_000000.bin", DOC_LENGTHS)
    loader = DistributedDataLoader(str(tmp_path / "train_*.bin"), 4, 2, 0, 1, CPU)
    batches = {(4, 0): [doc(0, 0, 5), doc(0, 4, 5) + doc(1, 0, 3) + doc(2, 0, 1)],
               (7, 6): [doc(2, 0, 6) + doc(3, 0, 2), doc(4, 0, 2) + doc(5, 0, 6)],
               (3, 0): [doc(6, 0, 4), doc(6, 3, 6) + doc(7, 0, 1)]}
    for shape, expected in batches.items():
        loader.set_shape(*shape)
        for tokens in expected:
            inputs, targets = next(loader)
            assert inputs.tolist() == tokens[:-1] and targets.tolist() == tokens[1:], shape
    assert loader.position() == {"shard": "train_000000.bin", "offset": 41}


@pytest.mark.parametrize("world_size", [2, 4])
def test_aligned_rank_slices_together_equal_the_single_rank_batch(tmp_path, world_size):
    rng = np.random.default_rng(0)
    write_documents(tmp_path / "train_000000.bin", rng.integers(1, 30, 200).tolist())
    pattern = str(tmp_path / "train_*.bin")
    single = DistributedDataLoader(pattern, 16, 4, 0, 1, CPU, doc_max_tokens=10)
    ranks = [DistributedDataLoader(pattern, 16, 4, r, world_size, CPU, doc_max_tokens=10) for r in range(world_size)]
    for _ in range(5):
        expected = [next(single) for _ in range(4)]
        got = [None] * 4
        for micro in range(4 // world_size):
            for r in range(world_size):
                got[micro * world_size + r] = next(ranks[r])
        for (ei, et), (gi, gt) in zip(expected, got):
            assert torch.equal(ei, gi) and torch.equal(et, gt) and ei[0].item() == EOT
