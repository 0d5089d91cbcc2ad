"""Faults: exact resume from checkpoints under any world size, kill switch and signals, divergence guard, and
an elastic restart after a killed worker."""
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train_gpt
from conftest import REPO_ROOT
from train_gpt import forward_backward
from train_gpt import run_on_ranks
from layouts import fork
from synthetic import tiny_flags

STEPS = 8


def run_flags(tmp_path, files, run_id, **overrides):
    return tiny_flags(files, **dict(dict(log_dir=tmp_path / "logs", run_id=run_id, num_iterations=STEPS,
                                         val_loss_every=2), **overrides))


def run(tmp_path, files, world_size, run_id, in_worker=False, **overrides):
    """A tiny run of STEPS steps on world_size processes (1: in this one, unless in_worker: in a process of its own
    with one thread, as each of several has, since thread counts change the rounding); returns its log text."""
    flags = run_flags(tmp_path, files, run_id, **overrides)
    if world_size == 1 and not in_worker:
        train_gpt.main(flags)
    else:
        run_on_ranks(main_on_rank, world_size, flags)
    return (tmp_path / "logs" / f"{run_id}.txt").read_text()


def runs_at_once(tmp_path, files, *runs):
    """Independent runs (world_size, run_id, overrides), each as run(..., in_worker=True) runs it, all at once (a
    one-process run leaves a core idle)."""
    train_gpt.run_together(*((main_on_rank, world_size, run_flags(tmp_path, files, run_id, **overrides))
                             for world_size, run_id, overrides in runs))


def main_on_rank(rank, world_size, flags):
    return train_gpt.main(flags)


def checkpoint(tmp_path, run_id, step) -> dict:
    """A checkpoint's contents, a table's tensors by row (held gradients and sums) made dense."""
    state = torch.load(tmp_path / "logs" / run_id / f"step{step:06d}.pt", weights_only=True)
    return torch.utils._pytree.tree_map(lambda t: train_gpt.dense(t) if isinstance(t, torch.Tensor) else t, state)


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        flat |= flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return flat


def trained_state(state: dict) -> dict:
    """Every tensor that training changes (weights, Muon momentum, Adam moments, gradients held for Adam's next
    step, the tail averages), flattened to name -> tensor."""
    return flatten({part: state[part] for part in ("model", "muon", "adam", "held_gradients", "tail")})


def after_source(log: str) -> str:
    return log[len(Path(train_gpt.__file__).read_text()):]


def step_lines(log: str) -> list[str]:
    """The step lines with the wall-clock fields removed: what two equal runs must print alike."""
    return [re.sub(r" train_time:\S+ step_avg:\S+", "", line) for line in log.splitlines() if line.startswith("step:")]


def after_step(lines: list[str], step: int) -> list[str]:
    return [line for line in lines if int(line.split()[0].split(":")[1].split("/")[0]) >= step and
            not (line.split()[0] == f"step:{step}/{STEPS}" and "train_loss" in line)]


def assert_states_equal(a: dict, b: dict, relative_error: float = 0.0):
    """Bit-identical, or each tensor within relative_error in norm: ||a - b|| <= relative_error * ||a||.

    A norm, not elementwise: Adam with eps 1e-10 turns rounding in a rare token's tiny gradient into a visible
    step for that one embedding row, while the tensor as a whole agrees to ~1e-5.
    """
    a, b = trained_state(a), trained_state(b)
    assert a.keys() == b.keys()
    for name in a:
        if relative_error == 0:
            assert torch.equal(a[name], b[name]), name
        else:
            x, y = a[name].double(), b[name].double()
            assert (x - y).norm() <= relative_error * x.norm(), (name, ((x - y).norm() / x.norm()).item())


def assert_holds_adam_gradients(state: dict, held: bool):
    """Whether a checkpoint holds gradients for Adam's next step (after a step on which it did not step): then
    every one of Adam's parameters has one, and they are not all zero (those behind the zero-initialised output
    projections still are at step 3)."""
    assert state["held_gradients"].keys() == (state["adam"].keys() if held else set())
    assert not held or any(grad.any() for grad in state["held_gradients"].values())


# saved at step 4, after Adam's step (the tiny preset's adam_every 2), with #92's tail averages halfway (their windows
# are longer than the run: folded from step 1, shipped at the end); at step 3, with Adam's gradients of step 3
# held for step 4's; each in the second of the tiny run's stages (steps 3 and 4: a rotary that YaRN stretched)
# the second: a staged batch, saved as its second stage (steps 3 and 4 of 8) starts: 256-token sequences of documents
# cut at 256 after 128-token ones cut at 64, and the head and the embedding, one table until then, untied on step 3;
# the matrices under ANVIL, its rails blended from step 2 (its slow momentum saved, its decay mask sent); #92's sampled
# softmax, its candidates' count changing at step 2 (its sweep's cursors saved in the data position); #92's n-gram
# table and value embeddings on a cadence of 4 steps, the table stepped by rows, saved holding step 2's gradients;
# the embedding tables held by rows under ZeRO 1, saved holding their rows' gradients of step 3
@pytest.mark.parametrize("world_size, saved_at, staged", [
    (1, 4, dict(tail_average=True)), (2, 3, dict(train_seq_len="128,256,128,256", doc_max_tokens="64,256,256,256", tied_stages=1,
                            matrix_optimizer="anvil", anvil_blend_step=2, candidates="512:512:2048,2048,2048,2048",
                            table_cadence="0:4", ngram_optimizer="rows", zero=1, tables_by_rows=True))])
def test_resumed_run_ends_bit_identical_to_the_uninterrupted_one(tmp_path, files, world_size, saved_at, staged):
    full_log = run(tmp_path, files, world_size, "full", save_every=saved_at, **staged)
    path = tmp_path / "logs" / "full" / f"step{saved_at:06d}.pt"
    resumed_log = run(tmp_path, files, world_size, "resumed", save_every=saved_at, resume=path, **staged)
    assert f"resumed: step:{saved_at}/{STEPS} from {path}" in resumed_log
    assert_holds_adam_gradients(checkpoint(tmp_path, "full", saved_at), held=saved_at % 2 == 1)
    # the room check's bound holds; less the held gradients where there are none (float64: the tiny preset's sums)
    # and the other bytes it allows, it is the file's size, but where tables are held by rows (their held gradients
    # and sums by row: the rows read)
    args = train_gpt.parse_args(tiny_flags(files, **staged), cuda=False)
    bound = train_gpt.checkpoint_bytes_at_most(args) + len(Path(train_gpt.__file__).read_bytes())
    held = 0 if saved_at % 2 else 8 * train_gpt.parameter_count(args)
    indices = 16 * sum(map(len, train_gpt.embedding_tables(train_gpt.build_model(args, torch.device("meta")))))
    assert args.tables_by_rows or bound - held - indices - 2 * train_gpt.CHECKPOINT_OTHER_BYTES <= path.stat().st_size
    assert path.stat().st_size <= bound
    assert_states_equal(checkpoint(tmp_path, "full", STEPS), checkpoint(tmp_path, "resumed", STEPS))
    # a checkpoint does not change the run that saves it (held gradients averaged over the ranks and held again, in
    # float64 sums, the tiny preset's, exactly as they were)
    run(tmp_path, files, world_size, "unsaved", save_every=STEPS, **staged)
    assert_states_equal(checkpoint(tmp_path, "unsaved", STEPS), checkpoint(tmp_path, "resumed", STEPS))
    assert checkpoint(tmp_path, "full", STEPS)["data"] == checkpoint(tmp_path, "resumed", STEPS)["data"]
    assert step_lines(resumed_log) == after_step(step_lines(full_log), saved_at)


@pytest.mark.parametrize("world_size, flags", [(1, dict(table_cadence="0:4")), (2, dict(
    table_cadence="0:4", ngram_optimizer="rows", zero=1, tables_by_rows=True, tail_average=True))])
def test_the_room_checks_bound_holds_for_the_checkpoint_of_every_step(tmp_path, files, world_size, flags):
    # odd and even steps hold different things: gradients held for Adam's next step (float64, the tiny preset's
    # sums), a cadence's sums, the tables' by row, the tail averages; the bound (with the source it keeps) holds them
    # all, and it is not loose by more than a tenth where nothing is held by row
    run(tmp_path, files, world_size, "every", save_every=1, num_iterations=4, **flags)
    args = train_gpt.parse_args(tiny_flags(files, **flags), cuda=False)
    bound = train_gpt.checkpoint_bytes_at_most(args) + len(Path(train_gpt.__file__).read_bytes())
    sizes = [(tmp_path / "logs" / "every" / f"step{step:06d}.pt").stat().st_size for step in range(1, 5)]
    assert max(sizes) <= bound and (args.tables_by_rows or max(sizes) > 0.9 * bound), (sizes, bound)


ROUNDED_ROWS = 3


def without_rows_stepped_on_rounding(state: dict, reference: dict) -> dict:
    """The state with the ROUNDED_ROWS rows of each embedding table (a matrix of more than 1024 rows) that differ most
    from the reference's taken from the reference."""
    model = dict(state["model"])
    for name, table in model.items():
        if table.dim() == 2 and table.size(0) > 1024 and name in reference["model"]:
            rows = (table.double() - reference["model"][name].double()).norm(dim=1).topk(ROUNDED_ROWS).indices
            model[name] = table.clone()
            model[name][rows] = reference["model"][name][rows]
    return dict(state, model=model)


def assert_resumed_within_rounding(resumed: dict, reference: dict, floor_pair: tuple[dict, dict], multiple: float = 10):
    """A run resumed under another layout or world size, against the new one's run from the start, when the two sum
    floats in another order: the floor is how far the old and the new ran apart from the start, with the order of
    float sums their only difference (training amplifies it, by how much depends on the CPU's kernels: Adam with eps
    1e-10 turns rounding in a rare token's gradient into a visible step of its embedding row, the more so where the
    tiny preset's zero-initialised attention output leaves a gradient exactly zero in one order and rounding in
    another: 1.04e-2 of a value embedding's norm after its 8 steps, against 6.0e-5 with #89's uniform start). Such a
    row steps by up to the lr in either direction whichever order summed its gradient (one token's row of 50,257 was
    0.72 apart while every other row was within 2e-5, and the Adam moments within 2e-6), so the ROUNDED_ROWS rows of
    each table that differ most are left out of both comparisons. The resumed run shares its first steps with the old
    run and its last with the new, so it is of the floor's order from the new one, not within it: where two runs'
    roundings part ways changes which tensors they cancel in, and a scalar's Adam moment is the noisiest (3.9 x the
    floor on an AMD EPYC family 25 model 1: blocks.2.attn.proj_scale's first moment, 1.36e-4 of its norm against a
    floor of 3.50e-5). So `multiple` is 10; a resume that lost state is off by four orders of magnitude more (Muon's
    momentum restored as zeros: 0.38 of a matrix's norm), and in every row."""
    resumed, *floor_pair = (without_rows_stepped_on_rounding(state, reference) for state in (resumed, *floor_pair))
    floor, floor_tensor = train_gpt.worst_difference(*floor_pair)
    error, tensor = train_gpt.worst_difference(resumed, reference)
    assert 0 < floor < 3e-2, f"the runs should differ by rounding only: {floor:.2e} in {floor_tensor}"
    assert error <= multiple * floor, (f"resumed run {error:.2e} of the norm from the reference in {tensor}, over "
                                       f"{multiple} x the floor {floor:.2e} (in {floor_tensor})")


# the first with #92's sampled softmax: each sequence's cursor of the sweep is one state at any world size
@pytest.mark.parametrize("saved_on, resumed_on, fp64_grad_sum, saved_at, sampled", [
    (2, 1, True, 4, "512"), (1, 2, False, 3, "0")])
def test_a_checkpoint_resumes_under_another_world_size(tmp_path, files, saved_on, resumed_on, fp64_grad_sum,
                                                       saved_at, sampled):
    # saved at step 3, Adam's gradients held: their average over the old ranks is all the new ones need
    same = dict(fp64_grad_sum=fp64_grad_sum, candidates=sampled)
    runs_at_once(tmp_path, files, (saved_on, "saved", dict(save_every=saved_at, **same)),
                 (resumed_on, "reference", dict(save_every=STEPS, **same)))
    log = run(tmp_path, files, resumed_on, "resumed", True, save_every=saved_at, **same,
              resume=tmp_path / "logs" / "saved" / f"step{saved_at:06d}.pt")
    assert f"\nresumed: step:{saved_at}/{STEPS} from " in log
    resumed, reference = checkpoint(tmp_path, "resumed", STEPS), checkpoint(tmp_path, "reference", STEPS)
    if fp64_grad_sum:  # float64 gradient sums (--fp64_grad_sum, on in the tiny preset): world sizes bit-identical
        assert_states_equal(reference, resumed)
    else:  # 1 and 2 processes sum gradients in another order
        assert_resumed_within_rounding(resumed, reference, (checkpoint(tmp_path, "saved", STEPS), reference))


# (5: the tables have moved; ANVIL: its slow momentum whole on the owner of a tensor-parallel slice, then of a matrix)
ANVIL = dict(matrix_optimizer="anvil", anvil_blend_step=2)
@pytest.mark.parametrize("saved, resumed, saved_at", [(dict(zero=3), dict(pp=2), 4),
                                                      (dict(tp=2, **ANVIL), dict(zero=1, **ANVIL), 3),
                                                      (dict(pp=2), dict(zero=2), 5)])
def test_a_checkpoint_resumes_under_another_layout(tmp_path, files, saved, resumed, saved_at):
    # sharded optimizer state, tensor-parallel slices and pipeline stages are gathered into full tensors on save,
    # and cut the new layout's way on load; so are the gradients held for Adam's next step (saved at step 3 or 5)
    # tensor parallelism adds activations in another order: the new layout from the start is the reference
    rounded = "tp" in saved | resumed
    runs = [(2, "saved", dict(save_every=saved_at, **saved))]
    if rounded:
        runs.append((2, "reference", dict(save_every=STEPS, **resumed)))
    runs_at_once(tmp_path, files, *runs)
    run(tmp_path, files, 2, "resumed", save_every=saved_at,
        resume=tmp_path / "logs" / "saved" / f"step{saved_at:06d}.pt", **resumed)
    saved_state, resumed_state = checkpoint(tmp_path, "saved", STEPS), checkpoint(tmp_path, "resumed", STEPS)
    if not rounded:  # with float64 sums, data, ZeRO and pipeline layouts train one process exactly
        assert_states_equal(saved_state, resumed_state)
        return
    reference = checkpoint(tmp_path, "reference", STEPS)
    assert_resumed_within_rounding(resumed_state, reference, (saved_state, reference))


def restore_on_rank(rank, world_size, path, flags):
    """This rank's model, Adam state and the Muon momentum it owns after restoring the checkpoint at path."""
    args = train_gpt.parse_args(flags, cuda=False)
    trainer = train_gpt.build_trainer(args, train_gpt.build_parallel_context(rank, world_size, torch.device("cpu")))
    train_gpt.restore_checkpoint(train_gpt.load_checkpoint(path), path, trainer)
    model, (adam, muon) = trainer.model, trainer.optimizers
    names = {p: n for n, p in model.named_parameters()}
    return dict(model={n: p.detach().clone() for n, p in model.named_parameters()},
                adam={names[p]: dict(s) for p, s in adam.state.items()},
                muon={names[p]: dict(s) for p, s in muon.state.items()})


@pytest.mark.parametrize("world_size", [1, 2])
def test_restore_puts_back_every_saved_tensor_with_muon_momentum_on_its_owner(tmp_path, files, world_size):
    run(tmp_path, files, 3 - world_size, "saved", save_every=4)  # saved under the other world size
    path = tmp_path / "logs" / "saved" / "step000004.pt"
    flags = tiny_flags(files)
    ranks = [restore_on_rank(0, 1, path, flags)] if world_size == 1 else run_on_ranks(restore_on_rank, 2, path, flags)
    saved = checkpoint(tmp_path, "saved", 4)
    muon_names = [n for rank in ranks for n in rank["muon"]]
    assert sorted(muon_names) == sorted(saved["muon"])  # each matrix's momentum on exactly one rank
    for rank in ranks:
        restored = dict(model=rank["model"], adam=rank["adam"], muon=rank["muon"])
        for part in restored:
            for name, value in flatten(restored[part]).items():
                assert torch.equal(torch.as_tensor(value), flatten(saved[part])[name]), (part, name)
        assert flatten(restored["model"]).keys() == flatten(saved["model"]).keys()
        assert flatten(restored["adam"]).keys() == flatten(saved["adam"]).keys()


def interrupt_at_call(monkeypatch, calls: int, action, before=False):
    """Run action(model) in the calls-th training step, before or after its forward and backward."""
    real, count = train_gpt.forward_backward, [0]

    def wrapped(trainer, *args, **kwargs):
        count[0] += 1
        if before and count[0] == calls:
            action(trainer.model)
        result = real(trainer, *args, **kwargs)
        if not before and count[0] == calls:
            action(trainer.model)
        return result
    monkeypatch.setattr(train_gpt, "forward_backward", wrapped)


@pytest.mark.parametrize("how", ["kill_switch", "sigterm"])
def test_stopped_run_saves_exits_3_and_resumes_to_the_uninterrupted_log(tmp_path, files, monkeypatch, how):
    reference = run(tmp_path, files, 1, "reference", save_every=STEPS)
    kill_switch = tmp_path / "logs" / "stopme.stop"
    action = (lambda _: kill_switch.touch()) if how == "kill_switch" else \
        (lambda _: os.kill(os.getpid(), signal.SIGTERM))
    handler_before = signal.getsignal(signal.SIGTERM)
    interrupt_at_call(monkeypatch, 3, action)
    with pytest.raises(train_gpt.RunEnded) as stopped:
        run(tmp_path, files, 1, "stopme", save_every=STEPS)
    assert stopped.value.exit_status == train_gpt.EXIT_STOPPED == 3
    reason = f"kill switch {kill_switch}" if how == "kill_switch" else "SIGTERM"
    log = (tmp_path / "logs" / "stopme.txt").read_text()
    assert log.endswith(f"checkpoint: {tmp_path / 'logs' / 'stopme' / 'step000003.pt'}\n"
                        f"stopped: step:3/{STEPS} reason:{reason}\n")
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the handler is put back

    monkeypatch.undo()
    if how == "kill_switch":
        with pytest.raises(train_gpt.UserError, match="kill switch .* exists: delete it"):
            run(tmp_path, files, 1, "stopme", resume="latest")
        kill_switch.unlink()
    resumed = run(tmp_path, files, 1, "stopme", save_every=STEPS, resume="latest")
    # the log is continued from the checkpoint: same lines as the uninterrupted run, plus where it resumed
    assert step_lines(resumed) == step_lines(reference)
    assert f"resumed: step:3/{STEPS} from {tmp_path / 'logs' / 'stopme' / 'step000003.pt'}" in resumed
    assert not any(line.startswith(("stopped:", "checkpoint:")) for line in after_source(resumed).splitlines()[:-3])
    assert_states_equal(checkpoint(tmp_path, "reference", STEPS), checkpoint(tmp_path, "stopme", STEPS))


@pytest.mark.parametrize("what", ["loss", "gradient"])
def test_divergence_stops_at_the_step_and_names_the_last_checkpoint(tmp_path, files, monkeypatch, what):
    def poison(model):
        if what == "gradient":  # after the backward: this step's loss is finite, its gradient is not
            model.blocks[0].mlp.c_fc.weight.grad.view(-1)[0] = float("inf")
        else:  # before the forward: NaN logits
            model.lm_head.weight.data.fill_(float("nan"))
    interrupt_at_call(monkeypatch, 3, poison, before=what == "loss")
    with pytest.raises(train_gpt.RunEnded) as diverged:
        run(tmp_path, files, 1, "nan", save_every=2)
    assert diverged.value.exit_status == train_gpt.EXIT_DIVERGED
    last_saved = tmp_path / "logs" / "nan" / "step000002.pt"
    assert str(diverged.value).startswith("training diverged at step 3: ")
    # what is known of it: the step it was saved at, and that its loss was finite (not that it is good)
    assert str(diverged.value).endswith(f"the last checkpoint, {last_saved}, was saved at step 2 with a finite "
                                        "training loss")
    assert sorted(p.name for p in (tmp_path / "logs" / "nan").iterdir()) == ["step000002.pt"]
    assert "\ndiverged: training diverged at step 3" in after_source((tmp_path / "logs" / "nan.txt").read_text())


def test_bad_checkpoints_are_refused_by_name(tmp_path, files):
    run(tmp_path, files, 1, "small", save_every=4)
    path = tmp_path / "logs" / "small" / "step000004.pt"
    with pytest.raises(train_gpt.UserError, match=r"tensor embed.weight is of shape \(50257, 32\) there and of "
                                                  r"shape \(50257, 64\) here"):
        run(tmp_path, files, 1, "small", model_dim=64, head_dim=16, resume=path)  # same run id: its log is at stake
    for name, value, words in [("lm_head.weight", torch.zeros(3), r"a gradient for lm_head.weight of shape \(3,\), "
                                r"which is of shape \(50304, 32\) here"),
                               ("blocks.0.mlp.c_fc.weight", torch.zeros(128, 32), r"a gradient for "
                                r"blocks.0.mlp.c_fc.weight of shape \(128, 32\), which is not one of Adam's"),
                               ("lm_head.weight", torch.full((50304, 32), float("nan")),
                                "non-finite values in tensor lm_head.weight")]:
        state = checkpoint(tmp_path, "small", 4)
        state["held_gradients"][name] = value
        edited = tmp_path / "edited.pt"
        torch.save(state, edited)
        with pytest.raises(train_gpt.UserError, match=f"checkpoint {edited} holds {words}"):
            run(tmp_path, files, 1, "x", resume=edited)
    older = tmp_path / "older.pt"
    torch.save(dict(checkpoint(tmp_path, "small", 4), format=train_gpt.CHECKPOINT_FORMAT - 1), older)
    with pytest.raises(train_gpt.UserError, match=f"{older} is a checkpoint of format {train_gpt.CHECKPOINT_FORMAT - 1}"
                                                  ", written by another version of train_gpt.py"):
        run(tmp_path, files, 1, "x", resume=older)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(train_gpt.UserError, match=f"cannot read checkpoint {garbage}"):
        run(tmp_path, files, 1, "x", resume=garbage)
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"format": 1, "payload": Path("/etc/passwd")}, unsafe)  # an arbitrary object: weights_only says no
    with pytest.raises(train_gpt.UserError, match=f"cannot read checkpoint {unsafe}"):
        run(tmp_path, files, 1, "x", resume=unsafe)
    with pytest.raises(train_gpt.UserError, match="--resume nowhere.pt: no such file"):
        run(tmp_path, files, 1, "x", resume="nowhere.pt")
    with pytest.raises(train_gpt.UserError, match="--resume latest needs the run's id: pass --run_id"):
        run(tmp_path, files, 1, "", resume="latest")
    log = (tmp_path / "logs" / "small.txt").read_text()
    assert f"\nstep:{STEPS}/{STEPS} val_loss:" in log and log.endswith(" MiB\n")  # the refusal left it alone


def test_a_crash_while_writing_leaves_the_previous_checkpoint_intact(tmp_path, files, monkeypatch):
    run(tmp_path, files, 1, "crash", save_every=4)
    previous = (tmp_path / "logs" / "crash" / "step000008.pt").read_bytes()

    def crash_mid_write(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(train_gpt.torch, "save", crash_mid_write)
    with pytest.raises(train_gpt.UserError, match=r"cannot write checkpoint .*step000012\.pt: disk full; the earlier "
                                                  "checkpoints are intact"):
        run(tmp_path, files, 1, "crash", save_every=4, resume="latest", num_iterations=STEPS + 4)
    assert (tmp_path / "logs" / "crash" / "step000008.pt").read_bytes() == previous
    assert sorted(p.name for p in (tmp_path / "logs" / "crash").iterdir()) == ["step000004.pt", "step000008.pt"]


def child_pids(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def torchrun(files, tmp_path, run_id, *extra, max_restarts=0):
    flags = tiny_flags(files, log_dir=tmp_path / "logs", run_id=run_id, num_iterations=8, val_loss_every=0,
                       save_every=4, resume="latest")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             f"--max-restarts={max_restarts}", str(REPO_ROOT / "train_gpt.py"), *flags, *extra],
                            cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_elastic_restart_after_a_killed_worker_ends_like_an_uninterrupted_run(tmp_path, files):
    elastic = torchrun(files, tmp_path, "elastic", max_restarts=1)
    # the uninterrupted run, on two worker processes of one thread each, as torchrun's: trained meanwhile
    with concurrent.futures.ThreadPoolExecutor(1) as beside:
        reference = beside.submit(run, tmp_path, files, 2, "reference", num_iterations=8, val_loss_every=0,
                                  save_every=4)
        first_checkpoint = tmp_path / "logs" / "elastic" / "step000004.pt"
        deadline = time.time() + 240
        while not first_checkpoint.exists() and elastic.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        workers = child_pids(elastic.pid)
        assert len(workers) == 2, (workers, elastic.poll())
        os.kill(workers[1], signal.SIGKILL)
        output = elastic.communicate(timeout=300)[0]
        reference.result()
    assert elastic.returncode == 0, output
    log = (tmp_path / "logs" / "elastic.txt").read_text()
    assert re.search(r"^resumed: step:\d+/8 from ", log, re.MULTILINE), log[-3000:]
    assert_states_equal(checkpoint(tmp_path, "reference", 8), checkpoint(tmp_path, "elastic", 8))


def stop_on_rank(rank, world_size, flags, signalled_rank):
    """train_gpt.main on this rank; only signalled_rank gets SIGTERM, during its third step. Returns how it ended."""
    real, calls = train_gpt.forward_backward, [0]

    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        calls[0] += 1
        if rank == signalled_rank and calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    train_gpt.forward_backward = wrapped  # a fresh process per rank: nothing to undo
    try:
        train_gpt.main(flags)
    except train_gpt.RunEnded as e:
        return e.exit_status, str(e)
    return 0, "finished"


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, files):
    flags = run_flags(tmp_path, files, "stopme", save_every=STEPS)
    _, ended = train_gpt.run_together((main_on_rank, 2, run_flags(tmp_path, files, "reference", save_every=STEPS)),
                                      (stop_on_rank, 2, flags, 1))  # (the uninterrupted run beside it)
    reference = (tmp_path / "logs" / "reference.txt").read_text()
    assert [status for status, _ in ended] == [train_gpt.EXIT_STOPPED] * 2
    assert ended[0][1].startswith("stopped after step 3 (another rank was asked to stop)")
    assert ended[1][1].startswith("stopped after step 3 (SIGTERM)")
    saved = tmp_path / "logs" / "stopme" / "step000003.pt"
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]  # one complete file, no .tmp
    assert (tmp_path / "logs" / "stopme.txt").read_text().endswith(
        f"checkpoint: {saved}\nstopped: step:3/{STEPS} reason:another rank was asked to stop\n")
    resumed = run(tmp_path, files, 2, "stopme", save_every=STEPS, resume="latest")
    assert step_lines(resumed) == step_lines(reference)
    assert_states_equal(checkpoint(tmp_path, "reference", STEPS), checkpoint(tmp_path, "stopme", STEPS))


def test_ctrl_c_stops_the_trainer_process_with_a_checkpoint_and_exit_status_3(tmp_path, files):
    flags = tiny_flags(files, log_dir=tmp_path / "logs", run_id="ctrlc", num_iterations=100, val_loss_every=0)
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "train_gpt.py"), *flags], cwd=tmp_path,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    log = tmp_path / "logs" / "ctrlc.txt"
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and \
            not (log.exists() and "\nstep:1/100 train_loss:" in log.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # inside the training loop: the first step is logged
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == train_gpt.EXIT_STOPPED == 3, err[-3000:]
    stopped = re.search(r"\ncheckpoint: (\S+)\nstopped: step:(\d+)/100 reason:SIGINT\n$", log.read_text())
    assert stopped, log.read_text()[-1000:]
    step = int(stopped[2])
    assert stopped[1] == str(tmp_path / "logs" / "ctrlc" / f"step{step:06d}.pt")
    assert torch.load(stopped[1], weights_only=True)["step"] == step
    assert f"stopped after step {step} (SIGINT)" in err and "Traceback" not in err


@pytest.fixture
def stats_read_late(monkeypatch):
    """As on CUDA: each step's loss, gradient norm and stop votes read when the next step is queued."""
    monkeypatch.setattr(train_gpt, "stats_read_a_step_late", lambda device: True)


def test_read_a_step_late_the_log_and_the_model_are_those_of_reading_at_once(tmp_path, files, monkeypatch):
    at_once = run(tmp_path, files, 1, "at_once", save_every=STEPS)
    monkeypatch.setattr(train_gpt, "stats_read_a_step_late", lambda device: True)
    late = run(tmp_path, files, 1, "late", save_every=STEPS)
    assert step_lines(late) == step_lines(at_once)  # every train and val line, in the same order
    assert_states_equal(checkpoint(tmp_path, "at_once", STEPS), checkpoint(tmp_path, "late", STEPS))


def test_read_a_step_late_a_kill_switch_stops_after_the_next_step_and_resumes_exactly(tmp_path, files, monkeypatch,
                                                                                     stats_read_late):
    reference = run(tmp_path, files, 1, "reference", save_every=STEPS)
    kill_switch = tmp_path / "logs" / "stopme.stop"
    interrupt_at_call(monkeypatch, 3, lambda _: kill_switch.touch())
    with pytest.raises(train_gpt.RunEnded) as stopped:
        run(tmp_path, files, 1, "stopme", save_every=STEPS)
    assert stopped.value.exit_status == train_gpt.EXIT_STOPPED
    # the vote of step 3 is read once step 4 is under way: the run stops after step 4, with its checkpoint
    assert (tmp_path / "logs" / "stopme.txt").read_text().endswith(
        f"checkpoint: {tmp_path / 'logs' / 'stopme' / 'step000004.pt'}\n"
        f"stopped: step:4/{STEPS} reason:kill switch {kill_switch}\n")
    kill_switch.unlink()
    monkeypatch.setattr(train_gpt, "forward_backward", forward_backward)
    resumed = run(tmp_path, files, 1, "stopme", save_every=STEPS, resume="latest")
    assert step_lines(resumed) == step_lines(reference)
    assert_states_equal(checkpoint(tmp_path, "reference", STEPS), checkpoint(tmp_path, "stopme", STEPS))


def test_read_a_step_late_divergence_stops_at_the_diverged_step_before_saving_the_next(tmp_path, files, monkeypatch,
                                                                                     stats_read_late):
    def poison(model):  # this step's loss is finite, its gradient is not
        model.blocks[0].mlp.c_fc.weight.grad.view(-1)[0] = float("inf")
    interrupt_at_call(monkeypatch, 3, poison)
    with pytest.raises(train_gpt.RunEnded) as diverged:
        run(tmp_path, files, 1, "nan", save_every=2)
    assert str(diverged.value).startswith("training diverged at step 3: ")
    # step 4 ran (it was queued when step 3 was read), but its checkpoint was never written
    assert sorted(p.name for p in (tmp_path / "logs" / "nan").iterdir()) == ["step000002.pt"]


def test_a_state_a_fork_adds_to_muon_is_saved_restored_and_required_as_muon_keeps_it(tmp_path, files):
    # what a checkpoint must hold of each optimizer is what it keeps (found by one step of it on the meta device),
    # not a list of names: a fork's second momentum is saved, resumed from, and missing from a checkpoint refused
    module = fork("muon_with_a_second_momentum")
    flags = tiny_flags(files, log_dir=tmp_path / "logs", run_id="slow", num_iterations=4, save_every=2,
                       val_loss_every=0)
    module.main(flags)
    states = {"momentum_buffer", "second_moment", "slow_momentum"}
    for step in (2, 4):
        assert checkpoint(tmp_path, "slow", step)["muon"] and all(
            set(entry) == states for entry in checkpoint(tmp_path, "slow", step)["muon"].values())
    assert any(entry["slow_momentum"].norm() > 0 for entry in checkpoint(tmp_path, "slow", 4)["muon"].values())
    state = checkpoint(tmp_path, "slow", 2)
    name = next(iter(state["muon"]))
    del state["muon"][name]["slow_momentum"]
    torch.save(state, tmp_path / "without.pt")
    with pytest.raises(module.UserError, match=rf"has no Muon state for {re.escape(name)}\.slow_momentum: it is "
                                               r"incomplete"):
        module.main([*flags, f"--resume={tmp_path / 'without.pt'}", "--run_id=without"])
    module.main([*flags, f"--resume={tmp_path / 'logs' / 'slow' / 'step000002.pt'}", "--run_id=again"])
    assert_states_equal(checkpoint(tmp_path, "again", 4), checkpoint(tmp_path, "slow", 4))  # (an exact resume)


def test_a_checkpoint_of_one_matrix_optimizer_is_refused_by_name_under_the_other(tmp_path, files):
    # NorMuon keeps no slow momentum, ANVIL needs one: the flag is named, not the state
    flags = tiny_flags(files, log_dir=tmp_path / "logs", run_id="anvil", num_iterations=2, save_every=2,
                       val_loss_every=0, matrix_optimizer="anvil")
    train_gpt.main(flags)
    saved = tmp_path / "logs" / "anvil" / "step000002.pt"
    assert all("slow_momentum_buffer" in entry for entry in checkpoint(tmp_path, "anvil", 2)["muon"].values())
    with pytest.raises(train_gpt.UserError, match=r"was trained with --matrix_optimizer anvil, whose state "
                                                  r"--matrix_optimizer normuon does not keep: resume with "
                                                  r"--matrix_optimizer anvil$"):
        train_gpt.main([*flags, f"--resume={saved}", "--run_id=normuon", "--matrix_optimizer=normuon"])


# the untie of the head and the embedding (tied_stages 1 of 8 steps: after step 4) moved across the checkpoint's step by
# a changed step count, either way; gradients held for Adam's next step (saved at step 3) under another cadence
@pytest.mark.parametrize("saved_at, tied_stages, resumed, words", [
    (4, 1, dict(num_iterations=12), "--num_iterations 12 moves the untie of the head and the embedding from after "
                                    "step 4 to after step 6, across the step of checkpoint"),
    (2, 1, dict(num_iterations=4), "--num_iterations 4 moves the untie of the head and the embedding from after step "
                                   "4 to after step 2"),
    (3, 0, dict(adam_every=1), "holds gradients summed for Adam's next step on the cadence of --adam_every 2"),
])
def test_a_resume_that_would_change_what_was_trained_is_refused_before_any_file_changes(tmp_path, files, saved_at,
                                                                                         tied_stages, resumed, words):
    run(tmp_path, files, 1, "saved", save_every=saved_at, tied_stages=tied_stages, val_loss_every=0)
    saved = tmp_path / "logs" / "saved" / f"step{saved_at:06d}.pt"
    before = {path: path.read_bytes() for path in (tmp_path / "logs").rglob("*") if path.is_file()}
    with pytest.raises(train_gpt.UserError, match=re.escape(words)):
        run(tmp_path, files, 1, "saved", save_every=saved_at, tied_stages=tied_stages, val_loss_every=0,
            resume=saved, **resumed)
    assert before == {path: path.read_bytes() for path in (tmp_path / "logs").rglob("*") if path.is_file()}
    # what keeps the past as it was resumes: the stages and the lr move from the checkpoint's step on
    kept = dict(num_iterations=6) if tied_stages else dict(adam_every=2, num_iterations=10)
    log = run(tmp_path, files, 1, "saved", save_every=saved_at, tied_stages=tied_stages, val_loss_every=0,
              resume=saved, **kept)
    assert f"resumed: step:{saved_at}/{kept['num_iterations']}" in log


def test_a_table_cadence_that_cannot_act_is_refused_and_so_is_a_changed_one_mid_cycle(tmp_path, files):
    # a cadence whose first cycle ends past the run would never step the tables; one with a step past the run changes
    # nothing
    with pytest.raises(train_gpt.UserError, match=r"first step after step 8, past the run's --num_iterations 4"):
        train_gpt.parse_args(tiny_flags(files, num_iterations=4, table_cadence="0:8"), cuda=False)
    with pytest.raises(train_gpt.UserError, match=r"its step 6 is past the run's --num_iterations 4"):
        train_gpt.parse_args(tiny_flags(files, num_iterations=4, table_cadence="0:2,6:4"), cuda=False)
    # saved after step 5 of a 4-step cycle (steps 4 to 7): step 5's gradients summed for its step after step 7, at
    # the betas of a cycle of 4; a cycle of 2 from there would step them after step 5's sum alone
    run(tmp_path, files, 1, "saved", save_every=6, table_cadence="0:4", val_loss_every=0)
    saved = tmp_path / "logs" / "saved" / "step000006.pt"
    assert checkpoint(tmp_path, "saved", 6)["adam"]["ngram.table.weight"]["held"].any()
    with pytest.raises(train_gpt.UserError, match=r"--table_cadence '0:2': checkpoint .* holds the tables' gradients "
                                                  r"summed over part of a cycle of --table_cadence '0:4'"):
        run(tmp_path, files, 1, "saved", save_every=6, table_cadence="0:2", val_loss_every=0, resume=saved)


def test_a_checkpoint_past_the_step_count_is_refused_with_a_step_count_that_resumes_it(tmp_path, files):
    # advice is a command that works: the step count given is checked as the resume would check it, then taken
    run(tmp_path, files, 1, "long", save_every=5, num_iterations=5, val_loss_every=0)
    saved = tmp_path / "logs" / "long" / "step000005.pt"
    with pytest.raises(train_gpt.UserError, match=r"is at step 5, past --num_iterations 3: resume with "
                                                  r"--num_iterations 5$") as refused:
        run(tmp_path, files, 1, "long", num_iterations=3, val_loss_every=0, resume=saved)
    steps = re.search(r"--num_iterations (\d+)$", str(refused.value)).group(1)
    assert "resumed: step:5/5" in run(tmp_path, files, 1, "long", num_iterations=steps, val_loss_every=0,
                                      resume=saved)
