"""Training: 4-bit base + LoRA (model.py), padding (collator.py), the linear train flow (run.py), the data
half of it alone for another machine (preprocess.py)."""

from qlora_train.train.noise import silence_library_noise

silence_library_noise()  # before any training module imports peft, and with it bitsandbytes
