"""
Chat templates
==============

Renders a ``tokenizer_config.json`` chat template the way HuggingFace
``apply_chat_template`` does, so token counts match the model server's:

- an :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` with
  ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a
  no-op ``{% generation %}`` block;
- the variables ``messages``, ``tools``, ``add_generation_prompt``,
  ``bos_token``, ``eos_token`` (plus any ``chat_template_kwargs``), the globals
  ``raise_exception`` and ``strftime_now`` and HF's ``tojson`` filter
  (``ensure_ascii=False``, optional ``indent``, ``separators``, ``sort_keys``).

Each template text is compiled once (an LRU cache keyed by the text).

Render budget
-------------

A template is code. The sandbox stops it from reaching Python internals, but not
from looping forever or building a gigabyte string, so every render runs under a
:class:`RenderBudget`:

- **steps** — every loop iteration, call, macro call, recursive ``loop()``,
  string concatenation and intercepted operator costs one step. Loops are counted
  by rewriting each ``{% for %}``'s iterable through a counting wrapper at
  compile time, so nested loops over anything (not only ``range``) are bounded;
- **wall time** — checked as steps are counted;
- **characters** — everything a render produces (``{{ }}`` output, captured
  ``{% set %}`` blocks, ``~``/``+``/``*``/``%`` results, filter and method results)
  is charged, and the final output has its own bound;
- **arguments** — operations whose cost is set by one number are checked before
  they run: ``*`` and ``+`` on sequences, ``**`` and ``*`` on big integers,
  integer arguments over 65 536 (``center``, ``range``, ...), indentation widths
  over 64, six-digit widths in ``%``/``format`` strings.

Failures — syntax errors, ``raise_exception``, undefined values, a sandbox
violation, an exhausted budget — raise :class:`~meshkit.errors.InvalidRequest`
(400) with a message saying which. A message never quotes the request.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, cast

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from meshkit.errors import InvalidRequest

__all__ = [
    "RenderBudget",
    "compile_template",
    "render_chat_template",
]

#: An integer argument above this is refused (widths, counts, ranges).
MAX_INT_ARG: Final = 65_536
#: Indentation widths (``indent``, ``tojson(indent=...)``, ``expandtabs``).
MAX_INDENT: Final = 64
#: Integers stay below this many bits (``**`` and ``*`` on ints).
MAX_INT_BITS: Final = 65_536
_BIG_NUMBER: Final = re.compile(r"\d{6,}")  # a width or precision in a format string


@dataclass(frozen=True)
class RenderBudget:
    """Bounds of one render (see the module documentation)."""

    max_steps: int = 1_000_000
    max_seconds: float = 5.0
    max_output_chars: int = 16 * 1024 * 1024
    max_work_chars: int = 128 * 1024 * 1024


class _BudgetExceeded(Exception):
    """The render went over its budget; becomes an InvalidRequest."""


class _State:
    __slots__ = ("budget", "deadline", "steps", "work")

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.steps = 0
        self.work = 0
        self.deadline = time.monotonic() + budget.max_seconds


# Per render, per thread: the environment and compiled templates are shared.
_STATE: contextvars.ContextVar[_State | None] = contextvars.ContextVar(
    "meshkit_template_budget", default=None
)


def _tick() -> _State | None:
    """Count one step of the current render (if any); return its state."""
    state = _STATE.get()
    if state is not None:
        _step(state)
    return state


def _step(state: _State) -> None:
    state.steps += 1
    if state.steps > state.budget.max_steps:
        raise _BudgetExceeded(f"more than {state.budget.max_steps} steps")
    # The clock is read every 64 steps: cheap, and a step is short.
    if not state.steps & 63 and time.monotonic() > state.deadline:
        raise _BudgetExceeded(f"longer than {state.budget.max_seconds:g} s")


def _charge(value: Any, state: _State | None) -> None:
    if state is None or not isinstance(value, str | bytes | list | tuple | dict):
        return
    state.work += len(value)
    if state.work > state.budget.max_work_chars:
        raise _BudgetExceeded(f"more than {state.budget.max_work_chars} characters produced")


def _check_int(value: Any, limit: int = MAX_INT_ARG) -> None:
    if type(value) is int and abs(value) > limit:
        raise _BudgetExceeded(f"an integer argument above {limit}")


def _check_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for value in args:
        _check_int(value)
    for value in kwargs.values():
        _check_int(value)


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _BIG_NUMBER.search(fmt):
        raise _BudgetExceeded("a format width or precision of six digits or more")


def _sized(value: Any) -> int | None:
    return len(value) if isinstance(value, str | bytes | list | tuple) else None


def _check_binop(operator: str, left: Any, right: Any, state: _State | None) -> None:
    limit = state.budget.max_work_chars if state is not None else MAX_INT_ARG
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            size = _sized(seq)
            if size is not None and type(count) is int and size * count > limit:
                raise _BudgetExceeded("a repeated sequence over the character budget")
        if (
            type(left) is int
            and type(right) is int
            and left.bit_length() + right.bit_length() > MAX_INT_BITS
        ):
            raise _BudgetExceeded(f"an integer over {MAX_INT_BITS} bits")
    elif operator == "**":
        if (
            type(left) is int
            and type(right) is int
            and abs(left) > 1
            and right * left.bit_length() > MAX_INT_BITS
        ):
            raise _BudgetExceeded(f"an integer over {MAX_INT_BITS} bits")
    elif operator == "+":
        a, b = _sized(left), _sized(right)
        if a is not None and b is not None and a + b > limit:
            raise _BudgetExceeded("a concatenation over the character budget")
    elif operator == "%":
        _check_format(left)


class _Counted:
    """A loop's iterable, counting one step per item (and keeping ``len``)."""

    __slots__ = ("_it", "_source", "_state")

    def __init__(self, source: Any, state: _State | None) -> None:
        self._source = source
        self._it = iter(source)
        self._state = state

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        if self._state is not None:
            _step(self._state)
        return item

    def __len__(self) -> int:
        # TypeError for an iterable without len, as LoopContext expects.
        return len(self._source)


class _BudgetTransformer(NodeTransformer):
    """Routes loop iterables and ``~`` through the environment's counting hooks."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _env_call("budget_iter", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return _env_call("budget_concat", list(node.nodes), node.lineno)


def _env_call(name: str, args: Sequence[nodes.Node], lineno: int) -> nodes.Call:
    # `environment.<name>`: a template cannot shadow it with a variable. The
    # arguments are a loop's iterable or a concatenation's operands: expressions.
    exprs = cast(list[nodes.Expr], list(args))
    return nodes.Call(nodes.EnvironmentAttribute(name), exprs, [], None, None, lineno=lineno)


class _GenerationExtension(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant masks): renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's tojson: plain json.dumps, unlike jinja's HTML-safe default.
    if isinstance(indent, int):
        _check_int(indent, MAX_INDENT)
    elif isinstance(indent, str) and len(indent) > MAX_INDENT:
        raise _BudgetExceeded(f"an indentation wider than {MAX_INDENT}")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _guard_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment markers
    def guarded(*args: Any, **kwargs: Any) -> Any:
        state = _tick()
        _check_args(args, kwargs)
        if name == "indent":
            width = kwargs.get("width", args[1] if len(args) > 1 else 4)
            size = width if isinstance(width, int) else len(str(width))
            _check_int(size, MAX_INDENT)
        elif name == "format" and args:
            _check_format(args[0])
        result = fn(*args, **kwargs)
        _charge(result, state)
        return result

    return guarded


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox plus the render budget's hooks."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[loopcontrols, _GenerationExtension],
            finalize=self._finalize,
            # Constant folding would run filters at compile time, outside any budget.
            optimized=False,
        )
        self.filters["tojson"] = _tojson
        for name, fn in list(self.filters.items()):
            self.filters[name] = _guard_filter(name, fn)
        self.globals.pop("lipsum", None)  # a text generator with a size argument
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        transformed: nodes.Template = _BudgetTransformer().visit(tree)
        return transformed

    @staticmethod
    def _finalize(value: Any) -> Any:
        _charge(value if isinstance(value, str) else str(value), _STATE.get())
        return value

    # Reached through `environment.budget_iter` / `environment.budget_concat`.
    def budget_iter(self, iterable: Any) -> _Counted:
        return _Counted(iterable, _STATE.get())

    def budget_concat(self, *parts: Any) -> str:
        state = _STATE.get()
        if state is not None:
            size = sum(len(p) if isinstance(p, str) else 0 for p in parts)
            if state.work + size > state.budget.max_work_chars:
                raise _BudgetExceeded("a concatenation over the character budget")
        result = "".join(str(p) for p in parts)
        _charge(result, state)
        return result

    def call(
        __self,  # jinja's signature: the odd names avoid clashes with template kwargs
        __context: jinja2.runtime.Context,
        __obj: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        state = _tick()
        _check_args(args, kwargs)
        # The sandbox hands str.format out wrapped; __wrapped__ is the bound method.
        target = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            method = getattr(target, "__name__", "")
            if method in ("format", "format_map"):
                _check_format(owner)
            elif method == "expandtabs":
                _check_int(args[0] if args else kwargs.get("tabsize", 8), MAX_INDENT)
            elif method == "replace" and len(args) >= 2:
                growth = len(str(args[1])) - len(str(args[0]))
                limit = state.budget.max_work_chars if state is not None else MAX_INT_ARG
                if growth > 0 and (len(owner) + 1) * growth > limit:
                    raise _BudgetExceeded("a replacement over the character budget")
        result = super().call(__context, __obj, *args, **kwargs)
        _charge(result, state)
        return result

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        state = _tick()
        _check_binop(operator, left, right, state)
        result = super().call_binop(context, operator, left, right)
        _charge(result, state)
        return result


@functools.cache
def _environment() -> _BudgetedEnvironment:
    return _BudgetedEnvironment()


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once (cached by its text).

    :raises InvalidRequest: on a syntax error.
    """
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequest(
            f"the chat template is invalid: {exc.message} (line {exc.lineno})"
        ) from None


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    extra: Mapping[str, Any] | None = None,
    budget: RenderBudget | None = None,
) -> str:
    """Render ``template`` for a conversation, within ``budget``.

    ``extra`` (``chat_template_kwargs``) adds variables; it cannot replace
    ``messages``, ``tools`` or ``add_generation_prompt``.

    :raises InvalidRequest: (400) when the template fails or exceeds its budget.
    """
    compiled = compile_template(template)
    budget = budget or RenderBudget()
    context: dict[str, Any] = {"bos_token": bos_token, "eos_token": eos_token}
    if extra:
        context.update(extra)
    context.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
    token = _STATE.set(_State(budget))
    try:
        return _collect(compiled.generate(context), budget)
    except InvalidRequest:
        raise
    except _BudgetExceeded as exc:
        raise InvalidRequest(f"the chat template exceeded its render budget: {exc}") from None
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"the chat template failed: {exc.message}") from None
    except (RecursionError, MemoryError) as exc:
        raise InvalidRequest(
            f"the chat template exceeded its render budget: {type(exc).__name__}"
        ) from None
    except Exception as exc:
        raise InvalidRequest(
            f"the chat template failed: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    finally:
        _STATE.reset(token)


def _collect(chunks: Iterator[str], budget: RenderBudget) -> str:
    out: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > budget.max_output_chars:
            raise _BudgetExceeded(f"an output over {budget.max_output_chars} characters")
        out.append(chunk)
    return "".join(out)
