"""After training: find the trained adapter, merge it into the base (``merge.py``), write a serving
``generation_config`` that stops at the template's end-of-turn token (``stop_tokens.py``), and try the
model on a prompt (``generate.py``)."""
