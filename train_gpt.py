"""GPT-2 speedrun trainer: one file that trains a GPT-2-small-class model to 3.28 val loss on FineWeb.

    torchrun --standalone --nproc_per_node=8 train_gpt.py     # the record config on 8 GPUs
    torchrun --standalone --nproc_per_node=1 train_gpt.py     # same run on 1 GPU (gradient accumulation)
    python train_gpt.py                                       # no GPU: the CPU preset on the embedded data
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_endpoint=HOST:29500 train_gpt.py   # across nodes

Every hyperparameter is a flag (`--num_iterations 50`); `--preset cpu|record|tiny` picks a base.
`import train_gpt` has no side effects: `main()` trains.
"""
import argparse
import collections
import copy
import dataclasses
import functools
import glob
import json
import math
import os
import pickle
import platform
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention


class UserError(Exception):
    """A mistake in the run's inputs (flags, files, layout): reported as one sentence, no traceback."""


# ----------------------------------------------------------------------------------------------------
# FP8 matmul: a custom op so torch.compile sees one opaque node with a fake (shape-only) implementation

def _scale(value: float, like: Tensor) -> Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)  # a fill kernel, no host-to-device copy


@torch.library.custom_op("nanogpt::mm", mutates_args=())
def fp8_mm(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """x @ w.T with both operands in float8_e4m3fn (x / x_s, w / w_s); also returns the fp8 operands for backward."""
    x_f8 = x.div(x_s).to(torch.float8_e4m3fn)
    w_f8 = w.div(w_s).to(torch.float8_e4m3fn)
    # _scaled_mm wants the second operand column-major: w_f8.T of a row-major w_f8 is exactly that
    out = torch._scaled_mm(x_f8, w_f8.T, out_dtype=x.dtype, scale_a=_scale(x_s, x), scale_b=_scale(w_s, x),
                           use_fast_accum=True)
    return out, x_f8, w_f8


@fp8_mm.register_fake
def _(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float):
    return x.new_empty(x.size(0), w.size(0)), x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)


@torch.library.custom_op("nanogpt::mm_backward", mutates_args=())
def fp8_mm_backward(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float,
                    grad_s: float) -> tuple[Tensor, Tensor]:
    """Gradients of fp8_mm: the incoming gradient goes to float8_e5m2 (wider range, less precision) scaled by grad_s."""
    grad_f8 = grad.div(grad_s).to(torch.float8_e5m2)
    # grad_x = grad @ w: (M, N) @ (N, K); w_f8 made column-major
    grad_x = torch._scaled_mm(grad_f8, w_f8.T.contiguous().T, out_dtype=grad.dtype,
                              scale_a=_scale(grad_s, grad), scale_b=_scale(w_s, grad), use_fast_accum=False)
    # grad_w = grad.T @ x: (N, M) @ (M, K), row-major like w (the fake promises that layout to torch.compile);
    # kept in fp32 for the optimizer
    grad_w = torch._scaled_mm(grad_f8.T.contiguous(), x_f8.T.contiguous().T, out_dtype=torch.float32,
                              scale_a=_scale(grad_s, grad), scale_b=_scale(x_s, grad), use_fast_accum=False)
    return grad_x, grad_w


@fp8_mm_backward.register_fake
def _(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float):
    return grad.new_empty(grad.size(0), w_f8.size(1)), grad.new_empty(w_f8.shape, dtype=torch.float32)


def _fp8_mm_setup_context(ctx, inputs, output):
    x, w, x_s, w_s, grad_s = inputs
    _, x_f8, w_f8 = output
    ctx.save_for_backward(x_f8, w_f8)
    ctx.scales = x_s, w_s, grad_s
    ctx.w_dtype = w.dtype


def _fp8_mm_backward(ctx, grad_out: Tensor, *_unused_grads):
    x_f8, w_f8 = ctx.saved_tensors
    grad_x, grad_w = fp8_mm_backward(grad_out, x_f8, w_f8, *ctx.scales)
    return grad_x, grad_w.to(ctx.w_dtype), None, None, None


fp8_mm.register_autograd(_fp8_mm_backward, setup_context=_fp8_mm_setup_context)


# ----------------------------------------------------------------------------------------------------
# Communication: byte accounting, axes of the rank grid, and the tensor-parallel conjugate operators

comm_bytes: collections.Counter = collections.Counter()  # collective name -> bytes since the last clear()


def count_comm(op: str, *tensors: Tensor) -> None:
    """Bytes of the tensors handed to a collective on this rank, so a run can be set against --plan."""
    comm_bytes[op] += sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Axis:
    """One axis of the rank grid as this rank sees it: its coordinate, the axis length, the process group along
    it (None: the default group), and that group's global ranks in order (collectives name peers globally)."""
    rank: int = 0
    size: int = 1
    group: object = None
    ranks: tuple = (0,)

    def global_rank(self, axis_rank: int) -> int:
        return self.ranks[axis_rank]


def world_axis(rank: int, size: int) -> Axis:
    return Axis(rank, size, None, tuple(range(size)))


class _Conjugate(torch.autograd.Function):
    """A tensor-parallel collective whose backward is its conjugate: forward_op(x, tp) going forward,
    backward_op(grad, tp) coming back (Megatron's f and g, and their sequence-parallel forms)."""

    @staticmethod
    def forward(ctx, x: Tensor, tp: Axis, forward_op, backward_op) -> Tensor:
        ctx.tp, ctx.backward_op = tp, backward_op
        return forward_op(x, tp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.backward_op(grad, ctx.tp), None, None, None


def unchanged(x: Tensor, tp: Axis) -> Tensor:
    return x.view_as(x)


def all_reduce_sum(x: Tensor, tp: Axis) -> Tensor:
    out = x.contiguous().clone()
    count_comm("all_reduce", out)
    dist.all_reduce(out, group=tp.group)
    return out


def gather_sequence_shards(x: Tensor, tp: Axis, async_op: bool = False):
    """(1, T / tp, d) shards -> (1, T, d), rank order along the sequence (flat buffers: gloo wants 1-D)."""
    full = x.new_empty(x.size(0), tp.size * x.size(1), *x.shape[2:])
    count_comm("all_gather_into_tensor", full)
    handle = dist.all_gather_into_tensor(full.view(-1), x.contiguous().view(-1), group=tp.group, async_op=async_op)
    return (full, handle) if async_op else full


def reduce_scatter_sequence_shards(x: Tensor, tp: Axis) -> Tensor:
    """(1, T, d) partial sums -> this rank's (1, T / tp, d) shard of their sum."""
    x = x.contiguous()
    shard = x.new_empty(x.size(0), x.size(1) // tp.size, *x.shape[2:])
    count_comm("reduce_scatter_tensor", x)
    dist.reduce_scatter_tensor(shard.view(-1), x.view(-1), group=tp.group)
    return shard


class _GatherThenLinear(torch.autograd.Function):
    """Asynchronous tensor parallelism (seed 000): the column-parallel matmul of a sequence-sharded input starts
    the all-gather of the other shards, multiplies its own shard while they travel, then the rest. Backward as
    gather-then-linear: the weight gradient from the gathered input, the input gradient reduce-scattered."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, tp: Axis) -> Tensor:
        full, handle = gather_sequence_shards(x, tp, async_op=True)
        own = F.linear(x, weight)
        handle.wait()
        n = x.size(1)
        before, after = full[:, :tp.rank * n], full[:, (tp.rank + 1) * n:]
        out = torch.cat([F.linear(before, weight), own, F.linear(after, weight)], dim=1)
        ctx.save_for_backward(full, weight)
        ctx.tp = tp
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        full, weight = ctx.saved_tensors
        grad_weight = grad.flatten(end_dim=-2).t() @ full.flatten(end_dim=-2)
        return reduce_scatter_sequence_shards(grad @ weight, ctx.tp), grad_weight, None


def column_parallel_linear(x: Tensor, weight: Tensor, tp: Axis, mode: str) -> Tensor:
    """x @ weight.T where weight holds this rank's output columns, and x (the `sequence` mode) arrives
    "replicated" (f: identity, backward all-reduce), "sharded" along the sequence (all-gathered first), or
    sharded and gathered while this rank's shard is multiplied ("async")."""
    if tp.size == 1:
        return F.linear(x, weight)
    if mode == "async":
        return _GatherThenLinear.apply(x, weight, tp)
    return F.linear(enter_tensor_parallel(x, tp, mode), weight)


def enter_tensor_parallel(x: Tensor, tp: Axis, mode: str) -> Tensor:
    """The whole activation for a tensor-parallel region: f (replicated), or all-gathered sequence shards, whose
    backward reduce-scatters the ranks' partial input gradients."""
    if tp.size == 1 or mode == "replicated":
        return copy_to_tensor_parallel(x, tp)
    return _Conjugate.apply(x, tp, gather_sequence_shards, reduce_scatter_sequence_shards)


def leave_tensor_parallel(x: Tensor, tp: Axis, mode: str) -> Tensor:
    """The sum of the ranks' partial outputs of a row-parallel layer: g (all-reduce), or this rank's sequence
    shard of it (reduce-scatter), whose backward all-gathers the shards' gradients."""
    if tp.size == 1 or mode == "replicated":
        return reduce_from_tensor_parallel(x, tp)
    return _Conjugate.apply(x, tp, reduce_scatter_sequence_shards, gather_sequence_shards)


def copy_to_tensor_parallel(x: Tensor, tp: Axis) -> Tensor:
    """f: identity forward; backward all-reduces, summing the input gradients of the ranks' shards."""
    return x if tp.size == 1 else _Conjugate.apply(x, tp, unchanged, all_reduce_sum)


def reduce_from_tensor_parallel(x: Tensor, tp: Axis) -> Tensor:
    """g: forward all-reduces the ranks' partial sums; identity backward (each rank's part has the same gradient)."""
    return x if tp.size == 1 else _Conjugate.apply(x, tp, all_reduce_sum, unchanged)


def tp_shard(full: Tensor, dim: int, tp: Axis) -> Tensor:
    """This rank's equal slice of full along dim (zero-padded first to a multiple of tp.size)."""
    n = -(-full.size(dim) // tp.size)
    pad = n * tp.size - full.size(dim)
    if pad:
        full = torch.cat([full, full.new_zeros(*full.shape[:dim], pad, *full.shape[dim + 1:])], dim)
    return full.narrow(dim, tp.rank * n, n).contiguous()


def tp_gather(local: Tensor, dim: int, full_size: int, tp: Axis) -> Tensor:
    """The whole tensor from every rank's tp_shard slice (inverse of tp_shard)."""
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    count_comm("all_gather", *parts)
    dist.all_gather(parts, local.contiguous(), group=tp.group)
    return torch.cat(parts, dim).narrow(dim, 0, full_size)


def mark_tensor_parallel(param: Tensor, dim: int, full_size: int, tp: Axis) -> None:
    """Record that param is one rank's tp_shard slice along dim of a tensor full_size long there."""
    if tp.size > 1:
        param.tp_dim, param.tp_full = dim, full_size


def is_tensor_parallel(param: Tensor) -> bool:
    return getattr(param, "tp_dim", None) is not None


def full_shape(param: Tensor) -> tuple:
    """The shape param has in a one-process model."""
    shape = list(param.shape)
    if is_tensor_parallel(param):
        shape[param.tp_dim] = param.tp_full
    return tuple(shape)


# ----------------------------------------------------------------------------------------------------
# Optimizers: Muon for hidden matrices (Newton-Schulz orthogonalised momentum), Adam for the rest

def zeropower_via_newtonschulz5(G: Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximately orthogonalise G (batched over leading dims): U S' V^T with S' roughly in [0.5, 1.5].

    Quintic iteration whose coefficients maximise the slope at zero, so 5 steps suffice; it trades exact
    convergence to U V^T for speed, which does not hurt training. bf16 on GPU, fp32 on CPU (bf16 is slow there).
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide orientation so X @ X.mT is the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # Frobenius >= spectral norm, so spectral norm <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-Schulz, sharded across data-parallel ranks.

    Parameters are grouped by size; within a group rank r orthogonalises parameters r, r+W, r+2W, ... and the
    flattened updates are exchanged with async all_gather_into_tensor, so every rank applies every update while
    the next chunk is being orthogonalised. Gradients must already be averaged across ranks.
    Under tensor parallelism the owner's tensor-parallel group gathers each matrix's gradient and orthogonalises
    the whole matrix (every member alike, keeping the whole momentum), each applying its own slice.
    With owner_applies (ZeRO 3, where a parameter lives on its owner alone) the owner applies its own update and
    nothing is exchanged.
    """

    def __init__(self, params, lr=0.05, momentum=0.95, nesterov=True, ns_steps=5, dp: Axis = Axis(),
                 tp: Axis = Axis(), orthogonalize=zeropower_via_newtonschulz5, ns_dtype=torch.bfloat16,
                 owner_applies=False):
        params = list(params)
        self.dp, self.tp, self.owner_applies = dp, tp, owner_applies
        self.rank, self.world_size = dp.rank, dp.size
        self.orthogonalize, self.ns_dtype = orthogonalize, ns_dtype
        sizes = sorted({p.numel() for p in params}, reverse=True)
        groups = [dict(params=[p for p in params if p.numel() == size]) for size in sizes]
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))
        # flat gather targets (gloo needs 1-D), kept outside param_groups so state_dict() never copies them
        self.update_buffers = [torch.empty(dp.size * size, dtype=ns_dtype, device=params[0].device)
                               for size in sizes]

    @staticmethod
    def owners(params, world_size: int) -> dict[Tensor, int]:
        """The rank that orthogonalises each parameter and so alone keeps its momentum: r, r+W, ... of each size."""
        params = list(params)
        owner_of = {}
        for size in sorted({p.numel() for p in params}, reverse=True):
            for i, p in enumerate(p for p in params if p.numel() == size):
                owner_of[p] = i % world_size
        return owner_of

    def param_owners(self):
        """(parameter, owner rank) for every parameter, in param_groups order."""
        owner_of = self.owners([p for group in self.param_groups for p in group["params"]], self.world_size)
        for group in self.param_groups:
            for p in group["params"]:
                yield p, owner_of[p]

    @torch.no_grad()
    def step(self):
        if self.owner_applies:
            for p, owner in self.param_owners():
                if owner == self.rank:
                    self._apply(None, [p], [self._orthogonalized_momentum(p, self._group_of(p))], self._group_of(p))
            return
        for group, update_buffer in zip(self.param_groups, self.update_buffers):
            params, views = group["params"], update_buffer.view(self.world_size, -1).unbind(0)
            pending = None  # (handle, params of the chunk in flight)
            for base in range(0, len(params), self.world_size):
                if base + self.rank < len(params):
                    update = self._orthogonalized_momentum(params[base + self.rank], group).flatten()
                else:
                    update = views[self.rank]  # no parameter left for this rank: a placeholder of the right size
                if pending is not None:
                    self._apply(*pending, views, group)
                if self.world_size > 1:
                    count_comm("all_gather_into_tensor", update_buffer)
                    handle = dist.all_gather_into_tensor(update_buffer, update, group=self.dp.group, async_op=True)
                else:
                    views[0].copy_(update)
                    handle = None
                pending = handle, params[base:base + self.world_size]
            if pending is not None:
                self._apply(*pending, views, group)

    def _orthogonalized_momentum(self, p: Tensor, group) -> Tensor:
        g = p.grad
        if g is None:
            raise RuntimeError(f"Muon parameter of shape {tuple(p.shape)} has no gradient")
        if is_tensor_parallel(p):
            g = tp_gather(g, p.tp_dim, p.tp_full, self.tp)  # Newton-Schulz needs the whole matrix
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        buf = state["momentum_buffer"]
        buf.lerp_(g, 1 - group["momentum"])
        g = g.lerp_(buf, group["momentum"]) if group["nesterov"] else buf
        update = self.orthogonalize(g, steps=group["ns_steps"], dtype=self.ns_dtype)
        return tp_shard(update, p.tp_dim, self.tp) if is_tensor_parallel(p) else update

    def _group_of(self, p: Tensor) -> dict:
        return next(group for group in self.param_groups if group["params"][0].numel() == p.numel())

    @staticmethod
    def _apply(handle, chunk, views, group):
        if handle is not None:
            handle.wait()
        for p, update in zip(chunk, views):
            rows, cols = full_shape(p)[-2:]  # the whole matrix's aspect, also for a tensor-parallel slice
            p.add_(update.view_as(p), alpha=-group["lr"] * max(1, rows / cols) ** 0.5)


# ----------------------------------------------------------------------------------------------------
# Model: the U-Net GPT with value embeddings and document-causal sliding-window attention

def next_multiple_of_n(v: float, n: int) -> int:
    return max(n, n * math.ceil(v / n))


def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))  # no learnable scale


class CastedLinear(nn.Linear):
    """Bias-free linear whose fp32 weight is cast to the activations' dtype; optionally an FP8 matmul in training."""

    def __init__(self, in_features: int, out_features: int, use_fp8=False, x_s=1.0, w_s=1.0, grad_s=1.0):
        super().__init__(in_features, out_features, bias=False)
        self.use_fp8, self.x_s, self.w_s, self.grad_s = use_fp8, x_s, w_s, grad_s

    def reset_parameters(self) -> None:
        bound = 3 ** 0.5 * 0.5 * self.in_features ** -0.5  # uniform with std 0.5 / sqrt(fan_in)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if self.use_fp8 and self.training:
            out = fp8_mm(x.flatten(0, -2), self.weight, self.x_s, self.w_s, self.grad_s)[0]
            return out.reshape(*x.shape[:-1], -1)
        return F.linear(x, self.weight.type_as(x))


class Rotary(nn.Module):
    """Half-truncated RoPE: only the first half of each head's dims rotate (base 1024); the rest pass through."""

    def __init__(self, head_dim: int, max_seq_len: int):
        super().__init__()
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
        angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(head_dim // 4)])
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), angular_freq)
        self.cos = nn.Buffer(theta.cos(), persistent=False)
        self.sin = nn.Buffer(theta.sin(), persistent=False)

    def forward(self, x_BTHD: Tensor) -> Tensor:
        T = x_BTHD.size(-3)
        cos, sin = self.cos[None, :T, None, :], self.sin[None, :T, None, :]
        x1, x2 = x_BTHD.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x_BTHD)


ATTENTION_BLOCK_SIZE = 128  # FlexAttention's block granularity, and the unit of the sliding window


@dataclass
class AttentionMask:
    """Document-causal sliding-window mask as FlexAttention block lists, with a dense twin for the CPU.

    Per query block, kv blocks are listed nearest-first: `full` ones (causal and same document throughout)
    need no per-token check; `partial` ones get the document-causal mask_mod. The window keeps the nearest
    window-1 full blocks and enough partial blocks to make up the window (at least the diagonal one).
    """
    docs: Tensor  # (T,) document id of each token
    partial_num: Tensor  # (1, 1, NB) after the window clamp
    partial_idx: Tensor  # (1, 1, NB, NB)
    full_num: Tensor
    full_idx: Tensor

    def mask_mod(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (self.docs[q_idx] == self.docs[kv_idx])

    def flex(self) -> BlockMask:
        return BlockMask.from_kv_blocks(self.partial_num, self.partial_idx, self.full_num, self.full_idx,
                                        BLOCK_SIZE=ATTENTION_BLOCK_SIZE, mask_mod=self.mask_mod)

    def dense(self) -> Tensor:
        """(T, T) boolean mask that allows exactly what the flex block mask allows."""
        nb = self.partial_idx.size(-1)
        rank = torch.arange(nb, device=self.docs.device)
        allowed = torch.zeros(nb, nb, dtype=torch.bool, device=self.docs.device)
        for num, idx in ((self.partial_num, self.partial_idx), (self.full_num, self.full_idx)):
            kept = rank[None, :] < num[0, 0, :, None]  # the first `num` entries of each row's list
            allowed |= torch.zeros_like(allowed).scatter_(1, idx[0, 0].long(), kept)
        allowed = allowed.repeat_interleave(ATTENTION_BLOCK_SIZE, 0).repeat_interleave(ATTENTION_BLOCK_SIZE, 1)
        pos = torch.arange(len(self.docs), device=self.docs.device)
        return allowed & self.mask_mod(None, None, pos[:, None], pos[None, :])


def document_causal_masks(input_seq: Tensor, window_blocks: Tensor) -> tuple[AttentionMask, AttentionMask]:
    """Long (window_blocks) and short (window_blocks // 2) masks for one sequence; documents start at EOT_TOKEN."""
    docs = (input_seq == EOT_TOKEN).cumsum(0)
    nb = len(input_seq) // ATTENTION_BLOCK_SIZE
    block = torch.arange(nb, dtype=torch.int32, device=input_seq.device)
    docs_low = docs.view(nb, ATTENTION_BLOCK_SIZE)[:, 0].contiguous()
    docs_high = docs.view(nb, ATTENTION_BLOCK_SIZE)[:, -1].contiguous()
    any_causal = block[:, None] >= block
    all_causal = block[:, None] > block
    any_same_doc = (docs_low[:, None] <= docs_high) & (docs_high[:, None] >= docs_low)
    all_same_doc = (docs_low[:, None] == docs_high) & (docs_high[:, None] == docs_low)
    full = all_causal & all_same_doc
    partial = any_causal & any_same_doc & ~full

    def nearest_first(dense: Tensor) -> tuple[Tensor, Tensor]:
        num = dense.sum(dim=-1, dtype=torch.int32)
        idx = dense.argsort(dim=-1, descending=False, stable=True).flip(-1).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    partial_num, partial_idx = nearest_first(partial)
    full_num, full_idx = nearest_first(full)

    def windowed(blocks: Tensor) -> AttentionMask:
        # clamp_min(0) on the full count: a 0-block window (short mask at window 1) keeps just the diagonal
        return AttentionMask(docs, torch.clamp_max(partial_num, torch.clamp_min(blocks - full_num, 1)), partial_idx,
                             torch.clamp_max(full_num, torch.clamp_min(blocks - 1, 0)), full_idx)

    return windowed(window_blocks), windowed(window_blocks // 2)


# always compiled: eager flex_attention applies only mask_mod and ignores the block lists, i.e. the window
compiled_flex_attention = torch.compile(flex_attention, dynamic=False)


class CausalSelfAttention(nn.Module):
    """Tensor parallel over heads (Megatron): q, k, v column-parallel, the output projection row-parallel."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, max_seq_len: int, tp: Axis = Axis(),
                 sequence: str = "replicated"):
        super().__init__()
        self.tp, self.sequence = tp, sequence
        self.num_heads, self.head_dim = num_heads // tp.size, head_dim  # this rank's heads
        hdim = self.num_heads * head_dim
        bound = 3 ** 0.5 * 0.5 * dim ** -0.5
        self.qkv_w = nn.Parameter(torch.empty(3, hdim, dim).uniform_(-bound, bound))
        self.lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))  # mix of v and the value embedding
        self.rotary = Rotary(head_dim, max_seq_len)
        self.c_proj = CastedLinear(hdim, dim)
        self.c_proj.weight.detach().zero_()  # zero-init: each block starts as the identity
        mark_tensor_parallel(self.qkv_w, 1, num_heads * head_dim, tp)
        mark_tensor_parallel(self.c_proj.weight, 1, num_heads * head_dim, tp)

    def forward(self, x: Tensor, ve: Tensor | None, mask: AttentionMask, use_flex: bool) -> Tensor:
        qkv = column_parallel_linear(x, self.qkv_w.flatten(end_dim=1).type_as(x), self.tp, self.sequence)
        B, T = qkv.size(0), qkv.size(1)  # B == 1: masks are per sequence; T: the whole sequence
        q, k, v = qkv.view(B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=-2)  # (B, T, H, D) each
        q, k = self.rotary(norm(q)), self.rotary(norm(k))  # QK-norm, then rotate
        lambdas = copy_to_tensor_parallel(self.lambdas, self.tp)  # each rank's heads hold part of their gradient
        v = lambdas[0] * v + lambdas[1] * ve.view_as(v) if ve is not None else lambdas[0] * v
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if use_flex:
            y = compiled_flex_attention(q, k, v, block_mask=mask.flex(), scale=0.12)
        else:  # CPU twin: FlexAttention has no backward there; same function through a dense boolean mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), scale=0.12)
        y = y.transpose(1, 2).contiguous().view(B, T, self.num_heads * self.head_dim)
        return leave_tensor_parallel(self.c_proj(y), self.tp, self.sequence)


class MLP(nn.Module):
    """Tensor parallel (Megatron): the up projection column-parallel, the down projection row-parallel."""

    def __init__(self, dim: int, tp: Axis = Axis(), sequence: str = "replicated"):
        super().__init__()
        self.tp, self.sequence = tp, sequence
        self.c_fc = CastedLinear(dim, 4 * dim // tp.size)
        self.c_proj = CastedLinear(4 * dim // tp.size, dim)
        self.c_proj.weight.detach().zero_()
        mark_tensor_parallel(self.c_fc.weight, 0, 4 * dim, tp)
        mark_tensor_parallel(self.c_proj.weight, 1, 4 * dim, tp)

    def forward(self, x: Tensor) -> Tensor:
        up = column_parallel_linear(x, self.c_fc.weight.type_as(x), self.tp, self.sequence)
        return leave_tensor_parallel(self.c_proj(F.relu(up).square()), self.tp, self.sequence)  # ReLU^2


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, max_seq_len: int, has_attention: bool,
                 takes_skip: bool, tp: Axis = Axis(), sequence: str = "replicated"):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads, head_dim, max_seq_len, tp, sequence) if has_attention \
            else None
        self.mlp = MLP(dim, tp, sequence)
        self.tp, self.sequence_sharded = tp, sequence != "replicated"
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # mix of the residual stream and the embedding x0
        # decoder blocks weigh the U-Net skip from their mirror encoder block (a block's own parameter, so that
        # each parameter lives on exactly one pipeline stage)
        self.skip_weight = nn.Parameter(torch.tensor(1.0)) if takes_skip else None

    def shared(self, param: Tensor) -> Tensor:
        """A scalar parameter used on sequence shards: each tensor-parallel rank holds part of its gradient, and
        f's backward sums them."""
        return copy_to_tensor_parallel(param, self.tp) if self.sequence_sharded else param

    def forward(self, x: Tensor, skip: Tensor | None, ve: Tensor | None, x0: Tensor, mask: AttentionMask,
                use_flex: bool) -> Tensor:
        lambdas = self.shared(self.lambdas)
        if skip is not None:
            x = x + self.shared(self.skip_weight) * skip
        x = lambdas[0] * x + lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), ve, mask, use_flex)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    """U-Net GPT: encoder-half outputs feed the mirrored decoder half through learnable skip weights; three
    value embeddings feed the first three and last three layers' values; window_pattern says which layers
    use the long ('L') or short ('S') sliding window.

    A pipeline stage is built with `layers`, a contiguous run of block indices: it holds those blocks only (the
    others are None, so parameter names stay those of the whole model), the embeddings if it starts at layer 0,
    and the head if it ends at the last layer.
    """

    NUM_VALUE_EMBEDS = 3
    # evaluation runs the head over this many tokens at a time: a 262K-token validation sequence's fp32 logits
    # over the whole vocabulary are 53 GB, which no GPU holds when the model runs uncompiled (tp, pp, ZeRO 3)
    EVAL_HEAD_ROWS = 16384

    def __init__(self, vocab_size: int, num_layers: int, num_heads: int, head_dim: int, model_dim: int,
                 max_seq_len: int, window_pattern: str, attention_free_layers=(), fp8_head=True, tp: Axis = Axis(),
                 layers: range | None = None, sequence: str = "replicated"):
        super().__init__()
        self.window_pattern, self.tp, self.model_dim, self.sequence = window_pattern, tp, model_dim, sequence
        self.layers = range(num_layers) if layers is None else layers
        self.num_encoder_layers = num_layers // 2
        self.use_flex = False  # set by the trainer: FlexAttention on CUDA, the dense twin elsewhere
        # tensor parallel: the token embedding and the head split by vocabulary, the value embeddings by the heads
        # they feed (no communication), the blocks by heads and MLP width
        first, last = self.layers.start == 0, self.layers.stop == num_layers
        self.embed = nn.Embedding(-(-vocab_size // tp.size), model_dim) if first else None
        self.value_embeds = nn.ModuleList([nn.Embedding(vocab_size, model_dim // tp.size)
                                           for _ in range(self.NUM_VALUE_EMBEDS)]) if first else None
        self.blocks = nn.ModuleList([Block(model_dim, num_heads, head_dim, max_seq_len, i not in attention_free_layers,
                                           i >= self.num_encoder_layers, tp, sequence) if i in self.layers else None
                                     for i in range(num_layers)])
        # vocab padded to a multiple of 128 for faster kernels; the FP8 scales are the record's
        padded_vocab = next_multiple_of_n(vocab_size, n=128)
        self.lm_head = CastedLinear(model_dim, padded_vocab // tp.size, use_fp8=fp8_head, x_s=model_dim ** 0.5 / 448,
                                    w_s=24 / 448, grad_s=1 / 448) if last else None
        if first:
            mark_tensor_parallel(self.embed.weight, 0, vocab_size, tp)
            for value_embed in self.value_embeds:
                mark_tensor_parallel(value_embed.weight, 1, model_dim, tp)
        if last:
            self.lm_head.weight.detach().zero_()
            mark_tensor_parallel(self.lm_head.weight, 0, padded_vocab, tp)

    def local_blocks(self) -> list[Block]:
        return [self.blocks[i] for i in self.layers]

    def embed_tokens(self, input_seq: Tensor) -> Tensor:
        if self.tp.size == 1:
            return self.embed(input_seq)
        rows = self.embed.num_embeddings  # vocabulary-parallel: look up this rank's rows, zero elsewhere, sum
        local = input_seq - self.tp.rank * rows
        inside = (local >= 0) & (local < rows)
        found = self.embed(local.clamp(0, rows - 1)) * inside[:, None].to(self.embed.weight.dtype)
        return leave_tensor_parallel(found[None], self.tp, self.sequence)[0]

    def value_embed_of_layer(self, ve: list[Tensor], i: int) -> Tensor | None:
        """Value embedding k feeds layer k and layer num_layers - 3 + k; the middle layers get none."""
        n_ve, n_layers = self.NUM_VALUE_EMBEDS, len(self.blocks)
        return ve[i] if i < n_ve else ve[i - (n_layers - n_ve)] if i >= n_layers - n_ve else None

    def carry_shapes(self, layer: int, seq_len: int) -> list[tuple]:
        """Shapes of what crosses a pipeline boundary before `layer` (see forward's carry), for the receiver."""
        pending_skips = min(layer, self.num_encoder_layers) - max(0, layer - self.num_encoder_layers)
        shard = seq_len // self.tp.size if self.sequence != "replicated" else seq_len
        stream, value_embed = (1, shard, self.model_dim), (seq_len, self.model_dim // self.tp.size)
        return [stream] * 2 + [value_embed] * self.NUM_VALUE_EMBEDS + [stream] * pending_skips

    def forward(self, input_seq: Tensor, target_seq: Tensor, window_blocks: Tensor,
                carry: list[Tensor] | None = None) -> Tensor | list[Tensor]:
        """input_seq, target_seq: (T,). Loss summed over tokens in training, averaged in evaluation.

        A pipeline stage after the first takes `carry` from the stage before: the residual stream x, the normed
        embedding x0, the three value embeddings and the encoder outputs its decoder blocks have yet to take
        as skips. Every stage but the last returns the carry for the next.
        """
        long_mask, short_mask = document_causal_masks(input_seq, window_blocks)
        if carry is None:
            x = norm(self.embed_tokens(input_seq)[None])  # (1, T, D); sequence parallel: (1, T / tp, D)
            carry = [x, x, *[value_embed(input_seq) for value_embed in self.value_embeds]]
        x, x0, ve, skips = carry[0], carry[1], carry[2:2 + self.NUM_VALUE_EMBEDS], carry[2 + self.NUM_VALUE_EMBEDS:]
        for i in self.layers:
            skip = skips.pop() if i >= self.num_encoder_layers else None
            mask = long_mask if self.window_pattern[i] == "L" else short_mask
            x = self.blocks[i](x, skip, self.value_embed_of_layer(ve, i), x0, mask, self.use_flex)
            if i < self.num_encoder_layers:
                skips.append(x)
        if self.lm_head is None:
            return [x, x0, *ve, *skips]
        x = enter_tensor_parallel(norm(x), self.tp, self.sequence)[0]  # (T, D)
        if self.training:
            return self.summed_loss(x, target_seq)
        rows = self.EVAL_HEAD_ROWS
        return sum(self.summed_loss(x[i:i + rows], target_seq[i:i + rows])
                   for i in range(0, len(target_seq), rows)) / len(target_seq)

    def summed_loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """Cross-entropy summed over the rows of x (T, D), through the head and the soft cap."""
        logits = self.lm_head(x).float()
        logits = 30 * torch.sigmoid(logits / (7.5 * x.size(-1) ** 0.5))  # soft cap in (0, 30), element-wise
        if self.tp.size == 1:
            return F.cross_entropy(logits, targets, reduction="sum")
        return vocab_parallel_cross_entropy(logits, targets, self.tp)


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, tp: Axis) -> Tensor:
    """Cross-entropy summed over tokens, of logits split by vocabulary across tp: (T, V / tp) here, full (T, V)
    nowhere."""
    n = logits.size(-1)
    with torch.no_grad():
        top = logits.max(dim=-1).values
        count_comm("all_reduce", top)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
    shifted = logits - top[:, None]
    sum_exp = reduce_from_tensor_parallel(shifted.exp().sum(dim=-1), tp)
    local = targets - tp.rank * n
    inside = (local >= 0) & (local < n)
    target_logit = shifted.gather(1, local.clamp(0, n - 1)[:, None]).squeeze(1) * inside
    losses = sum_exp.log() - reduce_from_tensor_parallel(target_logit, tp)
    return losses.sum()


# ----------------------------------------------------------------------------------------------------
# Data: the sharded .bin token format and the distributed batch generator

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256  # int32 header: magic, version, token count, then zeros
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
EOT_TOKEN = 50256  # GPT-2 <|endoftext|>; every document starts with it


def read_shard_header(path) -> int:
    """Check a shard's header and size; return its token count. Raises UserError naming the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise UserError(f"cannot read data shard {path}: {e.strerror}") from None
    if size < SHARD_HEADER_BYTES:
        raise UserError(f"data shard {path} is {size} bytes, shorter than its {SHARD_HEADER_BYTES}-byte header: "
                        "the file is truncated or not a shard; fetch or build it again")
    header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise UserError(f"data shard {path} has magic number {header[0]}, expected {SHARD_MAGIC}: "
                        "not a .bin token shard (or corrupt); fetch or build it again")
    if header[1] != SHARD_VERSION:
        raise UserError(f"data shard {path} has format version {header[1]}, this trainer reads version "
                        f"{SHARD_VERSION}; rebuild it with data/fineweb.py")
    num_tokens = int(header[2])
    expected = SHARD_HEADER_BYTES + 2 * num_tokens
    if num_tokens <= 0 or size != expected:
        raise UserError(f"data shard {path} header says {num_tokens} tokens ({expected} bytes) but the file is "
                        f"{size} bytes: truncated or corrupt; fetch or build it again")
    return num_tokens


def load_data_shard(path, pin_memory: bool = False) -> Tensor:
    """Read a whole shard's uint16 tokens into (optionally pinned) host memory."""
    num_tokens = read_shard_header(path)
    tokens = torch.empty(num_tokens, dtype=torch.uint16, pin_memory=pin_memory)
    with open(path, "rb", buffering=0) as f:  # unbuffered: read straight into the tensor
        f.seek(SHARD_HEADER_BYTES)
        nbytes = f.readinto(tokens.numpy())
    if nbytes != 2 * num_tokens:
        raise UserError(f"data shard {path}: read {nbytes} bytes of tokens, header promised {2 * num_tokens}")
    return tokens


def write_data_shard(path, tokens) -> None:
    """Write tokens (ints below 2**16) as a shard, via a temporary name so no half-written file is left."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must fit in uint16, got range [{tokens.min()}, {tokens.max()}]")
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    os.replace(tmp, path)


def list_shards(pattern: str, flag: str) -> list[Path]:
    files = [Path(f) for f in sorted(glob.glob(pattern))]
    if not files:
        raise UserError(f"--{flag} {pattern!r} matches no file; fetch FineWeb with `python data/cached_fineweb10B.py` "
                        "or point the flag at existing .bin shards")
    return files


class DistributedDataLoader:
    """This rank's (inputs, targets) micro-batches, one sequence of seq_len tokens each, resumable from a position.

    A global batch is seqs_per_batch consecutive sequences. Sequence j goes to rank j % world_size as its
    micro-step j // world_size, so every world size dividing seqs_per_batch sees the same global batch.
    A batch never straddles shards: when the current shard cannot hold the next one, move to the next shard.
    Between global batches, `position()` names the shard and token offset where the next one starts.
    """

    def __init__(self, pattern: str, seq_len: int, seqs_per_batch: int, rank: int, world_size: int,
                 device: torch.device, flag: str = "train_files", position: dict | None = None):
        self.files = list_shards(pattern, flag)
        for f in self.files:  # fail on a bad shard now, not hours into the run
            read_shard_header(f)
        self.pattern, self.flag = pattern, flag
        self.seq_len, self.rank, self.world_size, self.device = seq_len, rank, world_size, device
        self.batch_tokens = seq_len * seqs_per_batch
        self.micro_steps = seqs_per_batch // world_size
        self.shard_index, self.offset, self.micro_step, self.tokens = 0, 0, 0, None
        if position is not None:
            names = [f.name for f in self.files]
            if position["shard"] not in names:
                raise UserError(f"the checkpoint's data position is in shard {position['shard']}, which --{flag} "
                                f"{pattern!r} does not match: resume with the data the run was started on")
            self.shard_index, self.offset = names.index(position["shard"]), position["offset"]

    def position(self) -> dict:
        return dict(shard=self.files[self.shard_index].name, offset=self.offset)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        if self.micro_step == 0:
            self._ensure_room_for_a_batch()
        j = self.rank + self.micro_step * self.world_size
        buf = self.tokens[self.offset + j * self.seq_len:][:self.seq_len + 1]
        self.micro_step += 1
        if self.micro_step == self.micro_steps:
            self.micro_step, self.offset = 0, self.offset + self.batch_tokens
        # non_blocking: the copy overlaps the host's next work; no host sync needed
        inputs = buf[:-1].to(device=self.device, dtype=torch.int32, non_blocking=True)
        targets = buf[1:].to(device=self.device, dtype=torch.int64, non_blocking=True)
        return inputs, targets

    def _ensure_room_for_a_batch(self) -> None:
        pin = self.device.type == "cuda"
        if self.tokens is None:
            self.tokens = load_data_shard(self.files[self.shard_index], pin_memory=pin)
        while self.offset + self.batch_tokens + 1 > len(self.tokens):
            if self.shard_index + 1 == len(self.files):
                raise UserError(f"--{self.flag} {self.pattern!r}: out of data after {len(self.files)} shard(s); a "
                                f"batch needs {self.batch_tokens + 1} tokens in one shard. Fetch more shards or "
                                "train fewer steps")
            self.shard_index, self.offset = self.shard_index + 1, 0
            self.tokens = load_data_shard(self.files[self.shard_index], pin_memory=pin)


# ----------------------------------------------------------------------------------------------------
# Hyperparameters: the record's values are the defaults; presets and flags override them

@dataclass
class Hyperparameters:
    preset: str = "record"
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10485760  # validation tokens per evaluation, split across ranks
    train_seq_len: int = 48 * 1024  # tokens per micro-batch (one sequence: FlexAttention masks are per sequence)
    val_seq_len: int = 4 * 64 * 1024
    seqs_per_step: int = 8  # global batch in sequences; ranks short of it are made up by gradient accumulation
    # model
    vocab_size: int = 50257
    num_layers: int = 12
    num_heads: int = 6
    head_dim: int = 128
    model_dim: int = 768
    window_pattern: str = "LSSSLSSLSSSL"  # long or short sliding window, per layer
    attention_free_layers: str = "7"  # comma-separated layer indices without attention
    window_max_tokens: int = 1728  # the sliding window grows linearly to this over the run
    fp8_head: bool = True  # FP8 matmul for the lm_head in training
    # optimisation
    num_iterations: int = 1770
    cooldown_frac: float = 0.4  # final fraction of steps with the lr decaying linearly to 0.1x
    lr_head: float = 0.22
    lr_embed: float = 0.6
    lr_scalar: float = 0.04
    lr_muon: float = 0.05
    muon_momentum_warmup_steps: int = 300  # Muon momentum 0.85 -> 0.95 over these steps
    # evaluation and logging
    val_loss_every: int = 125  # 0: only at the end
    target_val_loss: float = 3.28
    log_dir: str = "logs"
    run_id: str = ""  # empty: torchrun's rendezvous id (so elastic restarts share it), else a fresh uuid
    # checkpoints and stopping
    save_every: int = 0  # checkpoint every N steps and at the end; 0: only when stopped by kill switch or signal
    resume: str = ""  # a checkpoint file, or "latest": this run id's newest (none yet: start fresh)
    kill_switch: str = ""  # stop (with a checkpoint) when this file appears; empty: <log_dir>/<run_id>.stop
    # runtime
    compile: bool | None = None  # None: compile on CUDA, eager elsewhere
    warmup_steps: int = 10  # compile warm-up steps on random tokens, undone afterwards
    fp64_grad_sum: bool = False  # sum gradients in float64: every world size trains bit-identical models
    tp: int = 1  # tensor-parallel size: consecutive ranks split heads, MLP width and vocabulary
    sp: bool = False  # sequence parallel (with --tp): outside attention and MLP each tp rank holds 1/tp of the sequence
    async_tp: bool = False  # with --sp: a column-parallel matmul starts on its own shard while the others arrive
    pp: int = 1  # pipeline-parallel size: the blocks split into this many contiguous stages
    pp_schedule: str = "1f1b"  # afab (all forwards, then all backwards) or 1f1b (one forward, one backward)
    zero: int = 0  # ZeRO stage over the data-parallel ranks: 1 shards optimizer states, 2 also gradients, 3 also params
    plan: bool = False  # print each rank's memory and each collective's bytes per step for this layout; no training
    nproc: int = 0  # with --plan: the number of processes to plan for (0: WORLD_SIZE, else 1)
    plan_device: str = "cuda"  # with --plan: the dtypes of a run on cuda (bf16 embeddings) or cpu
    seed: int = 0


PRESETS = {
    "record": {},
    # ~6.5 minutes on 2 CPU cores, on the embedded Shakespeare shards (most of a step is the 50304-wide lm_head)
    "cpu": dict(train_files="data/shakespeare/shakespeare_train_*.bin",
                val_files="data/shakespeare/shakespeare_val_*.bin",
                val_tokens=16 * 1024, train_seq_len=256, val_seq_len=1024, seqs_per_step=4, num_layers=6,
                num_heads=2, head_dim=64, model_dim=128, window_pattern="LSSSSL", attention_free_layers="",
                window_max_tokens=512, fp8_head=False, num_iterations=200, muon_momentum_warmup_steps=50,
                val_loss_every=25, target_val_loss=5.8, fp64_grad_sum=True),
    # seconds, for tests and smoke runs
    "tiny": dict(train_files="data/shakespeare/shakespeare_train_*.bin",
                 val_files="data/shakespeare/shakespeare_val_*.bin",
                 val_tokens=4 * 256, train_seq_len=256, val_seq_len=256, num_layers=6, num_heads=2, head_dim=16,
                 model_dim=32, window_pattern="LSSSSL", attention_free_layers="4", window_max_tokens=256,
                 fp8_head=False, num_iterations=20, muon_momentum_warmup_steps=5, val_loss_every=10,
                 target_val_loss=8.0, fp64_grad_sum=True),
}


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false or 1/0, got {text!r}")


def parse_args(argv=None, cuda: bool | None = None) -> Hyperparameters:
    """Flags named after the fields; `--preset` (default: record with CUDA, cpu without) sets the base values."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description="GPT-2 speedrun trainer", allow_abbrev=False)
    for field in dataclasses.fields(Hyperparameters):
        if field.name == "preset":
            parser.add_argument("--preset", choices=sorted(PRESETS), default="record" if cuda else "cpu")
        elif field.type in (bool, bool | None):
            parser.add_argument(f"--{field.name}", type=_parse_bool, default=None, metavar="BOOL")
        else:
            parser.add_argument(f"--{field.name}", type=field.type, default=None)
    flags = parser.parse_args(argv)
    values = dict(PRESETS[flags.preset], preset=flags.preset)
    values.update({k: v for k, v in vars(flags).items() if v is not None and k != "preset"})
    args = Hyperparameters(**values)
    check_hyperparameters(args)
    return args


def sequence_mode(args: Hyperparameters) -> str:
    """How activations outside the tensor-parallel regions are held (see column_parallel_linear)."""
    return "async" if args.async_tp else "sharded" if args.sp else "replicated"


def attention_free_layers(args: Hyperparameters) -> tuple[int, ...]:
    try:
        return tuple(int(i) for i in args.attention_free_layers.split(",") if i.strip())
    except ValueError:
        raise UserError(f"--attention_free_layers {args.attention_free_layers!r}: expected comma-separated "
                        "layer indices such as '7'") from None


def check_hyperparameters(args: Hyperparameters) -> None:
    """Refuse values the run cannot use, before any model is built."""
    def need(ok: bool, message: str):
        if not ok:
            raise UserError(message)
    for name in ("num_iterations", "num_layers", "num_heads", "head_dim", "model_dim", "seqs_per_step",
                 "train_seq_len", "val_seq_len", "val_tokens", "window_max_tokens", "vocab_size"):
        need(getattr(args, name) > 0, f"--{name} must be positive, got {getattr(args, name)}")
    for name in ("val_loss_every", "save_every"):
        need(getattr(args, name) >= 0, f"--{name} must be >= 0, got {getattr(args, name)}")
    need(args.tp >= 1, f"--tp must be >= 1, got {args.tp}")
    need(1 <= args.pp <= args.num_layers, f"--pp {args.pp} must be between 1 and --num_layers {args.num_layers}: "
         "each pipeline stage holds at least one block")
    need(args.sp or not args.async_tp, "--async_tp overlaps the all-gather of sequence-parallel shards with the "
         "matmul: it needs --sp true")
    need(args.pp_schedule in PIPELINE_SCHEDULES, f"--pp_schedule must be one of {PIPELINE_SCHEDULES}, got "
         f"{args.pp_schedule!r}")
    need(args.model_dim == args.num_heads * args.head_dim, f"--model_dim {args.model_dim} must equal --num_heads x "
         f"--head_dim ({args.num_heads * args.head_dim}): the value embeddings are added to the values")
    need(args.zero in (0, 1, 2, 3), f"--zero must be 0, 1, 2 or 3, got {args.zero}")
    need(not (args.zero >= 3 and args.compile), "--zero 3 gathers parameters in module hooks that torch.compile "
         "does not trace: run it with --compile false")
    need(args.nproc >= 0, f"--nproc must be >= 0, got {args.nproc}")
    need(args.plan_device in ("cuda", "cpu"), f"--plan_device must be cuda or cpu, got {args.plan_device!r}")
    need(0 <= args.cooldown_frac <= 1, f"--cooldown_frac must be in [0, 1], got {args.cooldown_frac}")
    need(args.vocab_size <= 2**16, f"--vocab_size {args.vocab_size} does not fit the uint16 token shards")
    for name in ("train_seq_len", "val_seq_len"):
        need(getattr(args, name) % ATTENTION_BLOCK_SIZE == 0,
             f"--{name} {getattr(args, name)} must be a multiple of {ATTENTION_BLOCK_SIZE} (the attention block)")
    need(args.val_tokens % args.val_seq_len == 0,
         f"--val_tokens {args.val_tokens} must be a multiple of --val_seq_len {args.val_seq_len}")
    need(args.num_layers % 2 == 0 and args.num_layers >= 2 * GPT.NUM_VALUE_EMBEDS,
         f"--num_layers {args.num_layers} must be even and at least {2 * GPT.NUM_VALUE_EMBEDS} "
         "(U-Net halves, value embeddings on the first and last three layers)")
    need(len(args.window_pattern) == args.num_layers and set(args.window_pattern) <= {"L", "S"},
         f"--window_pattern {args.window_pattern!r} must have one letter L or S per layer ({args.num_layers})")
    need(args.head_dim % 4 == 0, f"--head_dim {args.head_dim} must be a multiple of 4 (half-truncated rotary)")
    bad = [i for i in attention_free_layers(args) if not 0 <= i < args.num_layers]
    need(not bad, f"--attention_free_layers names layers {bad} outside 0..{args.num_layers - 1}")


def check_world_size(args: Hyperparameters, world_size: int) -> int:
    """Gradient-accumulation steps (micro-batches per rank) for this world size, --tp and --pp; refuses a layout
    that does not fit, before any process group or model is built."""
    tp, pp = args.tp, args.pp
    if world_size % (tp * pp):
        raise UserError(f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the world size {world_size}: the ranks "
                        f"form a grid of pipeline {pp} x data parallel x tensor parallel {tp}; launch a multiple of "
                        f"{tp * pp} processes")
    for what, size in (("--num_heads", args.num_heads), ("--model_dim", args.model_dim),
                       ("the MLP width (4 x --model_dim)", 4 * args.model_dim),
                       ("the padded vocabulary", next_multiple_of_n(args.vocab_size, n=128))):
        if size % tp:
            raise UserError(f"--tp {tp} does not divide {what} ({size}): tensor parallelism splits it evenly")
    if args.sp:
        if tp == 1:
            raise UserError("--sp shards the sequence over the tensor-parallel ranks: it needs --tp 2 or more")
        for flag in ("train_seq_len", "val_seq_len"):
            if getattr(args, flag) % tp:
                raise UserError(f"--sp splits --{flag} {getattr(args, flag)} over --tp {tp} ranks: it must divide")
    dp = world_size // (tp * pp)
    name = f"world size {world_size}" if tp * pp == 1 else \
        f"data-parallel size {dp} (world size {world_size} / (--tp {tp} x --pp {pp}))"
    if args.seqs_per_step % dp:
        divisors = [d * tp * pp for d in range(1, args.seqs_per_step + 1) if args.seqs_per_step % d == 0]
        raise UserError(f"{name} does not divide --seqs_per_step {args.seqs_per_step}: run on "
                        f"{divisors} processes, or change --seqs_per_step")
    val_seqs = args.val_tokens // args.val_seq_len
    if val_seqs % dp:
        raise UserError(f"--val_tokens {args.val_tokens} is {val_seqs} sequences of --val_seq_len "
                        f"{args.val_seq_len}, which {name} does not divide")
    micro_batches = args.seqs_per_step // dp
    if micro_batches < pp:
        raise UserError(f"--pp {pp} stages need at least {pp} micro-batches per step to keep each stage busy, but "
                        f"--seqs_per_step {args.seqs_per_step} over {name} gives {micro_batches}: raise "
                        "--seqs_per_step or lower the data-parallel size or --pp")
    return micro_batches


# ----------------------------------------------------------------------------------------------------
# Schedules: learning rate, sliding window, Muon momentum (all functions of the step)

def lr_multiplier(step: int, args: Hyperparameters) -> float:
    """1.0, then linear to 0.1 over the final cooldown_frac of the run."""
    x = step / args.num_iterations
    if x < 1 - args.cooldown_frac:
        return 1.0
    w = (1 - x) / args.cooldown_frac
    return w * 1.0 + (1 - w) * 0.1


def window_size_blocks(step: int, args: Hyperparameters) -> int:
    """Sliding window in 128-token blocks, growing linearly with progress from 1 block to window_max_tokens."""
    x = step / args.num_iterations
    return next_multiple_of_n(args.window_max_tokens * x, n=ATTENTION_BLOCK_SIZE) // ATTENTION_BLOCK_SIZE


def muon_momentum(step: int, args: Hyperparameters) -> float:
    frac = min(step / args.muon_momentum_warmup_steps, 1) if args.muon_momentum_warmup_steps > 0 else 1
    return (1 - frac) * 0.85 + frac * 0.95


# ----------------------------------------------------------------------------------------------------
# Data parallel: setup, parameter broadcast, bucketed async gradient all-reduce

@dataclass
class ParallelContext:
    """This rank's place in the grid world = pp x dp x tp and the process group along each axis; built once.

    Tensor-parallel groups are runs of consecutive ranks (torchrun puts those on one node, where the links are
    fast); data-parallel groups take every tp-th rank within a pipeline stage; pipeline stages are the outermost
    axis, so only the activations crossing a stage boundary travel between blocks of dp x tp ranks.
    """
    rank: int
    world_size: int
    device: torch.device
    dp: Axis
    tp: Axis
    pp: Axis = Axis()

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def grid_rank(self, dp_rank: int, tp_rank: int, pp_rank: int | None = None) -> int:
        """The global rank at these coordinates (pp_rank None: this rank's stage)."""
        pp_rank = self.pp.rank if pp_rank is None else pp_rank
        return (pp_rank * self.dp.size + dp_rank) * self.tp.size + tp_rank


def build_parallel_context(rank: int, world_size: int, device: torch.device, tp: int = 1,
                           pp: int = 1) -> ParallelContext:
    """(check_world_size has refused a layout that does not factor world_size.)"""
    sizes = dict(pp=pp, dp=world_size // (tp * pp), tp=tp)  # outermost first: rank = (pp * dp + dp) * tp + tp
    strides = dict(pp=sizes["dp"] * tp, dp=tp, tp=1)
    axes = {}
    for name, size in sizes.items():
        if size == world_size:
            axes[name] = world_axis(rank, world_size)  # the default group: nothing to create
            continue
        if size == 1:
            axes[name] = Axis(ranks=(rank,))
            continue
        starts = sorted({r - (r // strides[name] % size) * strides[name] for r in range(world_size)})
        for start in starts:  # every rank creates every group, in the same order
            ranks = tuple(start + i * strides[name] for i in range(size))
            group = dist.new_group(list(ranks))
            if rank in ranks:
                axes[name] = Axis(ranks.index(rank), size, group, ranks)
    return ParallelContext(rank, world_size, device, **axes)


def setup_distributed(tp: int = 1, pp: int = 1) -> ParallelContext:
    """torchrun's environment (or none: one process); NCCL on CUDA, gloo on CPU."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():  # (tests start the group themselves)
        store = elastic_attempt_store(world_size)
        if device.type == "cuda":
            dist.init_process_group(backend="nccl", device_id=device, store=store, rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size)
        dist.barrier()
    return build_parallel_context(rank, world_size, device, tp, pp)


def elastic_attempt_store(world_size: int) -> "dist.Store | None":
    """torchrun's shared store under a prefix of its own for this restart attempt; None outside torchrun's.

    torchrun keeps one store across elastic restarts, so without the prefix restarted workers can read the dead
    workers' addresses and fail to connect (pytorch/pytorch#135712).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # init_process_group reads MASTER_ADDR and MASTER_PORT itself
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", shared)


def broadcast_parameters(model: nn.Module, dp: Axis) -> None:
    if dp.size > 1:
        for param in model.parameters():
            dist.broadcast(param.detach(), dp.global_rank(0), group=dp.group)


class GradientBuckets:
    """Average gradients over the data-parallel ranks in ~bucket_mb buckets, as soon as a bucket's gradients are final.

    Hooks run after a parameter's gradient is accumulated, so communication overlaps the rest of backward.
    Buckets follow reverse registration order (roughly the order backward produces gradients) and never mix
    dtypes. With gradient accumulation set `sync = False` for all but the last micro-batch.

    owner_of (ZeRO 2 and 3): a bucket then holds one owner's parameters and is reduced to that rank alone; the
    other ranks drop those gradients, so each rank keeps only the gradients of the parameters it updates.

    With sum_dtype=torch.float64 the micro-batches' gradients are summed and reduced in float64 (call
    set_aside_micro_batch() after each backward but the last) and rounded to the parameters' dtype once. Each
    micro-batch's gradient is exact in float64 and so are the few sums, so the result no longer depends on how
    the global batch was split over ranks and micro-batches: every world size trains bit-identical models.
    It costs a full float64 copy of the gradients (unsharded, even under ZeRO 2) and twice the bytes sent.
    """

    def __init__(self, params, bucket_mb: float = 25, sum_dtype: torch.dtype | None = None,
                 owner_of: dict | None = None, dp: Axis = Axis()):
        self.dp, self.owner_of, self.sum_dtype = dp, owner_of, sum_dtype
        self.buckets: list[list[Tensor]] = []
        sizes: list[float] = []
        for param in reversed([p for p in params if p.requires_grad]):
            mb = param.numel() * param.element_size() / 2**20
            last = self.buckets[-1] if self.buckets else None
            if (last is None or sizes[-1] + mb > bucket_mb or last[0].dtype != param.dtype
                    or self.owner(last[0]) != self.owner(param)):
                self.buckets.append([])
                sizes.append(0.0)
            self.buckets[-1].append(param)
            sizes[-1] += mb
        self.bucket_of = {param: i for i, bucket in enumerate(self.buckets) for param in bucket}
        self.sums = None if sum_dtype is None else [
            torch.zeros(sum(p.numel() for p in bucket), dtype=sum_dtype, device=bucket[0].device)
            for bucket in self.buckets]
        self.flat: list[Tensor | None] = [None] * len(self.buckets)
        self.ready = [0] * len(self.buckets)
        self.handles: list = [None] * len(self.buckets)
        self.sync = True
        for param in self.bucket_of:
            param.register_post_accumulate_grad_hook(self._hook)

    def owner(self, param: Tensor) -> int | None:
        """The rank that keeps this parameter's reduced gradient; None: every rank (plain all-reduce)."""
        return None if self.owner_of is None else self.owner_of[param]

    def _hook(self, param: Tensor) -> None:
        if not self.sync:
            return
        i = self.bucket_of[param]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i: int) -> None:
        if self.sums is not None:
            self._add_to_sum(i)
            flat = self.sums[i]
        else:
            flat = torch.cat([p.grad.view(-1) for p in self.buckets[i]])
            for p in self.buckets[i]:
                p.grad = None
        self.flat[i] = flat
        if self.dp.size == 1:
            return
        owner = self.owner(self.buckets[i][0])
        if owner is None:
            count_comm("all_reduce", flat)
            self.handles[i] = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=self.dp.group, async_op=True)
        else:  # (no AVG for reduce on gloo: the owner divides)
            count_comm("reduce", flat)
            self.handles[i] = dist.reduce(flat, dst=self.dp.global_rank(owner), op=dist.ReduceOp.SUM,
                                          group=self.dp.group, async_op=True)

    def _add_to_sum(self, i: int) -> None:
        offset = 0
        for p in self.buckets[i]:
            self.sums[i][offset:offset + p.numel()] += p.grad.view(-1)
            offset += p.numel()
            p.grad = None

    def set_aside_micro_batch(self) -> None:
        """Move this micro-batch's gradients into the float64 sums (nothing to do without them)."""
        if self.sums is not None:
            for i in range(len(self.buckets)):
                self._add_to_sum(i)

    def wait_for_gradients(self) -> None:
        missing = [i for i, flat in enumerate(self.flat) if flat is None]
        if missing:
            shapes = [tuple(p.shape) for p in self.buckets[missing[0]] if p.grad is None]
            raise RuntimeError(f"gradient bucket {missing[0]} was never reduced; parameters without a gradient "
                               f"this step: {shapes}")
        for i, (bucket, flat, handle) in enumerate(zip(self.buckets, self.flat, self.handles)):
            if handle is not None:
                handle.wait()
            owner = self.owner(bucket[0])
            if owner is None or owner == self.dp.rank:  # (another rank's shard: its gradients stay dropped)
                if owner is not None and self.dp.size > 1:
                    flat.div_(self.dp.size)
                offset = 0
                for p in bucket:  # views of the flat buffer, or (float64 sums) rounded once to the parameter's dtype
                    p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
                    offset += p.numel()
            if self.sums is not None:
                flat.zero_()
        self.ready = [0] * len(self.buckets)
        self.flat = [None] * len(self.buckets)
        self.handles = [None] * len(self.buckets)


# ----------------------------------------------------------------------------------------------------
# Pipeline parallel: each stage a contiguous run of blocks, activations passed on by point-to-point ops

PIPELINE_SCHEDULES = ("afab", "1f1b")


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """Stage `stage`'s contiguous share of the blocks; shares differ by at most one block."""
    return range(stage * num_layers // stages, (stage + 1) * num_layers // stages)


class PipelineStage:
    """This rank's stage of the pipeline (seeds 000 and 002), and the point-to-point ops to its neighbours.

    The stage before sends each micro-batch's carry (GPT.forward: residual stream, x0, value embeddings, pending
    U-Net skips); the stage after sends back the gradient of the carry this stage sent. Every exchange at one
    point of the schedule goes out as one batch of isend/irecv, both directions at once, so two neighbours that
    each send and receive cannot wait on each other. With one stage (no pipeline) nothing is sent.
    """

    def __init__(self, model: GPT, pp: Axis = Axis(), schedule: str = "1f1b", dtype: torch.dtype = torch.float32):
        self.model, self.pp, self.dtype = model, pp, dtype
        self.schedule = schedule if pp.size > 1 else "1f1b"  # one stage: nothing to overlap, keep one in flight
        self.first, self.last = pp.rank == 0, pp.rank == pp.size - 1
        if pp.size > 1:  # NCCL wants a group's first call to involve all its ranks; a batch of isend/irecv may not
            dist.barrier(group=pp.group)

    def exchange(self, seq_len: int, to_next: list[Tensor] | None = None, to_prev: list[Tensor] | None = None,
                 from_prev: bool = False, from_next: bool = False) -> tuple[list[Tensor] | None, list[Tensor] | None]:
        """Send carries (forward) or their gradients (backward) and receive them, in one batch; returns what came
        (from the stage before, from the stage after). Requests toward a missing neighbour are ignored."""
        ops, received = [], []
        peers = dict(prev=self.pp.rank - 1, next=self.pp.rank + 1)
        for tensors, peer in ((to_next, "next"), (to_prev, "prev")):
            if tensors is not None and 0 <= peers[peer] < self.pp.size:
                count_comm("send", *tensors)
                ops += [dist.P2POp(dist.isend, t.contiguous(), self.pp.global_rank(peers[peer]), self.pp.group)
                        for t in tensors]
        for wanted, peer, layer in ((from_prev, "prev", self.model.layers.start),
                                    (from_next, "next", self.model.layers.stop)):
            tensors = None
            if wanted and 0 <= peers[peer] < self.pp.size:
                tensors = [torch.empty(shape, dtype=self.dtype, device=self.device)
                           for shape in self.model.carry_shapes(layer, seq_len)]
                ops += [dist.P2POp(dist.irecv, t, self.pp.global_rank(peers[peer]), self.pp.group) for t in tensors]
            received.append(tensors)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received[0], received[1]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, model: nn.Module, inputs: Tensor, targets: Tensor, window: Tensor,
                carry: list[Tensor] | None) -> Tensor | list[Tensor]:
        """The loss on the last stage; elsewhere the carry for the next stage, in the activation dtype."""
        if carry is not None and torch.is_grad_enabled():
            for t in carry:
                t.requires_grad_()  # the gradient of the carry goes back to the stage before
        out = model(inputs, targets, window, carry)
        return out if self.last else [t.to(self.dtype) for t in out]


# ----------------------------------------------------------------------------------------------------
# Building the run: model, optimizers, compile warm-up

def build_model(args: Hyperparameters, device: torch.device, tp: Axis = Axis(), pp: Axis = Axis(),
                cuda_dtypes: bool | None = None) -> GPT:
    """This rank's model on device; cuda_dtypes (default: on CUDA) gives it the CUDA run's dtypes, for --plan.

    With tensor or pipeline parallelism the one-process model is built first, so every layout starts from the
    same weights, and this rank keeps its stage's blocks and its tensor-parallel slices of them.
    `full_shapes` records the one-process model's parameter shapes, which checkpoints hold.
    """
    def make(tp: Axis, layers: range | None = None) -> GPT:
        return GPT(vocab_size=args.vocab_size, num_layers=args.num_layers, num_heads=args.num_heads,
                   head_dim=args.head_dim, model_dim=args.model_dim,
                   max_seq_len=max(args.train_seq_len, args.val_seq_len), window_pattern=args.window_pattern,
                   attention_free_layers=attention_free_layers(args), fp8_head=args.fp8_head, tp=tp,
                   layers=layers, sequence=sequence_mode(args) if tp.size > 1 else "replicated").to(device)
    model = make(Axis())
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if tp.size > 1 or pp.size > 1:
        full = model.state_dict()
        model = make(tp, stage_layers(args.num_layers, pp.size, pp.rank))
        model.load_state_dict(shard_state_dict(full, model))
    model.full_shapes = full_shapes
    model.use_flex = device.type == "cuda"
    if device.type == "cuda" if cuda_dtypes is None else cuda_dtypes:
        for m in model.modules():  # bf16 embeddings make the activations bf16; CPU stays fp32 (bf16 is slow there)
            if isinstance(m, nn.Embedding):
                m.bfloat16()
    return model


def compute_dtype(device_type: str) -> torch.dtype:
    """Of activations and Newton-Schulz: bf16 on CUDA, fp32 on CPU (where bf16 matmuls are slow)."""
    return torch.bfloat16 if device_type == "cuda" else torch.float32


def shard_state_dict(full: dict[str, Tensor], model: GPT) -> dict[str, Tensor]:
    """A one-process model's tensors cut to this rank's: its pipeline stage's, and its tensor-parallel slices."""
    return {name: tp_shard(full[name], p.tp_dim, model.tp) if is_tensor_parallel(p) else full[name]
            for name, p in model.named_parameters()}


def optimizer_param_groups(model: GPT) -> dict[str, list[Tensor]]:
    """Muon takes the hidden matrices; Adam the head, the embeddings and the scalars, each with its own lr."""
    embeddings = [model.embed, *model.value_embeds] if model.embed is not None else []  # (a pipeline stage's own)
    return dict(muon=[p for p in model.blocks.parameters() if p.ndim >= 2],
                head=[model.lm_head.weight] if model.lm_head is not None else [],
                embed=[p for m in embeddings for p in m.parameters()],
                scalar=[p for p in model.parameters() if p.ndim < 2])


def build_optimizers(model: GPT, args: Hyperparameters, ctx: ParallelContext) -> list[torch.optim.Optimizer]:
    groups = optimizer_param_groups(model)
    adam_groups = [dict(params=groups["head"], lr=args.lr_head), dict(params=groups["embed"], lr=args.lr_embed),
                   dict(params=groups["scalar"], lr=args.lr_scalar)]
    adam = torch.optim.Adam([group for group in adam_groups if group["params"]],  # (pipeline stages lack some)
                            betas=(0.8, 0.95), eps=1e-10, fused=True)
    on_cuda = ctx.device.type == "cuda"
    muon = Muon(groups["muon"], lr=args.lr_muon, momentum=0.95, dp=ctx.dp, tp=ctx.tp,
                orthogonalize=torch.compile(zeropower_via_newtonschulz5) if on_cuda else zeropower_via_newtonschulz5,
                ns_dtype=compute_dtype(ctx.device.type), owner_applies=args.zero >= 3)
    optimizers = [adam, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


@dataclass
class Zero:
    """The ZeRO stage over the data-parallel ranks and which rank owns (updates) each parameter.

    Stage 1: Adam's moments live only on the parameter's owner, which broadcasts the updated parameter (Muon's
    momentum is always kept by the one rank that orthogonalises the matrix). Stage 2: gradients are reduced to
    the owner alone. Stage 3: parameters too live only on their owner between uses.
    """
    stage: int
    dp: Axis
    owner_of: dict  # parameter -> data-parallel rank

    @staticmethod
    def build(stage: int, groups: dict[str, list[Tensor]], dp: Axis) -> "Zero":
        owner_of = Muon.owners(groups["muon"], dp.size)
        load = [0] * dp.size
        adam_params = groups["head"] + groups["embed"] + groups["scalar"]
        for p in sorted(adam_params, key=lambda p: -p.numel()):  # largest first, to the least loaded rank
            owner = load.index(min(load))
            owner_of[p] = owner
            load[owner] += p.numel()
        return Zero(stage, dp, owner_of)

    def owns(self, param: Tensor) -> bool:
        return self.owner_of[param] == self.dp.rank

    def broadcast_from_owner(self, param: Tensor):
        """Async: the owner's values of param to the other data-parallel ranks (.data: see ShardedParameters)."""
        count_comm("broadcast", param)
        return dist.broadcast(param.data, self.dp.global_rank(self.owner_of[param]), group=self.dp.group,
                              async_op=True)

    def gradient_owners(self) -> dict | None:
        """For GradientBuckets: reduce each gradient to its owner (stage 2 and up), or all-reduce (None)."""
        return self.owner_of if self.stage >= 2 else None


class ShardedParameters:
    """ZeRO 3: a parameter's values live on its owner alone except while a forward or backward needs them.

    Units are the blocks and the rest of the model (embeddings, head, scalars). A block is gathered (broadcast
    from the owners into storage re-allocated for the purpose) just before its forward, with the next block's
    gather already under way, and dropped after; a hook on its output gathers it again, and starts on the block
    before it, when backward reaches it; it is dropped once all its gradients are in. The rest is gathered when
    the forward starts and dropped after its gradients (or, without grad, after the forward). Autograd's saved
    tensors share the parameters' storage, so they see the values again when backward runs.
    """

    def __init__(self, model: GPT, zero: Zero):
        self.zero = zero
        blocks = model.local_blocks()
        in_blocks = {p for block in blocks for p in block.parameters()}
        self.units = [list(block.parameters()) for block in blocks]
        self.units.append([p for p in model.parameters() if p not in in_blocks])
        self.root = len(self.units) - 1
        self.unit_of = {p: u for u, unit in enumerate(self.units) for p in unit}
        self.handles: dict[int, list] = {}  # unit -> broadcasts in flight
        self.resident: set[int] = set(range(len(self.units)))
        self.grads_in = [0] * len(self.units)
        model.register_forward_pre_hook(lambda module, args: self._enter(self.root, prefetch=0))
        model.register_forward_hook(lambda module, args, out: self.drop(self.root) if not torch.is_grad_enabled()
                                    else None)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, args, i=i: self._enter(i, i + 1))
            block.register_forward_hook(lambda module, args, out, i=i: self._after_forward(i, out))
        for p in self.unit_of:
            p.register_post_accumulate_grad_hook(self._gradient_in)
        self.drop_all()

    def _start(self, u: int) -> None:
        """Start gathering unit u (no-op past either end, or when it is resident or on its way)."""
        if not 0 <= u < len(self.units) or u in self.resident or u in self.handles:
            return
        for p in self.units[u]:
            if not self.zero.owns(p):
                p.data.untyped_storage().resize_(nbytes(p))
        # into .data, which has its own version counter: refilling does not invalidate what autograd saved
        self.handles[u] = [self.zero.broadcast_from_owner(p) for p in self.units[u]]

    def gather(self, u: int) -> None:
        self._start(u)
        for handle in self.handles.pop(u, []):
            handle.wait()
        self.resident.add(u)

    def drop(self, u: int) -> None:
        for p in self.units[u]:
            if not self.zero.owns(p):
                p.data.untyped_storage().resize_(0)
        self.resident.discard(u)

    def gather_all(self) -> None:
        for u in range(len(self.units)):
            self.gather(u)

    def drop_all(self) -> None:
        for u in range(len(self.units)):
            self.drop(u)

    def _enter(self, u: int, prefetch: int) -> None:
        self.gather(u)
        self._start(prefetch)

    def _after_forward(self, i: int, out: Tensor) -> None:
        self.drop(i)
        if out.requires_grad:
            out.register_hook(lambda grad: self._enter(i, i - 1))

    def _gradient_in(self, p: Tensor) -> None:
        u = self.unit_of[p]
        self.grads_in[u] += 1
        if self.grads_in[u] == len(self.units[u]):
            self.grads_in[u] = 0
            self.drop(u)


def set_schedules(optimizers: list[torch.optim.Optimizer], step: int, args: Hyperparameters) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier(step, args)
    for group in optimizers[1].param_groups:
        group["momentum"] = muon_momentum(step, args)


def warmup_and_restore(model: nn.Module, optimizers: list[torch.optim.Optimizer], train_step, steps: int) -> None:
    """Run `steps` training steps (to trigger compilation), then put model and optimizers back as they were."""
    initial = dict(model=copy.deepcopy(model.state_dict()),
                   optimizers=[copy.deepcopy(opt.state_dict()) for opt in optimizers])
    for _ in range(steps):
        train_step()
    model.load_state_dict(initial["model"])
    for opt, state in zip(optimizers, initial["optimizers"]):
        opt.load_state_dict(state)
    model.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------------
# Plan: each rank's memory and each collective's bytes per step, predicted from the model's shapes

def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def plan_layout(args: Hyperparameters, world_size: int, cuda: bool) -> dict:
    """What a run of args on world_size processes holds per rank and sends per training step, in bytes.

    Built from each stage's model on the meta device (nothing allocated) and the same ownership rules the run
    uses, so parameters, gradients, optimizer states and collectives are exact; activations are an estimate
    (the tensors autograd keeps for the micro-batches in flight). Bytes of a collective or a send are those of
    the tensors handed to it, per rank.
    """
    grad_accum_steps = check_world_size(args, world_size)
    tp, pp = args.tp, args.pp
    dp = world_size // (tp * pp)
    with torch.device("meta"):
        stages = [build_model(args, torch.device("meta"), Axis(0, tp, None, tuple(range(tp))),
                              Axis(s, pp, None, tuple(range(pp))), cuda_dtypes=cuda) for s in range(pp)]
    ns_bytes = act_bytes = compute_dtype("cuda" if cuda else "cpu").itemsize
    sum_bytes = 8 if args.fp64_grad_sum else None
    tokens = args.train_seq_len

    ranks = []
    for rank in range(world_size):
        stage, dp_rank = rank // (dp * tp), rank // tp % dp
        model = stages[stage]
        groups = optimizer_param_groups(model)
        params = list(model.parameters())
        adam_params = groups["head"] + groups["embed"] + groups["scalar"]
        first, last = model.layers.start == 0, model.layers.stop == args.num_layers
        zero = Zero.build(args.zero, groups, Axis(dp_rank, dp))
        owned = [p for p in params if zero.owns(p)]
        comm = collections.Counter()
        if dp > 1:
            grad_bytes = sum(sum_bytes * p.numel() if sum_bytes else nbytes(p) for p in params)
            comm["reduce" if args.zero >= 2 else "all_reduce"] += grad_bytes
            if args.zero >= 3:  # each micro-batch gathers every parameter for forward, the blocks' for backward
                block_bytes = sum(map(nbytes, model.blocks.parameters()))
                comm["broadcast"] += grad_accum_steps * (sum(map(nbytes, params)) + block_bytes)
            else:  # Muon's updates exchanged; under ZeRO 1 and 2, Adam's updated parameters sent by their owners
                for size, count in collections.Counter(p.numel() for p in groups["muon"]).items():
                    comm["all_gather_into_tensor"] += math.ceil(count / dp) * dp * size * ns_bytes
                if args.zero >= 1:
                    comm["broadcast"] += sum(map(nbytes, adam_params))
            if args.zero >= 2:
                comm["all_reduce"] += 4  # the gradient norm's squared shares
        if tp > 1:
            activation = tokens * args.model_dim * act_bytes
            n_layers = len(model.layers)
            n_attention = sum(block.attn is not None for block in model.local_blocks())
            # entering each attention, each MLP and the head, and leaving each attention, each MLP and the
            # embedding, once forward and once backward: replicated, g and f's backward all-reduce the activation;
            # sequence parallel, an all-gather of the shards and a reduce-scatter to them, each way
            crossings = activation * (2 * (n_attention + n_layers) + first + last)
            # f's backward sums each attention's lambdas (and under sp each block's lambdas and skip weight); the
            # loss all-reduces its max, sum of exponentials and target logit
            scalars = n_attention * 2 * 4 + last * 3 * tokens * 4
            if args.sp:
                comm["all_gather_into_tensor"] += grad_accum_steps * crossings
                comm["reduce_scatter_tensor"] += grad_accum_steps * crossings
                scalars += sum(sum(map(nbytes, (b.lambdas, b.skip_weight) if b.skip_weight is not None
                                       else (b.lambdas,))) for b in model.local_blocks())
            else:
                comm["all_reduce"] += grad_accum_steps * crossings
            comm["all_reduce"] += grad_accum_steps * scalars
            comm["all_gather"] += sum(tp * nbytes(p) for p in groups["muon"] if zero.owns(p))  # Muon's whole matrices
            comm["all_reduce"] += 4  # the gradient norm's sliced part
        if pp > 1:  # each micro-batch's carry forward to the next stage, its gradient back to the one before
            carry_bytes = [act_bytes * sum(map(math.prod, model.carry_shapes(layer, tokens)))
                           for layer, exists in ((model.layers.stop, not last), (model.layers.start, not first))
                           if exists]
            comm["send"] += grad_accum_steps * sum(carry_bytes)
            comm["broadcast"] += 4  # the last stage's loss
            comm["all_reduce"] += 4  # the gradient norm's stage part
        if world_size > 1:
            comm["all_reduce"] += 3 * 4  # loss, gradient norm and stop flag, in one float32 all-reduce
        ranks.append(dict(
            stage=stage, parameters=sum(map(nbytes, owned if args.zero >= 3 else params)),
            gradients=sum(map(nbytes, owned if args.zero >= 2 else params)),
            optimizer_states=sum(2 * nbytes(p) + 4 for p in adam_params if args.zero == 0 or zero.owns(p))
            + sum(math.prod(full_shape(p)) * p.element_size() for p in groups["muon"] if zero.owns(p)),
            gradient_sums=sum(sum_bytes * p.numel() for p in params) if sum_bytes else 0,
            activations=activation_estimate(args, cuda, model.layers, grad_accum_steps, stage), comm=dict(comm)))
    return dict(world_size=world_size, dp=dp, tp=tp, pp=pp, grad_accum_steps=grad_accum_steps, zero=args.zero,
                ranks=ranks, num_params=sum(math.prod(shape) for shape in stages[0].full_shapes.values()))


def activation_estimate(args: Hyperparameters, cuda: bool, layers: range, micro_batches: int, stage: int) -> int:
    """Bytes autograd keeps for a stage's micro-batches in flight: per layer, the inputs of each matmul, norm and
    nonlinearity, split over tp where tensor parallelism splits them (and the residual stream too under --sp).
    Without a pipeline one micro-batch is in flight; under 1f1b stage s keeps up to pp - s, under afab all."""
    tokens, d, hdim = args.train_seq_len, args.model_dim, args.num_heads * args.head_dim
    act_bytes = compute_dtype("cuda" if cuda else "cpu").itemsize
    split, stream_split = args.tp, args.tp if args.sp else 1
    attention = sum(i not in attention_free_layers(args) for i in layers)
    per_token = (len(layers) * (3 * d / stream_split + (2 * 4 * d + 4 * d) / split)  # residual mix, norms; MLP
                 + attention * (2 * d / stream_split + 5 * hdim / split))  # norm, input; q, k, v, output
    has_head = layers.stop == args.num_layers
    logits = has_head * tokens * next_multiple_of_n(args.vocab_size, n=128) // split * 4 * 2  # fp32, log-softmax
    in_flight = micro_batches if args.pp > 1 and args.pp_schedule == "afab" else min(args.pp - stage, micro_batches)
    return int(in_flight * (tokens * per_token * act_bytes + logits))


def format_plan(plan: dict) -> str:
    mib = 2 ** 20
    psi = plan["num_params"]
    memory = ("parameters", "gradients", "optimizer_states", "gradient_sums", "activations")
    lines = [f"plan: {plan['world_size']} processes = pipeline {plan['pp']} x data parallel {plan['dp']} x tensor "
             f"parallel {plan['tp']}, ZeRO stage {plan['zero']}, {plan['grad_accum_steps']} micro-batches per rank "
             f"per step, {psi:,} parameters",
             "rank stage  parameters  gradients  optimizer  grad sums  activations (est.)    total   [MiB]"]
    for rank, r in enumerate(plan["ranks"]):
        values = [r[kind] / mib for kind in memory]
        lines.append(f"{rank:4d} {r['stage']:5d}  {values[0]:10.1f} {values[1]:10.1f} {values[2]:10.1f} "
                     f"{values[3]:10.1f} {values[4]:19.1f} {sum(values):8.1f}")
    lines.append("collectives per training step, bytes handed over per rank:")
    for rank, r in enumerate(plan["ranks"]):
        lines.append(f"{rank:4d}  " + (", ".join(f"{op} {n:,}" for op, n in sorted(r["comm"].items()))
                                       or "none (one process)"))
    n = plan["dp"]  # seed 003's mixed-precision Adam formulas (2-byte params and grads, K = 12), for scale
    formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[plan["zero"]]
    lines.append(f"seed 003's formula for this ZeRO stage (fp16 params, fp32 Adam states, K=12; tensor and "
                 f"pipeline parallelism divide it further): {formula / mib:.1f} MiB per rank of model states")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Checkpoints and stopping: full tensors keyed by parameter name, so a run resumes under any world size

CHECKPOINT_FORMAT = 1
EXIT_STOPPED = 3  # kill switch or signal: a checkpoint was saved; continue with --resume latest
EXIT_DIVERGED = 4  # non-finite training loss or gradient norm


class RunEnded(Exception):
    """The run ended before its last step on purpose; exit_status tells the launcher why."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


def from_master(value):
    """Rank 0's `value`, on every rank: decisions that all ranks must take alike (paths, files, ids)."""
    box = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(box, 0)
    return box[0]


def agree_on_run_id(args: Hyperparameters, ctx: ParallelContext) -> None:
    """--run_id, else torchrun's rendezvous id (the same after an elastic restart), else a fresh uuid."""
    if not args.run_id:
        rendezvous_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id is "none"
        if rendezvous_id == "none" and args.resume == "latest":
            raise UserError("--resume latest needs the run's id: pass --run_id (or launch with torchrun --standalone "
                            "or --rdzv-id, whose id the restarts share)")
        args.run_id = from_master(rendezvous_id if rendezvous_id != "none" else str(uuid.uuid4()))


def checkpoint_dir(args: Hyperparameters) -> Path:
    return Path(args.log_dir) / args.run_id


def checkpoint_path(args: Hyperparameters, step: int) -> Path:
    return checkpoint_dir(args) / f"step{step:06d}.pt"


def find_checkpoint(args: Hyperparameters, ctx: ParallelContext) -> Path | None:
    """The file --resume names; with "latest", this run id's newest checkpoint, or None when there is none yet.

    Rank 0 looks and tells the others, so all ranks resume from the same file (or none). Ranks on other nodes
    need to see the same file system to read it.
    """
    found = None
    if ctx.is_master and args.resume == "latest":
        saved = sorted(checkpoint_dir(args).glob("step*.pt"))
        found = str(saved[-1]) if saved else None
    elif ctx.is_master and args.resume:
        found = args.resume if Path(args.resume).is_file() else ""
    found = from_master(found)
    if found == "":
        raise UserError(f"--resume {args.resume}: no such file; name a checkpoint (<log_dir>/<run_id>/stepNNNNNN.pt) "
                        "or use 'latest'")
    return Path(found) if found else None


def optimizer_state_owners(optimizers: list[torch.optim.Optimizer], zero: Zero | None) -> list[dict]:
    """Per optimizer, the rank holding each parameter's state: Muon's owner; Adam's under ZeRO, else None (all)."""
    adam, muon = optimizers
    adam_owners = {p: zero.owner_of[p] if zero else None for group in adam.param_groups for p in group["params"]}
    return [adam_owners, dict(muon.param_owners())]


OPTIMIZER_STATE_KEYS = {torch.optim.Adam: ("step", "exp_avg", "exp_avg_sq"), Muon: ("momentum_buffer",)}


def full_state_tensor(key: str, value: Tensor, p: Tensor, tp: Axis) -> Tensor:
    """The one-process tensor of an optimizer state: Adam's moments are sliced like their parameter; Muon keeps
    whole matrices and the step count is a scalar."""
    return tp_gather(value, p.tp_dim, p.tp_full, tp) if key.startswith("exp_avg") and is_tensor_parallel(p) \
        else value


def local_state_tensor(key: str, value: Tensor, p: Tensor, tp: Axis) -> Tensor:
    """This rank's part of a one-process optimizer state tensor (inverse of full_state_tensor)."""
    return tp_shard(value, p.tp_dim, tp) if key.startswith("exp_avg") and is_tensor_parallel(p) else value


def optimizer_state_on_stage_master(opt: torch.optim.Optimizer, owners: dict, names: dict,
                                    ctx: ParallelContext) -> dict[str, dict[str, Tensor]]:
    """{parameter name: its full state} on the stage master (data- and tensor-parallel rank 0 of this pipeline
    stage; empty elsewhere). The owner's tensor-parallel group gathers the slices; its first rank sends them to
    the stage master, one tensor at a time."""
    keys = OPTIMIZER_STATE_KEYS[type(opt)]
    master = ctx.grid_rank(0, 0)
    gathered = {}
    for p, owner in owners.items():
        holder = owner or 0  # the data-parallel rank whose tensor-parallel group holds this state
        sender = ctx.grid_rank(holder, 0)
        state = {k: full_state_tensor(k, opt.state[p][k], p, ctx.tp) for k in keys} if ctx.dp.rank == holder \
            else None
        if ctx.rank == master == sender:
            gathered[names[p]] = state
        elif ctx.rank == master:
            gathered[names[p]] = {key: torch.empty((), dtype=torch.float32, device=p.device) if key == "step"
                                  else torch.empty(full_shape(p), dtype=p.dtype, device=p.device) for key in keys}
            for tensor in gathered[names[p]].values():
                dist.recv(tensor, sender)
        elif ctx.rank == sender:
            for key in keys:
                dist.send(state[key].contiguous(), master)
    return gathered


def stage_model_state(model: nn.Module, ctx: ParallelContext) -> dict[str, Tensor] | None:
    """This stage's parameters as in a one-process model, on the stage master (None elsewhere), gathered over
    tensor parallelism."""
    if ctx.dp.rank != 0:
        return None
    state = {name: tp_gather(p.detach(), p.tp_dim, p.tp_full, ctx.tp) if is_tensor_parallel(p) else p.detach()
             for name, p in model.named_parameters()}
    return state if ctx.tp.rank == 0 else None


def collect_stages(part: dict | None, ctx: ParallelContext) -> dict | None:
    """Rank 0's merge of every stage master's `part` (a dict of dicts of tensors); None on other ranks.

    The stage masters are rank 0's pipeline group; each sends its part at once, as CPU tensors."""
    if ctx.pp.size == 1 or ctx.dp.rank != 0 or ctx.tp.rank != 0:
        return part if ctx.is_master else None
    parts = [None] * ctx.pp.size if ctx.is_master else None
    cpu_part = {kind: {name: value.cpu() if isinstance(value, Tensor) else {k: v.cpu() for k, v in value.items()}
                       for name, value in entries.items()} for kind, entries in part.items()}
    dist.gather_object(cpu_part, parts, dst=ctx.pp.global_rank(0), group=ctx.pp.group)
    if not ctx.is_master:
        return None
    return {kind: {name: value for stage_part in parts for name, value in stage_part[kind].items()} for kind in part}


def save_checkpoint(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], ctx: ParallelContext,
                    zero: Zero | None = None, **run_state) -> None:
    """Rank 0 writes full tensors keyed by name; ranks owning optimizer state (Muon's, Adam's under ZeRO) send it
    to their stage's master, and the other stage masters send their stage to rank 0.

    Written to a temporary name, then renamed: a crash mid-write leaves the previous checkpoint intact.
    Tensors rank 0 holds are saved from where they live, so it holds at most one extra copy of the others' state.
    """
    names = {p: name for name, p in model.named_parameters()}
    adam_state, muon_state = (optimizer_state_on_stage_master(opt, owners, names, ctx)
                              for opt, owners in zip(optimizers, optimizer_state_owners(optimizers, zero)))
    state = collect_stages(dict(model=stage_model_state(model, ctx), adam=adam_state,
                                muon={name: s["momentum_buffer"] for name, s in muon_state.items()}), ctx)
    if ctx.is_master:
        state.update(format=CHECKPOINT_FORMAT,
                     rng=dict(cpu=torch.get_rng_state(),
                              cuda=torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None),
                     code=Path(__file__).read_text(), **run_state)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename survives a power cut too
        finally:
            os.close(directory)
    if dist.is_initialized():
        dist.barrier()  # no rank goes on, or exits, before the file is complete


def load_checkpoint(path: Path) -> dict:
    try:  # weights_only: tensors and plain containers only, no code runs; mmap: no copy in memory until used
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}: {' '.join(str(e).split())[:300]}): "
                        "the file is damaged or not a checkpoint; resume from an earlier one") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{path} is not a checkpoint of this trainer (format {CHECKPOINT_FORMAT})")
    return state


def restore_checkpoint(state: dict, path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                       ctx: ParallelContext, zero: Zero | None = None) -> None:
    """Load weights, the optimizer state this rank holds, and the RNG; refuse another model's shapes."""
    def shape(t):
        return "absent" if t is None else f"of shape {tuple(t if isinstance(t, tuple) else t.shape)}"
    current = model.full_shapes  # every pipeline stage's, so a checkpoint of another model is caught on each
    for name in [*current, *(n for n in state["model"] if n not in current)]:
        here, there = current.get(name), state["model"].get(name)
        if here is None or there is None or here != there.shape:
            raise UserError(f"checkpoint {path} does not fit this model: tensor {name} is {shape(there)} there and "
                            f"{shape(here)} here; resume with the model flags it was saved with (its "
                            "'hyperparameters' entry lists them)")
    model.load_state_dict(shard_state_dict(state["model"], model))
    adam, muon = optimizers
    adam_owners, muon_owners = optimizer_state_owners(optimizers, zero)
    names = {p: name for name, p in model.named_parameters()}
    for p, owner in adam_owners.items():  # moments in the parameter's dtype (bf16 embeddings on CUDA, fp32 on CPU)
        if owner in (None, ctx.dp.rank):
            adam.state[p] = {}
            for key, value in state["adam"][names[p]].items():
                value = local_state_tensor(key, value, p, ctx.tp)
                adam.state[p][key] = value.to(p.device, copy=True) if key == "step" else \
                    value.to(p.device, p.dtype, copy=True)
    for p, owner in muon_owners.items():
        if owner == ctx.dp.rank:
            muon.state[p]["momentum_buffer"] = state["muon"][names[p]].to(p.device, p.dtype, copy=True)
    torch.set_rng_state(state["rng"]["cpu"])
    if ctx.device.type == "cuda" and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], ctx.device)


class StopRequests:
    """Whether to stop after this step: the kill-switch file appeared, or SIGTERM or SIGINT arrived."""

    def __init__(self, kill_switch: Path):
        self.kill_switch = kill_switch
        self.reason: str | None = None
        self.previous_handlers = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info):
        for sig, handler in self.previous_handlers.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        self.reason = signal.Signals(signum).name
        signal.signal(signum, self.previous_handlers[signum])  # a second one acts at once

    def check(self) -> str | None:
        if self.reason is None and self.kill_switch.exists():
            self.reason = f"kill switch {self.kill_switch}"
        return self.reason


# ----------------------------------------------------------------------------------------------------
# Logging: the log file starts with this file's source, so a run is reproducible from its log alone

def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return f"GPU: {torch.cuda.get_device_name(device)} (nvidia-smi unavailable)"
    model_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model_name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU: {model_name} ({os.cpu_count()} cores)"


def peak_memory_line(device: torch.device) -> str:
    if device.type == "cuda":
        return (f"peak memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
                f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    import resource
    return f"peak memory rss: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB"


class RunLog:
    """Writes the log file on the master rank; other ranks' calls do nothing."""

    def __init__(self, args: Hyperparameters, ctx: ParallelContext):
        self.path = Path(args.log_dir) / f"{args.run_id}.txt" if ctx.is_master else None

    def __call__(self, line: str, console: bool = False) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            print(line, file=f)
        if console:
            print(line, flush=True)

    def num_bytes(self) -> int:
        return self.path.stat().st_size if self.path is not None else 0

    def continue_from(self, num_bytes: int) -> bool:
        """Cut this run's log back to where a checkpoint was saved, so the resumed run's lines follow on."""
        if self.path is None or not self.path.is_file() or self.path.stat().st_size < num_bytes:
            return False
        os.truncate(self.path, num_bytes)
        return True

    def start(self, args: Hyperparameters, ctx: ParallelContext, grad_accum_steps: int) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(Path(__file__).read_text().rstrip("\n") + "\n")  # the source, byte for byte
        self("=" * 100)
        self(f"Running Python {sys.version}")
        self(f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}")
        self(device_description(ctx.device))
        self("=" * 100)
        self("hyperparameters: " + json.dumps(dataclasses.asdict(args)))
        self(f"run: id={args.run_id} device={ctx.device.type} world_size={ctx.world_size} dp={ctx.dp.size} "
             f"tp={ctx.tp.size} pp={ctx.pp.size} zero={args.zero} grad_accum_steps={grad_accum_steps}", console=True)


# ----------------------------------------------------------------------------------------------------
# Training loop

def device_synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CPU ops are synchronous: nothing to wait for


def all_reduce_mean(value: Tensor) -> Tensor:
    if dist.is_initialized():
        count_comm("all_reduce", value)
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value


@functools.lru_cache(maxsize=8)
def window_tensor(blocks: int, device: torch.device) -> Tensor:
    # a tensor, not an int, so torch.compile(dynamic=False) does not recompile as the window grows
    return torch.tensor(blocks, dtype=torch.int32, device=device)


def accumulate_gradients(model: nn.Module, buckets: "GradientBuckets | None", batches, window: Tensor,
                         grad_accum_steps: int, stage: PipelineStage | None = None) -> Tensor:
    """Forward and backward over this rank's share of the global batch; returns its summed loss (zero on pipeline
    stages but the last).

    Afterwards every rank holds the gradient of the mean over the global batch's sequences of each
    sequence's summed token loss, whatever the world size. The micro-batches run in the stage's schedule:
    with one stage both schedules are forward, backward, forward, backward, ...
    """
    stage = stage or PipelineStage(model)
    micro_batches = [next(batches) for _ in range(grad_accum_steps)]
    seq_len = micro_batches[0][0].numel()
    loss_sum = torch.zeros((), device=window.device)
    in_flight = collections.deque()  # (carry in, output) of micro-batches forwarded and not yet backwarded
    backwards_done = 0

    def forward(carry: list[Tensor] | None) -> list[Tensor] | None:
        nonlocal loss_sum
        out = stage.forward(model, *micro_batches[len(in_flight) + backwards_done], window, carry)
        in_flight.append((carry, out))
        if stage.last:
            loss_sum += out.detach()
        return None if stage.last else out

    def backward(grad: list[Tensor] | None) -> list[Tensor] | None:
        """Backward of the oldest micro-batch in flight, given the gradient of its output; returns its carry's."""
        nonlocal backwards_done
        carry, out = in_flight.popleft()
        last = backwards_done == grad_accum_steps - 1
        if buckets is not None:
            buckets.sync = last  # reduce once, during the last backward
        if stage.last:
            (out / grad_accum_steps).backward()
        else:
            torch.autograd.backward(out, grad)
        if buckets is not None and not last:
            buckets.set_aside_micro_batch()
        backwards_done += 1
        return None if carry is None else [t.grad if t.grad is not None else torch.zeros_like(t) for t in carry]

    def exchange(**kwargs):
        return stage.exchange(seq_len, **kwargs)

    # 1f1b: stage s runs stages - 1 - s forwards ahead, then alternates one forward and one backward, so it keeps
    # at most stages - s micro-batches' activations; afab runs every forward first and keeps them all
    warmup = grad_accum_steps if stage.schedule == "afab" else min(stage.pp.size - 1 - stage.pp.rank,
                                                                       grad_accum_steps)
    steady = grad_accum_steps - warmup
    for _ in range(warmup):
        exchange(to_next=forward(exchange(from_prev=True)[0]))
    carry = exchange(from_prev=True)[0] if steady else None
    for i in range(steady):
        grad = exchange(to_next=forward(carry), from_next=True)[1]
        carry_grad = backward(grad)
        if i < steady - 1:
            carry = exchange(to_prev=carry_grad, from_prev=True)[0]
        else:
            exchange(to_prev=carry_grad)
    for _ in range(warmup):
        exchange(to_prev=backward(exchange(from_next=True)[1]))
    if buckets is not None:
        buckets.wait_for_gradients()
    return loss_sum


def optimizer_step(model: nn.Module, optimizers: list[torch.optim.Optimizer], step: int, args: Hyperparameters,
                   zero: Zero | None = None) -> None:
    set_schedules(optimizers, step, args)
    adam = optimizers[0]
    adam_params = [p for group in adam.param_groups for p in group["params"]]
    if zero is not None and zero.stage >= 1:
        for p in adam_params:
            if not zero.owns(p):
                p.grad = None  # Adam skips a parameter without a gradient: no moments for it here
    for opt in optimizers:
        opt.step()
    if zero is not None and zero.stage in (1, 2) and zero.dp.size > 1:  # (stage 3 gathers before each use)
        for handle in [zero.broadcast_from_owner(p) for p in adam_params]:
            handle.wait()
    model.zero_grad(set_to_none=True)


def gradient_norm(params, zero: Zero | None, ctx: ParallelContext) -> Tensor:
    """Global gradient norm: tensor-parallel slices summed over tp; under ZeRO 2 and 3 the ranks' disjoint shares
    of the gradients summed over dp; the pipeline stages' parameters summed over pp."""
    params = [p for p in params if p.grad is not None]
    squared = []
    for sliced in (True, False):
        grads = [p.grad for p in params if is_tensor_parallel(p) == sliced]
        squared.append(torch.nn.utils.get_total_norm(grads).square() if grads else
                       torch.zeros((), device=ctx.device))
    if ctx.tp.size > 1:
        count_comm("all_reduce", squared[0])
        dist.all_reduce(squared[0], group=ctx.tp.group)
    total = squared[0] + squared[1]
    if zero is not None and zero.stage >= 2 and ctx.dp.size > 1:
        count_comm("all_reduce", total)
        dist.all_reduce(total, group=ctx.dp.group)
    if ctx.pp.size > 1:
        count_comm("all_reduce", total)
        dist.all_reduce(total, group=ctx.pp.group)
    return total.sqrt()


def evaluate(model: nn.Module, args: Hyperparameters, ctx: ParallelContext, step: int,
             stage: PipelineStage | None = None) -> float:
    """Mean val loss over val_tokens, the same for every world size (each rank averages equal shares); under
    pipeline parallelism computed on the last stage, which shares it with the others."""
    stage = stage or PipelineStage(model)
    val_seqs = args.val_tokens // args.val_seq_len
    loader = DistributedDataLoader(args.val_files, args.val_seq_len, val_seqs, ctx.dp.rank, ctx.dp.size,
                                   ctx.device, flag="val_files")
    window = window_tensor(window_size_blocks(step, args), ctx.device)
    model.eval()
    total = torch.zeros((), device=ctx.device, dtype=torch.float32)
    with torch.no_grad():
        for _ in range(val_seqs // ctx.dp.size):
            inputs, targets = next(loader)
            out = stage.forward(model, inputs, targets, window, stage.exchange(args.val_seq_len, from_prev=True)[0])
            if stage.last:
                total += out.float()
            else:
                stage.exchange(args.val_seq_len, to_next=out)
    model.train()
    total = from_last_stage(total / (val_seqs // ctx.dp.size), ctx.pp)
    return all_reduce_mean(total).item()  # (tp ranks agree: their mean is the same)


def from_last_stage(value: Tensor, pp: Axis) -> Tensor:
    """The last pipeline stage's value (a loss) on every stage."""
    if pp.size > 1:
        count_comm("broadcast", value)
        dist.broadcast(value, pp.global_rank(pp.size - 1), group=pp.group)
    return value


def reduce_step_stats(loss: Tensor, grad_norm: Tensor, stop: bool, device: torch.device) -> tuple[float, float, bool]:
    """Mean train loss, gradient norm and whether any rank must stop, in one all-reduce and one host sync."""
    stats = torch.stack([loss.float(), grad_norm.float(), torch.full((), float(stop), device=device)])
    loss_value, grad_norm_value, stop_value = all_reduce_mean(stats).tolist()
    return loss_value, grad_norm_value, stop_value > 0


def main(argv=None) -> float | None:
    """Train and return the final validation loss; with --plan, print the plan instead."""
    args = parse_args(argv)
    check_world_size(args, args.nproc if args.plan and args.nproc else int(os.environ.get("WORLD_SIZE", 1)))
    if args.plan:
        print(format_plan(plan_layout(args, args.nproc or int(os.environ.get("WORLD_SIZE", 1)),
                                      cuda=args.plan_device == "cuda")))
        return None
    ctx = setup_distributed(args.tp, args.pp)
    try:
        return train(args, ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: Hyperparameters, ctx: ParallelContext) -> float:
    grad_accum_steps = check_world_size(args, ctx.world_size)
    for pattern, flag in ((args.train_files, "train_files"), (args.val_files, "val_files")):
        for path in list_shards(pattern, flag):  # refuse bad data before building anything
            read_shard_header(path)
    agree_on_run_id(args, ctx)
    if args.compile is None:  # (tensor parallelism's collectives inside autograd functions, and a stage's
        # carry, are not yet proven under compile on GPUs)
        args.compile = ctx.device.type == "cuda" and args.zero < 3 and args.tp == 1 and args.pp == 1
    stop_requests = StopRequests(Path(args.kill_switch or Path(args.log_dir) / f"{args.run_id}.stop"))
    if from_master(stop_requests.kill_switch.exists()):
        raise UserError(f"the kill switch {stop_requests.kill_switch} exists: delete it to start or resume the run")
    resume_path = find_checkpoint(args, ctx)
    checkpoint = load_checkpoint(resume_path) if resume_path else None

    torch.manual_seed(args.seed)
    raw_model = build_model(args, ctx.device, ctx.tp, ctx.pp)
    broadcast_parameters(raw_model, ctx.dp)
    optimizers = build_optimizers(raw_model, args, ctx)
    zero = Zero.build(args.zero, optimizer_param_groups(raw_model), ctx.dp) if args.zero else None
    sum_dtype = torch.float64 if args.fp64_grad_sum else None
    buckets = None
    if ctx.world_size > 1 or sum_dtype:
        buckets = GradientBuckets(raw_model.parameters(), sum_dtype=sum_dtype, dp=ctx.dp,
                                  owner_of=zero.gradient_owners() if zero else None)
    model = torch.compile(raw_model, dynamic=False) if args.compile else raw_model
    stage = PipelineStage(raw_model, ctx.pp, args.pp_schedule, compute_dtype(ctx.device.type))

    def train_step(batches, step: int) -> tuple[Tensor, Tensor]:
        window = window_tensor(window_size_blocks(step, args), ctx.device)
        loss_sum = from_last_stage(accumulate_gradients(model, buckets, batches, window, grad_accum_steps, stage),
                                   ctx.pp)
        grad_norm = gradient_norm(raw_model.parameters(), zero, ctx)
        optimizer_step(model, optimizers, step, args, zero)
        return loss_sum, grad_norm

    if args.compile and args.warmup_steps > 0:
        def random_batches():
            while True:
                tokens = torch.randint(0, args.vocab_size, (args.train_seq_len + 1,), device=ctx.device)
                yield tokens[:-1].to(torch.int32), tokens[1:]
        random_stream = random_batches()
        warmup_and_restore(raw_model, optimizers, lambda: train_step(random_stream, 0), args.warmup_steps)

    start_step, training_time_ms, data_position = 0, 0.0, None
    if checkpoint is not None:
        restore_checkpoint(checkpoint, resume_path, raw_model, optimizers, ctx, zero)
    shards = ShardedParameters(raw_model, zero) if args.zero >= 3 and ctx.dp.size > 1 else None
    log = RunLog(args, ctx)  # opened only now, so a refused checkpoint leaves the previous log as it was
    if checkpoint is None or checkpoint["run_id"] != args.run_id or not log.continue_from(checkpoint["log_bytes"]):
        log.start(args, ctx, grad_accum_steps)
    if log.path is not None:
        print(f"logging to {log.path}", flush=True)
    if checkpoint is not None:
        start_step, training_time_ms, data_position = checkpoint["step"], checkpoint["training_time_ms"], \
            checkpoint["data"]
        log(f"resumed: step:{start_step}/{args.num_iterations} from {resume_path}", console=True)
        bookkeeping = ("run_id", "resume", "save_every", "kill_switch")
        changed = [f"{k}={v}" for k, v in dataclasses.asdict(args).items()
                   if k not in bookkeeping and checkpoint["hyperparameters"].get(k) != v]
        if changed:
            log(f"resumed with changed hyperparameters: {' '.join(changed)}", console=True)
        del checkpoint  # unmaps the file
    elif args.resume:
        log(f"no checkpoint of run {args.run_id} yet: starting from step 0", console=True)

    train_loader = DistributedDataLoader(args.train_files, args.train_seq_len, args.seqs_per_step, ctx.dp.rank,
                                         ctx.dp.size, ctx.device, position=data_position)
    tokens_per_rank_step = grad_accum_steps * args.train_seq_len
    last_checkpoint = resume_path
    val_loss = float("nan")
    last_comm_bytes = collections.Counter()
    with stop_requests:
        device_synchronize(ctx.device)
        t0 = time.perf_counter()
        for step in range(start_step, args.num_iterations + 1):
            last_step = step == args.num_iterations
            if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):
                device_synchronize(ctx.device)
                training_time_ms += 1000 * (time.perf_counter() - t0)  # validation is not timed
                val_loss = evaluate(model, args, ctx, step, stage)
                log(f"step:{step}/{args.num_iterations} val_loss:{val_loss:.4f} train_time:{training_time_ms:.0f}ms "
                    f"step_avg:{training_time_ms / max(step, 1):.2f}ms", console=True)
                device_synchronize(ctx.device)
                t0 = time.perf_counter()
            if last_step:
                break
            comm_bytes.clear()
            loss_sum, grad_norm = train_step(train_loader, step)
            train_loss, grad_norm, stop = reduce_step_stats(loss_sum / tokens_per_rank_step, grad_norm,
                                                            stop_requests.check() is not None, ctx.device)
            done = step + 1
            if comm_bytes != last_comm_bytes:  # the same every step: logged when it first appears or changes
                last_comm_bytes = collections.Counter(comm_bytes)
                log(f"comm: step:{done} bytes per rank "
                    + " ".join(f"{op}:{n}" for op, n in sorted(comm_bytes.items())))
            elapsed_ms = training_time_ms + 1000 * (time.perf_counter() - t0)
            log(f"step:{done}/{args.num_iterations} train_loss:{train_loss:.4f} train_time:{elapsed_ms:.0f}ms "
                f"step_avg:{elapsed_ms / done:.2f}ms", console=True)
            if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
                message = (f"training diverged at step {done}: train loss {train_loss}, gradient norm {grad_norm}; "
                           + (f"the last good checkpoint is {last_checkpoint}" if last_checkpoint
                              else "there is no checkpoint to go back to (see --save_every)"))
                log(f"diverged: {message}", console=True)
                raise RunEnded(message, EXIT_DIVERGED)
            if stop or (args.save_every > 0 and (done % args.save_every == 0 or done == args.num_iterations)):
                training_time_ms = elapsed_ms  # checkpoints are not timed
                last_checkpoint = checkpoint_path(args, done)
                if shards is not None:
                    shards.gather_all()
                save_checkpoint(last_checkpoint, raw_model, optimizers, ctx, zero, step=done, run_id=args.run_id,
                                data=train_loader.position(), training_time_ms=training_time_ms,
                                log_bytes=log.num_bytes(), hyperparameters=dataclasses.asdict(args))
                if shards is not None:
                    shards.drop_all()
                log(f"checkpoint: {last_checkpoint}", console=True)
                if stop:
                    reason = stop_requests.reason or "another rank was asked to stop"
                    log(f"stopped: step:{done}/{args.num_iterations} reason:{reason}", console=True)
                    raise RunEnded(f"stopped after step {done} ({reason}); to continue, remove the kill switch if "
                                   f"it is there and run again with --run_id {args.run_id} --resume latest",
                                   EXIT_STOPPED)
                device_synchronize(ctx.device)
                t0 = time.perf_counter()
    log(peak_memory_line(ctx.device), console=True)
    return val_loss


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunEnded as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_status)
