"""The JSON report: the stable machine contract (see report.report_to_dict)."""

from __future__ import annotations

import json

from nanaudit.report.interface import Renderer
from nanaudit.report.model import Report, report_to_dict


class JsonRenderer(Renderer):
    def render(self, report: Report) -> str:
        # allow_nan=False: non-finite statistics are already strings; bare NaN is not JSON.
        return json.dumps(report_to_dict(report), indent=2, allow_nan=False) + "\n"
