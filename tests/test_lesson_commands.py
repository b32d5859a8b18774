"""Every shell command quoted in lessons/*.md, docs/*.md and README.md runs as written on the
default model, or this file says why it is not run here.

A command is a line of a ```bash block (continuation lines joined, the comment cut off) or an
inline `code span` that starts like one (python -m ..., .venv/bin/python, ./run.sh, torchrun,
curl, pip, with optional VAR=value in front). `.venv/bin/python` and `python` are the same
interpreter (this one). Each command has one entry in PLAN:

- RUN: runs to the end, exit status 0.
- STARTS: a command that works for minutes (a benchmark, the self-check, a generation on a
  loaded 2-core machine) passes once it printed the line that comes only after its start-up (the
  model loaded, the engine built, the first section or the first token) with no traceback; then
  it is stopped. A command that exits before that must exit 0.
- SERVES: a server: started, it must answer GET on its health URL, then it is stopped. Its port
  is replaced by a free one so it cannot collide with a server already running here.
- TORCHRUN: the two-machine launch, both node ranks on 127.0.0.1 with a free port: rank 0 must
  stream its first token.
- PARSED: not started, with the reason; its arguments go through the engine's own parser and its
  parallel sizes through the engine's own check against the default model, so a flag or a size
  that cannot work still fails here.
- NOT_RUN: not a command this test can or should run, with the reason.

The commands that start are bounded by their markers, so the whole file stays within a few
minutes on 2 cores; a command whose marker does not come within its timeout fails.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from engine.utils import free_port

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = (
    sorted(ROOT.glob("lessons/*.md")) + sorted(ROOT.glob("docs/*.md")) + [ROOT / "README.md"]
)
COMMAND_START = re.compile(
    r"^(?:[A-Z_]+=\S+\s+)*(?:nice -n \d+\s+)?"
    r"(?:python3?|\.venv/bin/python|\./run\.sh|torchrun|curl|pip)\s"
)

RUN, STARTS, SERVES, TORCHRUN, PARSED, NOT_RUN = (
    "run",
    "starts",
    "serves",
    "torchrun",
    "parsed",
    "not run",
)
BENCH_STARTED = r"^\[1/\d+\] "  # the benchmark's first section: engine built, kernels chosen
FIRST_OUTPUT = r"\S"  # generate: the first streamed token
SELFCHECK_STARTED = r"^\[selfcheck\] .+: "  # the first check's verdict

# command (as normalised by `normalise`) -> (kind, marker or reason)
PLAN: dict[str, tuple[str, str]] = {
    # -- chapter 01, README: the artifact
    "python -m engine artifact build": (RUN, ""),
    "python -m engine artifact info": (RUN, ""),
    # -- docs/architecture.md
    "python -m engine.tools.import_graph --check": (RUN, ""),
    "python -m engine.tools.import_graph": (RUN, ""),
    # -- generate
    'python -m engine generate "서울을 소개해 줘"': (STARTS, FIRST_OUTPUT),
    'python -m engine generate "The capital of France is" -tp 3': (STARTS, FIRST_OUTPUT),
    'python -m engine generate "Hello" --linear-precision auto': (STARTS, FIRST_OUTPUT),
    'python -m engine generate "Hello" --kv-cache-dtype bfloat16': (STARTS, FIRST_OUTPUT),
    'python -m engine generate -tp 3 "Hello"': (
        PARSED,
        "the same tp 3 launch as docs/distributed.md's generate -tp 3, which runs here",
    ),
    # -- serve
    "python -m engine serve": (SERVES, "/health"),
    "python -m engine serve --port 8000": (
        PARSED,
        "the same server as `python -m engine serve` (its default port is 8000), which runs here",
    ),
    "python -m engine serve -tp 3": (
        PARSED,
        "tp 3 workers (started by generate -tp 3 here) behind the server (started by `serve` "
        "here); the pair would double this test's time",
    ),
    # -- bench: the quick variants start; the rest share their start-up
    "python -m engine bench --quick": (STARTS, BENCH_STARTED),
    "python -m engine bench --quick -tp 3": (STARTS, BENCH_STARTED),
    "python -m engine bench --quick --compare-quantization --skip-transformers": (
        STARTS,
        BENCH_STARTED,
    ),
    "python -m engine bench": (
        PARSED,
        "the full benchmark (about 7 minutes; on CUDA the same command): the same start-up as "
        "`bench --quick`, which runs here",
    ),
    "LLM_LAB_KERNEL_ARCH=x86-64-v3 PYTHONPATH=.:/tmp/llama_avx2 python -m engine bench --quick "
    "--quantization gguf --skip-transformers": (
        PARSED,
        "a second build of the kernels (a minute): tests/test_kernels.py checks the target's "
        "build folder and name; start-up as `bench --quick`",
    ),
    "python -m engine bench --kernels torch": (
        PARSED,
        "the full benchmark on the torch path: start-up as `bench --quick`",
    ),
    "python -m engine bench --kernels auto": (
        PARSED,
        "the full benchmark with the default kernels: start-up as `bench --quick`",
    ),
    "python -m engine bench --speculative ngram": (
        PARSED,
        "the full benchmark plus a speculative section after the others: start-up as "
        "`bench --quick`",
    ),
    "python -m engine bench --compare-quantization": (
        PARSED,
        "the full quantization comparison (many minutes): start-up as "
        "`bench --quick --compare-quantization --skip-transformers`, which runs here",
    ),
    "python -m engine bench --compare-quantization --skip-transformers": (
        PARSED,
        "the full quantization comparison without the transformers baseline (many minutes): "
        "start-up as `bench --quick --compare-quantization --skip-transformers`, which runs here",
    ),
    "python -m engine bench --json my.json --model /path/to/hf-llama-dir --threads 2": (
        PARSED,
        "/path/to/hf-llama-dir is a placeholder for the reader's model directory",
    ),
    # -- quality
    "python -m engine quality": (
        PARSED,
        "scores every quantized variant against float32 on the evaluation texts (minutes)",
    ),
    "python -m engine quality --variants int4 gguf": (
        PARSED,
        "as `quality`, two variants (minutes)",
    ),
    # -- simulate
    "python -m engine simulate --model-preset llama-3.1-8b --hardware h100-sxm --rate 4": (
        STARTS,
        r"^Simulated: ",
    ),
    "python -m engine simulate": (
        PARSED,
        "the same simulation with its default preset (a minute or more here): the README's "
        "simulate with flags runs here",
    ),
    # -- the KV connector (docs/kv_connector.md)
    "python -m engine serve --port 8100 --kv-role kv_producer --kv-peer 127.0.0.1:29600": (
        PARSED,
        "one half of a pair (it waits for its consumer): tests/test_kv_p2p.py starts both servers "
        "and the proxy on free ports and checks one engine's tokens",
    ),
    "python -m engine serve --port 8200 --kv-role kv_consumer --kv-peer 127.0.0.1:29600": (
        PARSED,
        "the other half: tests/test_kv_p2p.py runs the pair end to end",
    ),
    "python -m engine proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 "
    "--port 8000": (
        PARSED,
        "needs the two servers above: tests/test_kv_p2p.py runs the proxy against them",
    ),
    "curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d "
    '\'{"prompt": "The KV cache", "max_tokens": 32, "temperature": 0}\'': (
        NOT_RUN,
        "a request to the proxy above (tests/test_kv_p2p.py sends it)",
    ),
    "python -m engine generate --kv-offload-mb N": (
        NOT_RUN,
        "N stands for a size; tests/test_kv_offload.py runs the host tier, and "
        "tests/test_lesson_commands.py's generate commands run the same CLI",
    ),
    # -- structured outputs (docs/structured_outputs.md)
    "PYTHONPATH=/tmp/so_scratch python docs/scripts/measure_grammar_backends.py llguidance": (
        NOT_RUN,
        "the backend comparison over the scratch install of both wheels (the commands above it); "
        "llguidance itself, as the engine uses it, is tested in tests/test_structured_output.py",
    ),
    'python -c "': (
        NOT_RUN,
        "a multi-line snippet: the bench's structured-outputs part, which tests/test_bench.py runs",
    ),
    # -- disaggregated prefill/decode (docs/performance.md): engine/tools/disagg_sim.py
    "python -m engine simulate --list": (RUN, ""),
    "python -m engine simulate --disaggregate 1:2 --trace-file tests/data/mooncake_sample.jsonl": (
        PARSED,
        "the shipped sample, from the repository root: tests/test_simulator_disagg.py runs "
        "--disaggregate 1:2 on it",
    ),
    "python -m engine simulate --disaggregate 1:3 --link ib --slo-ttft-ms 500 --slo-tpot-ms 12": (
        PARSED,
        "1,000 requests through split and colocated (about a minute here): "
        "tests/test_simulator_disagg.py runs --disaggregate on a small workload",
    ),
    "python -m engine simulate --pd-sweep 4 --link ib --rate 12 --num-requests 300 "
    "--prompt-len 512 4096 --output-len 64 512 --max-num-batched-tokens 8192 "
    "--slo-ttft-ms 500 --slo-tpot-ms 12 --json sweep.json": (
        PARSED,
        "the documented sweep (four runs of 300 requests, about 20 s here, and a JSON file): "
        "tests/test_simulator_disagg.py runs --pd-sweep on a small workload",
    ),
    # -- traces out (docs/traces.md): parsed here, so that no trace file lands in the repository;
    # tests/test_trace_export.py runs simulate --trace and generate --trace (slow) into tmp_path
    "python -m engine simulate --trace run.json": (
        PARSED,
        "the default simulation (a minute or more here) and its trace: test_trace_export runs one",
    ),
    "python -m engine simulate --model-preset llama-3.1-8b --num-requests 200 --trace sim.json": (
        PARSED,
        "a simulation and its trace: tests/test_trace_export.py runs simulate --trace",
    ),
    'python -m engine generate "KV 캐시가 뭐야?" --max-tokens 64 --trace generate.json': (
        PARSED,
        'a generation (start-up as generate "서울을 소개해 줘") and its trace: '
        "tests/test_trace_export.py runs generate --trace (slow)",
    ),
    "python -m engine bench --quick --trace bench.json": (
        PARSED,
        "`bench --quick`, which runs here, writing its offline run's trace",
    ),
    # -- traces in (README, docs/performance.md): engine/tools/trace_readers.py and fidelity.py
    "python -m engine simulate --trace-file mooncake_trace.jsonl": (
        PARSED,
        "a user's own trace file (not shipped; the README says where they are published): "
        "tests/test_trace_readers.py runs simulate --trace-file on the shipped sample",
    ),
    "python -m engine.tools.fidelity": (STARTS, r"^fidelity: \d+ requests of "),
    "python -m engine.tools.fidelity --trace-file tests/data/azure_sample.csv --json fid.json": (
        PARSED,
        "as python -m engine.tools.fidelity (which starts here) on the other shipped sample, "
        "from the repository root",
    ),
    "python -m engine.tools.fidelity --calibrate --calibration /tmp/cal.json": (
        PARSED,
        "a calibration run (about a minute), then python -m engine.tools.fidelity (started here)",
    ),
    # -- selfcheck
    "./run.sh selfcheck": (STARTS, SELFCHECK_STARTED),
    "python -m engine selfcheck": (
        PARSED,
        "what ./run.sh selfcheck runs after its set-up, which runs here",
    ),
    "python -m engine selfcheck --json selfcheck.json": (
        PARSED,
        "./run.sh selfcheck with a JSON file at the end: start-up as ./run.sh selfcheck",
    ),
    # -- the app and the tests
    "./run.sh app": (SERVES, "/_stcore/health"),
    "./run.sh test": (NOT_RUN, "the whole suite (about 15 minutes); this file is part of it"),
    './run.sh test -m "not slow and not browser"': (
        NOT_RUN,
        "the fast tier, about two minutes of its own: more than this file's bound",
    ),
    "./run.sh test tests/test_scheduler.py": (RUN, ""),
    "UPDATE_DOC_SHOTS=1 ./run.sh test tests/test_browser_walk.py": (
        NOT_RUN,
        "drives every chapter in a headless browser (minutes) and rewrites docs/screenshots",
    ),
    "python tests/load_classroom.py --learners 4 --steps 4": (
        NOT_RUN,
        "four headless Chromium learners against a served app (minutes, needs playwright)",
    ),
    "python tests/bench_lab_click.py --warm 20 --clicks 6": (
        NOT_RUN,
        "26 lab clicks in-process (minutes); a measurement, not a start-up",
    ),
    "OMP_WAIT_POLICY=PASSIVE python tests/bench_lab_click.py --warm 20 --clicks 6": (
        NOT_RUN,
        "as the line above, with passive OpenMP threads",
    ),
    "python -m ui.serve": (NOT_RUN, "what ./run.sh app starts (served above, /_stcore/health)"),
    "OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE LLM_LAB_MAX_ENGINES=24 python -m ui.serve "
    '--server.port "$port" &': (
        NOT_RUN,
        "one of three background app processes behind a reverse proxy; the same app starts "
        "here through ./run.sh app",
    ),
    # -- across machines
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 10.0.0.1 --master-port "
    '29500 -m engine generate "The capital of France is" -pp 2': (TORCHRUN, "node 1 below"),
    "torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 10.0.0.1 --master-port "
    '29500 -m engine generate "The capital of France is" -pp 2': (
        PARSED,
        "started together with node 0 (the line above) on 127.0.0.1",
    ),
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 주소 --master-port 포트 "
    '-m engine generate "..." -pp 2': (
        PARSED,
        "chapter 12's form of docs/distributed.md's two-machine launch (주소, 포트 and the "
        "prompt are placeholders), which runs here",
    ),
    "torchrun --nnodes 2 --node-rank R --nproc-per-node 3 --master-addr A --master-port P -m "
    "engine serve -tp 3 -pp 2": (
        PARSED,
        "two machines of three processes each (R, A, P are placeholders); six ranks of the "
        "default model would not fit this file's bound",
    ),
    # -- docs/deploy.md: the classroom arrangement (tests/test_deploy.py starts it on 127.0.0.1)
    "python deploy/classroom.py --replicas 3 --listen 0.0.0.0:8080": (
        NOT_RUN,
        "three app replicas, an engine server and nginx on every interface; "
        "tests/test_deploy.py starts the same launcher with two replicas on 127.0.0.1",
    ),
    "python deploy/classroom.py --replicas 3 --first-port 8501 --engine-port 8000 --listen 80 "
    "--run-dir /var/lib/llm-lab --render-only > /etc/nginx/llm-lab.conf": (
        NOT_RUN,
        "writes into /etc/nginx as root; tests/test_deploy.py renders the same configuration "
        "and has nginx check it",
    ),
    "python deploy/classroom.py --replicas 2 --listen 127.0.0.1:8080": (
        NOT_RUN,
        "the arrangement tests/test_deploy.py starts and drives (about two minutes)",
    ),
    "python tests/load_classroom.py --url http://127.0.0.1:8080 --pid PID_R0,PID_R1 "
    "--learners 6 --steps 4": (
        NOT_RUN,
        "headless Chromium learners against the arrangement above (PID_R0,PID_R1 are placeholders)",
    ),
    # -- installs
    "pip install llama-cpp-python==0.3.36": (
        NOT_RUN,
        "installs a package into the environment (docs/performance.md's optional comparison)",
    ),
    "CMAKE_BUILD_PARALLEL_LEVEL=1 nice -n 19 pip install llama-cpp-python==0.3.36": (
        NOT_RUN,
        "as the line above, built gently",
    ),
}


# -- finding the commands -----------------------------------------------------------------------


def normalise(command: str) -> str:
    command = re.sub(r"\s+", " ", command.strip())
    return command.replace(".venv/bin/python ", "python ")


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a # inside quotes stays)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "\"'" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def block_commands(code: str) -> list[str]:
    """The commands of one bash block: continuation lines joined, comments and blank lines off;
    a shell loop's body line counts on its own (`for`, `do`, `done` are not commands)."""
    out, pending = [], ""
    for raw in code.splitlines():
        line = _strip_comment(raw)
        alternative = re.search(r"#\s*or:\s*(.+)$", raw[len(line) :])
        if alternative and COMMAND_START.match(alternative.group(1) + " "):
            out.append(alternative.group(1).strip())  # "cmd   # or: other cmd"
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line and COMMAND_START.match(line + " "):
            out.append(line)
    return out


def quoted_commands() -> dict[str, list[str]]:
    """normalised command -> the files quoting it."""
    found: dict[str, list[str]] = {}
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        commands = []
        for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S):
            if m.group(1) in ("bash", "sh", "shell", ""):
                commands += block_commands(m.group(2))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for m in re.finditer(r"`([^`\n]+)`", prose):
            span = m.group(1).strip()
            if COMMAND_START.match(span + " "):
                commands.append(span)
        for command in commands:
            found.setdefault(normalise(command), []).append(str(path.relative_to(ROOT)))
    return found


def test_every_quoted_command_has_a_plan_and_every_plan_a_command():
    found = quoted_commands()
    # a bare `python -m engine` in prose names the entry point; it is not a command line
    found.pop("python -m engine", None)
    missing = {c: files for c, files in found.items() if c not in PLAN}
    assert not missing, f"commands quoted in the docs with no entry in PLAN: {missing}"
    stale = [c for c in PLAN if c not in found]
    assert not stale, f"PLAN entries no doc quotes any more: {stale}"
    for command, (kind, why) in PLAN.items():
        assert kind in (RUN, STARTS, SERVES, TORCHRUN, PARSED, NOT_RUN), command
        assert kind == RUN or why, f"{command}: no marker or reason"


# -- running them --------------------------------------------------------------------------------


def argv_of(command: str) -> tuple[dict, list[str]]:
    """The environment additions and the argv of a command, `python` as this interpreter."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] in ("python", "python3"):
        words[0] = sys.executable
    elif words[0] == "torchrun":
        words[0] = str(Path(sys.executable).with_name("torchrun"))
    return env, words


def engine_args(argv: list[str]) -> list[str] | None:
    """What follows `-m engine` (None: not the engine's command line)."""
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == "engine":
            return argv[i + 2 :]
    return None


def check_parsed(command: str) -> None:
    """The engine's parser accepts the arguments, and the parallel sizes fit the default model."""
    from engine.entrypoints.cli import build_parser
    from engine.layers.sharding import check_parallel_sizes

    _, argv = argv_of(command.rstrip(" &"))
    args = engine_args(argv)
    if args is None:
        return
    parsed = build_parser().parse_args(args)
    tp = getattr(parsed, "tensor_parallel_size", 1) or 1
    pp = getattr(parsed, "pipeline_parallel_size", 1) or 1
    check_parallel_sizes(default_config(), tp, pp)


def default_config():
    from engine.artifact import resolve_model_path
    from engine.models.llama import LlamaConfig

    return LlamaConfig.from_model_dir(resolve_model_path(None))


class Started:
    """A command started in its own process group, its output collected in files."""

    def __init__(self, argv: list[str], env_add: dict, workdir: Path, name: str):
        self.out = workdir / f"{name}.out"
        self.err = workdir / f"{name}.err"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **env_add}
        cwd = ROOT if argv[0].startswith("./") else workdir
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True
            )

    def text(self) -> tuple[str, str]:
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break


def wait_for(started: Started, ready, timeout: float, what: str) -> None:
    """Until `ready()` holds (pass), the process exits (pass only with 0 and no traceback), or
    the timeout (fail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            out, err = started.text()
            assert "Traceback" not in err, f"{what}: traceback\n{err[-3000:]}"
            return
        status = started.proc.poll()
        if status is not None:
            out, err = started.text()
            assert status == 0 and "Traceback" not in err, (
                f"{what}: exit {status}\n{out[-2000:]}\n{err[-3000:]}"
            )
            return
        time.sleep(0.5)
    out, err = started.text()
    pytest.fail(f"{what}: not started within {timeout:.0f} s\n{out[-2000:]}\n{err[-3000:]}")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def with_port(argv: list[str], port: int) -> list[str]:
    if argv[:2] == ["./run.sh", "app"]:
        return argv + ["--server.port", str(port)]
    return argv + ["--port", str(port)]  # argparse: the last --port wins


def run_one(command: str, kind: str, marker: str, workdir: Path) -> None:
    env_add, argv = argv_of(command)
    name = re.sub(r"\W+", "_", command)[:60]
    if kind == SERVES:
        port = free_port()
        argv = with_port(argv, port)
        marker = f"http://127.0.0.1:{port}{marker}"
    if kind == TORCHRUN:
        return run_torchrun(command, workdir)
    started = Started(argv, env_add, workdir, name)
    try:
        if kind == RUN:
            status = started.proc.wait(180)
            out, err = started.text()
            assert status == 0, f"{command}: exit {status}\n{out[-2000:]}\n{err[-3000:]}"
        elif kind == SERVES:
            wait_for(started, lambda: answers(marker), 150, command)
            assert started.proc.poll() is None, f"{command}: exited instead of serving"
        else:
            pattern = re.compile(marker, re.M)
            wait_for(started, lambda: bool(pattern.search(started.text()[0])), 180, command)
    finally:
        started.stop()


def run_torchrun(command: str, workdir: Path) -> None:
    """Both node ranks of the two-machine launch on 127.0.0.1 with a free port."""
    port = str(free_port())
    nodes = []
    for rank in ("0", "1"):
        line = command.replace("--node-rank 0", f"--node-rank {rank}")
        line = line.replace("10.0.0.1", "127.0.0.1").replace("29500", port)
        env_add, argv = argv_of(line)
        nodes.append(Started(argv, env_add, workdir, f"torchrun_node{rank}"))
    try:
        wait_for(nodes[0], lambda: bool(nodes[0].text()[0].strip()), 240, command)
    finally:
        for node in nodes:
            node.stop()


STARTED_KINDS = (RUN, STARTS, SERVES, TORCHRUN)


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [c for c, (kind, _) in PLAN.items() if kind in STARTED_KINDS], ids=lambda c: c[:50]
)
def test_command_runs_as_written(command, default_model_dir, tmp_path):
    kind, marker = PLAN[command]
    run_one(command, kind, marker, tmp_path)


@pytest.mark.slow
def test_commands_not_started_parse_and_fit_the_default_model(default_model_dir):
    """The engine's parser takes each one's arguments and its tp × pp fits the default model
    (the -tp 2 that the default model cannot be split by fails here)."""
    for command, (kind, _) in PLAN.items():
        if kind in (PARSED, STARTS, SERVES, TORCHRUN):
            check_parsed(command)
    with pytest.raises(ValueError, match="sizes that work: 1, 3"):
        check_parsed('python -m engine generate "Hi" -tp 2')
