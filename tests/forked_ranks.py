"""`python forked_ranks.py SPEC.json`: a launch's ranks as forks of one interpreter that has
imported torch once (helpers.launch_ranks starts it).

A rank is `python ARGV...` (a script, or `-m module`) with its own torchrun environment. Started
apart, every rank pays an interpreter and a torch import: about 2.3 s of CPU each, the larger
part of a short multi-process test's cost (a 4-rank launch of a 5-step FSDP2 + TP script takes
about 14 s of CPU, 9 of them imports). Here the parent imports torch and its distributed stack
once (dynamo too: FSDP2 and DTensor import it at their first use, another 1.5 s of CPU a rank),
while it runs a single thread (so a fork copies no lock another thread held), and forks one
child per rank; each child sets its rank's environment, points its stdout and stderr at
its own files, and runs the command line as `python` would (`sys.argv`, `sys.path[0]`, the
module or script run as `__main__`; an uncaught exception prints its traceback and exits 1; a
SystemExit's code is the exit code; atexit handlers run). Nothing of nanaudit is imported
before the fork: each rank imports it as the plain command would, in its own environment.

SPEC: {"argv": [...], "envs": [{...} per rank], "outputs": folder}. The parent writes each
rank's exit code (as `Popen.returncode`: -N for a signal) as a JSON list to its stdout; the
ranks' output is in `folder/RANK.out` and `folder/RANK.err`. SIGUSR1 makes the parent and every
rank print their threads' Python stacks to their stderr and go on."""

import faulthandler
import gc
import json
import os
import runpy
import signal
import sys
import threading

import torch
import torch._dynamo
import torch.distributed
import torch.distributed.fsdp
import torch.distributed.tensor.parallel  # noqa: F401


def run_rank(rank: int, spec: dict) -> None:
    """This child's rank: never returns (its SystemExit ends the interpreter, as `python`)."""
    os.environ.clear()
    os.environ.update(spec["envs"][rank])
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(spec["outputs"], f"{rank}.{suffix}"),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    argv = spec["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]    # run_module puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    assert threading.active_count() == 1, "forking a process that runs other threads"
    sys.stdout.flush()
    sys.stderr.flush()
    # SIGUSR1 prints every thread's Python stack to fd 2, the rank's own .err file after the
    # fork (the handler and its fd are inherited): a launch past its timeout is dumped so first.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The imported heap moves to the permanent generation: no rank's collector walks it (a
    # collection at each rank's exit walked all of torch's objects, copying the pages each
    # touched: about 1 s of CPU a rank, as much as the run itself).
    gc.freeze()
    pids = []
    for rank in range(len(spec["envs"])):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, spec)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
