"""Training: 4-bit base + LoRA (model.py), padding (collator.py), the linear train flow (run.py), the data
half of it alone for another machine (preprocess.py)."""
