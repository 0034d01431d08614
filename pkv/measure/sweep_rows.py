"""Which time of a calibration sweep's row a fit reads (pkv.measure.calibrate, and the
overlapped margin's replay, pkv.measure.overlapped_margin): the split grid's rows, CUDA
events or wall, graph replay where it was timed."""

from __future__ import annotations

import numpy as np
import pandas as pd


def grid_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The split grid's rows: split 0 (the engine's own, the replayed run) is not a split of it."""
    return frame[frame["split"] != 0] if "split" in frame else frame


def measured_s(rows: pd.DataFrame) -> np.ndarray:
    """Device time per step: CUDA events, wall time where none were timed (the CPU)."""
    return rows["cuda_s"].where(rows["cuda_s"].notna(), rows["wall_s"]).to_numpy()


def replayed(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows with a CUDA-graph replay time where there are any, else all of them. Events
    around run() also hold the host's launch of it: for FlashInfer's Python run() that is
    most of a short step's event span."""
    graphed = rows[rows["graph_s"].notna()] if "graph_s" in rows else rows.iloc[:0]
    return graphed if len(graphed) else rows


def device_s(rows: pd.DataFrame) -> np.ndarray:
    """Device time per step: graph replay, else what measured_s gives (events, else wall)."""
    measured = measured_s(rows)
    return np.where(rows["graph_s"].notna(), rows["graph_s"], measured) if "graph_s" in rows else measured
