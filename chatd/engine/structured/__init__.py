"""Structured output: a request's grammar (JSON schema, regex, choice, Lark grammar) compiled, and its
masks computed ahead.

spec.py is what a request asks for (`StructuredOutput`, checked); grammar.py compiles it with
llguidance (probed, cached, its cost bounded) and hands each sequence a matcher; grammar_threads.py
computes the next token's mask off the engine thread. What the lower layers see of it: core/grammar_matcher.py (a sequence's place in its
grammar, no torch) and worker/grammar_masks.py (the masks applied to the logits). Imports: any of
the engine's layers; nothing below imports it.
"""
