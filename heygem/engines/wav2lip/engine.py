"""The public Wav2Lip generator as a heygem lip-sync engine.

Per batch: crop each face box and shrink it to 96x96, mask the lower half,
run the generator on the masked crop plus the unmasked crop as reference and the
frame's mel window, and scale the 96x96 result back to the box size. Pasting the
patch into the frame is the blend stage's job.

The generator runs through heygem.runtime.device.FixedBatchRunner: batches of one fixed
size (the last one padded), so cuDNN autotunes once and, on a GPU, each batch
is one CUDA graph replay. ``generate_faces`` is the tensor-in, tensor-out entry
for callers that keep their batches on the GPU.
"""

from __future__ import annotations

import logging
from pathlib import Path

import cv2
import numpy as np
import torch

from heygem.config import EngineConfig
from heygem.models.wav2lip import Wav2Lip, fold_batchnorm
from heygem.runtime import timeline
from heygem.runtime.device import FixedBatchRunner, configure_backends, pick_device
from heygem.types import Box, EngineBatch, Face, FacePatch
from heygem.weights import load_state_dict_strict

logger = logging.getLogger("heygem")

FACE_SIZE = Wav2Lip.face_size  # 96


def crop_face(frame_bgr: np.ndarray, box: Box) -> np.ndarray:
    """The box's pixels shrunk to (96, 96, 3) uint8 BGR; INTER_AREA averages instead of aliasing."""
    x1, y1, x2, y2 = box
    return cv2.resize(frame_bgr[y1:y2, x1:x2], (FACE_SIZE, FACE_SIZE), interpolation=cv2.INTER_AREA)


def prepare_faces(crops_bgr: torch.Tensor) -> torch.Tensor:
    """(B, 96, 96, 3) uint8 BGR crops -> (B, 6, 96, 96) float generator input in [0, 1].

    Channels 0-2 are the crop with rows 48: zeroed (the mouth to generate),
    channels 3-5 the whole crop as the reference for identity and pose.
    Runs where the crops are, so uint8 crops sent to the GPU are made float there.
    """
    reference = crops_bgr.permute(0, 3, 1, 2).float().div_(255.0)  # (B, 3, 96, 96)
    masked = reference.clone()
    masked[:, :, FACE_SIZE // 2:] = 0.0  # (B, 3, 96, 96), lower half zero
    return torch.cat((masked, reference), dim=1)  # (B, 6, 96, 96)


def prepare_mel_windows(mel_windows: np.ndarray) -> torch.Tensor:
    """(B, 80, 16) float32 mel windows -> (B, 1, 80, 16) generator input."""
    return torch.from_numpy(np.ascontiguousarray(mel_windows, dtype=np.float32)).unsqueeze(1)


def to_uint8_images(generated: torch.Tensor) -> torch.Tensor:
    """(B, 3, 96, 96) float in [0, 1] -> (B, 96, 96, 3) uint8 BGR, rounded rather than truncated."""
    return generated.float().mul(255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


class MouthsFromCrops(torch.nn.Module):
    """The generator with the conversions around it (:func:`prepare_faces`, :func:`to_uint8_images`) inside
    one module: uint8 crops in, uint8 mouths out, so that a runner's CUDA graph holds the whole step and a
    caller makes a handful of calls per batch rather than dozens. The same operations in the same order as
    ``generate`` runs them, so the same mouths."""

    def __init__(self, generator: torch.nn.Module, dtype: torch.dtype, channels_last: bool):
        super().__init__()
        self.generator = generator
        self.dtype = dtype  # what the runner's buffers would have cast the faces to
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def forward(self, mel_windows: torch.Tensor, crops_bgr: torch.Tensor) -> torch.Tensor:
        """(B, 1, 80, 16) mel windows and (B, 96, 96, 3) uint8 BGR crops -> (B, 96, 96, 3) uint8 BGR mouths."""
        faces = prepare_faces(crops_bgr).to(self.dtype, memory_format=self.memory_format)  # (B, 6, 96, 96)
        return to_uint8_images(self.generator(mel_windows, faces)).contiguous()


def resize_to_box(image_bgr: np.ndarray, box: Box) -> np.ndarray:
    """Scale a 96x96 result to the box size.

    Boxes are almost always larger than 96 px, and bicubic keeps the generated
    lips and teeth sharper than bilinear (cv2 saturates its overshoot to 0..255);
    boxes smaller than 96 px are shrunk with INTER_AREA to avoid aliasing.
    """
    x1, y1, x2, y2 = box
    width, height = x2 - x1, y2 - y1
    upscaling = width * height >= FACE_SIZE * FACE_SIZE
    interpolation = cv2.INTER_CUBIC if upscaling else cv2.INTER_AREA
    return cv2.resize(image_bgr, (width, height), interpolation=interpolation)


def clip_box(box: Box, frame_height: int, frame_width: int) -> Box | None:
    """``box`` limited to the frame, or None if nothing of it is inside."""
    x1, y1, x2, y2 = (int(value) for value in box)
    x1, x2 = max(0, x1), min(frame_width, x2)
    y1, y2 = max(0, y1), min(frame_height, y2)
    return (x1, y1, x2, y2) if x2 > x1 and y2 > y1 else None


def face_crop(frame_bgr: np.ndarray, face: Face | None) -> tuple[Box, np.ndarray] | None:
    """The face's box limited to the frame and its (96, 96, 3) uint8 crop (:func:`crop_face`), what the
    generator reads; None without a face or where the box lies outside the frame."""
    box = clip_box(face.box, *frame_bgr.shape[:2]) if face is not None else None
    return None if box is None else (box, crop_face(frame_bgr, box))


def mouth_patch(mouth_bgr: np.ndarray, box: Box, face: Face) -> FacePatch:
    """The patch of a generated (96, 96, 3) mouth: scaled to its box (:func:`resize_to_box`), blended with the
    blend stage's own mask."""
    return FacePatch(box=box, image_bgr=resize_to_box(mouth_bgr, box), mask=None, face=face)


# bench/bench_wav2lip.py --device cpu --variants fp32-cl on a 2-core CPU: 20.7 faces/s at 8 faces a
# pass, 20.5 at 12, 19.5 at 16, 18.6 at 32 (the caches hold a smaller batch's activations)
CPU_BATCH_SIZE = 8


class Wav2LipEngine:
    """Lip sync with the public Wav2Lip or Wav2Lip-GAN generator weights."""

    name = "wav2lip"

    def __init__(self, checkpoint_path: Path, config: EngineConfig):
        with timeline.span("CUDA start and cuDNN check"):  # on the CPU: the flags alone
            self.device = pick_device(config.device)
            configure_backends(deterministic=config.deterministic, cudnn=config.cudnn, device=self.device,
                               autotune=config.cudnn_benchmark)
        batch_size = config.batch_size
        if self.device.type == "cpu":
            batch_size = min(batch_size, CPU_BATCH_SIZE)
        with torch.device("meta"):  # no random init: every value comes from the checkpoint
            model = Wav2Lip()
        # the checkpoint's tensors become the model's (meta tensors' to_empty imports sympy, ~0.5 s)
        load_state_dict_strict(model, checkpoint_path, assign=True)
        model.to(self.device)
        fold_batchnorm(model)  # checked strictly above; now one op per unit instead of two
        on_gpu = self.device.type == "cuda"
        self.runner = FixedBatchRunner(
            model, self.device, batch_size, precision=config.precision,
            channels_last=True,  # NHWC: what tensor-core convolutions want, and 20-25 % faster on a 2-core CPU too
            use_cuda_graph=on_gpu and config.cuda_graph, name="wav2lip generator")
        # in the loading thread, while the first frames are tracked: the first batch is then a graph replay
        self.runner.warm_up(((1, 80, Wav2Lip.mel_window_frames), torch.float32),
                            ((6, FACE_SIZE, FACE_SIZE), torch.float32))
        self.model = model
        self._mouths_runner: FixedBatchRunner | None = None  # made by the first call of ``mouths``
        logger.info("wav2lip engine on %s, batches of %d, %s%s%s", self.device, batch_size,
                    str(self.runner.compute_dtype or torch.float32).removeprefix("torch."),
                    ", channels-last", ", CUDA graph" if self.runner.use_cuda_graph else "")

    @property
    def batch_size(self) -> int:
        """Faces per generator pass; lowered for good if a batch runs out of memory."""
        return self.runner.batch_size

    def generate_faces(self, faces: torch.Tensor, mel_windows: torch.Tensor) -> torch.Tensor:
        """Run the generator on tensors that are already on ``self.device``.

        faces: (F, 6, 96, 96) float BGR in [0, 1], lower half of channels 0-2 masked (see prepare_faces);
        mel_windows: (F, 1, 80, 16) float.
        Returns (F, 3, 96, 96) float32 BGR in [0, 1] on ``self.device``.
        """
        faces_fit = faces.dim() == 4 and faces.shape[1:] == (6, FACE_SIZE, FACE_SIZE)
        mel_fits = mel_windows.dim() == 4 and mel_windows.shape[1:] == (1, 80, Wav2Lip.mel_window_frames)
        if not (faces_fit and mel_fits and len(faces) == len(mel_windows)):
            raise ValueError(f"generate_faces takes (F, 6, 96, 96) faces and (F, 1, 80, 16) mel windows, "
                             f"got {tuple(faces.shape)} and {tuple(mel_windows.shape)}")
        if len(faces) == 0:
            return torch.empty((0, 3, FACE_SIZE, FACE_SIZE), device=self.device)
        return self.runner(mel_windows, faces)  # the public model takes the audio first

    def mouths(self, crops_bgr: np.ndarray, mel_windows: np.ndarray) -> np.ndarray:
        """The generated mouths of faces already cropped: (F, 96, 96, 3) uint8 BGR crops (:func:`crop_face`'s)
        and their (F, 80, 16) mel windows -> (F, 96, 96, 3) uint8 BGR, what ``generate`` scales to each box.

        For callers that draw a few faces many times a second from a thread sharing the interpreter with
        others (live sessions): the conversions run inside the runner's graph (:class:`MouthsFromCrops`),
        so a call is about ten operations, each of which lets the interpreter's lock go and waits to take it
        back, instead of some fifty plus two image resizes per face. Not thread-safe (one runner)."""
        crops_bgr = np.asarray(crops_bgr)
        mel_windows = np.asarray(mel_windows)
        if crops_bgr.shape[1:] != (FACE_SIZE, FACE_SIZE, 3) or crops_bgr.dtype != np.uint8 \
                or mel_windows.shape != (len(crops_bgr), 80, Wav2Lip.mel_window_frames):
            raise ValueError(f"mouths takes (F, 96, 96, 3) uint8 crops and (F, 80, 16) mel windows, got "
                             f"{crops_bgr.shape} {crops_bgr.dtype} and {mel_windows.shape}")
        if len(crops_bgr) == 0:
            return np.empty((0, FACE_SIZE, FACE_SIZE, 3), np.uint8)
        runner = self.warm_up_mouths()
        crops = torch.from_numpy(np.ascontiguousarray(crops_bgr)).to(self.device)  # (F, 96, 96, 3) uint8
        mels = prepare_mel_windows(mel_windows).to(self.device)  # (F, 1, 80, 16)
        return runner(mels, crops).cpu().numpy()

    def warm_up_mouths(self) -> FixedBatchRunner:
        """Make the runner of :meth:`mouths` (the generator's own weights, as its runner cast them) and ready
        its batch and graph: a live server calls it while it loads the engine, before the first frame."""
        if self._mouths_runner is None:
            main = self.runner
            dtype = main.compute_dtype if main.cast_weights else torch.float32
            runner = FixedBatchRunner(MouthsFromCrops(self.model, dtype, main.channels_last), self.device,
                                      main.batch_size, precision=main.precision, use_cuda_graph=main.use_cuda_graph,
                                      name="wav2lip mouths")
            runner.warm_up(((1, 80, Wav2Lip.mel_window_frames), torch.float32),
                           ((FACE_SIZE, FACE_SIZE, 3), torch.uint8))
            self._mouths_runner = runner
        return self._mouths_runner

    def close(self) -> None:
        """Nothing runs beside the generator: it stays loaded (kept for its thread's next job)."""

    def generate(self, batch: EngineBatch) -> list[FacePatch | None]:
        frame_count = len(batch.frames_bgr)
        if not len(batch.faces) == len(batch.mel_windows) == frame_count:
            raise ValueError(f"batch of {frame_count} frames has {len(batch.faces)} faces "
                             f"and {len(batch.mel_windows)} mel windows")
        patches: list[FacePatch | None] = [None] * frame_count

        face_rows: list[int] = []  # frame positions in the batch that have a usable face box
        boxes: list[Box] = []
        crops: list[np.ndarray] = []  # (96, 96, 3) uint8 each
        for row, face in enumerate(batch.faces):
            cropped = face_crop(batch.frames_bgr[row], face)
            if cropped is not None:
                face_rows.append(row)
                boxes.append(cropped[0])
                crops.append(cropped[1])
        if not face_rows:
            return patches

        crops_bgr = torch.from_numpy(np.stack(crops))  # (F, 96, 96, 3) uint8
        # Only uint8 pixels cross the bus; the float conversion happens on the device.
        faces = prepare_faces(crops_bgr.to(self.device))  # (F, 6, 96, 96)
        mel_windows = prepare_mel_windows(batch.mel_windows[face_rows]).to(self.device)  # (F, 1, 80, 16)
        generated = to_uint8_images(self.generate_faces(faces, mel_windows)).cpu().numpy()  # (F, 96, 96, 3) BGR

        for row, box, image_bgr in zip(face_rows, boxes, generated):
            patches[row] = mouth_patch(image_bgr, box, batch.faces[row])
        return patches
