"""The xspec version: ``xspec.__version__``, and what a cached step-cost profile records
(a module of its own, so that reading it imports nothing of the package above it)."""

__version__ = "0.1.0"
