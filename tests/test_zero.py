"""ZeRO 1, 2 and 3 over two gloo processes: the same training as one process; and for each layout the memory and
the bytes --plan predicts."""
import re

import pytest
import torch

import train_gpt
from distributed import run_on_ranks
from layouts import assert_holds_what_the_plan_predicts, train_steps
from synthetic import tiny_flags
from test_checkpoints import main_on_rank


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_on_two_ranks_trains_the_one_process_model_holding_what_the_plan_says(files, single, zero):
    ranks = run_on_ranks(train_steps, 2, files, 3, None, dict(zero=zero))
    # gradients after the first step, compared directly (an Adam update would hide a constant factor); under
    # ZeRO 2 and 3 each gradient lives on exactly one rank
    seen = sorted(name for rank in ranks for name in rank["grads"])
    assert seen == sorted(list(single["grads"]) * (2 if zero < 2 else 1))
    for rank in ranks:
        for name, grad in rank["grads"].items():
            torch.testing.assert_close(torch.as_tensor(grad), single["grads"][name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"gradient of {name}: {m}")
        assert rank["losses"] == pytest.approx(single["losses"], rel=1e-6)
        # (1e-4: see test_data_parallel; Adam can turn summation-order rounding into ~1e-5 moves)
        for name, param in single["params"].items():
            torch.testing.assert_close(torch.as_tensor(rank["params"][name]), param.detach(), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"parameter {name}: {m}")
    assert_holds_what_the_plan_predicts(ranks, files, zero=zero)
    full = single["held"]
    assert sum(rank["held"]["gradients"] for rank in ranks) == full["gradients"] * (2 if zero < 2 else 1)
    if zero >= 3:  # one copy of the parameters across the ranks, and of the optimizer state from stage 1 on
        assert sum(rank["held"]["parameters"] for rank in ranks) == full["parameters"]
    assert sum(rank["held"]["optimizer_states"] for rank in ranks) == full["optimizer_states"]


@pytest.mark.parametrize("layout", [dict(), dict(zero=2), dict(zero=3), dict(zero=1, tp=2),
                                    dict(tp=2, sp=True, async_tp=True), dict(pp=2)])
def test_counted_collective_bytes_per_step_equal_the_plan(tmp_path, files, layout):
    flags = tiny_flags(files, **layout, log_dir=tmp_path, run_id="comm", num_iterations=2)
    run_on_ranks(main_on_rank, 2, flags)
    log = (tmp_path / "comm.txt").read_text()
    lines = re.findall(r"^comm: step:(\d+) bytes per rank (.*)$", log, flags=re.M)
    assert [step for step, _ in lines] == ["1"]  # logged once: every step sends the same
    counted = {op: int(n) for op, n in (item.split(":") for item in lines[0][1].split())}
    plan = train_gpt.plan_layout(train_gpt.parse_args(flags, cuda=False), 2, cuda=False)
    assert counted == plan["ranks"][0]["comm"]


def test_plan_prints_per_rank_memory_for_the_record_on_eight_gpus(capsys):
    train_gpt.main(["--preset", "record", "--plan", "true", "--nproc", "8", "--zero", "1"])
    out = capsys.readouterr().out
    assert "8 processes = pipeline 1 x data parallel 8 x tensor parallel 1, ZeRO stage 1" in out
    assert len(re.findall(r"^\s+\d+\s+\d+\s+\d+\.\d+ ", out, flags=re.M)) == 8  # one memory row per rank
