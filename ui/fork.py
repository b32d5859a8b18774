"""여기서 갈라 보기: fork a lab's engine at any step and compare what happens next.

A branch is EngineCore.fork(**changes): a second engine that continues from the lab engine's
exact state (queues, tokens, block tables, KV, engine clock) with some settings changed. The lab's
buttons step it in lockstep with the others (ui/lab.py). Below the views, per branch: each
request's TTFT and E2E against the original on the engine clock, the steps whose decisions differ
with the scheduler's reasons, and the KV blocks in use of both on one chart. At most MAX_BRANCHES
per lab; 리셋 or a rebuilt engine (other settings) drops them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pandas as pd
import streamlit as st

from engine.core import FORKABLE, EngineCore
from engine.executor.abstract import ForkNotSupportedError
from engine.trace import StepRecord
from ui import figures
from ui.registry import ClassroomFull
from ui.session import (
    adopt_engine,
    adopted_engine,
    conditions_of,
    get_records,
    persist_key,
    reset_engine,
)
from ui.simulation import is_simulated
from ui.widgets import PHASE_KO, evidence, show_frame

MAX_BRANCHES = 3
_BRANCHES = "_lab_branches"  # lab key → list[Branch]
persist_key(_BRANCHES)  # a reload keeps them with their engines (ui/session.py)

POLICY_KO = {"fcfs": "FCFS (먼저 온 순서)", "priority": "우선순위", "static": "정적 배칭"}
PREEMPTION_KO = {"recompute": "재계산 (recompute)", "swap": "스왑 (swap)"}
SPEC_OFF = "끔"


@dataclass
class Branch:
    """One fork of a lab engine: its engine key, the side it came from, when, and what changed."""

    key: str
    parent: str  # the lab side's engine key
    parent_engine: int  # id() of that engine when forked: a rebuilt parent makes the branch stale
    label: str
    changes: dict = field(default_factory=dict)
    step: int = 0  # the parent's last step when forked


@dataclass(frozen=True)
class Setting:
    """One setting a fork may change (EngineCore.FORKABLE), as the form shows it."""

    name: str
    label: str
    kind: str  # "int", "bool" or a choice table's name
    low: int = 0
    high: int = 0


SETTINGS = [
    Setting("max_num_batched_tokens", "토큰 예산 (max_num_batched_tokens)", "int", 1, 16384),
    Setting("max_num_seqs", "최대 동시 요청 (max_num_seqs)", "int", 1, 512),
    Setting("long_prefill_token_threshold", "긴 prefill 상한 (0 = 없음)", "int", 0, 16384),
    Setting("num_kv_blocks", "KV 블록 수", "int", 1, 1_000_000),
    Setting("scheduling_policy", "스케줄링 정책", "policy"),
    Setting("preemption_mode", "선점 방식", "preemption"),
    Setting("enable_chunked_prefill", "chunked prefill", "bool"),
    Setting("enable_prefix_caching", "prefix caching", "bool"),
]
CHOICES = {"policy": POLICY_KO, "preemption": PREEMPTION_KO}
FORM_FIELDS = [s.name for s in SETTINGS] + ["spec_method", "spec_k"]
_MESSAGE = "_lab_fork_message_{}"  # lab key → why the last 갈라 보기 made no branch


# -- the branches of a lab -----------------------------------------------------------------------


def _all() -> dict[str, list[Branch]]:
    return st.session_state.setdefault(_BRANCHES, {})


def live_branches(lab_key: str, engines: dict[str, EngineCore]) -> list[Branch]:
    """This lab's branches whose parent is still the engine they were forked from; the others
    (the parent was rebuilt or reset) are released."""
    kept = []
    for branch in _all().get(lab_key, []):
        parent = engines.get(branch.parent)
        if parent is not None and id(parent) == branch.parent_engine and adopted_engine(branch.key):
            kept.append(branch)
        else:
            reset_engine(branch.key)
    _all()[lab_key] = kept
    return kept


def drop_branches(lab_key: str) -> None:
    for branch in _all().pop(lab_key, []):
        reset_engine(branch.key)


def setting_value(engine: EngineCore, name: str):
    """A SETTINGS field's value in this engine (KV blocks as sized, the rest from its config)."""
    return engine.num_blocks if name == "num_kv_blocks" else getattr(engine.config, name)


def spec_of(engine: EngineCore) -> tuple[str, int]:
    """(method or 끔, k) of an engine's speculative decoding."""
    sc = engine.speculative_config
    return (sc.method, sc.num_speculative_tokens) if sc else (SPEC_OFF, 3)


def changes_from(engine: EngineCore, values: dict) -> dict:
    """The form's values that differ from the engine's settings, as EngineCore.fork takes them."""
    current = {s.name: setting_value(engine, s.name) for s in SETTINGS}
    changes = {
        k: v for k, v in values.items() if k in current and v is not None and v != current[k]
    }
    method, k = values.get("spec_method") or SPEC_OFF, values.get("spec_k") or 3
    if (method, k) != spec_of(engine) and not (method == SPEC_OFF == spec_of(engine)[0]):
        base = dict(engine.config.speculative_config or {})
        changes["speculative_config"] = (
            None if method == SPEC_OFF else {**base, "method": method, "num_speculative_tokens": k}
        )
    return changes


def describe(changes: dict, engine: EngineCore) -> str:
    """The changes in Korean: "토큰 예산 128 → 256, prefix caching 켬 → 끔"."""
    labels = {s.name: s.label.split(" (")[0] for s in SETTINGS}
    parts = []
    for name, value in changes.items():
        if name == "speculative_config":
            after = f"{value['method']} k={value['num_speculative_tokens']}" if value else "끔"
            before = "끔" if spec_of(engine)[0] == SPEC_OFF else "%s k=%d" % spec_of(engine)
            parts.append(f"추측 디코딩 {before} → {after}")
            continue
        before = setting_value(engine, name)
        parts.append(f"{labels[name]} {_value_ko(before)} → {_value_ko(value)}")
    return ", ".join(parts) or "바꾼 설정 없음 (같은 엔진이 같은 결정을 하는지 확인)"


def _value_ko(value) -> str:
    if isinstance(value, bool):
        return "켬" if value else "끔"
    return POLICY_KO.get(value) or PREEMPTION_KO.get(value, str(value)).split(" (")[0]


def create_branch(
    lab_key: str, parent_key: str, engine: EngineCore, changes: dict, feeders: dict
) -> Branch:
    """Fork `engine` with `changes` and keep it as this lab's next branch (its workload feeder
    forked too). Raises what EngineCore.fork raises (ForkNotSupportedError, ValueError)."""
    branches = _all().setdefault(lab_key, [])
    twin = engine.fork(**changes)
    number = max((int(b.key.rsplit("fork", 1)[1]) for b in branches), default=0) + 1
    key = f"{parent_key}__fork{number}"
    adopt_engine(key, twin, parent_key)
    feeder = feeders.get(parent_key)
    if feeder is not None and feeder.engine is engine:
        feeders[key] = feeder.fork(twin)
    step = len(get_records(parent_key))
    branch = Branch(key, parent_key, id(engine), f"갈래 {number}", changes, step)
    branches.append(branch)
    return branch


def refusal_ko(exc: ValueError) -> str:
    """Why EngineCore.fork refused, in Korean (the engine's own words follow in the message)."""
    text = str(exc)
    numbers = [int(n) for n in re.findall(r"\d+", text)]
    if "blocks the running requests" in text:
        return (
            f"KV 블록 {numbers[0]}개로는 지금 실행 중인 요청들이 쓰는 블록 {numbers[1]}개를 담을 "
            f"수 없습니다. KV 블록 수를 {numbers[1]} 이상으로 두세요."
        )
    if "cannot hold one request" in text:
        return "KV 블록이 최대 길이(max_model_len)의 요청 하나도 담지 못할 만큼 적습니다."
    if "with chunked prefill off" in text:
        return (
            "chunked prefill을 끄면 프롬프트가 한 스텝에 통째로 들어가야 해서, 토큰 예산이 최대 "
            f"길이(max_model_len, {numbers[-1]}) 이상이어야 합니다. 토큰 예산도 함께 올리세요."
        )
    if "swapped out" in text:
        return (
            "지금 스왑된 요청이 있어 스왑 공간을 바꿀 수 없습니다. 그 요청이 돌아온 뒤에 "
            "갈라 보세요."
        )
    return "엔진이 이 설정을 받지 않았습니다."


def _on_fork(lab_key: str, side_keys: list[str], feeders: dict) -> None:
    """The form's submit (a callback: the branch exists before the lab draws its counters and
    views). What went wrong is kept for the form to show."""
    state = st.session_state
    parent_key = state.get(f"{lab_key}_fork_parent") or side_keys[0]
    engine = adopted_engine(parent_key)
    message = _MESSAGE.format(lab_key)
    state.pop(message, None)
    if engine is None:
        return
    if len(_all().get(lab_key, [])) >= MAX_BRANCHES:
        state[message] = f"갈래는 {MAX_BRANCHES}개까지입니다. 리셋하면 모두 지워집니다."
        return
    values = {name: state.get(f"{lab_key}_fork_{name}") for name in FORM_FIELDS}
    try:
        create_branch(lab_key, parent_key, engine, changes_from(engine, values), feeders)
    except ClassroomFull as exc:
        state[message] = exc.message_ko().replace("‘다시 시도’", "‘갈라 보기’")
    except ForkNotSupportedError:
        state[message] = (
            "이 엔진은 갈라 볼 수 없습니다: 텐서·파이프라인 병렬 엔진은 KV 캐시를 여러 워커 "
            "프로세스가 나눠 갖고 있어, 복사하려면 워커를 다시 띄워야 합니다. 같은 실험을 워커 "
            "하나(tp=1, pp=1)나 시뮬레이션으로 돌려 갈라 보세요."
        )
    except ValueError as exc:
        state[message] = f"이 설정으로는 갈라 볼 수 없습니다: {refusal_ko(exc)} (엔진: {exc})"


# -- the form ------------------------------------------------------------------------------------


def fork_form(lab_key: str, sides: list, engines: dict, feeders: dict) -> None:
    """여기서 갈라 보기: which engine, which settings; submitting makes the branch."""
    with st.expander("여기서 갈라 보기 — 지금 이 상태에서 설정만 바꾼 엔진을 옆에 세웁니다"):
        with st.form(f"{lab_key}_fork_form", border=False):
            labels = {s.key: s.label or "이 엔진" for s in sides}
            parent_key = st.selectbox(
                "어느 엔진에서 갈라질까요",
                list(labels),
                format_func=labels.get,
                key=f"{lab_key}_fork_parent",
                disabled=len(sides) == 1,
            )
            _setting_inputs(lab_key, engines[parent_key or sides[0].key])
            st.form_submit_button(
                "갈라 보기",
                type="primary",
                on_click=_on_fork,
                args=(lab_key, [s.key for s in sides], feeders),
            )
        message = st.session_state.get(_MESSAGE.format(lab_key))
        if message:
            st.warning(message)
        st.caption(
            "갈래는 원래 엔진의 대기열, 요청마다의 토큰, 블록 테이블, KV 값, 엔진 시계를 그대로 "
            "복사해서 시작합니다. 다음 스텝부터 같은 버튼이 둘을 함께 진행합니다. 설정을 하나도 "
            f"바꾸지 않으면 원래 엔진과 똑같이 진행해야 합니다. 갈래는 {MAX_BRANCHES}개까지."
        )


def _setting_inputs(lab_key: str, engine: EngineCore) -> None:
    """The form's fields (keys f"{lab_key}_fork_{name}", read by _on_fork), first shown with the
    engine's own settings."""
    left, right = st.columns(2)
    for i, s in enumerate(SETTINGS):
        column = left if i % 2 == 0 else right
        key = f"{lab_key}_fork_{s.name}"
        current = setting_value(engine, s.name)
        if s.kind == "int":
            column.number_input(s.label, s.low, s.high, int(current), key=key, step=1)
        elif s.kind == "bool":
            column.toggle(s.label, bool(current), key=key)
        else:
            table = CHOICES[s.kind]
            column.selectbox(
                s.label, list(table), list(table).index(current), format_func=table.get, key=key
            )
    method, k = spec_of(engine)
    left.selectbox(
        "추측 디코딩", [SPEC_OFF, "ngram"], [SPEC_OFF, "ngram"].index(method),
        key=f"{lab_key}_fork_spec_method",
    )  # fmt: skip
    right.number_input("추측 토큰 수 k", 1, 8, int(k), key=f"{lab_key}_fork_spec_k", step=1)


# -- the comparison ------------------------------------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def request_deltas(original: EngineCore, branch: EngineCore) -> pd.DataFrame:
    """Per request: TTFT and E2E on the engine clock in each engine, and the branch's change."""
    rows = []
    for request in sorted(original.all_requests(), key=lambda r: r.arrival_time):
        twin = branch.get_request(request.request_id)
        if twin is None:
            continue
        a, b = request.metrics(clock="engine"), twin.metrics(clock="engine")
        row = {"요청": request.request_id}
        for name, x, y in (("TTFT", a.ttft, b.ttft), ("E2E", a.e2e, b.e2e)):
            row[f"{name} 원래 (ms)"], row[f"{name} 갈래 (ms)"] = _ms(x), _ms(y)
            row[f"{name} 변화 (ms)"] = _ms(y - x) if x is not None and y is not None else None
        rows.append(row)
    return pd.DataFrame(rows)


def same_tokens(original: EngineCore, branch: EngineCore) -> tuple[int, int]:
    """(requests whose output tokens so far agree with the original's, requests in both): the
    shorter output must be the start of the longer one."""
    same = total = 0
    for request in original.all_requests():
        twin = branch.get_request(request.request_id)
        if twin is None:
            continue
        a, b = request.output_token_ids, twin.output_token_ids
        n = min(len(a), len(b))
        total += 1
        same += a[:n] == b[:n]
    return same, total


def decision_text(record: StepRecord | None) -> str:
    """A step's decision in one line: who got how many tokens, who was preempted."""
    if record is None:
        return "(스텝 없음: 끝남)"
    parts = [
        f"{s.request_id} {PHASE_KO.get(s.phase, s.phase)} {s.num_tokens}" for s in record.scheduled
    ]
    if record.preempted:
        parts.append("선점: " + ", ".join(record.preempted))
    return " · ".join(parts) or "(아무도 없음)"


def reason_text(record: StepRecord | None) -> str:
    if record is None or not record.unscheduled:
        return ""
    return ", ".join(
        f"{rid}: {figures.REASON_KO.get(r, r)}" for rid, r in record.unscheduled.items()
    )


def differing_steps(original: list[StepRecord], branch: list[StepRecord], since: int) -> list[dict]:
    """The steps after the fork whose decisions differ (matched by step number), with reasons."""
    a = {r.step: r for r in original if r.step > since}
    b = {r.step: r for r in branch if r.step > since}
    rows = []
    for step in sorted(set(a) | set(b)):
        ra, rb = a.get(step), b.get(step)
        if decision_text(ra) == decision_text(rb):
            continue
        rows.append(
            {
                "스텝": step,
                "원래 엔진의 결정": decision_text(ra),
                "갈래의 결정": decision_text(rb),
                "원래 엔진: 못 받은 이유": reason_text(ra),
                "갈래: 못 받은 이유": reason_text(rb),
            }
        )
    return rows


def branch_view(branch: Branch, parent_label: str, engines: dict, views, texts=None) -> None:
    """One branch against its original: requests, differing decisions, KV use; its own views."""
    original, engine = engines[branch.parent], engines[branch.key]
    ours, theirs = get_records(branch.parent), get_records(branch.key)
    st.markdown(f"#### {branch.label}: {describe(branch.changes, original)}")
    st.caption(f"'{parent_label}'의 스텝 {branch.step}에서 갈라졌습니다.")
    kind = "계산값" if is_simulated(engine) else "측정값"
    deltas = request_deltas(original, engine)
    if not deltas.empty:
        show_frame(deltas, width="stretch")
        evidence(
            kind,
            "요청별 TTFT·E2E (엔진 시계, 갈래 − 원래)",
            **conditions_of(engine, 시계="엔진 시계"),
        )
    same, total = same_tokens(original, engine)
    if total:
        st.markdown(
            f"**출력 토큰이 원래 엔진과 같은 요청: {same}/{total}** (두 엔진이 지금까지 낸 "
            "토큰끼리 비교. greedy라면 스케줄이 달라도 같아야 합니다)"
        )
    rows = differing_steps(ours, theirs, branch.step)
    if rows:
        st.markdown(f"**결정이 달라진 스텝 {len(rows)}개** (처음 20개)")
        show_frame(pd.DataFrame(rows[:20]), width="stretch")
    elif len(theirs) > branch.step:
        st.markdown("**갈라진 뒤 모든 스텝의 결정이 원래 엔진과 같습니다.**")
    series = [(parent_label, ours), (branch.label, theirs)]
    spec = figures.kv_usage_compare_spec(series, branch.step)
    st.plotly_chart(figures.prebuilt(spec), width="stretch", key=f"{branch.key}_kvcompare")
    with st.expander(f"{branch.label}의 세 가지 보기 (여정 · 스케줄러 · KV)"):
        views(branch.key, engine, theirs)
    if texts is not None:
        with st.expander(f"{branch.label}의 스트리밍된 글"):
            texts(branch.key, engine)


def fork_section(ctx, views, feeders: dict, texts=None) -> None:
    """The fork form, then one comparison per live branch (called by ui/lab.py's lab, with its
    kept workload feeders: a branch's feeder is kept there too)."""
    fork_form(ctx.key, ctx.sides, ctx.engines, feeders)
    labels = {s.key: s.label or "원래 엔진" for s in ctx.sides}
    for branch in ctx.branches:
        branch_view(branch, labels.get(branch.parent, branch.parent), ctx.engines, views, texts)


# -- branches in a shared link (ui/share.py's `fork` parameter) ----------------------------------

MAX_LINK_STEP = 500  # the lab's N 스텝 limit


def branches_param(lab_key: str) -> str:
    """This lab's live branches as a link's `fork` value: JSON [{"from", "at", "changes"}]."""
    branches = _all().get(lab_key, [])
    items = [{"from": b.parent, "at": b.step, "changes": b.changes} for b in branches]
    return json.dumps(items, ensure_ascii=False, separators=(",", ":")) if items else ""


def parse_branches(text: str, side_keys: list[str]) -> tuple[list[dict], list[str]]:
    """A link's `fork` value, checked: at most MAX_BRANCHES items, each from a side of this lab,
    at a step in [0, MAX_LINK_STEP], changing only what a fork may change (EngineCore.FORKABLE).
    Returns the usable items (by step) and Korean notes on what was left out."""
    try:
        items = json.loads(text)
    except ValueError:
        return [], ["링크의 갈래(fork)를 읽지 못해 갈래 없이 열었습니다."]
    if not isinstance(items, list):
        return [], ["링크의 갈래(fork)는 목록이어야 해서 갈래 없이 열었습니다."]
    usable, notes = [], []
    for item in items[:MAX_BRANCHES]:
        ok = (
            isinstance(item, dict)
            and item.get("from") in side_keys
            and isinstance(item.get("at"), int)
            and 0 <= item["at"] <= MAX_LINK_STEP
            and isinstance(item.get("changes"), dict)
            and set(item["changes"]) <= set(FORKABLE)
        )
        if ok:
            usable.append(item)
        else:
            notes.append(f"링크의 갈래 {str(item)[:80]}은(는) 이 실험실에 맞지 않아 뺐습니다.")
    return sorted(usable, key=lambda i: i["at"]), notes


def open_shared_branches(ctx, text: str, step_all, feeders: dict, limit: int) -> list[str]:
    """Make a link's branches: step the lab (lockstep) to each branch's step, fork there. Steps
    stop at `limit` (the link's own step) or when the lab has nothing left. Korean notes back."""
    items, notes = parse_branches(text, [s.key for s in ctx.sides])
    for item in items:
        while len(get_records(item["from"])) < min(item["at"], limit) and step_all(ctx):
            pass
        engine = ctx.engines[item["from"]]
        try:
            branch = create_branch(ctx.key, item["from"], engine, item["changes"], feeders)
        except ClassroomFull as exc:
            notes.append(exc.message_ko().replace(" 잠시 뒤 ‘다시 시도’를 눌러 주세요.", ""))
        except ValueError as exc:  # ForkNotSupportedError included
            notes.append(f"링크의 갈래를 만들지 못했습니다: {refusal_ko(exc)} (엔진: {exc})")
            continue
        ctx.engines[branch.key] = adopted_engine(branch.key)
        ctx.feeders[branch.key] = feeders.get(branch.key)
        ctx.branches.append(branch)
    return notes
