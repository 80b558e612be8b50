"""The OpenAI features vLLM users rely on, through the official client, colocated and disaggregated alike:
n > 1, logprobs, penalties and logit_bias, min_tokens and stop_token_ids, structured output (OpenAI's
response_format and vLLM's structured_outputs), completions batches and echo (with the prompt's logprobs),
/tokenize and /detokenize."""

import json
import re

import httpx
import jsonschema
import openai
import pytest
from conftest import MODEL, wait_pages_back
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CHAT = [{"role": "user", "content": "List three colors."}]


@pytest.fixture(scope="module", params=["colocated", "disagg"])
def server(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def token_id(server, text: str) -> int:
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def shared_prompt_tokens(url: str) -> float:
    """The engine's count of prompt tokens that choices read from their first choice's pages."""
    line = next(x for x in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                if x.startswith("kvseal_shared_prompt_tokens_total "))
    return float(line.split()[1])


def test_n_choices_streamed_and_whole(client, server, request):
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0, "n": 3}
    colocated = request.node.callspec.params["server"] == "colocated"  # disaggregated: shared on a prefill
    before = shared_prompt_tokens(server.url) if colocated else 0
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.message.content for c in whole.choices}) == 1  # greedy: every choice the same
    assert whole.usage.completion_tokens == 36 and whole.usage.prompt_tokens < 40  # the prompt counted once
    if colocated:  # the two other choices read the prompt the first one computed, never computing it again
        assert shared_prompt_tokens(server.url) - before == 2 * whole.usage.prompt_tokens
    texts = {0: "", 1: "", 2: ""}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert list(texts.values()) == [c.message.content for c in whole.choices]
    seeded = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 1.0, "n": 3, "seed": 5}
    a = [c.message.content for c in client.chat.completions.create(**seeded).choices]
    b = [c.message.content for c in client.chat.completions.create(**seeded).choices]
    assert a == b and len(set(a)) > 1
    wait_pages_back(server)


def test_chat_logprobs_are_sorted_and_name_the_chosen_token(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        # greedy: the chosen token has the highest logprob; bf16 logits tie often (a step is 1/8 at 16-32), and
        # ties may list in either order (an AMX Xeon tied ' popular' with ' vibrant' here)
        assert e.logprob == pytest.approx(tops[0])
        assert e.token in [t.token for t in e.top_logprobs if t.logprob == pytest.approx(tops[0])]
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completion_logprobs_line_up_with_the_text(client):
    r = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(t) == 2 for t in lp.top_logprobs)


def test_logit_bias_bans_the_greedy_token(client, server):
    kw = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 2, "temperature": 0}
    first = client.completions.create(**kw).choices[0].text
    assert first.startswith(" four")
    banned = client.completions.create(logit_bias={str(token_id(server, " four")): -100}, **kw).choices[0].text
    assert not banned.startswith(" four")


def test_penalties_change_a_repetitive_greedy_output(client):
    kw = {"model": MODEL, "prompt": "ha ha ha ha ha ha ha", "max_tokens": 12, "temperature": 0, "logprobs": 0}
    plain = client.completions.create(**kw).choices[0]
    assert plain.text.count(" ha") >= 8  # the model just repeats
    for extra in ({"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        # at least halved (measured: 3 in bf16, 4 in fp32 with frequency_penalty; 0 with repetition_penalty)
        assert client.completions.create(**kw, **extra).choices[0].text.count(" ha") < plain.text.count(" ha") / 2, extra
    # presence: a flat 2.0 does not beat this model's margin, but the distribution it samples from moved
    pres = client.completions.create(**kw, presence_penalty=2.0).choices[0]
    assert pres.text == plain.text
    assert all(a < b - 1e-3 for a, b in zip(pres.logprobs.token_logprobs[2:], plain.logprobs.token_logprobs[2:]))


def test_stop_token_ids_and_min_tokens(client, server):
    comma = token_id(server, ",")
    kw = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 10, "temperature": 0}
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [comma]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 2  # " four" ","
    assert r.choices[0].text == " four", "as vLLM: the stop token counts, its text is not the answer's"
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [comma], "min_tokens": 4})
    assert r.usage.completion_tokens >= 4
    # vLLM's include_stop_str_in_output keeps the stop token's text, and a matched stop string
    for extra, stop, kept_text in (({"stop_token_ids": [comma]}, None, " four,"), ({}, [", f"], " four, f")):
        for include in (False, True):
            body = {"include_stop_str_in_output": include} | extra
            whole = client.completions.create(**kw, stop=stop, extra_body=body).choices[0].text
            streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, extra_body=body,
                                                                                    stream=True))
            assert whole == streamed == (kept_text if include else " four"), (extra, stop, include, whole, streamed)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                 "admin": {"type": "boolean"}},
                 "required": ["id", "admin"], "additionalProperties": False},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1,
                   "maxItems": 3}},
     "required": ["user", "scores"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "enum-array", "nested"])
def test_json_schema_output_validates(client, schema):
    for temperature in (0, 1.0):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a user as JSON."}], max_tokens=160,
            temperature=temperature, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_and_a_schema_that_cannot_compile(client, server):
    ask = 'Return a JSON object with the key "ok" set to true.'
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}],
                                       max_tokens=160, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert e.value.body["param"] == "response_format"
    wait_pages_back(server)


def test_min_tokens_beside_a_grammar_ends_where_the_grammar_ends(client, server):
    """response_format with min_tokens past the JSON's end was a 500 at temperature 1 (no token left to draw)
    for this request and every request in its step, and at temperature 0 ran on to min_tokens with token 0."""
    closed = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # {"ok":true} or {"ok":false}, then nothing but its end
    for temperature in (0, 1.0):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}], max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": closed}},
            temperature=temperature, seed=2, extra_body={"min_tokens": 30})
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 30, r
        assert json.loads(r.choices[0].message.content) in ({"ok": True}, {"ok": False})
    wait_pages_back(server)


STRUCTURED = [  # vLLM's structured_outputs: each form, and what its output must be
    ({"choice": ["zebra crossing", "platypus", 'a "quoted"\nline']},
     lambda t: t in ("zebra crossing", "platypus", 'a "quoted"\nline')),
    ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"grammar": 'start: "Q" NUM ("," NUM)?\nNUM: /[0-9]{1,3}/'},  # Lark
     lambda t: re.fullmatch(r"Q[0-9]{1,3}(,[0-9]{1,3})?", t)),
    ({"grammar": 'root ::= ("yes" | "no") " " [a-c]'}, lambda t: re.fullmatch(r"(yes|no) [a-c]", t)),  # GBNF
    ({"json": SCHEMAS[0]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0]) is None),
    ({"json": json.dumps(SCHEMAS[2])}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[2]) is None),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
]


@pytest.mark.parametrize("form,holds", STRUCTURED, ids=["choice", "regex", "lark", "gbnf", "json", "json-text",
                                                        "json-object"])
def test_vllm_structured_outputs_hold_the_output_to_its_form(client, form, holds):
    """vLLM's ``structured_outputs`` (``extra_body``; its ``guided_*`` fields before v0.12), greedy and sampled,
    chat and completions: the output is that form, whole (it ends by the grammar, not by max_tokens)."""
    for temperature in (0, 1.0):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=160, temperature=temperature,
                                           seed=5, extra_body={"structured_outputs": form})
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and holds(text), (form, text)
    r = client.completions.create(model=MODEL, prompt="Colors: red, green,", max_tokens=160, temperature=0,
                                  extra_body={"structured_outputs": form})
    assert r.choices[0].finish_reason == "stop" and holds(r.choices[0].text), (form, r.choices[0].text)


def test_logprobs_of_tokens_a_grammar_rules_out_are_floored_as_openai_reports_them(client, server):
    """With JSON output most tokens have logprob -inf, which JSON cannot carry: once the whole answer was a 500
    (colocated), "-Infinity" in a stream, and a 503 "malformed ack" from the prefill worker (disaggregated)."""
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 20,
          "response_format": {"type": "json_object"}}
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices
                for e in (c.logprobs.content if c.logprobs else None) or ()]
    for content in (whole, streamed):
        tops = [t.logprob for e in content for t in e.top_logprobs]  # the first token: `{` or a space, no more
        assert content and len(tops) == 20 * len(content) and min(tops) == -9999.0, tops
        assert all(-9999.0 <= t <= 0 for t in tops + [e.logprob for e in content]), tops
    wait_pages_back(server)


def test_completions_batch_echo_and_choice_order(client):
    r = client.completions.create(model=MODEL, prompt=["One, two, three,", "Monday, Tuesday,"], max_tokens=4,
                                  temperature=0, n=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text.startswith("One, two, three,") for c in r.choices[:2])
    assert all(c.text.startswith("Monday, Tuesday,") for c in r.choices[2:])
    assert r.choices[0].text == r.choices[1].text and r.usage.completion_tokens == 16


def test_a_streamed_completion_equals_the_whole_one(client):
    kw = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text and chunks[-1].finish_reason == whole.finish_reason
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == whole.logprobs.tokens


def test_echo_with_logprobs_scores_the_prompt(client, server):
    """echo with logprobs, as lm-evaluation-harness scores a continuation: the prompt's tokens come first (the
    first with no logprob), each with its logprob given the tokens before it. The logprob the model gave the
    token it generated after a prompt is the logprob that token gets when it is appended to the prompt and
    echoed; streamed equals whole; every choice of n = 2 and a repeat (a prefix-cache hit otherwise) agree."""
    prompt = "One, two, three,"
    gen = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=2)
    assert gen.choices[0].text == " four"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    longer = ids + [token_id(server, " four")]
    kw = {"model": MODEL, "prompt": longer, "max_tokens": 2, "temperature": 0, "logprobs": 2, "echo": True}
    r = client.completions.create(n=2, **kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("One, two, three, four") and len(lp.tokens) == len(longer) + 2
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    scored = lp.token_logprobs[len(ids)]  # " four" after the prompt
    assert lp.tokens[len(ids)] == " four" and " four" in lp.top_logprobs[len(ids)]
    assert scored == pytest.approx(gen.choices[0].logprobs.token_logprobs[0], abs=0.05)
    other = r.choices[1].logprobs
    assert other.tokens == lp.tokens and other.token_logprobs[0] is None
    assert other.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=0.05)
    again = client.completions.create(**kw).choices[0].logprobs
    assert again.tokens == lp.tokens and again.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=0.05)
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = [v for c in chunks if c for v in c.token_logprobs]
    assert [t for c in chunks if c for t in c.tokens] == lp.tokens and streamed[0] is None
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=0.05)
    assert [o for c in chunks if c for o in c.text_offset] == lp.text_offset
    # max_tokens 0 with echo (OpenAI's legacy way to score a text alone): the prompt and its logprobs, no output
    scored = client.completions.create(**{**kw, "max_tokens": 0})
    alone = scored.choices[0]
    assert alone.text == "One, two, three, four" and alone.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(longer)
    assert alone.logprobs.tokens == lp.tokens[:len(longer)] and alone.logprobs.token_logprobs[0] is None
    assert alone.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(longer)], abs=0.05)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**kw, "max_tokens": 0, "echo": False})
    assert e.value.body["param"] == "max_tokens"
    wait_pages_back(server)


def test_vllm_prompt_logprobs_in_completions_and_chat(client, server):
    """vLLM's prompt_logprobs extension: per prompt token None, then {id: {logprob, rank, decoded_token}} for the
    token itself and the k most likely; the same numbers as echo with logprobs; chat carries one list at the top
    level; streaming refuses it (as vLLM)."""
    prompt = "One, two, three, four"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None and r.choices[0].logprobs is None
    for tid, entry in zip(ids[1:], pl[1:]):
        own = entry[str(tid)]
        ranked = sorted(entry.values(), key=lambda e: e["rank"])
        assert own["rank"] >= 1 and [e["rank"] for e in ranked][:2] == [1, 2] and len(entry) in (2, 3)
        assert ranked[0]["logprob"] >= ranked[1]["logprob"] >= -9999 and ranked[0]["logprob"] >= own["logprob"]
        assert (own["rank"] > 2) <= (len(entry) == 3)  # a token below the top 2 is listed beside them
    first = httpx.post(server.url + "/detokenize", json={"tokens": ids[:1]}, timeout=30).json()["prompt"]
    assert first + "".join(pl[i][str(t)]["decoded_token"] for i, t in enumerate(ids) if i) == prompt
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    theirs = echo.choices[0].logprobs.token_logprobs[1:len(ids)]
    assert [pl[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(theirs, abs=0.05)
    assert all(len(e) == 1 for e in echo.choices[0].logprobs.top_logprobs[1:])  # echo's alternatives: logprobs=1
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    cp = c.model_extra["prompt_logprobs"]
    n = httpx.post(server.url + "/tokenize", json={"messages": CHAT}, timeout=30).json()["count"]
    assert len(cp) == n == c.usage.prompt_tokens and cp[0] is None and all(len(e) == 1 for e in cp[1:])
    assert all(v["rank"] >= 1 and v["logprob"] <= 0 for e in cp[1:] for v in e.values())
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, stream=True,
                                       extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    wait_pages_back(server)


@st.composite
def scoring_requests(draw) -> dict:
    """A completions request around echo and prompt logprobs: max_tokens 0 to 3, and any of the fields that
    meet them (n, stream, stop, min_tokens, a batch of prompts, token-id prompts, sampling)."""
    prompt = draw(st.sampled_from(["One, two, three,", "Hi", "a", [5, 6, 7], [[1, 2], [3]], ["x y", "z"]]))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": draw(st.integers(0, 3)), "temperature": 0}
    for k, values in [("echo", st.booleans()), ("logprobs", st.integers(0, 3)), ("prompt_logprobs", st.integers(0, 3)),
                      ("n", st.integers(1, 3)), ("stream", st.booleans()), ("stop", st.sampled_from([",", ["e", " "]])),
                      ("min_tokens", st.integers(0, 2)), ("ignore_eos", st.booleans()), ("seed", st.integers(0, 5)),
                      ("temperature", st.sampled_from([0, 1.0]))]:
        if draw(st.booleans()):
            body[k] = draw(values)
    return body


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=scoring_requests())
def test_echo_and_prompt_logprobs_beside_every_field_they_meet(server, body):
    """Served (200) or refused (400), never a 500 or an error in a 200's stream; a whole answer that echoes
    with logprobs lists each prompt token then each output token, the first with no logprob; vLLM's
    prompt_logprobs has one entry per prompt token; max_tokens 0 generates nothing. (A hand-run of 1,600
    such requests over both modes found no 500.)"""
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code in (200, 400), (body, r.status_code, r.text)
    if r.status_code != 200 or body.get("stream"):
        assert r.status_code != 200 or '"error"' not in r.text, (body, r.text[-300:])
        return
    out = r.json()
    single = isinstance(body["prompt"], str) or isinstance(body["prompt"][0], int)
    n_prompt = out["usage"]["prompt_tokens"]
    for c in out["choices"]:
        if body.get("echo") and body.get("logprobs") is not None:
            lp = c["logprobs"]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, body
            if single and body.get("n", 1) == 1:
                assert len(lp["tokens"]) == n_prompt + out["usage"]["completion_tokens"], body
        if body.get("prompt_logprobs") is not None:
            assert c["prompt_logprobs"][0] is None and all(c["prompt_logprobs"][1:]), body
            if single:
                assert len(c["prompt_logprobs"]) == n_prompt, body
    if body["max_tokens"] == 0:
        assert out["usage"]["completion_tokens"] == 0 and all(c["finish_reason"] == "length" for c in out["choices"])


def test_vllm_continue_final_message_leaves_the_last_message_open(client, server):
    """vLLM's ``continue_final_message`` (with ``add_generation_prompt: false``): the assistant's message is
    rendered without its end of turn and the answer continues it, as the same prompt sent as token ids does;
    with vLLM's chat ``echo`` the answer starts with that message.
    Both flags true is a 400, as in vLLM; so is a ``chat_template_kwargs`` that would replace what the server
    hands the template."""
    msgs = CHAT + [{"role": "assistant", "content": "Red, green"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    tok = lambda body: httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]  # noqa: E731
    open_ids, closed = tok({"messages": msgs, **flags}), tok({"messages": msgs, "add_generation_prompt": False})
    tail = tok({"prompt": "Red, green"})
    assert open_ids[-len(tail):] == tail and len(closed) > len(open_ids), (open_ids, closed)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, extra_body=flags)
    same = client.completions.create(model=MODEL, prompt=open_ids, max_tokens=10, temperature=0)
    assert r.usage.prompt_tokens == len(open_ids) and r.choices[0].message.content == same.choices[0].text
    # vLLM's echo: the answer starts with the assistant's own last message (a user's is not echoed)
    echoed = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                            extra_body=flags | {"echo": True}).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True, extra_body=flags | {"echo": True}))
    assert echoed == streamed == "Red, green" + r.choices[0].message.content, (echoed, streamed)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    same = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                          extra_body={"echo": True})
    assert same.choices[0].message.content == plain.choices[0].message.content
    for body, param in (({"continue_final_message": True}, "continue_final_message"),
                        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs")):
        for path in ("/v1/chat/completions", "/tokenize"):
            q = httpx.post(server.url + path, json={"model": MODEL, "messages": msgs, **body}, timeout=30)
            assert q.status_code == 400 and q.json()["error"]["param"] == param, q.text


def test_vllm_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, server):
    """vLLM's ``truncate_prompt_tokens: k``: the model reads the prompt's last k tokens (chat: of the rendered
    conversation), as if they were the prompt; echo shows what it read; -1 keeps what the context holds; 0, a
    count below -1 or one past the context is a 400."""
    prompt = "One, two, three, four, five,"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    cut = client.completions.create(prompt=prompt, echo=True,
                                    extra_body={"truncate_prompt_tokens": 4}, **kw)
    alone = client.completions.create(prompt=ids[-4:], **kw)
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text.endswith(alone.choices[0].text)
    assert cut.choices[0].text == httpx.post(server.url + "/detokenize", json={"tokens": ids[-4:]},
                                             timeout=30).json()["prompt"] + alone.choices[0].text
    whole = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": -1}, **kw)
    assert whole.usage.prompt_tokens == len(ids)
    r = client.chat.completions.create(messages=CHAT, extra_body={"truncate_prompt_tokens": 5}, **kw)
    assert r.usage.prompt_tokens == 5
    window = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    for k in (0, -2, window + 1):
        q = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "truncate_prompt_tokens": k} | kw,
                       timeout=30)
        assert q.status_code == 400 and q.json()["error"]["param"] == "truncate_prompt_tokens", (k, q.text)


def test_vllm_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries the usage so
    far, counting up to the final usage chunk; without it only that last chunk does."""
    kw = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True, "n": 2}
    for continuous in (False, True):
        opts = {"include_usage": True} | ({"continuous_usage_stats": True} if continuous else {})
        chunks = list(client.chat.completions.create(stream_options=opts, **kw))
        *body, last = chunks
        assert not last.choices and last.usage.completion_tokens == 16
        if not continuous:
            assert all(c.usage is None for c in body)
            continue
        counts = [c.usage.completion_tokens for c in body]
        assert all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in body)
        assert counts == sorted(counts) and 1 <= counts[0] and counts[-1] == 16, counts


def test_vllm_skip_special_tokens_false_keeps_special_tokens_but_the_end(client, server):
    """vLLM's ``skip_special_tokens: false``: special tokens are part of the text, whole and streamed, except
    the end of sequence that ends the request (``include_stop_str_in_output`` keeps that one too)."""
    start = token_id(server, "<|im_start|>")
    kw = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    forced = {"logit_bias": {str(start): 100}}  # a special token each step, mid-text
    for skip, want in ((True, ""), (False, "<|im_start|>" * 3)):
        body = forced | {"skip_special_tokens": skip}
        r = client.completions.create(**kw, extra_body=body)
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, extra_body=body, stream=True))
        assert r.choices[0].finish_reason == "length" and r.choices[0].text == streamed == want, (skip, r, streamed)
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 60, "temperature": 0}
    plain = client.chat.completions.create(**chat).choices[0]
    kept = client.chat.completions.create(**chat, extra_body={"skip_special_tokens": False}).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **chat, extra_body={"skip_special_tokens": False}, stream=True))
    assert plain.finish_reason == kept.finish_reason == "stop" and kept.message.content == streamed == plain.message.content
    ended = client.chat.completions.create(**chat, extra_body={"skip_special_tokens": False,
                                                               "include_stop_str_in_output": True}).choices[0]
    assert ended.message.content == plain.message.content + "<|im_end|>", ended.message.content


def test_tokenize_detokenize_round_trip(server):
    t = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello, world!"}, timeout=30).json()
    assert t["count"] == len(t["tokens"]) > 1 and t["max_model_len"] == 8192
    d = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": t["tokens"]}, timeout=30).json()
    assert d["prompt"] == "Hello, world!"
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert chat["count"] > t["count"]
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# -- tools: named and "required" calls, constrained to the tools' schemas as vLLM serves them on any model -------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


def streamed_calls(chunks) -> dict[int, dict]:
    """A stream's tool-call deltas put together, by call index."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.choices:
            for d in c.delta.tool_calls or ():
                call = out.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    return out


def test_a_named_tool_call_is_its_functions_arguments_whole_and_streamed(client):
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 60, "temperature": 0,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and m.content is None and len(m.tool_calls) == 1, m
    call = m.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    got = streamed_calls(chunks)
    assert list(got) == [0] and got[0]["name"] == "get_weather" and got[0]["id"].startswith("call_")
    assert got[0]["arguments"] == call.function.arguments  # greedy: the same arguments, in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize("parallel,temperature", [(True, 0), (False, 0), (True, 1.0)])
def test_required_tool_calls_each_follow_their_tools_schema(client, parallel, temperature):
    """Greedy, this model calls both tools (on a Zen 3, fp32): ``parallel_tool_calls: false`` holds it to one."""
    kw = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 120,
          "temperature": temperature, "seed": 11, "parallel_tool_calls": parallel}
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and calls and (parallel or len(calls) == 1), r.choices[0].message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    got = streamed_calls(client.chat.completions.create(stream=True, **kw))  # greedy or seeded: the same calls
    assert [(g["name"], json.loads(g["arguments"])) for g in got.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert len({g["id"] for g in got.values()}) == len(got)


def test_a_conversation_with_calls_and_their_answers_reaches_the_model(client, server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"}]
    prompt = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": [WEATHER]}, timeout=30).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": prompt["tokens"]}, timeout=30).json()["prompt"]
    # this model's template knows no tool calls: the call is shown in the assistant's turn, the answer in its own
    assert '"name": "get_weather"' in text and '"city": "Paris"' in text and "Sunny, 21 degrees" in text, text
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    wait_pages_back(server)


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto", the default with tools: no parser of this model's format
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "echo": True}, "echo"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
])
def test_tool_requests_kvseal_cannot_serve_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4} | body,
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_template_that_knows_tool_calls_gets_them_with_their_arguments_as_objects():
    import jinja2

    from kvseal.server.schema import Message
    from kvseal.server.tools import template_messages
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    msgs = [Message.model_validate(m) for m in (
        ASK[0], {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"})]
    knows = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
             "<call {{ c.function.name }} {{ c.function.arguments.zone }}>{% endfor %}"
             "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %};{% endfor %}")
    rendered = jinja2.Environment().from_string(knows).render(messages=template_messages(msgs, knows))
    assert rendered.endswith("assistant:<call get_time UTC>;tool:12:00(call_1);"), rendered
    plain = template_messages(msgs, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert json.loads(plain[1]["content"]) == [{"name": "get_time", "arguments": {"zone": "UTC"}}]


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: ???"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "tools": [WEATHER], "tool_choice": "required"}, "structured_outputs"),
])
def test_structured_outputs_kvseal_cannot_serve_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4} | body,
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
