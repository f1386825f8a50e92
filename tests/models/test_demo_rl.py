"""The demo's RL phase (issue 47): GRPO with rollouts in vLLM and the trainer's weights synced live every step.

The end-to-end cases run ``oarlock demo --tiny`` (every phase, RL included) and a deliberately skipped sync in the
vLLM venv that ``make test``'s set-up builds (``.vllm-venv``; skipped, naming it, without one). The pieces of the
algorithm are checked against hand computations.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from oarlock.cli import main
from oarlock.models import rl

REPO = Path(__file__).resolve().parents[2]
VPY = REPO / ".vllm-venv" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VPY.is_file(), reason=".vllm-venv is missing (bash scripts/vllm_env.sh builds it)")


# ------------------------------------------------------------------------------------------ the algorithm's pieces

def test_group_advantages_are_normalised_per_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2]])
    adv = rl.group_advantages(r, eps=0.0 + 1e-12)
    # group 1: mean 0.5, population std 0.5 -> +1 / -1; group 2: all equal -> no signal
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64))
    assert torch.equal(adv[1], torch.zeros(4, dtype=torch.float64))


def test_clipped_surrogate_clips_only_in_the_direction_of_the_advantage():
    logp_old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))  # ratios 1.5, 1.5, 0.5, 0.5
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    got = rl.clipped_surrogate(logp, logp_old, adv, eps=0.2)
    # -min(rho A, clip(rho) A): A>0 caps a large ratio at 1.2; A<0 caps a small ratio at 0.8
    assert torch.allclose(got, torch.tensor([-1.2, 1.5, -0.5, 0.8]))


def test_reward_is_the_share_of_digits():
    assert rl.reward("12 ab") == pytest.approx(2 / 5)
    assert rl.reward("  2024  ") == 1.0
    assert rl.reward("") == 0.0 and rl.reward("none") == 0.0


def test_token_logprobs_match_unpadded_sequences():
    """The batched, left/right-padded computation (logits only for completion columns) equals each sequence run
    alone through transformers with a full log-softmax."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    seqs = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    plens = [2, 2, 6]
    with torch.no_grad():
        got = rl._token_logprobs(model, seqs, plens)
        want = []
        for x, p in zip(seqs, plens):
            lp = torch.log_softmax(model(torch.tensor([x])).logits[0].double(), -1)
            want += [lp[k - 1, x[k]].item() for k in range(p, len(x))]
    assert got.shape == (len(want),)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)


def test_engine_slice_bytes_of_a_known_layout():
    cfg = {"hidden_size": 64, "vocab_size": 96, "intermediate_size": 96, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 1}
    # per rank at TP=2: qkv (4+2+2)*16*64/2, o 64*64/2, gate_up 2*96*64/2, down 64*96/2, 2 norms 64;
    # embedding and lm_head 48 rows of 64 each; final norm 64
    per = 8 * 16 * 64 // 2 + 64 * 64 // 2 + 2 * 96 * 64 // 2 + 64 * 96 // 2 + 2 * 64 + 2 * 48 * 64 + 64
    assert rl.engine_slice_bytes(cfg, 2) == [per * 4, per * 4]
    with pytest.raises(Exception, match="KV heads 2 does not split evenly over TP=3"):
        rl.engine_slice_bytes({**cfg, "vocab_size": 96 * 3, "num_attention_heads": 6}, 3)


@pytest.mark.parametrize("args,needle", [
    (["--rl-group-size", "1"], "--rl-group-size must be >= 2"),
    (["--rl-prompts", "3", "--rl-group-size", "3"], "do not split into 2 minibatches on 2 trainer ranks"),
    (["--rl-bound", "0"], "--rl-bound must be > 0"),
])
def test_bad_rl_settings_are_one_line_errors(tmp_path, capsys, args, needle):
    rc = main(["demo", "--tiny", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err


def test_missing_vllm_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("OARLOCK_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(Exception, match="OARLOCK_VLLM_PYTHON=.* is not an executable interpreter"):
        rl.vllm_python()


# ----------------------------------------------------------------------------------------- end to end, with vLLM

def _tiny_model(cache_dir: Path) -> Path:
    from oarlock.models.demo import _tiny_hf_dir

    return _tiny_hf_dir(cache_dir, 0)


@needs_vllm
@pytest.mark.slow
@pytest.mark.multiproc
def test_tiny_demo_runs_every_phase_and_learns(tmp_path, cache_dir, monkeypatch, capfd):
    monkeypatch.setenv("OARLOCK_VLLM_PYTHON", str(VPY))
    out = tmp_path / "out"
    rc = main(["demo", "--tiny", "--out", str(out), "--cache", str(cache_dir), "--steps-a", "2", "--steps-b", "2",
               "--seq-len", "32", "--max-new-tokens", "8", "--rl-steps", "8"])
    printed = capfd.readouterr().out  # rank 0 of the RL phase prints to the inherited descriptor
    assert rc == 0, printed[-3000:]
    report = json.loads((out / "report.json").read_text())
    r = report["rl"]
    # the names tests outside the project read
    assert {"reward", "bound", "reply_before", "reply_after", "steps"} <= set(r)
    assert "digits" in r["reward"] and r["bound"] == 1e-3
    keys = {"step", "reward_mean", "reward_std", "loss", "logprob_max_abs_diff", "logprob_mean_abs_diff",
            "sync_seconds", "step_seconds", "bytes_received", "slice_bytes"}
    assert [s["step"] for s in r["steps"]] == list(range(1, 9))
    for s in r["steps"]:
        assert keys <= set(s), keys - set(s)
        # on-policy at every step: the engine sampled from exactly the trainer's weights (fp32 both sides)
        assert s["logprob_max_abs_diff"] <= 1e-3 and s["logprob_mean_abs_diff"] <= s["logprob_max_abs_diff"]
        # each of the 3 engine workers received exactly its TP slice, computed from the HF config
        assert len(s["bytes_received"]) == 3 and s["bytes_received"] == s["slice_bytes"]
        assert 0 < s["sync_seconds"] < s["step_seconds"] and math.isfinite(s["loss"])
    cfg = json.loads((_tiny_model(cache_dir) / "config.json").read_text())
    assert r["steps"][0]["slice_bytes"] == rl.engine_slice_bytes(cfg, 3)
    # the engine served the export like transformers before RL, and the trainer's final weights after it
    assert r["serve_check"]["tokens_equal"] and r["final_check"]["tokens_equal"]
    assert r["final_check"]["engine_tokens"] != r["serve_check"]["engine_tokens"]  # the policy moved
    # learning happened: the last 3 steps' mean reward exceeds the first 3 steps'
    first = sum(s["reward_mean"] for s in r["steps"][:3]) / 3
    last = sum(s["reward_mean"] for s in r["steps"][-3:]) / 3
    assert last > first and r["learning_margin"] == pytest.approx(last - first)
    text = (out / "report.txt").read_text()
    assert "each engine worker received exactly its slice" in text and "engine reply after RL" in text
    assert (out / "rl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[rl] step 8/8: reward" in printed  # progress as it goes
    # the earlier phases still ran and checked out
    assert abs(report["resume_check"]["abs_diff"]) < 1e-5 and report["export"]["logits_max_abs_diff"] < 1e-3


@needs_vllm
@pytest.mark.slow
@pytest.mark.multiproc
def test_a_skipped_sync_fails_the_on_policy_check(tmp_path, cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("OARLOCK_VLLM_PYTHON", str(VPY))
    out = tmp_path / "out"
    rc = main(["demo", "--tiny", "--rl-only", str(_tiny_model(cache_dir)), "--out", str(out), "--rl-steps", "3",
               "--rl-skip-sync-at", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "RL step 2: on-policy check failed" in err and "the sync of step 1 was skipped on purpose" in err, err
    got = float(err.split("differ from the engine's by up to ")[1].split(" ")[0])
    assert got > 1e-3  # far outside the bound: the engine sampled from the weights before step 1's update
