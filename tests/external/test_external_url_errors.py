"""--external-inference-url without a server behind it: the server stops at start-up and says why (runs in CI,
needs no vLLM)."""

from __future__ import annotations

import pytest
from live_server import free_port, live_server


def test_unreachable_inference_server_stops_the_server_with_the_reason(preset_cache) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RuntimeError, match=r"--external-inference-url http://127\.0\.0\.1:\d+: no vLLM answers there"), \
            live_server(base_model="tiny-qwen3", extra_args=["--external-inference-url", url]):
        pass
