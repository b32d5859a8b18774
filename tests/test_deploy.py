"""The classroom deployment of docs/deploy.md: two `streamlit run app.py` replicas behind nginx with
sticky sessions and the engine server beside them (deploy/classroom.py renders
deploy/nginx.conf.template and starts everything on free 127.0.0.1 ports, no root needed).

The slow test runs the load script (tests/load_classroom.py) through the proxy and checks that
the learners were spread over both replicas (the proxy's X-LLM-Lab-Replica header on each
learner's page), stayed there (every websocket in nginx's access log went to the replica its
cookie names), were isolated (each saw only its own request, no errors), and that each replica's
own registry built and released the engines of the learners sent to it (its status file). It
also streams a completion from the engine server through the proxy's /v1/ and checks the proxy's
own 413 in OpenAI's error shape. Skips only where nginx or Chromium is missing."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from _browser import find_chromium

from deploy.classroom import Classroom, ProxyLimits, find_nginx, free_port, render_nginx_config

LEARNERS, STEPS, TTL_S = 3, 2, 3
NO_NGINX = "no nginx binary found: apt-get install nginx (.ci/run does) to run the deploy tests"


def test_the_config_pins_each_replica_and_fills_every_placeholder():
    conf = render_nginx_config([8501, 8502, 8503], 8000, "80", "/var/lib/llm-lab")
    assert not re.search(r"\{\{\w+\}\}", conf)
    for i, port in enumerate((8501, 8502, 8503)):
        assert f"r{i} llm_lab_r{i};" in conf  # the cookie names the replica's own upstream
        block = re.search(rf"upstream llm_lab_r{i} \{{(.*?)\}}", conf, re.S).group(1)
        primary = [line for line in block.splitlines() if "backup" not in line and "server" in line]
        assert primary == [f"        server 127.0.0.1:{port} max_fails=1 fail_timeout=10s;"]
        assert block.count("backup") == 2
    assert "proxy_buffering off;" in conf.split("location /v1/")[1].split("}")[0]
    assert "daemon off;" in conf


def test_nginx_accepts_the_rendered_config(tmp_path):
    nginx = find_nginx()
    if nginx is None:
        pytest.skip(NO_NGINX)
    for temp in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp_path / "temp" / temp).mkdir(parents=True)
    conf = tmp_path / "nginx.conf"
    listen = f"127.0.0.1:{free_port()}"
    conf.write_text(render_nginx_config([8501, 8502], 8000, listen, tmp_path, ProxyLimits()))
    check = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path), "-c", str(conf), "-e", "stderr"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr


def _stream_through_proxy(url: str) -> list[str]:
    """POST a streamed completion to the proxy's /v1/ and return the SSE data lines."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"prompt": "Hello", "max_tokens": 8, "stream": True, "temperature": 0})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.getheader("Content-Type", "").startswith("text/event-stream")
    assert response.getheader("Content-Length") is None  # streamed, not buffered whole
    lines = [line.decode().strip() for line in response if line.startswith(b"data: ")]
    conn.close()
    return lines


def _too_large_through_proxy(url: str, max_bytes: int) -> tuple[int, dict]:
    """A request head that announces a body over the proxy's limit: refused before the body."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(max_bytes + 1))
    conn.endheaders()
    response = conn.getresponse()
    status, body = response.status, json.loads(response.read())
    conn.close()
    return status, body


def _check_engine_api(url: str) -> None:
    events = _stream_through_proxy(url)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert len(chunks) >= 2 and chunks[0]["object"] == "text_completion"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    status, body = _too_large_through_proxy(url, 2 << 20)
    assert status == 413 and body["error"]["code"] == "request_too_large", body


def _wait_released(room: Classroom, wanted: dict[str, int], wait_s: float = 60) -> dict:
    """Each replica's status file once it holds no engine and has released at least
    `wanted[replica]` (or the last figures seen at the deadline)."""
    deadline, seen = time.monotonic() + wait_s, {}
    while time.monotonic() < deadline:
        for i in range(room.replicas):
            try:
                seen[f"r{i}"] = json.loads(room.status_file(i).read_text())
            except (OSError, ValueError):
                pass
        if all(
            name in seen and seen[name]["engines"] == 0 and seen[name]["released_engines"] >= n
            for name, n in wanted.items()
        ):
            break
        time.sleep(0.5)
    return seen


def _app_requests(access_log: Path) -> list[tuple[str, str, str]]:
    """(request line, replica that served, replica the cookie named) of every request to the app
    in nginx's access log (a websocket is logged when it closes)."""
    rows = []
    for line in access_log.read_text().splitlines():
        served = re.search(r" replica=(\S*)", line).group(1)
        if served:  # an app replica served it (the engine's lines have none)
            request = re.search(r'"([^"]*)"', line).group(1)
            rows.append((request, served, re.search(r" cookie=(\S*)", line).group(1)))
    return rows


@pytest.mark.slow
@pytest.mark.browser
def test_two_replicas_behind_nginx_spread_and_isolate_learners(
    default_model_dir, tiny_model_dir, tmp_path
):
    if find_nginx() is None:
        pytest.skip(NO_NGINX)
    if find_chromium() is None:
        pytest.skip("no Chromium found: install Debian's chromium to run the browser tests")
    pytest.importorskip("playwright.async_api", reason="playwright is not installed")
    from load_classroom import classroom, report

    room = Classroom(
        replicas=2,
        listen=f"127.0.0.1:{free_port()}",
        replica_env={"LLM_LAB_SESSION_TTL_S": str(TTL_S), "LLM_LAB_REAP_INTERVAL_S": "1"},
        engine_args=["--model", str(tiny_model_dir), "--max-connections", "32"],
        run_dir=tmp_path / "deploy",
    )
    with room:
        _check_engine_api(room.url)
        pids = [room.procs["r0"].pid, room.procs["r1"].pid]
        r = asyncio.run(classroom(room.url, pids, LEARNERS, STEPS, 120_000, reap_wait_s=0))
        print("\n" + report(r))
        per_replica = Counter(r["replicas"].values())
        released = _wait_released(room, dict(per_replica))
    logs = {name: room.log(name).read_text() for name in room.procs}
    assert not r["errors"] and r["isolation_ok"], (r["errors"], logs["r0"][-2000:])
    assert r["clicks"] == LEARNERS * STEPS
    # Spread: every learner (and the warm-up one) got a replica, and both replicas got learners.
    assert len(r["replicas"]) == LEARNERS + 1, r["replicas"]
    assert set(per_replica) == {"r0", "r1"}, r["replicas"]
    wave = Counter(replica for i, replica in r["replicas"].items() if i >= 0)
    assert set(wave) == {"r0", "r1"}, r["replicas"]
    # Sticky: every request that carried the cookie (the websockets among them) went to the
    # replica it names. (Without the cookie's map, round robin sends them anywhere.)
    requests = _app_requests(room.run_dir / "access.log")
    sockets = [row for row in requests if row[0].startswith("GET /_stcore/stream")]
    assert len(sockets) >= LEARNERS + 1 and all(cookie != "-" for _, _, cookie in sockets), sockets
    strays = [row for row in requests if row[2] != "-" and row[1] != row[2]]
    assert not strays, strays
    # Each replica's own registry built and released the engines of the learners sent to it.
    for name, learners in per_replica.items():
        assert released[name]["released_engines"] >= learners, (name, released)
        assert released[name]["engines"] == 0, (name, released)
    for name, text in logs.items():
        assert "Traceback" not in text, (name, text[-3000:])
    # nginx itself: no failure to open its temp files (a large response spills there), nothing
    # worse than the 413's "[error]" line.
    errors = (room.run_dir / "error.log").read_text()
    assert not re.search(r"\[(crit|alert|emerg)\]", errors), errors
