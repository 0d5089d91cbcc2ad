"""The layout tests' harness: a few training steps under any layout (train_gpt.train_steps, the same runs and
comparison as `train_gpt.py --check_layout`), and the edits a forker makes to train_gpt.py, made to its source as a
fork's file has them: each fork is train_gpt.py with some lines changed, imported as a module of its own."""
import concurrent.futures
import linecache
import sys
import types
from pathlib import Path

import train_gpt
from synthetic import tiny_flags

# The forks: each a list of (lines of train_gpt.py, what the fork has there instead); each original found once.
SHIFT = "torch.cat([torch.zeros_like({0}[:, :1]), {0}[:, :-1]], dim=1)"  # each position the previous one's vector

# a learned gate on attention's output
ATTENTION_GATE = [("""        self.mlp = MLP(dim, hidden) if layer.mlps else None
""", """        self.mlp = MLP(dim, hidden) if layer.mlps else None
        self.attn_gate = nn.Parameter(torch.tensor(0.7)) if layer.attention else None
"""), ("""        return self.attn(read, value_input, mask,""", """        return self.attn_gate * self.attn(read, value_input, mask,""")]

# The edits the field's records make, in one model: natural ones (a gate on attention's output, a fourth value
# embedding, a gated MLP, a learnable per-layer vector, a hashed token-pair embedding), the record history's (a token
# shift of the embedding, a second head predicting the token after next, the embedding tied to the head as one
# parameter, a learnable soft cap and a temperature the two heads share, a per-head temperature, a block's scalar read
# by the GPT after the block ran) and the later records' kinds: code in GPT.forward itself (a scale on the stream
# before the head; the rotaries stretched as the window grows, as dynamic YaRN does), a GPT vector whose entries
# attention takes by keyword, a per-head gate made in the block and a per-head vector the block holds, each handed
# to attention by keyword, a block returning
# a second stream, a bias per vocabulary entry and a fixed offset per vocabulary entry held as the head's buffer
FORKS = {"forks": [
    ('''    LayerConfig(long_window=True, key_offset=True, gate_network=True),
''', '''    LayerConfig(long_window=True, key_offset=True, gate_network=True, value_embed=True),
'''),
    ('''        self.c_proj.weight.detach().zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())  # ReLU^2''',
     '''        self.c_proj.weight.detach().zero_()
        self.c_gate = CastedLinear(dim, 4 * dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square() * torch.sigmoid(self.c_gate(x)))'''),
    ('''        self.sum_over_heads = SumOverHeads() if composed else None
''', '''        self.sum_over_heads = SumOverHeads() if composed else None
        self.head_temperature = nn.Parameter(torch.linspace(0.8, 1.2, num_heads))
'''),
    ('''                banded: Tensor | None = None) -> Tensor:
''', '''                banded: Tensor | None = None, scale: Tensor | float = 1.0,
                head_gate: Tensor | None = None, key_temperature: Tensor | None = None) -> Tensor:
'''),
    ('''        if output_gate is not None:
            y = y * output_gate.type_as(y)[..., None]
''', '''        if output_gate is not None:
            y = y * output_gate.type_as(y)[..., None]
        y = y * head_gate.type_as(y)[..., None]
'''),
    ('''        q, k, v = self.project(x)
        B, T = q.size(0), q.size(1)  # B == 1: masks are per sequence
        q, k = self.rotary(norm(q), norm(k), self.head_offsets)  # QK-norm, then rotate
''', '''        q, k, v = self.project(x * scale)
        B, T = q.size(0), q.size(1)  # B == 1: masks are per sequence
        q, k = self.rotary(norm(q), norm(k), self.head_offsets)  # QK-norm, then rotate
        q = q * self.head_temperature[:, None]
        k = k * key_temperature.type_as(k)[:, None]
'''),
    *ATTENTION_GATE,
    ('''        self.mlp = MLP(dim, hidden) if layer.mlps else None
''', '''        self.mlp = MLP(dim, hidden) if layer.mlps else None
        self.head_gate = Gate(8, num_heads) if layer.attention else None
        self.key_temperature = nn.Parameter(torch.linspace(0.9, 1.1, num_heads)) if layer.attention else None
'''),
    ('''                         gates.get("dc_weight"), banded, **for_attention)''',
     '''                         gates.get("dc_weight"), banded, head_gate=torch.sigmoid(self.head_gate(read) + 1),
                         key_temperature=self.key_temperature, **for_attention)'''),    ('''        dense_value = None
        if dense is not None:''', '''        block_input = x
        dense_value = None
        if dense is not None:'''),
    ('''        return (out, read) if mlp_input else out''', '''        return out, out - block_input'''),
    ('''        self.soft_cap = soft_cap
        self.statistics = VocabularyStatistics()
''', '''        self.soft_cap = soft_cap
        self.statistics = VocabularyStatistics()
        self.cap = nn.Parameter(torch.tensor(23.0))
        self.logit_bias = nn.Parameter(torch.zeros(self.weight.size(0)))
        self.logit_offsets = nn.Buffer(torch.linspace(-1, 1, self.weight.size(0)), persistent=False)
        self.temperature = 1.0
'''),
    ('''        return SoftCap.apply(super().forward(x, rows).float(), *self.soft_cap)''',
     '''        logits = super().forward(x, rows).float() + self.logit_bias + self.logit_offsets
        return self.cap * torch.sigmoid((logits + 5) / (7.5 * self.temperature))'''),
    ('''    copy_window: int = flag(0, ''', '''    copy_window: int = flag(8, '''),
    ('''        self.rotary_windows = ()  # the windows YaRN has stretched the rotaries for (stretch_rotary)
''', '''        self.rotary_windows = ()  # the windows YaRN has stretched the rotaries for (stretch_rotary)
        self.layer_gains = nn.Parameter(torch.linspace(0.8, 1.2, c.num_layers))
        self.pair_embed = nn.Embedding(2**16, c.model_dim)
        self.smear_gate = CastedLinear(12, 1)
        self.embed = nn.Embedding(head_rows, c.model_dim)  # tied: one table of the head's (padded) size
        self.lm_head.weight = self.embed.weight
        self.next_head = LMHead(c.model_dim, head_rows)
        self.next_head.weight.detach().zero_()  # a head starts at zero, as the GPT's own does
        self.head_temperature = nn.Parameter(torch.tensor(1.0))
        for head in (self.lm_head, self.next_head):
            head.temperature = self.head_temperature
        self.out_scale = nn.Parameter(torch.tensor(1.5))
        self.attention_scales = nn.Parameter(torch.linspace(0.8, 1.2, c.num_layers))
        self.rotary_window = ATTENTION_BLOCK_SIZE  # the long window the rotaries are stretched for, in tokens
'''),
    ('''        masks = self.attention_masks(input_seq, windows)
        if stream is None:  # the embedding''', '''        masks = self.attention_masks(input_seq, windows)
        if int(windows[1]) != self.rotary_window:  # the rotaries stretched as the long window grows
            for rotary in (m for m in self.modules() if isinstance(m, Rotary)):
                quarter = rotary.angular_freq.numel() // 2
                turns = (1 / 1024) ** torch.linspace(0, 1, steps=quarter)
                stretched = turns * ATTENTION_BLOCK_SIZE / int(windows[1])
                rotary.angular_freq.copy_(torch.cat([stretched, stretched.new_zeros(quarter)]))
            self.rotary_window = int(windows[1])
        if stream is None:  # the embedding'''),
    ('''            x = norm((x if self.smear is None else self.smear(x))[None])  # (1, T, D)
            s = Stream(x=x, x0=x, ve={int(i): table(input_seq) for i, table in self.value_embeds.items()}, gates={})''',
     f'''            x = norm((x if self.smear is None else self.smear(x))[None])  # (1, T, D)
            x = x + torch.sigmoid(self.smear_gate(x[..., :12])) * {SHIFT.format("x")}
            previous = torch.cat([input_seq.new_zeros(1), input_seq[:-1]])
            x = norm(x + 0.1 * self.pair_embed((input_seq * 31 + previous) % 2**16)[None])
            s = Stream(x=x, x0=x, ve={{int(i): table(input_seq) for i, table in self.value_embeds.items()}}, gates={{}},
                       updates=torch.zeros_like(x))'''),
    ('''            block, layer = self.blocks[i], c.layers[i]
''', '''            block, layer = self.blocks[i], c.layers[i]
            s.x = s.x * self.layer_gains[i]
'''),
    ('''            out = block(s.x, x0=''', '''            out, update = block(s.x, x0='''),
    ('''                        **(dict(mlp_input=True) if keep_mlp_input else {}))
''', '''                        **(dict(mlp_input=True) if keep_mlp_input else {}),
                        **(dict(scale=self.attention_scales[i]) if block.attn is not None else {}))
'''),
    ('''            else:
                s.x = out
''', '''            else:
                s.x = out
            s.updates = s.updates + update
            if block.mlp_scales is not None:  # (a dense layer's scales are per token)
                s.x = s.x + 0.1 * block.mlp_scales.output * s.x0
'''),
    ('''        s = self.stream_leaves(s)
        x = s.x
''', '''        s = self.stream_leaves(s)
        x = s.x * self.out_scale + 0.1 * s.updates
'''),
    ('''        loss = summed_loss(log_probs, stats.found, weights)
''', '''        loss = summed_loss(log_probs, stats.found, weights)
        if self.training:
            after_next = self.next_head(x[:-1], target_seq[1:, None])
            loss = loss + summed_loss(after_next.log_probs(), after_next.found)
'''),
]}

# heads j and j + H/2 attending as one head of twice the width, their queries, keys and values concatenated (a fork
# ignoring XSA, output gates and DC-MHA); the tiny preset's own paired heads off
PAIRS = '''        q, k = self.rotary(norm(q), norm(k))  # heads j and j + H/2 as one head of twice the width
        pairs = [torch.cat(t.chunk(2, dim=2), dim=-1).transpose(1, 2) for t in (q, k, self.values(v, ve))]
        y = attention(*pairs, mask, self.rotary.attention_scale).transpose(1, 2)
        return self.c_proj(self.proj_scale * torch.cat(y.chunk(2, dim=-1), dim=2).reshape(B, T, -1))
'''
NO_PAIRED_HEADS = [('''    LayerConfig(paired_head=True, value_embed=True, gate_network=True),
''', '''    LayerConfig(value_embed=True, gate_network=True),
'''), ('''    LayerConfig(long_window=True, paired_head=True, value_embed=True, output_gate=True),
''', '''    LayerConfig(long_window=True, value_embed=True, output_gate=True),
''')]
FORKS["heads_in_pairs"] = [*NO_PAIRED_HEADS, ('''        B, T = q.size(0), q.size(1)  # B == 1: masks are per sequence
''', '''        B, T = q.size(0), q.size(1)  # B == 1: masks are per sequence
''' + PAIRS)]
# the same, every layer's q, k, v matrices in one bank parameter of the GPT, handed to attention by keyword, and a
# gate on attention's output
FORKS["bank_in_pairs"] = [*NO_PAIRED_HEADS, *ATTENTION_GATE, ('''        self.sum_over_heads = SumOverHeads() if composed else None
''', '''        self.sum_over_heads = SumOverHeads() if composed else None
        del self.qk, self.v
'''), ('''                banded: Tensor | None = None) -> Tensor:
''', '''                banded: Tensor | None = None, qkv: Tensor | None = None) -> Tensor:
'''), ('''        q, k, v = self.project(x)
        B, T = q.size(0), q.size(1)  # B == 1: masks are per sequence
''', '''        q, k, v = F.linear(x, qkv.flatten(end_dim=-2)).view(*x.shape[:2], 3, -1, self.qk_dim).unbind(2)
        B, T = q.size(0), q.size(1)  # B == 1: masks are per sequence
''' + PAIRS), ('''        self.rotary_windows = ()  # the windows YaRN has stretched the rotaries for (stretch_rotary)
''', '''        self.rotary_windows = ()  # the windows YaRN has stretched the rotaries for (stretch_rotary)
        bound = 3 ** 0.5 * 0.5 * c.model_dim ** -0.5  # a matrix of each kind for each layer
        self.qkv_bank = nn.Parameter(torch.empty(c.num_layers, 3, c.num_heads * c.head_dim, c.model_dim).uniform_(
            -bound, bound))
'''), ('''                        **(dict(mlp_input=True) if keep_mlp_input else {}))
''', '''                        **(dict(mlp_input=True) if keep_mlp_input else {}),
                        **(dict(qkv=self.qkv_bank[i]) if block.attn is not None else {}))
''')]
# a token shift inside each block: where sequence parallelism cuts the stream, so it must refuse it
FORKS["token_shift_in_a_block"] = [('''        self.mlp = MLP(dim, hidden) if layer.mlps else None
''', '''        self.mlp = MLP(dim, hidden) if layer.mlps else None
        self.shift_gain = nn.Parameter(torch.tensor(0.5))
'''), ('''        dense_value = None
        if dense is not None:''', f'''        x = x + self.shift_gain * {SHIFT.format("x")}
        dense_value = None
        if dense is not None:''')]
# a token-id table read in the layer loop (#378's document copy feature's kind): whole sequences, where sequence
# parallelism hands the layer a part of one
FORKS["token_table_in_the_layer_loop"] = [("""            dense = i == c.dense_layer""", """            s.x = s.x + 0.01 * norm(self.embed(input_seq))[None]
            dense = i == c.dense_layer""")]
# a weight matrix inside attention, on its heads' output, that neither reads the region's input nor writes its
# output: no tensor-parallel rule places it
FORKS["unplaced_matrix_in_attention"] = [('''        self.sum_over_heads = SumOverHeads() if composed else None
''', '''        self.sum_over_heads = SumOverHeads() if composed else None
        self.mix = CastedLinear(dim, dim)
'''), ('''        return self.c_proj((self.proj_scale.type_as(y) * y).contiguous().view(B, T, -1))''',
       '''        return self.c_proj(self.mix((self.proj_scale.type_as(y) * y).contiguous().view(B, T, -1)))''')]
# a value embedding handed to attention ungated (#23's form): a stream tensor only attention reads, whole under
# sequence parallelism, entering beside the input as each rank's heads' part
FORKS["ungated_value_embeds"] = [
    ('''        self.value_gate = Gate(2 * VALUE_GATE_CHANNELS, num_heads) if layer.value_embed and not dense_sources else None''',
     '''        self.value_gate = None'''),
    ('''        if ve is None:
            return dense_value
''', '''        if ve is None:
            return dense_value
        return ve if dense_value is None else ve + dense_value
''')]
# a table looked up inside attention (learned positions added to its input): tensor parallelism refuses it
FORKS["embedding_inside_attention"] = [('''        self.sum_over_heads = SumOverHeads() if composed else None
''', '''        self.sum_over_heads = SumOverHeads() if composed else None
        self.positions = nn.Embedding(256, dim)  # (the tests' longest sequence)
'''), ('''        q, k, v = self.project(x)
        B, T''', '''        q, k, v = self.project(x + self.positions(torch.arange(x.size(1))))
        B, T''')]
# a head scoring only some rows of its weight in training, picked by token (a sampled softmax's shape, #92's): the
# rows of the step's targets and 64 more; tensor parallelism keeps such a head whole
FORKS["head_picking_its_rows"] = [('''        """The statistics of these tokens' logits over the whole vocabulary, masked after `previous` tokens."""
        logits = self.logits(x)
''', '''        if self.training:
            rows = torch.cat([targets[targets >= 0], torch.arange(64, device=x.device)]).unique()  # (sorted)
            logits = SoftCap.apply(F.linear(x, self.weight[rows].type_as(x)).float(), *self.soft_cap)
            picked = torch.where(targets >= 0, torch.searchsorted(rows, targets.clamp_min(0)), -1)
            return self.statistics(logits, picked)
        logits = self.logits(x)
''')]
# two losses a forker might write over the head's logits themselves, where tensor parallelism's ranks each hold part
# of them: the target's logit picked by a one-hot in the head, and a log-softmax in GPT.forward
FORKS["target_logit_by_a_one_hot"] = [('''        return self.statistics(logits, targets)
''', '''        one_hot = F.one_hot(targets.clamp_min(0), logits.size(-1)).to(logits.dtype)  # (tokens, J, vocabulary)
        return self.statistics(logits, targets)._replace(picked=(logits[:, None] * one_hot).sum(-1))
''')]
FORKS["log_softmax_in_gpt_forward"] = [('''        log_probs = stats.log_probs()
''', '''        log_probs = self.lm_head(x, None).log_softmax(-1).gather(1, targets.clamp_min(0))
''')]
# a second, slower momentum kept by Muon beside its own, its update the mean of the two's
FORKS["muon_with_a_second_momentum"] = [('''        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - (group["momentum"] if group["fast_momentum"] is None else group["fast_momentum"]))
''', '''        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - (group["momentum"] if group["fast_momentum"] is None else group["fast_momentum"]))
        slow = state.setdefault("slow_momentum", torch.zeros_like(grad))
        slow.lerp_(grad, 0.01)
        grad = grad.add(slow)
''')]
# a second gated skip, from layer 0's output into the last layer's input, as the README's forking section writes it:
# its gate where the model's parameters are made, the state where layer 0 makes it, the join where the last layer
# uses it
FORKS["skip_from_the_first_layer_into_the_last"] = [
    ("""        self.backout = nn.Parameter(torch.tensor(-0.5)) if c.attend_over is not None and not c.mudd else None
""", """        self.backout = nn.Parameter(torch.tensor(-0.5)) if c.attend_over is not None and not c.mudd else None
        self.first_skip_gate = nn.Parameter(torch.tensor(SKIP_GATE_START))
"""),
    ("""            dense = i == c.dense_layer""", """            if i == c.num_layers - 1:
                s.x = s.x + torch.sigmoid(self.first_skip_gate) * s.first_output
            dense = i == c.dense_layer"""),
    ("""            if c.skip is not None and i == c.skip[0]:  # the skip leaves
                s.skip = s.x
""", """            if c.skip is not None and i == c.skip[0]:  # the skip leaves
                s.skip = s.x
            if i == 0:
                s.first_output = s.x
""")]
# code in GPT.forward outside its three parts (a shift after the embedding's branch): every part applies it
FORKS["code_between_the_parts"] = [('''        for i in range(c.num_layers) if layers is None else layers:
''', '''        s.x = s.x + 0.5
        for i in range(c.num_layers) if layers is None else layers:
''')]


def forked_source(edits: list[tuple[str, str]]) -> str:
    """train_gpt.py with each edit made: its original lines replaced by the fork's."""
    source = Path(train_gpt.__file__).read_text()
    for original, forked in edits:
        assert source.count(original) == 1, f"a fork's edit finds its lines {source.count(original)} times:\n{original}"
        source = source.replace(original, forked)
    return source


def fork(name: str) -> types.ModuleType:
    """The named fork of train_gpt.py, imported as train_gpt_<name> (its ops and types registered under that name)."""
    module_name = f"train_gpt_{name}"
    if module_name not in sys.modules:
        module = types.ModuleType(module_name)
        module.__file__ = train_gpt.__file__
        sys.modules[module_name] = module  # (before it runs: its dataclasses look themselves up there)
        source, file = forked_source(FORKS[name]), f"<{module_name}>"
        linecache.cache[file] = (len(source), None, source.splitlines(keepends=True), file)  # (for tracebacks)
        exec(compile(source, file, "exec"), module.__dict__)
    return sys.modules[module_name]


# the layout tests' steps: the tiny preset on a 3-step schedule, so that they cross a change of the learning rate and
# of Muon's momentum, and of the window (1 to 2 blocks: what a window-dependent forward sees, though a 128-token
# sequence holds one block)
LAYOUT_TEST_FLAGS = dict(num_iterations=3, train_seq_len="256,128,128,128",  # (a staged batch, shrinking: cheaper)
                         tied_stages=1)  # (the head and embedding untied after step 1)


def edited_train_steps(rank, world_size, edit, flags, steps, jitter=0.0):
    """train_steps of the named fork (None: of train_gpt itself)."""
    return (fork(edit) if edit else train_gpt).train_steps(rank, world_size, flags, steps, "cpu", jitter)


def assert_trains_like_one_process(ranks, single, floors, exact=False):
    """Every rank's losses, its final validation loss, and every parameter and optimizer state after the last step
    (gathered on rank 0), equal the one-process run's as --check_layout compares them (within NOISE_MULTIPLE times the
    noise floors, measured by the jittered one-process run: train_gpt.noise_floors), and bit-identical when exact.
    Adam's moments and Muon's momentum carry every step's gradients, and each compared one is asserted non-zero."""
    for name, value in train_gpt.flat_state(single["state"]).items():
        assert name.endswith("/step") or train_gpt.torch.as_tensor(value).norm() > 0, \
            f"{name} is zero: the comparison is empty"
    ok, how_far = train_gpt.trains_like_one_process(ranks, single, floors)
    assert ok, how_far
    assert not exact or train_gpt.worst_difference(ranks[0]["state"], single["state"])[0] == 0, how_far


def beside_its_plan(train, flags, processes):
    """train() (a layout's ranks, each in a process of its own) and, meanwhile, the plan of the run flags describe
    on `processes` on the meta device in this process (train_gpt.plan_layout: Python's work, one core, which the
    ranks leave idle part of the time): (what train returned, the plan)."""
    with concurrent.futures.ThreadPoolExecutor(1) as planner:
        plan = planner.submit(train_gpt.plan_layout, train_gpt.parse_args(flags, cuda=False), processes, cuda=False)
        return train(), plan.result()


def assert_holds_and_sends_what_the_plan_predicts(ranks, plan, files, **layout):
    """Each rank's bytes in its first step (parameters, their peak, gradients, float64 sums, optimizer states,
    every collective) equal the plan's (beside_its_plan: --plan's, which runs the same code on the meta device;
    assert_sends_what_the_plan_says)."""
    args = train_gpt.parse_args(tiny_flags(files, **LAYOUT_TEST_FLAGS, **layout), cuda=False)
    assert len(plan["ranks"]) == len(ranks)
    for rank, predicted in zip(ranks, plan["ranks"]):
        held = rank["accounted"]
        for kind in ("parameters", "peak_parameters", "gradients", "gradient_sums", "optimizer_states"):
            # (a table held by rows: its gradients and sums are of the rows read, which the plan takes for a row a
            # lookup, at most)
            assert held[kind] == predicted[kind] or args.tables_by_rows and kind in ("gradients", "gradient_sums",
                                                                                     "optimizer_states") and \
                held[kind] < predicted[kind], (kind, held[kind], predicted[kind])
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
