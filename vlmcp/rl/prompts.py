"""The prompts of an RL job (`rl.prompts`): read, rendered as training renders them, in seeded order.

A prompt row comes from any data file vlmcp reads (JSON Lines or a JSON array, `vlmcp.data.sources`)
or from a Hugging Face `datasets` table (a `.parquet` file, or a directory `save_to_disk` wrote;
these need the `datasets` package). What holds the prompt, first match wins:

    "messages" / "conversations"  vlmcp's chat formats; a trailing assistant turn is the reference
                                  answer (the column "answer" when the row has none), the turns
                                  before it the prompt
    "prompt"                      TRL's: a string (standard) or a list of messages (conversational)
    "question" / "problem"        a string: one user turn

Images are named as in vlmcp's formats ("images"/"image" paths with `<image>` markers or typed
entries, relative to the file's directory). Every other column (answer, info, task, ...) goes to
the reward functions, as TRL passes a dataset's columns.

`render_prompt` gives the prompt's token ids exactly as training tokenizes the same conversation:
the row's messages and an assistant reply go through `vlmcp.data.formats.tokenize_record` (chat
template with data.chat_template_kwargs and data.empty_think, image placeholders expanded from
the image headers), and the prompt is everything before the reply's first target token, so an
answer the engine appends to it is what training sees after the same header.

`PromptStream` orders the rows by the job's seed: epoch e is a permutation of all rows seeded by
(seed, e), and position p of the stream is row `order(p)`. The position is the orchestrator's
state: a resumed run continues at the position the last written step ended at.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmcp.data.formats import record_image_paths, tokenize_record
from vlmcp.data.image_size import header_grid
from vlmcp.data.processor import VLProcessor
from vlmcp.data.sources import iter_records
from vlmcp.data.video_records import record_videos
from vlmcp.errors import DataError

#: The columns that hold the prompt, in the order they are looked for.
PROMPT_KEYS = ("messages", "conversations", "prompt", "question", "problem")
#: Columns that are the prompt's own and never reach the rewards as extra columns.
_OWN_KEYS = ("messages", "conversations", "prompt", "images", "image")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class PromptRow:
    """One prompt: its place in the prompt set, what it says and what goes to the rewards.

    index:    its position in the set (the files of rl.prompts one after the other).
    source:   "file:line" (or "file[index]"), for every message about it.
    messages: the prompt's chat messages, {"role", "content"} in vlmcp's forms.
    images:   resolved image paths, in marker order.
    columns:  every other column of the row (with "answer" from a trailing assistant turn).
    conversational: the prompt was given as messages (TRL then passes prompts and completions
              to the rewards as messages).
    """

    index: int
    source: str
    messages: list[dict[str, Any]]
    images: list[Path] = field(default_factory=list)
    columns: dict[str, Any] = field(default_factory=dict)
    conversational: bool = True

    def reward_prompt(self) -> Any:
        """The prompt as TRL hands it to a reward function: the messages, or the text."""
        if self.conversational:
            return self.messages
        content = self.messages[-1]["content"]
        return content if isinstance(content, str) else " ".join(
            part.get("text", "") for part in content if isinstance(part, dict))


def _fail(source: str, message: str) -> DataError:
    return DataError(f"{source}: {message}")


def _messages(raw: Any, source: str, key: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise _fail(source, f'"{key}" must be a non-empty list of messages')
    sharegpt = key == "conversations"
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    out = []
    for message in raw:
        if not isinstance(message, dict) or role_key not in message or content_key not in message:
            raise _fail(source, f'each message of "{key}" needs "{role_key}" and "{content_key}"')
        role = _SHAREGPT_ROLES.get(message[role_key]) if sharegpt else message[role_key]
        if role not in ("system", "user", "assistant"):
            raise _fail(source, f"unknown role {message[role_key]!r} in \"{key}\"")
        out.append({"role": role, "content": message[content_key]})
    return out


def _answer_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def prompt_row(record: dict[str, Any], index: int, source: str, base_dir: Path) -> PromptRow:
    """The `PromptRow` of one decoded row (see the module docstring); DataError naming `source`
    when no column holds a prompt or a column is malformed."""
    key = next((k for k in PROMPT_KEYS if k in record), None)
    if key is None:
        raise _fail(source, f"no prompt: a prompt row has one of {', '.join(PROMPT_KEYS)} "
                            f"(keys {sorted(record)})")
    columns = {k: v for k, v in record.items() if k not in _OWN_KEYS}
    value = record[key]
    conversational = key in ("messages", "conversations") or isinstance(value, list)
    if conversational:
        messages = _messages(value, source, key)
        if messages[-1]["role"] == "assistant":
            columns.setdefault("answer", _answer_text(messages[-1]["content"]))
            messages = messages[:-1]
        if not messages or messages[-1]["role"] == "assistant":
            raise _fail(source, f'"{key}" holds no prompt before the answer')
    elif isinstance(value, str) and value:
        messages = [{"role": "user", "content": value}]
    else:
        raise _fail(source, f'"{key}" must be a non-empty string or a list of messages')
    image_record = {"messages": messages, **{k: record[k] for k in ("images", "image")
                                             if k in record}}
    images = record_image_paths(image_record, source, base_dir)
    if record_videos(record, base_dir, source, None):
        raise _fail(source, "videos in rl.prompts are not sent to the engines (vlmcp rl sends "
                            "images); train on video prompts through rollouts.dir")
    return PromptRow(index, source, messages, images, columns, conversational)


def _hf_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(source label, row) of a Hugging Face table: a parquet file, or a `save_to_disk`
    directory (a DatasetDict's "train" split)."""
    try:
        import datasets
    except ImportError as exc:
        raise DataError(f"{path}: reading a Hugging Face dataset needs the datasets package "
                        "(pip install datasets); or give the rows as JSON Lines") from exc
    if path.is_dir():
        table = datasets.load_from_disk(str(path))
        if isinstance(table, datasets.DatasetDict):
            if "train" not in table:
                raise DataError(f"{path}: a DatasetDict without a \"train\" split (splits "
                                f"{sorted(table)}); save the split to use")
            table = table["train"]
    else:
        table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    for i, row in enumerate(table):
        yield f"{path}[{i}]", dict(row)


def _rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | DataError]]:
    if path.is_dir() or path.suffix == ".parquet":
        yield from _hf_rows(path)
    else:
        yield from iter_records(path)


def read_prompts(paths: Sequence[Path]) -> list[PromptRow]:
    """Every prompt row of the files, in order. Raises DataError listing every bad row (each
    naming its file:line)."""
    rows: list[PromptRow] = []
    problems: list[str] = []
    for path in paths:
        for source, record in _rows(path):
            if isinstance(record, DataError):
                problems += record.problems
                continue
            try:
                rows.append(prompt_row(record, len(rows), source, path.parent))
            except DataError as exc:
                problems += exc.problems
    if problems:
        raise DataError(problems)
    return rows


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt's token ids as training renders it (image placeholders expanded)."""

    input_ids: list[int]
    images: list[Path]


def render_prompt(row: PromptRow, processor: VLProcessor) -> RenderedPrompt:
    """The prompt's tokens: the row's messages and an assistant reply rendered as training
    renders a chat record, cut before the reply's first target. DataError naming the row."""
    record = {"messages": [*row.messages, {"role": "assistant", "content": ""}],
              "images": [str(p) for p in row.images]}
    grids = [header_grid(p, row.source, processor.image_processor) for p in row.images]
    tokens = tokenize_record(record, row.source, Path("/"), processor, grids, max_seq_len=1 << 30)
    first = next((t for t, label in enumerate(tokens.labels) if label != -100), None)
    if first is None:
        raise _fail(row.source, "the chat template renders no assistant reply after the prompt")
    return RenderedPrompt(tokens.input_ids[:first], list(row.images))


class PromptStream:
    """The job's seeded order of `size` rows: position p is row `at(p)` (see the module
    docstring)."""

    def __init__(self, size: int, seed: int):
        if size < 1:
            raise ValueError("a prompt stream needs at least one row")
        self.size, self.seed = size, seed
        self._epoch, self._order = -1, list(range(size))

    def at(self, position: int) -> int:
        """The row index at stream position `position` (>= 0)."""
        epoch = position // self.size
        if epoch != self._epoch:
            self._order = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order[position % self.size]
