"""The library's version, in a module of its own: the package, the CLI and the plan cache's key read it
without importing the package's ``__init__`` from inside the package."""

__version__ = "0.1.0"
