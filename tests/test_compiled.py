"""torch.compile on the CPU (Inductor's C++ backend, the dense twin of the attention masks): what tests/test_cuda.py
checks of the compiled model, short of the CUDA kernels. A small model with the FP8 head, compiled by Inductor once
for the module, every layer kind of the tiny model lowered; the trainer's warm-up on AOTAutograd's eager backend."""
import copy

import pytest
import torch

import train_gpt
from layouts import train_step
from synthetic import TWO_LAYERS, tiny_flags, write_synthetic_shards
from test_attention import sequence_with_documents

SEQ_LEN = 512  # four attention blocks: windows of 1 to 4 blocks over the schedule's stages
DOC_STARTS = [0, 70, 128, 129, 300, 450]  # documents starting mid-block, on a block's edge, one token long


def small_args(files=None, layers=(), **overrides):
    files = files or dict(train_files="unused", val_files="unused")
    flags = dict(fp8_head=True, train_seq_len=SEQ_LEN, val_seq_len=SEQ_LEN, window_blocks="1:1,1:2,2:3,2:4",
                 final_window_blocks=4, extension_steps=0)
    return train_gpt.parse_args(tiny_flags(files, **dict(flags, **overrides)) + list(layers), cuda=False)


def nonzero_model(args):
    """The model with its zero-initialised layers given values, so that every gradient is non-zero at once."""
    torch.manual_seed(0)
    model = train_gpt.build_model(args, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(std=0.02)
    return model


@pytest.fixture(scope="module")
def compiled_over_the_schedule():
    """One compiled model run forward and backward at each stage's windows and rotary (YaRN's, retuned in place as
    in training), recompiles made errors; the eager model beside it; dynamo's counters."""
    args = small_args(num_iterations=20)
    eager = nonzero_model(args)
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, dynamic=False)
    tokens = sequence_with_documents(DOC_STARTS, SEQ_LEN + 1)
    stages = {train_gpt.window_tokens(step, args): train_gpt.windows_so_far(step, args)
              for step in range(args.num_iterations + 1)}
    graphs_after_first_window, losses = None, []
    # a recompile raises; Inductor's C++ kernels scalar (the same lowering and fusion, and a sixth less compile time
    # on 2 cores than with its vectorised variants, most of it spent generating and building code)
    with torch._dynamo.config.patch(error_on_recompile=True), torch._inductor.config.patch({"cpp.simdlen": 1}):
        for windows, so_far in stages.items():
            model.stretch_rotary(so_far)
            eager.stretch_rotary(so_far)
            window = train_gpt.window_tensor(windows, torch.device("cpu"))
            loss = compiled(tokens[:-1].to(torch.int32), tokens[1:], window)
            loss.backward()
            losses.append((loss.item(), eager(tokens[:-1].to(torch.int32), tokens[1:], window)))
            losses[-1][1].backward()
            graphs_after_first_window = graphs_after_first_window or counters["stats"]["unique_graphs"]
    return dict(windows=list(stages), graph_breaks=dict(counters["graph_break"]), unique_graphs=counters["stats"]
                ["unique_graphs"], graphs_after_first_window=graphs_after_first_window, losses=losses, eager=eager,
                compiled=model)


def test_the_model_compiles_once_across_the_window_schedule_with_no_graph_break(compiled_over_the_schedule):
    run = compiled_over_the_schedule
    assert run["windows"] == [(128, 128), (128, 256), (256, 384), (256, 512)]  # each stage's, in tokens
    assert not run["graph_breaks"], run["graph_breaks"]
    assert run["unique_graphs"] == run["graphs_after_first_window"]


def test_the_compiled_model_gives_the_eager_loss_and_gradients(compiled_over_the_schedule):
    # the same fp32 math, fused apart: within 1e-5 of the loss and 1e-4 of each gradient's norm, summed over the
    # four windows (measured up to 2e-6 and 2e-5); a scalar's gradient, a sum over every position, can nearly cancel
    # (a paired layer's value scale here: 0.5% of the others', 1e-4 off in eager fp32 against fp64), so scalars are
    # held within 1e-4 of the largest scalar gradient
    run = compiled_over_the_schedule
    for compiled_loss, eager_loss in run["losses"]:
        assert compiled_loss == pytest.approx(eager_loss.item(), rel=1e-5)
    scalars = max(p.grad.abs().item() for p in run["eager"].parameters() if p.numel() == 1)
    for (name, p), q in zip(run["eager"].named_parameters(), run["compiled"].parameters()):
        assert p.grad.norm() > 0, name
        assert (q.grad - p.grad).norm() <= 1e-4 * (scalars if p.numel() == 1 else p.grad.norm()), name


def test_the_fp8_head_runs_inside_the_compiled_model(compiled_over_the_schedule):
    # the custom op is one node of the compiled graph (whose loss and gradients are the eager FP8 model's, above),
    # and its quantisation shows: an fp32 head's gradient differs from it by more than rounding, by less than 10%
    args = small_args()
    tokens = sequence_with_documents(DOC_STARTS, SEQ_LEN + 1)
    batch = (tokens[:-1].to(torch.int32), tokens[1:], train_gpt.window_tensor((train_gpt.ATTENTION_BLOCK_SIZE, train_gpt.ATTENTION_BLOCK_SIZE), torch.device("cpu")))
    explained = torch._dynamo.explain(nonzero_model(args))(*batch)
    assert any(f"{train_gpt.OPS}.mm" in str(graph.graph) for graph in explained.graphs)
    grads = []
    for fp8 in (True, False):
        model = nonzero_model(args)
        model.lm_head.use_fp8 = fp8
        model(*batch).backward()
        grads.append(model.lm_head.weight.grad)
    assert 1e-3 < ((grads[0] - grads[1]).norm() / grads[1].norm()).item() < 0.1


def assert_warmup_restores_exactly(trainer, steps: int) -> None:
    """After `steps` compiled warm-up steps the model is bit for bit as built, with no optimizer state or gradient."""
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    train_gpt.warmup_and_restore(trainer, steps)
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, initial[k]), k
    assert all(not opt.state for opt in trainer.optimizers)
    assert all(p.grad is None for p in trainer.model.parameters())


def test_compiled_warmup_restores_model_and_optimizer_state_exactly_and_compiles_each_stages_shape(tmp_path,
                                                                                                  monkeypatch):
    # a staged batch: steps 0 and 1 of 256-token sequences, then of 512 (the warm-up's 2 steps at each); the tiny
    # model cut to two layers, compiled by dynamo and AOTAutograd with the eager backend: what is checked here (a
    # graph a shape, no recompile after the warm-up, the exact restore) is theirs, and Inductor's two compiles of it
    # took 105 s of the suite on a 2-core AMD EPYC (the fixture above lowers the whole model through Inductor)
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda module, **options: compile_module(module, **options, backend="aot_eager"))
    files = write_synthetic_shards(tmp_path)
    args = small_args(files, TWO_LAYERS, compile=True, seqs_per_step=2, train_seq_len="256,512,512,512",
                      num_iterations=6)
    trainer = train_gpt.build_trainer(args, train_gpt.build_parallel_context(0, 1, torch.device("cpu")))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    assert_warmup_restores_exactly(trainer, 2)
    assert counters["stats"]["unique_graphs"] == 2  # one a sequence length
    # and it trains from there across the change of sequence length with no new compile: four steps (Adam's first
    # step, with the zero-initialised head's, after the second), the loss falls
    batches = train_gpt.DistributedDataLoader(args.train_files, SEQ_LEN, 2, 0, 1, torch.device("cpu"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses = [train_step(trainer, batches, step)[0].item() for step in range(4)]
    assert losses[3] < losses[0]
