"""Schemathesis against the live server's own /openapi.json: whatever it generates from the declared
schemas, valid or not (positive and negative modes, the boundary cases of the coverage phase), the
server must refuse or answer it, never fail with a 5xx.

Only the server-error check is asserted here; the bad-input matrix (test_bad_input.py) pins the exact
status and error body of each kind of refusal."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis import GenerationMode  # noqa: E402

# Driven through schemathesis's strategies and hypothesis's own @given rather than schemathesis's pytest plugin,
# whose hooks break on pytest releases newer than it (pytest 9.2: no Function._nodeid). Bounded for a 2-core
# machine: up to 50 generated requests per mode (each over every operation), no shrinking, no example
# database written into the tree.
FUZZ = settings(max_examples=50, deadline=None, database=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def api_schema(live):
    """The server's own document, with one thing the fuzzer cannot guess: `model` is the served id
    (an enum of one). Otherwise nearly every generated request would stop at 404 model_not_found and
    never reach the prompt, token and sampling checks or the model; negative mode still sends others."""
    raw = live.client.get("/openapi.json").json()
    for name in ("CompletionRequest", "ChatCompletionRequest", "TextsRequest"):
        raw["components"]["schemas"][name]["properties"]["model"]["enum"] = [live.state.name]
    config = schemathesis.Config.from_dict({"request-timeout": 30, "base-url": live.url})
    return schemathesis.openapi.from_dict(raw, config=config)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_server_error(api_schema, live, mode):
    seen = []

    @FUZZ
    @given(case=api_schema.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call(base_url=live.url)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text)

    fuzz()
    assert len(seen) >= 20  # it did send requests


def test_no_server_error_on_boundary_cases(api_schema, live):
    """Schemathesis's coverage cases: each field at its bounds and just past them, wrong types, missing."""
    statuses = []
    for result in api_schema.get_all_operations():
        op = result.ok()
        for case in api_schema.iter_coverage_cases(
                op, generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                generation_config=api_schema.config.generation_for(operation=op)):
            response = case.call(base_url=live.url)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text)
    assert len(statuses) >= 50 and 200 in statuses and 422 in statuses


def test_still_healthy_after_fuzzing(live):
    """After everything the fuzzer sent: a normal completion works and no 5xx was ever counted."""
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    metrics = live.client.get("/metrics").text
    served = [line for line in metrics.splitlines() if line.startswith("moeserve_requests_total{")]
    assert served, "no requests were counted"
    assert not [line for line in served if 'status="5' in line], served
