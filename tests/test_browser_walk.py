"""A learner's walk through every chapter, in a real browser on the real default model.

For each chapter 00–16: open the page, put its default work into its lab (the workload, or the
first example request), step it three times, check that the sidebar's 엔진 상태 reads the same
engine at the same step as the lab's counters, reload the page and find the same step again, then
run the lab to the end and check what the learner sees: no refusal warning, no U+FFFD, no
exception. A screenshot of each finished lab goes to tests/screenshots/walk_chNN.png (and to
docs/screenshots/ with UPDATE_DOC_SHOTS=1). At the end the server's log holds no traceback.

(정지 interrupting 끝까지 within one step is tests/test_lab_state_browser.py's.)"""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
from _browser import ROOT, SHOTS, LabDriver, chapter_fixtures, click_button, wait_run_over

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TIMEOUT_MS = 240_000
DOC_SHOTS = ROOT / "docs" / "screenshots"
CHAPTERS = [f"{i:02d}" for i in range(17)]
# A chapter whose lab has no step controls: the button that runs its default experiment.
NO_STEP_LAB = {"01": "HTTP 요청 보내기 (stream=True)", "05": "실행"}
LAB_COUNTER = re.compile(r"스텝 (\d+) · KV 블록 (\d+)/(\d+)")
SIDEBAR_STEP = re.compile(r"스텝 (\d+)")
SIDEBAR_KV = re.compile(r"KV 블록 (\d+)/(\d+) 사용")
REFUSALS = ("거절했습니다", "거절되었습니다", "받지 못했습니다")
# What a chapter's finished default run shows beyond the common checks: texts on the page and the
# least number of plots drawn with data (the lab checks of ch05, ch07, ch08 and ch10–13 live here,
# not in a second run of the same workload elsewhere).
SHOWS = {
    "05": (("메모리 예산 계산기",), 3),
    "06": ((), 1),
    "07": (("같은 워크로드, 세 가지 방식",), 6),
    "08": (("긴 프롬프트가 decode 중인",), 4),
    "10": (("요청별 비교", "decode 스텝은 켬·끔 모두", "측정값"), 3),
    "11": (
        ("decode 스텝 하나가 읽는 가중치", "측정 요약", "왜 이런 일치율인가", "최대 절대 오차 0"),
        2,
    ),
    "12": (
        ("tp 3 × pp 1", "워커가 가진 것", "전체 비교", "측정값", "제조사 문서", "all-reduce 60번"),
        5,
    ),
    "13": (("토큰 하나하나까지 같습니다", "이 실험이 보여 줄 것", "받아들임"), 3),
    "15": (("요청마다 건너간 길", "짧은 요청들의 토큰 간격", "측정값"), 2),
    "16": (("스텝마다 마스크가 한 일", "마스크가 지운 확률", "측정값"), 0),
}

app_url, page = chapter_fixtures("walk", TIMEOUT_MS)


def url_of(chapter_id: str) -> str:
    from ui.lesson import CHAPTERS as ALL

    return next(c.address for c in ALL if c.id == chapter_id)


def wait_idle(pg) -> None:
    """The click's script run and the sliced lab run it may have started (끝까지, N 스텝)."""
    wait_run_over(pg, TIMEOUT_MS)


def no_exception(pg) -> None:
    errors = pg.locator("[data-testid='stException']")
    assert errors.count() == 0, errors.first.inner_text()
    failed = pg.get_by_text("실험실을 그리지 못했습니다")
    assert failed.count() == 0, failed.first.inner_text()


def open_chapter(pg, base: str, chapter_id: str) -> None:
    pg.goto(f"{base}/{url_of(chapter_id)}")
    pg.wait_for_selector("[data-testid='stApp']")
    wait_idle(pg)
    dialogs = pg.locator("[role=dialog]")  # none since the app runs via ui/serve.py
    assert dialogs.count() == 0, dialogs.first.inner_text()
    no_exception(pg)


def button(pg, label: str):
    return pg.get_by_role("button", name=label, exact=True)


def click(pg, label: str) -> None:
    click_button(pg, label, TIMEOUT_MS)
    no_exception(pg)


def lab_counters(pg) -> list[tuple[int, int, int]]:
    main = pg.locator("[data-testid='stMain']").inner_text()
    return [tuple(int(x) for x in m) for m in LAB_COUNTER.findall(main)]


def sidebar_state(pg) -> tuple[int, int, int]:
    side = pg.locator("[data-testid='stSidebar']").inner_text()
    step, kv = SIDEBAR_STEP.search(side), SIDEBAR_KV.search(side)
    assert step and kv, f"the sidebar shows no engine state: {side[-600:]}"
    return int(step.group(1)), int(kv.group(1)), int(kv.group(2))


def sidebar_reads(pg, expected: tuple[int, int, int], timeout_s: float = 30.0) -> None:
    """The sidebar's 엔진 상태 reaches the lab's `expected` counters: it is drawn at the end of the
    lab's run (ui/lab.py, draw_status), after the counters, so a look in between sees the step
    before."""
    deadline = time.monotonic() + timeout_s
    while sidebar_state(pg) != expected and time.monotonic() < deadline:
        pg.wait_for_timeout(250)
    assert sidebar_state(pg) == expected, (sidebar_state(pg), expected)


def add_default_work(pg) -> None:
    for label in ("워크로드 넣기", "예시 요청 추가"):
        if button(pg, label).count():
            click(pg, label)
            return
    pytest.fail("the lab offers neither a workload nor an example request")


def run_to_end(pg) -> None:
    """끝까지, waited for to its end: every engine of the lab then has nothing running, nothing
    waiting and no request still to arrive."""
    click(pg, "끝까지")
    main = pg.locator("[data-testid='stMain']").inner_text()
    counts = re.findall(r"실행 (\d+) · 대기 (\d+)", main)
    assert counts and all(c == ("0", "0") for c in counts), counts
    assert "도착 전" not in main


def check_text(pg, chapter_id: str) -> None:
    body = pg.locator("[data-testid='stMain']").inner_text()
    assert "\ufffd" not in body, f"ch{chapter_id}: U+FFFD in the page"
    for word in REFUSALS:
        assert word not in body, f"ch{chapter_id}: a default request was refused ({word})"


def check_shows(pg, chapter_id: str) -> None:
    texts, min_plots = SHOWS.get(chapter_id, ((), 0))
    body = pg.locator("[data-testid='stMain']").inner_text()
    missing = [t for t in texts if t not in body]
    assert not missing, f"ch{chapter_id}: {missing} not on the page"
    with_data = [n for n in LabDriver.plot_traces(pg) if n > 0]
    assert len(with_data) >= min_plots, f"ch{chapter_id}: plots with data {with_data}"


def screenshot(pg, chapter_id: str) -> None:
    header = pg.get_by_role("heading", name="실험실").first
    if header.count():
        header.scroll_into_view_if_needed()
    path = SHOTS / f"walk_ch{chapter_id}.png"
    pg.screenshot(path=str(path))
    if os.environ.get("UPDATE_DOC_SHOTS") == "1":
        DOC_SHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, DOC_SHOTS / f"ch{chapter_id}.png")


def step_reload_and_finish(pg, base: str, chapter_id: str) -> None:
    add_default_work(pg)
    for _ in range(3):
        click(pg, "다음 스텝")
    counters = lab_counters(pg)
    assert counters and counters[0][0] == 3, counters
    sidebar_reads(pg, counters[0])
    pg.reload()
    pg.wait_for_selector("[data-testid='stApp']")
    wait_idle(pg)
    assert lab_counters(pg) == counters, "a reload lost the learner's run"
    run_to_end(pg)
    finished = lab_counters(pg)
    assert finished[0][0] > 3
    sidebar_reads(pg, finished[0])


@pytest.mark.parametrize("chapter_id", CHAPTERS)
def test_walk_every_chapters_default_lab(page, app_url, chapter_id):
    open_chapter(page, app_url, chapter_id)
    if chapter_id in NO_STEP_LAB:
        click(page, NO_STEP_LAB[chapter_id])
    else:
        step_reload_and_finish(page, app_url, chapter_id)
    check_text(page, chapter_id)
    check_shows(page, chapter_id)
    no_exception(page)
    screenshot(page, chapter_id)


def test_server_log_has_no_traceback(app_url):
    from _browser import SHARED

    log = SHARED.log_path.read_text() if SHARED.log_path else ""
    assert "Traceback" not in log, log[log.find("Traceback") - 200 :][:3000]
