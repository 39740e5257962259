"""The paged KV-cache pool: fixed-size blocks, ref counts and prefix caching.

A sequence's `block_table` maps its logical blocks to physical ones. Full blocks are
named by a chained hash (parent hash + the block's tokens), so requests that share a
prefix point their tables at the same physical blocks. A block whose last user leaves
keeps its hash and waits in an LRU of cached-free blocks: a later request with the same
prefix takes it back; a new allocation evicts the least recently freed one.

Sharing stays inside a namespace, the sequence's `cache_salt` (the worker's tenant): the salt
goes into the hash of a sequence's blocks, so another tenant's identical prompt neither hits
them nor learns from its cached-token count that someone asked it. Pinned prefixes are the
exception, shared by all: a sequence's head blocks that are a pinned prefix's keep the unsalted
hash, and the salt enters at the first block past it.
Pure Python: no torch, no redis.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from worker.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "pinned")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()  # kept to compare on a hit: a collision never shares KV
        self.pinned = False  # holds one reference on behalf of a pinned prefix


@dataclass(frozen=True)
class BlockStats:
    total: int
    free: int  # ref count 0, no hash
    used: int  # ref count > 0 (pinned included)
    cached: int  # ref count 0, hash kept, reusable until evicted
    pinned: int
    tokens_stored: int  # KV slots filled in used blocks
    slots_allocated: int  # used blocks x block size

    @property
    def kv_utilisation(self) -> float:
        return self.tokens_stored / self.slots_allocated if self.slots_allocated else 1.0


def chain_hash(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if block_size < 8 or block_size > 256 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in [8, 256], got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[Block] = deque(self.blocks)
        self.evictable: OrderedDict[int, Block] = OrderedDict()  # LRU: oldest first
        self.cached: dict[bytes, Block] = {}
        self.pinned_hashes: Counter[bytes] = Counter()
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: never used, or cached-free (evictable)."""
        return len(self.free) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    # --- prefix cache ------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        size = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), num_full_blocks):
            tokens = seq.token_ids[i * size:(i + 1) * size]
            parent = hashes[i - 1] if i else b""
            # Unsalted while still on a pinned prefix's head (hashed twice only there), salted after.
            if seq.cache_salt and (i == 0 or parent in self.pinned_hashes):
                shared = chain_hash(parent, tokens)
                hashes.append(shared if shared in self.pinned_hashes else chain_hash(seq.cache_salt + parent, tokens))
            else:
                hashes.append(chain_hash(seq.cache_salt + parent, tokens))

    def match_prefix(self, seq: Sequence) -> list[Block]:
        """The longest run of cached full blocks at the head of the sequence. The last
        token is always left to compute: its logits are needed to sample the next one."""
        if not self.enable_prefix_caching:
            return []
        size = self.block_size
        num_full = (len(seq.token_ids) - 1) // size
        self._extend_hashes(seq, num_full)
        hits: list[Block] = []
        for i in range(num_full):
            block = self.cached.get(seq.block_hashes[i])
            if block is None or block.token_ids != tuple(seq.token_ids[i * size:(i + 1) * size]):
                break
            hits.append(block)
        return hits

    def admission_cost(self, seq: Sequence, hits: list[Block], num_new_tokens: int) -> int:
        """Free blocks an admission takes: new blocks, plus hits that sit cached-free."""
        new = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return new + sum(1 for block in hits if block.ref_count == 0)

    def take_prefix(self, seq: Sequence, hits: list[Block]) -> None:
        """Admit a sequence onto its cached prefix (counted for the hit-rate metrics)."""
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += len(hits) * self.block_size
        for block in hits:
            self._ref(block)
            seq.block_table.append(block.block_id)

    # --- allocation --------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give the sequence blocks for its next `num_new_tokens` tokens, all or nothing."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block = self.free.popleft() if self.free else self._evict()
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        return True

    def _evict(self) -> Block:
        _, block = self.evictable.popitem(last=False)
        del self.cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()
        return block

    def _ref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.evictable[block.block_id]
        block.ref_count += 1

    def _unref(self, block: Block) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block.block_id} ref count went negative"
        if block.ref_count == 0:
            if block.block_hash is None:
                self.free.append(block)
            else:
                self.evictable[block.block_id] = block

    def free_sequence(self, seq: Sequence) -> None:
        """Release a sequence's blocks. Tail first, so the LRU evicts tails before the
        shared heads that other requests are more likely to hit."""
        for block_id in reversed(seq.block_table):
            self._unref(self.blocks[block_id])
        seq.block_table = []

    def commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """Tokens were just computed: blocks that became full join the prefix cache."""
        size, end = self.block_size, seq.num_computed_tokens
        first, full = (end - num_new_tokens) // size, end // size
        if not self.enable_prefix_caching or full == first:
            return  # no block became full: the common decode step costs nothing here
        self._extend_hashes(seq, full)
        for index in range(first, full):
            self._register(self.blocks[seq.block_table[index]], seq.block_hashes[index],
                           tuple(seq.token_ids[index * size:(index + 1) * size]))

    def _register(self, block: Block, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        if block.block_hash is not None or block_hash in self.cached:
            return  # already cached, or another block holds the same content
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block
        if self.pinned_hashes[block_hash]:
            self._hold_pin(block)

    # --- pinned prefixes ---------------------------------------------------------------
    def _prefix_hashes(self, token_ids: list[int]) -> list[bytes]:
        hashes, parent, size = [], b"", self.block_size
        for i in range(len(token_ids) // size):
            parent = chain_hash(parent, token_ids[i * size:(i + 1) * size])
            hashes.append(parent)
        return hashes

    def pin_prefix(self, token_ids: list[int]) -> int:
        """Keep the full blocks of this prefix resident once computed (now or later).
        Returns how many blocks the pin covers."""
        hashes = self._prefix_hashes(token_ids)
        for block_hash in hashes:
            self.pinned_hashes[block_hash] += 1
            block = self.cached.get(block_hash)
            if block is not None and not block.pinned:
                self._hold_pin(block)
        return len(hashes)

    def unpin_prefix(self, token_ids: list[int]) -> None:
        for block_hash in self._prefix_hashes(token_ids):
            if not self.pinned_hashes[block_hash]:
                raise KeyError("prefix is not pinned")
            self.pinned_hashes[block_hash] -= 1
            if self.pinned_hashes[block_hash]:
                continue
            del self.pinned_hashes[block_hash]
            block = self.cached.get(block_hash)
            if block is not None and block.pinned:
                block.pinned = False
                self._unref(block)

    def _hold_pin(self, block: Block) -> None:
        block.pinned = True
        self._ref(block)

    def blocks_pinned_with(self, token_ids: list[int]) -> int:
        """Blocks the pins would hold once computed, were this prefix pinned too (a head that
        pins share counts once)."""
        return len(self.pinned_hashes.keys() | set(self._prefix_hashes(token_ids)))

    @property
    def num_pinned_blocks(self) -> int:
        """Pinned blocks resident now: a pinned prefix's blocks count once computed."""
        return sum(1 for block_hash in self.pinned_hashes if block_hash in self.cached)

    # --- accounting --------------------------------------------------------------------
    def stats(self, sequences: Iterable[Sequence] = ()) -> BlockStats:
        """Counts by state; `sequences` (the running ones) give the KV fill. Only full,
        computed blocks are ever shared or pinned, so every empty slot belongs to exactly
        one sequence's table, past its computed tokens."""
        used = [block for block in self.blocks if block.ref_count > 0]
        empty_slots = sum(len(seq.block_table) * self.block_size - seq.num_computed_tokens
                          for seq in sequences)
        slots = len(used) * self.block_size
        return BlockStats(
            total=self.num_blocks, free=len(self.free), used=len(used),
            cached=len(self.evictable), pinned=sum(1 for block in used if block.pinned),
            tokens_stored=slots - empty_slots, slots_allocated=slots)
