"""A run built before its first step: the flag checks before anything starts (checks.py), `start` (run.py) over the
run's plan, resolved once and handed to every part beside its own section (plan.py), the mesh, data and pipeline
(startup.py), what does not combine (clashes.py), the model config and optimizer (build.py), the
state at step 0 (initial_state.py, init_from.py, adapters.py, and padnet.py: PAD-Net's mode partition), the memory pre-
flight (memory.py), --switch-at's layouts (switch.py), whether a blockwise optimizer runs its blockwise step
(blockwise.py) and the newest readable checkpoint (resume.py)."""
