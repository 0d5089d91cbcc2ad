"""ZeRO 1, 2 and 3 over two gloo processes: what each rank holds, the bytes a run logs against --plan, and the
plan of the record on eight GPUs. (tests/test_layouts.py: the same training as one process.)"""
import dataclasses
import re
import types

import torch

import pytest

import train_gpt
from train_gpt import run_on_ranks
from layouts import LAYOUT_TEST_FLAGS, assert_sends_what_the_plan_says, beside_its_plan
from synthetic import TWO_LAYERS, tiny_flags
from test_checkpoints import main_on_rank


def rows_padding(args, world_size):
    """The embedding tables whose rows the ranks share out under ZeRO, and the bytes of rows of zeros that pad each
    rank's (the ranks with fewer rows have one of them), over all ranks."""
    model = train_gpt.build_model(args, torch.device("meta"))
    tied = train_gpt.tied_pair(model, args.vocab_size) if args.tied_stages else ()
    names = {p: name for name, p in model.named_parameters()}
    shared_out = [t for t in train_gpt.embedding_tables(model) if names[t] not in (tied or ())]
    return len(shared_out), sum(-len(t) % world_size * t[0].numel() * t.element_size() for t in shared_out)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_on_two_ranks_splits_what_each_rank_holds(layout_runs, layout_files, zero):
    ranks, single = layout_runs(f"dp2_zero{zero}"), layout_runs("one process")
    held = [rank["accounted"] for rank in ranks]
    full = single["accounted"]
    # the embedding tables (but the one tied to the head) are shared out by rows: each rank keeps its rows, and its
    # own step count of each
    args = train_gpt.parse_args(tiny_flags(layout_files, **LAYOUT_TEST_FLAGS), cuda=False)
    shared_out, padding = rows_padding(args, 2)
    assert shared_out == 4 and padding > 0
    # after the step's reduction each rank keeps the gradients of the parameters it updates: one copy in all
    assert sum(rank["gradients"] for rank in held) == full["gradients"] + padding
    if zero >= 3:  # one copy of the parameters across the ranks between uses, and more while a step runs (those
        # read outside the unit holding them are whole on each rank: the tiny model's are layer 4's skip gate,
        # which GPT.forward reads where the skip joins, and the gate networks' one scale, which the second network
        # reads; its backout is one of MUDD's head coefficients)
        model = train_gpt.build_model(args, torch.device("meta"))
        whole = (model.blocks[4].skip_gate.numel() + model.gate_networks["0"].scale.numel()) * 4
        assert sum(rank["parameters"] for rank in held) == full["parameters"] + padding + whole
        assert all(rank["parameters"] < rank["peak_parameters"] < full["parameters"] for rank in held)
    # one copy of the optimizer states (Adam's two moments of the padding, and a step count a table on each rank)
    assert sum(rank["optimizer_states"] for rank in held) == full["optimizer_states"] + 2 * padding + shared_out * 4
    # stage 1 all-reduces the gradients (float64 sums, the tiny preset's) and broadcasts what owners updated; from
    # stage 2 on, the ZeRO paper's volume: every gradient handed once to its owner's reduce. Beside them, the one
    # all-reduce of the step's loss, gradient norm and stop flag. But the embedding tables': at every stage only
    # the rows the step looked up travel, to the owner, in less than a tenth of the table's bytes
    comm = held[0]["comm"]
    tables = train_gpt.embedding_tables(train_gpt.build_model(args, torch.device("meta")))
    table_sums = sum(p.numel() for p in tables) * torch.float64.itemsize
    sent_by_tables = sum(n for op, n in comm.items() if op.startswith("table_"))
    assert len(tables) == 5 and 0 < comm["table_all_to_all"] and sent_by_tables < table_sums / 10
    assert "table_all_gather" not in comm and "table_reduce" not in comm
    if zero == 1:
        assert comm["all_reduce"] == full["gradient_sums"] - table_sums + 3 * 4 and "reduce" not in comm
    else:
        assert comm["reduce"] == full["gradient_sums"] - table_sums and comm["all_reduce"] == 3 * 4


def test_tables_held_by_rows_leave_each_rank_its_share_of_their_rows_and_no_whole_table(layout_runs, layout_files):
    # --tables_by_rows: against ZeRO 1 with whole tables, each rank holds every table (but the one tied to the head)
    # less, its parameters and their gradients (its rows' gradients are its only ones); what they fetch and send
    # back travels as the tables' rows (test_layouts: it trains the one-process model, as the plan says)
    by_rows, whole = (layout_runs(name) for name in ("dp2_zero1_rows", "dp2_zero1"))
    args = train_gpt.parse_args(tiny_flags(layout_files, **LAYOUT_TEST_FLAGS), cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))
    tied = train_gpt.tied_pair(model, args.vocab_size) or ()
    names = {p: name for name, p in model.named_parameters()}
    tables = sum(t.numel() * t.element_size() for t in train_gpt.embedding_tables(model) if names[t] not in tied)
    assert tables > 0.5 * sum(p.numel() * p.element_size() for p in model.parameters())  # (most of the tiny model)
    for rows, kept in zip(by_rows, whole):
        held, full = rows["accounted"], kept["accounted"]
        assert held["parameters"] == full["parameters"] - tables
        # (the tiny preset sums gradients in float64: whole tables there too; by rows, the rows read, by row)
        assert 0 < held["gradient_sums"] - (full["gradient_sums"] - 2 * tables) < tables
        assert held["gradients"] <= full["gradients"]
        assert held["comm"]["table_all_to_all"] > full["comm"]["table_all_to_all"]  # (the lookups too)
        assert "all_gather_single" not in held["comm"] or \
            held["comm"]["all_gather_single"] < full["comm"]["all_gather_single"] - tables / 2  # (no table gathered)


@pytest.mark.parametrize("layout", [dict(), dict(zero=2), dict(zero=3), dict(zero=1, tp=2),
                                    dict(tp=2, sp=True, async_tp=True), dict(pp=2)])
def test_counted_collective_bytes_per_step_equal_the_plan(tmp_path, files, layout):
    flags = tiny_flags(files, **layout, log_dir=tmp_path, run_id="comm", num_iterations=2)
    _, plan = beside_its_plan(lambda: run_on_ranks(main_on_rank, 2, flags), flags, 2)
    log = (tmp_path / "comm.txt").read_text()
    lines = re.findall(r"^comm: step:(\d+) bytes per rank (.*)$", log, flags=re.M)
    # logged once for each kind of step: under data parallelism, Adam's gradients wait for the step that uses them,
    # the second in the tiny preset (the record's adam_every 2)
    data_parallel = layout.get("tp", 1) * layout.get("pp", 1) == 1
    assert [step for step, _ in lines] == (["1", "2"] if data_parallel else ["1"])
    sent = [{op: int(n) for op, n in (item.split(":") for item in line.split())} for _, line in lines]
    counted = sent[-1]
    assert not data_parallel or sum(sent[0].values()) < sum(counted.values())
    if data_parallel and layout.get("zero") in (1, 2):  # owners broadcast what Adam updated, only when it steps
        assert "broadcast" not in sent[0] and counted["broadcast"] > 0
    assert_sends_what_the_plan_says(counted, plan["ranks"][0]["comm"])


def test_a_plan_without_a_preset_prints_per_rank_memory_for_92s_record_on_four_gpus_and_it_fits(capsys):
    train_gpt.main(["--plan", "true", "--nproc", "4"])
    out = capsys.readouterr().out
    assert "preset record" in out  # (said: no preset was named)
    assert "4 processes = pipeline 1 x data parallel 4 x tensor parallel 1, ZeRO stage 1" in out  # (the preset's)
    assert len(re.findall(r"^\s+\d+\s+\d+\s+\d+\.\d+ ", out, flags=re.M)) == 4  # one memory row per rank
    # #92's n-gram table, 84,602,880 x 768, is all but 0.45% of the model; held by rows, its gradients and its
    # cadence's sums by row, it fits an 80 GB GPU of 4: 31.5 GB of it its rows (bf16), 18.5 the activations
    count = int(re.search(r"([\d,]+) parameters", out).group(1).replace(",", ""))
    assert 84_602_880 * 768 < count < 1.0045 * 84_602_880 * 768
    fits = re.search(r"on 80 GB GPUs \(an H100's\): fits, (\d+\.\d) GB of 76\.0 GB a rank", out)
    assert fits and 2 * count / 4 / 1e9 < float(fits.group(1)) < 60
    # record #89's model (the record89 preset), by hand: the head and the token embedding tied to it 2 x 50304 x 768,
    # 5 value embeddings 5 x 50257 x 768, 10 attention layers 4 x 768^2 + 2 (v's scale and the output projection's),
    # 11 MLPs 8 x 768^2, the scales of the residual and the output (2 each) of 10 MLPs and 9 attentions (not the
    # dense layer's), the skip's gate, 4 value-embedding gates 6 x 12, the smear's gate (12) and scale, two gate
    # networks of 64 x 768 and 26 and 41 coefficients (DC-MHA's 12 among them) of 64 + 1 each and their one scale,
    # MUDD's two of 64 x 768 and 14 and 5 coefficients of 65, the bigram table 377280 x 768: 635,704,895 (#89's
    # file: 643,751,335)
    assert train_gpt.parameter_count(train_gpt.parse_args(["--preset", "record89"], cuda=True)) == 635_704_895


def test_the_plan_counts_adams_gradients_held_whole_on_every_rank(files):
    # without float64 sums, a step that holds Adam's gradients keeps each rank's own, whole, until Adam's step
    # reduces them to their owners: the plan shows the larger of the two steps
    flags = dict(zero=1, fp64_grad_sum=False, num_iterations=3)
    plans = {every: train_gpt.plan_layout(train_gpt.parse_args(tiny_flags(files, adam_every=every, **flags),
                                                               cuda=False), 2, cuda=False) for every in (1, 2)}
    args = train_gpt.parse_args(tiny_flags(files, **flags), cuda=False)
    model = train_gpt.build_model(args, torch.device("meta"))
    params = dict(model.named_parameters())
    groups = train_gpt.optimizer_param_groups(model, args.vocab_size, args.model_dim)
    adam_bytes = sum(train_gpt.nbytes(params[name]) for kind in groups if kind != "muon" for name in groups[kind])
    owned, held = ([rank["gradients"] for rank in plans[every]["ranks"]] for every in (1, 2))
    padding = rows_padding(args, 2)[1]  # (each rank's rows of the tables: held whole, or its rows padded)
    assert adam_bytes > 0 and sum(held) == sum(owned) - padding + adam_bytes  # each of Adam's on both ranks, not one



def test_the_plan_counts_buffers_and_a_sampled_softmaxs_largest_head(files):
    # the canonical mask's bits: 50,304 next tokens x 50,304 / 8 bytes on one process, half of its rows on each of two
    # tensor-parallel ranks; the head's largest step: a sampled softmax scoring 512 rows until step 5 and every row from
    # step 6 (the plan's steps 4 and 5 hold Adam's gradients and step: sampled) plans the whole head's activations, one
    # never scoring every row fewer
    def plan(world_size=1, **flags):
        args = train_gpt.parse_args(tiny_flags(files, fp64_grad_sum=False, num_iterations=8,
                                               train_seq_len="128,256,256,256", **flags) + TWO_LAYERS, cuda=False)
        return train_gpt.plan_layout(args, world_size, cuda=False)["ranks"]
    plain, masked = plan()[0], plan(canonical_mask=True)[0]
    split, split_plain = plan(2, canonical_mask=True, tp=2), plan(2, tp=2)[0]
    assert masked["buffers"] - plain["buffers"] == 50304 * 50304 // 8
    assert [rank["buffers"] - split_plain["buffers"] for rank in split] == [50304 * 50304 // 16] * 2
    late_whole, always_sampled = plan(candidates="512,512,512:0:0,0")[0], plan(candidates="512")[0]
    assert late_whole["activations"] == plain["activations"] > always_sampled["activations"]


def steps_of_a_table_built(rank, world_size, flags, by_rows):
    """Three steps from the run's own (zero) start under a layout holding the tables by rows, the n-gram table built
    on meta (by_rows) or whole, as a layout that cannot build it by rows does: whether its table had values, and on
    rank 0 the losses and the one-process training state."""
    train_gpt.Layout.tables_built_by_rows = lambda args, ctx: by_rows  # (this rank's process alone)
    args = train_gpt.parse_args(flags, cuda=False)
    trainer = train_gpt.build_trainer(args, train_gpt.build_parallel_context(rank, world_size, torch.device("cpu")))
    table_is_meta = trainer.model.ngram.table.weight.is_meta
    batches, losses = train_gpt.train_batches(trainer), []
    for step in range(3):
        losses.append(train_gpt.forward_backward(trainer, batches, step).item())
        train_gpt.optimizer_step(trainer, step)
    state = train_gpt.gather_training_state(trainer)  # (rank 0's)
    return table_is_meta, losses, train_gpt.flat_state(state) if state is not None else None


def test_a_zero_started_table_held_by_rows_is_never_built_whole_and_trains_as_one_built_whole(layout_files):
    # #92's table is 130 GB in bf16: each rank makes only its rows of its zeros. The reference: the same layout with
    # the table built whole and then shared out (test_layouts: that trains the one-process model); the same sums
    # in the same order, so bit for bit
    flags = tiny_flags(layout_files, zero=1, tables_by_rows=True, num_iterations=3, adam_every=1)
    (meta, losses, state), _ = run_on_ranks(steps_of_a_table_built, 2, flags, True)
    (whole, reference_losses, reference), _ = run_on_ranks(steps_of_a_table_built, 2, flags, False)
    assert meta and not whole
    assert losses == reference_losses
    table = torch.as_tensor(state["model/ngram.table.weight"])  # (run_on_ranks hands arrays back)
    assert table.shape == (4096, 32) and (table.norm(dim=1) > 0).sum() > 100  # (its looked-up rows trained)
    assert state.keys() == reference.keys() and all((state[k] == reference[k]).all() for k in state)


def test_the_host_memory_check_counts_a_table_built_by_rows_as_its_ranks_rows(monkeypatch):
    # a tiny model of a 64e9-parameter table: whole on each of 8 processes it needs 2 TB of the host, by rows none
    # (its rows are made on the GPUs), or on CPUs an eighth of it each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = train_gpt.parse_args(["--preset", "tiny", "--ngram_rows", "2000000000", "--zero", "1"], cuda=False)
    ranks = lambda device: types.SimpleNamespace(dp=types.SimpleNamespace(size=8), tp=types.SimpleNamespace(size=1),
                                                 pp=types.SimpleNamespace(size=1), device=torch.device(device))
    with pytest.raises(train_gpt.UserError, match=r"parameters \(\d+% of them in ngram.table.weight"):
        train_gpt.check_host_memory(args, ranks("cuda"))
    by_rows = dataclasses.replace(args, tables_by_rows=True)
    train_gpt.check_host_memory(by_rows, ranks("cuda"))
    with pytest.raises(train_gpt.UserError, match=r"need at least 95[34]\.\d GiB"):  # (16 bytes x 8e9 x 8: 954 GiB)
        train_gpt.check_host_memory(by_rows, ranks("cpu"))


def whole_of_a_table_by_rows(rank, world_size, chunk_bytes):
    """A 4097-row table's rows on this rank, gathered whole for a checkpoint: its values and a per-row state; and the
    elements of each gather this rank took part in."""
    ctx = train_gpt.build_parallel_context(rank, world_size, torch.device("cpu"))
    table = torch.arange(4097 * 3, dtype=torch.float32).view(4097, 3)
    rows = train_gpt.TableRows(table, ctx.dp, ctx.device)
    sizes, gather = [], rows._all_gather
    rows._all_gather = lambda t: sizes.append(t.numel() * world_size) or gather(t)
    values, per_row = rows.whole(rows.rows.detach(), chunk_bytes), rows.whole(rows.rows[:, 1].detach(), chunk_bytes)
    return values, per_row, sizes


def test_a_table_held_by_rows_is_gathered_for_a_checkpoint_a_chunk_at_a_time_onto_the_first_ranks_cpu():
    # #92's table is 130 GB: gathered whole on each GPU for a checkpoint, it would not fit. Rank 0 gets it on its CPU,
    # 2,400 bytes a gather: 100 rows of each rank (300 of the per-row state), the last rank one row short
    (values, per_row, sizes), (elsewhere, _, _) = run_on_ranks(whole_of_a_table_by_rows, 2, 2400)
    table = torch.arange(4097 * 3, dtype=torch.float32).view(4097, 3)
    assert torch.equal(torch.as_tensor(values), table) and torch.equal(torch.as_tensor(per_row), table[:, 1])
    assert elsewhere is None
    assert len(sizes) == 21 + 7 and max(sizes) * 4 == 2400 and sum(sizes) == 2 * 2049 * 3 + 2 * 2049
