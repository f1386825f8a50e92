"""README snippets (issue 29, section 6): every ``python`` block of README.md marked ``<!-- runnable: ... -->``
on the line before its fence runs as written, each in a fresh interpreter in an empty directory (what a new
user pasting it into a file gets). The blocks that need a running job, a trained model or a downloaded checkpoint
(their fills are names the text explains) are not marked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = "<!-- runnable"


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of the fence, code)`` of every python block whose previous line starts with :data:`MARK`."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() == "```python" and i and lines[i - 1].startswith(MARK):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            out.append((i + 1, "\n".join(lines[i + 1:end]) + "\n"))
    return out


BLOCKS = runnable_blocks(README.read_text())
ATTENTION_TESTS = Path(__file__).resolve().parent / "attention"

# Checks run after the blocks that assert nothing themselves, keyed by a line only that block has (issue 41
# section 4). Each compares what the block produced with values obtained without the calls it demonstrates: the
# in-memory state that was saved, a second optimizer step taken by both optimizers, a float64 attention.
MANAGER_CHECK = """
from pathlib import Path
assert sorted(p.name for p in Path("ckpts").glob("step-*")) == ["step-00000100", "step-00000200", "step-00000300"]
rng_at_save = torch.get_rng_state()  # nothing drew random numbers after the save of step 300
model2 = torch.nn.Linear(8, 8)
opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
sched2, pos2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=100), LoaderPosition()
msd2 = sharded_state_dict(model2)
state2 = {"model": msd2, "optim": OptimizerState(opt2, msd2), "sched": sched2, "data": RankLocal(pos2),
          "rng": RNGState(), "step": 0}
assert CheckpointManager("ckpts", keep_last=3).load_latest(state2) == 300
assert state2["step"] == 300 and pos2.index == 300 * 4 and sched2.last_epoch == 300
for p, p2 in zip(model.parameters(), model2.parameters()):
    assert torch.equal(p, p2)
    assert all(torch.equal(torch.as_tensor(opt.state[p][k]), torch.as_tensor(opt2.state[p2][k]))
               for k in ("step", "exp_avg", "exp_avg_sq"))
assert torch.equal(torch.get_rng_state(), rng_at_save)
"""
OPTIM_CHECK = """
assert all(torch.equal(p, p2) for p, p2 in zip(model.parameters(), model2.parameters()))
x = torch.randn(2, 8)
for m, o in ((model, opt), (model2, opt2)):  # the next step is the same only if the moments and step were loaded
    o.zero_grad()  # the block's model still holds the gradient of its step
    m(x).sum().backward()
    o.step()
assert all(torch.equal(p, p2) for p, p2 in zip(model.parameters(), model2.parameters()))
"""
FLASHMASK_CHECK = f"""
import sys
sys.path.insert(0, {str(ATTENTION_TESTS)!r})
from f64_reference import attention_f64

pos = torch.arange(1024)
doc = torch.stack([(pos >= 300).long(), torch.zeros(1024, dtype=torch.long)])  # each token's document, per row
keep = (doc[:, :, None] == doc[:, None, :]) & (pos[None, :] <= pos[:, None])  # same document, causal
ref_out, ref_lse = attention_f64(q.detach(), k.detach(), v.detach(), keep[:, None].expand(-1, 4, -1, -1))
assert out.shape == (2, 1024, 4, 64) and lse.shape == (2, 4, 1024)
torch.testing.assert_close(out.detach().double(), ref_out, atol=2e-5, rtol=1e-5)
torch.testing.assert_close(lse.detach().double(), ref_lse, atol=2e-5, rtol=1e-5)
plain = flashmask_attention(q, k, v, idx, causal=True)  # the block's first call, overwritten by its second
torch.testing.assert_close(plain.detach().double(), ref_out, atol=2e-5, rtol=1e-5)
"""
CHECKS = {"mgr.wait()": MANAGER_CHECK, "load_sharded_optimizer_state_dict(opt2": OPTIM_CHECK,
          "out, lse = flashmask_attention(": FLASHMASK_CHECK}


def _check_of(code: str) -> str:
    """The check appended to a block: the one whose key the block contains, else none (the block asserts)."""
    found = [check for key, check in CHECKS.items() if key in code]
    assert len(found) <= 1, code
    return found[0] if found else ""


def test_the_marked_blocks_are_found():
    """The marker survives edits: the four self-contained blocks (FlexCheckpoint save/load, the checkpoint
    manager with RankLocal, optimizer resume, FlashMask) are marked."""
    assert len(BLOCKS) >= 4, [n for n, _ in BLOCKS]
    assert any("RankLocal(loader_pos)" in code and "def state_dict" in code for _, code in BLOCKS)
    assert runnable_blocks("<!-- runnable -->\n```python\nx = 1\n```\n```python\ny\n```\n") == [(2, "x = 1\n")]


def test_every_block_checks_its_result():
    """A block that runs but asserts nothing proves only that it does not raise: each marked block asserts, or
    has a check in :data:`CHECKS`; each check belongs to exactly one block."""
    for line, code in BLOCKS:
        assert "assert" in code or _check_of(code), f"README.md line {line}: no assertion and no check"
    for key in CHECKS:
        assert sum(key in code for _, code in BLOCKS) == 1, key


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs(tmp_path, line, code):
    r = subprocess.run([sys.executable, "-c", code + _check_of(code)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"README.md line {line}:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"
