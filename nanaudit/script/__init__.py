"""Auditing an unmodified training script (`nanaudit run`): hooks, first run, re-run, findings."""
