"""Renderers: one small class per output format, each turning a Report into text.

The CLI maps its format choices to these classes through FORMATS; tests render one canonical
report fixture with every renderer and compare to golden files.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from nanaudit.report import Report


class Renderer(ABC):
    """Turns a Report into the text of one format."""

    @abstractmethod
    def render(self, report: Report) -> str:
        ...


def renderer_for(name: str) -> Renderer:
    from nanaudit.render.github import GithubRenderer
    from nanaudit.render.json import JsonRenderer
    from nanaudit.render.junit import JunitRenderer
    from nanaudit.render.markdown import MarkdownRenderer
    formats = {"json": JsonRenderer, "junit": JunitRenderer, "github": GithubRenderer,
               "markdown": MarkdownRenderer}
    return formats[name]()
