"""A run's files: the run directory (rundir.py), orbax checkpoints (checkpoint.py) and their checksums (integrity.py),
runs and Hugging Face directories read as models (pretrained.py)."""
