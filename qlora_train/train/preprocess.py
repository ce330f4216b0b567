"""``--preprocess``: the data half of a training run, on a machine without a GPU: tokenizer + pipeline (+ packing)
-> a prepared directory that ``data.prepared_path`` trains from (``data/prepared.py`` says what it holds).

Loads the tokenizer only: no model weights, and neither peft, bitsandbytes nor the Trainer.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from qlora_train.config import Config
from qlora_train.data.dataset import gc_frozen
from qlora_train.data.prepared import default_prepared_dir, write_prepared
from qlora_train.output_dir import claim_output_dir, run_inputs
from qlora_train.terminal import visible
from qlora_train.tokenizer import load_tokenizer


def preprocess(cfg: Config, out_dir: str | Path | None = None, *, stream: TextIO | None = None) -> Path:
    """Write the prepared datasets of ``cfg`` to ``out_dir`` (default ``default_prepared_dir``); print what was
    written and the rows per second of the pipeline (the tokenizer's loading left out). Returns the directory."""
    stream = stream or sys.stdout
    dest = Path(out_dir) if out_dir else default_prepared_dir(cfg)
    if not out_dir and not cfg.data.prepared_path:  # <train.output_dir>/prepared: the folder ours (output_dir)
        claim_output_dir(Path(cfg.train.output_dir), run_inputs(cfg))
    with gc_frozen():  # the modules imported, then the tokenizer, kept out of every collection's walk
        tokenizer = load_tokenizer(cfg.model)
        start = time.perf_counter()
        data = write_prepared(cfg, tokenizer, dest)
    seconds = time.perf_counter() - start
    rows = data.report.rows_in
    lines = [f"data       {line}" for line in data.report.lines()]
    lines += [f"batches    {data.packing.line()}"] if data.packing else []
    lines += [f"processed  {rows} rows in {seconds:.1f} s ({rows / seconds:.0f} rows/s, "
              f"data.num_proc={cfg.data.num_proc or 1})",
              f"prepared data written to {dest}; train from it with `--set data.prepared_path={dest}` "
              "(or data.prepared_path in the config)"]
    print(visible("\n".join(lines)), file=stream, flush=True)
    return dest
