"""What the host KV store keeps under cache pressure, simulated (pure: no model, no clock but the
simulation's): the store as built (`runtime/engine/host_kv_store.py`: exclusive of the slots, idle chains
first, then the deepest blocks) against the segmented LRU it was before (the least recently used leaf goes,
probation's first; a fetched chain stays in the store too), over the same slots, on the routing benchmark's
cache-pressure multi-turn pattern, in one run.

Per pod: --slots slots of --max-seq-len tokens (the scheduler's `PrefixCache`: a prompt takes the slot that
holds its prefix or the one freed longest ago; what it overwrites is saved into the store first) and a store
of as many tokens (the default size). --conversations conversations of a ~1000-token document each, --turns
turns, each on its home pod (as a prefix router keeps them), arriving over --arrivals-seconds, pausing 0 to 2x
--think-seconds between turns, served one at a time per pod (1.3 ms a prompt token computed, 0.5 s a turn
besides: the 2-core machine's figures). Measured: the share of prompt tokens found cached (slots or store),
the median request's share, and the share of requests that found more than half their prompt.

    .venv/bin/python -P bench/host_kv_store_policy.py [--conversations 20] [--seeds 10] [--out F]

The figures are the simulation's, the same on every machine; the measured run is bench/routing.py's.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from pathlib import Path

from neuronfleet.runtime.engine.host_kv_store import HostKvStore
from neuronfleet.runtime.engine.prefix_cache import PrefixCache, common_prefix
from neuronfleet.runtime.engine.scheduler import stored_prefix

ROOT = Path(__file__).resolve().parent.parent


class SegmentedLru(HostKvStore):
    """The peer, the store before: the least recently used leaf goes (probation's, then protected's), and a
    fetched chain stays in the store as well as in its slot."""

    def _victim(self, segment, keep):
        return next((n for n in segment if n not in keep and not self._children.get(n)), None)

    def moved_out(self, names):
        return []


def simulate(store_type: type[HostKvStore], seed: int, args) -> tuple[float, float, float]:
    rng, now = random.Random(seed), [0.0]
    blocks = args.slots * args.max_seq_len // 16
    stores = [store_type(blocks, clock=lambda: now[0]) for _ in range(args.pods)]
    caches = [PrefixCache(args.slots) for _ in range(args.pods)]
    freed = [[0.0] * args.slots for _ in range(args.pods)]
    history = [[rng.randrange(50000) for _ in range(1000)] for _ in range(args.conversations)]
    events = [(rng.uniform(0, args.arrivals_seconds), c, 0) for c in range(args.conversations)]
    heapq.heapify(events)
    busy_until = [0.0] * args.pods
    shares, found, total = [], 0, 0
    while events:
        now[0], c, turn = heapq.heappop(events)
        pod = c % args.pods
        prompt = history[c] + [rng.randrange(50000) for _ in range(25)]
        cache, store = caches[pod], stores[pod]
        best = max(range(args.slots), key=lambda s: (cache.reusable(s, prompt), -freed[pod][s]))
        slot = best if cache.reusable(best, prompt) else min(range(args.slots), key=lambda s: freed[pod][s])
        held = cache.held[slot]
        if len(held) // 16 > common_prefix(held, prompt) // 16:
            store.save(held)  # what the prompt overwrites
        in_slot = cache.reusable(slot, prompt)
        in_store, chain = stored_prefix(store, prompt)  # as the scheduler reads the store
        if in_store > in_slot:
            store.use(chain)
            store.moved_out(chain)
        reused = max(in_slot, in_store)
        shares.append(reused / len(prompt))
        found, total = found + reused, total + len(prompt)
        history[c] = prompt + [rng.randrange(50000) for _ in range(16)]  # its answer
        cache.holds(slot, history[c])
        freed[pod][slot] = now[0]
        start = max(now[0], busy_until[pod])
        busy_until[pod] = start + (len(prompt) - reused) * 0.0013 + 0.5
        if turn + 1 < args.turns:
            heapq.heappush(events, (busy_until[pod] + rng.uniform(0, 2 * args.think_seconds), c, turn + 1))
    return found / total, statistics.median(shares), sum(s > 0.5 for s in shares) / len(shares)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pods", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=1280)
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think-seconds", type=float, default=30)
    parser.add_argument("--arrivals-seconds", type=float, default=60)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--out", default="host_kv_store_policy.json")
    args = parser.parse_args()
    results = {}
    for name, store_type in (("segmented LRU", SegmentedLru), ("as built", HostKvStore)):
        runs = [simulate(store_type, seed, args) for seed in range(args.seeds)]
        hit, median, over_half = (statistics.mean(r[i] for r in runs) for i in range(3))
        results[name] = {"hit_rate": round(hit, 3), "median_share": round(median, 3),
                         "over_half": round(over_half, 3)}  # fmt: skip
        print(f"{name:13} hit rate {hit:.3f}  median request's share {median:.3f}  over half {over_half:.3f}")
    ratio = results["as built"]["hit_rate"] / results["segmented LRU"]["hit_rate"]
    print(f"as built: hit rate {ratio:.2f}x the segmented LRU's")
    out = ROOT / "bench" / "results" / args.out
    out.write_text(json.dumps({"args": vars(args), "results": results, "hit_rate_ratio": round(ratio, 3)},
                              indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
