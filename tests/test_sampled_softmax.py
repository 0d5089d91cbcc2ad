"""Record #92's sampled softmax: training's loss over a set of candidate entries of the vocabulary that a micro-batch's
tokens share. The candidates against hand-computed sweeps, the loader's draws under two world sizes and a resume, the
head's loss and gradients against a float64 softmax restricted to the candidates, and tensor parallelism, where the
candidates span the ranks' parts of the vocabulary, against one process."""
import numpy as np
import pytest
import torch

import train_gpt
from conftest import REPO_ROOT

SHAKESPEARE = REPO_ROOT / "data" / "shakespeare"


def test_the_candidates_are_the_distinct_targets_then_the_sweeps_next_entries_not_among_them():
    # rows 384: the sweep's k-th entry is 20011 k mod 384 = 43 k mod 384; from cursor 100, by hand: 4300 mod 384 = 76,
    # then 119, 162, 205, 248, 291, 334 (none a target); 3 distinct targets, so 7 negatives, read from a window of
    # 1.7 x 7 + 256 = 267 entries, which the cursor moves past
    candidates, cursor = train_gpt.sampled_candidates(np.array([5, 7, 5, 300, 7]), 10, 384, cursor=100)
    assert candidates.tolist() == [5, 7, 76, 119, 162, 205, 248, 291, 300, 334] and cursor == 367
    # a target where the sweep reads is passed over: 76 and 119 are targets, so the two after 334 (377, 36) join
    candidates, _ = train_gpt.sampled_candidates(np.array([76, 119]), 9, 384, cursor=100)
    assert candidates.tolist() == [36, 76, 119, 162, 205, 248, 291, 334, 377]
    # as many distinct targets as candidates, or more: those, and the cursor stays
    assert train_gpt.sampled_candidates(np.arange(20), 12, 384, cursor=5)[0].tolist() == list(range(20))
    assert train_gpt.sampled_candidates(np.arange(12), 12, 384, cursor=5)[1] == 5


def test_a_window_of_targets_leaves_it_to_evenly_spaced_entries_of_the_rest():
    # #92's fallback: the 600 targets are the sweep's next 600 entries, so its window of 1.7 x 100 + 256 = 426 holds
    # no new one; the 100 negatives are then every 14th entry of the 1,448 others (1448 // 100 = 14)
    rows, cursor = 2048, 7
    targets = 20011 * np.arange(cursor, cursor + 600) % rows
    candidates, moved = train_gpt.sampled_candidates(targets, 700, rows, cursor)
    others = sorted(set(range(rows)) - set(targets.tolist()))
    assert candidates.tolist() == sorted(set(targets.tolist()) | set(others[::14][:100]))
    assert moved == cursor + 426


def test_the_loader_draws_each_sequences_candidates_alike_under_one_and_two_ranks_and_after_a_resume():
    """Each sequence of a step has a cursor of its own (#92's rank's), starting spread over the vocabulary, and
    every rank moves all of them: two ranks draw what one draws, and the position carries the cursors."""
    rows, files, seqs = 50304, str(SHAKESPEARE / "shakespeare_train_*.bin"), 4
    cpu = torch.device("cpu")

    def loader(rank, world_size, position=None):
        batches = train_gpt.DistributedDataLoader(files, 64, seqs, rank, world_size, cpu, position=position,
                                                  candidates=rows)
        batches.set_shape(64, 0, candidates=256)
        return batches

    def step(batches, micro_steps):
        return [(next(batches)[1], batches.candidates) for _ in range(micro_steps)]

    one, ranks = loader(0, 1), [loader(r, 2) for r in range(2)]
    assert one.cursors == [0, 12576, 25152, 37728]
    for _ in range(3):
        drawn = step(one, seqs)
        split = step(ranks[0], 2), step(ranks[1], 2)
        for j, (targets, candidates) in enumerate(drawn):
            assert len(candidates) == 256 and bool(torch.isin(targets, candidates).all())
            assert torch.equal(candidates, split[j % 2][j // 2][1])  # sequence j: rank j % 2's (j // 2)th
        assert len({tuple(c.tolist()) for _, c in drawn}) == seqs  # each cursor its own negatives
    assert one.position() == ranks[0].position() == ranks[1].position()
    assert one.position()["negatives"] != [0, 12576, 25152, 37728]
    resumed = loader(0, 1, position=one.position())
    for (t1, c1), (t2, c2) in zip(step(one, seqs), step(resumed, seqs)):
        assert torch.equal(t1, t2) and torch.equal(c1, c2)


def float64_restricted_loss(soft_cap, weight, x, targets, weights, candidates):
    """The head's loss in float64 with its softmax over the candidates only: each target among them is scored
    against their log-sum-exp, and one elsewhere counts nothing."""
    cap, shift, divisor = soft_cap
    logits = cap * torch.sigmoid((x @ weight.T + shift) / divisor)  # (T, V)
    lse = logits[:, candidates].logsumexp(-1)  # (T,)
    columns = targets if targets.dim() == 2 else targets[:, None]
    w = torch.ones(columns.size(1), dtype=torch.float64) if weights is None else weights.double()
    counted = torch.isin(columns, candidates) & (columns >= 0)
    picked = logits.gather(1, columns.clamp_min(0))
    return ((lse[:, None] - picked) * counted * w).sum()


def head_loss(head, x, targets, weights=None, **kwargs):
    """The loss GPT.forward builds from the head's statistics."""
    stats = head(x, targets, **kwargs)
    return train_gpt.summed_loss(stats.log_probs(), stats.found, weights)


@pytest.mark.parametrize("weighted", [False, True])
def test_the_heads_sampled_loss_and_its_gradients_are_a_float64_softmax_over_the_candidates(weighted):
    """The head in training with candidates, against float64 restricted to them: the loss, and the gradients of the
    input and of the weight, which is zero on every row outside the candidates. With weights, the later tokens' and
    prefix targets' columns, some of whose targets are outside the candidates (counted nothing, as #92's) or -1."""
    torch.manual_seed(0)
    rows, dim, tokens = 256, 16, 40
    head = train_gpt.LMHead(dim, rows, soft_cap=(23.0, 5.0, 7.5))
    head.weight.data.normal_(std=0.5)
    x = torch.randn(tokens, dim, requires_grad=True)
    targets = torch.randint(0, rows, (tokens,))
    weights = None
    if weighted:
        later, prefix = torch.roll(targets, -1), torch.randint(0, rows, (tokens,))
        later[-1], prefix[:5] = -1, -1
        targets, weights = torch.stack([targets, later, prefix], dim=1), torch.tensor([1.0, 0.5, 0.25])
    negatives = torch.tensor([1, 2, 3, 100, 200, 255])
    candidates = torch.cat([(targets if targets.dim() == 1 else targets[:, 0]), negatives]).unique()
    if weighted:
        assert not torch.isin(targets[:, 2][targets[:, 2] >= 0], candidates).all()  # some prefix targets left out
    targets = targets if weighted else targets[:, None]
    got = head_loss(head, x, targets, weights, candidates=candidates)
    got.backward()
    x64, weight64 = (t.detach().double().requires_grad_() for t in (x, head.weight))
    expected = float64_restricted_loss(head.soft_cap, weight64, x64, targets, weights, candidates)
    expected.backward()
    whole = head_loss(head, x.detach(), targets, weights)  # the whole vocabulary's
    assert whole.item() - expected.item() > 10  # the restriction matters here
    assert torch.isclose(got.double(), expected, rtol=1e-6), (got, expected)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    grad_w = head.weight.grad
    torch.testing.assert_close(grad_w.double(), weight64.grad, rtol=1e-5, atol=1e-6)
    outside = torch.ones(rows, dtype=torch.bool)
    outside[candidates] = False
    assert grad_w[outside].eq(0).all() and grad_w[~outside].abs().sum(-1).gt(0).all()


def sampled_steps_on_rank(rank, world_size, flags, steps):
    """train_gpt.train_steps, with the rows of this rank's head and those it scored in the first step."""
    scored = {}
    original = train_gpt.LMHead.logits

    def logits(head, x, rows=None):
        if rows is not None and not scored:
            scored.update(rows=rows.clone(), head_rows=head.weight.size(0))
        return original(head, x, rows)
    train_gpt.LMHead.logits = logits
    result = train_gpt.train_steps(rank, world_size, flags, steps)
    return dict(losses=result["losses"], val_loss=result["val_loss"], **scored)


def test_under_tensor_parallelism_each_rank_scores_its_own_candidates_and_training_matches_one_process():
    """The tiny model, 4 steps of sampled softmax (384, then 1024 candidates from step 2): under --tp 2 each rank
    holds half the head's rows and scores the candidates among them; the losses are one process's."""
    flags = ["--preset=tiny", "--num_iterations=4", "--adam_every=1", "--candidates=384,384:1024,1024,1024",
             f"--train_files={SHAKESPEARE}/shakespeare_train_*.bin", f"--val_files={SHAKESPEARE}/shakespeare_val_*.bin"]
    one = sampled_steps_on_rank(0, 1, flags, 4)
    split = train_gpt.run_on_ranks(sampled_steps_on_rank, 2, flags + ["--tp=2"], 4)
    assert one["head_rows"] == 50304 and [rank["head_rows"] for rank in split] == [25152, 25152]
    assert len(one["rows"]) == 384 and min(len(rank["rows"]) for rank in split) > 0  # (spanning both halves)
    assert np.array_equal(np.concatenate([split[0]["rows"], split[1]["rows"] + 25152]), one["rows"])
    for rank in split:
        np.testing.assert_allclose(rank["losses"], one["losses"], rtol=1e-5)
        assert abs(rank["val_loss"] - one["val_loss"]) < 1e-4
