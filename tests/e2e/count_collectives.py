"""`python count_collectives.py OUT ARGV...`: run `python ARGV...` (a script, or `-m module`)
and, when the script destroys its process group, write how many collectives each of its process
groups ran (the group's sequence number: every collective on it, whoever issued it: the
script, FSDP, tensor parallel, nanaudit) to OUT.rankN as JSON {the group's ranks: count}, so a
test can compare a plain run with an audited one."""

import json
import runpy
import sys

import torch.distributed as dist


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
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
    if argv[0] == "-m":
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
