"""Batching: pad what the dataset module made; never re-mask or re-tokenize."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qlora_train.data.tokenize import IGNORE_INDEX


@dataclass
class PadCollator:
    """Right-pad ``input_ids`` with the pad id, ``labels`` with -100, ``attention_mask`` with 0.

    >>> PadCollator(0, 4)([{"input_ids": [5, 6], "attention_mask": [1, 1], "labels": [-100, 6]}])["labels"]
    tensor([[-100,    6, -100, -100]])
    """

    pad_token_id: int
    pad_to_multiple_of: int = 8

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        m = self.pad_to_multiple_of
        width = -(-longest // m) * m if m else longest
        ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            ids[row, :n] = torch.as_tensor(f["input_ids"])
            labels[row, :n] = torch.as_tensor(f["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
