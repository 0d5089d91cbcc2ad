"""The run as a whole: flags, schedules, warm-up restore, the log file, and training that learns."""
import dataclasses
import json
import math
import re

import pytest
import torch

import train_gpt
from conftest import REPO_ROOT
from train_gpt import run_on_ranks
from layouts import train_step
from synthetic import tiny_flags, write_synthetic_shards


def test_flags_override_preset_values():
    args = train_gpt.parse_args(["--preset", "tiny", "--num_iterations", "50", "--fp8_head", "true",
                                 "--lr_muon=0.01", "--run_id", "x"], cuda=False)
    assert (args.num_iterations, args.fp8_head, args.lr_muon, args.run_id) == (50, True, 0.01, "x")
    assert args.model_dim == train_gpt.PRESETS["tiny"].flags["model_dim"]
    assert train_gpt.parse_args([], cuda=False).preset == "cpu"
    record = train_gpt.parse_args([], cuda=True)  # the record preset: #92's
    assert (record.preset, record.num_iterations, record.ngram_rows, record.matrix_optimizer) == \
        ("record", 1194, 84602880, "anvil")
    record89 = train_gpt.parse_args(["--preset", "record89"], cuda=True)
    assert record89 == dataclasses.replace(train_gpt.Hyperparameters(), preset="record89",  # #89's: the defaults
                                           num_layers=len(train_gpt.RECORD89_LAYERS))  # (unset: its stack's)
    assert (record89.val_tokens, record89.val_seq_len, record89.num_iterations) == (10485760, 4 * 64 * 1024, 1285)
    assert train_gpt.stage_seq_lens(record89) == [16384, 32768, 49152, 49152]  # (its stage table's)


@pytest.mark.parametrize("flags, words", [
    (["--train_seq_len", "100"], "--train_seq_len '100': each stage's must be a multiple of 128 (the attention block), not 100"),
    (["--train_seq_len", "128,256,384"], "--train_seq_len '128,256,384': expected 4 whole numbers above 0, one for "
     "each of the run's stages (--stage_shares makes them) and its extension, or one for all"),
    (["--doc_max_tokens", "896,x,2048,2048"], "--doc_max_tokens '896,x,2048,2048': expected 4 whole numbers"),
    (["--stage_lr", "1,1.5"], "--stage_lr '1,1.5': expected 3 numbers of 0 or more, one for each of the run's stages "
     "(--stage_shares makes them), or one for all, such as #92's '1,1.52,1.73,1.57927'"),
    (["--stage_shares", "1,0,1"], "--stage_shares '1,0,1': expected 3 numbers above 0"),
    (["--stage_shares", "1,x"], "--stage_shares '1,x': expected 2 numbers above 0"),
    (["--table_cadence", "0:3"], "--table_cadence '0:3': expected STEP:EVERY pairs, the first step 0 and the steps "
     "rising, each EVERY a multiple of --adam_every 2 (the tiny preset's): the tables step on some of Adam's"),
    (["--table_cadence", "4:2"], "--table_cadence '4:2': expected STEP:EVERY pairs, the first step 0"),
    (["--table_cadence", "0:2,8:x"], "--table_cadence '0:2,8:x': expected STEP:EVERY pairs"),
    (["--tables_by_rows", "true", "--tp", "2", "--zero", "1"], "--tables_by_rows with --tp 2: a table split over the "
     "tensor-parallel ranks and held by rows over the data-parallel ones is not built"),
    (["--stage_shares", "1,1,1,1"], "--stage_shares '1,1,1,1' makes 4 stages before the extension, but the tiny "
     "preset's 3 have a --window_blocks each ('1:1,1:2,2:2,2:2'): give --window_blocks too"),
    (["--stage_shares", "1,1", "--window_blocks", "1:1,1:2,2:2", "--tied_stages", "3"], "--tied_stages 3: the run has "
     "2 stages before the extension; give at most that many"),
    # issue 65: the flags whose values the tables' columns now hold, in forms of their own
    (["--window_pattern", "LLS"], "--window_pattern is now --long_window_layers, the layers of the long window"),
    (["--stage_steps", "4,8"], "--stage_steps is now --stage_shares, each stage's share of the scheduled steps"),
    (["--key_offset", "false"], "--key_offset is now --key_offset_layers"),
    (["--sampled_softmax", "0:1024"], "--sampled_softmax is now --candidates, a count a stage"),
    (["--num_iterations", "0"], "--num_iterations must be a whole number > 0 and below 2**31, got 0"),
    (["--cooldown_frac", "1.5"], "--cooldown_frac must be in"),
    (["--muon_beta2", "1"], "--muon_beta2 must be in [0, 1), got 1.0"),
    (["--attention_free_layers", "3,x"], "--attention_free_layers '3,x'"),
    (["--soft_cap", "23,5"], "--soft_cap '23,5': expected three numbers C,S,D"),
    (["--soft_cap", "23,5,0"], "--soft_cap '23,5,0': expected three numbers C,S,D"),
    (["--skip_layers", "4,1"], "--skip_layers '4,1': the skip goes from an earlier layer to a later one"),
    (["--skip_layers", "1"], "--skip_layers '1': expected two layer indices FROM,TO such as '3,6', or '' for none"),
    (["--attend_over_layer", "6"], "--attend_over_layer '6' names layers [6], outside 0 to 5 (--num_layers 6)"),
    (["--attend_over_layer", "5"], "--attend_over_layer '5': no layer comes after the last"),
    (["--num_layers", "4", "--long_window_layers", "0,3"],
     "--skip_layers '1,4' (the tiny preset's; set it to fit --num_layers) names layers [4]"),
    (["--val_tokens", "1000"], "--val_tokens 1000 must be a multiple of --val_seq_len"),
    (["--window_blocks", "1:3,3:7"], "--window_blocks '1:3,3:7': expected 4 numbers SHORT:LONG above 0"),
    (["--window_blocks", "1:1,1:2,2:x,2:2"], "--window_blocks '1:1,1:2,2:x,2:2': expected 4 numbers SHORT:LONG"),
    (["--window_blocks", "0.001:1"], "--window_blocks '0.001:1': each window must be a token or more"),
    (["--extension_steps", "20"], "--extension_steps 20 must be below --num_iterations 20 (the tiny preset's)"),
    (["--train_seq_len", "2147483520"], "--train_seq_len '2147483520': a sequence's attention block mask holds a "
     "block index for each pair of its 128-token blocks, 1 TiB of them at 67,108,864 tokens"),
    (["--val_seq_len", str(2**26 + 128), "--val_tokens", str(2**26 + 128)], "--val_seq_len 67108992: a sequence's"),
    (["--candidates", "1024,x"], "--candidates '1024,x': expected 4 whole numbers (A:B:C: through equal parts of the "
     "stage) of 0 or more"),
    (["--candidates", "60000"], "--candidates '60000': each count must be at most the head's 50304 rows"),
    (["--candidates", "1024", "--vocab_size", str(20011 * 128)], "--vocab_size 2561408: the head's 2561408 rows are "
     "a multiple of the negatives' stride 20011"),
    (["--adam_every", "1000", "--num_iterations", "3"], "--adam_every 1000: Adam steps first after step 1000, past "
     "the run's --num_iterations 3 steps, so the head, the embeddings, the gates and the scalars would never train"),
])
def test_bad_flag_values_are_refused_by_name(flags, words):
    with pytest.raises(train_gpt.UserError, match=re.escape(words)):
        train_gpt.parse_args(["--preset", "tiny", *flags], cuda=False)


def test_the_sampled_softmaxs_candidate_counts_by_step_are_92s():
    # #92's: 10,240 candidates through step 680, 14,336 from 681, 24,576 from 965 (the last third of its third
    # stage, 681..1106), the whole vocabulary from 1107
    args = train_gpt.Hyperparameters(preset="record", num_iterations=1194, extension_steps=20)
    counts = {0: 10240, 680: 10240, 681: 14336, 964: 14336, 965: 24576, 1106: 24576, 1107: 0, 1193: 0}
    assert {step: train_gpt.candidate_count(step, args) for step in counts} == counts
    assert train_gpt.candidate_counts(args) == [(0, 10240), (681, 14336), (965, 24576), (1107, 0)]
    # a ramp through halves of #89's second stage (423..846): its second half from step 635, (635 - 423) x 2 // 424
    halves = train_gpt.Hyperparameters(candidates="0,0:512,1024,0")
    assert [train_gpt.candidate_count(step, halves) for step in (0, 634, 635, 846, 847, 1270)] == [0, 0, 512, 512,
                                                                                                   1024, 0]
    assert train_gpt.candidate_count(500, train_gpt.Hyperparameters()) == 0  # (#89's: all)


def test_schedules_at_hand_computed_points():
    # the record's: 1000 scheduled steps (thirds ending at 333, 667) and 15 of extension; the stages' lrs 1, 1.52 and
    # 1.73, each falling over the last 60% of the scheduled steps as if from step 400, to 0.15
    args = train_gpt.Hyperparameters(num_iterations=1015)
    lrs = {0: 1.0, 332: 1.0, 333: 1.52, 399: 1.52, 500: 1.52 * 5 / 6 + 0.15 / 6, 666: 1.52 * 0.334 / 0.6 + 0.15 *
           (1 - 0.334 / 0.6), 700: 0.5 * 1.73 + 0.5 * 0.15, 1000: 0.15, 1014: 0.15}  # (the extension: 0.15)
    for step, lr in lrs.items():
        assert train_gpt.lr_multiplier(step, args) == pytest.approx(lr), step
    # as #89's, the cooldown starts at a whole step: 59 scheduled steps fall from step int(59 x 0.4) = 23, halfway at
    # step 41 (in the third stage, 1.73), not from step 23.6
    short = train_gpt.Hyperparameters(num_iterations=60, extension_steps=1)
    assert train_gpt.lr_multiplier(23, short) == pytest.approx(1.52)
    assert train_gpt.lr_multiplier(41, short) == pytest.approx(0.5 * 1.73 + 0.5 * 0.15)
    # #46's staged batch: 16K-token sequences of documents cut at 896, then 32K and 48K of documents cut at 2048
    shapes = {0: (16384, 896), 332: (16384, 896), 333: (32768, 2048), 666: (32768, 2048), 667: (49152, 2048),
              1014: (49152, 2048)}
    for step, shape in shapes.items():
        assert train_gpt.batch_shape(step, args) == shape, step
    assert train_gpt.first_step_of_seq_len(args) == {16384: 0, 32768: 333, 49152: 667}
    # at the longest: one holding Adam's gradients, then not; and with pipeline stages, which send what the tie
    # does, the untie first (the third stage's first of Adam's steps)
    assert train_gpt.accounted_steps(args) == [668, 669] and train_gpt.last_tied_step(args) == 667
    assert train_gpt.accounted_steps(dataclasses.replace(args, pp=2)) == [667, 668, 669]
    # #89's windows in 128-token blocks: (1, 3), (3, 7), (5, 11), then (6, 13); 20 long at the final validation
    blocks = {0: (1, 3), 332: (1, 3), 333: (3, 7), 666: (3, 7), 667: (5, 11), 999: (5, 11), 1000: (6, 13),
              1014: (6, 13), 1015: (6, 20)}
    for step, (short, long) in blocks.items():
        assert train_gpt.window_tokens(step, args) == (128 * short, 128 * long), step
    assert train_gpt.windows_so_far(0, args) == ((128, 384),)
    assert train_gpt.windows_so_far(700, args) == ((128, 384), (384, 896), (640, 1408))
    assert train_gpt.windows_so_far(1015, args)[-1] == (768, 1664)  # (not stretched for the 20)
    assert train_gpt.muon_momentum(0, args) == pytest.approx(0.85)
    assert train_gpt.muon_momentum(150, args) == pytest.approx(0.90)
    assert train_gpt.muon_momentum(300, args) == pytest.approx(0.95)
    assert train_gpt.muon_momentum(965, args) == pytest.approx(0.95)  # the cooldown's 50 steps start
    assert train_gpt.muon_momentum(990, args) == pytest.approx(0.90)
    assert train_gpt.muon_momentum(1015, args) == pytest.approx(0.85)
    # the head and the embedding one table through the first of Adam's (odd) steps of the third stage (#89's 1270
    # scheduled steps: 847), or of the second; apart from the start; with Adam on every third step, 335 (333 is not)
    assert train_gpt.last_tied_step(args) == 667
    assert train_gpt.last_tied_step(train_gpt.Hyperparameters()) == 847
    assert train_gpt.last_tied_step(dataclasses.replace(args, tied_stages=1)) == 333
    assert train_gpt.last_tied_step(dataclasses.replace(args, tied_stages=0)) == -1
    assert train_gpt.last_tied_step(dataclasses.replace(args, tied_stages=1, adam_every=3)) == 335


def test_92s_schedule_as_flags_at_hand_computed_points():
    args = train_gpt.parse_args(["--preset", "record"], cuda=False)
    # #92's stage ends: its fractions 0.2854, 0.3209 and 0.3931 less the taper's 0.06 (over their sum) of 1,122 steps,
    # 52 more steps in the third stage, then its 20 of extension
    fractions = [0.2854 / 0.9994, 0.3209 / 0.9994, (0.3931 - 0.06) / 0.9994]
    ends = [round(sum(fractions[:i + 1]) * 1122) for i in range(3)]
    assert ends == [320, 681, 1055]
    assert train_gpt.stage_starts(args) == [0, 320, 681, 1055 + 52, 1122 + 52, 1194]
    # its lr: the stage's multiplier, falling over the last 80% of the 1,174 steps before the extension from step
    # int(1174 x 0.2) = 234 to 0.30 (computed by hand from its schedule.py's rule)
    lrs = {233: 1.0, 319: 0.937, 320: 1.408, 680: 0.941, 681: 1.050, 1106: 0.403, 1107: 0.391, 1174: 0.30, 1193: 0.30}
    assert {s: round(train_gpt.lr_multiplier(s, args), 3) for s in lrs} == lrs
    # a rank's tokens (8, 16, 24, 20 then 8 sequences of 2048 over 8 ranks), the documents' cut and the windows
    shapes = {319: (16384, 896, (1, 3)), 320: (32768, 2048, (3, 7)), 681: (49152, 3072, (5, 11)),
              1107: (40960, 3072, (5, 11)), 1173: (40960, 3072, (5, 11)), 1174: (16384, 3072, (6, 13))}
    for step, (tokens, cut, (short, long)) in shapes.items():
        assert train_gpt.batch_shape(step, args) == (tokens, cut), step
        assert train_gpt.window_tokens(step, args) == (128 * short, 128 * long), step
    # the taper keeps the windows, so YaRN stretches nothing there: the rotaries of step 1107 are those of 1106
    model = train_gpt.build_model(train_gpt.parse_args(["--preset", "tiny", "--narrow_qk_layers", "2",
                                                        "--rotary_follows", "own"], cuda=False), torch.device("cpu"))
    rotaries = [m for m in model.modules() if isinstance(m, train_gpt.Rotary)]
    stretched = {}
    for step in (681, 1106, 1107, 1174):
        model.stretch_rotary(train_gpt.windows_so_far(step, args))
        stretched[step] = [(r.angular_freq.clone(), r.attention_scale.item()) for r in rotaries]
    for (f1, s1), (f2, s2), (f3, s3) in zip(stretched[681], stretched[1107], stretched[1174]):
        assert torch.equal(f1, f2) and s1 == s2 and s3 > s2  # (the extension's windows stretch again)
    # the loss weights: three tokens, then two, then one; the prefix token's 0.25, then 0.20, 0.15, 0.10 and 0.05 in
    # the quarters of steps 320..680 (361 steps: from 320, 411, 501 and 591), then none
    prefix = {0: 0.25, 319: 0.25, 320: 0.20, 410: 0.20, 411: 0.15, 500: 0.15, 501: 0.10, 590: 0.10, 591: 0.05,
              680: 0.05, 681: 0.0, 1193: 0.0}
    assert {s: train_gpt.loss_weights(s, args)[-1] for s in prefix} == prefix
    assert train_gpt.loss_weights(0, args)[:3] == [1, 0.5, 0.25] and train_gpt.loss_weights(320, args)[:3] == [1, 0.5, 0]
    assert train_gpt.loss_weights(700, args)[:3] == [1, 0, 0]
    # the head and the embedding one table until the extension's first odd step, #92's split step
    assert train_gpt.last_tied_step(args) == 1175


def build(files, **overrides):
    args = train_gpt.parse_args(tiny_flags(files, **overrides), cuda=False)
    return args, train_gpt.build_trainer(args, train_gpt.build_parallel_context(0, 1, torch.device("cpu")))


def test_adam_steps_on_the_last_of_every_adam_every_steps():
    assert [train_gpt.adam_steps(step, train_gpt.Hyperparameters(adam_every=2)) for step in range(5)] == \
        [False, True, False, True, False]  # #89's odd steps
    assert [train_gpt.adam_steps(step, train_gpt.Hyperparameters(adam_every=3)) for step in range(6)] == \
        [False, False, True, False, False, True]
    assert all(train_gpt.adam_steps(step, train_gpt.Hyperparameters(adam_every=1)) for step in range(3))
    # as #89's: its 1,285 steps end on an even one (from 0), which is Muon's alone
    assert not train_gpt.adam_steps(4, train_gpt.Hyperparameters(adam_every=2, num_iterations=5))


@pytest.mark.parametrize("fp64_grad_sum", [True, False])
def test_adam_steps_every_other_step_with_the_sum_of_both_steps_gradients(tmp_path, fp64_grad_sum):
    # the reference: a run whose Adam steps every step at lr 0 (its parameters stay put, as held ones do) gives each
    # step's gradients at the same weights; one Adam step with their sum from the start must be the held run's
    files = write_synthetic_shards(tmp_path)
    _, held = build(files, fp64_grad_sum=fp64_grad_sum)
    _, frozen = build(files, fp64_grad_sum=fp64_grad_sum, adam_every=1, lr_head=0, lr_embed=0, lr_scalar=0)
    adam, reference_adam = held.optimizers[0], frozen.optimizers[0]
    adam_params = [p for group in adam.param_groups for p in group["params"]]
    start = [p.detach().clone() for p in adam_params]
    loader = lambda: train_gpt.DistributedDataLoader(files["train_files"], 128, 4, 0, 1, torch.device("cpu"),
                                                     doc_max_tokens=256)
    batches, frozen_batches, summed = loader(), loader(), None
    for step in range(2):
        train_step(held, batches, step)
        train_gpt.forward_backward(frozen, frozen_batches, step)
        grads = [p.grad.clone() for group in reference_adam.param_groups for p in group["params"]]
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]
        train_gpt.optimizer_step(frozen, step)
        if step == 0:
            assert all(torch.equal(p, q) for p, q in zip(adam_params, start))  # Adam waited
            assert all(p.grad is None for p in adam_params) == fp64_grad_sum  # (float64 sums: held in them)
        for (name, p), q in zip(held.model.named_parameters(), frozen.model.parameters()):
            if not any(p is a for a in adam_params):  # Muon steps every step, alike in both runs
                assert torch.allclose(p, q, rtol=0, atol=1e-6), (step, name)
    # the reference step: a fresh Adam with the same groups, at step 1's learning rates, on the summed gradients
    copies = [p.clone().requires_grad_() for p in start]
    by_param = dict(zip(adam_params, range(len(adam_params))))
    reference = train_gpt.Adam([dict(group, params=[copies[by_param[p]] for p in group["params"]])
                                for group in adam.param_groups], fused=True)
    for copy, grad in zip(copies, summed):
        copy.grad = grad
    reference.step()
    assert all(adam.state[p]["step"].item() == 1 for p in adam_params)  # one Adam step in two training steps
    moved = 0
    for p, copy, begin in zip(adam_params, copies, start):
        assert torch.allclose(p, copy, rtol=0, atol=1e-6), (p.shape, (p - copy).abs().max().item())
        moved = max(moved, (p - begin).abs().max().item())
    assert moved > 1e-3  # a real step, against which 1e-6 is small


class GPTWithOneTable(train_gpt.GPT):
    """The head and the token embedding as one parameter: what the tie must train, step for step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.embed.weight = self.lm_head.weight


def test_the_tied_head_and_embedding_train_as_one_parameter_then_apart_from_its_adam_state(tmp_path, monkeypatch):
    files = write_synthetic_shards(tmp_path)
    flags = dict(tied_stages=1, num_iterations=8)  # thirds start at steps 0, 3, 5: one table through step 3
    args, tied = build(files, **flags)
    with monkeypatch.context() as patched:
        patched.setattr(train_gpt, "GPT", GPTWithOneTable)
        _, one_table = build(files, **flags)
    assert train_gpt.last_tied_step(args) == 3
    embed, head, table = tied.model.embed.weight, tied.model.lm_head.weight, one_table.model.embed.weight
    assert table is one_table.model.lm_head.weight and torch.equal(embed, table) and torch.equal(head, table)
    loader = lambda: train_gpt.DistributedDataLoader(files["train_files"], 128, 4, 0, 1, torch.device("cpu"),
                                                     doc_max_tokens=256)
    batches, one_table_batches, start = loader(), loader(), table.detach().clone()
    for step in range(4):
        train_step(tied, batches, step)
        train_step(one_table, one_table_batches, step)
        assert torch.equal(embed, head)  # one table: the embedding takes the head's values
    # the same training, but for the order in which the two gradients add up, which Adam amplifies where a gradient
    # is near zero: within 1e-3 of each tensor's norm (measured: 6.6e-5 at most; --check_layout's noise floor after
    # 3 steps is 1.9e-4), after a real move; without the embedding's gradient in the head's, some are 0.85 off
    assert (table - start).norm() > 0.1 * start.norm()
    for name, p in one_table.model.named_parameters():
        ours = dict(tied.model.named_parameters())[name]
        assert (ours - p).norm() <= 1e-3 * p.norm(), name
    adam = tied.optimizers[0]
    for key in ("exp_avg", "exp_avg_sq", "step"):  # untied with the head's Adam state
        assert torch.equal(adam.state[embed][key], adam.state[head][key]), key
        theirs = one_table.optimizers[0].state[table][key]
        assert (adam.state[embed][key] - theirs).norm() <= 1e-3 * theirs.norm(), key
    # apart: the embedding's next Adam step is torch's Adam (with cautious decay) on that state and its own gradient
    state = {key: value.clone() for key, value in adam.state[embed].items()}
    before = embed.detach().clone()
    train_step(tied, batches, 4)  # (Adam waits)
    train_gpt.forward_backward(tied, batches, 5)
    grad, group = embed.grad.clone(), next(g for g in adam.param_groups if any(p is embed for p in g["params"]))
    train_gpt.optimizer_step(tied, 5)
    copy = before.clone().requires_grad_()
    reference = train_gpt.Adam([dict(group, params=[copy])], fused=True)
    reference.state[copy] = state
    copy.grad = grad
    reference.step()
    assert torch.equal(embed, copy) and not torch.equal(embed, head)
    assert (embed - before).norm() > 1e-3 * before.norm()


def test_warmup_leaves_no_trace(tmp_path):
    files = write_synthetic_shards(tmp_path)
    args, trainer = build(files)
    model, optimizers = trainer.model, trainer.optimizers
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    train_gpt.warmup_and_restore(trainer, 3)
    for k, v in model.state_dict().items():
        assert torch.equal(v, initial[k]), k
    assert all(not opt.state for opt in optimizers)  # no momentum or Adam moments survive
    assert all(p.grad is None for p in model.parameters())
    # and training from here is exactly training from a fresh model
    _, fresh = build(files)
    loader = lambda: train_gpt.DistributedDataLoader(args.train_files, 128, args.seqs_per_step, 0, 1,
                                                     trainer.ctx.device)
    after_warmup, batches = [], loader()
    reference, fresh_batches = [], loader()
    for step in range(2):
        after_warmup.append(train_step(trainer, batches, step)[0].item())
        reference.append(train_step(fresh, fresh_batches, step)[0].item())
    assert after_warmup == reference
    for (name, p), q in zip(model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(p, q), name


def test_evaluation_runs_the_head_in_slices_and_averages_over_every_token():
    torch.manual_seed(0)
    layers = tuple(train_gpt.LayerConfig(long_window=window == "L") for window in "LSSL")
    model = train_gpt.GPT(train_gpt.ModelConfig(vocab_size=50257, model_dim=32, num_heads=2, head_dim=16,
                                                layers=layers)).eval()
    torch.nn.init.normal_(model.lm_head.weight)  # the zero-initialised head gives every token the same loss
    tokens = torch.randint(0, 50257, (257,))
    tokens[[0, 90, 200]] = train_gpt.EOT_TOKEN
    inputs, targets, window = tokens[:-1], tokens[1:], train_gpt.window_tensor((2, 2), torch.device("cpu"))
    head_inputs, statistics_of = [], model.lm_head.statistics_of
    model.lm_head.statistics_of = lambda x, *rest: head_inputs.append(x) or statistics_of(x, *rest)
    with torch.no_grad():
        whole = model(inputs, targets, window)  # 256 tokens: one slice
        model.lm_head.EVAL_ROWS = 100  # slices of 100, 100 and 56 tokens
        sliced = model(inputs, targets, window)
    assert [len(x) for x in head_inputs] == [256, 100, 100, 56]
    # fp64 reference: the soft-capped logits of every token, averaged once
    x = torch.cat(head_inputs[1:]).double()
    logits = 23 * torch.sigmoid((x @ model.lm_head.weight.double().T + 5) / 7.5)
    expected = torch.nn.functional.cross_entropy(logits, targets).item()
    assert sliced.item() == pytest.approx(expected, rel=1e-6) and whole.item() == pytest.approx(expected, rel=1e-6)


def run_main(tmp_path, files, run_id, **overrides):
    flags = tiny_flags(files, log_dir=tmp_path / "logs", run_id=run_id, **overrides)
    final_val_loss = train_gpt.main(flags)
    log_path = tmp_path / "logs" / f"{run_id}.txt"
    return final_val_loss, log_path.read_text() if log_path.exists() else None  # only rank 0 logs


def test_log_file_holds_source_environment_hyperparameters_and_steps(tmp_path):
    files = write_synthetic_shards(tmp_path)
    final_val, log = run_main(tmp_path, files, "logtest", num_iterations=4, val_loss_every=2)
    source = open(train_gpt.__file__).read()
    assert log.startswith(source)
    rest = log[len(source):].splitlines()
    assert rest[0] == "=" * 100
    assert rest[1].startswith("Running Python ") and rest[2].startswith(f"Running PyTorch {torch.__version__}")
    assert rest[3].startswith("CPU: ")
    assert rest[4] == "=" * 100
    hparams = json.loads(rest[5].removeprefix("hyperparameters: "))
    assert hparams["num_iterations"] == 4 and hparams["preset"] == "tiny" and hparams["run_id"] == "logtest"
    assert rest[6] == "run: id=logtest device=cpu world_size=1 dp=1 tp=1 pp=1 zero=0 grad_accum_steps=4"
    # the layer stack and the stages as the flags made them: the tiny preset's six layers (its one attention-free
    # layer, 4, without x0 and the n-gram), its thirds of the 4 steps (0, 1-2, 3) and its extension (none)
    args = train_gpt.parse_args(tiny_flags(files, num_iterations=4), cuda=False)
    tables = f"{train_gpt.model_config(args).table()}\n{train_gpt.schedule_table(args)}".splitlines()
    assert rest[7:7 + len(tables)] == tables and tables[5].split()[:2] == ["4", "-"]
    assert [row.split()[:2] for row in tables[-4:]] == [["0", "0-0"], ["1", "1-2"], ["2", "3-3"], ["extension", "none"]]
    steps = rest[7 + len(tables):-1]
    assert [line.split()[0] for line in steps] == ["step:0/4", "step:1/4", "step:2/4", "step:2/4", "step:3/4",
                                                   "step:4/4", "step:4/4"]
    assert [("val_loss" in line) for line in steps] == [True, False, False, True, False, False, True]
    assert steps[-1].startswith(f"step:4/4 val_loss:{final_val:.4f} train_time:")
    assert rest[-1].startswith("peak memory rss: ") and rest[-1].endswith(" MiB")


def test_short_run_learns(tmp_path):
    files = write_synthetic_shards(tmp_path)
    _, log = run_main(tmp_path, files, "learn", num_iterations=30, val_loss_every=30)
    val = [float(line.split("val_loss:")[1].split()[0]) for line in log.splitlines() if "val_loss:" in line
           and line.startswith("step:")]
    assert val[0] == pytest.approx(math.log(50304), abs=0.05)  # zero-init head: uniform logits at the start
    assert val[-1] < val[0] - 3, val  # the synthetic pattern is easy to learn


def test_tiny_preset_learns_on_the_embedded_shakespeare(tmp_path):
    shards = REPO_ROOT / "data" / "shakespeare"
    files = dict(train_files=shards / "shakespeare_train_*.bin", val_files=shards / "shakespeare_val_*.bin")
    flags = [f"--{k}={v}" for k, v in dict(preset="tiny", log_dir=tmp_path, run_id="shakespeare", num_iterations=15,
                                             val_loss_every=15, **files).items()]
    train_gpt.main(flags)
    log = (tmp_path / "shakespeare.txt").read_text()
    val = [float(line.split("val_loss:")[1].split()[0]) for line in log.splitlines() if line.startswith("step:")
           and "val_loss:" in line]
    assert val[0] == pytest.approx(math.log(50304), abs=0.05)
    assert val[-1] < val[0] - 2, val  # real English: unigram statistics alone are worth several nats


def run_main_on_rank(rank, world_size, tmp_path, files):
    return run_main(tmp_path, files, "dp", num_iterations=6, val_loss_every=3)[0]


def test_two_process_run_ends_with_the_single_process_val_loss(tmp_path):
    files = write_synthetic_shards(tmp_path)
    single, _ = run_main(tmp_path, files, "single", num_iterations=6, val_loss_every=3)
    for val_loss in run_on_ranks(run_main_on_rank, 2, tmp_path, files):
        # float64 gradient sums (the tiny preset's) make the models bit-identical; the val loss itself is
        # averaged over ranks in float32, so it may differ in the last bits
        assert abs(val_loss - single) < 1e-5


@pytest.mark.parametrize("cap, shift, divisor", [(23.0, 5.0, 7.5), (30.0, 0.0, 7.5 * 128 ** 0.5)])  # #89's, #23's
def test_soft_cap_computes_the_plain_expression_and_its_autograd_gradient_bit_for_bit(cap, shift, divisor):
    torch.manual_seed(0)
    logits = torch.randn(64, 1000) * 20 * divisor / 7.5  # the sigmoid's flat tails and its steep middle
    targets = torch.randint(0, 1000, (64,))
    results = []
    for soft_cap in (lambda x: cap * torch.sigmoid((x + shift) / divisor),
                     lambda x: train_gpt.SoftCap.apply(x, cap, shift, divisor)):
        x = logits.clone().requires_grad_()
        capped = soft_cap(x)
        torch.nn.functional.cross_entropy(capped, targets, reduction="sum").div(3).backward()
        results.append((capped.detach(), x.grad))
    (plain, plain_grad), (fused, fused_grad) = results
    assert plain_grad.abs().sum() > 0
    assert torch.equal(fused, plain) and torch.equal(fused_grad, plain_grad)


def test_float64_sums_of_sparse_embedding_gradients_equal_those_of_dense_ones(tmp_path):
    # the float64 sums take embeddings' gradients sparse (the micro-batch's rows): the summed gradients must be
    # those of the dense backward, bit for bit, with tokens repeated within micro-batches
    files = write_synthetic_shards(tmp_path)
    grads = []
    for sparse in (True, False):
        args, trainer = build(files)
        embeddings = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Embedding)]
        assert embeddings and all(m.sparse for m in embeddings)  # (what build_trainer chose with --fp64_grad_sum)
        for m in embeddings:
            m.sparse = sparse
        batches = train_gpt.DistributedDataLoader(args.train_files, 128, args.seqs_per_step, 0, 1,
                                                  trainer.ctx.device)
        for step in (0, 1):  # then a step after Adam's first: the zero-initialised head no longer zeroes every
            train_step(trainer, batches, step)  # gradient
        train_gpt.forward_backward(trainer, batches, 3)  # (one on which Adam steps: no gradient is held back)
        grads.append({name: p.grad for name, p in trainer.model.named_parameters()})
    for name, grad in grads[1].items():
        assert not grad.is_sparse and torch.equal(grads[0][name], grad), name
    assert grads[1]["embed.weight"].abs().sum() > 0


@pytest.mark.parametrize("compiled", [False, True])
def test_float64_sums_take_sparse_embedding_gradients_only_in_an_eager_model(tmp_path, compiled):
    # torch.compile does not lower sparse embeddings (Inductor asserts), so a compiled model keeps dense ones
    args, trainer = build(write_synthetic_shards(tmp_path), compile=compiled)
    embeddings = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Embedding)]
    assert args.fp64_grad_sum and embeddings and all(m.sparse is not compiled for m in embeddings)


def test_the_plans_steps_and_the_untie_are_found_by_arithmetic_as_a_walk_over_the_steps_finds_them():
    # a walk over every step (the reference) on short runs; then a run of 2 billion steps with Adam stepping once at
    # its end, which a walk would take minutes and gigabytes for (--plan, and so every CUDA start, pays it)
    def walked(args):
        firsts = train_gpt.first_step_of_seq_len(args)
        first = firsts[max(firsts)]
        held = [s for s in range(first, args.num_iterations) if not train_gpt.adam_steps(s, args)][:1]
        stepping = [s for s in range(held[0] if held else first, args.num_iterations)
                    if train_gpt.adam_steps(s, args)][:1]
        start = train_gpt.stage_starts(args)[args.tied_stages]
        untie = next((s for s in range(start, args.num_iterations) if train_gpt.adam_steps(s, args)),
                     args.num_iterations) if args.tied_stages else -1
        return held + stepping, untie
    cases = 0
    for num_iterations in (1, 2, 3, 7, 10, 31):
        for adam_every in (1, 2, 3, 5, 40):
            for tied_stages in (0, 1, 2, 3):
                args = train_gpt.Hyperparameters(num_iterations=num_iterations, extension_steps=num_iterations // 5,
                                                 adam_every=adam_every, tied_stages=tied_stages)
                steps, untie = walked(args)
                assert (train_gpt.accounted_steps(args), train_gpt.last_tied_step(args)) == (steps, untie), args
                cases += len(steps) == 2
    assert cases > 20  # (most hold a step and then step)
    huge = train_gpt.Hyperparameters(num_iterations=2_000_000_000, adam_every=2_000_000_000, extension_steps=0)
    assert train_gpt.accounted_steps(huge) == [1_333_333_333, 1_999_999_999]
    assert train_gpt.last_tied_step(huge) == 1_999_999_999
