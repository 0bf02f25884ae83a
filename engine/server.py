"""The gRPC face of the engine: a thin servicer over EngineCore, plus health and reflection."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, TypeVar

import grpc
from grpc_health.v1 import health

from common.eviction import EvictionOrder
from common.grpc_server import build_server
from common.grpc_server import set_serving as set_health
from common.secret_auth import SecretAuth
from common.tracing import QUIET_METHODS, ServerTracingInterceptor
from engine.proto_convert import (commit_policy, guided_spec, lookup_enabled, request_class, sampling_params,
                                  update_messages)
from engine.call_status import Abort, submit
from engine.core import EngineCore
from engine import adapter_calls
from engine.lora.registry import ServedAdapter
from engine.guided import CompiledGuide, GuidedCompiler, GuidedSpec, ModelFormats, ReasoningTokens, infer_formats
from engine.outputs import RequestUpdate
from engine.prompt import RenderedPrompt, check_input_size, render_input
from engine.request import EngineRequest
from engine.responses_store import ResponseStore, StoreError
from engine.session import GenerateSession
from engine.state_listing import StateLister, parse_page, stats_message
from engine.tracing import capture_context
from ignis.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("ignis.engine")
SERVICE_NAME = "ignis.v1.Engine"
T = TypeVar("T")
PROMPT_WORKERS = 2  # threads rendering and tokenizing prompts (off the event loop)
DEFAULT_MAX_OPEN_CALLS = 1024  # while the model loads (every call then ends UNAVAILABLE anyway)
SNAPSHOT_TIMEOUT = 30.0  # seconds ListState waits for the step thread's copy (a step runs at most that long)


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, model_id: str, core: EngineCore | None = None, responses: ResponseStore | None = None
                 ) -> None:
        self._core = core  # None while the model loads: calls answer UNAVAILABLE
        self.model_id = model_id
        self.created = int(time.time())
        self.accepting = True
        self._ids = itertools.count()
        self._prompts = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="ignis-prompt")
        # ListState's ranking and tierstore calls: one worker, so a burst of monitors queues up.
        self._listings = ThreadPoolExecutor(1, thread_name_prefix="ignis-listing")
        self._lister: StateLister | None = None
        self._guided: GuidedCompiler | None = None  # built on the first guided request (it reads the vocabulary)
        self._guided_lock = threading.Lock()
        self._formats: ModelFormats | None = None
        self.responses = responses  # None: this engine stores no responses (PutResponse is FAILED_PRECONDITION)
        self.session_socket = ""  # where GenerateSession is also served (engine/session_socket.py), if anywhere
        # LMDB calls block (a write fsyncs): one worker, off the event loop, in arrival order.
        self._records = ThreadPoolExecutor(1, thread_name_prefix="ignis-responses")

    def attach(self, core: EngineCore) -> None:
        self._core = core

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        if not self.accepting:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        return self._core

    @property
    def max_open_calls(self) -> int:
        """Calls one GenerateSession stream may hold open: the engine's queue size (a stream's calls past it
        could never all be queued; before it, each holds a task and a prompt render)."""
        return self._core.config.max_queue if self._core is not None else DEFAULT_MAX_OPEN_CALLS

    def _check_model(self, model: str) -> ServedAdapter | None:
        """The LoRA adapter `model` names (None: the base model); NOT_FOUND when this engine serves no such model."""
        return adapter_calls.named_adapter(self.core, self.model_id, model)

    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[RequestUpdate] = asyncio.Queue()

        def sink(update: RequestUpdate) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(updates.put_nowait, update)

        try:
            core = self.core
            engine_request = await self.engine_request(request)
            submit(core, engine_request, sink)
        except Abort as exc:
            await context.abort(exc.code, exc.message)
            return
        except Exception:  # a bug: INTERNAL with a message, not an UNKNOWN from grpc
            log.exception("admitting request %s failed", request.request_id or "(no id)")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error while admitting the request "
                                "(see the engine log)")
            return
        done = False
        first = True
        try:
            while not done:
                update = await updates.get()
                if update.error is not None:
                    done = True
                    await context.abort(grpc.StatusCode.INTERNAL, update.error)
                    return
                prompt_ids = engine_request.prompt_ids if first and engine_request.echo else None
                for msg in update_messages(core.tokenizer, update, prompt_ids):
                    first = False
                    yield msg
                done = update.done
        finally:
            if not done:  # the client went away or passed its deadline: free the work now
                core.abort(engine_request.request_id)

    async def GenerateSession(self, request_iterator: AsyncIterator[engine_pb2.SessionRequest],
                              context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.SessionResponse]:
        """Many Generate calls on one stream (engine/session.py)."""
        async for response in GenerateSession(self).serve(request_iterator):
            yield response

    async def _render(self, core: EngineCore, request: engine_pb2.GenerateRequest | engine_pb2.TokenizeRequest
                      ) -> RenderedPrompt:
        """Template rendering and tokenizing run on a worker thread: a huge prompt must not
        stall every stream and the health service on the event loop."""
        check_input_size(request, core.max_model_len)
        return await asyncio.get_running_loop().run_in_executor(self._prompts, render_input, core.tokenizer, request,
                                                                core.max_model_len, core.vision)

    async def engine_request(self, request: engine_pb2.GenerateRequest) -> EngineRequest:
        """The request as the core takes it: prompt rendered, sampling checked, guide compiled (else `Abort`)."""
        core = self.core
        adapter = self._check_model(request.model)
        try:
            prompt = await self._render(core, request)
            params = sampling_params(request.sampling, core.sampling_defaults, core.max_model_len - len(prompt.token_ids))
            spec = guided_spec(request.guided, self.formats(core).tool_call) if request.HasField("guided") else None
            reasoning = self.formats(core).reasoning_tokens(core.tokenizer) if request.guided.after_reasoning else None
            guided = await self._compile_guide(core, spec, params.stop_token_ids, reasoning) if spec is not None else None
            engine_request = EngineRequest(
                request_id=request.request_id or f"req-{next(self._ids)}",
                prompt_ids=prompt.token_ids,
                params=params,
                request_class=request_class(request.request_class),
                cache_salt=request.cache_salt,
                echo=request.echo,
                lookup=lookup_enabled(request.reuse.lookup),
                commit=commit_policy(request.reuse.commit),
                head_tokens=prompt.head_tokens,
                speculative=not request.HasField("speculative") or request.speculative,
                trace_context=capture_context(),  # this RPC's SERVER span: the parent of the engine's spans
                guided=guided,
                adapter=adapter,
                media=prompt.media,
            )
            if engine_request.echo and prompt.media is not None:
                raise ValueError("echo is not supported for a prompt with images")
        except ValueError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except (Abort, asyncio.CancelledError):
            raise
        except Exception:  # a bug in rendering, checking or compiling: this call ends with a status, nothing leaks
            log.exception("preparing request %s failed", request.request_id or "(no id)")
            raise Abort(grpc.StatusCode.INTERNAL, "internal error while preparing the request (see the engine log)"
                        ) from None
        return engine_request

    def formats(self, core: EngineCore) -> ModelFormats:
        """The tool-call and reasoning syntax of the checkpoint's chat template (read once)."""
        if self._formats is None:
            self._formats = infer_formats(core.tokenizer)
        return self._formats

    async def _compile_guide(self, core: EngineCore, spec: GuidedSpec, stop_ids: tuple[int, ...],
                             reasoning: ReasoningTokens | None) -> CompiledGuide:
        """Compiled on a prompt worker before the request is queued: it waits here, not in the step."""
        def compile_() -> CompiledGuide:
            with self._guided_lock:
                if self._guided is None:
                    self._guided = GuidedCompiler(core.tokenizer, core.loaded.config.vocab_size, core.eos_ids)
            return self._guided.compile(spec, stop_ids, reasoning)
        return await asyncio.get_running_loop().run_in_executor(self._prompts, compile_)

    async def Tokenize(self, request: engine_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> engine_pb2.TokenizeResponse:
        try:
            core = self.core
            self._check_model(request.model)
            prompt = await self._render(core, request)
        except Abort as exc:
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
        return engine_pb2.TokenizeResponse(
            token_ids=prompt.token_ids,
            prompt=prompt.text or "",
            count=len(prompt.token_ids),
            max_model_len=core.max_model_len,
        )

    async def ListModels(self, request: engine_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> engine_pb2.ListModelsResponse:
        try:
            core = self.core
        except Abort as exc:
            await context.abort(exc.code, exc.message)
            raise
        adapters = [] if core.adapters is None else core.adapters.served()
        cards = [self._card(core), *(self._card(core, adapter) for adapter in adapters)]
        return engine_pb2.ListModelsResponse(models=cards,
                                             engine_id=self.responses.engine_id if self.responses is not None else "",
                                             session_socket=self.session_socket)

    def _card(self, core: EngineCore, adapter: ServedAdapter | None = None) -> engine_pb2.ModelCard:
        """The base model's card, or a LoRA adapter's (its base as `parent`)."""
        card = engine_pb2.ModelCard(
            id=self.model_id, max_model_len=core.max_model_len, owned_by="ignis", created=self.created,
            architecture=core.loaded.config.architecture, page_size=core.config.page_size,
            dtype=str(core.loaded.model.dtype).removeprefix("torch."),
            tool_call_parser=self.formats(core).tool_call, reasoning_parser=self.formats(core).reasoning,
        )
        if adapter is not None:
            card.id, card.created, card.parent, card.root = adapter.name, adapter.created, self.model_id, adapter.path
        return card

    async def LoadAdapter(self, request: engine_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
                          ) -> engine_pb2.LoadAdapterResponse:
        try:
            core = self.core
            served = await adapter_calls.load(core, self.model_id, request.name, request.path, self._prompts)
        except Abort as exc:
            await context.abort(exc.code, exc.message)
            raise
        log.info("serving LoRA adapter %s (rank %d, slot %d) from %s", served.name, served.rank, served.slot,
                 served.path)
        return engine_pb2.LoadAdapterResponse(card=self._card(core, served))

    async def UnloadAdapter(self, request: engine_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
                            ) -> engine_pb2.UnloadAdapterResponse:
        try:
            served = await adapter_calls.unload(self.core, request.name)
        except Abort as exc:
            await context.abort(exc.code, exc.message)
            raise
        log.info("no longer serving LoRA adapter %s", served.name)
        return engine_pb2.UnloadAdapterResponse()

    async def GetStats(self, request: engine_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
                       ) -> engine_pb2.GetStatsResponse:
        try:
            s = self.core.stats()
        except Abort as exc:
            await context.abort(exc.code, exc.message)
            raise
        return stats_message(s)

    async def ListState(self, request: engine_pb2.ListStateRequest, context: grpc.aio.ServicerContext
                        ) -> engine_pb2.ListStateResponse:
        try:
            core = self.core
            offset, rows = parse_page(request.page_size, request.page_token)
        except Abort as exc:
            await context.abort(exc.code, exc.message)
            raise
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
        try:
            snap = await asyncio.wait_for(asyncio.wrap_future(core.request_snapshot()), SNAPSHOT_TIMEOUT)
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine step did not hand over its state "
                                f"within {SNAPSHOT_TIMEOUT:.0f} s")
            raise
        if self._lister is None:
            self._lister = StateLister(self.model_id, EvictionOrder(core.config.retained_interactive_ttl), core.tiers)
        return await asyncio.get_running_loop().run_in_executor(self._listings, self._lister.listing, snap,
                                                                offset, rows)

    async def _store_call(self, context: grpc.aio.ServicerContext, fn: Callable[[ResponseStore], T]) -> T:
        store = self.responses
        if store is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine stores no responses "
                                "(responses.path is empty)")
            raise AssertionError("unreachable: abort raises")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._records, fn, store)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise

    async def PutResponse(self, request: engine_pb2.PutResponseRequest, context: grpc.aio.ServicerContext
                          ) -> engine_pb2.PutResponseResponse:
        await self._store_call(context, lambda s: s.put(request.id, request.scope, request.record))
        return engine_pb2.PutResponseResponse()

    async def GetResponse(self, request: engine_pb2.GetResponseRequest, context: grpc.aio.ServicerContext
                          ) -> engine_pb2.GetResponseResponse:
        found = await self._store_call(context, lambda s: s.get(request.id, request.scope))
        if found is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no stored response {request.id!r}")
            raise AssertionError("unreachable: abort raises")
        return engine_pb2.GetResponseResponse(record=found.record)

    async def DeleteResponse(self, request: engine_pb2.DeleteResponseRequest, context: grpc.aio.ServicerContext
                             ) -> engine_pb2.DeleteResponseResponse:
        deleted = await self._store_call(context, lambda s: s.delete(request.id, request.scope))
        if not deleted:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no stored response {request.id!r}")
        return engine_pb2.DeleteResponseResponse(deleted=True)


def create_server(service: EngineService, address: str | list[str], tracing: bool = False,
                  secret: bytes | None = None) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Build (not start) the server on `address` (``unix:/path``, ``host:port``, port 0 picks a free one, or a
    list of them); returns (server, port, health), port being the TCP port (0: none).

    Calls over a Unix socket are let in (the socket's mode decides who connects); calls over TCP need
    `authorization: Bearer <secret>`, all refused without a `secret` (common/secret_auth.py); health is open.

    With `tracing`, each RPC is a SERVER span continuing the caller's trace; gateways poll
    ListModels and monitors GetStats, so those are traced only inside a caller's trace.
    """
    quiet = (*QUIET_METHODS, f"/{SERVICE_NAME}/ListModels", f"/{SERVICE_NAME}/GetStats",
             f"/{SERVICE_NAME}/ListState",
             f"/{SERVICE_NAME}/GenerateSession")  # a long-lived stream: each call on it has its own span
    interceptors: list[grpc.aio.ServerInterceptor] = [SecretAuth(secret, "engine")]
    if tracing:
        interceptors.append(ServerTracingInterceptor(quiet))
    return build_server(lambda server: engine_pb2_grpc.add_EngineServicer_to_server(service, server),
                        engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name, address, "engine", interceptors)


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    await set_health(health_servicer, SERVICE_NAME, serving)
