"""Text from a checkpoint (--sample) and during training (--sample_every), through the training model's own forward;
bad sampling input refused by name."""
import os
import re
import subprocess
import sys

import pytest
import torch

import train_gpt
from conftest import REPO_ROOT
from synthetic import tiny_flags
from train_gpt import run_on_ranks

STEPS = 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory, files):
    """A tiny run's checkpoint after STEPS steps, in one process."""
    logs = tmp_path_factory.mktemp("logs")
    train_gpt.main(tiny_flags(files, log_dir=logs, run_id="saved", num_iterations=STEPS, save_every=STEPS,
                              val_loss_every=0))
    return logs / "saved" / f"step{STEPS:06d}.pt"


def model_of(path):
    state = train_gpt.load_checkpoint(path)
    args = train_gpt.Hyperparameters(**state["hyperparameters"])
    model = train_gpt.build_model(args, torch.device("cpu"))
    model.load_state_dict(state["model"])
    return args, model


def test_greedy_samples_follow_the_argmax_of_the_training_forward_on_each_prefix(saved):
    args, model = model_of(saved)
    prompt = [train_gpt.EOT_TOKEN, 464, 3290, 318]
    window = train_gpt.window_tokens(args.num_iterations, args)
    new = list(train_gpt.generate(model, prompt, 40, 1.0, 1, window, args.vocab_size, torch.Generator()))
    assert len(new) >= 10 and len(set(new)) > 1  # (up to an end-of-text token)
    # the reference: the training forward (train mode, the whole sequence at once, padded with another token) and its
    # argmax at each position before a generated token
    sequence = torch.tensor(prompt + new + [7] * (128 - len(prompt) - len(new)))
    model.train()
    with torch.no_grad():
        logits = model(sequence.to(torch.int32), None, train_gpt.window_tensor(window, torch.device("cpu")))
    expected = logits[:, :args.vocab_size].argmax(-1)
    assert new == expected[len(prompt) - 1:len(prompt) + len(new) - 1].tolist()


def resave_on_rank(rank, world_size, path, out, flags):
    """Restore the one-process checkpoint under a layout and write it again from there."""
    args = train_gpt.parse_args(flags, cuda=False)
    trainer = train_gpt.build_trainer(args, train_gpt.build_parallel_context(rank, world_size, torch.device("cpu"),
                                                                             args.tp, args.pp))
    state = train_gpt.load_checkpoint(path)
    train_gpt.restore_checkpoint(state, path, trainer)
    train_gpt.save_checkpoint(out, trainer, **{k: state[k] for k in ("step", "run_id", "data", "training_time_ms",
                                                                     "log_bytes", "log_sha256", "hyperparameters")})


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2)])
def test_a_checkpoint_written_under_a_layout_samples_the_one_process_text(saved, files, tmp_path, gpt2_ranks, capsys,
                                                                          layout):
    resaved = tmp_path / "resaved.pt"
    run_on_ranks(resave_on_rank, 2, saved, resaved, tiny_flags(files, **layout))
    texts = []
    for path in (saved, resaved):
        train_gpt.main(["--sample", str(path), "--prompt", "To be, or not", "--max_new_tokens", "24", "--seed", "3",
                        "--num_samples", "2"])
        texts.append(re.sub(r"\d+\.\d tokens/s|in \d+\.\d s", "", capsys.readouterr().out))
    assert texts[0] == texts[1] and texts[0].count("--- sample ") == 2 and "To be, or not" in texts[0]


@pytest.mark.parametrize("flags, words", [
    (["--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
    (["--top_k", "50258"], "--top_k must be between 0 (all tokens) and --vocab_size 50257, got 50258"),
    (["--max_new_tokens", "0"], "--max_new_tokens must be a whole number > 0 and below 2**31, got 0"),
])
def test_bad_sampling_values_are_refused_by_name(flags, words):
    with pytest.raises(train_gpt.UserError) as error:
        train_gpt.parse_args(["--preset", "tiny", "--sample", "x.pt", *flags], cuda=False)
    assert words in str(error.value)


def test_a_missing_or_incomplete_checkpoint_and_an_overlong_prompt_are_refused(saved, tmp_path, gpt2_ranks):
    with pytest.raises(train_gpt.UserError, match=r"--sample nowhere\.pt: no such file"):
        train_gpt.main(["--sample", "nowhere.pt"])
    state = torch.load(saved, weights_only=True)
    del state["model"]
    torch.save(state, tmp_path / "incomplete.pt")
    with pytest.raises(train_gpt.UserError, match=r"incomplete\.pt lacks model: it is incomplete"):
        train_gpt.main(["--sample", str(tmp_path / "incomplete.pt")])
    with pytest.raises(train_gpt.UserError, match=r"--prompt is \d+ tokens with the document start, and 100 new ones "
                                                  r"\(--max_new_tokens\) would not fit the model's context of 128 "
                                                  r"tokens .*: shorten the prompt"):
        train_gpt.main(["--sample", str(saved), "--prompt", "to be " * 100])


def sampled(path, *flags):
    """--sample's texts (what main prints)."""
    return train_gpt.sample_from_checkpoint(train_gpt.parse_args(["--sample", str(path), *flags], cuda=False))


def test_new_tokens_beyond_the_context_are_refused_and_a_sample_is_printed_token_by_token(saved, gpt2_ranks, capsys,
                                                                                         monkeypatch):
    """Issue 32, case 3: --max_new_tokens 2147483647 once printed nothing for years; now what the model cannot attend
    to is refused, and a sample shows from its first token on."""
    with pytest.raises(train_gpt.UserError, match=r"--prompt is 3 tokens with the document start, and 2147483647 new "
                                                  r"ones .* context of 128 tokens .*: ask for at most 125 new tokens"):
        train_gpt.main(["--sample", str(saved), "--prompt", "To be", "--max_new_tokens", "2147483647"])
    seen, real_generate = [], train_gpt.generate

    def watched(*args, **kwargs):  # what the console holds when the next token is asked for
        for token in real_generate(*args, **kwargs):
            yield token
            seen.append((token, capsys.readouterr().out))
    monkeypatch.setattr(train_gpt, "generate", watched)
    texts = sampled(saved, "--prompt", "To be", "--max_new_tokens", "40", "--top_k", "0")
    encoding = train_gpt.gpt2_encoding()
    assert len(seen) > 10 and seen[0][1] == "--- sample 1 of 1\nTo be" + encoding.decode([seen[0][0]])
    assert "".join(out for token, out in seen) == "--- sample 1 of 1\n" + texts[0]  # each token printed as drawn


def test_a_prompt_may_hold_a_document_start_and_the_least_temperature_samples_the_greedy_text(saved, gpt2_ranks,
                                                                                              capsys):
    """Issue 32, case 5: `<|endoftext|>` in --prompt once raised tiktoken's ValueError (it is the token that starts
    each document), and --temperature 1e-45 gave inf and nan to multinomial (it is greedy sampling)."""
    args = train_gpt.parse_args(["--preset", "tiny", "--prompt", "<|endoftext|> hello", "--sample_every", "10"],
                                cuda=False)
    encoding = train_gpt.gpt2_encoding()
    assert train_gpt.sampling_prompt(args, encoding, 128, 1) == [train_gpt.EOT_TOKEN] * 2 + encoding.encode(" hello")
    texts = [sampled(saved, "--prompt", "<|endoftext|>To be", "--max_new_tokens", "40", *flags)
             for flags in (["--temperature", "1e-45", "--top_k", "0"], ["--top_k", "1"])]
    assert texts[0] == texts[1] and texts[0][0].startswith("<|endoftext|>To be") and len(texts[0][0]) > 30


@pytest.mark.parametrize("saved_flags, words", [
    (dict(model_dim="32"), "holds model_dim '32', not of type int"),  # once a TypeError while building the model
    (dict(vocab_size=10**12), "--vocab_size must be a whole number > 0 and below 2**31, got 1000000000000"),
    (dict(train_seq_len="100"), "--train_seq_len '100': each stage's must be a multiple of 128"),  # once blamed --prompt
    (dict(fp8_head="yes"), "holds fp8_head 'yes', not of type bool"),
])
def test_a_checkpoint_whose_flags_the_command_line_would_refuse_is_refused_before_sampling(saved, tmp_path,
                                                                                           saved_flags, words):
    """Issue 32, cases 5 and 11: a checkpoint's hyperparameters are held to the flags' rules, named as its own."""
    state = torch.load(saved, weights_only=True)
    state["hyperparameters"].update(saved_flags)
    edited = tmp_path / "edited.pt"
    torch.save(state, edited)
    with pytest.raises(train_gpt.UserError) as error:
        train_gpt.main(["--sample", str(edited)])
    assert str(error.value).startswith(f"checkpoint {edited} holds ") and words in str(error.value), str(error.value)
    assert "preset's" not in str(error.value)


def test_sample_every_prints_samples_at_validation_and_changes_no_loss(files, tmp_path, gpt2_ranks, capsys):
    logs = []
    for run_id, sample_every in (("plain", 0), ("sampled", 2)):
        train_gpt.main(tiny_flags(files, log_dir=tmp_path, run_id=run_id, num_iterations=4, val_loss_every=2,
                                  sample_every=sample_every))
        text = (tmp_path / f"{run_id}.txt").read_text()
        logs.append([re.sub(r" train_time.*", "", line) for line in text.splitlines() if line.startswith("step:")])
    out = capsys.readouterr().out
    assert logs[0] == logs[1]
    assert [int(step) for step in re.findall(r"^sample: step:(\d+) '", out, re.M)] == [0, 2, 4]


RUN_AS_A_SCRIPT = """import runpy, sys
sys.argv = ["train_gpt.py", *sys.argv[1:]]
try:
    runpy.run_path("train_gpt.py", run_name="__main__")
finally:
    print("imported:", sorted(name for name in sys.modules if name == "train_gpt" or name.split(".")[0] == "data"))
"""


def test_sampling_with_the_prefix_loss_runs_the_trainer_once_as_a_script(tmp_path, files, gpt2_ranks, monkeypatch):
    # the prefix loss and the sampler read GPT-2's ranks from the trainer itself: python train_gpt.py imports nothing
    # of data/ (whose scripts import the trainer), so the file never runs a second time as another module
    monkeypatch.setenv("GPT2_TIKTOKEN_FILE", str(gpt2_ranks))
    logs = tmp_path / "logs"
    train_gpt.main(tiny_flags(files, log_dir=logs, run_id="prefix", num_iterations=1, adam_every=1, save_every=1,
                              val_loss_every=0, prefix_loss=True))
    done = subprocess.run([sys.executable, "-c", RUN_AS_A_SCRIPT, f"--sample={logs / 'prefix' / 'step000001.pt'}",
                           "--max_new_tokens=8", "--prompt=Hello"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0 and "Hello" in done.stdout, done.stdout[-2000:] + done.stderr
    assert done.stdout.splitlines()[-1] == "imported: []", done.stdout[-2000:]
