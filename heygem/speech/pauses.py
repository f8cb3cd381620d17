"""Pauses in the speech: where every engine lets go of the mouth and the face shows its own, as filmed.

A presenter who smiles between sentences should keep smiling: an engine's generated mouth is
closed flat in silence. So once a silence lasts PAUSE_SECONDS, the generated mouth fades out over
HANDOVER_SECONDS and the filmed frame shows through, and it fades back in before the next word
is heard. :func:`mouth_weights` says, per output frame, how much of the generated mouth shows;
heygem.render.pauses applies it to whatever the engine drew. The landmark engine reads the same
threshold and handover from here for its own mouth shapes (heygem.engines.landmark.mouth_shapes).
"""

from __future__ import annotations

import numpy as np

PAUSE_SECONDS = 0.35  # a silence at least this long lets go of the mouth
HANDOVER_SECONDS = 0.12  # the mouth goes from the speech to the face's own (and back) over this long
HOP_SECONDS = 0.01  # loudness is measured in steps of this length
HEARD_DB = -30.0  # a step this close to the speech's loud level is heard
QUIET_DBFS = -55.0  # a step quieter than this (of full scale) is never heard
LOUD_PERCENTILE = 95  # the speech's loud level: this percentile of its steps' loudness


def heard_steps(samples_16k: np.ndarray, sample_rate: int = 16000) -> np.ndarray:
    """(S,) bool: whether each HOP_SECONDS step of the speech is heard (within HEARD_DB of its loud
    level and above QUIET_DBFS)."""
    hop = int(round(HOP_SECONDS * sample_rate))
    count = len(samples_16k) // hop
    if count == 0:
        return np.zeros(0, bool)
    steps = np.asarray(samples_16k[: count * hop], np.float32).reshape(count, hop)  # (S, hop)
    loudness_db = 10.0 * np.log10(np.mean(steps.astype(np.float64) ** 2, axis=1) + 1e-12)  # (S,)
    loud_db = float(np.percentile(loudness_db, LOUD_PERCENTILE))
    return (loudness_db > loud_db + HEARD_DB) & (loudness_db > QUIET_DBFS)


def pause_frames(samples_16k: np.ndarray, fps: float, frame_count: int, sample_rate: int = 16000) -> np.ndarray:
    """(frame_count,) bool: the output frames inside a silence of at least PAUSE_SECONDS (one before the
    first word or after the last counts too; frames past the speech's end are silent)."""
    heard = heard_steps(samples_16k, sample_rate)
    pause_steps = int(np.ceil(PAUSE_SECONDS / HOP_SECONDS - 1e-9))
    quiet = np.zeros(len(heard), bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[1], heard.astype(np.int8), [1]])))  # run starts and ends
    for start, end in zip(edges[::2], edges[1::2]):  # runs of steps not heard
        if end - start >= pause_steps:
            quiet[start:end] = True
    centres = ((np.arange(frame_count) + 0.5) / fps / HOP_SECONDS).astype(np.int64)  # (N,) each frame's step
    inside = centres < len(quiet)
    pauses = np.ones(frame_count, bool)
    pauses[inside] = quiet[centres[inside]]
    return pauses


def mouth_weights(samples_16k: np.ndarray, fps: float, frame_count: int, sample_rate: int = 16000) -> np.ndarray:
    """(frame_count,) float32 in [0, 1]: how much of the engine's mouth each output frame shows. 1 while
    the speech is heard, 0 inside its pauses, where the filmed frame shows; within a pause, a ramp of
    HANDOVER_SECONDS at each end that touches speech (the generated mouth fades out once the silence
    starts and is back whole by the next word), so nothing pops."""
    pauses = pause_frames(samples_16k, fps, frame_count, sample_rate)
    ramp = max(1, int(round(HANDOVER_SECONDS * fps)))
    # frames from the nearest frame with speech, before or after (a pause at the output's edge has none there)
    distance = np.full(frame_count, np.inf)
    last = -np.inf
    for index in range(frame_count):
        if not pauses[index]:
            last = index
        distance[index] = index - last
    following = np.inf
    for index in range(frame_count - 1, -1, -1):
        if not pauses[index]:
            following = index
        distance[index] = min(distance[index], following - index)
    return np.clip(1.0 - distance / (ramp + 1), 0.0, 1.0).astype(np.float32)
