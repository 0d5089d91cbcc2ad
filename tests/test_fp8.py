"""The FP8 matmul op against fp64 references built from the same quantised operands."""
import time

import torch

import train_gpt
from train_gpt import CastedLinear, fp8_mm

X_S, W_S, GRAD_S = 0.05, 0.02, 0.01


def quantised(t: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """What the op feeds the tensor cores: t / scale rounded to fp8, times scale, in fp64."""
    return (t / scale).to(dtype).double() * scale


def operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=g) * 2
    w = torch.randn(48, 64, generator=g) * 0.5
    grad = torch.randn(32, 48, generator=g) * 0.3
    return x, w, grad


def test_forward_equals_fp64_product_of_quantised_operands():
    x, w, _ = operands()
    out = fp8_mm(x, w, X_S, W_S, GRAD_S)[0]
    reference = quantised(x, X_S, torch.float8_e4m3fn) @ quantised(w, W_S, torch.float8_e4m3fn).T
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)
    # and it is a faithful matmul: within fp8's few-percent rounding of the unquantised product
    exact = x.double() @ w.double().T
    assert (out.double() - exact).norm() / exact.norm() < 0.05


def test_backward_uses_e5m2_gradient_and_matches_fp64_reference():
    x, w, grad = operands(1)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = fp8_mm(x, w, X_S, W_S, GRAD_S)[0]
    out.backward(grad)
    g_q = quantised(grad, GRAD_S, torch.float8_e5m2)
    x_q = quantised(x.detach(), X_S, torch.float8_e4m3fn)
    w_q = quantised(w.detach(), W_S, torch.float8_e4m3fn)
    torch.testing.assert_close(x.grad.double(), g_q @ w_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), g_q.T @ x_q, rtol=1e-5, atol=1e-5)
    assert w.grad.dtype == w.dtype and x.grad.dtype == x.dtype


def test_custom_op_registration_passes_opcheck():
    # checks the fake (meta) implementation against the real one and the autograd registration
    x, w, _ = operands(2)
    # (test_schema is skipped: it compares outputs with arithmetic that float8 tensors do not support)
    torch.library.opcheck(fp8_mm, (x.requires_grad_(True), w.requires_grad_(True), X_S, W_S, GRAD_S),
                          test_utils=("test_faketensor", "test_autograd_registration"))


def test_backward_op_fake_matches_real_layout():
    # torch.compile trusts the fake's strides: a column-major real grad_w crashed the compiled backward on CUDA
    x, w, grad = operands(3)
    x_f8, w_f8 = (x / X_S).to(torch.float8_e4m3fn), (w / W_S).to(torch.float8_e4m3fn)
    torch.library.opcheck(train_gpt.fp8_mm_backward, (grad, x_f8, w_f8, X_S, W_S, GRAD_S),
                          test_utils=("test_faketensor",))


def test_casted_linear_uses_fp8_only_in_training():
    torch.manual_seed(0)
    layer = CastedLinear(64, 48, use_fp8=True, x_s=X_S, w_s=W_S, grad_s=GRAD_S)
    x = torch.randn(2, 16, 64)
    out_train = layer(x)
    expected = (quantised(x.flatten(0, 1), X_S, torch.float8_e4m3fn)
                @ quantised(layer.weight.detach(), W_S, torch.float8_e4m3fn).T).view(2, 16, 48)
    torch.testing.assert_close(out_train.double(), expected, rtol=1e-5, atol=1e-5)
    layer.eval()
    torch.testing.assert_close(layer(x), x @ layer.weight.detach().T)


def test_lm_head_carries_record_89s_scales():
    model = train_gpt.GPT(train_gpt.ModelConfig(vocab_size=300, model_dim=64, num_heads=1, head_dim=16,
                                                layers=(train_gpt.LayerConfig(),) * 6, fp8_head=True))
    head = model.lm_head
    assert head.use_fp8 and head.weight.shape == (384, 64)  # vocab padded to a multiple of 128
    assert (head.x_s, head.w_s, head.grad_s) == (100 / 448, 1.6 / 448, 0.75 / 448)


def test_compiled_bodies_compute_what_the_eager_ones_do():
    # CUDA runs the op's bodies compiled; compiled here on the CPU they must give the same bits as the eager
    # bodies the CPU runs (each output compared, and the fp8 operands are not trivially equal to zero)
    x, w, grad = operands(2)
    eager = train_gpt.fp8_mm_body(x, w, X_S, W_S)
    compiled = train_gpt.compiled(train_gpt.fp8_mm_body)(x, w, X_S, W_S)
    for a, b in zip(eager, compiled):
        assert a.float().abs().sum() > 0 and torch.equal(a.float(), b.float())
    _, x_f8, w_f8 = eager
    backward = (grad, x_f8, w_f8, X_S, W_S, GRAD_S)
    compiled_backward = train_gpt.compiled(train_gpt.fp8_mm_backward_body)
    for a, b in zip(train_gpt.fp8_mm_backward_body(*backward), compiled_backward(*backward)):
        assert a.abs().sum() > 0 and torch.equal(a, b)


def test_cpu_product_equals_scaled_mm_to_fp32_accumulation_order():
    # the CPU's product of the fp8 values against torch._scaled_mm itself, on a shape where its CPU kernel is quick:
    # any two fp32 sums of K products differ by at most 2 K eps times the sum of their magnitudes (scales odd, so that
    # where the kernel applies them changes rounding; the bound is not met by a product missing a scale)
    x, w, _ = operands(4)
    x_s, w_s = 0.37, 3 / 448
    x_f8, w_f8 = (x / x_s).to(torch.float8_e4m3fn), (w / w_s).to(torch.float8_e4m3fn)
    ours = train_gpt.scaled_mm(x_f8, w_f8.T, x_s, w_s, torch.float32, fast_accum=True)
    theirs = torch._scaled_mm(x_f8, w_f8.T, out_dtype=torch.float32, scale_a=torch.tensor(x_s),
                              scale_b=torch.tensor(w_s))
    magnitudes = (x_f8.float().abs() @ w_f8.float().abs().T) * x_s * w_s
    bound = 2 * x.size(1) * torch.finfo(torch.float32).eps * magnitudes + 1e-30
    assert theirs.abs().max() > 1 and (bound / magnitudes.max()).max() < 1e-3
    assert ((ours - theirs).abs() <= bound).all(), ((ours - theirs).abs() / bound).max()


def test_head_sized_fp8_product_takes_under_two_seconds_on_a_cpu(monkeypatch):
    # a guard, not a benchmark: _scaled_mm's CPU kernel took 158 s for this forward alone on an Intel AMX Xeon (on AMD
    # it is quick, so it is also refused outright); the fp32 product of the fp8 values takes about 0.5 s forward and
    # backward on 2 cores
    def refused(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on a CPU")
    monkeypatch.setattr(torch, "_scaled_mm", refused)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 128, generator=g).requires_grad_(True)
    w = (torch.randn(50304, 128, generator=g) * 0.02).requires_grad_(True)
    grad = torch.randn(256, 50304, generator=g) * 1e-3
    fp8_mm(x[:8], w[:128], X_S, W_S, GRAD_S)[0].sum().backward()  # the op's first call: dispatch set up
    start = time.perf_counter()
    fp8_mm(x, w, X_S, W_S, GRAD_S)[0].backward(grad)
    seconds = time.perf_counter() - start
    assert w.grad.abs().sum() > 0 and seconds < 2, f"{seconds:.1f} s"
