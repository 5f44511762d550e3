"""Learning-rate schedules: linear warmup, then cosine decay, warmup-stable-decay, or constant."""

from __future__ import annotations

import optax


def make_schedule(kind: str, peak: float, steps: int, *, warmup: int = 0, min_ratio: float = 0.1,
                  decay_fraction: float = 0.2) -> optax.Schedule:
  """lr(step) for `steps` training steps.

  cosine:   0 -> peak linearly over `warmup`, then cosine to `min_ratio * peak` at `steps`.
  wsd:      warmup, constant `peak`, then linear decay to `min_ratio * peak` over the last
            `decay_fraction` of the steps (Hu et al., 2024, MiniCPM).
  constant: warmup, then `peak`.

  Args:
    kind: "cosine", "wsd" or "constant".
    peak: the learning rate after the warmup.
    steps: the number of training steps the schedule spans.
    warmup: steps of linear warmup from 0 (default 0: start at `peak`); must lie in [0, steps].
    min_ratio: the final learning rate as a fraction of `peak` (cosine and wsd; default 0.1).
    decay_fraction: wsd: the fraction of the steps spent in the final linear decay (default 0.2).

  Returns:
    The schedule, a function of the step.

  Raises:
    ValueError: when `warmup` is outside [0, steps], or `kind` is not a known schedule.

  References:
    Hu et al., "MiniCPM: Unveiling the Potential of Small Language Models with Scalable Training Strategies", 2024
      (the warmup-stable-decay schedule).
  """
  if not 0 <= warmup <= steps:
    raise ValueError(f"warmup ({warmup}) must lie in [0, steps={steps}]")
  end = peak * min_ratio
  warm = optax.linear_schedule(0.0, peak, warmup) if warmup else optax.constant_schedule(peak)
  if kind == "cosine":
    return optax.join_schedules([warm, optax.cosine_decay_schedule(peak, max(steps - warmup, 1), alpha=min_ratio)],
                                [warmup])
  if kind == "wsd":
    decay = max(int(round(steps * decay_fraction)), 1)
    stable = max(steps - warmup - decay, 0)
    return optax.join_schedules(
        [warm, optax.constant_schedule(peak), optax.linear_schedule(peak, end, decay)], [warmup, warmup + stable])
  if kind == "constant":
    return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
  raise ValueError(f"unknown schedule {kind!r}; choose cosine, wsd or constant")
