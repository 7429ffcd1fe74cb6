"""`python count_collectives.py OUT ARGV... [--then PORT OUT ARGV...]...`: run `python ARGV...`
(a script, or `-m module`) and, when the script destroys its process group, write how many
collectives each of its process groups ran (the group's sequence number: every collective on it,
whoever issued it: the script, FSDP, tensor parallel, nanaudit) to OUT.rankN as JSON {the
group's ranks: count}, so a test can compare a plain run with an audited one.

Each `--then PORT OUT ARGV...` runs one more command line after the previous one, in this same
process, its ranks meeting at MASTER_PORT=PORT (a fresh store: the previous run's is gone, and a
peer still on the old port must not join the new group). A plain run followed by an audited one
costs one interpreter and one torch import per rank instead of two. A command that ends the
process (nanaudit run under torchrun exits at once once its reports are written) must be last."""

import json
import os
import runpy
import sys

import torch.distributed as dist

THEN = "--then"


def runs(args: list[str]) -> list[tuple[str | None, str, list[str]]]:
    """(port or None: the launch's own, OUT, ARGV) for each command line, in order."""
    segments, current = [], [None]
    for arg in args:
        if arg == THEN:
            segments.append(current)
            current = []
        else:
            current.append(arg)
    segments.append(current)
    return [(seg[0], seg[1], seg[2:]) for seg in segments]


def run_counted(out: str, argv: list[str]) -> None:
    destroy = dist.destroy_process_group

    def counted_destroy(group=None):
        if group is None:
            counts = {}
            for pg in dist.distributed_c10d._world.pg_map:
                ranks = dist.get_process_group_ranks(pg)
                key = ",".join(map(str, ranks))
                counts[key] = counts.get(key, 0) + pg._get_sequence_number_for_group()
            with open(f"{out}.rank{dist.get_rank()}", "w") as f:
                json.dump(counts, f)
        return destroy(group)
    dist.destroy_process_group = counted_destroy
    sys.argv = argv[1:] if argv[0] == "-m" else argv
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        dist.destroy_process_group = destroy


def main() -> int:
    for port, out, argv in runs(sys.argv[1:]):
        if port is not None:
            os.environ["MASTER_PORT"] = port
        run_counted(out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
