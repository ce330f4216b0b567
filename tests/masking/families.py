"""Stand-in chat templates of real model families, for tests on the real Qwen vocabulary.

Each template in ``family_templates/`` was written from the family's published
template (Hugging Face ``tokenizer_config.json`` / ``chat_template.jinja``, the
copies llama.cpp keeps under ``models/templates``, Mistral's tokenization docs,
FastChat for Vicuna) to reproduce its render byte for byte for ordinary
conversations, quirks included: trimming, JSON-encoded tool results, raising on
roles it does not know, dropped reasoning, where eos goes. ``FAMILIES`` says what
each one is; ``family_tokenizer`` builds a tokenizer that renders with it::

    tok = family_tokenizer(qwen_tokenizer_dir, "phi3")
    tok.apply_chat_template(example_messages("phi3"), tokenize=False)
    # '<s><|user|>\\nWhat is the capital of France?<|end|>\\n<|assistant|>\\nParis.<|end|>\\n...'

The family's special tokens are added to the Qwen vocabulary so that each
tokenizes as one token, as with the family's own tokenizer.

``Family.example_trained`` is the text a training row of ``EXAMPLE`` must train,
written by hand from the template's layout (see ``_Turns``), not computed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent / "family_templates"

REASONING = ("none", "rendered_last_only", "never", "always")
# where the prompt of a turn ends, as the probe names it (qlora_train.masking.layout.LAYOUT_CLASSES, less "unknown")
LAYOUT_CLASSES = ("header_from_generation_prompt", "header_in_user_turn", "no_header", "header_after_every_render")
# issue 24: five turn shapes of recent families (tokens and wording ours), each a family below: the probe sees where
# their prompt ends like any other; the shape is what its old layout could not describe (per-turn prefix renders
# and the fields added for them verify these rows)
SHAPES = ("structured_elements", "open_think_prompt", "prompt_not_in_render", "results_inside_assistant",
          "call_block_after_end",
          # issue 34: shapes the probe misread (a trailer the generation prompt extends, reasoning tags it cut through)
          "trailer_prompt_extends", "reasoning_tag_prompt",
          # issue 45: what the generation prompt writes after the header is prompt (an empty block it pre-fills, an
          # opener, one that a system flag switches), a tool result written differently when it is last, a header
          # the model writes itself inside its turn
          "prefilled_empty_think", "opener_prompt", "flag_changes_prompt", "tool_last_differs",
          "channel_second_header")

# system?, user, assistant, user, assistant: no reasoning, no tools, nothing a template trims
EXAMPLE = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


class _Turns(tuple):
    """The trained text of each assistant turn of ``EXAMPLE``, in order.

    Derived by hand, per the masking policy (docs/masking.md): a turn's trained
    text is what the model generates after the prompt the template gives it at
    inference (the render of the conversation up to that turn with
    ``add_generation_prompt=True``), through the end-of-turn marker(s) it must emit
    to stop, without the separator after the last marker. So:

    - text the generation prompt (or the end of the user turn) writes is never
      trained: the header and whatever the generation prompt adds after it (EXAONE 4
      pre-fills a whole empty ``<think>\\n\\n</think>\\n\\n``, structured elements open
      the think element): the model is given it at inference and never writes it;
    - whitespace between the prompt and the content is generated, so it is
      trained: ``[/INST]`` + `` Paris.`` (Mistral v1/v3, Llama 2), ``ASSISTANT:`` +
      `` Paris.`` (Vicuna), ``<|assistant|>`` + ``\\nParis.`` (GLM);
    - a template whose turns have no end marker (GLM) ends a turn with the next
      header the model generates to stop (``<|user|>``); the last turn ends with
      its text;
    - text the template appends after every render (the first Llama 3 template's
      assistant header) is prompt, never generated;
    - a turn the full render writes differently from its prefix render (an
      earlier answer without the think block the last one gets) is trained as
      the full render writes it.
    """


@dataclass(frozen=True)
class Family:
    """One model family's chat template and the tokens it writes."""

    name: str
    template: str  # file name in family_templates/
    special_tokens: tuple[str, ...]  # control tokens the template writes, single tokens in the family's tokenizer
    bos_token: str | None  # as the family's tokenizer config defines them (None: not defined / not used)
    eos_token: str | None
    supports_tools: bool  # the template writes tool calls and tool results (see notes for the tool list)
    supports_system: bool  # a leading system message is (or can be) rendered
    reasoning: str  # one of REASONING: how the template renders an assistant turn's reasoning
    layout_class: str  # one of LAYOUT_CLASSES: where the prompt of a turn ends (compared with the probe's)
    notes: str
    example_turns: _Turns  # trained text of each assistant turn of example_messages(name)
    end_markers: tuple[str, ...] = ()  # what closes a generated turn (answer first)
    reasoning_key: str | None = None  # the message key the template reads reasoning from
    tool_arguments_as_string: bool = False  # tool call arguments must be a JSON string (a dict raises)
    shape: str = ""  # one of SHAPES, or "" for a turn the layout describes as it always has
    plain_markers: tuple[str, ...] = ()  # markers a generated turn writes as plain text, not as special tokens
    flags: tuple[str, ...] = ()  # texts a system message may hold that switch what the generation prompt writes

    def __post_init__(self):
        assert self.reasoning in REASONING, self.reasoning
        assert self.layout_class in LAYOUT_CLASSES, self.layout_class
        assert self.shape in ("", *SHAPES), self.shape
        assert (TEMPLATE_DIR / self.template).is_file(), self.template

    @property
    def example_trained(self) -> str:
        """The trained text of all assistant turns of ``example_messages(name)``, concatenated."""
        return "".join(self.example_turns)

    @property
    def template_text(self) -> str:
        return (TEMPLATE_DIR / self.template).read_text()


def _t(*turns: str) -> _Turns:
    return _Turns(turns)


_MISTRAL_TOOLS = ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
_COHERE = ("<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>",
           "<|CHATBOT_TOKEN|>")
_DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
             "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
             "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
             "<｜tool▁output▁end｜>")
_DS_EOS = "<｜end▁of▁sentence｜>"
_GLM = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>")
_R7B = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
_R7B_TOOLS = ("<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>",
              "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>")

_FAMILY_LIST = [
    Family(
        "phi3", "phi3.jinja", ("<s>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"), "<s>", "<|endoftext|>",
        supports_tools=False, supports_system=False, reasoning="none", layout_class="header_in_user_turn",
        notes="Phi-3-mini original: <|assistant|>\\n closes every user turn, no generation prompt; system dropped",
        example_turns=_t("Paris.<|end|>", "Rome.<|end|>"), end_markers=("<|end|>",)),
    Family(
        "phi3.5", "phi3.5.jinja", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"), "<s>",
        "<|endoftext|>", supports_tools=False, supports_system=True, reasoning="none",
        layout_class="header_from_generation_prompt",
        notes="Phi-3.5-mini: generation prompt <|assistant|>\\n; without it the render ends with eos after <|end|>\\n",
        example_turns=_t("Paris.<|end|>", "Rome.<|end|>"), end_markers=("<|end|>",)),
    Family(
        "llama2", "llama2.jinja", ("<s>", "</s>"), "<s>", "</s>", supports_tools=False, supports_system=True,
        reasoning="none", layout_class="no_header",
        notes="Llama 2 chat: <s>[INST] <<SYS>> system in the first turn; answers ' ' + strip + ' </s>'; "
              "[INST] is plain text; roles must alternate",
        example_turns=_t(" Paris. </s>", " Rome. </s>"), end_markers=("</s>",)),
    Family(
        "mistral-v1", "mistral-v1.jinja", ("<s>", "</s>"), "<s>", "</s>", supports_tools=False,
        supports_system=True, reasoning="none", layout_class="no_header",
        notes="Mistral tokenizer v1 (7B v0.1/v0.2): ' [INST] ' + system\\n\\n + user + ' [/INST]', ' ' + answer + "
              "</s>; [INST] is plain text; other roles raise",
        example_turns=_t(" Paris.</s>", " Rome.</s>"), end_markers=("</s>",)),
    Family(
        "mistral-v3", "mistral-v3.jinja", ("<s>", "</s>", "[INST]", "[/INST]", *_MISTRAL_TOOLS), "<s>", "</s>",
        supports_tools=True, supports_system=True, reasoning="none", layout_class="no_header",
        notes="Mistral tokenizer v3 (7B v0.3): system only inside a user turn that is the last message (dropped "
              "when the conversation ends with an answer); answers ' ' + trim; 9-character tool call ids",
        example_turns=_t(" Paris.</s>", " Rome.</s>"), end_markers=("</s>",)),
    Family(
        "mistral-v7", "mistral-v7.jinja",
        ("<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", *_MISTRAL_TOOLS), "<s>", "</s>",
        supports_tools=True, supports_system=True, reasoning="none", layout_class="no_header",
        notes="Mistral Small 3.1 (v7 tekken): [SYSTEM_PROMPT] always written (default one with today's date); "
              "tool call ids of 9+ characters, last 9 written; a second system message raises",
        example_turns=_t("Paris.</s>", "Rome.</s>"), end_markers=("</s>",)),
    Family(
        "mistral-tekken", "mistral-tekken.jinja", ("<s>", "</s>", "[INST]", "[/INST]", *_MISTRAL_TOOLS), "<s>",
        "</s>", supports_tools=True, supports_system=True, reasoning="none", layout_class="no_header",
        notes="Mistral Nemo (v3 tekken): no spaces around [INST]; system only in a last-message user turn; "
              "9-character tool call ids",
        example_turns=_t("Paris.</s>", "Rome.</s>"), end_markers=("</s>",)),
    Family(
        "zephyr", "zephyr.jinja", ("</s>",), "<s>", "</s>", supports_tools=False, supports_system=True,
        reasoning="none", layout_class="header_from_generation_prompt",
        notes="Zephyr: <|role|>\\n + content + </s>\\n; the role headers are plain text, only </s> is special",
        example_turns=_t("Paris.</s>", "Rome.</s>"), end_markers=("</s>",)),
    Family(
        "vicuna", "vicuna.jinja", ("<s>", "</s>"), "<s>", "</s>", supports_tools=False, supports_system=True,
        reasoning="none", layout_class="header_from_generation_prompt",
        notes="Vicuna v1.1 (FastChat format, no official template): 'USER: q ASSISTANT: a</s>'; generation "
              "prompt 'ASSISTANT:' without the space, so the space is generated",
        example_turns=_t(" Paris.</s>", " Rome.</s>"), end_markers=("</s>",)),
    Family(
        "command-r", "command-r.jinja", _COHERE, "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", supports_tools=False,
        supports_system=True, reasoning="none", layout_class="header_from_generation_prompt",
        notes="Command R v01 default template: stripped contents, roles must alternate",
        example_turns=_t("Paris.<|END_OF_TURN_TOKEN|>", "Rome.<|END_OF_TURN_TOKEN|>"),
        end_markers=("<|END_OF_TURN_TOKEN|>",)),
    Family(
        "command-r7b", "command-r7b.jinja", (*_COHERE, *_R7B), "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>",
        supports_tools=False, supports_system=True, reasoning="none", layout_class="header_from_generation_prompt",
        notes="Command R7B default template: generation prompt ends with <|START_RESPONSE|>; two end markers",
        example_turns=_t("Paris.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", "Rome.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"),
        end_markers=("<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",)),
    Family(
        "command-r7b-tools", "command-r7b-tools.jinja", (*_COHERE, *_R7B, *_R7B_TOOLS), "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>", supports_tools=True, supports_system=True, reasoning="none",
        layout_class="header_after_every_render",
        notes="Command R7B tool_use template: every render ends with <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>; "
              "the model generates <|START_RESPONSE|> (answer marker) or <|START_THINKING|>..<|START_ACTION|>",
        example_turns=_t("<|START_RESPONSE|>Paris.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
                         "<|START_RESPONSE|>Rome.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"),
        end_markers=("<|END_RESPONSE|><|END_OF_TURN_TOKEN|>", "<|END_ACTION|><|END_OF_TURN_TOKEN|>")),
    Family(
        "deepseek-v3", "deepseek-v3.jinja", _DEEPSEEK, "<｜begin▁of▁sentence｜>", _DS_EOS, supports_tools=True,
        supports_system=True, reasoning="none", layout_class="header_in_user_turn",
        notes="DeepSeek-V3-0324: <｜Assistant｜> closes each user turn; tools kwarg not written; tool call "
              "arguments concatenated as strings (dicts raise); after tool results the answer follows "
              "<｜tool▁outputs▁end｜>",
        example_turns=_t("Paris." + _DS_EOS, "Rome." + _DS_EOS), end_markers=(_DS_EOS,),
        tool_arguments_as_string=True),
    Family(
        "deepseek-r1", "deepseek-r1.jinja", (*_DEEPSEEK, "<think>", "</think>"), "<｜begin▁of▁sentence｜>", _DS_EOS,
        supports_tools=True, supports_system=True, reasoning="never", layout_class="header_from_generation_prompt",
        notes="DeepSeek-R1: content cut after </think>, reasoning never rendered; generation prompt "
              "<｜Assistant｜><think>\\n; tools kwarg not written; string tool arguments only; only the first "
              "tool-call turn of a conversation gets its header",
        example_turns=_t("Paris." + _DS_EOS, "Rome." + _DS_EOS), end_markers=(_DS_EOS,),
        tool_arguments_as_string=True),
    Family(
        "exaone4", "exaone4.jinja",
        ("[|system|]", "[|user|]", "[|assistant|]", "[|tool|]", "[|endofturn|]", "<think>", "</think>"), "[BOS]",
        "[|endofturn|]", supports_tools=True, supports_system=True, reasoning="never",
        layout_class="header_from_generation_prompt",
        notes="EXAONE 4.0: skip_think (default true) writes an empty <think>\\n\\n</think>\\n\\n in every answer "
              "and the generation prompt; skip_think=false shows the last message's reasoning; "
              "enable_thinking=true makes the generation prompt open <think>\\n; unknown roles raise",
        example_turns=_t("Paris.[|endofturn|]", "Rome.[|endofturn|]"),
        end_markers=("[|endofturn|]",), reasoning_key="reasoning_content"),
    Family(
        "falcon3", "falcon3.jinja", ("<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>"), None,
        "<|endoftext|>", supports_tools=True, supports_system=True, reasoning="none",
        layout_class="header_from_generation_prompt",
        notes="Falcon3 instruct (the Falcon-H1 template could not be confirmed): the last message ends with eos "
              "and no newline; with tools a call turn has no header when its content is empty and tool "
              "results are written under <|assistant|>",
        example_turns=_t("Paris.<|endoftext|>", "Rome.<|endoftext|>"), end_markers=("<|endoftext|>",)),
    Family(
        "llama4", "llama4.jinja",
        ("<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|python_start|>", "<|python_end|>"),
        "<|begin_of_text|>", "<|eot|>", supports_tools=True, supports_system=True, reasoning="none",
        layout_class="header_from_generation_prompt",
        notes="Llama 4: tool results written through tojson (a string becomes a quoted JSON string); tools in "
              "the first user turn by default; contents not trimmed (the system one is)",
        example_turns=_t("Paris.<|eot|>", "Rome.<|eot|>"), end_markers=("<|eot|>",)),
    Family(
        "glm4", "glm4.jinja", _GLM, None, "<|endoftext|>", supports_tools=False, supports_system=True,
        reasoning="none", layout_class="header_from_generation_prompt",
        notes="GLM-4-9B-chat: no end marker, a turn ends at the next header (<|user|>, <|observation|>); "
              "empty-content messages left out; tools only from a message's 'tools' field",
        example_turns=_t("\nParis.<|user|>", "\nRome."), end_markers=("<|user|>", "<|observation|>")),
    Family(
        "glm4.5", "glm4.5.jinja",
        (*_GLM, "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
         "</arg_value>", "<tool_response>", "</tool_response>"), None, "<|endoftext|>", supports_tools=True,
        supports_system=True, reasoning="rendered_last_only", layout_class="header_from_generation_prompt",
        notes="GLM-4.5/4.6: no end marker; every answer opens \\n<think>..</think>, the reasoning shown only "
              "after the last user message; enable_thinking=false appends /nothink to user turns; dict "
              "tool arguments only (strings raise)",
        example_turns=_t("\n<think></think>\nParis.<|user|>", "\n<think></think>\nRome."),
        end_markers=("<|user|>", "<|observation|>"), reasoning_key="reasoning_content"),
    Family(
        "granite3", "granite3.jinja", ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"), "<|end_of_text|>",
        "<|end_of_text|>", supports_tools=False, supports_system=True, reasoning="never",
        layout_class="header_from_generation_prompt",
        notes="Granite 3.3: default system turn with today's date; tools listed but tool_calls and reasoning "
              "never written; 'thinking' kwarg only changes the default system text",
        example_turns=_t("Paris.<|end_of_text|>", "Rome.<|end_of_text|>"), end_markers=("<|end_of_text|>",)),
    Family(
        "smollm3", "smollm3.jinja", ("<|im_start|>", "<|im_end|>", "<think>", "</think>"), None, "<|im_end|>",
        supports_tools=False, supports_system=True, reasoning="never", layout_class="header_from_generation_prompt",
        notes="SmolLM3: /think (default) or /no_think from enable_thinking or the system message; /no_think "
              "answers and generation prompt open <think>\\n\\n</think>\\n; reasoning_content never read; "
              "tools only via xml_tools/python_tools kwargs",
        example_turns=_t("Paris.<|im_end|>", "Rome.<|im_end|>"), end_markers=("<|im_end|>",)),
    Family(
        "gpt-oss", "gpt-oss.jinja", ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"),
        "<|startoftext|>", "<|return|>", supports_tools=True, supports_system=True, reasoning="rendered_last_only",
        layout_class="header_from_generation_prompt",
        notes="gpt-oss harmony: reasoning from message.thinking, shown only for the last message (and tool-call "
              "turns with no later answer); answers end <|end|>, the last <|return|>, calls <|call|>; "
              "generation prompt <|start|>assistant",
        example_turns=_t("<|channel|>final<|message|>Paris.<|end|>", "<|channel|>final<|message|>Rome.<|return|>"),
        end_markers=("<|end|>", "<|return|>", "<|call|>"), reasoning_key="thinking"),
]

_L3 = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>")
_ELEMENTS = ("<|el|>", "<|/el|>", "<|gt|>", "<|turn_done|>")


def _element_turn(reasoning: str, content: str, calls: str = "") -> str:
    """What an assistant turn of structured-elements.jinja generates: after its generation prompt, which ends by
    opening the think element."""
    def el(name: str, body: str) -> str:
        return f"<|el|>{name}<|gt|>{body}<|/el|>{name}<|gt|>"
    turn = el("think", reasoning) + el("response", content) + el("tools", calls) + "<|/el|>message<|gt|><|turn_done|>"
    return turn.removeprefix("<|el|>think<|gt|>")


# issue 24: the first Llama 3 template and the five SHAPES; templates and tokens written by us
_NEW_FAMILY_LIST = [
    Family(
        "llama3-original", "llama3-original.jinja", _L3, "<|begin_of_text|>", "<|end_of_text|>",
        supports_tools=False, supports_system=True, reasoning="none", layout_class="header_after_every_render",
        notes="Meta's first Llama 3 Instruct template: the assistant header is appended after every render, "
              "generation prompt or not; only content written (tool calls, reasoning, tools dropped); trimmed",
        example_turns=_t("Paris.<|eot_id|>", "Rome.<|eot_id|>"), end_markers=("<|eot_id|>",)),
    Family(
        "structured-elements", "structured-elements.jinja", _ELEMENTS, None, "<|turn_done|>", supports_tools=True,
        supports_system=True, reasoning="always", layout_class="header_from_generation_prompt",
        shape="structured_elements",
        notes="class A: every part of a turn a named element <|el|>NAME<|gt|>..<|/el|>NAME<|gt|>, empty ones "
              "written too; every turn keeps its reasoning; calls as JSON in the tools element; the generation "
              "prompt ends with the think element's opener (prompt: never trained)",
        example_turns=_t(_element_turn("", "Paris."), _element_turn("", "Rome.")), end_markers=("<|turn_done|>",),
        reasoning_key="reasoning_content"),
    Family(
        "open-think-prompt", "open-think-prompt.jinja", ("<|turn|>", "<|turn_end|>", "<think>"), None,
        "<|turn_end|>", supports_tools=False, supports_system=True, reasoning="never",
        layout_class="header_from_generation_prompt", shape="open_think_prompt",
        notes="class B: the generation prompt <|turn|>Assistant\\n<think>\\n\\n opens a think block never "
              "closed; the last answer is written after it, earlier answers without it; reasoning never written",
        example_turns=_t("Paris.<|turn_end|>", "Rome.<|turn_end|>"), end_markers=("<|turn_end|>",)),
    Family(
        "prompt-not-in-render", "prompt-not-in-render.jinja", ("<|msg|>", "<|/msg|>"), None, "<|/msg|>",
        supports_tools=False, supports_system=True, reasoning="always", layout_class="header_from_generation_prompt",
        shape="prompt_not_in_render",
        notes="class C: the generation prompt appends 'Let me work through this.\\n', which no turn contains; "
              "reasoning has no opener and ends at '\\n[[ANSWER]]\\n'; the last message has no end marker",
        example_turns=_t("Paris.<|/msg|>", "Rome."), end_markers=("<|/msg|>",), reasoning_key="reasoning_content",
        plain_markers=("[[ANSWER]]",)),
    Family(
        "results-inside-assistant", "results-inside-assistant.jinja",
        ("<|sys|>", "<|tools|>", "<|human|>", "<|bot|>", "<|call_begin|>", "<|call_end|>", "<|result|>", "<|stop|>"),
        None, "<|stop|>", supports_tools=True, supports_system=True, reasoning="none",
        layout_class="header_from_generation_prompt", shape="results_inside_assistant",
        notes="class D: call, tool result and answer in one <|bot|> block (<|call_begin|>[..]<|call_end|>"
              "<|result|>..\\n answer); <|stop|> only where a user turn follows; the call ends at <|call_end|>",
        example_turns=_t("Paris.<|stop|>", "Rome."), end_markers=("<|stop|>", "<|call_end|>")),
    Family(
        "call-block-after-end", "call-block-after-end.jinja", ("<|role_end|>", "<|msg_end|>"), None, "<|msg_end|>",
        supports_tools=True, supports_system=True, reasoning="none", layout_class="header_from_generation_prompt",
        shape="call_block_after_end",
        notes="class E: ROLE<|role_end|>\\n..<|msg_end|>\\n\\n blocks with plain-text roles; each tool call a "
              "'tool call' block of its own after the assistant's block ends, results in 'tool output' blocks",
        example_turns=_t("Paris.<|msg_end|>", "Rome.<|msg_end|>"), end_markers=("<|msg_end|>",)),
]

# issue 34, shape 2: a plain-text header ending in a space (template and tokens ours)
_SPACE_HEADER = Family(
    "qa-space-header", "qa-space-header.jinja", ("<|done|>",), None, "<|done|>", supports_tools=True,
    supports_system=True, reasoning="none", layout_class="header_from_generation_prompt",
    notes="plain-text 'Q: ' / 'A: ' lines, a note first, calls on 'Call: ' lines, results on 'Result: ' lines; the "
          "generation prompt 'A: ' ends with a space the answer's first word would merge with (' Paris') if the "
          "render were tokenized whole; contents as given",
    example_turns=_t("Paris.<|done|>", "Rome.<|done|>"), end_markers=("<|done|>",), plain_markers=("Call: ",))

_TRAILER = ("<|seg|>", "<|setup|>", "<|person|>", "<|model|>", "<|output|>", "<|say|>", "<|/say|>", "<|act|>",
            "<|/act|>", "<|fin|>")
_TAGGED = ("<|rules|>", "<|asker|>", "<|toolout|>", "<|answerer|>", "<think>", "</think>", "<tool>", "</tool>",
           "<|over|>")

# issue 34: shapes the probe misread or the walk refused (a trailer the generation prompt extends, reasoning tags
# cut through, class C reasoning without an opener dropped before the last user message); written by us
_ISSUE34_FAMILY_LIST = [
    Family(
        "trailer-prompt-extends", "trailer-prompt-extends.jinja", _TRAILER, None, "<|fin|>", supports_tools=True,
        supports_system=True, reasoning="none", layout_class="header_after_every_render",
        shape="trailer_prompt_extends",
        notes="every render ends with an assistant turn's opener <|seg|><|model|> (the trailer), generation prompt "
              "or not; the generation prompt adds <|say|> after it; an answer is <|seg|><|model|><|say|>..<|/say|>"
              "<|fin|>; a default system turn when none is given (so the user turn is not the render's start)",
        example_turns=_t("Paris.<|/say|><|fin|>", "Rome.<|/say|><|fin|>"), end_markers=("<|/say|><|fin|>",)),
    Family(
        "reasoning-tag-prompt", "reasoning-tag-prompt.jinja", _TAGGED, None, "<|over|>", supports_tools=True,
        supports_system=True, reasoning="rendered_last_only", layout_class="header_from_generation_prompt",
        shape="reasoning_tag_prompt",
        notes="generation prompt <|answerer|><think>; an answer after the last user message with reasoning is "
              "<|answerer|><think>..</think>answer, every other one <|answerer|></think>answer (an empty block, "
              "closed only: the probe's character-level common prefix '<|answerer|><' cuts through both tags)",
        example_turns=_t("</think>Paris.<|over|>", "</think>Rome.<|over|>"), end_markers=("<|over|>",),
        reasoning_key="reasoning_content"),
    Family(
        "preamble-prompt-tools", "preamble-prompt-tools.jinja", ("<|m|>", "<|/m|>"), None, "<|/m|>",
        supports_tools=True, supports_system=True, reasoning="rendered_last_only",
        layout_class="header_from_generation_prompt", shape="prompt_not_in_render",
        notes="class C with tool calls, reasoning written only after the last user message: the generation "
              "prompt appends 'Here is my plan:\\n', which no turn contains; reasoning has no opener and ends at "
              "'\\n[[FINAL]]\\n'; calls follow the content as '\\n[[CALL]] {json}'; the last message has no end "
              "marker",
        example_turns=_t("Paris.<|/m|>", "Rome."), end_markers=("<|/m|>",), reasoning_key="reasoning_content",
        plain_markers=("[[FINAL]]", "[[CALL]]")),
]

# issue 45: the generation prompt writes more than the header (templates and tokens ours)
_ISSUE45_FAMILY_LIST = [
    Family(
        "prefilled-empty-think", "prefilled-empty-think.jinja",
        ("<|ts|>", "<|te|>", "<think>", "</think>", "<call>", "</call>"), None, "<|te|>", supports_tools=True,
        supports_system=True, reasoning="always", layout_class="header_from_generation_prompt",
        shape="prefilled_empty_think",
        notes="hybrid reasoning, default off: the generation prompt pre-fills an empty <think>\\n\\n</think>\\n\\n "
              "after <|ts|>assistant\\n, every answer writes its block (the empty one where it has no reasoning); "
              "the pre-filled block is prompt, so a turn without reasoning trains its answer alone and one with "
              "reasoning trains from where it parts from the empty block (after <think>\\n)",
        example_turns=_t("Paris.<|te|>", "Rome.<|te|>"), end_markers=("<|te|>",), reasoning_key="reasoning_content"),
    Family(
        "opener-prompt", "opener-prompt.jinja",
        ("<|begin|>", "<|sep|>", "<|finish|>", "<reason>", "</reason>", "<invoke>", "</invoke>"), None, "<|finish|>",
        supports_tools=True, supports_system=True, reasoning="always", layout_class="header_from_generation_prompt",
        shape="opener_prompt",
        notes="the generation prompt <|begin|>assistant<|sep|><reason> opens the block, every turn writes "
              "<reason>REASONING</reason>ANSWER: the opener is prompt, the reasoning, </reason> and the answer "
              "are generated",
        example_turns=_t("</reason>Paris.<|finish|>", "</reason>Rome.<|finish|>"), end_markers=("<|finish|>",),
        reasoning_key="reasoning_content"),
    Family(
        "thinking-flag", "thinking-flag.jinja", ("<|im|>", "<|/im|>", "<think>", "</think>"), None, "<|/im|>",
        supports_tools=False, supports_system=True, reasoning="always", layout_class="header_from_generation_prompt",
        shape="flag_changes_prompt",
        notes="'/skip_thinking' in the system message switches thinking off: the generation prompt then pre-fills an "
              "empty block (<think>\\n\\n</think>\\n\\n), otherwise it opens one (<think>\\n); every answer "
              "writes the block, reasoning only with thinking on",
        example_turns=_t("\n</think>\n\nParis.<|/im|>", "\n</think>\n\nRome.<|/im|>"), end_markers=("<|/im|>",),
        reasoning_key="reasoning_content", flags=("/skip_thinking",)),
    Family(
        "tool-last-differs", "tool-last-differs.jinja",
        ("<|msg_open|>", "<|msg_close|>", "<tool_response>", "</tool_response>", "<tool_call>", "</tool_call>"), None,
        "<|msg_close|>", supports_tools=True, supports_system=True, reasoning="none",
        layout_class="header_from_generation_prompt", shape="tool_last_differs",
        notes="a tool result ends </tool_response><|msg_close|> when it is the last message, "
              "</tool_response>\\n<|msg_close|> when another follows: the generation prompt's render and the "
              "render through the answer part inside the tool turn; the answer still starts after its header",
        example_turns=_t("Paris.<|msg_close|>", "Rome.<|msg_close|>"), end_markers=("<|msg_close|>",)),
    Family(
        "channel-second-header", "channel-second-header.jinja",
        ("<|head|>", "<|chan|>", "<|body|>", "<|stop|>", "<|fn|>", "<|/fn|>"), None, "<|stop|>", supports_tools=True,
        supports_system=True, reasoning="always", layout_class="header_from_generation_prompt",
        shape="channel_second_header",
        notes="the generation prompt <|head|>assistant<|chan|> asks for a channel name; an answer with reasoning is "
              "thoughts<|body|>..<|stop|> then a header the model writes itself, <|head|>assistant<|chan|>reply"
              "<|body|>..<|stop|>: that header is trained, the prompt's is not",
        example_turns=_t("reply<|body|>Paris.<|stop|>", "reply<|body|>Rome.<|stop|>"), end_markers=("<|stop|>",),
        reasoning_key="reasoning_content"),
]

FAMILIES: dict[str, Family] = {f.name: f for f in [*_FAMILY_LIST, *_NEW_FAMILY_LIST, *_ISSUE34_FAMILY_LIST,
                                                   _SPACE_HEADER, *_ISSUE45_FAMILY_LIST]}
# the families of issue 24: the first Llama 3 template and the five shapes
ISSUE24_NAMES = tuple(f.name for f in _NEW_FAMILY_LIST)
ISSUE34_NAMES = tuple(f.name for f in _ISSUE34_FAMILY_LIST)
ISSUE45_NAMES = tuple(f.name for f in _ISSUE45_FAMILY_LIST)


def example_messages(name: str) -> list[dict]:
    """A fresh copy of ``EXAMPLE`` for the family (without the system message where it has none)."""
    messages = copy.deepcopy(EXAMPLE)
    return messages if FAMILIES[name].supports_system else messages[1:]


def family_tokenizer(base_tokenizer_dir, name: str, *, markers_as_tokens: bool = True):
    """The base tokenizer with the family's chat template, bos/eos and (by default) its special tokens.

    Tokens the base tokenizer already has as added tokens (``<|endoftext|>``,
    ``<think>``) are kept as they are; the others are added as special tokens.
    With ``markers_as_tokens=False`` none is added: the markers the base
    vocabulary lacks are plain text, several tokens each (a base model given a
    template it was not built for).
    """
    from tests.vocabularies import tokenizer_with_template

    family = FAMILIES[name]
    wanted = (*family.special_tokens, *(t for t in (family.bos_token, family.eos_token) if t))
    return tokenizer_with_template(base_tokenizer_dir, family.template_text, bos_token=family.bos_token,
                                   eos_token=family.eos_token, add_markers=wanted if markers_as_tokens else ())
