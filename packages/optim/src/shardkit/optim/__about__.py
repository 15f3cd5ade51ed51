"""Version of this distribution (bumped by tools/release.py)."""

__all__ = ["__version__"]

__version__ = "0.12.1"
