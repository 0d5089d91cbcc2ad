"""Every parallel layout trains the one-process model and holds and sends what --plan predicts, also for a model a
fork has edited (tests/layouts.py) without touching any parallel code; what a layout cannot train is refused by
name before the first step; and --check_layout says so for a fork's own file."""
import difflib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import train_gpt
from conftest import REPO_ROOT
from layouts import FORKS, LAYOUT_TEST_FLAGS, assert_holds_and_sends_what_the_plan_predicts, \
    assert_trains_like_one_process, beside_its_plan, fork, forked_source
from synthetic import tiny_flags
from train_gpt import LAYOUTS

# the layouts a forked model trains under: each mechanism at least once (ZeRO 3, tensor and sequence parallelism, the
# asynchronous matmul, three pipeline stages, the buckets beside a pipeline) and each four-process combination of
# kinds, which hold ZeRO 3 too (dp2_tp2_zero3); the others (plain dp, ZeRO 1 and 2, plain tp, ...) treat a fork's
# parameters as the unedited model's, which trains under every layout above, and a pipeline schedule orders the
# micro-batches whatever the model (all-forward-all-backward: the unedited model's test)
FORK_LAYOUTS = ("tp2_sp_async", "pp3_1f1b", "dp2_pp2", "dp2_tp2_zero3", "pp2_tp2_sp")

# (the fork layouts train the unedited model's machinery on a harder model in the tests below: not twice)
@pytest.mark.parametrize("name", [name for name in LAYOUTS if name not in FORK_LAYOUTS])
def test_each_layout_trains_the_one_process_model_holding_and_sending_what_the_plan_says(layout_runs, layout_files,
                                                                                         name):
    # float64 gradient sums (the tables held by rows: by row) make every layout but tensor parallelism bit-identical
    # to one process
    processes, layout = LAYOUTS[name]
    ranks, plan = beside_its_plan(lambda: layout_runs(name), tiny_flags(layout_files, **LAYOUT_TEST_FLAGS, **layout),
                                  processes)
    assert_trains_like_one_process(ranks, layout_runs("one process"), layout_runs.floors(),
                                   exact=layout.get("tp", 1) == 1)
    assert_holds_and_sends_what_the_plan_predicts(ranks, plan, layout_files, **layout)


@pytest.mark.parametrize("name", FORK_LAYOUTS)
def test_a_forked_model_trains_the_one_process_model_under_the_fork_layouts_untouched(layout_runs, name):
    # the edits of tests/layouts.py's "forks": an attention-output gate, a 4th value embedding, a gated MLP, a
    # per-layer vector on the GPT, a hashed token-pair embedding, a token shift of the embedding, a second head, tied
    # embeddings, a learnable soft cap, a per-head temperature (one held by attention, one by the block and handed to
    # attention by keyword: cut with the heads either way), a GPT parameter read in the heads, a block's scalar read
    # by the GPT; and the later kinds, each with a test of its own below
    processes, layout = LAYOUTS[name]
    single = layout_runs("one process", "forks")
    edited = {"blocks.0.attn_gate", "value_embeds.0.weight", "blocks.0.mlp.c_gate.weight", "layer_gains",
              "pair_embed.weight", "smear_gate.weight", "next_head.weight", "lm_head.cap", "head_temperature",
              "blocks.0.attn.head_temperature", "out_scale", "attention_scales", "lm_head.logit_bias",
              "blocks.0.head_gate.weight", "blocks.0.key_temperature"}
    assert edited <= single["state"]["model"].keys() and "lm_head.weight" not in single["state"]["model"]  # (tied)
    assert_trains_like_one_process(layout_runs(name, "forks"), single, layout_runs.floors("forks"))


def assert_the_edit_trains_under(layout_runs, edit, name, tensors):
    """The edited model trains the one-process model under the layout, and its edited tensors (non-zero after the
    steps) are among those compared."""
    single = layout_runs("one process", edit)
    for tensor in tensors:
        assert torch.as_tensor(single["state"]["model"][tensor]).norm() > 0, tensor
    assert_trains_like_one_process(layout_runs(name, edit), single, layout_runs.floors(edit))


# The later records' kinds of edit (tests/layouts.py, in the "forks" model): kind -> a tensor it adds
LATER_KINDS = {
    # a scale on the stream before the head, and the rotaries stretched as the window grows (dynamic YaRN's kind),
    # written in GPT.forward itself: every layout runs GPT.forward, a pipeline stage over its own layers
    "code_in_gpt_forward": "out_scale",
    # attention_scales[i] is indexed where block i runs and used inside attention: a value made of a parameter counts
    # as the parameter's where it is used, so under tensor parallelism its gradient is summed over the group
    "gpt_vector_used_inside_attention": "attention_scales",
    # a tuple out of each block: ZeRO 3 gathers a block's parameters again when backward reaches any of its outputs
    "block_returning_a_second_stream": "blocks.0.mlp.c_proj.weight",
    # tensor parallelism splits any of a head's parameters with a dimension of its vocabulary along it
    "bias_per_vocabulary_entry_in_the_head": "lm_head.logit_bias",
    # a per-head tensor handed to attention by keyword enters as each rank's heads' part, as one by position does
    "per_head_gate_handed_by_keyword": "blocks.0.head_gate.weight",
    # a head's buffer with a value per vocabulary entry is split with its rows: the validation after the steps, whose
    # logits are split, adds each rank's part of it (the head's weight: the embedding's, tied)
    "offset_per_vocabulary_entry_held_as_the_heads_buffer": "embed.weight",
    # a new output distribution (#379's copy pointer, --copy_window) built from the head's statistics: model code
    "copy_pointer_mixed_into_the_heads_distribution": "copy_pointer.query.weight",
}


@pytest.mark.parametrize("name", FORK_LAYOUTS)
@pytest.mark.parametrize("kind", LATER_KINDS)
def test_each_later_kind_of_edit_trains_under_the_fork_layouts(layout_runs, kind, name):
    assert_the_edit_trains_under(layout_runs, "forks", name, [LATER_KINDS[kind]])


@pytest.mark.parametrize("name", ["tp2", "tp2_sp"])
def test_an_ungated_value_embedding_enters_attention_whole_and_trains_under_tensor_parallelism(layout_runs, name):
    # a stream tensor only attention reads is not cut under --sp: it enters as the rank's heads' part, not gathered
    assert_the_edit_trains_under(layout_runs, "ungated_value_embeds", name, ["value_embeds.1.weight"])


@pytest.mark.parametrize("name", ["tp2", "dp2_tp2_zero3"])
def test_a_head_picking_rows_of_its_own_weight_by_token_stays_whole_under_tensor_parallelism(layout_runs, name):
    # a sampled softmax's candidates are anywhere in the vocabulary: the head, and the embedding tied to it, stay
    # whole on every rank, which computes its loss in full
    assert_the_edit_trains_under(layout_runs, "head_picking_its_rows", name, ["lm_head.weight", "embed.weight"])


@pytest.mark.parametrize("edit, where", [("target_logit_by_a_one_hot", "sum in lm_head"),
                                         ("log_softmax_in_gpt_forward", "log_softmax in GPT.forward")])
def test_a_loss_reducing_the_split_logits_outside_the_heads_statistics_is_refused_by_tensor_parallelism(layout_files,
                                                                                                     edit, where):
    # each is the loss of the unedited model in one process (the same function, computed another way); under --tp
    # each rank holds part of the logits
    module, losses = fork(edit), []
    for source in (module, train_gpt):
        torch.manual_seed(0)
        model = source.build_model(source.parse_args(tiny_flags(layout_files, **LAYOUT_TEST_FLAGS), cuda=False),
                                   torch.device("cpu"))
        torch.nn.init.normal_(model.lm_head.weight, std=0.02)  # (a zero head's logits are all alike)
        with torch.no_grad():
            losses.append(model(*source.ModelTrace(model, 128).run().probe))
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-5) and losses[1].item() > 1
    with pytest.raises(module.UserError, match=rf"tensor parallelism: {where} reduces over logits as wide as "
                                                   r"the vocabulary of the head lm_head \(50304 entries\) outside "
                                                   r"its VocabularyStatistics.* or train without --tp"):
        build_edited(layout_files, edit, tp=2)


def test_an_embedding_looked_up_inside_attention_is_refused_by_tensor_parallelism(layout_files):
    with pytest.raises(fork("embedding_inside_attention").UserError, match=r"tensor parallelism: the embedding blocks\.0\.attn\.positions is "
                                                  r"looked up inside blocks\.0\.attn, .* look it up outside"):
        build_edited(layout_files, "embedding_inside_attention", tp=2)


@pytest.mark.parametrize("name", ["dp2", "dp2_zero1", "dp2_zero2", "dp2_zero3", "pp2_1f1b"])
def test_a_bank_of_every_layers_qkv_matrices_trains_under_data_zero_and_pipeline_layouts(layout_runs, name):
    # one 4-D parameter of the GPT, indexed per layer: Muon's (a matrix of the stream's width, orthogonalised matrix
    # by matrix), whole under ZeRO 3 (read outside any block), kept by every pipeline stage and summed over them
    assert_the_edit_trains_under(layout_runs, "bank_in_pairs", name, ["qkv_bank"])


def test_a_bank_of_matrices_is_refused_by_tensor_parallelism_saying_what_to_change(layout_files):
    with pytest.raises(fork("bank_in_pairs").UserError, match=r"tensor parallelism: qkv_bank is a matrix \(of shape "
                                                  r"\(6, 3, 32, 32\)\) that blocks\.0\.attn uses .* hold each "
                                                  r"layer's matrices in a CastedLinear inside the region .* or train "
                                                  r"without --tp"):
        build_edited(layout_files, "bank_in_pairs", tp=2)


@pytest.mark.parametrize("name", ["dp2", "dp2_zero3", "pp2_1f1b"])
def test_heads_attending_in_pairs_train_under_data_zero_and_pipeline_layouts(layout_runs, name):
    assert_the_edit_trains_under(layout_runs, "bank_in_pairs", name, ["blocks.0.attn.c_proj.weight"])


def test_heads_attending_in_pairs_are_refused_by_tensor_parallelism_naming_the_tp_that_works(layout_files):
    # the fork pairs heads j and j + 2 of the tiny model's 4 and gives no runs to cut alike (head_groups), so ranks
    # holding consecutive heads split every pair: no --tp above 1 keeps them apart
    with pytest.raises(fork("heads_in_pairs").UserError, match=r"tensor parallelism: blocks\.0\.attn does not split into 2 "
                                                  r"ranks' shares of its heads .* no --tp above 1 keeps it apart"):
        build_edited(layout_files, "heads_in_pairs", tp=2)


def build_edited(files, edit, **layout):
    """Build the edited model (a fork's, or train_gpt's) under a layout as rank 0 of its processes, with no process
    group: a refusal comes before any collective."""
    module = fork(edit) if edit else train_gpt
    args = module.parse_args(tiny_flags(files, **LAYOUT_TEST_FLAGS, **layout), cuda=False)
    model = module.build_model(args, torch.device("cpu"))
    trace = module.ModelTrace(model, 128).run()
    module.tensor_parallelize(model, module.Axis(0, args.tp, None, tuple(range(args.tp))), args, trace)
    return model



def test_tensor_and_sequence_parallelism_replace_no_method_of_the_model_and_set_no_attribute_on_it(layout_files):
    # the layouts change what the model does through hooks the model offers (module hooks, its seams, the head's
    # VocabularyStatistics), so every module holds the attributes a freshly built one holds, and no function of its own
    model = build_edited(layout_files, None, tp=2, sp=True, async_tp=True)
    fresh = train_gpt.build_model(train_gpt.parse_args(tiny_flags(layout_files), cuda=False), torch.device("cpu"))
    for name, module in model.named_modules():
        assert vars(module).keys() == vars(fresh.get_submodule(name)).keys(), name
        assert not [key for key, value in vars(module).items() if callable(value) and not key.startswith("_")], name
    assert any(module._forward_hooks for module in model.modules())  # (the layout is there: as hooks)


def test_a_weight_matrix_inside_attention_that_no_rule_places_is_refused_saying_what_to_declare(layout_files):
    with pytest.raises(fork("unplaced_matrix_in_attention").UserError, match=r"blocks\.0\.attn\.mix\.weight is a weight matrix in the tensor-"
                                                  r"parallel region blocks\.0\.attn that no rule places .* "
                                                  r"TENSOR_PARALLEL_PLAN\[\(CausalSelfAttention, 'mix'\)\]"):
        build_edited(layout_files, "unplaced_matrix_in_attention", tp=2)


def test_sequence_parallelism_refuses_a_token_shift_inside_a_block_by_name(layout_files):
    build_edited(layout_files, "token_shift_in_a_block", tp=2)  # without --sp nothing is cut: it trains
    with pytest.raises(fork("token_shift_in_a_block").UserError, match=r"sequence parallelism: layer 0 mixes positions outside attention "
                                                  r"and the MLP"):
        build_edited(layout_files, "token_shift_in_a_block", tp=2, sp=True)


def test_sequence_parallelism_refuses_by_name_a_layer_that_fails_on_part_of_the_sequence(layout_files):
    # the probe runs the layer on a part of the sequence: what fails there is refused as what gives another result
    build_edited(layout_files, "token_table_in_the_layer_loop", tp=2)
    with pytest.raises(fork("token_table_in_the_layer_loop").UserError, match=r"sequence parallelism: layer 0 mixes "
                       r"positions outside attention and the MLP \(run on a part of the sequence, its part of "
                       r"GPT.forward raises RuntimeError: The size of tensor a \(64\)"):
        build_edited(layout_files, "token_table_in_the_layer_loop", tp=2, sp=True)


def test_a_run_says_at_its_start_which_optimizer_a_parameter_placed_by_its_shape_gets(layout_files, tmp_path):
    # the bank fork's qkv_bank, which no module kind claims: Muon's by its shape, and the run's log says so
    fork("bank_in_pairs").main(tiny_flags(layout_files, num_iterations=2, val_loss_every=0, log_dir=tmp_path,
                                          run_id="bank"))
    assert "\noptimizer: qkv_bank (6, 3, 32, 32): Muon, by its shape (set its `optimizer` attribute to \"adam\" or " \
        "\"muon\" to choose)\n" in (tmp_path / "bank.txt").read_text()


def test_a_parameter_no_module_kind_claims_is_placed_by_its_shape_or_its_attribute_and_refused_otherwise():
    model = nn.Module()
    model.bank = nn.Parameter(torch.zeros(6, 3, 64, 32))  # per layer, three matrices reading the 32-wide stream
    model.gains = nn.Parameter(torch.zeros(6))
    assert train_gpt.optimizer_param_groups(model, vocab_size=50257, model_dim=32) == dict(
        scalar=["gains"], residual_scale=[], output_scale=[], gate=[], head=[], ngram=[], embed=[], muon=["bank"])
    # a stack of per-layer vectors of the stream's width is Adam's (Muon would orthogonalise its 6 rows as a matrix),
    # said in a line the log prints; its `optimizer` attribute chooses otherwise
    model.layer_gates = nn.Parameter(torch.zeros(6, 32))
    placed = []
    assert train_gpt.optimizer_param_groups(model, 50257, 32, placed)["scalar"] == ["gains", "layer_gates"]
    assert placed == [f"{name}: {kind}, by its shape (set its `optimizer` attribute to \"adam\" or \"muon\" to "
                      "choose)" for name, kind in (("bank (6, 3, 64, 32)", "Muon"), ("layer_gates (6, 32)", "Adam"))]
    model.layer_gates.optimizer = "muon"
    assert train_gpt.optimizer_param_groups(model, 50257, 32)["muon"] == ["bank", "layer_gates"]
    model.table = nn.Parameter(torch.zeros(40, 4))
    with pytest.raises(train_gpt.UserError, match=r"table is a 2-D parameter of shape \(40, 4\) held by no linear "
                                                  r"layer, embedding or head, and not a matrix of the stream's width "
                                                  r"\(32\) nor a stack of fewer than 32 vectors"):
        train_gpt.optimizer_param_groups(model, vocab_size=50257, model_dim=32)


def test_code_between_gpt_forwards_parts_that_runs_once_per_part_is_refused_naming_gpt_forward(layout_files):
    # a shift put after the embedding's branch: every part applies it
    module = fork("code_between_the_parts")
    args = module.parse_args(tiny_flags(layout_files, **LAYOUT_TEST_FLAGS), cuda=False)
    with pytest.raises(module.UserError, match=r"GPT\.forward run in the parts the layouts run it in .* Put code "
                                               r"that changes the stream in the embedding's branch"):
        module.ModelTrace(module.build_model(args, torch.device("cpu")), 128).run()


def test_tied_embeddings_are_one_parameter_in_one_optimizer_group(layout_files):
    module = fork("forks")
    args = module.parse_args(tiny_flags(layout_files), cuda=False)
    model = module.build_model(args, torch.device("cpu"))
    groups = module.optimizer_param_groups(model, args.vocab_size, args.model_dim)
    assert model.embed.weight is model.lm_head.weight
    assert sum(name in ("embed.weight", "lm_head.weight") for group in groups.values() for name in group) == 1
    assert "embed.weight" in groups["head"]  # the head's rule comes first
    assert "pair_embed.weight" in groups["embed"]  # an embedding whatever its name
    assert "lm_head.cap" in groups["scalar"]  # a scalar of the head is a scalar
    assert "next_head.weight" in groups["head"]  # a head whatever its name


# A fork's file as a user runs --check_layout on it: a token shift inside each block with sequence parallelism's
# rule against it switched off, and the rotaries stretched as the window grows, written (by mistake) in GPT.forward's
# embedding branch, which only the first pipeline stage runs
FORK_WITH_RULES_OFF = FORKS["token_shift_in_a_block"] + [
    ("""    whole = {id(t) for i, t in enumerate(pytree.tree_leaves(trace.streams[0])) if i not in cut}
""", """    return
    whole = {id(t) for i, t in enumerate(pytree.tree_leaves(trace.streams[0])) if i not in cut}
"""),
    ("""        if stream is None:  # the embedding
""", """        if stream is None:  # the embedding
            if int(windows[1]) != getattr(self, "rotary_window", ATTENTION_BLOCK_SIZE):
                for rotary in (m for m in self.modules() if isinstance(m, Rotary)):
                    rotary.angular_freq.div_(int(windows[1]) / getattr(self, "rotary_window", ATTENTION_BLOCK_SIZE))
                self.rotary_window = int(windows[1])
""")]


def test_check_layout_finds_a_layout_that_mixes_positions_or_skips_gpt_forward_with_its_rule_switched_off(tmp_path):
    # its schedule crosses a change of the window (below), so the second pipeline stage, which never stretches its
    # rotaries, trains another model
    forked = tmp_path / "fork.py"
    forked.write_text(forked_source(FORK_WITH_RULES_OFF))
    done = subprocess.run([sys.executable, str(forked), "--check_layout", "dp2,tp2_sp,pp2_1f1b"], capture_output=True,
                          text=True, timeout=300, cwd=REPO_ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(line.startswith("dp2 ") and " OK " in line for line in lines), done.stdout
    assert any(line.startswith("tp2_sp ") and " DIFFERS " in line for line in lines), done.stdout
    assert any(line.startswith("pp2_1f1b ") and " DIFFERS " in line for line in lines), done.stdout


# a per-token scale of the embedding from a table built once and kept (#375's kind of token-normalisation table, made
# by a function under functools.cache): the model built on meta first, as a run's checks build it, keeps a table of
# no values, which every later build then shares
CACHED_TABLE = [("""        self.embed.tied_to_head = c.tied_embed
""", """        self.embed.tied_to_head = c.tied_embed
        self.token_scale = nn.Buffer(token_scales(c.vocab_size), persistent=False)
"""), ("""            x = self.embed(input_seq)
            x = norm(""", """            x = self.embed(input_seq) * self.token_scale[input_seq, None]
            x = norm("""), ("""class GPT(nn.Module):
""", """@functools.cache
def token_scales(vocab_size: int) -> Tensor:
    return torch.linspace(0.5, 1.5, vocab_size)

class GPT(nn.Module):
""")]


def test_check_layout_builds_the_model_as_a_run_does_and_fails_where_the_run_would(tmp_path):
    # the check builds the model on meta before its one-process run, as main() does: a fork keeping its first build's
    # table fails there as a run fails at its first step, and the check says so
    forked = tmp_path / "fork.py"
    forked.write_text(forked_source(CACHED_TABLE))
    done = subprocess.run([sys.executable, str(forked), "--check_layout", "dp2"], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1 and "one process FAILED: " in done.stderr and "device meta" in done.stderr, \
        done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_second_gated_skip_as_the_readme_writes_it_adds_lines_in_three_places_and_passes_check_layout(tmp_path):
    # the forking section's example: lines added where the gate is made, where layer 0 leaves its output on the
    # stream and where the last layer takes it in, and nothing else; --check_layout on the fork's file trains it
    # under a pipeline, whose first stage sends the new state to the second, like one process
    edits = FORKS["skip_from_the_first_layer_into_the_last"]
    original, forked = Path(train_gpt.__file__).read_text(), forked_source(edits)
    diff = [line for line in difflib.unified_diff(original.splitlines(), forked.splitlines(), lineterm="", n=0)
            if not line.startswith(("---", "+++"))]
    assert sum(line.startswith("@@") for line in diff) == 3 and not any(line.startswith("-") for line in diff)
    readme = (REPO_ROOT / "README.md").read_text()
    added = [line[1:] for line in diff if line.startswith("+")]
    assert len(added) == 5 and all(line in readme for line in added), [line for line in added if line not in readme]
    (tmp_path / "fork.py").write_text(forked)
    done = subprocess.run([sys.executable, str(tmp_path / "fork.py"), "--check_layout", "pp2_1f1b"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(line.startswith("pp2_1f1b ") and " OK " in line for line in done.stdout.splitlines()), done.stdout


@pytest.mark.parametrize("flags", [train_gpt.LAYOUT_CHECK_FLAGS, LAYOUT_TEST_FLAGS])
def test_the_layout_checks_steps_cross_a_change_of_sequences_window_learning_rate_and_momentum(flags):
    args = train_gpt.parse_args([f"--{k}={v}" for k, v in dict(dict(preset="tiny"), **flags).items()], cuda=False)
    steps = range(3)
    assert len({train_gpt.batch_shape(step, args)[0] for step in steps}) > 1
    assert len({train_gpt.window_tokens(step, args) for step in steps}) > 1
    assert len({train_gpt.lr_multiplier(step, args) for step in steps}) > 1
    assert len({train_gpt.muon_momentum(step, args) for step in steps}) > 1


def test_check_layout_trains_the_tiny_model_with_the_flags_given_beside_it(monkeypatch):
    # a recipe's part behind a flag (#92's optimizer, its n-gram table) is checked as given, over the check's own
    trained = []
    def record(*jobs, **kwargs):  # (the one-process run first: each job is fn, world_size, argv, ...)
        trained.extend(train_gpt.parse_args(argv, cuda=False) for fn, world_size, argv, *rest in jobs)
        raise train_gpt.UserError("recorded")
    monkeypatch.setattr(train_gpt, "run_together", record)
    with pytest.raises(train_gpt.UserError, match="recorded"):
        train_gpt.main(["--check_layout", "dp2", "--matrix_optimizer", "anvil", "--trigrams", "true"])
    args = trained[0]
    assert (args.preset, args.num_iterations, args.matrix_optimizer, args.trigrams) == ("tiny", 3, "anvil", True)


def meet(rank, world_size, folder, mine, theirs, what):
    """Leave a file named mine, wait (20 s at most) for one named theirs, and return what; a what of "refuse" or
    "fail" raises a UserError or another error instead."""
    (Path(folder) / f"{mine}{rank}").touch()
    deadline = time.time() + 20
    while not (Path(folder) / f"{theirs}0").exists():
        assert time.time() < deadline, f"{theirs} never ran beside {mine}"
        time.sleep(0.01)
    if what in ("refuse", "fail"):
        raise train_gpt.UserError("refused by rank") if what == "refuse" else ValueError("rank failed")
    return (what, rank, world_size)


def test_jobs_run_together_each_getting_its_ranks_results_and_a_failure_is_raised_once_all_ended(tmp_path):
    # as --check_layout runs the one-process run beside its jittered twin: each job waits for the other's file,
    # which run one after the other would never meet
    one, two = train_gpt.run_together((meet, 2, tmp_path, "a", "b", "first"), (meet, 1, tmp_path, "b", "a", "second"),
                                      timeout=60)
    assert one == [("first", 0, 2), ("first", 1, 2)] and two == [("second", 0, 1)]
    for what, raised in (("refuse", train_gpt.UserError), ("fail", RuntimeError)):
        folder = tmp_path / what
        folder.mkdir()
        with pytest.raises(raised, match="refused by rank|ValueError: rank failed"):
            train_gpt.run_together((meet, 1, folder, "a", "b", what), (meet, 1, folder, "b", "a", "ended"), timeout=60)
        assert (folder / "b0").exists()  # the second job ran, and ended, beside the failed first
