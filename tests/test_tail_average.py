"""#92's end game (--tail_average): the averages of the last steps' weights folded and written back as #92's
tail_average.py does, against a float64 loop written from #92's rules for its own 1,194 steps."""
import pytest
import torch

import train_gpt

STEPS = 1194  # #92's, on its cadences: Adam's odd steps, its tables' odd steps then every fourth from step 336


def tiny_trainer(**flags):
    argv = ["--preset", "tiny", "--num_iterations", str(STEPS), "--extension_steps", "20", "--tail_average", "true",
            "--table_cadence", "0:2,336:4", "--value_embed_layers", "1", "--vocab_size", "50304", "--model_dim", "16",
            "--num_heads", "2"]  # (narrow: the tables are most of the time)
    for name, value in flags.items():
        argv += [f"--{name}", str(value)]
    args = train_gpt.parse_args(argv, cuda=False)
    return args, train_gpt.build_trainer(args, train_gpt.build_parallel_context(0, 1, torch.device("cpu")))


def weights_at(start: dict, drift: dict, step: int) -> dict:
    """A stand-in for training: each weight moves along its own direction, unevenly from step to step."""
    return {name: start[name] + (step + 5 * (step % 7)) * drift[name] for name in start}


def by_hand(start: dict, drift: dict, kinds: dict) -> dict:
    """#92's four averages over its steps 0..1193 in float64, from its rules: the head's EMA from step 896 on odd
    steps at 1 - (1 - 2/299)^2, the last at 2/299; the tail average from 945 every 4th at 4/53; the value embeddings'
    from their first event at or after 944 (steps 3 mod 4) at 4/53; the blend from 897 every 4th and at 1192 and 1193
    at 2/75; each seeded by its first step. Then shipped in that order (blend last) and each kind's norm restored."""
    r = 2 / 299
    rules = {"head_ema": (("head", "embed"), lambda s: r if s in (896, 1193) else 1 - (1 - r) ** 2 if s % 2 and
                          s > 896 else None),
             "matrix_average": (("vo", "mlp"), lambda s: 4 / 53 if s >= 944 and (1193 - s) % 4 == 0 else None),
             "value_embed_average": (("value_embed",), lambda s: 4 / 53 if s >= 944 and s % 4 == 3 else None),
             "matrix_blend": (("qk", "vo", "mlp"), lambda s: 2 / 75 if s >= 896 and (s % 4 == 1 or s >= 1192)
                              else None)}
    sums = {average: {} for average in rules}
    for step in range(896, STEPS):
        weights = weights_at(start, drift, step)
        for average, (which, rate) in rules.items():
            if rate(step) is None:
                continue
            for name in (name for kind in which for name in kinds[kind]):
                held = sums[average]
                held[name] = weights[name].clone() if name not in held else \
                    held[name] + rate(step) * (weights[name] - held[name])
    final = weights_at(start, drift, STEPS - 1)
    before = {kind: sum(final[n].square().sum() for n in kinds[kind]) ** 0.5 for kind in train_gpt.TAIL_NORMS_KEPT}
    blends = {"head_ema": dict(head=0.65, embed=0.65), "matrix_average": dict(vo=None, mlp=None),
              "value_embed_average": dict(value_embed=None), "matrix_blend": dict(qk=0.55, vo=0.3493, mlp=0.3493)}
    for average, by_kind in blends.items():
        for kind, blend in by_kind.items():
            for name in kinds[kind]:
                folded = sums[average][name]
                final[name] = folded if blend is None else final[name] + blend * (folded - final[name])
    for kind in train_gpt.TAIL_NORMS_KEPT:
        after = sum(final[n].square().sum() for n in kinds[kind]) ** 0.5
        for name in kinds[kind]:
            final[name] = final[name] * before[kind] / after
    return final


def test_the_tail_averages_fold_and_ship_as_92s_rules_by_hand():
    args, trainer = tiny_trainer()
    kinds = trainer.tail.kinds
    assert all(kinds[kind] for kind in ("head", "embed", "qk", "vo", "mlp", "value_embed"))
    params = dict(trainer.model.named_parameters())
    g = torch.Generator().manual_seed(0)
    averaged = {name for names in kinds.values() for name in names}
    start = {name: torch.randn(params[name].shape, generator=g, dtype=torch.float64) for name in averaged}
    drift = {name: 1e-3 * torch.randn(params[name].shape, generator=g, dtype=torch.float64) for name in averaged}
    with torch.no_grad():
        for step in range(STEPS):
            if step >= 896:
                for name, value in weights_at(start, drift, step).items():
                    params[name].copy_(value)
            trainer.tail.fold(step)
        final = {name: params[name].detach().double().clone() for name in averaged}
        trainer.tail.ship()
    expected = by_hand(start, drift, kinds)
    for name in averaged:
        shipped = params[name].detach().double()
        assert (shipped - expected[name]).norm() <= 1e-5 * expected[name].norm(), name
        assert (shipped - final[name]).norm() > 1e-3 * final[name].norm(), name  # (the averages moved it)
    for kind in train_gpt.TAIL_NORMS_KEPT:  # (each kind's norm as the last step left it)
        norm = lambda weights: sum(weights[n].square().sum() for n in kinds[kind]) ** 0.5
        assert abs(norm({n: params[n].detach().double() for n in kinds[kind]}) / norm(final) - 1) < 1e-6


def test_tail_averages_are_refused_under_zero_3_by_name():
    with pytest.raises(train_gpt.UserError, match="--tail_average with --zero 3: the averages are kept where the "
                                                  "weights are between steps"):
        train_gpt.parse_args(["--preset", "tiny", "--tail_average", "true", "--zero", "3"], cuda=False)


def test_the_plan_counts_the_averages_float32_copies_as_the_last_steps_hold_them():
    # #92's four averages hold the head and the embedding, the values and outputs and the MLPs (twice: an average and
    # a blend), the value embeddings, and the queries and keys: in float32, beside the optimizer states
    flags = ["--preset", "tiny", "--num_iterations", "3", "--adam_every", "1"]
    args, averaged = (train_gpt.parse_args(flags + extra, cuda=False) for extra in ([], ["--tail_average", "true"]))
    plans = [train_gpt.plan_layout(a, 1, cuda=False)["ranks"][0]["optimizer_states"] for a in (args, averaged)]
    model = train_gpt.build_model(args, torch.device("meta"))
    params, kinds = dict(model.named_parameters()), train_gpt.tail_kinds(model)
    copies = {"head": 1, "embed": 1, "qk": 1, "vo": 2, "mlp": 2, "value_embed": 1}
    expected = sum(4 * copies[kind] * params[name].numel() for kind in copies for name in kinds[kind])
    assert expected > 0 and plans[1] - plans[0] == expected
