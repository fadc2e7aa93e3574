"""The scheduler side: requests and their lifecycle, batching, KV page bookkeeping, the overlap loop and the single
commit step. It speaks to the executor and the grammar service only through the shared values (``engine.step``,
``engine.grammar_calls``, ``engine.model_info``) and never loads the model or xgrammar itself."""
