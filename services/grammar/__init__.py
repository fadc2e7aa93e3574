"""The grammar service: a :class:`engine.grammar.GrammarRegistry` served over ``ordinal.grammar.v1.Grammar``.

``python -m services.grammar`` starts one; :mod:`services.grammar.convert` maps the protocol's messages to the
engine's grammar values for both sides; :mod:`services.grammar_client` is the client.
"""
