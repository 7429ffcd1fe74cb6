"""Renderers: one small class per output format, each turning a Report into text.

The CLI maps its format choices to these classes through FORMATS; tests render one canonical
report fixture with every renderer and compare to golden files.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from nanaudit.report.model import Report


class Renderer(ABC):
    """Turns a Report into the text of one format."""

    @abstractmethod
    def render(self, report: Report) -> str:
        ...
