"""Adam with cautious weight decay (record #89's), against an fp64 loop written from the formula."""
import functools

import pytest
import torch

import train_gpt
from train_gpt import Adam


def params_and_grads(seed, shapes=((7, 5), (11,), (3, 4, 2))):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=g) for shape in shapes]
    grads = [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(5)]
    return params, grads


def run(optimizer_class, params, grads, lrs, **kwargs):
    """params trained by steps of the given gradients, the lr set before each step as a schedule does."""
    params = [torch.nn.Parameter(p.clone()) for p in params]
    opt = optimizer_class(params, lr=lrs[0], **kwargs)
    for step_grads, lr in zip(grads, lrs):
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        opt.param_groups[0]["lr"] = lr
        opt.step()
    return [p.detach() for p in params]


LRS = [0.1, 0.08, 0.05, 0.05, 0.02]


def cautious_adam_by_hand(params, grads, lrs, betas, eps, cautious_weight_decay=0.0):
    """Element by element in fp64: Adam's step u (eps added to the bias-corrected root, as torch's Adam does; #89
    adds it before the correction, which at eps 1e-10 moves nothing measured here); where u and the weight share a
    sign (the step pulls it towards zero), the weight also loses cautious_weight_decay x lr^2 of itself."""
    weight_decay = cautious_weight_decay
    beta1, beta2 = betas
    out, decayed = [], 0
    for i, p in enumerate(params):
        p = p.double().flatten().tolist()
        m, v = [0.0] * len(p), [0.0] * len(p)
        for t, (step_grads, lr) in enumerate(zip(grads, lrs), start=1):
            g = step_grads[i].double().flatten().tolist()
            for j in range(len(p)):
                m[j] = beta1 * m[j] + (1 - beta1) * g[j]
                v[j] = beta2 * v[j] + (1 - beta2) * g[j] ** 2
                u = lr / (1 - beta1 ** t) * m[j] / ((v[j] / (1 - beta2 ** t)) ** 0.5 + eps)
                pulls_to_zero = u * p[j] > 0
                decayed += pulls_to_zero
                p[j] -= u + (weight_decay * lr * lr * p[j] if pulls_to_zero else 0.0)
        out.append(torch.tensor(p, dtype=torch.float64).view(params[i].shape))
    return out, decayed


@pytest.mark.parametrize("cautious_weight_decay", [0.0, 5.0])  # 5: strong, so that the decay shows
def test_adam_with_cautious_weight_decay_equals_the_formula_by_hand(cautious_weight_decay):
    start, grads = params_and_grads(1)
    kwargs = dict(betas=(0.5, 0.95), eps=1e-10, cautious_weight_decay=cautious_weight_decay)
    ours = run(Adam, start, grads, LRS, **kwargs)
    expected, decayed = cautious_adam_by_hand(start, grads, LRS, **kwargs)
    for p, e, s in zip(ours, expected, start):
        assert (p.double() - e).norm() <= 1e-6 * (e - s.double()).norm()
        assert (p - s).norm() > 0.1 * LRS[-1]  # it moved
    if cautious_weight_decay:
        assert 0 < decayed < 5 * sum(p.numel() for p in start)  # some weights decayed, not all
        undecayed = run(Adam, start, grads, LRS, betas=(0.5, 0.95), eps=1e-10)
        assert all((p - u).norm() > 1e-3 * u.norm() for p, u in zip(ours, undecayed))  # the decay made a difference


def test_a_parameter_without_a_gradient_is_left_alone():
    # (another data-parallel rank's to update, under ZeRO)
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = Adam([p, q], lr=0.1, cautious_weight_decay=1.0)
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(q.detach(), torch.ones(3)) and not opt.state[q] and (p < 1).all()


def test_groups_with_and_without_decay_step_together_as_by_hand():
    # a decayed group steps in Adam's own update, the other in torch's fused one, in the same step()
    start, grads = params_and_grads(2)
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = Adam([dict(params=params[:2], cautious_weight_decay=5.0), dict(params=params[2:], betas=(0.9, 0.99))],
               lr=LRS[0], betas=(0.5, 0.95))
    for step_grads, lr in zip(grads, LRS):
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    expected = (cautious_adam_by_hand(start[:2], [g[:2] for g in grads], LRS, (0.5, 0.95), 1e-10, 5.0)[0]
                + cautious_adam_by_hand(start[2:], [g[2:] for g in grads], LRS, (0.9, 0.99), 1e-10)[0])
    for p, e, s in zip(params, expected, start):
        assert p.grad is not None and (p.detach().double() - e).norm() <= 1e-6 * (e - s.double()).norm()


def test_a_bf16_weight_keeps_its_small_decay_on_average():
    # 0.025 x lr^2 at lr 0.2 is a thousandth of a weight: below half a bf16 step near 1, so a decay rounded on its
    # own would vanish; added to the step before rounding it survives on average (within a quarter of fp64's)
    g = torch.Generator().manual_seed(3)
    start = ((torch.rand(4096, generator=g) + 0.5) * torch.randn(4096, generator=g).sign(),)
    grads = [(torch.randn(4096, generator=g),) for _ in range(5)]
    lrs = [0.2] * 5
    decayed, undecayed = (run(Adam, [start[0].bfloat16()], [(grad[0].bfloat16(),) for grad in grads], lrs,
                              betas=(0.75, 0.95), cautious_weight_decay=wd)[0].double() for wd in (0.025, 0.0))
    exact_decayed, exact_undecayed = (cautious_adam_by_hand([start[0].bfloat16().double()],
                                                            [(grad[0].bfloat16().double(),) for grad in grads], lrs,
                                                            (0.75, 0.95), 1e-10, wd)[0][0] for wd in (0.025, 0.0))
    shrink = (undecayed.abs() - decayed.abs()).mean()
    exact_shrink = (exact_undecayed.abs() - exact_decayed.abs()).mean()
    assert exact_shrink > 0 and abs(shrink - exact_shrink) < 0.25 * exact_shrink, (shrink, exact_shrink)


def test_92s_tables_on_their_own_cadence_equal_the_formula_by_hand():
    """#92's n-gram table (no momentum, one second moment a row, the mean square of its gradient) and value
    embeddings (Adam), on the cadence 0:2,8:4 with Adam on odd steps: they step after steps 1, 3, 5, 7, then 11 and
    15 on the sums of their gradients of Adam's steps in the cycle (9 + 11, 13 + 15), with betas squared and decay
    doubled in the 4-step cycles. By hand in float64 from #92's formula; the optimizers as the trainer builds them."""
    args = train_gpt.parse_args(["--preset", "tiny", "--table_cadence", "0:2,8:4", "--ngram_optimizer", "rows",
                                 "--num_iterations", "16", "--lr_embed", "3"], cuda=False)  # (a lr at which the
    # decay, x lr^2, shows)
    torch.manual_seed(0)
    model = train_gpt.build_model(args, torch.device("cpu"))
    groups = train_gpt.optimizer_param_groups(model, args.vocab_size, args.model_dim)
    optimizers = train_gpt.build_optimizers(model, groups, args, torch.device("cpu"), cuda_dtypes=False)
    table, embed = model.ngram.table.weight, model.value_embeds["1"].weight
    with torch.no_grad():
        table.normal_()  # (zero at the start, it would never decay)
    g = torch.Generator().manual_seed(4)
    # a step's lookups: some rows, each step others, the rest no gradient (a row read in one step of a cycle and not
    # in the next, or not for cycles, its second moment decaying all the while)
    touched = {s: torch.rand(table.shape[0], generator=g) < 0.3 for s in range(1, 16, 2)}
    gradients = {s: (torch.randn(table.shape, generator=g) * touched[s][:, None], torch.randn(embed.shape, generator=g))
                 for s in range(1, 16, 2)}
    start, moved = (table.detach().double().clone(), embed.detach().double().clone()), {}
    for s in range(16):
        if not train_gpt.adam_steps(s, args):
            continue
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        table.grad, embed.grad = (grad.clone() for grad in gradients[s])
        if s % 4 == 3:  # (as a table held by rows sends it: by row)
            table.grad = train_gpt.by_rows(touched[s].nonzero().squeeze(1), table.grad[touched[s]], table.shape)
        train_gpt.set_schedules(optimizers, s, args)
        optimizers[0].step()
        moved[s] = table.detach().clone()
    assert torch.equal(moved[9], moved[7]) and not torch.equal(moved[11], moved[9])  # (held through step 9)
    assert optimizers[0].state[table]["exp_avg_sq"].shape == (table.shape[0],)  # one a row
    events, held = 0, [torch.zeros_like(start[0]), torch.zeros_like(start[1])]
    p, q = start[0].clone(), start[1].clone()
    v_rows, m, v = torch.zeros(len(p), dtype=torch.float64), torch.zeros_like(q), torch.zeros_like(q)
    for s in range(1, 16, 2):
        held = [h + grad.double() for h, grad in zip(held, gradients[s])]
        cycle = 2 if s >= 8 else 1  # (4 steps over the first cycles' 2)
        if (s + 1) % (2 * cycle):
            continue
        events += 1
        lr = args.lr_embed * train_gpt.lr_multiplier(s, args)
        beta1, beta2, decay = 0.75 ** cycle, 0.95 ** cycle, 0.025 * cycle  # #89's embedding recipe per 2 steps
        v_rows = beta2 * v_rows + (1 - beta2) * held[0].square().mean(-1)
        u = held[0] / (v_rows.sqrt() + 1e-10)[:, None] * lr * (1 - beta2 ** events) ** 0.5
        p = p - u - (u * p > 0) * decay * lr * lr * p
        m, v = beta1 * m + (1 - beta1) * held[1], beta2 * v + (1 - beta2) * held[1].square()
        u = lr / (1 - beta1 ** events) * m / ((v / (1 - beta2 ** events)).sqrt() + 1e-10)
        q = q - u - (u * q > 0) * decay * lr * lr * q
        held = [torch.zeros_like(h) for h in held]
    assert events == 6
    for ours, expected, begun in ((table, p, start[0]), (embed, q, start[1])):
        assert (ours.detach().double() - expected).norm() <= 1e-5 * (expected - begun).norm()
        assert (expected - begun).norm() > 1e-3 * begun.norm()  # (it moved)
    second_moments = optimizers[0].state[table]["exp_avg_sq"]
    assert second_moments.dtype == torch.float32 and (second_moments.double() - v_rows).norm() <= 1e-6 * v_rows.norm()
    never = ~functools.reduce(torch.logical_or, touched.values())
    assert never.any() and torch.equal(table.detach()[never].double(), start[0][never])  # rows never read stay put
