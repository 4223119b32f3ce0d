"""The arithmetic of a capacity plan: sessions per GPU under each constraint, replicas, tokens/s and cost.

Plain numbers in, numbers out: the step time comes in as a function of the batch (curves.py makes
it), memory as bytes already counted (model_shape.py). The model of the service, stated once:

- A *session* is one stream generating a reply (a turn in flight); idle conversations hold no
  KV here (their blocks are the prefix cache's, evictable).
- KV memory: each session holds `context_tokens` of KV, whole blocks of `block_size` tokens.
- TPOT: in steady state each of n streams makes one token a step, and the turns that end are
  replaced by new ones whose prompts are prefilled in the same steps (chunked prefill), so a
  token's time is the decode step plus n x prompt/output prefill tokens at the measured rate.
- TTFT: turns arrive as a Poisson stream at n / turn_seconds per GPU; prefills are served one at a
  time, each taking prompt / prefill rate (deterministic): an M/D/1 queue, whose waiting time's
  distribution is Erlang's exact formula. TTFT = wait + prefill + one decode step.
- Peak sessions: users x turns/day / 86,400 s x peak factor turns a second, each held for
  turn_seconds (Little's law). Replicas are sized for the peak and run all day.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, localcontext

SECONDS_PER_DAY = 86_400
TTFT_PERCENTILE = 0.95


@dataclass(frozen=True)
class Traffic:
    """What users ask of the service."""

    users: int
    turns_per_day: float  # per user
    prompt_tokens: int  # computed per turn (prefill)
    output_tokens: int  # generated per turn
    context_tokens: int  # KV a session holds
    peak_factor: float  # peak turns a second over the day's average
    turn_seconds: float  # how long a turn holds its stream

    @property
    def average_turns_per_s(self) -> float:
        return self.users * self.turns_per_day / SECONDS_PER_DAY

    @property
    def peak_turns_per_s(self) -> float:
        return self.average_turns_per_s * self.peak_factor

    @property
    def peak_sessions(self) -> float:
        """Streams in flight at the peak (Little's law)."""
        return self.peak_turns_per_s * self.turn_seconds

    @property
    def tokens_per_day(self) -> float:
        return self.users * self.turns_per_day * (self.prompt_tokens + self.output_tokens)


@dataclass(frozen=True)
class Device:
    """One GPU (or CPU) as the plan sees it."""

    kv_budget_bytes: float  # what the KV pool may take
    kv_bytes_per_token: int
    block_size: int
    step_seconds: Callable[[int], float]  # a decode step of n streams at the plan's context
    max_batch: int  # the curve's largest measured batch
    prefill_tokens_per_s: float
    max_num_seqs: int  # chatd's scheduler limit
    gpu_hour_usd: float | None


@dataclass(frozen=True)
class Constraint:
    """How many sessions one constraint allows per GPU, within the batches the curve and scheduler cover."""

    name: str
    sessions: int
    capped: bool  # True: it would allow more, but no more could be checked (the curve's or scheduler's end)


@dataclass(frozen=True)
class Capacity:
    """A plan's results."""

    constraints: tuple[Constraint, ...]
    sessions_per_gpu: int
    binding: tuple[str, ...]  # the constraints that set sessions_per_gpu
    replicas: int | None  # None: not one session meets the SLO
    step_seconds: float | None  # at the operating point
    tpot_seconds: float | None
    ttft_p95_seconds: float | None
    output_tokens_per_s: float | None  # per GPU, at the operating point
    tokens_per_s: float | None  # prompt and output, per GPU
    usd_per_m_output_tokens: float | None
    usd_per_m_tokens: float | None
    usd_per_day: float | None  # replicas x 24 h
    usd_per_m_tokens_day: float | None  # the day's cost over the day's tokens


def tpot_seconds(n: int, traffic: Traffic, device: Device) -> float:
    """A token's time with n streams: the decode step plus the prefill of the turns that replace the ones ending."""
    prefill_per_step = n * traffic.prompt_tokens / traffic.output_tokens / device.prefill_tokens_per_s
    return device.step_seconds(n) + prefill_per_step


def prefill_seconds(traffic: Traffic, device: Device) -> float:
    return traffic.prompt_tokens / device.prefill_tokens_per_s


def md1_wait_cdf(t: float, arrivals_per_s: float, service_s: float) -> float:
    """P(wait <= t) in an M/D/1 queue (Erlang): (1 - rho) sum_{j<=t/S} (lam (jS - t))^j / j! e^{-lam (jS - t)}.
    The terms alternate and grow as e^{lam t}; Decimal at enough digits keeps the sum exact."""
    rho = arrivals_per_s * service_s
    if rho >= 1:
        return 0.0
    with localcontext() as ctx:
        ctx.prec = int(arrivals_per_s * t / 2.3) + 30
        lam, when, service = Decimal(repr(arrivals_per_s)), Decimal(repr(t)), Decimal(repr(service_s))
        total, factorial = Decimal(0), Decimal(1)
        for j in range(int(t // service_s) + 1):
            if j:
                factorial *= j
            x = lam * (j * service - when)
            total += (x**j if j else 1) / factorial * (-x).exp()  # Decimal refuses 0**0
        return min(1.0, float((1 - Decimal(repr(rho))) * total))


def md1_wait_quantile(q: float, arrivals_per_s: float, service_s: float) -> float:
    """The q-quantile of the M/D/1 wait (bisection on md1_wait_cdf); inf when the queue is unstable."""
    if arrivals_per_s * service_s >= 1:
        return math.inf
    if md1_wait_cdf(0.0, arrivals_per_s, service_s) >= q:
        return 0.0
    low, high = 0.0, service_s
    while md1_wait_cdf(high, arrivals_per_s, service_s) < q:
        low, high = high, high * 2
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if md1_wait_cdf(mid, arrivals_per_s, service_s) < q else (low, mid)
    return high


def ttft_p95_seconds(n: int, traffic: Traffic, device: Device) -> float:
    """The 95th percentile of TTFT with n sessions: M/D/1 wait + the prompt's prefill + one decode step."""
    prefill = prefill_seconds(traffic, device)
    wait = md1_wait_quantile(TTFT_PERCENTILE, n / traffic.turn_seconds, prefill)
    return wait + prefill + device.step_seconds(n)


def meets_ttft(n: int, target: float, traffic: Traffic, device: Device) -> bool:
    """Whether p95 TTFT with n sessions is within target (one CDF evaluation, not a quantile search)."""
    prefill = prefill_seconds(traffic, device)
    budget = target - prefill - device.step_seconds(n)
    if budget < 0:
        return False
    return md1_wait_cdf(budget, n / traffic.turn_seconds, prefill) >= TTFT_PERCENTILE


def largest(limit: int, ok: Callable[[int], bool]) -> int:
    """The largest n in 1..limit for which ok holds, ok being true up to some n and false after (0: none);
    a bisection, as each M/D/1 evaluation sums up to t / S terms."""
    if limit < 1 or not ok(1):
        return 0
    low, high = 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if ok(mid) else (low, mid - 1)
    return low


def plan(traffic: Traffic, device: Device, ttft_target: float, tpot_target: float) -> Capacity:
    """Sessions per GPU (the least any constraint allows), replicas for the peak, and what that GPU serves."""
    limit = min(device.max_batch, device.max_num_seqs)
    blocks = -(-traffic.context_tokens // device.block_size)
    session_bytes = blocks * device.block_size * device.kv_bytes_per_token
    kv = max(0, int(device.kv_budget_bytes // session_bytes))
    # Measured step times can dip with noise: TPOT allows n only when every smaller batch meets it too.
    tpot = next((n - 1 for n in range(1, limit + 1) if tpot_seconds(n, traffic, device) > tpot_target), limit)
    ttft = largest(limit, lambda n: meets_ttft(n, ttft_target, traffic, device))  # its queue grows with n
    constraints = (
        Constraint("KV memory", min(kv, limit), kv > limit),
        Constraint("TPOT", tpot, tpot == limit),
        Constraint("TTFT", ttft, ttft == limit),
        Constraint("curve's largest measured batch", device.max_batch, False),
        Constraint("scheduler.max_num_seqs", device.max_num_seqs, False),
    )
    sessions = min(c.sessions for c in constraints)
    binding = tuple(c.name for c in constraints if c.sessions == sessions and not c.capped)
    if sessions == 0:
        return Capacity(constraints, 0, binding, None, *(None,) * 9)
    step = device.step_seconds(sessions)
    tpot_at = tpot_seconds(sessions, traffic, device)
    output_tps = sessions / tpot_at
    total_tps = output_tps * (traffic.prompt_tokens + traffic.output_tokens) / traffic.output_tokens
    replicas = max(1, math.ceil(traffic.peak_sessions / sessions))
    price = device.gpu_hour_usd
    per_day = replicas * 24 * price if price is not None else None
    return Capacity(
        constraints=constraints, sessions_per_gpu=sessions, binding=binding, replicas=replicas, step_seconds=step,
        tpot_seconds=tpot_at, ttft_p95_seconds=ttft_p95_seconds(sessions, traffic, device),
        output_tokens_per_s=output_tps, tokens_per_s=total_tps,
        usd_per_m_output_tokens=usd_per_million(price, output_tps), usd_per_m_tokens=usd_per_million(price, total_tps),
        usd_per_day=per_day,
        usd_per_m_tokens_day=per_day / traffic.tokens_per_day * 1e6 if per_day is not None else None,
    )


def usd_per_million(gpu_hour_usd: float | None, tokens_per_s: float) -> float | None:
    """A GPU-hour's price over the million tokens it makes in that hour: usd / (tok/s x 3600) x 1e6."""
    return gpu_hour_usd / (tokens_per_s * 3600) * 1e6 if gpu_hour_usd is not None else None
