"""The executor service: serves a :class:`engine.executor.runner.ModelRunner` over ``ordinal.executor.v1.Executor``.

``python -m services.executor`` starts one; :mod:`services.executor.convert` maps the protocol's protos to
the engine's step values for both sides.
"""
