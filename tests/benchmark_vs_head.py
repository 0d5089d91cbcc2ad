"""This file's port of record #89's math against #89's own trainer on a CPU (../shared/head_cpu/), step by step.

    python tests/benchmark_vs_head.py             # 60 steps at head_cpu's default tiny configuration
    python tests/benchmark_vs_head.py --steps 8   # a quick look

First the noise floor: #89 against itself with one numerics flag changed (its FP8 products emulated in fp32 against
torch._scaled_mm on the CPU), from the same seed and batches. It prints the largest difference of the next-token
loss per step and of the validation loss, and after steps 1 and 5 the largest differences of the parameters
(||a - b|| / ||b||, fp32 master weights, by this file's names, as the port is compared: one of #89's banks holds
several of this file's tensors). A parameter's floor is the largest difference of its kind, the same tensor in any
layer (blocks.*.value_gate.weight): one pair of runs is one sample of each, and Adam's first steps, nearly signs on
gradients near zero, flip in one layer's gates and not in another's. Against #89 as it runs, with the FP8 MLP that
the port has not, a parameter's floor is the larger of that and the same of #89 with FP8 against #89 without.
Of an embedding table (every nn.Embedding of this file's model: the token and value embeddings, the bigram table)
only the rows that a micro-batch of the steps so far looked up are compared, in the floor as in the port: the others
have had no gradient of their own, so they have not moved, or only by weight decay, or (the token embedding's, while
tied to the head) they are the head's rows, and the head is compared whole (every row of it has a gradient, through
the softmax). The port is held to 5 times each floor, or to the fixed bounds (loss and validation loss 1%, a
parameter 2%), whichever is larger.

Then this file against #89: both start from #89's initial weights (tests/head_weights.py maps its parameter banks
onto this file's parameters) and train on the same batches (both read the Shakespeare shards as one stream, 8
sequences a step), this file in this process through train_gpt's own step functions. It prints the next-token loss of
both at every step, the validation loss, and every parameter after steps 1 and 5 by this file's names against its
tolerance, and exits 1 when one is exceeded. Skips with a message when ../shared/head_cpu is missing. Runs #89 as
subprocesses, two at a time (one thread each).
"""
import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import head_weights
import train_gpt
from head_weights import GPT2_RANKS, HEAD_CPU, REPO_ROOT
from tool_inputs import need_out_folder, open_own, run_tool

FIXED_BOUNDS = dict(loss=0.01, val_loss=0.01, parameter=0.02)  # the port's bounds where the floor is smaller
FLOOR_MULTIPLE = 5
STATE_STEPS = (1, 5)  # parameters compared after these steps
# one numerics flag of head_cpu changed: the same math with its FP8 products summed in another order
NUMERICS = {"emulated FP8": ["--fp8", "emulate"], "scaled_mm FP8": ["--fp8", "scaled_mm"]}
# #89 as the port is compared with it: as it runs (FP8 head and MLP, emulated), and with no FP8 anywhere against the
# port's head in bf16, which leaves the math alone (the port has no FP8 MLP); -> the port's --fp8_head
COMPARED = {"emulated FP8": True, "no FP8": False}
HEAD_FLAGS = dict(NUMERICS, **{"no FP8": ["--fp8", "off"]})
# a parameter's floor in each comparison: #89 against itself with a numerics flag changed (the largest difference of
# its kind), the larger of the two where two are named. The port has no FP8 MLP, so against #89 as it runs, what
# #89's FP8 moves a tensor by counts too (without it, the MLPs' output projections, which start at zero, come to 95%
# of their tolerance after step 1, and at 8 steps the head exceeds its own after step 5)
PARAMETER_FLOORS = {"emulated FP8": (tuple(NUMERICS), ("emulated FP8", "no FP8")), "no FP8": (tuple(NUMERICS),)}


def head_runs(name: str, flags: list[str], steps: int, out: Path) -> list[tuple[list[str], Path]]:
    """The head_cpu commands for one configuration: the whole run with its losses, and a short one per saved state
    (step 0: the initial weights)."""
    base = head_weights.head_cpu_command(steps, flags, out / "head_logs")
    tag = tag_of(name)
    runs = [([*base, "--dump_losses", str(out / f"{tag}.json")], out / f"{tag}.log")]
    for step in (0, *STATE_STEPS):
        runs.append(([*base, "--stop_after", str(max(step, 1)), "--save_step", str(step),
                      "--save_state", str(out / f"{tag}_step{step}.pt")], out / f"{tag}_step{step}.log"))
    return runs


def tag_of(name: str) -> str:
    return name.replace(" ", "_")


def run_two_at_a_time(runs: list[tuple[list[str], Path]]) -> None:
    pending = list(runs)
    while pending:
        batch, pending = pending[:2], pending[2:]
        procs = [(subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=open_own(log), stderr=subprocess.STDOUT), log)
                 for cmd, log in batch]
        for proc, log in procs:
            if proc.wait() != 0:
                sys.exit(f"head_cpu failed (exit {proc.returncode}); its output: {log}")


def head_state(path: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """A saved head_cpu state's model tensors, the parameters as fp32 (NorMuon's bf16 banks joined with their 16-bit
    mantissas), and the names of the parameters (the rest are buffers: FP8 scales, the bigram signs, rotary tables)."""
    state = head_weights.load_tensors(path)
    tensors = head_weights.fp32_masters(state)
    parameters = set(state["optimizer"])
    return {name: t.float() if name in parameters else t for name, t in tensors.items()}, parameters


def port_parameters(path: Path, config: dict) -> dict[str, torch.Tensor]:
    """A saved head_cpu state's parameters as this file's, by this file's names."""
    like = train_gpt.build_model(head_weights.port_hyperparameters(config), torch.device("meta"))
    return head_weights.port_names(head_state(path)[0], dict(like.named_parameters()))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    b64 = b.double()
    return ((a.double() - b64).norm() / b64.norm().clamp_min(1e-30)).item()


def compare_losses(a: dict, b: dict) -> tuple[list[float], float]:
    """Per step |a - b| / b of the next-token loss, and the same of the validation loss."""
    per_step = [abs(x["ntp_loss"] - y["ntp_loss"]) / y["ntp_loss"] for x, y in zip(a["steps"], b["steps"])]
    val = abs(a["val"][-1]["val_loss"] - b["val"][-1]["val_loss"]) / b["val"][-1]["val_loss"]
    return per_step, val


def kind_of(name: str) -> str:
    """A parameter's name with its layer left out: blocks.3.attn.qk.weight -> blocks.*.attn.qk.weight."""
    return re.sub(r"\.\d+\.", ".*.", name)


def compare_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                       rows: dict[str, torch.Tensor]) -> dict[str, float]:
    """||a - b|| / ||b|| of every parameter in both, of a table only over `rows` (table name -> row indices)."""
    def part(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return t[name][rows[name]] if name in rows else t[name]
    return {name: relative(part(a, name), part(b, name)) for name in b if name in a and b[name].numel() > 0}


@torch.no_grad()
def looked_up_rows(config: dict) -> dict[int, dict[str, torch.Tensor]]:
    """After each of STATE_STEPS, the rows of every embedding table (nn.Embedding) of this file's model that a
    micro-batch of the steps so far looked up, by the table's parameter name: seen by hooks on the tables in this
    file's forward of #89's micro-batches (which its loader gives too), from its initial weights (which rows a
    forward looks up depends on the tokens alone)."""
    args = head_weights.port_hyperparameters(config)
    model = train_gpt.build_model(args, torch.device("cpu"))
    tables = {module: f"{name}.weight" for name, module in model.named_modules()
              if isinstance(module, torch.nn.Embedding)}
    seen = {name: [] for name in tables.values()}
    hooks = [module.register_forward_hook(lambda module, inputs, _: seen[tables[module]].append(inputs[0].flatten()))
             for module in tables]
    rows = {}
    for step in range(1, max(STATE_STEPS) + 1):
        for inputs, _ in head_weights.head_batches(config, step):
            head_weights.port_logits(model, args, inputs, step)
        if step in STATE_STEPS:
            rows[step] = {name: torch.cat(ids).unique() for name, ids in seen.items()}
    for hook in hooks:
        hook.remove()
    return rows


def port_run(config: dict, initial: Path, steps: int, fp8_head: bool) -> dict:
    """This file trained on head_cpu's configuration from #89's initial weights, through train_gpt's own step
    functions in this process: per step the training loss (#89's weighting of its losses) and the next-token loss
    (taken off the head's logits as the loss sees them), the validation loss after the last step, and the model's
    parameters after each of STATE_STEPS."""
    torch.set_num_threads(1)  # (as head_cpu's runs)
    args = head_weights.port_hyperparameters(config)  # (its steps, extension included: the config's)
    args.fp8_head = fp8_head
    trainer = train_gpt.build_trainer(args, train_gpt.build_parallel_context(0, 1, torch.device("cpu")))
    head_weights.load_head_weights(trainer.model, head_state(initial)[0])
    next_token = []

    def next_token_loss(module, inputs, output):
        logits, targets = inputs[0].detach(), inputs[1][:, 0]
        next_token.append((torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum").item(),
                           len(targets)))

    hook = trainer.model.lm_head.statistics.register_forward_hook(next_token_loss)
    batches, records, states = train_gpt.train_batches(trainer), [], {}
    for step in range(steps):
        loss = train_gpt.forward_backward(trainer, batches, step)
        train_gpt.optimizer_step(trainer, step)
        summed, tokens = map(sum, zip(*next_token))
        next_token.clear()
        records.append(dict(step=step + 1, train_loss=loss.item(), ntp_loss=summed / tokens))
        if step + 1 in STATE_STEPS:
            states[step + 1] = {name: p.detach().float().clone() for name, p in trainer.model.named_parameters()}
        print(f"port step:{step + 1}/{steps} train_loss:{records[-1]['train_loss']:.6f} "
              f"ntp_loss:{records[-1]['ntp_loss']:.6f}", flush=True)
    val_loss = train_gpt.evaluate(trainer, steps)
    hook.remove()
    return dict(steps=records, val=[dict(step=steps, val_loss=val_loss)], states=states)


def measure_floor(out: Path, rows: dict[int, dict[str, torch.Tensor]]) -> tuple[dict[str, float], dict]:
    """#89 against itself with one numerics flag changed: the tolerances of the next-token loss (from its largest
    difference over the steps) and of the validation loss; and for each comparison, after each of STATE_STEPS, each
    parameter's tolerance from its kind's floor (PARAMETER_FLOORS; of a table, over `rows`: those looked up by
    then)."""
    (reference, _), (perturbed, _) = NUMERICS.items()
    losses = [json.loads((out / f"{tag_of(name)}.json").read_text()) for name in NUMERICS]
    config = losses[0]["config"]
    per_step, val = compare_losses(losses[1], losses[0])
    assert any(per_step) or val, "the two numerics gave identical runs: no floor to measure"
    print(f"\nnoise floor: #89 with {perturbed} against #89 with {reference}, same seed and batches")
    print("step  ntp_loss (ref)  ntp_loss (other)  |diff|/ref")
    for record, other, diff in zip(losses[0]["steps"], losses[1]["steps"], per_step):
        print(f"{record['step']:4d}  {record['ntp_loss']:14.6f}  {other['ntp_loss']:16.6f}  {diff:.2e}")
    print(f"validation loss: {losses[0]['val'][-1]['val_loss']:.6f} vs {losses[1]['val'][-1]['val_loss']:.6f}, "
          f"|diff|/ref {val:.2e}")
    floors = {}  # ((reference, other), step) -> parameter -> ||other - reference|| / ||reference||
    for pair in dict.fromkeys(pair for pairs in PARAMETER_FLOORS.values() for pair in pairs):
        for step in STATE_STEPS:
            floors[pair, step] = diffs = compare_parameters(
                *(port_parameters(out / f"{tag_of(name)}_step{step}.pt", config) for name in reversed(pair)),
                rows[step])
            worst = sorted(diffs.items(), key=lambda item: -item[1])
            print(f"parameters after step {step}, #89 with {pair[1]} against #89 with {pair[0]}: largest "
                  "||a - b|| / ||b|| " + ", ".join(f"{name} {diff:.2e}" for name, diff in worst[:5]))
    parameter_tolerances = {compared: {step: kind_tolerances([floors[pair, step] for pair in pairs])
                                       for step in STATE_STEPS} for compared, pairs in PARAMETER_FLOORS.items()}
    print("\nfloors and the port's tolerances (the larger of 5 x floor and the fixed bound):")
    tolerances = {}
    for what, floor in dict(loss=max(per_step), val_loss=val).items():
        tolerances[what] = max(FLOOR_MULTIPLE * floor, FIXED_BOUNDS[what])
        print(f"  {what:28s} floor {floor:.2e}  tolerance {tolerances[what]:.2e}")
    for compared, by_step in parameter_tolerances.items():
        for step, by_name in by_step.items():
            held = sum(tolerance > FIXED_BOUNDS["parameter"] for tolerance in by_name.values())
            print(f"  each parameter after step {step} against #89 with {compared}: {held} of {len(by_name)} held to "
                  f"5 x their kind's floor, the rest to {FIXED_BOUNDS['parameter']:.0%}")
    return tolerances, parameter_tolerances


def kind_tolerances(floors: list[dict[str, float]]) -> dict[str, float]:
    """Each parameter's tolerance: FLOOR_MULTIPLE times the largest floor of its kind in any of `floors` (the same
    parameters in each), or the fixed bound where that is larger."""
    largest = {}
    for diffs in floors:
        for name, diff in diffs.items():
            largest[kind_of(name)] = max(largest.get(kind_of(name), 0.0), diff)
    return {name: max(FLOOR_MULTIPLE * largest[kind_of(name)], FIXED_BOUNDS["parameter"]) for name in floors[0]}


def compare_port(port: dict, head: dict, out: Path, tag: str, tolerances: dict[str, float],
                 parameter_tolerances: dict[int, dict[str, float]], rows: dict[int, dict[str, torch.Tensor]]
                 ) -> list[str]:
    """The port's run against #89's, printed step by step and tensor by tensor: what exceeds its tolerance."""
    failures = []
    per_step, val = compare_losses(port, head)
    print(f"\nthis file against #89 ({tag}), from the same initial weights and batches")
    print("step  ntp_loss #89  ntp_loss port  |diff|/#89   train_loss #89  train_loss port")
    for ours, theirs, diff in zip(port["steps"], head["steps"], per_step):
        over = diff > tolerances["loss"]
        print(f"{ours['step']:4d}  {theirs['ntp_loss']:12.6f}  {ours['ntp_loss']:13.6f}  {diff:.2e}"
              f"{' !' if over else '  '}  {theirs['train_loss']:14.6f}  {ours['train_loss']:15.6f}")
        failures += [f"next-token loss at step {ours['step']}: {diff:.2e}"] if over else []
    print(f"validation loss: #89 {head['val'][-1]['val_loss']:.6f}, port {port['val'][-1]['val_loss']:.6f}, "
          f"|diff|/#89 {val:.2e} (tolerance {tolerances['val_loss']:.2e})")
    failures += [f"validation loss: {val:.2e}"] if val > tolerances["val_loss"] else []
    for step, ours in port["states"].items():
        theirs = head_weights.port_names(head_state(out / f"{tag}_step{step}.pt")[0], ours)
        diffs = compare_parameters(ours, theirs, rows[step])
        tolerance = parameter_tolerances[step]
        print(f"parameters after step {step}, ||port - #89|| / ||#89|| against the tensor's tolerance (! over it):")
        for name, diff in sorted(diffs.items(), key=lambda item: -item[1] / tolerance[item[0]]):
            print(f"  {name:48s} {diff:.2e}  tolerance {tolerance[name]:.2e}{' !' if diff > tolerance[name] else ''}")
        worst = max(diffs, key=lambda name: diffs[name] / tolerance[name])
        print(f"parameters after step {step}: {sum(diffs[n] > tolerance[n] for n in diffs)} of {len(diffs)} over "
              f"their tolerance; the closest, {worst}: {diffs[worst]:.2e} of {tolerance[worst]:.2e} "
              f"({diffs[worst] / tolerance[worst]:.0%})")
        failures += [f"{name} after step {step}: {diff:.2e} (tolerance {tolerance[name]:.2e})"
                     for name, diff in diffs.items() if diff > tolerance[name]]
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="head_cpu's steps (its schedules are scaled to them)")
    parser.add_argument("--out", default="", help="folder for the runs' files (default: a temporary one)")
    parser.add_argument("--reuse", action="store_true", help="keep #89's runs whose files are in --out already")
    args = parser.parse_args(argv)
    if args.steps < max(STATE_STEPS):
        parser.error(f"--steps {args.steps}: the parameters are compared after steps {STATE_STEPS}; give at least "
                     f"{max(STATE_STEPS)}")
    if args.out:
        need_out_folder("--out", Path(args.out))
    if not (HEAD_CPU / "run_head_cpu.py").is_file():
        print(f"skipped: {HEAD_CPU} is missing (record #89's trainer on a CPU; it sits beside the repository in "
              "../shared)")
        return 0
    if not GPT2_RANKS.is_file():
        sys.exit(f"{GPT2_RANKS} is missing: #89 builds its prefix-token table from the GPT-2 ranks; fetch them with "
                 "`python data/gpt2_tokenizer.py --fetch`")
    out = Path(args.out or tempfile.mkdtemp(prefix="vs_head_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"head_cpu: {HEAD_CPU}; {args.steps} steps at its default tiny configuration; files in {out}")
    runs = [run for name, flags in HEAD_FLAGS.items() for run in head_runs(name, flags, args.steps, out)]
    run_two_at_a_time([(cmd, log) for cmd, log in runs if not (args.reuse and Path(cmd[-1]).is_file())])
    rows = looked_up_rows(json.loads((out / f"{tag_of(next(iter(NUMERICS)))}.json").read_text())["config"])
    tolerances, parameter_tolerances = measure_floor(out, rows)
    failures = []
    for name, fp8_head in COMPARED.items():
        head = json.loads((out / f"{tag_of(name)}.json").read_text())
        port = port_run(head["config"], out / f"{tag_of(name)}_step0.pt", args.steps, fp8_head)
        over = compare_port(port, head, out, tag_of(name), tolerances, parameter_tolerances[name], rows)
        failures += [f"{name}: {failure}" for failure in over]
    print("\n" + (f"{len(failures)} over their tolerance: " + "; ".join(failures[:10]) if failures
                  else "every loss and parameter within its tolerance"))
    return 1 if failures else 0


if __name__ == "__main__":
    run_tool(main, train_gpt.UserError)
