"""A study's budgets, decided from what the database says it used (tuner.store.usage), so a
restarted worker or the next Slurm allocation continues the same budget."""

from __future__ import annotations

from tuner.spec import BudgetSpec
from tuner.store import Usage


def may_add_trial(budget: BudgetSpec, used: Usage) -> bool:
    """A new layout may be asked for: fewer than max_trials trials exist (pruned ones do not
    count; a re-queued trial is the same trial)."""
    return used.trials < budget.max_trials


def stop_reason(budget: BudgetSpec, used: Usage) -> str | None:
    """Why no further trial may start (queued ones included), or None. Running trials finish."""
    if budget.max_wall_time_s and used.wall_s >= budget.max_wall_time_s:
        return f"max_wall_time_s ({budget.max_wall_time_s:g} s) reached after {used.wall_s:.0f} s"
    if budget.max_device_hours and used.device_s / 3600 >= budget.max_device_hours:
        return f"max_device_hours ({budget.max_device_hours:g}) reached: {used.device_s / 3600:.4g} used"
    if budget.early_stop_trials and used.since_improvement >= budget.early_stop_trials:
        return (f"early stop: {used.since_improvement} trials without beating the best by more than "
                f"{budget.early_stop_min_improvement:.0%}")  # fmt: skip
    return None
