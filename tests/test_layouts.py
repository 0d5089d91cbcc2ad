"""Every parallel layout trains the one-process model and holds and sends what --plan predicts, also for a model a
fork has edited (tests/layouts.py) without touching any parallel code; what a layout cannot train is refused by
name before the first step; and --check_layout says so for a fork's own file."""
import os
import subprocess
import sys

import pytest

import train_gpt
from conftest import REPO_ROOT
from layouts import assert_holds_and_sends_what_the_plan_predicts, assert_trains_like_one_process, model_edit
from synthetic import tiny_flags
from train_gpt import LAYOUTS


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_trains_the_one_process_model_holding_and_sending_what_the_plan_says(layout_runs, layout_files,
                                                                                         name):
    # float64 gradient sums make every layout but tensor parallelism bit-identical to one process
    processes, layout = LAYOUTS[name]
    ranks = layout_runs(name)
    assert_trains_like_one_process(ranks, layout_runs("one process"), layout, exact=layout.get("tp", 1) == 1)
    assert_holds_and_sends_what_the_plan_predicts(ranks, layout_files, **layout)


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_forked_model_trains_the_one_process_model_under_each_layout_untouched(layout_runs, name):
    # the edits of tests/layouts.py: an attention-output gate, a 4th value embedding, a gated MLP, a per-layer vector
    # on the GPT, a bigram-hash embedding, a token shift of the embedding, a second head, tied embeddings, a learnable
    # soft cap, a per-head temperature, a GPT parameter read in the heads, a block's scalar read by the GPT
    processes, layout = LAYOUTS[name]
    single = layout_runs("one process", "forks")
    edited = {"blocks.0.attn_gate", "value_embeds.3.weight", "blocks.0.mlp.c_gate.weight", "layer_gains",
              "bigram.weight", "smear_gate.weight", "next_head.weight", "lm_head.cap", "head_temperature",
              "blocks.0.attn.head_temperature"}
    assert edited <= single["state"]["model"].keys() and "lm_head.weight" not in single["state"]["model"]  # (tied)
    assert_trains_like_one_process(layout_runs(name, "forks"), single, layout)


def build_edited(files, edit, **layout):
    """Build the edited model under a layout as rank 0 of its processes, with no process group: a refusal comes
    before any collective."""
    args = train_gpt.parse_args(tiny_flags(files, **layout), cuda=False)
    with model_edit(edit):
        model = train_gpt.build_model(args, train_gpt.torch.device("cpu"))
        trace = train_gpt.ModelTrace(model, 128).run()
        train_gpt.tensor_parallelize(model, train_gpt.Axis(0, args.tp, None, tuple(range(args.tp))), args, trace)


def test_a_weight_matrix_inside_attention_that_no_rule_places_is_refused_saying_what_to_declare(layout_files):
    with pytest.raises(train_gpt.UserError, match=r"blocks\.0\.attn\.mix\.weight is a weight matrix in the tensor-"
                                                  r"parallel region blocks\.0\.attn that no rule places .* "
                                                  r"TENSOR_PARALLEL_PLAN\[\(AttentionWithUnplacedMatrix, 'mix'\)\]"):
        build_edited(layout_files, "unplaced_matrix_in_attention", tp=2)


def test_sequence_parallelism_refuses_a_token_shift_inside_a_block_by_name(layout_files):
    build_edited(layout_files, "token_shift_in_a_block", tp=2)  # without --sp nothing is cut: it trains
    with pytest.raises(train_gpt.UserError, match=r"sequence parallelism: layer 0 mixes positions outside attention "
                                                  r"and the MLP"):
        build_edited(layout_files, "token_shift_in_a_block", tp=2, sp=True)


def test_a_matrix_of_no_linear_layer_or_embedding_is_refused_by_the_optimizer_rule():
    model = train_gpt.torch.nn.Module()
    model.mix = train_gpt.torch.nn.Parameter(train_gpt.torch.zeros(4, 4))
    with pytest.raises(train_gpt.UserError, match=r"mix is a 2-D parameter of no linear layer, embedding or head"):
        train_gpt.optimizer_param_groups(model, vocab_size=50257)


def test_tied_embeddings_are_one_parameter_in_one_optimizer_group(layout_files):
    args = train_gpt.parse_args(tiny_flags(layout_files), cuda=False)
    with model_edit("forks"):
        model = train_gpt.build_model(args, train_gpt.torch.device("cpu"))
    groups = train_gpt.optimizer_param_groups(model, args.vocab_size)
    assert model.embed.weight is model.lm_head.weight
    assert sum(p is model.embed.weight for group in groups.values() for p in group) == 1
    assert any(p is model.embed.weight for p in groups["head"])  # the head's rule comes first
    assert any(p is model.bigram.weight for p in groups["embed"])  # an embedding whatever its name
    assert any(p is model.lm_head.cap for p in groups["scalar"])  # a scalar of the head is a scalar
    assert any(p is model.next_head.weight for p in groups["head"])  # a head whatever its name


FORK = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import train_gpt
from layouts import BlockWithTokenShift
train_gpt.Block = BlockWithTokenShift  # the fork's edit: a token shift inside each block
train_gpt.refuse_sequence_mixing = lambda *args: None  # the rule switched off
if __name__ == "__main__":
    try:
        train_gpt.main(["--check_layout", "dp2,tp2_sp"])
    except train_gpt.RunEnded as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_status)
"""


def test_check_layout_finds_a_sequence_mixing_edit_when_the_rule_is_switched_off(tmp_path):
    fork = tmp_path / "fork.py"
    fork.write_text(FORK.format(tests=str(REPO_ROOT / "tests"), root=str(REPO_ROOT)))
    done = subprocess.run([sys.executable, str(fork)], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(line.startswith("dp2 ") and " OK " in line for line in lines), done.stdout
    assert any(line.startswith("tp2_sp ") and " DIFFERS " in line for line in lines), done.stdout
