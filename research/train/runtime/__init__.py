"""The process the run lives in: devices, BLAS threads and the compile cache (devices.py), multi-process bring-up
(processes.py), SIGINT/SIGTERM (signals.py; early.py, before the imports), XLA options (xla.py)."""
