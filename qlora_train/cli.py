"""``qlora-train --config x.yaml [--set key.path=value ...] [--overwrite]``: a thin entry over ``train.run``.

Training into a ``train.output_dir`` that holds checkpoints of the same config resumes them; one that holds a
finished run or another config's checkpoints is refused unless ``--overwrite`` (``train.resume``).

``--stats-only`` and ``--debug-samples N`` run the data pipeline with the
tokenizer only (``diagnostics.run``) and exit without training; so does ``--preprocess``, which writes the
datasets for ``data.prepared_path`` (``train.preprocess``). After training,
``--merge`` writes the merged model and ``--generate PROMPT`` / ``--chat`` try it
(``export/``, docs/export.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from qlora_train.config import load_config
from qlora_train.errors import ConfigError, QloraError
from qlora_train.terminal import VisibleFormatter, visible


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="qlora-train", description="QLoRA fine-tuning with exact loss masks.")
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config value (repeatable; applied after the file)")
    p.add_argument("--overwrite", action="store_true",
                   help="training: remove the run found in train.output_dir (a finished one, or another config's "
                        "checkpoints) and start at step 0; without it such a directory is refused")
    d = p.add_argument_group("diagnostics (tokenizer and data only, no model; exit without training)")
    d.add_argument("--stats-only", action="store_true",
                   help="print length statistics; write stats.json and token_lengths.png")
    d.add_argument("--stats-dir", metavar="DIR",
                   help="where diagnostics write their files (default: train.output_dir)")
    d.add_argument("--debug-samples", type=int, default=0, metavar="N",
                   help="show N processed samples with trained text marked; write debug_samples.html")
    d.add_argument("--debug-seed", type=int, metavar="SEED", help="draw the samples at random with this seed")
    d.add_argument("--debug-tokens", action="store_true", help="also print one line per token: label and id")
    d.add_argument("--debug-refused", action="store_true", help="show refused rows with their reason instead")
    r = p.add_argument_group("preprocess (tokenizer and data only, no model; see docs/training.md)")
    r.add_argument("--preprocess", action="store_true",
                   help="run the data pipeline as training would and write the datasets for data.prepared_path")
    r.add_argument("--preprocess-dir", metavar="DIR",
                   help="where --preprocess writes (default: data.prepared_path, else <train.output_dir>/prepared)")
    e = p.add_argument_group("after training (the trained adapter in train.output_dir; see docs/export.md)")
    e.add_argument("--merge", action="store_true",
                   help="merge the adapter into the base and write a transformers model directory")
    e.add_argument("--merge-dir", metavar="DIR",
                   help="where --merge writes and --merged reads (default: <train.output_dir>/merged)")
    e.add_argument("--merge-base", choices=("original", "dequantized"),
                   help="add the adapter to the base's own 16-bit weights (original, the default) or to the "
                        "4-bit weights training used, dequantised (dequantized)")
    e.add_argument("--max-shard-size", metavar="SIZE", help="largest safetensors file --merge writes (default: 5GB)")
    e.add_argument("--checkpoint", metavar="NAME",
                   help="use checkpoint-N instead of the final adapter: N, checkpoint-N, last, or a path")
    e.add_argument("--generate", metavar="PROMPT",
                   help="answer PROMPT with the trained model (training template, greedy) and print the answer")
    e.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="--generate: an image the prompt asks about, before its text (repeatable; a vision-language "
                        "model, docs/vision.md)")
    e.add_argument("--chat", action="store_true", help="chat with the trained model (an empty line ends)")
    e.add_argument("--merged", action="store_true",
                   help="--generate / --chat with the merged model in --merge-dir instead of base + adapter")
    e.add_argument("--max-new-tokens", type=int, metavar="N", help="--generate / --chat: at most N tokens per "
                   "answer (default: 256)")
    args = p.parse_args(argv)
    check_export_args(p, args)
    if args.debug_samples < 0:
        p.error("--debug-samples must be >= 0")
    if (args.debug_seed is not None or args.debug_tokens or args.debug_refused) and not args.debug_samples:
        p.error("--debug-seed, --debug-tokens and --debug-refused need --debug-samples N")
    return args


def check_export_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each after-training flag needs the mode it modifies; the modes exclude training diagnostics."""
    trying = args.generate is not None or args.chat
    if args.generate is not None and args.chat:
        p.error("--generate and --chat: pick one")
    if (args.merge or trying) and (args.stats_only or args.debug_samples):
        p.error("--merge, --generate and --chat cannot be combined with --stats-only or --debug-samples")
    if (args.merge_base or args.max_shard_size) and not args.merge:
        p.error("--merge-base and --max-shard-size need --merge")
    if args.image and args.generate is None:
        p.error("--image needs --generate")
    if (args.merged or args.max_new_tokens is not None) and not trying:
        p.error("--merged and --max-new-tokens need --generate or --chat")
    if args.checkpoint and not (args.merge or trying and not args.merged):
        p.error("--checkpoint needs --merge, or --generate / --chat without --merged")
    if args.merge_dir and not (args.merge or args.merged):
        p.error("--merge-dir needs --merge or --merged")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    if args.preprocess and (args.stats_only or args.debug_samples or args.merge or trying):
        p.error("--preprocess runs alone: not with --stats-only, --debug-samples, --merge, --generate or --chat")
    if args.preprocess_dir and not args.preprocess:
        p.error("--preprocess-dir needs --preprocess")
    if args.overwrite and (args.stats_only or args.debug_samples or args.preprocess or args.merge or trying):
        p.error("--overwrite applies to training only (the diagnostics, --preprocess and export never remove a run)")


def export_and_try(cfg, args: argparse.Namespace) -> None:
    """``--merge`` first, then ``--generate`` / ``--chat`` (with the merged model under ``--merged``)."""
    from qlora_train.export.merge import MergeOptions, merge, merge_dir

    if args.merge:
        path = merge(cfg, MergeOptions(args.merge_dir, args.checkpoint, args.merge_base or "original",
                                       args.max_shard_size or "5GB"))
        print(f"merged model written to {path}", flush=True)
    if args.generate is not None or args.chat:
        from qlora_train.export.generate import try_model

        try_model(cfg, prompt=args.generate, chat=args.chat, checkpoint=None if args.merged else args.checkpoint,
                  merged_dir=merge_dir(cfg, args.merge_dir) if args.merged else None,
                  max_new_tokens=args.max_new_tokens or 256, images=args.image)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    shown = logging.StreamHandler()  # row text in a log line (a refusal's detail) is shown escaped
    shown.setFormatter(VisibleFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, handlers=[shown])
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"invalid config {args.config}:", file=sys.stderr)
        for problem in err.problems:
            print(visible(f"  {problem}"), file=sys.stderr)
        return 2

    if args.stats_only or args.debug_samples:
        from qlora_train.diagnostics.run import DebugOptions, diagnose

        debug = DebugOptions(args.debug_samples, args.debug_seed, args.debug_tokens, args.debug_refused)
        return run_guarded(cfg, lambda: diagnose(cfg, stats=args.stats_only, debug=debug, out_dir=args.stats_dir))
    if args.merge or args.generate is not None or args.chat:
        return run_guarded(cfg, lambda: export_and_try(cfg, args))
    if args.preprocess:
        from qlora_train.train.preprocess import preprocess

        return run_guarded(cfg, lambda: preprocess(cfg, args.preprocess_dir))
    from qlora_train.train.run import train

    return run_guarded(cfg, lambda: train(cfg, overwrite=args.overwrite))


def run_guarded(cfg, job) -> int:
    """Run ``job`` (training, diagnostics or export), turning the expected failures into one clear message and
    an exit code (no traceback): every ``QloraError`` carries its own (``errors``), so nothing here imports
    the modules that raise them.

    0 done · 1 data or model error (unreadable source, every row dropped, a bad
    row with ``on_bad_row: error``, a model that cannot be loaded) · 2 config error, or nothing to export
    (no adapter, no disk space) · 3 CUDA out of memory ·
    128 + signal: stopped by Ctrl-C / SIGTERM after saving a checkpoint.
    """
    try:
        job()
    except QloraError as err:
        print(visible(err.cli_message()), file=sys.stderr)  # it may name a row's content
        return err.exit_code
    except KeyboardInterrupt:  # outside the training loop, or a second Ctrl-C inside it
        print("interrupted: stopped at once without saving (a single Ctrl-C or SIGTERM during training saves "
              "a checkpoint first)", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as err:
        if not _cuda_out_of_memory(err):
            raise
        from qlora_train.train.run import oom_advice  # training ran: already imported

        print(f"error: {oom_advice(cfg)}\n({' '.join(str(err).split())[:300]})", file=sys.stderr)
        return 3
    return 0


def _cuda_out_of_memory(err: BaseException) -> bool:
    torch = sys.modules.get("torch")  # only a run that imported torch can run out of its memory
    return torch is not None and isinstance(err, torch.OutOfMemoryError)


if __name__ == "__main__":
    sys.exit(main())
