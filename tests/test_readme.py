"""README.md and the docs' runnable snippets (issue 29 section 6, issue 41 section 4, issue 42 section 3).

Snippets: every ``python`` block of README.md or docs/**.md marked ``<!-- runnable: ... -->`` on the line before its
fence runs as written, each in a fresh interpreter in an empty directory (what a new user pasting it into a file
gets), followed by a check of what it produced. The blocks that need a running job, a trained model or a
downloaded checkpoint (their fills are names the text explains) are not marked.

README claims (issue 42): at most 200 lines; AOA spelled out in the opening paragraph; exactly the two set-up
commands, which the Makefile has and CI runs; a first example that saves in one layout and loads in another;
one line per command of ``oarlock --help``; one link per docs page in the feature list; one table of results in
which every row names the benchmark command behind it, and every figure of the row is found in that benchmark's
section of benchmarks/RESULTS.md; no figure anywhere else.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_TEXT = README.read_text()
DOCS = REPO / "docs"
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


def _blocks_of(path: Path) -> list[tuple[str, str]]:
    return [(f"{path.relative_to(REPO)}:{n}", code) for n, code in runnable_blocks(path.read_text())]


README_BLOCKS = _blocks_of(README)
BLOCKS = README_BLOCKS + [b for p in sorted(DOCS.rglob("*.md")) for b in _blocks_of(p)]
ATTENTION_TESTS = Path(__file__).resolve().parent / "attention"

# Checks run after the blocks, keyed by a line only that block has (issue 41 section 4). Each compares what the
# block produced with values obtained without the calls it demonstrates: the in-memory state that was saved, a
# second optimizer step taken by both optimizers, a float64 attention, the layout recorded on disk.
RESHARD_CHECK = """
from oarlock.checkpoint import read_metadata
from safetensors.torch import load_file
stored = read_metadata("ckpt").tensors["w"]  # layout A on disk: the two row shards of [12, 6]
assert sorted((s.global_offset, s.local_shape) for s in stored.shards) == [((0, 0), (6, 6)), ((6, 0), (6, 6))]
assert [(s.global_offset, s.local_shape) for s in state["w"]] == [((0, 0), (12, 2)), ((0, 2), (12, 2)), ((0, 4), (12, 2))]
assert all(torch.equal(s.local_tensor, trained[:, 2 * i:2 * i + 2]) for i, s in enumerate(state["w"]))
assert torch.equal(load_file("hf_out/model.safetensors")["w"], trained)
"""
README_MANAGER_CHECK = """
from pathlib import Path
assert sorted(p.name for p in Path("ckpts").glob("step-*")) == ["step-00000200", "step-00000300"]  # keep_last=2
assert Path("ckpts/latest").read_text().strip().endswith("step-00000300")
rng_at_save = torch.get_rng_state()  # nothing drew random numbers after the save of step 300
model2 = torch.nn.Linear(8, 8)
opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
msd2 = sharded_state_dict(model2)
state2 = {"model": msd2, "optim": OptimizerState(opt2, msd2), "rng": RNGState(), "step": 0}
assert CheckpointManager("ckpts", keep_last=2).load_latest(state2) == 300 and state2["step"] == 300
for p, p2 in zip(model.parameters(), model2.parameters()):
    assert torch.equal(p, p2)
    assert all(torch.equal(torch.as_tensor(opt.state[p][k]), torch.as_tensor(opt2.state[p2][k]))
               for k in ("step", "exp_avg", "exp_avg_sq"))
assert torch.equal(torch.get_rng_state(), rng_at_save)
"""
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
CHECKS = {'save_state_dict({"w": layout(trained, 0, 2)': RESHARD_CHECK, "keep_last=2)": README_MANAGER_CHECK,
          "RankLocal(loader_pos)": MANAGER_CHECK, "load_sharded_optimizer_state_dict(opt2": OPTIM_CHECK,
          "out, lse = flashmask_attention(": FLASHMASK_CHECK}


def _check_of(code: str) -> str:
    """The check appended to a block: the one whose key the block contains, else none (the block asserts)."""
    found = [check for key, check in CHECKS.items() if key in code]
    assert len(found) <= 1, code
    return found[0] if found else ""


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a markdown text (up to the next ``## ``)."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no section '## {title}'"
    return m.group(1)


def test_the_marked_blocks_are_found():
    """The marker survives edits: the README's two examples (save -> reshard load, the manager with an async
    save) and the docs' manager with RankLocal, optimizer resume and FlashMask blocks are marked."""
    assert len(README_BLOCKS) >= 2, [n for n, _ in README_BLOCKS]
    assert "layout(trained, 0, 2)" in README_BLOCKS[0][1] and "async_save=True" in README_BLOCKS[1][1]
    assert any("RankLocal(loader_pos)" in code and "def state_dict" in code for _, code in BLOCKS)
    assert len(BLOCKS) >= 5, [n for n, _ in BLOCKS]
    assert runnable_blocks("<!-- runnable -->\n```python\nx = 1\n```\n```python\ny\n```\n") == [(2, "x = 1\n")]


def test_every_block_checks_its_result():
    """A block that runs but asserts nothing proves only that it does not raise: each marked block asserts, or
    has a check in :data:`CHECKS`; each check belongs to exactly one block."""
    for where, code in BLOCKS:
        assert "assert" in code or _check_of(code), f"{where}: no assertion and no check"
    for key in CHECKS:
        assert sum(key in code for _, code in BLOCKS) == 1, key


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_block_imports_only_what_it_uses(where, code):
    """Every name a snippet imports is used in it (issue 42: the first example imports only what it uses)."""
    tree = ast.parse(code)
    imported = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert imported <= used, f"{where}: imported and not used: {sorted(imported - used)}"


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_block_runs(tmp_path, where, code):
    r = subprocess.run([sys.executable, "-c", code + _check_of(code)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{where}:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"


def test_readme_is_at_most_200_lines():
    assert len(README_TEXT.splitlines()) <= 200, len(README_TEXT.splitlines())


def test_opening_paragraph_says_what_oarlock_is_and_spells_out_aoa():
    opening = README_TEXT.split("\n## ", 1)[0]
    assert '**AOA** ("All in One Arrow")' in opening
    for package in ("oarlock.checkpoint", "oarlock.attention", "oarlock.memory", "oarlock.debug"):
        assert package in opening, package


def test_exactly_the_two_commands_which_the_makefile_has_and_ci_runs():
    section = _section(README_TEXT, "Set up and go")
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 1, blocks
    assert [line.split("#")[0].strip() for line in blocks[0].strip().splitlines()] == ["make demo", "make test"]
    assert set(re.findall(r"\bmake \w+", README_TEXT)) == {"make demo", "make test"}
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == "make test", ci


def _help_commands(*args: str) -> list[str]:
    """The (sub)commands ``oarlock ARGS --help`` lists under "positional arguments" (none for a command that
    takes no subcommand: its positional arguments are indented less)."""
    oarlock = str(Path(sys.executable).parent / "oarlock")
    r = subprocess.run([oarlock, *args, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (args, r.stderr[-2000:])
    out = r.stdout
    listing = out.split("positional arguments:", 1)[-1].split("\noptions:", 1)[0] if "positional" in out else ""
    return re.findall(r"^    ([a-z][\w-]*)", listing, re.M)


def test_one_line_per_cli_command():
    """The "Command line" section has one line per command of ``oarlock --help``, none missing, none extra; a
    command group's line names its subcommands, all of them real."""
    lines = re.findall(r"^- `oarlock ([a-z][\w-]*)([^`]*)`", _section(README_TEXT, "Command line"), re.M)
    commands = _help_commands()
    assert len(commands) >= 8, commands
    assert sorted(c for c, _ in lines) == sorted(commands)
    groups = 0
    for command, rest in lines:
        subs = _help_commands(command)
        if subs:
            groups += 1
            named = re.match(r" ([a-z|]+)", rest)
            assert named and set(named.group(1).split("|")) <= set(subs), (command, rest, subs)
    assert groups >= 3  # aoa, memory, debug


def test_feature_list_links_every_docs_page_once():
    section = _section(README_TEXT, "Features and docs")
    bullets = [line for line in section.splitlines() if line.startswith("- ")]
    links = [link for line in bullets for link in re.findall(r"\]\((docs/[^)#]+)\)", line)]
    pages = sorted(str(p.relative_to(REPO)) for p in DOCS.rglob("*.md") if p.name != "index.md")
    assert sorted(links) == pages, set(links) ^ set(pages)
    assert all(re.search(r"\]\(docs/", line) for line in bullets)  # every feature line points at its page
    assert "](docs/index.md)" in section  # the site's home, named in the line above the list


def test_every_link_in_the_readme_resolves():
    links = re.findall(r"\]\(([^)]+)\)", README_TEXT)
    assert len(links) > 20
    for link in links:
        assert not link.startswith("http"), link
        assert (REPO / link.split("#")[0]).exists(), link


FIGURE = re.compile(r"\d+(?:\.\d+)?(?:x\b| ?%| ms\b| s\b)")


def _results_rows() -> list[dict[str, str]]:
    section = _section(README_TEXT, "Headline results")
    table = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["what", "result", "anchor", "command", "load average"], header
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in table[2:]]


def _numbers(text: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?", text)


def test_results_table_rows_name_their_benchmark_and_quote_its_figures():
    """Every row names the command of a benchmark in benchmarks/, that command is the one RESULTS.md gives in the
    benchmark's section, and each number of the row's result, anchor and load average is found in that section
    (today's figure, not a remembered one)."""
    results = (REPO / "benchmarks" / "RESULTS.md").read_text()
    rows = _results_rows()
    assert len(rows) >= 8, rows
    for row in rows:
        command = re.fullmatch(r"`([^`]+)`", row["command"])
        assert command, row
        script = re.search(r"benchmarks/(\w+\.py)", command.group(1))
        assert script and (REPO / "benchmarks" / script.group(1)).is_file(), row
        m = re.search(rf"^## {re.escape(script.group(1))}:.*?(?=^## |\Z)", results, re.S | re.M)
        assert m, f"no section for {script.group(1)} in RESULTS.md"
        section = m.group(0)
        assert command.group(1) in section, (command.group(1), script.group(1))
        assert FIGURE.search(row["result"]), row
        for column in ("result", "anchor", "load average"):
            for number in _numbers(row[column]):
                assert re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", section), (script.group(1), column, number)
        assert _numbers(row["load average"]), row


def test_every_figure_of_the_readme_is_in_the_results_table():
    """Outside code blocks, a figure (a ratio, a percentage, a time) appears only in a row of the results table,
    which names its command (checked above)."""
    prose = re.sub(r"```.*?```", "", README_TEXT, flags=re.S)
    for line in prose.splitlines():
        if FIGURE.search(line):
            assert line.startswith("|") and "`" in line and "benchmarks/" in line, line
