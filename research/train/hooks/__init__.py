"""What the loop calls around each step, at a cadence (cadence.py): the metrics processor (metrics.py), trackers
(trackers.py, _tbimport.py), dynamic data weights (source_weights.py), the profiler (profiler.py), the peer watchdog
(watchdog.py), throughput and MFU (throughput.py, peaks.py), the console (progress.py)."""
