"""Exceptions shared across grpolab that no other module should have to import a subsystem for."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value; the message names the field (and file:line when known)."""
