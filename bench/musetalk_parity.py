"""heygem's MuseTalk engine against the official MuseTalk code, on the same random-init files.

Given a checkout of the official repository (never part of this one), this writes random-init files
in the official layout (``models/`` as its download script lays them out: the reduced config of the
same classes by default, ``--size full`` for the published one), imports the official modules and
compares, for the same photo, face box and audio:

- the face box: the official get_landmark_and_bbox fed the 68 points heygem maps from its mesh
  (its DWPose and S3FD models stood in by our points and box) against heygem's musetalk_box;
- the whisper features: the official AudioProcessor (get_audio_feature, get_whisper_chunk) and
  PositionalEncoding against heygem's audio_features;
- the UNet input latents: the official VAE.get_latents_for_unet of the same 256x256 crop, with its
  random posterior draw replaced by the posterior's mean (heygem takes the mean; the draw itself is
  reported too) against heygem's unet_input_latents;
- the predicted latents: the official UNet (its UNet class, t = 0) against heygem's loaded UNet;
- the decoded face: the official VAE.decode_latents (uint8 BGR) against heygem's model step
  (float RGB in [0, 1], rounded the same way), in levels of 0..255;
- with ``--parsing``, the face parsing masks: the official FaceParsing (jaw mode, cheeks 90) against
  heygem's BiSeNet and mask, on the same 512x512 square.

Stand-ins only for what inference does not run here: mmpose and the face_alignment detector (their
landmarks and box are ours), torchvision's package start (its compiled operators; the transforms
are the real ones), and librosa where it is not installed (then the 16 kHz samples go to the
official feature extractor in 30 s segments as get_audio_feature does, and that step is said to be
skipped). Prints a table of max abs differences with their tolerances and writes it as JSON.

    python bench/musetalk_parity.py --official /tmp/musetalk-official                # CPU, reduced
    python bench/musetalk_parity.py --official /tmp/musetalk-official --size full --device cuda
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import cv2  # noqa: E402 - after the path above
import numpy as np  # noqa: E402
import torch  # noqa: E402

TOLERANCES = {  # max abs difference accepted, per comparison and device
    "face box (pixels)": {"cpu": 0, "cuda": 0},
    "whisper features": {"cpu": 1e-4, "cuda": 1e-4},
    "UNet input latents": {"cpu": 1e-4, "cuda": 1e-3},
    "predicted latents": {"cpu": 1e-4, "cuda": 1e-3},
    "decoded face (0..255 levels)": {"cpu": 1, "cuda": 2},
    "decoded face, all of heygem's chain (0..255 levels)": {"cpu": 2, "cuda": 4},
    "parsing mask (pixels differing)": {"cpu": 0, "cuda": 0},
}


FLOOR_FACTOR = 4  # ours may differ by this many times the official output's own rounding floor


def nudged(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` moved by about one float32 rounding (1e-7), for the floor of a comparison."""
    generator = torch.Generator(device="cpu").manual_seed(1)
    return tensor + (torch.randn(tensor.shape, generator=generator) * 1e-7).to(tensor.device, tensor.dtype)


def thread_floor(compute) -> float:
    """How much ``compute()`` (an official function's output) changes when torch's CPU threads change
    (1 instead of N, or 2 instead of 1): the reduction order differs, and random weights amplify that
    rounding by several orders of magnitude."""
    threads = torch.get_num_threads()
    first = compute()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        second = compute()
    finally:
        torch.set_num_threads(threads)
    if isinstance(first, np.ndarray):
        return float(np.abs(first.astype(np.float64) - second.astype(np.float64)).max())
    return (first.float() - second.float()).abs().max().item()


def install_stand_ins(points_68: np.ndarray | None, detector_box: tuple | None) -> None:
    """Modules the official code imports but inference does not run here."""
    mmpose, apis, structures = (types.ModuleType(name) for name in ("mmpose", "mmpose.apis", "mmpose.structures"))
    keypoints = np.zeros((1, 133, 2), np.float32)  # COCO-WholeBody: face points are 23..90
    if points_68 is not None:
        keypoints[0, 23:91] = points_68
    apis.init_model = lambda *args, **kwargs: None
    apis.inference_topdown = lambda model, image: [None]
    structures.merge_data_samples = lambda results: types.SimpleNamespace(
        pred_instances=types.SimpleNamespace(keypoints=keypoints.copy()))
    mmpose.apis, mmpose.structures = apis, structures
    face_detection = types.ModuleType("face_detection")

    class FaceAlignment:
        def __init__(self, *args, **kwargs):
            pass

        def get_detections_for_batch(self, frames):
            return [detector_box for _ in frames]

    face_detection.FaceAlignment = FaceAlignment
    face_detection.LandmarksType = types.SimpleNamespace(_2D=2)
    sys.modules.update({"mmpose": mmpose, "mmpose.apis": apis, "mmpose.structures": structures,
                        "face_detection": face_detection})
    if importlib.util.find_spec("librosa") is None:
        sys.modules["librosa"] = types.ModuleType("librosa")  # load() is not called then: see get_audio_feature


def torchvision_without_operators() -> None:
    """torchvision's package without its start (which loads compiled operators that need the very torch
    build they were made for): its transforms, which the official code uses, are the real ones."""
    spec = importlib.util.find_spec("torchvision")
    if spec is not None and "torchvision" not in sys.modules:
        package = types.ModuleType("torchvision")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["torchvision"] = package


def points_from_mesh(landmarks: np.ndarray) -> np.ndarray:
    """(68, 2): the jaw line and point 29 heygem maps from the mesh; the other points at point 29,
    inside the box, so that they decide nothing (as they decide nothing on a real face)."""
    from heygem.engines.musetalk.crop import landmarks_68_subset

    jaw, nose_29 = landmarks_68_subset(landmarks)
    points = np.repeat(nose_29[None], 68, axis=0)
    points[:17] = jaw
    return points


def mesh_of(frame_bgr: np.ndarray) -> np.ndarray | None:
    """heygem's face mesh of the photo, or None where mediapipe cannot run (a fixed box is used then)."""
    from heygem.config import FaceConfig
    from heygem.face.finder import FaceFinder

    try:
        with FaceFinder(FaceConfig(), still_images=True) as finder:
            return finder.find(frame_bgr)
    except Exception as error:  # noqa: BLE001 - no mediapipe here: the box is fixed instead
        print(f"no face mesh ({type(error).__name__}: {error}); a fixed box is compared")
        return None


def speech_samples(path: Path) -> np.ndarray:
    """(S,) float32 at 16 kHz: heygem's decoder (ffmpeg), or, where there is no ffmpeg, the WAV file
    resampled by scipy. Both sides are given these same samples."""
    try:
        from heygem.speech.audio import load_audio_16k

        return load_audio_16k(path)
    except Exception:  # noqa: BLE001 - no ffmpeg on this machine
        import wave
        from math import gcd

        from scipy.signal import resample_poly

        with wave.open(str(path)) as reader:
            rate, channels = reader.getframerate(), reader.getnchannels()
            pcm = np.frombuffer(reader.readframes(reader.getnframes()), np.int16).reshape(-1, channels)
        common = gcd(rate, 16000)
        return resample_poly(pcm.mean(axis=1) / 32768.0, 16000 // common, rate // common).astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", type=Path, required=True, help="a checkout of the official MuseTalk repository")
    parser.add_argument("--size", choices=("reduced", "full"), default="reduced")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frames", type=int, default=8, help="video frames of audio compared")
    parser.add_argument("--parsing", action="store_true", help="also compare the BiSeNet jaw masks")
    parser.add_argument("--photo", type=Path, default=REPO / "assets" / "astronaut.jpg")
    parser.add_argument("--audio", type=Path, default=REPO / "assets" / "speech_en.wav")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--site", type=Path, action="append", default=[],
                        help="a folder holding the official code's own dependencies (einops, torchvision), if they "
                             "are not installed")
    args = parser.parse_args()
    sys.path.extend(str(folder) for folder in args.site)
    device = torch.device(args.device)
    started = time.perf_counter()
    torchvision_without_operators()  # before transformers looks for it

    from heygem.config import EngineConfig
    from heygem.engines.musetalk import crop
    from heygem.engines.musetalk.engine import MuseTalkEngine
    from heygem.engines.musetalk.files import find_musetalk_files
    from heygem.engines.musetalk.random_files import write_random_files, write_random_parsing_files
    from heygem.types import Face

    frame = cv2.imread(str(args.photo))
    landmarks = mesh_of(frame)
    results: dict[str, dict] = {}

    def report(name: str, difference: float, note: str = "", floor: float | None = None) -> None:
        """``floor``: how much the official output itself moves when its input moves by one rounding
        (1e-7) or torch's CPU threads change: random weights amplify rounding, so what ours may differ by
        is at least a few times that."""
        tolerance = TOLERANCES[name][device.type]
        if floor is not None:
            tolerance = max(tolerance, FLOOR_FACTOR * floor)
            note = f"{note}; the official output itself moves {floor:.3g} (rounding floor)".lstrip("; ")
        results[name] = {"max_abs_difference": float(difference), "tolerance": tolerance,
                         "within": bool(difference <= tolerance), "note": note}
        print(f"| {name} | {difference:.3g} | {tolerance} | {'yes' if difference <= tolerance else 'NO'} | {note} |")

    print("| compared | max abs difference | tolerance | within | note |\n| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="musetalk-parity-") as work:
        work = Path(work)
        models = write_random_files(work / "models", size=args.size, seed=0)
        if args.parsing:
            write_random_parsing_files(models, seed=0)
        files = find_musetalk_files(models)

        # the face box: the official function on our 68 points, against ours
        if landmarks is not None:
            points = points_from_mesh(landmarks)
            ours = crop.musetalk_box(Face(box=(0, 0, 1, 1), landmarks=landmarks), *frame.shape[:2], extra_margin=0)
            detector_box = (0, 0, frame.shape[1], frame.shape[0])
        else:
            points, ours, detector_box = None, (150, 80, 300, 230), (150, 80, 300, 230)
        install_stand_ins(points, detector_box)
        sys.path.insert(0, str(args.official.resolve()))
        os.chdir(work)  # the official code finds models/ and its dwpose config relative to the working folder
        (work / "musetalk" / "utils" / "dwpose").mkdir(parents=True, exist_ok=True)
        from musetalk.utils.audio_processor import AudioProcessor
        from musetalk.utils.utils import load_all_model

        if landmarks is not None:
            from musetalk.utils.preprocessing import get_landmark_and_bbox

            cv2.imwrite(str(work / "frame.png"), frame)
            official_boxes, _ = get_landmark_and_bbox([str(work / "frame.png")], 0)
            official_box = tuple(int(value) for value in official_boxes[0])
            report("face box (pixels)", float(np.abs(np.subtract(official_box, ours)).max()),
                   f"official {official_box}, heygem {ours}")
        box = ours
        x1, y1, x2, y2 = box
        y2 = min(y2 + 10, frame.shape[0])  # v1.5's extra margin, as the official inference adds it
        box = (x1, y1, x2, y2)
        crop_bgr = crop.crop_256(frame, box)
        official_crop = cv2.resize(frame[y1:y2, x1:x2], (256, 256), interpolation=cv2.INTER_LANCZOS4)
        assert np.array_equal(crop_bgr, official_crop)

        # fp32 without TF32 (deterministic) on both sides: the same arithmetic is compared
        ours_engine = MuseTalkEngine(files, EngineConfig(device=args.device, precision="fp32", cuda_graph=False,
                                                         deterministic=True), use_cache=False)
        vae, unet, positional = load_all_model(unet_model_path=str(files.unet), vae_type="sd-vae",
                                               unet_config=str(files.unet_config), device=device)
        positional = positional.to(device)
        vae.vae = vae.vae.to(device)
        unet.model = unet.model.to(device)

        # whisper features
        from transformers import WhisperModel

        samples = speech_samples(args.audio)[:int(16000 * args.frames / 25) + 1600]
        processor = AudioProcessor(feature_extractor_path=str(models / "whisper"))
        whisper = WhisperModel.from_pretrained(str(models / "whisper")).to(device).eval()
        note = ""
        if isinstance(sys.modules.get("librosa"), types.ModuleType) and not hasattr(sys.modules["librosa"], "load"):
            segments = [samples[start:start + 480000] for start in range(0, len(samples), 480000)]
            input_features = [processor.feature_extractor(segment, return_tensors="pt", sampling_rate=16000)
                              .input_features for segment in segments]
            length = len(samples)
            note = "librosa not installed: get_audio_feature's segments made here"
        else:
            import soundfile  # librosa's own dependency

            wav_16k = work / "speech_16k.wav"
            soundfile.write(str(wav_16k), samples, 16000, subtype="FLOAT")
            input_features, length = processor.get_audio_feature(str(wav_16k))
        frame_count = int(np.floor(length / 16000 * 25))
        with torch.no_grad():
            chunks = processor.get_whisper_chunk(input_features, device, torch.float32, whisper, length, fps=25)
            official_audio = positional(chunks).float().cpu()
        our_audio = ours_engine.audio_features(samples, 25.0, frame_count)
        report("whisper features", (official_audio - our_audio).abs().max().item(),
               f"{frame_count} frames, {tuple(our_audio.shape[1:])} each{'; ' + note if note else ''}")

        # UNet input latents: the official posterior draw, and the draw replaced by the mean
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        torch.manual_seed(0)
        drawn = vae.get_latents_for_unet(crop_bgr).float().cpu()
        sample = DiagonalGaussianDistribution.sample
        DiagonalGaussianDistribution.sample = lambda self, generator=None: self.mean
        try:
            official_latents = vae.get_latents_for_unet(crop_bgr)
            # the official tensor is laid out otherwise in memory than a contiguous one of the same values,
            # which takes other kernels: what that alone changes is the floor
            masked_input = vae.preprocess_img(crop_bgr, half_mask=True)
            official_masked = official_latents[:, :4]
            latents_floor = max((vae.encode_latents(masked_input.contiguous()) - official_masked).abs().max().item(),
                                (vae.encode_latents(nudged(masked_input)) - official_masked).abs().max().item(),
                                thread_floor(lambda: vae.get_latents_for_unet(crop_bgr)))
        finally:
            DiagonalGaussianDistribution.sample = sample
        our_latents = ours_engine.unet_input_latents(crop_bgr[None])
        report("UNet input latents", (official_latents.float().cpu() - our_latents).abs().max().item(),
               f"the official random draw is {(drawn - our_latents).abs().max().item():.3g} from the mean",
               floor=latents_floor)

        # each network on the same inputs (the official latents and features), then all of ours chained
        count = min(4, frame_count)
        latents_batch = official_latents.repeat(count, 1, 1, 1)
        audio_batch = official_audio[:count].to(device)
        with torch.no_grad():
            def official_unet(latents):
                return unet.model(latents, torch.tensor([0], device=device), encoder_hidden_states=audio_batch).sample

            official_predicted = official_unet(latents_batch)
            official_faces = vae.decode_latents(official_predicted)  # (B, 256, 256, 3) uint8 BGR
            from heygem.engines.musetalk.loading import load_unet

            our_unet = load_unet(files).to(device)
            our_predicted = our_unet(latents_batch, torch.zeros(1, device=device),
                                     encoder_hidden_states=audio_batch).sample
        report("predicted latents", (official_predicted - our_predicted).abs().max().item(),
               f"{count} faces, the same inputs", floor=thread_floor(lambda: official_unet(latents_batch)))

        def as_bgr_levels(faces: torch.Tensor) -> np.ndarray:
            faces = (faces.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
            return faces[..., ::-1].astype(np.int16)

        difference = np.abs(official_faces.astype(np.int16) - as_bgr_levels(
            ours_engine.generate_faces(latents_batch.float().cpu(), official_audio[:count])))
        report("decoded face (0..255 levels)", float(difference.max()),
               f"the model step (UNet + decode) on the same inputs; {(difference > 0).sum()} of {difference.size} "
               "values differ", floor=thread_floor(lambda: vae.decode_latents(official_unet(latents_batch))))
        chained = np.abs(official_faces.astype(np.int16) - as_bgr_levels(
            ours_engine.generate_faces(our_latents.repeat(count, 1, 1, 1), our_audio[:count])))
        report("decoded face, all of heygem's chain (0..255 levels)", float(chained.max()),
               f"heygem's latents and features; {(chained > 0).sum()} of {chained.size} values differ")

        if args.parsing:
            from musetalk.utils.face_parsing import FaceParsing
            from PIL import Image

            from heygem.engines.musetalk.parsing import mode_mask

            official_parser = FaceParsing(left_cheek_width=90, right_cheek_width=90)
            square = cv2.resize(frame[y1:y2, x1:x2], (300, 300))
            official_mask = np.asarray(official_parser(Image.fromarray(square[..., ::-1]), mode="jaw"))
            parser = ours_engine.parser if ours_engine.parser is not None else None
            our_mask = mode_mask(parser.classes(square), "jaw", parser.kernel, parser.cheeks)
            report("parsing mask (pixels differing)", float((official_mask != our_mask).sum()),
                   f"{(official_mask > 0).mean() * 100:.1f} % of the square in the mask")
    summary = {"size": args.size, "device": str(device), "torch": torch.__version__,
               "seconds": round(time.perf_counter() - started, 1), "results": results}
    print(json.dumps({key: value for key, value in summary.items() if key != "results"}))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return 0 if all(result["within"] for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
