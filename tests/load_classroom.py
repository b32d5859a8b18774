"""A classroom in one command: N headless learners click through chapter 00's lab at once.

    .venv/bin/python tests/load_classroom.py --learners 4 --steps 5

Starts `streamlit run app.py` on a free 127.0.0.1 port (with .streamlit/config.toml), or measures
a server already running (--url and --pid), or several behind a proxy (--url of the proxy, --pid
of every replica: their CPU and RSS are summed; deploy/classroom.py, docs/deploy.md). One warm-up
learner first loads the page and steps, alone: that is the one-learner level. Then the wave:
every learner opens chapter 00 in its own browser context (its own Streamlit session), queues a
prompt carrying its own marker and presses "다음 스텝" --steps times; all learners click at the
same time. Printed:

  click latency p50/p90 (click → the app idle again), server CPU seconds per click (from
  /proc/<pid>/stat), server RSS at start, with one learner, at the wave's peak and after the wave
  left (the reaper releases engines LLM_LAB_SESSION_TTL_S after a tab closes; this script sets
  a short TTL when it starts the server), whether each learner saw only its own request, and
  (behind deploy/'s proxy) which replica served each learner (its X-LLM-Lab-Replica header).
The server it starts gets OMP_WAIT_POLICY=PASSIVE (the classroom's serving setting, README) unless
--omp-wait-policy says otherwise.

Needs Chromium (Debian's /usr/bin/chromium or $CHROMIUM) and playwright (requirements.txt).
Client browsers run on the same machine as the server: on a small box they compete for its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from _browser import CHROMIUM_ARGS, IDLE, RUNNING, find_chromium, start_streamlit, stop_process

MB = 1 << 20
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def servers_cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds of the app's processes together (several replicas behind a proxy)."""
    return sum(cpu_seconds(pid) for pid in pids)


def descendants_cpu_seconds(root: int, exclude: Iterable[int] = ()) -> float:
    """CPU seconds of every live process below `root`, leaving out those in `exclude` and
    whatever runs below them (here: below this script, without the Streamlit servers it started,
    are the headless Chromium's browser, GPU and renderer processes: what the learners' browsers
    cost)."""
    exclude = set(exclude)
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    total = 0.0
    for pid in parent:
        p, seen = pid, 0
        while p in parent and p != root and p not in exclude and seen < 64:
            p, seen = parent[p], seen + 1
        if p == root and pid != root:
            try:
                total += cpu_seconds(pid)
            except (OSError, ValueError, IndexError):
                pass
    return total


def rss_mb(pids: int | Iterable[int]) -> float:
    """Resident memory of a process, or of several together, in MB."""
    total = 0.0
    for pid in (pids,) if isinstance(pids, int) else pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
                break
        else:
            return float("nan")
    return total


class Server:
    """`streamlit run app.py` on 127.0.0.1 with the classroom's environment."""

    def __init__(
        self, log_path: Path, env: dict[str, str], app: str = "app.py", start_timeout_s: float = 180
    ):
        self.status_file = Path(tempfile.mkdtemp(prefix="llm-lab-")) / "status.json"
        full_env = {**os.environ, "LLM_LAB_STATUS_FILE": str(self.status_file), **env}
        self.log_path = log_path
        self.proc, self.url = start_streamlit(log_path, app, full_env, start_timeout_s)
        self.pid = self.proc.pid

    def status(self) -> dict | None:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        stop_process(self.proc)


@dataclass
class Learner:
    index: int
    marker: str
    clicks_s: list[float] = field(default_factory=list)
    load_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    saw_own: bool = False
    body: str = ""
    clicks_cpu_s: float | None = None  # server CPU over this learner's clicks (alone: per click)
    replica: str | None = None  # the proxy's X-LLM-Lab-Replica: which app process served it


async def _wait_run(page, timeout_ms: int) -> None:
    try:
        await page.wait_for_selector(RUNNING, timeout=1500)
    except Exception:  # noqa: BLE001 - the run may have finished before we looked
        pass
    await page.wait_for_selector(IDLE, timeout=timeout_ms)


# Armed before the click, in the page: resolves when the app's script state has gone to
# "running" and back to "notRunning". A MutationObserver sees every change of the attribute, so a
# run that starts and ends between two polls is not missed (polling for "running" first, as
# _wait_run does, waits out its 1.5 s timeout when the run was already over).
_ARM_RUN_WATCH = """() => {
  const app = document.querySelector("[data-testid='stApp']");
  window.__llmLabRunDone = new Promise((resolve) => {
    let ran = false;
    const observer = new MutationObserver((records) => {
      // Both changes may land before this callback runs: the records keep the old values.
      const state = app.getAttribute("data-test-script-state");
      if (state === "running" || records.some((r) => r.oldValue === "running")) ran = true;
      if (ran && state === "notRunning") { observer.disconnect(); resolve(true); }
    });
    observer.observe(app, {
      attributes: true, attributeOldValue: true, attributeFilter: ["data-test-script-state"],
    });
    // A click that starts no run at all (seen under load) resolves after 1.5 s, reported apart.
    setTimeout(() => {
      if (!ran && app.getAttribute("data-test-script-state") === "notRunning") {
        observer.disconnect(); resolve(false);
      }
    }, 1500);
  });
}"""


NO_RUN_CLICKS: list[str] = []  # clicks after which no script run was seen


async def _click(page, name: str, timeout_ms: int) -> float:
    """Seconds from the click until the app is idle again after the run the click started."""
    button = page.get_by_role("button", name=name, exact=True).first
    await button.scroll_into_view_if_needed()
    await page.evaluate(_ARM_RUN_WATCH)
    t0 = time.perf_counter()
    await button.click()
    ran = await asyncio.wait_for(page.evaluate("window.__llmLabRunDone"), timeout_ms / 1000)
    if not ran:
        NO_RUN_CLICKS.append(name)
    return time.perf_counter() - t0


async def run_learner(
    browser,
    url: str,
    learner: Learner,
    steps: int,
    start: asyncio.Event,
    timeout_ms: int,
    keep_open: asyncio.Event | None = None,
    pids: tuple[int, ...] = (),
) -> None:
    context = await browser.new_context(viewport={"width": 1280, "height": 900}, locale="ko-KR")
    page = await context.new_page()
    page.set_default_timeout(timeout_ms)
    try:
        t0 = time.perf_counter()
        response = await page.goto(url)
        learner.replica = response.headers.get("x-llm-lab-replica") if response else None
        await page.wait_for_selector("[data-testid='stApp']")
        await _wait_run(page, timeout_ms)
        learner.load_s = time.perf_counter() - t0
        await page.get_by_label("직접 쓴 프롬프트").fill(
            f"{learner.marker}: 한 문장으로 인사해 주세요."
        )
        await _click(page, "요청 추가", timeout_ms)
        await start.wait()  # everybody clicks together
        cpu0 = servers_cpu_seconds(pids) if pids else None
        for _ in range(steps):
            learner.clicks_s.append(await _click(page, "다음 스텝", timeout_ms))
        if cpu0 is not None:
            learner.clicks_cpu_s = servers_cpu_seconds(pids) - cpu0
        body = await page.inner_text("body")
        learner.saw_own = learner.marker in body
        exceptions = page.locator("[data-testid='stException']")
        for i in range(await exceptions.count()):
            learner.errors.append(await exceptions.nth(i).inner_text())
        if "교실이 가득 찼습니다" in body:
            learner.errors.append("classroom full")
        learner.body = body
        if keep_open is not None:
            await keep_open.wait()
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the other learners go on
        learner.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        await context.close()  # the tab closes: its websocket goes, the reaper takes it from here


async def _wait_engines_released(status, wait_s: float) -> float | None:
    """Seconds until the server's status file reports no engines (None: not within wait_s)."""
    t0 = time.perf_counter()
    while status is not None and time.perf_counter() - t0 < wait_s:
        s = status()
        if s is not None and s["time"] > time.time() - 5 and s.get("engines") == 0:
            elapsed = time.perf_counter() - t0
            await asyncio.sleep(2)  # let malloc_trim's effect settle before reading RSS
            return elapsed
        await asyncio.sleep(1)
    return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def classroom(
    url: str,
    pid: int | Iterable[int],
    learners: int,
    steps: int,
    timeout_ms: int,
    reap_wait_s: float,
    status=None,
    log=print,
) -> dict:
    """Run the one-learner level and the wave against `url`; `pid` is the app's process, or the
    processes of every replica behind a proxy (CPU and RSS are their sums)."""
    from playwright.async_api import async_playwright

    pids = (pid,) if isinstance(pid, int) else tuple(pid)

    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError(
            "no Chromium: install Debian's chromium (apt-get install chromium "
            "fonts-noto-cjk) or set $CHROMIUM"
        )
    tag = uuid.uuid4().hex[:6]
    result: dict = {
        "learners": learners,
        "steps": steps,
        "rss_start_mb": rss_mb(pids),
        "load_average_start": os.getloadavg(),
    }
    async with async_playwright() as p:
        browser = await p.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_ARGS
        )
        # 1. One learner alone: weights loaded, one engine, a few steps. The one-learner level.
        go = asyncio.Event()
        go.set()
        warm = Learner(-1, f"워밍업{tag}")
        await run_learner(browser, url, warm, steps, go, timeout_ms, pids=pids)
        result["one_learner_click_p50_s"] = percentile(warm.clicks_s, 0.5)
        result["one_learner_cpu_per_click_s"] = (warm.clicks_cpu_s or 0.0) / max(
            len(warm.clicks_s), 1
        )
        result["rss_one_learner_mb"] = rss_mb(pids)
        log(
            f"one learner: click p50 {result['one_learner_click_p50_s']:.2f} s, "
            f"{result['one_learner_cpu_per_click_s']:.3f} server CPU-s per click, "
            f"RSS {result['rss_one_learner_mb']:.0f} MB, errors {warm.errors or 'none'}"
        )
        # Let the reaper release the warm-up engine first, so that its gc and malloc_trim are not
        # counted in the wave's CPU seconds.
        if status is not None:
            await _wait_engines_released(status, reap_wait_s)
        # 2. The wave: N learners load, queue their own prompt, then click together.
        go = asyncio.Event()
        loaded = [Learner(i, f"학습자{i}표지{tag}") for i in range(learners)]
        closing = asyncio.Event()
        tasks = [
            asyncio.create_task(run_learner(browser, url, lr, steps, go, timeout_ms, closing))
            for lr in loaded
        ]
        # Wait until every learner has its request queued (its first click is the last before go).
        while sum(1 for lr in loaded if lr.load_s) < learners and not all(t.done() for t in tasks):
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        me = os.getpid()
        cpu0, t0 = servers_cpu_seconds(pids), time.perf_counter()
        client0 = descendants_cpu_seconds(me, exclude=pids)
        go.set()
        while any(len(lr.clicks_s) < steps and not lr.errors for lr in loaded):
            await asyncio.sleep(0.1)
        cpu1, t1 = servers_cpu_seconds(pids), time.perf_counter()
        client1 = descendants_cpu_seconds(me, exclude=pids)
        result["rss_peak_mb"] = rss_mb(pids)
        closing.set()
        await asyncio.gather(*tasks)
        await browser.close()
    clicks = [c for lr in loaded for c in lr.clicks_s]
    result.update(
        clicks=len(clicks),
        click_p50_s=percentile(clicks, 0.5),
        click_p90_s=percentile(clicks, 0.9),
        wave_wall_s=t1 - t0,
        server_cpu_s=cpu1 - cpu0,
        server_cpu_per_click_s=(cpu1 - cpu0) / max(len(clicks), 1),
        client_cpu_per_click_s=(client1 - client0) / max(len(clicks), 1),
        clicks_without_a_run=len(NO_RUN_CLICKS),
        clicks_s=sorted(round(c, 3) for c in clicks),
        page_load_p50_s=percentile([lr.load_s for lr in loaded if lr.load_s], 0.5),
        errors={lr.index: lr.errors for lr in loaded if lr.errors},
        isolation_ok=all(
            lr.saw_own and not [o.marker for o in loaded if o is not lr and o.marker in lr.body]
            for lr in loaded
        ),
    )
    result["learner_bodies"] = {lr.index: lr.body for lr in loaded}
    result["markers"] = {lr.index: lr.marker for lr in loaded}
    result["replicas"] = {lr.index: lr.replica for lr in [warm, *loaded] if lr.replica}
    # 3. Everybody has left. Nobody else connects: only the reaper can give the memory back.
    result["load_average_wave"] = os.getloadavg()
    result["engines_released_after_s"] = await _wait_engines_released(status, reap_wait_s)
    result["rss_after_mb"] = rss_mb(pids)
    result["status_after"] = status() if status else None
    return result


def report(r: dict) -> str:
    after = r["engines_released_after_s"]
    released = (
        f"{after:.0f} s after the tabs closed" if after is not None else "NOT within the wait"
    )
    lines = [
        f"learners {r['learners']} × {r['steps']} steps = {r['clicks']} clicks on chapter 00",
        f"  click latency  p50 {r['click_p50_s']:.2f} s   p90 {r['click_p90_s']:.2f} s   "
        f"(one learner alone: p50 {r['one_learner_click_p50_s']:.2f} s)",
        f"  page load p50  {r['page_load_p50_s']:.2f} s",
        f"  server CPU     {r['server_cpu_s']:.1f} s over {r['wave_wall_s']:.1f} s wall = "
        f"{r['server_cpu_per_click_s']:.3f} CPU-s per click "
        f"(one learner alone: {r['one_learner_cpu_per_click_s']:.3f})",
        f"  browsers' CPU  {r['client_cpu_per_click_s']:.3f} CPU-s per click (the headless "
        "Chromium processes of this script, on the same cores)",
        f"  clicks that started no run: {r['clicks_without_a_run']} (each counted as 1.5 s)",
        "  load average   "
        + " → ".join(
            "/".join(f"{x:.1f}" for x in r[k]) for k in ("load_average_start", "load_average_wave")
        )
        + " (1/5/15 min, at the start and after the wave; other jobs share the machine)",
        f"  server RSS     start {r['rss_start_mb']:.0f} MB, "
        f"one learner {r['rss_one_learner_mb']:.0f} MB, "
        f"wave peak {r['rss_peak_mb']:.0f} MB, after the wave left {r['rss_after_mb']:.0f} MB "
        f"({r['rss_after_mb'] - r['rss_one_learner_mb']:+.0f} MB vs one learner)",
        f"  engines released {released}",
        "  isolation      "
        + ("each learner saw only its own request" if r["isolation_ok"] else "BROKEN"),
        f"  errors         {r['errors'] or 'none'}",
    ]
    if r.get("replicas"):
        spread = Counter(r["replicas"].values())
        lines.append(
            "  replicas       "
            + ", ".join(f"{name}: {n} learners" for name, n in sorted(spread.items()))
            + " (the proxy's X-LLM-Lab-Replica; the warm-up learner is index -1)"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--url", help="a running app (default: start one here)")
    ap.add_argument(
        "--pid",
        type=lambda text: [int(p) for p in text.split(",")],
        help="the running app's process id (with --url); behind a proxy, every replica's, "
        "comma-separated (deploy/classroom.py prints them)",
    )
    ap.add_argument(
        "--ttl", type=float, default=15, help="LLM_LAB_SESSION_TTL_S of the server started here"
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds one click may take")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of the server started here (README, Classroom: idle OpenMP threads "
        "sleep instead of spinning on cores the other learners need); '' inherits this shell's",
    )
    ap.add_argument(
        "--app",
        default="app.py",
        help="the app file to start "
        "(tests/classroom_fragment_app.py: chapter 00's lab in a fragment)",
    )
    args = ap.parse_args()
    server = None
    if args.url:
        if not args.pid:
            ap.error("--url needs --pid (the server's process, for CPU and RSS)")
        url, pid, status = args.url, args.pid, None
    else:
        log = Path(tempfile.mkdtemp(prefix="llm-lab-")) / "streamlit.log"
        env = {"LLM_LAB_SESSION_TTL_S": str(args.ttl), "LLM_LAB_REAP_INTERVAL_S": "2"}
        if args.omp_wait_policy:
            env["OMP_WAIT_POLICY"] = args.omp_wait_policy
        server = Server(log, env, app=args.app)
        url, pid, status = server.url, server.pid, server.status
        print(f"server {url} pid {pid} (log {log})")
    try:
        r = asyncio.run(
            classroom(
                url,
                pid,
                args.learners,
                args.steps,
                int(args.timeout * 1000),
                reap_wait_s=args.ttl + 120,
                status=status,
            )
        )
    finally:
        if server:
            server.stop()
    print(report(r))
    if args.json:
        r.pop("learner_bodies", None)
        Path(args.json).write_text(json.dumps(r, indent=2, ensure_ascii=False))
    return 0 if not r["errors"] and r["isolation_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
