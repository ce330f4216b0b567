"""A tool that takes its time (tests/rl/test_agent_rollout.py: the per-call time limit)."""

import time


def wait(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: How long to wait.
    """
    time.sleep(seconds)
    return "waited"
