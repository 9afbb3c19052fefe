"""The simulated worker's LoRA registry, as TensorRT-LLM's sibling server keeps one (tensorrt_llm/openengine/
lora_registry.py @72f828a4d082). Pure but for reading the adapter's directory.

Logical and lazy, as upstream: LoadLora checks the adapter (a name, a lora_id >= 0, a directory holding an
adapter_config.json with a JSON object and adapter_model.safetensors or adapter_model.bin) and records it; the
engine would load the weights on first use into a GPU cache of max_loras adapters, so the registry itself is not
bounded by max_loras (the simulator bounds it at MAX_REGISTERED only to bound its own memory). A name is bound to
its id and path for the life of the process, and an id and a path to one name: loading the same adapter again is
`already_loaded`, loading it after an unload registers it again, anything else is refused (INVALID_ARGUMENT).
UnloadLora of a name not loaded: NOT_FOUND. ListLoras: sorted by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

MAX_REGISTERED = 1024


class LoraRefused(ValueError):
    """LoadLora refused (the sibling server's ValueError: INVALID_ARGUMENT)."""


@attrs.frozen
class Adapter:
    lora_id: int
    name: str
    source_path: str


def _checked(lora_id: int, name: str, source_path: str) -> Adapter:
    if not name:
        raise LoraRefused("lora_name must not be empty")
    if lora_id < 0:
        raise LoraRefused("lora_id must be non-negative")
    path = Path(source_path).expanduser().resolve()
    if not path.is_dir():
        raise LoraRefused(f"LoRA source path is not a directory: {path}")
    config = path / "adapter_config.json"
    if not config.is_file():
        raise LoraRefused(f"LoRA directory is missing adapter_config.json: {path}")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise LoraRefused(f"LoRA adapter_config.json is invalid: {path}") from exc
    if not isinstance(parsed, dict):
        raise LoraRefused(f"LoRA adapter_config.json must contain an object: {path}")
    if not any((path / weights).is_file() for weights in ("adapter_model.safetensors", "adapter_model.bin")):
        raise LoraRefused(f"LoRA directory is missing adapter weights: {path}")
    return Adapter(lora_id, name, str(path))


class LoraRegistry:
    def __init__(self) -> None:
        self.loaded: dict[str, Adapter] = {}
        self._bound: dict[str, Adapter] = {}  # every name ever loaded, with the attributes it is bound to
        self._names_by_id: dict[int, str] = {}
        self._names_by_path: dict[str, str] = {}

    def load(self, lora_id: int, name: str, source_path: str) -> tuple[Adapter, bool]:
        """(the adapter, already_loaded); LoraRefused with the reason."""
        adapter = _checked(lora_id, name, source_path)
        bound = self._bound.get(name)
        if bound is not None:
            if bound != adapter:
                raise LoraRefused(f"LoRA name {name!r} is permanently bound to different attributes")
            already = name in self.loaded
            self.loaded[name] = bound
            return bound, already
        if lora_id in self._names_by_id:
            raise LoraRefused(f"LoRA ID {lora_id} is permanently bound to {self._names_by_id[lora_id]!r}")
        if adapter.source_path in self._names_by_path:
            raise LoraRefused(f"LoRA path {adapter.source_path!r} is permanently bound to "
                              f"{self._names_by_path[adapter.source_path]!r}")
        if len(self._bound) >= MAX_REGISTERED:
            raise LoraRefused(f"the simulated worker registers at most {MAX_REGISTERED} adapters")
        self._bound[name] = self.loaded[name] = adapter
        self._names_by_id[lora_id] = name
        self._names_by_path[adapter.source_path] = name
        return adapter, False

    def unload(self, name: str) -> Adapter:
        """KeyError: not loaded. A request already running with it goes on (it holds its adapter)."""
        return self.loaded.pop(name)

    def listed(self) -> list[Adapter]:
        return [self.loaded[name] for name in sorted(self.loaded)]

    def get(self, name: str) -> Adapter | None:
        return self.loaded.get(name)
