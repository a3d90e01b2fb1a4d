"""skyrl_tx/_C.pyi names exactly what the built extension binds: every public function, class, method and property."""

from __future__ import annotations

import ast
from pathlib import Path

import skyrl_tx
from skyrl_tx._ext import load_extension

STUB = Path(skyrl_tx.__file__).with_name("_C.pyi")
REGENERATE = "regenerate it: pip install pybind11-stubgen && python -m skyrl_tx.extension_stub"
NCCL_ONLY = {"NcclCommunicator"}  # bound only in CUDA + NCCL builds (the stub is generated from one)


def _stub_names() -> dict[str, set[str]]:
    """Top-level public names → the public members of each (empty for functions)."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            names[node.name] = {m for m in members if not m.startswith("_")}
    return names


def _module_names(native) -> dict[str, set[str]]:
    names = {}
    for name in dir(native):
        if name.startswith("_"):
            continue
        value = getattr(native, name)
        if isinstance(value, type):
            names[name] = {m for m in vars(value) if not m.startswith("_")}
        elif callable(value):
            names[name] = set()
    return names


def test_stub_matches_the_built_extension() -> None:
    native = load_extension()
    stub, built = _stub_names(), _module_names(native)
    if not native.build_info()["nccl"]:
        stub = {k: v for k, v in stub.items() if k not in NCCL_ONLY}
    assert sorted(stub) == sorted(built), f"skyrl_tx/_C.pyi is out of date ({REGENERATE})"
    for name, members in built.items():
        assert stub[name] == members, f"_C.{name}: the stub's members differ ({REGENERATE})"
