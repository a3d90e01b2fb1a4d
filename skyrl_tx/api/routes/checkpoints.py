"""Checkpoint endpoints the server does not implement yet: a clear 400 instead of a bare 404 or a retry loop."""

from __future__ import annotations

from fastapi import APIRouter

from skyrl_tx.errors import InvalidArgumentError

router = APIRouter(prefix="/api/v1")

NOT_YET = ("checkpoints on disk (save_state / load_state / weights_info / training runs) are not implemented "
           "by this server yet; save_weights_for_sampler and save_weights_and_get_sampling_client work")


@router.post("/save_weights")
@router.post("/load_weights")
@router.post("/save_weights_external")
@router.post("/weights_info")
def not_implemented() -> None:
    # A 4xx: the SDK retries 5xx (and 501) for minutes, but raises a 400 to the caller at once.
    raise InvalidArgumentError(NOT_YET)
