"""The engine's plain-Python core, no torch: what runs in a step before and after the model.

Read in this order: sequence.py (one choice: tokens, counters, block table), block_manager.py (the
paged KV pool and the prefix cache), scheduler.py (the step's batch under a token budget,
preemption, `postprocess`), with fairness.py (who goes first: class, fair share, arrival). Beside
them: drafts.py (speculative decoding's guesses: which a decode verifies, how many it keeps),
host_tier.py (the host KV tier's slots and copies), grammar_matcher.py (a sequence's place in
its structured output's grammar), engine_stats.py (the counters metrics read), stage_times.py
(where a step's host time goes), ragged.py (ragged lists to numpy). Imports: params and each other;
never torch, nor anything above (tests/test_layout.py).
"""
