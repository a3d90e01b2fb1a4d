"""Helpers for the sampling tests: request builders, HF generate references, logprob references, training."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from skyrl_tx.types import AdamParams, Datum, SampledSequence, SampleRequest, SamplingParams, TrainRequest

# A tie between the two best logits closer than this may legitimately resolve differently in two float32
# implementations (different reduction orders); anything larger must give the same greedy token.
TIE_TOL = 1e-4


# ---- requests ---------------------------------------------------------------------------------------
def random_prompts(vocab: int, lengths: Sequence[int], seed: int, avoid: Sequence[int] = ()) -> list[list[int]]:
    """Random prompts of the given lengths; ids in `avoid` (EOS, specials) are replaced by 7."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        prompts.append([7 if t in avoid else t for t in ids])
    return prompts


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def greedy_requests(prompts: Sequence[Sequence[int]], max_tokens: int, weights_id: str = "") -> list[SampleRequest]:
    return [SampleRequest(list(p), greedy(max_tokens), weights_id=weights_id) for p in prompts]


def sample_one(backend, prompt: Sequence[int], params: SamplingParams, weights_id: str = "",
               num_samples: int = 1) -> list[SampledSequence]:
    (result,) = backend.sample([SampleRequest(list(prompt), params, num_samples=num_samples, weights_id=weights_id)])
    assert len(result.sequences) == num_samples
    return result.sequences


def run_continuous(backend, requests: Sequence[SampleRequest], max_steps: int = 10_000) -> tuple[dict, dict]:
    """submit_sample every request, then sample_step until all finish. Returns ({idx: result}, {idx: step})."""
    ids = {backend.submit_sample(r): i for i, r in enumerate(requests)}
    results, finished_at = {}, {}
    for step in range(1, max_steps + 1):
        for rid, result in backend.sample_step():
            assert rid in ids, f"sample_step returned unknown id {rid}"
            assert ids[rid] not in results, f"request {ids[rid]} returned twice"
            results[ids[rid]], finished_at[ids[rid]] = result, step
        if len(results) == len(requests):
            return results, finished_at
    raise AssertionError(f"only {len(results)} of {len(requests)} requests finished in {max_steps} steps")


# ---- references ---------------------------------------------------------------------------------------
def completion_logprobs(backend, prompt: Sequence[int], completion: Sequence[int], adapter: str = "") -> torch.Tensor:
    """log p(completion_i | prompt + completion_<i) through token_logprobs (the training-side forward)."""
    full = list(prompt) + list(completion)
    (lp,) = backend.token_logprobs([full[:-1]], [full[1:]], [adapter])
    return lp[len(prompt) - 1:]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int, eos: Sequence[int]) -> list[int]:
    """transformers generate(do_sample=False) on one unpadded prompt: the new tokens only."""
    ids = torch.tensor([list(prompt)])
    pad = getattr(model.config, "pad_token_id", None)
    pad = list(eos)[0] if pad is None else pad
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=list(eos), pad_token_id=pad,
                         temperature=None, top_p=None, top_k=None)
    new = out[0, len(prompt):].tolist()
    # generate pads finished rows; with one row it simply stops, but cut at the first EOS to be safe.
    for i, t in enumerate(new):
        if t in eos:
            return new[:i + 1]
    return new


@torch.no_grad()
def hf_next_logits(model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """[len, vocab] float32 logits; row t predicts token t + 1."""
    return model(input_ids=torch.tensor([list(tokens)])).logits[0].float()


def assert_greedy_matches(ours: Sequence[int], reference: Sequence[int], model: torch.nn.Module,
                          prompt: Sequence[int], what: str = "") -> int:
    """Token-exact comparison, except that a divergence is accepted at a genuine near-tie (top-2 logits of the
    reference model within TIE_TOL, our token being one of them); the comparison ends there. Returns the number
    of tokens compared."""
    n = min(len(ours), len(reference))
    for i in range(n):
        if ours[i] == reference[i]:
            continue
        logits = hf_next_logits(model, list(prompt) + list(reference[:i]))[-1]
        best = logits.max().item()
        gap = best - logits[ours[i]].item()
        assert gap <= TIE_TOL, (f"{what}: token {i}: ours {ours[i]} != reference {reference[i]} and our token's logit "
                                f"is {gap:.3g} below the best (not a tie); ours {list(ours)} "
                                f"reference {list(reference)}")
        return i
    assert len(ours) == len(reference), f"{what}: lengths differ: ours {list(ours)} reference {list(reference)}"
    return n


# ---- training ---------------------------------------------------------------------------------------
def random_lora_weights(backend, model_id: str, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """Random nonzero A and B for an existing adapter (a fresh adapter has B = 0 and equals the base)."""
    gen = torch.Generator().manual_seed(seed)
    state = backend.trainable_state(model_id)
    weights = {k: torch.randn(v.shape, generator=gen) * scale for k, v in state.items()}
    backend.set_adapter_weights(model_id, weights)
    return weights


def sft_datum(prompt: Sequence[int], completion: Sequence[int]) -> Datum:
    """cross_entropy datum that trains completion given prompt (weights 1 on the completion's targets)."""
    full = list(prompt) + list(completion)
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return Datum(full[:-1], {"target_tokens": full[1:], "weights": weights})


def train(backend, model_id: str, data: list[Datum], steps: int, lr: float) -> None:
    for _ in range(steps):
        backend.forward_backward([TrainRequest(model_id, data, "cross_entropy")])
        backend.optim_step(model_id, AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8))


def peft_from_state(model_dir, state: dict[str, torch.Tensor], *, rank: int, alpha: float,
                    target_modules: Sequence[str] | None = None) -> torch.nn.Module:
    """A PEFT LoRA model whose factors are `state` (adapter_state_dict / trainable_state); all linear layers
    unless target_modules says otherwise."""
    from hf_reference import ALL_LINEAR, load_hf_model
    from peft import LoraConfig, get_peft_model

    modules = list(target_modules or ALL_LINEAR)
    peft_model = get_peft_model(load_hf_model(model_dir), LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                                     target_modules=modules))
    params = {n.replace(".default", ""): p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert sorted(params) == sorted(state), f"names differ: {sorted(set(params) ^ set(state))[:6]}"
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name])
    return peft_model.eval()


def assert_same_sequences(actual: Sequence[SampledSequence], expected: Sequence[SampledSequence], what: str = "",
                          atol: float = 1e-5) -> None:
    """The same request sampled twice (alone / in another batch / later): same tokens, logprobs within atol.

    Float32 logits of one sequence differ by ~1e-6 between batch compositions, so two tokens whose probabilities
    tie to that precision may swap places in the sampler's order; a divergence is accepted only at such a tie
    (both chosen tokens' logprobs within atol), and the comparison ends there. Any other divergence fails."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} sequences != {len(expected)}"
    for s, (a, b) in enumerate(zip(actual, expected)):
        assert len(a.tokens) == len(a.logprobs) and len(b.tokens) == len(b.logprobs)
        n = min(len(a.tokens), len(b.tokens))
        for i in range(n):
            assert abs(a.logprobs[i] - b.logprobs[i]) <= atol, (
                f"{what} sample {s} token {i}: logprob {a.logprobs[i]} != {b.logprobs[i]} "
                f"(tokens {a.tokens[i]} / {b.tokens[i]}); {a.tokens} vs {b.tokens}")
            if a.tokens[i] != b.tokens[i]:
                break  # a genuine near-tie (checked just above): the streams legitimately part here
        else:
            assert a.tokens == b.tokens and a.stop_reason == b.stop_reason, f"{what} sample {s}: {a} != {b}"


def stop_string_case(tokenizer, tokens: list[int], min_cut: int = 1) -> tuple[str, int]:
    """A clean stop string spanning a token boundary in the second half of `tokens`, and the index of the first
    token whose decoded text completes it (at least `min_cut`)."""
    def text(n: int) -> str:
        return tokenizer.decode(tokens[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for j in range(len(tokens) // 2, len(tokens) - min_cut):
        before, upto = text(j), text(j + 1)
        if len(before) < 2 or len(upto) <= len(before) or not upto.startswith(before):
            continue
        s = upto[len(before) - 2:len(before) + 1]  # two characters of earlier tokens, one of token j
        if "\ufffd" in s or not s.strip():
            continue
        cut = next(i for i in range(len(tokens)) if s in text(i + 1))
        if cut >= min_cut:
            return s, cut
    raise AssertionError(f"no usable stop string in {text(len(tokens))!r}")
