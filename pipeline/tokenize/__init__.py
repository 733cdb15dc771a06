"""Tokenize stage: raw text → packed, sharded Arrow sequences + manifest.json.

``python -m pipeline.tokenize shard|gather ...`` (see ``__main__``); the Python API is
:func:`tokenize_shard`, :func:`gather` and :class:`SourceSpec`.
"""

from pipeline.text.sources import SourceSpec
from pipeline.tokenize.manifest import gather
from pipeline.tokenize.shard import shard_path, stats_path, tokenize_shard

__all__ = ["SourceSpec", "gather", "shard_path", "stats_path", "tokenize_shard"]
