"""OpenAI's Responses API (``client.responses``): the chat path's answer in the Response shape, whole and as typed
events, both modes; what it cannot serve is a 400 naming the field; nothing is stored."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from conftest import MODEL, wait_pages_back
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_api import JSON, ints, served_or_refused
from test_openai_features import client, server  # noqa: F401 - the fixtures: both modes, one openai client each

from kvseal.errors import KVIntegrityError
from kvseal.server.reply import Formatter, Piece
from kvseal.server.responses import Answer, ResponsesRequest, to_chat
from kvseal.server.text import TokenStrings

INSTRUCTIONS = "You are a helpful assistant."
ASK = "List three colors."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


def cached(send, **kw):
    """A greedy answer that another is compared with: sent twice, the second kept. The first request of a prompt
    computes all of it; later ones read its full pages from the prefix cache and compute the rest, and in bf16
    the two paths may break a near-tie differently. Compared answers are all cache hits, read the same way."""
    send(**kw)
    return send(**kw)


def test_a_response_is_the_chat_answer_whole_and_streamed(client, server):
    """The same conversation through chat completions and responses: the same greedy text and token counts;
    stopped by max_output_tokens it is "incomplete", as OpenAI says it. The stream's events come in OpenAI's
    order with consecutive sequence numbers, and its deltas make the whole answer's text."""
    chat = cached(client.chat.completions.create, model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}])
    kw = {"model": MODEL, "instructions": INSTRUCTIONS, "input": ASK, "max_output_tokens": 12, "temperature": 0}
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL and r.store is False
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "incomplete"

    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"], kinds
    assert kinds[-5:] == ["response.output_text.delta", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12

    done = {"model": MODEL, "input": ASK, "max_output_tokens": 200, "temperature": 0}
    whole = cached(client.responses.create, **done)
    assert whole.status == "completed" and whole.incomplete_details is None and whole.usage.output_tokens < 200
    with client.responses.stream(**done) as s:  # the client's own helper rebuilds the response from the events
        final = s.get_final_response()  # (a "response.completed" one only)
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    wait_pages_back(server)


def test_input_items_are_the_conversation_the_template_sees(client, server):
    """Messages with text parts, an earlier function call and its output: the prompt is the chat template's
    rendering of the same conversation as chat messages (the same token count)."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "unit": "celsius"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 degrees"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
             {"role": "user", "content": "And tomorrow?"}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [{"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"},
                {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "And tomorrow?"}]
    want = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()["count"]
    r = cached(client.responses.create, model=MODEL, instructions=INSTRUCTIONS, input=items, max_output_tokens=4,
               temperature=0)
    assert r.usage.input_tokens == want and r.output_text
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert r.output_text == chat.choices[0].message.content


def test_a_named_function_call_is_an_item_whole_and_streamed(client, server):
    kw = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER], "max_output_tokens": 60,
          "temperature": 0, "tool_choice": {"type": "function", "name": "get_weather"}}
    r = cached(client.responses.create, **kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert r.status == "completed" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments == final.output[0].arguments  # greedy: the same call
    assert events[-1].type == "response.completed"
    wait_pages_back(server)


def test_a_client_leaving_a_stream_stops_its_generation(server):
    """4,000 tokens would take most of a minute: the pages come back within seconds of the client leaving."""
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 4000, "stream": True,
            "logit_bias": {"0": -100, "2": -100}}  # SmolLM2's <|endoftext|> and <|im_end|>: no end but the bound
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:
                break
    wait_pages_back(server, timeout=10)


def test_text_format_json_schema_and_logprobs(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}},
              "required": ["color"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Name a color as JSON.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    r = cached(client.responses.create, model=MODEL, input=ASK, max_output_tokens=6, temperature=0, top_logprobs=2,
               include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 6 and "".join(x.token for x in lps) == r.output_text
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.logprob - 1e-4 for x in lps)
    plain = client.responses.create(model=MODEL, input=ASK, max_output_tokens=6, temperature=0)
    assert not plain.output[0].content[0].logprobs and plain.output_text == r.output_text


@pytest.mark.parametrize("body,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # no parser of this model's call format
    ({"tools": [WEATHER | {"name": "bad name"}], "tool_choice": "required"}, "tools.0.name"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 100_000}, "input"),  # can never fit: context_length_exceeded
    ({"temperature": 3}, "temperature"),
    ({"n": 2}, "n"),
])
def test_what_responses_cannot_serve_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": ASK} | body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_nothing_is_stored(client, server):
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, store=True, metadata={"k": "v"})
    assert r.store is False and r.metadata == {"k": "v"}
    for method, path in (("GET", r.id), ("DELETE", r.id), ("POST", r.id + "/cancel")):
        got = httpx.request(method, f"{server.url}/v1/responses/{path}", timeout=30)
        assert got.status_code == 404 and got.json()["error"]["code"] == "not_found", got.text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


class Failing:
    """A reply whose third piece is an integrity failure (decode's tag check refusing a page): mid-stream."""

    finish = None
    tenant = "default"
    cached_tokens = n_tokens = 0

    def __init__(self) -> None:
        self.left = [Piece("one"), Piece(" two"), KVIntegrityError("a page failed its tag check")]
        self.metrics = self
        self.ended: list[int] = []

    def finished(self, status: int, tenant: str | None) -> None:
        self.ended.append(status)

    async def next(self):
        x = self.left.pop(0)
        if isinstance(x, Exception):
            raise x
        return x

    async def close(self) -> None:
        pass


def test_a_stream_that_fails_midway_says_so_and_never_completes():
    """After the 200 went out, a failure is an ``error`` event and ``response.failed``: never a quiet end, and
    never ``response.completed`` over a partial answer."""
    req = ResponsesRequest(model=MODEL, input=ASK, stream=True)
    chat = to_chat(req)
    fmt = Formatter("x", MODEL, True, TokenStrings(None), 5)
    reply = Failing()

    async def drain() -> list[dict]:
        out = [c async for c in Answer(req, chat, fmt).stream(reply, Piece(""))]
        return [json.loads(c.split(b"data: ", 1)[1]) for c in out]

    events = asyncio.run(asyncio.wait_for(drain(), 5))
    kinds = [e["type"] for e in events]
    assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds, kinds
    assert events[-2]["code"] == events[-1]["response"]["error"]["code"] == "kv_integrity_error"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert reply.ended == [500]


PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "x"]),
                                        "text": st.text(max_size=8)}), max_size=2)
ITEMS = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                           "content": st.text(max_size=12) | PARTS}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call")}, optional={
        "call_id": st.text(max_size=4), "name": st.sampled_from(["f", "bad name"]),
        "arguments": st.sampled_from(["{}", "[", 3])}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call_output", "reasoning", "item_reference"])},
                          optional={"call_id": st.text(max_size=4), "output": st.text(max_size=6) | PARTS})),
    min_size=1, max_size=3)
FIELDS = {
    "instructions": st.text(max_size=12), "max_output_tokens": ints(0, 3), "temperature": st.floats(0, 2.5),
    "top_p": st.floats(0, 1), "top_logprobs": ints(-1, 21), "stream": st.booleans(),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]),
                        max_size=2),
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                             "name": st.sampled_from(["f", "g", "bad name"])},
                                            optional={"parameters": st.sampled_from([{"type": "object"}, {}]),
                                                      "extra": st.booleans()}), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", "any"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "name": st.sampled_from(["f", "h"])}),
    "text": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
        optional={"schema": st.sampled_from([{"type": "object"}, {"type": "no-such-type"}]),
                  "name": st.text(max_size=3)}),
        "verbosity": st.sampled_from(["low", "loud"])}),
    "store": st.booleans(), "metadata": st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
    "stream_options": st.fixed_dictionaries({"include_obfuscation": st.booleans()}),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from([None, "low"])}),
    "truncation": st.sampled_from(["disabled", "auto"]), "previous_response_id": st.text(max_size=4),
    "seed": ints(-(2**70), 2**70), "top_k": ints(-2, 60), "parallel_tool_calls": st.booleans(),
    "cache_salt": st.text(max_size=4), "logit_bias": st.dictionaries(ints(-2, 50_000).map(str), st.floats(-101, 101),
                                                                     max_size=2),
}


@st.composite
def bodies(draw) -> dict:
    """A request that would be served, with up to four fields drawn (one time in five any JSON at all)."""
    body = {"model": MODEL, "input": draw(st.text(min_size=1, max_size=12) | ITEMS), "max_output_tokens": 2}
    for k in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        body[k] = draw(JSON) if draw(st.integers(0, 4)) == 0 else draw(FIELDS[k])
    return body


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=bodies())
def test_any_responses_body_is_served_or_refused_never_a_500(colocated, body):
    served_or_refused(colocated.url + "/v1/responses", body)
