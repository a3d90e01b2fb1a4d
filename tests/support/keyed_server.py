"""A live server with --auth keys and keys made beforehand on its database (SQLite file or a PostgreSQL schema), for
the key and ownership tests; service_clients() opens one SDK client per key; status_of() reads the HTTP status out
of whatever the SDK raised."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable

import pytest
from live_server import ServerUrl, live_server
from postgres import postgres_url_or_skip, schema_url

from skyrl_tx.keys import create_key


@contextmanager
def keyed_server(backend: str, keys: Mapping[str, Mapping[str, Any]], *, extra_args: Sequence[str] = (),
                 **options: Any) -> Iterator[ServerUrl]:
    """live_server(--auth keys) whose URL carries `.database_url` and `.keys` (name -> the key itself)."""
    with ExitStack() as stack:
        if backend == "sqlite":
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="skyrl_tx_keys_")))
            database_url = f"sqlite:///{directory / 'skyrl_tx.db'}"
        else:
            database_url = stack.enter_context(schema_url(postgres_url_or_skip(), prefix="skyrl_keys"))
        made = {name: create_key(database_url, name, **spec)[0] for name, spec in keys.items()}
        url = stack.enter_context(live_server(database_url=database_url, extra_args=["--auth", "keys", *extra_args],
                                              **options))
        url.database_url, url.keys = database_url, made
        yield url


@contextmanager
def service_clients(url: ServerUrl, **client_options: Any) -> Iterator[dict[str, Any]]:
    """One tinker.ServiceClient per key of a keyed_server (name -> client), telemetry off, closed at the end."""
    import tinker

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        with ExitStack() as stack:
            yield {name: stack.enter_context(tinker.ServiceClient(base_url=url, api_key=key, **client_options))
                   for name, key in url.keys.items()}


def status_of(call: Callable[[], Any]) -> int:
    """The HTTP status of the error `call` raises (the SDK's APIStatusError, possibly wrapped by a future)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - any wrapper; the status is what the test checks
        seen: Exception | None = exc
        while seen is not None:
            status = getattr(seen, "status_code", None)
            if isinstance(status, int):
                return status
            seen = seen.__cause__ or seen.__context__
        raise
    pytest.fail("the call succeeded; expected an HTTP error")
