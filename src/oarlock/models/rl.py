"""The demo's RL phase: GRPO with rollouts in a vLLM engine, the trainer's weights pushed into the engine live after
every step (``oarlock demo``, docs/demo.md).

Two trainer processes hold the policy with FSDP2 (a transformers model, ``fully_shard`` per layer); trainer rank 0
also holds an offline ``vllm.LLM`` at ``engine_tp``-way tensor parallelism built from the same HF directory with
``WeightTransferConfig(backend="oarlock")``. One step:

1. **Rollout** (vLLM): ``group_size`` samples of each of ``prompts_per_step`` prompts at temperature 1, with the
   engine's log-probability of every sampled token (``SamplingParams(logprobs=0)``).
2. **Reward**: a rule (:data:`REWARD`) scores each completion; advantages are group-normalised
   (``(r - mean_group) / (std_group + eps)``, GRPO, no value model).
3. **On-policy check**: the trainer recomputes the log-probability of every sampled token with its current
   weights, before its update. The engine sampled with the weights of the last sync, so the two agree to
   rounding when every sync landed; the step fails (:class:`~oarlock.models.errors.ModelError` naming the
   step) when the largest |difference| exceeds ``bound``.
4. **Update**: the batch is cut into ``minibatches``; each takes one AdamW step on the clipped surrogate
   ``-min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)`` per token, ``rho = exp(logp - logp_old)``, averaged over the
   minibatch's completion tokens (the first minibatch is on-policy, ``rho = 1``; later ones see the clip).
   Algorithm: Shao et al. 2024, "DeepSeekMath" (GRPO), with the token-level mean of Yu et al. 2025 (DAPO).
5. **Sync**: :meth:`OarlockTrainerWeightTransferEngine.send_weights` on both trainer ranks moves each engine
   worker's tensor-parallel slice of every parameter straight from the FSDP2 shards (docs/vllm.md); nothing is
   written to disk.

Run by :func:`run_rl_phase` (the demo's driver, any interpreter) as two processes of an interpreter that has vLLM
(``.vllm-venv`` in a clone, made by ``scripts/vllm_env.sh``; ``OARLOCK_VLLM_PYTHON`` names another).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from oarlock.models.errors import ModelError

#: What the rule rewards, in the report's words.
REWARD = ("the share of the completion's characters that are ASCII digits (0.0: none, 1.0: only digits); a "
          "completion with no characters scores 0")

#: Prompts of the RL phase, taken in turn (``prompts_per_step`` each step).
PROMPTS = (
    "List some numbers.",
    "Count from one to ten.",
    "What is twelve plus seven?",
    "Give me a year from the last century.",
    "How many days are in a week?",
    "Write a phone number.",
    "What is the temperature today?",
    "How many legs does a spider have?",
)


#: The system message of the RL prompts (chat models only).
SYSTEM = "Be brief."


def reward(text: str) -> float:
    """The demo's verifiable reward (:data:`REWARD`) of one decoded completion: a float in [0, 1]."""
    text = text.strip()
    return sum(c in "0123456789" for c in text) / len(text) if text else 0.0


@dataclass
class RLSettings:
    """Settings of the RL phase (``oarlock demo --rl-*`` flags map one to one)."""

    steps: int = 8
    prompts_per_step: int = 3
    group_size: int = 8
    max_new_tokens: int = 24
    lr: float | None = None  # AdamW learning rate; None: 2e-5 for a real model, 5e-3 for --tiny's random one
    clip_eps: float = 0.2
    minibatches: int = 2
    engine_tp: int = 3
    bound: float = 1e-3  # largest |trainer - engine| log-probability of a sampled token (fp32 both sides)
    skip_sync_at: int | None = None  # a step (1-based) whose sync is skipped on purpose: the next step must fail
    seed: int = 0
    reply_tokens: int = 24
    timeout_s: float = 900.0

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "minibatches", "engine_tp"):
            if getattr(self, name) < 1:
                raise ModelError(f"demo: --rl-{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ModelError("demo: --rl-group-size must be >= 2 (advantages are normalised within a group)")
        n = self.prompts_per_step * self.group_size
        if n % (TRAINER_RANKS * self.minibatches):
            raise ModelError(f"demo: the {n} completions of a step ({self.prompts_per_step} prompts x "
                             f"{self.group_size}) do not split into {self.minibatches} minibatches on "
                             f"{TRAINER_RANKS} trainer ranks")
        if not self.bound > 0:
            raise ModelError(f"demo: --rl-bound must be > 0, got {self.bound}")


TRAINER_RANKS = 2


# ------------------------------------------------------------------------------------------------ pure pieces

def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's standard deviation.

    Args:
        rewards: ``[groups, group_size]`` float.
    Returns:
        ``[groups, group_size]`` float64; a group whose rewards are all equal gets zeros (nothing to learn).
    """
    r = rewards.double()
    return (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + eps)


def clipped_surrogate(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-token PPO/GRPO loss ``-min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)``, ``rho = exp(logp - logp_old)``.

    Args:
        logp: ``[T]`` log-probabilities of the sampled tokens under the weights being trained (with grad).
        logp_old: ``[T]`` the same under the weights that sampled them (no grad).
        adv: ``[T]`` each token's advantage (its completion's).
    Returns:
        ``[T]`` losses (sum or average them as the normalisation requires).
    """
    rho = torch.exp(logp - logp_old)
    return -torch.minimum(rho * adv, rho.clamp(1.0 - eps, 1.0 + eps) * adv)


def engine_slice_bytes(hf_config: dict, tp: int, itemsize: int = 4) -> list[int]:
    """Bytes each of an engine's ``tp`` workers holds of a Llama-family model in vLLM's layout, computed from the
    HF config alone: fused ``qkv_proj`` ``[(q + 2 kv heads) / tp * head_dim, hidden]``, ``o_proj``, fused
    ``gate_up_proj`` and ``down_proj`` split ``tp`` ways, the vocabulary-parallel embedding and ``lm_head``
    ``vocab / tp`` rows each (vLLM keeps ``lm_head`` a parameter of its own name even when it is tied), norms
    whole. Raises :class:`ModelError` when a split is uneven (this formula covers even splits only)."""
    h, v, i = hf_config["hidden_size"], hf_config["vocab_size"], hf_config["intermediate_size"]
    nq, nkv = hf_config["num_attention_heads"], hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]
    d = hf_config.get("head_dim") or h // nq
    for what, n in (("vocabulary", v), ("attention heads", nq), ("KV heads", nkv), ("intermediate size", i)):
        if n % tp:
            raise ModelError(f"engine_slice_bytes: {what} {n} does not split evenly over TP={tp}")
    per_layer = ((nq + 2 * nkv) * d * h + h * nq * d + 2 * i * h + h * i) // tp + 2 * h
    total = hf_config["num_hidden_layers"] * per_layer + 2 * (v // tp) * h + h
    return [total * itemsize] * tp


# ------------------------------------------------------------------------------------------- trainer process

def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[rl] {msg}", flush=True)


def _tokenizer(model_dir: str, tiny: bool) -> Any:
    if tiny:
        from oarlock.models.data import ByteTokenizer

        return ByteTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _prompt_ids(tok: Any, text: str, tiny: bool) -> list[int]:
    if tiny:
        return tok.encode(text)
    # a short system message: the template's default one (about 20 tokens) would be most of every sequence the
    # trainer runs, and the trainer's work grows with every token
    chat = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                                   tokenize=False, add_generation_prompt=True)
    return [int(t) for t in tok(chat, add_special_tokens=False).input_ids]


def _decode(tok: Any, ids: list[int], tiny: bool) -> str:
    return tok.decode(ids) if tiny else tok.decode(ids, skip_special_tokens=True)


def _token_logprobs(model: Any, seqs: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
    """Log-probabilities of every completion token of ``seqs`` (prompt + completion), concatenated in order:
    ``[sum of completion lengths]`` float32.

    One batch: prompts left-padded and completions right-padded so that every completion starts in the same
    column, positions counted from each sequence's first real token (as the engine counts them), and logits
    computed only for the columns that predict completion tokens (``logits_to_keep``): the vocabulary projection
    and its softmax are a large share of a small model's work, and the prompt's are not needed."""
    if not seqs:
        return torch.zeros(0)
    lead = max(prompt_lens)
    tail = max(len(x) - p for x, p in zip(seqs, prompt_lens))
    ids = torch.zeros(len(seqs), lead + tail, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, (x, p) in enumerate(zip(seqs, prompt_lens)):
        ids[j, lead - p:lead - p + len(x)] = torch.tensor(x)
        mask[j, lead - p:lead - p + len(x)] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    # the last `tail + 1` columns: column lead - 1 (the prompt's last token) predicts the first completion token
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                   logits_to_keep=tail + 1).logits[:, :-1].float()
    logp = -torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, lead:], reduction="none")
    return torch.cat([logp[j, :len(x) - p] for j, (x, p) in enumerate(zip(seqs, prompt_lens))])


def _all_reduce(values: list[float], op: Any) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _engine_generate(llm: Any, prompts: list[list[int]], params: list[Any]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def _greedy(llm: Any, prompt: list[int], n: int) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    return list(_engine_generate(llm, [prompt], [sp])[0].outputs[0].token_ids)


def _hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _cut_at_eos(ids: list[int], eos: list[int]) -> list[int]:
    for k, t in enumerate(ids):
        if t in eos:
            return ids[:k]
    return ids


class _Trainer:
    """One trainer rank: the FSDP2 policy, its optimizer and (rank 0) the engine."""

    def __init__(self, rank: int, cfg: dict) -> None:
        import torch.distributed as dist

        self.rank, self.cfg = rank, cfg
        self.s = RLSettings(**cfg["settings"])
        torch.set_num_threads(1)
        torch.manual_seed(self.s.seed)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['trainer_port']}", rank=rank,
                                world_size=TRAINER_RANKS)
        self.model_dir, self.tiny = cfg["model_dir"], bool(cfg["tiny"])
        self.hf_config = json.loads((Path(self.model_dir) / "config.json").read_text())
        self.llm = self.client = self.tok = None
        eos = self.hf_config.get("eos_token_id")
        self.eos = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        self.result: dict[str, Any] = {"reward": REWARD, "bound": self.s.bound, "engine_tp": self.s.engine_tp,
                                       "trainer": f"FSDP2 on {TRAINER_RANKS} ranks (gloo)", "steps": []}
        self.times: dict[str, float] = {}

    # -- set-up
    def start_engine(self) -> None:
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from oarlock.integrations.vllm import LLMClient

        t0 = time.perf_counter()
        self.tok = _tokenizer(self.model_dir, self.tiny)
        self.llm = LLM(model=self.model_dir, skip_tokenizer_init=True, tensor_parallel_size=self.s.engine_tp,
                       dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=64,
                       kv_cache_memory_bytes=64 << 20, seed=self.s.seed,
                       weight_transfer_config=WeightTransferConfig(backend="oarlock"))
        self.client = LLMClient(self.llm)
        self.times["engine_start_s"] = time.perf_counter() - t0
        _log(0, f"vLLM engine up (TP={self.s.engine_tp}, fp32) in {self.times['engine_start_s']:.0f} s")

    def load_policy(self) -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.config.use_cache = False
        return model

    def serve_check(self, model: Any) -> None:
        """Rank 0, before FSDP2: the engine's greedy reply to the demo prompt equals transformers' on the export."""
        self.prompt = _prompt_ids(self.tok, self.cfg["prompt"], self.tiny)
        n = self.s.reply_tokens
        got, want = _greedy(self.llm, self.prompt, n), _hf_greedy(model, self.prompt, n)
        self.result["serve_check"] = {"tokens_equal": got == want, "engine_tokens": got, "transformers_tokens": want}
        if got != want:
            raise ModelError(f"RL serve check: the vLLM engine's greedy tokens {got} differ from transformers' "
                             f"{want} on the export")
        self.result["reply_before"] = _decode(self.tok, _cut_at_eos(got, self.eos), self.tiny).strip()
        _log(0, f"engine reply == transformers reply ({n} greedy tokens): {self.result['reply_before']!r}")

    def shard(self, model: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (TRAINER_RANKS,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=self.s.lr, weight_decay=0.0)

    def connect(self) -> None:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from oarlock.integrations.vllm import OarlockTrainerInitInfo, register

        register()
        t0 = time.perf_counter()
        info = OarlockTrainerInitInfo(host="127.0.0.1", port=int(self.cfg["sync_port"]),
                                      trainer_world_size=TRAINER_RANKS, engine_world_size=self.s.engine_tp,
                                      timeout=120.0, rank=self.rank)
        self.sync = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.model)
        self.times["sync_init_s"] = time.perf_counter() - t0

    # -- one step
    def rollout(self, step: int) -> dict | None:
        """Rank 0: sample, score, normalise. Returns what both ranks train on."""
        from vllm import SamplingParams

        s = self.s
        texts = [PROMPTS[((step - 1) * s.prompts_per_step + k) % len(PROMPTS)] for k in range(s.prompts_per_step)]
        prompts = [_prompt_ids(self.tok, t, self.tiny) for t in texts]
        reqs, params = [], []
        for g, p in enumerate(prompts):
            for k in range(s.group_size):
                reqs.append(p)
                # without its tokenizer the engine knows no end-of-sequence token: name it
                params.append(SamplingParams(temperature=1.0, max_tokens=s.max_new_tokens, logprobs=0,
                                             stop_token_ids=self.eos, detokenize=False, seed=s.seed * 1_000_003 + step * 1009 + g * 101 + k))
        outs = _engine_generate(self.client, reqs, params)
        seqs, plens, elogp, rewards = [], [], [], []
        for p, o in zip(reqs, outs):
            c = o.outputs[0]
            ids = list(c.token_ids)
            seqs.append(p + ids)
            plens.append(len(p))
            elogp.append([d[t].logprob for t, d in zip(ids, c.logprobs)])
            rewards.append(reward(_decode(self.tok, ids, self.tiny)))
        r = torch.tensor(rewards).view(s.prompts_per_step, s.group_size)
        adv = group_advantages(r).flatten().tolist()
        return {"seqs": seqs, "plens": plens, "elogp": elogp, "adv": adv, "rewards": rewards,
                "completion_tokens": sum(len(x) for x in elogp)}

    def train_step(self, step: int, batch: dict) -> dict:
        """Both ranks: the on-policy check, then the clipped-surrogate updates on this rank's completions."""
        import torch.distributed as dist

        s, mine = self.s, list(range(self.rank, len(batch["seqs"]), TRAINER_RANKS))
        seqs = [batch["seqs"][j] for j in mine]
        plens = [batch["plens"][j] for j in mine]
        lens = [len(x) - p for x, p in zip(seqs, plens)]
        per_mb = len(seqs) // s.minibatches
        mbs = [range(m * per_mb, (m + 1) * per_mb) for m in range(s.minibatches)]

        def logp_of(idx: range) -> torch.Tensor:
            return _token_logprobs(self.model, [seqs[k] for k in idx], [plens[k] for k in idx])

        # the log-probabilities under the weights that are about to change, for every completion: the first
        # minibatch's forward keeps its graph for its update (no second pass), the others run without one
        first = logp_of(mbs[0])
        with torch.no_grad():
            old_parts = [first.detach()] + [logp_of(idx) for idx in mbs[1:]]
        old = torch.cat(old_parts)
        engine = torch.tensor([x for j in mine for x in batch["elogp"][j]], dtype=torch.float32)
        diff = (old - engine).abs()
        mx, = _all_reduce([float(diff.max()) if diff.numel() else 0.0], dist.ReduceOp.MAX)
        total, count = _all_reduce([float(diff.double().sum()), float(diff.numel())], dist.ReduceOp.SUM)
        check = {"logprob_max_abs_diff": mx, "logprob_mean_abs_diff": total / max(count, 1.0)}
        if not mx <= s.bound:
            skipped = s.skip_sync_at is not None and s.skip_sync_at < step
            raise ModelError(
                f"RL step {step}: on-policy check failed: the trainer's log-probabilities of the tokens the engine "
                f"sampled differ from the engine's by up to {mx:.3g} (bound {s.bound:g}; mean "
                f"{check['logprob_mean_abs_diff']:.3g}): the engine did not sample from the trainer's weights"
                + (f" (the sync of step {s.skip_sync_at} was skipped on purpose)" if skipped else ""))
        loss_sum = 0.0
        for m, idx in enumerate(mbs):
            tokens, = _all_reduce([float(sum(lens[k] for k in idx))], dist.ReduceOp.SUM)
            logp = first if m == 0 else logp_of(idx)
            adv = torch.cat([torch.full((lens[k],), batch["adv"][mine[k]], dtype=torch.float32) for k in idx])
            per_token = clipped_surrogate(logp, old_parts[m], adv, s.clip_eps)
            # FSDP2 averages gradients over the ranks: scale so the result is the mean over the minibatch's tokens
            loss = per_token.sum() * (TRAINER_RANKS / max(tokens, 1.0))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            loss_sum += float(per_token.detach().sum()) / max(tokens, 1.0)
        loss_all, = _all_reduce([loss_sum], dist.ReduceOp.SUM)
        check["loss"] = loss_all / s.minibatches
        return check

    def run(self) -> None:
        import torch.distributed as dist

        s = self.s
        if self.rank == 0:
            self.start_engine()
        model = self.load_policy()
        if self.rank == 0:
            self.serve_check(model)
        dist.barrier()
        self.shard(model)
        self.connect()
        slice_bytes = engine_slice_bytes(self.hf_config, s.engine_tp)
        _log(self.rank, f"GRPO: {s.steps} steps x {s.prompts_per_step} prompts x {s.group_size} samples, reward: "
                        f"{REWARD}")
        for step in range(1, s.steps + 1):  # 1-based, as the report and the messages count
            t0 = time.perf_counter()
            payload = [self.rollout(step) if self.rank == 0 else None]
            t_roll = time.perf_counter() - t0
            dist.broadcast_object_list(payload, src=0)
            batch = payload[0]
            rec = self.train_step(step, batch)
            t_train = time.perf_counter() - t0 - t_roll
            t1 = time.perf_counter()
            synced = s.skip_sync_at != step
            if synced:
                self.sync.send_weights(step=step)
            sync_s = time.perf_counter() - t1
            step_s = time.perf_counter() - t0
            r = torch.tensor(batch["rewards"])
            rec = {"step": step, "reward_mean": float(r.mean()), "reward_std": float(r.std(unbiased=False)), **rec,
                   "synced": synced, "sync_seconds": sync_s, "step_seconds": step_s, "rollout_seconds": t_roll,
                   "train_seconds": t_train, "sync_share": sync_s / step_s, "completion_tokens":
                   batch["completion_tokens"], "slice_bytes": slice_bytes}
            sent, = _all_reduce([float(self.sync.last_report.bytes_sent if synced else 0)], dist.ReduceOp.SUM)
            rec["bytes_sent_by_trainers"] = int(sent)
            # the first sync also plans (describes both sides, agrees, plans); later ones replay the plan
            rec["sync_plan_seconds"] = float(self.sync.last_report.plan_seconds) if synced else 0.0
            if self.rank == 0:  # every worker's report of the round, gathered over the sync group by the back end
                states = self.sync.worker_states
                rec["bytes_received"] = [int(w["report"]["bytes_received"]) if synced and w["report"] else 0
                                         for w in states]
                self.result["steps"].append(rec)
                _log(0, f"step {step}/{s.steps}: reward {rec['reward_mean']:.3f} +- {rec['reward_std']:.3f}, "
                        f"loss {rec['loss']:+.4f}, on-policy max |diff| {rec['logprob_max_abs_diff']:.1e}, "
                        + (f"sync {sync_s:.2f} s ({100 * rec['sync_share']:.1f}% of {step_s:.1f} s)" if synced
                           else "sync SKIPPED on purpose"))
        self.final_check()

    def final_check(self) -> None:
        """The engine's greedy reply after the last sync equals transformers' on the trainer's final weights
        (gathered once here, for the check only)."""
        full = {n: p.full_tensor() for n, p in self.model.named_parameters()}
        if self.rank == 0:
            ref = self.load_policy()
            missing, unexpected = ref.load_state_dict(full, strict=False)
            if unexpected or any(k != "lm_head.weight" for k in missing):
                raise ModelError(f"RL final check: keys do not match: missing {missing}, unexpected {unexpected}")
            n = self.s.reply_tokens
            got, want = _greedy(self.llm, self.prompt, n), _hf_greedy(ref.eval(), self.prompt, n)
            self.result["final_check"] = {"tokens_equal": got == want, "engine_tokens": got,
                                          "transformers_tokens": want}
            self.result["reply_after"] = _decode(self.tok, _cut_at_eos(got, self.eos), self.tiny).strip()
            last_synced = self.s.skip_sync_at != self.s.steps
            if last_synced and got != want:
                raise ModelError(f"RL final check: after the last sync the engine's greedy tokens {got} differ from "
                                 f"transformers' {want} on the trainer's weights")
            _log(0, f"engine reply after RL == transformers on the trainer's weights: {self.result['reply_after']!r}")


def trainer_main(rank: int, config_path: str) -> int:
    """Entry point of one trainer process (``python -m oarlock.models.rl RANK CONFIG``). Writes
    ``rl.json`` (rank 0) or ``rl-error-<rank>.txt`` next to the config."""
    import torch.distributed as dist

    cfg = json.loads(Path(config_path).read_text())
    out = Path(config_path).parent
    trainer = None
    try:
        trainer = _Trainer(rank, cfg)
        trainer.run()
        if rank == 0:
            trainer.result["times"] = trainer.times
            (out / "rl.json").write_text(json.dumps(trainer.result, indent=1))
        code = 0
    except BaseException as e:  # the driver reads the message; the traceback goes to this rank's log
        import traceback

        traceback.print_exc()
        msg = str(e) if isinstance(e, ModelError) else f"{type(e).__name__}: {e}"
        (out / f"rl-error-{rank}.txt").write_text(msg)
        code = 3
    finally:
        if trainer is not None and getattr(trainer, "sync", None) is not None:
            trainer.sync.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


# ------------------------------------------------------------------------------------------------- driver

def vllm_python() -> str:
    """An interpreter with vLLM: ``$OARLOCK_VLLM_PYTHON``, this one when it imports vLLM, or the clone's
    ``.vllm-venv`` (``scripts/vllm_env.sh``). Raises :class:`ModelError` saying how to get one.

    ``make demo`` builds ``.vllm-venv`` while the file phases run and names a file that receives the set-up's exit
    status in ``OARLOCK_VLLM_SETUP_RC`` (its log in ``OARLOCK_VLLM_SETUP_LOG``): this waits for it."""
    _wait_for_setup()
    env = os.environ.get("OARLOCK_VLLM_PYTHON")
    if env:
        if not os.access(env, os.X_OK):
            raise ModelError(f"demo: OARLOCK_VLLM_PYTHON={env} is not an executable interpreter")
        return env
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    for root in (Path(sys.prefix).parent, Path(__file__).resolve().parents[3]):
        cand = root / ".vllm-venv" / "bin" / "python"
        if cand.is_file():
            return str(cand)
    raise ModelError("demo: the RL phase needs vLLM: run `bash scripts/vllm_env.sh` in the clone (builds "
                     ".vllm-venv), or set OARLOCK_VLLM_PYTHON to a Python with vllm (pip install 'oarlock[vllm]'); "
                     "--rl-steps 0 skips the phase")


def _wait_for_setup() -> None:
    rc_file = os.environ.get("OARLOCK_VLLM_SETUP_RC")
    if not rc_file:
        return
    log = os.environ.get("OARLOCK_VLLM_SETUP_LOG", "")
    rc_path = Path(rc_file)
    if not rc_path.is_file():
        print(f"[demo] waiting for the vLLM set-up (scripts/vllm_env.sh{', log: ' + log if log else ''})", flush=True)
        t0 = time.monotonic()
        while not rc_path.is_file():
            if time.monotonic() - t0 > 1800:
                raise ModelError(f"demo: the vLLM set-up did not finish in 30 minutes (log: {log})")
            time.sleep(1)
    code = rc_path.read_text().strip()
    if code != "0":
        tail = "\n".join(Path(log).read_text(errors="replace").splitlines()[-15:]) if log and Path(log).is_file() else ""
        raise ModelError(f"demo: the vLLM set-up (scripts/vllm_env.sh) failed with exit status {code} (log: {log})"
                         + (f"; its last lines:\n{tail}" if tail else ""))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _core_binding(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: one core list per engine worker, round-robin over this machine's cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) >= tp:
        per = len(cores) // tp
        return "|".join(",".join(str(c) for c in cores[w * per:(w + 1) * per]) for w in range(tp))
    return "|".join(str(cores[w % len(cores)]) for w in range(tp))


def run_rl_phase(settings: RLSettings, model_dir: Path, out: Path, *, prompt: str, tiny: bool) -> dict:
    """Run the RL phase on the HF model in ``model_dir`` (two trainer processes, one vLLM engine); returns the
    ``rl`` object of the report. Raises :class:`ModelError` with the failing rank's message (e.g. the on-policy
    check naming its step) when a process fails or the phase runs past ``settings.timeout_s``."""
    settings.validate()
    python = vllm_python()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rl-error-*.txt"):
        old.unlink()
    (out / "rl.json").unlink(missing_ok=True)
    cfg = {"settings": asdict(settings), "model_dir": str(model_dir), "tiny": tiny, "prompt": prompt,
           "trainer_port": _free_port(), "sync_port": _free_port()}
    cfg_path = out / "rl-config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    import secrets

    env = {**os.environ, "OARLOCK_SYNC_TOKEN": secrets.token_hex(16),  # only these processes may join the sync
           "VLLM_CPU_OMP_THREADS_BIND": _core_binding(settings.engine_tp),
           "VLLM_CONFIGURE_LOGGING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    t0 = time.monotonic()
    import threading

    # the ranks run in sessions of their own (so that their vLLM processes can be killed with them): a SIGTERM to
    # this driver must still reach the clean-up below, which Python's default handler would skip
    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main_thread else None
    try:
        for rank in range(TRAINER_RANKS):
            log = open(out / f"rl-rank{rank}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen([python, "-m", "oarlock.models.rl", str(rank), str(cfg_path)], env=env,
                                          stdout=None if rank == 0 else log, stderr=log, start_new_session=True))
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() - t0 > settings.timeout_s:
                time.sleep(2)  # let the other rank write its own error first
                break
            time.sleep(0.5)
    finally:
        for p in procs:  # each rank and the vLLM processes it started: one session each
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for log in logs:
            log.close()
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)
    errors = [(out / f"rl-error-{r}.txt") for r in range(TRAINER_RANKS)]
    for e in errors:
        if e.is_file():
            raise ModelError(e.read_text().strip() + f" (log: {out / 'rl-rank0.log'})")
    if time.monotonic() - t0 > settings.timeout_s:
        raise ModelError(f"demo: the RL phase ran past {settings.timeout_s:.0f} s (logs: {out}/rl-rank*.log)")
    codes = [p.returncode for p in procs]
    if codes != [0] * TRAINER_RANKS or not (out / "rl.json").is_file():
        tail = "\n".join((out / "rl-rank0.log").read_text(errors="replace").splitlines()[-20:])
        raise ModelError(f"demo: an RL process failed (exit codes {codes}); last lines of rank 0's log:\n{tail}")
    return json.loads((out / "rl.json").read_text())


def learning_margin(steps: list[dict], k: int = 3) -> float:
    """Mean reward of the last ``k`` steps minus that of the first ``k`` (NaN with fewer than ``2 k`` steps)."""
    if len(steps) < 2 * k:
        return math.nan
    first = sum(x["reward_mean"] for x in steps[:k]) / k
    last = sum(x["reward_mean"] for x in steps[-k:]) / k
    return last - first


if __name__ == "__main__":
    sys.exit(trainer_main(int(sys.argv[1]), sys.argv[2]))
