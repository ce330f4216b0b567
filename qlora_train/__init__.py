"""qlora-train: QLoRA fine-tuning of chat LLMs with exact, verified loss masks."""

__version__ = "0.1.0"
