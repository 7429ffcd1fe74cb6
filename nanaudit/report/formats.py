"""The registry of output formats: `renderer_for(name)` maps the CLI's choices (json, junit,
markdown, github, html) to their renderers; tests render one canonical report with each and
compare it to golden files.
"""

from __future__ import annotations

from collections.abc import Callable

from nanaudit.report.interface import Renderer


def renderer_for(name: str) -> Renderer:
    from nanaudit.report.github import GithubRenderer
    from nanaudit.report.html import HtmlRenderer
    from nanaudit.report.json import JsonRenderer
    from nanaudit.report.junit import JunitRenderer
    from nanaudit.report.markdown import MarkdownRenderer
    formats: dict[str, Callable[[], Renderer]] = {
        "json": JsonRenderer, "junit": JunitRenderer, "github": GithubRenderer,
        "markdown": MarkdownRenderer, "html": HtmlRenderer}
    return formats[name]()
