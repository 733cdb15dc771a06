"""Tokenizer stage: train a byte-level BPE locally, load any local HF tokenizer, fast exact encoder.

CLI::

    python -m pipeline.tokenize tokenizer train --input PATH_OR_GLOB... [--vocab-size N] --out DIR
        [--format auto|txt|jsonl|parquet] [--text-field F] [--doc-split file|blank-line]
        [--max-bytes N] [--special-token TOK ...] [--bos-token TOK] [--min-frequency N]
    python -m pipeline.tokenize tokenizer import --path DIR_OR_TOKENIZER_JSON --out DIR
    python -m pipeline.tokenize tokenizer fingerprint DIR

The trained directory holds ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` (written by ``transformers``), so
``transformers.AutoTokenizer.from_pretrained(DIR)`` loads it offline.

Encoding (:func:`make_encoder`): the fastest exact encoder for a loaded tokenizer, from
:mod:`pipeline.text.encoders` (a tiktoken fast path verified against HF ``encode_batch``, or HF).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts import MAX_VOCAB_SIZE, OUTPUT_MARKER, replacing_dir
from pipeline.errors import PipelineError
from pipeline.text.encoders import GPT2_PATTERN as GPT2_PATTERN
from pipeline.text.encoders import (
    HFEncoder,
    TiktokenEncoder,
    tiktoken_encoding_from_hf,
    verify_encoder,
)
from pipeline.text.encoders import byte_decoder as byte_decoder
from pipeline.text.encoders import cpu_count as cpu_count

EOS_TOKEN = "<|endoftext|>"
#: The longest run the BPE trainer sees as one word, in characters. The trainer's work on one
#: word grows with its length times the merges (a whitespace-free input is one word per piece:
#: 50 MB of "a" did not finish in 15 minutes), so for training only, a run of more
#: non-whitespace (or whitespace) characters than this is cut into pieces of this many before
#: the byte-level pre-tokenizer sees them (4 to 7 s for the same input). Natural words are far
#: shorter; no learned token can be longer; encoding is not cut.
TRAIN_MAX_RUN = 256
# \G continues a cut run where the last piece ended; the lookbehind starts one only at a run's
# first character, so each character is looked at a bounded number of times.
_LONG_RUN = r"(?:(?<!\S)|\G)\S{{{n}}}|(?:(?<!\s)|\G)\s{{{n}}}"
#: What a tokenizer folder written before output markers existed may hold (and be replaced).
TOKENIZER_DIR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                       "vocab.json", "merges.txt", "chat_template.jinja")
# Tried in order when a loaded tokenizer's config does not name its EOS/BOS token.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
_BOS_CANDIDATES = ("<|startoftext|>", "<s>", "<bos>", "<|begin_of_text|>")

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
                "with `python -m pipeline.tokenize tokenizer train`"
            )
        return tj
    if p.is_file():
        return p
    if p.exists():
        raise PipelineError(f"tokenizer {p} is neither a folder nor a regular file: point "
                            "--tokenizer at an HF tokenizer directory or its tokenizer.json")
    raise PipelineError(
        f"tokenizer {p} does not exist: train one with `python -m pipeline.tokenize tokenizer train "
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
    except OSError as e:
        raise PipelineError(f"tokenizer {tj} cannot be read ({e}); check its permissions") from e
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
        except (UnicodeDecodeError, json.JSONDecodeError, OSError) as e:
            raise PipelineError(f"{cfg_path} is not valid JSON ({e}); re-save the tokenizer") from e
        if not isinstance(cfg, dict):
            raise PipelineError(
                f"{cfg_path} is a JSON {type(cfg).__name__}, not an object: re-save the tokenizer"
            )
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
            "add one (e.g. retrain with `python -m pipeline.tokenize tokenizer train`)"
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
# Choosing the encoder
# ---------------------------------------------------------------------------------------------


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
    ``bos_token``, when given, is added as a special token and recorded as ``bos_token``. Runs
    longer than :data:`TRAIN_MAX_RUN` characters are cut for training (the saved tokenizer's
    pre-tokenizer is the plain byte-level one).
    Written atomically: into a temporary sibling directory, then swapped in; an existing
    ``out_dir`` is replaced only if this command wrote it (``pipeline.artifacts.replacing_dir``).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = list(
        dict.fromkeys([EOS_TOKEN, *special_tokens, *([bos_token] if bos_token else [])])
    )
    minimum = 256 + len(specials) + 1
    if vocab_size < minimum:
        raise PipelineError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens + "
            f"{len(specials)} special token(s) + at least one merge; use >= {minimum}"
        )
    if vocab_size > MAX_VOCAB_SIZE:  # the trainer would try to allocate for it
        raise PipelineError(f"vocab_size {vocab_size} is more than {MAX_VOCAB_SIZE}, the largest "
                            "vocabulary the pipeline trains (data.tokenizer.vocab_size)")
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LONG_RUN.format(n=TRAIN_MAX_RUN)), "isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),  # the library's own bars, at a terminal only
    )
    n_docs = 0

    def counted() -> Iterator[str]:
        nonlocal n_docs
        for t in texts:
            n_docs += 1
            yield t

    tok.train_from_iterator(counted(), trainer=trainer)
    tok.pre_tokenizer = byte_level  # the cut shapes training only: encoding splits as GPT-2 does
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
    with replacing_dir(Path(out_dir), OUTPUT_MARKER, TOKENIZER_DIR_FILES) as tmp:
        hf.save_pretrained(str(tmp))
        _write_hf_files(tmp, bos_token)
        _mark(tmp, "tokenizer train")
    return Path(out_dir)


def _mark(folder: Path, command: str) -> None:
    (folder / OUTPUT_MARKER).write_text(json.dumps({"written_by": command}) + "\n")


def _write_hf_files(tmp: Path, bos_token: str | None) -> None:
    """The tokenizer_config and special_tokens_map every transformers version loads."""
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


def import_tokenizer(path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Copy a local HF tokenizer (directory or ``tokenizer.json``) into ``out_dir``.

    It must load with ``tokenizers`` and have an EOS token. ``tokenizer.json`` is copied byte for
    byte (so the fingerprint is the source's); ``tokenizer_config.json`` and
    ``special_tokens_map.json`` are copied when present, else written from what was detected.
    Written atomically (temporary sibling directory, then swapped in), and only over a
    folder this command wrote before.
    """
    info = tokenizer_info(path)  # validates: loads, has an EOS
    out = Path(out_dir)
    with replacing_dir(out, OUTPUT_MARKER, TOKENIZER_DIR_FILES) as tmp:
        _copy_tokenizer(info, Path(path), tmp)
        _mark(tmp, "tokenizer import")
    return out


def _copy_tokenizer(info: TokenizerInfo, path: Path, tmp: Path) -> None:
    import shutil

    src_dir = info.path.parent
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


def _print_summary(out: Path, **extra: object) -> None:
    """One JSON line describing the tokenizer just written (what the rule logs)."""
    info = tokenizer_info(out)
    summary = {"out": str(out), "vocab_size": info.vocab_size, "eos_id": info.eos_id,
               "fingerprint": info.fingerprint, **extra}
    print(json.dumps(summary))


def _cmd_train(args: argparse.Namespace) -> int:
    from pipeline.text.readers import iter_texts
    from pipeline.text.sources import SourceSpec

    if (args.input is None) == (args.sources_json is None):
        raise PipelineError("give --input (sources read alike) or --sources-json, one of them")
    if args.input is not None:
        specs = [SourceSpec.from_args(
            args.input, fmt=args.format, text_field=args.text_field, doc_split=args.doc_split
        )]
    else:
        specs = _specs_from_json(args.sources_json)
    if args.max_bytes is not None and args.max_bytes < 1:
        raise PipelineError(f"--max-bytes {args.max_bytes} must be at least 1")
    if args.min_frequency < 0:
        raise PipelineError(f"--min-frequency {args.min_frequency} must be at least 0")
    for tok in [*(args.special_token or ()), *([args.bos_token] if args.bos_token is not None else [])]:
        if not tok.strip():
            raise PipelineError(f"special token {tok!r} is empty: name a token such as <|bos|>")
    skipped: dict[str, int] = {}
    examples: dict[str, str] = {}
    # Each source reads its own format; an equal share of the byte budget each, so that a small
    # source listed last still shapes the vocabulary.
    share = None if args.max_bytes is None else max(1, args.max_bytes // len(specs))
    texts = itertools.chain.from_iterable(
        iter_texts(spec, max_bytes=share, skipped=skipped, examples=examples) for spec in specs
    )
    try:
        out = train_tokenizer(
            texts,
            args.vocab_size,
            args.out,
            special_tokens=args.special_token or (),
            bos_token=args.bos_token,
            min_frequency=args.min_frequency,
        )
    except PipelineError as err:
        if examples and str(err).startswith("no usable documents"):
            eg = "; ".join(f"{k}: {v}" for k, v in examples.items())
            raise PipelineError(f"{err}; skipped {skipped} (e.g. {eg})") from None
        raise
    _print_summary(out, skipped=skipped)
    return 0


def _specs_from_json(text: str) -> list:
    """``--sources-json``: a list of ``{path, format, text_field, doc_split}`` (data.sources)."""
    from pipeline.text.sources import SourceSpec

    try:
        items = json.loads(text)
        specs = [
            SourceSpec.from_args(
                [it["path"]], fmt=it.get("format", "auto"), text_field=it.get("text_field", "text"),
                doc_split=it.get("doc_split", "file"),
            )
            for it in items
        ]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise PipelineError(
            f"--sources-json is not a list of {{path, format, text_field, doc_split}} ({e})"
        ) from None
    if not specs:
        raise PipelineError("--sources-json lists no source")
    return specs


def _parser() -> argparse.ArgumentParser:
    """Options that mirror a config key (``data.tokenizer.*``, ``data.sources[].*``) take its
    default and description from ``pipeline.config.schema``."""
    from pipeline.config.files import in_range, mirror_argument
    from pipeline.config.schema import TokenizerConfig
    from pipeline.text.readers import add_reader_arguments

    ap = argparse.ArgumentParser(
        prog="python -m pipeline.tokenize tokenizer", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train a byte-level BPE and save an HF tokenizer dir")
    tr.add_argument(
        "--input",
        nargs="+",
        help="files, globs or dirs; <stdlib> = Python's stdlib dir",
    )
    tr.add_argument(
        "--sources-json",
        help="instead of --input: a JSON list of data.sources entries (path, format, "
        "text_field, doc_split), each read its own way, each an equal share of --max-bytes",
    )
    mirror_argument(tr, "--vocab-size", TokenizerConfig, "vocab_size")
    tr.add_argument("--out", required=True, help="output tokenizer directory")
    add_reader_arguments(tr)
    mirror_argument(tr, "--max-bytes", TokenizerConfig, "train_max_bytes")
    tr.add_argument("--special-token", action="append", help="extra special token (repeatable)")
    tr.add_argument("--bos-token", default=None, help="add this BOS token (default: none)")
    tr.add_argument("--min-frequency", type=int, default=2,
                    help="merge only pairs seen at least this often (default: 2)",
                    **in_range(0, 2**32 - 1, "a count"))
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
        load_tokenizer(args.path)  # a tokenizer, not any JSON file
        print(fingerprint(args.path))
        return 0
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output folder cannot be written (permissions, a file in the way)
        where = e.filename or getattr(args, "out", None) or getattr(args, "path", "")
        print(f"error: {where}: {e.strerror or e}: check --out", file=sys.stderr)
        return 1
