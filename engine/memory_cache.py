"""The memory tier: blocks by key, evicted leaf-first in LRU order under a byte budget.

Engine thread only (it holds MLX arrays), so no lock. Besides the key map it
keeps each parent's children, which is how a lookup that stops mid-block finds
the cached block (or tail) sharing the most tokens with the prompt.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.cache_blocks import Block


class MemoryCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self._children: dict[bytes, set[bytes]] = {}
        self._pins: dict[bytes, int] = {}
        self.evictions = 0  # blocks dropped for room (a new block refused counts too): read by the recorder

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> Block | None:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def children(self, parent: bytes) -> list[Block]:
        return [self._blocks[k] for k in self._children.get(parent, ())]

    def can_hold(self, nbytes: int) -> bool:
        return nbytes <= self.max_bytes

    def put(self, block: Block) -> None:
        """Insert (most recently used), evicting unpinned blocks past the budget."""
        if block.key in self._blocks:
            self._blocks.move_to_end(block.key)
            return
        self._blocks[block.key] = block
        self._children.setdefault(block.parent, set()).add(block.key)
        self.nbytes += block.nbytes
        if self.nbytes <= self.max_bytes:
            return
        keep = self._ancestors(block)
        while self.nbytes > self.max_bytes:
            victim = next((k for k in self._blocks if self._evictable(k) and k not in keep and k != block.key), None)
            self.evictions += 1
            if victim is None:  # only its own chain is left: the new block is the one to go
                self.discard(block.key)
                return
            self.discard(victim)

    def _evictable(self, key: bytes) -> bool:
        # Leaves only, least recently used first, and never an ancestor of the
        # block being added: evicting a block with cached children would strand
        # them (a chain without its head is never hit).
        return key not in self._pins and key not in self._children

    def _ancestors(self, block: Block) -> set[bytes]:
        seen, parent = set(), block.parent
        while parent in self._blocks and parent not in seen:
            seen.add(parent)
            parent = self._blocks[parent].parent
        return seen

    def discard(self, key: bytes) -> None:
        block = self._blocks.pop(key, None)
        if block is None:
            return
        self.nbytes -= block.nbytes
        siblings = self._children[block.parent]
        siblings.discard(key)
        if not siblings:
            del self._children[block.parent]

    def pin(self, key: bytes) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def pinned(self, key: bytes) -> bool:
        return key in self._pins

    def unpin(self, key: bytes) -> None:
        left = self._pins.get(key, 0) - 1
        if left > 0:
            self._pins[key] = left
        else:
            self._pins.pop(key, None)
