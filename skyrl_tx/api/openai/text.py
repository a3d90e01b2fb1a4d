"""Text ↔ tokens for the OpenAI-compatible endpoint: the base model's tokenizer (Rust `tokenizers`, no torch), its
chat template rendered with jinja2 as transformers renders it, and the detokenization of completions (stop
strings cut off, text deltas for streaming)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from skyrl_tx.api.openai.errors import invalid
from skyrl_tx.models.hf_config import load_decoder_config
from skyrl_tx.models.token_bytes import eos_token_ids, token_bytes_table


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' AssistantTracker marks assistant turns with it for
    training masks); rendering needs only its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API names its tags in a class attribute

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: not HTML-escaped, unlike jinja2's own
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    # The same environment options transformers' _compile_jinja_template uses
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization (applied where tokenizer_config.json asks for it)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class ModelText:
    """The served base model's tokenizer files, loaded once per server (every checkpoint shares its base's)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.chat_template = self._find_chat_template(model_dir)
        decoder = load_decoder_config(model_dir)
        self.eos_ids = set(eos_token_ids(model_dir, decoder.eos_token_ids))
        self.vocab_size = decoder.vocab_size
        self._bytes: list[bytes] | None = None  # every token's raw bytes: read when chat logprobs first ask
        self._template: jinja2.Template | None = None  # the chat template, compiled on first use
        # Older tokenizers (e.g. Llama 2's) ask transformers to tidy spaces before punctuation when decoding
        self._clean_up_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))

    def _find_chat_template(self, model_dir: Path) -> str | None:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not template and (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        return template or None

    # ---- prompts -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """A completion prompt, with the tokenizer's special tokens (a BOS where the model's tokenizer adds one), as
        transformers' tokenizer(text) and vLLM do."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    extra: dict[str, Any]) -> str:
        if self.chat_template is None:
            raise invalid("this model's tokenizer has no chat template; use /completions with a formatted prompt",
                          "messages")
        special = {name: _token_content(self.config.get(name)) for name in
                   ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}
        context = {**{k: v for k, v in special.items() if v is not None}, **extra, "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        try:
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
            return self._template.render(**context)
        except jinja2.exceptions.TemplateError as exc:
            raise invalid(f"the chat template could not render these messages: {exc}", "messages") from None

    def encode_chat(self, rendered: str) -> list[int]:
        # the template wrote the special tokens (BOS included) itself: no second BOS (vLLM does the same)
        return self.tokenizer.encode(rendered, add_special_tokens=False).ids

    # ---- completions ---------------------------------------------------------------------------
    def decode(self, tokens: list[int]) -> str:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def token_bytes(self, token: int) -> list[int]:
        if self._bytes is None:
            self._bytes = token_bytes_table(self.model_dir, self.vocab_size) or []
        raw = self._bytes[token] if 0 <= token < len(self._bytes) else self.token_text(token).encode()
        return list(raw)

    def check_tokens(self, tokens: list[int], param: str) -> None:
        for token in tokens:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise invalid(f"{param}: token id {token!r} is outside the model's vocabulary [0, {self.vocab_size})",
                              param)


def cut_completion(text: ModelText, tokens: list[int], stop_reason: str, stop_strings: list[str],
                   stop_ids: set[int]) -> tuple[list[int], str, str]:
    """(tokens whose text is returned, text, finish_reason) of one sampled sequence. A trailing EOS or stop token is
    left out of the text (OpenAI never returns the stop sequence); a stop string is cut off with everything after
    it. The engine stops at the token completing a stop string, so its first occurrence is the one it stopped at."""
    if stop_reason != "stop":
        return tokens, text.decode(tokens), "length"
    if tokens and (tokens[-1] in text.eos_ids or tokens[-1] in stop_ids):
        kept = tokens[:-1]
        return kept, text.decode(kept), "stop"
    decoded = text.decode(tokens)
    cuts = [decoded.find(s) for s in stop_strings if s in decoded]
    if cuts:
        decoded = decoded[:min(cuts)]
    return tokens, decoded, "stop"


def text_deltas(text: ModelText, tokens: list[int], final: str) -> list[str]:
    """`final` split into one delta per token (the text that token adds), for streaming: prefixes are decoded
    token by token; a prefix ending in a partial UTF-8 character waits for the next token. The deltas join to
    exactly `final` (a cut stop string is never sent)."""
    deltas, sent = [], 0
    for i in range(len(tokens)):
        prefix = text.decode(tokens[: i + 1])
        end = sent if prefix.endswith("\ufffd") else min(len(prefix), len(final))
        end = max(end, sent)
        if i == len(tokens) - 1:
            end = len(final)
        deltas.append(final[sent:end])
        sent = end
    if not tokens and final:
        deltas.append(final)
    return deltas
