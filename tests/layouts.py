"""The layout tests' harness: a few training steps under any layout (train_gpt.train_steps, the same runs and
comparison as `train_gpt.py --check_layout`), and the model edits a forker makes, applied by subclassing the
model's classes."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import train_gpt
from synthetic import tiny_flags
from train_gpt import CastedLinear, norm


def shift(x: torch.Tensor) -> torch.Tensor:
    """Each position gets the previous position's vector (the first gets zeros): a token shift."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


# Issue's natural edits: a gate on the attention output, a 4th value embedding, a new linear layer in the MLP, a
# learnable per-layer vector, and a bigram-hash embedding added to x0 (the field's record #62)

class BlockWithAttentionGate(train_gpt.Block):
    def __init__(self, *args):
        super().__init__(*args)
        self.attn_gate = nn.Parameter(torch.tensor(0.7)) if self.attn is not None else None

    def forward(self, x, skip, ve, x0, mask):
        if skip is not None:
            x = x + self.skip_weight * skip
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn_gate * self.attn(norm(x), ve, mask)
        return x + self.mlp(norm(x))


class GatedMLP(train_gpt.MLP):
    def __init__(self, dim):
        super().__init__(dim)
        self.c_gate = CastedLinear(dim, 4 * dim)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square() * torch.sigmoid(self.c_gate(x)))


class GPTWithNaturalEdits(train_gpt.GPT):
    NUM_VALUE_EMBEDS = 4

    def __init__(self, vocab_size, num_layers, num_heads, head_dim, model_dim, *args, **kwargs):
        super().__init__(vocab_size, num_layers, num_heads, head_dim, model_dim, *args, **kwargs)
        self.layer_gains = nn.Parameter(torch.linspace(0.8, 1.2, num_layers))
        self.bigram = nn.Embedding(2**16, model_dim)

    def embed_tokens(self, input_seq):
        stream = super().embed_tokens(input_seq)
        previous = torch.cat([input_seq.new_zeros(1), input_seq[:-1]])
        x = norm(stream["x"] + 0.1 * self.bigram((input_seq * 31 + previous) % 2**16)[None])
        return dict(stream, x=x, x0=x)

    def run_block(self, i, stream, masks):
        return super().run_block(i, dict(stream, x=stream["x"] * self.layer_gains[i]), masks)


# The field's record history: a token shift ("smear") of the embedding, a second head for multi-token prediction,
# tied input and output embeddings, a learnable soft cap, a per-head temperature, a GPT parameter read only in the
# head, and a block's scalar read by the GPT after the block ran

class HeadWithLearnedCap(train_gpt.LMHead):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cap = nn.Parameter(torch.tensor(30.0))

    def summed_loss(self, x, targets):
        logits = CastedLinear.forward(self, x).float() / (7.5 * x.size(-1) ** 0.5 * self.temperature)
        return self.cross_entropy(self.cap * torch.sigmoid(logits), targets)


class AttentionWithHeadTemperature(train_gpt.CausalSelfAttention):
    def __init__(self, dim, num_heads, head_dim, max_seq_len):
        super().__init__(dim, num_heads, head_dim, max_seq_len)
        self.head_temperature = nn.Parameter(torch.linspace(0.8, 1.2, num_heads))

    def forward(self, x, ve, mask):
        qkv = self.qkv(x)
        B, T = qkv.size(0), qkv.size(1)
        q, k, v = qkv.view(B, T, 3, -1, self.head_dim).unbind(2)
        q, k = self.rotary(norm(q)) * self.head_temperature[:, None], self.rotary(norm(k))
        v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v) if ve is not None else self.lambdas[0] * v
        y = train_gpt.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class GPTWithRecordEdits(train_gpt.GPT):
    def __init__(self, vocab_size, num_layers, num_heads, head_dim, model_dim, *args, **kwargs):
        super().__init__(vocab_size, num_layers, num_heads, head_dim, model_dim, *args, **kwargs)
        self.smear_gate = CastedLinear(12, 1)
        padded = self.lm_head.weight.size(0)
        self.embed = nn.Embedding(padded, model_dim)  # tied: one table of the head's (padded) size
        self.lm_head.weight = self.embed.weight
        self.next_head = train_gpt.LMHead(model_dim, padded)
        self.next_head.weight.detach().zero_()  # a head starts at zero, as the GPT's own does
        self.head_temperature = nn.Parameter(torch.tensor(1.0))
        for head in (self.lm_head, self.next_head):
            head.temperature = self.head_temperature

    def embed_tokens(self, input_seq):
        stream = super().embed_tokens(input_seq)
        x = stream["x"] + torch.sigmoid(self.smear_gate(stream["x"][..., :12])) * shift(stream["x"])
        return dict(stream, x=x, x0=x)

    def run_block(self, i, stream, masks):
        stream = super().run_block(i, stream, masks)
        return dict(stream, x=stream["x"] + 0.1 * self.blocks[i].lambdas[1] * stream["x0"])

    def head_loss(self, stream, target_seq):
        loss = super().head_loss(stream, target_seq)
        if self.training:  # the second head predicts the token after next
            loss = loss + self.next_head(norm(stream["x"])[0, :-1], target_seq[1:])
        return loss


# A token shift inside a block: where sequence parallelism cuts the stream, so it must refuse it
class BlockWithTokenShift(train_gpt.Block):
    def __init__(self, *args):
        super().__init__(*args)
        self.shift_gain = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, skip, ve, x0, mask):
        return super().forward(x + self.shift_gain * shift(x), skip, ve, x0, mask)


class AttentionWithUnplacedMatrix(train_gpt.CausalSelfAttention):
    """A weight matrix inside attention, on its heads' output, that neither reads the region's input nor writes its
    output: no tensor-parallel rule places it."""

    def __init__(self, dim, *args):
        super().__init__(dim, *args)
        self.mix = CastedLinear(dim, dim)

    def forward(self, x, ve, mask):
        qkv = self.qkv(x)
        B, T = qkv.size(0), qkv.size(1)
        q, k, v = qkv.view(B, T, 3, -1, self.head_dim).unbind(2)
        q, k = self.rotary(norm(q)), self.rotary(norm(k))
        v = self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v) if ve is not None else self.lambdas[0] * v
        y = train_gpt.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.c_proj(self.mix(y.transpose(1, 2).contiguous().view(B, T, -1)))


class GPTWithAllEdits(GPTWithRecordEdits, GPTWithNaturalEdits):
    """Both sets of edits in one model (each class's embed_tokens and run_block call the next one's)."""


# edit name -> the train_gpt classes it replaces by subclasses
MODEL_EDITS = {
    "forks": dict(GPT=GPTWithAllEdits, Block=BlockWithAttentionGate, MLP=GatedMLP, LMHead=HeadWithLearnedCap,
                  CausalSelfAttention=AttentionWithHeadTemperature),
    "token_shift_in_a_block": dict(Block=BlockWithTokenShift),
    "unplaced_matrix_in_attention": dict(CausalSelfAttention=AttentionWithUnplacedMatrix),
}


@contextlib.contextmanager
def model_edit(name):
    """train_gpt's model classes replaced by the named edit's subclasses (the model is built from these names, as in
    a fork that edited the file); put back afterwards."""
    replaced = MODEL_EDITS[name] if name else {}
    saved = {attr: getattr(train_gpt, attr) for attr in replaced}
    for attr, cls in replaced.items():
        setattr(train_gpt, attr, cls)
    try:
        yield
    finally:
        for attr, cls in saved.items():
            setattr(train_gpt, attr, cls)


def edited_train_steps(rank, world_size, edit, flags, steps):
    """train_gpt.train_steps on the model as edited."""
    with model_edit(edit):
        return train_gpt.train_steps(rank, world_size, flags, steps)


def assert_trains_like_one_process(ranks, single, layout, exact=False):
    """Every rank's losses, and every parameter and optimizer state after the last step (gathered on rank 0), equal
    the one-process run's: the state bit-identical when exact, else as --check_layout compares it; the losses, which
    each rank's share sums in float32 in another order, to 1e-6. Adam's moments and Muon's momentum carry every
    step's gradients, and each compared one is asserted non-zero."""
    reference = train_gpt.flat_state(single["state"])
    for name, value in reference.items():
        assert name.endswith("/step") or torch.as_tensor(value).norm() > 0, f"{name} is zero: the comparison is empty"
    worst, tensor = train_gpt.worst_difference(ranks[0]["state"], single["state"])
    assert worst <= (0 if exact else train_gpt.layout_tolerance(layout)), (tensor, worst)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=0)


def assert_holds_and_sends_what_the_plan_predicts(ranks, files, **layout):
    """Each rank's bytes in its first step (parameters, their peak, gradients, float64 sums, optimizer states,
    every collective) equal --plan's, which runs the same code on the meta device."""
    args = train_gpt.parse_args(tiny_flags(files, **layout), cuda=False)
    plan = train_gpt.plan_layout(args, len(ranks), cuda=False)
    for rank, predicted in zip(ranks, plan["ranks"]):
        held = rank["first_step"]
        for kind in ("parameters", "peak_parameters", "gradients", "gradient_sums", "optimizer_states", "comm"):
            assert held[kind] == predicted[kind], kind



def train_step(trainer, batches, step):
    """One step as train_gpt.train() takes it: its summed loss and squared gradient norm."""
    loss_sum = train_gpt.forward_backward(trainer, batches, step)
    grad_squares = trainer.gradient_squares()
    train_gpt.optimizer_step(trainer, step)
    return loss_sum, grad_squares
