"""docs/quickstart.md runs as written: its Python block (2 ranks save row shards, 3 ranks load column shards and
assert them equal to the saved tensor) and its commands (inspect, convert --to hf, verify) on the checkpoint it
wrote; the HF file is read back with the safetensors library."""

import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "quickstart.md").read_text()


def test_quickstart_runs_as_written(tmp_path):
    code = re.search(r"```python\n(.*?)```", DOC, re.S).group(1)
    script = tmp_path / "save_reshard_load.py"
    script.write_text(code)
    ck = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, str(script), str(ck)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "loaded as column shards on 3: equal" in r.stdout
    oarlock = str(Path(sys.executable).parent / "oarlock")
    for line in re.search(r"```bash\n(.*?)```", DOC, re.S).group(1).strip().splitlines():
        args = line.split("#")[0].split()
        args = [oarlock if a == ".venv/bin/oarlock" else a.replace("/tmp/ckpt", str(ck)) for a in args]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
    hf = load_file(str(tmp_path / "ckpt-hf" / "model.safetensors"))
    assert torch.equal(hf["w"], torch.arange(72, dtype=torch.float32).reshape(12, 6))
