"""A worker's prefix cache: KV blocks reused across requests, as TensorRT-LLM's KV cache manager keeps them.

Pure: no I/O, no clock. The scheduler (scheduler.py) asks it what a request may reuse, pins what the
request uses, stores the blocks a request computed, and evicts under capacity pressure; what changed is
queued as events, which kv_events.py publishes in TensorRT-LLM's wire formats.

Keys are TensorRT-LLM's KV cache manager V2 block keys (`tensorrt_llm/runtime/kv_cache_manager_v2/
_block_radix_tree.py` @065ff9e93780, Hasher/RootBlock/Block.make_key): the root is sha256 of the reuse
scope (one mask byte 0: no LoRA, no cache salt), each block is sha256(parent key + its tokens), a text
token as 4 little-endian bytes, an image's first expanded token as that image's 32-byte digest and the
rest as ids above the vocabulary (`gen_multimodal_cache_key_tokens`: id_offset + position in the image).
So a block covering part of an image is keyed with the image's identity, and the same image at the same
place in the same prefix hits. The events' 64-bit hash is the first 8 bytes of the key, big-endian, read
as a signed int64 (`StreamingEventSink::wireHash`, cpp/.../kv_cache_manager_v2/streamingEventSink.cpp
@1454f28a18fa; advertised as "v2_sha256_64").

Rules, each as the engine has it:
- Only full blocks are cached and published (the streaming sink suppresses partial blocks).
- A request reuses at most the full blocks of its prompt minus its last token: the engine computes at
  least one prompt token to get the first output's logits (tensorrt_llm/serve/router_utils.py @305304fe94e3
  compute_token_ids_block_hashes: "in KvCacheManager, the last token is not included in the block key").
- Blocks a request uses are pinned until it ends; unpinned blocks stay resident and are evicted least
  recently used first, leaves before their parents (a child is unreachable without its parent).
- Consecutive stores that extend one chain are one BlockStored event; consecutive removals are one
  BlockRemoved (the sink's coalescing).

Capacity: `retained` counts resident blocks that no live request's reservation pays for (the scheduler's
reservations cover the rest). The scheduler evicts retained blocks when an admission needs the room.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable, Sequence

import attrs

Token = int | bytes  # bytes: an image's digest, the first of its expanded tokens
Lora = tuple[int, str]  # a LoRA adapter: (lora_id, lora_name)
HASH_ALGO = "v2_sha256_64"
ROOT_KEY = hashlib.sha256(b"\x00").digest()  # ReuseScope(lora_id=None, salt=None).to_bytes() == b"\x00"


def root_key(cache_salt: str | None, lora_id: int | None = None) -> bytes:
    """The root of a request's chains: its reuse scope, so that blocks of requests with different cache salts
    (kv.cache_salt) or LoRA adapters never match. TensorRT-LLM's scope (ReuseScope(lora_id, salt).to_bytes,
    tensorrt_llm/runtime/kv_cache_manager_v2/_cache_key.py @fa202e2a0fc2 reuse_scope_to_bytes) is a mask byte (bit 0:
    an adapter, bit 1: a salt), then the adapter's lora_id and the salt id, each as 8 little-endian bytes; its salt
    id is the first 8 bytes of the salt's blake3 (get_cache_salt_id), sha256 here, which is not a dependency:
    equal salts meet, different ones never do."""
    if cache_salt is None and lora_id is None:
        return ROOT_KEY
    scope = bytes([(lora_id is not None) | (cache_salt is not None) << 1])
    if lora_id is not None:
        scope += lora_id.to_bytes(8, "little")
    if cache_salt is not None:
        scope += hashlib.sha256(cache_salt.encode()).digest()[:8]
    return hashlib.sha256(scope).digest()
DIGEST_SIZE = 32


def block_key(parent_key: bytes, tokens: Sequence[Token]) -> bytes:
    digest = hashlib.sha256(parent_key)
    for token in tokens:
        digest.update(token if isinstance(token, bytes) else token.to_bytes(4, "little"))
    return digest.digest()


def wire_hash(key: bytes) -> int:
    """The signed int64 TensorRT-LLM publishes for a block key."""
    return int.from_bytes(key[:8], "big", signed=True)


def image_digest(identity: str) -> bytes:
    """The 32-byte digest an image is keyed with: its content sha256 when its identity is one (media.py
    names uuid-less images "sha256:<hex of the bytes>"), else sha256 of the caller's uuid."""
    if identity.startswith("sha256:") and len(identity) == 7 + 2 * DIGEST_SIZE:
        try:
            return bytes.fromhex(identity[7:])
        except ValueError:
            pass
    return hashlib.sha256(identity.encode()).digest()


def expanded_image(identity: str, count: int, id_offset: int) -> list[Token]:
    """One image's `count` prompt tokens as the cache keys them (gen_multimodal_cache_key_tokens)."""
    return [image_digest(identity), *(id_offset + i for i in range(1, count))]


def prompt_tokens(prompt_ids: Sequence[int], images: Sequence[str], *, image_tokens: int, id_offset: int,
                  placeholder: int | None) -> tuple[Token, ...]:
    """The prompt as the cache sees it: each image expanded where its placeholder is (after it, so the
    length is the prompt_len admission counted), or ahead of the text when the model has no placeholder."""
    expanded = [expanded_image(identity, image_tokens, id_offset) for identity in images]
    if placeholder is None:
        return tuple(token for image in expanded for token in image) + tuple(prompt_ids)
    result: list[Token] = []
    pending = iter(expanded)
    for token in prompt_ids:
        result.append(token)
        if token == placeholder:
            result.extend(next(pending, ()))
    for rest in pending:  # placeholders were checked against the images; kept total for safety
        result.extend(rest)
    return tuple(result)


# ---- events --------------------------------------------------------------------------------------------

@attrs.frozen
class MmKey:
    """One image segment inside a stored block: the image's digest (hex) and where in the image it starts."""

    hash: str
    start_offset: int


@attrs.frozen
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[Token, ...]
    block_size: int
    mm_keys: tuple[tuple[MmKey, ...], ...] = ()  # one tuple per block when the worker takes images
    lora: Lora | None = None  # the adapter the blocks were computed with (the events' lora_id and lora_name)


@attrs.frozen
class BlockRemoved:
    block_hashes: tuple[int, ...]


@attrs.frozen
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


# ---- the cache ----------------------------------------------------------------------------------------

class _Block:
    __slots__ = ("key", "hash", "parent", "tokens", "children", "refs", "last_used", "last_digest", "lora")

    def __init__(self, key: bytes, parent: _Block | None, tokens: tuple[Token, ...], lora: Lora | None = None):
        self.key, self.parent, self.tokens, self.lora = key, parent, tokens, lora
        self.hash = wire_hash(key)
        self.children = 0
        self.refs = 0
        self.last_used = 0
        digests = [t for t in tokens if isinstance(t, bytes)]
        # the image whose synthetic ids may continue into the next block (decodeEventBlock's item digest)
        self.last_digest: bytes | None = digests[-1] if digests else (parent.last_digest if parent else None)


@attrs.define(eq=False)
class PrefixLease:
    """What one request holds in the cache: the chain of blocks it uses, pinned, and how many of them its
    own reservation paid for (it computed and stored them)."""

    chain: list[_Block] = attrs.field(factory=list)
    owned: int = 0
    cached_tokens: int = 0  # the prefix it found cached at admission
    released: bool = False
    root: bytes = ROOT_KEY  # its reuse scope (root_key of its cache salt and adapter)
    lora: Lora | None = None  # its adapter


class PrefixCache:
    def __init__(self, block_size: int, *, enabled: bool = True, mm_keys: bool = False, id_offset: int = 0):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.enabled = enabled
        self.mm_keys = mm_keys  # publish mm_keys per block (a worker that takes images)
        self.id_offset = id_offset
        self.blocks: dict[bytes, _Block] = {}
        self.retained = 0  # resident blocks no live reservation pays for
        self.unpinned = 0  # resident blocks no request uses: all of them can be evicted, leaves first
        self.events: list[Event] = []
        self.stored_total = 0
        self.evicted_total = 0
        self._tick = 0
        self._evictable: list[tuple[int, int, bytes]] = []  # (last_used, tiebreak, key), lazily invalidated
        self._tiebreak = 0

    # ---- requests ------------------------------------------------------------------------------------
    def acquire(self, tokens: Sequence[Token], cache_salt: str | None = None, lora: Lora | None = None
                ) -> PrefixLease:
        """Pin the longest cached prefix of `tokens` a request may reuse (not its last token), within the
        reuse scope of its `cache_salt` and LoRA adapter."""
        lease = PrefixLease(root=root_key(cache_salt, lora[0] if lora is not None else None), lora=lora)
        if not self.enabled:
            return lease
        parent_key, parent = lease.root, None
        reusable = (len(tokens) - 1) // self.block_size
        for index in range(reusable):
            chunk = tokens[index * self.block_size:(index + 1) * self.block_size]
            block = self.blocks.get(block_key(parent_key, chunk))
            if block is None or block.parent is not parent:
                break
            lease.chain.append(block)
            parent_key, parent = block.key, block
        self._touch(lease.chain)
        for block in lease.chain:
            self._pin(block)
        lease.cached_tokens = len(lease.chain) * self.block_size
        return lease

    def store(self, lease: PrefixLease, tokens: Sequence[Token]) -> None:
        """The request has KV for `tokens` (a prefix of its sequence): cache their full blocks beyond its
        chain. A block someone else stored meanwhile is reused, not stored twice."""
        if not self.enabled or lease.released:
            return
        full = len(tokens) // self.block_size
        parent = lease.chain[-1] if lease.chain else None
        for index in range(len(lease.chain), full):
            chunk = tuple(tokens[index * self.block_size:(index + 1) * self.block_size])
            key = block_key(parent.key if parent else lease.root, chunk)
            block = self.blocks.get(key)
            if block is None:
                block = _Block(key, parent, chunk, lease.lora)
                self.blocks[key] = block
                if parent is not None:
                    parent.children += 1
                lease.owned += 1
                self.stored_total += 1
                self._event_stored(block)
                block.refs = 1  # pinned by its creator from birth
            else:
                self._pin(block)
            lease.chain.append(block)
            parent = block
        self._touch(lease.chain)

    def release(self, lease: PrefixLease) -> None:
        """The request ended (or handed its KV on): its blocks stay cached, unpinned; the ones it paid for
        now count as retained, since its reservation goes back to the free pool."""
        if lease.released:
            return
        lease.released = True
        self.retained += lease.owned
        for block in lease.chain:
            block.refs -= 1
            if block.refs == 0:
                self.unpinned += 1
                if block.children == 0:
                    self._push_evictable(block)
        lease.chain = []

    # ---- capacity ------------------------------------------------------------------------------------
    def evict(self, count: int) -> int:
        """Evict up to `count` unpinned blocks, least recently used leaves first; returns how many."""
        evicted = 0
        while evicted < count and self._evictable:
            last_used, _, key = heapq.heappop(self._evictable)
            block = self.blocks.get(key)
            if block is None or block.refs or block.children or block.last_used != last_used:
                continue  # stale entry: pinned again, grew a child, or touched since
            del self.blocks[key]
            self.retained -= 1
            self.unpinned -= 1
            self.evicted_total += 1
            evicted += 1
            self._event_removed(block)
            parent = block.parent
            if parent is not None:
                parent.children -= 1
                if parent.children == 0 and parent.refs == 0:
                    self._push_evictable(parent)
        return evicted

    # ---- events --------------------------------------------------------------------------------------
    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def _event_stored(self, block: _Block) -> None:
        parent_hash = block.parent.hash if block.parent else None
        mm = (self._mm_keys(block),) if self.mm_keys else ()
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and parent_hash is not None and last.block_hashes[-1] == parent_hash:
            self.events[-1] = attrs.evolve(last, block_hashes=(*last.block_hashes, block.hash),
                                           token_ids=(*last.token_ids, *block.tokens), mm_keys=last.mm_keys + mm)
            return
        self.events.append(BlockStored((block.hash,), parent_hash, block.tokens, self.block_size, mm, block.lora))

    def _event_removed(self, block: _Block) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            self.events[-1] = BlockRemoved((*last.block_hashes, block.hash))
            return
        self.events.append(BlockRemoved((block.hash,)))

    def _mm_keys(self, block: _Block) -> tuple[MmKey, ...]:
        """The image segments of a block, as decodeEventBlock derives them (cpp/tensorrt_llm/batch_manager/
        kv_cache_manager_v2/eventData.cpp @3e0a0df65be8): a digest
        starts one at offset 0; a run of synthetic ids continues the last image seen, at id - id_offset."""
        keys: list[MmKey] = []
        digest = block.parent.last_digest if block.parent else None
        in_run = False
        for token in block.tokens:
            if isinstance(token, bytes):
                digest, in_run = token, True
                keys.append(MmKey(token.hex(), 0))
            elif digest is not None and token > self.id_offset:
                if not in_run:
                    keys.append(MmKey(digest.hex(), token - self.id_offset))
                in_run = True
            else:
                in_run = False
        return tuple(keys)

    # ---- internals -----------------------------------------------------------------------------------
    def _pin(self, block: _Block) -> None:
        if block.refs == 0:
            self.unpinned -= 1
        block.refs += 1

    def _touch(self, chain: Iterable[_Block]) -> None:
        self._tick += 1
        for block in chain:
            block.last_used = self._tick

    def _push_evictable(self, block: _Block) -> None:
        self._tiebreak += 1
        heapq.heappush(self._evictable, (block.last_used, self._tiebreak, block.key))

    # ---- inspection (GetLoad, tests) ---------------------------------------------------------------------
    @property
    def resident(self) -> int:
        return len(self.blocks)

    def hashes(self) -> set[int]:
        return {block.hash for block in self.blocks.values()}
