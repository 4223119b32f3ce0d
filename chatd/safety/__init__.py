"""chatd's content-safety pipeline. It knows nothing of HTTP or the store: chatd/http/server/safety.py
applies it to requests and replies, and the store keeps its decisions.

    rules.py      the rules stage: per-category word lists and patterns (default_rules.toml),
                  and detectors of personal data (emails, phone numbers, card numbers by Luhn)
    normalize.py  text as the rules read it: look-alike letters, invisible characters and accents
                  undone (NFKC, UTS #39 confusables), each character traced back to where it was
    guard.py      a guard model (Llama Guard 1/2/3) on chatd's own engine: prompt and verdicts
    policy.py     what the operator's [policies] make of findings: block, flag, redact, per tier
    stream.py     the output check: a streamed reply held back just enough to never send a match
    pipeline.py   the three put together: check_input, output_window, moderate
"""
