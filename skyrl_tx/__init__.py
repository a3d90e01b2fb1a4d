"""skyrl_tx: a self-hosted Tinker API server on a C++ libtorch core.

The package itself imports nothing heavy: torch loads in the engine (and wherever the extension is used) through
skyrl_tx._ext.load_extension(), never in the API process."""

__version__ = "0.1.0"
