"""Training: 4-bit base + LoRA (model.py), padding (collator.py), the linear train flow (run.py)."""
