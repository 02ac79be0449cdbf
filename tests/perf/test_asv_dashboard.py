"""The published asv dashboard works with no network (fp8rl.perf.asv_offline), and the conformance track benchmarks.

The render test publishes a real asv dashboard (a two-commit demo project, asv 0.6.6 as locked), makes it offline,
serves the folder on 127.0.0.1 and opens it in headless Chromium with every other host unreachable: no console
problem, every vendored file served, and flot has drawn a benchmark graph. The same page as asv publishes it fails
there ("Can not determine continental origin of swallow"): the test can tell the two apart.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fp8rl.perf import asv_offline as AO
from support import REPO_ROOT

SWALLOW = "continental origin of swallow"
#: browser log lines that mean the page had a problem (as tests/harness/test_reports.py reads Chromium's log)
BROWSER_PROBLEM = re.compile(r":CONSOLE[:(]|CONSOLE\(\d+\)|Uncaught|Refused to|Content Security Policy|net::ERR_")
BENCH = "bench_demo.Demo.track_value"


# ---------------------------------------------------------------------------------------------------------------
# the rewrite, without a browser


def _fake_modules(root: Path, versions: dict[str, str] | None = None) -> Path:
    """A node_modules tree holding every asset file (placeholder contents) at the locked versions."""
    want = AO.locked_versions()
    for a in AO.ASSETS:
        meta = root / a.package / "package.json"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"name": a.package, "version": (versions or {}).get(a.package, want[a.package])}))
        for p in (a.path, *a.extra):
            (root / a.package / p).parent.mkdir(parents=True, exist_ok=True)
            (root / a.package / p).write_text(f"/* {a.package} {p} */")
    return root


def _asv_index() -> str:
    import asv

    return (Path(asv.__file__).parent / "www" / "index.html").read_text()


def test_every_cdn_load_of_asv_index_html_has_a_local_copy_exact():
    """The installed asv's own index.html: after the rewrite no script or stylesheet points off the folder, and the
    rewritten tags point exactly at the ASSETS' local paths."""
    page, unknown = AO.rewrite_html(_asv_index())
    assert unknown == []
    assert "https://cdn" not in page and "code.jquery.com" not in page and "integrity=" not in page
    for a in AO.ASSETS:
        assert f'"{AO.local_path(a)}"' in page, a.url
    assert AO.CSP in page
    assert AO.rewrite_html(page) == (page, [])  # idempotent


def test_unknown_external_script_is_refused_and_plain_links_are_left_alone():
    page = ('<html><head><link rel="shortcut icon" href="https://example.invalid/x.ico">'
            '<script src="https://cdn.example.invalid/other.js"></script></head></html>')
    out, unknown = AO.rewrite_html(page)
    assert unknown == ["https://cdn.example.invalid/other.js"]
    assert 'href="https://example.invalid/x.ico"' in out  # an icon link loads nothing the page needs


def test_make_offline_copies_rewrites_and_checks_versions(tmp_path):
    html = tmp_path / "html"
    html.mkdir()
    (html / "index.html").write_text(_asv_index())
    done = AO.make_offline(html, _fake_modules(tmp_path / "nm"))
    assert done["rewritten"] == ["index.html"]
    for a in AO.ASSETS:
        for p in (a.path, *a.extra):
            assert (html / AO.local_path(a, p)).read_text() == f"/* {a.package} {p} */"
    assert "vendor/bootstrap/dist/fonts/glyphicons-halflings-regular.woff" in done["copied"]  # beside the CSS
    bad = _fake_modules(tmp_path / "nm-bad", {"jquery": "3.7.0"})
    with pytest.raises(AO.OfflineError, match=r"jquery: installed 3.7.0, package-lock.json says 3.3.1"):
        AO.make_offline(html, bad)
    with pytest.raises(AO.OfflineError, match="has no index.html"):
        AO.make_offline(tmp_path / "nm", tmp_path / "nm")
    assert AO.main([str(tmp_path / "nowhere")]) == 1


def test_lock_pins_asvs_versions_and_stupidtable_1_1_3():
    """package.json asks for exactly the versions of asv 0.6.6's CDN URLs (stupidtable: the registry's only 1.1.3),
    and the lock agrees with it."""
    pkg = json.loads((AO.VENDOR_DIR / "package.json").read_text())["dependencies"]
    assert pkg == AO.locked_versions()
    for a in AO.ASSETS:
        if a.package != "stupid-table-plugin":
            assert pkg[a.package] in a.url, (a.package, a.url)
    assert pkg["stupid-table-plugin"] == "1.1.3"


# ---------------------------------------------------------------------------------------------------------------
# conformance counts as asv track values


def _write_report(folder: Path, engine: str, checks: list[dict], duration_s: float) -> None:
    """A minimal valid conformance report.json of ``engine`` with ``checks`` into ``folder``."""
    from fp8rl.reports import summarize

    report = {"schema_version": "1.0", "suite": {"name": "fp8rl", "version": "0.1.0"}, "kind": "conformance",
              "engine": {"name": engine, "version": "1", "capabilities": {}},
              "environment": {"python": "3.11", "torch": "2.13.0", "numpy": "2.4", "platform": "linux",
                              "device": "cpu", "cpu": "x"}, "profile": "ci", "seed": 0,
              "started_at": "2026-12-01T00:00:00+00:00", "duration_s": duration_s, "command": ["fp8rl"],
              "summary": summarize(checks), "checks": checks, "warnings": [], "sections": {}}
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps(report))


def test_conformance_tracks_read_the_reports_named_by_the_env_var(tmp_path, monkeypatch):
    import importlib

    for name, outcomes in (("torch", {"Q-1": "passed", "Q-2": "xfailed"}), ("vllm", {"Q-1": "failed", "Q-2": "skipped"})):
        checks = [{"id": cid, "area": "quantization", "title": "t", "nodeid": f"n::{cid}", "case": "", "outcome": o,
                   "message": "", "bound": None, "metrics": {}, "duration_s": 0.0} for cid, o in outcomes.items()]
        _write_report(tmp_path / name / "seed-0", name, checks, 12.5)
    monkeypatch.syspath_prepend(str(REPO_ROOT / "perf"))
    monkeypatch.setenv("FP8RL_ASV_REPORTS", os.pathsep.join([str(tmp_path / "torch"), str(tmp_path / "vllm")]))
    import benchmarks.bench_conformance as bc

    bc = importlib.reload(bc)
    assert bc.Conformance.params == ["torch", "vllm"]
    b = bc.Conformance()
    b.setup("torch")
    assert (b.track_passed("torch"), b.track_xfailed("torch"), b.track_failed_or_error("torch"),
            b.track_wall_s("torch")) == (1, 1, 0, 12.5)
    b.setup("vllm")
    assert (b.track_passed("vllm"), b.track_failed_or_error("vllm"), b.track_skipped("vllm")) == (0, 1, 1)
    with pytest.raises(NotImplementedError):  # asv records a skipped benchmark
        b.setup("sglang")
    # a second run of one engine over other areas (the vLLM tier's rollout run) is its own series, named by its areas
    rollout = json.loads((tmp_path / "vllm" / "seed-0" / "report.json").read_text())
    rollout.update(selection={"areas": ["e2e", "learning"], "keyword": None}, duration_s=300.0)
    (tmp_path / "vllm-rollout").mkdir()
    (tmp_path / "vllm-rollout" / "report.json").write_text(json.dumps(rollout))
    monkeypatch.setenv("FP8RL_ASV_REPORTS", os.pathsep.join(str(tmp_path / n) for n in ("torch", "vllm", "vllm-rollout")))
    bc = importlib.reload(bc)
    assert bc.Conformance.params == ["torch", "vllm", "vllm[e2e+learning]"]
    b = bc.Conformance()
    b.setup("vllm[e2e+learning]")
    assert b.track_wall_s("vllm[e2e+learning]") == 300.0
    monkeypatch.delenv("FP8RL_ASV_REPORTS")
    bc = importlib.reload(bc)
    assert bc.Conformance.params == ["(no FP8RL_ASV_REPORTS)"]


def test_mismatch_tracks_read_each_engines_e2e_k3_kl(tmp_path, monkeypatch):
    import importlib

    def check(case: str, outcome: str, k3: float | None) -> dict:
        return {"id": "E2E-MISMATCH-001", "area": "e2e", "title": "t", "nodeid": f"n::{case}", "case": case,
                "outcome": outcome, "message": "", "bound": "e2e_mismatch",
                "metrics": {} if k3 is None else {"k3_kl": k3}, "duration_s": 0.0}

    runs = {"reference": [check("tiny-qwen3-fp8-kv", "passed", 0.0015), check("tiny-qwen3-bf16", "passed", 2.7e-4)],
            "vllm": [check("tiny-qwen3-fp8-kv", "failed", 0.25), check("tiny-qwen3-bf16", "skipped", None),
                     check("tiny-qwen3-fp8-all", "error", 9.0)]}
    for name, checks in runs.items():
        _write_report(tmp_path / name, name, checks, 1.0)
    monkeypatch.syspath_prepend(str(REPO_ROOT / "perf"))
    monkeypatch.setenv("FP8RL_ASV_REPORTS", os.pathsep.join(str(tmp_path / n) for n in runs))
    import benchmarks.bench_conformance as bc

    bc = importlib.reload(bc)
    assert bc.Mismatch.params == (["reference", "vllm"], ["tiny-qwen3-bf16", "tiny-qwen3-fp8-kv"])
    b = bc.Mismatch()
    b.setup("vllm", "tiny-qwen3-fp8-kv")  # a failed check still measured its rollouts: the step to see
    assert b.track_k3_kl("vllm", "tiny-qwen3-fp8-kv") == 0.25
    assert b.track_k3_kl("reference", "tiny-qwen3-bf16") == 2.7e-4
    for engine, case in (("vllm", "tiny-qwen3-bf16"), ("vllm", "tiny-qwen3-fp8-all")):  # skipped / error: no value
        with pytest.raises(NotImplementedError):
            b.setup(engine, case)
    monkeypatch.delenv("FP8RL_ASV_REPORTS")
    assert importlib.reload(bc).Mismatch.params == (["(no FP8RL_ASV_REPORTS)"], ["(none)"])


# ---------------------------------------------------------------------------------------------------------------
# a real published dashboard in a real browser, with no network


DEMO = '''
class Demo:
    params = [1, 2]
    param_names = ["n"]

    def track_value(self, n):
        return 3 * n

    track_value.unit = "things"
'''


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """asv publish of a demo project with results at two commits; the html folder as asv writes it."""
    pytest.importorskip("asv")
    root = tmp_path_factory.mktemp("asv")
    repo = root / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "__init__.py").write_text("")
    (repo / "benchmarks" / "bench_demo.py").write_text(DEMO)
    _git(repo, "init", "-q")
    hashes = []
    for i in range(2):
        (repo / "n.txt").write_text(str(i))
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"c{i}")
        hashes.append(_git(repo, "rev-parse", "HEAD"))
    conf = root / "asv.conf.json"
    conf.write_text(json.dumps({
        "version": 1, "project": "demo", "project_url": "http://127.0.0.1/", "repo": str(repo), "branches": ["HEAD"],
        "environment_type": "existing", "benchmark_dir": str(repo / "benchmarks"), "env_dir": str(root / "env"),
        "results_dir": str(root / "results"), "html_dir": str(root / "html"), "hash_length": 8,
        "build_cache_size": 0}))
    env = {**os.environ, "HOME": str(root)}  # asv machine writes ~/.asv-machine.json
    asv = [sys.executable, "-m", "asv"]

    def run(*args: str) -> None:
        p = subprocess.run([*asv, *args, "--config", str(conf)], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    run("machine", "--yes", "--machine", "demo-box")
    for h in hashes:
        run("run", "--python=same", "--quick", "--machine", "demo-box", f"--set-commit-hash={h}")
    run("publish")
    return root / "html"


class _Handler(SimpleHTTPRequestHandler):
    log: list[tuple[str, int]]

    def log_request(self, code="-", size="-"):  # noqa: ARG002 - record instead of printing
        type(self).log.append((self.path.split("?")[0], int(code) if str(code).isdigit() else 0))

    def log_message(self, *args):
        pass


def _serve(folder: Path):
    handler = type("H", (_Handler,), {"log": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler.log


def _open_offline(chromium: str, url: str, profile: Path) -> tuple[str, str]:
    """(DOM after the page's scripts ran, browser log) with every host but 127.0.0.1 unresolvable and any proxied
    request sent to a closed port: the network is off for the page."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "--proxy-server=socks5://127.0.0.1:9",
           "--virtual-time-budget=20000", "--window-size=1300,900", "--dump-dom", url]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(profile)})
    return p.stdout, p.stderr


@pytest.fixture(scope="module")
def chromium() -> str:
    exe = next((p for p in map(shutil.which, ("chromium", "chromium-headless-shell", "chromium-browser",
                                               "google-chrome")) if p), None)
    if exe is None:
        pytest.skip("no chromium on PATH (CI installs it: apt-get install -y chromium)")
    return exe


def test_published_dashboard_draws_a_graph_offline_and_asvs_own_page_does_not(published, chromium, tmp_path):
    modules = AO.VENDOR_DIR / "node_modules"
    if not (modules / "jquery" / "package.json").is_file():
        pytest.skip(f"the dashboard's vendor packages are not installed: npm ci --ignore-scripts --prefix "
                    f"{AO.VENDOR_DIR} (nox -s asv_smoke runs it)")
    as_published, offline = tmp_path / "as-published", tmp_path / "offline"
    shutil.copytree(published, as_published)
    shutil.copytree(published, offline)
    AO.make_offline(offline, modules)

    server, log = _serve(offline)
    try:
        dom, browser_log = _open_offline(chromium, f"http://127.0.0.1:{server.server_port}/#{BENCH}",
                                         tmp_path / "p1")
    finally:
        server.shutdown()
    problems = [ln for ln in browser_log.splitlines() if BROWSER_PROBLEM.search(ln)]
    assert not problems, "\n".join(problems)
    assert SWALLOW not in dom
    assert 'class="flot-base"' in dom, dom[-3000:]  # flot drew the graph's canvas
    assert BENCH in dom  # the graph page of that benchmark
    vendor = {path: code for path, code in log if path.startswith("/vendor/")}
    for a in AO.ASSETS:
        assert vendor.get("/" + AO.local_path(a)) == 200, (a.url, sorted(vendor.items()))

    server, _ = _serve(as_published)
    try:
        dom, _ = _open_offline(chromium, f"http://127.0.0.1:{server.server_port}/#{BENCH}", tmp_path / "p2")
    finally:
        server.shutdown()
    assert SWALLOW in dom and 'class="flot-base"' not in dom


def test_parity_control_track_reads_the_nightlys_smallest_detected_strength(tmp_path, monkeypatch):
    """The dashboard's 'smallest σ detected' of each parity control is the nightly's parity-<control>/parity.json
    control.smallest_detected; a control the night did not run is a skipped benchmark, one never caught is NaN."""
    import math

    for control, smallest in (("noise", 2.0), ("wrong-policy", None)):
        (tmp_path / f"parity-{control}").mkdir()
        (tmp_path / f"parity-{control}" / "parity.json").write_text(json.dumps(
            {"control": {"name": control, "smallest_detected": smallest}}))
    monkeypatch.syspath_prepend(str(REPO_ROOT / "perf"))
    monkeypatch.setenv("FP8RL_ASV_PARITY", str(tmp_path))
    from benchmarks.bench_learning import ParityControls

    b = ParityControls()
    b.setup("noise")
    assert b.track_smallest_detected("noise") == 2.0
    b.setup("wrong-policy")
    assert math.isnan(b.track_smallest_detected("wrong-policy"))
    with pytest.raises(NotImplementedError):
        b.setup("inverted-ratio")
