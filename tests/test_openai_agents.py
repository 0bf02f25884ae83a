"""openai-agents against the gateway: its Responses model, a function tool, and
`previous_response_id` chaining across a multi-turn loop.

Real processes on loopback (an engine with its own response store, a gateway); the agents SDK
drives `/v1/responses` through its own AsyncOpenAI client, whose requests are recorded to check
that each call after the first sends only the new items."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

agents = pytest.importorskip("agents")

from agents import (  # noqa: E402
    Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool,
    set_tracing_disabled,
)

from services import RunningService  # noqa: E402
# An engine with a response store of its own and a gateway in front: the WebSocket tests' fixtures.
from test_responses_ws import MODEL, engine, gateway  # noqa: E402,F401
WEATHER = {"paris": "sunny", "rome": "rain", "oslo": "snow"}


class Forecast(BaseModel):
    sky: Literal["sunny", "rain", "snow"]


@function_tool
def weather(city: Literal["paris", "rome", "oslo"]) -> str:
    """Today's weather in a city."""
    return WEATHER[city]


async def run_loop(port: int, questions: list[str]) -> tuple[list[Any], list[dict[str, Any]]]:
    """Runs one agent turn per question, each chained to the last by previous_response_id."""
    sent: list[dict[str, Any]] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/responses"):
            sent.append(json.loads(request.content))

    async with httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120) as http:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="agents",
                                    http_client=http, max_retries=0)
        # tool_choice "required" forces the tool call; the SDK resets it to auto once the tool
        # has run (reset_tool_choice), so each turn is: forced call, tool output, then the
        # output_type's JSON (text.format, held by the grammar even on random weights).
        agent = Agent(name="forecaster", instructions="Answer with the weather.", tools=[weather],
                      output_type=Forecast, model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                   temperature=0, max_tokens=160))
        results: list[Any] = []
        previous: str | None = None
        for question in questions:
            result = await Runner.run(agent, question, previous_response_id=previous,
                                      auto_previous_response_id=True, max_turns=4,
                                      run_config=RunConfig(tracing_disabled=True))
            results.append(result)
            previous = result.last_response_id
    return results, sent


def test_a_multi_turn_agent_loop_chains_by_previous_response_id(gateway: RunningService) -> None:
    set_tracing_disabled(True)
    questions = ["Weather in Paris?", "And in Rome?", "And Oslo?"]
    results, sent = asyncio.run(run_loop(gateway.port, questions))

    calls = [response for result in results for response in result.raw_responses]
    assert len(calls) == 2 * len(questions), [len(result.raw_responses) for result in results]
    for result in results:
        tool_outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
        assert len(tool_outputs) == 1 and tool_outputs[0] in WEATHER.values(), result.new_items
        assert isinstance(result.final_output, Forecast), result.final_output

    # Every call after the first names the one before it and sends only what is new: a
    # function_call_output inside a turn, the next user message across turns.
    assert len(sent) == len(calls) and "previous_response_id" not in sent[0]
    for before, body, call in zip(calls, sent[1:], calls[1:]):
        assert body["previous_response_id"] == before.response_id, body
        kinds = [item.get("type", "message") for item in body["input"]]
        assert kinds in (["function_call_output"], ["message"]), body["input"]
        assert call.response_id.startswith("resp_")

    # The stored chain is what the engine prefills from: each call's prompt holds the previous
    # call's prompt and reply, and the previous turn's reply-end checkpoint serves it.
    for before, call in zip(calls, calls[1:]):
        assert call.usage.input_tokens > before.usage.input_tokens
        assert call.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens, (
            before.usage, call.usage)

    retrieved = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="agents",
                              max_retries=0).responses.retrieve(calls[-1].response_id)
    assert retrieved.previous_response_id == calls[-2].response_id


async def forced_step(port: int, seed: int, stream: bool) -> Any:
    """One agent step with tool_choice "required" and the SDK's default parallel calls: the step's
    tool calls run and the first one's output is the run's result (stop_on_first_tool)."""
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="agents", max_retries=0,
                                  timeout=120) as client:
        agent = Agent(name="caller", instructions="Call the tool.", tools=[weather],
                      tool_use_behavior="stop_on_first_tool",
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", temperature=1.0, max_tokens=400,
                                                   extra_body={"seed": seed}))
        config = RunConfig(tracing_disabled=True)
        if not stream:
            return await Runner.run(agent, "Weather in Paris?", max_turns=1, run_config=config)
        result = Runner.run_streamed(agent, "Weather in Paris?", max_turns=1, run_config=config)
        async for _ in result.stream_events():
            pass
        return result


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_a_required_tool_choice_step_returns_tool_calls(gateway: RunningService, stream: bool) -> None:
    """ModelSettings(tool_choice="required"), parallel calls left to the default: the response is
    `completed` with function calls only (it was `incomplete` with a message after the call, and the
    SDK raised ModelBehaviorError)."""
    set_tracing_disabled(True)
    for seed in range(3):
        result = asyncio.run(forced_step(gateway.port, seed, stream))
        [response] = result.raw_responses
        assert response.output and {item.type for item in response.output} == {"function_call"}, response.output
        assert result.final_output in WEATHER.values(), result.new_items
