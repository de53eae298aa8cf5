"""Agent sessions driven by real frameworks against an OpenAI-compatible server, every HTTP request
they send saved as it went out (endpoint and exact JSON body): the traces bench/agent_replay.py
replays.

Two frameworks, both through Chat Completions (the API every peer speaks, so a trace replays
against llama-server and ik_llama.cpp unchanged): the OpenAI Agents SDK
(``OpenAIChatCompletionsModel``) and pydantic-ai (``OpenAIChatModel``). The agent explores this
repository with two tools whose results are real text: ``list_files`` (a folder's files and
sizes) and ``read_file`` (the next page of a file, so a file read twice moves on). The bundled
models are too small to run an agent on their own, so the recorder scripts *which* tool each
step calls (``tool_choice`` naming it: list a folder every few steps, read otherwise, answer in
text at the last step); the model still writes the arguments (an enum of real paths, held by
the server's tool grammar), and the frameworks build every body themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Literal

import httpx

ROOT = Path(__file__).resolve().parent.parent
PAGE_CHARS = 2400             # one read_file result: ~600-700 tokens of code or prose
LIST_EVERY = 6                # a list_files step every this many steps
DIRS = ("turnkv/prompt_cache", "turnkv/server", "turnkv/engine", "turnkv/cache", "docs", "bench")
FILES = tuple(str(p.relative_to(ROOT)) for d in DIRS for p in sorted((ROOT / d).glob("*.*"))
              if p.suffix in (".py", ".md") and p.stat().st_size >= 4000)[:48]
TASKS = (
    "Review how the prompt cache evicts entries under memory pressure and list the risks you see.",
    "Explain how a chat request becomes tokens and reaches the engine; cite the files you read.",
    "Find where streamed replies are built and summarise how tool calls are streamed.",
    "Survey the benchmarks in bench/ and say which one measures reuse across turns.",
)
INSTRUCTIONS = ("You are a careful code-review agent working in the turnkv repository, a Python LLM "
                "inference server. Use list_files to see a folder and read_file to read a file page by "
                "page (each call returns the next page). Read the files that matter for the task before "
                "you answer, then answer with a short report naming the files.")

DirName = Literal[DIRS]          # type: ignore[valid-type]
FileName = Literal[FILES]        # type: ignore[valid-type]


class Workspace:
    """The tools' state for one session: how far each file has been read."""

    def __init__(self):
        self.offsets: dict[str, int] = {}

    def list_files(self, directory: str) -> str:
        d = ROOT / directory
        if directory not in DIRS or not d.is_dir():
            return f"error: no folder {directory!r}"
        rows = [f"{p.name}\t{p.stat().st_size} bytes" for p in sorted(d.iterdir()) if p.is_file()]
        return f"{directory}/ ({len(rows)} files)\n" + "\n".join(rows)

    def read_file(self, path: str) -> str:
        if path not in FILES:
            return f"error: no file {path!r}"
        text = (ROOT / path).read_text(errors="replace")
        start = self.offsets.get(path, 0)
        if start >= len(text):
            start = 0                        # read to the end already: start over, as a pager would
        page = text[start:start + PAGE_CHARS]
        self.offsets[path] = start + len(page)
        return f"{path} [chars {start}-{start + len(page)} of {len(text)}]\n{page}"


def scripted_tool(step: int, steps: int) -> str | None:
    """The tool step ``step`` (1-based) must call; None: answer in text (the last step)."""
    if step >= steps:
        return None
    return "list_files" if step % LIST_EVERY == 1 else "read_file"


class Recorder:
    """An httpx event hook that appends every request the framework sends to a JSONL trace."""

    def __init__(self, path: Path, session: str, framework: str):
        self.path, self.session, self.framework = path, session, framework
        self.step = 0

    async def __call__(self, request: httpx.Request) -> None:
        self.step += 1
        body = json.loads(request.content)
        row = {"session": self.session, "framework": self.framework, "step": self.step,
               "endpoint": request.url.path, "body": body}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"request": [self]}, timeout=900)


async def openai_agents_session(url: str, model: str, task: str, steps: int, rec: Recorder,
                                max_tokens: int) -> None:
    import agents
    import openai
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel

    agents.set_tracing_disabled(True)
    ws = Workspace()

    @agents.function_tool
    def list_files(directory: DirName) -> str:
        """List the files of a folder of the repository with their sizes."""
        return ws.list_files(directory)

    @agents.function_tool
    def read_file(path: FileName) -> str:
        """Read the next page of a file of the repository."""
        return ws.read_file(path)

    class Scripted(OpenAIChatCompletionsModel):
        """The SDK's own chat-completions model; only tool_choice is set per step."""
        calls = 0

        async def stream_response(self, system_instructions, input, model_settings, *args, **kw):
            Scripted.calls += 1
            tool = scripted_tool(Scripted.calls, steps)
            settings = model_settings.resolve(agents.ModelSettings(
                tool_choice=tool or "none", max_tokens=max_tokens if tool else 2 * max_tokens))
            async for event in super().stream_response(system_instructions, input, settings, *args, **kw):
                yield event

    api = openai.AsyncOpenAI(base_url=url, api_key=os.environ.get("TURNKV_API_KEY", "none"),
                             max_retries=0, http_client=rec.client())
    agent = agents.Agent(name="reviewer", instructions=INSTRUCTIONS, tools=[list_files, read_file],
                         model=Scripted(model, api), reset_tool_choice=False,
                         model_settings=agents.ModelSettings(temperature=0, include_usage=True))
    run = agents.Runner.run_streamed(agent, task, max_turns=steps + 1)
    async for _ in run.stream_events():
        pass


async def pydantic_ai_session(url: str, model: str, task: str, steps: int, rec: Recorder,
                              max_tokens: int) -> None:
    import openai
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    ws = Workspace()
    api = openai.AsyncOpenAI(base_url=url, api_key=os.environ.get("TURNKV_API_KEY", "none"),
                             max_retries=0, http_client=rec.client())

    def settings(ctx) -> dict:
        tool = scripted_tool(ctx.run_step, steps)
        return {"tool_choice": [tool] if tool else "none", "temperature": 0.0,
                "max_tokens": max_tokens if tool else 2 * max_tokens}

    agent = Agent(OpenAIChatModel(model, provider=OpenAIProvider(openai_client=api)),
                  instructions=INSTRUCTIONS, model_settings=settings)

    @agent.tool_plain
    def list_files(directory: DirName) -> str:
        """List the files of a folder of the repository with their sizes."""
        return ws.list_files(directory)

    @agent.tool_plain
    def read_file(path: FileName) -> str:
        """Read the next page of a file of the repository."""
        return ws.read_file(path)

    async def drain(ctx, events):      # a handler makes every model request a streamed one
        async for _ in events:
            pass

    await agent.run(task, event_stream_handler=drain)


FRAMEWORKS = {"openai-agents": openai_agents_session, "pydantic-ai": pydantic_ai_session}


def record(url: str, model: str, out: Path, sessions: int, steps: int, max_tokens: int) -> None:
    """``sessions`` sessions, the frameworks taking turns, appended to ``out`` one after another."""
    names = list(FRAMEWORKS)
    for i in range(sessions):
        framework = names[i % len(names)]
        rec = Recorder(out, f"s{i + 1}-{framework}", framework)
        asyncio.run(FRAMEWORKS[framework](url, model, TASKS[i % len(TASKS)], steps, rec, max_tokens))
        print(f"recorded {rec.session}: {rec.step} requests", flush=True)
