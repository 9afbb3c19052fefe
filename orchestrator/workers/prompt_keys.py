"""A request's prompt as KV block keys, for KV-aware routing: computed once per request by the plan, and only
when a role routes kv_aware (orchestrator.config.RoutingConfig.kv_aware_roles).

The keys are the index's own (orchestrator.workers.kv_index.prompt_block_keys) over the prompt as the engine
caches it: each image placeholder token is followed by `image_tokens` positions (the engine's expansion, a
per-model figure the orchestrator cannot read from the worker: routing.kv_aware.image_tokens; 0 keeps the one
placeholder position, so blocks after an image match only our own routing history, not the engine's events).
An image is keyed by its identity: the caller's uuid, else the sha256 of its data-URI bytes, else of its URL.
"""

from __future__ import annotations

import base64
import binascii
from typing import Sequence

from orchestrator.workers.kv_index import PromptImage, image_identity, prompt_block_keys


def identity_of(image) -> str:
    """An orchestrator.convert.media.ImageRef's identity (uuid, data-URI bytes, URL)."""
    if image.uuid:
        return image_identity(uuid=image.uuid)
    if image.data_uri is not None:
        payload = image.data_uri.partition(",")[2]
        try:
            data = base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError):
            data = payload.encode()
        return image_identity(data=data)
    return image_identity(url=image.url)


def request_block_keys(prompt_ids: Sequence[int], block_size: int, images: Sequence = (),
                       image_token_id: int | None = None, image_tokens: int = 0) -> list[int]:
    """The prompt's full-block keys. `images` in prompt order; each expands right after the next placeholder
    (`image_token_id`), which stays, as the engine caches it (orchestrator/sim/prefix_cache.py prompt_tokens);
    a model without a placeholder gets its images ahead of the text."""
    if not images:
        return prompt_block_keys(prompt_ids, block_size)
    width = max(image_tokens, 1)  # unknown expansion: one position, so that the identity still counts
    identities = [identity_of(image) for image in images]
    tokens: list[int] = []
    placed: list[PromptImage] = []
    if image_token_id is None or image_token_id not in prompt_ids:
        for identity in identities:
            placed.append(PromptImage(identity, len(tokens), width))
            tokens.extend([0] * width)
        tokens.extend(prompt_ids)
        return prompt_block_keys(tokens, block_size, placed)
    pending = iter(identities)
    for token in prompt_ids:
        tokens.append(token)
        identity = next(pending, None) if token == image_token_id else None
        if identity is not None:
            placed.append(PromptImage(identity, len(tokens), width))
            tokens.extend([0] * width)  # the ids at image positions do not count in the keys
    return prompt_block_keys(tokens, block_size, placed)
