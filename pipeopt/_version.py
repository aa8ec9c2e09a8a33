"""The release of pipeopt, in a module of its own so that any module (the command line's
``--version``) can read it without importing the package that re-exports everything."""

__version__ = "0.1.0"
