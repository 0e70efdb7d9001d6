"""Speculative decoding through the server (--speculative-config): completions, chat and streams on several
adapters give the tokens the engine gives without it, and /metrics counts proposals per adapter."""
import httpx
import openai
import pytest

from support.serving import metric, offline_llm, start_server
from loramux import SamplingParams

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPTS = ["abcabcabcabcab", "hello hello hello hel", "xyzxyzxyzxy"]


@pytest.fixture(scope="module")
def server(files):
    proc, url = start_server(files, "--speculative-config", SPEC)
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from support.serving import make_files

    return make_files(tmp_path_factory)


def test_answers_equal_the_engine_without_speculation_and_proposals_are_counted(server, files):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    llm = offline_llm(files, files["served"])
    names = ["s0", "tiny", "s3"]
    for prompt, name in zip(PROMPTS, names):
        expected = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                adapters=[None if name == "tiny" else name])[0]
        done = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == expected.text and done.usage.completion_tokens == 24
        streamed = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected.text
    assert metric(server, "loramux:spec_decode_num_drafts_total") > 0
    accepted = metric(server, "loramux:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= metric(server, "loramux:spec_decode_num_draft_tokens_total")
    text = httpx.get(f"{server}/metrics").text
    assert 'loramux:spec_decode_adapter_draft_tokens_total{adapter="s0"}' in text
