"""Every step on N processes trains the global batch one process would: the epoch's ragged last batch is
filled with blank rows, never with repeated ones.

On N ranks accelerate hands out a sampler's per-device batches round-robin (``BatchSamplerShard``), and every
rank must take part in every step; when an epoch's rows do not divide into N whole micro-batches it fills the
last step with rows from the start of the epoch (``even_batches``), which one process never trains on there:
that step's update differs, and so does every later loss. Here the per-device batches come from
``WholeGlobalBatches`` instead: the epoch's last batch is completed, and whole batches added, with ``BLANK``, an
index ``BlankRows`` answers with a row of one untrained token. A blank row adds nothing to the loss or the
gradient: the SFT loss is normalised by the trained tokens of the global batch (``num_items_in_batch``), and a
preference loss by the pairs that are real (``preference_loss.mean_over``). So accelerate has nothing to fill,
and the step is the one process's step on the rows left (the quickstart: 43 rows, 2 ranks x 2 rows; the last
step's 3 rows are 2 on rank 0 and 1 + a blank on rank 1).

    >>> from torch.utils.data import SequentialSampler
    >>> list(WholeGlobalBatches(SequentialSampler(range(5)), batch_size=2, num_processes=2))
    [[0, 1], [2, 3], [4, -1], [-1, -1]]
    >>> blank_row(["input_ids", "attention_mask", "labels"], pad_token_id=0)
    {'input_ids': [0], 'attention_mask': [1], 'labels': [-100]}
"""

from __future__ import annotations

from torch.utils.data import BatchSampler, Dataset

from qlora_train.masking import IGNORE_INDEX

BLANK = -1  # the index of the blank row: never one a sampler of the dataset yields

# a blank row's value of each column a model or a collator reads (data.processed's MODEL, PAIR and UNPAIRED columns, and
# packing's): one token, attended to (so that attention over it is defined) and untrained
_BLANK_VALUES = {"attention_mask": [1], "labels": [IGNORE_INDEX], "chosen_labels": [IGNORE_INDEX],
                 "rejected_labels": [IGNORE_INDEX], "position_ids": [0], "seq_lens": [1], "prompt_length": 1,
                 "desirable": 0, "images": []}


def blank_row(columns, pad_token_id: int) -> dict:
    """A row with ``columns`` that trains nothing: one pad token (``*input_ids``), its label -100."""
    row = {}
    for name in columns:
        if name.endswith("input_ids"):
            row[name] = [pad_token_id]
        elif name in _BLANK_VALUES:
            row[name] = _BLANK_VALUES[name]
        else:
            raise ValueError(f"no blank value for the column {name!r} of the training rows")
    return row


class WholeGlobalBatches(BatchSampler):
    """``sampler``'s indices in batches of ``batch_size``, as ``BatchSampler`` without ``drop_last``, then
    ``BLANK`` until every batch is whole and there are a multiple of ``num_processes`` of them."""

    def __init__(self, sampler, batch_size: int, num_processes: int):
        super().__init__(sampler, batch_size, drop_last=False)
        self.num_processes = num_processes

    def __iter__(self):
        count = 0
        for batch in super().__iter__():
            count += 1
            yield batch + [BLANK] * (self.batch_size - len(batch))
        for _ in range(-count % self.num_processes):
            yield [BLANK] * self.batch_size

    def __len__(self) -> int:
        return -(-super().__len__() // self.num_processes) * self.num_processes


class BlankRows(Dataset):
    """``dataset`` (a ``datasets.Dataset`` of training rows), and at ``BLANK`` its ``blank_row``."""

    def __init__(self, dataset, pad_token_id: int):
        self.dataset = dataset
        self.blank = blank_row(dataset.column_names, pad_token_id)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return self.blank if index == BLANK else self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        real = [i for i in indices if i != BLANK]
        rows = iter(self.dataset.__getitems__(real) if real else [])
        return [self.blank if i == BLANK else next(rows) for i in indices]


class GlobalBatchesTrainer:
    """Mixed in before a ``Trainer`` class when several processes train: its training batches are
    ``WholeGlobalBatches`` of ``BlankRows``, in the order the Trainer's own sampler gives (accelerate seeds it as
    on one process, so every rank draws the same order). accelerate still deals the batches out to the ranks
    (``BatchSamplerShard``): only the ``BatchSampler`` inside it is replaced, before the first batch is drawn."""

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        shard = loader.batch_sampler  # accelerate's BatchSamplerShard around the DataLoader's BatchSampler
        inner = getattr(shard, "batch_sampler", None)
        if type(inner) is not BatchSampler or getattr(shard, "split_batches", True):
            raise RuntimeError(f"unexpected training batches on {self.args.world_size} processes: "
                               f"{type(shard).__name__} of {type(inner).__name__}")
        shard.batch_sampler = WholeGlobalBatches(inner.sampler, inner.batch_size, self.args.world_size)
        return loader

    def _get_dataloader(self, dataset, description, *args, **kwargs):
        if description == "Training":
            dataset = BlankRows(dataset, self.processing_class.pad_token_id)
        return super()._get_dataloader(dataset, description, *args, **kwargs)


def with_global_batches(trainer_class: type) -> type:
    """``trainer_class`` with ``GlobalBatchesTrainer`` mixed in."""
    return type(f"GlobalBatches{trainer_class.__name__}", (GlobalBatchesTrainer, trainer_class), {})
