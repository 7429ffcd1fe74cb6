"""The package version: inner modules import it from here, never from the package face."""

__version__ = "0.1.0"
