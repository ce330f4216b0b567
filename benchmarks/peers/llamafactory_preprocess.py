"""LLaMA-Factory's SFT preprocessing on a sharegpt-format JSON lines file, run in its own virtual environment by
``bench_peers.py``: its tokenizer load, template (``qwen3``), dataset load and conversion, and
``SupervisedDatasetProcessor`` through ``get_dataset``, as ``llamafactory-cli train`` runs them before it loads
the model's weights (which this stops short of).

    python llamafactory_preprocess.py TOKENIZER_DIR DATA_DIR OUT_DIR    # DATA_DIR holds dataset_info.json
"""

import sys

from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
from llamafactory.hparams import get_train_args
from llamafactory.model import load_tokenizer


def main() -> None:
    tokenizer_dir, data_dir, out_dir = sys.argv[1:4]
    model_args, data_args, training_args, _, _ = get_train_args({
        "model_name_or_path": tokenizer_dir, "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "dataset": "bench", "dataset_dir": data_dir, "template": "qwen3", "cutoff_len": 4096,
        "overwrite_cache": True, "output_dir": out_dir, "report_to": "none", "enable_thinking": True,
    })
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    print("rows", len(module["train_dataset"]))


if __name__ == "__main__":
    main()
