"""The few readable lines `sustain analyze` prints without --json."""

from __future__ import annotations

from agent.analysis.result import SteadyStateResult


def render_summary(result: SteadyStateResult, unit: str = "iterations/s") -> str:
    """Classification first, then peak, steady with its CI, the sustained ratio and the warm-up
    (in seconds where the series gave times, else in iterations), then why."""
    lines = [f"{result.classification.value} ({result.n} iterations)"]
    if result.peak_throughput is not None:
        lines.append(f"peak      {result.peak_throughput:.6g} {unit}")
    if result.steady_throughput is not None and result.steady_ci is not None:
        low, high = result.steady_ci
        lines.append(
            f"steady    {result.steady_throughput:.6g} {unit} (99% CI {low:.6g} to {high:.6g})"
        )
    if result.sustained_ratio is not None:
        lines.append(f"sustained {result.sustained_ratio:.1%} of peak")
    if result.warmup_throughput is not None and result.steady_start_index is not None:
        span = f"{result.steady_start_index} iterations"
        if result.warmup_seconds is not None:
            span = f"{result.warmup_seconds:.3g} s ({span})"
        lines.append(f"warm-up   {span} at {result.warmup_throughput:.6g} {unit}")
    elif result.steady_start_index is not None:
        start = f"steady from iteration {result.steady_start_index}"
        if result.warmup_seconds is not None:
            start += f" ({result.warmup_seconds:.3g} s)"
        lines.append(start)
    lines.append(result.reason)
    return "\n".join(lines)
