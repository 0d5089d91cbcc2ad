"""The layout tests' harness: a few training steps under any layout (train_gpt.train_steps, the same runs and
comparison as `train_gpt.py --check_layout`), and the model edits a forker makes, applied by subclassing the
model's classes."""
import contextlib

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

    def attend(self, *args, **for_attention):
        return self.attn_gate * super().attend(*args, **for_attention)


class GatedMLP(train_gpt.MLP):
    def __init__(self, dim):
        super().__init__(dim)
        self.c_gate = CastedLinear(dim, 4 * dim)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square() * torch.sigmoid(self.c_gate(x)))


class GPTWithNaturalEdits(train_gpt.GPT):
    def __init__(self, vocab_size, num_layers, num_heads, head_dim, model_dim, *args, **kwargs):
        kwargs["value_embed_layers"] = (*kwargs.get("value_embed_layers", ()), 0)  # a 4th, for layer 0
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
    """A learnable soft cap, and (a later kind) a bias per vocabulary entry."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cap = nn.Parameter(torch.tensor(23.0))
        self.logit_bias = nn.Parameter(torch.zeros(self.weight.size(0)))

    def logits(self, x):
        logits = CastedLinear.forward(self, x).float() + self.logit_bias
        return self.cap * torch.sigmoid((logits + 5) / (7.5 * self.temperature))


class AttentionWithHeadTemperature(train_gpt.CausalSelfAttention):
    def __init__(self, dim, num_heads, head_dim, *args):
        super().__init__(dim, num_heads, head_dim, *args)
        self.head_temperature = nn.Parameter(torch.linspace(0.8, 1.2, num_heads))

    def forward(self, x, ve, mask, xsa=None, output_gate=None, *composition):  # (a fork ignoring XSA and gates)
        q, k, v = self.project(x)
        B, T = q.size(0), q.size(1)
        q, k = self.rotary(norm(q), norm(k), self.head_offsets)
        q = q * self.head_temperature[:, None]
        v = self.values(v, ve)
        y = self.compose(self.attend(q, k, v, mask), q, k, v, *composition)
        return self.c_proj(y.contiguous().view(B, T, -1))


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
        if self.blocks[i].mlp_scales is None:  # (a dense layer's scales are per token)
            return stream
        return dict(stream, x=stream["x"] + 0.1 * self.blocks[i].mlp_scales.output * stream["x0"])

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

    def forward(self, x, *args, **kwargs):
        return super().forward(x + self.shift_gain * shift(x), *args, **kwargs)


class AttentionWithUnplacedMatrix(train_gpt.CausalSelfAttention):
    """A weight matrix inside attention, on its heads' output, that neither reads the region's input nor writes its
    output: no tensor-parallel rule places it."""

    def __init__(self, dim, *args):
        super().__init__(dim, *args)
        self.mix = CastedLinear(dim, dim)

    def forward(self, x, ve, mask, xsa=None, output_gate=None, *composition):
        q, k, v = self.project(x)
        B, T = q.size(0), q.size(1)
        q, k = self.rotary(norm(q), norm(k), self.head_offsets)
        v = self.values(v, ve)
        y = self.compose(self.attend(q, k, v, mask), q, k, v, *composition)
        return self.c_proj(self.mix(y.contiguous().view(B, T, -1)))


# The kinds of edit the field's later records make, for the layouts' rules to carry: code in GPT.forward itself (a
# scale on the stream before the head; the rotaries stretched as the window grows, as dynamic YaRN does), a GPT's
# per-layer vector whose entries attention uses, a block returning a second stream, a bias per vocabulary entry

def stretch_rotary(rotary: train_gpt.Rotary, factor: float) -> None:
    """The rotary's frequencies divided by factor: positions stretched, as dynamic YaRN does when the window grows."""
    half = rotary.angular_freq.numel()
    frequencies = (1 / 1024) ** torch.linspace(0, 1, steps=half // 2)
    rotary.angular_freq.copy_(torch.cat([frequencies, frequencies.new_zeros(half // 2)]) / factor)


class AttentionWithInputScale(AttentionWithHeadTemperature):
    def forward(self, x, ve, mask, *gates, scale=1.0):
        return super().forward(x * scale, ve, mask, *gates)


class BlockWithSecondStream(BlockWithAttentionGate):
    """Returns its update beside the residual: a second stream, which the GPT sums over the layers."""

    def forward(self, x, *args, **kwargs):
        out = super().forward(x, *args, **kwargs)
        return out, out - x


class GPTStretchingRotary(train_gpt.GPT):
    """Step-dependent code in GPT.forward itself: the rotaries stretched whenever the window changes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rotary_window = train_gpt.ATTENTION_BLOCK_SIZE  # the long window, in tokens, they are stretched for

    def stretch_rotaries(self, windows):
        long = int(windows[1])  # (short, long) tokens
        if long != self.rotary_window:
            for module in self.modules():
                if isinstance(module, train_gpt.Rotary):
                    stretch_rotary(module, long / train_gpt.ATTENTION_BLOCK_SIZE)
            self.rotary_window = long

    def forward(self, input_seq, target_seq, window, stream=None, layers=None):
        self.stretch_rotaries(window)
        return super().forward(input_seq, target_seq, window, stream, layers)


class GPTWithLaterKinds(GPTStretchingRotary):
    def __init__(self, vocab_size, num_layers, *args, **kwargs):
        super().__init__(vocab_size, num_layers, *args, **kwargs)
        self.out_scale = nn.Parameter(torch.tensor(1.5))
        self.attention_scales = nn.Parameter(torch.linspace(0.8, 1.2, num_layers))

    def forward(self, input_seq, target_seq, window, stream=None, layers=None):
        self.stretch_rotaries(window)
        masks = self.attention_masks(input_seq, window)
        if stream is None:
            stream = self.stream_enters(self.embed_tokens(input_seq))
        layers = range(len(self.blocks)) if layers is None else layers
        for i in layers:
            stream = self.run_block(i, stream, masks)
        if layers.stop < len(self.blocks):
            return stream
        stream = dict(stream, x=stream["x"] * self.out_scale)  # the scale before the head
        return self.head_loss(self.stream_leaves(stream), target_seq)

    def embed_tokens(self, input_seq):
        stream = super().embed_tokens(input_seq)
        return dict(stream, updates=torch.zeros_like(stream["x"]))

    def run_block(self, i, stream, masks):
        for_attention = dict(scale=self.attention_scales[i]) if self.blocks[i].attn is not None else {}
        stream = self.enter_block(i, stream)
        x, update = self.blocks[i](**self.block_inputs(i, stream, masks), **for_attention)
        return self.keep_output(i, dict(stream, x=x, updates=stream["updates"] + update))

    def head_loss(self, stream, target_seq):
        return super().head_loss(dict(stream, x=stream["x"] + 0.1 * stream["updates"]), target_seq)


class GPTWithAllEdits(GPTWithRecordEdits, GPTWithNaturalEdits, GPTWithLaterKinds):
    """Every set of edits in one model (each class's embed_tokens, run_block and head_loss call the next one's; the
    later kinds' run_block is the last, handing each block what its attention takes and taking a second stream)."""


# Edits a layout refuses by name: heads that attend in pairs (under tensor parallelism, a pair split over ranks), and
# every layer's q, k, v matrices in one bank parameter of the GPT (tensor parallelism has no rule to split it)

def attend_in_pairs(attention: train_gpt.CausalSelfAttention, q, k, v, ve, mask) -> torch.Tensor:
    """Attention's forward from its (B, T, H, D) q, k, v, heads j and j + H/2 attending as one head of twice the
    width: their queries, keys and values concatenated."""
    B, T = q.size(0), q.size(1)
    q, k = attention.rotary(norm(q), norm(k))
    v = attention.values(v, ve)
    pairs = [torch.cat(t.chunk(2, dim=2), dim=-1).transpose(1, 2) for t in (q, k, v)]  # (B, H/2, T, 2D)
    y = train_gpt.attention(*pairs, mask, attention.rotary.attention_scale).transpose(1, 2)
    return attention.c_proj(torch.cat(y.chunk(2, dim=-1), dim=2).reshape(B, T, -1))


class AttentionInPairs(train_gpt.CausalSelfAttention):
    def __init__(self, dim, num_heads, head_dim, key_offset, zero_out, *kinds):  # (its own pairs, in every layer)
        super().__init__(dim, num_heads, head_dim, key_offset, zero_out)

    def forward(self, x, ve, mask, *gates):  # (a fork ignoring XSA, output gates and DC-MHA)
        return attend_in_pairs(self, *self.project(x), ve, mask)


class AttentionInPairsFromBank(train_gpt.CausalSelfAttention):
    """Heads attending in pairs, their q, k, v matrices handed in from the GPT's bank instead of held."""

    def __init__(self, dim, num_heads, head_dim, key_offset, zero_out, *kinds):  # (its own pairs, in every layer)
        super().__init__(dim, num_heads, head_dim, key_offset, zero_out)
        del self.qk, self.v

    def forward(self, x, ve, mask, *gates, qkv=None):
        q, k, v = F.linear(x, qkv.flatten(end_dim=-2)).view(*x.shape[:2], 3, -1, self.head_dim).unbind(2)
        return attend_in_pairs(self, q, k, v, ve, mask)


class GPTWithQKVBank(train_gpt.GPT):
    def __init__(self, vocab_size, num_layers, num_heads, head_dim, model_dim, *args, **kwargs):
        super().__init__(vocab_size, num_layers, num_heads, head_dim, model_dim, *args, **kwargs)
        bound = 3 ** 0.5 * 0.5 * model_dim ** -0.5
        shape = (num_layers, 3, num_heads * head_dim, model_dim)  # a matrix of each kind for each layer
        self.qkv_bank = nn.Parameter(torch.empty(shape).uniform_(-bound, bound))

    def run_block(self, i, stream, masks):
        for_attention = dict(qkv=self.qkv_bank[i]) if self.blocks[i].attn is not None else {}
        stream = self.enter_block(i, stream)
        return self.keep_output(i, dict(stream, x=self.blocks[i](**self.block_inputs(i, stream, masks),
                                                                 **for_attention)))


# edit name -> the train_gpt classes it replaces by subclasses
# A value embedding handed to attention ungated (#23's form): a stream tensor only attention reads, whole under
# sequence parallelism, entering beside the input as each rank's heads' part
class BlockWithUngatedValueEmbeds(train_gpt.Block):
    def __init__(self, *args):
        super().__init__(*args)
        self.value_gate = None

    def value_input(self, read, ve, gates, dense_value):
        return ve if dense_value is None else ve + dense_value


# A table looked up inside attention (learned positions added to the queries): tensor parallelism refuses it
class AttentionWithPositionTable(train_gpt.CausalSelfAttention):
    POSITIONS = 256  # (the tests' longest sequence)

    def __init__(self, dim, num_heads, head_dim, *args):
        super().__init__(dim, num_heads, head_dim, *args)
        self.positions = nn.Embedding(self.POSITIONS, dim)

    def forward(self, x, ve, mask, *gates):
        return super().forward(x + self.positions(torch.arange(x.size(1))), ve, mask, *gates)


MODEL_EDITS = {
    "forks": dict(GPT=GPTWithAllEdits, Block=BlockWithSecondStream, MLP=GatedMLP, LMHead=HeadWithLearnedCap,
                  CausalSelfAttention=AttentionWithInputScale),
    "heads_in_pairs": dict(CausalSelfAttention=AttentionInPairs),
    "bank_in_pairs": dict(GPT=GPTWithQKVBank, Block=BlockWithAttentionGate,
                          CausalSelfAttention=AttentionInPairsFromBank),
    "token_shift_in_a_block": dict(Block=BlockWithTokenShift),
    "unplaced_matrix_in_attention": dict(CausalSelfAttention=AttentionWithUnplacedMatrix),
    "ungated_value_embeds": dict(Block=BlockWithUngatedValueEmbeds),
    "embedding_inside_attention": dict(CausalSelfAttention=AttentionWithPositionTable),
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


# the layout tests' steps: the tiny preset on a 3-step schedule, so that they cross a change of the learning rate and
# of Muon's momentum, and of the window (1 to 2 blocks: what a window-dependent forward sees, though a 128-token
# sequence holds one block)
LAYOUT_TEST_FLAGS = dict(num_iterations=3, train_seq_len="256,128,128,128",  # (a staged batch, shrinking: cheaper)
                         tied_stages=1)  # (the head and embedding untied after step 1)


def edited_train_steps(rank, world_size, edit, flags, steps, jitter=0.0):
    """train_gpt.train_steps on the model as edited."""
    with model_edit(edit):
        return train_gpt.train_steps(rank, world_size, flags, steps, "cpu", jitter)


def assert_trains_like_one_process(ranks, single, floors, exact=False):
    """Every rank's losses, and every parameter and optimizer state after the last step (gathered on rank 0), equal
    the one-process run's as --check_layout compares them (within NOISE_MULTIPLE times the noise floors, measured by
    the jittered one-process run: train_gpt.noise_floors), and bit-identical when exact. Adam's moments and Muon's
    momentum carry every step's gradients, and each compared one is asserted non-zero."""
    for name, value in train_gpt.flat_state(single["state"]).items():
        assert name.endswith("/step") or torch.as_tensor(value).norm() > 0, f"{name} is zero: the comparison is empty"
    ok, how_far = train_gpt.trains_like_one_process(ranks, single, floors)
    assert ok, how_far
    assert not exact or train_gpt.worst_difference(ranks[0]["state"], single["state"])[0] == 0, how_far


def assert_holds_and_sends_what_the_plan_predicts(ranks, files, **layout):
    """Each rank's bytes in its first step (parameters, their peak, gradients, float64 sums, optimizer states,
    every collective) equal --plan's, which runs the same code on the meta device (assert_sends_what_the_plan_says)."""
    args = train_gpt.parse_args(tiny_flags(files, **LAYOUT_TEST_FLAGS, **layout), cuda=False)
    plan = train_gpt.plan_layout(args, len(ranks), cuda=False)
    for rank, predicted in zip(ranks, plan["ranks"]):
        held = rank["accounted"]
        for kind in ("parameters", "peak_parameters", "gradients", "gradient_sums", "optimizer_states"):
            assert held[kind] == predicted[kind], kind
        assert_sends_what_the_plan_says(held["comm"], predicted["comm"])


def assert_sends_what_the_plan_says(sent, planned):
    """Every collective's bytes as planned, but the embedding tables' gradients' (table_*), which depend on the
    tokens: the plan takes each lookup for a row of its own, so a run sends at most that, and some."""
    tables = lambda comm: sum(n for op, n in comm.items() if op.startswith("table_"))
    assert {op: n for op, n in sent.items() if not op.startswith("table_")} == \
        {op: n for op, n in planned.items() if not op.startswith("table_")}, (sent, planned)
    assert 0 < tables(sent) <= tables(planned) or tables(sent) == tables(planned) == 0, (sent, planned)



def train_step(trainer, batches, step):
    """One step as train_gpt.train() takes it: its summed loss and squared gradient norm."""
    loss = train_gpt.forward_backward(trainer, batches, step)
    grad_squares = trainer.layout.gradient_squares()
    train_gpt.optimizer_step(trainer, step)
    return loss, grad_squares
