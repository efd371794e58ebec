"""Structured output: a `StructuredOutput` spec compiled into a grammar, matched token by token.

`grammars.Grammars` is the engine's one owner of it all (compile, the compile threads, the time bound,
refusals); `compiler` binds the grammar library (llguidance), `closing` walks the tokens that finish an
output in time, `pool` is the compile threads, `cache` the per-tenant cache of grammars and refusals.
Nothing is imported here: importing `cache` or `pool` must not load the grammar library.
"""
