"""StructuredOutput: the grammar a request's output must follow, as the request gave it, checked.

Plain data, no torch and no llguidance: chatd/http builds it from a request's response_format,
structured_outputs or tools; grammar.py compiles it. It rides on SamplingParams.structured.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatd.engine.params import ParamError

MAX_CHOICES = 256  # the most strings a `choice` constraint may list


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain a request's output to a grammar: exactly one of the kinds below.

    The engine compiles it (structured/grammar.py) and masks every token the grammar does not
    allow, so the output always matches: a JSON schema, any JSON object, a regular expression,
    one of a list of strings, or a Lark grammar (llguidance's dialect, with `%json` for embedded
    schemas). `param` is the request field it came from, named in errors.
    """

    json_schema: str | None = None  # the schema as JSON text (property order is the output's order)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on (the cache key)."""
        return (self.json_schema, self.json_object, self.regex, self.choice, self.grammar)

    def validate(self) -> None:
        kinds = [self.json_schema is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        _check(sum(kinds) == 1, self.param, "must name exactly one of json_schema, json_object, regex, choice, grammar")
        for name in ("json_schema", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, str) and value != "", self.param, f"{name} must be a non-empty string")
        if self.choice is not None:
            _check(0 < len(self.choice) <= MAX_CHOICES, self.param,
                   f"choice must list 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            _check(all(isinstance(c, str) and c for c in self.choice), self.param, "choice must list non-empty strings")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, f"{param} {message}")
