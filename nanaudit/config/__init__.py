"""What a run is asked to do: the YAML schema, its parsing and validation, and the user's entrypoints (no torch at import time)."""
