"""Nothing a client sends can blow up /metrics (issue 23, item 2).

The label values a client chooses (the model name, the trusted header's client name) are bounded
in length and in kind (docs/metrics.md, "Label values"): a model name over 256 characters or with a
control character is `other`, a client name is 1-64 safe characters or `other`; so every line of
/metrics stays within MAX_LINE bytes, whatever clients send, and the file that shares admitted
names across workers holds only such names. The randomized tests draw arbitrary text for model
names and arbitrary bytes for the client header; CI runs INFERTAP_LABEL_EXAMPLES (default 40)
examples, a long run thousands.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.control.auth import HeaderNames
from proxy.observe.metrics.labels import OTHER, ModelLabels
from proxy.tools.fake_upstream import FakeUpstream
from tests.conftest import CHAT, make_settings, serve_in_thread

EXAMPLES = int(os.environ.get("INFERTAP_LABEL_EXAMPLES", "40"))
MAX_LABEL_CHARS = 256  # docs/metrics.md
CLIENT_HEADER = "X-Infertap-Client"
# docs/metrics.md: every line of /metrics is at most 2,048 bytes whatever clients send (with
# upstream names, which the operator chooses, up to 64 characters).
MAX_LINE = 2048
OM = {"accept": "application/openmetrics-text; version=1.0.0"}


def longest_line(text: str) -> int:
    return max(len(line.encode()) for line in text.splitlines())


@pytest.fixture(scope="module")
def proxy() -> Iterator[str]:
    with serve_in_thread(FakeUpstream()) as up:
        settings = make_settings(("fake", up + "/v1"))
        settings.clients.header = CLIENT_HEADER
        settings.metrics.access_log = False
        settings.server.upstream_check_interval = 60
        with serve_in_thread(create_app(settings)) as url:
            yield url


def test_long_model_names_do_not_blow_up_metrics(proxy: str) -> None:
    """Regression: five chat requests with 2 MB model names made /metrics 330 MB; here 300 kB names,
    each was a label value of a dozen series."""
    with httpx.Client(timeout=30) as c:
        for i in range(5):
            model = f"{i}" + "m" * 300_000
            r = c.post(f"{proxy}/v1/chat/completions", json={**CHAT, "model": model, "stream": True})
            assert r.status_code == 200
        text = c.get(f"{proxy}/metrics").text
        om = c.get(f"{proxy}/metrics", headers=OM).text
        ui = c.get(f"{proxy}/ui/data").json()
    assert longest_line(text) <= MAX_LINE and longest_line(om) <= MAX_LINE
    assert len(text) < 1_000_000, len(text)
    assert all(len(m) <= MAX_LABEL_CHARS for m in ui["latency"])


def test_the_shared_label_file_admits_only_sane_names(tmp_path: Path) -> None:
    """Regression: with --workers N, a long model name was appended to the label file every worker
    reads. A name over 256 characters, or with a control character, is `other` and never written."""
    labels = ModelLabels(None, 100, str(tmp_path))
    assert labels("x" * (MAX_LABEL_CHARS + 1)) == OTHER
    assert labels("bad\x00name") == OTHER and labels("bad\rname") == OTHER and labels("tab\tname") == OTHER
    assert labels("x" * MAX_LABEL_CHARS) == "x" * MAX_LABEL_CHARS
    assert labels("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    shared = (tmp_path / "infertap_model_labels.txt").read_text().splitlines()
    assert shared == ["x" * MAX_LABEL_CHARS, "Qwen/Qwen2.5-7B-Instruct"]


# -- the class: whatever clients send -------------------------------------------------------------

# Model names: any text (JSON carries every code point, control characters included), some of it
# long; header values: any bytes HTTP lets through (h11 refuses control characters itself).
MODEL_NAMES = st.one_of(
    st.text(min_size=1),
    st.text(min_size=200, max_size=400),
    st.builds(lambda c, n: c * n, st.characters(), st.integers(1, 5000)),
)
HEADER_BYTES = st.binary(max_size=300).map(
    lambda b: bytes(x for x in b if x == 9 or 32 <= x < 127 or x >= 128).strip(b" \t")
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(requests=st.lists(st.tuples(MODEL_NAMES, HEADER_BYTES, st.booleans()), min_size=1, max_size=3))
@pytest.mark.timeout(0)  # a long run (INFERTAP_LABEL_EXAMPLES) takes minutes
def test_whatever_clients_send_every_metrics_line_stays_bounded(
    proxy: str, requests: list[tuple[str, bytes, bool]]
) -> None:
    with httpx.Client(timeout=30) as c:
        for model, client, stream in requests:
            body = json.dumps({**CHAT, "model": model, "stream": stream})  # ASCII: escapes for the rest
            headers = [(b"content-type", b"application/json")]
            if client:
                headers.append((CLIENT_HEADER.encode(), client))
            c.post(f"{proxy}/v1/chat/completions", content=body, headers=headers)
        text = c.get(f"{proxy}/metrics").text
        om = c.get(f"{proxy}/metrics", headers=OM).text
        ui = c.get(f"{proxy}/ui/data").json()
    assert longest_line(text) <= MAX_LINE and longest_line(om) <= MAX_LINE
    # Every model and client label value is on a request counter's line (each request ends there);
    # those lines still parse.
    counters = "\n".join(ln for ln in text.splitlines() if ln.startswith("infertap_requests_total{"))
    for family in text_string_to_metric_families(counters):
        for sample in family.samples:
            model, client = sample.labels.get("model", ""), sample.labels.get("client", "")
            assert len(model) <= MAX_LABEL_CHARS and model.isprintable(), repr(model[:80])
            assert len(client) <= 64 and client.isprintable(), repr(client[:80])
    assert all(len(m) <= MAX_LABEL_CHARS and m.isprintable() for m in ui["latency"])


@settings(max_examples=EXAMPLES * 5, deadline=None)
@given(names=st.lists(st.one_of(MODEL_NAMES, HEADER_BYTES.map(lambda b: b.decode("latin-1"))), max_size=20))
def test_shared_label_files_hold_only_bounded_names(
    names: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Whatever names come, every name a worker writes for the others is short and printable, and
    every label value handed out is either such a name or `other`."""
    where = tmp_path_factory.mktemp("labels")
    models = ModelLabels(None, 10, str(where))
    clients = HeaderNames(CLIENT_HEADER, 10, str(where))
    for name in names:
        for labels in (models, clients):
            got = labels(name)
            assert got in (name, OTHER, "none", "anonymous")
            assert len(got) <= MAX_LABEL_CHARS and got.isprintable()
    for file in where.iterdir():
        for line in file.read_text(encoding="utf-8").split("\n")[:-1]:
            assert 0 < len(line) <= MAX_LABEL_CHARS and line.isprintable(), repr(line[:80])
