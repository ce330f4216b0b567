"""What the processed rows depend on, hashed: the tokenizer (``tokenizer_identity``, a part of the prepared data's
fingerprint) and the whole of a source's processing map (``map_fingerprint``, the key of its ``datasets`` cache).

    >>> from qlora_train.config import DataConfig
    >>> cfg = DataConfig(datasets=[{"path": "rows.jsonl"}])
    >>> map_fingerprint("raw0", tok, cfg) == map_fingerprint("raw0", tok, cfg) != map_fingerprint("raw1", tok, cfg)
    True

``datasets`` would otherwise fingerprint the map by pickling its arguments, the tokenizer with its whole Rust
pipeline (megabytes of JSON, a fifth of a second for a 150k vocabulary), on every run; and the prepared data's
fingerprint hashed the tokenizer's vocabulary again. Here the tokenizer's model is serialized and hashed once per
tokenizer and vocabulary size (``model_digest``, kept as the fast encoder is: ``tokenize.per_vocabulary``) and
both keys are made from that digest and the cheap rest.
"""

from __future__ import annotations

import hashlib
import json
import weakref

from datasets.fingerprint import Hasher
from tokenizers import Tokenizer

from qlora_train.masking import per_vocabulary, saved_model

FORMAT = 1  # of the map's key: a change here gives every source's cache a new key

_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (backend, size, digest)


def _hash(value) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _pipeline_digest(backend: Tokenizer, files: tuple[bytes, bytes] | None) -> str:
    """A ``tokenizers`` pipeline's model (a BPE's saved files, ``files``, and its settings; another model as it
    serializes itself), its normalizer, pre-tokenizer, post-processor and decoder, hashed: everything it does to a
    text but its added tokens (hashed with the Python side's) and its truncation and padding settings (which a
    tokenizer call may change; the engine never asks for either)."""
    h = hashlib.blake2b(digest_size=16)
    settings = _bpe_settings(backend.model) if files is not None else None
    if settings is None:
        h.update(backend.model.__getstate__())
    else:
        h.update(json.dumps(settings, sort_keys=True).encode())
        for data in files:
            h.update(b"\1")
            h.update(data)
    for part in (backend.normalizer, backend.pre_tokenizer, backend.post_processor, backend.decoder):
        h.update(b"\1")
        h.update(b"\0" if part is None else part.__getstate__())
    return h.hexdigest()


def _bpe_settings(model) -> dict | None:
    """A BPE model's settings: every key its serialization holds beside the vocabulary and merges (read off an
    empty BPE's, so a setting a later ``tokenizers`` adds is read too), each as the model exposes it; None when
    one is not exposed (then the model is hashed as it serializes itself)."""
    from tokenizers.models import BPE

    keys = [k for k in json.loads(BPE().__getstate__()) if k not in ("vocab", "merges")]
    try:
        return {k: type(model).__name__ if k == "type" else getattr(model, k) for k in keys}
    except AttributeError:
        return None


def model_digest(tokenizer) -> str | list:
    """The tokenizer's pipeline hashed (``_pipeline_digest``), worked out once per tokenizer, backend and vocabulary
    size (a BPE's files saved once for this and the fast encoder's build: ``tokenize.saved_model``); a tokenizer
    without a Rust pipeline (a Python tokenizer) by its vocabulary, sorted by id."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return per_vocabulary(_DIGESTS, tokenizer, backend,
                              lambda b: _pipeline_digest(b, saved_model(tokenizer, b)))
    return sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])


def tokenizer_identity(tokenizer) -> dict:
    """The tokenizer as the rows depend on it, hashed (the template is its own part): its pipeline
    (``model_digest``), the added tokens and the special-token map; with its name and size to say what differs."""
    added = sorted((i, t.content, bool(t.special)) for i, t in tokenizer.added_tokens_decoder.items())
    specials = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
    return {"hash": _hash([model_digest(tokenizer), added, specials]),
            "name_or_path": getattr(tokenizer, "name_or_path", ""), "size": len(tokenizer)}


def map_fingerprint(raw_fingerprint: str, tokenizer, cfg, code: str = "") -> str:
    """The key of a source's processing map (``dataset.process_dataset``): what ``datasets`` would hash, with the
    tokenizer's pipeline by its digest. The raw rows' fingerprint, the tokenizer (``tokenizer_identity``, its
    chat template, its class and every attribute of its Python side, as ``datasets`` hashes them), the source's
    processing options (``DataConfig``, whole; with ``prompt_tools``, the tools' schemas), the engine's code
    (``pipeline_code_hash``) and the map's batch size and processes."""
    python_side = Hasher.hash({k: v for k, v in vars(tokenizer).items() if k != "_tokenizer"})
    tools = None
    if cfg.prompt_tools:
        from qlora_train.data.prompts import tool_schemas

        tools = tool_schemas(tuple(cfg.prompt_tools))
    return _hash({"format": FORMAT, "raw": raw_fingerprint, "tokenizer": tokenizer_identity(tokenizer)["hash"],
                  "class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
                  "template": tokenizer.chat_template, "python_side": python_side,
                  "config": cfg.model_dump(mode="json"), "tools": tools, "code": code,
                  "batch_size": cfg.batch_size, "num_proc": cfg.num_proc})
