"""Encoders: HF's ``encode_batch`` and an exact tiktoken fast path over the same vocabulary.

The encoder is the measured bottleneck of the tokenize stage, so for byte-level BPE
vocabularies whose ids follow merge order we build a ``tiktoken.Encoding`` from the same
vocabulary (byte-level unicode strings mapped back to bytes, ids as ranks). That is exact for
such vocabularies; :func:`pipeline.text.tokenizer.make_encoder` still verifies token identity against
the HF tokenizer on a sample when the encoder is built (and the tokenize stage re-verifies on the
first batch of real data) and falls back to HF ``encode_batch`` with a warning when anything
differs.

Special tokens that appear literally in the text are encoded as plain text by both encoders
(``encode_special_tokens = True`` on the HF side, ``encode_ordinary`` semantics on the tiktoken
side): a document containing the string ``<|endoftext|>`` must not inject an EOS id.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np

# GPT-2's pre-tokenizer regex: what HF's ByteLevel(use_regex=True) applies.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def cpu_count() -> int:
    """Cores this process may use (affinity-aware, so a Slurm/cgroup limit is respected)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-ins ByteLevel uses for bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class HFEncoder:
    """Reference encoder: HF ``Tokenizer.encode_batch`` (Rust threads), no special tokens added."""

    name = "hf"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids (int32 arrays) of each text."""
        # encode_batch_fast (tokenizers >= 0.21) skips offset tracking: same ids, less work.
        fn = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encs = fn(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def close(self) -> None:
        """Nothing to release (kept for interface symmetry)."""


class TiktokenEncoder:
    """Exact fast path: a ``tiktoken.Encoding`` over the same byte-level BPE vocabulary.

    Texts are encoded by a persistent thread pool; tiktoken releases the GIL inside its Rust core
    and returns a numpy buffer (``encode_to_numpy``), so no Python int lists are built.
    """

    name = "tiktoken"

    def __init__(self, encoding, num_threads: int | None = None) -> None:
        self.encoding = encoding
        self.num_threads = num_threads or cpu_count()
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="tiktoken")

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        enc = self.encoding
        # disallowed_special=() + no specials registered = encode_ordinary semantics.
        return [enc.encode_to_numpy(t, disallowed_special=()).astype(np.int32) for t in texts]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids (int32 arrays) of each text, encoded on ``num_threads`` threads."""
        if len(texts) <= 1 or self.num_threads == 1:
            return self._encode_many(texts)
        # Chunk by characters so threads get similar work whatever the document sizes.
        total = sum(len(t) for t in texts)
        target = max(1, total // (self.num_threads * 4))
        chunks: list[list[str]] = []
        cur: list[str] = []
        size = 0
        for t in texts:
            cur.append(t)
            size += len(t)
            if size >= target:
                chunks.append(cur)
                cur, size = [], 0
        if cur:
            chunks.append(cur)
        out: list[np.ndarray] = []
        for part in self._pool.map(self._encode_many, chunks):
            out.extend(part)
        return out

    def close(self) -> None:
        """Stop the worker threads."""
        self._pool.shutdown(wait=False)


def _pattern_of(pre: dict | None) -> str | None:
    """The tiktoken split pattern equivalent to an HF pre-tokenizer, or None if there is none."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre.get("type") == "Sequence":
        items = pre.get("pretokenizers") or []
        # Llama-3 / cl100k style: Split(Regex, Isolated) followed by ByteLevel(use_regex=False).
        if (
            len(items) == 2
            and items[0].get("type") == "Split"
            and "Regex" in (items[0].get("pattern") or {})
            and items[0].get("behavior") == "Isolated"
            and not items[0].get("invert", False)
            and items[1].get("type") == "ByteLevel"
            and not items[1].get("use_regex", True)
            and not items[1].get("add_prefix_space")
        ):
            return items[0]["pattern"]["Regex"]
    return None


def tiktoken_encoding_from_hf(tokenizer):  # -> tiktoken.Encoding | None
    """Build a ``tiktoken.Encoding`` from a byte-level BPE HF tokenizer; None if not convertible.

    Exact only when the HF model is a byte-level BPE without normaliser whose merged-token ids
    increase in merge order (true for ``tokenizers``-trained and GPT-2-style vocabularies),
    because tiktoken merges by rank of the merged token while HF merges by merge index.
    """
    import tiktoken

    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("normalizer") is not None:
        return None
    if model.get("byte_fallback") or model.get("continuing_subword_prefix"):
        return None
    if model.get("end_of_word_suffix"):
        return None
    pattern = _pattern_of(spec.get("pre_tokenizer"))
    if pattern is None:
        return None
    dec = byte_decoder()
    added = {a["content"] for a in spec.get("added_tokens") or []}
    ranks: dict[bytes, int] = {}
    try:
        for tok, idx in model["vocab"].items():
            if tok in added:
                continue
            ranks[bytes(dec[c] for c in tok)] = idx
    except KeyError:
        return None  # a vocabulary entry that is not byte-level
    if len(ranks) != len(set(ranks.values())) or any(bytes([b]) not in ranks for b in range(256)):
        return None
    # Merge order must equal rank order of the merged tokens.
    last = -1
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        r = model["vocab"].get(a + b)
        if r is None or r <= last:
            return None
        last = r
    try:
        return tiktoken.Encoding(
            name="zerosnake-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
        )
    except Exception:  # tiktoken rejects patterns its regex engine cannot compile
        return None


def verify_encoder(fast, reference: HFEncoder, texts: Iterable[str]) -> str | None:
    """Compare ``fast`` against the HF reference on ``texts``; a description of the first
    difference, or None when every text gives identical ids."""
    texts = list(texts)
    for t, a, b in zip(texts, fast.encode_batch(texts), reference.encode_batch(texts), strict=True):
        if not np.array_equal(a, b):
            n = int(np.argmax(a[: min(len(a), len(b))] != b[: min(len(a), len(b))]))
            return f"ids differ at token {n} of a {len(t)}-character text starting {t[:40]!r}"
    return None
