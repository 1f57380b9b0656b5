"""kvpack: Python client for the kvpackd attention daemon."""

__version__ = "0.1.0"
