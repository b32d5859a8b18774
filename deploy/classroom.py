"""A classroom that outgrows one process: N Streamlit replicas of the app behind nginx with sticky
sessions, and the engine's OpenAI-compatible server beside them (docs/deploy.md).

    .venv/bin/python deploy/classroom.py --replicas 3 --listen 0.0.0.0:8080
    .venv/bin/python deploy/classroom.py --replicas 3 --render-only --run-dir /var/lib/llm-lab \
        --listen 80 > /etc/nginx/llm-lab.conf && nginx -c /etc/nginx/llm-lab.conf

Starts every replica on 127.0.0.1 (`streamlit run app.py --server.port P`, the serving settings of
.streamlit/config.toml, OMP_WAIT_POLICY=PASSIVE and an equal share of the cores each), the engine
server (`python -m engine serve`), then nginx with deploy/nginx.conf.template rendered into a run
directory (pid, logs, temp files: no root needed, `nginx -p DIR -c DIR/nginx.conf`). Waits until
each answers its health check, prints the address, and stops everything on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = Path(__file__).resolve().parent / "nginx.conf.template"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
TEMP_FOLDERS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


@dataclass(frozen=True)
class ProxyLimits:
    """What the proxy bounds (docs/deploy.md says why each value)."""

    worker_processes: str = "auto"
    worker_connections: int = 1024
    app_conn_per_address: int = 256  # a classroom behind one NAT address shares this
    api_conn_per_address: int = 16
    app_max_body: str = "1m"
    api_max_body: str = "2m"  # the engine server's own --max-body-bytes default
    app_idle_timeout: str = "300s"
    api_read_timeout: str = "300s"


def find_nginx() -> str | None:
    """The nginx binary ($NGINX, PATH, or Debian's /usr/sbin/nginx, off a user's PATH)."""
    for candidate in (os.environ.get("NGINX"), shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _upstream_lines(app_ports: list[int]) -> dict[str, str]:
    """The per-replica parts of the template: replica i is `r<i>` on 127.0.0.1:app_ports[i]."""
    addresses = [f"127.0.0.1:{port}" for port in app_ports]
    first_visit = "\n".join(f"        server {a} max_fails=1 fail_timeout=10s;" for a in addresses)
    replicas = []
    for i, own in enumerate(addresses):
        backups = "".join(f"        server {a} backup;\n" for a in addresses if a != own)
        replicas.append(
            f"    upstream llm_lab_r{i} {{\n        server {own} max_fails=1 fail_timeout=10s;\n"
            f"{backups}    }}"
        )
    cookie = "\n".join(f"        r{i} llm_lab_r{i};" for i in range(len(addresses)))
    served_by = "\n".join(f'        "~{re.escape(a)}$" r{i};' for i, a in enumerate(addresses))
    return {
        "first_visit_servers": first_visit,
        "replica_upstreams": "\n".join(replicas),
        "cookie_to_upstream": cookie,
        "address_to_replica": served_by,
    }


def render_nginx_config(
    app_ports: list[int],
    engine_port: int,
    listen: str,
    run_dir: Path | str,
    limits: ProxyLimits = ProxyLimits(),
    daemon: bool = False,
    temp_dir: Path | str | None = None,
) -> str:
    """deploy/nginx.conf.template with every placeholder filled (an unknown one is an error);
    nginx's temp folders under `temp_dir` (default: run_dir/temp)."""
    values = {
        **{name: str(value) for name, value in vars(limits).items()},
        **_upstream_lines(app_ports),
        "engine_port": str(engine_port),
        "listen": listen,
        "run_dir": str(run_dir),
        "temp_dir": str(temp_dir or Path(run_dir) / "temp"),
        "daemon": "" if daemon else "daemon off;",
    }
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], TEMPLATE.read_text())


def wait_http(url: str, deadline_s: float, proc: subprocess.Popen | None = None) -> None:
    """Return once `url` answers 200; raise RuntimeError at the deadline or if `proc` exits."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {deadline_s:.0f} s")
        time.sleep(0.3)


def python() -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


@dataclass
class Classroom:
    """The processes of one deployment, all on this machine; use as a context manager (every
    process is stopped on the way out, whatever happened)."""

    replicas: int = 2
    listen: str = "127.0.0.1:8080"
    limits: ProxyLimits = field(default_factory=ProxyLimits)
    app: str = "app.py"
    replica_env: dict[str, str] = field(default_factory=dict)
    engine_args: list[str] = field(default_factory=list)
    run_dir: Path | None = None
    start_timeout_s: float = 120
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    app_ports: list[int] = field(default_factory=list)
    engine_port: int = 0
    temp_dir: Path | None = None

    @property
    def url(self) -> str:
        host, _, port = self.listen.rpartition(":")
        return f"http://{'127.0.0.1' if host in ('', '0.0.0.0', '*') else host}:{port}"

    def status_file(self, replica: int) -> Path:
        """Where replica `replica`'s reaper writes its figures (LLM_LAB_STATUS_FILE)."""
        return self.run_dir / f"r{replica}.status.json"

    def log(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def __enter__(self) -> "Classroom":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        nginx = find_nginx()
        if nginx is None:
            raise RuntimeError("no nginx binary: apt-get install nginx, or set $NGINX")
        self.run_dir = Path(self.run_dir or tempfile.mkdtemp(prefix="llm-lab-deploy-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ports: list[int] = []
        while len(ports) < self.replicas + 1:  # distinct, though the OS could hand one out twice
            port = free_port()
            ports += [port] if port not in ports else []
        *self.app_ports, self.engine_port = ports
        for i, port in enumerate(self.app_ports):
            self._spawn(f"r{i}", self._replica_command(port), self._replica_environment(i))
        self._spawn("engine", self._engine_command(), {**os.environ})
        for i, port in enumerate(self.app_ports):
            url = f"http://127.0.0.1:{port}/_stcore/health"
            self._wait(url, f"r{i}")
        self._wait(f"http://127.0.0.1:{self.engine_port}/health", "engine")
        self._start_nginx(nginx)

    def _replica_command(self, port: int) -> list[str]:
        # ui/serve.py: `streamlit run app.py` without the first deep link's "Page not found"
        launcher = ["-m", "streamlit", "run", self.app]
        if self.app == "app.py":
            launcher = ["-m", "ui.serve"]
        return [python(), *launcher, "--server.port", str(port),
                "--server.address", "127.0.0.1", "--server.headless", "true"]  # fmt: skip

    def _replica_environment(self, replica: int) -> dict[str, str]:
        """Each replica its share of the cores and idle OpenMP threads asleep (README,
        Classroom), its own status file; `replica_env` overrides."""
        threads = max(1, (os.cpu_count() or 1) // self.replicas)
        return {
            **os.environ,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
            "LLM_LAB_STATUS_FILE": str(self.status_file(replica)),
            **self.replica_env,
        }

    def _engine_command(self) -> list[str]:
        return [python(), "-m", "engine", "serve", "--host", "127.0.0.1",
                "--port", str(self.engine_port), *self.engine_args]  # fmt: skip

    def _make_temp_folders(self) -> None:
        """nginx's temp folders: large responses and request bodies spill there, written by its
        worker processes. Started by root, nginx runs those as `nobody`, who may not get through
        a private folder above the run directory (pytest's tmp_path is one), so they then get a
        folder of their own under the system's temp directory, owned by nobody."""
        if os.geteuid() != 0:
            self.temp_dir = self.run_dir / "temp"
        else:
            self.temp_dir = Path(tempfile.mkdtemp(prefix="llm-lab-nginx-temp-"))
            self.temp_dir.chmod(0o755)
        for name in TEMP_FOLDERS:
            (self.temp_dir / name).mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0:
                os.chown(self.temp_dir / name, pwd.getpwnam("nobody").pw_uid, -1)

    def _start_nginx(self, nginx: str) -> None:
        self._make_temp_folders()
        conf = self.run_dir / "nginx.conf"
        conf.write_text(
            render_nginx_config(
                self.app_ports,
                self.engine_port,
                self.listen,
                self.run_dir,
                self.limits,
                temp_dir=self.temp_dir,
            )
        )
        # -e: messages before the config is read go to stderr (nginx.log), not to the
        # compiled-in log path, which a user other than root may not open.
        base = [nginx, "-p", str(self.run_dir), "-c", str(conf), "-e", "stderr"]
        check = subprocess.run([*base, "-t"], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t rejected {conf}:\n{check.stderr}")
        self._spawn("nginx", base, {**os.environ})
        self._wait(f"{self.url}/_stcore/health", "nginx")

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.log(name), "w") as out:
            self.procs[name] = subprocess.Popen(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def _wait(self, url: str, name: str) -> None:
        try:
            wait_http(url, self.start_timeout_s, self.procs[name])
        except RuntimeError as exc:
            raise RuntimeError(f"{name}: {exc}\n{self.log(name).read_text()[-3000:]}") from None

    def stop(self) -> None:
        """nginx first (no new requests reach the replicas), then the rest; kill what lingers."""
        for name in sorted(self.procs, key=lambda n: n != "nginx"):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self.temp_dir is not None and self.run_dir not in self.temp_dir.parents:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2, help="Streamlit processes (default 2)")
    ap.add_argument(
        "--listen", default="127.0.0.1:8080", help="nginx's address (0.0.0.0:80 for a classroom)"
    )
    ap.add_argument("--run-dir", type=Path, help="config, pids and logs (default: a temp dir)")
    ap.add_argument("--worker-connections", type=int, default=ProxyLimits.worker_connections)
    ap.add_argument("--app-conn-per-address", type=int, default=ProxyLimits.app_conn_per_address)
    ap.add_argument("--api-conn-per-address", type=int, default=ProxyLimits.api_conn_per_address)
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="one more argument for `python -m engine serve` (repeat it), e.g. "
        "--engine-arg=--max-connections --engine-arg=64",
    )
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="print the nginx config for replicas on --first-port.. and the engine on "
        "--engine-port, start nothing",
    )
    ap.add_argument("--first-port", type=int, default=8501, help="with --render-only")
    ap.add_argument("--engine-port", type=int, default=8000, help="with --render-only")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limits = ProxyLimits(
        worker_connections=args.worker_connections,
        app_conn_per_address=args.app_conn_per_address,
        api_conn_per_address=args.api_conn_per_address,
    )
    if args.render_only:
        ports = [args.first_port + i for i in range(args.replicas)]
        run_dir = args.run_dir or "/var/lib/llm-lab"
        print(render_nginx_config(ports, args.engine_port, args.listen, run_dir, limits, True))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop() runs on the way out
    with Classroom(args.replicas, args.listen, limits, engine_args=args.engine_arg,
                   run_dir=args.run_dir) as room:  # fmt: skip
        print(f"classroom on {room.url} (run dir {room.run_dir})")
        for name, pid in room.pids().items():
            port = {"engine": room.engine_port, "nginx": room.listen}.get(name)
            port = port or room.app_ports[int(name[1:])]
            print(f"  {name:7} pid {pid:>7}  {port}  log {room.log(name)}")
        print("Ctrl-C stops every process.")
        try:
            while all(proc.poll() is None for proc in room.procs.values()):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        dead = [name for name, proc in room.procs.items() if proc.poll() is not None]
        if dead:
            print(f"stopped: {', '.join(dead)} exited (logs in {room.run_dir})")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
