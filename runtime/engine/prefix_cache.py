"""Which tokens each slot's KV cache holds, and which prompts can reuse them (pure Python; no torch).

A slot keeps what it holds after its request ends. A prompt that starts with tokens some slot holds (a chat
template's preamble, a shared system prompt, a conversation's earlier turns) skips prefilling them: read in
place when it is the prompt's own slot (the scheduler prefers such a slot), else copied from that slot first,
which costs far less than computing them. The scheduler owns this bookkeeping (it plans the copies and
books what each step wrote); the model runner only executes the copies it is given.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_PREFIX_REUSE = 8  # tokens: a shorter common prefix is prefilled again
FROM_STORE = -1  # a plan's source when the prefix comes from the host KV store, not a slot


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token sequences share."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class PrefixCache:
    """Per slot, the tokens at cache positions 0, 1, ..."""

    def __init__(self, slots: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.held: list[list[int]] = [[] for _ in range(slots)]

    def reusable(self, slot: int, prompt_ids: Sequence[int]) -> int:
        """How many leading tokens of a prompt the slot's own cache already holds: the longest common prefix
        with what the slot last held, less the prompt's last token (its logits are needed), and none when
        shorter than MIN_PREFIX_REUSE (not worth a scattered prefill)."""
        if not self.enabled:
            return 0
        n = min(common_prefix(self.held[slot], prompt_ids), len(prompt_ids) - 1)
        return n if n >= MIN_PREFIX_REUSE else 0

    def plan(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        stored: Sequence[int] | None = None,
    ) -> list[tuple[int, int]]:
        """For a prefill group: per prompt, the slot whose cache holds its longest prefix and that prefix's
        length (0: prefill it all). The prompt's own slot wins ties (no copy). `stored`, per prompt, is the
        prefix the host KV store holds (`host_kv_store`): where it is longer than every slot's, the source is
        FROM_STORE.

        The runner makes the copies in the group's order, all before the pass writes anything, so a slot holds
        what it held when a prompt's copy reads it unless an earlier prompt of the group copied into it: any
        other slot is a source, the group's own targets included (32 chat prompts admitted together into
        fresh slots all copy the system prompt from the one slot that holds it, where they were once refused
        it because that slot was being written too)."""
        copied_into: set[int] = set()
        plan = []
        for i, (slot, ids) in enumerate(zip(slots, prompts, strict=True)):
            best = (slot, self.reusable(slot, ids))
            for other in range(len(self.held)):
                if other != slot and other not in copied_into:
                    n = self.reusable(other, ids)
                    if n > best[1]:
                        best = (other, n)
            if stored is not None and self.enabled and stored[i] > best[1]:
                best = (FROM_STORE, stored[i])
            if best[0] != slot:
                copied_into.add(slot)
            plan.append(best)
        return plan

    def holds(self, slot: int, token_ids: Sequence[int]) -> None:
        """The slot's cache now holds these tokens (a prefill, or keys and values imported from elsewhere)."""
        self.held[slot] = list(token_ids)

    def copied(self, src: int, dst: int, length: int) -> None:
        """Positions [0, length) of slot src were copied into slot dst."""
        self.held[dst] = self.held[src][:length]

    def swapped(self, a: int, b: int, length: int) -> None:
        """Positions [0, length) of two slots were exchanged (a running request moved into a free slot, whose
        cached prefix went to the slot it left)."""
        self.held[a], self.held[b] = self.held[b][:length], self.held[a][:length]

    def wrote(self, slot: int, token: int, position: int) -> None:
        """A pass wrote one token at this position of the slot's cache (a decode row)."""
        held = self.held[slot]
        if len(held) == position:
            held.append(token)
        else:  # not the continuation of what the slot holds: trust none of it
            held.clear()

    def forget_all(self) -> None:
        """A step failed: what the cache holds is unknown now."""
        self.held = [[] for _ in self.held]
