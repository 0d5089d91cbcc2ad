"""A few training steps under any layout (data, tensor and pipeline parallel, ZeRO), built by the trainer's own
build_run, reporting what tests compare with a one-process run: losses, gradients and parameters as full
one-process tensors, and the bytes each rank held and sent in its first step."""
import contextlib
import inspect
import textwrap

import pytest
import torch
from torch import nn

import train_gpt
from synthetic import tiny_flags

# every layout the equivalence tests cover: name -> (processes, flags)
LAYOUTS = {
    "dp2": (2, dict()),
    "dp2_zero1": (2, dict(zero=1)),
    "dp2_zero2": (2, dict(zero=2)),
    "dp2_zero3": (2, dict(zero=3)),
    "tp2": (2, dict(tp=2)),
    "tp2_sp": (2, dict(tp=2, sp=True)),
    "tp2_sp_async": (2, dict(tp=2, sp=True, async_tp=True)),
    "pp2_afab": (2, dict(pp=2, pp_schedule="afab")),
    "pp3_1f1b": (3, dict(pp=3, pp_schedule="1f1b")),
    "dp2_tp2_zero3": (4, dict(tp=2, zero=3)),
    "dp2_pp2": (4, dict(pp=2)),
    "dp2_pp2_zero3": (4, dict(pp=2, zero=3)),
    "pp2_tp2_sp": (4, dict(pp=2, tp=2, sp=True)),
}


def train_steps(rank, world_size, files, steps, layout=None, edit=None, device_type="cpu"):
    """Losses of `steps` steps; every gradient this rank holds after the last step's backward and the parameters
    after its update, as full one-process tensors (a pipeline stage has its own only); and what the first step
    held and sent (train_gpt.account_step). edit: a MODEL_EDITS entry applied to the model first. device_type
    "cuda": on GPU `rank`, in the CUDA run's dtypes with FlexAttention."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    with model_edit(edit):
        args = train_gpt.parse_args(tiny_flags(files, **(layout or {})), cuda=False)
        ctx = train_gpt.build_parallel_context(rank, world_size, device, args.tp, args.pp)
        run = train_gpt.build_run(args, ctx)
        batches = train_gpt.DistributedDataLoader(args.train_files, args.train_seq_len, args.seqs_per_step,
                                                  ctx.dp.rank, ctx.dp.size, ctx.device)
        losses, no_gradient = [], torch.zeros((), device=device)
        for step in range(steps):
            if step == 0:
                first = train_gpt.account_step(run, batches, step)
                loss_sum = first.pop("loss_sum")
            else:
                loss_sum = run.backward(batches, step)
                if step == steps - 1:  # (under ZeRO 1 and up, only the gradients this rank owns; cloned: Muon
                    # updates its momentum in the gradient)
                    grads = {name: train_gpt.whole(p, p.grad).clone() for name, p in run.model.named_parameters()
                             if p.grad is not None}
                run.optimizer_step(step)
            losses.append(run.step_stats(loss_sum, no_gradient, stop=False)[0].item())
        with run.zero.whole_parameters():
            params = {name: train_gpt.whole(p, p.detach()).clone() for name, p in run.model.named_parameters()}
        return dict(grads=grads, losses=losses, first_step=first, params=params,
                    num_buckets=len(getattr(run.gradients, "buckets", [])))


def assert_close_in_norm(got, expected, tolerance, what):
    """||got - expected|| <= tolerance * ||expected||; tolerance 0: bit-identical."""
    got, expected = torch.as_tensor(got), torch.as_tensor(expected)
    if tolerance == 0:
        assert torch.equal(got, expected), what
        return
    got, expected = got.double(), expected.double()
    assert got.shape == expected.shape, what
    error = (got - expected).norm().item()
    assert error <= tolerance * expected.norm().item(), (what, error / expected.norm().item())


def assert_trains_like_one_process(ranks, single, gradient_tolerance=0.0, parameter_tolerance=None,
                                   loss_tolerance=1e-6):
    """Each rank's gradients (at the last step, every one of them non-zero) and losses equal the one-process run's,
    its parameters after the last step too, and together the ranks hold every one of them.

    Gradients are compared directly: Adam would hide a constant factor. Tolerances are relative to each tensor's
    norm (0: bit-identical). Parameters by default within 1e-4 where gradients may differ: Adam (eps 1e-10) turns
    summation-order rounding in a rare token's tiny gradient into a visible step for that one embedding row, while
    every tensor as a whole agrees to within 2e-5 of its norm (measured; Muon's Newton-Schulz carries the rounding
    on)."""
    if parameter_tolerance is None:
        parameter_tolerance = 1e-4 if gradient_tolerance else 0.0
    for rank in ranks:
        assert rank["grads"].keys() <= single["grads"].keys()
        for name, grad in rank["grads"].items():
            assert single["grads"][name].norm() > 0, f"gradient of {name} is zero: the comparison would be empty"
            assert_close_in_norm(grad, single["grads"][name], gradient_tolerance, f"gradient of {name}")
        assert rank["losses"] == pytest.approx(single["losses"], rel=loss_tolerance)
        for name, param in rank["params"].items():
            assert_close_in_norm(param, single["params"][name], parameter_tolerance, f"parameter {name}")
    assert set().union(*(rank["grads"] for rank in ranks)) == single["grads"].keys()
    assert set().union(*(rank["params"] for rank in ranks)) == single["params"].keys()


def assert_holds_and_sends_what_the_plan_predicts(ranks, files, **layout):
    """Each rank's bytes in its first step (parameters, their peak, gradients, float64 sums, optimizer states,
    every collective) equal --plan's, which runs the same code on the meta device."""
    args = train_gpt.parse_args(tiny_flags(files, **layout), cuda=False)
    plan = train_gpt.plan_layout(args, len(ranks), cuda=False)
    for rank, predicted in zip(ranks, plan["ranks"]):
        held = rank["first_step"]
        for kind in ("parameters", "peak_parameters", "gradients", "gradient_sums", "optimizer_states", "comm"):
            assert held[kind] == predicted[kind], kind


# Edits a speedrunner makes to the model, as source edits of train_gpt's classes: (class, method, the line as
# it is, the line as edited), and parameters added at the end of a class's __init__.
MODEL_EDITS = {
    # a scalar gate on a block's attention output, a vector on the MLP's output in the residual stream, a
    # vector inside attention on head-sharded activations, a weight matrix on the residual stream that no
    # layout knows (it trains replicated), and vectors of the GPT itself on the embedding (the first pipeline
    # stage's) and before the head (the last's)
    "gates": dict(
        sources=[("Block", "forward", "x = x + self.attn(norm(x), ve, mask)",
                  "x = x + self.attn_gate * self.attn(norm(x), ve, mask)"),
                 ("Block", "forward", "return x + self.mlp(norm(x))",
                  "return x + self.mlp(norm(x)) * self.mlp_gain + self.mix(norm(x))"),
                 ("CausalSelfAttention", "forward", "y = attention(", "y = self.head_gain * attention("),
                 ("GPT", "embed_tokens", "x = norm(self.embed(input_seq)[None])",
                  "x = norm(self.embed(input_seq)[None]) * self.embed_gain"),
                 ("GPT", "head_loss", 'self.lm_head(norm(stream["x"])[0], target_seq)',
                  'self.lm_head(norm(stream["x"])[0] * self.out_gain, target_seq)')],
        parameters=[("GPT", lambda gpt: dict(
                        embed_gain=nn.Parameter(torch.linspace(0.5, 1.5, gpt.embed.weight.size(1))),
                        out_gain=nn.Parameter(torch.linspace(1.5, 0.5, gpt.embed.weight.size(1))))),
                    ("Block", lambda block: dict(
                        attn_gate=nn.Parameter(torch.tensor(1.0)) if block.attn is not None else None,
                        mlp_gain=nn.Parameter(torch.linspace(0.5, 1.5, block.mlp.c_proj.weight.size(0))),
                        mix=train_gpt.CastedLinear(block.mlp.c_fc.weight.size(1), block.mlp.c_fc.weight.size(1)))),
                    ("CausalSelfAttention", lambda attn: dict(
                        head_gain=nn.Parameter(torch.linspace(0.5, 1.5, attn.head_dim))))]),
    # a vector of the GPT itself with one entry per layer, scaling each block's input (as the record's design once
    # kept its U-Net skip weights): every pipeline stage would read it
    "per_layer_vector_on_gpt": dict(
        sources=[("GPT", "run_block", 'x = self.blocks[i](stream["x"],',
                  'x = self.blocks[i](stream["x"] * self.layer_gains[i],')],
        parameters=[("GPT", lambda gpt: dict(layer_gains=nn.Parameter(torch.linspace(0.5, 1.5, len(gpt.blocks)))))]),
    # a weight matrix inside attention that the tensor-parallel plan does not name
    "unnamed_matrix_in_attention": dict(
        sources=[("CausalSelfAttention", "forward", "qkv = self.qkv(x)", "qkv = self.qkv(self.pre(x))")],
        parameters=[("CausalSelfAttention", lambda attn: dict(
                        pre=train_gpt.CastedLinear(attn.qkv.weight.size(-1), attn.qkv.weight.size(-1))))]),
}


@contextlib.contextmanager
def model_edit(name):
    """train_gpt's model classes with the named edit applied, as if typed into the file; put back afterwards."""
    if name is None:
        yield
        return
    edit, saved, sources = MODEL_EDITS[name], [], {}
    for class_name, method, before, after in edit["sources"]:
        cls = getattr(train_gpt, class_name)
        source = sources.get((cls, method)) or textwrap.dedent(inspect.getsource(getattr(cls, method)))
        assert source.count(before) == 1, f"the edit's line is no longer in {class_name}.{method}: {before}"
        sources[cls, method] = source.replace(before, after)
    for (cls, method), source in sources.items():
        namespace = {}
        exec(source, vars(train_gpt), namespace)
        saved.append((cls, method, cls.__dict__[method]))
        setattr(cls, method, namespace[method])
    for class_name, new_parameters in edit["parameters"]:
        cls = getattr(train_gpt, class_name)
        saved.append((cls, "__init__", cls.__dict__["__init__"]))

        def __init__(self, *args, _init=cls.__init__, _new=new_parameters, **kwargs):
            _init(self, *args, **kwargs)
            for attribute, value in _new(self).items():
                setattr(self, attribute, value)
        cls.__init__ = __init__
    try:
        yield
    finally:
        for cls, method, original in reversed(saved):
            setattr(cls, method, original)
