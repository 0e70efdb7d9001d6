"""The openai-agents SDK against the server `make serve` runs (the embedded default model and the demo adapters,
no tool-call parser): an agent with the pirate adapter calls its tool (tool_choice "required"), gets the result
back, and answers in its output type on the second turn, through the Responses API."""
import os
import subprocess
import sys
import time
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from support.serving import free_port

agents = pytest.importorskip("agents")
pytestmark = pytest.mark.slow
ADAPTERS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "adapters")


@pytest.fixture(scope="module")
def url():
    port = free_port()
    cmd = [sys.executable, "-m", "loramux", "serve", "--port", str(port), "--max-model-len", "1024",
           "--log-level", "warning", "--lora-modules", *[f"{n}={os.path.join(ADAPTERS, n)}" for n in ("pirate", "json")]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while proc.poll() is None:  # (start-up is bounded by the server itself: --engine-start-timeout)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        assert proc.poll() is None, "the server exited during start-up"
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


class Report(pydantic.BaseModel):
    city: str
    sunny: bool


def test_an_agent_calls_its_tool_then_answers_in_its_output_type(url):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    model = OpenAIResponsesModel(model="pirate", openai_client=openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-"))
    agent = Agent(name="weather", instructions="Use the tool, then report.", tools=[get_weather], model=model,
                  output_type=Report, model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                                   max_tokens=200, temperature=0))
    result = Runner.run_sync(agent, "What is the weather in Oslo?", max_turns=2)
    assert len(asked) == 1 and len(result.raw_responses) == 2
    assert result.raw_responses[0].output[0].type == "function_call"
    assert isinstance(result.final_output, Report)
