"""``qlora-train --config x.yaml [--set key.path=value ...]``: a thin entry over ``train.run``.

``--stats-only`` and ``--debug-samples N`` run the data pipeline with the
tokenizer only (``diagnostics.run``) and exit without training.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from qlora_train.config import ConfigError, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="qlora-train", description="QLoRA fine-tuning with exact loss masks.")
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a config value (repeatable; applied after the file)")
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
    args = p.parse_args(argv)
    if args.debug_samples < 0:
        p.error("--debug-samples must be >= 0")
    if (args.debug_seed is not None or args.debug_tokens or args.debug_refused) and not args.debug_samples:
        p.error("--debug-seed, --debug-tokens and --debug-refused need --debug-samples N")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"invalid config {args.config}:", file=sys.stderr)
        for problem in err.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2

    if args.stats_only or args.debug_samples:
        from qlora_train.diagnostics.run import DebugOptions, diagnose

        debug = DebugOptions(args.debug_samples, args.debug_seed, args.debug_tokens, args.debug_refused)
        return run_guarded(cfg, lambda: diagnose(cfg, stats=args.stats_only, debug=debug, out_dir=args.stats_dir))
    from qlora_train.train.run import train

    return run_guarded(cfg, lambda: train(cfg))


def run_guarded(cfg, job) -> int:
    """Run ``job`` (training or diagnostics), turning the expected failures into one clear message and an
    exit code (no traceback).

    0 done · 1 data or model error (unreadable source, every row dropped, a bad
    row with ``on_bad_row: error``, a model that cannot be loaded) · 2 config error · 3 CUDA out of memory ·
    128 + signal: stopped by Ctrl-C / SIGTERM after saving a checkpoint.
    """
    import torch

    from qlora_train.data.dataset import EmptyDatasetError
    from qlora_train.data.messages import BadRowError
    from qlora_train.data.sources import SourceError
    from qlora_train.errors import ModelLoadError
    from qlora_train.train.run import oom_advice
    from qlora_train.train.signals import TrainingInterrupted

    try:
        job()
    except ConfigError as err:
        print("invalid config:", file=sys.stderr)
        for problem in err.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    except (EmptyDatasetError, SourceError, BadRowError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError as err:
        print(f"error: {oom_advice(cfg)}\n({' '.join(str(err).split())[:300]})", file=sys.stderr)
        return 3
    except TrainingInterrupted as stop:
        print(f"interrupted: {stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:  # outside the training loop, or a second Ctrl-C inside it
        print("interrupted: stopped at once without saving (a single Ctrl-C or SIGTERM during training saves "
              "a checkpoint first)", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
