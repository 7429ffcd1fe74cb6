"""The check core: what a step reads, and what its read decides, written once for every front
end (the step loop of `scan`, `Sentinel` and its callbacks, the `nanaudit run` script auditor).

- `scope`: what a step reads besides the optimizer's parameters and gradients: the model's
  floating buffers (a running statistic a forward updates), found once, read live.
- `scaler`: a GradScaler's skipped steps, counted, and the one rule that makes them a finding
  (the scale collapsed: below its floor, or too many skips in a row).
- `verdict`: which check tripped, from a step's finiteness flags, in step order.
- `rank_row`: under torchrun, each rank's row of flags in the step's one exchange, and the
  table's verdict by the one per-rank rule.
- `decision`: what the caller does with the step's update once the read is in: apply it, or
  stop (the place a later "skip this step and go on" mode joins).

The front ends decide only *when* to check and with what; the reading and the deciding are here.
"""
