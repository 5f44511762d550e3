"""tensorboardX, imported for the TensorBoard tracker (research/train/hooks/trackers.py) without torch."""

from __future__ import annotations

import sys


def tensorboardx():
  """tensorboardX's summary, EventsWriter, Event and SessionLog, imported without torch: tensorboardX's package imports
  torch whenever it is installed (for a type check this code never reaches), which cost every run 2.1 s of start-up
  and torch's memory where the test oracles are installed. A torch already imported is left as it is."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX takes torch as absent
  try:
    from tensorboardX import summary
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog
  finally:
    if hide:
      del sys.modules["torch"]
  return summary, EventsWriter, Event, SessionLog
