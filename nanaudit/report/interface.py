"""The renderer contract: one small class per output format turning a Report into text. It
imports no format, so the registry (formats.py) and the formats never import each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from nanaudit.report.model import Report


class Renderer(ABC):
    """Turns a Report into the text of one format."""

    @abstractmethod
    def render(self, report: Report) -> str:
        ...
