"""Tool calls the way vLLM serves them: forced calls constrained to the tools' schemas on any model, and "auto"
calls read out of the text of a model that writes them in a known format.

``tool_choice`` naming a function makes the output that function's arguments, a JSON object that follows its
``parameters`` schema; ``"required"`` makes it a JSON array of one or more ``{"name", "parameters"}`` objects, each
one of the tools (one only with ``parallel_tool_calls: false``). Either way the grammar that holds the output to
that form is the same llguidance grammar as ``response_format``'s, so it reaches whichever engine samples
(colocated, or prefill then decode) as a sampling parameter, and the answer comes back as ``tool_calls``.
``"auto"`` (OpenAI's default with tools) needs ``--enable-auto-tool-choice --tool-call-parser hermes``: the
model writes freely, and ``<tool_call>`` blocks in its text become ``tool_calls`` (``Hermes``), as vLLM's parser
of that name reads them; the arguments are then whatever the model wrote.

The chat template sees the tools (``tools=``, for templates that describe them to the model) and the
conversation's earlier calls and answers: as ``tool_calls`` and ``tool`` messages where the template knows
them, and otherwise as the calls' JSON in the assistant's content, so that a plain template still shows the
model what it called.
"""

from __future__ import annotations

import json
import secrets
from typing import Literal

from kvseal.engine.grammar import compile_json_schema
from kvseal.server.schema import Message, Tool

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters left out


def parameters(tool: Tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def output_schema(forced: Tool | Literal["required"], tools: list[Tool], parallel: bool) -> dict:
    """The JSON schema the output must follow."""
    if forced != "required":
        return parameters(forced)
    calls = [{"type": "object", "properties": {"name": {"enum": [t.function.name]}, "parameters": parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return array | ({} if parallel else {"maxItems": 1})


def grammar(forced: Tool | Literal["required"], tools: list[Tool], parallel: bool) -> str:
    return compile_json_schema(output_schema(forced, tools, parallel), "tools")


def _arguments(text: str) -> object:
    """A call's arguments as a template expects them (an object), or the string if it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(messages: list[Message], template: str) -> list[dict]:
    """The conversation as the chat template takes it; a template that never mentions ``tool_calls`` gets an
    assistant's calls as JSON in its content."""
    knows_calls = "tool_calls" in template
    out = []
    for m in messages:
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                     for c in m.tool_calls]
            if knows_calls:
                d["tool_calls"] = calls
            else:
                shown = json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                    for c in calls])
                d["content"] = f"{d['content']}\n{shown}" if d["content"] else shown
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


Mode = Tool | Literal["required", "auto"]


def answer(mode: Mode, text: str) -> tuple[str | None, list[dict] | None]:
    """The output as OpenAI's ``content`` and ``tool_calls``. A named call's arguments are what was written,
    whole or cut short (its ``finish_reason`` says which); a "required" array that is not whole JSON (cut by
    ``max_tokens`` or a stop string) is answered as content; "auto" text with no call in it is content."""
    if mode == "auto":
        content, found = Hermes().feed(text, final=True)
        return (content if content.strip() else None) if found else text, found or None
    if mode != "required":
        return None, [_call(mode.function.name, text)]
    try:
        made = [_call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
    except (ValueError, TypeError, KeyError):  # not the whole array: cut by max_tokens or a stop string
        return text, None
    return (None, made) if made else (text, None)


class Hermes:
    """Calls in the Hermes format (Qwen2.5, Qwen3, Hermes 2 Pro and later): ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`` blocks in the text, read as they stream. Text outside the blocks is content; a block
    that does not hold a call (not JSON, no name) stays in the content as it was written."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.held = ""  # text not yet judged: inside a block, or what may be the start of one
        self.inside = False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content, calls) that ``text`` completes; ``final`` flushes whatever is held as content."""
        self.held += text
        content, calls = "", []
        while True:
            if not self.inside:
                i = self.held.find(self.OPEN)
                if i < 0:
                    keep = next((k for k in range(min(len(self.OPEN) - 1, len(self.held)), 0, -1)
                                 if self.OPEN.startswith(self.held[-k:])), 0)
                    content += self.held[:len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep:]
                    break
                content += self.held[:i]
                self.held, self.inside = self.held[i + len(self.OPEN):], True
            else:
                j = self.held.find(self.CLOSE)
                if j < 0:
                    break
                block, self.held, self.inside = self.held[:j], self.held[j + len(self.CLOSE):], False
                call = _hermes_call(block)
                if call is None:
                    content += self.OPEN + block + self.CLOSE
                else:
                    calls.append(call)
        if final:
            content += (self.OPEN if self.inside else "") + self.held
            self.held, self.inside = "", False
        return content, calls


def _hermes_call(block: str) -> dict | None:
    try:
        c = json.loads(block)
    except ValueError:
        return None
    if not isinstance(c, dict) or not isinstance(c.get("name"), str):
        return None
    args = c.get("arguments", c.get("parameters", {}))
    return _call(c["name"], args if isinstance(args, str) else json.dumps(args))


class StreamedCalls:
    """A streamed choice's deltas. A named function: its arguments as they come, after a first delta with the
    call's id and name. "required": the calls whole, once the array is complete (its text cannot be split into
    calls before then). "auto": content as it comes, and each call whole once its block has closed."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.text = ""
        self.id = f"call_{secrets.token_hex(12)}"
        self.hermes = Hermes() if mode == "auto" else None
        self.calls = 0  # calls sent so far

    def delta(self, text: str, first: bool, finish: str | None) -> dict:
        d: dict = {}
        if self.hermes is not None:
            content, made = self.hermes.feed(text, final=finish is not None)
            if content:
                d["content"] = content
            if made:
                d["tool_calls"] = [{"index": self.calls + i} | c for i, c in enumerate(made)]
                self.calls += len(made)
        elif self.mode != "required":
            fn = {"arguments": text} if not first else {"name": self.mode.function.name, "arguments": text}
            call = {"index": 0, "function": fn} | ({"id": self.id, "type": "function"} if first else {})
            d = {"tool_calls": [call]} if first or text else {}
        else:
            self.text += text
            if finish is not None:
                content, made = answer(self.mode, self.text)
                d = {"tool_calls": [{"index": i} | c for i, c in enumerate(made)]} if made else {"content": content}
        if first:  # the role, and content: null where the answer is calls only
            d = {"role": "assistant", "content": d.pop("content", "" if self.hermes else None)} | d
        return d

    def finish_reason(self, finish: str | None) -> str | None:
        """"tool_calls" for a stream that made calls on its own ("auto"), as vLLM and OpenAI say it."""
        return "tool_calls" if finish == "stop" and self.calls else finish
