"""The length index on disk, so that a second run starts without reading its data again.

One file per (data files, processor, settings): `<cache_dir>/index-<key>.npz`, where key is a
SHA-256 over the absolute data file paths, a fingerprint of the processor (the tokenizer's
serialized vocabulary, merges and added tokens, its chat template, the chat template kwargs and
empty-think choice it renders with, the image processor's settings, the video settings and the
vision token ids, the MoE routing layout that `routed_experts` is checked against), the
index-affecting settings (max_seq_len, truncate, image_root) and the index format version. Inside, next to the arrays, each data file's
size, mtime and SHA-256 of its bytes.

A cached index is used when every data file has the recorded size and mtime (nothing is read), or
else the same content (its bytes are hashed: a copied or touched file still hits). Images are not
stamped: the index holds only their sizes, and a sample whose image changed size since the index was
built fails when its pack is loaded, naming the image and this cache file (delete it, or run `vlmcp
validate`, which rebuilds it). Videos are not stamped either, for the same reason. Writes are atomic
(a temporary file renamed into place), so ranks or nodes that write the same index at once leave one
whole file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlmcp.data.batch import TOKEN_ARRAYS
from vlmcp.data.index import COLUMNS, LengthIndex, build_index
from vlmcp.data.processor import VLProcessor

logger = logging.getLogger(__name__)

#: Bumped whenever the index's content or meaning changes.
INDEX_VERSION = 5


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/vlmcp/index, or ~/.cache/vlmcp/index."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vlmcp" / "index"


def processor_fingerprint(processor: VLProcessor) -> str:
    """SHA-256 of everything of the processor that changes token counts."""
    tokenizer = processor.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "tokenizer": backend.to_str() if backend is not None else repr(sorted(
            tokenizer.get_vocab().items())),
        "added": repr(sorted((str(k), str(v)) for k, v in tokenizer.get_added_vocab().items())),
        "chat_template": tokenizer.chat_template or "",
        "image_processor": processor.image_processor.to_json_string(),
        "ids": [processor.image_token_id, processor.vision_start_id, processor.vision_end_id,
                processor.merge_size, processor.video_token_id],
        "video": repr(processor.video),
        "chat_template_kwargs": processor.chat_template_kwargs,
        "empty_think": processor.empty_think,
        "routes": repr(processor.routes),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: Path, files: Sequence[Path], processor: VLProcessor,
               settings: dict[str, Any]) -> Path:
    """Where the index of `files` under `processor` and `settings` is cached."""
    key = json.dumps({"version": INDEX_VERSION, "files": [str(Path(f).absolute()) for f in files],
                      "processor": processor_fingerprint(processor), "settings": settings},
                     sort_keys=True, default=str)
    return cache_dir / f"index-{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"


def _content_hash(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def file_stamp(path: Path) -> dict[str, Any]:
    """Size, mtime and content hash of a data file (reads the whole file)."""
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": _content_hash(path)}


def _unchanged(stamp: dict[str, Any]) -> bool:
    path = Path(stamp["path"])
    try:
        stat = path.stat()
    except OSError:
        return False
    if (stat.st_size, stat.st_mtime_ns) == (stamp["size"], stamp["mtime_ns"]):
        return True
    return stat.st_size == stamp["size"] and _content_hash(path) == stamp["sha256"]


def save_index(path: Path, index: LengthIndex, stamps: list[dict[str, Any]]) -> None:
    """Write `index` and its data files' `stamps` to `path` atomically (a unique temporary file,
    then os.replace). Raises OSError when it cannot be written."""
    buffer = io.BytesIO()
    meta = json.dumps({"version": INDEX_VERSION, "files": index.files,
                       "json_array": index.json_array, "image_root": index.image_root,
                       "array_names": list(index.array_names), "stamps": stamps})
    np.savez(buffer, meta=np.array(meta), **index.arrays())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        with tmp.open("wb") as handle:
            handle.write(buffer.getbuffer())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_index(path: Path) -> tuple[LengthIndex | None, str]:
    """(the cached index at `path`, "") when it is current, else (None, why not)."""
    if not path.is_file():
        return None, "no cached index"
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {name: data[name].astype(dtype) for name, dtype in COLUMNS}
    except (OSError, ValueError, KeyError) as e:
        return None, f"unreadable cached index ({e})"
    if meta.get("version") != INDEX_VERSION:
        return None, "cached index has another format version"
    changed = [s["path"] for s in meta["stamps"] if not _unchanged(s)]
    if changed:
        return None, f"data changed since the cached index: {changed}"
    return LengthIndex(files=meta["files"], json_array=meta["json_array"],
                       image_root=meta["image_root"], array_names=tuple(meta["array_names"]),
                       **arrays), ""


@dataclass
class IndexResult:
    """What `obtain_index` did: the index (None when it could not), the problems found (one
    line each), the cache file, whether it was built now, and in how many seconds."""

    index: LengthIndex | None
    problems: list[str]
    path: Path
    built: bool
    seconds: float


def obtain_index(files: Sequence[Path], processor: VLProcessor, settings: dict[str, Any],
                 cache_dir: Path, *, image_root: Path | None = None, may_build: bool,
                 rebuild: bool = False) -> IndexResult:
    """The length index of `files`: loaded from `cache_dir` when current, else (when
    `may_build`) built and saved there. `settings`: max_seq_len, truncate, the job's own
    per-token weight arrays ("weight_arrays", read besides `TOKEN_ARRAYS`) and whatever else
    changes the index (part of the cache key, with `image_root`). `rebuild` (validation) always builds, decoding
    every image once. Data problems come back as problems; so does a cache that cannot be
    written, naming data.cache_dir. Logs "length index: loaded from cache PATH" or "built in X s".
    """
    started = time.perf_counter()
    key_settings = {**settings, "image_root": None if image_root is None
                    else str(Path(image_root).absolute())}
    path = cache_path(cache_dir, files, processor, key_settings)
    if not rebuild:
        index, why = load_index(path)
        if index is not None:
            logger.info("length index: loaded from cache %s (%d samples)", path, len(index))
            return IndexResult(index, [], path, False, time.perf_counter() - started)
        if not may_build:
            return IndexResult(None, [f"length index {path}: {why} (the rank that builds it "
                                      "did not write it)"], path, False, 0.0)
        logger.info("length index: %s; building it", why)
    stamps = [file_stamp(Path(f)) for f in files if Path(f).is_file()]
    index, problems = build_index(files, processor, settings["max_seq_len"],
                                  settings["truncate"], image_root=image_root, decode=rebuild,
                                  array_names=TOKEN_ARRAYS + tuple(settings.get("weight_arrays", ())))
    seconds = time.perf_counter() - started
    if not problems:
        try:
            save_index(path, index, stamps)
        except OSError as e:
            problems.append(f"config key 'data.cache_dir': cannot write the length index "
                            f"{path}: {e.strerror or e}")
    logger.info("length index: built in %.1f s (%d samples%s) -> %s", seconds, len(index),
                f", {len(problems)} problems" if problems else "", path)
    return IndexResult(index, problems, path, True, seconds)
