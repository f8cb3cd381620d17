"""GFPGAN v1.4 restoration of the generated lower face, for both render paths.

Per face with tracked landmarks (faces without them are left as they are):

1. align: five points of the face mesh (eye centres, nose tip, mouth corners) are fitted
   by least squares with a similarity transform onto the 512x512 five-point template
   that GFPGAN was trained with (the FFHQ alignment), and the frame, with the generated
   mouth already pasted, is warped into that square (bilinear, edge pixels repeated);
2. restore: the network runs on batches of aligned faces (RGB in [-1, 1]; fp16 on a GPU
   through --precision; a smaller batch after an out-of-memory) and its output is clamped;
3. warp back with the inverse transform and blend into the frame with the lower-face mask
   the paste used (below the nose, inside the jaw line, feathered) times the strength, so
   the eyes, the rest of the face and every pixel outside the mask keep their values.

The CPU render does this on BGR frames with OpenCV (``restore_patches_gfpgan``); the torch
render on the I420 face regions on the device with ``affine_grid``/``grid_sample``
(``GfpganRestorer.restore_regions``). Both give the same pixels up to rounding.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn import functional

from heygem.config import BlendConfig, EngineConfig
from heygem.errors import HeygemError
from heygem.render.blend import blend_patch
from heygem.runtime.kept import GFPGAN_RESTORER, KEPT, file_identity
from heygem.types import Face, FacePatch

if TYPE_CHECKING:
    from heygem.models.gfpgan import GFPGANClean

logger = logging.getLogger("heygem")

GFPGAN_EXPECTED = "the official GFPGANv1.4.pth (the 'clean' GFPGAN architecture, 512x512)"
ALIGNED_SIZE = 512  # GFPGAN's input and output size
# The five-point template of 512x512 FFHQ faces: image-left eye, image-right eye, nose tip,
# image-left mouth corner, image-right mouth corner (x, y pixels)
FFHQ_TEMPLATE_512 = np.array([[192.98138, 239.94708], [318.90277, 240.19360], [256.63416, 314.01935],
                              [201.26117, 371.41043], [313.08905, 371.15118]], dtype=np.float64)
# mediapipe face-mesh points: the contour of each eye (its centre is their mean), the nose tip,
# and the mouth corners
IMAGE_LEFT_EYE_POINTS = [33, 7, 163, 144, 145, 153, 154, 155, 133, 173, 157, 158, 159, 160, 161, 246]
IMAGE_RIGHT_EYE_POINTS = [263, 249, 390, 373, 374, 380, 381, 382, 362, 398, 384, 385, 386, 387, 388, 466]
NOSE_TIP_POINT = 1
MOUTH_CORNER_POINTS = (61, 291)  # image-left, image-right
FOOTPRINT_MARGIN = 2  # pixels around the aligned square's footprint that bilinear sampling may touch
CPU_BATCH = 1  # faces per forward pass on the CPU (a bigger batch is no faster there; padding would waste)
GPU_BATCH = 8


# ---------------------------------------------------------------------------------------------
# Alignment


def five_points(landmarks: np.ndarray) -> np.ndarray:
    """(..., 468, 2) face-mesh points -> (..., 5, 2) float64 in the template's order."""
    landmarks = np.asarray(landmarks, dtype=np.float64)
    return np.stack((landmarks[..., IMAGE_LEFT_EYE_POINTS, :].mean(axis=-2),
                     landmarks[..., IMAGE_RIGHT_EYE_POINTS, :].mean(axis=-2),
                     landmarks[..., NOSE_TIP_POINT, :],
                     landmarks[..., MOUTH_CORNER_POINTS[0], :],
                     landmarks[..., MOUTH_CORNER_POINTS[1], :]), axis=-2)


def similarity_transform(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least-squares rotation + uniform scale + shift taking ``source`` points onto ``target``.

    source (F, K, 2), target (K, 2) or (F, K, 2) -> (F, 2, 3) float64 matrices M with
    target ~ M @ (x, y, 1). The fit is x' = a x - b y + tx, y' = b x + a y + ty, solved in
    closed form on the centred points (linear in a, b), so it never reflects.
    """
    source = np.asarray(source, dtype=np.float64)
    target = np.broadcast_to(np.asarray(target, dtype=np.float64), source.shape)
    source_mean, target_mean = source.mean(axis=1, keepdims=True), target.mean(axis=1, keepdims=True)  # (F, 1, 2)
    s, t = source - source_mean, target - target_mean  # (F, K, 2)
    energy = np.maximum((s ** 2).sum(axis=(1, 2)), 1e-12)  # (F,)
    a = (s[..., 0] * t[..., 0] + s[..., 1] * t[..., 1]).sum(axis=1) / energy  # (F,)
    b = (s[..., 0] * t[..., 1] - s[..., 1] * t[..., 0]).sum(axis=1) / energy
    rotation = np.stack((np.stack((a, -b), axis=1), np.stack((b, a), axis=1)), axis=1)  # (F, 2, 2)
    shift = target_mean[:, 0] - np.einsum("fij,fj->fi", rotation, source_mean[:, 0])  # (F, 2)
    return np.concatenate((rotation, shift[:, :, None]), axis=2)


def alignment_matrices(landmarks: np.ndarray) -> np.ndarray:
    """(F, 468, 2) face-mesh points -> (F, 2, 3) maps from their pixels to the 512x512 template's."""
    return similarity_transform(five_points(landmarks), FFHQ_TEMPLATE_512)


def invert_affine(matrices: np.ndarray) -> np.ndarray:
    """(F, 2, 3) -> (F, 2, 3) inverse affine maps."""
    linear = np.linalg.inv(matrices[:, :, :2])  # (F, 2, 2)
    return np.concatenate((linear, -np.einsum("fij,fj->fi", linear, matrices[:, :, 2])[:, :, None]), axis=2)


def translate(matrices: np.ndarray, x, y) -> np.ndarray:
    """Maps from pixels of a window whose top-left pixel is frame pixel (x, y): M @ shift(x, y)."""
    shifted = np.array(matrices, dtype=np.float64, copy=True)
    offset = np.stack(np.broadcast_arrays(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)), axis=-1)
    shifted[..., :, 2] += np.einsum("...ij,...j->...i", shifted[..., :, :2], offset)
    return shifted


def crop_footprints(matrices: np.ndarray, frame_height: int, frame_width: int) -> np.ndarray:
    """(F, 4) int64 x1 y1 x2 y2 (x2/y2 exclusive): the frame pixels the aligned square is sampled
    from (its corners mapped back, a margin added), clipped to the frame."""
    corners = np.array([[0, 0, 1], [ALIGNED_SIZE, 0, 1], [0, ALIGNED_SIZE, 1], [ALIGNED_SIZE, ALIGNED_SIZE, 1]],
                       dtype=np.float64)  # (4, 3)
    frame_corners = np.einsum("fij,kj->fki", invert_affine(matrices), corners)  # (F, 4, 2)
    low = np.floor(frame_corners.min(axis=1)) - FOOTPRINT_MARGIN  # (F, 2)
    high = np.ceil(frame_corners.max(axis=1)) + FOOTPRINT_MARGIN + 1
    low = np.clip(low, 0, [frame_width - 1, frame_height - 1])
    high = np.clip(high, low + 1, [frame_width, frame_height])
    return np.concatenate((low, high), axis=1).astype(np.int64)


def has_landmarks(face: Face | None) -> bool:
    return face is not None and face.landmarks is not None and bool(np.isfinite(face.landmarks).all())


# ---------------------------------------------------------------------------------------------
# Warping on the device


def _normalizer(width: int, height: int) -> np.ndarray:
    """3x3 map from pixel coordinates to grid_sample's [-1, 1] (align_corners=False: pixel centres)."""
    return np.array([[2.0 / width, 0.0, 1.0 / width - 1.0], [0.0, 2.0 / height, 1.0 / height - 1.0], [0.0, 0.0, 1.0]])


def warp_images(images: torch.Tensor, output_to_source: np.ndarray, height: int, width: int,
                padding: str = "zeros") -> torch.Tensor:
    """Resample (F, C, h, w) images bilinearly to (F, C, height, width).

    ``output_to_source`` (F, 2, 3) maps each output pixel to the source pixel it shows, as
    cv2.warpAffine's inverse map does. ``padding`` "border" repeats the edge pixels
    (BORDER_REPLICATE), "zeros" is black outside (BORDER_CONSTANT 0).
    """
    count, _, source_height, source_width = images.shape
    square = np.concatenate((output_to_source, np.broadcast_to([[[0.0, 0.0, 1.0]]], (count, 1, 3))), axis=1)
    theta = _normalizer(source_width, source_height) @ square @ np.linalg.inv(_normalizer(width, height))  # (F, 3, 3)
    # (F, 2, 3); a non-blocking copy from pageable memory: staged at once, without waiting for the GPU's queue
    theta = torch.from_numpy(theta[:, :2].astype(np.float32)).to(images.device, non_blocking=True)
    grid = functional.affine_grid(theta, [count, 1, height, width], align_corners=False)  # (F, height, width, 2)
    return functional.grid_sample(images.float(), grid, mode="bilinear", padding_mode=padding, align_corners=False)


# ---------------------------------------------------------------------------------------------
# The network


def even_batch_size(count: int, limit: int) -> int:
    """The batch size at most ``limit`` that splits ``count`` items into the fewest, most equal passes,
    so that a fixed batch shape (padded on a GPU) computes as few padding items as it can."""
    if count <= 0:
        return limit
    passes = -(-count // limit)
    return -(-count // passes)


class GfpganRestorer:
    """A loaded GFPGAN on its device: restores aligned faces, or faces in I420 regions in place.

    The weights are shared by every thread; each thread gets its own batch runner
    (heygem.runtime.device.FixedBatchRunner: fixed batch shape, fp16 on CUDA, halving on out-of-memory).
    """

    def __init__(self, model, device, precision: str = "auto", batch_size: int | None = None,
                 cuda_graph: bool = False):
        self.device = torch.device(device)
        if hasattr(model, "set_fused_modulation"):
            model.set_fused_modulation(True)  # one shared convolution per layer: cuDNN's fast path
        self.model = model.to(self.device).eval()
        self.precision = precision
        self.batch_size = batch_size or (GPU_BATCH if self.device.type == "cuda" else CPU_BATCH)
        self.cuda_graph = cuda_graph
        self._threads = threading.local()
        self._lock = threading.Lock()

    def _runner(self, face_count: int):
        """This thread's runner; made on its first call with batches that split ``face_count`` faces (the
        pipeline's batch) evenly: 21 faces in 3 passes of 7, not 8 + 8 + 5 padded to 24 on a GPU."""
        from heygem.runtime.device import FixedBatchRunner

        runner = getattr(self._threads, "runner", None)
        if runner is None:
            batch_size = even_batch_size(face_count, self.batch_size)
            with self._lock:  # the runner casts the shared weights once; not while another thread does
                runner = FixedBatchRunner(self.model, self.device, batch_size, precision=self.precision,
                                          channels_last=self.device.type == "cuda", use_cuda_graph=self.cuda_graph,
                                          name="GFPGAN restorer")
            self._threads.runner = runner
        return runner

    def restore_faces(self, faces_bgr: torch.Tensor) -> torch.Tensor:
        """(F, 3, 512, 512) BGR in 0..255 on the device -> the restored faces, the same layout, float32."""
        if len(faces_bgr) == 0:
            return faces_bgr.float()
        faces_rgb = faces_bgr.float().flip(1).div_(127.5).sub_(1.0)  # (F, 3, 512, 512) RGB in [-1, 1]
        restored = self._runner(len(faces_rgb))(faces_rgb).clamp_(-1.0, 1.0)  # (F, 3, 512, 512) RGB
        return restored.add_(1.0).mul_(127.5).flip(1)  # (F, 3, 512, 512) BGR in 0..255

    def restore_regions(self, planes: torch.Tensor, boxes: np.ndarray, landmarks: np.ndarray, strength: float,
                        feather: float, chroma: str = "average") -> int:
        """Restore the lower face of each I420 region of ``planes`` in place; returns how many were restored.

        planes: (F, Hc * 3/2, Wc) uint8, one face per region, contiguous, on the device.
        boxes (F, 4) and landmarks (F, 468, 2) in region pixels (NaN rows: no landmarks, skipped).
        Only pixels under the lower-face mask (blend's, feathered by ``feather``) change.
        """
        from heygem.render import gpu_blend

        strength = min(float(strength), 1.0)
        landmarks = np.asarray(landmarks, dtype=np.float32)
        rows = np.flatnonzero(np.isfinite(landmarks).all(axis=(1, 2)))
        if strength <= 0 or len(rows) == 0:
            return 0
        height, width = planes.shape[1] * 2 // 3, planes.shape[2]
        rows_device = gpu_blend.to_device(rows, planes.device)
        y, u, v = gpu_blend.split_planes(planes)
        regions = gpu_blend.i420_to_bgr(y[rows_device], u[rows_device], v[rows_device])  # (S, 3, Hc, Wc) 0..255
        matrices = alignment_matrices(landmarks[rows])  # (S, 2, 3) region pixels -> template pixels
        # aligned: (S, 3, 512, 512)
        aligned = warp_images(regions, invert_affine(matrices), ALIGNED_SIZE, ALIGNED_SIZE, "border")
        restored = self.restore_faces(aligned)  # (S, 3, 512, 512) BGR
        back = warp_images(restored, matrices, height, width)  # (S, 3, Hc, Wc), 0 outside the square
        inside = warp_images(torch.ones_like(restored[:, :1]), matrices, height, width)  # (S, 1, Hc, Wc)
        boxes_host = np.asarray(boxes, dtype=np.int64)[rows]  # (S, 4)
        canvas = gpu_blend.FaceCanvas(frame_index=rows_device, boxes=gpu_blend.to_device(boxes_host, planes.device),
                                      origin=torch.zeros((len(rows), 2), dtype=torch.int64, device=planes.device),
                                      height=height, width=width, host_boxes=boxes_host, one_per_frame=True)
        masks = gpu_blend.face_masks(boxes_host, landmarks[rows], feather, canvas) * inside * strength
        gpu_blend.blend_canvas(planes, canvas, regions, back, masks, chroma)
        return len(rows)


def restore_masks(boxes: np.ndarray, landmarks: np.ndarray, feather: float, height: int, width: int) -> np.ndarray:
    """The lower-face masks the torch render blends with, on (height, width) windows whose top-left
    pixel is (0, 0): boxes (F, 4) and landmarks (F, 468, 2) in window pixels -> (F, height, width) float32."""
    from heygem.render import gpu_blend

    count = len(boxes)
    canvas = gpu_blend.FaceCanvas(frame_index=torch.arange(count), boxes=torch.as_tensor(boxes, dtype=torch.int64),
                                  origin=torch.zeros((count, 2), dtype=torch.int64), height=height, width=width)
    return gpu_blend.face_masks(canvas.boxes, np.asarray(landmarks, np.float32), feather, canvas)[:, 0].numpy()


def restore_patches_gfpgan(restorer: GfpganRestorer, patches: list[FacePatch | None], frames_bgr: np.ndarray,
                           strength: float, blend: BlendConfig) -> list[FacePatch | None]:
    """The CPU render's GFPGAN step: each patch pasted into its frame, restored, and returned as
    the final pixels of its box (with a mask of ones, so the blend stage copies them as they are).

    frames_bgr (N, H, W, 3) uint8 BGR, the source frames. Patches whose face has no landmarks
    come back unchanged. Outside the lower-face mask the pixels are those the blend stage
    would have made from the patch.
    """
    import cv2

    strength = min(float(strength), 1.0)
    prepared = []  # (index, window (h, w, 3) uint8 with the mouth pasted, box in the window, window -> template)
    for index, (patch, frame) in enumerate(zip(patches, frames_bgr)):
        if patch is None or strength <= 0 or not has_landmarks(patch.face):
            continue
        frame_height, frame_width = frame.shape[:2]
        matrix = alignment_matrices(patch.face.landmarks[None])  # (1, 2, 3) frame -> template
        fx1, fy1, fx2, fy2 = crop_footprints(matrix, frame_height, frame_width)[0]
        x1, y1, x2, y2 = patch.box
        left, top, right, bottom = min(x1, fx1), min(y1, fy1), max(x2, fx2), max(y2, fy2)
        window = frame[top:bottom, left:right].copy()
        offset = np.array([left, top], dtype=np.float32)
        face = Face(box=patch.face.box, landmarks=patch.face.landmarks - offset, score=patch.face.score)
        box = (x1 - left, y1 - top, x2 - left, y2 - top)
        blend_patch(window, FacePatch(box=box, image_bgr=patch.image_bgr, mask=patch.mask, face=face), blend)
        prepared.append((index, window, box, face.landmarks, translate(matrix[0], left, top)))
    if not prepared:
        return patches

    aligned = np.stack([cv2.warpAffine(window, matrix, (ALIGNED_SIZE, ALIGNED_SIZE), flags=cv2.INTER_LINEAR,
                                       borderMode=cv2.BORDER_REPLICATE)
                        for _, window, _, _, matrix in prepared])  # (S, 512, 512, 3) uint8 BGR
    faces = torch.from_numpy(aligned).permute(0, 3, 1, 2).to(restorer.device)  # (S, 3, 512, 512)
    with torch.inference_mode():
        restored = restorer.restore_faces(faces).permute(0, 2, 3, 1).contiguous().cpu().numpy()  # (S, 512, 512, 3)

    result = list(patches)
    ones = np.ones((ALIGNED_SIZE, ALIGNED_SIZE), dtype=np.float32)
    for (index, window, box, landmarks, matrix), face_restored in zip(prepared, restored):
        x1, y1, x2, y2 = box
        width, height = x2 - x1, y2 - y1
        box_matrix = translate(matrix, x1, y1)  # box pixels -> template pixels
        flags = cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP
        back = cv2.warpAffine(face_restored, box_matrix, (width, height), flags=flags,
                              borderMode=cv2.BORDER_CONSTANT, borderValue=0)  # (h, w, 3) float32
        inside = cv2.warpAffine(ones, box_matrix, (width, height), flags=flags, borderMode=cv2.BORDER_CONSTANT,
                                borderValue=0)  # (h, w)
        mask = restore_masks(np.array([[0, 0, width, height]]), (landmarks - np.array([x1, y1], np.float32))[None],
                             blend.feather, height, width)[0] * inside * strength  # (h, w)
        region = window[y1:y2, x1:x2].astype(np.float32)
        mixed = region + (back - region) * mask[:, :, None]
        image = np.clip(np.rint(mixed), 0, 255).astype(np.uint8)
        patch = patches[index]
        result[index] = FacePatch(box=patch.box, image_bgr=image, mask=np.ones((height, width), np.float32),
                                  face=patch.face)
    return result


# ---------------------------------------------------------------------------------------------
# Loading, once per process


def load_gfpgan(checkpoint_path: Path, device="cpu") -> GFPGANClean:
    """GFPGANClean in eval mode on ``device`` with every weight from ``checkpoint_path``.

    Accepts the released layout ``{"params_ema": ...}``, a training layout ``{"params": ...}``
    and a bare state dict. Every key and shape must match; otherwise a HeygemError names
    the file and the first missing, unexpected or wrongly shaped keys.
    """
    import torch

    from heygem.models.gfpgan import GFPGANClean
    from heygem.weights import describe_mismatch, describe_unreadable

    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise HeygemError(f"GFPGAN checkpoint not found: {checkpoint_path}; expected {GFPGAN_EXPECTED}")
    try:
        payload = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to unpickle means the file is not usable
        raise HeygemError(f"{checkpoint_path} is not a readable GFPGAN checkpoint "
                          f"({describe_unreadable(checkpoint_path, error)}); expected {GFPGAN_EXPECTED}") from None
    if isinstance(payload, dict):
        for wrapper in ("params_ema", "params"):
            if isinstance(payload.get(wrapper), dict):
                payload = payload[wrapper]
                break
    if not isinstance(payload, dict) or not payload or not all(
            isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in payload.items()):
        raise HeygemError(f"{checkpoint_path} holds no GFPGAN weights (neither a state dict nor a dict with "
                          f"'params_ema' or 'params'); expected {GFPGAN_EXPECTED}")
    state_dict = {key.removeprefix("module."): value for key, value in payload.items()}

    with torch.device("meta"):  # no random init: every value comes from the file
        model = GFPGANClean()
    problem = describe_mismatch(model.state_dict(), state_dict)
    if problem:
        raise HeygemError(f"{checkpoint_path} does not fit GFPGAN: {problem}; expected {GFPGAN_EXPECTED}")
    state_dict = {key: value.float() if value.is_floating_point() else value for key, value in state_dict.items()}
    model.load_state_dict(state_dict, strict=True, assign=True)
    logger.info("loaded GFPGAN weights from %s", checkpoint_path)
    return model.to(device).eval()


def load_restorer(checkpoint: Path, config: EngineConfig) -> GfpganRestorer:
    """The GFPGAN restorer for ``checkpoint`` on the engine's device and precision, loaded once per
    process and kept for later jobs while the file and those options stay the same (heygem.runtime.kept)."""
    from heygem.runtime.device import configure_backends, pick_device

    device = pick_device(config.device)

    def load() -> GfpganRestorer:
        configure_backends(deterministic=config.deterministic, cudnn=config.cudnn, device=device,
                           autotune=config.cudnn_benchmark)
        restorer = GfpganRestorer(load_gfpgan(checkpoint, device), device, precision=config.precision,
                                  cuda_graph=config.cuda_graph)
        logger.info("GFPGAN restorer on %s, batches of %d", device, restorer.batch_size)
        return restorer

    key = (file_identity(checkpoint), str(device), config.precision, config.cuda_graph)
    return KEPT.shared(GFPGAN_RESTORER, key, load)
