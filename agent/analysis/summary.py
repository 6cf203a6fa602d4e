"""The few readable lines `sustain analyze` prints without --json."""

from __future__ import annotations

from agent.analysis.result import SteadyStateResult


def render_summary(result: SteadyStateResult, unit: str = "iterations/s") -> str:
    """Classification first, then peak over its window, steady with its interval, the sustained
    ratio and the warm-up (in seconds where the series gave times, else in iterations), then why.
    Every throughput is work over time (docs/design.md). Figures have four significant digits,
    the interval and the ratio are worded as `sustain probe` words them."""
    lines = [f"{result.classification.value} ({result.n} iterations)"]
    if result.peak_throughput is not None:
        window = result.peak_window_iterations
        over = "" if window is None else f" (best {window} consecutive iterations)"
        lines.append(f"peak      {result.peak_throughput:.4g} {unit}{over}")
    if result.steady_throughput is not None and result.steady_ci is not None:
        low, high = result.steady_ci
        lines.append(
            f"steady    {result.steady_throughput:.4g} {unit}, work over time of the steady "
            f"regime (99% interval {low:.4g} to {high:.4g})"
        )
    if result.sustained_ratio is not None:
        lines.append(f"sustained {result.sustained_ratio:.3f} of peak (steady / peak)")
    if result.warmup_throughput is not None and result.steady_start_index is not None:
        span = f"{result.steady_start_index} iterations"
        if result.warmup_seconds is not None:
            span = f"{result.warmup_seconds:.3g} s ({span})"
        lines.append(f"warm-up   {span} at {result.warmup_throughput:.4g} {unit}")
    elif result.steady_start_index is not None and not result.reason.startswith(
        start := f"steady from iteration {result.steady_start_index}"
    ):  # said once: the reason may open with it
        if result.warmup_seconds is not None:
            start += f" ({result.warmup_seconds:.3g} s)"
        lines.append(start)
    lines.append(result.reason)
    return "\n".join(lines)
