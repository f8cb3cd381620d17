"""MuseTalk's own real-time loop, timed on the same files, video and speech as heygem's pipeline.

    python bench/bench_musetalk_e2e.py --official /tmp/musetalk-official --weights WEIGHTS \\
        --video face_1920x1080_60s.mp4 --audio speech_60s.wav [--cycle 250] [--json OUT.json]

WEIGHTS holds ``musetalk/`` in the official layout (bench/bench_pipeline.py writes random-init ones;
--write-random makes them here first). This runs the inference loop of the official
``scripts/realtime_inference.py`` with the official modules (its UNet and VAE classes,
PositionalEncoding, datagen, get_image_blending), fp16 as that script casts them, its default batch
of 20 and its fastest setting (``--skip_save_images``: no PNG per frame, no video written):

- avatar preparation, not timed (the official script does it once per avatar): the first ``--cycle``
  frames of the video, each one's 256x256 crop (heygem's MuseTalk box of the first frame's face, with
  v1.5's 10-pixel margin below the chin), encoded by the official ``VAE.get_latents_for_unet``; the
  paste mask of the official crop box (expand 1.5) with its upper half cleared (the mask's content
  does not change what pasting costs);
- the speech's Whisper features: heygem's (shown equal to the official ones by bench/musetalk_parity.py);
- timed: batches of the official ``datagen`` through ``pe``, ``unet.model`` at t = 0 and
  ``vae.decode_latents`` (which returns uint8 BGR on the CPU), and a second thread that resizes each
  face to its box and pastes it into a copy of its 1080p frame with ``get_image_blending``, as the
  script's ``process_frames`` does. Frames per second over every frame of the speech.

Nothing of the official code is part of this repository: give its checkout with --official.
"""

from __future__ import annotations

import argparse
import copy
import json
import queue
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import cv2  # noqa: E402 - after the path above
import numpy as np  # noqa: E402
import torch  # noqa: E402


def read_frames(video: Path, count: int) -> list[np.ndarray]:
    """The first ``count`` frames of ``video``, BGR (as the official script reads its avatar's frames)."""
    capture = cv2.VideoCapture(str(video))
    frames = []
    while len(frames) < count:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(frame)
    capture.release()
    if not frames:
        raise SystemExit(f"no frames in {video}")
    return frames


def face_box(frame: np.ndarray) -> tuple[int, int, int, int]:
    """heygem's MuseTalk box (with v1.5's margin) of the frame's face, or a fixed box where mediapipe is absent."""
    from heygem.config import FaceConfig
    from heygem.engines.musetalk import crop
    from heygem.face.finder import FaceFinder
    from heygem.types import Face

    height, width = frame.shape[:2]
    try:
        with FaceFinder(FaceConfig(), still_images=True) as finder:
            landmarks = finder.find(frame)
    except Exception as error:  # noqa: BLE001 - no mediapipe: a box of a face's usual size instead
        print(f"no face mesh ({type(error).__name__}: {error}); a fixed box is used")
        landmarks = None
    if landmarks is not None:
        box = crop.musetalk_box(Face(box=(0, 0, 1, 1), landmarks=landmarks), height, width, 10)
        if box is not None:
            return tuple(int(value) for value in box)
    side = height // 3
    return (width // 2 - side // 2, height // 4, width // 2 + side // 2, height // 4 + side)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", type=Path, required=True, help="a checkout of the official MuseTalk code")
    parser.add_argument("--weights", type=Path, required=True, help="a folder holding musetalk/ (official layout)")
    parser.add_argument("--write-random", choices=("full", "reduced"),
                        help="first write random-init files of this size into WEIGHTS/musetalk")
    parser.add_argument("--video", type=Path, required=True)
    parser.add_argument("--audio", type=Path, required=True)
    parser.add_argument("--cycle", type=int, default=250, help="avatar frames prepared (the official avatar's cycle)")
    parser.add_argument("--batch-size", type=int, default=20, help="the official script's --batch_size")
    parser.add_argument("--frames", type=int, default=0, help="at most this many frames of speech (0: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from musetalk_parity import torchvision_without_operators

    torchvision_without_operators()
    from heygem.engines.musetalk import audio_features, crop, loading
    from heygem.engines.musetalk.files import find_musetalk_files
    from heygem.speech.audio import load_audio_16k

    folder = args.weights / "musetalk"
    if args.write_random:
        from heygem.engines.musetalk.random_files import write_random_files

        write_random_files(folder, size=args.write_random)
    files = find_musetalk_files(folder)
    if files is None:
        raise SystemExit(f"no complete MuseTalk files in {folder}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sys.path.insert(0, str(args.official.resolve()))
    from musetalk.utils.blending import get_crop_box, get_image_blending
    from musetalk.utils.utils import datagen, load_all_model

    started = time.perf_counter()
    vae, unet, pe = load_all_model(unet_model_path=str(files.unet), vae_type=str(files.vae.parent),
                                   unet_config=str(files.unet_config), device=device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32  # the script's .half(), on a GPU
    pe = pe.to(device=device, dtype=dtype)
    vae.vae = vae.vae.to(device=device, dtype=dtype)
    unet.model = unet.model.to(device=device, dtype=dtype)
    timesteps = torch.tensor([0], device=device)
    load_seconds = time.perf_counter() - started

    # the speech's features (heygem's, equal to the official ones)
    samples = load_audio_16k(args.audio)
    frame_count = int(len(samples) / 16000 * 25)
    if args.frames:
        frame_count = min(frame_count, args.frames)
    encoder = loading.load_whisper_encoder(files).to(device)
    extractor = loading.load_feature_extractor(files)
    chunks = audio_features.audio_features(samples, 25.0, frame_count, extractor, encoder, device)
    chunks = chunks.to(dtype)  # (frames, 50, 384); pe adds the positional encoding in the loop
    chunks = chunks - pe(torch.zeros_like(chunks[:1]).to(device)).cpu()  # ours include it: take it off

    # avatar preparation, not timed
    started = time.perf_counter()
    frames = read_frames(args.video, args.cycle)
    box = face_box(frames[0])
    x1, y1, x2, y2 = box
    crop_box, _ = get_crop_box(box, 1.5)
    mask = np.zeros((crop_box[3] - crop_box[1], crop_box[2] - crop_box[0]), np.uint8)
    mask[mask.shape[0] // 2:] = 255
    with torch.no_grad():
        latents = [vae.get_latents_for_unet(crop.crop_256(frame, box)) for frame in frames]
    prepare_seconds = time.perf_counter() - started

    done = queue.Queue()

    def paste_frames(count: int) -> None:
        """The official process_frames: each face resized to its box and pasted into a copy of its frame."""
        for index in range(count):
            face = done.get()
            frame = copy.deepcopy(frames[index % len(frames)])
            face = cv2.resize(face.astype(np.uint8), (x2 - x1, y2 - y1))
            get_image_blending(frame, face, box, mask, crop_box)

    def loop(count: int) -> tuple[float, float]:
        """(seconds of the whole loop, seconds until the last batch was decoded) for ``count`` frames."""
        thread = threading.Thread(target=paste_frames, args=(count,))
        thread.start()
        begun = time.perf_counter()
        with torch.no_grad():
            for whisper_batch, latent_batch in datagen(chunks[:count], latents, args.batch_size, device=device):
                audio_batch = pe(whisper_batch.to(device))
                latent_batch = latent_batch.to(device=device, dtype=unet.model.dtype)
                predicted = unet.model(latent_batch, timesteps, encoder_hidden_states=audio_batch).sample
                for face in vae.decode_latents(predicted.to(device=device, dtype=vae.vae.dtype)):
                    done.put(face)
        decoded = time.perf_counter() - begun
        thread.join()
        return time.perf_counter() - begun, decoded

    loop(min(frame_count, 2 * args.batch_size))  # warm-up: cuDNN's first choices, allocations
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, decoded = loop(frame_count)
    result = {
        "frames": frame_count, "seconds": round(seconds, 2), "frames_per_second": round(frame_count / seconds, 1),
        "unet_vae_frames_per_second": round(frame_count / decoded, 1), "batch_size": args.batch_size,
        "dtype": str(dtype).removeprefix("torch."), "device": torch.cuda.get_device_name(0) if device.type == "cuda"
        else "cpu", "frame_size": list(frames[0].shape[:2]), "box": list(box), "avatar_frames": len(frames),
        "load_seconds": round(load_seconds, 1), "prepare_seconds": round(prepare_seconds, 1),
        "peak_vram_mib": round(torch.cuda.max_memory_reserved() / 2**20) if device.type == "cuda" else 0,
    }
    print("OFFICIAL " + json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
