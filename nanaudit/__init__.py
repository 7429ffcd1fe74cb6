"""nanaudit: find the batch, sample, module and op that made PyTorch training go non-finite.

The library API: `audit(config)` runs what `nanaudit scan` runs and returns the `Report`;
`Sentinel(model, optimizer, loss_fn=...)` checks a hand-written loop and raises
`NonFiniteError(report)`, whose `.report.finding` is a `Finding`.

The face is written twice on purpose. Type checkers and IDEs read the `TYPE_CHECKING` imports
and see the real classes and signatures; at run time the same names resolve on first use
through the module `__getattr__`, so `import nanaudit` (and `nanaudit --help`) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanaudit._version import __version__

if TYPE_CHECKING:
    from nanaudit.commands.scan import audit
    from nanaudit.integrations.sentinel import NonFiniteError, Sentinel
    from nanaudit.report.model import Finding, Report

__all__ = ["Finding", "NonFiniteError", "Report", "Sentinel", "__version__", "audit"]

# name -> the module that defines it; imported only when the name is first read.
_LAZY = {
    "Sentinel": "nanaudit.integrations.sentinel",
    "NonFiniteError": "nanaudit.integrations.sentinel",
    "Report": "nanaudit.report.model",
    "Finding": "nanaudit.report.model",
}

if not TYPE_CHECKING:
    def audit(config_or_path, **overrides):
        """Run what `nanaudit scan` runs and return the Report (imports torch on first call)."""
        from nanaudit.commands.scan import audit as scan_audit
        return scan_audit(config_or_path, **overrides)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nanaudit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
