"""Diagnostics before training: length statistics (``--stats-only``) and mask rendering (``--debug-samples``)."""
