"""Reads /metrics before and after a create / exec / pause / resume /
delete cycle through SPACE's API, parses both with prometheus_client's
text parser, and checks that every counter and histogram moved as it must.
Run by crates/space-cli/tests/metrics.rs with SPACE_URL and SPACE_API_KEY."""

import json
import os
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

URL = os.environ["SPACE_URL"]
KEY = os.environ["SPACE_API_KEY"]


def call(method, path, body=None, key=KEY):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(URL + path, data=data, method=method)
    if key:
        request.add_header("Authorization", "Bearer " + key)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=120) as response:
        raw = response.read()
        return response.status, response.headers, raw


def scrape():
    status, headers, raw = call("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), headers
    samples = {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples, name, **labels):
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def wait(operation):
    while True:
        _, _, raw = call("GET", f"/v1/operations/{operation}?wait=30")
        op = json.loads(raw)
        if op["state"] in ("succeeded", "failed", "cancelled"):
            assert op["state"] == "succeeded", op
            return


# Without the server's key: refused.
try:
    call("GET", "/metrics", key=None)
    raise AssertionError("metrics answered without a key")
except urllib.error.HTTPError as e:
    assert e.code == 401, e.code

before = scrape()
_, _, raw = call("POST", "/v1/sandboxes", {"template": "base"})
created = json.loads(raw)
sandbox = created["sandbox"]["id"]
wait(created["operation"]["id"])
during = scrape()
assert total(during, "space_sandboxes", state="running", template="base") >= 1, "a running sandbox is counted"
_, _, raw = call("POST", f"/v1/sandboxes/{sandbox}/exec", {"cmd": "printf hello"})
assert json.loads(raw)["result"]["exit_code"] == 0
_, _, raw = call("POST", f"/v1/sandboxes/{sandbox}/exec", {"cmd": "exit 3"})
assert json.loads(raw)["result"]["exit_code"] == 3
for action in ("pause", "resume"):
    _, _, raw = call("POST", f"/v1/sandboxes/{sandbox}/{action}")
    wait(json.loads(raw)["operation"]["id"])
_, _, raw = call("DELETE", f"/v1/sandboxes/{sandbox}")
wait(json.loads(raw)["operation"]["id"])
after = scrape()


def moved(name, by, **labels):
    delta = total(after, name, **labels) - total(before, name, **labels)
    assert delta == by, f"{name} {labels}: moved by {delta}, not {by}"


moved("space_http_requests_total", 1, method="POST", route="/v1/sandboxes", status="202")
moved("space_http_requests_total", 2, method="POST", route="/v1/sandboxes/{id}/exec", status="200")
moved("space_http_requests_total", 1, method="DELETE", route="/v1/sandboxes/{id}", status="202")
moved("space_http_request_duration_seconds_count", 2, method="POST", route="/v1/sandboxes/{id}/exec")
assert total(after, "space_http_request_duration_seconds_sum", route="/v1/sandboxes/{id}/exec") > total(
    before, "space_http_request_duration_seconds_sum", route="/v1/sandboxes/{id}/exec"
)
moved("space_operation_duration_seconds_count", 1, kind="create", outcome="succeeded")
moved("space_operation_duration_seconds_count", 1, kind="pause", outcome="succeeded")
moved("space_operation_duration_seconds_count", 1, kind="resume", outcome="succeeded")
moved("space_operation_duration_seconds_count", 1, kind="delete", outcome="succeeded")
started = sum(
    total(snapshot, "space_operation_duration_seconds_count", kind="create", start=start) * sign
    for snapshot, sign in ((after, 1), (before, -1))
    for start in ("hot", "warm", "cold")
)
assert started == 1, f"the create is counted as hot, warm or cold once, not {started}"
assert (total(after, "space_warm_pool_hits_total") + total(after, "space_warm_pool_misses_total")) - (
    total(before, "space_warm_pool_hits_total") + total(before, "space_warm_pool_misses_total")
) == 1, "one create, one hit or miss"
moved("space_command_starts_total", 2)
moved("space_command_exits_total", 1, outcome="exit_zero")
moved("space_command_exits_total", 1, outcome="exit_nonzero")
moved("space_command_output_bytes_total", 5, stream="stdout")
assert total(after, "space_capacity_mib") > 0
assert total(after, "space_sandboxes", state="running", template="base") == total(
    during, "space_sandboxes", state="running", template="base"
) - 1, "the deleted sandbox is no longer counted"
# No label holds an id: every label set is bounded.
assert not any("sbx_" in value for (_, labels) in after for (_, value) in labels), "an id in a label"
print("METRICS OK")
