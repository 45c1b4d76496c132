"""Dynamic batching: merged inputs equal inputs featurised together, concurrent requests get the
predictions they get alone, batches do form (metrics), and one request's failure in a batch
fails no other request."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.batching import merge
from api.featurize import featurize_instances
from api.schemas import PredictRequest
from api.settings import Settings

from .test_api import file_store_url, to_instance  # noqa: F401 - file_store_url is a fixture

PREDICT = "/v1/models/dlrm:predict"


@pytest.fixture(scope="module")
def rows(criteo_sample) -> list[dict]:
    lines = (criteo_sample / "test.txt").read_text().splitlines()[:48]
    out = [to_instance(x) for x in lines]
    # a bag: offsets that are not 1 apart
    out[3]["sparse"][2] = ["68fd1e64", "80e26c9b", "fb936136"]
    out[7]["sparse"][5] = []
    return out


def histogram(text: str, name: str) -> dict[str, float]:
    """Bucket counts (le -> count) and the total of a histogram from /metrics."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_bucket":
                out[s.labels["le"]] = s.value
            elif s.name == f"{name}_count":
                out["count"] = s.value
    return out


@pytest.mark.parametrize("bags", [False, True])
def test_merged_inputs_equal_inputs_featurised_together(file_store_url, rows, bags):
    batch = [dict(r, sparse=list(r["sparse"])) for r in rows[8:20]]
    if bags:  # every request with a bag (a request's layout follows its own values)
        for k, r in enumerate(batch):
            r["sparse"][2] = [r["sparse"][2], "fb936136"][: k % 3] if r["sparse"][2] else []
    with TestClient(create_app(Settings(store=file_store_url))) as client:
        model = client.app.state.service.model
        validated = PredictRequest(instances=batch).instances
        merged = merge(
            [
                featurize_instances(model.spec, model.featurizer, validated[lo:hi])
                for lo, hi in ((0, 1), (1, 5), (5, 6), (6, 12))
            ]
        )
        together = featurize_instances(model.spec, model.featurizer, validated)
        for got, want in zip(merged, together, strict=True):
            np.testing.assert_array_equal(got, want)
        if bags:
            assert len(np.unique(np.diff(merged[2]))) > 1, "no bag of other than one value"


def _slow_first_calls(service, seconds: float, calls: int):
    """Make the first ``calls`` model calls take ``seconds`` longer: requests queue behind them."""
    score, count = service.score, [0]

    def slow(model, inputs):
        count[0] += 1
        if count[0] <= calls:
            time.sleep(seconds)
        return score(model, inputs)

    service.score = slow


def test_concurrent_requests_are_batched_and_score_as_alone(file_store_url, rows):
    with TestClient(create_app(Settings(store=file_store_url, batching=False))) as client:
        alone = [
            client.post(PREDICT, json={"instances": [r]}).json()["predictions"][0] for r in rows
        ]
    with TestClient(create_app(Settings(store=file_store_url, batch_max_size=16))) as client:
        service = client.app.state.service
        _slow_first_calls(service, 0.3, 1)
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda r: client.post(PREDICT, json={"instances": [r]}), rows))
        assert all(a.status_code == 200 for a in answers), [
            a.text for a in answers if a.status_code != 200
        ]
        together = [a.json()["predictions"][0] for a in answers]
        sizes = histogram(client.get("/metrics").text, "dlrm_model_batch_requests")
        examples = histogram(client.get("/metrics").text, "dlrm_model_batch_examples")
    np.testing.assert_allclose(together, alone, atol=1e-6)
    calls = sizes["count"]
    assert calls < len(rows), f"{len(rows)} requests in {calls} model calls: no batch formed"
    assert sizes["1.0"] < calls, "every model call scored one request"
    assert examples["16.0"] == calls, "a batch went over batch_max_size"


def test_a_failing_request_fails_alone_in_its_batch(file_store_url, rows):
    poison = {"dense": [987654321] + [None] * 12, "sparse": [None] * 26}
    # The blocker's slow model call must hold the batcher (off the loop), not the event loop: a
    # lone small request is otherwise scored on the loop (inline_max_bytes) and the others arrive
    # only after it, to an idle batcher.
    with TestClient(create_app(Settings(store=file_store_url, inline_max_bytes=0))) as client:
        service = client.app.state.service
        score, calls = service.score, []

        def score_unless_poisoned(model, inputs):  # a fault in the model call of one request's data
            calls.append(len(inputs[0]))
            if np.isclose(inputs[0][:, 0], np.log1p(987654321)).any():
                raise RuntimeError("poisoned example")
            return score(model, inputs)

        service.score = score_unless_poisoned
        _slow_first_calls(service, 0.3, 1)
        expected = [
            client.post(PREDICT, json={"instances": [r]}).json()["predictions"][0] for r in rows[:8]
        ]
        bodies = [{"instances": [poison]}, *({"instances": [r]} for r in rows[:8])]
        _slow_first_calls(service, 0.5, 1)
        with ThreadPoolExecutor(len(bodies) + 1) as pool:
            # scored first, slowly
            blocker = pool.submit(client.post, PREDICT, json={"instances": [rows[9]]})
            time.sleep(0.2)
            # queued behind it
            answers = list(pool.map(lambda body: client.post(PREDICT, json=body), bodies))
            assert blocker.result().status_code == 200
    assert answers[0].status_code == 500 and "request_id" in answers[0].json()
    assert [a.status_code for a in answers[1:]] == [200] * 8
    np.testing.assert_allclose(
        [a.json()["predictions"][0] for a in answers[1:]], expected, atol=1e-6
    )
    assert len(bodies) in calls, f"the poisoned request was never batched with the others: {calls}"


def test_concurrent_small_requests_are_queued_from_the_loop_and_fail_alone(file_store_url, rows):
    """Small requests that arrive while others are in flight are decoded and featurised on the
    event loop and scored by the batcher thread (``fastpath.Staged``: no pool thread each), batched
    and as alone; a bad body gets its own 422 naming its field, a failing model call its own 500."""
    poison = {"dense": [987654321] + [None] * 12, "sparse": [None] * 26}
    bad = {"dense": ["many"] + [None] * 12, "sparse": [None] * 26}
    with TestClient(create_app(Settings(store=file_store_url))) as client:
        service = client.app.state.service
        expected = [
            client.post(PREDICT, json={"instances": [r]}).json()["predictions"][0]
            for r in rows[:12]
        ]
        score, threads = service.score, []

        def score_unless_poisoned(model, inputs):
            threads.append((threading.current_thread().name, len(inputs[0])))
            if np.isclose(inputs[0][:, 0], np.log1p(987654321)).any():
                raise RuntimeError("poisoned example")
            return score(model, inputs)

        service.score = score_unless_poisoned
        # the first queued call holds the batcher: the rest queue
        _slow_first_calls(service, 0.3, 1)
        bodies = [
            {"instances": [poison]},
            {"instances": [bad]},
            *({"instances": [r]} for r in rows[:12]),
        ]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda body: client.post(PREDICT, json=body), bodies))
    assert answers[0].status_code == 500 and "request_id" in answers[0].json()
    assert answers[1].status_code == 422 and answers[1].json()["field"] == "instances.0.dense.0", (
        answers[1].text
    )
    assert [a.status_code for a in answers[2:]] == [200] * 12
    np.testing.assert_allclose(
        [a.json()["predictions"][0] for a in answers[2:]], expected, atol=1e-6
    )
    names = {name for name, _ in threads}
    assert "batcher" in names and not any(n.startswith("score") for n in names), threads
    assert max(size for _, size in threads) > 1, f"no batch formed: {threads}"


def test_an_unavailable_store_fails_a_batch_at_once(file_store_url, rows):
    """A coalesced call that finds the store down answers 503 to all its requests, without
    scoring each again alone (each would wait out the store's timeout once more)."""
    from embedding_server.stores import StoreUnavailable

    with TestClient(create_app(Settings(store=file_store_url))) as client:
        service = client.app.state.service
        sizes = []

        def down(model, inputs):
            sizes.append(len(inputs[0]))
            if len(sizes) == 1:
                time.sleep(0.3)  # the first call holds the batcher: the rest queue behind it
            raise StoreUnavailable("store down (test)")

        service.score = down
        with ThreadPoolExecutor(12) as pool:
            answers = list(
                pool.map(lambda r: client.post(PREDICT, json={"instances": [r]}), rows[:12])
            )
    assert [a.status_code for a in answers] == [503] * 12, [a.text for a in answers]
    assert max(sizes) > 1 and len(sizes) < 12, (
        f"model calls of {sizes} examples: a batch was scored again alone"
    )


def test_submit_after_stop_is_refused_and_queued_jobs_are_scored(file_store_url, rows):
    """Queued jobs are scored when the batcher stops (their futures always resolve); a submit
    after it stopped is refused with BatcherStopped (the fast path then scores in the pool)."""
    from api.batching import BatcherStopped

    with TestClient(create_app(Settings(store=file_store_url))) as client:
        service = client.app.state.service
        model = service.model
        inputs = featurize_instances(
            model.spec, model.featurizer, PredictRequest(instances=rows[:2]).instances
        )
        _slow_first_calls(service, 0.3, 1)
        futures = [service.batcher.submit(model, inputs) for _ in range(3)]
        service.batcher.stop()
        assert [len(f.result(timeout=10)) for f in futures] == [2, 2, 2]
        with pytest.raises(BatcherStopped):
            service.batcher.submit(model, inputs)
