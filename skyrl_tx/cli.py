"""`skyrl-tx` command line: serve a base model, API keys, migrations, tiny presets. Settings are built once, here."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import InvalidArgumentError, NotFoundError, SkyrlTxError

log = logging.getLogger("skyrl_tx")

# Secret settings may come from these environment variables (or --X-file) instead of the command line.
DATABASE_URL_ENV = "SKYRL_TX_DATABASE_URL"
STORAGE_OPTIONS_ENV = "SKYRL_TX_CHECKPOINTS_STORAGE_OPTIONS"
SIGNING_SECRET_ENV = "SKYRL_TX_URL_SIGNING_SECRET"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-model", required=True,
                        help="a tiny preset (tiny-qwen3, tiny-qwen3-tied, tiny-llama3, tiny-qwen3-moe, "
                             "tiny-deepseek-v3, tiny-qwen3.5, tiny-qwen3.5-moe, tiny-qwen3-hd64), a local Hugging Face "
                             "model directory, or a hub id already in the HF cache")
    parser.add_argument("--model-alias", action="append", default=[], metavar="NAME",
                        help="another name clients may use for the base model (e.g. Qwen/Qwen3-8B); repeatable")
    parser.add_argument("--backend-config", default=None, metavar="JSON",
                        help=f"JSON object; keys: {', '.join(BackendSettings.valid_keys())}")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; an address other machines "
                             "can reach needs --auth keys)")
    parser.add_argument("--auth", choices=("keys", "none"), default=None,
                        help="keys: every request needs an API key (`skyrl-tx keys create`) and each key sees only "
                             "its own sessions, models and checkpoints; none: no key is checked (default, allowed "
                             "only when --host is a loopback address)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--public-url", default=None, metavar="URL",
                        help="the base URL clients reach this server at (e.g. behind a proxy); signed checkpoint "
                             "download URLs point there (default: http://<host>:<port>)")
    parser.add_argument("--session-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="unload the models of a session that sent no heartbeat for this long (default 300)")
    parser.add_argument("--long-poll-s", type=_long_poll_seconds, default=25.0, metavar="SECONDS",
                        help="how long retrieve_future waits for a result before answering try_again (default 25; "
                             "0.5-50, below the SDK's 60 s HTTP timeout; keep it below any proxy's idle timeout)")
    parser.add_argument("--sample-retrieve-futures", action="store_true",
                        help="ask SDK 0.38 clients to wait for samples with one retrieve_futures long poll per "
                             "sampling client (off by default: that SDK path can hang a client's close; README)")
    parser.add_argument("--database-url", default=None,
                        help="SQLAlchemy URL (default: SQLite under $SKYRL_TX_DATA_DIR or ~/.local/share/skyrl_tx). "
                             f"A URL with a password: pass it with --database-url-file or ${DATABASE_URL_ENV} "
                             "instead, since every user of the machine can read command lines (ps)")
    parser.add_argument("--database-url-file", default=None, metavar="PATH", help="a file holding --database-url")
    parser.add_argument("--checkpoints-base", default=None, metavar="URL",
                        help="where checkpoints are written: a local directory or an fsspec URL such as "
                             "s3://bucket/prefix (default: <data dir>/checkpoints)")
    parser.add_argument("--engine", choices=("process", "thread", "external"), default="process",
                        help="process (default): a child process the server restarts if it dies; thread: inside "
                             "the server process; external: run `skyrl-tx engine` yourself on the same database")
    parser.add_argument("--checkpoints-storage-options", default=None, metavar="JSON",
                        help='fsspec options for --checkpoints-base, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'; '
                             f'with credentials use --checkpoints-storage-options-file or ${STORAGE_OPTIONS_ENV}')
    parser.add_argument("--checkpoints-storage-options-file", default=None, metavar="PATH",
                        help="a file holding --checkpoints-storage-options")
    parser.add_argument("--url-signing-secret", default=None, metavar="SECRET",
                        help=f"signs checkpoint download URLs (at least 16 characters; better: "
                             f"--url-signing-secret-file or ${SIGNING_SECRET_ENV}); default: a random secret kept in "
                             "<data dir>/url_signing_secret (mode 0600), so issued URLs survive restarts; replicas "
                             "behind one address need the same one")
    parser.add_argument("--url-signing-secret-file", default=None, metavar="PATH",
                        help="a file holding --url-signing-secret")
    parser.add_argument("--external-inference-url", default=None, metavar="URL",
                        help="sample with a vLLM server at URL (e.g. http://127.0.0.1:8001) instead of the built-in "
                             "sampler; LoRA sampler weights are loaded into it at run time (README: vLLM as the "
                             "sampling engine)")


def _json_object(text: str | None, flag: str) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{flag}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{flag}: must be a JSON object")
    return value


def secret_option(args: argparse.Namespace, name: str, env: str) -> str | None:
    """--NAME, else the contents of --NAME-file, else $ENV: secrets given by file or environment stay off the
    command line, which `ps` shows to every user of the machine."""
    flag = "--" + name.replace("_", "-")
    if getattr(args, name, None):
        return getattr(args, name)
    path = getattr(args, f"{name}_file", None)
    if path:
        try:
            value = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(f"{flag}-file: cannot read {path} ({exc})") from exc
        if not value:
            raise InvalidArgumentError(f"{flag}-file: {path} is empty; write the value of {flag} into it")
        return value
    return os.environ.get(env) or None


def _long_poll_seconds(text: str) -> float:
    """--long-poll-s: a number of seconds in [0.5, 50] (the SDK's own 60 s HTTP timeout bounds the top)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0.5 <= value <= 50.0:
        raise argparse.ArgumentTypeError(f"must be between 0.5 and 50 seconds, got {value:g}")
    return value


def server_settings(args: argparse.Namespace):
    from skyrl_tx.config import ServerSettings

    storage_options = secret_option(args, "checkpoints_storage_options", STORAGE_OPTIONS_ENV)
    return ServerSettings(base_model=args.base_model, model_aliases=tuple(args.model_alias), host=args.host,
                          port=args.port, database_url=secret_option(args, "database_url", DATABASE_URL_ENV),
                          backend=BackendSettings.from_json(args.backend_config),
                          session_timeout_s=args.session_timeout, long_poll_s=getattr(args, "long_poll_s", 25.0),
                          checkpoints_base=args.checkpoints_base,
                          checkpoints_storage_options=_json_object(storage_options, "--checkpoints-storage-options"),
                          engine=getattr(args, "engine", "process"), public_url=getattr(args, "public_url", None),
                          url_signing_secret=secret_option(args, "url_signing_secret", SIGNING_SECRET_ENV),
                          auth=getattr(args, "auth", None) or "none",
                          external_inference_url=getattr(args, "external_inference_url", None),
                          sample_retrieve_futures=getattr(args, "sample_retrieve_futures", False))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from skyrl_tx.api.app import create_app
    from skyrl_tx.models.checkpoint import resolve_model_path
    from skyrl_tx.models.hf_config import load_decoder_config

    settings = server_settings(args)
    settings.validate()  # before loading anything: e.g. a non-loopback --host without --auth keys stops here
    model_dir = resolve_model_path(args.base_model)
    app = create_app(settings, model_dir, load_decoder_config(model_dir).architecture)
    log.info("listening on http://%s:%d (API reference: http://%s:%d/docs)", args.host, args.port, args.host,
             args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def engine(args: argparse.Namespace) -> int:
    """A standalone engine for a server started with --engine external (same database and checkpoints)."""
    import threading

    from skyrl_tx.checkpoints.store import default_checkpoints_base
    from skyrl_tx.db import migrate
    from skyrl_tx.db.session import default_database_url
    from skyrl_tx.engine.settings import EngineSettings
    from skyrl_tx.models.checkpoint import resolve_model_path

    settings = server_settings(args)
    database_url = settings.database_url or default_database_url()
    migrate.upgrade(database_url)
    engine_settings = EngineSettings.for_server(settings, resolve_model_path(args.base_model), database_url,
                                                settings.checkpoints_base or default_checkpoints_base())
    stop, wake = threading.Event(), threading.Event()
    try:
        engine_settings.run(stop, wake, notify=lambda outcomes: None, on_ready=lambda: log.info("engine ready"))
    except KeyboardInterrupt:
        stop.set()
    return 0


def generate_preset(args: argparse.Namespace) -> int:
    from skyrl_tx.models.tiny_presets import resolve_preset

    path = resolve_preset(args.name)
    if path is None:
        from skyrl_tx.models.tiny_presets import PRESETS

        raise NotFoundError(f"unknown preset {args.name!r}; known: {', '.join(sorted(PRESETS))}")
    print(path)
    return 0


# --- skyrl-tx db: schema migrations (skyrl_tx.db.migrate) -------------------------------------------------


def database_url_from(args: argparse.Namespace) -> str:
    """--database-url, else $SKYRL_TX_DATABASE_URL, else SQLite in the data directory ($SKYRL_TX_DATA_DIR)."""
    if args.database_url:
        return args.database_url
    if os.environ.get(DATABASE_URL_ENV):
        return os.environ[DATABASE_URL_ENV]
    from skyrl_tx.db.session import default_database_url

    return default_database_url()


def _shown(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def db_command(args: argparse.Namespace) -> int:
    """Runs one `db` subcommand; migration and connection failures are reported in one line, exit 2."""
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # else a line per plugin at import
    from alembic.util import CommandError
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from skyrl_tx.db import migrate

    try:
        if args.db_command == "revision":
            url = args.database_url or None
            path = migrate.revision(args.message, autogenerate=args.autogenerate, url=url)
            log.info("wrote %s: review it (autogenerate misses renames and server defaults)", path)
            return 0
        url = database_url_from(args)
        if args.db_command == "upgrade":
            migrate.upgrade(url, args.revision)
            log.info("database %s is at revision %s", _shown(url), migrate.current(url))
        elif args.db_command == "downgrade":
            migrate.downgrade(url, args.revision)
            log.info("database %s is at revision %s", _shown(url), migrate.current(url) or "base (empty)")
        elif args.db_command == "current":
            rev = migrate.current(url)
            head = migrate.head()
            print(f"{rev or 'base'}{' (head)' if rev == head else f' (head is {head})'}")
        return 0
    except (CommandError, ArgumentError, RuntimeError, FileNotFoundError) as exc:
        log.error("db %s: %s", args.db_command, exc)
    except SQLAlchemyError as exc:
        cause = getattr(exc, "orig", None) or exc
        log.error("db %s: database error (%s): %s", args.db_command, type(cause).__name__, str(cause).strip())
    return 2


# --- skyrl-tx keys: API keys (skyrl_tx.keys) ---------------------------------------------------------------


def _quota(value: int | None) -> str:
    return "-" if value is None else str(value)


def keys_command(args: argparse.Namespace) -> int:
    """Runs one `keys` subcommand on the server's database (same defaults as `serve`)."""
    logging.getLogger("alembic").setLevel(logging.WARNING)  # the schema is brought up to date quietly
    from skyrl_tx import keys

    url = secret_option(args, "database_url", DATABASE_URL_ENV) or database_url_from(args)
    if args.keys_command == "create":
        key, info = keys.create_key(url, args.name, admin=args.admin, max_live_models=args.max_live_models,
                                    max_inflight_requests=args.max_inflight_requests)
        print(key)  # alone on stdout, for scripts: KEY=$(skyrl-tx keys create --name ...)
        log.info("created API key %r (id %s%s): it is shown only this once and stored hashed; give it to its user "
                 "as TINKER_API_KEY (the server must run with --auth keys on this database: %s)", info.name, info.id,
                 ", admin" if info.admin else "", _shown(url))
    elif args.keys_command == "list":
        rows = [("ID", "NAME", "PREFIX", "ADMIN", "MAX_MODELS", "MAX_INFLIGHT", "CREATED", "REVOKED")]
        for k in keys.list_keys(url):
            rows.append((k.id, k.name, k.key_prefix + "...", "yes" if k.admin else "no", _quota(k.max_live_models),
                         _quota(k.max_inflight_requests), k.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                         k.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if k.revoked_at else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    elif args.keys_command == "revoke":
        info = keys.revoke_key(url, args.key)
        log.info("revoked API key %r (id %s): its next request gets 401 (within a second); its sessions stop "
                 "heartbeating, so their models unload after the server's --session-timeout", info.name, info.id)
    return 0


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    keys_parser = sub.add_parser("keys", help="API keys of a server started with --auth keys")
    keys_sub = keys_parser.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="make a key; prints it once (it is stored hashed)")
    create.add_argument("--name", required=True, help="unique name of the key (its user)")
    create.add_argument("--max-live-models", type=int, default=None, metavar="N",
                        help="at most N models (training clients) live at once; more get 403 (default: no limit)")
    create.add_argument("--max-inflight-requests", type=int, default=None, metavar="N",
                        help="at most N requests queued or running at once; more get 429 (default: no limit)")
    create.add_argument("--admin", action="store_true", help="the key sees and acts on every key's objects")
    keys_sub.add_parser("list", help="list the keys (never the keys themselves)")
    revoke = keys_sub.add_parser("revoke", help="revoke a key: its next request gets 401")
    revoke.add_argument("key", metavar="NAME_OR_ID", help="the key's name or id, as `skyrl-tx keys list` shows them")
    for p in keys_sub.choices.values():
        p.add_argument("--database-url", default=None, help=f"the server's database (default ${DATABASE_URL_ENV}, "
                       "else sqlite in $SKYRL_TX_DATA_DIR or ~/.local/share/skyrl_tx, as for `serve`)")
        p.add_argument("--database-url-file", default=None, metavar="PATH", help="a file holding --database-url")
        p.set_defaults(func=keys_command)


def add_db_parser(sub: argparse._SubParsersAction) -> None:
    db_parser = sub.add_parser("db", help="database schema migrations (Alembic)")
    db_sub = db_parser.add_subparsers(dest="db_command", required=True)
    url_help = (f"SQLAlchemy URL (sqlite:///path.db, postgresql+psycopg://user:pw@host/db); default "
                f"${DATABASE_URL_ENV}, else sqlite in $SKYRL_TX_DATA_DIR or ~/.local/share/skyrl_tx")
    upgrade = db_sub.add_parser("upgrade", help="migrate the database to the newest schema (or REVISION)")
    upgrade.add_argument("revision", nargs="?", default="head", help="target revision (default head: the newest)")
    downgrade = db_sub.add_parser("downgrade", help="migrate the database down to REVISION (base: drop all)")
    downgrade.add_argument("revision", help="target revision, e.g. 0010; base drops every table")
    current = db_sub.add_parser("current", help="print the database's revision")
    revision = db_sub.add_parser("revision", help="write a new migration script (development)")
    revision.add_argument("-m", "--message", required=True, help="what the revision does (its file name's slug)")
    revision.add_argument("--autogenerate", action="store_true",
                          help="diff the models against the database (default: a scratch SQLite at head)")
    for p in (upgrade, downgrade, current, revision):
        p.add_argument("--database-url", default=None, help=url_help)
        p.set_defaults(func=db_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skyrl-tx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="load a base model and serve the Tinker API")
    add_serve_arguments(serve_parser)
    serve_parser.set_defaults(func=serve)
    preset_parser = sub.add_parser("preset", help="generate (or find) a tiny preset model; prints its directory")
    preset_parser.add_argument("name", help="a preset name, e.g. tiny-qwen3 (an unknown name lists the known ones)")
    preset_parser.set_defaults(func=generate_preset)
    engine_parser = sub.add_parser("engine", help="run only the engine, for a server started with --engine external")
    add_serve_arguments(engine_parser)
    engine_parser.set_defaults(func=engine)
    worker_parser = sub.add_parser("worker", help="run another node's data-parallel ranks for a server started with "
                                   "fully_sharded_data_parallel_size and num_processes > 1")
    worker_parser.add_argument("--coordinator-address", help="HOST:PORT of the engine's node (its backend-config "
                               "coordinator_address); default: MASTER_ADDR:MASTER_PORT")
    worker_parser.add_argument("--num-processes", type=int, help="node processes in all (the engine's included); "
                               "default: SLURM_NNODES, NNODES, or torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE")
    worker_parser.add_argument("--process-id", type=int, help="this node process: 1 .. N-1; default: GROUP_RANK "
                               "(torchrun), SLURM_NODEID or NODE_RANK")
    worker_parser.add_argument("--base-model", required=True, help="the server's base model (same checkpoint)")
    worker_parser.add_argument("--backend-config", default=None, help="the server's --backend-config JSON")
    worker_parser.set_defaults(func=worker)
    merge_parser = sub.add_parser("export-merged", help="merge a PEFT LoRA adapter directory (e.g. from `tinker "
                                  "checkpoint download`) into its base model; writes a Hugging Face model directory")
    merge_parser.add_argument("--base-model", required=True, help="preset name, local HF directory or cached hub id")
    merge_parser.add_argument("--adapter", required=True, help="directory with adapter_config.json and "
                              "adapter_model.safetensors")
    merge_parser.add_argument("--out", required=True, help="output directory (must not exist)")
    merge_parser.set_defaults(func=export_merged)
    add_db_parser(sub)
    add_keys_parser(sub)
    from skyrl_tx.plan.command import add_plan_parser  # torch-free: config.json and --backend-config only

    add_plan_parser(sub)
    return parser


def worker(args: argparse.Namespace) -> int:
    """Another node's ranks of a data-parallel engine (skyrl_tx/parallel/data_parallel_backend.py)."""
    import dataclasses

    from skyrl_tx.config import BackendSettings
    from skyrl_tx.models.checkpoint import resolve_model_path
    from skyrl_tx.parallel.data_parallel_backend import run_node_process
    from skyrl_tx.parallel.layout import node_process_from_env

    address, processes, process_id = node_process_from_env(dict(os.environ), args.coordinator_address,
                                                           args.num_processes, args.process_id)
    settings = BackendSettings.from_json(args.backend_config)
    settings = BackendSettings.from_dict({**dataclasses.asdict(settings), "coordinator_address": address,
                                          "num_processes": processes})
    return run_node_process(resolve_model_path(args.base_model), settings, process_id)


def export_merged(args: argparse.Namespace) -> int:
    from skyrl_tx.checkpoints.merge import merge_adapter
    from skyrl_tx.models.checkpoint import resolve_model_path

    modules = merge_adapter(resolve_model_path(args.base_model), args.adapter, args.out)
    log.info("merged %d adapted modules into %s", len(modules), args.out)
    print(args.out)
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "command", None) != "db":  # `skyrl-tx db` shows each migration step; the rest log one line
        logging.getLogger("alembic").setLevel(logging.WARNING)  # else a line per plugin at import and per step
    try:
        return args.func(args)
    except SkyrlTxError as exc:
        log.error("%s", exc.message)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
