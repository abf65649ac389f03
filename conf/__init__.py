"""xspec's Hydra configuration (YAML values only; schemas live in xspec/config.py).

This top-level ``conf/`` is the one copy: a checkout reads it directly
(``xspec.config.config_dir``), and pyproject maps the package ``xspec.conf`` to it, so a
wheel installs the same files as ``xspec/conf/``.
"""
