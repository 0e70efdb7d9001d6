"""run_choices over an OutputStream: engine outputs driven into the choices of one HTTP request."""
import asyncio

from conftest import char_tokenizer
from loramux.engine.output import CoreOutput
from loramux.sampling_params import SamplingParams
from loramux.server.http.choices import new_choices, run_choices
from loramux.server.engine.engine_client import OutputStream
from loramux.server.engine.wire import AddRequest
from loramux.tokenizer import Tokenizer


class Client:
    """The EngineClient side an OutputStream talks to: its routing table, and aborts."""

    def __init__(self):
        self._streams, self.aborted = {}, []

    async def abort(self, request_ids):
        self.aborted += request_ids


def test_outputs_queued_before_a_stop_string_ended_a_choice_leave_it_as_the_stop_string_ended_it():
    """n = 2: a stop string ends choice 0 while the engine's later outputs for it are queued already (the
    stream stays open for choice 1); and choice 1 meets the stop string in its last tokens."""
    tokenizer = Tokenizer.from_pretrained(char_tokenizer())
    params = SamplingParams(max_tokens=8, stop=["cd"])
    requests = [AddRequest(f"r{i}", [1, 2], params, None) for i in range(2)]
    choices = new_choices(requests, tokenizer)
    ids = tokenizer.encode("abcdef")
    client = Client()
    stream = OutputStream(client, ["r0", "r1"])
    for out in (CoreOutput("r0", ids[:4]), CoreOutput("r1", ids[:2]), CoreOutput("r0", ids[4:], "length"),
                CoreOutput("r1", ids[2:], "length")):
        stream.queue.put_nowait(out)

    async def drive():
        return [item async for item in run_choices(stream, choices)]

    asyncio.run(drive())
    assert client.aborted == ["r0"]
    assert (choices[0].text, choices[0].finish_reason) == ("ab", "stop")
    assert (choices[1].text, choices[1].finish_reason) == ("ab", "stop")
