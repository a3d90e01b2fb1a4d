"""skyrl_tx: a self-hosted Tinker API server on a C++ libtorch core."""

# torch first: _C resolves libtorch symbols that `import torch` loads (pytorch/extension-cpp#6).
import torch  # noqa: F401

__version__ = "0.1.0"
