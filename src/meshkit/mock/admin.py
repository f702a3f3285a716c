"""
Non-inference endpoints of the mock worker
==========================================

* ``GET /health`` (and ``/health_generate``): 200, empty body (also while sleeping,
  as vLLM does).
* ``GET /metrics``: a few vLLM-style Prometheus lines.
* Start-up probes of the Rust routers: ``GET /model_info``, ``/server_info``
  (also ``/get_model_info``, ``/get_server_info``) and ``/version``.
* ``GET /v1/models``; ``POST /tokenize``, ``/detokenize`` (also under ``/v1``), in
  vLLM's shapes: ``{"count", "max_model_len", "tokens"}`` and ``{"prompt"}``.
* vLLM sleep mode (only with ``MockConfig.sleep_mode``): ``GET /is_sleeping``,
  ``POST /sleep?level=N&mode=M`` (or ``tags=...``; takes ``sleep_ms``),
  ``POST /wake_up`` (optionally ``tags=...``; takes ``wake_ms``). Level >= 1 drops
  the prefix cache. Level 0 only pauses scheduling; an untagged ``/wake_up``
  resumes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshkit.mock.tokens import prompt_tokens
from meshkit.mock.wire import Delayed, Reply, Request

if TYPE_CHECKING:
    from meshkit.mock.app import MockApp

__all__ = ["MAX_MODEL_LEN", "VERSION", "AdminHandlers"]

MAX_MODEL_LEN = 32768
VERSION = "0.1.0+meshkit.mock"
_PROM = b"text/plain; version=0.0.4; charset=utf-8"


class AdminHandlers:
    """Handlers for one :class:`~meshkit.mock.app.MockApp`."""

    def __init__(self, app: MockApp) -> None:
        self.app = app

    def register(self) -> None:
        r = self.app.route
        r("/health", None, False, GET=self.health)
        r("/health_generate", None, False, GET=self.health)
        r("/metrics", None, False, GET=self.metrics)
        for prefix in ("/", "/get_"):
            r(f"{prefix}model_info", None, False, GET=self.model_info)
            r(f"{prefix}server_info", None, False, GET=self.server_info)
        r("/version", None, False, GET=self.version)
        r("/v1/models", "models", False, GET=self.models)
        r("/v1/load_lora_adapter", None, False, POST=self.load_lora_adapter)
        r("/v1/unload_lora_adapter", None, False, POST=self.unload_lora_adapter)
        for prefix in ("", "/v1"):
            r(f"{prefix}/tokenize", "tokenize", False, POST=self.tokenize)
            r(f"{prefix}/detokenize", "tokenize", False, POST=self.detokenize)
        if self.app.config.sleep_mode:
            r("/is_sleeping", None, False, GET=self.is_sleeping)
            r("/sleep", None, False, POST=self.sleep)
            r("/wake_up", None, False, POST=self.wake_up)

    # -- probes ------------------------------------------------------------------

    def health(self, req: Request) -> Reply:
        return self.app.plain(req)

    def metrics(self, req: Request) -> Reply:
        app, stats = self.app, self.app.stats
        model = app.config.model.replace('"', "'")
        label = f'{{model_name="{model}"}}'
        cache = app.cache
        # vLLM counts the blocks running requests hold (cached free blocks are
        # "free"); without that model, the mock's figure is the cached share.
        usage = (
            0.0
            if cache is None or cache.capacity_blocks == 0
            else (cache.held_blocks if app.config.cache_holds_running else len(cache))
            / cache.capacity_blocks
        )
        waiting = cache.waiting if cache is not None else 0
        rows: list[tuple[str, str, str, float]] = [
            ("vllm:num_requests_running", "gauge", label, max(stats.in_flight - waiting, 0)),
            ("vllm:num_requests_waiting", "gauge", label, waiting),
            ("vllm:kv_cache_usage_perc", "gauge", label, usage),
            ("vllm:prefix_cache_queries_total", "counter", label, stats.prompt_tokens_total),
            ("vllm:prefix_cache_hits_total", "counter", label, stats.cached_tokens_total),
            ("meshkit_mock_active_streams", "gauge", "", stats.active_streams),
            ("meshkit_mock_sleeping", "gauge", "", 1 if app.sleeping_tags else 0),
        ]
        lines: list[str] = []
        for name, kind, labels, value in rows:
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{labels} {value}")
        lines.append("# TYPE meshkit_mock_requests_total counter")
        for path, count in sorted(stats.requests_total.items()):
            lines.append(f'meshkit_mock_requests_total{{path="{path}"}} {count}')
        return app.plain(req, body=("\n".join(lines) + "\n").encode(), ctype=_PROM)

    def model_info(self, req: Request) -> Reply:
        model = self.app.config.model
        info: dict[str, Any] = {
            "model_path": model,
            "tokenizer_path": model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "mock",
            "architectures": ["MockForCausalLM"],
        }
        return self.app.json(req, info)

    def server_info(self, req: Request) -> Reply:
        cfg = self.app.config
        info: dict[str, Any] = {
            "model_path": cfg.model,
            "served_model_name": cfg.model,
            "tokenizer_path": cfg.model,
            "dp_size": cfg.dp_size,
            "tp_size": 1,
            "page_size": 16,
            "max_total_num_tokens": cfg.cache_tokens,
            "context_length": MAX_MODEL_LEN,
            "version": VERSION,
            "worker_name": cfg.name,
        }
        return self.app.json(req, info)

    def version(self, req: Request) -> Reply:
        return self.app.json(req, {"version": VERSION})

    def models(self, req: Request) -> Reply:
        cfg = self.app.config
        card = {
            "id": cfg.model,
            "object": "model",
            "created": 0,
            "owned_by": "meshkit-mock",
        }
        cards = [card, *(_adapter_card(name, cfg.model) for name in cfg.lora_adapters)]
        return self.app.json(req, {"object": "list", "data": cards})

    # -- adapters loaded at run time ---------------------------------------------
    # vLLM's answers (vllm/entrypoints/openai/serving_models.py, load_lora_adapter
    # and its checks; vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING, the mock does not):
    # a plain-text success, 400 for a name loaded already, 404 for one not loaded.

    def load_lora_adapter(self, req: Request) -> Reply:
        app = self.app
        body = app.parse(req) or {}
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return app.error(req, 400, "Both 'lora_name' and 'lora_path' must be provided.")
        adapters = app.config.lora_adapters
        if name in adapters:
            return app.error(req, 400, f"The lora adapter '{name}' has already been loaded.")
        app.config.lora_adapters = (*adapters, name)
        return app.plain(req, body=f"Success: LoRA adapter '{name}' added successfully.".encode())

    def unload_lora_adapter(self, req: Request) -> Reply:
        app = self.app
        body = app.parse(req) or {}
        name = body.get("lora_name")
        adapters = app.config.lora_adapters
        if not isinstance(name, str) or name not in adapters:
            return app.error(req, 404, f"The lora adapter '{name}' cannot be found.")
        app.config.lora_adapters = tuple(a for a in adapters if a != name)
        return app.plain(req, body=f"Success: LoRA adapter '{name}' removed successfully.".encode())

    # -- tokenizer ---------------------------------------------------------------

    def tokenize(self, req: Request) -> Reply:
        app = self.app
        body = app.parse(req)
        if body is None:
            return app.error(req, 400, "The request body is not a JSON object")
        prompt = body.get("prompt")
        out: dict[str, Any]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            ids = [app.vocab.encode(prompt_tokens(p)) for p in prompt]
            out = {"count": [len(i) for i in ids], "max_model_len": MAX_MODEL_LEN, "tokens": ids}
            return app.json(req, out)
        if prompt is None and body.get("messages") is None:
            return app.error(req, 400, "either 'prompt' or 'messages' is required", param="prompt")
        tokens = prompt_tokens(prompt if prompt is not None else body.get("messages"))
        ids_flat = app.vocab.encode(tokens)
        out = {"count": len(ids_flat), "max_model_len": MAX_MODEL_LEN, "tokens": ids_flat}
        if body.get("return_token_strs") is True:
            out["token_strs"] = [str(tok) for tok in tokens]
        return app.json(req, out)

    def detokenize(self, req: Request) -> Reply:
        app = self.app
        body = app.parse(req)
        tokens = None if body is None else body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int | list) for t in tokens):
            return app.error(req, 400, "'tokens' must be a list of token ids", param="tokens")
        if tokens and all(isinstance(t, list) for t in tokens):
            return app.json(req, {"prompt": [app.vocab.decode(t) for t in tokens]})
        if not all(isinstance(t, int) for t in tokens):
            return app.error(req, 400, "'tokens' must be a list of token ids", param="tokens")
        return app.json(req, {"prompt": app.vocab.decode(tokens)})

    # -- vLLM sleep mode ---------------------------------------------------------

    def is_sleeping(self, req: Request) -> Reply:
        return self.app.json(req, {"is_sleeping": bool(self.app.sleeping_tags)})

    def sleep(self, req: Request) -> Reply:
        app, stats = self.app, self.app.stats
        params = req.params()
        try:
            level = int((params.get("level") or ["1"])[-1])
        except ValueError:
            return app.error(req, 400, "level must be an integer", param="level")
        stats.sleep_calls += 1
        stats.last_sleep_level = level
        stats.last_sleep_mode = params.get("mode", [""])[-1] or None
        tags = set(params.get("tags") or [])
        if not tags:
            tags = {"weights", "kv_cache"} if level >= 1 else {"scheduling"}

        def sleep() -> None:
            app.sleeping_tags |= tags
            if "kv_cache" in tags and app.cache is not None:
                app.cache.clear()

        delay = app.config.sleep_ms / 1000.0
        if delay > 0.0:
            return Delayed(delay, app.plain(req), req.keep_alive, before=sleep)
        sleep()
        return app.plain(req)

    def wake_up(self, req: Request) -> Reply:
        app = self.app
        app.stats.wake_calls += 1
        tags = set(req.params().get("tags") or [])

        def wake() -> None:
            if tags:
                app.sleeping_tags -= tags
            else:
                app.sleeping_tags.clear()

        data = app.plain(req)
        delay = app.config.wake_ms / 1000.0
        if delay > 0.0:
            return Delayed(delay, data, req.keep_alive, before=wake)
        wake()
        return data


def _adapter_card(name: str, base: str) -> dict[str, Any]:
    """A LoRA adapter as vLLM lists it (``ModelCard`` of its OpenAI protocol)."""
    permission = {
        "id": "modelperm-" + name.encode().hex()[:32].ljust(32, "0"),
        "object": "model_permission",
        "created": 0,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "vllm",
        "root": f"/adapters/{name}",
        "parent": base,
        "max_model_len": None,
        "permission": [permission],
    }
