"""The OpenAI Agents SDK (openai-agents) as a user runs it against the HTTP app, through chat completions:
an agent with a function tool calls it, gets its output back in the next turn and answers; streamed and
not. Every model call the agent makes is one usage row of its tenant.

The tiny model is random, so the first turn names its tool (tool_choice, forced by the grammar); the SDK
resets tool_choice after a call (Agent.reset_tool_choice), so the second turn answers in free text.
"""

import asyncio
import time

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

from tests.app.conftest import MODEL, Served
from tests.app.test_metering import usage_rows


async def run_agent(url: str, key: str, streamed: bool) -> tuple[list[str], object]:
    calls: list[str] = []

    @function_tool
    def current_colour() -> str:
        """The colour of the sea today."""
        calls.append("current_colour")
        return "deep blue"

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    agent = Agent(
        name="colours",
        instructions="Answer in a few words, using your tool.",
        tools=[current_colour],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="current_colour", max_tokens=64, temperature=0),
    )
    config = RunConfig(tracing_disabled=True)  # nothing is sent to OpenAI's trace exporter
    try:
        if streamed:
            run = Runner.run_streamed(agent, "What colour is the sea?", max_turns=3, run_config=config)
            async for _ in run.stream_events():
                pass
            return calls, run
        return calls, await Runner.run(agent, "What colour is the sea?", max_turns=3, run_config=config)
    finally:
        await client.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_an_agent_calls_its_tool_and_answers(served: Served, streamed: bool) -> None:
    tenant_id, key = served.new_tenant(f"agents-{'stream' if streamed else 'plain'}")
    calls, result = asyncio.run(run_agent(served.url, key, streamed))
    assert calls == ["current_colour"]
    items = result.new_items  # type: ignore[attr-defined]
    kinds = [type(item) for item in items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem] and kinds[-1] is MessageOutputItem
    assert items[1].output == "deep blue"
    assert isinstance(result.final_output, str)  # type: ignore[attr-defined]
    assert len(result.raw_responses) == 2  # type: ignore[attr-defined]  # two model calls
    deadline = time.monotonic() + 30
    while len(usage_rows(served, tenant_id)) < 2:
        assert time.monotonic() < deadline, "the agent's two calls were not billed"
        served.services.delivery.wake()
        time.sleep(0.1)
    time.sleep(0.3)
    rows = usage_rows(served, tenant_id)
    assert len(rows) == 2  # once each, never twice
    assert all(r.status == "completed" for r in rows)
