"""Renderers: one small class per output format, each turning a Report into text.

The CLI maps its format choices to these classes through FORMATS; tests render one canonical
report fixture with every renderer and compare to golden files.
"""

from __future__ import annotations

from nanaudit.report.interface import Renderer


def renderer_for(name: str) -> Renderer:
    from nanaudit.report.github import GithubRenderer
    from nanaudit.report.json import JsonRenderer
    from nanaudit.report.junit import JunitRenderer
    from nanaudit.report.markdown import MarkdownRenderer
    formats = {"json": JsonRenderer, "junit": JunitRenderer, "github": GithubRenderer,
               "markdown": MarkdownRenderer}
    return formats[name]()
