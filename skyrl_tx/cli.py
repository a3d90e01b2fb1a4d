"""`skyrl-tx` command line: serve a base model, generate tiny presets. Settings are built once, here."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from skyrl_tx.config import BackendSettings
from skyrl_tx.errors import NotFoundError, SkyrlTxError

log = logging.getLogger("skyrl_tx")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-model", required=True,
                        help="a tiny preset (tiny-qwen3, tiny-qwen3-tied, tiny-llama3), a local Hugging Face "
                             "model directory, or a hub id already in the HF cache")
    parser.add_argument("--backend-config", default=None,
                        help=f"JSON object; keys: {', '.join(BackendSettings.valid_keys())}")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def serve(args: argparse.Namespace) -> int:
    from skyrl_tx.backend.native import NativeBackend

    settings = BackendSettings.from_json(args.backend_config)
    started = time.perf_counter()
    log.info("loading base model %s (dtype=%s, device=%s)", args.base_model, settings.dtype, settings.device)
    backend = NativeBackend.from_name(args.base_model, settings)
    cfg = backend.decoder_config
    log.info("model loaded: %s from %s (%d layers, hidden %d, vocab %d) in %.1fs", cfg.architecture,
             backend.model_dir, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, time.perf_counter() - started)
    log.info("ready: core loaded with %d LoRA slots (max rank %d)", settings.max_lora_adapters, settings.max_lora_rank)
    # NOTE: the HTTP API (issue 5) is not built yet; until then serving stops after the readiness check.
    log.info("the Tinker HTTP API is not implemented yet; would listen on http://%s:%d", args.host, args.port)
    return 0


def generate_preset(args: argparse.Namespace) -> int:
    from skyrl_tx.models.tiny_presets import resolve_preset

    path = resolve_preset(args.name)
    if path is None:
        from skyrl_tx.models.tiny_presets import PRESETS

        raise NotFoundError(f"unknown preset {args.name!r}; known: {', '.join(sorted(PRESETS))}")
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skyrl-tx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="load a base model and serve the Tinker API")
    add_serve_arguments(serve_parser)
    serve_parser.set_defaults(func=serve)
    preset_parser = sub.add_parser("preset", help="generate (or find) a tiny preset model; prints its directory")
    preset_parser.add_argument("name")
    preset_parser.set_defaults(func=generate_preset)
    return parser


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except SkyrlTxError as exc:
        log.error("%s", exc.message)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
