"""What the HTTP front door (colocated server or router) says about its model, from vLLM's model flags:

- ``--served-model-name NAME [NAME ...]``: the names requests may use (the first is the one ``/v1/models``
  lists first); default: the checkpoint's file or directory name;
- ``--tokenizer PATH``: a tokenizer other than the checkpoint's (an HF directory or a GGUF file);
- ``--chat-template FILE``: a Jinja chat template replacing the tokenizer's (a string with ``{`` is taken as
  the template itself, as vLLM does);
- ``--generation-config auto|none|DIR``: sampling defaults from ``generation_config.json`` (the checkpoint's
  with ``auto``): temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as the default
  ``max_tokens``). A request's own value always wins. As vLLM, ``do_sample`` is not read: a checkpoint that
  sets a temperature samples unless the request says ``temperature: 0``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvseal.model.arch import ConfigError

# generation_config.json key → request field
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class Served:
    names: list[str]
    root: str  # the checkpoint it serves, as given
    defaults: dict = field(default_factory=dict)  # request field → default from the generation config
    tool_parser: str | None = None  # --tool-call-parser, with --enable-auto-tool-choice: tool_choice "auto"


def add_front_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model names requests may use (default: the checkpoint's name)")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template replacing the tokenizer's")
    p.add_argument("--generation-config", default="auto", metavar="auto|none|DIR",
                   help="sampling defaults from generation_config.json (auto: the checkpoint's); requests override")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default with tools), reading calls out of the model\'s text '
                        "with --tool-call-parser (as vLLM's flags)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="the model's tool-call format: hermes (<tool_call>{json}</tool_call>: Qwen2.5, Qwen3, "
                        "Hermes 2 Pro and later)")
    p.add_argument("--admin-key", default=None, metavar="KEY",
                   help="the operator's key: /dashboard (pages of every pool, by state and tenant); off without it")
    p.add_argument("--per-tenant-metrics", action="store_true",
                   help="label request and prefix-cache metrics with tenant names (default: one label, 'all'); "
                        "/metrics then answers only --admin-key")


def model_path(model: str | None) -> Path:
    from kvseal.model.files import default_model_path

    return Path(model) if model else default_model_path()


def generation_defaults(model: str | None, how: str) -> dict:
    if how == "none":
        return {}
    d = model_path(model) if how == "auto" else Path(how)
    f = d / "generation_config.json" if d.is_dir() else None
    if f is None or not f.exists():
        if how != "auto":
            raise ConfigError(f"--generation-config {how}: no generation_config.json there")
        return {}
    try:
        g = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f}: not valid JSON ({e})") from None
    out = {}
    for key, field_ in GENERATION_KEYS.items():
        v = g.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[field_] = v
    from pydantic import ValidationError

    from kvseal.server.schema import CompletionRequest

    try:  # the same bounds a request's own values must keep (they are applied without re-validation)
        CompletionRequest(model="-", prompt="-", **out)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"{f}: {err['loc'][0]} {err['input']!r}: {err['msg']}") from None
    return out


def chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if "{" in value:
        return value
    try:
        return Path(value).read_text()
    except OSError as e:
        raise ConfigError(f"--chat-template {value}: {e.strerror}") from None


def check_front(a: argparse.Namespace) -> None:
    """The front door's flags, refused in one line before anything starts."""
    generation_defaults(a.model, a.generation_config)
    template = chat_template(a.chat_template)
    if template is not None:
        import jinja2

        try:
            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"--chat-template: line {e.lineno}: {e.message}") from None
    if a.enable_auto_tool_choice != (a.tool_call_parser is not None):
        raise ConfigError("--enable-auto-tool-choice and --tool-call-parser go together: the parser reads the "
                          "model's calls out of its text")
    if a.per_tenant_metrics and not a.admin_key:
        raise ConfigError("--per-tenant-metrics needs --admin-key: series that name tenants are the admin's to read")
    if a.served_model_name is not None and (not a.served_model_name or any(not n for n in a.served_model_name)):
        raise ConfigError("--served-model-name needs non-empty names")
    from kvseal.server.tenants import Tenants

    try:  # a malformed key or an unreadable keys file: refused now, not after the model has loaded
        Tenants.load(a.api_key, a.api_keys, a.admin_key)
    except OSError as e:
        raise ConfigError(f"--api-keys {a.api_keys}: {e.strerror}") from None


def front(a: argparse.Namespace, tokenizer: object) -> Served:
    """The served names and sampling defaults; installs ``--chat-template`` on ``tokenizer``."""
    path = model_path(a.model)
    template = chat_template(a.chat_template)
    if template is not None:
        tokenizer.chat_template = template
    names = list(a.served_model_name or [path.stem if path.is_file() else path.name])
    return Served(names, str(a.model or path), generation_defaults(a.model, a.generation_config),
                  a.tool_call_parser if a.enable_auto_tool_choice else None)


def front_tokenizer_source(a: argparse.Namespace) -> Path:
    """Where the front door reads its tokenizer: a directory, or a GGUF file whose load cache is not written."""
    from kvseal.model.files import tokenizer_source

    return tokenizer_source(Path(a.tokenizer) if a.tokenizer else model_path(a.model))


def load_front_tokenizer(a: argparse.Namespace) -> object:
    from kvseal.model.files import load_tokenizer

    return load_tokenizer(front_tokenizer_source(a))
