"""Which worker (and attention-DP rank) holds which prefix of a prompt in its KV cache: a pure index.

No I/O and no clock of its own: kv_events.py feeds it the engines' KV events, the router (routing.py) asks
it how many leading blocks of a prompt each (worker, rank) holds, and records where it sent a prompt for the
workers whose events say nothing (approximate mode, entries expire after a TTL).

Keys are ours, not the engine's: a block's key is computed from its token ids (and the identities of the
images it covers), chained on its parent's key, so both a prompt and an engine's BlockStored event (which
carries each stored block's token ids) yield the same key without reproducing the engine's hash (its salt,
LoRA scope and hash algorithm differ per engine and revision). Removals carry only the engine's hashes, so
each (worker, rank) keeps a map engine hash -> our key.

Key function: Python's hash of a tuple of ints (chained key, block tokens) -- deterministic across
processes of one Python version (only ints are hashed; str hashing is randomized, so an image identity
is turned into an int with sha256 first). Keys never leave the process: every orchestrator replica computes
both sides itself, so replicas fed by the same events agree. A 64-bit collision costs a wrong routing
guess, never a wrong answer (the engine checks its own keys).

LoRA adapters: a block computed with an adapter is cached in that adapter's reuse scope (TensorRT-LLM's
ReuseScope(lora_id, salt)), so its chain starts at the adapter's own root (`adapter_root`) instead of ROOT_KEY,
on both sides: a prompt routed with an adapter, and a BlockStored event whose lora_name names one. An adapter's
prefix is then found on the workers that cached it with that adapter, and never for another adapter or the base.

The lowest bit of a key says "this block or an earlier one in its chain covers an image": a worker whose
events carry no image keys (revision 3 fails closed on image blocks, see sim/kv_events.py) is answered
from the approximate entries from its first image block on.

Images (as the simulated worker and TensorRT-LLM's KV cache manager V2 key them, sim/prefix_cache.py): an
image expands into `length` prompt positions; its first is the image's 32-byte digest and the rest are
synthetic ids (id_offset + position in the image); BlockStored events carry them as a hex string and ints,
plus `mm_keys` per block: (digest hex, start offset in the image) per image segment in the block. We key an
image position by (image digest, offset in the image), so the same image at the same place after the same
prefix hits, whichever text tokens the caller's prompt has at those positions.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice

import attrs

WorkerRank = tuple[str, int]  # (worker address as in WorkerSpec/pool, attention-DP rank)

ROOT_KEY = 0
IMAGE_BIT = 1  # set on a block covering an image, and on every block after it in the chain
_TEXT = ~IMAGE_BIT
_IMAGE_POSITION = -1  # what an image position contributes to the block's token tuple (segments say which)
MODES = ("events", "approximate")
# What the index learns of images from events is bounded, whatever a worker sends: at most MAX_IMAGE_LENGTHS
# images (the oldest learned go first), each of at most MAX_IMAGE_POSITIONS positions. A prompt is laid out with
# that length (one position per slot), so a worker's mm_keys claiming an image of 2**62 positions made the next
# request with that image allocate them. The largest default expansion we know (Qwen2-VL's max_pixels: 16,384
# positions) is half the bound.
MAX_IMAGE_LENGTHS = 100_000
MAX_IMAGE_POSITIONS = 1 << 15


# ---- keys -----------------------------------------------------------------------------------------------

@attrs.frozen
class PromptImage:
    """One image in the prompt, in prompt order."""

    identity: str  # caller UUID, else "sha256:<hex>" of its bytes (data URI), else sha256 of the URL
    start: int  # index in the (engine-side) token sequence where its tokens start
    length: int  # how many token positions it covers


def image_identity(*, uuid: str | None = None, data: bytes | None = None, url: str | None = None) -> str:
    """An image's identity as the engine's media hash names it (sim/media.py): the caller's uuid, else the
    sha256 of its bytes as "sha256:<hex>"; for a URL we cannot read, the sha256 of the URL itself (it then
    matches only our own approximate entries, not an engine's events, which hash the fetched bytes)."""
    if uuid:
        return uuid
    if data is not None:
        return "sha256:" + hashlib.sha256(data).hexdigest()
    if url is not None:
        return "url-sha256:" + hashlib.sha256(url.encode()).hexdigest()
    raise ValueError("an image needs a uuid, its bytes or its URL")


def image_digest(identity: str) -> bytes:
    """The 32-byte digest an image identity stands for, as the engine keys the image (sim/prefix_cache.py
    image_digest): a "sha256:<hex>" identity is its own digest, anything else is hashed."""
    if identity.startswith("sha256:") and len(identity) == 7 + 64:
        try:
            return bytes.fromhex(identity[7:])
        except ValueError:
            pass
    return hashlib.sha256(identity.encode()).digest()


def adapter_root(adapter: str) -> int:
    """The root an adapter's chains start from ("": the base model's, ROOT_KEY). From the name's sha256, not
    Python's str hash, which differs per process."""
    if not adapter:
        return ROOT_KEY
    return int.from_bytes(hashlib.sha256(b"lora\x00" + adapter.encode()).digest()[:8], "big", signed=True) & _TEXT


def _digest_int(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


def _chain(parent: int, block: tuple, segments: tuple | None) -> int:
    if segments is None:
        return (hash((parent, block)) & _TEXT) | (parent & IMAGE_BIT)
    return hash((parent, block, segments)) | IMAGE_BIT


def prompt_block_keys(token_ids: Sequence[int], block_size: int,
                      images: Sequence[PromptImage] = (), root: int = ROOT_KEY) -> list[int]:
    """Chained keys of the prompt's FULL blocks: key(block i) = H(key(block i-1), token ids of block i,
    identities of images covering block i), block 0 chained on `root` (an adapter's: adapter_root). Our own
    hash, not the engine's.

    `token_ids` is the sequence as the engine caches it (images already expanded to their positions);
    the ids at image positions do not matter. A trailing partial block has no key (engines cache only full
    blocks). Images must not overlap and must lie inside the sequence."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    blocks = zip(*[iter(token_ids)] * block_size)  # every full block's ids as a tuple, in order (cut in C)
    if not images:
        return _chained_blocks(blocks, root)
    full = len(token_ids) // block_size
    keys: list[int] = []
    parent = root
    spans = _image_spans(images, len(token_ids))
    low = 0  # where the next block of `blocks` starts
    for start, end, value in spans:
        text_end = min(start // block_size, full) * block_size
        if low < text_end:
            keys += _chained_blocks(islice(blocks, (text_end - low) // block_size), parent)
            parent, low = keys[-1], text_end
        # blocks this image covers (one of them may hold the end of an earlier image: spans sort by start)
        whole = (_IMAGE_POSITION,) * block_size
        while low < full * block_size and low < end:
            high = low + block_size
            block = next(blocks)
            if start <= low and high <= end:
                # inside this image only (the common case for a large image): no text, one segment
                # (an earlier image cannot reach in: images do not overlap and this one covers the block)
                parent = _chain(parent, whole, ((0, block_size, value, low - start),))
                keys.append(parent)
                low = high
                continue
            mixed = list(block)
            segments = []
            for other_start, other_end, other in spans:
                if other_start < high and other_end > low:
                    first, last = max(other_start, low), min(other_end, high)
                    mixed[first - low:last - low] = [_IMAGE_POSITION] * (last - first)
                    segments.append((first - low, last - first, other, first - other_start))
            parent = _chain(parent, tuple(mixed), tuple(segments))
            keys.append(parent)
            low = high
    keys += _chained_blocks(blocks, parent)  # the text after the last image
    return keys


def _chained_blocks(blocks: Iterable[tuple], parent: int) -> list[int]:
    """The keys of text `blocks` (each a block's ids as a tuple) chained on `parent` (the image bit, once set in
    a chain, stays set): the hottest loop, for a prompt's text and an event's blocks. The callers cut the blocks
    with zip over one iterator, as tuples in C (no slicing, no copy of the whole list first; a trailing partial
    block is dropped by zip itself). Measured for an 8k-token prompt: cutting and hashing the token ids in C is
    about two thirds of the time, the chain step the rest; hashlib.blake2b per block over packed bytes
    (array/struct) is about 4x slower (packing the list alone costs as much as this loop, then one digest
    object per block), and a comprehension carrying the chain saves under 10%, within the noise. Hashing each
    block first (map(hash, ...)) and chaining the pair of ints runs as many instructions (callgrind: 1.10M against
    1.06M for 8192 tokens): the cost is cutting and hashing the 8192 ids, the floor without a C extension."""
    keys: list[int] = []
    append = keys.append
    image = parent & IMAGE_BIT
    for block in blocks:
        parent = (hash((parent, block)) & _TEXT) | image
        append(parent)
    return keys


def engine_layout(token_ids: Sequence[int], images: Sequence[tuple[str, int]], placeholder: int | None
                  ) -> tuple[list[int], list[PromptImage]]:
    """The prompt as the engine caches it, for prompt_block_keys: each image (identity, positions it expands
    into) right after its placeholder token, in order, or ahead of the text when the model has none (the
    simulated worker's layout, sim/prefix_cache.py prompt_tokens). Image positions hold 0 (their ids do not
    matter to the keys)."""
    result: list[int] = []
    placed: list[PromptImage] = []
    pending = iter(images)
    if placeholder is None:
        for identity, length in pending:
            placed.append(PromptImage(identity, len(result), length))
            result.extend([0] * length)
        result.extend(token_ids)
        return result, placed
    for token in token_ids:
        result.append(token)
        if token == placeholder:
            image = next(pending, None)
            if image is not None:
                placed.append(PromptImage(image[0], len(result), image[1]))
                result.extend([0] * image[1])
    for identity, length in pending:  # more images than placeholders: the engine refuses it; kept total
        placed.append(PromptImage(identity, len(result), length))
        result.extend([0] * length)
    return result, placed


def _image_spans(images: Sequence[PromptImage], total: int) -> list[tuple[int, int, int]]:
    spans = sorted((image.start, image.start + image.length, _digest_int(image_digest(image.identity)))
                   for image in images if image.length > 0)
    end = 0
    for start, stop, _ in spans:
        if start < end or start < 0 or stop > total:
            raise ValueError("images must not overlap and must lie inside the token sequence")
        end = stop
    return spans


# ---- engine events -> our keys ----------------------------------------------------------------------------

@attrs.frozen
class MmSegment:
    """One image segment in a stored block, as an event's mm_keys carries it."""

    digest_hex: str
    start_offset: int  # offset in the image where the segment starts


class EventBlockError(ValueError):
    """A BlockStored event this index cannot key (the feed logs it and drops the blocks)."""


def event_block_keys(parent_key: int, token_ids: Sequence[int | str], block_size: int,
                     mm_keys: Sequence[Sequence[MmSegment]] | None = None, *, id_offset: int | None = None,
                     image_lengths: dict[int, int] | None = None) -> list[int]:
    """Our keys for the blocks of one BlockStored event (its token ids, block after block), chained on
    `parent_key`. Image positions are read as the engine writes them: a digest (hex text) where an image
    starts, then its synthetic ids, id_offset + position in the image; a block starting inside an image has
    an mm_key with its offset. With `id_offset` known (learn_id_offset) an image's end is exact; without, its
    run of consecutive ids is taken (text ids lie below id_offset, so only an image of ONE position followed
    by text is misread: that block then never matches, a cache miss).
    A block with image positions but no mm_keys gets a key no prompt has (harmless: it never matches).
    `image_lengths` (image digest value -> positions) learns how many positions each image whose end this
    event shows expanded into: a prompt needs that to lay its images out as the engine did.
    Raises EventBlockError for a partial block or mm_keys that do not fit the blocks."""
    if block_size < 1 or len(token_ids) % block_size:
        raise EventBlockError(f"{len(token_ids)} token ids are not whole blocks of {block_size}")
    if not mm_keys:  # the hot path: text blocks
        return _chained_blocks(zip(*[iter(token_ids)] * block_size), parent_key)
    tokens = token_ids if type(token_ids) is tuple else tuple(token_ids)
    count = len(tokens) // block_size
    keys: list[int] = []
    parent = parent_key
    if len(mm_keys) != count:
        raise EventBlockError(f"{len(mm_keys)} mm_keys entries for {count} blocks")
    for index in range(count):
        block = tokens[index * block_size:(index + 1) * block_size]
        segments = mm_keys[index]
        if segments:
            block_tokens, found = _event_image_block(block, segments, id_offset)
            parent = _chain(parent, block_tokens, found)
            if image_lengths is not None:
                following = mm_keys[index + 1] if index + 1 < count else None
                _learn_lengths(found, block_size, following, image_lengths)
        else:
            parent = _chain(parent, block, None)
        keys.append(parent)
    return keys


def _learn_lengths(found: tuple, block_size: int, following: Sequence[MmSegment] | None,
                   lengths: dict[int, int]) -> None:
    """An image whose run ends inside this block, or at its end with the next block (of the same event) not
    continuing it, has its length shown: its start offset here plus the positions it covers here."""
    for first, count, value, offset in found:
        end = offset + count
        if not 0 < end <= MAX_IMAGE_POSITIONS:
            continue  # no engine expands an image into that: not learned
        if first + count < block_size:
            lengths[value] = end
        elif following is not None and not any(s.start_offset == end for s in following):
            lengths[value] = end
    if len(lengths) > MAX_IMAGE_LENGTHS:
        # The oldest half goes at once: one at a time, each `next(iter(...))` walked past the slots already freed
        # at the front of the dict (quadratic under a stream of new images).
        for key in list(islice(lengths, len(lengths) - MAX_IMAGE_LENGTHS // 2)):
            del lengths[key]


def learn_id_offset(token_ids: Sequence[int | str], block_size: int,
                    mm_keys: Sequence[Sequence[MmSegment]] | None) -> int | None:
    """The engine's id_offset, where an event shows it exactly: a block that starts inside an image has its
    synthetic id id_offset + start_offset at its first position."""
    if not mm_keys:
        return None
    for index, segments in enumerate(mm_keys):
        for segment in segments:
            first = token_ids[index * block_size] if index * block_size < len(token_ids) else None
            if segment.start_offset > 0 and type(first) is int:
                return first - segment.start_offset
    return None


def _event_image_block(block: Sequence[int | str], segments: Sequence[MmSegment],
                       id_offset: int | None) -> tuple[tuple, tuple]:
    tokens = list(block)
    found = []
    for segment in segments:
        value = _digest_int(bytes.fromhex(segment.digest_hex))
        if segment.start_offset == 0:
            try:
                first = tokens.index(segment.digest_hex)
            except ValueError:
                raise EventBlockError(
                    f"mm_key {segment.digest_hex[:16]}... at offset 0 has no digest token") from None
            last = first + 1
            previous: int | None
            if id_offset is not None:
                previous = id_offset
            else:
                after = tokens[last] if last < len(tokens) else None
                previous = after - 1 if type(after) is int else None
        else:
            first, last = 0, 0  # a block starting inside an image: the segment starts at its first position
            if id_offset is not None:
                previous = id_offset + segment.start_offset - 1
            else:
                head = tokens[0]
                previous = head - 1 if type(head) is int else None
        # The synthetic ids run on one by one (id_offset + position in the image) to the image's end.
        while last < len(tokens) and previous is not None:
            token = tokens[last]
            if type(token) is not int or token != previous + 1:
                break
            previous = token
            last += 1
        tokens[first:last] = [_IMAGE_POSITION] * (last - first)
        found.append((first, last - first, value, segment.start_offset))
    found.sort()
    return tuple(tokens), tuple(found)


# ---- the index -------------------------------------------------------------------------------------------

class _RankState:
    __slots__ = ("index", "bit", "by_engine", "extra_refs", "computing")

    def __init__(self, index: int):
        self.index = index  # 1..255: this (worker, rank)'s bit in the masks
        self.bit = 1 << index
        self.by_engine: dict[int, int] = {}  # engine hash -> our key (events); our key -> our key (stored())
        self.extra_refs: dict[int, int] = {}  # our key -> further engine hashes mapping to it (rare: LoRA, salt)
        # In-flight entries (events mode): our key -> until when, for the blocks of prompts we routed here that
        # its events have not shown stored yet (routed_computing)
        self.computing: dict[int, float] = {}


class KvIndex:
    """Who holds which block: event-fed entries per (worker, rank), and approximate entries (where we routed)
    that expire `ttl_s` after their last routing.

    `overlap()` walks a prompt's keys from the first and answers, per (worker, rank), how many LEADING blocks
    it holds; a worker counts its event entries, and its approximate entries where its mode is approximate
    (or, for a worker whose events carry no image keys, from the prompt's first image block on)."""

    def __init__(self, ttl_s: float = 120.0, max_approximate: int = 1_000_000, computing_ttl_s: float = 10.0):
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        if computing_ttl_s < 0:
            raise ValueError("computing_ttl_s must be >= 0")
        self.ttl_s = ttl_s
        # How long a prompt routed to a worker with events counts as being computed there when its events do not
        # show it stored (the request failed, or its blocks were cached already); 0: not counted at all.
        self.computing_ttl_s = computing_ttl_s
        self._computing_sweep_at = 0.0
        self.max_approximate = max_approximate
        self._ranks: dict[WorkerRank, _RankState] = {}
        self._free_bits: list[int] = []  # indexes of (worker, rank)s forgotten
        self._next_index = 1
        self._names: dict[int, WorkerRank] = {}  # bit -> (worker, rank)
        self._held: dict[int, int] = {}  # key -> mask of (worker, rank) bits holding it per events
        self._modes: dict[str, str] = {}
        self._id_offsets: dict[str, int] = {}  # worker -> its engine's image id_offset, once an event showed it
        self._image_lengths: dict[int, int] = {}  # image digest value -> positions it expanded into (events)
        self._without_image_keys: set[str] = set()
        self._approx_mask = 0  # bits of workers in approximate mode
        self._no_image_mask = 0  # bits of events-mode workers whose events carry no image keys
        # Approximate entries: key -> mask of bits routed it, and (key << 8 | bit index) -> until when; the
        # expiry queue holds one item per routed() call, in expiry order (one TTL for all).
        self._routed: dict[int, int] = {}
        self._routed_until: dict[int, float] = {}
        self._routed_count = 0
        self._expiry_keys = 0  # keys held by the expiry queue: a prompt routed again adds an item, not an entry
        self._expiry: collections.deque[tuple[float, tuple[int, ...], int, int]] = collections.deque()

    # ---- who is there -------------------------------------------------------------------------------
    def _state(self, where: WorkerRank) -> _RankState:
        state = self._ranks.get(where)
        if state is None:
            if self._free_bits:
                index = self._free_bits.pop()
            elif self._next_index < 256:
                index = self._next_index  # bit 0 is never used: a mask never reads as IMAGE_BIT
                self._next_index += 1
            else:
                raise ValueError("the KV index tracks at most 255 (worker, rank) pairs")
            state = self._ranks[where] = _RankState(index)
            self._names[state.bit] = where
            self._refresh_masks()
        return state

    def _refresh_masks(self) -> None:
        approx = no_image = 0
        for (worker, _), state in self._ranks.items():
            mode = self._modes.get(worker, "approximate")
            if mode == "approximate":
                approx |= state.bit
            elif worker in self._without_image_keys:
                no_image |= state.bit
        self._approx_mask, self._no_image_mask = approx, no_image

    def set_mode(self, worker: str, mode: str, *, image_keys: bool = True) -> None:
        """How `worker`'s entries are known: "events" (its engines' events; `image_keys` False when they
        carry none, so its image blocks are answered approximately) or "approximate" (where we routed)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        self._modes[worker] = mode
        if image_keys:
            self._without_image_keys.discard(worker)
        else:
            self._without_image_keys.add(worker)
        self._refresh_masks()

    def mode(self, worker: str) -> str:
        """"events" | "approximate" (the default: a worker nobody fed events for)."""
        return self._modes.get(worker, "approximate")

    def image_keys(self, worker: str) -> bool:
        """Whether `worker`'s image blocks come from its events (else from approximate entries)."""
        return self.mode(worker) == "events" and worker not in self._without_image_keys

    def forget(self, worker: str) -> None:
        """The worker left the pool: every entry and its mode go at once."""
        self.cleared(worker)
        self.cleared_routed(worker)
        for where in [w for w in self._ranks if w[0] == worker]:
            state = self._ranks.pop(where)
            del self._names[state.bit]
            self._free_bits.append(state.index)
        self._modes.pop(worker, None)
        self._id_offsets.pop(worker, None)
        self._without_image_keys.discard(worker)
        self._refresh_masks()

    # ---- event-fed entries --------------------------------------------------------------------------
    def stored(self, where: WorkerRank, keys: Sequence[int]) -> None:
        """`where` holds these blocks (our keys; each is also its own engine hash for a later removed())."""
        self._store(self._state(where), keys, keys)

    def removed(self, where: WorkerRank, keys: Sequence[int]) -> None:
        """`where` no longer holds these blocks (our keys, as given to stored())."""
        state = self._ranks.get(where)
        if state is not None:
            self._remove(state, keys)

    def stored_engine(self, where: WorkerRank, engine_hashes: Sequence[int], parent_hash: int | None,
                      token_ids: Sequence[int | str], block_size: int,
                      mm_keys: Sequence[Sequence[MmSegment]] | None = None, adapter: str = "") -> bool:
        """A BlockStored event: keys its blocks chained on the parent's (None: a root block, chained on the root
        of its `adapter`, the event's lora_name). Returns False, storing nothing, when the parent is unknown
        here (stored before we listened, or cleared since): its descendants cannot be keyed until the engine
        stores the chain again."""
        state = self._state(where)
        if parent_hash is None:
            parent = adapter_root(adapter)
        else:
            known = state.by_engine.get(parent_hash)
            if known is None:
                return False
            parent = known
        id_offset: int | None = None
        if mm_keys:
            worker = where[0]
            id_offset = self._id_offsets.get(worker)
            if id_offset is None:
                id_offset = learn_id_offset(token_ids, block_size, mm_keys)
                if id_offset is not None:
                    self._id_offsets[worker] = id_offset
        keys = event_block_keys(parent, token_ids, block_size, mm_keys, id_offset=id_offset,
                                image_lengths=self._image_lengths if mm_keys else None)
        if len(keys) != len(engine_hashes):
            raise EventBlockError(f"{len(engine_hashes)} block hashes for {len(keys)} blocks of token ids")
        self._store(state, engine_hashes, keys)
        return True

    def removed_engine(self, where: WorkerRank, engine_hashes: Sequence[int]) -> None:
        """A BlockRemoved event."""
        self.removed(where, engine_hashes)

    def _store(self, state: _RankState, engine_hashes: Sequence[int], keys: Sequence[int]) -> None:
        if state.computing:  # the events settle what was being computed there
            pop = state.computing.pop
            for key in keys:
                pop(key, None)
        held, by_engine, bit = self._held, state.by_engine, state.bit
        for engine_hash, key in zip(engine_hashes, keys):
            old = by_engine.get(engine_hash)
            if old == key:
                continue
            if old is not None:
                self._drop(state, old)
            by_engine[engine_hash] = key
            mask = held.get(key, 0)
            if mask & bit:
                state.extra_refs[key] = state.extra_refs.get(key, 0) + 1
            else:
                held[key] = mask | bit

    def _remove(self, state: _RankState, engine_hashes: Iterable[int]) -> None:
        by_engine = state.by_engine
        for engine_hash in engine_hashes:
            key = by_engine.pop(engine_hash, None)
            if key is not None:
                self._drop(state, key)

    def _drop(self, state: _RankState, key: int) -> None:
        extra = state.extra_refs.get(key)
        if extra:
            if extra == 1:
                del state.extra_refs[key]
            else:
                state.extra_refs[key] = extra - 1
            return
        mask = self._held.get(key, 0) & ~state.bit
        if mask:
            self._held[key] = mask
        else:
            self._held.pop(key, None)

    def cleared(self, worker: str, rank: int | None = None) -> None:
        """Forget `worker`'s event entries (one rank, or all): a sequence gap, a reconnect, AllBlocksCleared,
        or removal. They are rebuilt from the events that follow."""
        for where, state in self._ranks.items():
            if where[0] != worker or (rank is not None and where[1] != rank):
                continue
            held, clear = self._held, ~state.bit
            for key in state.by_engine.values():
                mask = held.get(key, 0) & clear
                if mask:
                    held[key] = mask
                else:
                    held.pop(key, None)
            state.by_engine = {}
            state.extra_refs = {}

    # ---- approximate entries --------------------------------------------------------------------------
    def routed(self, where: WorkerRank, keys: Sequence[int], now: float) -> None:
        """We sent a prompt with these keys to `where`: it will hold them for a while (until `now + ttl_s`).
        Call it for every routing decision; it keeps only what may answer: everything for a worker in
        approximate mode, the image blocks (IMAGE_BIT) of one whose events carry no image keys, nothing for
        one whose events say it all."""
        try:
            state = self._state(where)
        except ValueError:  # every bit taken: not recorded (a routing decision must not fail on it)
            return
        bit = state.bit
        if not bit & self._approx_mask:
            self._routed_computing(state, keys, now)
        if not (bit & (self._approx_mask | self._no_image_mask)):
            return
        if not (bit & self._approx_mask):
            keys = [key for key in keys if key & IMAGE_BIT]
        self.expire(now)
        expires = now + self.ttl_s
        routed, stamps, shift = self._routed, self._routed_until, state.index
        fresh = 0
        for key in keys:
            stamp = (key << 8) | shift
            if stamp not in stamps:
                fresh += 1
            stamps[stamp] = expires
            routed[key] = routed.get(key, 0) | bit
        if keys:
            self._expiry.append((expires, tuple(keys), bit, shift))
            self._expiry_keys += len(keys)
            self._routed_count += fresh
        # Memory bound, oldest first: on the entries, and on the queue, which a hot prompt routed again and
        # again lengthens without adding entries.
        while self._expiry and (self._routed_count > self.max_approximate
                                or self._expiry_keys > 2 * self.max_approximate):
            self._expire_oldest(float("inf"))

    def expire(self, now: float) -> None:
        """Drop approximate entries whose TTL passed (routed() and overlap() call it; cheap when none did)."""
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            self._expire_oldest(now)

    def _expire_oldest(self, now: float) -> None:
        expires, keys, bit, shift = self._expiry.popleft()
        self._expiry_keys -= len(keys)
        routed, stamps = self._routed, self._routed_until
        for key in keys:
            stamp = (key << 8) | shift
            if stamps.get(stamp) == expires:  # else routed there again since: a later item expires it
                del stamps[stamp]
                self._routed_count -= 1
                mask = routed.get(key, 0) & ~bit
                if mask:
                    routed[key] = mask
                else:
                    routed.pop(key, None)

    def cleared_routed(self, worker: str) -> None:
        """Forget where we routed to `worker` (it restarted, or left: its cache is empty)."""
        states = [state for where, state in self._ranks.items() if where[0] == worker]
        if not states:
            return
        bits = 0
        for state in states:
            bits |= state.bit
        for state in states:
            state.computing = {}
        shifts = {state.index for state in states}
        for stamp in [stamp for stamp in self._routed_until if stamp & 0xFF in shifts]:
            del self._routed_until[stamp]
            self._routed_count -= 1
        for key in [key for key, mask in self._routed.items() if mask & bits]:
            mask = self._routed[key] & ~bits
            if mask:
                self._routed[key] = mask
            else:
                del self._routed[key]
        # their deque items stay until due; expiring them finds no stamp and does nothing

    # ---- in-flight entries (events mode) ----------------------------------------------------------------
    # A prompt routed to a worker whose events say what it holds counts as held there from the routing on, not
    # from its events (which come after its prefill): the next request with the same prefix follows it instead
    # of computing the prefix again elsewhere. The events settle each block (stored: held from then on); a
    # block they never show (the request failed, or it was cached already) lapses after computing_ttl_s.
    def _routed_computing(self, state: _RankState, keys: Sequence[int], now: float) -> None:
        if not self.computing_ttl_s or not keys:
            return
        if now >= self._computing_sweep_at:  # lapsed entries go once per TTL, amortised over the decisions
            self._computing_sweep_at = now + self.computing_ttl_s
            for other in self._ranks.values():
                if other.computing:
                    other.computing = {k: until for k, until in other.computing.items() if until > now}
        if len(state.computing) > self.max_approximate:  # memory bound: forgotten, never wrong for long
            state.computing = {}
        # Only the blocks its events do not show yet (held blocks are prefix-closed: found by bisection).
        held, bit = self._held, state.bit
        low, high = 0, len(keys)
        while low < high:
            middle = (low + high + 1) // 2
            if held.get(keys[middle - 1], 0) & bit:
                low = middle
            else:
                high = middle - 1
        state.computing.update(zip(islice(keys, low, None), itertools.repeat(now + self.computing_ttl_s)))

    def computing(self, where: WorkerRank, keys: Sequence[int], depth: int, now: float) -> bool:
        """Whether the first `depth` blocks of `keys` are still being computed at `where`: routed there, not yet
        shown stored by its events, and within computing_ttl_s."""
        state = self._ranks.get(where)
        if state is None or depth < 1 or not state.computing:
            return False
        key = keys[depth - 1]  # (a prefix's blocks are stored in order: its last says it all)
        return not self._held.get(key, 0) & state.bit and state.computing.get(key, 0.0) > now

    def _with_computing(self, result: dict[WorkerRank, int], keys: Sequence[int], now: float
                        ) -> dict[WorkerRank, int]:
        """`result` (the confirmed overlap) extended by each rank's in-flight entries. Held and in-flight blocks
        together are prefix-closed (an engine stores a block after its parent and evicts leaves first; a routed
        prompt adds its whole chain), so the leading run is found by bisection: a few lookups, not one a block."""
        total = len(keys)
        held = self._held
        for where, state in self._ranks.items():
            computing = state.computing
            if not computing:
                continue
            bit = state.bit
            low = result.get(where, 0)  # blocks known there: the answer is at least that
            high = total
            while low < high:
                middle = (low + high + 1) // 2
                key = keys[middle - 1]
                if held.get(key, 0) & bit or computing.get(key, 0.0) > now:
                    low = middle
                else:
                    high = middle - 1
            if low:
                result[where] = low
        return result

    # ---- questions -----------------------------------------------------------------------------------
    def overlap(self, keys: Sequence[int], now: float) -> dict[WorkerRank, int]:
        """How many LEADING blocks of `keys` each (worker, rank) holds, or is computing for a prompt we routed
        there (in-flight entries); only those holding at least one."""
        result = self.confirmed_overlap(keys, now)
        return self._with_computing(result, keys, now) if keys and self.computing_ttl_s else result

    def confirmed_overlap(self, keys: Sequence[int], now: float) -> dict[WorkerRank, int]:
        """overlap() from the events and approximate entries alone (without the in-flight entries)."""
        self.expire(now)
        result: dict[WorkerRank, int] = {}
        if not keys:
            return result
        held, names = self._held, self._names
        approx, no_image = self._approx_mask, self._no_image_mask
        routed = self._routed if approx | no_image else None
        alive = 0
        depth = 0
        if routed:
            for key in keys:
                mask = held.get(key, 0) | (routed.get(key, 0) & (approx | no_image if key & IMAGE_BIT else approx))
                if depth == 0:
                    alive = mask
                elif alive & ~mask:
                    _record(result, names, alive & ~mask, depth)
                    alive &= mask
                if not alive:
                    return result
                depth += 1
        else:  # events only: one lookup per block
            get = held.get
            alive = get(keys[0], 0)
            if not alive:
                return result
            for key in keys:
                mask = get(key, 0)
                if alive & ~mask:
                    _record(result, names, alive & ~mask, depth)
                    alive &= mask
                    if not alive:
                        return result
                depth += 1
        _record(result, names, alive, depth)
        return result

    def image_length(self, identity: str) -> int | None:
        """How many token positions the engine expanded this image into, when an event showed its end (the
        same image expands alike on every worker of one model); None if not seen yet."""
        return self._image_lengths.get(_digest_int(image_digest(identity)))

    # ---- sizes (metrics, /health, the feed's bound) ---------------------------------------------------
    def rank_blocks(self, where: WorkerRank) -> int:
        """Event-fed entries of one (worker, rank): what the KV event feed bounds (kv_event_codec.rank_bound)."""
        state = self._ranks.get(where)
        return 0 if state is None else len(state.by_engine)

    def engine_hashes(self, worker: str) -> dict[int, list[int]]:
        """Each rank's engine hashes of `worker`'s event entries: the feed clears a big rank a slice at a time
        (removed_engine), so that the event loop runs between slices."""
        return {where[1]: list(state.by_engine) for where, state in self._ranks.items() if where[0] == worker}

    def blocks(self, worker: str | None = None) -> int:
        """Event-fed entries (block x rank), of one worker or all."""
        return sum(len(s.by_engine) for w, s in self._ranks.items() if worker is None or w[0] == worker)

    def routed_entries(self) -> int:
        """Approximate entries (block x rank) alive or due to expire."""
        return self._routed_count

    def keys_indexed(self) -> int:
        """Distinct block keys held per events, over every worker (inspection: tests)."""
        return len(self._held)

    def workers(self) -> Mapping[str, str]:
        """Every worker the index knows, with its mode (inspection: tests; /health asks mode() per worker)."""
        known = {where[0] for where in self._ranks} | set(self._modes)
        return {worker: self.mode(worker) for worker in sorted(known)}


def _record(result: dict[WorkerRank, int], names: dict[int, WorkerRank], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        where = names.get(low)
        if where is not None:
            result[where] = depth
        mask ^= low
