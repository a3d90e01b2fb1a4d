"""The OpenAI-compatible endpoint through the real `openai` client against a live server: completions (text and
token ids), chat completions (the tokenizer's chat template, as transformers renders it), n with seeds, stop strings
and stop tokens, logprobs, streaming, /models, sampling a saved sampler checkpoint by its tinker:// path, OpenAI-shaped
errors; greedy results equal the Tinker SDK's sample of the same prompt and weights, token for token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tinker import types

BASE_MODEL = "tiny-qwen3"
PROMPT = [5, 17, 300, 42, 7, 99, 1000, 12]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name two animals."}]
API_KEY = "tml-test"
# A prompt sent a second time (SDK, then OpenAI route) is a prefix-cache hit: logprobs agree to float32 rounding.
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def server_options(tiny_model_dir: Any) -> dict[str, Any]:
    """The preset is generated here first (that needs torch), so the server process only loads it (as a server
    of a cached or local model does): test_the_api_process_tokenizes_without_torch checks that process."""
    tiny_model_dir(BASE_MODEL)
    return {}


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def base_sampler(service_client: Any) -> Any:
    return service_client.create_sampling_client(base_model=BASE_MODEL).result()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir(BASE_MODEL)))


def tinker_greedy(sampler: Any, tokens: list[int], max_tokens: int) -> Any:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    return sampler.sample(types.ModelInput.from_ints(tokens), 1, params).result().sequences[0]


def without_eos(seq: Any, eos: set[int]) -> tuple[list[int], list[float]]:
    """A Tinker sequence as OpenAI returns it: a final EOS is not part of the text (nor of the logprobs)."""
    tokens, logprobs = list(seq.tokens), list(seq.logprobs)
    if seq.stop_reason == "stop" and tokens and tokens[-1] in eos:
        return tokens[:-1], logprobs[:-1]
    return tokens, logprobs


def eos_ids(hf_tokenizer: Any) -> set[int]:
    return {hf_tokenizer.convert_tokens_to_ids("<|im_end|>"), hf_tokenizer.eos_token_id}


def test_greedy_completion_of_token_ids_equals_tinker_sample(client: openai.OpenAI, base_sampler: Any,
                                                             hf_tokenizer: Any) -> None:
    ours = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    tokens, logprobs = without_eos(tinker_greedy(base_sampler, PROMPT, 12), eos_ids(hf_tokenizer))
    (choice,) = ours.choices
    assert choice.text == hf_tokenizer.decode(tokens, skip_special_tokens=True)
    assert choice.logprobs.tokens == [hf_tokenizer.decode([t]) for t in tokens]
    assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    assert choice.finish_reason in ("stop", "length")
    assert ours.usage.prompt_tokens == len(PROMPT) and ours.usage.completion_tokens >= len(tokens)


def test_text_prompt_is_tokenized_as_transformers_does(client: openai.OpenAI, base_sampler: Any,
                                                       hf_tokenizer: Any) -> None:
    text = "What is 12 + 30? The answer is"
    ours = client.completions.create(model=BASE_MODEL, prompt=text, max_tokens=8, temperature=0)
    prompt = hf_tokenizer(text)["input_ids"]
    tokens, _ = without_eos(tinker_greedy(base_sampler, prompt, 8), eos_ids(hf_tokenizer))
    assert ours.choices[0].text == hf_tokenizer.decode(tokens, skip_special_tokens=True)
    assert ours.usage.prompt_tokens == len(prompt)


def test_a_list_of_prompts_gives_n_choices_each_in_order(client: openai.OpenAI) -> None:
    ours = client.completions.create(model=BASE_MODEL, prompt=[PROMPT, PROMPT[:4]], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in ours.choices] == [0, 1, 2, 3]
    texts = [c.text for c in ours.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the n choices of one prompt agree
    assert ours.usage.prompt_tokens == len(PROMPT) + 4


def test_greedy_chat_completion_equals_tinker_sample_of_the_chat_template(client: openai.OpenAI, base_sampler: Any,
                                                                          hf_tokenizer: Any) -> None:
    ours = client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                          logprobs=True)
    prompt = list(hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"])
    tokens, logprobs = without_eos(tinker_greedy(base_sampler, prompt, 10), eos_ids(hf_tokenizer))
    (choice,) = ours.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == hf_tokenizer.decode(tokens, skip_special_tokens=True)
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    assert [bytes(c.bytes).decode("utf-8", "replace") for c in choice.logprobs.content] == \
        [hf_tokenizer.decode([t]) for t in tokens]
    assert ours.usage.prompt_tokens == len(prompt)


def test_n_with_a_seed_is_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> list[str]:
        out = client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0,
                                             n=4, seed=seed)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        return [c.message.content for c in out.choices]

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert len(set(first)) > 1, "the 4 choices of one request are all identical"
    assert first != other


def test_stop_string_stops_and_is_left_out(client: openai.OpenAI) -> None:
    full = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
                                     stop=[]).choices[0]
    pieces = full.logprobs.tokens
    k = next(i for i in range(2, len(pieces)) if len(pieces[i].strip()) >= 2 and "\ufffd" not in pieces[i])
    stop = pieces[k].strip()
    expected = full.text[: full.text.find(stop)]
    cut = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == expected and stop not in cut.choices[0].text
    assert cut.usage.completion_tokens < 16  # it stopped, not ran to max_tokens


def test_stop_token_stops_and_is_left_out(client: openai.OpenAI, base_sampler: Any, hf_tokenizer: Any) -> None:
    tokens, _ = without_eos(tinker_greedy(base_sampler, PROMPT, 12), eos_ids(hf_tokenizer))
    assert len(tokens) >= 4
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    ours = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     stop=[stop_id])  # type: ignore[list-item]
    assert ours.choices[0].finish_reason == "stop"
    assert ours.choices[0].text == hf_tokenizer.decode(tokens[:first], skip_special_tokens=True)
    assert ours.usage.completion_tokens == first + 1  # the stop token was generated (and counted), not returned


def test_max_tokens_gives_length(client: openai.OpenAI) -> None:
    ours = client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_completion_tokens=3,
                                          temperature=1.0, seed=3, stop=["\x01never\x02"])
    # a sampled EOS could end it first: only a sequence of 3 tokens is a "length" one
    choice = ours.choices[0]
    assert (choice.finish_reason == "length") == (ours.usage.completion_tokens == 3)
    assert ours.usage.completion_tokens <= 3


def test_streaming_yields_the_same_text_chunk_by_chunk(client: openai.OpenAI, server_url: str) -> None:
    whole = client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1 and "".join(content) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    # the raw events: data: {...} lines, [DONE] last
    with httpx.Client(base_url=server_url, timeout=120) as raw:
        body = {"model": BASE_MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
        lines = [line for line in raw.post("/oai/api/v1/completions", json=body).text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
    plain = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert "".join(texts) == plain.choices[0].text


def test_stream_follows_the_decode_steps_and_joins_to_the_whole_answer(client: openai.OpenAI) -> None:
    """stream: true sends text as the engine decodes (api/openai/live.py): with n=2 the two choices' chunks
    interleave step by step (the finished-result path sends one choice after the other), stop strings are cut
    exactly as without streaming, and the chunks of each choice join to the non-streamed text."""
    args = {"model": BASE_MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 1.0, "seed": 123, "n": 2}
    for stop in (None, ["e", "at"]):
        whole = client.completions.create(**args, stop=stop)
        chunks = list(client.completions.create(**args, stop=stop, stream=True))
        order = [c.choices[0].index for c in chunks if c.choices and c.choices[0].text]
        for choice in whole.choices:
            streamed = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == choice.index)
            assert streamed == choice.text, (stop, choice.index)
            finish = [c.choices[0].finish_reason for c in chunks
                      if c.choices and c.choices[0].index == choice.index and c.choices[0].finish_reason]
            assert finish == [choice.finish_reason]
        if stop is None:
            assert all(len(c.text) > 10 for c in whole.choices), "short answers: the interleaving is not exercised"
            assert order != sorted(order), f"choices came one after the other, not per decode step: {order}"


def test_models_and_sampling_a_saved_checkpoint_by_its_tinker_path(client: openai.OpenAI, service_client: Any,
                                                                   hf_tokenizer: Any) -> None:
    trainer = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = trainer.save_weights_for_sampler("oai-ckpt").result().path
    assert path.startswith("tinker://") and "/sampler_weights/" in path
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == BASE_MODEL and path in ids
    assert client.models.retrieve(path).id == path and client.models.retrieve(BASE_MODEL).root == BASE_MODEL
    tuned = service_client.create_sampling_client(model_path=path).result()
    tokens, logprobs = without_eos(tinker_greedy(tuned, PROMPT, 10), eos_ids(hf_tokenizer))
    ours = client.completions.create(model=path, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=0)
    assert ours.choices[0].text == hf_tokenizer.decode(tokens, skip_special_tokens=True)
    assert ours.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    assert ours.model == path
    chat = client.chat.completions.create(model=path, messages=MESSAGES, max_tokens=8, temperature=0)
    prompt = list(hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"])
    tokens, _ = without_eos(tinker_greedy(tuned, prompt, 8), eos_ids(hf_tokenizer))
    assert chat.choices[0].message.content == hf_tokenizer.decode(tokens, skip_special_tokens=True)


def test_top_logprobs_are_the_tinker_top_k_of_the_same_sample(client: openai.OpenAI, base_sampler: Any,
                                                              hf_tokenizer: Any) -> None:
    """chat top_logprobs and completions logprobs=k carry the engine's topk_sample_logprobs: the same alternatives
    as Tinker's sample of the same tokens and seed, chosen token first (greedy), text and bytes per alternative."""
    chat = client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    prompt = list(hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"])
    params = types.SamplingParams(max_tokens=6, temperature=0.0, seed=0)
    want = base_sampler.sample(types.ModelInput.from_ints(prompt), 1, params, topk_sample_logprobs=3).result()
    content = chat.choices[0].logprobs.content
    assert content and len(content) <= len(want.sequences[0].topk_logprobs)
    for entry, alternatives in zip(content, want.sequences[0].topk_logprobs):
        assert [a.token for a in entry.top_logprobs] == [hf_tokenizer.decode([t]) for t, _ in alternatives]
        want_logprobs = [lp for _, lp in alternatives]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(want_logprobs, abs=LOGPROB_ATOL)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
    plain = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    tops = plain.choices[0].logprobs.top_logprobs
    assert tops is not None and all(len(t) == 2 for t in tops)
    for position, chosen in zip(tops, plain.choices[0].logprobs.token_logprobs):
        assert max(position.values()) == pytest.approx(chosen, abs=LOGPROB_ATOL)
    assert client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=2,
                                     logprobs=0).choices[0].logprobs.top_logprobs is None


def test_refusals_are_openai_shaped_and_name_the_field(client: openai.OpenAI, server_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert missing.value.body["param"] == "model" and missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tinker://nope:train:0/sampler_weights/x", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    cases = [({"frequency_penalty": 0.5}, "frequency_penalty"), ({"extra_body": {"mirostat": 1}}, "mirostat"),
             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
             ({"temperature": -1}, "temperature"),
             ({"n": 0}, "n"), ({"n": 17}, "n")]  # 17: above max_sampling_sequences (16)
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=2, **fields)
        error = refused.value.body
        assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]
    with pytest.raises(openai.BadRequestError) as top:
        client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=2, logprobs=6)  # OpenAI's limit: 5
    assert top.value.body["param"] == "logprobs"
    raw = httpx.post(f"{server_url}/oai/api/v1/completions", json={"model": BASE_MODEL, "prompt": PROMPT,
                                                                  "echo": True}, timeout=60)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "echo"


def test_the_api_process_tokenizes_without_torch(client: openai.OpenAI, server_url: Any) -> None:
    """Text in and out (tokenizer, chat template) runs in the API process, which never maps libtorch (the engine
    child does): checked on the live server's own memory map after a chat completion."""
    maps = Path(f"/proc/{server_url.process.pid}/maps")
    if not maps.is_file():
        pytest.skip("needs Linux /proc")
    client.chat.completions.create(model=BASE_MODEL, messages=MESSAGES, max_tokens=2, logprobs=True)
    mapped = maps.read_text()
    assert "tokenizers" in mapped  # the check can fail: the Rust tokenizer is loaded there
    assert "libtorch" not in mapped and "skyrl_tx/_C" not in mapped


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama3"])
def test_chat_template_and_prompts_tokenize_as_transformers(tiny_model_dir: Any, preset: str) -> None:
    """The API's own rendering (jinja2, no transformers) gives transformers' prompt tokens, BOS handling included."""
    from transformers import AutoTokenizer

    from skyrl_tx.api.openai.text import ModelText

    model_dir = tiny_model_dir(preset)
    ours, hf = ModelText(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    for generation_prompt in (True, False):
        rendered = ours.render_chat(MESSAGES, generation_prompt, {})
        assert rendered == hf.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt, tokenize=False)
        expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt, tokenize=True,
                                          return_dict=True)["input_ids"]
        assert ours.encode_chat(rendered) == list(expected)
    text = "What is 12 + 30? The answer is"
    assert ours.encode(text) == hf(text)["input_ids"]
    tokens = hf(text + " 42.")["input_ids"]
    assert ours.decode(tokens) == hf.decode(tokens, skip_special_tokens=True)


def test_seeded_sampling_equals_tinker_sample_with_the_same_seed(client: openai.OpenAI, base_sampler: Any,
                                                                 hf_tokenizer: Any) -> None:
    """Not only greedy: n sequences at temperature 1 with a seed are Tinker's num_samples with that seed."""
    params = types.SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=99)
    theirs = base_sampler.sample(types.ModelInput.from_ints(PROMPT), 3, params).result().sequences
    ours = client.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0.9,
                                     seed=99, n=3, logprobs=0)
    eos = eos_ids(hf_tokenizer)
    for seq, choice in zip(theirs, ours.choices, strict=True):
        tokens, logprobs = without_eos(seq, eos)
        assert choice.text == hf_tokenizer.decode(tokens, skip_special_tokens=True)
        assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=LOGPROB_ATOL)


def test_openai_and_tinker_requests_share_the_batch_without_mixing_up(client: openai.OpenAI, base_sampler: Any,
                                                                      hf_tokenizer: Any) -> None:
    """OpenAI and Tinker requests in flight together (one continuous batch in the engine) each get their own
    sequence: every concurrent answer equals the one each gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [PROMPT, PROMPT[:5], [7, 8, 9, 10], PROMPT[::-1]]
    alone = [client.completions.create(model=BASE_MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text
             for p in prompts]
    eos = eos_ids(hf_tokenizer)
    with ThreadPoolExecutor(8) as pool:
        ours = [pool.submit(client.completions.create, model=BASE_MODEL, prompt=p, max_tokens=10, temperature=0)
                for p in prompts]
        theirs = [pool.submit(tinker_greedy, base_sampler, p, 10) for p in prompts]
        assert [f.result().choices[0].text for f in ours] == alone
        assert [hf_tokenizer.decode(without_eos(f.result(), eos)[0], skip_special_tokens=True) for f in theirs] == alone


def test_stream_deltas_join_to_the_text_through_multibyte_characters(tiny_model_dir: Any) -> None:
    """Byte-level tokens split UTF-8 characters: a delta never carries half of one, and the deltas of a completion
    cut at a stop string join to exactly the cut text."""
    from skyrl_tx.api.openai.text import ModelText, cut_completion, text_deltas

    text = ModelText(tiny_model_dir(BASE_MODEL))
    sentence = "Emoji: 😀 🎉 敏捷的棕色狐狸 café — done."
    tokens = text.encode(sentence)
    deltas = text_deltas(text, tokens, sentence)
    assert "".join(deltas) == sentence and len(deltas) == len(tokens)
    assert not any("\ufffd" in d for d in deltas)
    assert any(d == "" for d in deltas), "no token split a character: the case above is not exercised"
    kept, cut, reason = cut_completion(text, tokens, "stop", ["狐狸"], set())
    assert (cut, reason, kept) == ("Emoji: 😀 🎉 敏捷的棕色", "stop", tokens)
    assert "".join(text_deltas(text, kept, cut)) == cut
    assert cut_completion(text, tokens, "length", ["狐狸"], set())[1:] == (sentence, "length")


@pytest.fixture(scope="module")
def keyed_url(preset_cache: Any) -> Any:
    from keyed_server import keyed_server

    with keyed_server("sqlite", {"alice": {}, "bob": {}}) as url:
        yield url


def test_keys_see_only_their_own_checkpoints(keyed_url: Any) -> None:
    """Under --auth keys the endpoint takes the openai client's Bearer key; /models lists the caller's sampler
    checkpoints only, and another key's tinker:// path is an unknown model (404), as on the Tinker routes."""
    import tinker

    keys = keyed_url.keys
    alice, bob = (openai.OpenAI(base_url=f"{keyed_url}/oai/api/v1", api_key=keys[name], max_retries=0, timeout=120)
                  for name in ("alice", "bob"))
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="tml-not-a-key", max_retries=0).models.list()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        with tinker.ServiceClient(base_url=keyed_url, api_key=keys["alice"]) as service:
            trainer = service.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=6).result()
            path = trainer.save_weights_for_sampler("alice-oai").result().path
    assert path in [m.id for m in alice.models.list().data]
    assert path not in [m.id for m in bob.models.list().data]
    assert alice.completions.create(model=path, prompt=PROMPT, max_tokens=3, temperature=0).model == path
    with pytest.raises(openai.NotFoundError) as hidden:
        bob.completions.create(model=path, prompt=PROMPT, max_tokens=3, temperature=0)
    assert hidden.value.body["param"] == "model"
    assert bob.completions.create(model=BASE_MODEL, prompt=PROMPT, max_tokens=3).usage.prompt_tokens == len(PROMPT)
