"""Deployments (sim workers + a real `orchestrator serve` process) shared by the end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai

from orchestrator.testkit.plugin import OrchestratorServers, SimWorkers, write_config


class Deployment:
    def __init__(self, tmp: Path, mode: str, roles: dict[str, list[tuple[str, ...]]], *, server_env: dict | None = None,
                 **sections):
        self.workers = SimWorkers(tmp)
        self.servers = OrchestratorServers(tmp)
        try:
            self.by_role = {role: [self.workers.start(role, *flags) for flags in flag_sets]
                            for role, flag_sets in roles.items()}
            config = write_config(tmp / f"{mode}.yaml", mode,
                                  {role: [w.address for w in ws] for role, ws in self.by_role.items()}, **sections)
            self.config = config  # (another replica may serve the same file)
            self.server = self.servers.start(config, env=server_env)
        except BaseException:
            self.close()
            raise
        self.url = self.server.url

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)

    def worker(self, role: str, i: int = 0):
        return self.by_role[role][i]

    def close(self) -> None:
        self.servers.close()
        self.workers.close()


def chat_body(content="Tell me about the weather", **extra):
    return {"model": "tiny-chat", "messages": [{"role": "user", "content": content}], **extra}


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
