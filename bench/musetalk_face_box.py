"""MuseTalk's face box from heygem's mesh points against the box from a 68-point detector, on real photos.

MuseTalk takes its box from 68 face landmarks (DWPose's, in the iBUG 300-W order); heygem takes the
same box from the mediapipe mesh points at the same places (heygem.engines.musetalk.crop). This
compares the two on the photos heygem and its packages ship, with dlib's 68-point shape predictor
(the face_recognition_models package's file) standing in for DWPose: the same 68-point layout from
another detector, so the differences are those of the mapping plus those between two detectors.
Per photo: each side of the box (before MuseTalk's 10-pixel margin) in pixels and as a share of the
box's size, and dlib's point 29 against heygem's.

    pip install --target /tmp/dlib dlib-bin face_recognition_models   # measurement only
    python bench/musetalk_face_box.py --site /tmp/dlib
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import cv2  # noqa: E402 - after the path above
import numpy as np  # noqa: E402


def photos() -> dict[str, np.ndarray]:
    """The real faces at hand, as (H, W, 3) uint8 BGR: the bundled portrait (also mirrored and at
    twice its size, which moves every landmark detector a little) and scikit-image's cameraman."""
    portrait = cv2.imread(str(REPO / "assets" / "astronaut.jpg"))
    found = {"astronaut.jpg": portrait, "astronaut.jpg mirrored": portrait[:, ::-1].copy(),
             "astronaut.jpg x2": cv2.resize(portrait, None, fx=2, fy=2, interpolation=cv2.INTER_CUBIC)}
    try:
        from skimage import data

        found["skimage camera x2"] = cv2.resize(cv2.cvtColor(data.camera(), cv2.COLOR_GRAY2BGR), None, fx=2, fy=2,
                                                interpolation=cv2.INTER_CUBIC)
    except ImportError:
        pass
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, action="append", default=[], help="a folder holding dlib")
    args = parser.parse_args()
    sys.path.extend(str(folder) for folder in args.site)
    import importlib.util

    import dlib

    from heygem.config import FaceConfig
    from heygem.engines.musetalk.crop import box_from_68, landmarks_68_subset
    from heygem.face.finder import FaceFinder

    detector = dlib.get_frontal_face_detector()
    models = Path(importlib.util.find_spec("face_recognition_models").submodule_search_locations[0]) / "models"
    predictor = dlib.shape_predictor(str(models / "shape_predictor_68_face_landmarks.dat"))
    print("| photo | dlib 68-point box | heygem box | left, top, right, bottom (px) | largest / box size | "
          "point 29 (px) |\n| --- | --- | --- | --- | --- | --- |")
    for name, frame in photos().items():
        rgb = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
        faces = detector(rgb, 1)
        with FaceFinder(FaceConfig(), still_images=True) as finder:
            mesh = finder.find(frame)
        if not faces or mesh is None:
            print(f"| {name} | {'no face' if not faces else '-'} | {'no face' if mesh is None else '-'} | | | |")
            continue
        face = max(faces, key=lambda rect: rect.width() * rect.height())
        shape = predictor(rgb, face)
        points = np.array([(shape.part(i).x, shape.part(i).y) for i in range(68)], np.float32)
        reference = box_from_68(points, points[29])
        jaw, nose_29 = landmarks_68_subset(mesh)
        ours = box_from_68(jaw, nose_29)
        sides = np.subtract(ours, reference)
        size = max(reference[2] - reference[0], reference[3] - reference[1])
        nose = nose_29 - points[29]
        print(f"| {name} | {reference} | {ours} | {', '.join(str(int(v)) for v in sides)} | "
              f"{np.abs(sides).max() / size * 100:.1f} % of {size} | {nose[0]:+.1f}, {nose[1]:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
