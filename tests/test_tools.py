"""tool_choice "auto": calls read out of the model's text (the Hermes format of Qwen2.5/Qwen3), whole and streamed,
through the real front door over a scripted backend. SmolLM2 writes no such calls, and no model that does ships
here: the backend plays the text a Qwen-style model writes, token by token through the real tokenizer, detokenizer
and formatter. Forced calls (named, "required") run on the real model in test_openai_features.py."""

import json

import pytest
from fastapi.testclient import TestClient

from kvseal.config import Protections
from kvseal.engine.request import Event
from kvseal.server.tools import Hermes, answer

SCRIPT = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
          '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n, _ in CALLS]


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_reads_the_same_calls_and_content_however_the_text_is_cut():
    content, calls = answer("auto", SCRIPT)
    assert content == "Let me look that up.\n\n" and named(calls) == CALLS
    for a in range(len(SCRIPT) + 1):
        for b in sorted({a, min(a + 1, len(SCRIPT)), min(a + 7, len(SCRIPT))}):
            h, got, text = Hermes(), [], ""
            for i, piece in enumerate((SCRIPT[:a], SCRIPT[a:b], SCRIPT[b:])):
                c, made = h.feed(piece, final=i == 2)
                text += c
                got += made
            assert text == content and named(got) == CALLS, (a, b)


@pytest.mark.parametrize("text,content,calls", [
    ("Paris is sunny.", "Paris is sunny.", None),  # no call: the text, as it was
    ("a <tool", "a <tool", None),  # what looked like the start of a block, held, then given back
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", None),  # not a call: kept
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', None),  # no name
    ('x<tool_call>{"name": "f", "arguments": {"a": 1}', 'x<tool_call>{"name": "f", "arguments": {"a": 1}', None),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', None, [("f", {"a": 1})]),
])
def test_hermes_leaves_whatever_is_not_a_whole_call_in_the_content(text, content, calls):
    c, made = answer("auto", text)
    assert c == content and (named(made) if made else None) == calls


@pytest.mark.parametrize("text", ['[{"name": "f", "parameters": {"a"', '[{"name": "f"}]', "[]", '{"name": "f"}'])
def test_required_output_that_is_not_a_whole_array_of_calls_is_content(text):
    """Cut by max_tokens or a stop string, "required"'s output is answered as the text it is, never a 500."""
    assert answer("required", text) == (text, None)


class Scripted:
    """A backend whose every generation is ``text``, one token per event, then a stop."""

    model_name, context_window, pool_tokens, prot = "m", 8192, 8192, Protections()

    def __init__(self, tokenizer, text: str) -> None:
        self.ids = tokenizer.encode(text, add_special_tokens=False)

    def check_capacity(self) -> None:
        pass

    async def generate(self, req):
        for t in self.ids:
            yield Event(req.rid, (t,))
        yield Event(req.rid, (), "stop")


@pytest.fixture(scope="module")
def tokenizer():
    from kvseal.model.files import default_model_path, load_tokenizer, tokenizer_source

    return load_tokenizer(tokenizer_source(default_model_path()))


def front(tokenizer, text: str, parser: str | None) -> TestClient:
    from kvseal.server.api import create_app
    from kvseal.server.metrics import Metrics
    from kvseal.server.served import Served

    return TestClient(create_app(Scripted(tokenizer, text), tokenizer, Metrics(), served=Served(["m"], "m", {}, parser)))


BODY = {"model": "m", "messages": [{"role": "user", "content": "Weather and time in Paris?"}], "tools": TOOLS}


def test_auto_answers_the_calls_in_the_text_whole_and_streamed(tokenizer):
    client = front(tokenizer, SCRIPT, "hermes")
    r = client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look that up.\n\n"
    assert named(choice["message"]["tool_calls"]) == CALLS
    deltas = []
    with client.stream("POST", "/v1/chat/completions", json=BODY | {"stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                deltas += json.loads(line[6:])["choices"]
    assert deltas[0]["delta"]["role"] == "assistant" and deltas[-1]["finish_reason"] == "tool_calls"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me look that up.\n\n"
    streamed = [c for d in deltas for c in d["delta"].get("tool_calls") or ()]
    assert [c["index"] for c in streamed] == [0, 1] and named(streamed) == CALLS
    assert all(c["id"].startswith("call_") for c in streamed)


def test_auto_with_no_call_in_the_text_is_plain_content(tokenizer):
    r = front(tokenizer, "It is sunny in Paris.", "hermes").post("/v1/chat/completions", json=BODY)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"] == {"role": "assistant",
                                                                       "content": "It is sunny in Paris."}


def test_auto_without_a_parser_is_a_400_that_names_the_flags(tokenizer):
    for body in (BODY, BODY | {"tool_choice": "auto"}):
        r = front(tokenizer, SCRIPT, None).post("/v1/chat/completions", json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tool_choice" and "--tool-call-parser" in err["message"]


def test_auto_in_the_responses_api_answers_a_message_and_function_call_items(tokenizer):
    """The same text through /v1/responses: the content as a message item, then one function_call item per
    call, whole and streamed (the items come once the text has ended, in the same order)."""
    client = front(tokenizer, SCRIPT, "hermes")
    flat = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
            for t in TOOLS]
    body = {"model": "m", "input": "Weather and time in Paris?", "tools": flat}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [o["type"] for o in out] == ["message", "function_call", "function_call"]
    assert out[0]["content"][0]["text"] == "Let me look that up.\n\n"
    assert [(o["name"], json.loads(o["arguments"])) for o in out[1:]] == CALLS
    assert all(o["call_id"].startswith("call_") and o["status"] == "completed" for o in out[1:])
    events = []
    with client.stream("POST", "/v1/responses", json=body | {"stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["type"] for d in done] == ["message", "function_call", "function_call"]
    args = [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [c[1] for c in CALLS]
    final = events[-1]
    assert final["type"] == "response.completed" and [o["type"] for o in final["response"]["output"]] == \
        ["message", "function_call", "function_call"]
