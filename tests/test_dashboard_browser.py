"""The dashboard in a real headless browser (Debian's ``chromium``): its script runs,
fetches ``/status`` and ``/goodput`` and draws what an operator reads: the replicas with
their straggler scores and the goodput chart (an inline SVG); on a lighthouse serving
several jobs, the job its ``?job=`` names, with the job picker. Skipped, with the reason,
where no chromium is installed (``apt-get install chromium``)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile

import pytest

from test_ledger import run_rounds

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no headless browser: install Debian's chromium "
                                                        "(apt-get install chromium) to test the dashboard")


def _render(url: str) -> str:
    """The page's DOM after its script ran (virtual time: its timers fire without waiting)."""
    assert BROWSER is not None
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                              f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--dump-dom", url],
                             capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_dashboard_draws_replicas_scores_and_the_goodput_chart(lighthouse, client) -> None:
    lh = lighthouse(min_replicas=2, http_bind="127.0.0.1:0")
    run_rounds(client(lh), ["group_a", "group_b"], range(8))
    dom = _render(f"{lh.http_address()}/")
    assert "group_a" in dom and "group_b" in dom, dom[-3000:]
    chart = re.search(r'<svg id="gp-chart".*?</svg>', dom, re.S)
    assert chart is not None and chart.group(0).count("<polygon") >= 1 and "<polyline" in chart.group(0), dom[-3000:]
    assert re.search(r'<section id="goodput"(?![^>]*hidden)', dom), "the goodput section stayed hidden"
    assert re.search(r'id="gp-value">80\.0%<', dom), dom[-3000:]  # the ledger's 0.8, as the page shows it
    assert re.search(r'<label[^>]*id="job-picker"[^>]*hidden', dom), "one job: the job picker should stay hidden"


def test_dashboard_shows_the_job_its_url_names(lighthouse, client) -> None:
    """Two jobs on one lighthouse: ``/?job=b`` draws job b's replicas, not a's, and the job
    picker (filled from /jobs) shows both with b chosen; every request carried ``job=b``."""
    lh = lighthouse(min_replicas=1, http_bind="127.0.0.1:0")
    client(lh, job="a").heartbeat("replica_of_a")
    client(lh, job="b").heartbeat("replica_of_b")
    dom = _render(f"{lh.http_address()}/?job=b")
    assert "replica_of_b" in dom and "replica_of_a" not in dom, dom[-3000:]
    picker = re.search(r'<label[^>]*id="job-picker"[^>]*>.*?</label>', dom, re.S)
    assert picker is not None and "hidden" not in picker.group(0).split(">", 1)[0], dom[-3000:]
    options = dict(re.findall(r'<option value="([^"]+)"([^>]*)>', picker.group(0)))
    assert {"a", "b", "default"} <= set(options), picker.group(0)
    assert "selected" in options["b"] and "selected" not in options["a"], picker.group(0)
    assert "<title>rallypoint lighthouse: b</title>" in dom
    dom = _render(f"{lh.http_address()}/?job=a")  # the other job, by the same route the picker takes
    assert "replica_of_a" in dom and "replica_of_b" not in dom, dom[-3000:]


def test_dashboard_shows_each_groups_last_complete_checkpoint(lighthouse, client) -> None:
    from test_ledger import ask_concurrently, assert_one_quorum, report

    lh = lighthouse(min_replicas=2, http_bind="127.0.0.1:0")
    c = client(lh)
    ckpt = {"group_a": {"step": 60, "age_s": 30.0, "writes": 2, "bytes": 100, "failures": 0},
            "group_b": {"writes": 0, "failures": 3}}
    for step in range(3):
        answers = ask_concurrently(c, list(ckpt), timeout=10.0, kw_for=lambda rid: {
            "step": step, "data": report(step - 1, ckpt=ckpt[rid]) if step else ""})
        assert_one_quorum(answers, list(ckpt))
    dom = _render(f"{lh.http_address()}/")
    assert re.search(r">step 60, [0-9.]+ s ago<", dom), dom[-3000:]
    assert re.search(r'<span class="warn">none yet</span>', dom), dom[-3000:]  # group_b: failures, no checkpoint
