"""run_choices: engine outputs driven into the choices of one HTTP request."""
import asyncio

from conftest import char_tokenizer
from loramux.engine.output import CoreOutput
from loramux.sampling_params import SamplingParams
from loramux.server.choices import new_choices, run_choices
from loramux.server.wire import AddRequest
from loramux.tokenizer import Tokenizer


class Queued:
    """An OutputStream whose outputs were all queued before anything was cancelled (as when the engine ran
    on while the front end found a stop string)."""

    def __init__(self, outputs):
        self.outputs, self.cancelled = list(outputs), []

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop(0)

    async def cancel(self, request_ids):
        self.cancelled += request_ids


def test_outputs_queued_after_a_stop_string_leave_the_choice_as_the_stop_string_ended_it():
    tokenizer = Tokenizer.from_pretrained(char_tokenizer())
    params = SamplingParams(max_tokens=8, stop=["cd"])
    requests = [AddRequest(f"r{i}", [1, 2], params, None) for i in range(2)]
    choices = new_choices(requests, tokenizer)
    ids = tokenizer.encode("abcdef")
    outputs = [CoreOutput("r0", ids[:4]), CoreOutput("r1", ids[:2]), CoreOutput("r0", ids[4:], "length"),
               CoreOutput("r1", ids[2:], "length")]
    stream = Queued(outputs)

    async def drive():
        return [(c.index, text) for c, text in [item async for item in run_choices(stream, choices)]]

    asyncio.run(drive())
    assert stream.cancelled == ["r0"]
    assert (choices[0].text, choices[0].finish_reason) == ("ab", "stop")
    assert (choices[1].text, choices[1].finish_reason) == ("ab", "stop")
