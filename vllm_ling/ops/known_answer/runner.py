"""Known-answer cases, the per-kernel result, and the runner that compares a kernel with them."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch

from vllm_ling.log import one_line


@dataclasses.dataclass
class KnownAnswerCase:
    """One input of a kernel and its answer (float64, CPU).

    ``per_row``: error of output row t is ||out_t - ref_t|| / ||ref_t|| (random inputs);
    else elementwise |out - ref| / (|ref| + floor) (one-hot inputs, ``floor`` per element
    far below any code step so a wrong zero shows). ``explain`` turns the mask of bad rows /
    elements into the inputs that failed (codes, blocks, expert regimes)."""

    label: str
    inputs: dict[str, Any]
    reference: torch.Tensor
    rtol: float
    per_row: bool = False
    floor: torch.Tensor | None = None
    explain: Callable[[torch.Tensor], str] | None = None
    judged_rows: torch.Tensor | None = None  # per_row: bool mask of the rows compared (default all)


@dataclasses.dataclass
class KernelCheckResult:
    name: str  # what is checked, e.g. "dense_fp8"
    kernel: str  # what ran, read from the objects that serve
    passed: bool
    max_error: float  # worst case's max relative error (inf: non-finite or raised)
    tolerance: float  # that case's tolerance
    failing_inputs: list[str]
    seconds: float
    cases: int = 0
    skipped: str | None = None  # reason the kernel could not be checked here

    def message(self) -> str:
        if self.skipped:
            return f"{self.name} [{self.kernel}]: not checked ({self.skipped})"
        if self.passed:
            return (f"{self.name} [{self.kernel}]: {self.cases} known-answer cases passed "
                    f"(max relative error {self.max_error:.3g} <= {self.tolerance:.3g})")
        return (f"{self.name} [{self.kernel}]: max relative error {self.max_error:.3g} > tolerance "
                f"{self.tolerance:.3g} on {'; '.join(self.failing_inputs)}")

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["max_error"] = None if math.isinf(self.max_error) or math.isnan(self.max_error) else self.max_error
        return d


def _case_errors(case: KnownAnswerCase, out: torch.Tensor) -> torch.Tensor:
    out = out.detach().to("cpu", torch.float64).reshape(case.reference.shape)
    diff = (out - case.reference).abs()
    if case.per_row:
        err = diff.norm(dim=-1) / case.reference.norm(dim=-1).clamp(min=1e-300)
        finite = torch.isfinite(out).all(dim=-1)
        if case.judged_rows is not None:
            err, finite = err * case.judged_rows, finite | ~case.judged_rows
    else:
        floor = case.floor if case.floor is not None else torch.zeros(())
        err = diff / (case.reference.abs() + floor)
        finite = torch.isfinite(out)
    return torch.where(finite, err, torch.full_like(err, math.inf))


def run_check(name: str, kernel: str, cases: list[KnownAnswerCase],
              forward: Callable[[dict[str, Any]], torch.Tensor]) -> KernelCheckResult:
    """Run ``forward(case.inputs)`` on every case and compare with the answers."""
    t0 = time.perf_counter()
    worst_ratio, max_error, tolerance = -1.0, 0.0, cases[0].rtol if cases else 0.0
    failing: list[str] = []
    for case in cases:
        try:
            out = forward(case.inputs)
            if torch.is_tensor(out) and out.is_cuda:
                torch.cuda.synchronize(out.device)
            err = _case_errors(case, out)
        except Exception as exc:  # a kernel that raises fails its check, named
            failing.append(f"{case.label}: raised {one_line(exc)}")
            worst_ratio, max_error, tolerance = math.inf, math.inf, case.rtol
            continue
        case_max = float(err.max()) if err.numel() else 0.0
        ratio = case_max / case.rtol
        if ratio > worst_ratio:
            worst_ratio, max_error, tolerance = ratio, case_max, case.rtol
        bad = err > case.rtol
        if bool(bad.any()):
            detail = case.explain(bad) if case.explain else f"{int(bad.sum())} of {bad.numel()} outputs"
            failing.append(f"{case.label}: {detail}")
    return KernelCheckResult(name, kernel, not failing, max_error, tolerance, failing,
                             time.perf_counter() - t0, len(cases))


def skipped_result(name: str, kernel: str, reason: str) -> KernelCheckResult:
    return KernelCheckResult(name, kernel, True, 0.0, 0.0, [], 0.0, 0, skipped=reason)
