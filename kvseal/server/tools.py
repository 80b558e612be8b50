"""Tool calls the way vLLM serves them on any model: constrained to the tools' schemas, never parsed out of text.

``tool_choice`` naming a function makes the output that function's arguments, a JSON object that follows its
``parameters`` schema; ``"required"`` makes it a JSON array of one or more ``{"name", "parameters"}`` objects, each
one of the tools (one only with ``parallel_tool_calls: false``). Either way the grammar that holds the output to
that form is the same llguidance grammar as ``response_format``'s, so it reaches whichever engine samples
(colocated, or prefill then decode) as a sampling parameter, and the answer comes back as ``tool_calls``.

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


def calls(forced: Tool | Literal["required"], text: str) -> list[dict] | None:
    """The output as OpenAI's ``tool_calls``; None where it is not whole (cut short by ``max_tokens``): the
    answer then carries the text as content, with ``finish_reason: "length"``."""
    if forced != "required":
        return [_call(forced.function.name, text)]
    try:
        made = json.loads(text)
    except ValueError:
        return None
    return [_call(c["name"], json.dumps(c["parameters"])) for c in made]


class StreamedCalls:
    """A streamed choice's deltas: a named function's arguments as they come, after a first delta with the
    call's id and name; ``"required"``'s calls whole, once the array is complete (its text cannot be split into
    calls before then)."""

    def __init__(self, forced: Tool | Literal["required"]) -> None:
        self.forced = forced
        self.text = ""
        self.id = f"call_{secrets.token_hex(12)}"

    def delta(self, text: str, first: bool, finish: str | None) -> dict:
        if self.forced != "required":
            fn = {"arguments": text} if not first else {"name": self.forced.function.name, "arguments": text}
            call = {"index": 0, "function": fn} | ({"id": self.id, "type": "function"} if first else {})
            d = {"tool_calls": [call]} if first or text else {}
        else:
            self.text += text
            d = {}
            if finish is not None:
                made = calls(self.forced, self.text)
                d = {"tool_calls": [{"index": i} | c for i, c in enumerate(made)]} if made else {"content": self.text}
        return ({"role": "assistant", "content": None} | d) if first else d
