"""A checkpoint's ``tokenizer.json`` and chat template without transformers (no torch).

The gateway needs to tokenize, render chat templates and detokenize; transformers'
tokenizer classes import torch whenever it is installed. ``JsonTokenizer`` reads the same
files with the ``tokenizers`` library and renders the template with jinja2 the way
transformers does (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``,
``tojson``, ``raise_exception``, ``strftime_now``, the special tokens as variables).
tests/unit/test_tokenizer_json.py holds it token- and text-identical to AutoTokenizer.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant masks): just its body here."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class JsonTokenizer:
    """encode / decode / apply_chat_template over a checkpoint's tokenizer files."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        # A saved tokenizer.json may carry padding / truncation; transformers turns both
        # off unless a call asks for them, and so do we.
        self._tok.no_padding()
        self._tok.no_truncation()
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special_tokens = {k: t for k in _SPECIAL if (t := _token_text(config.get(k)))}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = _chat_template(model_dir, config)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self._tok.token_to_id(eos)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and type(self._tok.model).__name__ != "BPE":
            text = _clean_up(text)
        return text

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs,
    ):
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _template(self):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


def _chat_template(model_dir: Path, config: dict) -> str | None:
    """transformers' places, newest first: chat_template.jinja, chat_template.json, the
    tokenizer config."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    json_file = model_dir / "chat_template.json"
    template = (
        json.loads(json_file.read_text()).get("chat_template") if json_file.exists() else None
    )
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


# transformers' clean_up_tokenization: the spaces a decode removes.
CLEANUPS = [
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
]


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and
    contractions (WordPiece decodes put one there)."""
    for before, after in CLEANUPS:
        text = text.replace(before, after)
    return text


def has_tokenizer_json(model_dir: str | Path) -> bool:
    return (Path(model_dir) / "tokenizer.json").is_file()
