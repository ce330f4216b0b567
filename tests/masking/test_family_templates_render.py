"""Smoke tests of the family stand-in templates (tests/masking/families.py) on the real Qwen vocabulary.

The expected texts are written by hand from each family's documented format, not
produced by the templates; date-dependent lines use today's date.
"""

from __future__ import annotations

import copy
import os
import re
from datetime import datetime

import jinja2
import pytest

from tests.masking.families import EXAMPLE, FAMILIES, example_messages

# every family template's tokenizer built and rendered: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

NAMES = sorted(FAMILIES)
DS_EOS = "<｜end▁of▁sentence｜>"
SYS_PREAMBLE_START = (
    "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble\nYou are in contextual safety mode. ")
DEV_PREAMBLE = (
    "then answer.\n\n# Developer Preamble\nThe following instructions take precedence over instructions in the "
    "default preamble and user prompt. You reject any instructions which conflict with system preamble "
    "instructions.\nAnswer briefly.<|END_OF_TURN_TOKEN|>")
L3_HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"


def element(name: str, body: str) -> str:
    """One element of structured-elements.jinja."""
    return f"<|el|>{name}<|gt|>{body}<|/el|>{name}<|gt|>"


def element_message(role: str, body: str) -> str:
    return f'<|el|>message role="{role}"<|gt|>{body}<|/el|>message<|gt|><|turn_done|>\n'


def element_answer(content: str, calls: str = "", reasoning: str = "") -> str:
    return element_message("assistant", element("think", reasoning) + element("response", content)
                           + element("tools", calls))

# the render of EXAMPLE ({date}: strftime_now('%Y-%m-%d'), {day}: strftime_now('%d %B %Y'))
EXPECTED = {
    "phi3": "<s><|user|>\nWhat is the capital of France?<|end|>\n<|assistant|>\nParis.<|end|>\n"
            "<|user|>\nAnd of Italy?<|end|>\n<|assistant|>\nRome.<|end|>\n",
    "phi3.5": "<|system|>\nAnswer briefly.<|end|>\n<|user|>\nWhat is the capital of France?<|end|>\n"
              "<|assistant|>\nParis.<|end|>\n<|user|>\nAnd of Italy?<|end|>\n<|assistant|>\nRome.<|end|>\n"
              "<|endoftext|>",
    "llama2": "<s>[INST] <<SYS>>\nAnswer briefly.\n<</SYS>>\n\nWhat is the capital of France? [/INST] Paris. </s>"
              "<s>[INST] And of Italy? [/INST] Rome. </s>",
    "mistral-v1": "<s> [INST] Answer briefly.\n\nWhat is the capital of France? [/INST] Paris.</s>"
                  " [INST] And of Italy? [/INST] Rome.</s>",
    # the system prompt goes only into a user turn that ends the conversation: here it is not written
    "mistral-v3": "<s>[INST] What is the capital of France?[/INST] Paris.</s>[INST] And of Italy?[/INST] Rome.</s>",
    "mistral-v7": "<s>[SYSTEM_PROMPT]Answer briefly.[/SYSTEM_PROMPT][INST]What is the capital of France?[/INST]"
                  "Paris.</s>[INST]And of Italy?[/INST]Rome.</s>",
    "mistral-tekken": "<s>[INST]What is the capital of France?[/INST]Paris.</s>[INST]And of Italy?[/INST]Rome.</s>",
    "qa-space-header": "Note: Answer briefly.\nQ: What is the capital of France?\nA: Paris.<|done|>\n"
                       "Q: And of Italy?\nA: Rome.<|done|>\n",
    "zephyr": "<|system|>\nAnswer briefly.</s>\n<|user|>\nWhat is the capital of France?</s>\n"
              "<|assistant|>\nParis.</s>\n<|user|>\nAnd of Italy?</s>\n<|assistant|>\nRome.</s>\n",
    "vicuna": "<s>Answer briefly. USER: What is the capital of France? ASSISTANT: Paris.</s>"
              "USER: And of Italy? ASSISTANT: Rome.</s>",
    "command-r": "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Answer briefly.<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is the capital of France?<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Paris.<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>And of Italy?<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Rome.<|END_OF_TURN_TOKEN|>",
    "command-r7b": "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Answer briefly.<|END_OF_TURN_TOKEN|>"
                   "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is the capital of France?<|END_OF_TURN_TOKEN|>"
                   "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>Paris.<|END_RESPONSE|>"
                   "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>And of Italy?<|END_OF_TURN_TOKEN|>"
                   "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>Rome.<|END_RESPONSE|>"
                   "<|END_OF_TURN_TOKEN|>",
    # the fixed preamble is checked piecewise below; this is everything after it
    "command-r7b-tools": "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is the capital of France?<|END_OF_TURN_TOKEN|>"
                         "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>Paris.<|END_RESPONSE|>"
                         "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>And of Italy?"
                         "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>Rome."
                         "<|END_RESPONSE|><|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "deepseek-v3": "<｜begin▁of▁sentence｜>Answer briefly.<｜User｜>What is the capital of France?<｜Assistant｜>"
                   f"Paris.{DS_EOS}<｜User｜>And of Italy?<｜Assistant｜>Rome.{DS_EOS}",
    "deepseek-r1": "<｜begin▁of▁sentence｜>Answer briefly.<｜User｜>What is the capital of France?<｜Assistant｜>"
                   f"Paris.{DS_EOS}<｜User｜>And of Italy?<｜Assistant｜>Rome.{DS_EOS}",
    "exaone4": "[|system|]\nAnswer briefly.[|endofturn|]\n[|user|]\nWhat is the capital of France?[|endofturn|]\n"
               "[|assistant|]\n<think>\n\n</think>\n\nParis.[|endofturn|]\n[|user|]\nAnd of Italy?[|endofturn|]\n"
               "[|assistant|]\n<think>\n\n</think>\n\nRome.[|endofturn|]\n",
    "falcon3": "<|system|>\nAnswer briefly.\n<|user|>\nWhat is the capital of France?\n<|assistant|>\n"
               "Paris.<|endoftext|>\n<|user|>\nAnd of Italy?\n<|assistant|>\nRome.<|endoftext|>",
    "llama4": "<|begin_of_text|><|header_start|>system<|header_end|>\n\nAnswer briefly.<|eot|>"
              "<|header_start|>user<|header_end|>\n\nWhat is the capital of France?<|eot|>"
              "<|header_start|>assistant<|header_end|>\n\nParis.<|eot|>"
              "<|header_start|>user<|header_end|>\n\nAnd of Italy?<|eot|>"
              "<|header_start|>assistant<|header_end|>\n\nRome.<|eot|>",
    "glm4": "[gMASK]<sop><|system|>\nAnswer briefly.<|user|>\nWhat is the capital of France?<|assistant|>\nParis."
            "<|user|>\nAnd of Italy?<|assistant|>\nRome.",
    "glm4.5": "[gMASK]<sop><|system|>\nAnswer briefly.<|user|>\nWhat is the capital of France?<|assistant|>\n"
              "<think></think>\nParis.<|user|>\nAnd of Italy?<|assistant|>\n<think></think>\nRome.",
    "granite3": "<|start_of_role|>system<|end_of_role|>Answer briefly.<|end_of_text|>\n"
                "<|start_of_role|>user<|end_of_role|>What is the capital of France?<|end_of_text|>\n"
                "<|start_of_role|>assistant<|end_of_role|>Paris.<|end_of_text|>\n"
                "<|start_of_role|>user<|end_of_role|>And of Italy?<|end_of_text|>\n"
                "<|start_of_role|>assistant<|end_of_role|>Rome.<|end_of_text|>\n",
    "smollm3": "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nToday Date: {day}\n"
               "Reasoning Mode: /think\n\n## Custom Instructions\n\nAnswer briefly.\n\n<|im_end|>\n"
               "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"
               "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\nRome.<|im_end|>\n",
    "gpt-oss": "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
               "Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: medium\n\n# Valid channels: analysis, "
               "commentary, final. Channel must be included for every message.<|end|>"
               "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n<|end|>"
               "<|start|>user<|message|>What is the capital of France?<|end|>"
               "<|start|>assistant<|channel|>final<|message|>Paris.<|end|>"
               "<|start|>user<|message|>And of Italy?<|end|>"
               "<|start|>assistant<|channel|>final<|message|>Rome.<|return|>",
    # issue 24 (templates written by us)
    "llama3-original": "<|begin_of_text|>" + "".join(
        L3_HEADER.format(role) + text + "<|eot_id|>" for role, text in [
            ("system", "Answer briefly."), ("user", "What is the capital of France?"), ("assistant", "Paris."),
            ("user", "And of Italy?"), ("assistant", "Rome.")]) + L3_HEADER.format("assistant"),
    "structured-elements": element_message("system", "Answer briefly.")
                           + element_message("user", "What is the capital of France?") + element_answer("Paris.")
                           + element_message("user", "And of Italy?") + element_answer("Rome."),
    "open-think-prompt": "<|turn|>System\nAnswer briefly.<|turn_end|>\n<|turn|>User\nWhat is the capital of France?"
                         "<|turn_end|>\n<|turn|>Assistant\nParis.<|turn_end|>\n<|turn|>User\nAnd of Italy?"
                         "<|turn_end|>\n<|turn|>Assistant\n<think>\n\nRome.<|turn_end|>\n",
    "prompt-not-in-render": "<|msg|>system\nAnswer briefly.<|/msg|>\n<|msg|>user\nWhat is the capital of France?"
                            "<|/msg|>\n<|msg|>assistant\nParis.<|/msg|>\n<|msg|>user\nAnd of Italy?<|/msg|>\n"
                            "<|msg|>assistant\nRome.",
    "results-inside-assistant": "<|sys|>Answer briefly.<|human|>What is the capital of France?<|bot|>Paris.<|stop|>"
                                "<|human|>And of Italy?<|bot|>Rome.",
    "call-block-after-end": "system<|role_end|>\nAnswer briefly.<|msg_end|>\n\nuser<|role_end|>\nWhat is the capital "
                            "of France?<|msg_end|>\n\nassistant<|role_end|>\nParis.<|msg_end|>\n\nuser<|role_end|>\n"
                            "And of Italy?<|msg_end|>\n\nassistant<|role_end|>\nRome.<|msg_end|>\n\n",
    # issue 34 (templates written by us)
    "trailer-prompt-extends": "<|seg|><|setup|>Answer briefly.<|fin|><|seg|><|person|>What is the capital of France?"
                              "<|fin|><|seg|><|model|><|say|>Paris.<|/say|><|fin|><|seg|><|person|>And of Italy?"
                              "<|fin|><|seg|><|model|><|say|>Rome.<|/say|><|fin|><|seg|><|model|>",
    "reasoning-tag-prompt": "<|rules|>Answer briefly.<|over|>\n<|asker|>What is the capital of France?<|over|>\n"
                            "<|answerer|></think>Paris.<|over|>\n<|asker|>And of Italy?<|over|>\n"
                            "<|answerer|></think>Rome.<|over|>\n",
    "preamble-prompt-tools": "<|m|>system\nAnswer briefly.<|/m|>\n<|m|>user\nWhat is the capital of France?<|/m|>\n"
                             "<|m|>assistant\nParis.<|/m|>\n<|m|>user\nAnd of Italy?<|/m|>\n<|m|>assistant\nRome.",
    # issue 45 (templates and tokens ours)
    "prefilled-empty-think": "<|ts|>system\nAnswer briefly.<|te|>\n<|ts|>user\nWhat is the capital of France?<|te|>\n"
                             "<|ts|>assistant\n<think>\n\n</think>\n\nParis.<|te|>\n<|ts|>user\nAnd of Italy?<|te|>\n"
                             "<|ts|>assistant\n<think>\n\n</think>\n\nRome.<|te|>\n",
    "opener-prompt": "<|begin|>system<|sep|>Answer briefly.<|finish|><|begin|>user<|sep|>What is the capital of France?"
                     "<|finish|><|begin|>assistant<|sep|><reason></reason>Paris.<|finish|><|begin|>user<|sep|>And of "
                     "Italy?<|finish|><|begin|>assistant<|sep|><reason></reason>Rome.<|finish|>",
    "thinking-flag": "<|im|>system\nAnswer briefly.<|/im|>\n<|im|>user\nWhat is the capital of France?<|/im|>\n"
                     "<|im|>assistant\n<think>\n\n</think>\n\nParis.<|/im|>\n<|im|>user\nAnd of Italy?<|/im|>\n"
                     "<|im|>assistant\n<think>\n\n</think>\n\nRome.<|/im|>\n",
    "tool-last-differs": "<|msg_open|>system\nAnswer briefly.<|msg_close|>\n<|msg_open|>user\nWhat is the capital of "
                         "France?<|msg_close|>\n<|msg_open|>assistant\nParis.<|msg_close|>\n<|msg_open|>user\nAnd of "
                         "Italy?<|msg_close|>\n<|msg_open|>assistant\nRome.<|msg_close|>\n",
    "channel-second-header": "<|head|>system<|body|>Answer briefly.<|stop|><|head|>user<|body|>What is the capital of "
                             "France?<|stop|><|head|>assistant<|chan|>reply<|body|>Paris.<|stop|><|head|>user<|body|>"
                             "And of Italy?<|stop|><|head|>assistant<|chan|>reply<|body|>Rome.<|stop|>",
}

# how the render of EXAMPLE without its last answer ends, with add_generation_prompt=True
EXPECTED_PROMPT_END = {
    "phi3": "And of Italy?<|end|>\n<|assistant|>\n",
    "phi3.5": "And of Italy?<|end|>\n<|assistant|>\n",
    "llama2": "<s>[INST] And of Italy? [/INST]",
    "mistral-v1": " [INST] And of Italy? [/INST]",
    "mistral-v3": "Paris.</s>[INST] Answer briefly.\n\nAnd of Italy?[/INST]",  # the system prompt moved here
    "mistral-v7": "[INST]And of Italy?[/INST]",
    "mistral-tekken": "Paris.</s>[INST]Answer briefly.\n\nAnd of Italy?[/INST]",
    "qa-space-header": "Paris.<|done|>\nQ: And of Italy?\nA: ",  # the header's space is the prompt's
    "zephyr": "And of Italy?</s>\n<|assistant|>\n",
    "vicuna": "USER: And of Italy? ASSISTANT:",
    "command-r": "And of Italy?<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "command-r7b": "And of Italy?<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>",
    "command-r7b-tools": "And of Italy?<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "deepseek-v3": "<｜User｜>And of Italy?<｜Assistant｜>",
    "deepseek-r1": "<｜User｜>And of Italy?<｜Assistant｜><think>\n",
    "exaone4": "[|user|]\nAnd of Italy?[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\n",
    "falcon3": "<|user|>\nAnd of Italy?\n<|assistant|>\n",
    "llama4": "And of Italy?<|eot|><|header_start|>assistant<|header_end|>\n\n",
    "glm4": "<|user|>\nAnd of Italy?<|assistant|>",
    "glm4.5": "<|user|>\nAnd of Italy?<|assistant|>",
    "granite3": "And of Italy?<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>",
    "smollm3": "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
    "gpt-oss": "<|start|>user<|message|>And of Italy?<|end|><|start|>assistant",
    "llama3-original": "And of Italy?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "structured-elements": '<|/el|>message<|gt|><|turn_done|>\n<|el|>message role="assistant"<|gt|><|el|>think<|gt|>',
    "open-think-prompt": "<|turn|>User\nAnd of Italy?<|turn_end|>\n<|turn|>Assistant\n<think>\n\n",
    "prompt-not-in-render": "<|msg|>user\nAnd of Italy?<|/msg|>\n<|msg|>assistant\nLet me work through this.\n",
    "results-inside-assistant": "<|stop|><|human|>And of Italy?<|bot|>",
    "call-block-after-end": "user<|role_end|>\nAnd of Italy?<|msg_end|>\n\nassistant<|role_end|>\n",
    "trailer-prompt-extends": "<|seg|><|person|>And of Italy?<|fin|><|seg|><|model|><|say|>",
    "reasoning-tag-prompt": "<|asker|>And of Italy?<|over|>\n<|answerer|><think>",
    "preamble-prompt-tools": "<|m|>user\nAnd of Italy?<|/m|>\n<|m|>assistant\nHere is my plan:\n",
    "prefilled-empty-think": "<|ts|>user\nAnd of Italy?<|te|>\n<|ts|>assistant\n<think>\n\n</think>\n\n",
    "opener-prompt": "<|begin|>user<|sep|>And of Italy?<|finish|><|begin|>assistant<|sep|><reason>",
    "thinking-flag": "<|im|>user\nAnd of Italy?<|/im|>\n<|im|>assistant\n<think>\n",
    "tool-last-differs": "<|msg_open|>user\nAnd of Italy?<|msg_close|>\n<|msg_open|>assistant\n",
    "channel-second-header": "<|head|>user<|body|>And of Italy?<|stop|><|head|>assistant<|chan|>",
}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}]

# how the render of the tool conversation ends (no generation prompt)
EXPECTED_TOOL_END = {
    "mistral-v3": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>'
                  '[TOOL_RESULTS] {"content": sunny, 22C, "call_id": "call00001"}[/TOOL_RESULTS]'
                  " It is sunny and 22C in Paris.</s>",
    "mistral-tekken": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>'
                      '[TOOL_RESULTS]{"content": sunny, 22C, "call_id": "call00001"}[/TOOL_RESULTS]'
                      "It is sunny and 22C in Paris.</s>",
    "mistral-v7": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>'
                  '[TOOL_RESULTS] {"content": sunny, 22C, "call_id": "call00001"}[/TOOL_RESULTS]'
                  "It is sunny and 22C in Paris.</s>",
    "command-r7b-tools": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|><|START_ACTION|>[\n"
                         '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}\n'
                         "]<|END_ACTION|><|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>"
                         '<|START_TOOL_RESULT|>[\n    {\n        "tool_call_id": "0",\n        "results": {\n'
                         '            "0": "sunny, 22C"\n        },\n        "is_error": null\n    }\n]'
                         "<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
                         "<|START_RESPONSE|>It is sunny and 22C in Paris.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
                         "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "deepseek-v3": "<｜User｜>What's the weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                   'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
                   f"<｜tool▁calls▁end｜>{DS_EOS}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny, 22C"
                   f"<｜tool▁output▁end｜><｜tool▁outputs▁end｜>It is sunny and 22C in Paris.{DS_EOS}",
    "deepseek-r1": "<｜User｜>What's the weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                   'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
                   f"<｜tool▁calls▁end｜>{DS_EOS}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny, 22C"
                   f"<｜tool▁output▁end｜><｜tool▁outputs▁end｜>It is sunny and 22C in Paris.{DS_EOS}",
    "exaone4": '[|assistant|]\n<think>\n\n</think>\n\n<tool_call>{"name": "get_weather", "arguments": {"city": '
               '"Paris"}}</tool_call>[|endofturn|]\n[|tool|]\n<tool_result>{"result": "sunny, 22C"}</tool_result>'
               "[|endofturn|]\n[|assistant|]\n<think>\n\n</think>\n\nIt is sunny and 22C in Paris.[|endofturn|]\n",
    "falcon3": "<|user|>\nWhat's the weather in Paris?\n\n<tool_call>\n[\n  {\n    \"type\": \"function\",\n"
               '    "id": "call00001",\n    "function": {\n      "name": "get_weather",\n      "arguments": {\n'
               '        "city": "Paris"\n      }\n    }\n  }\n]\n</tool_call><|endoftext|>\n'
               "<|assistant|>\n<tool_response>\nsunny, 22C\n</tool_response>\n"
               "<|assistant|>\nIt is sunny and 22C in Paris.<|endoftext|>\n",
    "llama4": "<|header_start|>assistant<|header_end|>\n\n<|python_start|><|python_end|>"
              '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot|>'
              '<|header_start|>ipython<|header_end|>\n\n"sunny, 22C"<|eot|>'
              "<|header_start|>assistant<|header_end|>\n\nIt is sunny and 22C in Paris.<|eot|>",
    "glm4.5": "<|assistant|>\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
              "<arg_value>Paris</arg_value>\n</tool_call><|observation|>\n<tool_response>\nsunny, 22C\n"
              "</tool_response><|assistant|>\n<think></think>\nIt is sunny and 22C in Paris.",
    "gpt-oss": '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
               '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny, 22C"'
               "<|end|><|start|>assistant<|channel|>final<|message|>It is sunny and 22C in Paris.<|return|>",
    "structured-elements": element_answer("", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
                           + element_message("tool", "sunny, 22C") + element_answer("It is sunny and 22C in Paris."),
    "results-inside-assistant": "<|human|>What's the weather in Paris?<|bot|><|call_begin|>"
                                '[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|call_end|>'
                                "<|result|>sunny, 22C\nIt is sunny and 22C in Paris.",
    "qa-space-header": "Q: What's the weather in Paris?\nA: \nCall: get_weather {\"city\": \"Paris\"}<|done|>\n"
                       "Result: sunny, 22C\nA: It is sunny and 22C in Paris.<|done|>\n",
    "call-block-after-end": "user<|role_end|>\nWhat's the weather in Paris?<|msg_end|>\n\nassistant<|role_end|>\n"
                            '<|msg_end|>\n\ntool call<|role_end|>\n{"name": "get_weather", "arguments": {"city": '
                            '"Paris"}}<|msg_end|>\n\ntool output<|role_end|>\nsunny, 22C<|msg_end|>\n\n'
                            "assistant<|role_end|>\nIt is sunny and 22C in Paris.<|msg_end|>\n\n",
    "trailer-prompt-extends": "<|seg|><|person|>What's the weather in Paris?<|fin|><|seg|><|model|><|say|><|act|>"
                              '{"name": "get_weather", "arguments": {"city": "Paris"}}<|/act|><|/say|><|fin|>'
                              "<|seg|><|output|>sunny, 22C<|fin|><|seg|><|model|><|say|>It is sunny and 22C in Paris."
                              "<|/say|><|fin|><|seg|><|model|>",
    "reasoning-tag-prompt": "<|asker|>What's the weather in Paris?<|over|>\n<|answerer|></think><tool>"
                            '{"name": "get_weather", "args": {"city": "Paris"}}</tool><|over|>\n<|toolout|>sunny, 22C'
                            "<|over|>\n<|answerer|></think>It is sunny and 22C in Paris.<|over|>\n",
    "preamble-prompt-tools": "<|m|>user\nWhat's the weather in Paris?<|/m|>\n<|m|>assistant\n\n[[CALL]] "
                             '{"name": "get_weather", "arguments": {"city": "Paris"}}<|/m|>\n<|m|>tool\nsunny, 22C'
                             "<|/m|>\n<|m|>assistant\nIt is sunny and 22C in Paris.",
    "prefilled-empty-think": "<|ts|>assistant\n<think>\n\n</think>\n\n\n<call>{\"name\": \"get_weather\", "
                             "\"arguments\": {\"city\": \"Paris\"}}</call><|te|>\n<|ts|>tool\nsunny, 22C<|te|>\n"
                             "<|ts|>assistant\n"
                             "<think>\n\n</think>\n\nIt is sunny and 22C in Paris.<|te|>\n",
    "opener-prompt": "<|begin|>assistant<|sep|><reason></reason><invoke>get_weather({\"city\": \"Paris\"})</invoke>"
                     "<|finish|><|begin|>observation<|sep|>sunny, 22C<|finish|><|begin|>assistant<|sep|><reason>"
                     "</reason>It is sunny and 22C in Paris.<|finish|>",
    "tool-last-differs": "<|msg_open|>assistant\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                         "\"Paris\"}}\n</tool_call><|msg_close|>\n<|msg_open|>tool\n<tool_response>\nsunny, 22C\n"
                         "</tool_response>\n<|msg_close|>\n<|msg_open|>assistant\nIt is sunny and 22C in Paris."
                         "<|msg_close|>\n",
    "channel-second-header": "<|head|>assistant<|chan|>reply<|body|><|fn|>get_weather {\"city\": \"Paris\"}<|/fn|>"
                             "<|stop|><|head|>tool<|body|>sunny, 22C<|stop|><|head|>assistant<|chan|>reply<|body|>It "
                             "is sunny and 22C in Paris.<|stop|>",
}

# families whose render of a prefix writes the system prompt elsewhere (the last user turn)
SYSTEM_MOVES = {"mistral-v3", "mistral-tekken"}


@pytest.fixture(scope="module")
def tokenizers(family_vocab_tokenizer):
    return {name: family_vocab_tokenizer(name) for name in NAMES}


def render(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def _dates():
    now = datetime.now()
    return {"date": now.strftime("%Y-%m-%d"), "day": now.strftime("%d %B %Y")}


def tool_conversation(name: str) -> list[dict]:
    family = FAMILIES[name]
    args = '{"city": "Paris"}' if family.tool_arguments_as_string else {"city": "Paris"}
    call = {"type": "function", "id": "call00001", "function": {"name": "get_weather", "arguments": args}}
    return [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "sunny, 22C"},
        {"role": "assistant", "content": "It is sunny and 22C in Paris."},
    ]


def reasoning_conversation(name: str) -> list[dict]:
    key = FAMILIES[name].reasoning_key or "reasoning_content"
    return [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", key: "Two plus two is four."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", key: "Three plus three is six."},
    ]


def test_registry_is_complete():
    assert len(FAMILIES) >= 14
    on_disk = {p.name for p in (os.scandir(os.path.join(os.path.dirname(__file__), "family_templates")))}
    assert on_disk == {f.template for f in FAMILIES.values()}
    assert set(EXPECTED) == set(FAMILIES) == set(EXPECTED_PROMPT_END)
    assert {n for n, f in FAMILIES.items() if f.supports_tools} == set(EXPECTED_TOOL_END)
    for family in FAMILIES.values():
        assert family.template_text.startswith("{#-"), family.name  # a comment describing the layout
        assert family.example_trained and family.end_markers


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_are_single_tokens(tokenizers, name):
    tok, family = tokenizers[name], FAMILIES[name]
    for token in {*family.special_tokens, *(t for t in (family.bos_token, family.eos_token) if t)}:
        assert len(tok(token, add_special_tokens=False).input_ids) == 1, token
    assert tok.bos_token == (family.bos_token or tok.bos_token)
    assert tok.eos_token == family.eos_token


@pytest.mark.parametrize("name", NAMES)
def test_example_render_is_exact(tokenizers, name):
    tok = tokenizers[name]
    before = _dates()
    text = render(tok, example_messages(name))
    expected = {EXPECTED[name].format(**d) for d in (before, _dates())}
    if name == "command-r7b-tools":
        assert text.startswith(SYS_PREAMBLE_START)
        assert text.endswith(DEV_PREAMBLE + EXPECTED[name])
        assert "## Available Tools" not in text
    else:
        assert text in expected
    assert render(tok, example_messages(name)[:-1], add_generation_prompt=True).endswith(EXPECTED_PROMPT_END[name])


@pytest.mark.parametrize("name", NAMES)
def test_single_turn_renders_with_and_without_generation_prompt(tokenizers, name):
    tok = tokenizers[name]
    user = [{"role": "user", "content": "Hi there"}]
    prompt = render(tok, user, add_generation_prompt=True)
    full = render(tok, user + [{"role": "assistant", "content": "Hello!"}])
    assert "Hi there" in prompt and "Hello!" in full and "Hello!" not in prompt


@pytest.mark.parametrize("name", NAMES)
def test_example_trained_turns_follow_the_inference_prompt(tokenizers, name):
    """Each hand-written trained turn starts where the prompt of that turn stops matching the full render (at the
    prompt's end: what the generation prompt writes is prompt; where the full render writes only part of it, where
    they part, out of a marker they part inside), and the turns appear in order."""
    tok, family = tokenizers[name], FAMILIES[name]
    messages = example_messages(name)
    if name in SYSTEM_MOVES:
        messages = [m for m in messages if m["role"] != "system"]
    full = render(tok, messages)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(answers) == len(family.example_turns)
    for i, turn in zip(answers, family.example_turns):
        prompt = render(tok, messages[:i], add_generation_prompt=True)
        start = len(os.path.commonprefix([prompt, full]))
        for marker in re.finditer(r"<[^<>\s]+>|\[[^\[\]\s]+\]", prompt):  # they part inside '<think>' ('</think>')
            if marker.start() < start < marker.end():
                start = marker.start()
        assert full[start:].startswith(turn), (i, full[start:start + 80])
    at = 0
    for turn in family.example_turns:
        at = full.index(turn, at) + len(turn)


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n].supports_tools])
def test_tool_conversation(tokenizers, name):
    tok = tokenizers[name]
    messages = tool_conversation(name)
    text = render(tok, messages, tools=TOOLS)
    assert text.endswith(EXPECTED_TOOL_END[name])
    assert "get_weather" in render(tok, messages[:-1], tools=TOOLS, add_generation_prompt=True)


@pytest.mark.parametrize("name", [n for n in NAMES if FAMILIES[n].tool_arguments_as_string])
def test_dict_tool_arguments_raise_where_the_template_concatenates_them(tokenizers, name):
    messages = tool_conversation(name)
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    with pytest.raises(TypeError):
        render(tokenizers[name], messages, tools=TOOLS)


@pytest.mark.parametrize("name", NAMES)
def test_reasoning_is_rendered_as_the_family_says(tokenizers, name):
    tok, family = tokenizers[name], FAMILIES[name]
    messages = reasoning_conversation(name)
    text = render(tok, messages)
    first, last = "Two plus two is four.", "Three plus three is six."
    assert (first in text) == (family.reasoning == "always")
    assert (last in text) == (family.reasoning in ("rendered_last_only", "always"))
    prompt = render(tok, messages[:-1], add_generation_prompt=True)
    assert first not in prompt or family.reasoning == "always"


def test_reasoning_layouts_in_detail(tokenizers):
    glm = render(tokenizers["glm4.5"], reasoning_conversation("glm4.5"))
    assert glm.endswith("<|user|>\nAnd 3+3?<|assistant|>\n<think>Three plus three is six.</think>\n6")
    harmony = render(tokenizers["gpt-oss"], reasoning_conversation("gpt-oss"))
    assert harmony.endswith("<|start|>assistant<|channel|>final<|message|>4<|end|><|start|>user<|message|>And 3+3?"
                            "<|end|><|start|>assistant<|channel|>analysis<|message|>Three plus three is six.<|end|>"
                            "<|start|>assistant<|channel|>final<|message|>6<|return|>")
    exaone = render(tokenizers["exaone4"], reasoning_conversation("exaone4"), skip_think=False)
    assert exaone.endswith("[|assistant|]\n<think>\n\n</think>\n\n4[|endofturn|]\n[|user|]\nAnd 3+3?[|endofturn|]\n"
                           "[|assistant|]\n<think>\nThree plus three is six.\n</think>\n\n6[|endofturn|]\n")
    r1 = render(tokenizers["deepseek-r1"], [{"role": "user", "content": "q"},
                                            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nok"}])
    assert r1.endswith("<｜User｜>q<｜Assistant｜>\n\nok" + DS_EOS)


def test_chat_template_kwargs(tokenizers):
    user = [{"role": "user", "content": "q"}]
    answer = [{"role": "assistant", "content": "a"}]
    exaone = tokenizers["exaone4"]
    assert render(exaone, user, add_generation_prompt=True, enable_thinking=True).endswith("[|assistant|]\n<think>\n")
    smol = tokenizers["smollm3"]
    no_think = render(smol, user + answer, enable_thinking=False)
    assert "Reasoning Mode: /no_think" in no_think and no_think.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\na<|im_end|>\n")
    flagged = render(smol, [{"role": "system", "content": "Be nice. /no_think"}] + user, add_generation_prompt=True)
    assert "Be nice.\n\n" in flagged and flagged.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    glm = tokenizers["glm4.5"]
    assert render(glm, user, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|user|>\nq/nothink<|assistant|>\n<think></think>")
    assert "\nReasoning: high\n" in render(tokenizers["gpt-oss"], user, reasoning_effort="high")
    granite = render(tokenizers["granite3"], user)
    assert f"Today's Date: {datetime.now().strftime('%B %d, %Y')}. You are Granite" in granite


@pytest.mark.parametrize(("name", "messages", "kwargs"), [
    ("llama2", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {}),
    ("mistral-v1", [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], {}),
    ("vicuna", [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], {}),
    ("qa-space-header", [{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}], {}),
    ("exaone4", [{"role": "knowledge", "content": "a"}, {"role": "user", "content": "b"}], {}),
    ("gpt-oss", [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], {}),
    ("mistral-v3", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "short", "function": {"name": "f", "arguments": {}}}]}], {}),
])
def test_templates_raise_on_what_the_real_ones_refuse(tokenizers, name, messages, kwargs):
    with pytest.raises(jinja2.exceptions.TemplateError):
        render(tokenizers[name], messages, **kwargs)


def test_quirks_kept(tokenizers):
    # Phi-3 drops the system prompt; Llama 4 leaves out an assistant message whose tool_calls list is empty
    assert "Answer briefly." not in render(tokenizers["phi3"], copy.deepcopy(EXAMPLE))
    llama4 = render(tokenizers["llama4"], [{"role": "user", "content": "q"},
                                            {"role": "assistant", "content": "gone", "tool_calls": []}])
    assert "gone" not in llama4
    # GLM-4 writes a tool message under <|tool|> and leaves out empty messages
    glm = render(tokenizers["glm4"], [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                                      {"role": "tool", "content": "r"}])
    assert glm == "[gMASK]<sop><|user|>\nq<|tool|>\nr"
    # Granite never writes tool calls; SmolLM3 never writes reasoning_content
    call = tool_conversation("granite3")
    assert "get_weather" not in render(tokenizers["granite3"], call).split("<|start_of_role|>user")[1]
    assert "Three plus" not in render(tokenizers["smollm3"], reasoning_conversation("smollm3"))
    # Mistral v3 writes tool results raw (not JSON) and trims answers; v7 keeps the last 9 characters of an id
    v7 = tool_conversation("mistral-v7")
    v7[1]["tool_calls"][0]["id"] = v7[2]["tool_call_id"] = "call_0123456789"
    assert '"id": "123456789"}]</s>' in render(tokenizers["mistral-v7"], v7, tools=TOOLS)
