"""Ready for the GPU a user has: FP8 only where the GPU has it, and a run refused before any work when its plan
does not fit the GPU's memory (capabilities and memory sizes faked: no GPU here)."""
import dataclasses
import json
import re

import pytest

import train_gpt
from synthetic import TWO_LAYERS


@pytest.mark.parametrize("capability, fp8", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)])
def test_the_record_s_fp8_head_is_turned_off_on_a_gpu_without_fp8_and_the_log_says_so(capability, fp8):
    args = train_gpt.parse_args([], cuda=True)  # the record: fp8_head by default
    line = train_gpt.settle_fp8(args, capability, "NVIDIA A100-SXM4-80GB")
    assert args.fp8_head is fp8
    assert (line is None) is fp8
    if not fp8:
        assert line == (f"fp8: off: NVIDIA A100-SXM4-80GB (compute capability {capability[0]}.{capability[1]}) has "
                        "no FP8 matmul; the head multiplies in bf16 (fp8_head false)")
        assert json.loads(json.dumps(train_gpt.dataclasses.asdict(args)))["fp8_head"] is False  # the log's line


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_fp8_head_asked_for_on_a_gpu_without_fp8_is_refused(capability):
    args = train_gpt.parse_args(["--fp8_head", "true"], cuda=True)
    if capability >= (8, 9):
        assert train_gpt.settle_fp8(args, capability, "NVIDIA H100 80GB HBM3") is None and args.fp8_head
        return
    with pytest.raises(train_gpt.UserError, match=r"--fp8_head true needs FP8 matmul \(compute capability 8\.9 or "
                                                  r"newer.*\), and NVIDIA H100 80GB HBM3 \(compute capability 8\.0\) "
                                                  r"has no FP8 matmul: drop the flag"):
        train_gpt.settle_fp8(args, capability, "NVIDIA H100 80GB HBM3")


def test_the_memory_check_refuses_the_record_on_a_24_gib_gpu_saying_what_fits_and_runs_it_on_80():
    # the record on one GPU, compiled (one micro-batch a step: what a GPU holds at once, and a quicker plan)
    args = train_gpt.parse_args(["--preset", "record89", "--compile", "true", "--seqs_per_step", "1"], cuda=True)
    need = train_gpt.planned_peak(args, 1)
    assert 25 * 2**30 < need < 35 * 2**30  # near the 30.7 GB the reference design measured on an H100
    with pytest.raises(train_gpt.UserError, match=r"this run needs about \d+\.\d GiB on a GPU by its plan .* the GPU "
                                                  r"has 24\.0 GiB free: it would fit with --train_seq_len 8192,16384,24576,24576; "
                                                  r"--memory_check false runs it anyway"):
        train_gpt.check_memory(args, 1, 24 * 2**30)
    train_gpt.check_memory(args, 1, 80 * 2**30)


def test_the_memory_check_names_zero_3_and_more_processes_where_the_model_states_do_not_fit():
    # 2 processes, a short sequence: the parameters, gradients and optimizer states fill the GPU; ZeRO 3 splits
    # them, and so do 4 processes with ZeRO 3 and the tables held by rows, while a shorter sequence is not enough.
    # The record's width and tables in two layers (fewer to plan): its tables are most of its model states already
    args = train_gpt.parse_args(["--preset", "record89", "--train_seq_len", "256", "--val_seq_len", "256",
                                 "--val_tokens", "2048", "--compile", "false", "--seqs_per_step", "4", *TWO_LAYERS],
                                cuda=True)
    free = train_gpt.planned_peak(args, 2) - 2**28
    with pytest.raises(train_gpt.UserError, match=r"it would fit with --zero 3 or 4 processes with --zero 3 or "
                                                  r"--zero 1 --tables_by_rows true or --ngram_rows \d+ \(the "
                                                  r"largest n-gram table that fits\);"):
        train_gpt.check_memory(args, 2, int(free / train_gpt.MEMORY_HEADROOM))


def test_the_memory_check_names_the_largest_ngram_table_that_fits():
    # #92's n-gram table is most of its model; a GPU too small for this one (2M rows) is told the most rows that
    # fit: the free memory is a 1M-row table's plan, so about 1M (the plan prices a row from two plans, and checks)
    flags = ["--preset", "record89", "--train_seq_len", "256", "--val_seq_len", "256", "--val_tokens", "2048",
             "--compile", "false", "--seqs_per_step", "1", "--trigrams", "true", *TWO_LAYERS]
    args = train_gpt.parse_args([*flags, "--ngram_rows", "2000000"], cuda=True)
    free = train_gpt.planned_peak(dataclasses.replace(args, ngram_rows=1_000_000), 1) / train_gpt.MEMORY_HEADROOM
    with pytest.raises(train_gpt.UserError, match=r"it would fit with --ngram_rows (\d+) \(the largest n-gram table "
                                                  r"that fits\); --memory_check false") as refused:
        train_gpt.check_memory(args, 1, int(free))
    rows = int(re.search(r"--ngram_rows (\d+)", str(refused.value)).group(1))
    assert 990_000 <= rows <= 1_000_000 and rows % 2 == 0
    assert train_gpt.planned_peak(dataclasses.replace(args, ngram_rows=rows), 1) <= free * train_gpt.MEMORY_HEADROOM


def test_every_change_the_memory_check_advises_is_one_a_run_accepts_and_it_fits():
    # the advice is checked as the run would check it: with #92's tail averages, which ZeRO 3 does not keep, neither
    # --zero 3 nor more processes with it is advised; a host tier for a table stepped by row is, with its host memory;
    # each advised change, taken, is accepted and fits
    base = ["--preset", "record89", "--train_seq_len", "256", "--val_seq_len", "256", "--val_tokens", "2048",
            "--compile", "false", "--seqs_per_step", "4", "--tail_average", "true", "--ngram_optimizer", "rows",
            *TWO_LAYERS]
    args = train_gpt.parse_args(base, cuda=True)
    room = train_gpt.planned_peak(dataclasses.replace(args, zero=3, compile=False), 4) + 2**24  # (ZeRO 3 would fit)
    assert train_gpt.planned_peak(args, 2) > room
    with pytest.raises(train_gpt.UserError, match=r"it would fit with ") as refused:
        train_gpt.check_memory(args, 2, int(room / train_gpt.MEMORY_HEADROOM))
    advice = re.search(r"it would fit with (.*); --memory_check", str(refused.value)).group(1)
    assert "--zero 3" not in advice and "--table_host_fraction" in advice and "GB of pinned host memory" in advice
    for change in re.sub(r" \([^)]*\)", "", advice).split(" or "):
        processes = re.match(r"(\d+) processes with (.*)", change)
        world_size, flags = (int(processes[1]), processes[2]) if processes else (2, change)
        taken = train_gpt.parse_args([*base, *flags.split()], cuda=True)
        train_gpt.check_world_size(taken, world_size)
        assert train_gpt.planned_peak(taken, world_size) <= room, change
