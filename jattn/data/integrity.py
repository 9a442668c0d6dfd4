"""Prepared data is checked, not trusted: record counts and checksums of every split.

tfds records how many examples each split has (``dataset_info.json``), but
reading a split never checks its files against that: a truncated
``.array_record`` shard reads as fewer records, or as records whose features
are missing, and two swapped shards read as another data set. Training on
them would be a different experiment that looks like the intended one.

So when a data set is prepared (or, for data prepared before this check
existed, the first time it is read) `record` writes ``jattn_integrity.json``
beside its files: per shard, its size in bytes, its number of records (from
the array_record footer, which the reader finds without scanning the file)
and a checksum. Every later `load` calls `verify`, which recomputes the three
and raises a `DataIntegrityError` naming the file that differs.

The checksum must be cheap enough to compute on every start, also for
gigabytes of WMT: files up to `_FULL_HASH_BYTES` are hashed whole, larger
ones by their size, their first and last MiB and `_SAMPLES` evenly spaced
MiB blocks. Truncation, swapping and replacement are always caught (size,
footer and head/tail change); a bit flip in the middle of a large file may
not be, and is left to the array_record chunk checksums that fail when the
record is read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "MANIFEST",
    "DataIntegrityError",
    "file_checksum",
    "manifest",
    "record",
    "verify",
]

MANIFEST = "jattn_integrity.json"
_FULL_HASH_BYTES = 64 << 20  # files up to this size are hashed whole
_BLOCK = 1 << 20
_SAMPLES = 16


class DataIntegrityError(ValueError):
    """Prepared data that does not match what was recorded when it was prepared."""


def file_checksum(path: str) -> str:
    """``sha256:<hex>`` of a file: whole up to 64 MiB, else size + sampled 1 MiB blocks."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _FULL_HASH_BYTES:
            for block in iter(lambda: f.read(_BLOCK), b""):
                digest.update(block)
        else:
            step = (size - _BLOCK) // (_SAMPLES + 1)
            offsets = [0, *(step * (i + 1) for i in range(_SAMPLES)), size - _BLOCK]
            for offset in offsets:
                f.seek(offset)
                digest.update(f.read(_BLOCK))
    kind = "sha256" if size <= _FULL_HASH_BYTES else "sha256-sampled"
    return f"{kind}:{digest.hexdigest()}"


def _num_records(path: str) -> int:
    """Records in one array_record shard, from its footer (a truncated file reads 0)."""
    from array_record.python import array_record_module  # noqa: PLC0415

    try:
        reader = array_record_module.ArrayRecordReader(path)
        count = int(reader.num_records())
        reader.close()  # reports a damaged file too
    except (RuntimeError, OSError, ValueError) as e:
        raise DataIntegrityError(
            f"data file {path} is damaged ({str(e).splitlines()[0] if str(e) else e!r}); "
            f"delete {os.path.dirname(path)} to prepare the data set again"
        ) from None
    return count


def _shard(path: str) -> dict[str, Any]:
    return {
        "bytes": os.path.getsize(path),
        "records": _num_records(path),
        "checksum": file_checksum(path),
    }


def manifest(split_files: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """``{split: {"records": n, "shards": {file name: {bytes, records, checksum}}}}``."""
    out = {}
    for split, paths in split_files.items():
        shards = {os.path.basename(p): _shard(p) for p in paths}
        out[split] = {"records": sum(s["records"] for s in shards.values()), "shards": shards}
    return out


def split_files(info: Any) -> dict[str, list[str]]:
    """The shard paths of every split of a prepared tfds `DatasetInfo`."""
    return {name: [os.fspath(p) for p in split.filepaths] for name, split in info.splits.items()}


def record(
    directory: str,
    files: Mapping[str, Sequence[str]],
    expected: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Computes the manifest of `files` and writes it to `directory/jattn_integrity.json`.

    Every split's record count is first checked against `expected` (tfds'
    ``dataset_info.json``), so that data damaged before its first read is
    refused instead of recorded. The file is written atomically (a crash
    leaves no half manifest). A data directory that cannot be written
    (read-only shared data) is verified against nothing rather than refused:
    the data is then only as trusted as tfds makes it.

    Raises:
      DataIntegrityError: a split with another number of records than `expected`.
    """
    splits = manifest(files)
    for split, n in (expected or {}).items():
        if split in splits and splits[split]["records"] != n:
            counts = {k: v["records"] for k, v in splits[split]["shards"].items()}
            raise DataIntegrityError(
                f"split {split!r} of {directory} has {splits[split]['records']} records "
                f"{counts} but its dataset_info.json says {n}: a shard is truncated or "
                f"replaced; delete {directory} to prepare the data set again"
            )
    entry = {"version": 1, "splits": splits}
    path = os.path.join(directory, MANIFEST)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(entry, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        return entry
    return entry


def verify(directory: str, files: Mapping[str, Sequence[str]], expected: Mapping[str, int]) -> None:
    """Checks every split's shards against the manifest recorded in `directory`.

    Args:
      directory: the prepared data set's folder (holds the manifest).
      files: split -> its shard paths (what tfds will read).
      expected: split -> number of examples tfds' ``dataset_info.json`` states.

    Raises:
      DataIntegrityError: a missing shard, a shard whose size, record count or
        checksum differs from the manifest, a split whose record count differs
        from ``dataset_info.json``, or an unreadable manifest; one line naming
        the file.
    """
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            recorded = json.load(f)["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataIntegrityError(
            f"{path} cannot be read ({e}); delete it to record the data's checksums again, "
            "or delete the data set's folder to prepare it again"
        ) from None
    fix = f"delete {directory} to prepare the data set again"
    for split, paths in files.items():
        want = recorded.get(split)
        if want is None:
            raise DataIntegrityError(f"split {split!r} of {directory} is not in {path}; {fix}")
        names = sorted(os.path.basename(p) for p in paths)
        if names != sorted(want["shards"]):
            raise DataIntegrityError(
                f"split {split!r} of {directory} has shards {names}, recorded "
                f"{sorted(want['shards'])}; {fix}"
            )
        for p in paths:
            name = os.path.basename(p)
            if not os.path.exists(p):
                raise DataIntegrityError(f"data file {p} is missing; {fix}")
            got, saved = _shard(p), want["shards"][name]
            for key in ("bytes", "records", "checksum"):
                if got[key] != saved[key]:
                    raise DataIntegrityError(
                        f"data file {p} is damaged or replaced: {key} {got[key]} != "
                        f"{saved[key]} recorded when it was prepared; {fix}"
                    )
        if split in expected and want["records"] != expected[split]:
            raise DataIntegrityError(
                f"split {split!r} of {directory} has {want['records']} records but its "
                f"dataset_info.json says {expected[split]}; {fix}"
            )


def record_location(data_source: Any, index: int) -> str:
    """``"record 12 of FILE"`` for example `index` of a tfds array_record data source
    (``"record 12 of split 'train'"`` where the files are not known)."""
    inner = getattr(data_source, "data_source", None)
    offset = int(index)
    for instruction in getattr(inner, "_read_instructions", None) or ():
        count = instruction.end - instruction.start
        if offset < count:
            return f"record {instruction.start + offset} of {instruction.filename}"
        offset -= count
    return f"record {index} of split {getattr(data_source, 'split', '?')!r}"
