"""``qlora-train --config x.yaml [--set key.path=value ...]``: a thin entry over ``train.run``."""

from __future__ import annotations

import argparse
import logging
import os
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

    from qlora_train.data.dataset import EmptyDatasetError
    from qlora_train.data.sources import SourceError
    from qlora_train.train.run import train

    try:
        train(cfg)
    except (EmptyDatasetError, SourceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
