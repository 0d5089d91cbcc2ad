"""Benchmark (not a test) of the embedding tables' gradient traffic under data parallelism: each of the record's
tables averaged by the rows the ranks looked up (GradientBuckets.average_rows) against averaged whole (an all-reduce,
or with --zero, where each rank keeps its rows of a table, a reduce-scatter), on gloo processes.

    python tests/benchmark_tables.py [--ranks 8] [--width 128] [--zero 0] [--shard PATH]

Each rank looks up its share of one of Adam's steps in the record's last stage (adam_every steps of its 49,152
tokens), read in order from the shard (default: the Shakespeare train shard, whose narrow vocabulary touches fewer
rows than FineWeb would), in the record's token, value-embedding and bigram tables, at --width columns of float32
(the bytes scale with it; a row's index adds 8 bytes). It prints per table the rows, the rows each rank looked up and
all ranks together, the bytes each rank handed to collectives and the seconds, both ways, and their ratios.
"""
import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

import train_gpt  # noqa: E402
from tool_inputs import need, need_at_least, run_tool  # noqa: E402


def record_tables(args) -> dict[str, int]:
    """The record's embedding tables by name, each -> its rows."""
    model = train_gpt.build_model(args, torch.device("meta"))
    names = {p: name for name, p in model.named_parameters()}
    return {names[p]: len(p) for p in train_gpt.embedding_tables(model)}


def lookups(name: str, rows: int, tokens: torch.Tensor) -> torch.Tensor:
    """The rows of table `name` that these tokens look up."""
    return train_gpt.bigram_rows(tokens, rows).long() if "ngram" in name else tokens.long()


def measure(rank: int, world_size: int, shard: str, tokens_per_rank: int, width: int, zero: bool) -> dict:
    args = train_gpt.parse_args(["--preset", "record89"], cuda=False)
    stream = train_gpt.load_data_shard(shard)
    tokens = stream[rank * tokens_per_rank:(rank + 1) * tokens_per_rank]
    keeper = train_gpt.ROW_OWNERS if zero else None
    results = {}
    for name, rows in record_tables(args).items():
        found = lookups(name, rows, tokens)
        table = torch.nn.Parameter(torch.zeros(rows, width))
        buckets = train_gpt.GradientBuckets([table], dp=train_gpt.world_axis(rank, world_size),
                                            owner_of={table: keeper} if zero else None, reduce_to_owner=zero,
                                            tables={table: None})
        gradient = torch.zeros(rows, width).index_add_(0, found, torch.ones(len(found), width))
        figures = {}
        for way, average in (("by_rows", buckets.average_rows), ("whole", buckets._average_whole)):
            grad = gradient.clone()
            train_gpt.comm_bytes.clear()
            torch.distributed.barrier()
            start = time.perf_counter()
            average(grad, table if way == "by_rows" else keeper)
            torch.distributed.barrier()
            figures[way] = (sum(train_gpt.comm_bytes.values()), time.perf_counter() - start)
        union = torch.zeros(rows, dtype=torch.int32).index_fill_(0, found.unique(), 1)
        torch.distributed.all_reduce(union, op=torch.distributed.ReduceOp.MAX)
        results[name] = dict(rows=rows, looked_up=len(found.unique()), union=int(union.sum()), **figures)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--zero", type=int, default=0, help="a ZeRO stage: 1 and up: each rank keeps its rows")
    parser.add_argument("--shard", default=str(REPO_ROOT / "data/shakespeare/shakespeare_train_000001.bin"))
    options = parser.parse_args()
    need_at_least("--ranks", options.ranks, 1, "gloo processes")
    need_at_least("--width", options.width, 1, "columns of each table")
    need(options.zero in (0, 1, 2, 3), f"--zero {options.zero}: give a ZeRO stage, 0 to 3")
    need(Path(options.shard).is_file(), f"--shard {options.shard} is not a file: name a .bin token shard")
    args = train_gpt.parse_args(["--preset", "record89"], cuda=False)
    last_step = args.num_iterations - 1
    tokens_per_rank = train_gpt.batch_shape(last_step, args)[0] * args.adam_every
    held = len(train_gpt.load_data_shard(options.shard))
    need(held >= tokens_per_rank * options.ranks, f"--shard {options.shard} holds {held:,} tokens, and --ranks "
         f"{options.ranks} need {tokens_per_rank * options.ranks:,}: give fewer ranks or a longer shard")
    results = train_gpt.run_on_ranks(measure, options.ranks, options.shard, tokens_per_rank, options.width,
                                     options.zero > 0, timeout=1800)
    print(f"{options.ranks} ranks, {tokens_per_rank:,} tokens each (adam_every {args.adam_every} of the record's last "
          f"steps), width {options.width} float32, {'ZeRO: each rank its rows' if options.zero else 'every rank'}")
    print(f"{'table':24s} {'rows':>8s} {'per rank':>9s} {'all':>8s}   {'bytes by rows':>14s} {'whole':>14s} "
          f"{'ratio':>6s}   {'s by rows':>9s} {'whole':>7s} {'ratio':>6s}")
    for name in results[0]:
        r = results[0][name]
        looked_up = sum(rank[name]["looked_up"] for rank in results) / len(results)
        sent = [max(rank[name][way][0] for rank in results) for way in ("by_rows", "whole")]
        seconds = [max(rank[name][way][1] for rank in results) for way in ("by_rows", "whole")]
        print(f"{name:24s} {r['rows']:8,d} {looked_up:9,.0f} {r['union']:8,d}   {sent[0]:14,d} {sent[1]:14,d} "
              f"{sent[1] / sent[0]:6.2f}   {seconds[0]:9.3f} {seconds[1]:7.3f} {seconds[1] / seconds[0]:6.2f}")


if __name__ == "__main__":
    run_tool(main, train_gpt.UserError)
