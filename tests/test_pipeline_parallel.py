"""Pipeline parallelism on gloo processes: where each stage's parameters live, what crosses each boundary, the
stage split, and the layouts it refuses. (tests/test_layouts.py: the same training as one process.)"""
import pytest
import torch

import train_gpt
from layouts import train_step
from train_gpt import run_on_ranks
from synthetic import tiny_flags


@pytest.mark.parametrize("name", ["pp2_afab", "pp3_1f1b"])
def test_each_parameter_lives_on_one_stage_the_embeddings_first_and_the_head_last(layout_runs, name):
    # the tiny model's 6 blocks: 2 stages, with layer 1's output crossing to the skip into layer 4 (a parameter of
    # stage 1); 3 stages give a middle stage that both receives and sends, layer 1's output passing through it. The
    # one parameter two stages read is kept by both: the gate networks' scale, where the second network (layer 2's)
    # is on another stage than the first
    ranks = layout_runs(name)
    assert "embed.weight" in ranks[0]["held"] and "lm_head.weight" in ranks[-1]["held"]
    shared = {"gate_networks.0.scale"} if name == "pp3_1f1b" else set()
    assert {name for name in ranks[0]["held"] if any(name in other["held"] for other in ranks[1:])} == shared
    for rank in ranks:
        assert sum(name in other["held"] for other in ranks for name in rank["held"] if name not in shared) == \
            len(set(rank["held"]) - shared)


@pytest.mark.parametrize("name", ["dp2_pp2", "dp2_pp2_zero3", "pp2_tp2_sp"])
def test_ranks_of_one_stage_hold_the_same_parameters(layout_runs, name):
    ranks = layout_runs(name)
    assert ranks[0]["held"] == ranks[1]["held"]  # ranks 0, 1: within stage 0
    assert not set(ranks[0]["held"]) & set(ranks[2]["held"])


def stream_structures(rank, world_size, files, layout):
    """The structure of every stream this rank received or sent, after one training step and one evaluation."""
    args = train_gpt.parse_args(tiny_flags(files, **layout), cuda=False)
    ctx = train_gpt.build_parallel_context(rank, world_size, torch.device("cpu"), args.tp, args.pp)
    trainer = train_gpt.build_trainer(args, ctx)
    batches = train_gpt.DistributedDataLoader(args.train_files, train_gpt.context_length(args), args.seqs_per_step,
                                              ctx.dp.rank, ctx.dp.size, ctx.device)
    train_step(trainer, batches, 0)
    train_gpt.evaluate(trainer, 0)
    return trainer.layout.pipeline.stream_specs


# the tiny preset's stream at the boundaries of 3 stages of 2 blocks, by hand: what a later stage reads of it. After
# stage 0: x, x0, the bigram embedding (every layer with attention takes it), the first layer's input (MUDD's dense
# layer 5 and head read it), layer 1's output (the skip into layer 4, MUDD's head), the value embeddings of layers 2
# and 5 and of layer 1 (MUDD's head); no gate coefficient (network 0's serve layers 0-1, network 2 runs at layer 2).
# After stage 1: x0 no longer (layer 4 has no attention, the dense layer 5 re-adds the first layer's input), layer
# 3's output (attended over by layer 5, read by MUDD's), layer 2's value embedding no longer, and the coefficients
# network 2 gave layers 4 and 5
SENT = {2: {".x", ".x0", ".ngram", ".first_input", ".skip", ".ve[1]", ".ve[2]", ".ve[5]"},
        4: {".x", ".ngram", ".first_input", ".skip", ".attended", ".ve[1]", ".ve[5]", ".gates[4]['skip']",
            ".gates[5]['output_gate']"}}


def test_what_crosses_each_boundary_is_what_the_later_stages_read_of_the_one_process_stream(files):
    # the one-process forward run to each boundary holds the stream; a stage sends each tensor of it that a later
    # stage reads, and an empty one of its dtype for every other (so code that only names it runs as it did), the
    # residual and layer 1's output (one tensor there) once
    layout = dict(pp=3)
    specs = {}
    for rank_specs in run_on_ranks(stream_structures, 3, files, layout):
        specs.update(rank_specs)
    assert len(specs) == 4  # two boundaries, in training and in evaluation
    args = train_gpt.parse_args(tiny_flags(files, **layout), cuda=False)
    model = train_gpt.build_model(args, torch.device("cpu"))
    window = train_gpt.window_tensor((train_gpt.ATTENTION_BLOCK_SIZE,) * 2, torch.device("cpu"))
    for training, seq_len in ((True, train_gpt.batch_shape(0, args)[0]), (False, args.val_seq_len)):
        model.train(training)
        tokens = torch.full((seq_len,), train_gpt.EOT_TOKEN)
        for boundary, sent in SENT.items():
            with torch.set_grad_enabled(training):
                stream = model(tokens, None, window, layers=range(boundary))
            spec, places, shapes = specs[boundary, seq_len, training]
            leaves, structure = train_gpt.pytree.tree_flatten_with_path(stream)
            assert spec == train_gpt.pytree.treespec_dumps(structure)
            received = [shapes[i] for i in places]
            assert {train_gpt.pytree.keystr(path) for (path, _), (shape, _) in zip(leaves, received) if shape != (0,)} == sent
            for (path, t), (shape, dtype) in zip(leaves, received):
                assert dtype == t.dtype and shape in (tuple(t.shape), (0,)), train_gpt.pytree.keystr(path)
            # the residual is the last layer's output: there the skip's source, then the attended one (one tensor)
            assert (stream.skip if boundary == 2 else stream.attended) is stream.x and len(shapes) == len(leaves) - 1


def test_the_plan_counts_what_the_tie_sends_between_stages(files):
    # with the embedding on the first stage and the head on the last, the step that unties them sends the
    # embedding's gradient one way and the head's values and Adam moments (and step count) the other, on top of what
    # the pipeline sends at every step: the plan runs that step too
    plans = {tied: train_gpt.plan_layout(train_gpt.parse_args(tiny_flags(files, pp=2, tied_stages=tied), cuda=False),
                                         2, cuda=False) for tied in (0, 1)}
    args = train_gpt.parse_args(tiny_flags(files), cuda=False)
    table = train_gpt.next_multiple_of_n(args.vocab_size, 128) * args.model_dim * torch.float32.itemsize
    tie_sent = [tied["comm"]["send"] - apart["comm"]["send"]
                for tied, apart in zip(plans[1]["ranks"], plans[0]["ranks"])]
    assert plans[0]["ranks"][0]["comm"]["send"] > 0 and tie_sent == [table, 3 * table + 4]


def test_stages_split_the_blocks_evenly_and_in_order():
    for num_layers, stages in [(12, 1), (12, 5), (6, 4), (7, 7)]:
        split = [train_gpt.stage_layers(num_layers, stages, s) for s in range(stages)]
        assert [i for layers in split for i in layers] == list(range(num_layers))
        assert max(map(len, split)) - min(map(len, split)) <= 1


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
