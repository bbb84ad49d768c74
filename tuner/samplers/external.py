"""optuna (TPE, GP, NSGA-II) and deephyper (CBO) behind the Sampler seam.

Both see the layout as categorical knobs (the samplers' axes of trainer/contract/axes.py: tp, pp,
micro-batch, zero stage, checkpointing, sequence parallelism, with tp_col, ep and cp where used; then
the schedule); dp and the micro-batch count follow from them. A suggestion that is not a
valid layout, or one already run, is told back to them (invalid: as infeasible) and they are asked
again; after MAX_RETRIES the base class takes a random unseen layout. Layouts that ran out of
memory (and every other infeasible outcome: tuner/outcome.py feedback()) are constraints (optuna)
or "F" failures (deephyper), never plain FAILs, so neither proposes them again; an outcome that
tells nothing (infrastructure, cancelled) ends optuna's trial as FAIL (ignored by its samplers)
and is not told to deephyper at all. Warm start: both are first told the model's best-predicted
layout to try (docs/samplers.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainer.contract.axes import AXIS, SAMPLER_AXES
from trainer.contract.parallel import ParallelConfig
from tuner.outcome import Feedback, Outcome
from tuner.samplers.base import BaseSampler

if TYPE_CHECKING:
    from tuner.pricing import Pricing

SCHEDULE = "schedule"  # pp_schedule with virtual_stages as one knob ("none" at pp 1), after the axes
# The knobs every study has: the samplers' axes of the axis table (trainer/contract/axes.py) but
# those added later (written only when set: tp_col, ep, cp), which are knobs only in a study whose
# candidates use them, so a study without them keeps the search space it always had.
KNOBS = (*(name for name in SAMPLER_AXES if AXIS[name].written == "always"), SCHEDULE)
INT_KNOBS = tuple(name for name in SAMPLER_AXES if AXIS[name].sampler == "int")  # categorical ints
# Categorical strings read back as ints (micro_batch_size, zero_stage); the others stay strings.
_INT_STRINGS = tuple(
    name for name in SAMPLER_AXES if AXIS[name].sampler == "categorical" and AXIS[name].type is int
)
MAX_RETRIES = 16
CBO_BATCH = 8


def _knob_names(candidates: Sequence[ParallelConfig]) -> tuple[str, ...]:
    """KNOBS, with a later axis's knob (2D tensor parallelism's column degree after tp, expert and
    context parallelism's degrees after pp) when a candidate uses it. Without cp, cp2 dpr4 and cp1
    dpr8 at a fixed device count would share every knob: one key, and all but one of them
    unreachable."""
    used = [
        name for name in SAMPLER_AXES
        if AXIS[name].written == "always" or any(getattr(c, name) != AXIS[name].default for c in candidates)
    ]  # fmt: skip
    return (*used, SCHEDULE)


def _knobs(c: ParallelConfig, names: tuple[str, ...] = KNOBS) -> dict[str, Any]:
    sched = "none" if c.pp == 1 else f"{c.pp_schedule}/v{c.virtual_stages}"
    values = {k: str(getattr(c, k)) if AXIS[k].sampler == "bool" else getattr(c, k) for k in names[:-1]}
    return {**values, SCHEDULE: sched}  # booleans as categorical strings everywhere


def _value(outcome: Outcome) -> float:
    return outcome.tokens_per_s if outcome.ok else 0.0


class _Categorical(BaseSampler):
    def __init__(
        self, candidates: Sequence[ParallelConfig], seed: int = 0, *, pricing: Pricing | None = None,
        warm_start: ParallelConfig | None = None,
    ):  # fmt: skip
        super().__init__(candidates, seed, pricing=pricing)
        self.knobs = _knob_names(self.candidates)
        self.index = {tuple(_knobs(c, self.knobs).items()): c for c in self.candidates}
        all_knobs = [_knobs(c, self.knobs) for c in self.candidates]
        self.choices = {k: sorted({v if k in INT_KNOBS else str(v) for v in (d[k] for d in all_knobs)}, key=str)
                        for k in self.knobs}  # fmt: skip
        self.warm_start = warm_start

    def _lookup(self, params: dict[str, Any]) -> ParallelConfig | None:
        key = []
        for k in self.knobs:
            v = params[k]
            if k in _INT_STRINGS:
                v = int(v)
            key.append((k, v))
        return self.index.get(tuple(key))


class OptunaSampler(_Categorical):
    def __init__(
        self, candidates, seed: int = 0, *, pricing: Pricing | None = None, kind: str = "tpe",
        warm_start: ParallelConfig | None = None,
    ):  # fmt: skip
        import optuna

        super().__init__(candidates, seed, pricing=pricing, warm_start=warm_start)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.name = kind
        make = {
            "tpe": lambda: optuna.samplers.TPESampler(seed=seed, n_startup_trials=5),
            "gp": lambda: optuna.samplers.GPSampler(seed=seed, n_startup_trials=5),
            "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=seed, population_size=8),
        }[kind]
        self.study = optuna.create_study(direction="maximize", sampler=make())
        self.pending: dict[ParallelConfig, Any] = {}
        if warm_start is not None:
            self.study.enqueue_trial(self._params(warm_start))

    def _params(self, c: ParallelConfig) -> dict[str, Any]:
        return {k: (v if k in INT_KNOBS else str(v)) for k, v in _knobs(c, self.knobs).items()}

    def _suggest(self, trial) -> dict[str, Any]:
        return {k: trial.suggest_categorical(k, self.choices[k]) for k in self.knobs}

    def _finish(self, trial, value: float, feasible: bool) -> None:
        trial.set_constraint("feasible", 0.0 if feasible else 1.0)
        self.study.tell(trial, value)

    def _propose(self) -> ParallelConfig | None:
        import optuna

        for _ in range(MAX_RETRIES):
            trial = self.study.ask()
            config = self._lookup(self._suggest(trial))
            if config is None:
                self._finish(trial, 0.0, feasible=False)  # not a valid layout
            elif config in self.seen:  # a repeat: tell it what that layout gave
                known = next((o for c, o in self.history if c == config), None)
                if known is None:  # still running, or it told nothing: ignore the repeat
                    self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                else:
                    self._finish(trial, _value(known), feasible=known.ok)
            else:
                self.pending[config] = trial
                return config
        return None

    def _observe(self, config: ParallelConfig, outcome: Outcome, told: Feedback) -> None:
        import optuna

        trial = self.pending.pop(config, None)
        if told is Feedback.NOTHING:
            if trial is not None:
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return
        if trial is None:  # replayed from the database: enqueue its params, ask, tell
            self.study.enqueue_trial(self._params(config))
            trial = self.study.ask()
            self._suggest(trial)
        self._finish(trial, _value(outcome), feasible=told is Feedback.SCORE)


class CBOSampler(_Categorical):
    """deephyper's centralized Bayesian optimisation (UCB: the default UCBd failed with its GP
    surrogate here)."""

    name = "cbo"

    def __init__(
        self, candidates, seed: int = 0, *, pricing: Pricing | None = None, warm_start: ParallelConfig | None = None,
        log_dir: str | None = None,
    ):  # fmt: skip
        import tempfile
        import warnings

        from deephyper.hpo import CBO, HpProblem

        warnings.filterwarnings("ignore", message="The objective has been evaluated at this point before")

        super().__init__(candidates, seed, pricing=pricing, warm_start=warm_start)
        problem = HpProblem(seed=seed)
        for k in self.knobs:
            problem.add_hyperparameter([str(v) for v in self.choices[k]], k)
        initial = (
            [{k: str(v) for k, v in _knobs(warm_start, self.knobs).items()}]
            if warm_start is not None
            else None
        )
        if log_dir is None:  # deephyper wants a directory; ours goes with the sampler
            self._log_dir = tempfile.TemporaryDirectory(prefix="cbo-")
            log_dir = self._log_dir.name
        self.search = CBO(problem, random_state=seed, acq_func="UCB", log_dir=log_dir,
                          checkpoint_history_to_csv=False, initial_points=initial, n_initial_points=5,
                          acq_optimizer="sampling", acq_optimizer_kwargs={"max_total_failures": -1, "n_points": 1000})  # fmt: skip
        self.pending: dict[ParallelConfig, dict] = {}

    def _lookup(self, params: dict[str, Any]) -> ParallelConfig | None:
        typed = {k: (int(v) if k in INT_KNOBS else v) for k, v in params.items() if k in self.knobs}
        return super()._lookup(typed)

    def _propose(self) -> ParallelConfig | None:
        # Each ask() refits the surrogate (~0.1 s): ask for a batch, keep the first valid new
        # layout, tell the rest back in one call.
        for _ in range(MAX_RETRIES // CBO_BATCH):
            chosen, told = None, []
            for params in self.search.ask(CBO_BATCH):
                config = self._lookup(params)
                if (
                    chosen is None
                    and config is not None
                    and config not in self.seen
                    and config not in self.pending
                ):
                    chosen = config
                    self.pending[config] = params
                elif config is None:
                    told.append((params, "F_invalid"))
                elif config in self.seen:
                    known = next((o for c, o in self.history if c == config), None)
                    told.append((params, known.tokens_per_s if known and known.ok else "F_seen"))
                else:  # a second valid new layout in the batch: let the surrogate propose it again
                    told.append((params, "F_deferred"))
            if told:
                self.search.tell(told)
            if chosen is not None:
                return chosen
        return None

    def _observe(self, config: ParallelConfig, outcome: Outcome, told: Feedback) -> None:
        params = self.pending.pop(config, None) or {k: str(v) for k, v in _knobs(config, self.knobs).items()}
        if told is Feedback.NOTHING:
            return
        self.search.tell([(params, outcome.tokens_per_s if told is Feedback.SCORE else "F_infeasible")])
