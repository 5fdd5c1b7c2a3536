"""The request adapters (glm53.serving.protocol) on the shipped model's tokenizer: no engine, no HTTP server.

Issue 28, the protocol side: every request that passes validation is either turned into a `Generation` or
refused with a 400 naming its field, never a crash; nothing a client sends is pasted into the prompt as JSON
(media refused, earlier thinking dropped); the `Limits` bound stop strings and tools; error texts stay short;
a prompt's errors are about `messages` / `prompt`.
"""

import json

import pytest
from pydantic import ValidationError

from glm53 import assets, tokenizer
from glm53.serving import constrain
from glm53.serving import protocol as P
from glm53.serving.limits import INT32_MAX, Limits

MODEL = "glm53-mini"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def tok():
    return tokenizer.load_tokenizer(assets.require_default_model())


def _loads(body: dict):
    """The body as the app's JSON parser gives it (json.loads: `\\ud800` escapes become lone surrogates)."""
    return json.loads(json.dumps(body))


def chat(tok, max_len=256, limits=None, **body):
    r = P.ChatRequest.model_validate(_loads({"model": MODEL, **body}))
    return P.openai_chat(r, tok, max_len, limits=limits)


def completion(tok, limits=None, **body):
    r = P.CompletionRequest.model_validate(_loads({"model": MODEL, **body}))
    return P.openai_completion(r, tok, tok.vocab_size, limits=limits)


def messages(tok, limits=None, **body):
    r = P.MessagesRequest.model_validate(_loads({"model": MODEL, "max_tokens": 16, **body}))
    return P.anthropic_messages(r, tok, limits=limits)


def count(tok, limits=None, **body):
    r = P.CountTokensRequest.model_validate(_loads({"model": MODEL, **body}))
    return P.anthropic_count(r, tok, limits=limits)


def refused(fn, *args, **kw) -> P.ApiError:
    with pytest.raises(P.ApiError) as e:
        fn(*args, **kw)
    err = e.value
    assert err.status == 400 and err.message.startswith(f"{err.param}: "), (err.param, err.message)
    for api in ("openai", "anthropic"):  # the answer always encodes (no lone surrogate, bounded)
        assert len(json.dumps(P.error_body(api, err), ensure_ascii=False).encode("utf-8")) < 2000
    return err


def user(text="Hi"):
    return [{"role": "user", "content": text}]


def fn_tool(name="get_weather", params=None, description="Weather."):
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": params or WEATHER}}  # fmt: skip


# ------------------------------------------------------------------------------------------------ 1: Unicode
BAD = "a\ud800b"  # JSON "a\ud800b": a lone surrogate


@pytest.mark.parametrize(
    "call, body, param",
    [
        (chat, {"messages": user(BAD)}, "messages[0].content"),
        (chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
         "messages[0].content[0].text"),
        (chat, {"messages": [{"role": "assistant", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": BAD, "arguments": "{}"}}]}, *user()]},
         "messages[0].tool_calls[0].function.name"),
        (chat, {"messages": user(), "tools": [fn_tool(description=BAD)]}, "tools[0].function.description"),
        (chat, {"messages": user(), "tools": [fn_tool(params={"type": "object", "properties": {BAD: {}}})]},
         "tools[0].function.parameters.properties"),
        (chat, {"messages": user(), "stop": [BAD]}, "stop[0]"),
        (completion, {"prompt": BAD}, "prompt"),
        (messages, {"messages": user(BAD)}, "messages[0].content"),
        (messages, {"messages": user(), "system": BAD}, "system"),
        (messages, {"messages": user(), "system": [{"type": "text", "text": BAD}]}, "system[0].text"),
        (messages, {"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": BAD}]}]}]},
         "messages[0].content[0].content[0].text"),
        (messages, {"messages": user(), "tools": [{"name": "f", "input_schema": {"enum": [BAD]}}]},
         "tools[0].input_schema.enum[0]"),
        (messages, {"messages": user(), "stop_sequences": [BAD]}, "stop_sequences[0]"),
        (count, {"messages": user(BAD)}, "messages[0].content"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_a_400_naming_the_field(tok, call, body, param):
    err = refused(call, tok, **body)
    assert err.param == param and "invalid Unicode (a lone surrogate)" in err.message


def test_surrogate_pairs_are_valid_text(tok):
    emoji = json.loads('"\\ud83d\\ude00"')  # a pair: one astral character
    assert count(tok, messages=user(emoji)) > 0 and chat(tok, messages=user(emoji)).request.prompt


# ------------------------------------------------------------------------------------------------ 2: schema types
def _forced(tok, prop_schema, api="openai"):
    schema = {"type": "object", "properties": {"a": prop_schema}}
    if api == "openai":
        gen = chat(tok, messages=user(), tools=[fn_tool("f", schema)],
                   tool_choice={"type": "function", "function": {"name": "f"}})  # fmt: skip
    else:
        gen = messages(tok, messages=user(), tools=[{"name": "f", "input_schema": schema}],
                       tool_choice={"type": "tool", "name": "f"})  # fmt: skip
    c = gen.request.constraint
    assert c is not None and gen.tools.force == "f"
    return c


def _takes(c, text: str) -> bool:
    g = c.grammar
    s = g.feed(g.start(), text)
    return s is not None and g.done(s)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_list_type_constrains_to_the_union(tok, api):
    c = _forced(tok, {"type": ["string", "null"]}, api)
    assert _takes(c, '{"a": null}') and _takes(c, '{"a": "x"}')
    assert not _takes(c, '{"a": 1}') and not _takes(c, '{"a": {}}')
    assert c.allowed('{"a": ', 0).any()  # the mask of the typed value (its closing move: a string's quote)
    c = _forced(tok, {"type": ["integer", "boolean"]}, api)
    assert _takes(c, '{"a": -3}') and _takes(c, '{"a": true}') and not _takes(c, '{"a": "x"}')


@pytest.mark.parametrize("bad", [{"x": 1}, 5, [], ["string", "file"], ["string", 3], None, "file", True])
def test_a_malformed_type_leaves_the_value_free(tok, bad):
    c = _forced(tok, {"type": bad})
    assert all(_takes(c, t) for t in ('{"a": 1}', '{"a": "x"}', '{"a": null}', '{"a": [{}]}'))
    assert not _takes(c, '{"b": 1}')  # the keys are still the schema's


def test_first_chars_of_types():
    assert constrain.first_chars("string") == '"' and constrain.first_chars(["null", "string"])[0] == '"'
    assert set(constrain.first_chars(["integer", "number"])) == set("0-123456789")
    assert [constrain.first_chars(t) for t in ({"a": 1}, [], ["x"], 1, None)] == [""] * 5


# ------------------------------------------------------------------------------------------------ 3: content blocks
def _turns(assistant_content):
    return [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": assistant_content},
            {"role": "user", "content": "And 3+3?"}]  # fmt: skip


@pytest.mark.parametrize(
    "block",
    [{"type": "thinking", "thinking": "2+2 is 4, simple.", "signature": "sig"},
     {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}],
)  # fmt: skip
def test_earlier_thinking_blocks_are_dropped(tok, block):
    plain = _turns([{"type": "text", "text": "4."}])
    with_thinking = _turns([block, {"type": "text", "text": "4."}])
    ids = messages(tok, messages=plain).request.prompt
    assert messages(tok, messages=with_thinking).request.prompt == ids
    assert count(tok, messages=with_thinking) == count(tok, messages=plain) == len(ids)
    # with a tool call after the thinking, as in a tool loop
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
    assert count(tok, messages=_turns([block, call])) == count(tok, messages=_turns([call]))


def test_thinking_blocks_belong_to_assistant_messages(tok):
    body = [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}]
    assert refused(count, tok, messages=body).param == "messages[0].content[0]"


def test_openai_reasoning_content_is_not_fed_back(tok):
    plain = [*user("What is 2+2?"), {"role": "assistant", "content": "4."}, *user("And 3+3?")]
    extra = [*user("What is 2+2?"), {"role": "assistant", "content": "4.", "reasoning_content": "2+2=4"},
             *user("And 3+3?")]  # fmt: skip
    assert chat(tok, messages=extra).request.prompt == chat(tok, messages=plain).request.prompt


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hello"}}


@pytest.mark.parametrize("call", [messages, count])
@pytest.mark.parametrize(
    "msgs, param, text",
    [
        ([*user(), {"role": "assistant", "content": "ok"}, {"role": "user", "content": [IMAGE]}],
         "messages[2].content[0]", "image content is not supported by this model (text only)"),
        ([{"role": "user", "content": [{"type": "text", "text": "Read:"}, DOCUMENT]}],
         "messages[0].content[1]", "document content is not supported by this model (text only)"),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}],
         "messages[0].content[0].content[0]", "image content is not supported by this model (text only)"),
        ([{"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t", "content": []}]}],
         "messages[0].content[0]", "unknown content block type 'search_result'"),
        ([{"role": "user", "content": [{"text": "no type"}]}],
         "messages[0].content[0]", "unknown content block type None"),
    ],
)  # fmt: skip
def test_anthropic_media_and_unknown_blocks_are_refused(tok, call, msgs, param, text):
    err = refused(call, tok, messages=msgs)
    assert err.param == param and text in err.message


def test_anthropic_system_blocks_are_text_only(tok):
    err = refused(count, tok, messages=user(), system=[{"type": "text", "text": "Be brief."}, IMAGE])
    assert err.param == "system[1]" and "not supported by this model (text only)" in err.message


@pytest.mark.parametrize(
    "part, kind",
    [({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "image_url"),
     ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "input_audio"),
     ({"type": "file", "file": {"file_id": "file-1"}}, "file")],
)  # fmt: skip
def test_openai_media_parts_are_refused(tok, part, kind):
    msgs = [*user(), {"role": "assistant", "content": "ok"}, {"role": "user", "content": [part]}]
    err = refused(chat, tok, messages=msgs)
    assert err.param == "messages[2].content[0]"
    assert err.message == f"messages[2].content[0]: {kind} content is not supported by this model (text only)"


def test_openai_unknown_parts_are_refused_and_text_parts_read(tok):
    err = refused(chat, tok, messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}])
    assert err.param == "messages[0].content[0]" and "unknown content part type 'video'" in err.message
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    assert chat(tok, messages=parts).request.prompt == chat(tok, messages=user("Hello")).request.prompt


# ------------------------------------------------------------------------------------------------ 4: limits
def test_stop_strings_are_bounded(tok):
    lim = Limits(max_stop=2, max_stop_chars=5)
    for call, param, body in ((chat, "stop", {"messages": user()}), (completion, "stop", {"prompt": "Hi"}),
                              (messages, "stop_sequences", {"messages": user()})):  # fmt: skip
        err = refused(call, tok, limits=lim, **body, **{param: ["a", "b", "c"]})
        assert err.param == param and "at most 2 stop sequences" in err.message
        err = refused(call, tok, limits=lim, **body, **{param: ["a", "toolong"]})
        assert err.param == param and f"at most 5 characters ({param}[1] has 7)" in err.message
        assert call(tok, limits=lim, **body, **{param: ["a", "12345"]}).request.stop[:2] == ("a", "12345")
    err = refused(chat, tok, messages=user(), stop="x" * 300)  # the default Limits
    assert err.param == "stop" and "at most 256 characters" in err.message


def test_tools_are_bounded(tok):
    lim = Limits(max_tools=2, max_schema_depth=3, max_name_chars=8)
    tools = [fn_tool(f"f{i}") for i in range(3)]
    assert refused(chat, tok, limits=lim, messages=user(), tools=tools).param == "tools"
    anth = [{"name": f"f{i}", "input_schema": WEATHER} for i in range(3)]
    assert refused(count, tok, limits=lim, messages=user(), tools=anth).param == "tools"
    assert chat(tok, limits=lim, messages=user(), tools=tools[:2]).tools is not None
    deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    err = refused(chat, tok, limits=lim, messages=user(), tools=[fn_tool("f", deep)])
    assert err.param == "tools[0].function.parameters" and "nested deeper than 3 levels" in err.message
    err = refused(messages, tok, limits=lim, messages=user(), tools=[{"name": "f", "input_schema": deep}])
    assert err.param == "tools[0].input_schema"
    assert refused(chat, tok, limits=lim, messages=user(), tools=[fn_tool("x" * 9)]).param == (
        "tools[0].function.name"
    )
    assert refused(count, tok, limits=lim, messages=user(), tools=[{"name": "x" * 9}]).param == "tools[0].name"


@pytest.mark.parametrize(
    "tool, param",
    [({"name": "", "input_schema": WEATHER}, "tools[0].name"),
     ({"name": "a b", "input_schema": WEATHER}, "tools[0].name"),
     ({"name": "a\nb", "input_schema": WEATHER}, "tools[0].name"),
     ({"name": 3}, "tools[0].name"),
     ({"name": "f", "description": {"x": 1}}, "tools[0].description"),
     ({"name": "f", "input_schema": "object"}, "tools[0].input_schema")],
)  # fmt: skip
def test_malformed_tools_are_a_400_naming_the_field(tok, tool, param):
    assert refused(count, tok, messages=user(), tools=[tool]).param == param


def test_tool_names_are_unique(tok):
    err = refused(chat, tok, messages=user(), tools=[fn_tool("f"), fn_tool("f")])
    assert err.param == "tools[1].function.name" and "unique" in err.message


def test_top_k_is_an_int32():
    base = {"model": MODEL, "messages": user()}
    for cls, extra in ((P.ChatRequest, {}), (P.MessagesRequest, {"max_tokens": 1})):
        assert cls.model_validate({**base, **extra, "top_k": INT32_MAX}).top_k == INT32_MAX
        with pytest.raises(ValidationError) as e:
            cls.model_validate({**base, **extra, "top_k": INT32_MAX + 1})
        assert P.validation_error(e.value.errors()).param == "top_k"


# ------------------------------------------------------------------------------------------------ 5: short errors
def test_clip():
    long = "m" * 100_000
    assert len(P.clip(long, 256)) < 300 and P.clip(long, 256).endswith("... (100000 characters)")
    assert P.clip("short") == "short" and P.clip({"a": 1}) == "{'a': 1}"
    assert P.clip("a\ud800b") == "a\\ud800b"  # encodable
    assert P.clip(repr("x" * 10), 4) == "'xxx... (12 characters)"


def test_errors_never_echo_large_input(tok):
    big = "n" * 100_000
    for call, body in (
        (chat, {"messages": user(), "tools": [fn_tool("f")], "tool_choice": {"type": "function",
                                                                             "function": {"name": big}}}),
        (chat, {"messages": user(), "tools": [fn_tool("f")], "tool_choice": big}),
        (chat, {"messages": user(), "reasoning_effort": big}),
        (chat, {"messages": [{"role": "user", "content": [{"type": big}]}]}),
        (messages, {"messages": [{"role": "user", "content": [{"type": big}]}]}),
        (messages, {"messages": user(), "tools": [{"name": "f"}], "tool_choice": {"type": "tool", "name": big}}),
        (messages, {"messages": user(), "tools": [{"name": big}]}),
        (messages, {"messages": user(), "thinking": {"type": "enabled", "budget_tokens": big}}),
    ):  # fmt: skip
        assert len(refused(call, tok, **body).message) < 400
    for key in (big, "x\ud800" * 1000):
        with pytest.raises(ValidationError) as e:
            P.ChatRequest.model_validate({"model": MODEL, "messages": user(), key: 1})
        err = P.validation_error(e.value.errors())
        assert len(err.message) < 400 and len(err.param) < 100 and err.message.startswith(f"{err.param}: ")
        assert json.dumps(P.error_body("openai", err), ensure_ascii=False).encode("utf-8")


def test_a_list_tool_choice_type_is_a_400(tok):
    err = refused(messages, tok, messages=user(), tools=[{"name": "f"}], tool_choice={"type": ["any"]})
    assert err.param == "tool_choice"


# ------------------------------------------------------------------------------------------------ 6: the prompt
def test_param_for_and_api_error():
    assert P.param_for("chat", "prompt") == P.param_for("anthropic", "prompt") == "messages"
    assert P.param_for("completion", "prompt") == "prompt" and P.param_for("anthropic", "stop") == "stop_sequences"
    assert P.param_for("chat", "max_tokens") == "max_tokens"
    e = P.api_error("anthropic", ValueError("prompt: 300 tokens exceed the context of 256 tokens"))
    assert (e.status, e.param, e.message) == (400, "messages", "messages: 300 tokens exceed the context of 256 tokens")
    e = P.api_error("completion", ValueError("prompt: 300 tokens exceed the context of 256 tokens"))
    assert e.param == "prompt" and e.message.startswith("prompt: ")
    e = P.api_error("chat", ValueError("top_k=-1: must be an integer >= 0 (0 = off)"))
    assert e.param == "top_k" and e.message.startswith("top_k=-1")


def test_a_prompt_that_fills_the_context_is_about_messages(tok):
    n = len(chat(tok, messages=user("Hello there")).request.prompt)
    err = refused(chat, tok, max_len=n, messages=user("Hello there"))
    assert err.param == "messages" and f"{n} tokens" in err.message
    gen = chat(tok, max_len=n + 1, messages=user("Hello there"))  # room for one token: max_tokens defaults to it
    assert gen.request.max_tokens == 1 and gen.api == "chat"
    assert messages(tok, messages=user()).api == "anthropic" and completion(tok, prompt="Hi").api == "completion"


# ------------------------------------------------------------------------------------------------ 7: still works
def test_ordinary_requests_still_work(tok):
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18C"}]}
    conv = [*user("Weather in Paris?"), {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result, {"type": "text", "text": "Thanks"}]}]  # fmt: skip
    tools = [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER}]
    gen = messages(tok, messages=conv, tools=tools, system=[{"type": "text", "text": "Be brief."}],
                   stop_sequences=["\n\n"])  # fmt: skip
    assert gen.request.prompt and gen.request.stop == ("\n\n",) and gen.tools.force is None
    assert count(tok, messages=conv, tools=tools, system="Be brief.") == len(gen.request.prompt)
    oa = [*user("Weather in Paris?"),
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "18C"}, *user("Thanks")]  # fmt: skip
    gen = chat(tok, messages=oa, tools=[fn_tool()], tool_choice="required", top_k=INT32_MAX, stop="\n\n")
    assert gen.tools.force == "get_weather" and gen.request.constraint is not None
    assert gen.request.stop == ("\n\n", "</tool_call>") and gen.request.top_k == INT32_MAX
    assert completion(tok, prompt=[1, 2, 3], stop=["x"]).request.prompt == [1, 2, 3]
