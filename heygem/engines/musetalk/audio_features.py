"""MuseTalk's audio features: every Whisper encoder hidden state, a window of them per video frame.

The facts, as MuseTalk 1.5 computes them:

- the 16 kHz audio in 30 s segments, each made into 80 log-mel bins of 3000 frames by Whisper's
  feature extractor (the last segment padded to 30 s);
- every hidden state of the encoder (its input embedding and each layer's output: 5 for
  whisper-tiny), stacked: (1500, 5, 384) per segment, 50 per second; segments concatenated and
  cut to the audio's length, floor(seconds * 50);
- zeros before (2 frames of context x ceil(50 / fps)) and after (3 x 2 x ceil(50 / fps)) them;
- video frame f (the rate taken as a whole number, as MuseTalk does) takes the 2 * (2 + 1 + 2) = 10
  rows starting at floor(f * 50 / fps) of that padded sequence: (10, 5, 384) -> (50, 384);
- the UNet sees them plus the sinusoidal positional encoding of d_model 384 over those 50 rows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SAMPLE_RATE = 16000
FEATURE_RATE = 50  # encoder positions per second
SEGMENT_SECONDS = 30
CONTEXT_FRAMES = 2  # video frames of audio before and after each frame
RIGHT_PADDING_FACTOR = 3  # MuseTalk pads three times the context on the right


def encoder_states(samples_16k: np.ndarray, feature_extractor, encoder, device, dtype=torch.float32,
                   features_on_device: bool = False) -> torch.Tensor:
    """(T, L + 1, D) float32 on the CPU: every encoder hidden state, 50 per second, T = floor(seconds * 50).

    ``samples_16k``: (S,) float32 mono at 16 kHz; ``encoder``: transformers' Whisper encoder.
    ``features_on_device``: the log-mel spectrogram computed on ``device`` (the feature extractor's own option,
    equal to the CPU's within 1e-5) instead of the CPU, where the short passes of live sessions would spend
    their time: each is a whole 30 s segment."""
    segment_length = SEGMENT_SECONDS * SAMPLE_RATE
    stacked = []
    for start in range(0, max(len(samples_16k), 1), segment_length):
        segment = samples_16k[start:start + segment_length]
        mel = feature_extractor(segment, sampling_rate=SAMPLE_RATE, return_tensors="pt",
                                device=str(device) if features_on_device else "cpu").input_features  # (1, 80, 3000)
        with torch.inference_mode():
            hidden = encoder(mel.to(device=device, dtype=dtype), output_hidden_states=True).hidden_states
        stacked.append(torch.stack(hidden, dim=2)[0].float().cpu())  # (1500, L + 1, D)
    states = torch.cat(stacked, dim=0)
    return states[:math.floor(len(samples_16k) / SAMPLE_RATE * FEATURE_RATE)]


def frame_windows(states: torch.Tensor, fps: float, frame_count: int, first: int = 0) -> torch.Tensor:
    """(frame_count - first, 2 * (2 * CONTEXT + 1) * (L + 1), D): the windows of video frames ``first`` to
    ``frame_count - 1`` of ``states`` (T, L + 1, D), on its device, flattened over time and layer as MuseTalk's
    UNet takes them; frames past the audio's end see zeros."""
    whole_fps = int(fps)
    step = FEATURE_RATE / whole_fps
    padding = math.ceil(step)
    window = 2 * (2 * CONTEXT_FRAMES + 1)  # 10 rows of 20 ms: 2 video frames either side and the frame
    starts = np.floor(np.arange(frame_count) * step).astype(np.int64)  # (F,), the padding's rows as every frame's
    before = padding * CONTEXT_FRAMES
    needed = int(starts[-1]) + window if frame_count else 0  # rows the last frame reads
    after = max(padding * RIGHT_PADDING_FACTOR * CONTEXT_FRAMES, needed - before - len(states))
    padded = torch.cat([states.new_zeros((before, *states.shape[1:])), states,
                        states.new_zeros((after, *states.shape[1:]))], dim=0)
    rows = torch.from_numpy(starts[first:])[:, None] + torch.arange(window)[None, :]  # (F - first, 10)
    # queued, not waited for: a blocking copy onto a GPU would wait for everything queued there (the encoder)
    return padded[rows.to(states.device, non_blocking=True)].flatten(1, 2)  # (F - first, 10 * (L + 1), D)


def positional_encoding(length: int, d_model: int) -> torch.Tensor:
    """(length, d_model) float32 sinusoidal encoding: sin on even channels, cos on odd ones, at
    position p and channel pair i the angle p / 10000^(2i / d_model)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    encoding = torch.zeros(length, d_model)
    encoding[:, 0::2] = torch.sin(position * frequency)
    encoding[:, 1::2] = torch.cos(position * frequency)
    return encoding


def audio_features(samples_16k: np.ndarray, fps: float, frame_count: int, feature_extractor, encoder,
                   device, dtype=torch.float32, features_on_device: bool = False) -> torch.Tensor:
    """(frame_count, 50, 384) float32 on the CPU for whisper-tiny: each frame's window of every
    encoder state, plus the positional encoding, as the UNet's cross-attention takes it."""
    states = encoder_states(samples_16k, feature_extractor, encoder, device, dtype, features_on_device)
    windows = frame_windows(states, fps, frame_count)
    return windows + positional_encoding(windows.shape[1], windows.shape[2])
