"""Schemathesis against the live server's own /openapi.json: whatever it generates from the declared
schemas, valid or not (positive and negative modes, the boundary cases of the coverage phase), the
server must refuse or answer it, never fail with a 5xx.

Only the server-error check is asserted here; the bad-input matrix (test_bad_input.py) pins the exact
status and error body of each kind of refusal."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis.checks import not_a_server_error  # noqa: E402

# Bounded for a 2-core machine: up to 50 generated requests per operation and mode, no shrinking, no
# stateful phase (the API has no links between operations), and no example database written into the tree.
CONFIG = {
    "generation": {"mode": "all", "max-examples": 50, "no-shrink": True, "database": "none"},
    "phases": {"stateful": {"enabled": False}},
    "request-timeout": 30,
}


@pytest.fixture(scope="module")
def api_schema(live):
    """The server's own document, with one thing the fuzzer cannot guess: `model` is the served id
    (an enum of one). Otherwise nearly every generated request would stop at 404 model_not_found and
    never reach the prompt, token and sampling checks or the model; negative mode still sends others."""
    raw = live.client.get("/openapi.json").json()
    for name in ("CompletionRequest", "TextsRequest"):
        raw["components"]["schemas"][name]["properties"]["model"]["enum"] = [live.state.name]
    return schemathesis.openapi.from_dict(raw, config=schemathesis.Config.from_dict({**CONFIG, "base-url": live.url}))


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error(case):
    case.call_and_validate(checks=[not_a_server_error])


def test_still_healthy_after_fuzzing(live):
    """After everything the fuzzer sent: a normal completion works and no 5xx was ever counted."""
    r = live.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    metrics = live.client.get("/metrics").text
    served = [line for line in metrics.splitlines() if line.startswith("moeserve_requests_total{")]
    assert served, "no requests were counted"
    assert not [line for line in served if 'status="5' in line], served
