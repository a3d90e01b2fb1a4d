"""load_extension(): imports skyrl_tx._C after checking it was built against the running torch."""

from __future__ import annotations

import functools
from types import ModuleType

REINSTALL = "pip install --no-build-isolation --force-reinstall --no-deps -e ."


@functools.cache
def load_extension() -> ModuleType:
    """Returns the extension module; raises ImportError naming both torch versions on a mismatch."""
    # torch first: _C resolves libtorch symbols that `import torch` loads (pytorch/extension-cpp#6). Only here
    # (and in the engine): the package itself never loads torch, so the API process stays free of it.
    import torch

    try:
        from skyrl_tx import _build_info
    except ImportError as exc:
        raise ImportError(
            "skyrl_tx: the C++ extension is not built (no skyrl_tx/_build_info.py); "
            f"install the package with `{REINSTALL}`"
        ) from exc
    running_abi = bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    if _build_info.TORCH_VERSION != torch.__version__ or _build_info.CXX11_ABI != running_abi:
        raise ImportError(
            f"skyrl_tx._C was built against torch {_build_info.TORCH_VERSION} "
            f"(C++11 ABI {_build_info.CXX11_ABI}) but torch {torch.__version__} "
            f"(C++11 ABI {running_abi}) is installed; rebuild skyrl_tx with `{REINSTALL}`, "
            f"or install torch=={_build_info.TORCH_VERSION.split('+')[0]}"
        )
    from skyrl_tx import _C

    return _C
