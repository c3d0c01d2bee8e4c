"""kugetsu: a capacity manager for parallel AI coding agents."""

__version__ = "0.1.0"
