"""The OpenAI Agents SDK (openai-agents) as a user runs it against the HTTP app, through the Responses API
(the SDK's default model) and through chat completions: an agent with a function tool calls it, gets its
output back in the next turn and answers; streamed and not. Every model call the agent makes is one usage
row of its tenant.

The tiny model is random, so the first turn names its tool (tool_choice, forced by the grammar); the SDK
resets tool_choice after a call (Agent.reset_tool_choice), so the second turn answers in the agent's
output type on the Responses API (structured output, text.format): a random model's free text runs to
max_tokens, which the SDK's Responses model takes as a failed turn (status incomplete). Through chat
completions it answers in free text (finish_reason length is an answer there): chat refuses
response_format beside a forced tool_choice.
"""

import asyncio
import time
from dataclasses import dataclass
from typing import Literal

import httpx
import pytest
from agents import (
    Agent,
    Model,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.app.conftest import MODEL, Served
from tests.app.test_metering import usage_rows


class Sea(BaseModel):
    colour: Literal["blue", "green", "grey"]


@dataclass(frozen=True)
class Api:
    model: type[Model]
    output_type: type[Sea] | type[str]
    chained: bool = False  # the SDK sends previous_response_id and only the new items, not the whole list


API = {
    "responses": Api(OpenAIResponsesModel, Sea),
    "responses-chained": Api(OpenAIResponsesModel, Sea, chained=True),
    "chat": Api(OpenAIChatCompletionsModel, str),
}


async def run_agent(url: str, key: str, api: str, streamed: bool) -> tuple[list[str], object]:
    calls: list[str] = []

    @function_tool
    def current_colour() -> str:
        """The colour of the sea today."""
        calls.append("current_colour")
        return "deep blue"

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    chosen = API[api]
    model = chosen.model(model=MODEL, openai_client=client)  # type: ignore[call-arg]
    agent = Agent(
        name="colours",
        instructions="Answer in a few words, using your tool.",
        tools=[current_colour],
        output_type=chosen.output_type,
        model=model,
        model_settings=ModelSettings(tool_choice="current_colour", max_tokens=64, temperature=0),
    )
    config = RunConfig(tracing_disabled=True)  # nothing is sent to OpenAI's trace exporter
    question = "What colour is the sea?"
    options = {"max_turns": 3, "run_config": config, "auto_previous_response_id": chosen.chained}
    try:
        if streamed:
            run = Runner.run_streamed(agent, question, **options)  # type: ignore[arg-type]
            async for _ in run.stream_events():
                pass
            return calls, run
        return calls, await Runner.run(agent, question, **options)  # type: ignore[arg-type]
    finally:
        await client.close()


@pytest.mark.parametrize("api", list(API))
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_an_agent_calls_its_tool_and_answers(served: Served, api: str, streamed: bool) -> None:
    tenant_id, key = served.new_tenant(f"agents-{api}-{'stream' if streamed else 'plain'}")
    calls, result = asyncio.run(run_agent(served.url, key, api, streamed))
    assert calls == ["current_colour"]
    items = result.new_items  # type: ignore[attr-defined]
    kinds = [type(item) for item in items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem] and kinds[-1] is MessageOutputItem
    assert items[1].output == "deep blue"
    assert isinstance(result.final_output, API[api].output_type)  # type: ignore[attr-defined]
    responses = result.raw_responses  # type: ignore[attr-defined]
    assert len(responses) == 2  # two model calls
    if API[api].chained:  # the second call continued the first, stored here
        first, second = (r.response_id for r in responses)
        stored = httpx.get(f"{served.url}/v1/responses/{second}", headers={"Authorization": f"Bearer {key}"})
        assert stored.json()["previous_response_id"] == first
    deadline = time.monotonic() + 30
    while len(usage_rows(served, tenant_id)) < 2:
        assert time.monotonic() < deadline, "the agent's two calls were not billed"
        served.services.delivery.wake()
        time.sleep(0.1)
    time.sleep(0.3)
    rows = usage_rows(served, tenant_id)
    assert len(rows) == 2  # once each, never twice
    assert all(r.status == "completed" for r in rows)
