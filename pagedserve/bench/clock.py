"""A step-time model fitted to measured engine steps: the simulated clock without the noise.

On a shared machine a step's wall time also measures whatever else ran meanwhile, and a
burst of load lasting a minute skews a whole rate point. So the serving benchmarks time
one calibration run (every request queued at once: steps of every batch size from 1 up,
as the queue fills and drains), fit

    step_s = a + b * sequences + c * new_tokens + d * context_tokens

by least squares, refitted without the steps slower than the fit by more than 3 median
absolute residuals until that set settles (contention only ever adds time), and advance the simulated clock by
the model's time for each step instead of its wall time. A coefficient that comes out
negative is dropped and the rest refitted. The fit's R^2 and coefficients go in the JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.bench.sim import step_features

FEATURES = ("fixed", "per_sequence", "per_new_token", "per_context_token")


@dataclass(frozen=True)
class StepCostModel:
    coefficients: tuple[float, float, float, float]  # seconds: fixed, per sequence, per token, per context token
    r2: float
    num_steps: int

    def __call__(self, out: Any) -> float:
        return self.predict(step_features(out))

    def predict(self, features: Sequence[int]) -> float:
        a, b, c, d = self.coefficients
        seqs, tokens, context = features
        return a + b * seqs + c * tokens + d * context

    def as_dict(self) -> dict[str, Any]:
        return {"coefficients_s": dict(zip(FEATURES, self.coefficients, strict=True)), "r2": self.r2,
                "num_steps": self.num_steps}


def fit_step_model(steps: list[tuple[tuple[int, int, int], float]]) -> StepCostModel:
    """Least-squares fit of step time on (1, sequences, new tokens, context tokens)."""
    import numpy as np

    if len(steps) < 8:
        raise ValueError(f"need at least 8 measured steps to fit a step-time model, got {len(steps)}")
    x = np.array([(1.0, *f) for f, _ in steps], dtype=np.float64)
    y = np.array([t for _, t in steps], dtype=np.float64)
    keep = np.ones(len(y), dtype=bool)
    for _ in range(10):  # refit until the set of steps kept stops changing
        coef = _nonnegative_lstsq(x[keep], y[keep])
        residual = y - x @ coef
        mad = float(np.median(np.abs(residual[keep]))) or 1e-12
        new_keep = residual <= 3 * mad
        if (new_keep == keep).all():
            break
        keep = new_keep
    fitted = x[keep] @ coef
    total = float(np.sum((y[keep] - y[keep].mean()) ** 2)) or 1e-18
    r2 = 1.0 - float(np.sum((y[keep] - fitted) ** 2)) / total
    return StepCostModel(tuple(float(c) for c in coef), r2, int(keep.sum()))  # type: ignore[arg-type]


def _nonnegative_lstsq(x: Any, y: Any) -> Any:
    import numpy as np

    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))


def modelled_makespan(run: Any, model: StepCostModel) -> float:
    """A measured run's makespan with each step's wall time replaced by the model's: time
    spent waiting outside steps (adapter loads) and idle gaps stay as they were."""
    return run.makespan_s - run.wall_s + sum(model.predict(features) for features, _ in run.steps)
