"""nanaudit: find the batch, sample, module and op that made PyTorch training go non-finite.

The library API: `audit(config)` runs what `nanaudit scan` runs and returns the Report;
`Sentinel(model, optimizer, loss_fn=...)` checks a hand-written loop and raises
`NonFiniteError(report)`. Names resolve lazily so `import nanaudit` (and `nanaudit --help`)
does not import torch.
"""

from nanaudit._version import __version__

__all__ = ["NonFiniteError", "Sentinel", "__version__", "audit"]


def audit(config_or_path, **overrides):
    """Run what `nanaudit scan` runs and return the Report (imports torch on first use)."""
    from nanaudit.commands.scan import audit as _audit
    return _audit(config_or_path, **overrides)


def __getattr__(name):
    if name in ("Sentinel", "NonFiniteError"):
        from nanaudit.integrations import sentinel
        return getattr(sentinel, name)
    raise AttributeError(f"module 'nanaudit' has no attribute {name!r}")
