"""Polar Express and ANVIL's quintics, NorMuon's per-neuron normalisation and cautious weight decay, the Muon optimizer
(NorMuon and ANVIL), and its work shared over data-parallel ranks."""
import pytest
import torch

import train_gpt
from train_gpt import (POLAR_EXPRESS_COEFFICIENTS, DataParallelMuon, Muon, anvil_quintics, normalize_per_neuron,
                       polar_express, run_on_ranks, world_axis)

# ANVIL's six quintics as record #92's optim/anvil.py gives them, typed here from the record
ANVIL_COEFFICIENTS = ((3.923798038567, -6.095026865488, 3.905234618423),
                      (3.278126713798, -3.328923386476, 0.989127286973),
                      (3.505298394150, -5.137358782410, 1.968325560615),
                      (2.815058591845, -3.685181239622, 1.417196497642),
                      (2.245503932403, -2.443826979899, 0.963091710461),
                      (2.256537145403, -2.166840097229, 0.929501253245))


def polar_express_by_svd(G: torch.Tensor, coefficients=POLAR_EXPRESS_COEFFICIENTS, margin=2e-2) -> torch.Tensor:
    """Polar Express (or ANVIL's quintics) in fp64 computed on the singular values: each goes through the quintics,
    after G is scaled by its Frobenius norm with the safety margin; the singular vectors stay."""
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    s = S / (torch.linalg.matrix_norm(G.double(), keepdim=True).squeeze(-1) * (1 + margin) + 1e-6)
    for a, b, c in coefficients:
        s = a * s + b * s**3 + c * s**5
    return U @ torch.diag_embed(s) @ Vh


def anvil_by_svd(G: torch.Tensor) -> torch.Tensor:
    return polar_express_by_svd(G, ANVIL_COEFFICIENTS, margin=5e-2)


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 96), (3, 48, 32)])
def test_polar_express_maps_each_singular_value_through_its_quintics(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X = polar_express(G.float(), dtype=torch.float32).double()
    expected = polar_express_by_svd(G)
    assert X.shape == G.shape
    assert (X - expected).norm() / expected.norm() < 1e-4  # fp32 matrix products against fp64 scalars: ~1e-6 seen
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert (X - U @ Vh).norm() / (U @ Vh).norm() < 0.15  # near the orthogonal polar factor (0.09 seen)


def test_the_quintics_carry_every_singular_value_above_a_thousandth_into_a_band_around_one():
    # the property the coefficients were fitted for (Amsel et al. 2025): a mistyped one breaks it
    s = torch.linspace(1e-3, 1, 100_000, dtype=torch.float64) / 1.02
    for a, b, c in POLAR_EXPRESS_COEFFICIENTS:
        s = a * s + b * s**3 + c * s**5
    assert 0.84 < s.min() and s.max() < 1.15, (s.min(), s.max())  # 0.847 and 1.141


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (3, 48, 32)])
def test_anvils_quintics_map_each_singular_value_through_its_six_maps(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    X = anvil_quintics(G.float(), dtype=torch.float32).double()
    expected = anvil_by_svd(G)
    assert (X - expected).norm() / expected.norm() < 1e-4  # fp32 products against fp64 scalars
    assert (expected - polar_express_by_svd(G)).norm() > 1e-2 * expected.norm()  # not Polar Express's maps


def test_anvils_quintics_carry_every_singular_value_above_a_hundredth_to_within_a_thousandth_of_one():
    # what the six maps do, and the record's "tail gain": their slopes at zero multiply to 643.13
    s = torch.linspace(1e-2, 1, 100_000, dtype=torch.float64) / 1.05
    for a, b, c in train_gpt.ANVIL_COEFFICIENTS:
        s = a * s + b * s**3 + c * s**5
    assert 0.999 < s.min() and s.max() < 1.001, (s.min(), s.max())  # 0.99934 and 1.00040
    assert abs(torch.tensor([a for a, _, _ in train_gpt.ANVIL_COEFFICIENTS]).prod() - 643.13) < 0.01


def test_bf16_iteration_matches_fp32_iteration():
    # the CUDA path iterates in bf16, the CPU path in fp32: both must give the same update to bf16 accuracy
    G = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    fp32 = polar_express(G, dtype=torch.float32)
    bf16 = polar_express(G, dtype=torch.bfloat16).float()
    assert 0 < (bf16 - fp32).norm() / fp32.norm() < 0.06  # bf16's 8-bit mantissa through 5 iterations


def normalized_by_hand(update: torch.Tensor, mean_squares: list, beta2: float) -> torch.Tensor:
    """NorMuon in fp64, one matrix and one neuron (row, or column of a wide matrix) at a time; mean_squares holds
    each matrix's running mean squares (a list per neuron), updated here."""
    out = torch.empty_like(update, dtype=torch.float64)
    for m, v in enumerate(update.double().reshape(-1, *update.shape[-2:])):
        wide = v.size(0) < v.size(1)
        neurons = v.T if wide else v
        running = mean_squares[m]
        for i, neuron in enumerate(neurons):
            running[i] = beta2 * running[i] + (1 - beta2) * (neuron**2).mean().item()
        scaled = torch.stack([neuron / running[i] ** 0.5 for i, neuron in enumerate(neurons)])
        scaled = scaled.T if wide else scaled
        out.view(-1, *update.shape[-2:])[m] = scaled * (v.norm() / scaled.norm())
    return out


@pytest.mark.parametrize("shape", [(24, 16), (16, 24), (3, 24, 16)])
def test_normalize_per_neuron_equals_the_fp64_formula_over_steps(shape):
    g = torch.Generator().manual_seed(2)
    rows, cols = shape[-2:]
    second_moment = torch.zeros(*shape[:-1], 1) if rows >= cols else torch.zeros(*shape[:-2], 1, cols)
    mean_squares = [[0.0] * max(rows, cols) for _ in range(shape[0] if len(shape) == 3 else 1)]
    per_row = rows >= cols
    scales = torch.linspace(0.5, 2, rows if per_row else cols)  # neurons of different scales, for it to even out
    for _ in range(3):
        update = torch.randn(*shape, generator=g) * (scales.view(-1, 1) if per_row else scales.view(1, -1))
        expected = normalized_by_hand(update, mean_squares, beta2=0.9)
        got = normalize_per_neuron(update, second_moment, beta2=0.9)
        assert (got.double() - expected).norm() / expected.norm() < 1e-6
        assert (got - update).norm() > 0.05 * update.norm()  # it changed something
        torch.testing.assert_close(torch.linalg.matrix_norm(got), torch.linalg.matrix_norm(update))


def test_cautious_weight_decay_decays_only_where_the_update_pulls_towards_zero():
    p = torch.tensor([[1.0, -2.0], [3.0, -4.0], [0.5, 0.25]])
    update = torch.tensor([[0.5, 0.5], [-1.0, -1.0], [0.0, 2.0]])
    group = dict(lr=0.1, weight_decay=2.0, step_scale=train_gpt.record89_muon_scale, width=None, block_rows=None)
    expected = p.clone()
    step = 0.1 * (3 / 2) ** 0.5  # lr x sqrt(rows / cols) for a tall matrix
    for i in range(3):
        for j in range(2):
            decays = update[i, j] * p[i, j] >= 0  # same sign (or zero): the step moves p towards zero
            expected[i, j] -= step * (update[i, j] + (2.0 * 0.1 * p[i, j] if decays else 0.0))
    p = torch.nn.Parameter(p)
    with torch.no_grad():
        Muon.apply_update(p, update, Muon([p]).decays(p, update), group, p.shape)
    torch.testing.assert_close(p.detach(), expected)
    assert expected[0, 0] != 1.0 - step * 0.5 and expected[0, 1] == -2.0 - step * 0.5  # decayed, not decayed


def make_params():
    """Shapes like the model's: several equal-size groups, counts not divisible by 2, a 3-D qkv weight."""
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 16), (16, 32), (32, 16), (3, 24, 16), (48, 16), (16, 48), (48, 16)]
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def gradients(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def run_muon(rank, world_size, steps, slow_momentum=0.0, exchange_updates=True):
    params = make_params()
    opt = Muon(params, lr=0.05, momentum=0.9, dtype=torch.float32, slow_momentum=slow_momentum)
    if world_size > 1:
        opt = DataParallelMuon(opt, world_axis(rank, world_size), exchange_updates=exchange_updates)
    for step in range(steps):
        for p, g in zip(params, gradients(step, params)):
            p.grad = g
        opt.param_groups[0]["momentum"] = 0.85 + 0.02 * step  # schedules change group values between steps
        if slow_momentum and step >= 2:  # ANVIL's rails blended
            opt.param_groups[0].update(fast_momentum=0.85, blend=0.4385)
        opt.step()
    if world_size > 1 and not exchange_updates:  # (ZeRO 3: each owner applied its own; gathered here to compare)
        for p in params:
            owner = train_gpt.muon_owners(params, world_size)[p]
            torch.distributed.broadcast(p.data, owner)
    return [p.detach() for p in params]


# NorMuon; ANVIL, whose decay mask travels with the update; ANVIL under ZeRO 3, where each owner applies its own
@pytest.mark.parametrize("slow_momentum, exchange_updates", [(0.0, True), (0.98, True), (0.98, False)])
def test_muon_on_two_processes_equals_one_process(slow_momentum, exchange_updates):
    single = run_muon(0, 1, 4, slow_momentum)
    for rank_params in run_on_ranks(run_muon, 2, 4, slow_momentum, exchange_updates):
        for got, expected in zip(rank_params, single):
            torch.testing.assert_close(torch.as_tensor(got), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("record", [23, 89])
def test_muon_step_equals_hand_computed_update(record):
    params = make_params()[:2]
    start = [p.detach().clone() for p in params]
    opt = Muon(params, lr=0.1, momentum=0.9, beta2=0.8, weight_decay=0.5,
               step_scale=getattr(train_gpt, f"record{record}_muon_scale"), dtype=torch.float32)
    grads = [gradients(s, params) for s in range(3)]
    for s in range(3):
        for p, g in zip(params, grads[s]):
            p.grad = g.clone()
        opt.step()
    for i, p in enumerate(params):
        expected, buf = start[i].double(), torch.zeros_like(start[i])
        mean_squares = [[0.0] * max(p.shape)]
        for s in range(3):
            g = grads[s][i]
            buf = 0.9 * buf + 0.1 * g  # lerp towards the gradient
            nesterov = 0.1 * g + 0.9 * buf
            update = normalized_by_hand(polar_express_by_svd(nesterov), mean_squares, beta2=0.8)
            rows, cols = p.shape[-2:]  # #23: (32, 16) sqrt 2, (16, 32) 1; #89: sqrt 2, and 2 sqrt 2 for the wide
            scale = max(1, rows / cols) ** 0.5 if record == 23 else \
                (max(rows, cols) / min(rows, cols)) ** 0.5 * (2 if cols > rows else 1)
            expected -= 0.1 * scale * (update + 0.5 * 0.1 * (update * expected >= 0) * expected)
        assert (p.detach().double() - expected).norm() / (expected - start[i]).norm() < 1e-4


def anvil_by_hand(start: torch.Tensor, grads: list, mus: list, blend_step: int, lr: float, weight_decay: float,
                  scale: float, decay_on_slow: bool = True) -> torch.Tensor:
    """#92's ANVIL in fp64 for one matrix, as its optim/anvil.py steps it: a fast momentum (decay mu until the blend
    step, then 0.85) and a slow one (0.98), Nesterov over their blend (all fast, then 0.4385 fast), ANVIL's quintics,
    the per-lane equaliser (beta2 0.9), and decay where the slow momentum (decay_on_slow false: the update) pulls the
    weight towards zero."""
    p, fast, slow = start.double(), torch.zeros_like(start.double()), torch.zeros_like(start.double())
    mean_squares = [[0.0] * max(start.shape)]
    for s, (g, mu) in enumerate(zip(grads, mus)):
        g = g.double()
        beta_fast, w = (mu, 1.0) if s < blend_step else (0.85, 0.4385)
        fast = beta_fast * fast + (1 - beta_fast) * g
        slow = 0.98 * slow + 0.02 * g
        nesterov = (1 - mu) * g + mu * (w * fast + (1 - w) * slow)
        update = normalized_by_hand(anvil_by_svd(nesterov), mean_squares, beta2=0.9)
        decays = (slow if decay_on_slow else update) * p >= 0
        p = p - lr * scale * (update + weight_decay * lr * decays * p)
    return p


@pytest.mark.parametrize("shape", [(32, 16), (16, 32)])
def test_anvil_steps_as_92s_fp64_loop_across_the_blend_of_its_rails(shape):
    g = torch.Generator().manual_seed(6)
    start = torch.randn(*shape, generator=g)
    grads = [torch.randn(*shape, generator=g) + 0.5 * (-1) ** s for s in range(8)]  # (signs the slow rail lags)
    mus = [0.85 + 0.01 * s for s in range(8)]
    p = torch.nn.Parameter(start.clone())
    opt = Muon([p], lr=0.1, beta2=0.9, weight_decay=2.25, step_scale=train_gpt.record89_muon_scale,
               orthogonalize=anvil_quintics, dtype=torch.float32, slow_momentum=0.98)
    for s, (grad, mu) in enumerate(zip(grads, mus)):
        opt.param_groups[0].update(momentum=mu, fast_momentum=None if s < 4 else 0.85, blend=1.0 if s < 4 else 0.4385)
        p.grad = grad.clone()
        opt.step()
    rows, cols = shape  # #89's shape rule at the shorter side's width: sqrt 2, and 2 sqrt 2 for the wide
    scale = (max(rows, cols) / min(rows, cols)) ** 0.5 * (2 if cols > rows else 1)
    expected = anvil_by_hand(start, grads, mus, 4, 0.1, 2.25, scale)
    moved = (expected - start).norm()
    assert (p.detach().double() - expected).norm() < 1e-4 * moved
    # what the comparison tells apart: decay on the update's sign, the rails never blended
    assert (anvil_by_hand(start, grads, mus, 4, 0.1, 2.25, scale, decay_on_slow=False) - expected).norm() > 1e-3 * moved
    assert (anvil_by_hand(start, grads, mus, 8, 0.1, 2.25, scale) - expected).norm() > 1e-2 * moved


def test_anvils_schedule_is_92s():
    # #92's Nesterov momentum over its 1,194 steps: 0.85 to 0.93 over 240, back over the last 50; its rails from 514
    args = train_gpt.parse_args(["--preset", "record"], cuda=False)
    assert [round(train_gpt.muon_momentum(s, args), 6) for s in (0, 120, 240, 1144, 1193)] == \
        [0.85, 0.89, 0.93, 0.93, 0.8516]
    assert train_gpt.anvil_rails(513, args) == dict(fast_momentum=None, blend=1.0)
    assert train_gpt.anvil_rails(514, args) == dict(fast_momentum=0.85, blend=0.4385)


def test_a_group_with_block_rows_steps_each_block_of_rows_as_a_matrix_of_its_own():
    """#80: attention's q and k weights (2, H x D, width) stepped per pair of heads, each (2D, width) block through
    Polar Express and NorMuon on its own, in fp64 by hand, at #89's step size for such a block (1)."""
    g = torch.Generator().manual_seed(4)
    start = torch.randn(2, 32, 24, generator=g)  # q and k of 4 heads of 8 dims, width 24: 4 blocks of 16 rows
    grads = [torch.randn(2, 32, 24, generator=g) for _ in range(3)]
    runs = {}
    for block_rows in (16, None):
        p = torch.nn.Parameter(start.clone())
        opt = Muon([dict(params=[p], block_rows=block_rows)], lr=0.1, momentum=0.9, beta2=0.8, weight_decay=0.5,
                   step_scale=train_gpt.record89_muon_scale, dtype=torch.float32, width=24)
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
        runs[block_rows] = p.detach().double()
    expected, buf, mean_squares = start.double(), torch.zeros_like(start), [[0.0] * 24 for _ in range(4)]
    for grad in grads:
        buf = 0.9 * buf + 0.1 * grad
        blocks = (0.1 * grad + 0.9 * buf).view(4, 16, 24)
        update = normalized_by_hand(polar_express_by_svd(blocks), mean_squares, beta2=0.8).view(2, 32, 24)
        expected -= 0.1 * (update + 0.5 * 0.1 * (update * expected >= 0) * expected)
    assert (runs[16] - expected).norm() / (expected - start).norm() < 1e-4
    assert (runs[None] - runs[16]).norm() > 0.1 * (expected - start).norm()  # (whole matrices step otherwise)


def test_89s_step_sizes_by_shape_at_its_width():
    # #89's, by hand at width 768: MLP input (3072 x 768) sqrt(4) = 2, output (768 x 3072) 2 x 2 (its hidden-major
    # layout, doubled), attention's square matrices 1, a pair of heads' q or k block (256 x 768) 1
    step = lambda shape, block_rows=None: Muon.step_size(dict(
        lr=1.0, step_scale=train_gpt.record89_muon_scale, width=768, block_rows=block_rows), shape)
    assert [step((3072, 768)), step((768, 3072)), step((768, 768)), step((2, 768, 768), 256)] == [2, 4, 1, 1]


def test_polar_express_compiled_as_on_cuda_equals_the_eager_one():
    # build_optimizers compiles it on CUDA; Inductor's CPU code stands in for its GPU code here (tests/test_cuda.py
    # runs the compiled bf16 one on a GPU against the fp64 reference)
    G = torch.randn(3, 48, 32, generator=torch.Generator().manual_seed(3))
    eager = polar_express(G, dtype=torch.float32)
    compiled = torch.compile(polar_express, dynamic=False)(G, dtype=torch.float32)
    assert (compiled - eager).norm() / eager.norm() < 1e-5  # the same fp32 products, fused apart
    assert (eager - G / G.norm(dim=(-2, -1), keepdim=True)).norm() > 0.1 * eager.norm()  # it orthogonalised
