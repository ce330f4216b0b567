from qlora_train.train.collator import PadCollator


def test_pads_to_multiple_of_8_with_ignore_labels():
    batch = PadCollator(pad_token_id=0)([
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
        {"input_ids": [9] * 9, "attention_mask": [1] * 9, "labels": [9] * 9},
    ])
    assert batch["input_ids"].shape == (2, 16)
    assert batch["input_ids"][0].tolist() == [5, 6, 7] + [0] * 13
    assert batch["labels"][0].tolist() == [-100, 6, 7] + [-100] * 13
    assert batch["attention_mask"][0].tolist() == [1, 1, 1] + [0] * 13
    assert batch["attention_mask"][1].sum() == 9


def test_packed_collator_block_diagonal_mask_by_hand():
    import torch

    from qlora_train.train.collator import PackedCollator

    rows = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 0], "seq_lens": [2, 1]},
        {"input_ids": [8, 9], "labels": [-100, 9], "position_ids": [0, 1], "seq_lens": [2]},
    ]
    batch = PackedCollator(pad_token_id=0, pad_to_multiple_of=4)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100], [-100, 9, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 0], [0, 1, 0, 1]]  # padding: its own segment
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.float32
    allowed = (mask[:, 0] == 0).int().tolist()
    assert allowed[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    assert allowed[1] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert mask.min().item() == torch.finfo(torch.float32).min


def test_packed_collator_flattens_for_flash_attention():
    from qlora_train.train.collator import PackedCollator

    rows = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 0], "seq_lens": [2, 1]},
        {"input_ids": [8, 9], "labels": [-100, 9], "position_ids": [0, 1], "seq_lens": [2]},
    ]
    batch = PackedCollator(pad_token_id=0, attention="position_ids")(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no mask: the kernel reads the positions
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 0, 1]]
