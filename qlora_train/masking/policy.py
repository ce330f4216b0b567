"""The loss policy: which messages, and which parts of them, carry loss. Decided once, read by every stage.

``LossPolicy.of(data_config)`` is built once per batch. The parse stage marks
every message with an explicit ``train`` flag (``LossPolicy.mark``); render,
truncation and the reasoning expansion only read that flag, and the policy's
``think_loss`` / ``train_on_eos`` say which characters of a trained turn are
trained. No later stage decides again from roles.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from qlora_train.masking.messages import Message

# the policy's choices, bound here once: the config's fields (``data.think_loss`` ...) are typed with them
ThinkLoss = Literal["all", "answer_only", "answer_plus_think"]
TrainOnEos = Literal["turn", "all", "last", "none"]
ReasoningHistory = Literal["expand", "drop"]


@dataclass(frozen=True)
class LossPolicy:
    assistant_roles: tuple[str, ...] = ("assistant",)
    role_rules: tuple[tuple[str, bool], ...] | None = None  # data.mask: role -> trained (replaces assistant_roles)
    other_roles_trained: bool = False  # data.mask_default: train
    last_turn_only: bool = False
    think_loss: ThinkLoss = "all"
    train_on_eos: TrainOnEos = "turn"
    reasoning_history: ReasoningHistory = "expand"
    reasoning_history_max_examples: int = 16

    @classmethod
    def of(cls, cfg: Any) -> LossPolicy:
        """The policy a data config (``DataConfig``, or anything with its fields) asks for."""
        rules = None if cfg.mask is None else tuple((role, rule == "train") for role, rule in cfg.mask.items())
        return cls(assistant_roles=tuple(cfg.assistant_roles), role_rules=rules,
                   other_roles_trained=cfg.mask_default == "train", last_turn_only=cfg.last_turn_only,
                   think_loss=cfg.think_loss, train_on_eos=cfg.train_on_eos, reasoning_history=cfg.reasoning_history,
                   reasoning_history_max_examples=cfg.reasoning_history_max_examples)

    def trains_role(self, role: str) -> bool:
        """Whether messages of ``role`` are trained by the role rules (before a message's own ``train``)."""
        if self.role_rules is not None:
            return dict(self.role_rules).get(role, self.other_roles_trained)
        return role in self.assistant_roles

    def flags(self, messages: Iterable[dict]) -> list[bool]:
        """Which messages are trained: the role rules, then a message's own ``train`` (from the row's
        ``training`` / ``weight``), then ``last_turn_only``.

        >>> LossPolicy(last_turn_only=True).flags([{"role": "user"}, {"role": "assistant"},
        ...                                       {"role": "user"}, {"role": "assistant"}])
        [False, False, False, True]
        """
        flags = [m.get("train", self.trains_role(m["role"])) for m in messages]
        if self.last_turn_only and any(flags):
            last = max(i for i, f in enumerate(flags) if f)
            flags = [i == last for i in range(len(flags))]
        return flags

    def mark(self, messages: list[dict]) -> list[Message]:
        """Copies of ``messages``, each with its explicit ``train`` flag (``flags``)."""
        return [{**m, "train": f} for m, f in zip(messages, self.flags(messages))]

    def trains_eot(self, index: int, last_trained: int) -> bool:
        """Whether the end-of-turn marker of trained message ``index`` is trained."""
        return self.train_on_eos in ("turn", "all") or (self.train_on_eos == "last" and index == last_trained)


DEFAULT_POLICY = LossPolicy()


def is_trained(msg: Message, i: int = 0) -> bool:
    """A marked message's ``train`` flag (set by ``LossPolicy.mark``; the parse stage marks every message)."""
    try:
        return msg["train"]
    except KeyError:
        raise ValueError(f"messages[{i}] has no 'train' flag: mark the messages with LossPolicy.mark "
                         "(canonicalize_row does)") from None
