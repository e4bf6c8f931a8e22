"""The package version, here so every layer can report it without importing upward."""

__version__ = "0.1.0"
