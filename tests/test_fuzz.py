"""Property-based fuzzing: the OpenAPI document (schemathesis) with the served model's names,
versions and features as its enums and patterns, so that generated requests reach scoring (V1
JSON and lines, V2 tensors, pinned versions): no request may cause a 5xx. Then a stateful
machine publishes, promotes, collects and predicts, checking that every answer is its reported
version's own."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from schemathesis import GenerationMode

from api.app import create_app
from api.metrics import ServingMetrics
from api.openapi import model_openapi
from api.settings import Settings
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store

from .conftest import tiny_config
from .test_api import GOOD
from .test_serving_metrics import value

pytestmark = pytest.mark.slow

STORE_DIR = Path(tempfile.mkdtemp(prefix="dlrm-fuzz-store-"))
# Every call runs the app's lifespan (a service of its own): one metrics object counts them all.
METRICS = ServingMetrics()
APP = create_app(
    Settings(store=f"file://{STORE_DIR}", max_instances=64, max_body_bytes=1 << 20), metrics=METRICS
)
VERSIONS = ["fuzz-old", "fuzz"]
# The document the app serves once the model below is loaded (tiny.toml's Criteo spec; the test
# checks the live document is this one): model name, versions and features as enums and patterns.
DOC = model_openapi(APP, tiny_config().feature_spec(), "dlrm", VERSIONS)
schema = schemathesis.openapi.from_dict(DOC)
schema.app = APP
# Valid and invalid data alike (wrong types, missing fields, out-of-range values): any 5xx fails.
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], deterministic=True
)
CALLS = []


@pytest.fixture(scope="module", autouse=True)
def served_model(trained_criteo):
    store = open_store(f"file://{STORE_DIR}")
    for version in VERSIONS:
        publish_checkpoint(trained_criteo, store, version=version)
    with TestClient(APP):  # runs the lifespan: the service and its model are loaded
        assert APP.openapi() == DOC  # what is fuzzed is what is served
        yield
    shutil.rmtree(STORE_DIR, ignore_errors=True)


def aligned_tensors(context, body):
    """Make an infer body's shapes agree with its data and its features distinct (generated
    independently, they rarely are), so that valid requests reach featurising and scoring."""
    if isinstance(body, dict) and isinstance(body.get("inputs"), list):
        named = {t.get("name"): t for t in body["inputs"] if isinstance(t, dict)}
        body["inputs"] = list(named.values()) or body["inputs"]
        tensors = [t for t in body["inputs"] if isinstance(t.get("data"), list)]
        n = min((len(t["data"]) for t in tensors), default=0)
        for t in tensors:
            t["data"] = t["data"][:n]
            if isinstance(t.get("shape"), list) and t["shape"]:
                t["shape"] = [n]
    return body


@schema.hooks.apply(aligned_tensors, name="map_body")
@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_causes_a_server_error(case):
    response = case.call()
    CALLS.append(case.formatted_path)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
    )
    if response.status_code >= 400 and response.status_code != 405:
        assert "error" in response.json(), response.text[:300]


def test_the_fuzzer_reached_scoring():
    """Generated requests were scored: V1 instances, lines and V2 tensors, pinned versions too."""
    if not CALLS:
        pytest.skip("the fuzzing test did not run in this session")
    text = METRICS.render().decode()
    scored = {
        kind: value(text, "dlrm_batch_instances_count", input=kind)
        for kind in ("instances", "lines", "tensors")
    }
    assert all(v > 0 for v in scored.values()), scored
    pinned = [p for p in CALLS if "/versions/" in p]
    assert pinned


class PublishPromotePredict(RuleBasedStateMachine):
    """Publish (each version's dense weights nudged so that every version scores differently),
    promote, collect and predict through V1, V2 and pinned routes, in any order."""

    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="dlrm-fuzz-state-"))
        self.store = open_store(f"file://{self.dir}", keep_versions=10)
        self.truth: dict[str, list[float]] = {}
        self.client = TestClient(
            create_app(Settings(store=f"file://{self.dir}", poll_interval_s=0.05))
        )
        self.client.__enter__()
        self.count = 0

    def teardown(self):
        self.client.__exit__(None, None, None)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _publish(self):
        """A new version: the checkpoint's rows, its dense weights nudged (scores differ)."""
        name = f"v{self.count}"
        self.count += 1
        if self.count == 1:
            meta = publish_checkpoint(TRAINED, self.store, version=name)
            self.base = (
                meta,
                self.store.read_dense(name),
                {
                    t.name: self.store.get_rows(name, t.name, np.arange(t.rows))[0]
                    for t in meta.spec.tables
                },
            )
        else:
            meta, dense, rows = self.base
            with self.store.begin(meta.model_copy(update={"version": name})) as writer:
                for table, values in rows.items():
                    writer.write_rows(table, 0, values)
                writer.write_dense({k: v + 0.01 * self.count for k, v in dense.items()})
                writer.commit()
        r = self.client.post(f"/v1/models/dlrm/versions/{name}:predict", json={"instances": [GOOD]})
        assert r.status_code == 200, r.text
        self.truth[name] = r.json()["predictions"]
        assert all(self.truth[name] != p for v, p in self.truth.items() if v != name)

    @initialize()
    def first(self):
        self._publish()

    @rule()
    def publish(self):
        if self.count < 4:
            self._publish()

    @rule(data=st.data())
    def promote(self, data):
        versions = sorted(self.store.list_versions())
        self.store.promote(data.draw(st.sampled_from(versions)))

    @rule(keep=st.integers(1, 2))
    def gc(self, keep):
        self.store.collect_garbage(keep=keep)

    def _check(self, r, pinned: str | None = None):
        assert r.status_code in (200, 404, 503), r.text
        if r.status_code == 404:
            assert pinned is not None and pinned not in self.store.list_versions()
        if r.status_code != 200:
            return
        body = r.json()
        version = body.get("model_version")
        predictions = body["predictions"] if "predictions" in body else body["outputs"][0]["data"]
        # the reported version's own
        assert predictions == pytest.approx(self.truth[version], abs=1e-6)
        if pinned is not None:
            assert version == pinned

    @rule(data=st.data(), protocol=st.sampled_from(["v1", "v2"]), pin=st.booleans())
    def predict(self, data, protocol, pin):
        version = data.draw(st.sampled_from(sorted(self.truth))) if pin else None
        at = f"/versions/{version}" if version else ""
        if protocol == "v1":
            r = self.client.post(f"/v1/models/dlrm{at}:predict", json={"instances": [GOOD]})
        else:
            inputs = [
                {"name": f"I{i + 1}", "shape": [1], "datatype": "FP32", "data": [1]}
                for i in range(13)
            ]
            inputs += [
                {"name": f"C{i + 1}", "shape": [1], "datatype": "BYTES", "data": ["68fd1e64"]}
                for i in range(26)
            ]
            r = self.client.post(f"/v2/models/dlrm{at}/infer", json={"inputs": inputs})
        self._check(r, version)

    @invariant()
    def current_is_complete(self):
        current = self.store.current_version()
        assert current is None or current in self.store.list_versions()


TRAINED: Path | None = None


def test_publish_promote_predict_state_machine(trained_criteo):
    global TRAINED
    TRAINED = trained_criteo
    machine = PublishPromotePredict.TestCase
    machine.settings = settings(
        max_examples=6,
        stateful_step_count=8,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    machine().runTest()
