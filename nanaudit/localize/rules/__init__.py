"""The domain rules, one module per family of ops, and the registry they fill.

Importing any module of this package imports every family, so the registry (`registry.RULES`)
is complete before the tracer or the diagnosis reads it.
"""

from nanaudit.localize.rules import division, exp_log, losses, norms, poles, softmax

__all__ = ["division", "exp_log", "losses", "norms", "poles", "softmax"]
