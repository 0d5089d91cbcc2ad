"""Record #92's own code (../shared/head92_cpu: excerpts of its trainer, run on a CPU) against this file, piece by
piece: its checks run here and each piece stays within the bound its rounding allows. Skipped where ../shared is not
beside the repository."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_gpt

REPO_ROOT = Path(__file__).resolve().parent.parent
HEAD92 = REPO_ROOT.parent / "shared" / "head92_cpu"
# the checks call this file's API as it was when they were written (head92_api: today's, as they call it); this
# file's parameters the checks' table of #92's labels predates: the second attention scalar is #92's `sa_lambdas[1]`,
# one of its `scalars`; the n-gram table, renamed, its `bigram_embed`
NEWER_LABELS = [(r"\.attn\.proj_scale$", "scalars"), (r"^ngram\.table\.weight$", "bigram_embed")]


@pytest.fixture(scope="module")
def pieces(tmp_path_factory) -> dict[str, dict]:
    if not (HEAD92 / "run_head92_cpu.py").exists():
        pytest.skip(f"{HEAD92} is not beside the repository")
    out = tmp_path_factory.mktemp("head92")
    run = (f"import sys; sys.path.insert(0, {str(HEAD92)!r}); import head92_api, run_head92_cpu as checks; "
           f"checks.ADAM_LABELS += {NEWER_LABELS!r}; checks.main(['--out', {str(out)!r}, '--mask', '0'])")
    done = subprocess.run([sys.executable, "-c", run], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


def test_92s_schedule_hashes_rotary_and_candidates_are_this_files_exactly(pieces):
    schedule = pieces["schedule"]
    assert len(schedule["steps"]) == 1195 and schedule["first_difference"] == {}
    assert all(piece["differing_steps"] == 0 for piece in schedule["extra"].values() if "differing_steps" in piece)
    assert all(rows["bigram_rows_differing"] == rows["trigram_rows_differing"] == 0 and rows["tokens"] > 10**6
               for rows in pieces["hash"].values())
    for width in ("port_narrow", "port_wide"):
        rotary = pieces["rotary"][width]
        assert rotary["max_rel_freq_diff"] == 0 and rotary["scale_port"] == rotary["scale_record92"]
    assert len(pieces["candidates"]["rows"]) == 40 and all(row["identical"] for row in pieces["candidates"]["rows"])


def test_92s_ngram_table_loss_and_optimizers_agree_with_this_file_to_their_rounding(pieces):
    """Bounds: a few bf16 roundings (2^-8 = 3.9e-3) where #92 rounds where this file does not; each piece's control
    (#92 with one thing changed) is far outside its bound, so the bound tells a difference from rounding."""
    ngram = pieces["ngram"]
    assert ngram["port_table_bf16"]["lookup_bitwise_equal"] and ngram["port_table_bf16"]["table_grad_rel"] < 4e-3
    assert ngram["control_signs_exchanged"] > 0.5
    assert {int(k): v for k, v in ngram["joins"]["record92"].items()} == \
        {int(k): v for k, v in ngram["joins"]["port"].items()}
    for name, case in pieces["loss"].items():
        if name.startswith(("full", "sampled")):
            assert case["exact"]["loss_sum_rel"] < 1e-4 and case["exact"]["grad_logits_rel_rows_0_to_T_3"] < 1e-3, name
    assert pieces["loss"]["control_prefix_weight_doubled_loss_rel"] > 1e-2
    adam = pieces["ngram_adam"]
    assert adam["events_92"] == adam["events_port"]
    assert adam["port_fp32"]["rel_diff_of_update"] < 4e-3 and adam["port_fp32"]["v_rel"] < 1e-3
    assert adam["control_no_replay"]["rel_diff_of_update"] > 1e-2
    anvil = pieces["anvil"]
    assert anvil["port_fp32"]["rel_diff_of_total_update"] < 1e-2 and anvil["control_slow_decay_0.95"] > 5e-2
    assert pieces["mudd_head"]["rel"] < 1e-6 and pieces["mudd_head"]["control_ve_exchanged"] > 0.1


def test_every_adam_parameter_steps_at_92s_lr_betas_and_decay(pieces):
    """#92's three differences, closed: no decay on the smear's gate nor on a gate network's bias and scale, one
    scale both gate networks share, and each attention layer's second scalar (sa_lambdas[1]) trained as #92's
    scalars are. Before: 14 (parameter, step) pairs differed, and the scale and the scalar were not #92's."""
    table = pieces["adam_table"]
    assert table["differing"] == [] and all(row["label"] for row in table["rows"])
    labels = [row["label"] for row in table["rows"] if row["step"] == 1]
    assert labels.count("_mudd_gate_scale") == 1  # (#92's one scale, not one a network)
    assert labels.count("smear_gate") == 1 and labels.count("mudd_gate_b2") == 2
    second = [row for row in table["rows"] if row["port"].endswith("attn.proj_scale")]
    assert len(second) == 2 * 7  # (#92's seven attention layers, at steps 1 and 339)
    assert all(row["lr"][1] == pytest.approx(0.04) and row["decay"][1] == 0 for row in second if row["step"] == 1)
    assert table["dense_rel"] < 1e-5 < table["control_no_decay"]


def test_the_second_attention_scalar_scales_the_output_projections_weight_as_92s_does():
    """#92 multiplies the O weight by sa_lambdas[1] (`F.linear(y, sa_lambdas[1] * W_o)`); here it scales the
    projection's input, the same product. fp64, to 1e-12."""
    torch.manual_seed(0)
    attn = train_gpt.CausalSelfAttention(32, 4, 8, zero_out=False).double()
    with torch.no_grad():
        attn.proj_scale.fill_(1.7)
    x = torch.randn(1, 16, 32, dtype=torch.float64)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    scaled = attn(x, None, mask)
    projection = attn.c_proj.weight.detach().clone()
    with torch.no_grad():
        attn.proj_scale.fill_(1.0)
        attn.c_proj.weight.mul_(1.7)  # #92's: the scalar on the weight
    as_92 = attn(x, None, mask)
    assert not torch.equal(projection, attn.c_proj.weight) and scaled.abs().max() > 1e-3
    torch.testing.assert_close(scaled, as_92, rtol=1e-12, atol=1e-12)
