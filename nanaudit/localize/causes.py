"""The cause catalogue: every id a finding can name, what it means and the fix to suggest.

The ids are a public contract (the JSON report's `finding.cause`, JUnit test names, GitHub
annotations): an id never changes meaning once released. `Cause` (report/vocabulary.py, where
every renderer can read it) is the one spelling of them in the code, so a misspelt id fails
where it is written, not when a finding reaches `fix_for`.
"""

from __future__ import annotations

from nanaudit.report.vocabulary import Cause

# id -> (what happened, the usual fix)
CAUSES: dict[Cause, tuple[str, str]] = {
    Cause.NONFINITE_INPUT: (
        "a batch tensor already holds NaN/Inf before the model runs, and no torch op of the "
        "data code made it: it was already non-finite when it reached torch",
        "clean or filter the sample (the data set holds it, or the code that reads it: a file, "
        "NumPy, pandas); `nanaudit bisect` lists every such batch and row for a skip list"),
    Cause.NONFINITE_PARAMETER: (
        "a parameter or buffer is non-finite before the step",
        "restore the last good checkpoint; find where it went bad with `nanaudit bisect "
        "--checkpoints`"),
    Cause.LOG_DOMAIN: (
        "log of a value <= 0 (log1p of a value <= -1)",
        "clamp the input (`torch.log(x.clamp(min=1e-12))`), or use `log_softmax`, "
        "`F.logsigmoid` or `BCEWithLogitsLoss` instead of a hand-written log"),
    Cause.DIV_BY_ZERO: (
        "division or reciprocal by zero",
        "add an eps to the denominator, `clamp(min=1)` on counts, or guard with `torch.where` "
        "before dividing"),
    Cause.SQRT_DOMAIN: (
        "sqrt / fractional pow of a negative value, or sqrt at exactly 0 in backward",
        "`torch.sqrt(x + eps)` or `torch.sqrt(x.clamp(min=eps))`: the derivative 1/(2*sqrt(x)) "
        "is infinite at 0"),
    Cause.EXP_OVERFLOW: (
        "exp overflowed: its input is above log(dtype max)",
        "subtract the max before exp (the log-sum-exp trick), or use `softmax`, `log_softmax`, "
        "`logsumexp`, `F.softplus` instead of the hand-written formula"),
    Cause.TRIG_DOMAIN: (
        "acos / asin outside [-1, 1] or at +-1 in backward; atan2 at (0, 0) in backward",
        "`x.clamp(-1 + eps, 1 - eps)` before acos/asin; add eps to both atan2 arguments"),
    Cause.NORM_AT_ZERO: (
        "the norm of an all-zero vector: finite forward, 0/0 in backward",
        "use `F.normalize(x, eps=...)` or `torch.sqrt((x * x).sum() + eps)`"),
    Cause.SOFTMAX_ALL_MASKED: (
        "softmax over a row whose entries are all -inf",
        "drop empty or fully padded sequences, or fill masks with a large finite negative "
        "(`torch.finfo(dtype).min`) instead of -inf"),
    Cause.DEGENERATE_REDUCTION: (
        "a reduction over too few elements: std/var with degrees of freedom <= 0, a mean over "
        "nothing (every target ignored)",
        "use `correction=0`, `drop_last=True`, or skip batches with no valid element"),
    Cause.POLE: (
        "a function evaluated at (or rounded onto) a pole: lgamma / digamma / polygamma at 0 or a "
        "negative integer, tan at pi/2, x ** -k at 0; often the argument underflowed onto it",
        "keep the argument off the pole: `F.softplus(x) + eps` or `x.clamp(min=eps)` before "
        "lgamma / digamma / a negative power; fix what put the value there (a softplus or exp "
        "of a large negative number underflows to exactly 0)"),
    Cause.DTYPE_OVERFLOW: (
        "a finite computation exceeded the dtype's range",
        "compute that part in float32, scale it down, or use a GradScaler with AMP"),
    Cause.MASKED_NONFINITE_GRADIENT: (
        "a NaN/Inf made in forward was masked or indexed away, so the loss is finite but "
        "backward computes 0 * inf = NaN",
        "mask *before* the op (the double where): `safe = torch.where(m, x, 1.0); "
        "y = torch.where(m, f(safe), 0.0)`"),
    Cause.IMPOSSIBLE_CTC_TARGET: (
        "CTC loss with a target that cannot fit the input length: the loss is inf",
        "pass `zero_infinity=True` to the CTC loss, or filter samples whose target (plus "
        "repeats) is longer than the input"),
    Cause.DIVERGENCE: (
        "the loss, the gradient norm or the weights an update grew until a value overflowed",
        "lower the learning rate, clip gradients (`grad_clip:`), add warm-up"),
    Cause.OPTIMIZER_UPDATE: (
        "gradients were finite but the optimizer update made parameters non-finite",
        "check the optimizer's hyper-parameters and scheduler (lr, eps: Adam's eps=1e-8 is 0 "
        "in float16)"),
    Cause.INF_ARITHMETIC: (
        "an op turned infinities into NaN (inf - inf, 0 * inf, inf / inf)",
        "follow the inf back to where it was made and guard that op"),
    Cause.COMPILED_ONLY: (
        "only the torch.compile'd program makes the value: the eager step from the same state "
        "is finite (a decomposition or fused kernel computes an op less safely, or random ops "
        "draw differently)",
        "train with the stage that stays finite (`torch.compile(model, backend=\"aot_eager\")`, "
        "or without compile) until it is fixed; make a minimal repro with torch's minifier "
        "(`TORCHDYNAMO_REPRO_AFTER=aot TORCHDYNAMO_REPRO_LEVEL=4`) and report it at "
        "https://github.com/pytorch/pytorch/issues"),
    Cause.UNKNOWN: (
        "none of the catalogue's causes fits",
        "inspect the op and its inputs' statistics below"),
}


def fix_for(cause: Cause) -> str:
    """The catalogue's usual fix for a cause (a plain id string finds it too)."""
    return CAUSES[cause][1]


def divergence_fix(optimizer: str, which: str = "the optimizer at this step",
                   clips: bool = False) -> str:
    """The fix for a divergence in the script's terms: `which` optimizer and its rate;
    `clips`: the script clips its gradients already (then clipping is not the advice)."""
    fix = "lower the learning rate or warm it up"
    if optimizer:
        fix += f" ({which}: {optimizer})"
    if "Adam" in optimizer:
        # Adam divides by the gradient's own scale: its update is about lr per weight.
        fix += "; clipping the gradients does not shrink an Adam update, the rate does"
    else:
        fix += _CLIPS_ALREADY if clips else _CLIP_ADVICE
    return fix


_CLIP_ADVICE = ", or clip the gradients (`torch.nn.utils.clip_grad_norm_`)"
_CLIPS_ALREADY = ("; the script clips its gradients already (`clip_grad_norm_`), which bounds "
                  "the gradient, not the rate times it")


def clipping_known(fix: str) -> str:
    """A divergence's fix (divergence_fix's) for a script that clips its gradients already."""
    return fix[:-len(_CLIP_ADVICE)] + _CLIPS_ALREADY if fix.endswith(_CLIP_ADVICE) else fix
