"""Grammars: an engine's one owner of structured output, from a spec to the grammar its sequences follow.

It holds the compiler for the model's tokenizer (made on first use, cheaply: the tokenizer is converted on
its first compile), the compile threads (made on the first bounded compile), the time bound on a compile
and its wait, the refusals and their count. Thread-safe: `compile` blocks the calling thread (LLMEngine's
own `add_request`); `compile_bounded` is the async path, which never compiles on the engine loop thread.
The grammar library itself is imported on the first compile, never by importing this module.
"""

import asyncio
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from deployments.engine.config import EngineConfig
from deployments.engine.errors import EngineOverloaded
from deployments.engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from deployments.engine.grammar.compiler import CompiledGrammar, GrammarCompiler
    from deployments.engine.grammar.pool import GrammarPool

COMPILE_THREADS = 2


class Grammars:
    def __init__(
        self,
        tokenizer: "PreTrainedTokenizerBase",
        vocab_size: int,
        stop_token_ids: Iterable[int],
        config: EngineConfig,
    ) -> None:
        """`config`: its grammar_compile_timeout_s, grammar_refusal_ttl_s and grammar_compile_queue bound
        `compile_bounded` (read at each call)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._config = config
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()  # callers on several threads must all get the one cache
        self._pool: GrammarPool[CompiledGrammar] | None = None  # made on the first bounded compile

    @property
    def compiler(self) -> "GrammarCompiler":
        """Compiles grammars for this model's tokenizer, and caches grammars and refusals per tenant."""
        with self._compiler_lock:
            if self._compiler is None:
                from deployments.engine.grammar.compiler import GrammarCompiler

                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._stop_token_ids)
            return self._compiler

    def compile(self, spec: StructuredOutput, tenant: str | None = None) -> "CompiledGrammar":
        """The grammar of `spec`, compiled on this thread (blocking) unless cached; raises GrammarRefused."""
        return self.compiler.compile(spec, tenant)

    async def compile_bounded(self, spec: StructuredOutput, tenant: str | None) -> "CompiledGrammar":
        """The grammar of `spec`, compiled on a grammar thread, never the caller's: a request waits only
        for its own grammar, and the batch goes on meanwhile. The tenant (`EngineRequest.tenant`, an opaque id
        the ingress sets) owns a share of the grammar cache and takes turns on the threads.

        The whole wait, queue included, is bounded by grammar_compile_timeout_s. Past it, a compile that no
        thread took is dropped and refused as overload (503); one that was running is refused (400), and so
        is its schema for this tenant for grammar_refusal_ttl_s (it still runs to its end: compiles cannot
        be stopped, but their work is metered by the library's limits). A long queue refuses at once."""
        from deployments.engine.grammar.compiler import GrammarRefused
        from deployments.engine.grammar.pool import GrammarPool

        config = self._config
        compiler = self.compiler
        try:
            found = compiler.lookup(spec, tenant)
            if found is not None:
                return found
            if self._pool is None:
                self._pool = GrammarPool(
                    threads=COMPILE_THREADS,
                    max_queued=config.grammar_compile_queue,
                    tenant_share=max(1, config.grammar_compile_queue // 4),
                )
            pool = self._pool
            job = pool.submit(tenant, compiler.key(spec), lambda: self.compile(spec, tenant))
            waiting = asyncio.wrap_future(job.future)  # never cancelled: other requests may share the job
            bound = config.grammar_compile_timeout_s
            try:
                await asyncio.wait([waiting], timeout=bound)
            except asyncio.CancelledError:
                pool.leave(job)  # the caller left: drop the compile if nobody else waits and it has not begun
                raise
            if waiting.done():
                return waiting.result()
            if pool.leave(job):
                raise EngineOverloaded(f"no grammar thread took the compile within {bound:g} s")
            message = f"the schema did not compile within {bound:g} s; simplify it"
            compiler.refuse(spec, tenant, message, ttl_s=config.grammar_refusal_ttl_s)
            raise GrammarRefused(message, param=spec.param, reason="timeout")
        except GrammarRefused as refused:  # a shared job's error names the first waiter's field: name ours
            compiler.count_refusal(refused.reason)
            raise GrammarRefused(str(refused), param=spec.param, reason=refused.reason) from None
        except EngineOverloaded:
            compiler.count_refusal("busy")
            raise

    def refusals(self) -> dict[str, int]:
        """Requests refused since start, by reason ("schema", "timeout", "busy"); empty before any compile."""
        with self._compiler_lock:
            compiler = self._compiler
        return compiler.refusals() if compiler is not None else {}

    def shutdown(self) -> None:
        """Stop the compile threads, if they were started (queued compiles are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown()
