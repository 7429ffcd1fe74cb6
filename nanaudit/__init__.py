"""nanaudit: find the batch, sample, module and op that made PyTorch training go non-finite."""

__version__ = "0.1.0"

__all__ = ["__version__", "audit"]


def audit(config_or_path, **overrides):
    """Run what `nanaudit scan` runs and return the Report (imports torch on first use)."""
    from nanaudit.pipeline import audit as _audit
    return _audit(config_or_path, **overrides)
