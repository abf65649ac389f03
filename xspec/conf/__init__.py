"""Hydra configuration (YAML values only; schemas live in xspec/config.py)."""
