"""What a run is asked to do: the YAML schema (schema.py), reading and parsing it (reader.py,
values.py, sections.py, parse.py), and resolving and checking the user's code it names
(entrypoints.py, validate.py). Nothing here imports torch at import time."""
