"""The external engine's request mapping for SDK 0.38's sampling fields (needs no vLLM): fields vLLM cannot serve
are refused by name, never dropped; prompt_logprobs_last_n leaves the earlier positions unscored."""

from __future__ import annotations

import pytest

from skyrl_tx.engine.external_sampler import completion_body, sample_result
from skyrl_tx.errors import InvalidArgumentError
from skyrl_tx.types import SampleRequest, SamplingParams


@pytest.mark.parametrize("fields,name", [({"topk_sample_logprobs": 2}, "topk_sample_logprobs"),
                                         ({"prompt_alt_tokens_k": 1}, "prompt_alt_tokens_k"),
                                         ({"target_prompt_token_ids": [[1], [2]]}, "target_prompt_logprobs")])
def test_fields_vllm_cannot_serve_are_refused_by_name(fields: dict, name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{name} not available with the external inference engine"):
        completion_body(SampleRequest([1, 2, 3], SamplingParams(max_tokens=1), **fields), "m")


def test_prompt_logprobs_last_n_blanks_the_earlier_positions() -> None:
    request = SampleRequest([4, 5, 6, 7], SamplingParams(max_tokens=1), prompt_logprobs=True, topk_prompt_logprobs=1,
                            prompt_logprobs_last_n=2)
    assert completion_body(request, "m")["prompt_logprobs"] == 1
    entries = [None] + [{str(t): {"logprob": -float(t), "rank": 1}} for t in (5, 6, 7)]
    response = {"choices": [{"index": 0, "token_ids": [9], "logprobs": {"token_logprobs": [-1.5]},
                             "finish_reason": "length", "prompt_token_ids": [4, 5, 6, 7], "prompt_logprobs": entries}]}
    result = sample_result(response, request)
    assert result.prompt_logprobs == [None, None, -6.0, -7.0]
    assert result.topk_prompt_logprobs == [None, None, [(6, -6.0)], [(7, -7.0)]]
