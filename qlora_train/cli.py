"""``qlora-train --config x.yaml [--set key.path=value ...]``: a thin entry over ``train.run``."""

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
    return p.parse_args(argv)


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

    return run_training(cfg)


def run_training(cfg) -> int:
    """Train, turning the expected failures into one clear message and an exit code (no traceback).

    0 done · 1 data or model error (unreadable source, every row dropped, a bad
    row with ``on_bad_row: error``, a model that cannot be loaded) · 2 config error · 3 CUDA out of memory ·
    128 + signal: stopped by Ctrl-C / SIGTERM after saving a checkpoint.
    """
    import torch

    from qlora_train.data.dataset import EmptyDatasetError
    from qlora_train.data.messages import BadRowError
    from qlora_train.data.sources import SourceError
    from qlora_train.train.model import ModelLoadError
    from qlora_train.train.run import oom_advice, train
    from qlora_train.train.signals import TrainingInterrupted

    try:
        train(cfg)
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
