"""The bad steps of a run that keeps going (--keep-going), kept bounded.

A run may skip thousands of bad steps (a corrupt shard with a large --max-bad-steps), and its
report must stay under the 2 MB bound of long runs (run/timeline.py). So `BadStepLog` keeps:
  - the first KEEP_WHOLE findings whole (the report's `findings`; a finding with its input
    statistics, rows and chain is a few KB, so at most about 20 x 30 KB);
  - every later one folded into a `BadStepGroup` by (cause, op, file, line): a count and its
    steps as StepSpans (first, last and at most MAX_SPANS runs of consecutive steps);
  - every bad step's steps as StepSpans, and one skip-list entry per bad step (its batch and
    rows, for the --skip-list file; that file is not the report and is not summarized).
Memory and the report are bounded by KEEP_WHOLE, MAX_SPANS and the number of distinct
(cause, op, line), whatever the number of bad steps.

A cause is *persistent* when every bad step names an op, all the same op at the same line, over
at least PERSISTENT_MIN_STEPS bad steps: skipping will not outrun it (a bad shard, a formula
that fails on a class of inputs), and the report says so. Steps whose findings name no op (a
non-finite input, a replay that did not reproduce) never make a cause persistent.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from nanaudit.report.model import BadStepEntry, Finding, Report, TimelineEntry
from nanaudit.report.sections import BadStepGroup, BadSteps, SkipEntry, StepSpans
from nanaudit.report.skip_list import skip_entry
from nanaudit.report.vocabulary import BadStepAction, Cause, StopReason

MAX_BAD_STEPS = 10   # --max-bad-steps' default: bad steps skipped before the next one stops
KEEP_WHOLE = 20
MAX_SPANS = 32
PERSISTENT_MIN_STEPS = 3

# A finding's (cause, op, file, line): what the summary groups by.
Key = tuple[Cause, str | None, str | None, int | None]


@dataclass
class SpanLog:
    """Steps added in increasing order, kept as at most MAX_SPANS runs of consecutive steps."""

    spans: list[list[int]] = field(default_factory=list)
    left_out: int = 0
    first: int | None = None
    last: int | None = None

    def add(self, step: int) -> None:
        if self.last is not None and step <= self.last:
            raise ValueError(f"bad steps must come in step order: {step} after {self.last}")
        if self.first is None:
            self.first = step
        if self.spans and self.last == step - 1 and self.spans[-1][1] == self.last:
            self.spans[-1][1] = step
        elif self.last is not None and self.last == step - 1 and self.left_out:
            pass                            # extends a run that is counted, not listed
        elif len(self.spans) < MAX_SPANS:
            self.spans.append([step, step])
        else:
            self.left_out += 1
        self.last = step

    def spans_of(self) -> StepSpans:
        assert self.first is not None and self.last is not None, "a step was added"
        return StepSpans(self.first, self.last, [list(s) for s in self.spans], self.left_out)


@dataclass
class _Group:
    count: int = 0
    steps: SpanLog = field(default_factory=SpanLog)


def finding_key(finding: Finding) -> Key:
    source = finding.source
    return (finding.cause, finding.op, source.file if source else None,
            source.line if source else None)


class BadStepLog:
    """Record each bad step's finding as the run meets it, in step order (see the module
    docstring); `apply` puts them in the report."""

    def __init__(self, max_bad_steps: int, keep_whole: int = KEEP_WHOLE):
        if max_bad_steps < 1 or keep_whole < 1:
            raise ValueError("max_bad_steps and keep_whole must be at least 1")
        self.max_bad_steps, self.keep_whole = max_bad_steps, keep_whole
        self.whole: list[Finding] = []
        self.skip: list[SkipEntry] = []
        self.count = self.skipped = 0
        self.stopped: StopReason | None = None
        self._steps = SpanLog()
        self._groups: dict[Key, _Group] = {}
        self._keys: set[Key] = set()
        self._without_op = False

    def record(self, finding: Finding, action: BadStepAction,
               stop_reason: StopReason | None = None) -> None:
        """One bad step: its finding, whether its update was skipped or the run stopped there
        (and why)."""
        if self.stopped is not None:
            raise ValueError(f"the run already stopped at a bad step ({self.stopped})")
        if (action == BadStepAction.STOPPED) != (stop_reason is not None):
            raise ValueError("a stopped step says why it stopped; a skipped one does not")
        self._steps.add(finding.step)
        finding.action, finding.stop_reason = action, stop_reason
        self.count += 1
        self.skipped += action == BadStepAction.SKIPPED
        self.stopped = stop_reason
        key = finding_key(finding)
        self._keys.add(key)
        self._without_op |= finding.op is None
        self.skip.append(skip_entry(finding))
        if len(self.whole) < self.keep_whole:
            self.whole.append(finding)
            return
        group = self._groups.setdefault(key, _Group())
        group.count += 1
        group.steps.add(finding.step)

    @property
    def persistent(self) -> bool:
        return (self.count >= PERSISTENT_MIN_STEPS and len(self._keys) == 1
                and not self._without_op)

    def section(self) -> BadSteps:
        groups = sorted(self._groups.items(), key=lambda item: item[1].steps.first or 0)
        return BadSteps(
            max_bad_steps=self.max_bad_steps, count=self.count, skipped=self.skipped,
            whole=len(self.whole), stopped=self.stopped, persistent=self.persistent,
            steps=self._steps.spans_of(),
            summarized=[BadStepGroup(cause, op, file, line, g.count, g.steps.spans_of())
                        for (cause, op, file, line), g in groups])

    def apply(self, report: Report) -> None:
        """The report's `finding` (the first bad step's), `findings`, `bad_steps` and
        `skip_list`, and the mark of each bad step the timeline keeps (its `bad`)."""
        if not self.whole:
            return
        report.finding, report.findings = self.whole[0], list(self.whole)
        report.bad_steps = self.section()
        report.skip_list = list(self.skip)
        report.timeline = [self._marked(entry) for entry in report.timeline]

    def _marked(self, entry: TimelineEntry) -> TimelineEntry:
        if not self.contains(entry.step):
            return entry
        stopped = self.stopped is not None and entry.step == self._steps.last
        action = BadStepAction.STOPPED if stopped else BadStepAction.SKIPPED
        return BadStepEntry(**{f.name: getattr(entry, f.name) for f in fields(TimelineEntry)},
                            bad=action)

    def adopt(self, traced: dict[int, Finding]) -> None:
        """The whole findings of these steps, as another rank completed them (it traced what
        made a non-finite input), in place of this rank's copies."""
        self.whole = [traced.get(finding.step, finding) for finding in self.whole]

    def contains(self, step: int) -> bool:
        """Whether `step` was a bad step, as far as the bounded spans still list it."""
        return any(start <= step <= end for start, end in self._steps.spans) or \
            step == self._steps.last
