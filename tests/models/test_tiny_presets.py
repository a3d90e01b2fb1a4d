"""Tests for the offline tokenizer builder and tiny random-weight model presets."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from skyrl_tx.models import tiny_presets
from skyrl_tx.models.tiny_presets import PRESETS, generate_model, resolve_preset

SPECIAL_TOKENS = {
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
}
THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
TRICKY = [
    "\n\n",
    "  leading spaces\tand tabs\n",
    "emoji 😀🎉👍🏽 ❤️ and CJK 敏捷的棕色狐狸 こんにちは 안녕",
    "math: 12 + 34 = 46, \\boxed{46}\n#### 46",
    "Ωmega ∑ ∫ café naïve \u200b zero-width \x00 nul",
    "",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\n there"}]


@pytest.fixture(scope="module")
def preset_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("presets")
    return {name: generate_model(name, root / name) for name in PRESETS}


def _family_dir(preset_dirs: dict[str, Path], family: str) -> Path:
    return next(preset_dirs[n] for n, p in PRESETS.items() if p.family == family)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_loads_and_matches_config(preset_dirs: dict[str, Path], name: str) -> None:
    preset, path = PRESETS[name], preset_dirs[name]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)

    assert type(model).__name__ == preset.architecture == config.architectures[0]
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(config, field) == getattr(preset, field)
    assert (config.num_key_value_heads, config.head_dim) == (preset.num_key_value_heads, preset.head_dim)
    assert config.tie_word_embeddings == preset.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == preset.rope_theta
    assert config.vocab_size >= len(tok) and config.vocab_size % 64 == 0
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (
        tok.eos_token_id,
        tok.pad_token_id,
        tok.bos_token_id,
    )
    assert model.generation_config.eos_token_id == tok.eos_token_id

    # Legacy keys keep the checkpoint readable by transformers 4.x and non-Python loaders.
    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_theta"] == preset.rope_theta and raw["rope_scaling"] == preset.rope_scaling
    if preset.rope_scaling:
        assert config.rope_parameters["rope_type"] == preset.rope_scaling["rope_type"]  # llama3, or yarn (DeepSeek)
        assert config.rope_parameters["factor"] == preset.rope_scaling["factor"]

    tensors = load_file(path / "model.safetensors")
    assert ("lm_head.weight" in tensors) == (not preset.tie_word_embeddings)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    norm = tensors["model.norm.weight"]
    centre = 0.0 if preset.architecture.startswith("Qwen3_5") else 1.0  # Qwen3.5's norms scale by (1 + weight)
    assert not torch.allclose(norm, torch.full_like(norm, centre)) and abs(norm.mean().item() - centre) < 0.1

    ids = tok("hello world", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_special_tokens_are_single_ids(preset_dirs: dict[str, Path], family: str) -> None:
    path = _family_dir(preset_dirs, family)
    tok = AutoTokenizer.from_pretrained(path)
    split_tok = AutoTokenizer.from_pretrained(path, split_special_tokens=True)
    for token in SPECIAL_TOKENS[family]:
        assert tok.encode(token, add_special_tokens=False) == [tok.convert_tokens_to_ids(token)]
        assert token in tok.all_special_tokens
        # Special tokens in user content must be splittable, so they cannot be injected.
        assert len(split_tok.encode(token, add_special_tokens=False)) > 1
    if family == "qwen3":
        for token in THINK_TOKENS:
            assert token not in tok.all_special_tokens
            assert tok.encode(token, add_special_tokens=False) == [tok.convert_tokens_to_ids(token)]
            assert split_tok.encode(token, add_special_tokens=False) == [tok.convert_tokens_to_ids(token)]
        assert tok.decode(tok.encode("<think>x</think>"), skip_special_tokens=True) == "<think>x</think>"


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_unicode_round_trip(preset_dirs: dict[str, Path], family: str) -> None:
    tok = AutoTokenizer.from_pretrained(_family_dir(preset_dirs, family))
    for text in TRICKY:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert len(tok.encode("the answer is", add_special_tokens=False)) < len("the answer is")  # merges were learned


def test_chat_templates(preset_dirs: dict[str, Path]) -> None:
    qwen = AutoTokenizer.from_pretrained(_family_dir(preset_dirs, "qwen3"))
    assert qwen.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\n there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen.bos_token is None and qwen.eos_token == "<|im_end|>" and qwen.pad_token == "<|endoftext|>"
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)

    llama = AutoTokenizer.from_pretrained(_family_dir(preset_dirs, "llama3"))
    rendered = llama.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi\n there<|eot_id|>"
    )
    prompt = llama.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == rendered + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert (llama.bos_token, llama.eos_token, llama.pad_token) == (
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
    )
    # Like the real Llama 3 tokenizer, plain encoding prepends BOS exactly once.
    assert llama.encode("hi") == [llama.bos_token_id] + llama.encode("hi", add_special_tokens=False)


def test_generation_is_deterministic(tmp_path: Path) -> None:
    a = generate_model("tiny-qwen3", tmp_path / "a")
    b = generate_model("tiny-qwen3", tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # A different seed must actually change the weights.
    c = generate_model("tiny-qwen3", tmp_path / "c", seed=123)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_multi_shard(tmp_path: Path, preset_dirs: dict[str, Path]) -> None:
    path = generate_model("tiny-qwen3", tmp_path / "sharded", max_shard_size="200KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    reference = load_file(preset_dirs["tiny-qwen3"] / "model.safetensors")
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(path / shard, framework="pt") as f:
            merged.update({k: f.get_tensor(k) for k in f.keys()})
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k]) for k in reference)


def test_generate_refuses_non_empty_out_dir(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        generate_model("tiny-qwen3", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # temp dir cleaned up
    (tmp_path / "empty").mkdir()
    assert generate_model("tiny-qwen3", tmp_path / "empty") == tmp_path / "empty"  # an empty dir is fine


def test_resolve_preset_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYRL_TX_CACHE_DIR", str(tmp_path))
    assert resolve_preset("no-such-preset") is None
    path = resolve_preset("tiny-llama3")
    assert path == tmp_path / "models" / f"tiny-llama3-v{tiny_presets.GENERATOR_VERSION}"
    assert (path / "model.safetensors").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns

    def fail(*args: object, **kwargs: object) -> Path:
        raise AssertionError("cached preset was regenerated")

    monkeypatch.setattr(tiny_presets, "generate_model", fail)
    assert resolve_preset("tiny-llama3") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_root_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SKYRL_TX_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tiny_presets.preset_cache_dir("tiny-qwen3") == (
        tmp_path / ".cache" / "skyrl_tx" / "models" / f"tiny-qwen3-v{tiny_presets.GENERATOR_VERSION}"
    )
    assert len({hash(p) for p in PRESETS.values()}) == len(PRESETS)


def test_resolve_preset_concurrent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYRL_TX_CACHE_DIR", str(tmp_path))
    results: list[Path | None] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_preset("tiny-qwen3-tied"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and results[0] is not None
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_presets.main(["tiny-qwen3", "--out", str(tmp_path / "cli")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "config.json").is_file()
