"""The package version, in a module of its own so that no module imports the package's ``__init__``."""

__version__ = "0.1.0"
