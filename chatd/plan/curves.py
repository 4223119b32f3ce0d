"""Step-time curves: decode step time by batch size and context, and the prefill rate, as measured.

A curve is what a plan reads the device's speed from. It comes from measured.py (figures
transcribed from benchmarks/README.md), from a `--curve` JSON file, or from `--measure`
(measure.py, which writes the same JSON). Between measured batch sizes a step's time is
interpolated linearly in the batch; past the largest measured batch nothing is read (the plan
caps there). Contexts: with two or more measured, linear in the context between (or beyond) the
nearest two; with one, the extra (or missing) KV each sequence reads is added at the copy
bandwidth measured with the curve, where it was, else the step is taken as measured. This module
knows nothing of traffic or SLOs.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

from chatd.plan.measured import MEASURED_CURVES

# A curve's model dimensions, compared with the planned model's (ModelShape.dims()).
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class DecodePoint:
    """One measured decode step: `batch` sequences of `context` tokens each took `step_seconds`."""

    batch: int
    context: int
    step_seconds: float


@dataclass(frozen=True)
class StepCurve:
    """Measured decode step times and prefill rate of one model on one device, and where they came from."""

    name: str
    device: str
    source: str
    date: str
    command: str
    model: dict  # a name and the SHAPE_KEYS dimensions
    dtype: str
    quantization: str
    kv_cache_dtype: str
    decode: tuple[DecodePoint, ...]
    prefill_tokens: int  # the prompt whose time to first token was measured
    prefill_seconds: float
    gpu: str = ""  # the --gpu kind it describes ("" for a device measured here that is none of them)
    copy_bytes_per_s: float = 0.0  # measured with it; 0: unknown
    notes: tuple[str, ...] = field(default=())

    @property
    def prefill_tokens_per_s(self) -> float:
        """The prompt's tokens over its time to first token (one step, the first token sampled included)."""
        return self.prefill_tokens / self.prefill_seconds

    @property
    def contexts(self) -> list[int]:
        return sorted({p.context for p in self.decode})

    @property
    def max_batch(self) -> int:
        """The largest batch measured at every context: no step time is read past it."""
        return min(max(p.batch for p in self.decode if p.context == c) for c in self.contexts)

    def step_seconds(self, batch: int, context: int, kv_bytes_per_token: int) -> float:
        """A decode step of `batch` sequences holding `context` tokens each (see the module docstring)."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} is outside the curve's measured 1-{self.max_batch}")
        contexts = self.contexts
        if len(contexts) == 1:
            step = self._at_context(batch, contexts[0])
            if self.copy_bytes_per_s:
                step += batch * (context - contexts[0]) * kv_bytes_per_token / self.copy_bytes_per_s
            return step
        i = min(max(bisect.bisect_left(contexts, context), 1), len(contexts) - 1)
        low, high = contexts[i - 1], contexts[i]
        at_low, at_high = self._at_context(batch, low), self._at_context(batch, high)
        return at_low + (at_high - at_low) * (context - low) / (high - low)

    def context_method(self, context: int) -> str:
        """How step_seconds reaches `context` from the measured contexts, in words."""
        contexts = self.contexts
        if len(contexts) > 1:
            where = "between" if contexts[0] <= context <= contexts[-1] else "extrapolated from"
            return f"linear in context, {where} the measured contexts {', '.join(map(str, contexts))}"
        if context == contexts[0]:
            return f"measured at this context ({contexts[0]} tokens)"
        if self.copy_bytes_per_s:
            return (f"measured at {contexts[0]}-token contexts; each sequence's {context - contexts[0]:+d} tokens of KV "
                    f"read at the copy bandwidth measured with it ({self.copy_bytes_per_s / 1e9:,.0f} GB/s), a floor")
        return f"measured at {contexts[0]}-token contexts and used as is for {context} (no bandwidth to correct with)"

    def _at_context(self, batch: int, context: int) -> float:
        """Linear in the batch between the measured batches at this context (flat below the smallest)."""
        points = sorted((p.batch, p.step_seconds) for p in self.decode if p.context == context)
        batches = [b for b, _ in points]
        i = bisect.bisect_left(batches, batch)
        if i < len(points) and batches[i] == batch:
            return points[i][1]
        if i == 0:
            return points[0][1]
        (b0, s0), (b1, s1) = points[i - 1], points[i]
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)

    def shape_differences(self, dims: dict) -> list[str]:
        """The dimensions where the curve's model and `dims` differ ("hidden_size 4096 vs 576")."""
        return [f"{key} {self.model.get(key)} vs {dims[key]}" for key in SHAPE_KEYS if self.model.get(key) != dims[key]]

    def to_dict(self) -> dict:
        """The JSON form `--curve` reads and `--measure --save-curve` writes (times in ms)."""
        return dict(
            name=self.name, gpu=self.gpu, device=self.device, source=self.source, date=self.date, command=self.command,
            model=dict(self.model), dtype=self.dtype, quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
            decode=[dict(batch=p.batch, context=p.context, step_ms=round(p.step_seconds * 1e3, 4)) for p in self.decode],
            prefill=dict(prompt_tokens=self.prefill_tokens, ttft_ms=round(self.prefill_seconds * 1e3, 4)),
            copy_bytes_per_s=self.copy_bytes_per_s, notes=list(self.notes),
        )


def curve_from_dict(data: dict, where: str) -> StepCurve:
    """A StepCurve from its JSON form; a ValueError naming `where` and the field that is wrong."""
    decode = []
    for i, point in enumerate(_field(data, "decode", list, where)):
        path = f"decode[{i}]."
        decode.append(DecodePoint(int(_number(point, "batch", where, path, whole=True)),
                                  int(_number(point, "context", where, path, whole=True)),
                                  _number(point, "step_ms", where, path) / 1e3))
    if not decode:
        raise ValueError(f"{where}: field decode holds no points")
    if len({(p.batch, p.context) for p in decode}) != len(decode):
        raise ValueError(f"{where}: field decode measures a (batch, context) twice")
    curve_model = _field(data, "model", dict, where)
    missing = [key for key in SHAPE_KEYS if not isinstance(curve_model.get(key), int)]
    if missing:
        raise ValueError(f"{where}: field model lacks {', '.join(missing)}")
    prefill = _field(data, "prefill", dict, where)
    dtype = _field(data, "dtype", str, where)
    curve = StepCurve(
        name=str(data.get("name", where)), gpu=str(data.get("gpu", "")), device=_field(data, "device", str, where),
        source=str(data.get("source", where)), date=str(data.get("date", "")), command=str(data.get("command", "")),
        model=dict(curve_model), dtype=dtype, quantization=str(data.get("quantization", "none")),
        kv_cache_dtype=str(data.get("kv_cache_dtype", dtype)), decode=tuple(decode),
        prefill_tokens=int(_number(prefill, "prompt_tokens", where, "prefill.", whole=True)),
        prefill_seconds=_number(prefill, "ttft_ms", where, "prefill.") / 1e3,
        copy_bytes_per_s=float(data.get("copy_bytes_per_s") or 0.0), notes=tuple(data.get("notes", ())),
    )
    if any(min(p.batch for p in decode if p.context == c) != 1 for c in curve.contexts):
        raise ValueError(f"{where}: field decode must measure batch 1 at each context")
    return curve


def _field(mapping, key: str, kind: type, where: str, path: str = ""):
    value = mapping.get(key) if isinstance(mapping, dict) else None
    if not isinstance(value, kind):
        raise ValueError(f"{where}: field {path}{key} is missing or not a {kind.__name__}")
    return value


def _number(mapping, key: str, where: str, path: str, whole: bool = False) -> float:
    value = mapping.get(key) if isinstance(mapping, dict) else None
    kinds = int if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise ValueError(f"{where}: field {path}{key} must be a positive {'whole ' if whole else ''}number, got {value!r}")
    return value


def read_curve(path: str) -> StepCurve:
    """A `--curve` file (what `chatd plan --measure --save-curve` writes)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--curve {path!r} cannot be read: {exc}") from None
    return curve_from_dict(data, f"--curve {path!r}")


def measured_curve(gpu: str, quantization: str) -> StepCurve | None:
    """The curve benchmarks/README.md has for this GPU kind and weight format, or None."""
    for data in MEASURED_CURVES:
        if data["gpu"] == gpu and data["quantization"] == quantization:
            return curve_from_dict(data, data["name"])
    return None


def measured_kinds() -> dict[str, list[str]]:
    """Which weight formats have measured curves, by GPU kind."""
    kinds: dict[str, list[str]] = {}
    for data in MEASURED_CURVES:
        kinds.setdefault(data["gpu"], []).append(data["quantization"])
    return kinds
