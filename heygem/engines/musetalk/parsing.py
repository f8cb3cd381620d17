"""MuseTalk's paste mask from BiSeNet face parsing (face-parse-bisent/ in the weights folder).

The facts, as MuseTalk 1.5 blends a generated face back:

- the region pasted is a square around the face box's centre, 1.5 times its longer side
  (half-side int(max(w, h) // 2 * 1.5)); pixels of it outside the frame are black;
- that square, resized to 512x512 (bilinear) and normalised with ImageNet's mean and std, is
  parsed; the mask is the classes of the mode: "raw" skin (1), lips and mouth (11, 12, 13);
  "neck" those and the neck (14); "jaw" (1.5's default) the skin dilated downwards by a cone of
  33x33 pixels, eroded twice by a flat 35x3 ellipse inside the cheeks (more than ``cheek_width``
  pixels from the middle), the nose (10) left out, lips and mouth added;
- the mask, resized back to the square (PIL's bicubic), kept inside the face box and below the square's
  middle row, blurred with a Gaussian of side int(0.05 * side // 2 * 2) + 1;
- the square with the generated face in the box is blended into the frame through that mask.
"""

from __future__ import annotations

import cv2
import numpy as np
import torch
from PIL import Image

from heygem.engines.musetalk.files import MuseTalkFiles
from heygem.errors import HeygemError
from heygem.models.bisenet import BiSeNet, ResNet18Features
from heygem.types import Box, Face, FacePatch
from heygem.weights import describe_mismatch, read_state_dict

PARSING_SIZE = 512
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)
SKIN, NOSE, MOUTH_CLASSES, NECK = 1, 10, (11, 12, 13), 14
EXPAND = 1.5
PARSING_EXPECTED = "MuseTalk's face-parse-bisent/79999_iter.pth (BiSeNet) and resnet18-5c106cde.pth"


def load_bisenet(files: MuseTalkFiles, device) -> BiSeNet:
    """BiSeNet from 79999_iter.pth, every key and shape checked; resnet18-5c106cde.pth (the backbone's
    ImageNet start, which the parsing weights replace) is checked to be that backbone."""
    with torch.device("meta"):
        network, backbone = BiSeNet(), ResNet18Features()
    state_dict, _ = read_state_dict(files.parsing, "BiSeNet", PARSING_EXPECTED)
    problem = describe_mismatch(network.state_dict(), state_dict)
    if problem:
        raise HeygemError(f"{files.parsing} does not fit BiSeNet face parsing: {problem}; expected {PARSING_EXPECTED}")
    backbone_state, _ = read_state_dict(files.parsing_backbone, "ResNet-18", PARSING_EXPECTED)
    backbone_state = {key: value for key, value in backbone_state.items() if not key.startswith("fc.")}
    wanted = {key: value for key, value in backbone.state_dict().items() if not key.endswith("num_batches_tracked")}
    backbone_state = {key: value for key, value in backbone_state.items() if not key.endswith("num_batches_tracked")}
    problem = describe_mismatch(wanted, backbone_state)
    if problem:
        raise HeygemError(f"{files.parsing_backbone} is not ResNet-18: {problem}; expected {PARSING_EXPECTED}")
    network.load_state_dict({key: value.float() if value.is_floating_point() else value
                             for key, value in state_dict.items()}, strict=True, assign=True)
    return network.eval().requires_grad_(False).to(device)


def jaw_kernel() -> np.ndarray:
    """(33, 33) uint8: a downward cone (rows 10-20 widening by 2 a row from 1) on a column as wide as its base."""
    cone, tail = 21, 12
    size = cone + tail
    kernel = np.zeros((size, size), np.uint8)
    centre = size // 2
    for row in range(cone // 2, cone):
        half = (2 * (row - cone // 2) + 1) // 2
        kernel[row, centre - half:centre + half + 1] = 1
    base = int(kernel[cone - 1].sum())
    kernel[cone:, max(0, centre - base // 2):min(size, centre + base // 2 + 1)] = 1
    return kernel


def cheek_mask(cheek_width: int) -> np.ndarray:
    """(512, 512) uint8: 255 farther than ``cheek_width`` from the middle column (both sides), else 0."""
    mask = np.zeros((PARSING_SIZE, PARSING_SIZE), np.uint8)
    centre = PARSING_SIZE // 2
    mask[:, :centre - cheek_width + 1] = 255
    mask[:, centre + cheek_width:] = 255
    return mask


def mode_mask(classes: np.ndarray, mode: str, kernel: np.ndarray, cheeks: np.ndarray) -> np.ndarray:
    """(512, 512) uint8 255/0 mask of the parsing ``classes`` (512, 512) for ``mode`` (see the module)."""
    if mode == "raw":
        return np.where(np.isin(classes, (SKIN, *MOUTH_CLASSES)), 255, 0).astype(np.uint8)
    if mode == "neck":
        return np.where(np.isin(classes, (SKIN, *MOUTH_CLASSES, NECK)), 255, 0).astype(np.uint8)
    skin = np.where(classes == SKIN, 255, 0).astype(np.uint8)
    dilated = cv2.dilate(skin, kernel, iterations=1)
    eroded = cv2.erode(dilated, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (35, 3)), iterations=2)
    region = cv2.bitwise_or(cv2.bitwise_and(eroded, cheeks), cv2.bitwise_and(dilated, cv2.bitwise_not(cheeks)))
    chosen = ((region == 255) & (classes != NOSE)) | np.isin(classes, MOUTH_CLASSES)
    return np.where(chosen, 255, 0).astype(np.uint8)


def paste_square(box: Box) -> Box:
    """The square MuseTalk blends through (may reach outside the frame)."""
    x1, y1, x2, y2 = box
    centre_x, centre_y = (x1 + x2) // 2, (y1 + y2) // 2
    half = int(max(x2 - x1, y2 - y1) // 2 * EXPAND)
    return centre_x - half, centre_y - half, centre_x + half, centre_y + half


class FaceParser:
    """BiSeNet and the mask of one parsing mode; makes the patch that blends a generated face."""

    def __init__(self, files: MuseTalkFiles, device, mode: str, cheek_width: int):
        self.device = device
        self.network = load_bisenet(files, device)
        self.mode = mode
        self.kernel = jaw_kernel()
        self.cheeks = cheek_mask(cheek_width)

    def classes(self, square_bgr: np.ndarray) -> np.ndarray:
        """(512, 512) int64 parsing classes of a (S, S, 3) uint8 BGR square."""
        image = np.asarray(Image.fromarray(np.ascontiguousarray(square_bgr[..., ::-1])).resize(
            (PARSING_SIZE, PARSING_SIZE), Image.BILINEAR))  # PIL's, as MuseTalk's
        normalised = (image.astype(np.float32) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
        tensor = torch.from_numpy(normalised.transpose(2, 0, 1)).unsqueeze(0).to(self.device)
        with torch.inference_mode():
            return self.network(tensor)[0].argmax(0).cpu().numpy()

    def patch(self, frame_bgr: np.ndarray, face_bgr: np.ndarray, box: Box, face: Face) -> FacePatch:
        """The patch blending ``face_bgr`` (the generated face at ``box``'s size) as MuseTalk does."""
        frame_height, frame_width = frame_bgr.shape[:2]
        sx1, sy1, sx2, sy2 = paste_square(box)
        side = sx2 - sx1
        square = np.zeros((side, side, 3), np.uint8)  # outside the frame: black, as MuseTalk crops
        cx1, cy1, cx2, cy2 = max(sx1, 0), max(sy1, 0), min(sx2, frame_width), min(sy2, frame_height)
        square[cy1 - sy1:cy2 - sy1, cx1 - sx1:cx2 - sx1] = frame_bgr[cy1:cy2, cx1:cx2]
        parsed = mode_mask(self.classes(square), self.mode, self.kernel, self.cheeks)
        parsed = np.asarray(Image.fromarray(parsed).resize((side, side), Image.BICUBIC))
        x1, y1, x2, y2 = box
        mask = np.zeros((side, side), np.uint8)
        inner = (slice(y1 - sy1, y2 - sy1), slice(x1 - sx1, x2 - sx1))
        mask[inner] = parsed[inner]
        mask[:int(side * 0.5)] = 0  # only the lower half of the square speaks
        kernel_size = int(0.05 * side // 2 * 2) + 1
        mask = cv2.GaussianBlur(mask, (kernel_size, kernel_size), 0)
        square[inner] = face_bgr
        region = (slice(cy1 - sy1, cy2 - sy1), slice(cx1 - sx1, cx2 - sx1))
        return FacePatch(box=(cx1, cy1, cx2, cy2), image_bgr=np.ascontiguousarray(square[region]),
                         mask=mask[region].astype(np.float32) / 255.0, face=face)
