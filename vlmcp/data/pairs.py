"""Preference pairs: one record, two samples (the chosen and the rejected completion of one
prompt); and the one entry point every record goes through (`record_tokens`, `record_samples`).

Formats:

* TRL, conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages],
  "images": [...]}``, messages as in the messages format (string or typed content, ``<image>``
  markers). Without "prompt" (TRL's implicit prompt), "chosen" and "rejected" are whole
  conversations and the prompt is their longest common prefix of messages.
* LLaMA-Factory's ShareGPT ranking format: ``{"conversations": [{"from": "human", "value":
  "<image>..."}], "chosen": {"from": "gpt", "value": "..."}, "rejected": {"from": "gpt",
  "value": "..."}, "images": [...]}`` (a completion may also be a list of messages).
* tokens (TRL's tokenized columns): ``{"prompt_input_ids": [...], "chosen_input_ids": [...],
  "rejected_input_ids": [...], "images": [...]}``, image placeholders expanded in the prompt;
  every completion token is a target.

Optional in every format: ``"ref_chosen_logp"`` and ``"ref_rejected_logp"`` (`PAIR_VALUES`), the
reference policy's sum of the target logprobs of each half (`loss.type` dpo and ipo), both or
neither.

Each half is the prompt followed by its completion. Its targets are the completion's tokens: for
chat formats the completion's assistant turns as `vlmcp.data.formats` marks them (the prompt's
own assistant turns are not targets). Images belong to the prompt's user and system turns; both
halves show them, and a pack holds and encodes them once (`vlmcp.data.pack`).

DataError, naming the record, when: the halves render different prompt tokens (a chat template
that renders the prompt differently before the two completions, or an implicit prompt whose
conversations differ outside their final assistant turns); the pair does not fit max_seq_len
(both halves train in one pack; pairs are never truncated, whatever data.truncate says); a
completion holds an image or a turn other than the assistant's; a reference sum lacks its partner
or is not a finite number; the record carries per-token arrays.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmcp.data import json_text
from vlmcp.data.batch import IGNORE_INDEX, PAIR_VALUES, REF_LOGP, TOKEN_ARRAYS
from vlmcp.data.formats import (IMAGE_MARKER, SHAREGPT_ROLES, Sample, Tokens, parse_record,
                                process_images, record_image_paths, sample_of, tokenize_record)
from vlmcp.data.processor import VLProcessor
from vlmcp.data.routes import ROUTES_KEY
from vlmcp.data.video_plan import VideoPlan
from vlmcp.data.video_records import plan_videos
from vlmcp.errors import DataError

#: The keys of a tokens-format pair.
TOKEN_PAIR_KEYS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
HALVES = ("chosen", "rejected")


def is_pair_record(record: Any) -> bool:
    """Whether a decoded record is a preference pair (any of the formats above)."""
    return isinstance(record, dict) and (
        ("chosen" in record and "rejected" in record)
        or any(key in record for key in TOKEN_PAIR_KEYS[1:]))


@dataclass(frozen=True)
class _Halves:
    """A pair as two single-sample records of `vlmcp.data.formats`, and how many assistant turns
    of the shared prompt come before the completion (their targets are dropped)."""

    chosen: dict[str, Any]
    rejected: dict[str, Any]
    prompt_turns: int


def _fail(source: str, message: str) -> DataError:
    return DataError(f"{source}: {message}")


def _image_keys(record: dict[str, Any]) -> dict[str, Any]:
    return {key: record[key] for key in ("images", "image") if key in record}


def _token_list(record: dict[str, Any], key: str, source: str) -> list[int]:
    value = record.get(key)
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                              for x in value):
        raise _fail(source, f'"{key}" must be a list of token ids')
    return value


def _token_halves(record: dict[str, Any], source: str) -> _Halves:
    missing = [key for key in TOKEN_PAIR_KEYS if key not in record]
    if missing:
        raise _fail(source, f"a tokens-format pair needs {list(TOKEN_PAIR_KEYS)}; {missing} missing")
    prompt = _token_list(record, "prompt_input_ids", source)

    def half(name: str) -> dict[str, Any]:
        completion = _token_list(record, f"{name}_input_ids", source)
        return {"input_ids": prompt + completion,
                "labels": [IGNORE_INDEX] * len(prompt) + completion, **_image_keys(record)}

    return _Halves(half("chosen"), half("rejected"), 0)


def _role(message: Any, sharegpt: bool, source: str) -> str:
    role_key = "from" if sharegpt else "role"
    if not isinstance(message, dict) or not isinstance(message.get(role_key), str):
        raise _fail(source, f'each message of a pair needs "{role_key}"')
    return SHAREGPT_ROLES.get(message[role_key], message[role_key]) if sharegpt \
        else message[role_key]


def _image_count(message: dict[str, Any], sharegpt: bool) -> int:
    content = message.get("value" if sharegpt else "content")
    if isinstance(content, str):
        return content.count(IMAGE_MARKER)
    if isinstance(content, list):
        return sum(isinstance(e, dict) and e.get("type") == "image" for e in content)
    return 0


def _messages(value: Any, what: str, source: str) -> list[Any]:
    """A completion or prompt as a list of messages (one message object counts as a list)."""
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and value:
        return value
    if isinstance(value, str):
        raise _fail(source, f'"{what}" is a string: vlmcp reads TRL pairs in the conversational '
                            "form (lists of messages), or pairs in the tokens format")
    raise _fail(source, f'"{what}" must be a message or a non-empty list of messages')


def _implicit_prompt(chosen: list[Any], rejected: list[Any], source: str
                     ) -> tuple[list[Any], list[Any], list[Any]]:
    """(prompt, chosen completion, rejected completion) of TRL's implicit-prompt pair."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise _fail(source, "chosen and rejected do not share a prompt: their first messages "
                            "differ (give the prompt under \"prompt\", or start both "
                            "conversations with the same messages)")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _chat_halves(record: dict[str, Any], source: str) -> _Halves:
    sharegpt = "conversations" in record
    chosen = _messages(record["chosen"], "chosen", source)
    rejected = _messages(record["rejected"], "rejected", source)
    if sharegpt:
        prompt = _messages(record["conversations"], "conversations", source)
    elif "prompt" in record:
        prompt = _messages(record["prompt"], "prompt", source)
    else:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected, source)
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if not completion:
            raise _fail(source, f"the {name} conversation holds no reply after the shared prompt")
        for message in completion:
            role = _role(message, sharegpt, source)
            if role != "assistant":
                raise _fail(source, f"chosen and rejected do not share a prompt: the {name} "
                                    f"completion holds a {role!r} turn (a completion is "
                                    "assistant turns only)")
            if _image_count(message, sharegpt):
                raise _fail(source, f"the {name} completion holds an image; a pair's images "
                                    "belong to its prompt")
    prompt_turns = 0
    for message in prompt:
        if _role(message, sharegpt, source) == "assistant":
            prompt_turns += 1
            if _image_count(message, sharegpt):
                raise _fail(source, "an assistant turn of the prompt holds an image; a pair's "
                                    "images belong to its user or system turns")
    key = "conversations" if sharegpt else "messages"
    return _Halves({key: prompt + chosen, **_image_keys(record)},
                   {key: prompt + rejected, **_image_keys(record)}, prompt_turns)


def _halves(record: dict[str, Any], source: str) -> _Halves:
    carried = [name for name in (*TOKEN_ARRAYS, ROUTES_KEY) if name in record]
    if carried:
        raise _fail(source, f"a preference pair carries no per-token arrays; it has {carried}")
    if any(key in record for key in TOKEN_PAIR_KEYS):
        return _token_halves(record, source)
    return _chat_halves(record, source)


def _drop_prompt_targets(labels: list[int], turns: int) -> list[int]:
    """`labels` with the first `turns` runs of targets (the prompt's assistant turns) ignored."""
    out = list(labels)
    t = 0
    while turns and t < len(out):
        if out[t] == IGNORE_INDEX:
            t += 1
            continue
        while t < len(out) and out[t] != IGNORE_INDEX:
            out[t] = IGNORE_INDEX
            t += 1
        turns -= 1
    return out


def _reference(record: dict[str, Any], source: str) -> tuple[float, float] | None:
    present = [name for name in PAIR_VALUES if name in record]
    if not present:
        return None
    if len(present) == 1:
        other = next(name for name in PAIR_VALUES if name not in present)
        raise _fail(source, f'"{present[0]}" is given without "{other}"; give both or neither')
    values = []
    for name in PAIR_VALUES:
        value = json_text.finite(record[name])
        if value is None:
            raise _fail(source, f'"{name}" must be a finite number, got '
                                f"{json_text.brief(record[name])}")
        values.append(value)
    return values[0], values[1]


@dataclass
class PairTokens:
    """A tokenized pair: each half's `Tokens` (the same images), and the reference sums."""

    chosen: Tokens
    rejected: Tokens
    reference: tuple[float, float] | None

    @property
    def num_tokens(self) -> int:
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)


def pair_image_paths(record: dict[str, Any], source: str, base_dir: Path) -> list[Path]:
    """The prompt's image paths of a pair record."""
    return record_image_paths(_halves(record, source).chosen, source, base_dir)


def tokenize_pair(record: dict[str, Any], source: str, base_dir: Path, processor: VLProcessor,
                  grids: list[tuple[int, int, int]], max_seq_len: int) -> PairTokens:
    """Both halves of a pair record whose prompt images have the patch `grids`; see the module
    docstring for the checks. Decodes no image."""
    halves = _halves(record, source)
    tokens: dict[str, Tokens] = {}
    prompts: dict[str, list[int]] = {}
    for name, half in (("chosen", halves.chosen), ("rejected", halves.rejected)):
        full = tokenize_record(half, source, base_dir, processor, grids, sys.maxsize,
                               array_names=())
        labels = _drop_prompt_targets(full.labels, halves.prompt_turns)
        first = next((t for t, label in enumerate(labels) if t and label != IGNORE_INDEX), None)
        if first is None:
            raise _fail(source, f"the {name} completion has no target token")
        if processor.image_token_id in full.input_ids[first:]:
            raise _fail(source, f"the {name} completion holds an image; a pair's images belong "
                                "to its prompt")
        tokens[name] = Tokens(full.input_ids, labels, full.paths, full.grids)
        prompts[name] = full.input_ids[:first]
    if prompts["chosen"] != prompts["rejected"]:
        chosen, rejected = prompts["chosen"], prompts["rejected"]
        at = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b),
                  min(len(chosen), len(rejected)))
        raise _fail(source, f"chosen and rejected do not share a prompt: the tokens before their "
                            f"first targets ({len(chosen)} and {len(rejected)}) differ from "
                            f"token {at} on; both halves of a pair must render the same prompt")
    pair = PairTokens(tokens["chosen"], tokens["rejected"], _reference(record, source))
    if pair.num_tokens > max_seq_len:
        raise _fail(source, f"the pair has {len(pair.chosen.input_ids)} + "
                            f"{len(pair.rejected.input_ids)} tokens, more than max_seq_len "
                            f"{max_seq_len}: both halves train in one pack (pairs are never "
                            "truncated; raise data.max_seq_len)")
    return pair


@dataclass
class RecordTokens:
    """A record tokenized without pixels: its samples' `Tokens` (one, or a pair's chosen and
    rejected) and the names of the per-token arrays and pair values it carries."""

    halves: list[Tokens]
    carried: tuple[str, ...]

    @property
    def is_pair(self) -> bool:
        return len(self.halves) == 2


def record_paths(record: Any, source: str, base_dir: Path) -> list[Path]:
    """The image paths of one decoded record (a pair's: its prompt's), after checking that it has
    a known format."""
    if is_pair_record(record):
        return pair_image_paths(record, source, base_dir)
    return record_image_paths(record, source, base_dir)


def record_tokens(record: Any, source: str, base_dir: Path, processor: VLProcessor,
                  grids: list[tuple[int, int, int]], max_seq_len: int, truncate: bool,
                  array_names: tuple[str, ...], videos: list[VideoPlan]) -> RecordTokens:
    """`RecordTokens` of one decoded record whose images (`record_paths`) have `grids` and whose
    videos have the plans `videos` (`plan_videos`); a pair with videos is a DataError."""
    if is_pair_record(record):
        _refuse_videos(videos, source)
        pair = tokenize_pair(record, source, base_dir, processor, grids, max_seq_len)
        return RecordTokens([pair.chosen, pair.rejected],
                            PAIR_VALUES if pair.reference is not None else ())
    tokens = tokenize_record(record, source, base_dir, processor, grids, max_seq_len, truncate,
                             array_names, videos)
    return RecordTokens([tokens], tuple(tokens.arrays))


def _refuse_videos(videos: list[VideoPlan], source: str) -> None:
    if videos:
        raise DataError(f"{source}: a preference pair cannot hold videos (its halves share the "
                        "prompt's images only)")


def record_samples(record: Any, source: str, base_dir: Path, processor: VLProcessor,
                   max_seq_len: int, truncate: bool = False,
                   array_names: tuple[str, ...] = TOKEN_ARRAYS) -> list[Sample]:
    """The samples of one decoded record, images decoded once: one (`parse_record`), or a pair's
    chosen and rejected (`Sample.pair`, and the reference sums as `Sample.values[REF_LOGP]`)."""
    if not is_pair_record(record):
        return [parse_record(record, source, base_dir, processor, max_seq_len, truncate,
                             array_names)]
    _refuse_videos(plan_videos(record, base_dir, source, processor), source)
    paths = record_paths(record, source, base_dir)
    pixel_values, grid = process_images(paths, source, processor)
    grids = [] if grid is None else [tuple(row) for row in grid.tolist()]
    pair = tokenize_pair(record, source, base_dir, processor, grids, max_seq_len)
    samples = []
    for index, (role, tokens) in enumerate(zip(HALVES, (pair.chosen, pair.rejected))):
        sample = sample_of(tokens, pixel_values, source, processor)
        sample.pair = role
        if pair.reference is not None:
            sample.values[REF_LOGP] = pair.reference[index]
        samples.append(sample)
    return samples
