"""Test helpers that are not fixtures: run the CLI in-process, scan a config, a tiny case."""

from __future__ import annotations

import json
import runpy
import sys
import textwrap
from pathlib import Path

from click.testing import CliRunner

from nanaudit.cli import main

ROOT = Path(__file__).resolve().parent.parent



class Result:
    def __init__(self, code, stdout, stderr, report):
        self.code, self.stdout, self.stderr, self.report = code, stdout, stderr, report

    @property
    def finding(self):
        return self.report["finding"]



def run_cli(*args, env=None) -> Result:
    runner = CliRunner()
    result = runner.invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)
    return Result(result.exit_code, result.stdout, result.stderr, None)



def scan(config, *extra, tmp_path=None) -> Result:
    """`nanaudit scan CONFIG --json PATH`, returning the exit code and the parsed report."""
    out = Path(tmp_path or Path(config).parent) / "report.json"
    result = run_cli("scan", config, "--json", out, "--quiet", *extra)
    result.report = json.loads(out.read_text()) if out.exists() else None
    return result



# `python repro.py` with any `import nanaudit` failing: a bundle's repro.py stands alone.
BLOCK_NANAUDIT = ("import sys, runpy; sys.modules['nanaudit'] = None; sys.argv = ['repro.py'] + "
                  "sys.argv[1:]; runpy.run_path('repro.py', run_name='__main__')")


LINEAR_CASE = textwrap.dedent("""
    import torch
    from torch import nn

    def build_model():
        torch.manual_seed(0)
        return nn.Linear(3, 1)

    def batches():
        g = torch.Generator().manual_seed(0)
        for _ in range(4):
            yield torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)

    def loss(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()
""")

# LINEAR_CASE with a data source `case:interrupted` that is Ctrl-C'd before its third batch.
INTERRUPTED_CASE = LINEAR_CASE + (
    "\ndef interrupted():\n"
    "    for i, b in enumerate(batches()):\n"
    "        if i == 2:\n"
    "            raise KeyboardInterrupt\n"
    "        yield b\n")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: where a launch's ranks meet (env:// rendezvous). At
    random below the ephemeral range (32768 and up on Linux): the system gives those to every
    outgoing connection, gloo's many among them, and one could take the port between this call
    and rank 0's bind (rank 1 then waited on a store that was not its own until the timeout).
    Each xdist worker draws from a range of its own: two launches of two workers that drew the
    same port in the seconds before either bound it put one's rank 0 out (EADDRINUSE) and its
    rank 1 into the other's group, where both hung (a deepspeed launch was seen so)."""
    import random
    import socket
    low, high = _port_range()
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PORTS = (20000, 32000)      # below Linux's ephemeral range
_WORKER_PORTS = 2000         # a worker's share: six workers before the range repeats


def _port_range() -> tuple[int, int]:
    """This process's ports: its xdist worker's share (`gw3`: the fourth), else all of them."""
    import os
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return _PORTS
    shares = (_PORTS[1] - _PORTS[0]) // _WORKER_PORTS
    low = _PORTS[0] + (int(worker[2:]) % shares) * _WORKER_PORTS
    return low, low + _WORKER_PORTS - 1


def line_of(path: Path, text: str) -> int:
    """The 1-based number of the first line of `path` holding `text`."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def rank_reports(out: Path, nproc: int) -> list:
    """Each rank's JSON report of a `--json OUT` run under torchrun (rank 0 writes OUT, rank r
    OUT's folder's report.rank<r>.json), None for a rank that wrote none."""
    paths = [out] + [out.with_name(f"{out.stem}.rank{r}{out.suffix}") for r in range(1, nproc)]
    return [json.loads(p.read_text()) if p.exists() else None for p in paths]


def launch_ranks(argv, nproc: int = 2, timeout_s: float = 120) -> tuple[list, list]:
    """Start `python ARGV...` as `nproc` ranks with torchrun's environment variables (env://
    rendezvous on a free port); return each rank's exit code and (stdout, stderr). The ranks
    are forks of one interpreter that imported torch once (forked_ranks.py: a rank started
    apart pays its own import, seconds of CPU). Every rank is killed past `timeout_s`: no test
    hangs.

    Where several runs can share the ranks, give them one launch (tests/e2e/
    count_collectives.py's `--then` runs command lines in turn in the same processes, each at
    its own `free_port()`)."""
    timed_out = []
    for _attempt in range(_PORT_TRIES - 1):
        try:
            codes, outputs = _launch_ranks_once(argv, nproc, timeout_s)
        except LaunchTimedOut as e:
            if timed_out:
                raise AssertionError(f"{e}; an earlier launch timed out too:\n{timed_out[0]}") from None
            timed_out.append(e)
            continue
        if not any(_PORT_TAKEN in out + err for out, err in outputs):
            return codes, outputs
    return _launch_ranks_once(argv, nproc, timeout_s)


# free_port() gives a port free when asked; another test's process may take it before rank 0's
# store listens on it (xdist runs several launches at once). The ranks then fail to meet, and the
# launch is made again on a new port. A launch past its timeout is made again once too: on a
# loaded 2-core host two launches, each well inside it alone, have once run past it (the
# ranks' stacks at the timeout are kept, and the second timeout fails the test with both).
_PORT_TAKEN = "has failed to listen on any local network address"
_PORT_TRIES = 3


class LaunchTimedOut(AssertionError):
    """A launch's ranks ran past its timeout: the message holds each rank's output and its
    threads' stacks at that moment."""


def _launch_ranks_once(argv, nproc: int, timeout_s: float) -> tuple[list, list]:
    import os
    import signal
    import subprocess
    import tempfile
    port = free_port()
    envs = []
    for rank in range(nproc):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc)}
        env.pop("GITHUB_ACTIONS", None)
        envs.append(env)
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        spec = os.path.join(folder, "spec.json")
        with open(spec, "w") as f:
            json.dump({"argv": list(map(str, argv)), "envs": envs, "outputs": folder}, f)
        parent = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forked_ranks.py"), spec],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        try:
            out, err = parent.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            outputs = _stacks_then_kill(parent, folder, nproc)
            if any(_PORT_TAKEN in o + e for o, e in outputs):
                return [None] * nproc, outputs            # a peer waited on a taken port
            raise LaunchTimedOut(f"{argv} ran past {timeout_s} s; each rank's output and "
                                 f"stacks:\n{_tails(outputs)}") from None
        finally:
            if parent.poll() is None:
                os.killpg(parent.pid, signal.SIGKILL)     # the parent and every rank
                parent.wait()
        assert parent.returncode == 0, err
        outputs = _rank_outputs(folder, nproc)
    return json.loads(out.splitlines()[-1]), outputs


def _stacks_then_kill(parent, folder: str, nproc: int) -> list[tuple[str, str]]:
    """Have every process of a launch print its stacks (forked_ranks.py's SIGUSR1), kill them
    all, and return each rank's output."""
    import os
    import signal
    import time
    os.killpg(parent.pid, signal.SIGUSR1)
    time.sleep(1.0)
    os.killpg(parent.pid, signal.SIGKILL)             # the parent and every rank
    parent.wait()
    return _rank_outputs(folder, nproc)


def _tails(outputs: list[tuple[str, str]], chars: int = 6000) -> str:
    return "\n".join(f"--- rank {rank} stdout:\n{out[-chars:]}\n--- rank {rank} stderr:\n"
                     f"{err[-chars:]}" for rank, (out, err) in enumerate(outputs))


def _rank_outputs(folder: str, nproc: int) -> list[tuple[str, str]]:
    """(stdout, stderr) of each rank, as far as it wrote them."""
    import os
    outputs = []
    for rank in range(nproc):
        texts = []
        for stream in ("out", "err"):
            path = os.path.join(folder, f"{rank}.{stream}")
            texts.append(open(path).read() if os.path.exists(path) else "")
        outputs.append((texts[0], texts[1]))
    return outputs


def wait_for(path, proc, timeout: float = 60) -> None:
    """Wait until `proc` has made `path` (the point a test signals at); fail at once if the
    process ended first, or past `timeout`: no test hangs."""
    import time
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached the point to signal"
        time.sleep(0.02)


def on_fake_mesh(rank: int, test) -> None:
    """Run `test(mesh)` as `rank` of 4 on a ("dp", "tp") mesh of (2, 2), in this process: a
    fake process group, whose collectives do nothing (the global index needs none)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        test(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    finally:
        dist.destroy_process_group()


def plain(script: str, *args: str) -> None:
    """`python script args`, run in this process (its output is captured by capsys)."""
    saved = sys.argv[:]
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved
