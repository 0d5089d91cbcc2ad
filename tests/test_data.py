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
