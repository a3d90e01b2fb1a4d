"""Finds test assertions that bound a wall-clock duration, ratio or rate (speed is measured by benchmarks, never by
timed tests: a busy CI machine fails them; tests/test_no_timed_asserts.py applies this to the tests tree).

A small data-flow pass over each file's AST: a clock reading (time.perf_counter/monotonic/time, datetime.now) is a
point in time; point - point is a duration; arithmetic, min/max/sum/sorted/median and containers filled with
`.append` keep a duration a duration; a division by a duration (or of two durations) is a ratio or a rate. Helper
functions that return such values (also from tests/support, by name) carry their kind to their callers, a tuple's
positions separately. Flagged, inside an `assert` only:
* any comparison of a ratio or rate with anything;
* a duration compared as at most or exactly something (`took < 10`, `10 > took`, `took == 1`).
Allowed: clock points against deadlines (`assert time.monotonic() < deadline`: a bounded timeout), and a duration's
lower bound (`assert waited >= 1.0`: the code waited that long; a slower machine only lengthens it)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

POINT, DURATION, RATIO = "point", "duration", "ratio"
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "process_time",
          "now", "utcnow"}
CLOCK_OWNERS = {"time", "datetime"}  # time.monotonic(), datetime.now(), datetime.datetime.now()
KEEP_KIND = {"min", "max", "sum", "sorted", "abs", "float", "round", "median", "mean", "fmean", "list",
             "total_seconds"}
Kind = frozenset[str]
NONE: Kind = frozenset()


@dataclass
class Returns:
    """What calling a function gives: one kind, or one per position of the tuple it returns."""

    scalar: Kind = NONE
    positions: list[Kind] = field(default_factory=list)


def _call_name(call: ast.Call) -> tuple[str, str]:
    """(owner, name) of the called function: ("time", "monotonic"), ("", "helper"), ("x", "total_seconds")."""
    f = call.func
    if isinstance(f, ast.Attribute):
        owner = f.value.attr if isinstance(f.value, ast.Attribute) else getattr(f.value, "id", "")
        return owner, f.attr
    return "", getattr(f, "id", "")


class _Scope:
    """The kinds of one top-level function's names (nested functions included: closures share them)."""

    def __init__(self, returns: dict[str, Returns], base: dict[str, Kind]):
        self.returns = returns
        self.names: dict[str, Kind] = dict(base)

    def kind(self, e: ast.AST | None) -> Kind:
        if isinstance(e, ast.Name):
            return self.names.get(e.id, NONE)
        if isinstance(e, ast.Subscript):
            return self.kind(e.value)
        if isinstance(e, ast.UnaryOp):
            return self.kind(e.operand)
        if isinstance(e, ast.IfExp):
            return self.kind(e.body) | self.kind(e.orelse)
        if isinstance(e, ast.Call):
            owner, name = _call_name(e)
            if name in CLOCKS and owner in CLOCK_OWNERS or (not owner and name in CLOCKS - {"time", "now"}):
                return frozenset({POINT})
            if name in KEEP_KIND:
                inner = [self.kind(a) for a in e.args] + ([self.kind(e.func.value)]
                                                          if isinstance(e.func, ast.Attribute) else [])
                return frozenset().union(*inner) if inner else NONE
            return self.returns[name].scalar if not owner and name in self.returns else NONE
        if isinstance(e, ast.BinOp):
            left, right = self.kind(e.left), self.kind(e.right)
            timed = DURATION in left or RATIO in left or DURATION in right or RATIO in right
            if isinstance(e.op, ast.Sub) and POINT in left and POINT in right:
                return frozenset({DURATION})
            if isinstance(e.op, (ast.Add, ast.Sub)) and (POINT in left or POINT in right) and not timed:
                return frozenset({POINT})  # a deadline: a point plus a constant
            if isinstance(e.op, ast.Div):
                if DURATION in right or RATIO in right or RATIO in left:
                    return frozenset({RATIO})
                return frozenset({DURATION}) if DURATION in left else NONE
            return frozenset({DURATION}) if timed else NONE
        return NONE

    def _bind(self, target: ast.AST, kind: Kind) -> bool:
        while isinstance(target, (ast.Subscript, ast.Attribute, ast.Starred)):
            target = target.value
        if not isinstance(target, ast.Name) or kind <= self.names.get(target.id, NONE):
            return False
        self.names[target.id] = self.names.get(target.id, NONE) | kind
        return True

    def _assign(self, target: ast.AST, value: ast.AST | None) -> bool:
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                return any([self._assign(t, v) for t, v in zip(target.elts, value.elts)])
            if isinstance(value, ast.Call) and not _call_name(value)[0]:
                positions = self.returns.get(_call_name(value)[1], Returns()).positions
                return any([self._bind(t, k) for t, k in zip(target.elts, positions)])
            return False
        return self._bind(target, self.kind(value))

    def learn(self, tree: ast.AST) -> None:
        """Binds every name of the scope to the kinds it is ever given (order-insensitive, to a fixed point)."""
        changed = True
        while changed:
            changed = False
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    changed |= any([self._assign(t, node.value) for t in node.targets])
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                    changed |= self._bind(node.target, self.kind(node.value))
                elif isinstance(node, ast.For):
                    changed |= self._bind(node.target, self.kind(node.iter))
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in ("append", "extend", "add") and node.args):
                    changed |= self._bind(node.func.value, self.kind(node.args[0]))


def _bounds_a_time(scope: _Scope, compare: ast.Compare) -> bool:
    operands = [compare.left, *compare.comparators]
    for op, left, right in zip(compare.ops, operands, operands[1:]):
        lk, rk = scope.kind(left), scope.kind(right)
        if RATIO in lk or RATIO in rk:
            return True
        at_most = (isinstance(op, (ast.Lt, ast.LtE)) and DURATION in lk
                   or isinstance(op, (ast.Gt, ast.GtE)) and DURATION in rk)
        if at_most or isinstance(op, (ast.Eq, ast.NotEq)) and DURATION in lk | rk:
            return True
    return False


def _scopes(tree: ast.Module) -> list[ast.AST]:
    """The module's own statements (one scope) and each top-level function or method (one scope each)."""
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nested = {id(inner) for f in functions for inner in ast.walk(f) if inner is not f
              and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))}
    top = [f for f in functions if id(f) not in nested]
    module = ast.Module(body=[s for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                          ast.ClassDef))], type_ignores=[])
    return [module, *top]


def _learn_returns(trees: list[ast.Module]) -> dict[str, Returns]:
    """What each function of these files returns, by name, to a fixed point (helpers call helpers)."""
    returns: dict[str, Returns] = {}
    for _ in range(6):
        found: dict[str, Returns] = {}
        for tree in trees:
            for top in _scopes(tree):
                scope = _Scope(returns, {})
                scope.learn(top)
                for f in ast.walk(top):
                    if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        continue
                    got = found.setdefault(f.name, Returns())
                    for r in (n for n in ast.walk(f) if isinstance(n, ast.Return) and n.value is not None):
                        if isinstance(r.value, ast.Tuple):
                            kinds = [scope.kind(e) for e in r.value.elts]
                            got.positions = [a | b for a, b in zip(kinds, got.positions + [NONE] * len(kinds))]
                        else:
                            got.scalar |= scope.kind(r.value)
        found = {k: v for k, v in found.items() if v.scalar or any(v.positions)}
        if found == returns:
            break
        returns = found
    return returns


def timed_asserts(sources: dict[str, str]) -> list[str]:
    """'name:line: source' of every assert that bounds a wall-clock duration, ratio or rate in these sources."""
    trees = {name: ast.parse(text, name) for name, text in sources.items()}
    returns = _learn_returns(list(trees.values()))
    found = []
    for name, tree in trees.items():
        module = _Scope(returns, {})
        module.learn(_scopes(tree)[0])
        for top in _scopes(tree):
            scope = _Scope(returns, module.names)
            scope.learn(top)
            for node in ast.walk(top):
                if isinstance(node, ast.Assert) and any(_bounds_a_time(scope, c) for c in ast.walk(node.test)
                                                        if isinstance(c, ast.Compare)):
                    found.append(f"{name}:{node.lineno}: {ast.get_source_segment(sources[name], node)}")
    return sorted(set(found))


def timed_asserts_in(root: Path) -> list[str]:
    return timed_asserts({str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*.py"))})
