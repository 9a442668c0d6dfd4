"""Tokenizers: characters for the small tasks, words for SCAN, SentencePiece for real corpora.

Every tokenizer shares the id conventions of the models: ``PAD_ID = 0`` (padding
and the decoder's start symbol), ``EOS_ID = 1`` (end of sequence), ``UNK_ID = 2``.
`encode` appends EOS; `decode` stops at the first EOS or PAD. `encode_flat`
encodes many texts at once into one flat array, as the input pipeline reads
them (a character vocabulary by one table lookup, without a Python list a
text).

Vocabularies are learned from the training split (source and target together:
one shared vocabulary) and cached in the data directory, beside a small JSON
file recording the settings they were built with. Loading a cached vocabulary
whose settings differ from the requested ones raises a ValueError that names
the file and the differing settings.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import numpy as np
import sentencepiece as spm

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
UNK_TEXT = "\u2047"  # what an unknown id decodes to (as SentencePiece does)


class Tokenizer(Protocol):
    """What the pipeline and the models need from a tokenizer."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def encode_flat(tokenizer: Tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """What `tokenizer.encode` gives each of `texts`, end to end in one array.

    A tokenizer with its own `encode_flat` (the character and SentencePiece
    ones) encodes the texts together; any other is called text by text.

    Returns:
      ids: int32 [sum(lengths)], each text's ids followed by its EOS_ID.
      lengths: int64 [len(texts)], each text's ids, its EOS included.
    """
    own = getattr(tokenizer, "encode_flat", None)
    if own is not None:
        return own(texts)
    return _flat_lists([tokenizer.encode(t) for t in texts])


def _flat_lists(encoded: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ids -> (int32 [total] ids end to end, int64 [n] lengths)."""
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    ids = np.fromiter(itertools.chain.from_iterable(encoded), np.int32, int(lengths.sum()))
    return ids, lengths


def _until_end(ids: Iterable[int]) -> list[int]:
    """The ids before the first EOS or PAD."""
    out = []
    for i in ids:
        i = int(i)
        if i in (PAD_ID, EOS_ID):
            break
        out.append(i)
    return out


class CharTokenizer:
    """One id per character: PAD=0, EOS=1, UNK=2, then the characters in sorted order."""

    kind = "char"

    def __init__(self, chars: Sequence[str]):
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError(f"chars must be distinct single characters, got {chars!r}")
        self.chars = tuple(chars)
        self._ids = {c: i + 3 for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars) + 3
        # The id of each code point up to the largest in the vocabulary, then one UNK
        # standing for every code point above it: int32 [max code point + 2].
        codes = np.array([ord(c) for c in self.chars], np.int64)
        self._table = np.full(int(codes.max(initial=-1)) + 2, UNK_ID, np.int32)
        self._table[codes] = np.arange(3, self.vocab_size, dtype=np.int32)

    @classmethod
    def train(cls, texts: Iterable[str]) -> CharTokenizer:
        """The tokenizer whose vocabulary is every character of `texts`, sorted."""
        seen: set[str] = set()
        for t in texts:
            seen.update(t)
        return cls(sorted(seen))

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        return [ids.get(c, UNK_ID) for c in text] + [EOS_ID]

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of `texts` end to end (see `encode_flat`): one table lookup for all."""
        lengths = np.fromiter(map(len, texts), np.int64, len(texts)) + 1  # [n], EOS included
        # A str is a sequence of code points: UTF-32 gives one uint32 each ("surrogatepass":
        # a lone surrogate is a code point too, an unknown character as in `encode`).
        text = "".join(texts).encode("utf-32-le", "surrogatepass")
        codes = np.frombuffer(text, np.uint32)  # [sum(lengths) - n]
        ids = np.full(int(lengths.sum()), EOS_ID, np.int32)
        chars = np.ones(len(ids), bool)
        chars[np.cumsum(lengths) - 1] = False  # each text's last slot keeps its EOS
        ids[chars] = self._table[np.minimum(codes, len(self._table) - 1)]
        return ids, lengths

    def decode(self, ids: Iterable[int]) -> str:
        chars = self.chars
        n = len(chars)
        return "".join(chars[i - 3] if 3 <= i < n + 3 else UNK_TEXT for i in _until_end(ids))

    def save(self, path: str) -> None:
        _write_atomic(path, json.dumps({"chars": list(self.chars)}, ensure_ascii=False).encode())

    @classmethod
    def load(cls, path: str) -> CharTokenizer:
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f)["chars"])


class WordTokenizer:
    """One id per space-separated word: PAD=0, EOS=1, UNK=2, then the words in sorted order.

    For tasks whose tokens are words (SCAN's commands and actions): texts are
    words joined by single spaces, and `decode` joins them the same way, so
    ``decode(encode(t)) == t`` for a text of known words.
    """

    kind = "word"

    def __init__(self, words: Sequence[str]):
        if len(set(words)) != len(words) or any(not w or " " in w for w in words):
            raise ValueError(f"words must be distinct, non-empty and without spaces, got {words!r}")
        self.words = tuple(words)
        self._ids = {w: i + 3 for i, w in enumerate(self.words)}
        self.vocab_size = len(self.words) + 3

    @classmethod
    def train(cls, texts: Iterable[str]) -> WordTokenizer:
        """The tokenizer whose vocabulary is every word of `texts`, sorted."""
        seen: set[str] = set()
        for t in texts:
            seen.update(w for w in t.split(" ") if w)
        return cls(sorted(seen))

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        return [ids.get(w, UNK_ID) for w in text.split(" ") if w] + [EOS_ID]

    def decode(self, ids: Iterable[int]) -> str:
        words = self.words
        n = len(words)
        return " ".join(words[i - 3] if 3 <= i < n + 3 else UNK_TEXT for i in _until_end(ids))

    def save(self, path: str) -> None:
        _write_atomic(path, json.dumps({"words": list(self.words)}, ensure_ascii=False).encode())

    @classmethod
    def load(cls, path: str) -> WordTokenizer:
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f)["words"])


class SentencePieceTokenizer:
    """A SentencePiece model with PAD=0, EOS=1, UNK=2 and no BOS."""

    kind = "spm"

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self._sp.get_piece_size()
        ids = (self._sp.pad_id(), self._sp.eos_id(), self._sp.unk_id(), self._sp.bos_id())
        if ids != (PAD_ID, EOS_ID, UNK_ID, -1):
            raise ValueError(
                f"SentencePiece model must have pad=0, eos=1, unk=2 and no bos; got "
                f"(pad, eos, unk, bos)={ids}"
            )

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        model_type: str = "unigram",
        character_coverage: float = 1.0,
    ) -> SentencePieceTokenizer:
        """Trains a SentencePiece model of exactly `vocab_size` pieces on `texts`."""
        model = _BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts),
                model_writer=model,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                pad_id=PAD_ID,
                eos_id=EOS_ID,
                unk_id=UNK_ID,
                bos_id=-1,
                input_sentence_size=2_000_000,
                shuffle_input_sentence=True,
                num_threads=os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError as e:
            raise ValueError(
                f"SentencePiece training failed for vocab_size={vocab_size}, "
                f"model_type={model_type!r}: {e}"
            ) from e
        return cls(model.value)

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text) + [EOS_ID]

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of `texts` end to end (see `encode_flat`): one SentencePiece call."""
        return _flat_lists([ids + [EOS_ID] for ids in self._sp.encode(list(texts))])

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(_until_end(ids))

    def save(self, path: str) -> None:
        _write_atomic(path, self.model_proto)

    @classmethod
    def load(cls, path: str) -> SentencePieceTokenizer:
        with open(path, "rb") as f:
            return cls(f.read())


class _BytesIO:
    """The `model_writer` SentencePiece writes the serialized model into."""

    value = b""

    def write(self, data: bytes) -> None:
        self.value += data


def _write_atomic(path: str, data: bytes) -> None:
    """Writes `data` to `path` so that readers never see a partial file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# name -> (tokenizer class, extra training kwargs, file suffix)
TOKENIZERS: dict[str, tuple[type, dict, str]] = {
    "char": (CharTokenizer, {}, "json"),
    "word": (WordTokenizer, {}, "json"),
    "spm": (SentencePieceTokenizer, {"model_type": "unigram"}, "model"),
    "spm_unigram": (SentencePieceTokenizer, {"model_type": "unigram"}, "model"),
    "spm_bpe": (SentencePieceTokenizer, {"model_type": "bpe"}, "model"),
}


def vocab_path(cache_dir: str, tokenizer: str, vocab_size: int) -> str:
    """Where the vocabulary of `tokenizer` is cached (the settings file adds `.settings.json`)."""
    _, _, suffix = TOKENIZERS[tokenizer]
    stem = tokenizer if tokenizer in ("char", "word") else f"{tokenizer}_{vocab_size}"
    return os.path.join(cache_dir, f"{stem}.{suffix}")


def get_tokenizer(
    tokenizer: str,
    *,
    vocab_size: int,
    cache_dir: str,
    settings: dict,
    texts: Callable[[], Iterable[str]],
) -> Tokenizer:
    """Loads the cached vocabulary, or learns it from `texts()` and caches it.

    Args:
      tokenizer: a key of `TOKENIZERS`: "char", "spm" (= "spm_unigram") or "spm_bpe".
      vocab_size: pieces of a SentencePiece vocabulary, PAD/EOS/UNK included
        (ignored by "char", whose vocabulary is the characters of the data).
      cache_dir: directory of the cached vocabulary files.
      settings: JSON-able description of what the vocabulary is learned from (dataset,
        split, keys); stored beside the vocabulary and checked on every load.
      texts: called (only when nothing is cached) to get the training texts.

    Raises:
      ValueError: unknown tokenizer name, or a cached vocabulary whose settings or
        size differ from the requested ones.
    """
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; expected one of {sorted(TOKENIZERS)}")
    cls, train_kwargs, _ = TOKENIZERS[tokenizer]
    if cls is SentencePieceTokenizer and vocab_size < 4:
        raise ValueError(f"vocab_size must be at least 4 for {tokenizer!r}, got {vocab_size}")
    settings = dict(settings, tokenizer=tokenizer, **train_kwargs)
    if cls is SentencePieceTokenizer:
        settings["vocab_size"] = vocab_size
    path = vocab_path(cache_dir, tokenizer, vocab_size)
    settings_path = path + ".settings.json"
    if os.path.exists(path):
        found = {}
        if os.path.exists(settings_path):
            with open(settings_path) as f:
                found = json.load(f)
        differ = {
            k: (found.get(k), settings.get(k))
            for k in sorted(set(found) | set(settings))
            if found.get(k) != settings.get(k)
        }
        if differ:
            details = ", ".join(
                f"{k}: cached {a!r} vs requested {b!r}" for k, a, b in _flat(differ)
            )
            raise ValueError(
                f"cached vocabulary {path} does not match the requested settings ({details}); "
                "delete it (and its .settings.json) to rebuild it, or request its settings"
            )
        try:
            tok = cls.load(path)
        except (ValueError, RuntimeError, OSError, KeyError) as e:
            raise ValueError(f"cached vocabulary {path} cannot be read: {e}") from e
        if cls is SentencePieceTokenizer and tok.vocab_size != vocab_size:
            raise ValueError(
                f"cached vocabulary {path} has {tok.vocab_size} pieces but vocab_size="
                f"{vocab_size} was requested; delete it to rebuild it"
            )
        _check_recorded_hash(path, tok)
        return tok
    if cls is SentencePieceTokenizer:
        tok = cls.train(texts(), vocab_size=vocab_size, **train_kwargs)
    else:
        tok = cls.train(texts())
    # Settings first: a crash in between leaves no vocabulary, so it is rebuilt.
    _write_atomic(settings_path, json.dumps(settings, indent=1, sort_keys=True).encode())
    tok.save(path)
    _write_atomic(path + HASH_SUFFIX, vocab_hash(tok).encode())
    return tok


HASH_SUFFIX = ".sha256"


def vocab_hash(tokenizer: Tokenizer) -> str:
    """``sha256:<hex>`` of a tokenizer's vocabulary (its characters in order, or its
    SentencePiece model): two tokenizers with equal hashes encode every text alike.

    Raises:
      ValueError: a tokenizer that is not a `CharTokenizer`, `WordTokenizer` or
        `SentencePieceTokenizer`.
    """
    if isinstance(tokenizer, CharTokenizer):
        data = json.dumps(list(tokenizer.chars), ensure_ascii=False).encode()
    elif isinstance(tokenizer, WordTokenizer):
        data = json.dumps({"words": list(tokenizer.words)}, ensure_ascii=False).encode()
    elif isinstance(tokenizer, SentencePieceTokenizer):
        data = tokenizer.model_proto
    else:
        raise ValueError(f"cannot hash a {type(tokenizer).__name__} tokenizer")
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _check_recorded_hash(path: str, tokenizer: Tokenizer) -> None:
    """Compares a cached vocabulary with the hash written when it was learned.

    A vocabulary cached before hashes were recorded gets its hash now. An
    edited file (a character removed, the same characters reordered) would
    otherwise map text to other ids without a word.

    Raises:
      ValueError: the file no longer matches its recorded hash.
    """
    hash_path = path + HASH_SUFFIX
    got = vocab_hash(tokenizer)
    if not os.path.exists(hash_path):
        try:
            _write_atomic(hash_path, got.encode())
        except OSError:  # read-only data directory: nothing to record into
            pass
        return
    with open(hash_path) as f:
        want = f.read().strip()
    if got != want:
        raise ValueError(
            f"cached vocabulary {path} was changed after it was learned ({got} != {want} "
            f"recorded in {hash_path}); delete both to learn it again"
        )


def _flat(differ: dict) -> list[tuple]:
    return [(k, a, b) for k, (a, b) in differ.items()]


# -- a run's own copy (the workdir keeps the vocabulary it trained with) ---------------

RUN_TOKENIZER = "tokenizer.json"  # {"kind": "char" | "spm", "file": <name>}; beside it the file


def save_to_dir(tokenizer: Tokenizer, directory: str) -> str:
    """Saves `tokenizer` into `directory` (a run's workdir) so the run is self-contained.

    Writes the vocabulary file (``tokenizer.chars.json`` or ``tokenizer.model``)
    and then `RUN_TOKENIZER` naming it; returns the path of `RUN_TOKENIZER`.

    Raises:
      ValueError: a tokenizer that is not a `CharTokenizer`, `WordTokenizer` or
        `SentencePieceTokenizer`.
    """
    if isinstance(tokenizer, CharTokenizer):
        kind, name = "char", "tokenizer.chars.json"
    elif isinstance(tokenizer, WordTokenizer):
        kind, name = "word", "tokenizer.words.json"
    elif isinstance(tokenizer, SentencePieceTokenizer):
        kind, name = "spm", "tokenizer.model"
    else:
        raise ValueError(f"cannot save a {type(tokenizer).__name__} tokenizer")
    tokenizer.save(os.path.join(directory, name))
    path = os.path.join(directory, RUN_TOKENIZER)
    _write_atomic(path, json.dumps({"kind": kind, "file": name}).encode())
    return path


def load_from_dir(directory: str) -> Tokenizer | None:
    """The tokenizer `save_to_dir` saved in `directory`, or None if there is none."""
    path = os.path.join(directory, RUN_TOKENIZER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        entry = json.load(f)
    cls = {"char": CharTokenizer, "word": WordTokenizer, "spm": SentencePieceTokenizer}[
        entry["kind"]
    ]
    return cls.load(os.path.join(directory, entry["file"]))


def check_saved(directory: str, tokenizer: Tokenizer) -> None:
    """Refuses to resume a run in `directory` with another vocabulary than it saved.

    A run's workdir keeps the tokenizer it started with (`save_to_dir`); a
    data set's vocabulary cache that was rebuilt or edited since (other
    characters, or the same in another order) maps text to other ids, so
    training on would silently be a different experiment.

    Raises:
      ValueError: the saved vocabulary differs from `tokenizer`'s (both hashes named).
    """
    saved = load_from_dir(directory)
    if saved is None or type(saved) is not type(tokenizer):
        return
    if vocab_hash(saved) != vocab_hash(tokenizer):
        raise ValueError(
            f"the run in {directory} was trained with the vocabulary in its {RUN_TOKENIZER} "
            f"({vocab_hash(saved)}), but the data set's tokenizer now has another "
            f"({vocab_hash(tokenizer)}): its vocabulary cache changed; restore it, or use a "
            "new workdir"
        )
