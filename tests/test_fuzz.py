"""Property-based fuzzing of the OpenAPI schema (schemathesis): no request may cause a 5xx."""

import shutil
import tempfile
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from api.app import create_app
from api.settings import Settings
from embedding_server.publish import publish_checkpoint
from embedding_server.stores import open_store

pytestmark = pytest.mark.slow

STORE_DIR = Path(tempfile.mkdtemp(prefix="dlrm-fuzz-store-"))
APP = create_app(Settings(store=f"file://{STORE_DIR}", max_instances=64, max_body_bytes=1 << 20))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
# Valid and invalid data alike (wrong types, missing fields, out-of-range values): any 5xx fails.
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], deterministic=True)


@pytest.fixture(scope="module", autouse=True)
def served_model(trained_criteo):
    publish_checkpoint(trained_criteo, open_store(f"file://{STORE_DIR}"), version="fuzz")
    with TestClient(APP):  # runs the lifespan: the service and its model are loaded
        yield
    shutil.rmtree(STORE_DIR, ignore_errors=True)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_causes_a_server_error(case):
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
    if response.status_code >= 400 and response.status_code != 405:
        assert "error" in response.json(), response.text[:300]
