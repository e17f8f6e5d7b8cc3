"""POST /v1/responses: the request translation and the writer without a model (every event and
object validated against the openai library's own types), then through the official openai
client against kvlab serve: plain and streaming answers equal to chat completions at
temperature 0, cached_tokens equal to what the ledger says was reused, tool items rendered into
the prompt, and bad input answered with a 400 in OpenAI's error shape."""

import io
import json

import httpx
import pytest

from kvlab.serving.response_writer import ResponsesWriter
from kvlab.serving.responses import ResponsesError, to_chat

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


# -- no model: the translation ------------------------------------------------------------------
def test_to_chat_translates_items_and_tools():
    chat = to_chat({
        "model": "gpt-5", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0, "top_p": 0.9,
        "tools": [WEATHER], "store": False,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                            {"type": "input_text", "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Nice"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "rain"}]},
        ]})
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
             for i, city in ((1, "Paris"), (2, "Nice"))]
    # mutant caught: developer passed on as its own role / function calls as separate assistant
    # turns / reasoning kept / parts joined with a separator
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    # mutant caught: max_output_tokens dropped, or the chat request not streamed with usage
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0 and chat["top_p"] == 0.9
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER["parameters"]}}]
    # a function call with no assistant text before it is a turn of its own
    alone = to_chat({"input": [{"role": "user", "content": "x"}, {
        "type": "function_call", "call_id": "c", "name": "f", "arguments": ""}]})["messages"]
    assert alone[1] == {"role": "assistant", "content": "",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"model": "m"}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]},
     "input[0].arguments"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
])
def test_to_chat_refuses_what_it_cannot_serve(body, param):
    # mutant caught: a check removed (the request would reach mlx-lm and answer 200 or 500)
    with pytest.raises(ResponsesError) as e:
        to_chat(body)
    assert e.value.param == param and e.value.status == 400
    assert param.split("[")[0].split(".")[0] in str(e.value)


# -- no model: the writer -----------------------------------------------------------------------
class FakeHandler:
    """What ResponsesWriter needs of KvlabHandler: status, headers, the real wfile, usage."""

    kv_status = 200

    def __init__(self, usage=(10, 4)):
        self.kv_real_wfile, self.sent, self.usage = io.BytesIO(), [], usage

    def kv_send_headers(self, code, headers):
        self.sent.append((code, dict(headers)))

    def kv_usage(self):
        return self.usage


def _chunk(delta=None, finish=None, usage=None):
    # the shape mlx-lm's handler writes for a streamed chat completion
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [] if usage else [
        {"index": 0, "finish_reason": finish, "delta": {"role": "assistant", **(delta or {})}}]}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


def _run(chunks, body, **kw):
    h = FakeHandler()
    w = ResponsesWriter(h, body, **kw)
    for c in chunks:
        w.write(c)
    w.write(b"data: [DONE]\n\n")
    w.close()
    return h, w


def _events(raw: bytes) -> list[dict]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if lines:
            data = json.loads(lines["data"])
            assert lines["event"] == data["type"]
            out.append(data)
    return out


TOOL_CALL = {"id": "call_9", "type": "function", "index": 0,
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
USAGE = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}


def test_writer_streams_openai_events_with_diagnostics():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    diag = {"type": "cache_miss", "reason": "input_changed", "cache_missed_tokens": 2}
    chunks = [b": keepalive 1/10\n\n", _chunk({"content": "Hel"}), _chunk({"content": "lo"}),
              _chunk({"tool_calls": [TOOL_CALL]}, finish="tool_calls"), _chunk(usage=USAGE)]
    h, w = _run(chunks, {"model": "gpt-5", "input": "Hi", "stream": True}, diagnostics=lambda: diag)
    events = _events(h.kv_real_wfile.getvalue())
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:  # mutant caught: a renamed field or event type, a missing required field
        adapter.validate_python(e)
    # mutant caught: events out of order (a part before its item), a tool call's events missing
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", *TEXT_EVENTS, "response.output_text.delta",
        "response.output_text.delta", *TEXT_DONE, "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    # mutant caught: sequence_number not incremented per event
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert h.sent == [(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})]
    assert b": keepalive 1/10\n\n" in h.kv_real_wfile.getvalue()
    # mutant caught: the diagnostics hook left out of the first or the final response
    assert events[0]["response"]["prompt_cache_diagnostics"] == diag
    final = events[-1]["response"]
    assert final["prompt_cache_diagnostics"] == diag and final["id"] == w.id and final["status"] == "completed"
    assert [d["delta"] for d in events if d["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][1] == {**final["output"][1], "type": "function_call", "call_id": "call_9",
                                  "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"}
    # mutant caught: cached and uncached tokens swapped, or output tokens not read from usage
    assert final["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                              "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 13}


def test_writer_puts_reasoning_in_a_reasoning_item():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    chunks = [_chunk({"reasoning": "Think"}), _chunk({"reasoning": "ing."}), _chunk({"content": "Yes."}, finish="stop"),
              _chunk(usage=USAGE)]
    h, _ = _run(chunks, {"input": "Hi", "stream": True})
    events = _events(h.kv_real_wfile.getvalue())
    for e in events:
        TypeAdapter(ResponseStreamEvent).validate_python(e)
    # mutant caught: reasoning dropped, or mixed into the answer's output_text
    assert [e["type"] for e in events][2:-1] == [
        *TEXT_EVENTS, "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        *TEXT_EVENTS, "response.output_text.delta", *TEXT_DONE]
    output = events[-1]["response"]["output"]
    # mutant caught: an event addressed to the wrong output_index
    assert all(e["output_index"] == [o["id"] for o in output].index(e.get("item_id") or e["item"]["id"])
               for e in events if "output_index" in e)
    reasoning, message = output
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"][0]["text"] == "Yes."


def test_writer_json_and_function_call_round_trip():
    from openai.types.responses import Response

    h, w = _run([_chunk({"tool_calls": [TOOL_CALL]}, finish="tool_calls"), _chunk(usage=USAGE)],
                {"model": "gpt-5", "input": "Weather in Paris?", "tools": [WEATHER]})
    (code, headers), = h.sent
    body = json.loads(h.kv_real_wfile.getvalue())
    assert code == 200 and headers["Content-Type"] == "application/json"
    resp = Response.model_validate(body)  # the openai library parses it into its own type
    assert resp.id == w.id and resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.usage.input_tokens_details.cached_tokens == 4
    assert "prompt_cache_diagnostics" not in body  # no hook, no field
    (call,) = resp.output
    assert (call.type, call.call_id, call.name, call.arguments) == ("function_call", "call_9", "get_weather",
                                                                    '{"city": "Paris"}')
    # the call and its result sent back as the next request's input: one assistant turn, one tool message
    nxt = to_chat({"input": [{"role": "user", "content": "Weather in Paris?"},
                             call.model_dump(exclude_none=True),
                             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
                   "tools": [WEATHER]})
    assert nxt["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]


def test_writer_length_is_incomplete_and_late_failure_is_failed():
    h, _ = _run([_chunk({"content": "ab"}, finish="length"), _chunk(usage=USAGE)], {"input": "x", "stream": True})
    events = _events(h.kv_real_wfile.getvalue())
    # mutant caught: a cut answer reported as completed (OpenAI: status incomplete, its own event)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"

    h = FakeHandler()
    w = ResponsesWriter(h, {"input": "x", "stream": True})
    w.write(_chunk({"content": "a"}))
    h.kv_status = 500  # generation died after the headers went out (KvlabHandler._failed)
    w.write(json.dumps({"error": "generation failed: boom"}).encode())
    w.close()
    last = _events(h.kv_real_wfile.getvalue())[-1]
    # mutant caught: a second set of headers / a JSON error body after the stream started
    assert len(h.sent) == 1 and last["type"] == "response.failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "generation failed: boom"}


# -- kvlab serve with the tiny model ------------------------------------------------------------
PROMPT = "Summarise the plot of a short story about a lighthouse keeper."
MAX = 6


@pytest.mark.serving
@pytest.mark.model
def test_responses_plain_and_streaming_equal_chat(start, client):
    server = start("radix")
    c = client(server)
    plain = c.responses.create(model="gpt-5", input=PROMPT, max_output_tokens=MAX, temperature=0)
    r1 = server.results[0]
    assert plain.object == "response" and plain.model == "gpt-5" and plain.id.startswith("resp_")
    assert plain.usage.output_tokens == len(r1.output_ids)
    assert plain.usage.input_tokens == r1.prompt_tokens and plain.usage.input_tokens_details.cached_tokens == 0
    assert plain.status == ("incomplete" if len(r1.output_ids) == MAX else "completed")

    events = list(c.responses.create(model="gpt-5", input=PROMPT, max_output_tokens=MAX, temperature=0, stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    # mutant caught: events out of order, or deltas missing
    assert n >= 1 and kinds == ["response.created", "response.in_progress", *TEXT_EVENTS,
                                *["response.output_text.delta"] * n, *TEXT_DONE, f"response.{plain.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    chat = c.chat.completions.create(model="t", messages=[{"role": "user", "content": PROMPT}],
                                     max_tokens=MAX, temperature=0)
    # mutant caught: a delta carrying the text so far instead of the new piece
    assert deltas == final.output_text == events[-4].text == plain.output_text == chat.choices[0].message.content
    assert final.usage.input_tokens_details.cached_tokens == server.results[1].reused_tokens > 0
    events = server.events  # one snapshot: a second read may hold more rows than the first
    assert events.filter(events["detail"] == "responses").height == 2  # the ledger's arrive rows


@pytest.mark.serving
@pytest.mark.model
def test_cached_tokens_are_what_the_store_reused(start, client):
    server = start("radix")
    c = client(server)
    rules = "You are a careful assistant for a research lab. Answer in one short sentence. " * 3
    first = c.responses.create(model="gpt-5", instructions=rules, input="Name a prime number.",
                               max_output_tokens=4, temperature=0)
    before = httpx.get(server.url + "/kvlab/stats", timeout=30).json()["reused_tokens"]
    second = c.responses.create(model="gpt-5", instructions=rules, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And another one?"}])
    after = httpx.get(server.url + "/kvlab/stats", timeout=30).json()["reused_tokens"]
    cached = second.usage.input_tokens_details.cached_tokens
    # mutant caught: cached_tokens reported as 0, as the whole prompt, or from the wrong request
    assert first.usage.input_tokens_details.cached_tokens == server.results[0].reused_tokens == 0
    assert cached == server.results[1].reused_tokens == after - before > 0
    assert cached < second.usage.input_tokens == server.results[1].prompt_tokens


@pytest.mark.serving
@pytest.mark.model
def test_tool_items_reach_the_prompt(start, client, tiny):
    server = start("radix")
    resp = client(server).responses.create(model="gpt-5", tools=[WEATHER], max_output_tokens=3, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"}])
    assert resp.status in ("completed", "incomplete") and resp.output[0].type in ("message", "function_call")
    rendered = tiny.tokenizer.decode(list(server.results[0].prompt_ids))
    # mutant caught: tools, the call or its output dropped on the way to the chat template
    assert "Weather in a city." in rendered  # the tool definition (the call alone names the function)
    assert "get_weather" in rendered and "Paris" in rendered and "sunny, 21C" in rendered
    assert rendered.index('"city"') < rendered.index("sunny, 21C")


@pytest.mark.serving
@pytest.mark.model
def test_bad_input_is_a_400_in_openai_shape(start, client):
    import openai

    server = start("radix")
    c = client(server)
    for kw, param in [({"input": ""}, "input"), ({"input": [{"type": "bogus_item"}]}, "input[0].type"),
                      ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="gpt-5", **kw)
        err = e.value.body
        assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param
    r = httpx.post(server.url + "/v1/responses", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/responses", json=["not", "an", "object"], timeout=30)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    assert server.results == [] and server.stats()["failed"] == 0  # refused before generation


@pytest.mark.serving
@pytest.mark.model
def test_sdk_stream_helper_and_api_key(start, client):
    server = start("radix", api_key="s3cret")
    r = httpx.post(server.url + "/v1/responses", json={"model": "gpt-5", "input": "x"}, timeout=30)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    # the SDK's stream helper rebuilds the response from the events, each delta into the item at
    # its output_index (mutant caught: deltas addressed to the wrong item)
    with client(server, "s3cret").responses.stream(model="gpt-5", input=PROMPT, max_output_tokens=MAX,
                                                   temperature=0) as stream:
        events = list(stream)
    snapshots = [e.snapshot for e in events if e.type == "response.output_text.delta"]
    assert snapshots and events[-1].type in ("response.completed", "response.incomplete")
    assert snapshots[-1] == events[-1].response.output_text
