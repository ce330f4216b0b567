"""Ctrl-C / SIGTERM during training: finish the current step, save a checkpoint there, and stop.

    stopper = StopOnSignal()
    with handle_stop_signals(stopper):
        trainer = Trainer(..., callbacks=[stopper])
        trainer.train()
    if stopper.stopped_at is not None:
        ...  # interrupted: a checkpoint-<step> was saved; the same command again continues from it

The handler only sets a flag (nothing else is safe inside a signal handler);
the Trainer acts on it at the next optimiser step end: ``should_save`` writes
``checkpoint-<step>`` (weights, optimiser, scheduler, RNG and data position),
``should_training_stop`` ends the loop. A second signal stops at once
(``KeyboardInterrupt``) without saving. Under torchrun every rank must save the
same step, so the flag is OR-ed over ranks at each step end.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

from transformers import TrainerCallback

from qlora_train.errors import Interrupted

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Interrupted):
    """Training stopped on a signal after saving ``checkpoint``; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint saved to "
                         f"{checkpoint}; run the same command again to continue", signum)


class StopOnSignal(TrainerCallback):
    """Asks the Trainer to save a checkpoint and stop at the first step end after ``request_stop``."""

    def __init__(self):
        self.signum: int | None = None  # the signal received (or, on other ranks, SIGTERM)
        self.stopped_at: int | None = None  # the step where training stopped and saved

    def request_stop(self, signum, frame=None) -> None:
        """The signal handler: set the flag; a second signal interrupts at once."""
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def _any_rank_asked(self, args) -> bool:
        import torch.distributed as dist

        asked = self.signum is not None
        if dist.is_available() and dist.is_initialized():
            import torch

            flag = torch.tensor([int(asked)], device=args.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            asked = bool(flag.item())
        return asked

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is None and self._any_rank_asked(args):
            self.signum = self.signum or signal.SIGTERM
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control


@contextmanager
def handle_stop_signals(stopper: StopOnSignal):
    """Route SIGINT/SIGTERM to ``stopper`` inside the block (main thread only); restore the old handlers after."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal only works there
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, stopper.request_stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
