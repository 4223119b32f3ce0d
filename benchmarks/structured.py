"""Structured output: why chatd masks tokens with llguidance, and what a mask costs an engine step.

Two measurements, one run, one tokenizer (the model's: SmolLM2-135M-Instruct's 49152 tokens by
default, the demo model's 1000 with `--model demo`):

1. Library choice. For five realistic JSON schemas (a tool's arguments, a nested person record
   with a `pattern` and `maxLength`, an anyOf, an enum-heavy form, any JSON object), each grammar
   library is timed on the same work:
     tokenizer setup  build the library's view of the vocabulary (once per model)
     compile          a cold compile of the schema: llguidance
                      `LLMatcher(tok, grammar_from_json_schema(schema, defaults=JSON_OPTIONS))`;
                      xgrammar `GrammarCompiler(info, cache_enabled=False).compile_json_schema(
                      schema, any_whitespace=False, separators=(", ", ": "))`, the same layout
     first mask       the first token mask after compiling (llguidance builds its parser lazily,
                      so some of its compile work lands here)
     mask             the median time of one token mask (the first excluded) over a walk of up
                      to `--walk-steps` steps: compute the mask, then consume a random allowed
                      token (seeded; when only end-of-sequence is allowed, the walk ends)
   Each number is the median of `--repeats` runs. xgrammar is optional: without it, only
   llguidance is measured (chatd does not depend on xgrammar).
2. Mask cost per engine step. The engine on the model decodes a batch of B sequences (greedy;
   free rows ignore EOS) in which 0, 1 and all B rows are constrained by a JSON schema whose
   documents are longer than the run (an array of exactly 30 small items with bounded strings),
   so every timed step is B one-token decodes. The cases take turns, `--rounds` times, and the
   table shows each case's median step time, its ratio to the unconstrained case, and the part of
   the step spent in grammar work, and of that the masks alone (timed by wrapping the sampler's
   `apply_grammars`, the engine's wait for masks computed off its thread (`MaskWorkers.wait`) and
   the matchers' `accept`: the only place this script reaches inside chatd). Masks are computed
   while the previous step's tokens are detokenized, so the step waits only for what is left. A
   step in which a mask was still late after the engine's wait (its row sits that step out, by
   design) is not timed but taken again, and counted.

Otherwise this script uses chatd's offline API, and llguidance/xgrammar directly for part 1.

    python benchmarks/structured.py --json structured.json       # SmolLM2 on CPU, about 70 s on 2 cores
    python benchmarks/structured.py --quick --model demo         # smoke test, seconds
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # weight-loading progress bars would bury the tables

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

from chatd.engine.structured.grammar import JSON_OPTIONS  # noqa: E402


def strict_object(properties: dict, required: list[str] | None = None) -> dict:
    """An object schema with these properties and no others; all required unless `required` says."""
    return dict(type="object", properties=properties, required=list(properties) if required is None else required,
                additionalProperties=False)


COUNTRIES = ["Argentina", "Australia", "Austria", "Belgium", "Brazil", "Canada", "Chile", "China", "Colombia", "Czechia",
             "Denmark", "Egypt", "Finland", "France", "Germany", "Greece", "Hungary", "India", "Indonesia", "Ireland",
             "Israel", "Italy", "Japan", "Kenya", "Malaysia", "Mexico", "Morocco", "Netherlands", "New Zealand",
             "Nigeria", "Norway", "Peru", "Philippines", "Poland", "Portugal", "Romania", "Singapore", "South Africa",
             "South Korea", "Spain", "Sweden", "Switzerland", "Thailand", "Turkey", "Ukraine", "United Kingdom",
             "United States", "Vietnam"]
SCHEMAS = {
    "tool arguments": strict_object({
        "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
    }, required=["location", "unit"]),
    "person record": strict_object({
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9-]+\\.[a-z]{2,4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "address": strict_object({"street": {"type": "string", "maxLength": 60},
                                  "city": {"type": "string", "maxLength": 30},
                                  "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}}),
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
    }, required=["name", "email", "age", "address"]),
    "anyOf event": strict_object({
        "event": {"anyOf": [
            strict_object({"kind": {"const": "click"}, "x": {"type": "integer"}, "y": {"type": "integer"}}),
            strict_object({"kind": {"const": "key"}, "key": {"type": "string", "maxLength": 8},
                           "shift": {"type": "boolean"}}, required=["kind", "key"]),
            strict_object({"kind": {"const": "scroll"}, "delta": {"type": "number"}}),
            {"type": "null"},
        ]},
        "timestamp": {"type": "number"},
    }),
    "enum-heavy form": strict_object({
        "country": {"enum": COUNTRIES},
        "category": {"enum": ["electronics", "books", "clothing", "garden", "toys", "grocery", "sports",
                              "automotive", "beauty", "health", "music", "office"]},
        "priority": {"enum": ["low", "medium", "high", "urgent"]},
        "channels": {"type": "array", "items": {"enum": ["email", "sms", "push", "phone", "post"]}, "maxItems": 5},
        "sizes": {"type": "array", "items": {"enum": ["XS", "S", "M", "L", "XL", "XXL"]}, "maxItems": 6},
        "status": {"enum": ["draft", "submitted", "approved", "rejected", "archived"]},
    }, required=["country", "category", "priority", "channels", "status"]),
    "any JSON object": {"type": "object"},
}

# Part 2's schema: its documents (30 items of ~14 tokens) outlast every timed run.
ITEM = strict_object({"name": {"type": "string", "maxLength": 12},
                      "color": {"enum": ["red", "green", "blue", "black", "white"]},
                      "size": {"enum": ["S", "M", "L", "XL"]}})
STEP_SCHEMA = strict_object({"items": {"type": "array", "items": ITEM, "minItems": 30, "maxItems": 30}})
PROMPT = "List thirty products of a clothing shop ({}) as JSON with a name, a color and a size each."

# A timed step a late mask held a row back from is taken again, up to this many times the
# timed steps in all.
LATE_STEP_ALLOWANCE = 3
DEFAULTS = dict(repeats=5, walk_steps=200, batch=8, warmup_steps=2, timed_steps=8, rounds=6)
QUICK = dict(repeats=2, walk_steps=30, batch=3, warmup_steps=2, timed_steps=4, rounds=1)


# -- part 1: the grammar libraries ----------------------------------------------------------------


class Llguidance:
    """llguidance as chatd uses it (engine/structured/grammar.py): masks written into a numpy bit array."""

    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance.hf

        self.llguidance = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None)
        self.mask = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)

    def compile(self, schema: dict):
        matcher_class = self.llguidance.LLMatcher
        matcher = matcher_class(self.tokenizer, matcher_class.grammar_from_json_schema(schema, defaults=JSON_OPTIONS),
                                log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def fill_mask(self, matcher) -> np.ndarray:
        matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        return self.mask

    def accept(self, matcher, token_id: int) -> None:
        if not matcher.consume_token(token_id):
            raise RuntimeError(f"llguidance refused an allowed token {token_id}: {matcher.get_error()}")

    def is_done(self, matcher) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    """xgrammar with compact JSON in chatd's layout and its cache off, so every compile is cold."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar

        self.xgrammar = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=eos_token_ids or None)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab_size)  # int32 [1, words], same bit order

    def compile(self, schema: dict):
        separators = (JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"])
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=separators)
        return self.xgrammar.GrammarMatcher(compiled)

    def fill_mask(self, matcher) -> np.ndarray:
        matcher.fill_next_token_bitmask(self.mask)
        return self.mask[0].numpy()

    def accept(self, matcher, token_id: int) -> None:
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"xgrammar refused an allowed token {token_id}")

    def is_done(self, matcher) -> bool:
        return matcher.is_terminated()


def allowed_tokens(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids whose bit is set in a mask of 32-bit words (bit t of the mask = token t)."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def walk(library, schema: dict, vocab_size: int, eos_token_ids: np.ndarray, max_steps: int, seed: int) -> dict:
    """Compile once (cold), then mask and consume random allowed tokens; the times of each part."""
    rng = random.Random(seed)
    start = time.perf_counter()
    matcher = library.compile(schema)
    compile_seconds = time.perf_counter() - start
    mask_seconds = []
    while len(mask_seconds) < max_steps and not library.is_done(matcher):
        start = time.perf_counter()
        mask = library.fill_mask(matcher)
        mask_seconds.append(time.perf_counter() - start)
        allowed = allowed_tokens(mask, vocab_size)
        allowed = allowed[~np.isin(allowed, eos_token_ids)]
        if not len(allowed):  # only end-of-sequence may follow: the document is complete
            break
        library.accept(matcher, int(allowed[rng.randrange(len(allowed))]))
    return dict(compile_seconds=compile_seconds, first_mask_seconds=mask_seconds[0],
                mask_seconds=statistics.median(mask_seconds[1:] or mask_seconds), steps=len(mask_seconds))


def measure_library(library_class, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], args) -> dict:
    """Tokenizer setup, then every schema's compile, first mask and mask times: medians of args.repeats."""
    setups = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        library = library_class(hf_tokenizer, vocab_size, eos_token_ids)
        setups.append(time.perf_counter() - start)
    schemas = []
    for name, schema in SCHEMAS.items():
        runs = [walk(library, schema, vocab_size, np.array(eos_token_ids), args.walk_steps, args.seed + repeat)
                for repeat in range(args.repeats)]
        row = {key: statistics.median(run[key] for run in runs)
               for key in ("compile_seconds", "first_mask_seconds", "mask_seconds")}
        schemas.append(dict(schema=name, **row, walk_steps=[run["steps"] for run in runs]))
        print(f"  {library.name} {name}: compile {row['compile_seconds'] * 1e3:.2f} ms, "
              f"mask {row['mask_seconds'] * 1e6:.1f} us", flush=True)
    return dict(version=importlib.metadata.version(library.name), tokenizer_setup_seconds=statistics.median(setups),
                schemas=schemas)


def compare_libraries(hf_tokenizer, vocab_size: int, eos_token_ids: list[int], args) -> dict:
    """Part 1: llguidance, and xgrammar when it can be imported."""
    libraries = {"llguidance": measure_library(Llguidance, hf_tokenizer, vocab_size, eos_token_ids, args)}
    try:
        import xgrammar  # noqa: F401
    except ImportError as exc:
        print(f"  xgrammar is not installed ({exc}): measuring llguidance only", flush=True)
        return dict(libraries=libraries, xgrammar_skipped=str(exc), ratios=[])
    libraries["xgrammar"] = measure_library(Xgrammar, hf_tokenizer, vocab_size, eos_token_ids, args)
    ratios = [dict(schema=ll["schema"], **{key: xg[key] / ll[key]
                                            for key in ("compile_seconds", "first_mask_seconds", "mask_seconds")})
              for ll, xg in zip(libraries["llguidance"]["schemas"], libraries["xgrammar"]["schemas"])]
    return dict(libraries=libraries, xgrammar_skipped=None, ratios=ratios)


# -- part 2: the engine step ----------------------------------------------------------------------


class GrammarStopwatch:
    """Adds up the time the engine spends in grammar work while entered, by wrapping three functions:
    the sampler's `apply_grammars` (as worker/full_sampling.py calls it; `masking`: the masks gathered,
    then the logits masked), the engine's wait for the masks computed off its thread (`masks`: what is
    left of llguidance's part when the step needs them), and the matchers' `accept` (`accept`: the
    scheduler feeding each sampled token to its matcher). The one place this script reaches inside chatd.
    """

    def __init__(self) -> None:
        self.seconds = dict(masking=0.0, masks=0.0, accept=0.0)

    def __enter__(self) -> GrammarStopwatch:
        from chatd.engine.structured import grammar
        from chatd.engine.worker import full_sampling

        self._originals = [(full_sampling, "apply_grammars", "masking", full_sampling.apply_grammars),
                           (grammar.MaskWorkers, "wait", "masks", grammar.MaskWorkers.wait),
                           (grammar.GrammarMatcher, "accept", "accept", grammar.GrammarMatcher.accept)]
        for owner, name, bucket, function in self._originals:
            setattr(owner, name, self._timed(function, bucket))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, _, function in self._originals:
            setattr(owner, name, function)

    def _timed(self, function, bucket: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[bucket] += time.perf_counter() - start
        return timed


def time_steps(engine, num_constrained: int, args, round_index: int) -> dict:
    """Decode a batch with `num_constrained` constrained rows: each timed step's seconds, its grammar
    seconds, and the first row's text."""
    from chatd.engine import SamplingParams, StructuredOutput

    # Room for a prefill split over steps, and for steps left untimed because a mask was late.
    max_tokens = args.warmup_steps + LATE_STEP_ALLOWANCE * args.timed_steps + 8
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                 structured=StructuredOutput(json_schema=json.dumps(STEP_SCHEMA)))
    ids = [f"c{num_constrained}-r{round_index}-{row}" for row in range(args.batch)]
    num_tokens, texts = dict.fromkeys(ids, 0), dict.fromkeys(ids, "")
    for row, request_id in enumerate(ids):
        engine.add_request(request_id, PROMPT.format(f"row {row}"), constrained if row < num_constrained else free)

    def step() -> list:
        outs = engine.step()
        for out in outs:
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            num_tokens[out.request_id] += len(out.outputs[0].token_ids)
            texts[out.request_id] += out.outputs[0].text
        return outs

    step_seconds, grammar_seconds, mask_seconds, late_steps = [], [], [], 0
    try:
        while min(num_tokens.values()) == 0:  # until every row has its first token
            step()
        for _ in range(args.warmup_steps):
            step()
        while len(step_seconds) < args.timed_steps:
            with GrammarStopwatch() as grammar:
                start = time.perf_counter()
                outs = step()
                seconds = time.perf_counter() - start
            shapes = sorted((len(o.outputs[0].token_ids), o.finished) for o in outs)
            if shapes != [(1, False)] * args.batch:
                # A constrained row whose mask was not ready in MASK_WAIT_SECONDS sits the step out
                # (by design: a slow grammar delays its own reply, not the batch). On a busy machine
                # that happens now and then; such a step is not the case being measured.
                missing = args.batch - len(outs)
                if 0 < missing <= num_constrained and set(shapes) <= {(1, False)} \
                        and late_steps < (LATE_STEP_ALLOWANCE - 1) * args.timed_steps:
                    late_steps += 1
                    continue
                raise RuntimeError(f"{num_constrained} constrained: a timed step was not {args.batch} one-token "
                                   f"decodes (tokens, finished): {shapes}")
            step_seconds.append(seconds)
            grammar_seconds.append(grammar.seconds["masking"] + grammar.seconds["masks"] + grammar.seconds["accept"])
            mask_seconds.append(grammar.seconds["masks"])
    finally:
        for request_id in ids:
            engine.abort(request_id)
    return dict(step_seconds=step_seconds, grammar_seconds=grammar_seconds, mask_seconds=mask_seconds,
                late_steps=late_steps, text=texts[ids[0]])


def measure_steps(engine, args) -> dict:
    """Part 2: 0, 1 and all rows constrained, taking turns; each case's median step, its grammar part,
    and the ratio to the unconstrained case."""
    counts = sorted({0, 1, args.batch})
    keys = ("step_seconds", "grammar_seconds", "mask_seconds")
    runs = {count: {key: [] for key in keys} for count in counts}
    texts, late_steps = {}, dict.fromkeys(counts, 0)
    for round_index in range(args.rounds):
        for count in counts:
            timed = time_steps(engine, count, args, round_index)
            for key in keys:
                runs[count][key] += timed[key]
            texts[count] = timed["text"]
            late_steps[count] += timed["late_steps"]
    base = statistics.median(runs[0]["step_seconds"])
    cases = []
    for count in counts:
        step_seconds = statistics.median(runs[count]["step_seconds"])
        cases.append(dict(constrained_rows=count, step_seconds=step_seconds, ratio=step_seconds / base,
                          added_seconds=step_seconds - base,
                          grammar_seconds=statistics.median(runs[count]["grammar_seconds"]),
                          mask_seconds=statistics.median(runs[count]["mask_seconds"]),
                          runs=runs[count]["step_seconds"], grammar_runs=runs[count]["grammar_seconds"],
                          late_steps=late_steps[count], first_row_text=texts[count]))
    return dict(batch=args.batch, timed_steps_per_case=args.rounds * args.timed_steps, cases=cases)


# -- the run --------------------------------------------------------------------------------------


def load_model(args, tmp: Path):
    """The LLM for --model: the installed default model (SmolLM2), the demo model, or a path."""
    from chatd.engine import LLM
    from chatd.engine.models.demo import build_demo_model
    from chatd.engine.models.sources import default_model_path

    if args.model == "demo":
        path = build_demo_model(tmp / "demo")
    elif args.model == "default":
        path = default_model_path()
        if path is None:
            raise SystemExit("the default model's package is not installed; pass --model demo or a model path")
    else:
        path = Path(args.model)
    max_model_len = 256 if args.quick else 512
    return LLM(path, device="cpu", dtype="float32", max_num_seqs=max(args.batch, 1), max_model_len=max_model_len)


def run(args) -> dict:
    """Load the model, run both parts, print the tables; return every number."""
    import torch

    with tempfile.TemporaryDirectory(prefix="chatd-structured-") as tmp:
        start = time.perf_counter()
        llm = load_model(args, Path(tmp))
        load_seconds = time.perf_counter() - start
        engine = llm.engine
        hf_tokenizer, vocab_size = llm.tokenizer.hf, engine.vocab_size
        eos_token_ids = list(engine.grammars.eos_token_ids)
        print(f"model {engine.model_path} ({vocab_size} tokens, EOS {eos_token_ids}) loaded in {load_seconds:.1f} s; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
        print("part 1: grammar libraries", flush=True)
        libraries = compare_libraries(hf_tokenizer, vocab_size, eos_token_ids, args)
        print(f"part 2: engine steps, batch {args.batch}", flush=True)
        steps = measure_steps(engine, args)
    result = dict(args=dict(vars(args)), model=engine.model_path, vocab_size=vocab_size, load_seconds=load_seconds,
                  torch=torch.__version__, **libraries, steps=steps)
    report(result)
    return result


def report(result: dict) -> None:
    """Print both tables."""
    args, libraries = result["args"], result["libraries"]
    names = list(libraries)
    print(f"\nGrammar libraries, {result['vocab_size']}-token vocabulary; medians of {args['repeats']} runs; mask = "
          f"median over a random walk of up to {args['walk_steps']} tokens")
    for name, library in libraries.items():
        print(f"{name} {library['version']}: tokenizer setup {library['tokenizer_setup_seconds'] * 1e3:.0f} ms")
    header = f"{'schema':<17}" + "".join(f" {n + ' compile ms':>22} {'first mask us':>14} {'mask us':>8}" for n in names)
    if result["ratios"]:
        header += f" {'xg/ll compile':>14} {'xg/ll mask':>11}"
    print(header)
    for index, schema in enumerate(SCHEMAS):
        line = f"{schema:<17}"
        for name in names:
            row = libraries[name]["schemas"][index]
            line += (f" {row['compile_seconds'] * 1e3:>22.2f} {row['first_mask_seconds'] * 1e6:>14.0f}"
                     f" {row['mask_seconds'] * 1e6:>8.1f}")
        if result["ratios"]:
            ratio = result["ratios"][index]
            line += f" {ratio['compile_seconds']:>13.1f}x {ratio['mask_seconds']:>10.2f}x"
        print(line)
    if result["xgrammar_skipped"]:
        print(f"xgrammar not measured: {result['xgrammar_skipped']}")

    steps = result["steps"]
    print(f"\nEngine decode step, batch {steps['batch']}, greedy; median of {steps['timed_steps_per_case']} timed "
          f"steps per case ({args['rounds']} rounds, cases in turn)")
    print(f"{'constrained rows':>16} {'step ms':>9} {'x free':>7} {'added ms':>9} {'grammar ms':>11} {'masks ms':>9}"
          "  first row's text")
    for case in steps["cases"]:
        print(f"{case['constrained_rows']:>16} {case['step_seconds'] * 1e3:>9.2f} {case['ratio']:>6.2f}x "
              f"{case['added_seconds'] * 1e3:>9.2f} {case['grammar_seconds'] * 1e3:>11.2f} "
              f"{case['mask_seconds'] * 1e3:>9.2f}  {case['first_row_text'][:48]!r}")
    print("added = step - the unconstrained step (medians, so noise shows too); grammar = time in the sampler's "
          "apply_grammars, its wait for masks and the matchers' accept in the same steps; masks = of that, the wait "
          "for masks computed off the engine thread")
    late = {case["constrained_rows"]: case["late_steps"] for case in steps["cases"] if case["late_steps"]}
    if late:
        print("steps taken again because a mask was late and its row sat the step out (constrained rows: steps): "
              + ", ".join(f"{rows}: {count}" for rows, count in late.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct, installed), 'demo', or a path")
    p.add_argument("--quick", action="store_true", help="2 repeats, 30-token walks, batch 3, a few steps: a smoke test")
    p.add_argument("--repeats", type=int, help="runs per library measurement (5)")
    p.add_argument("--walk-steps", dest="walk_steps", type=int, help="most masks per walk (200)")
    p.add_argument("--batch", type=int, help="decode batch size B of part 2 (8)")
    p.add_argument("--warmup-steps", dest="warmup_steps", type=int, help="untimed decode steps before the timed ones (2)")
    p.add_argument("--timed-steps", dest="timed_steps", type=int, help="timed decode steps per case and round (8)")
    p.add_argument("--rounds", type=int, help="times each case runs, in turn with the others (6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random walks")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    for key, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batch < 2:
        p.error("--batch must be at least 2, so that one constrained row differs from all")
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
