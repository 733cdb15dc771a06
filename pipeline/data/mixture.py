"""Data mixtures: which source each entry of the training stream comes from.

Pure arithmetic over the sources' row ranges (no shards opened, no torch): the loader
(:mod:`pipeline.data.loader`) draws by it; render states it in ``plan.md`` (:func:`mixture_plan_line`);
reports show target and consumed shares (:func:`mixture_shares`).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from pipeline.errors import PipelineError

#: The name of the one source of a data directory whose manifest names none (the config's
#: default name of a single unnamed source, ``data.sources[0]`` → ``source0``).
DEFAULT_SOURCE = "source0"


#: Entries of the mixed stream computed at a time (amortises the merge; a few hundred KB).
MIX_CHUNK = 8192


class Mixture:
    """Which source each entry of the global stream comes from, by weight: exactly, seeded.

    Megatron-LM's blended datasets put sample ``i`` in the source furthest below its share
    (``weight * (i + 1) - drawn``); the same idea in closed form: source ``s`` (normalised weight
    ``w_s``, phase ``u_s`` in [0, 1) drawn from the seed) has its ``k``-th draw at time
    ``(k + u_s) / w_s``, and the stream is all draws in time order (ties by source order). Every
    prefix of the stream then holds each source's share to within one sequence, the order is a
    function of the seed and the entry index alone (not of how entries are batched or split
    among ranks), and the continuation from any position needs only each source's draw count.
    The ``k``-th draw of source ``s`` is row ``perm[k % n_s]`` of its range, ``perm`` being the
    seeded permutation of its epoch ``k // n_s``: a source that runs out starts over, reshuffled.
    """

    def __init__(
        self, sources: list[tuple[str, int, int]], weights: dict[str, float], seed: int
    ) -> None:
        known = {name: (lo, hi) for name, lo, hi in sources}
        unknown = sorted(set(weights) - set(known))
        if unknown:
            raise PipelineError(
                f"train.mixture names {unknown}, which the tokenized data does not have (its "
                f"sources: {sorted(known)}): rerun the tokenize stage or fix train.mixture"
            )
        for name, w in weights.items():
            if not (w > 0 and np.isfinite(w)):
                raise PipelineError(f"train.mixture.{name}: weight {w} must be a finite number > 0")
            if known[name][1] == known[name][0]:
                raise PipelineError(
                    f"train.mixture.{name}: source {name!r} has no training sequences (too few "
                    "tokens for one sequence of data.seq_len); drop it from train.mixture"
                )
        # Sources in manifest order (a fixed order: the tie-break and the state's layout).
        self.names = [n for n, _, _ in sources if n in weights]
        total = float(sum(weights[n] for n in self.names))
        self.weights = np.array([weights[n] / total for n in self.names], dtype=np.float64)
        self.lo = np.array([known[n][0] for n in self.names], dtype=np.int64)
        self.size = np.array([known[n][1] - known[n][0] for n in self.names], dtype=np.int64)
        self.phase = np.array(
            [np.random.default_rng([seed, _key(n), 0]).random() for n in self.names]
        )
        self.seed = seed
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def time(self, s: int, k: np.ndarray | int) -> np.ndarray | float:
        """When source ``s``'s ``k``-th draw comes (the one formula every computation uses)."""
        return (k + self.phase[s]) / self.weights[s]

    def chunk(self, drawn: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``count`` entries after ``drawn[s]`` draws of each source: (source, draw k)."""
        S = len(self.names)
        ks = drawn[:, None] + np.arange(count, dtype=np.int64)[None, :]  # (S, count)
        times = np.stack([self.time(s, ks[s]) for s in range(S)])
        srcs = np.broadcast_to(np.arange(S)[:, None], ks.shape)
        # Each source offers `count` candidates, so the first `count` in time order are exact.
        order = np.lexsort((srcs.ravel(), times.ravel()))[:count]
        return srcs.ravel()[order], ks.ravel()[order]

    def rows(self, src: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Global row index of each (source, draw) pair."""
        out = np.empty(len(src), dtype=np.int64)
        epoch, off = np.divmod(k, self.size[src])
        # Group the entries by (source, epoch) in one sort: a tiny source may pass through
        # thousands of epochs in one chunk.
        keys, inv = np.unique(np.stack([src, epoch]), axis=1, return_inverse=True)
        inv = inv.reshape(-1)
        order = np.argsort(inv, kind="stable")
        ends = np.cumsum(np.bincount(inv, minlength=keys.shape[1]))
        for g, (s, e) in enumerate(keys.T.tolist()):
            sel = order[(ends[g - 1] if g else 0) : ends[g]]
            out[sel] = self.lo[s] + self._perm(s, e)[off[sel]]
        return out

    def _perm(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        p = self._perms.get(key)
        if p is None:
            if len(self._perms) > 2 * len(self.names):  # keep the current epochs only
                self._perms.clear()
            p = np.random.default_rng([self.seed, _key(self.names[s]), 1 + epoch]).permutation(
                int(self.size[s])
            )
            self._perms[key] = p
        return p

    def before(self, s: int, k: int) -> int:
        """How many stream entries precede source ``s``'s ``k``-th draw."""
        t = self.time(s, k)
        total = 0
        for j in range(len(self.names)):
            if j == s:
                total += k
                continue

            def earlier(kk: int, j: int = j) -> bool:
                tj = self.time(j, kk)
                return bool(tj < t or (tj == t and j < s))

            # Estimate from the formula, then settle float rounding on the same expression.
            c = max(0, int(np.ceil(t * self.weights[j] - self.phase[j])))
            while c > 0 and not earlier(c - 1):
                c -= 1
            while earlier(c):
                c += 1
            total += c
        return total

    def exhausted_at(self) -> int:
        """The stream position where the first source would start its second epoch."""
        return min(self.before(s, int(n)) for s, n in enumerate(self.size))

    def drawn_at(self, position: int) -> np.ndarray:
        """Each source's draw count after ``position`` entries (a search on the merge time)."""
        drawn = np.zeros(len(self.names), dtype=np.int64)
        if position == 0:
            return drawn
        # Draws of s before entry `position`: the largest k with before(s, k) < position.
        for s in range(len(self.names)):
            lo, hi = 0, position  # before(s, lo) <= ... ; before(s, position) >= position
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.before(s, mid - 1) < position:
                    lo = mid
                else:
                    hi = mid - 1
            drawn[s] = lo
        return drawn


def _key(name: str) -> int:
    """A source's stable RNG key (its name's CRC-32: independent of the sources' order)."""
    return zlib.crc32(name.encode())


def source_sizes(manifest: dict) -> dict[str, int]:
    """Training tokens of each source of a data manifest, in its order (a manifest from before
    named sources holds one, :data:`DEFAULT_SOURCE`)."""
    by = manifest.get("by_source")
    if isinstance(by, dict) and by:
        return {str(n): int(e["train"]["tokens"]) for n, e in by.items()}
    return {DEFAULT_SOURCE: int(manifest["splits"]["train"]["tokens"])}


def mixture_shares(
    sizes: dict[str, int], mixture: dict[str, float] | None, consumed: dict[str, int] | None
) -> dict[str, dict[str, float | None]]:
    """Each source's target and consumed share of the training tokens, for reports.

    ``sizes``: each source's training tokens (:func:`source_sizes`); ``mixture``: the run's
    ``train.mixture`` (None: in proportion to ``sizes``; a source it leaves out has target 0);
    ``consumed``: ``train.done``'s ``tokens_by_source`` (None: not known, consumed is None).
    """
    if mixture is None:
        total = float(sum(sizes.values())) or 1.0
        target = {n: sizes[n] / total for n in sizes}
    else:
        total = float(sum(mixture.values()))
        target = {n: mixture.get(n, 0.0) / total for n in sizes}
    used = float(sum((consumed or {}).values()))
    return {
        n: {
            "target": target[n],
            "consumed": None if consumed is None else (consumed.get(n, 0) / used if used else 0.0),
        }
        for n in sizes
    }


def mixture_plan_line(
    manifest: dict | None, train: Any, global_batch: int
) -> str:
    """plan.md's line on the data mixture: the weights, and what happens when a source runs out
    (``train``: the run's TrainConfig; ``global_batch``: sequences per optimizer step)."""
    mixture, on = train.mixture, train.on_source_exhausted
    what = "in proportion to tokens" if mixture is None else ", ".join(
        f"{n} {w / sum(mixture.values()):.0%}" for n, w in mixture.items())
    head = f"- Data: {what} (train.mixture); a source that runs out "
    head += ("starts over, reshuffled" if on == "repeat" else "ends training") + (
        f" (train.on_source_exhausted: {on})")
    if manifest is None:
        return head
    seqs = {n: t // int(manifest["seq_len"]) for n, t in source_sizes(manifest).items()}
    lo, ranges = 0, []
    for n, k in seqs.items():
        ranges.append((n, lo, lo + k))
        lo += k
    drawn = global_batch * train.max_steps
    if mixture is None:
        passes = drawn / max(1, lo)
        end = lo // global_batch
        return head + (f"; {passes:.2f} passes over the data in {train.max_steps} steps"
                       if on == "repeat" or end >= train.max_steps
                       else f": it stops at step {end} of {train.max_steps}")
    mix = Mixture(ranges, mixture, train.seed)
    if on == "stop":
        end = mix.exhausted_at() // global_batch
        if end < train.max_steps:
            return head + f": it stops at step {end} of {train.max_steps}"
        return head + f"; no source runs out in {train.max_steps} steps"
    passes = ", ".join(
        f"{n} {w * drawn / k:.2f}×" for n, w, k in zip(mix.names, mix.weights, mix.size, strict=True))
    return head + f"; passes over each source in {train.max_steps} steps: {passes}"
