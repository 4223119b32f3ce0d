"""The output check: a reply's text checked as it streams, held back just enough to be safe.

A reply arrives in deltas of a few characters. A match can span deltas ("kill your" + "self"),
so each choice's text goes through an `OutputWindow` that releases all but its last
`RuleSet.MAX_MATCH_CHARS` characters: no rule matches more than that, so every match is seen
whole, and judged, before any of it is sent. The characters are counted as the rules read them
(normalize.py): a reply that pads a word with invisible characters is held back further, so that
padding cannot push the word's start out of the window. A match that ends where the text so far
ends may still grow ("kill" + "ing"), so it is judged only once a character follows it or the
reply ends.

What the policies say then: a `block` match ends the reply at the match (what came before it is
sent, nothing after), a `redact` match is sent masked, a `flag` is recorded and sent as is.
Each finding is reported once, however often the overlapping scans see it.
"""

from __future__ import annotations

from collections.abc import Mapping

from chatd.config import CategoryPolicy
from chatd.safety.normalize import start_of_last
from chatd.safety.policy import REDACTIONS, Finding, findings_from_matches
from chatd.safety.rules import RuleSet


class OutputWindow:
    """One choice's reply as it streams: what may be sent now, and what the rules found in it."""

    def __init__(self, rules: RuleSet, policies: Mapping[str, CategoryPolicy], hold: int | None = None) -> None:
        self.rules = rules
        self.policies = dict(policies)
        self.hold = rules.MAX_MATCH_CHARS if hold is None else hold  # in characters of normal form
        self.text = ""  # the whole reply so far, as the model wrote it
        self.released = 0  # characters of `text` sent (as themselves, or masked)
        self.violation: Finding | None = None  # the block that ended it
        self.findings: list[Finding] = []  # every finding, each once, in the order seen
        self._seen: set[tuple[str, int, int]] = set()
        self._redactions: list[Finding] = []  # judged, not yet released

    @property
    def stopped(self) -> bool:
        return self.violation is not None

    def feed(self, delta: str, final: bool = False) -> str:
        """Take the next delta (`final`: the reply ends with it); return the text that may be sent
        now. After a block, the text before the match, then nothing ever again."""
        if self.stopped:
            return ""
        self.text += delta
        self._judge(final)
        if self.violation is not None:
            return self._release(max(self.violation.start, self.released))
        return self._release(len(self.text) if final else start_of_last(self.text, self.hold))

    def masks(self, start: int, end: int) -> bool:
        """Whether text[start:end] overlaps a match that was sent masked."""
        return any(f.action == "redact" and f.start < end and start < f.end for f in self.findings)

    def refused(self, upto: int, candidates: list[str]) -> set[int]:
        """Which candidates, each written after text[:upto] (text already sent), would complete a
        match this window blocks or masks: how the tokens the model did not write (a logprobs
        position's alternatives) are judged before they are shown. One scan for them all, each after
        its own copy of the text a match could reach back into, copies kept apart by more blank lines
        than any match can span."""
        context = self.text[start_of_last(self.text, self.hold, upto):upto]
        separator = "\n" * (self.hold + 1)
        spans, text = [], ""
        for candidate in candidates:
            start = len(text) + len(context)
            text += context + candidate
            spans.append((start, len(text)))
            text += separator
        found = [f for f in findings_from_matches(self.rules.scan(text, self.policies), self.policies)
                 if f.action in ("block", "redact")]
        return {i for i, (start, end) in enumerate(spans) if any(start < f.end <= end for f in found)}

    def _judge(self, final: bool) -> None:
        # Rescan from a little before what was sent (a match may begin there), starting at a word's
        # start so that a word cut in two cannot match as a shorter word.
        start = start_of_last(self.text, self.hold, self.released)
        while start > 0 and not self.text[start - 1].isspace():
            start -= 1
        segment = self.text[start:]
        for finding in findings_from_matches(self.rules.scan(segment, self.policies), self.policies):
            finding = Finding(finding.category, finding.action, finding.stage, finding.start + start,
                              finding.end + start, finding.rule)
            if not final and finding.end >= len(self.text):
                continue  # it may still grow: judged when more text comes
            key = (finding.category, finding.start, finding.end)
            if key in self._seen:
                continue
            self._seen.add(key)
            self.findings.append(finding)
            if finding.action == "block" and (self.violation is None or finding.start < self.violation.start):
                self.violation = finding
            elif finding.action == "redact":
                self._redactions.append(finding)

    def _release(self, upto: int) -> str:
        """Send text up to `upto` (not into a match judged for masking: through its end, masked)."""
        for r in self._redactions:
            if r.start < upto < r.end:
                upto = r.end
        if upto <= self.released:
            return ""
        pieces, at = [], self.released
        for r in sorted(self._redactions, key=lambda f: f.start):
            if r.end <= at or r.start >= upto:
                continue
            pieces.append(self.text[at:max(r.start, at)])
            if r.start >= at:
                pieces.append(REDACTIONS.get(r.category, "[redacted]"))
            at = r.end
        pieces.append(self.text[at:upto])
        self._redactions = [r for r in self._redactions if r.end > upto]
        self.released = upto
        return "".join(pieces)
