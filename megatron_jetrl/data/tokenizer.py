"""Tokenizers: what the data side needs of one, how one is loaded, and how a prompt is rendered.

``load_tokenizer`` returns either a synthetic task's character tokenizer or a Hugging Face
tokenizer loaded from a local directory (never the network: the GPU hosts have none, and a job
should not depend on a hub being up).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Protocol, Sequence, Union

from megatron_jetrl.config import ConfigError
from megatron_jetrl.data.settings import CHAT_TEMPLATE_MODES

SYNTHETIC_PREFIX = "synthetic:"
Messages = Sequence[Mapping[str, str]]


class Tokenizer(Protocol):
    """The part of a tokenizer the RL loop uses (a HF tokenizer satisfies it).

    ``encode(text)`` adds the tokenizer's own special tokens (HF: BOS where the model uses one).
    A tokenizer with a ``chat_template`` is HF-like: it also has ``apply_chat_template`` and
    accepts ``encode(text, add_special_tokens=False)``. ``vocab_size`` is HF's: the base
    vocabulary, without added tokens (``len(tokenizer)`` counts those).
    """

    eos_token_id: int
    pad_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                             "vocab.txt", "spiece.model", "sentencepiece.bpe.model"})
"""Files one of which an HF tokenizer directory holds (a directory with none of them is refused by name
rather than through transformers' advice to install sentencepiece or tiktoken)."""


def load_tokenizer(spec: str) -> Tokenizer:
    """``synthetic:<task>`` → that task's tokenizer; otherwise a local HF tokenizer directory
    (``model.tokenizer``). A HF tokenizer without a pad token pads with its EOS token."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError("model.tokenizer", spec, "must be a local tokenizer directory or synthetic:<task>")
    if spec.startswith(SYNTHETIC_PREFIX):
        from megatron_jetrl.data import synthetic

        task = spec[len(SYNTHETIC_PREFIX):]
        if task not in synthetic.TASKS:
            raise ConfigError("model.tokenizer", spec, f"unknown synthetic task; use synthetic:<task> with a task "
                              f"from {sorted(synthetic.TASKS)}")
        return synthetic.TASKS[task].tokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError("model.tokenizer", spec,
                          "no such local path; download the model's tokenizer files first (e.g. `hf download "
                          "<repo> --local-dir <dir>`) and give that directory, or use synthetic:<task>")
    files = sorted(p.name for p in path.iterdir()) if path.is_dir() else [path.name]
    if path.is_dir() and not any(name in TOKENIZER_FILES for name in files):
        raise ConfigError("model.tokenizer", spec, f"holds no tokenizer files (none of {sorted(TOKENIZER_FILES)}; it "
                          f"holds {files[:6]}): download the model's tokenizer files there, or name the directory "
                          "that has them")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError("model.tokenizer", spec, f"not a loadable HF tokenizer directory ({e})") from e
    probe = "What is 12 + 30? Answer: 42."
    if len(tok) < 2 or not tok.encode(probe, add_special_tokens=False):
        raise ConfigError("model.tokenizer", spec,
                          f"is not a usable tokenizer: {len(tok)} token(s), {probe!r} encodes to "
                          f"{tok.encode(probe, add_special_tokens=False)} (the directory holds {files[:6]}); it needs "
                          "the model's tokenizer files (tokenizer.json / tokenizer_config.json ...): download them")
    if tok.eos_token_id is None:
        raise ConfigError("model.tokenizer", spec, "the tokenizer has no EOS token; generation could not stop")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def has_chat_template(tokenizer: Tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def uses_chat_template(tokenizer: Tokenizer, mode: str) -> bool:
    """Whether ``render_prompt`` applies the chat template for ``mode`` (auto|on|off); ``on``
    without a template raises ValueError."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"chat_template must be one of {CHAT_TEMPLATE_MODES}; got {mode!r}")
    if mode == "on" and not has_chat_template(tokenizer):
        raise ValueError("chat_template 'on' needs a tokenizer with a chat template; this one has none")
    return mode == "on" or (mode == "auto" and has_chat_template(tokenizer))


def render_prompt(tokenizer: Tokenizer, text: Union[str, Messages], *, system_prompt: Optional[str] = None,
                  chat_template: str = "auto") -> list[int]:
    """Prompt token ids, ending where the response begins.

    ``text`` is a user message or a list of ``{"role", "content"}`` messages. With the chat
    template: ``[system_prompt?] + messages``, rendered with ``add_generation_prompt=True`` and
    encoded without adding special tokens again (the template writes them). Without it:
    ``system_prompt + "\\n\\n" + text`` encoded plainly. Raises ValueError for messages without a
    template, for ``on`` without a template, and for a system prompt given twice (in the messages
    and in ``system_prompt``).
    """
    templated = uses_chat_template(tokenizer, chat_template)
    if isinstance(text, str):
        messages = [{"role": "user", "content": text}]
    else:
        if not templated:
            raise ValueError("a prompt given as chat messages needs a tokenizer with a chat template "
                             f"(chat_template is {chat_template!r})")
        messages = [dict(m) for m in text]
    if not templated:
        return list(tokenizer.encode(text if system_prompt is None else f"{system_prompt}\n\n{text}"))
    if system_prompt is not None:
        if any(m.get("role") == "system" for m in messages):
            raise ValueError("the prompt's messages already hold a system message; unset system_prompt")
        messages = [{"role": "system", "content": system_prompt}, *messages]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))
