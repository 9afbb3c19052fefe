"""A request's prompt as KV block keys, for KV-aware routing: computed once per request by the plan, and only
when a role routes kv_aware (orchestrator.config.RoutingConfig.kv_aware_roles).

The keys are the index's own (orchestrator.workers.kv_index.prompt_block_keys) over the prompt as the engine
caches it: each image placeholder token is followed by the positions the engine expands the image into: as
the KV events showed for that image (KvIndex.image_length), else routing.kv_aware.image_tokens (a per-model
figure), else one position, so that blocks after an image match only our own routing history.
An image is keyed by its identity: the caller's uuid, else the sha256 of its data-URI bytes, else of its URL.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence

from orchestrator.workers.kv_index import engine_layout, image_identity, prompt_block_keys


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
                       image_token_id: int | None = None, image_tokens: int = 0,
                       learned: Callable[[str], int | None] | None = None) -> list[int]:
    """The prompt's full-block keys. `images` in prompt order; each expands right after the next placeholder
    (`image_token_id`), which stays, as the engine caches it (kv_index.engine_layout); a model without a
    placeholder gets its images ahead of the text. An image's length is what the KV events showed for it
    (`learned(identity)`, KvIndex.image_length), else `image_tokens`, else one position (so that its
    identity still counts in the keys)."""
    if not images:
        return prompt_block_keys(prompt_ids, block_size)
    layout = []
    for image in images:
        identity = identity_of(image)
        length = (learned(identity) if learned is not None else None) or image_tokens or 1
        layout.append((identity, length))
    tokens, placed = engine_layout(prompt_ids, layout, image_token_id)
    return prompt_block_keys(tokens, block_size, placed)
