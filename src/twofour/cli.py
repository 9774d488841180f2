"""The ``twofour`` command: ``train``, ``compare``, ``export``, ``generate`` (and ``bench`` on a GPU)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from .sparse.recipes import DEFAULT_RECIPE, RECIPES

__all__ = ["main"]


def _run_args(p: argparse.ArgumentParser, command: str, default_out: str) -> None:
    """The run options ``command`` takes, each as TrainConfig declares it (:mod:`twofour.training.declare`)."""
    from .training.config import TrainConfig  # noqa: PLC0415
    from .training.declare import add_options  # noqa: PLC0415

    add_options(p, TrainConfig, command, {"out_dir": default_out})


def _config(a: argparse.Namespace, recipe: str):
    """A TrainConfig from the parsed options: every option named like a field sets that field."""
    from .training.config import TrainConfig  # noqa: PLC0415
    from .training.options import check_fsdp_launch, opt_pairs  # noqa: PLC0415

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(a).items() if k in fields}
    data = a.data
    if data is not None and not data.startswith("hf:"):  # a path means the same folder from anywhere
        data = str(Path(data).expanduser().resolve())
    check_fsdp_launch(a.fsdp, "fsdp" in getattr(a, "given", ()))
    return TrainConfig(**{**given, "recipe": recipe, "recipe_options": opt_pairs(a.recipe_options or []),
                          "data": data})


def _given(a: argparse.Namespace) -> set[str]:
    """The TrainConfig fields set by an option on the command line (not by a default)."""
    return set(a.given)


def _cmd_train(a: argparse.Namespace) -> int:
    from .training.checkpoint import CKPT, checkpoint_path  # noqa: PLC0415
    from .training.console import graphs_line  # noqa: PLC0415
    from .training.loop import train  # noqa: PLC0415
    from .training.runs import resume_config  # noqa: PLC0415

    cfg = _config(a, a.recipe)
    if a.resume:  # the run's own settings, from its checkpoint; options given must agree with them
        cfg = resume_config(a.out_dir, cfg, _given(a))
    s = train(cfg)
    if s:
        found = checkpoint_path(s["out_dir"])  # ckpt.pt, or an FSDP2 run's sharded ckpt/, or none
        ckpt = ("" if found is None or cfg.ckpt_interval == 0 else
                f"{CKPT}, " if found.name == CKPT else f"{found.parent.name}/ (sharded), ")
        val, loss = (f"{s[k]:.4f}" if s[k] is not None else "n/a" for k in ("final_val_loss", "final_train_loss"))
        print(f"\n{s['recipe']} on {s['model']}: {s['steps']} steps, {s['tokens']:,} tokens\n"
              f"  final train loss {loss}, val loss {val}\n  {s['tokens_per_s']:,.0f} tokens/s, "
              f"flip rate {s['final_flip_rate']:.2e} (mean {s['mean_flip_rate']:.2e}){graphs_line(s)}\n"
              f"  outputs: {s['out_dir']}/ (metrics.csv, {ckpt}summary.json{', curves.png' if s['plot'] else ''})")
    return 0


def _cmd_compare(a: argparse.Namespace) -> int:
    from .training.compare import compare, parse_recipes, parse_seeds, results_table  # noqa: PLC0415
    from .training.sweep import parse_rates, sweep, sweep_table  # noqa: PLC0415

    recipes, seeds = parse_recipes(a.recipes), parse_seeds(a.seeds)
    base = _config(a, recipes[0])
    if a.lrs is None:
        summaries, table_of = compare(recipes, base, seeds), results_table
    else:  # a learning-rate sweep: each recipe at its best rate
        summaries, table_of = sweep(recipes, base, seeds, parse_rates(a.lrs, base)), sweep_table
    if not summaries:  # under torchrun, a rank other than 0: rank 0 reports
        return 0
    print("\n" + table_of(summaries))
    print(f"table: {Path(a.out_dir) / 'compare.md'}, plot: {Path(a.out_dir) / 'compare.png'}")
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    from .training.export import export  # noqa: PLC0415

    info = export(a.run, a.out, a.dtype, weights_format=a.weights_format, overwrite=a.overwrite)
    print(json.dumps(info, indent=2))
    if info["dense"]:
        print(f"twofour export: {info['dense_reason']}; wrote {info['out']}", file=sys.stderr)
    else:
        print(f"twofour export: {len(info['sparse_layers'])} layers 2:4 as values + positions "
              f"({info['sparse_layer_ratio']:.4f}x of their dense {info['dtype']} bytes); wrote {info['out']}",
              file=sys.stderr)
    return 0


def _cmd_generate(a: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from .inference.format import load_for_inference, read_export_config  # noqa: PLC0415
    from .inference.sampling import MAX_NEW_TOKENS, IdCodec, codec_from_dict, stream  # noqa: PLC0415
    from .training.config import MAX_SEED, resolve_device  # noqa: PLC0415

    for opt, value, most in (("--max-new-tokens", a.max_new_tokens, MAX_NEW_TOKENS), ("--top-k", a.top_k, None),
                             ("--temperature", a.temperature, None), ("--seed", a.seed, MAX_SEED)):
        if not 0 <= value <= (most or math.inf):  # (a NaN temperature fails too)
            raise ValueError(f"{opt} must be >= 0{f' and at most {most:,}' if most else ''}, got {value}")
    cfg = read_export_config(a.dir)
    device = resolve_device(a.device)
    codec = codec_from_dict(cfg.get("tokenizer"), cfg["model"]["vocab_size"])
    ids = codec.encode(a.prompt)
    if not ids:
        raise ValueError("--prompt is empty: give at least one token")
    if isinstance(codec, IdCodec):
        print("twofour generate: this export records no tokenizer: the prompt and the output are token ids",
              file=sys.stderr)
    model = load_for_inference(a.dir, device)
    gen = torch.Generator(device).manual_seed(a.seed)
    text = codec.pieces()  # the prompt, then each token as it comes
    print(text(ids), end="", flush=True)
    for nxt in stream(model, torch.tensor([ids], device=device), a.max_new_tokens, temperature=a.temperature,
                      top_k=a.top_k or None, generator=gen):
        print(text(nxt[0].tolist()), end="", flush=True)
    print(text([]))
    return 0


def _cmd_bench(a: argparse.Namespace) -> int:
    from .bench.report import run_bench  # noqa: PLC0415

    run_bench(a)
    return 0


REGIME_HELP = """\
regimes (--regime) give the defaults of the options marked 'regime'; an option given explicitly wins:
                   ours (default)                    authors (S-STE paper's GPT-2 124M settings)
  peak lr          the preset's (tiny, gpt-10m 1e-3, 1.5e-4
                   gpt2-124m 6e-4, -350m 3e-4,
                   -774m 2.5e-4, -1.5b 2e-4;
                   llama-tiny 1e-3, -125m 6e-4,
                   -350m, -1b, -7b 3e-4)
  cosine floor     0.1 x peak                        1e-5, i.e. peak / 15
  warmup           5% of --steps, at most 2000       10% of --steps, at most 3000 (the authors warm
                                                     up 3000 of 300k steps; shorter runs warm up
                                                     for a tenth of their length)
  tokens per step  batch-size x seq-len x processes  about 524,288 (0.5M): grad-accum =
                   (grad-accum 1)                    ceil(524288 / (batch-size x seq-len x processes))
  SR-STE decay     the recipe's default (2e-4)       6e-5 for recipes that take decay
  not set by --regime: AdamW betas (0.9, 0.95), weight decay 0.1, gradient clipping 1.0
"""


def _export_parser(sub) -> argparse.ArgumentParser:
    """``twofour export``'s parser."""
    e = sub.add_parser("export", help="write a trained run for inference: 2:4 layers as values + positions "
                       "(docs/export-format.md)")
    e.add_argument("run", help="run folder or checkpoint file")
    e.add_argument("--out", default=None, help="output folder (default: the run's folder); gets model.safetensors "
                   "and model_config.json")
    e.add_argument("--weights-format", default="safetensors", choices=["safetensors", "pt"],
                   help="the weights file: model.safetensors, or model.pt (torch.save; read with weights_only=True) "
                        "(default %(default)s)")
    e.add_argument("--overwrite", action="store_true", help="replace an export the folder already holds")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the stored weights (default %(default)s)")
    e.set_defaults(func=_cmd_export)
    return e


def _generate_parser(sub) -> argparse.ArgumentParser:
    """``twofour generate``'s parser."""
    g = sub.add_parser("generate", help="sample from an exported model (twofour export), with a KV cache")
    g.add_argument("dir", help="export folder (a run folder after `twofour export RUN`)")
    g.add_argument("--prompt", default="\n", help="text to continue (token ids separated by spaces for a model "
                   "without a known tokenizer; default a newline)")
    g.add_argument("--max-new-tokens", type=int, default=300, help="tokens to sample, printed as they come (default "
                   "%(default)s, at most 1,000,000)")
    g.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 takes the most likely "
                   "token (default %(default)s)")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0: all "
                   "(default %(default)s)")
    g.add_argument("--seed", type=int, default=1337, help="sampling seed (default %(default)s)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default %(default)s)")
    g.set_defaults(func=_cmd_generate)
    return g


def _bench_parser(sub) -> argparse.ArgumentParser:
    """``twofour bench``'s parser."""
    b = sub.add_parser("bench", help="time twofour against dense bf16 on this GPU: layers, FFN blocks and the "
                       "training loop's tokens/s; print the tables (needs CUDA)")
    b.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    what = b.add_mutually_exclusive_group()
    what.add_argument("--inference", action="store_true", help="instead: an exported 2:4 model (--model) against "
                      "its dense twin, prefill and decode tokens/s (CUDA graphs, static KV cache)")
    what.add_argument("--fp8", action="store_true", help="instead: FP8 layers (dense and s-ste) against bf16 and "
                      "against dense FP8")
    b.add_argument("--model", default="gpt2-774m", help="--inference: the preset, random weights (default "
                   "%(default)s; e.g. llama-7b)")
    b.add_argument("--layers", type=int, default=None, help="--inference: build the preset with this many blocks "
                   "instead of its own (less memory and time; the report says so)")
    b.add_argument("--write", default=None, help="also write the markdown report into this file (e.g. "
                   "docs/bench.md), between its <!-- bench:begin --> and <!-- bench:end --> markers (fp8, inference: "
                   "their own), appended the first time")
    b.set_defaults(func=_cmd_bench)
    return b


def build_parser() -> argparse.ArgumentParser:
    """The ``twofour`` parser; ``parser.commands`` maps each command to its subparser."""
    from .version import __version__  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="twofour", description="Pre-train transformers with 2:4 sparse weights.",
                                allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a GPT or Llama-style model with a recipe (default: tiny, "
                       f"{DEFAULT_RECIPE}, Python stdlib corpus)",
                       epilog=REGIME_HELP, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    t.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"{', '.join(RECIPES)} (default %(default)s)")
    _run_args(t, "train", "runs/train")
    t.set_defaults(func=_cmd_train)
    c = sub.add_parser("compare", help="train several recipes on the same data and budget; table and plot",
                       description="Train each recipe once per seed with the same options; report per recipe "
                       "the mean +- standard deviation of the final val loss over seeds and the paired gap to "
                       "dense (recipe - dense of the same seed, then mean +- std of those gaps).",
                       epilog=REGIME_HELP, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    c.add_argument("--recipes", default="dense,ste,sr-ste,s-ste", help="comma-separated (default %(default)s)")
    c.add_argument("--seeds", default=None, help="comma-separated seeds, each recipe once per seed (default --seed)")
    c.add_argument("--lrs", default=None, metavar="LR,LR,...", help="a sweep: each recipe at each peak learning rate "
                   "(5e-4,1e-3,2e-3, or 0.5x,1x,2x the preset's); compare.md gives each at its best (not with --lr)")
    _run_args(c, "compare", "runs/compare")
    c.set_defaults(func=_cmd_compare)
    e, g, b = _export_parser(sub), _generate_parser(sub), _bench_parser(sub)
    p.commands = {"train": t, "compare": c, "export": e, "generate": g, "bench": b}
    return p


def _explicit(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The destinations of the options that appear in ``argv`` (abbreviations are off, so an
    option appears under one of its own names)."""
    flags = {tok.split("=", 1)[0] for tok in argv if tok.startswith("--")}
    return [act.dest for act in parser._actions if flags & set(act.option_strings)]


def _interrupted(args: argparse.Namespace, e: KeyboardInterrupt) -> str:
    """What an interrupt left behind, and how to go on."""
    from .training.checkpoint import checkpoint_path  # noqa: PLC0415
    from .training.console import Interrupted  # noqa: PLC0415

    if args.command not in ("train", "compare"):
        return "interrupted"
    again = ("run the same command again to continue (finished runs are kept, this one resumes)"
             if args.command == "compare" else f"`twofour train --out {args.out_dir} --resume` continues")
    if isinstance(e, Interrupted) and e.checkpoint is None:
        return f"interrupted after step {e.step}; nothing saved (--ckpt-interval 0)"
    if isinstance(e, Interrupted):
        return f"interrupted; step {e.step} is saved in {e.checkpoint}: {again}"
    if args.command == "train" and checkpoint_path(args.out_dir) is not None:
        return f"interrupted; the last checkpoint in {args.out_dir} is intact: {again}"
    if args.command == "compare":
        return f"interrupted; {again}"
    return "interrupted before a checkpoint was written"


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad input ends with one line on stderr and exit status 2."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.given = _explicit(parser.commands[args.command], argv)
    from .errors import TwofourError, out_of_memory_message  # noqa: PLC0415

    try:
        return args.func(args)
    except (TwofourError, ValueError, TypeError) as e:
        print(f"twofour {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or folder that can't be read or written
        where = f": {e.filename}" if e.filename else ""
        print(f"twofour {args.command}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        line = out_of_memory_message(e)
        if line is None:
            raise
        print(f"twofour {args.command}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from .training.parallel import launched_main  # noqa: PLC0415

        if launched_main():  # under torchrun, one message
            print(f"twofour {args.command}: {_interrupted(args, e)}", file=sys.stderr)
        return 130
    finally:  # under torchrun: leave NCCL/gloo cleanly
        import gc  # noqa: PLC0415

        import torch.distributed as dist  # noqa: PLC0415

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            # a sharded model's reference cycles hold the process group; freed in the interpreter's
            # final collection instead, gloo's worker threads abort the process waiting for the GIL
            gc.collect()


if __name__ == "__main__":
    sys.exit(main())
