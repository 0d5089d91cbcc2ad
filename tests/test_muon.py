"""Newton-Schulz orthogonalisation, the Muon optimizer, and its work shared over data-parallel ranks."""
import pytest
import torch

from train_gpt import DataParallelMuon, Muon, run_on_ranks, world_axis, zeropower_via_newtonschulz5


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 96), (3, 48, 32)])
def test_newton_schulz_keeps_singular_vectors_and_bands_singular_values(shape):
    # singular values of the normalised input above ~0.5 / 3.4445**5 (the slope at zero, 5 steps) reach the band
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X = zeropower_via_newtonschulz5(G.float(), steps=5, dtype=torch.float32).double()
    assert X.shape == G.shape
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    # in G's singular basis the output is diagonal: same singular vectors, new singular values
    core = U.mT @ X @ Vh.mT
    diag = torch.diagonal(core, dim1=-2, dim2=-1)
    off_diag = core - torch.diag_embed(diag)
    assert off_diag.abs().max() < 1e-3
    assert diag.max() < 1.5
    reachable = S / torch.linalg.matrix_norm(G, keepdim=True).squeeze(-1) > 0.003
    assert reachable.float().mean() > 0.9  # random matrices: nearly all singular values
    assert diag[reachable].min() > 0.5, diag.min()


def test_bf16_iteration_matches_fp32_iteration():
    # the CUDA path iterates in bf16, the CPU path in fp32: both must give the same update to bf16 accuracy
    G = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    fp32 = zeropower_via_newtonschulz5(G, dtype=torch.float32)
    bf16 = zeropower_via_newtonschulz5(G, dtype=torch.bfloat16).float()
    assert (bf16 - fp32).norm() / fp32.norm() < 0.06  # bf16's 8-bit mantissa through 5 iterations: ~4% seen


def make_params():
    """Shapes like the model's: several equal-size groups, counts not divisible by 2, a 3-D qkv weight."""
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 16), (16, 32), (32, 16), (3, 24, 16), (48, 16), (16, 48), (48, 16)]
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def gradients(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def run_muon(rank, world_size, steps):
    params = make_params()
    opt = Muon(params, lr=0.05, momentum=0.9, ns_dtype=torch.float32)
    if world_size > 1:
        opt = DataParallelMuon(opt, world_axis(rank, world_size), exchange_updates=True)
    for step in range(steps):
        for p, g in zip(params, gradients(step, params)):
            p.grad = g
        opt.param_groups[0]["momentum"] = 0.85 + 0.02 * step  # schedules change group values between steps
        opt.step()
    return [p.detach() for p in params]


def test_muon_on_two_processes_equals_one_process():
    single = run_muon(0, 1, steps=4)
    for rank_params in run_on_ranks(run_muon, 2, 4):
        for got, expected in zip(rank_params, single):
            torch.testing.assert_close(torch.as_tensor(got), expected, rtol=1e-6, atol=1e-6)


def test_muon_step_equals_hand_computed_update():
    params = make_params()[:2]
    start = [p.detach().clone() for p in params]
    opt = Muon(params, lr=0.1, momentum=0.9, ns_dtype=torch.float32)
    grads = [gradients(s, params) for s in range(2)]
    for s in range(2):
        for p, g in zip(params, grads[s]):
            p.grad = g.clone()
        opt.step()
    for i, p in enumerate(params):
        expected, buf = start[i].clone(), torch.zeros_like(start[i])
        for s in range(2):
            g = grads[s][i]
            buf = 0.9 * buf + 0.1 * g  # lerp towards the gradient
            nesterov = 0.1 * g + 0.9 * buf
            scale = max(1, p.size(-2) / p.size(-1)) ** 0.5
            expected -= 0.1 * scale * zeropower_via_newtonschulz5(nesterov, dtype=torch.float32)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-5)
