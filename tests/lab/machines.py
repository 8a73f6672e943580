"""Lab machines: network namespaces on one bridge in a /24 of 198.18.0.0/15, each with its own
HOME (the others' hidden by a private mount namespace), cores, optional CPU quota and memory limit
(cgroup v1) and optional capped link (tbf). Needs root and `ip`; everything it makes — processes,
namespaces, the bridge, cgroups, directories — goes away on close(), also after a failure.

    with Lab(3) as lab:
        server = lab.machines[0].popen(["tandem", "serve", ...])

Nothing leaves the lab: the machines have no default route; the host reaches them through the
bridge's own address (the lab's .254) only. Each lab takes a /24 no other lab on this host
holds, so two labs (a test and a benchmark) can run side by side.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NETWORK = "198.18"  # RFC 2544's benchmarking range (198.18.0.0/15): never routed anywhere
CGROUP_ROOT = Path("/sys/fs/cgroup")
STOP_WAIT_S = 10.0
_LAB_NUMBERS = itertools.count()  # labs made by this process


def lab_unavailable() -> str:
    """Why a lab cannot be built here ('' when it can)."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, a bridge, cgroups)"
    for tool in ("ip", "unshare", "taskset", "tc"):
        if shutil.which(tool) is None:
            return f"the lab needs `{tool}` (iproute2 / util-linux)"
    if not (CGROUP_ROOT / "cpu").is_dir():
        return "the lab needs the cgroup v1 cpu controller at /sys/fs/cgroup/cpu"
    return ""


@dataclass(frozen=True, slots=True)
class MachineSpec:
    """What a lab machine has: its cores, a CPU quota, a memory limit, a link cap."""

    cores: str = ""  # taskset list, e.g. "0" or "0,1"; "" for every core
    cpu_quota: float | None = None  # cores' worth of CPU time, e.g. 0.5
    memory_limit: int | None = None  # bytes
    link_rate: str | None = None  # tbf rate, e.g. "100mbit"


@dataclass
class Machine:
    """One lab machine: a namespace, an address, a HOME, and the processes started in it."""

    lab: Lab
    index: int
    spec: MachineSpec
    namespace: str
    address: str
    home: Path
    cgroups: list[Path] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        environment = {
            key: value for key, value in os.environ.items()
            if not key.startswith(("TANDEM_", "HF_", "XDG_"))
        }
        environment |= {
            "HOME": str(self.home),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "HF_HOME": str(self.home / ".cache" / "huggingface"),
            "HF_HUB_OFFLINE": "1",
            "TANDEM_INTERFACE": self.address,
            "PYTHONUNBUFFERED": "1",
        }
        return environment | (extra or {})

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer ended in this machine's memory cgroup."""
        [group] = [g for g in self.cgroups if "memory" in g.parts]
        lines = (group / "memory.oom_control").read_text().splitlines()
        return int(dict(line.split() for line in lines).get("oom_kill", 0))

    def pids(self) -> list[int]:
        """Every process running on this machine (in its memory cgroup), sorted."""
        [group] = [g for g in self.cgroups if "memory" in g.parts]
        return sorted(_read_pids(group))

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as it runs on this machine: in its namespace, cgroups, cores and disk."""
        hide = " ".join(
            f"mount -t tmpfs -o size=1m tdm-hidden {other.home};"
            for other in self.lab.machines if other is not self
        )
        pin = f"taskset -c {self.spec.cores} " if self.spec.cores else ""
        inside = [
            "ip", "netns", "exec", self.namespace,
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", f'{hide}{self._show_cgroups()} exec {pin}"$@"', "sh", *argv,
        ]
        # Join the cgroups before entering the namespace: `ip netns exec` mounts a sysfs of
        # its own, without the cgroup hierarchies.
        enter = "".join(f'echo $$ > "{group}/cgroup.procs"; ' for group in self.cgroups)
        return ["sh", "-c", f'{enter}exec "$@"', "sh", *inside] if enter else inside

    def _show_cgroups(self) -> str:
        """Mounts that show this machine its own cgroups (its memory limit, as a container
        sees it): `ip netns exec` mounts a sysfs without them."""
        mounts = " ".join(
            f"mkdir -p {CGROUP_ROOT}/{group.parent.name}; "
            f"mount -t cgroup -o {group.parent.name} {group.parent.name} "
            f"{CGROUP_ROOT}/{group.parent.name};"
            for group in self.cgroups
        )
        return f" mount -t tmpfs -o size=1m tdm-cgroups {CGROUP_ROOT}; {mounts}" if mounts else ""

    def popen(self, argv: list[str], log: Path | None = None, **options: Any) -> subprocess.Popen:
        """Start `argv` on this machine; it is stopped (by pid) when the lab closes."""
        output = open(log or self.home / f"process-{len(self.processes)}.log", "ab")  # noqa: SIM115
        options.setdefault("env", self.env())
        process = subprocess.Popen(
            self.command(argv), stdout=output, stderr=subprocess.STDOUT, **options
        )
        output.close()
        self.processes.append(process)
        return process

    def run(self, argv: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(argv), env=self.env(), capture_output=True, text=True,
            timeout=timeout_s, check=False,
        )


class Lab:
    """`count` machines on one bridge; a context manager that always tears everything down."""

    def __init__(self, count: int, specs: list[MachineSpec] | None = None) -> None:
        problem = lab_unavailable()
        if problem:
            raise RuntimeError(problem)
        # Unique per lab, not only per process: a deleted namespace's veth goes away in the
        # background, so the next lab of the same process must not reuse its names.
        self.tag = f"tdm{os.getpid() % 100000}l{next(_LAB_NUMBERS) % 100}"
        self.bridge = f"{self.tag}br"
        self.subnet = _free_subnet()
        self.host_address = f"{self.subnet}.254"
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.tag}-lab-"))
        self.machines: list[Machine] = []
        self._specs = specs or [MachineSpec() for _ in range(count)]
        self._closed = False
        atexit.register(self.close)

    def __enter__(self) -> Lab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index, spec in enumerate(self._specs):
            self._add_machine(index, spec)

    def _add_machine(self, index: int, spec: MachineSpec) -> None:
        namespace, outside = f"{self.tag}-m{index}", f"{self.tag}v{index}"
        address = f"{self.subnet}.{index + 1}"
        home = self.root / f"m{index}"
        (home / ".cache").mkdir(parents=True)
        machine = Machine(self, index, spec, namespace, address, home)
        _ip("netns", "add", namespace)
        self.machines.append(machine)  # from here on close() removes it, should a step fail
        _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("link", "set", outside, "master", self.bridge, "up")
        inside = ["ip", "netns", "exec", namespace, "ip"]
        _run(*inside, "addr", "add", f"{address}/24", "dev", "eth0")
        _run(*inside, "link", "set", "eth0", "up", "multicast", "on")
        _run(*inside, "link", "set", "lo", "up")
        _run(*inside, "route", "add", "224.0.0.0/4", "dev", "eth0")  # zeroconf's multicast
        if spec.link_rate:
            for device in ([*inside[:-1], "tc"], ["tc"]):
                name = "eth0" if device[0] == "ip" else outside
                _run(*device, "qdisc", "add", "dev", name, "root", "tbf", "rate",
                     spec.link_rate, "burst", "64kb", "latency", "100ms")
        if spec.cpu_quota is not None:
            group = CGROUP_ROOT / "cpu" / namespace
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text(str(int(spec.cpu_quota * 100000)))
            machine.cgroups.append(group)
        if spec.memory_limit is not None:
            group = CGROUP_ROOT / "memory" / namespace
            group.mkdir()
            (group / "memory.limit_in_bytes").write_text(str(spec.memory_limit))
            machine.cgroups.append(group)

    def close(self) -> None:
        """Stop every process (by pid), then remove namespaces, the bridge, cgroups, files."""
        if self._closed:
            return
        self._closed = True
        processes = [p for machine in self.machines for p in machine.processes]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
        for process in processes:
            try:
                process.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_WAIT_S)
        for machine in self.machines:
            for group in machine.cgroups:
                for pid in _read_pids(group):  # children of ours that outlived their parent
                    _kill(pid)
        for machine in self.machines:
            _ip("netns", "delete", machine.namespace, check=False)
            for group in machine.cgroups:
                try:
                    group.rmdir()
                except OSError:
                    pass
        _ip("link", "delete", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _free_subnet() -> str:
    """A /24 of 198.18.0.0/15 whose host address no bridge of this host has yet."""
    taken = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    for third in range(256):
        subnet = f"{NETWORK}.{third}"
        if f"inet {subnet}.254/" not in taken:
            return subnet
    raise RuntimeError("every /24 of 198.18.0.0/16 is taken by another lab")


def _ip(*args: str, check: bool = True) -> None:
    _run("ip", *args, check=check)


def _run(*args: str, check: bool = True) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")


def _read_pids(group: Path) -> list[int]:
    try:
        return [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
