"""Prompt datasets: records from JSONL, Parquet or a synthetic task, tokenized once at load.

RL prompt sets are small (thousands to tens of thousands of prompts), so every prompt is rendered
and tokenized eagerly: a bad record or a template problem fails at start-up, not at step 900.
Prompts longer than ``max_prompt_tokens`` are dropped at load, counted in ``dropped`` and logged.
An empty prompt (or one that tokenizes to nothing) is refused at load, naming its file and line: no
engine can generate from it, so it would otherwise stop the run at its batch on every resume.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from megatron_jetrl.config import ConfigError
from megatron_jetrl.data.settings import DatasetSettings
from megatron_jetrl.data.synthetic import OutOfVocabulary
from megatron_jetrl.data.tokenizer import Tokenizer, render_prompt, uses_chat_template

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_MISSING = object()


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``index`` is its position in the ``PromptDataset`` (what a sampler returns),
    ``token_ids`` the rendered prompt, ``answer`` the record's reference answer as stored (what the
    reward function receives), ``text`` the prompt as given (the last user message for a chat)."""

    index: int
    token_ids: tuple[int, ...]
    answer: Any
    text: str


class PromptDataset:
    """Tokenized prompts, indexed ``0 .. len - 1``. ``dropped`` counts the records left out for
    exceeding ``max_prompt_tokens``; ``source`` names where the records came from. ``records``
    (optional, one per prompt) are the source records, for fields other than prompt and answer
    (``records_field``)."""

    def __init__(self, prompts: Sequence[Prompt], *, records: Optional[Sequence[Mapping[str, Any]]] = None,
                 dropped: int = 0, source: str = "<records>"):
        for i, p in enumerate(prompts):
            if p.index != i:
                raise ValueError(f"prompt at position {i} has index {p.index}; indices must be 0 .. len - 1")
        if records is not None and len(records) != len(prompts):
            raise ValueError(f"{len(records)} records for {len(prompts)} prompts")
        self._prompts = tuple(prompts)
        self._records = None if records is None else tuple(records)
        self.dropped = dropped
        self.source = source

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self._prompts[i]

    def records_field(self, name: str, key: str) -> list[Any]:
        """Field ``name`` (dotted names reach into nested objects) of every prompt's record, in
        index order, e.g. the reference solutions for a supervised warm-up; a record without it is a
        ConfigError on ``key``, the setting that named the field."""
        if self._records is None:
            raise ConfigError(key, name, f"{self.source} was built without its records")
        values = []
        for prompt, record in zip(self._prompts, self._records, strict=True):
            value = _field(record, name)
            if value is _MISSING:
                raise ConfigError(key, name, _missing(f"the record of prompt {prompt.index} of {self.source}",
                                                      record, "wanted value"))
            values.append(value)
        return values

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} prompts from {self.source}, {self.dropped} dropped)"

    @classmethod
    def from_settings(cls, settings: DatasetSettings, tokenizer: Tokenizer, key: str) -> "PromptDataset":
        """Loads ``settings`` (validated again under ``key``, e.g. ``data.train``)."""
        settings.validate(key)
        if settings.synthetic is not None:
            from megatron_jetrl.data import synthetic

            s = settings.synthetic
            records = synthetic.TASKS[s.task].generate(s.size, s.seed, options_key=f"{key}.synthetic.options",
                                                       **s.options)
            return cls.from_records(records, tokenizer, settings, key, source=f"synthetic:{s.task}")
        path = Path(settings.path).expanduser()
        if not path.is_file():
            raise ConfigError(f"{key}.path", settings.path, "no such file")
        suffix = path.suffix.lower()
        lines = None
        if suffix in JSONL_SUFFIXES:
            lines, records = _read_jsonl(path, key)
        elif suffix in PARQUET_SUFFIXES:
            records = _read_parquet(path, key)
        else:
            raise ConfigError(f"{key}.path", settings.path, f"unknown file type {suffix!r}; use JSON lines "
                              f"{JSONL_SUFFIXES} or Parquet {PARQUET_SUFFIXES}")
        return cls.from_records(records, tokenizer, settings, key, source=str(path), lines=lines)

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, settings: DatasetSettings,
                     key: str, *, source: str = "<records>", lines: Optional[Sequence[int]] = None
                     ) -> "PromptDataset":
        """Renders and tokenizes ``records`` (record n is 1-based in error messages, which also name
        its line of the file when ``lines`` gives them). Raises ConfigError for a record without
        the fields, with an empty prompt or one that tokenizes to no tokens."""
        if lines is not None and len(lines) != len(records):
            raise ValueError(f"{len(lines)} line numbers for {len(records)} records")
        if not records:
            raise ConfigError(f"{key}.path" if settings.synthetic is None else f"{key}.synthetic.size",
                              source, "holds no records")
        try:
            uses_chat_template(tokenizer, settings.chat_template)
        except ValueError as e:
            raise ConfigError(f"{key}.chat_template", settings.chat_template, f"{e}; use 'auto' or 'off'") from None
        prompts: list[Prompt] = []
        kept: list[Mapping[str, Any]] = []
        dropped = 0
        for n, record in enumerate(records, 1):
            where = f"record {n} of {source}" + ("" if lines is None else f" (line {lines[n - 1]})")
            raw = _field(record, settings.prompt_key)
            if raw is _MISSING:
                raise ConfigError(f"{key}.prompt_key", settings.prompt_key, _missing(where, record, "prompt"))
            answer = _field(record, settings.answer_key)
            if answer is _MISSING:
                raise ConfigError(f"{key}.answer_key", settings.answer_key, _missing(where, record, "answer"))
            text = _prompt_text(raw, where, f"{key}.prompt_key", settings.prompt_key)
            if not text.strip():
                raise ConfigError(f"{key}.prompt_key", settings.prompt_key,
                                  f"{where}: the prompt is {'only whitespace' if text else 'empty'}; remove the "
                                  "record or give it a prompt")
            try:
                ids = render_prompt(tokenizer, raw, system_prompt=settings.system_prompt,
                                    chat_template=settings.chat_template)
            except OutOfVocabulary as e:
                raise ConfigError("model.tokenizer", "synthetic", f"{where}: {e}; a synthetic tokenizer encodes only "
                                  "its task's prompts: use the model's tokenizer for this data") from None
            except ValueError as e:
                raise ConfigError(f"{key}.chat_template", settings.chat_template, f"{where}: {e}") from None
            if not ids:
                raise ConfigError(f"{key}.prompt_key", settings.prompt_key,
                                  f"{where}: the prompt {text[:40]!r} tokenizes to no tokens; remove the record, "
                                  "or check that model.tokenizer is the model's tokenizer")
            if len(ids) > settings.max_prompt_tokens:
                dropped += 1
                continue
            prompts.append(Prompt(index=len(prompts), token_ids=tuple(ids), answer=answer, text=text))
            kept.append(record)
        if not prompts:
            raise ConfigError(f"{key}.max_prompt_tokens", settings.max_prompt_tokens,
                              f"all {len(records)} prompts of {source} are longer; raise it")
        if dropped:
            logger.warning("%s: dropped %d of %d prompts longer than %s.max_prompt_tokens=%d",
                           source, dropped, len(records), key, settings.max_prompt_tokens)
        return cls(prompts, records=kept, dropped=dropped, source=source)


def _field(record: Mapping[str, Any], name: str) -> Any:
    """``record[name]``, else the dotted path ``a.b.c`` through nested objects, else ``_MISSING``."""
    if not isinstance(record, Mapping):
        return _MISSING
    if name in record:
        return record[name]
    value: Any = record
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _missing(where: str, record: Any, what: str) -> str:
    fields = sorted(map(str, record))[:20] if isinstance(record, Mapping) else type(record).__name__
    return f"{where} has no such field (it has {fields}); set the key to the field that holds the {what}"


def _prompt_text(raw: Any, where: str, key: str, name: str) -> str:
    if isinstance(raw, str):
        return raw
    ok = isinstance(raw, (list, tuple)) and raw and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in raw)
    if not ok:
        raise ConfigError(key, name, f"{where}: the prompt must be a string or a list of "
                          f"{{'role', 'content'}} messages; got {type(raw).__name__}")
    users = [m["content"] for m in raw if m["role"] == "user"]
    return users[-1] if users else raw[-1]["content"]


def _read_jsonl(path: Path, key: str) -> tuple[list[int], list[dict]]:
    """The file's line number of each record (blank lines are skipped) and the records."""
    lines, records = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{key}.path", where, f"not UTF-8 text ({e.reason})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}.path", where, f"not valid JSON ({e.msg} at column {e.colno}); the file "
                                  f"must hold one JSON object per line") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{key}.path", where, f"the line holds a JSON {type(record).__name__}, not an object")
            lines.append(lineno)
            records.append(record)
    return lines, records


def _read_parquet(path: Path, key: str) -> list[dict]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(f"{key}.path", str(path), "reading Parquet needs pyarrow, which is not installed: "
                          "pip install pyarrow") from e
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{key}.path", str(path), f"not a readable Parquet file ({e})") from e
