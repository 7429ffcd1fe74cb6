"""The registry of output formats: `renderer_for(name)` maps the CLI's choices (json, junit,
markdown, github, html) to their renderers; tests render one canonical report with each and
compare it to golden files.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from nanaudit.report.interface import Renderer

# Each renderer's module, imported only when its format is asked for: a run writing JSON does
# not pay for the HTML renderer's or the console's imports (pygments, rich's syntax).
_RENDERERS = {"json": ("nanaudit.report.json", "JsonRenderer"),
              "junit": ("nanaudit.report.junit", "JunitRenderer"),
              "github": ("nanaudit.report.github", "GithubRenderer"),
              "markdown": ("nanaudit.report.markdown", "MarkdownRenderer"),
              "html": ("nanaudit.report.html", "HtmlRenderer")}


def renderer_for(name: str) -> Renderer:
    module, attribute = _RENDERERS[name]
    made: Callable[[], Renderer] = getattr(
        importlib.import_module(module), attribute)
    return made()
