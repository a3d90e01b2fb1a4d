"""The tinker:// checkpoint path grammar the SDK parses: tinker://<training_run_id>/<kind>/<name>."""

from __future__ import annotations

import re
from dataclasses import dataclass

from skyrl_tx.errors import InvalidArgumentError

# Path segment ↔ the SDK's Checkpoint.checkpoint_type.
KIND_TO_TYPE = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
TYPE_TO_KIND = {v: k for k, v in KIND_TO_TYPE.items()}
# Names become directory names in the store: no separators, no dot-only names, nothing a shell must quote.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")


def validate_name(name: str | None, what: str) -> str:
    if not name or not NAME_PATTERN.match(name):
        raise InvalidArgumentError(f"{what}: checkpoint name {name!r} must be 1-128 characters of letters, digits, "
                                   "'_', '-' or '.', not starting with '.' or '-' (e.g. 'step_000100')")
    return name


@dataclass(frozen=True)
class TinkerPath:
    """A parsed checkpoint path. `checkpoint_id` is what the REST API calls it: '<kind>/<name>'."""

    training_run_id: str  # the model id that saved it
    kind: str  # weights | sampler_weights | external_weights
    name: str

    @property
    def checkpoint_type(self) -> str:
        return KIND_TO_TYPE[self.kind]

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"tinker://{self.training_run_id}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, path: str, what: str = "path") -> TinkerPath:
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise InvalidArgumentError(f"{what}: {path!r} is not a tinker:// checkpoint path; expected "
                                       "tinker://<training_run_id>/weights/<name> (or sampler_weights/<name>)")
        parts = path.removeprefix("tinker://").split("/")
        if len(parts) != 3 or not parts[0] or parts[1] not in KIND_TO_TYPE:
            raise InvalidArgumentError(f"{what}: {path!r} must look like tinker://<training_run_id>/<kind>/<name> "
                                       f"with kind one of {', '.join(KIND_TO_TYPE)}")
        return cls(parts[0], parts[1], validate_name(parts[2], what))

    @classmethod
    def from_checkpoint_id(cls, training_run_id: str, checkpoint_id: str, what: str = "checkpoint_id") -> TinkerPath:
        """'<kind>/<name>' as the REST routes take it; a bare name is ambiguous and rejected."""
        kind, sep, name = checkpoint_id.partition("/")
        if not sep or kind not in KIND_TO_TYPE:
            raise InvalidArgumentError(f"{what}: {checkpoint_id!r} must be '<kind>/<name>' with kind one of "
                                       f"{', '.join(KIND_TO_TYPE)} (e.g. 'weights/{checkpoint_id}')")
        return cls(training_run_id, kind, validate_name(name, what))
