"""Nothing a user types loses work: bad run ids, data that runs short, token ids outside the vocabulary, values that
cannot train, file-system faults and incomplete checkpoints are refused before any training step, with the file,
flag or value named and every earlier log and checkpoint left byte for byte as it was."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt
from conftest import REPO_ROOT
from train_gpt import run_on_ranks
from synthetic import tiny_flags


def flags(files, tmp_path, run_id="run", **overrides):
    return tiny_flags(files, **dict(dict(log_dir=tmp_path / "logs", run_id=run_id, num_iterations=8,
                                         val_loss_every=4), **overrides))


def snapshot(folder):
    """Every file under folder and its bytes."""
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def refused(argv, *words):
    """main(argv) refuses with a UserError naming every one of words, before any training step."""
    with pytest.raises(train_gpt.UserError) as error:
        train_gpt.main([str(a) for a in argv])
    for word in words:
        assert str(word) in str(error.value), (word, str(error.value))
    return str(error.value)


def trainer(*argv, **kwargs):
    """train_gpt.py as a user runs it, in its own process."""
    return subprocess.Popen([sys.executable, str(REPO_ROOT / "train_gpt.py"), *map(str, argv)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


# 1. a refused resume leaves the log alone

def test_a_resume_refused_for_its_data_leaves_the_log_and_checkpoints_byte_for_byte(tmp_path, files):
    train_gpt.main(flags(files, tmp_path, "C", save_every=4, doc_max_tokens=0))  # (a stream: batches by hand)
    before = snapshot(tmp_path / "logs")
    small = tmp_path / "small"
    small.mkdir()
    train_gpt.write_data_shard(small / "synth_train_000001.bin", np.full(3000, 7))  # the same name, 3000 tokens
    refused(flags(files, tmp_path, "C", save_every=4, resume=tmp_path / "logs" / "C" / "step000004.pt",
                  train_files=small / "*.bin", doc_max_tokens=0), "--train_files", "synth_train_000001.bin",
            "steps 5..5", "up to step 8")
    assert snapshot(tmp_path / "logs") == before


# 2. run ids

def test_a_fresh_run_refuses_an_id_that_has_a_log_or_checkpoints(tmp_path, files):
    train_gpt.main(flags(files, tmp_path, "C", save_every=4))
    before = snapshot(tmp_path / "logs")
    refused(flags(files, tmp_path, "C"), "run id C is taken", str(tmp_path / "logs" / "C.txt"),
            "2 checkpoint(s)", "--run_id C --resume latest", "pick another --run_id")
    (tmp_path / "logs" / "C" / "step000004.pt").unlink()
    (tmp_path / "logs" / "C" / "step000008.pt").unlink()
    del before[tmp_path / "logs" / "C" / "step000004.pt"], before[tmp_path / "logs" / "C" / "step000008.pt"]
    words = refused(flags(files, tmp_path, "C"), "run id C is taken", "pick another --run_id")  # a log alone
    assert "--resume latest" not in words
    assert snapshot(tmp_path / "logs") == before


def test_a_checkpoint_of_another_run_may_not_start_over_an_existing_log(tmp_path, files):
    train_gpt.main(flags(files, tmp_path, "A", save_every=4))
    train_gpt.main(flags(files, tmp_path, "B"))
    before = snapshot(tmp_path / "logs")
    refused(flags(files, tmp_path, "B", resume=tmp_path / "logs" / "A" / "step000004.pt"), "run id B is taken")
    assert snapshot(tmp_path / "logs") == before


def test_a_resumed_run_whose_log_falls_short_of_its_checkpoint_keeps_that_log_aside(tmp_path, files, capsys):
    train_gpt.main(flags(files, tmp_path, "C", save_every=4))
    log = tmp_path / "logs" / "C.txt"
    log.write_bytes(log.read_bytes()[:500])  # cut short behind the run's back
    short = log.read_bytes()
    train_gpt.main(flags(files, tmp_path, "C", resume=tmp_path / "logs" / "C" / "step000004.pt"))
    assert (tmp_path / "logs" / "C.txt.earlier").read_bytes() == short and "kept as" in capsys.readouterr().out
    assert log.read_text().startswith('"""GPT-2 speedrun trainer') and "resumed: step:4/8" in log.read_text()


def test_after_an_elastic_restart_that_found_no_checkpoint_the_dead_attempt_s_log_is_moved_aside(tmp_path, files,
                                                                                                monkeypatch):
    train_gpt.main(flags(files, tmp_path, "E"))  # an attempt that saved no checkpoint
    log = tmp_path / "logs" / "E.txt"
    (tmp_path / "logs" / "E.txt.attempt1").write_text("an earlier restart's log")  # taken: the next free name
    dead = log.read_bytes()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    train_gpt.main(flags(files, tmp_path, "E", resume="latest"))
    assert (tmp_path / "logs" / "E.txt.attempt1.2").read_bytes() == dead
    assert (tmp_path / "logs" / "E.txt.attempt1").read_text() == "an earlier restart's log"
    assert "no checkpoint of run E yet: starting from step 0" in log.read_text()


def test_a_failure_of_a_check_on_rank_0_stops_every_rank():
    assert run_on_ranks(failing_check_on_rank_0, 2) == ["OSError", "RuntimeError: broken_check failed on rank 0: "
                                                        "OSError: [Errno 5] disk gone"]


def failing_check_on_rank_0(rank, world_size):
    def broken_check():
        raise OSError(5, "disk gone")
    try:
        train_gpt.on_master(broken_check)
    except Exception as e:
        return type(e).__name__ if rank == 0 else f"{type(e).__name__}: {e}"


# 3. data that runs short, found from the shard headers

def test_a_validation_shard_smaller_than_val_tokens_is_refused_with_what_fits(tmp_path, files):
    words = refused(flags(files, tmp_path, val_tokens=8192, val_seq_len=128, val_loss_every=0), "--val_tokens 8192",
                    "needs 8193 tokens in one shard", "whose largest holds 6000", "use --val_tokens 5888 or less")
    assert not (tmp_path / "logs" / "run.txt").exists(), words
    train_gpt.main(flags(files, tmp_path, val_tokens=5888, val_seq_len=128, num_iterations=1,
                         adam_every=1))  # and that fits


@pytest.mark.parametrize("doc_max_tokens", [0, 256])
def test_training_shards_too_short_for_the_run_are_refused_with_the_steps_that_fit(tmp_path, files, doc_max_tokens):
    # as a stream, 150,000 training tokens in batches of 4 x 128 = 512: 292 batches (each needs 513 tokens in its
    # shard); as documents, as many as the loader itself delivers before it runs out
    loader = train_gpt.DistributedDataLoader(files["train_files"], 128, 4, 0, 1, train_gpt.torch.device("cpu"),
                                             doc_max_tokens=doc_max_tokens)
    micro_batches = 0
    with pytest.raises(train_gpt.UserError, match="out of data"):
        while True:
            next(loader)
            micro_batches += 1
    steps = micro_batches // 4
    assert steps == 292 if not doc_max_tokens else 100 < steps < 292  # documents cut short waste their rest (135)
    refused(flags(files, tmp_path, num_iterations=500, val_loss_every=0, doc_max_tokens=doc_max_tokens),
            "--train_files", f"steps 1..{steps}", "up to step 500", f"--num_iterations {steps}",
            *[f"--doc_max_tokens {doc_max_tokens}"] * bool(doc_max_tokens))
    # a batch larger than any shard: no step fits, and fewer steps would not help
    refused(flags(files, tmp_path, seqs_per_step=2048, val_loss_every=0, doc_max_tokens=doc_max_tokens),
            "--train_files", "hold no batch", "lower --seqs_per_step or --train_seq_len")


def test_shards_too_short_for_a_staged_batch_are_refused_with_a_step_count_whose_stages_fit(tmp_path, files):
    # 150,000 tokens as a stream, 300 steps in thirds: 100 batches of 4 x 128 tokens (51,200), then of 4 x 256, each
    # needing 1,025 in the shard: 96 more (51,200 + 95 x 1,024 + 1,025 <= 150,000). N steps take round(N / 3)
    # batches of 512 and the rest of 1,024, plus the last target: 175 fit (58 x 512 + 117 x 1,024 + 1 = 149,505),
    # 176 do not (59 x 512 + 117 x 1,024 + 1 = 150,017)
    staged = dict(train_seq_len="128,256,256,256", doc_max_tokens=0, val_loss_every=0)
    refused(flags(files, tmp_path, num_iterations=300, **staged), "--train_files", "steps 1..196", "up to step 300",
            "(step 197's 1024)", "--num_iterations 175")
    for steps, fits in ((175, True), (176, False)):
        args = train_gpt.parse_args(flags(files, tmp_path, num_iterations=steps, **staged), cuda=False)
        if fits:
            train_gpt.check_data(args, 1, None)
        else:
            with pytest.raises(train_gpt.UserError, match="--num_iterations 175"):
                train_gpt.check_data(args, 1, None)


# 4. token ids outside the vocabulary

def test_a_token_id_outside_the_vocabulary_is_refused_before_training_naming_the_file(tmp_path):
    tokens = np.arange(20_000) % 1000
    tokens[::199] = train_gpt.EOT_TOKEN  # documents of 199 tokens
    tokens[3000] = 50257
    (tmp_path / "data").mkdir()
    train_gpt.write_data_shard(tmp_path / "data" / "bad_train_000001.bin", tokens)
    train_gpt.write_data_shard(tmp_path / "data" / "bad_val_000000.bin", tokens[:5000] % 50257)
    files = dict(train_files=tmp_path / "data" / "bad_train_*.bin", val_files=tmp_path / "data" / "bad_val_*.bin")
    refused(flags(files, tmp_path), "bad_train_000001.bin", "token id 50257", "the first at token 3000",
            "--vocab_size 50257")
    assert not (tmp_path / "logs" / "run.txt").exists()


def test_a_vocabulary_without_the_end_of_text_token_is_refused_at_parse_time():
    with pytest.raises(train_gpt.UserError, match="--vocab_size 50256 must be above 50256, the end-of-text token"):
        train_gpt.parse_args(["--preset", "tiny", "--vocab_size", "50256"], cuda=False)


# 5. values that pass the type check but cannot train

@pytest.mark.parametrize("argv, words", [
    (["--attention_free_layers", "0,2"], "--value_embed_layers '1,2,5' (the tiny preset's) names layers [2], which "
                                         "have no attention (--attention_free_layers '0,2')"),
    (["--value_embed_layers", "1,1"], "--value_embed_layers '1,1' names layers [1] more than once"),
    (["--model_dim", "8", "--num_heads", "2", "--head_dim", "4"], "--model_dim 8: the smear's gate reads 12 channels"),
    (["--lr_muon", "nan"], "--lr_muon must be a finite number >= 0, got nan"),
    (["--lr_embed", "-0.1"], "--lr_embed must be a finite number >= 0, got -0.1"),
    (["--lr_head", "inf"], "--lr_head must be a finite number >= 0, got inf"),
    (["--seed", "-1"], "--seed must be a whole number >= 0 and below 2**63, got -1"),
    (["--seed", str(2**63)], "--seed must be a whole number >= 0 and below 2**63"),
    (["--run_id", ".."], "--run_id '..' would put the run's log and checkpoints outside --log_dir"),
    (["--run_id", "a/b"], "--run_id 'a/b' would put"),
    (["--run_id", "..."], "--run_id '...' would put"),
    # issue 32, case 8: once a UnicodeEncodeError and an OverflowError
    (["--run_id", "bad\udcffid"], "--run_id 'bad\\udcffid' holds bytes that are not UTF-8 text"),
    (["--run_id", "a\nb"], "--run_id 'a\\nb' holds control characters"),
    (["--collective_timeout", "1e15"], "--collective_timeout must be below 2**31 seconds (68 years), got 1e+15"),
    (["--narrow_qk_layers", "4"], "--narrow_qk_layers '4' names layers [4], which have no attention"),
    (["--narrow_v_layers", "5", "--mudd", "true"], "--narrow_v_layers '5' names the last layer, 5, which --mudd true "
                                                   "makes dense: its values take in model-wide states"),
    (["--mlp_free_layers", "1", "--double_mlp_layers", "1,2"], "--mlp_free_layers '1' and --double_mlp_layers '1,2' "
                                                               "both name layers [1]"),
    (["--narrow_attention_scale", "0"], "--narrow_attention_scale must be a finite number > 0, got 0.0"),
    # issue 67: flags that do what they say or are refused
    (["--check_layout", ""], "--check_layout '' names no layout"),
    (["--table_host_fraction", "0.5"], "--table_host_fraction 0.5 keeps rows of a table stepped by row in host "
                                       "memory: it needs --tables_by_rows true, --ngram_optimizer rows"),
    (["--table_host_fraction", "1", "--tables_by_rows", "--ngram_optimizer", "rows"], "must be below 1"),
    (["--top_k", "5"], "--top_k 5 acts only with --sample (a checkpoint to sample from) or --sample_every"),
    (["--nproc", "4"], "--nproc 4 acts only with --plan"),
    (["--anvil_blend_step", "3"], "--anvil_blend_step 3 acts only with --matrix_optimizer anvil"),
    (["--pp_schedule", "afab"], "--pp_schedule 'afab' acts only with --pp 2 or more"),
    (["--ngram_optimizer", "rows", "--ngram_rows", "0"], "--ngram_optimizer 'rows' acts only with an n-gram "
                                                         "table (--ngram_rows)"),
    # issue 65: the n-gram table's flags by their old names
    (["--bigram_rows", "4096"], "--bigram_rows is now --ngram_rows: give that instead"),
    (["--bigram_layers=0,1"], "--bigram_layers is now --ngram_layers: give that instead"),
    (["--bigram_optimizer", "rows"], "--bigram_optimizer is now --ngram_optimizer: give that instead"),
])
def test_values_that_cannot_train_are_refused_at_parse_time(argv, words):
    with pytest.raises(train_gpt.UserError) as error:
        train_gpt.parse_args(["--preset", "tiny", *argv], cuda=False)
    assert words in str(error.value)


def test_heads_too_narrow_for_flexattention_on_cuda_are_refused_by_name_before_the_model_is_built():
    # FlexAttention's Triton kernels take 16 dims a head or more (an InductorError deep in the first compile else);
    # refused as the trainer builds for a CUDA device, which this needs no GPU to reach
    args = train_gpt.parse_args(tiny_flags(dict(train_files="unused", val_files="unused")), cuda=False)
    with pytest.raises(train_gpt.UserError, match=r"--head_dim 8 \(the tiny preset's\): FlexAttention's CUDA kernels "
                                                  r"take heads of 16 dims or more"):
        train_gpt.build_trainer(args, train_gpt.build_parallel_context(0, 1, torch.device("cuda")))
    wide = train_gpt.parse_args(tiny_flags(dict(train_files="unused", val_files="unused"), head_dim=16,
                                           model_dim=64), cuda=False)
    train_gpt.build_trainer(wide, train_gpt.build_parallel_context(0, 1, torch.device("cpu")))  # (CPU: no limit)


def test_a_kill_switch_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(train_gpt.UserError, match=f"--kill_switch {tmp_path} is a directory: name a file"):
        train_gpt.parse_args(["--preset", "tiny", "--kill_switch", str(tmp_path)], cuda=False)


# 6. file-system faults

def test_a_shard_path_that_is_a_directory_is_refused_by_the_trainer_and_check_py_checks_the_rest(tmp_path, files):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "synth_train_000000.bin").mkdir()  # a directory the pattern matches
    train_gpt.write_data_shard(tmp_path / "shards" / "synth_train_000001.bin", np.arange(4000) % 1000)
    pattern = str(tmp_path / "shards" / "synth_train_*.bin")
    refused(flags(files, tmp_path, train_files=pattern), "data shard", "synth_train_000000.bin is not a file")
    check = subprocess.run([sys.executable, str(REPO_ROOT / "data" / "check.py"), pattern], capture_output=True,
                           text=True)
    assert check.returncode == 1 and "Traceback" not in check.stderr
    assert "synth_train_000000.bin is not a file" in check.stdout
    assert f"ok  {tmp_path / 'shards' / 'synth_train_000001.bin'}" in check.stdout  # it went on to the next file


def test_an_unreadable_shard_is_named_with_the_reason(tmp_path, files, monkeypatch):
    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(train_gpt.np, "fromfile", unreadable)  # (root reads any file: fake the refusal)
    with pytest.raises(train_gpt.UserError, match=r"cannot read data shard .*synth_val_000000\.bin: Permission "
                                                  "denied"):
        train_gpt.read_shard_header(files["val_files"].replace("*", "000000"))


def test_a_log_dir_that_cannot_hold_the_run_is_refused_before_the_model_is_built(tmp_path, files, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    refused(flags(files, tmp_path, log_dir=a_file), f"--log_dir {a_file} is a file")
    refused(flags(files, tmp_path, log_dir=a_file / "logs"), f"cannot write in --log_dir {a_file / 'logs'}")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "run").write_text("")  # where the checkpoints of run id "run" go
    refused(flags(files, tmp_path), f"{tmp_path / 'logs' / 'run'} is a file", "pick another --run_id")
    built = []
    monkeypatch.setattr(train_gpt, "build_trainer", lambda *a, **k: built.append(1))
    monkeypatch.setattr(train_gpt.shutil, "disk_usage", lambda path: type("Usage", (), dict(free=100_000))())
    # every checkpoint the run will keep: steps 4 and 8, and one a stop would write
    refused(flags(files, tmp_path, run_id="full", save_every=4), "has 0.1 MiB free", "its log and 3 checkpoint(s)",
            "raise --save_every")
    assert not built


def test_a_log_that_cannot_be_written_is_named(tmp_path):
    args = train_gpt.parse_args(["--preset", "tiny", "--log_dir", str(tmp_path / "gone"), "--run_id", "L"],
                                cuda=False)
    log = train_gpt.RunLog(args, train_gpt.build_parallel_context(0, 1, train_gpt.torch.device("cpu")))
    with pytest.raises(train_gpt.UserError, match=r"cannot write the log .*gone/L\.txt \(No such file or directory\)"):
        log("step:1/20 train_loss:10.8")


def test_a_full_disk_during_a_checkpoint_write_names_the_path_and_leaves_no_temporary_file(tmp_path, files,
                                                                                      monkeypatch):
    train_gpt.main(flags(files, tmp_path, "C", save_every=4, num_iterations=4))
    real_usage = train_gpt.shutil.disk_usage

    def full(obj, f):  # the partial file fills the disk; removing it frees room again
        f.write(b"x" * 1000)
        partial = Path(f.name)
        monkeypatch.setattr(train_gpt.shutil, "disk_usage", lambda path: real_usage(path)._replace(
            free=1000 if partial.exists() else 2**40))
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
    monkeypatch.setattr(train_gpt.torch, "save", full)
    refused(flags(files, tmp_path, "C", save_every=4, resume="latest"), "cannot write checkpoint",
            "step000008.pt", "no space left on the device", "the earlier checkpoints are intact")
    assert sorted(p.name for p in (tmp_path / "logs" / "C").iterdir()) == ["step000004.pt"]


# 7. checkpoints

def test_an_incomplete_checkpoint_is_refused_naming_what_it_lacks_and_the_log_is_untouched(tmp_path, files):
    train_gpt.main(flags(files, tmp_path, "C", save_every=4))
    path = tmp_path / "logs" / "C" / "step000004.pt"
    state = train_gpt.torch.load(path, weights_only=True)
    before = snapshot(tmp_path / "logs")
    for broken, words in (({k: v for k, v in state.items() if k != "data"}, "lacks data"),
                          (dict(state, adam={k: v for k, v in state["adam"].items() if k != "embed.weight"}),
                           "no Adam state for embed.weight"),
                          (dict(state, adam=dict(state["adam"], **{"lm_head.weight": {"step": train_gpt.torch.tensor(1.0)}})),
                           "no Adam state for lm_head.weight.exp_avg"),
                          (dict(state, muon={k: v for k, v in state["muon"].items()
                                             if k != "blocks.0.mlp.c_fc.weight"}),
                           "no Muon state for blocks.0.mlp.c_fc.weight")):
        bad = tmp_path / "bad.pt"
        train_gpt.torch.save(broken, bad)
        refused(flags(files, tmp_path, "C", resume=bad), f"checkpoint {bad}", words, "resume from another one")
    assert snapshot(tmp_path / "logs") == before


def test_resuming_past_num_iterations_is_refused(tmp_path, files):
    train_gpt.main(flags(files, tmp_path, "C", save_every=8))
    before = snapshot(tmp_path / "logs")
    refused(flags(files, tmp_path, "C", resume="latest", num_iterations=4), "is at step 8, past --num_iterations 4",
            "resume with --num_iterations 8")
    assert snapshot(tmp_path / "logs") == before


# 9. flags

def test_a_bare_boolean_flag_means_true_and_false_still_works():
    assert train_gpt.parse_args(["--preset", "tiny", "--fp8_head"], cuda=False).fp8_head is True
    assert train_gpt.parse_args(["--preset", "tiny", "--fp8_head", "false"], cuda=False).fp8_head is False
    assert train_gpt.parse_args(["--preset", "tiny", "--plan"], cuda=False).plan is True


# exit status 2 and one line, not a traceback, as a user sees it

def test_refusals_exit_2_with_one_error_line(tmp_path, files):
    out = trainer(*flags(files, tmp_path, num_iterations=500), cwd=tmp_path)
    _, err = out.communicate(timeout=120)
    assert out.returncode == 2 and err.startswith("error: --train_files") and "Traceback" not in err


class Payload:
    """What a crafted pickle holds: unpickled in full, it runs code (here: writes a file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def load_head_state(path):
    import benchmark_vs_head  # (tests/: imports head_weights, which reads ../shared/head_cpu only when run)
    return benchmark_vs_head.head_state(path)


def load_head_tensors(path):
    import head_weights
    return head_weights.load_tensors(path)


# every torch.load of the repository: the trainer's checkpoints, head_cpu's states and the fp32 forward's file (by
# head_weights.py and benchmark_vs_head.py)
@pytest.mark.parametrize("load", [train_gpt.load_checkpoint, load_head_tensors, load_head_state])
def test_a_crafted_pickle_is_refused_by_every_loader_without_running_its_code(tmp_path, load):
    marker, crafted = tmp_path / "ran.txt", tmp_path / "head_step1.pt"
    torch.save({"format": train_gpt.CHECKPOINT_FORMAT, "model": Payload(marker), "step": 1}, crafted)
    with pytest.raises(train_gpt.UserError, match=rf"{crafted}"):
        load(crafted)
    assert not marker.exists()
    torch.load(crafted, weights_only=False)  # (what the file does when loaded in full: the test's premise)
    assert marker.read_text() == "ran"


def test_head_weights_refuses_a_crafted_state_in_its_out_folder_in_one_line_running_no_code(tmp_path, gpt2_ranks):
    # the reported case: `tests/head_weights.py --out DIR` reuses the states it finds in DIR
    import head_weights
    if not (head_weights.HEAD_CPU / "run_head_cpu.py").is_file():
        pytest.skip(f"{head_weights.HEAD_CPU} is missing")
    marker, out = tmp_path / "ran.txt", tmp_path / "out"
    out.mkdir()
    (out / "head_step1.json").write_text("{}")  # (head_cpu's run counts as done: its state is read next)
    torch.save({"model": Payload(marker)}, out / "head_step1.pt")
    done = subprocess.run([sys.executable, "tests/head_weights.py", "--out", str(out), "--no_fp32"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not marker.exists(), (done.returncode, done.stderr[-2000:])
    assert done.stderr.startswith(f"error: {out / 'head_step1.pt'} is not a file of tensors in plain containers")
    assert len(done.stderr.strip().splitlines()) == 1


def test_shards_without_a_document_start_are_named_as_the_cause_when_sequences_hold_documents(tmp_path, files):
    # no --seqs_per_step or --train_seq_len helps: the shards hold no end-of-text token, so no document starts
    stream = tmp_path / "stream"
    stream.mkdir()
    tokens = np.random.default_rng(0).integers(0, train_gpt.EOT_TOKEN, 100_000).astype(np.uint16)
    train_gpt.write_data_shard(stream / "stream_train_000001.bin", tokens)
    words = refused(flags(files, tmp_path, train_files=stream / "stream_train_*.bin", doc_max_tokens=128),
                    "hold no end-of-text token (50256), so no document starts in them", "--doc_max_tokens 0")
    assert "lower --seqs_per_step" not in words
    train_gpt.main(flags(files, tmp_path, train_files=stream / "stream_train_*.bin", doc_max_tokens=0,
                         num_iterations=2, val_loss_every=0))  # (as one stream, they train)


@pytest.mark.parametrize("case", ["dangling log", "log moved away", "folder of another run"])
def test_a_log_or_checkpoint_folder_that_is_a_link_is_refused_naming_it_and_nothing_outside_changes(tmp_path, files,
                                                                                                     case):
    outside = tmp_path / "archive"
    outside.mkdir()
    logs = tmp_path / "logs"
    if case == "dangling log":  # a link to a file outside that does not exist
        logs.mkdir()
        (logs / "run.txt").symlink_to(outside / "gone.txt")
        link, words = logs / "run.txt", ["this run's log", "which does not exist"]
    elif case == "log moved away":  # the run's log moved to an archive and linked back; resumed from its checkpoint
        train_gpt.main(flags(files, tmp_path, num_iterations=4, save_every=2, val_loss_every=0))
        (logs / "run.txt").rename(outside / "run.txt")
        (logs / "run.txt").symlink_to(outside / "run.txt")
        link, words = logs / "run.txt", ["this run's log", f"is a link to {outside / 'run.txt'}"]
    else:  # another run's checkpoint folder linked in as this run's
        train_gpt.main(flags(files, tmp_path, run_id="other", num_iterations=2, save_every=2, val_loss_every=0))
        (logs / "run").symlink_to(logs / "other")
        link, words = logs / "run", ["this run's checkpoint folder", "is a link to"]
    before = snapshot(tmp_path)
    refused(flags(files, tmp_path, num_iterations=4, save_every=2, val_loss_every=0, resume="latest"), *words,
            str(link), "never through a link")
    assert snapshot(tmp_path) == before and link.is_symlink()
