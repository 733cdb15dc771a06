"""Tokenizer stage: train a byte-level BPE locally, load any local HF tokenizer, fast exact encoder.

CLI::

    python -m pipeline.tokenizer train --input PATH_OR_GLOB... [--vocab-size N] --out DIR
        [--format auto|txt|jsonl|parquet] [--text-field F] [--doc-split file|blank-line]
        [--max-bytes N] [--special-token TOK ...] [--bos-token TOK] [--min-frequency N]
    python -m pipeline.tokenizer import --path DIR_OR_TOKENIZER_JSON --out DIR
    python -m pipeline.tokenizer fingerprint DIR

The trained directory holds ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` (written by ``transformers``), so
``transformers.AutoTokenizer.from_pretrained(DIR)`` loads it offline.

Encoding (:func:`make_encoder`): the encoder is the measured bottleneck of the tokenize stage, so
for byte-level BPE vocabularies whose ids follow merge order we build a ``tiktoken.Encoding`` from
the same vocabulary (byte-level unicode strings mapped back to bytes, ids as ranks). That is exact
for such vocabularies; we still verify token identity against the HF tokenizer on a sample when
the encoder is built (and the tokenize stage re-verifies on the first batch of real data) and fall
back to HF ``encode_batch`` with a warning when anything differs.

Special tokens that appear literally in the text are encoded as plain text by both encoders
(``encode_special_tokens = True`` on the HF side, ``encode_ordinary`` semantics on the tiktoken
side): a document containing the string ``<|endoftext|>`` must not inject an EOS id.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError

EOS_TOKEN = "<|endoftext|>"
# Tried in order when a loaded tokenizer's config does not name its EOS/BOS token.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
_BOS_CANDIDATES = ("<|startoftext|>", "<s>", "<bos>", "<|begin_of_text|>")

# GPT-2's pre-tokenizer regex: what HF's ByteLevel(use_regex=True) applies.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# A fixed, diverse sample used to verify the fast encoder when it is built: code, prose,
# contractions, digits, whitespace runs, non-Latin scripts, emoji, literal special-token text.
_VERIFY_SAMPLE = (
    "Hello, world! It's 2026; we'll see—don't they've? 12345 678.9e-3",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindented\ttabs   \n",
    "Ünïcödé façade, naïve café; Ελληνικά, русский, 日本語のテキスト, 中文, 한국어, עברית, العربية",
    "emoji 🙂🚀👩‍💻 and symbols ∑∫√≤≥ ©®™ … «quotes» „more“",
    "   leading spaces\n\n\r\nCRLF line\r\n  \n trailing   ",
    "literal special text <|endoftext|> must stay text </s> <s>",
    "a" * 300 + " " + "ab" * 200 + "\n" + "1" * 64 + " " + "=" * 80,
)


def cpu_count() -> int:
    """Cores this process may use (affinity-aware, so a Slurm/cgroup limit is respected)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------
# Loading and describing a tokenizer
# ---------------------------------------------------------------------------------------------


def _tokenizer_json_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if p.is_dir():
        tj = p / "tokenizer.json"
        if not tj.is_file():
            raise PipelineError(
                f"tokenizer directory {p} has no tokenizer.json: point --tokenizer at an HF "
                "tokenizer directory saved by a fast tokenizer (save_pretrained), or train one "
                "with `python -m pipeline.tokenizer train`"
            )
        return tj
    if p.is_file():
        return p
    raise PipelineError(
        f"tokenizer {p} does not exist: train one with `python -m pipeline.tokenizer train "
        "--input ... --vocab-size N --out DIR` or point --tokenizer at a local HF tokenizer "
        "directory (or its tokenizer.json)"
    )


def fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 of the canonical form of ``tokenizer.json`` (dir or file path).

    Canonical = parsed and re-serialised with sorted keys and no whitespace, so that formatting
    differences between writers do not change the fingerprint but any vocabulary, merge,
    normaliser or special-token change does.
    """
    tj = _tokenizer_json_path(path)
    try:
        obj = json.loads(tj.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PipelineError(f"{tj} is not valid JSON ({e}); re-save the tokenizer") from e
    canon = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


@dataclass
class TokenizerInfo:
    """What the pipeline needs to know about a tokenizer (recorded in the data manifest)."""

    path: Path  # the tokenizer.json file
    fingerprint: str
    vocab_size: int
    eos_token: str
    eos_id: int
    bos_token: str | None = None
    bos_id: int | None = None
    config: dict = field(default_factory=dict)  # tokenizer_config.json, when present


def _token_name(value: object) -> str | None:
    """tokenizer_config values are a string or an AddedToken-like dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def load_tokenizer(path: str | os.PathLike[str]):  # -> tokenizers.Tokenizer
    """Load a ``tokenizers.Tokenizer`` from an HF tokenizer dir or a ``tokenizer.json`` file."""
    from tokenizers import Tokenizer

    tj = _tokenizer_json_path(path)
    try:
        tok = Tokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises a bare Exception on bad files
        raise PipelineError(f"cannot load tokenizer {tj}: {e}; re-save or retrain it") from e
    # Literal special-token text inside documents is data, not control: encode it as text.
    tok.encode_special_tokens = True
    return tok


def tokenizer_info(path: str | os.PathLike[str], *, bos: bool = False) -> TokenizerInfo:
    """Describe the tokenizer at ``path``: fingerprint, vocab size, EOS (and BOS when asked)."""
    tj = _tokenizer_json_path(path)
    tok = load_tokenizer(tj)
    cfg_path = tj.parent / "tokenizer_config.json"
    cfg: dict = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PipelineError(f"{cfg_path} is not valid JSON ({e}); re-save the tokenizer") from e
    vocab = tok.get_vocab(with_added_tokens=True)

    def pick(key: str, candidates: Sequence[str]) -> str | None:
        name = _token_name(cfg.get(key))
        if name is not None and name in vocab:
            return name
        return next((c for c in candidates if c in vocab), None)

    eos = pick("eos_token", _EOS_CANDIDATES)
    if eos is None:
        raise PipelineError(
            f"tokenizer {tj} has no EOS token (no eos_token in tokenizer_config.json and none of "
            f"{', '.join(_EOS_CANDIDATES)} in the vocabulary): documents are joined by EOS, so "
            "add one (e.g. retrain with `python -m pipeline.tokenizer train`)"
        )
    bos_tok = None
    if bos:
        bos_tok = pick("bos_token", _BOS_CANDIDATES)
        if bos_tok is None:
            raise PipelineError(
                f"--bos was given but tokenizer {tj} has no BOS token (set bos_token in "
                "tokenizer_config.json or retrain with --bos-token); or drop --bos"
            )
    return TokenizerInfo(
        path=tj,
        fingerprint=fingerprint(tj),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_token=eos,
        eos_id=vocab[eos],
        bos_token=bos_tok,
        bos_id=vocab[bos_tok] if bos_tok is not None else None,
        config=cfg,
    )


# ---------------------------------------------------------------------------------------------
# Encoders
# ---------------------------------------------------------------------------------------------


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


def make_encoder(
    tokenizer, *, fast: bool = True, num_threads: int | None = None, sample: Iterable[str] = ()
):
    """The fastest exact encoder for ``tokenizer`` (a ``tokenizers.Tokenizer``).

    Returns a ``TiktokenEncoder`` when the vocabulary converts and the ids match HF's on the
    built-in sample plus ``sample``; otherwise an ``HFEncoder`` (with a warning when a fast path
    existed but disagreed).
    """
    ref = HFEncoder(tokenizer)
    if not fast:
        return ref
    encoding = tiktoken_encoding_from_hf(tokenizer)
    if encoding is None:
        return ref
    enc = TiktokenEncoder(encoding, num_threads=num_threads)
    diff = verify_encoder(enc, ref, [*_VERIFY_SAMPLE, *sample])
    if diff is not None:
        enc.close()
        warnings.warn(
            f"fast tiktoken encoder disagrees with the HF tokenizer ({diff}); "
            "falling back to HF encode_batch (exact, slower)",
            RuntimeWarning,
            stacklevel=2,
        )
        return ref
    return enc


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike[str],
    *,
    special_tokens: Sequence[str] = (EOS_TOKEN,),
    bos_token: str | None = None,
    min_frequency: int = 2,
) -> Path:
    """Train a byte-level BPE on ``texts`` and save an HF tokenizer directory at ``out_dir``.

    ``special_tokens`` get the first ids (``<|endoftext|>`` is always included and is the EOS);
    ``bos_token``, when given, is added as a special token and recorded as ``bos_token``.
    Written atomically: into a temporary sibling directory, then renamed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = list(
        dict.fromkeys([EOS_TOKEN, *special_tokens, *([bos_token] if bos_token else [])])
    )
    minimum = 256 + len(specials) + 1
    if vocab_size < minimum:
        raise PipelineError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens + "
            f"{len(specials)} special token(s) + at least one merge; use >= {minimum}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    n_docs = 0

    def counted() -> Iterator[str]:
        nonlocal n_docs
        for t in texts:
            n_docs += 1
            yield t

    tok.train_from_iterator(counted(), trainer=trainer)
    if n_docs == 0:
        raise PipelineError(
            "no usable documents to train the tokenizer on: check --input, --format and "
            "--text-field (empty and invalid-UTF-8 documents are skipped)"
        )

    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=bos_token,
        pad_token=EOS_TOKEN,  # causal LMs have no pad; EOS is the usual stand-in for evaluators
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    hf.save_pretrained(str(tmp))
    # transformers 5 writes its own class name ("TokenizersBackend"), which transformers 4 cannot
    # load; PreTrainedTokenizerFast loads in both, and clusters often pin an older transformers.
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    stm = tmp / "special_tokens_map.json"
    # transformers 5 folds special_tokens_map.json into tokenizer_config.json; the contract lists it.
    if not stm.exists():
        m = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
        if bos_token:
            m["bos_token"] = bos_token
        stm.write_text(json.dumps(m, indent=2) + "\n", encoding="utf-8")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def import_tokenizer(path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Copy a local HF tokenizer (directory or ``tokenizer.json``) into ``out_dir``.

    It must load with ``tokenizers`` and have an EOS token. ``tokenizer.json`` is copied byte for
    byte (so the fingerprint is the source's); ``tokenizer_config.json`` and
    ``special_tokens_map.json`` are copied when present, else written from what was detected.
    Written atomically (temporary sibling directory, then rename).
    """
    import shutil

    info = tokenizer_info(path)  # validates: loads, has an EOS
    src_dir = info.path.parent
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    shutil.copyfile(info.path, tmp / "tokenizer.json")
    copied_cfg = False
    if Path(path).is_dir():
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (src_dir / name).is_file():
                shutil.copyfile(src_dir / name, tmp / name)
                copied_cfg = copied_cfg or name == "tokenizer_config.json"
    if not copied_cfg:
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": info.eos_token,
            "pad_token": info.eos_token,
            "clean_up_tokenization_spaces": False,
        }
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(cfg, indent=2) + "\n", encoding="utf-8"
        )
    if not (tmp / "special_tokens_map.json").is_file():
        m = {"eos_token": info.eos_token, "pad_token": info.eos_token}
        (tmp / "special_tokens_map.json").write_text(
            json.dumps(m, indent=2) + "\n", encoding="utf-8"
        )
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _print_summary(out: Path, **extra: object) -> None:
    """One JSON line describing the tokenizer just written (what the rule logs)."""
    info = tokenizer_info(out)
    summary = {"out": str(out), "vocab_size": info.vocab_size, "eos_id": info.eos_id,
               "fingerprint": info.fingerprint, **extra}
    print(json.dumps(summary))


def _cmd_train(args: argparse.Namespace) -> int:
    from pipeline.readers import iter_texts
    from pipeline.sources import SourceSpec

    spec = SourceSpec.from_args(
        args.input, fmt=args.format, text_field=args.text_field, doc_split=args.doc_split
    )
    skipped: dict[str, int] = {}
    texts = iter_texts(spec, max_bytes=args.max_bytes, skipped=skipped)
    out = train_tokenizer(
        texts,
        args.vocab_size,
        args.out,
        special_tokens=args.special_token or (),
        bos_token=args.bos_token,
        min_frequency=args.min_frequency,
    )
    _print_summary(out, skipped=skipped)
    return 0


def _parser() -> argparse.ArgumentParser:
    """Options that mirror a config key (``data.tokenizer.*``, ``data.sources[].*``) take its
    default and description from ``pipeline.config``."""
    from pipeline.config import TokenizerConfig, mirror_argument
    from pipeline.readers import add_reader_arguments

    ap = argparse.ArgumentParser(
        prog="python -m pipeline.tokenizer", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train a byte-level BPE and save an HF tokenizer dir")
    tr.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, globs or dirs; <stdlib> = Python's stdlib dir",
    )
    mirror_argument(tr, "--vocab-size", TokenizerConfig, "vocab_size")
    tr.add_argument("--out", required=True, help="output tokenizer directory")
    add_reader_arguments(tr)
    mirror_argument(tr, "--max-bytes", TokenizerConfig, "train_max_bytes")
    tr.add_argument("--special-token", action="append", help="extra special token (repeatable)")
    tr.add_argument("--bos-token", default=None, help="add this BOS token (default: none)")
    tr.add_argument("--min-frequency", type=int, default=2)
    im = sub.add_parser("import", help="copy a local HF tokenizer dir or tokenizer.json into --out")
    im.add_argument("--path", required=True, help="HF tokenizer directory or tokenizer.json")
    im.add_argument("--out", required=True, help="output tokenizer directory")
    fp = sub.add_parser("fingerprint", help="print the sha256 fingerprint of a tokenizer")
    fp.add_argument("path")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 with ``error: ...`` on a user error)."""
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "train":
            return _cmd_train(args)
        if args.cmd == "import":
            _print_summary(import_tokenizer(args.path, args.out))
            return 0
        print(fingerprint(args.path))
        return 0
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
