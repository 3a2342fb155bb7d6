"""The ``treecompile`` console script.

Commands:
- ``treecompile demo``: SmolLM2 + the shipped draft head, tree speculation against plain greedy decoding
  (:mod:`treecompile.demo`).
- ``treecompile train-drafter``: train an EAGLE-3 head for a target on its own greedy continuations
  (:mod:`treecompile.train`).
"""

from __future__ import annotations

import argparse
import logging
import sys


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train-drafter",
        help="train an EAGLE-3 draft head on the target's own greedy continuations",
        description="Self-distill an EAGLE-3 draft head: generate the target's greedy continuations of the "
        "training prompts (cached in OUT/data, resumable), pick the draft vocabulary, train with "
        "training-time test, checkpoint to OUT and write the layout EagleDrafter.from_pretrained reads.",
    )
    p.add_argument("--target", default="smollm2", help="'smollm2' (the embedded default) or an HF model path/id")
    p.add_argument("--out", required=True, help="output directory (data cache, checkpoint, exported head)")
    p.add_argument("--prompts", type=int, default=None, help="use the first N prompts of the seeded order (default all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="continuation length per prompt (default 128)")
    p.add_argument("--gen-batch-size", type=int, default=32, help="prompts per generate call (default 32)")
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="continuations per prompt: the greedy one plus N-1 sampled ones (default 1)")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled continuations (default 0.8)")
    p.add_argument("--steps", type=int, default=1000, help="total optimizer steps (default 1000)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per training step (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--freeze-lm-head", action="store_true",
                   help="keep the lm_head rows copied from the target (regularizes small data sets); the export then "
                   "leaves them out and loading takes them from the target again (config lm_head_from_target)")
    p.add_argument("--lm-head-int8", action="store_true",
                   help="export the lm_head rows as int8 with a scale a row (half the bytes: a bigger --draft-vocab "
                   "fits a size budget; config lm_head_int8, which only treecompile's loader reads)")
    p.add_argument("--features", default="auto", choices=("auto", "online", "stored"),
                   help="where the target's hidden states come from: 'stored' records them during generation "
                   "(float16 in OUT/data, ~3.5 KB a token for SmolLM2, 24 KB for an 8B Llama; fastest training), "
                   "'online' runs the target in each training step instead (small data at any model size); "
                   "'auto' (default) stores them when that fits a quarter of memory and half the free disk")
    p.add_argument("--schedule-steps", type=int, default=None, help="cosine schedule horizon (default --steps)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default 8192)")
    p.add_argument("--topk-targets", type=int, default=8,
                   help="the target's top-k log-probs recorded per generated token: the soft targets (default 8)")
    p.add_argument("--ttt-steps", type=int, default=2, help="training-time-test steps after step 0 (default 2)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="checkpoint interval in steps (default 50)")
    p.add_argument("--export-dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="torch device (default cuda when available, else cpu)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for torch (default 2)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--init-from", default=None, metavar="HEAD_DIR",
                   help="warm start: train on from an exported head (its weights and draft vocabulary; fresh "
                   "optimizer state), e.g. with new sampled data or more steps; a --draft-vocab above the head's grows "
                   "its vocabulary (new ids start from the target's output rows, mapped into the head's)")  # fmt: skip
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training with a checkpoint after this many minutes of it in all (a resumed run counts "
                   "the time before it; --resume continues), e.g. to fit a job's time limit")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="SmolLM2 + the shipped head: tree speculation vs plain greedy decoding",
        description="Load SmolLM2-135M-Instruct and the draft head shipped with treecompile, generate for a few "
        "chat prompts with tree speculation and with plain greedy decoding (HF generate), and print the texts, "
        "tau (mean accepted tokens per round), tokens/s of both and whether the outputs match.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object line (tau, tokens_per_s_tree, "
                   "tokens_per_s_plain, outputs_match, device, ...)")  # fmt: skip
    p.add_argument("--device", default=None, help="torch device (default cuda when available, else cpu)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt (default 96)")
    p.add_argument("--prompts", type=int, default=None, help="use only the first N demo prompts")
    p.add_argument("--head", default=None, help="a draft head directory (default: the shipped one)")
    p.add_argument("--tree", default=None, metavar="K,S,N", help="override the tree shape: topk,steps,num_nodes")
    p.add_argument("--treecompile-plain", action="store_true",
                   help="also time treecompile's own plain decode (one-node tree; one more graph to compile)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the target's dtype (default float32: greedy text is reproducible across kernels only "
                   "there; bf16 trees and plain decoding round differently)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for torch (default 2)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed passes over the prompts; tokens/s from each method's median pass (default 1)")


def build_parser() -> argparse.ArgumentParser:
    from treecompile import __version__

    parser = argparse.ArgumentParser(
        prog="treecompile",
        description="Draft-tree speculative decoding for Hugging Face models (torch.compile backend 'treespec').",
    )
    parser.add_argument("--version", action="version", version=f"treecompile {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    _add_demo(sub)
    _add_train(sub)
    return parser


def _threads(n: int) -> None:
    import os

    import torch

    if n < 1:
        raise ValueError(f"threads: expected a positive int, got {n}")
    torch.set_num_threads(min(n, os.cpu_count() or n))


def _run_train(args, argv) -> int:
    from treecompile.train import TrainConfig, train_drafter

    _threads(args.threads)
    cfg = TrainConfig(
        out=args.out, prompts=args.prompts, max_new_tokens=args.max_new_tokens, gen_batch_size=args.gen_batch_size,
        samples_per_prompt=args.samples_per_prompt, temperature=args.temperature, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, schedule_steps=args.schedule_steps,
        draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps, checkpoint_every=args.checkpoint_every,
        seed=args.seed, resume=args.resume, export_dtype=args.export_dtype, weight_decay=args.weight_decay,
        freeze_lm_head=args.freeze_lm_head, lm_head_int8=args.lm_head_int8, features=args.features,
        topk_targets=args.topk_targets, init_from=args.init_from,
        max_hours=None if args.max_minutes is None else args.max_minutes / 60,
    )  # fmt: skip
    summary = train_drafter(cfg, target_name=args.target, device=args.device or _default_device(),
                            progress=not args.no_progress, argv=argv)  # fmt: skip
    logging.getLogger("treecompile").info(
        "done: %d steps, final loss %.4f, top-1 agreement per TTT step %s; head in %s", summary["steps"],
        summary["final_loss_mean_last_20"], [round(a, 3) for a in summary["final_top1_acc_per_ttt_step"]], args.out,
    )  # fmt: skip
    return 0


def _run_demo(args) -> int:
    from treecompile.demo import run_demo

    _threads(args.threads)
    tree = None
    if args.tree:
        try:
            tree = tuple(int(x) for x in args.tree.split(","))
            if len(tree) != 3:
                raise ValueError
        except ValueError:
            raise ValueError(f"tree: expected three ints K,S,N (e.g. 2,4,8), got {args.tree!r}") from None
    return run_demo(device=args.device or _default_device(), max_new_tokens=args.max_new_tokens, as_json=args.json,
                    prompts=args.prompts, head=args.head, tree=tree, treecompile_plain=args.treecompile_plain,
                    dtype=args.dtype, repeats=args.repeats)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    raw = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(raw)
    if args.command is None:
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)  # fmt: skip
    try:
        if args.command == "train-drafter":
            return _run_train(args, raw[raw.index("train-drafter") + 1 :])
        if args.command == "demo":
            return _run_demo(args)
    except (ValueError, ImportError) as exc:
        # Bad input and missing packages are the user's to fix: one clear line, no traceback.
        print(f"treecompile {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"treecompile {args.command}: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
