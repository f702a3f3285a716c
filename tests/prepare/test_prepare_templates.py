"""Chat templates: HF-compatible rendering, and hostile templates within budget."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from meshkit.errors import InvalidRequest
from meshkit.prepare.templates import RenderBudget, compile_template, render_chat_template
from meshkit.prepare.tokenizers import LoadedTokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_qwen_template_renders_a_tool_conversation(qwen: LoadedTokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "<think>\nok\n</think>\n\nIt is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    rendered = qwen.render_chat(messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        "<tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is the weather?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is sunny.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen_template_takes_chat_template_kwargs(qwen: LoadedTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert qwen.render_chat(messages, extra={"enable_thinking": False}) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert qwen.render_chat(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_fixture_template_with_bos_and_raise_exception(tiny: LoadedTokenizer) -> None:
    assert tiny.bos_token == "<s>"  # a {"content": ...} dict in tokenizer_config.json
    assert tiny.eos_token == "</s>"
    rendered = tiny.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    with pytest.raises(InvalidRequest, match="unknown role: robot"):
        tiny.render_chat([{"role": "robot", "content": "beep"}])


def test_hf_environment_details() -> None:
    template = (
        "{% for m in messages %}\n"
        "  {{ m.content | tojson }}|{{ m | tojson(sort_keys=True) }}\n"
        "{% endfor %}"
        "{% generation %}{{ bos_token }}{% endgeneration %}"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    out = render_chat_template(template, [{"role": "user", "content": 'é"<'}], bos_token="<s>")
    # trim_blocks/lstrip_blocks, HF's tojson (no HTML escaping, no ASCII escaping),
    # loop controls, the generation block and the globals.
    assert out == '  "é\\"<"|{"content": "é\\"<", "role": "user"}\n<s>014'


def test_templates_are_compiled_once() -> None:
    source = "{{ messages | length }}"
    assert compile_template(source) is compile_template(source)
    assert render_chat_template(source, [{"role": "user", "content": "x"}]) == "1"


def test_rendering_is_thread_safe(tiny: LoadedTokenizer) -> None:
    results: list[str] = []

    def render(i: int) -> None:
        results.append(tiny.render_chat([{"role": "user", "content": str(i)}]))

    threads = [threading.Thread(target=render, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(f"<s><|user|>\n{i}<|end|>\n<|assistant|>\n" for i in range(8))


def test_no_chat_template_is_a_400(tiny: LoadedTokenizer) -> None:
    copy = tiny.copy()
    object.__setattr__(copy._info, "chat_template", None)
    with pytest.raises(InvalidRequest, match="no chat template"):
        copy.render_chat([{"role": "user", "content": "x"}])


# -- failures and hostile templates ------------------------------------------------

SMALL = RenderBudget(
    max_steps=20_000, max_seconds=5.0, max_output_chars=100_000, max_work_chars=1_000_000
)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        # loops that would spin (practically) forever
        ("{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}", "steps"),
        ("{% for a in 'x' * 60000 %}{% for b in 'y' * 60000 %}{% endfor %}{% endfor %}", "steps"),
        ("{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "budget"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "budget"),
        # memory bombs
        ("{{ 'x' * 10000000000 }}", "budget"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
            "{% endfor %}{{ ns.s | length }}",
            "budget",
        ),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
            "{% endfor %}",
            "budget",
        ),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s %}{{ ns.s }}"
            "{{ ns.s }}{% endset %}{% endfor %}",
            "budget",
        ),
        ("{% for i in range(60000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "budget"),
        ("{{ 'x' | center(1000000000) }}", "integer"),
        ("{{ 'x'.ljust(1000000000) }}", "integer"),
        ("{{ ('a\\n' * 1000) | indent(60000) }}", "integer"),
        ("{{ messages | tojson(indent=1000) }}", "integer"),
        ("{{ ('\\t' * 1000).expandtabs(60000) }}", "integer"),
        ("{{ '%01000000d' % 5 }}", "format"),
        ("{{ '{:>1000000000}'.format(5) }}", "format"),
        ("{{ '{0:>{1}}'.format(5, 1000000000) }}", "integer"),
        ("{{ 99 ** 99999999 }}", "integer"),
        ("{{ ('x' * 5000).replace('', 'y' * 1000) }}", "replacement"),
        ("{{ lipsum(5) }}", "undefined"),
        # plain failures
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ ''.__class__.__mro__ }}", "failed"),
        ("{% for %}", "invalid"),
        ("{{ nope.attr }}", "undefined"),
    ],
)
def test_hostile_or_broken_templates_are_refused(template: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        render_chat_template(template, MESSAGES, budget=SMALL)
    assert info.value.status == 400
    assert "hi" not in info.value.message  # the request is never echoed


def test_the_sandbox_hides_internals() -> None:
    assert render_chat_template("{{ messages[0].__class__ }}", MESSAGES) == ""
    with pytest.raises(InvalidRequest):
        render_chat_template("{{ messages[0].__class__.__mro__ }}", MESSAGES)


def test_the_output_bound_is_enforced() -> None:
    budget = RenderBudget(max_output_chars=1000)
    over = "{% for i in range(200) %}0123456789{% endfor %}"
    with pytest.raises(InvalidRequest, match="output over 1000"):
        render_chat_template(over, MESSAGES, budget=budget)
    under = "{% for i in range(99) %}0123456789{% endfor %}"
    assert len(render_chat_template(under, MESSAGES, budget=budget)) == 990


def test_the_time_budget_is_enforced() -> None:
    budget = RenderBudget(max_steps=10**9, max_seconds=0.05, max_work_chars=10**9)
    with pytest.raises(InvalidRequest, match="longer than"):
        render_chat_template(
            "{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}",
            MESSAGES,
            budget=budget,
        )


def test_a_budget_does_not_leak_between_renders() -> None:
    budget = RenderBudget(max_steps=150)
    template = "{% for i in range(100) %}{% endfor %}ok"
    for _ in range(3):  # each render starts from zero
        assert render_chat_template(template, MESSAGES, budget=budget) == "ok"
