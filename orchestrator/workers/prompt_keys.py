"""A request's prompt as KV block keys, for KV-aware routing: computed once per request by the plan, and only
when a role routes kv_aware (orchestrator.config.RoutingConfig.kv_aware_roles).

The keys are the index's own (orchestrator.workers.kv_index.prompt_block_keys) over the prompt as the engine
caches it: each image placeholder token is followed by the positions the engine expands the image into: as
the KV events showed for that image (KvIndex.image_length), else routing.kv_aware.image_tokens (a per-model
figure), else one position, so that blocks after an image match only our own routing history.
An image is keyed by its identity: the caller's uuid, else the sha256 of its data-URI bytes, else of its URL.
A request with a LoRA adapter chains its keys on the adapter's root (kv_index.adapter_root), as the index keys the
blocks the engines report under that adapter's lora_name: the engine caches them in the adapter's reuse scope.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable, Sequence

from orchestrator.workers.kv_index import IMAGE_BIT, adapter_root, engine_layout, image_identity, prompt_block_keys


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


def salted(keys: list[int], cache_salt: str | None) -> list[int]:
    """`keys` of a request with a cache salt: the salt folded into the first block's key (its image bit kept).
    The engine keys such a request's blocks in the salt's own scope, so it reuses nothing of another salt's (or
    of no salt's): a prefix match starts at the first block, and a different first key matches nothing. The
    events carry no salt, so what the engines report stays keyed unsalted: a salted request finds only where
    it was routed before (approximate entries), never another tenant's blocks."""
    if cache_salt is None or not keys:
        return keys
    salt = int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "big")  # str hashes vary per process
    keys[0] = (hash((keys[0], salt)) & ~IMAGE_BIT) | (keys[0] & IMAGE_BIT)
    return keys


def request_block_keys(prompt_ids: Sequence[int], block_size: int, images: Sequence = (),
                       image_token_id: int | None = None, image_tokens: int = 0,
                       learned: Callable[[str], int | None] | None = None, adapter: str | None = None) -> list[int]:
    """The prompt's full-block keys, in the reuse scope of its LoRA `adapter` (None: the base model's).
    `images` in prompt order; each expands right after the next placeholder (`image_token_id`), which stays,
    as the engine caches it (kv_index.engine_layout); a model without a placeholder gets its images ahead of the
    text. An image's length is what the KV events showed for it
    (`learned(identity)`, KvIndex.image_length), else `image_tokens`, else one position (so that its
    identity still counts in the keys)."""
    root = adapter_root(adapter or "")
    if not images:
        return prompt_block_keys(prompt_ids, block_size, root=root)
    layout = []
    for image in images:
        identity = identity_of(image)
        length = (learned(identity) if learned is not None else None) or image_tokens or 1
        layout.append((identity, length))
    tokens, placed = engine_layout(prompt_ids, layout, image_token_id)
    return prompt_block_keys(tokens, block_size, placed, root)
