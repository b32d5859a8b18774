"""여기서 갈라 보기 in the shared lab component (ui/fork.py, ui/lab.py), under AppTest on the tiny
model: a branch made at step 1 with a smaller token budget is stepped by the same buttons as the
original, its comparison shows per-request TTFT / E2E deltas, the steps whose decisions differ
and both KV curves; a branch with no changes makes the original's decisions; 리셋 drops them."""

from __future__ import annotations

import pytest

pytest.importorskip("streamlit")

from _apptest import app_fixture, chart, no_exception  # noqa: E402

app = app_fixture("pages/ch00_intro.py")


def _records(at, key: str) -> list:
    return at.session_state["_records"][key]


def _fork(at, **values) -> None:
    for name, value in values.items():
        at.number_input(key=f"main_fork_{name}").set_value(value)
    submit = next(b for b in at.button if b.label == "갈라 보기")
    submit.click().run()
    no_exception(at)


def test_a_branch_steps_in_lockstep_and_shows_what_changed(app):
    at = app
    at.number_input(key="main_max_tokens").set_value(16).run()
    at.selectbox(key="main_preset").set_value("옛날 옛적에 (긴 프롬프트)").run()
    at.button(key="main_add_preset").click().run()
    at.selectbox(key="main_preset").set_value("프랑스의 수도 (영어)").run()
    at.button(key="main_add_preset").click().run()
    at.button(key="main_step").click().run()
    no_exception(at)
    budget = at.session_state["_engines"]["main"]["engine"].config.max_num_batched_tokens
    _fork(at, max_num_batched_tokens=8, long_prefill_token_threshold=0)
    _fork(at, max_num_batched_tokens=budget, long_prefill_token_threshold=64)  # no change
    branches = at.session_state["_lab_branches"]["main"]
    assert [b.key for b in branches] == ["main__fork1", "main__fork2"]
    assert branches[0].changes == {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 0}
    assert branches[1].changes == {} and branches[0].step == 1
    assert len(_records(at, "main__fork1")) == 1  # its history is the original's
    at.button(key="main_to_end").click().run()
    no_exception(at)
    main, narrow, same = (_records(at, k) for k in ("main", "main__fork1", "main__fork2"))
    assert len(narrow) > len(main) == len(same)
    assert [r.scheduled for r in same] == [r.scheduled for r in main]
    text = "\n".join(m.value for m in at.markdown)
    assert "갈래 1: 토큰 예산" in text and "결정이 달라진 스텝" in text
    assert "갈라진 뒤 모든 스텝의 결정이 원래 엔진과 같습니다" in text  # the no-change branch
    assert text.count("출력 토큰이 원래 엔진과 같은 요청: 2/2") == 2  # greedy: any schedule
    tables = [df.value for df in at.dataframe]
    deltas = next(t for t in tables if "TTFT 변화 (ms)" in t.columns)
    assert len(deltas) == 2 and deltas["TTFT 변화 (ms)"].notna().all()
    kv = chart(at, "main__fork1_kvcompare")["data"]
    assert [t["name"] for t in kv] == ["원래 엔진", "갈래 1"]
    assert len(kv[1]["x"]) == len(narrow) and kv[1]["y"] != kv[0]["y"]
    downloads = at.get("download_button")
    assert len(downloads) == 5, "the run's trace and tables, one row for every engine"
    from engine.tools import trace_export
    from ui.export import trace_runs

    engines = at.session_state["_engines"]
    runs = [(k, engines[k]["engine"], _records(at, k)) for k in ("main", "main__fork1")]
    names = [e["args"]["name"] for e in trace_export.chrome_trace(trace_runs(runs))["traceEvents"]
             if e.get("name") == "process_name"]  # fmt: skip
    assert names == ["main", "main__fork1"]
    counters = [m.value for m in at.main.markdown if "스텝 **" in m.value]
    assert any(c.startswith("**갈래 1**") for c in counters)
    at.button(key="main_reset").click().run()
    no_exception(at)
    assert at.session_state["_lab_branches"].get("main", []) == []
    assert "main__fork1" not in at.session_state["_engines"]


def test_a_refused_fork_says_why_in_korean(app):
    """Too few KV blocks (fewer than one request of max_model_len needs): no branch, the reason
    in Korean with the engine's words."""
    at = app
    at.button(key="main_reset").click().run()
    at.button(key="main_add_preset").click().run()
    at.button(key="main_step").click().run()
    _fork(at, num_kv_blocks=1)
    warnings = " ".join(w.value for w in at.warning)
    assert "최대 길이(max_model_len)의 요청 하나도 담지 못할" in warnings, warnings
    assert "cannot hold one request of max_model_len" in warnings
    assert at.session_state["_lab_branches"].get("main", []) == []


def test_a_fork_past_the_classroom_cap_is_refused_with_the_figures(app, monkeypatch):
    """The registry's engine cap counts branches too: past it, the form says so and no branch
    is kept (the lab goes on)."""
    from ui.registry import ClassroomFull, SessionRegistry

    def full(self, session_id, key, need_bytes):
        raise ClassroomFull("engines", 64, 64, 100 << 20, 4096 << 20, 1 << 20, 60.0)

    at = app
    at.button(key="main_reset").click().run()
    at.button(key="main_add_preset").click().run()
    at.button(key="main_step").click().run()
    monkeypatch.setattr(SessionRegistry, "check_room", full)
    _fork(at, max_num_batched_tokens=16, num_kv_blocks=64)  # (the last test set 1)
    assert "교실이 가득 찼습니다" in " ".join(w.value for w in at.warning)
    assert at.session_state["_lab_branches"].get("main", []) == []
