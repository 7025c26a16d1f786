"""The trained agent behind Ray Serve: OpenAI-compatible chat completions that run the tool loop.

    POST /v1/chat/completions   OpenAI format; "stream": true gives server-sent events
    GET  /v1/models             the served checkpoint
    GET  /health                "ok", or "degraded" while fewer replicas run than wanted; replica statistics

Two deployments. ``AgentRouter`` (the HTTP ingress, no CPU of its own) checks the key and the request and calls
the ``AgentServer`` replicas through a deployment handle, sending a request again to another replica when its
replica dies before answering. An ``AgentServer`` replica loads the checkpoint into the same
``InferenceEngine`` the rollout fleet uses (vLLM on a GPU, the torch engine on CPU), wraps it in a
``BatchingEngine`` so concurrent conversations share engine calls, and runs each conversation's agent loop
(sandboxed python, search; never retrieval of training traces) in a thread. Deploying again with another
checkpoint is a Serve rolling update: new replicas start and pass their health check before old ones drain, so
clients see no downtime.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from rapo_ray.agent.loop import AgentLoop, LoopSettings
from rapo_ray.config import Config, from_dict, load_config, to_dict
from rapo_ray.core.devices import pick_device, set_deterministic
from rapo_ray.core.errors import ConfigError
from rapo_ray.engines import make_engine
from rapo_ray.engines.vllm_engine import vllm_available
from rapo_ray.envs.suite import build_tools
from rapo_ray.model.factory import (
    context_length,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_checkpoint,
    set_torch_threads,
)
from rapo_ray.retrieval.search_index import search_index_for
from rapo_ray.serving.batching import BatchingEngine
from rapo_ray.serving.chat import (
    FINISH_REASON,
    BadRequest,
    ChatRequest,
    answer_of,
    chunk,
    completion_response,
    parse_chat_request,
    tool_trace,
    usage,
)
from rapo_ray.types import protocol
from rapo_ray.types.trajectory import GENERATED, Task

api = FastAPI(title="rapo_ray agent", docs_url=None, redoc_url=None)


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# ---------------------------------------------------------------- replica parts
# (defined before the deployment class: Serve pickles the class when it is decorated)


def _make_engine(sc, cfg: Config, model_dir: str, tokenizer):
    """serve.engine_factory if set; else what serve.engine names, where auto is vLLM on a replica given a GPU
    (serve.num_gpus) and the torch engine otherwise (on that GPU if it has one and vLLM does not import)."""
    if sc.engine_factory:
        module, _, fn = sc.engine_factory.partition(":")
        if not fn:
            raise ConfigError(f"serve.engine_factory={sc.engine_factory!r} must be 'module:function'")
        return getattr(importlib.import_module(module), fn)(model_dir, tokenizer, **sc.engine_kwargs)

    device = pick_device(sc.num_gpus, "serve.num_gpus")
    name = sc.engine
    if name == "auto":
        name = "vllm" if device.type == "cuda" and vllm_available() else "torch"
    return make_engine(
        replace(cfg.rollout, engine=name),
        model_dir,
        load_model_and_tokenizer,
        dtype=cfg.model.dtype,
        max_model_len=context_length(model_dir),
        device=device,
    )


def _make_tools(cfg: Config):
    """Python sandbox + search over the corpus (tasks.search_backend: lexical, or a Milvus collection)."""
    index = search_index_for(cfg.tasks, cfg.retrieval.milvus_token)
    return build_tools(cfg.tasks, cfg.rollout, search_index=index, max_concurrency=cfg.serve.tool_concurrency)


# a replica that died (also killed by Ray's memory monitor) or cannot be reached: the router retries the request on
# another one
REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)


@serve.deployment(
    name="AgentServer", health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=60
)
class AgentServer:
    """One replica: the engine, the tools and the conversations. Called only by ``AgentRouter``."""

    def __init__(self, model_dir: str, cfg_dict: dict, model_name: str):
        set_torch_threads(max(1, int(os.environ.get("RAPO_SERVE_THREADS", "1"))))
        self.cfg: Config = from_dict(cfg_dict)
        set_deterministic(self.cfg.run.deterministic)
        sc = self.cfg.serve
        self.model_dir, self.model_name = model_dir, model_name
        self.tok = load_tokenizer(model_dir)
        self.engine = BatchingEngine(
            _make_engine(sc, self.cfg, model_dir, self.tok), sc.max_batch_size, sc.batch_wait_ms
        )
        self.tools = _make_tools(self.cfg)
        self.bundled = protocol.ASSISTANT in self.tok.get_vocab()
        self.system_prompt = protocol.system_prompt_for(self.cfg.tasks.system_prompt, bundled=self.bundled)
        self.max_context = context_length(model_dir)
        self.pool = ThreadPoolExecutor(max_workers=sc.max_ongoing_requests, thread_name_prefix="conversation")
        self.requests = self.failures = 0

    def stats(self) -> dict:
        return {"requests": self.requests, "failures": self.failures, **self.engine.stats()}

    def check_health(self):
        if not self.engine.alive:
            raise RuntimeError("the engine batcher thread died")

    def check(self, req: ChatRequest) -> str | None:
        """What is wrong with ``req`` for this model (a prompt over the limits), or None."""
        try:
            self._task(req)
        except BadRequest as exc:
            return str(exc)
        return None

    async def complete(self, req: ChatRequest) -> dict:
        """``{"response": ...}`` or ``{"error": (status, message)}``: errors come back as values, so the router
        never has to tell a client's mistake from a replica's death by exception type."""
        try:
            task = self._task(req)
        except BadRequest as exc:
            return {"error": (400, str(exc))}
        self.requests += 1
        loop = asyncio.get_running_loop()
        try:
            traj = await loop.run_in_executor(self.pool, self._converse, req, task, None)
        except Exception as exc:  # the replica keeps serving; the client learns what failed
            self.failures += 1
            return {"error": (500, f"agent loop failed: {type(exc).__name__}: {exc}")}
        resp = completion_response(req, self.tok, traj)
        resp["agent"]["checkpoint"] = self.model_dir
        return {"response": resp}

    async def stream(self, req: ChatRequest):
        """SSE: the role, then every segment of the tool loop as ``reasoning_content`` as it happens, then the
        answer as ``content``, the finish reason (with the tool trace), optional usage, and ``[DONE]``."""
        task = self._task(req)  # the router asked ``check`` first
        self.requests += 1
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        segments: list[tuple[str, str]] = []

        def on_append(_traj, kind, ids):  # runs in the conversation thread
            loop.call_soon_threadsafe(events.put_nowait, (kind, ids))

        fut = loop.run_in_executor(self.pool, self._converse, req, task, on_append)
        fut.add_done_callback(lambda _f: events.put_nowait(None))
        yield _sse(chunk(req, {"role": "assistant", "content": ""}))
        while (item := await events.get()) is not None:
            kind, ids = item
            text = self.tok.decode(ids, skip_special_tokens=False)
            segments.append((kind, text))
            yield _sse(chunk(req, {"reasoning_content": text}))
        try:
            traj = fut.result()
        except Exception as exc:
            self.failures += 1
            yield _sse(
                {"error": {"message": f"agent loop failed: {type(exc).__name__}: {exc}", "type": "server_error"}}
            )
            yield "data: [DONE]\n\n"
            return
        generated = "".join(t for k, t in segments if k == GENERATED)
        yield _sse(chunk(req, {"content": answer_of(generated)}))
        yield _sse(
            chunk(
                req,
                {},
                FINISH_REASON.get(traj.finish_reason, "stop"),
                extra={
                    "tool_trace": tool_trace(segments),
                    "agent": {"finish_reason": traj.finish_reason, "tool_calls": traj.tool_calls},
                },
            )
        )
        if req.include_usage:
            yield _sse(
                {
                    "id": req.id,
                    "object": "chat.completion.chunk",
                    "created": req.created,
                    "model": req.model,
                    "choices": [],
                    "usage": usage(traj),
                }
            )
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ the agent loop

    def _task(self, req: ChatRequest):
        task = Task(
            id=req.id, question=req.messages[-1]["content"], answers=(), kind="qa", messages=tuple(req.messages)
        )
        n_prompt = len(self._loop(req).task_prompt_ids(task))
        if n_prompt > self.cfg.serve.max_prompt_tokens:
            raise BadRequest(
                f"the prompt is {n_prompt} tokens; the limit is {self.cfg.serve.max_prompt_tokens} (serve.max_prompt_tokens)"
            )
        if n_prompt + req.max_tokens > self.max_context:
            raise BadRequest(
                f"prompt ({n_prompt} tokens) + max_tokens ({req.max_tokens}) exceeds the model's context of {self.max_context}"
            )
        return task

    def _loop(self, req: ChatRequest, on_append=None):
        sc = self.cfg.serve
        settings = LoopSettings(
            temperature=req.temperature,
            top_p=req.top_p,
            max_response_tokens=req.max_tokens,
            max_step_tokens=min(sc.max_step_tokens, req.max_tokens),
            max_tool_calls=req.max_tool_calls,
            seed=req.seed,
            system_prompt=self.system_prompt,
        )
        return AgentLoop(self.engine, self.tok, self.tools, settings, retriever=None, on_append=on_append)

    def _converse(self, req: ChatRequest, task, on_append):
        (traj,), _ = self._loop(req, on_append).run_groups([task], group_size=1)
        return traj


@serve.deployment(name="AgentRouter", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(api)
class AgentRouter:
    """The HTTP front: auth, request validation, and the replicas behind it. A request whose replica dies before
    it answers is sent again to another one (safe: a conversation has no effect outside its own sandbox), up to
    ``serve.retries`` times; a stream is retried only while nothing of it has been sent."""

    def __init__(self, agent, cfg_dict: dict, model_name: str, model_dir: str):
        self.agent = agent  # DeploymentHandle of AgentServer
        self.cfg: Config = from_dict(cfg_dict)
        self.model_name, self.model_dir = model_name, model_dir
        sc = self.cfg.serve
        self.api_key = sc.api_key or (os.environ.get(sc.api_key_env, "") if sc.api_key_env else "")
        self.retried = 0  # requests sent again after their replica died

    # ------------------------------------------------------------ routes

    @api.get("/health")
    async def health(self):
        """Fast, and honest about capacity: "degraded" (HTTP 200) while fewer replicas run than
        ``serve.min_replicas``, HTTP 503 when none answers."""
        running, wanted = self._replica_counts()
        try:
            stats = await asyncio.wait_for(self._call("stats"), timeout=2.0)
        except Exception:
            stats = None
        status = "ok" if stats is not None and running >= wanted else "degraded"
        body = {
            "status": status if stats is not None else "unavailable",
            "model": self.model_name,
            "checkpoint": self.model_dir,
            "replicas_running": running,
            "replicas_wanted": wanted,
            "retried_requests": self.retried,
            **(stats or {}),
        }
        return JSONResponse(body, status_code=200 if stats is not None else 503)

    @api.get("/v1/models")
    def models(self, request: Request):
        if (denied := self._check_auth(request)) is not None:
            return denied
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "rapo_ray", "root": self.model_dir}],
        }

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        if (denied := self._check_auth(request)) is not None:
            return denied
        limit = 4 * self.cfg.serve.max_request_chars + 65536  # UTF-8 and JSON framing around the character limit
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > limit:  # refused before the body is read
            return _error(400, f"the request body is {size} bytes; the limit is {limit} (serve.max_request_chars)")
        try:
            body = await request.json()
        except Exception:
            return _error(400, "the request body is not valid JSON")
        try:
            req = parse_chat_request(body, self.cfg.serve, self.model_name)
        except BadRequest as exc:
            return _error(400, str(exc))
        try:
            if req.stream:
                problem = await self._call("check", req)
                if problem:
                    return _error(400, problem)
                return StreamingResponse(self._relay(req), media_type="text/event-stream")
            out = await self._call("complete", req)
        except REPLICA_LOST as exc:
            return _error(503, f"no replica could answer: {_first_line(exc)}", kind="server_error")
        if "error" in out:
            status, message = out["error"]
            return _error(status, message, kind="server_error" if status >= 500 else "invalid_request_error")
        return out["response"]

    # ------------------------------------------------------------ calls to the replicas

    async def _call(self, method: str, *args):
        retries = self.cfg.serve.retries
        for attempt in range(retries + 1):
            try:
                return await getattr(self.agent, method).remote(*args)
            except REPLICA_LOST:
                if attempt == retries:
                    raise
                self.retried += 1
                await asyncio.sleep(0.2 * (attempt + 1))  # Serve drops the dead replica from its routing

    async def _relay(self, req: ChatRequest):
        retries = self.cfg.serve.retries
        for attempt in range(retries + 1):
            sent = False
            try:
                async for piece in self.agent.options(stream=True).stream.remote(req):
                    sent = True
                    yield piece
                return
            except REPLICA_LOST as exc:
                if sent or attempt == retries:  # part of the answer is out: it cannot be taken back
                    yield _sse({"error": {"message": f"replica lost: {_first_line(exc)}", "type": "server_error"}})
                    yield "data: [DONE]\n\n"
                    return
                self.retried += 1
                await asyncio.sleep(0.2 * (attempt + 1))

    def _replica_counts(self) -> tuple[int, int]:
        """(AgentServer replicas running, ``serve.min_replicas``), from the Serve controller."""
        try:
            app = serve.status().applications[serve.get_replica_context().app_name]
            states = app.deployments["AgentServer"].replica_states
            return int(states.get("RUNNING", 0)), self.cfg.serve.min_replicas
        except Exception:
            return 0, self.cfg.serve.min_replicas

    def _check_auth(self, request: Request):
        if not self.api_key:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return _error(
                401,
                "missing or wrong API key (send 'Authorization: Bearer <key>')",
                kind="invalid_request_error",
                code="invalid_api_key",
            )
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# ---------------------------------------------------------------- building the application


def build_agent_app(cfg: Config, checkpoint: str | Path):
    """The Serve application for ``checkpoint`` (see ``resolve_checkpoint``) under ``cfg.serve``."""
    model_dir = resolve_checkpoint(checkpoint)
    sc = cfg.serve
    # Default model id: the run's name for a trainer checkpoint (stable across its checkpoints, so clients keep
    # working through a rolling update to a newer one), else the folder's name.
    name = sc.model_name or (model_dir.parent.parent.name if model_dir.name.startswith("step-") else model_dir.name)
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if sc.api_key_env and os.environ.get(sc.api_key_env):  # the replicas read the key where the deployer has it
        env[sc.api_key_env] = os.environ[sc.api_key_env]
    replicas = AgentServer.options(
        autoscaling_config={
            "min_replicas": sc.min_replicas,
            "max_replicas": sc.max_replicas,
            "target_ongoing_requests": sc.target_ongoing_requests,
        },
        max_ongoing_requests=sc.max_ongoing_requests,
        ray_actor_options={"num_cpus": sc.num_cpus, "num_gpus": sc.num_gpus, "runtime_env": {"env_vars": env}},
    ).bind(str(model_dir.resolve()), to_dict(cfg), name)
    router = AgentRouter.options(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}})
    return router.bind(replicas, to_dict(cfg), name, str(model_dir.resolve()))


def app_builder(args: dict):
    """For ``serve run`` / ``serve deploy``: args ``checkpoint`` (required), ``config`` (a YAML file) and any
    dotted overrides (``serve.max_tokens: 256``)."""
    args = dict(args)
    if "checkpoint" not in args:
        raise ConfigError(
            "serve application args: 'checkpoint' is required (an HF folder, a checkpoint, or a run directory)"
        )
    checkpoint = args.pop("checkpoint")
    config = args.pop("config", None)
    cfg = load_config(config, [f"{k}={v}" for k, v in args.items()])
    return build_agent_app(cfg, checkpoint)
