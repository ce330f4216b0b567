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
