"""Data: local tfds builders, tokenizers, and a grain pipeline with packing.

    task = jattn.data.load("numbers", data_dir=...)           # prepares it once
    loader = jattn.data.make_loader(
        task, "train", batch_size=64, max_len=64, max_input_len=16, seed=0
    )
    it = iter(loader)
    batch = next(it)    # int32: inputs* [64, 16], targets* [64, 64]
                        # (tokens, *_segment_ids, *_positions); max_input_len
                        # None = max_len for both sides

Checkpoint the iterator with the train state in one orbax step: see
`jattn.data.checkpoint`.
"""

from jattn.data.packing import BATCH_KEYS, pad_to_row, unpack
from jattn.data.pipeline import LoaderIO, loader_stats, make_loader, measure_loader
from jattn.data.tasks import Task, TextSource, load
from jattn.data.tokenizers import (
    EOS_ID,
    PAD_ID,
    UNK_ID,
    CharTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    WordTokenizer,
)

__all__ = [
    "BATCH_KEYS",
    "EOS_ID",
    "LoaderIO",
    "PAD_ID",
    "UNK_ID",
    "CharTokenizer",
    "SentencePieceTokenizer",
    "Task",
    "TextSource",
    "Tokenizer",
    "WordTokenizer",
    "load",
    "loader_stats",
    "make_loader",
    "measure_loader",
    "pad_to_row",
    "unpack",
]
