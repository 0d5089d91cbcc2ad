"""Pipeline parallelism on gloo processes: each schedule, a middle stage and pipeline x data parallel train the
one-process model; the stage split, the plan's memory, and the layouts it refuses."""
import pytest

import train_gpt
from distributed import run_on_ranks
from layouts import assert_holds_what_the_plan_predicts, assert_trains_like_one_process, train_steps
from synthetic import tiny_flags


@pytest.mark.parametrize("stages, schedule", [(2, "afab"), (3, "1f1b")])
def test_pipeline_stages_train_the_one_process_model(files, single, stages, schedule):
    # the tiny model's 6 blocks: 2 stages split at the U-Net's middle (three skips cross); 3 stages give a middle
    # stage that both receives and sends, with encoder skips passing through it
    ranks = run_on_ranks(train_steps, stages, files, 3, None, dict(pp=stages, pp_schedule=schedule))
    assert_trains_like_one_process(ranks, single)
    assert_holds_what_the_plan_predicts(ranks, files, pp=stages, pp_schedule=schedule)
    assert "embed.weight" in ranks[0]["params"] and "lm_head.weight" in ranks[-1]["params"]
    for rank in ranks:  # each parameter on one stage only
        assert sum(name in other["params"] for other in ranks for name in rank["params"]) == len(rank["params"])


@pytest.mark.parametrize("layout", [dict(pp=2), dict(pp=2, zero=3), dict(pp=2, tp=2, sp=True)])
def test_pipeline_2_combined_on_four_processes_trains_the_one_process_model(files, single, layout):
    # pipeline x data parallel (plain, and with ZeRO 3 inside each stage), and pipeline x tensor parallel with
    # sequence-sharded carries
    ranks = run_on_ranks(train_steps, 4, files, 3, None, layout, timeout=600)
    assert_trains_like_one_process(ranks, single)
    assert ranks[0]["params"].keys() == ranks[1]["params"].keys()  # ranks 0, 1: within stage 0
    assert_holds_what_the_plan_predicts(ranks, files, **layout)


def test_stages_split_the_blocks_evenly_and_in_order():
    for num_layers, stages in [(12, 1), (12, 5), (6, 4), (7, 7)]:
        split = [train_gpt.stage_layers(num_layers, stages, s) for s in range(stages)]
        assert [i for layers in split for i in layers] == list(range(num_layers))
        assert max(map(len, split)) - min(map(len, split)) <= 1


def test_the_carry_holds_the_skips_each_boundary_leaves_pending():
    # 12 layers: encoder 0-5 pushes a skip after each block, decoder 6-11 pops one before each
    model = train_gpt.GPT(100, 12, 2, 8, 16, 128, "L" * 12, layers=range(4, 9))
    assert len(model.carry_shapes(4, 128)) == 2 + 3 + 4  # x, x0, value embeddings, skips of blocks 0-3
    assert len(model.carry_shapes(9, 128)) == 2 + 3 + 3  # skips of blocks 0-2 still to be taken by 9-11
    assert [name.split(".")[1] for name, _ in model.named_parameters() if name.startswith("blocks.")][:1] == ["4"]
    assert model.embed is None and model.lm_head is None


@pytest.mark.parametrize("world_size, flags, words", [
    (3, ["--pp", "2"], r"--tp 1 x --pp 2 = 2 does not divide the world size 3"),
    (7, ["--pp", "7"], "--pp 7 must be between 1 and --num_layers 6"),
    (4, ["--pp", "2", "--seqs_per_step", "2"], r"--pp 2 stages need at least 2 micro-batches per step .* gives 1"),
    (2, ["--pp", "2", "--pp_schedule", "zigzag"], "--pp_schedule must be one of"),
])
def test_pipeline_layouts_that_do_not_fit_are_refused_by_name(files, world_size, flags, words):
    with pytest.raises(train_gpt.UserError, match=words):
        args = train_gpt.parse_args(tiny_flags(files) + flags, cuda=False)
        train_gpt.check_world_size(args, world_size)
