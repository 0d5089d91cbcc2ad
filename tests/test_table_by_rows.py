"""#92's n-gram table on any number of GPUs with the same math: its gradient, its cadence's sums and its row update
touch only the rows read (held by row), and a host tier keeps some of a rank's rows in host memory. One process with
the table whole, one with it by rows and half its rows in the host tier, and two ranks by rows train alike."""
import pytest
import torch

import train_gpt
from synthetic import tiny_flags
from test_checkpoints import assert_states_equal, checkpoint, run, runs_at_once

STEPS = 12
# #92's table and its update: bigrams and trigrams, stepped by row on Adam's (odd) steps, then on every fourth from
# step 6; the tiny preset's float64 sums of gradients (as one process sums them on any number of ranks)
TABLE = dict(trigrams=True, ngram_optimizer="rows", table_cadence="0:2,6:4", lr_embed=1.0, num_iterations=STEPS,
             val_loss_every=0)


def steps_of_the_table(rank, world_size, flags, validate_at):
    """STEPS steps from the run's own (zero) start, validated after step validate_at: the losses, and on rank 0 the
    one-process training state, and how many of the host tier's rows have values (-1: no host tier)."""
    args = train_gpt.parse_args(flags, cuda=False)
    trainer = train_gpt.build_trainer(args, train_gpt.build_parallel_context(rank, world_size, torch.device("cpu")))
    batches, losses = train_gpt.train_batches(trainer), []
    for step in range(STEPS):
        if step == validate_at:
            losses.append(train_gpt.evaluate(trainer, step))
        loss = train_gpt.forward_backward(trainer, batches, step)
        train_gpt.optimizer_step(trainer, step)
        losses.append(trainer.layout.step_stats(loss, torch.zeros(()), stop=False)[0].item())
    rows = next((rows.rows for rows in trainer.layout.zero.rows.values() if hasattr(rows.rows, "tiers")), None)
    host_rows = int(rows.tiers[1].ne(0).any(1).sum()) if rows is not None else -1
    state = train_gpt.gather_training_state(trainer)
    return losses, train_gpt.flat_state(state) if state is not None else None, host_rows


@pytest.fixture(scope="module")
def table_runs(files):
    """The three layouts' runs of the table: whole (one process), by rows with half of them in a host tier (one
    process), by rows on two ranks (rank 0's report)."""
    flags = lambda **layout: tiny_flags(files, **TABLE, **layout)
    layouts = dict(whole={}, host=dict(tables_by_rows=True, table_host_fraction=0.5),
                   ranks=dict(zero=1, tables_by_rows=True))
    runs = train_gpt.run_together(*((steps_of_the_table, 2 if name == "ranks" else 1, flags(**layout), 5)
                                    for name, layout in layouts.items()))  # (at once: two of them one process each)
    return {name: ranks[0] for name, ranks in zip(layouts, runs)}


def test_one_process_with_half_the_table_in_a_host_tier_trains_the_whole_table_bit_for_bit(table_runs):
    # the same sums in the same order: the whole table's gradient is dense (its rows read are those not zero), the
    # tier's by row; every loss, weight, second moment and held sum alike
    (losses, state, _), (tier_losses, tier_state, host_rows) = table_runs["whole"], table_runs["host"]
    assert losses == tier_losses
    assert state.keys() == tier_state.keys() and all((state[k] == tier_state[k]).all() for k in state)
    table = torch.as_tensor(state["model/ngram.table.weight"])
    assert table.shape == (4096, 32) and (table.norm(dim=1) > 0).sum() > 200  # (its rows read have trained)
    assert host_rows > 100  # (and half of those live in the host tier)


def test_two_ranks_by_rows_train_the_whole_table_bit_for_bit_with_float64_sums(table_runs):
    # each rank sums its lookups' gradients by row in float32 (as an embedding's backward does), and the ranks' and
    # the micro-batches' sums add up in float64, rounded once (the tiny preset's --fp64_grad_sum), as one process's.
    # (The losses logged are means over the ranks' means: float32 rounding of the log, not of the model.)
    (losses, state, _), (rank_losses, rank_state, _) = table_runs["whole"], table_runs["ranks"]
    assert max(abs(a - b) / a for a, b in zip(losses, rank_losses)) < 1e-6
    assert state.keys() == rank_state.keys() and all((state[k] == rank_state[k]).all() for k in state)


def test_a_checkpoint_by_rows_mid_cycle_resumes_on_one_process_with_a_host_tier(tmp_path, files):
    # saved on 2 ranks by rows after step 6: the table's cycle of 4 (steps 4 to 7) holding step 5's gradients in its
    # sums by row, and step 6's gradients held for Adam's next step (each rank's rows' in its float64 sums),
    # resumed on one process with half its rows in the host tier: that layout's run from the start, bit for bit (both
    # add the gradients up in float64), as is the run that saved it
    cadence = dict(TABLE, table_cadence="0:4", val_loss_every=2)
    tier = dict(tables_by_rows=True, table_host_fraction=0.5, **cadence)
    runs_at_once(tmp_path, files, (2, "saved", dict(save_every=7, zero=1, tables_by_rows=True, **cadence)),
                 (1, "reference", dict(save_every=STEPS, **tier)))
    saved = checkpoint(tmp_path, "saved", 7)
    assert saved["adam"]["ngram.table.weight"]["held"].any() and saved["held_gradients"]["ngram.table.weight"].any()
    log = run(tmp_path, files, 1, "resumed", True, save_every=STEPS, resume=tmp_path / "logs" / "saved" /
              "step000007.pt", **tier)
    assert "\nresumed: step:7/12 from " in log
    resumed, reference = checkpoint(tmp_path, "resumed", STEPS), checkpoint(tmp_path, "reference", STEPS)
    assert_states_equal(resumed, reference)
    assert_states_equal(checkpoint(tmp_path, "saved", STEPS), reference)
