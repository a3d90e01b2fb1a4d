"""Owns the offline byte-level BPE tokenizer: deterministic in-code corpus, training, and HF-format saving."""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

Family = Literal["qwen3", "llama3"]
FAMILIES: tuple[Family, ...] = ("qwen3", "llama3")

CORPUS_SEED = 1234

# Common English words; sentences, chat turns and Pig Latin are all derived from this list.
_WORDS = """
the of and to in is that it for was on are as with his they at be this from have or by one had not but what all
were when we there can an your which their said if do will each about how up out them then she many some so these
would other into has more her two like him see time could no make than first been its who now people my made over
did down only way find use may water long little very after words called just where most know get through back much
go good new write our me man too any day same right look think also around another came come work three word must
because does part even place well such here take why things help put years different away again off went old number
great tell men say small every found still between name should home big give air line set own under read last never
us left end along while might next sound below saw something thought both few those always looked show large often
together asked house world going want school important until form food keep children feet land side without boy once
animals life enough took sometimes four head above kind began almost live page got earth need far hand high year
mother light parts country father let night following picture being study second eyes soon times story boys since
white days ever paper hard near sentence better best across during today others however sure means knew try told
young miles sun ways thing whole hear example heard several change answer room sea against top turned learn point
city play toward five using himself usually model train token reward policy gradient sample loss batch step learning
rate optimizer weight adapter rank alpha checkpoint server client request response future result error value
""".split()

_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil Trent".split()

_CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x: float, y: float) -> None:\n        self.x = x\n        self.y = y\n",
    "import torch\n\nx = torch.randn(4, 8)\ny = x @ x.T\nprint(y.shape)\n",
    'if __name__ == "__main__":\n    main()\n',
    "with open(path) as f:\n    data = json.load(f)\n",
    "int main(int argc, char** argv) {\n  std::vector<int> v{1, 2, 3};\n  return 0;\n}\n",
    "fn main() {\n    let xs: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", xs);\n}\n",
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name;\n",
    '{"role": "user", "content": "hello"}\n',
    "try:\n    result = compute(x)\nexcept ValueError as e:\n    raise RuntimeError(str(e)) from e\n",
]

# Non-ASCII text so the merges cover multi-byte UTF-8 sequences, not just the raw byte alphabet.
_MULTILINGUAL = [
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "El rápido zorro marrón salta sobre el perro perezoso. ¿Qué tal? ¡Muy bien!",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。你好，世界！",
    "素早い茶色の狐がのろまな犬を飛び越える。こんにちは世界。",
    "빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요.",
    "الثعلب البني السريع يقفز فوق الكلب الكسول.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️ ✅ — “quotes” and ‘apostrophes’ … café naïve façade",
]


def _pig_latin(word: str) -> str:
    vowels = "aeiou"
    for i, ch in enumerate(word):
        if ch in vowels:
            return word[i:] + word[:i] + ("way" if i == 0 else "ay")
    return word + "ay"


def _sentence(rng: random.Random, lo: int = 4, hi: int = 14) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!", ","])


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice(["+", "-", "*"])
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return rng.choice(
        [
            f"{a} {op} {b} = {result}",
            f"What is {a} {op} {b}? The answer is \\boxed{{{result}}}.",
            f"{_NAMES[a % len(_NAMES)]} has {a} apples and gets {b} more.\n#### {a + b}",
        ]
    )


def build_corpus(seed: int = CORPUS_SEED, n_lines: int = 6000) -> list[str]:
    """Deterministic training corpus (seeded `random.Random`: fixed per Python version, stable across CPython 3.x)."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 8
        if kind == 0:
            lines.append(" ".join(_pig_latin(rng.choice(_WORDS)) for _ in range(rng.randint(3, 10))))
        elif kind == 1:
            lines.append(_arithmetic(rng))
        elif kind == 2:
            role = rng.choice(["System", "User", "Assistant"])
            lines.append(f"{role}: {_sentence(rng)}\n\nAssistant: {_sentence(rng)}")
        elif kind == 3:
            lines.append(_CODE[i // 8 % len(_CODE)] + f"def f_{i}(x):\n    return x * {i % 97}\n")
        elif kind == 4:
            lines.append(_MULTILINGUAL[i // 8 % len(_MULTILINGUAL)])
        else:
            lines.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 4))))
    return lines


@functools.lru_cache(maxsize=4)
def _trained_bpe_json(vocab_size: int) -> str:
    # Training is family-independent (special tokens are appended afterwards), so cache it per vocab size.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    return tok.to_str()


_QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Per family: special tokens, non-special added tokens, named special-token roles, chat template.
_FAMILY_SPECS: dict[str, dict[str, Any]] = {
    "qwen3": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<tool_call>", "</tool_call>", "<think>", "</think>"],
        "roles": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "chat_template": _QWEN3_TEMPLATE,
    },
    "llama3": {
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|finetune_right_pad_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "added": [],
        "roles": {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "pad_token": "<|finetune_right_pad_id|>",
        },
        "chat_template": _LLAMA3_TEMPLATE,
    },
}


def build_tokenizer(family: Family, vocab_size: int = 2048) -> Tokenizer:
    """Trained BPE plus the family's added tokens and post-processor (Llama 3 prepends BOS like the real one)."""
    if family not in _FAMILY_SPECS:
        raise ValueError(f"unknown tokenizer family {family!r}; expected one of {FAMILIES}")
    spec = _FAMILY_SPECS[family]
    tok = Tokenizer.from_str(_trained_bpe_json(vocab_size))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos = spec["roles"]["bos_token"]
    if bos is None:
        tok.post_processor = byte_level
    else:
        bos_id = tok.token_to_id(bos)
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    return tok


def special_token_ids(tok: Tokenizer, family: Family) -> dict[str, int | None]:
    """`bos_token_id` / `eos_token_id` / `pad_token_id` of a tokenizer built for `family` (None where unset)."""
    roles = _FAMILY_SPECS[family]["roles"]
    return {f"{role}_id": None if roles[role] is None else tok.token_to_id(roles[role]) for role in roles}


def _added_token_entry(content: str, special: bool) -> dict[str, Any]:
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {"content": content, **flags, "special": special}


def save_hf_tokenizer(
    out_dir: str | os.PathLike[str], family: Family, vocab_size: int = 2048, model_max_length: int = 4096
) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; loadable by transformers 4.x and 5.x."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = _FAMILY_SPECS[family]
    tok = build_tokenizer(family, vocab_size)
    tok.save(str(out / "tokenizer.json"), pretty=True)

    added = [(t, True) for t in spec["special"]] + [(t, False) for t in spec["added"]]
    roles: dict[str, Any] = {k: v for k, v in spec["roles"].items() if v is not None}
    # Listing the unnamed specials makes `all_special_ids` complete (transformers 5 maps this to extra_special_tokens).
    roles["additional_special_tokens"] = [t for t in spec["special"] if t not in roles.values()]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Explicit so older transformers versions do not rewrite " ." etc. on decode (breaks round-trips).
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": spec["chat_template"],
        "added_tokens_decoder": {str(tok.token_to_id(t)): _added_token_entry(t, s) for t, s in added},
        **spec["roles"],
        "unk_token": None,
        "additional_special_tokens": roles["additional_special_tokens"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(roles, indent=2) + "\n")
    return tok
