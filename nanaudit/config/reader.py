"""Read a config file's YAML, refusing hostile input before it is built.

A file over MAX_CONFIG_BYTES, or YAML whose aliases expand past MAX_YAML_NODES (a "billion
laughs" bomb) or refer to themselves, is a config error: every report and repro bundle later
copies the config's values out, so a config must stay a page of keys.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import yaml

from nanaudit.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20        # a config is a page of keys, never a data set


MAX_YAML_NODES = 100_000          # nodes after expanding aliases
YAML_FRAMES = 2_000               # Python frames the parser may nest: hundreds of levels


def read_yaml(path: Path) -> dict:
    """The file's top-level mapping; ConfigError when it is missing, too large or not YAML."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"config path is a folder, not a file: {path}")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"the file is {size} bytes; a config is at most "
                              f"{MAX_CONFIG_BYTES} bytes (put data in the data factory)",
                              source=str(path))
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        with _bounded_stack():
            _check_expansion(yaml.compose(text, Loader=yaml.SafeLoader))
            raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_problem(exc), source=str(path)) from None
    except _YamlTooLarge as exc:
        raise ConfigError(str(exc), source=str(path)) from None
    except RecursionError:
        raise ConfigError("the YAML nests too deeply (thousands of levels of [ or {); a config "
                          "is a page of keys", source=str(path)) from None
    if raw is None:
        raise ConfigError("the file is empty: it needs at least `model`, `data` and `loss`",
                          source=str(path))
    if not isinstance(raw, dict):
        raise ConfigError(f"the top level must be a mapping of keys, got {type(raw).__name__}",
                          source=str(path))
    return raw


class _YamlTooLarge(Exception):
    pass


def _check_expansion(root: yaml.Node | None) -> None:
    """Count the nodes the document expands to (aliases counted at every use), memoised per
    node so a bomb is measured in the time of its short text, and refuse cycles."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise _YamlTooLarge("a YAML alias refers to the node that contains it (a "
                                "recursive structure); write the values out")
        open_nodes.add(key)
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in node.value)
        else:
            total = 1
        open_nodes.discard(key)
        sizes[key] = total
        if total > MAX_YAML_NODES:
            raise _YamlTooLarge(f"the YAML expands to more than {MAX_YAML_NODES} values through "
                                f"its aliases (&anchor / *alias); a config this large is refused")
        return total
    if root is not None:
        size(root)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc)
    if mark is None:
        return f"YAML syntax error: {what}"
    return f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: {what}"


@contextmanager
def _bounded_stack() -> Iterator[None]:
    """PyYAML nests a Python call per level of [ or {: the parse runs under a recursion limit
    of YAML_FRAMES beyond the caller's depth, so a deeply nested file is refused alike whatever
    limit the process set (torch.compile and other libraries raise it, and a high one lets the
    parse reach the C stack)."""
    depth = 0
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(min(limit, depth + YAML_FRAMES))
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)
