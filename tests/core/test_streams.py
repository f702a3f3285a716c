"""Tests for :mod:`meshkit.core.streams`.

Every fixture is fed whole, one byte at a time and in splits drawn by hypothesis,
with LF and CRLF framing; all must agree. Feed ``i`` (0-based) happens at
``now = i + 1`` and ``finish`` at ``len(chunks) + 1``, so the expected first-token
time is the ``now`` of the feed holding the byte that completed the first-token
event (the event holding the case's ``first`` marker).
"""

from __future__ import annotations

import ast
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshkit.core import streams
from meshkit.core.endpoints import StreamFormat
from meshkit.core.streams import StreamAccountant, Usage

OPENAI = StreamFormat.OPENAI
RESPONSES = StreamFormat.RESPONSES
ANTHROPIC = StreamFormat.ANTHROPIC
GENERATE = StreamFormat.GENERATE
NONE = StreamFormat.NONE

STARTED = 0.5

# --------------------------------------------------------------------------------------
# Fixture streams: the event grammars of each API's streaming reference
# --------------------------------------------------------------------------------------

_CC = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1767225600,"model":"m",'
_CHOICE = b'"choices":[{"index":0,"delta":'
_TAIL = b',"logprobs":null,"finish_reason":null}],"usage":null}\n\n'

CHAT = (
    b"data: " + _CC + _CHOICE + b'{"role":"assistant","content":""}' + _TAIL
    + b"data: " + _CC + _CHOICE + b'{"content":"Hello"}' + _TAIL
    + b"data: " + _CC + _CHOICE + b'{"content":" world"}' + _TAIL
    + b"data: " + _CC + _CHOICE
    + b'{},"logprobs":null,"finish_reason":"stop"}],"usage":null}\n\n'
    + b"data: " + _CC + b'"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2,'
    b'"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8,"audio_tokens":0},'
    b'"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,'
    b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}\n\n'
    b"data: [DONE]\n\n"
)  # fmt: skip

CHAT_NO_USAGE = (
    b"data: " + _CC + _CHOICE + b'{"role":"assistant","content":""}' + _TAIL
    + b"data: " + _CC + _CHOICE + b'{"content":"Hi"}' + _TAIL
    + b"data: " + _CC + _CHOICE
    + b'{},"logprobs":null,"finish_reason":"stop"}],"usage":null}\n\n'
    + b"data: [DONE]\n\n"
)  # fmt: skip

CHAT_REFUSAL = (
    b"data: " + _CC + _CHOICE + b'{"role":"assistant","content":null,"refusal":""}' + _TAIL
    + b"data: " + _CC + _CHOICE + b'{"refusal":"I can\'t help with that."}' + _TAIL
    + b"data: " + _CC + _CHOICE
    + b'{},"logprobs":null,"finish_reason":"stop"}],"usage":null}\n\n'
    + b"data: " + _CC + b'"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":7,'
    b'"total_tokens":16}}\n\n'
    b"data: [DONE]\n\n"
)  # fmt: skip

CHAT_TOOL_CALLS = (
    b"data: " + _CC + _CHOICE + b'{"role":"assistant","content":null}' + _TAIL
    + b"data: " + _CC + _CHOICE + b'{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
    b'"function":{"name":"get_weather","arguments":""}}]}' + _TAIL
    + b"data: " + _CC + _CHOICE
    + b'{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\":\\"Paris\\"}"}}]}' + _TAIL
    + b"data: " + _CC + _CHOICE
    + b'{},"logprobs":null,"finish_reason":"tool_calls"}],"usage":null}\n\n'
    + b"data: [DONE]\n\n"
)  # fmt: skip

CHAT_REASONING = (
    b"data: " + _CC + _CHOICE + b'{"role":"assistant","content":""}' + _TAIL
    + b"data: " + _CC + _CHOICE + b'{"reasoning_content":"Let me think"}' + _TAIL
    + b"data: " + _CC + _CHOICE + b'{"content":"42"}' + _TAIL
    + b"data: [DONE]\n\n"
)  # fmt: skip

# vLLM stream_options.continuous_usage_stats: usage on every chunk, the last one wins.
CHAT_CONTINUOUS_USAGE = (
    b"data: " + _CC + _CHOICE + b'{"role":"assistant","content":""},"finish_reason":null}],'
    b'"usage":{"prompt_tokens":4,"completion_tokens":0,"total_tokens":4}}\n\n'
    + b"data: " + _CC + _CHOICE + b'{"content":"A"},"finish_reason":null}],'
    b'"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}\n\n'
    + b"data: " + _CC + _CHOICE + b'{"content":"B"},"finish_reason":null}],'
    b'"usage": {"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}\n\n'
    + b"data: [DONE]\n\n"
)  # fmt: skip

CHAT_ERROR = (
    b"data: " + _CC + _CHOICE + b'{"role":"assistant","content":""}' + _TAIL
    + b"data: " + _CC + _CHOICE + b'{"content":"Once"}' + _TAIL
    + b'data: {"error":{"message":"The server had an error while processing your request.",'
    b'"type":"server_error","param":null,"code":null}}\n\n'
    # Anything after the error is ignored.
    + b"data: " + _CC + b'"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    + b"data: [DONE]\n\n"
)  # fmt: skip

CHAT_ERROR_FIRST = (
    b'data: {"error":{"message":"Rate limit reached for requests","type":"requests",'
    b'"param":null,"code":"rate_limit_exceeded"}}\n\n'
)

_TC = b'{"id":"cmpl-1","object":"text_completion","created":1767225600,"model":"m",'
COMPLETIONS = (
    b"data: " + _TC + b'"choices":[{"text":" Paris","index":0,"logprobs":null,'
    b'"finish_reason":null}],"usage":null}\n\n'
    + b"data: " + _TC + b'"choices":[{"text":".","index":0,"logprobs":null,'
    b'"finish_reason":"stop"}],"usage":null}\n\n'
    + b"data: " + _TC + b'"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,'
    b'"total_tokens":7}}\n\n'
    b"data: [DONE]\n\n"
)  # fmt: skip

_RESP = (
    b'"id":"resp_abc","object":"response","created_at":1767225600,"model":"gpt-x",'
    b'"instructions":null,"text":{"format":{"type":"text"}},"error":null,'
)
RESPONSES_STREAM = (
    b"event: response.created\n"
    b'data: {"type":"response.created","response":{' + _RESP
    + b'"status":"in_progress","output":[],"usage":null},"sequence_number":0}\n\n'
    b"event: response.in_progress\n"
    b'data: {"type":"response.in_progress","response":{' + _RESP
    + b'"status":"in_progress","output":[],"usage":null},"sequence_number":1}\n\n'
    b"event: response.output_item.added\n"
    b'data: {"type":"response.output_item.added","output_index":0,"item":{"id":"msg_1",'
    b'"type":"message","status":"in_progress","role":"assistant","content":[]},'
    b'"sequence_number":2}\n\n'
    b"event: response.content_part.added\n"
    b'data: {"type":"response.content_part.added","item_id":"msg_1","output_index":0,'
    b'"content_index":0,"part":{"type":"output_text","text":"","annotations":[]},'
    b'"sequence_number":3}\n\n'
    b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","item_id":"msg_1","output_index":0,'
    b'"content_index":0,"delta":"Hi","sequence_number":4}\n\n'
    b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","item_id":"msg_1","output_index":0,'
    b'"content_index":0,"delta":" there","sequence_number":5}\n\n'
    b"event: response.output_text.done\n"
    b'data: {"type":"response.output_text.done","item_id":"msg_1","output_index":0,'
    b'"content_index":0,"text":"Hi there","sequence_number":6}\n\n'
    b"event: response.content_part.done\n"
    b'data: {"type":"response.content_part.done","item_id":"msg_1","output_index":0,'
    b'"content_index":0,"part":{"type":"output_text","text":"Hi there","annotations":[]},'
    b'"sequence_number":7}\n\n'
    b"event: response.output_item.done\n"
    b'data: {"type":"response.output_item.done","output_index":0,"item":{"id":"msg_1",'
    b'"type":"message","status":"completed","role":"assistant","content":[{"type":"output_text",'
    b'"text":"Hi there","annotations":[]}]},"sequence_number":8}\n\n'
    b"event: response.completed\n"
    b'data: {"type":"response.completed","response":{' + _RESP
    + b'"status":"completed","output":[{"id":"msg_1","type":"message","status":"completed",'
    b'"role":"assistant","content":[{"type":"output_text","text":"Hi there","annotations":[]}]}],'
    b'"usage":{"input_tokens":20,"input_tokens_details":{"cached_tokens":16},"output_tokens":2,'
    b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":22}},"sequence_number":9}\n\n'
)  # fmt: skip

_RESP_CREATED = (
    b"event: response.created\n"
    b'data: {"type":"response.created","response":{' + _RESP
    + b'"status":"in_progress","output":[],"usage":null},"sequence_number":0}\n\n'
)  # fmt: skip

RESPONSES_REFUSAL = (
    _RESP_CREATED
    + b"event: response.refusal.delta\n"
    b'data: {"type":"response.refusal.delta","item_id":"msg_1","output_index":0,'
    b'"content_index":0,"delta":"I can\'t","sequence_number":4}\n\n'
    b"event: response.completed\n"
    b'data: {"type":"response.completed","response":{' + _RESP
    + b'"status":"completed","output":[],"usage":{"input_tokens":5,"output_tokens":3,'
    b'"total_tokens":8}},"sequence_number":5}\n\n'
)  # fmt: skip

RESPONSES_FUNCTION_CALL = (
    _RESP_CREATED
    + b"event: response.output_item.added\n"
    b'data: {"type":"response.output_item.added","output_index":0,"item":{"id":"fc_1",'
    b'"type":"function_call","status":"in_progress","call_id":"call_1","name":"f",'
    b'"arguments":""},"sequence_number":1}\n\n'
    b"event: response.function_call_arguments.delta\n"
    b'data: {"type":"response.function_call_arguments.delta","item_id":"fc_1",'
    b'"output_index":0,"delta":"{\\"x\\":","sequence_number":2}\n\n'
    b"event: response.incomplete\n"
    b'data: {"type":"response.incomplete","response":{' + _RESP
    + b'"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},'
    b'"output":[],"usage":{"input_tokens":11,"input_tokens_details":{"cached_tokens":0},'
    b'"output_tokens":16,"total_tokens":27}},"sequence_number":3}\n\n'
)  # fmt: skip

RESPONSES_REASONING = (
    _RESP_CREATED
    + b"event: response.reasoning_summary_text.delta\n"
    b'data: {"type":"response.reasoning_summary_text.delta","item_id":"rs_1","output_index":0,'
    b'"summary_index":0,"delta":"Thinking","sequence_number":1}\n\n'
    b"event: response.completed\n"
    b'data: {"type":"response.completed","response":{' + _RESP
    + b'"status":"completed","output":[],"usage":{"input_tokens":3,"output_tokens":30}},'
    b'"sequence_number":2}\n\n'
)  # fmt: skip

RESPONSES_ERROR = (
    _RESP_CREATED
    + b"event: error\n"
    b'data: {"type":"error","code":"rate_limit_exceeded","message":"Rate limit reached",'
    b'"param":null,"sequence_number":1}\n\n'
)  # fmt: skip

RESPONSES_ERROR_NULL_CODE = (
    b"event: error\n"
    b'data: {"type":"error","code":null,"message":"Something went wrong","param":null,'
    b'"sequence_number":0}\n\n'
)

RESPONSES_FAILED = (
    _RESP_CREATED
    + b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","item_id":"msg_1","output_index":0,'
    b'"content_index":0,"delta":"Par","sequence_number":1}\n\n'
    b"event: response.failed\n"
    b'data: {"type":"response.failed","response":{"id":"resp_abc","object":"response",'
    b'"status":"failed","error":{"code":"server_error","message":"The model crashed"},'
    b'"output":[],"usage":null},"sequence_number":2}\n\n'
)  # fmt: skip

RESPONSES_FAILED_NO_CODE = (
    b"event: response.failed\n"
    b'data: {"type":"response.failed","response":{"id":"resp_f","status":"failed",'
    b'"error":null,"usage":null},"sequence_number":0}\n\n'
)

# A server that omits the event: lines (data.type still names each event).
RESPONSES_DATA_ONLY = (
    b'data: {"type":"response.created","response":{"id":"resp_d","status":"in_progress"},'
    b'"sequence_number":0}\n\n'
    b'data: {"type":"response.output_text.delta","item_id":"msg_1","output_index":0,'
    b'"content_index":0,"delta":"Yo","sequence_number":1}\n\n'
    b'data: {"type":"response.completed","response":{"id":"resp_d","status":"completed",'
    b'"usage":{"input_tokens":2,"output_tokens":1}},"sequence_number":2}\n\n'
    b"data: [DONE]\n\n"
)

_MSG_START = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_01","type":"message",'
    b'"role":"assistant","content":[],"model":"claude-x","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":31,"cache_creation_input_tokens":100,'
    b'"cache_read_input_tokens":2000,"output_tokens":1,"service_tier":"standard"}}}\n\n'
)
ANTHROPIC_STREAM = (
    _MSG_START
    + b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'
    b"\n\n"
    b"event: ping\n"
    b'data: {"type": "ping"}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}'
    b"\n\n"
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"!"}}'
    b"\n\n"
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":0}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"output_tokens":15}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)  # fmt: skip

# Thinking first, then a server tool: message_delta restates input and cache counts.
ANTHROPIC_THINKING = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"msg_02","type":"message",'
    b'"role":"assistant","content":[],"model":"claude-x","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":10,"cache_creation_input_tokens":0,'
    b'"cache_read_input_tokens":0,"output_tokens":1}}}\n\n'
    b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"thinking",'
    b'"thinking":"","signature":""}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta",'
    b'"thinking":"Let me see"}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta",'
    b'"signature":"EqQBCgIYAhIM"}}\n\n'
    b"event: content_block_stop\n"
    b'data: {"type":"content_block_stop","index":0}\n\n'
    b"event: ping\n"
    b'data: {"type": "ping"}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"input_tokens":50,"cache_creation_input_tokens":5,"cache_read_input_tokens":30,'
    b'"output_tokens":20}}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"output_tokens":42}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)

ANTHROPIC_TOOL = (
    _MSG_START
    + b"event: content_block_start\n"
    b'data: {"type":"content_block_start","index":0,"content_block":{"type":"tool_use",'
    b'"id":"toolu_1","name":"get_weather","input":{}}}\n\n'
    b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta",'
    b'"partial_json":"{\\"city\\": \\"Par"}}\n\n'
    b"event: message_delta\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},'
    b'"usage":{"output_tokens":9}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)  # fmt: skip

ANTHROPIC_ERROR = (
    _MSG_START
    + b"event: ping\n"
    b'data: {"type": "ping"}\n\n'
    b"event: error\n"
    b'data: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    b"event: message_stop\n"
    b'data: {"type":"message_stop"}\n\n'
)  # fmt: skip

_META = b'"meta_info":{"id":"a1","finish_reason":null,"prompt_tokens":7,'
GENERATE_STREAM = (
    b'data: {"text":"","output_ids":[],' + _META
    + b'"completion_tokens":0,"cached_tokens":4,"e2e_latency":0.01}}\n\n'
    b'data: {"text":" Paris","output_ids":[6342],' + _META
    + b'"completion_tokens":1,"cached_tokens":4,"e2e_latency":0.02}}\n\n'
    b'data: {"text":" Paris.","output_ids":[6342,13],' + _META
    + b'"completion_tokens":2,"cached_tokens":4,"e2e_latency":0.03}}\n\n'
    b'data: {"text":" Paris. It","output_ids":[6342,13,632],"meta_info":{"id":"a1",'
    b'"finish_reason":{"type":"length","length":3},"prompt_tokens":7,"completion_tokens":3,'
    b'"cached_tokens":4,"e2e_latency":0.05}}\n\n'
    b"data: [DONE]\n\n"
)  # fmt: skip

GENERATE_BATCH = (
    b'data: {"text":"A","output_ids":[32],"meta_info":{"prompt_tokens":3,"completion_tokens":1,'
    b'"cached_tokens":0},"index":0}\n\n'
    b'data: {"text":"B","output_ids":[33],"meta_info":{"prompt_tokens":5,"completion_tokens":1,'
    b'"cached_tokens":2},"index":1}\n\n'
    b'data: {"text":"AA","output_ids":[32,32],"meta_info":{"prompt_tokens":3,'
    b'"completion_tokens":2,"cached_tokens":0},"index":0}\n\n'
    b'data: {"text":"BB","output_ids":[33,33],"meta_info":{"prompt_tokens":5,'
    b'"completion_tokens":2,"cached_tokens":2},"index":1}\n\n'
    b"data: [DONE]\n\n"
)

GENERATE_ERROR = (
    b'data: {"text":" Paris","output_ids":[6342],' + _META
    + b'"completion_tokens":1,"cached_tokens":0}}\n\n'
    b'data: {"error":{"message":"Aborted: the prompt mentions secrets"}}\n\n'
    b"data: [DONE]\n\n"
)  # fmt: skip

# Framing edge cases.
COMMENTS = (
    b": keep-alive\n\n"
    b":another comment\n"
    b"data:" + _CC + _CHOICE + b'{"role":"assistant","content":"X"}' + _TAIL
    + b": ping\n\n"
    b"id: 7\nretry: 1000\ndata: [DONE]\n\n"
)  # fmt: skip

MULTILINE = (
    b"data: " + _CC + b"\n"
    b'data: "choices":[{"index":0,"delta":{"content":"multi"},\n'
    b'data: "finish_reason":null}],\n'
    b'data: "usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)  # fmt: skip

BOM = b"\xef\xbb\xbf" + CHAT_NO_USAGE

MALFORMED = (
    b'data: {"choices":[{"index":0,"delta":{"content":"x"}\n\n'
    b"data: not json at all\n\n"
    b"data: 42\n\n" + CHAT
)

BIG = b"x" * 5000
OVERFLOW = (
    b"data: " + _CC + _CHOICE + b'{"content":"Hello"}' + _TAIL
    + b"data: " + _CC + _CHOICE + b'{"content":"' + BIG + b'"}' + _TAIL
    + b"data: " + _CC + b'"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    + b"data: [DONE]\n\n"
)  # fmt: skip

# Streams that end without the final blank line or mid-event.
NO_FINAL_BLANK = CHAT_NO_USAGE[:-1]
TRUNCATED = CHAT[: CHAT.index(b"data: [DONE]") - 30]

# Non-streaming bodies.
CHAT_BODY = (
    b'{"id":"chatcmpl-2","object":"chat.completion","created":1767225600,"model":"m",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"Hello!","refusal":null},'
    b'"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":19,"completion_tokens":3,'
    b'"total_tokens":22,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0}},'
    b'"service_tier":"default"}'
)
COMPLETIONS_BODY = (
    b'{"id":"cmpl-2","object":"text_completion","created":1767225600,"model":"m",'
    b'"choices":[{"text":" Paris.","index":0,"logprobs":null,"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}'
)
RESPONSES_BODY = (
    b'{"id":"resp_body","object":"response","created_at":1767225600,"status":"completed",'
    b'"error":null,"incomplete_details":null,"model":"gpt-x","text":{"format":{"type":"text"}},'
    b'"output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant",'
    b'"content":[{"type":"output_text","text":"Hi","annotations":[]}]}],'
    b'"usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":32},"output_tokens":87,'
    b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":123}}'
)
ANTHROPIC_BODY = (
    b'{"id":"msg_01","type":"message","role":"assistant","model":"claude-x",'
    b'"content":[{"type":"text","text":"Hi!"}],"stop_reason":"end_turn","stop_sequence":null,'
    b'"usage":{"input_tokens":12,"cache_creation_input_tokens":3,"cache_read_input_tokens":40,'
    b'"output_tokens":6}}'
)
ANTHROPIC_PREWARM_BODY = (
    b'{"id":"msg_02","type":"message","role":"assistant","model":"claude-x","content":[],'
    b'"stop_reason":"max_tokens","usage":{"input_tokens":12,"output_tokens":0}}'
)
GENERATE_BODY = (
    b'{"text":" Paris.","output_ids":[6342,13],"meta_info":{"id":"a1","finish_reason":'
    b'{"type":"stop","matched":2},"prompt_tokens":7,"completion_tokens":2,"cached_tokens":5,'
    b'"e2e_latency":0.04}}'
)
GENERATE_BATCH_BODY = (
    b'[{"text":"A","output_ids":[32],"meta_info":{"prompt_tokens":3,"completion_tokens":1,'
    b'"cached_tokens":0}},{"text":"B","output_ids":[33],"meta_info":{"prompt_tokens":5,'
    b'"completion_tokens":4,"cached_tokens":2}}]'
)
EMBEDDINGS_BODY = (
    b'{"id":"embd-1","object":"list","created":1,"model":"m","data":[{"index":0,'
    b'"object":"embedding","embedding":[0.1,0.2]}],"usage":{"prompt_tokens":6,'
    b'"total_tokens":6,"completion_tokens":0}}'
)
RERANK_OLD_BODY = (
    b'{"id":"rerank-1","model":"m","usage":{"total_tokens":9},"results":[{"index":0,'
    b'"document":{"text":"x"},"relevance_score":0.5}]}'
)
OPENAI_ERROR_BODY = (
    b'{"error":{"message":"Incorrect API key provided","type":"invalid_request_error",'
    b'"param":null,"code":"invalid_api_key"}}'
)
ANTHROPIC_ERROR_BODY = (
    b'{"type":"error","error":{"type":"rate_limit_error","message":"Too many"},'
    b'"request_id":"req_1"}'
)
RESPONSES_FAILED_BODY = (
    b'{"id":"resp_failed","object":"response","status":"failed",'
    b'"error":{"code":"invalid_prompt","message":"Your prompt was flagged"},"output":[],'
    b'"usage":null}'
)
VLLM_FLAT_ERROR_BODY = (
    b'{"object":"error","message":"maximum context length","type":"BadRequestError",'
    b'"param":null,"code":400}'
)
COUNT_TOKENS_BODY = b'{"input_tokens":2095}'


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------

First = bytes | Literal["finish"] | None


@dataclass(frozen=True)
class Case:
    name: str
    fmt: StreamFormat
    body: bytes
    #: a marker inside the first-token event, "finish" (counted at finish) or None
    first: First
    usage: Usage | None = None
    error: str | None = None
    done: bool = True
    response_id: str | None = None
    streaming: bool = True
    malformed: int = 0
    overflow: bool = False
    max_line_bytes: int = 1 << 20


CASES = [
    Case("chat", OPENAI, CHAT, b'"Hello"', Usage(12, 2, 8)),
    Case("chat-no-usage", OPENAI, CHAT_NO_USAGE, b'"Hi"'),
    Case("chat-refusal", OPENAI, CHAT_REFUSAL, b"help with that", Usage(9, 7)),
    Case("chat-tool-calls", OPENAI, CHAT_TOOL_CALLS, b"get_weather"),
    Case("chat-reasoning", OPENAI, CHAT_REASONING, b"Let me think"),
    Case("chat-continuous-usage", OPENAI, CHAT_CONTINUOUS_USAGE, b'"A"', Usage(4, 2)),
    Case("chat-error", OPENAI, CHAT_ERROR, b'"Once"', error="server_error"),
    Case("chat-error-first", OPENAI, CHAT_ERROR_FIRST, None, error="rate_limit_exceeded"),
    Case("completions", OPENAI, COMPLETIONS, b'" Paris"', Usage(5, 2)),
    Case("responses", RESPONSES, RESPONSES_STREAM, b'"Hi"', Usage(20, 2, 16),
         response_id="resp_abc"),
    Case("responses-refusal", RESPONSES, RESPONSES_REFUSAL, b"I can't", Usage(5, 3),
         response_id="resp_abc"),
    Case("responses-function-call", RESPONSES, RESPONSES_FUNCTION_CALL, b"arguments.delta",
         Usage(11, 16), response_id="resp_abc"),
    Case("responses-reasoning", RESPONSES, RESPONSES_REASONING, b"Thinking", Usage(3, 30),
         response_id="resp_abc"),
    Case("responses-error", RESPONSES, RESPONSES_ERROR, None, error="rate_limit_exceeded",
         response_id="resp_abc"),
    Case("responses-error-null-code", RESPONSES, RESPONSES_ERROR_NULL_CODE, None, error="error"),
    Case("responses-failed", RESPONSES, RESPONSES_FAILED, b'"Par"', error="server_error",
         response_id="resp_abc"),
    Case("responses-failed-no-code", RESPONSES, RESPONSES_FAILED_NO_CODE, None, error="failed",
         response_id="resp_f"),
    Case("responses-data-only", RESPONSES, RESPONSES_DATA_ONLY, b'"Yo"', Usage(2, 1),
         response_id="resp_d"),
    Case("anthropic", ANTHROPIC, ANTHROPIC_STREAM, b'"Hello"', Usage(2131, 15, 2000)),
    Case("anthropic-thinking", ANTHROPIC, ANTHROPIC_THINKING, b"Let me see", Usage(85, 42, 30)),
    Case("anthropic-tool", ANTHROPIC, ANTHROPIC_TOOL, b"input_json_delta", Usage(2131, 9, 2000)),
    Case("anthropic-error", ANTHROPIC, ANTHROPIC_ERROR, None, Usage(2131, 1, 2000),
         error="overloaded_error"),
    Case("generate", GENERATE, GENERATE_STREAM, b'" Paris"', Usage(7, 3, 4)),
    Case("generate-batch", GENERATE, GENERATE_BATCH, b'"A"', Usage(8, 4, 2)),
    Case("generate-error", GENERATE, GENERATE_ERROR, b'" Paris"', Usage(7, 1), error="error"),
    Case("comments", OPENAI, COMMENTS, b'"X"'),
    Case("multiline-data", OPENAI, MULTILINE, b'"multi"', Usage(3, 1)),
    Case("bom", OPENAI, BOM, b'"Hi"'),
    Case("malformed", OPENAI, MALFORMED, b'"Hello"', Usage(12, 2, 8), malformed=3),
    Case("overflow", OPENAI, OVERFLOW, b'"Hello"', done=False, overflow=True,
         max_line_bytes=1024),
    Case("no-final-blank-line", OPENAI, NO_FINAL_BLANK, b'"Hi"'),
    Case("truncated", OPENAI, TRUNCATED, b'"Hello"', done=False),
    # Non-streaming bodies.
    Case("body-chat", OPENAI, CHAT_BODY, "finish", Usage(19, 3), streaming=False),
    Case("body-completions", OPENAI, COMPLETIONS_BODY, "finish", Usage(5, 2), streaming=False),
    Case("body-responses", RESPONSES, RESPONSES_BODY, "finish", Usage(36, 87, 32),
         response_id="resp_body", streaming=False),
    Case("body-responses-failed", RESPONSES, RESPONSES_FAILED_BODY, None, error="invalid_prompt",
         response_id="resp_failed", streaming=False),
    Case("body-anthropic", ANTHROPIC, ANTHROPIC_BODY, "finish", Usage(55, 6, 40),
         streaming=False),
    Case("body-anthropic-prewarm", ANTHROPIC, ANTHROPIC_PREWARM_BODY, None, Usage(12, 0),
         streaming=False),
    Case("body-generate", GENERATE, GENERATE_BODY, "finish", Usage(7, 2, 5), streaming=False),
    Case("body-generate-batch", GENERATE, GENERATE_BATCH_BODY, "finish", Usage(8, 5, 2),
         streaming=False),
    # vLLM's pooling answers: usage with prompt_tokens, or (older rerank) total_tokens only
    Case("body-embeddings", NONE, EMBEDDINGS_BODY, None, Usage(6, 0), streaming=False),
    Case("body-rerank-total-only", NONE, RERANK_OLD_BODY, None, Usage(9, 0), streaming=False),
    Case("body-openai-error", OPENAI, OPENAI_ERROR_BODY, None, error="invalid_api_key",
         streaming=False),
    Case("body-anthropic-error", ANTHROPIC, ANTHROPIC_ERROR_BODY, None, error="rate_limit_error",
         streaming=False),
    Case("body-vllm-flat-error", OPENAI, VLLM_FLAT_ERROR_BODY, None, error="BadRequestError",
         streaming=False),
    Case("body-none-format", NONE, COUNT_TOKENS_BODY, None, streaming=True),
    Case("body-truncated", OPENAI, CHAT_BODY[:-5], None, done=False, streaming=False, malformed=1),
    Case("body-overflow", OPENAI, CHAT_BODY, None, done=False, streaming=False, overflow=True,
         max_line_bytes=100),
    # A stream request answered with a plain JSON error (e.g. a 429 before any event).
    Case("stream-answered-with-json", OPENAI, OPENAI_ERROR_BODY, None, error="invalid_api_key"),
    Case("stream-answered-with-anthropic-json", ANTHROPIC, ANTHROPIC_ERROR_BODY, None,
         error="rate_limit_error"),
]  # fmt: skip

_LINE_END = re.compile(rb"\n\r?\n")


def variants(case: Case) -> list[bytes]:
    """LF and CRLF framing (JSON bodies keep theirs)."""
    if not case.streaming or case.fmt is NONE or case.body.startswith(b"{"):
        return [case.body]
    return [case.body, case.body.replace(b"\n", b"\r\n")]


PARAMS = [
    pytest.param(case, body, id=case.name + ("-crlf" if b"\r\n" in body else "-lf"))
    for case in CASES
    for body in variants(case)
]


def run(case: Case, chunks: list[bytes]) -> StreamAccountant:
    acc = StreamAccountant(
        case.fmt,
        streaming=case.streaming,
        started_at=STARTED,
        max_line_bytes=case.max_line_bytes,
    )
    for i, chunk in enumerate(chunks):
        acc.feed(chunk, float(i + 1))
    acc.finish(float(len(chunks) + 1))
    return acc


def expected_first(case: Case, body: bytes, chunks: list[bytes]) -> float | None:
    if case.first is None:
        return None
    if case.first == "finish":
        return float(len(chunks) + 1)
    m = _LINE_END.search(body, body.index(case.first))
    if m is None:  # the last event, completed only at finish
        return float(len(chunks) + 1)
    completing = m.end() - 1
    seen = 0
    for i, chunk in enumerate(chunks):
        seen += len(chunk)
        if seen > completing:
            return float(i + 1)
    raise AssertionError("the chunks do not cover the body")


def check(case: Case, body: bytes, chunks: list[bytes]) -> None:
    assert b"".join(chunks) == body
    acc = run(case, chunks)
    assert acc.first_token_at == expected_first(case, body, chunks)
    assert acc.usage == case.usage
    assert acc.error == case.error
    assert acc.done is case.done
    assert acc.response_id == case.response_id
    assert acc.overflow is case.overflow
    assert acc.malformed == case.malformed
    if acc.first_token_at is not None:
        assert acc.ttft == pytest.approx(acc.first_token_at - STARTED)
    else:
        assert acc.ttft is None


def split_at(body: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cuts), len(body)]
    return [body[a:b] for a, b in itertools.pairwise(points)]


# --------------------------------------------------------------------------------------
# Whole, byte by byte, random splits
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "body"), PARAMS)
def test_whole(case: Case, body: bytes) -> None:
    check(case, body, [body])


@pytest.mark.parametrize(("case", "body"), PARAMS)
def test_byte_at_a_time(case: Case, body: bytes) -> None:
    check(case, body, [body[i : i + 1] for i in range(len(body))])


@pytest.mark.parametrize(("case", "body"), PARAMS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_splits(case: Case, body: bytes, data: st.DataObject) -> None:
    # Duplicate cut points make empty feeds, which must be harmless too.
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=40), label="cuts")
    check(case, body, split_at(body, cuts))


# --------------------------------------------------------------------------------------
# Targeted behaviour
# --------------------------------------------------------------------------------------


def test_usage_defaults() -> None:
    assert Usage() == Usage(0, 0, 0)


def test_first_token_is_the_now_of_the_completing_feed() -> None:
    acc = StreamAccountant(OPENAI, streaming=True, started_at=10.0)
    first = CHAT.index(b'"Hello"')
    end = CHAT.index(b"\n\n", first)
    acc.feed(CHAT[: end + 1], 11.0)  # the event is not complete yet
    assert acc.first_token_at is None
    acc.feed(CHAT[end + 1 : end + 2], 12.5)
    assert acc.first_token_at == 12.5
    assert acc.ttft == 2.5
    acc.feed(CHAT[end + 2 :], 13.0)
    assert acc.first_token_at == 12.5
    assert acc.done


def test_crlf_event_completes_on_the_last_lf() -> None:
    body = CHAT.replace(b"\n", b"\r\n")
    first = body.index(b'"Hello"')
    end = body.index(b"\r\n\r\n", first)
    acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0)
    acc.feed(body[: end + 3], 1.0)  # up to the second "\r": maybe a CRLF
    assert acc.first_token_at is None
    acc.feed(body[end + 3 :], 2.0)
    assert acc.first_token_at == 2.0


def test_bytes_after_done_are_ignored() -> None:
    acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0)
    acc.feed(CHAT_NO_USAGE, 1.0)
    assert acc.done
    acc.feed(b"data: " + _CC + b'"choices":[],"usage":{"prompt_tokens":1}}\n\n', 2.0)
    acc.feed(b'data: {"error":{"type":"late"}}\n\n', 3.0)
    acc.finish(4.0)
    assert acc.usage is None
    assert acc.error is None


def test_bytes_after_finish_are_ignored() -> None:
    acc = StreamAccountant(ANTHROPIC, streaming=True, started_at=0.0)
    acc.finish(1.0)
    acc.feed(ANTHROPIC_STREAM, 2.0)
    acc.finish(3.0)
    assert not acc.done
    assert acc.first_token_at is None
    assert acc.usage is None


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the payloads the accountant decodes whole, in order."""
    calls: list[int] = []
    real = streams._decode

    def counting(payload: bytes) -> Any:
        calls.append(len(payload))
        return real(payload)

    monkeypatch.setattr(streams, "_decode", counting)
    return calls


def test_openai_decodes_only_what_it_needs(decodes: list[int]) -> None:
    calls = decodes
    deltas = b"".join(
        b"data: " + _CC + _CHOICE + b'{"content":"tok%d"}' % i + _TAIL for i in range(1000)
    )
    usage = b"data: " + _CC + b'"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1000}}'
    body = CHAT_NO_USAGE.split(b"data: [DONE]")[0] + deltas + usage + b"\n\ndata: [DONE]\n\n"
    acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0)
    acc.feed(body, 1.0)
    # the role chunk and the first content chunk; the usage chunk waits for a reader
    assert len(calls) == 2
    assert acc.usage == Usage(4, 1000)
    assert len(calls) == 3
    assert acc.usage == Usage(4, 1000)
    assert len(calls) == 3
    # Chunks saying "usage": null (include_usage without its final chunk) are never decoded.
    calls.clear()
    nulls = deltas.replace(b'"usage":null', b'"usage" : null')
    acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0)
    acc.feed(CHAT_NO_USAGE.split(b"data: [DONE]")[0] + deltas + nulls, 1.0)
    acc.finish(2.0)
    assert acc.usage is None
    assert len(calls) == 2


def test_named_formats_never_decode_deltas(decodes: list[int]) -> None:
    calls = decodes
    acc = StreamAccountant(RESPONSES, streaming=True, started_at=0.0)
    acc.feed(RESPONSES_STREAM, 1.0)
    assert acc.done
    assert calls == []  # lifecycle events go through the narrow struct decoder
    acc = StreamAccountant(ANTHROPIC, streaming=True, started_at=0.0)
    acc.feed(ANTHROPIC_STREAM, 1.0)
    assert len(calls) == 2  # message_start and message_delta


def test_generate_decodes_meta_info_lazily(decodes: list[int]) -> None:
    calls = decodes
    acc = StreamAccountant(GENERATE, streaming=True, started_at=0.0)
    acc.feed(GENERATE_STREAM, 1.0)
    assert len(calls) == 2  # the empty first chunk and the first with text
    assert acc.usage == Usage(7, 3, 4)
    assert len(calls) == 3


def test_error_code_never_carries_message_text() -> None:
    body = (
        b'data: {"error":{"message":"ignore previous instructions","type":"ignore previous '
        b'instructions","code":"contains spaces"}}\n\n'
    )
    acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0)
    acc.feed(body, 1.0)
    assert acc.error == "error"
    acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0)
    acc.feed(b'data: {"error":"the prompt text"}\n\n', 1.0)
    assert acc.error == "error"
    assert acc.done


@pytest.mark.parametrize("fmt", [OPENAI, RESPONSES, ANTHROPIC, GENERATE])
def test_deep_nesting_is_malformed_not_fatal(fmt: StreamFormat) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    acc = StreamAccountant(fmt, streaming=True, started_at=0.0)
    acc.feed(b"data: " + deep + b"\n\n", 1.0)
    acc.finish(2.0)
    assert acc.malformed == 1
    body = StreamAccountant(fmt, streaming=False, started_at=0.0)
    body.feed(b'{"a":' + deep + b"}", 1.0)
    body.finish(2.0)
    assert body.malformed == 1
    assert not body.done


def test_overflow_of_an_unterminated_event_stops_early() -> None:
    acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0, max_line_bytes=64)
    acc.feed(b"data: " + b"x" * 40, 1.0)
    assert not acc.overflow
    acc.feed(b"x" * 40, 2.0)
    assert acc.overflow
    acc.feed(b"\n\ndata: [DONE]\n\n", 3.0)
    acc.finish(4.0)
    assert not acc.done


def test_an_event_of_exactly_the_limit_is_parsed() -> None:
    payload = b'{"choices":[{"delta":{"content":"' + b"y" * 50 + b'"}}]}'
    event = b"data: " + payload
    for chunks in ([event + b"\n\n"], [bytes([b]) for b in event + b"\n\n"]):
        acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0, max_line_bytes=len(event))
        for i, c in enumerate(chunks):
            acc.feed(c, float(i))
        assert not acc.overflow
        assert acc.first_token_at is not None
        acc = StreamAccountant(
            OPENAI, streaming=True, started_at=0.0, max_line_bytes=len(event) - 1
        )
        for i, c in enumerate(chunks):
            acc.feed(c, float(i))
        assert acc.overflow
        assert acc.first_token_at is None


def test_none_format_streaming_is_a_body() -> None:
    acc = StreamAccountant(NONE, streaming=True, started_at=0.0)
    acc.feed(OPENAI_ERROR_BODY, 1.0)
    acc.finish(2.0)
    assert acc.error == "invalid_api_key"
    assert acc.done


def test_empty_body() -> None:
    acc = StreamAccountant(RESPONSES, streaming=False, started_at=0.0)
    acc.finish(1.0)
    assert not acc.done
    assert acc.malformed == 0
    assert acc.usage is None


@pytest.mark.parametrize(
    ("line", "name"),
    [
        (b"event: response.output_text.delta\ndata: {}\n\n", "with a space"),
        (b"event:response.output_text.delta\ndata:{}\n\n", "without a space"),
        (b": c\nevent: response.output_text.delta\n: c\ndata: {}\n\n", "with comments"),
        (b"data: {}\nevent: response.output_text.delta\n\n", "data before event"),
    ],
)
def test_event_field_variants(line: bytes, name: str) -> None:
    acc = StreamAccountant(RESPONSES, streaming=True, started_at=0.0)
    acc.feed(line, 1.0)
    assert acc.first_token_at == 1.0, name


def test_event_without_data_is_not_dispatched() -> None:
    acc = StreamAccountant(ANTHROPIC, streaming=True, started_at=0.0)
    acc.feed(b"event: message_stop\n\n", 1.0)
    assert not acc.done
    acc.feed(b"event: message_stop\ndata\n\n", 2.0)  # an empty data field still dispatches
    assert acc.done


def test_bare_cr_line_endings() -> None:
    acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0)
    acc.feed(CHAT.replace(b"\n", b"\r"), 1.0)
    acc.finish(2.0)
    assert acc.first_token_at == 1.0
    assert acc.usage == Usage(12, 2, 8)
    assert acc.done


def test_module_is_pure() -> None:
    forbidden = {
        "socket",
        "asyncio",
        "threading",
        "time",
        "httpx",
        "httpx2",
        "aiohttp",
        "anyio",
        "concurrent",
    }
    # the source beside the module (a compiled build imports an extension instead)
    tree = ast.parse((Path(streams.__file__).parent / "streams.py").read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & forbidden


# --------------------------------------------------------------------------------------
# Robustness: nothing an upstream sends makes the accountant raise
# --------------------------------------------------------------------------------------

_FRAGMENTS = [
    b"data: ",
    b"data:",
    b"event: ",
    b"error",
    b"message_start",
    b"response.completed",
    b"content_block_delta",
    b"\n",
    b"\r\n",
    b"\r",
    b"\n\n",
    b":",
    b"[DONE]",
    b"{",
    b"}",
    b'"usage":',
    b'"error":',
    b'"index":',
    b'"type":"error"',
    b'{"usage":{"prompt_tokens":-1,"completion_tokens":1.5}}',
    b'{"choices":[{"delta":{"content":"x"}}]}',
    b'{"response":"str"}',
    b'{"error":{"code":7}}',
    b'{"meta_info":[],"index":"x"}',
    b"null",
    b"\xef\xbb\xbf",
    b"\xff",
]


@pytest.mark.parametrize("fmt", list(StreamFormat))
@pytest.mark.parametrize("streaming", [True, False])
@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.binary(max_size=8)), max_size=60),
    limit=st.integers(1, 200),
)
def test_never_raises(fmt: StreamFormat, streaming: bool, pieces: list[bytes], limit: int) -> None:
    acc = StreamAccountant(fmt, streaming=streaming, started_at=0.0, max_line_bytes=limit)
    for i, piece in enumerate(pieces):
        acc.feed(piece, float(i))
    acc.finish(float(len(pieces)))
    _ = acc.usage, acc.ttft
    if acc.first_token_at is not None:
        assert 0.0 <= acc.first_token_at <= len(pieces)


@settings(max_examples=100, deadline=None)
@given(
    usage=st.dictionaries(
        st.sampled_from(["prompt_tokens", "completion_tokens", "prompt_tokens_details"]),
        st.one_of(st.none(), st.integers(-5, 10**12), st.floats(), st.text(max_size=3)),
    )
)
def test_odd_usage_values_never_raise(usage: dict[str, Any]) -> None:
    body = msgspec.json.encode({"choices": [], "usage": usage})
    acc = StreamAccountant(OPENAI, streaming=True, started_at=0.0)
    acc.feed(b"data: " + body + b"\n\n", 1.0)
    u = acc.usage
    assert u is None or min(u.input_tokens, u.output_tokens, u.cached_tokens) >= 0


CONVERSATION_BODY = b'{"id":"conv_1","object":"conversation","created_at":1,"metadata":{}}'


@pytest.mark.parametrize(
    ("fmt", "state_ids", "body", "expected"),
    [
        pytest.param(
            StreamFormat.NONE, True, CONVERSATION_BODY, "conv_1", id="conversation-create"
        ),
        pytest.param(StreamFormat.NONE, None, CONVERSATION_BODY, None, id="not-a-state-answer"),
        pytest.param(StreamFormat.NONE, True, b'{"object":"list","data":[]}', None, id="no-id"),
        pytest.param(
            StreamFormat.RESPONSES, None, b'{"id":"resp_1","output":[]}', "resp_1", id="response"
        ),
        pytest.param(StreamFormat.RESPONSES, False, b'{"id":"resp_1"}', None, id="response-delete"),
    ],
)
def test_the_id_of_a_stored_state_answer(
    fmt: StreamFormat, state_ids: bool | None, body: bytes, expected: str | None
) -> None:
    acc = StreamAccountant(fmt, streaming=False, started_at=0.0, state_ids=state_ids)
    acc.feed(body, 1.0)
    acc.finish(1.0)
    assert acc.response_id == expected


def _embeddings(n: int, dims: int) -> bytes:
    vector = b",".join([b"0.0123"] * dims)
    data = b",".join(
        b'{"object":"embedding","index":%d,"embedding":[%s]}' % (i, vector) for i in range(n)
    )
    return b'{"object":"list","data":[%s],"usage":{"prompt_tokens":80,"total_tokens":80}}' % data


def test_a_pooling_answer_is_accounted_without_decoding_its_vectors(decodes: list[int]) -> None:
    calls = decodes
    acc = StreamAccountant(StreamFormat.NONE, streaming=False, started_at=0.0)
    acc.feed(_embeddings(8, 1024), 1.0)
    acc.finish(2.0)
    assert acc.done
    assert acc.usage == Usage(80, 0)
    assert acc.first_token_at is None  # no output: no first token
    assert calls == []


@pytest.mark.parametrize(
    "body",
    [
        b'{"choices":[{"index":0,"message":{"content":"hi"}}],"usage":{"prompt_tokens":3}}',
        b'{"content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":3}}',
        b'{"text":"hi","meta_info":{"prompt_tokens":3}}',
    ],
)
def test_output_with_no_output_tokens_is_read_from_the_body(body: bytes) -> None:
    acc = StreamAccountant(StreamFormat.NONE, streaming=False, started_at=0.0)
    acc.feed(body, 1.0)
    acc.finish(2.0)
    assert acc.done
    assert acc.usage is not None
    assert acc.usage.output_tokens == 0
    assert acc.first_token_at == 2.0  # the output counts, though usage says none


# --------------------------------------------------------------------------------------
# Background responses: whether the Response seen had ended in the background
# --------------------------------------------------------------------------------------

_USAGE = b'"usage":{"input_tokens":3,"output_tokens":5,"total_tokens":8}'
_OUT = b'"output":[{"type":"message","content":[{"type":"output_text","text":"hi"}]}]'


def _stored(status: bytes, background: bytes, usage: bytes = _USAGE) -> bytes:
    return b'{"id":"resp_1","object":"response","status":"%s","background":%s,%s,%s}' % (
        status,
        background,
        _OUT if usage else b'"output":[]',
        usage or b'"usage":null',
    )


@pytest.mark.parametrize(
    ("body", "ended"),
    [
        pytest.param(_stored(b"completed", b"true"), True, id="completed"),
        pytest.param(_stored(b"incomplete", b"true"), True, id="incomplete"),
        pytest.param(_stored(b"cancelled", b"true"), True, id="cancelled"),
        pytest.param(_stored(b"failed", b"true", b""), True, id="failed-no-usage"),
        pytest.param(_stored(b"queued", b"true", b""), False, id="queued"),
        pytest.param(_stored(b"in_progress", b"true", b""), False, id="in-progress"),
        pytest.param(_stored(b"completed", b"false"), False, id="foreground"),
        pytest.param(_stored(b"completed", b"null"), False, id="background-null"),
        pytest.param(_stored(b"completed", b'"true"'), False, id="background-a-string"),
        pytest.param(
            b'{"id":"resp_1","status":["completed"],"background":true,' + _USAGE + b"}",
            False,
            id="status-not-a-string",
        ),
    ],
)
def test_a_stored_response_that_ended_in_the_background(body: bytes, ended: bool) -> None:
    acc = StreamAccountant(NONE, streaming=False, started_at=0.0, state_ids=True)
    acc.feed(body, 1.0)
    acc.finish(1.0)
    assert acc.response_id == "resp_1"
    assert acc.background_ended is ended


def test_only_a_state_answer_is_read_for_background() -> None:
    # A chat answer is never a stored Response: its body is not read for it.
    acc = StreamAccountant(NONE, streaming=False, started_at=0.0)
    acc.feed(_stored(b"completed", b"true"), 1.0)
    acc.finish(1.0)
    assert (acc.response_id, acc.background_ended) == (None, False)
    assert acc.usage == Usage(3, 5, 0)


def _responses_stream(terminal: bytes, background: bytes, named: bool = True) -> bytes:
    def event(name: bytes, data: bytes) -> bytes:
        return (b"event: " + name + b"\n" if named else b"") + b"data: " + data + b"\n\n"

    start = b'{"id":"resp_1","status":"in_progress","background":%s,"usage":null}' % background
    end = b'{"id":"resp_1","status":"x","background":%s,%s}' % (background, _USAGE)
    return (
        event(b"response.created", b'{"type":"response.created","response":%s}' % start)
        + event(
            b"response.output_text.delta",
            b'{"type":"response.output_text.delta","delta":"hi"}',
        )
        + event(terminal, b'{"type":"%s","response":%s}' % (terminal, end))
    )


@pytest.mark.parametrize("named", [True, False], ids=["event-lines", "type-only"])
@pytest.mark.parametrize(
    ("terminal", "background", "ended"),
    [
        (b"response.completed", b"true", True),
        (b"response.incomplete", b"true", True),
        (b"response.failed", b"true", True),
        (b"response.completed", b"false", False),
        (b"response.completed", b"null", False),
    ],
)
def test_a_streamed_response_that_ended_in_the_background(
    terminal: bytes, background: bytes, ended: bool, named: bool
) -> None:
    acc = StreamAccountant(RESPONSES, streaming=True, started_at=0.0)
    acc.feed(_responses_stream(terminal, background, named), 1.0)
    assert acc.done
    assert acc.response_id == "resp_1"
    assert acc.background_ended is ended
    assert acc.usage == Usage(3, 5, 0)


def test_a_stream_cut_before_its_terminal_event_has_not_ended() -> None:
    acc = StreamAccountant(RESPONSES, streaming=True, started_at=0.0)
    whole = _responses_stream(b"response.completed", b"true")
    acc.feed(whole[: whole.rindex(b"event: response.completed")], 1.0)
    acc.finish(2.0)
    assert not acc.background_ended
