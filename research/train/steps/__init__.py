"""The compiled programs and the state they step: `TrainState` (train_state.py), the one step contract every step kind
produces and the one function that builds a step's outputs (contract.py), the one update path and the plain step
(step.py) with the update arguments it supplies, each declared once (update_args.py), the step with the observers due at
it (observed.py), a block-coordinate optimizer's blockwise step (blockstep.py, _reachstep.py), --freeze-layers'
(layerfreeze.py), --freeze's mask (frozen.py), --sync's programs (sync.py), the non-finite guard and the bad-step
monitor (health.py)."""
