"""The MuseTalk 1.5 engine: 256x256 mouths from the official files, one UNet step in latent space.

Per face: MuseTalk's box from the landmarks (heygem.engines.musetalk.crop), its pixels resized to
256x256, the VAE latents of that crop with its lower half blacked out and of the whole crop (the
reference), both times the VAE's scaling factor, concatenated (8, 32, 32); the UNet at t = 0 with
the frame's window of Whisper states (heygem.engines.musetalk.audio_features) as cross-attention;
the predicted latents decoded to a 256x256 face (heygem.engines.musetalk.model_step), resized
back to the box and handed to the blend stage with the paste mask.

Loading: the libraries' model modules (heygem.engines.musetalk.loading.import_libraries), then the mouth
network from its copy beside the official files when one matches them (heygem.engines.musetalk.network_copy),
else from the official files, strictly, writing the copy for the next start. On a GPU the first batch's
autotuning and CUDA graph capture then run in a thread of their own while Whisper loads and the first
frames are decoded and tracked; the first call that needs the step waits for it. ``load_seconds`` says where
the load went. With ``--musetalk-compile`` always (what a server's workers and live sessions ask for) the UNet
and decoder are compiled by torch.compile in that same warm-up (about a minute with a cold compile cache, once
per process).

The crop latents are the avatar's preparation: kept in memory for the job and in the avatar
cache (heygem.face.avatar_cache) under the VAE's files and the crop's pixels, so a new script for
the same presenter never runs the encoder again; a saved presenter has them all encoded when it is
prepared (:meth:`MuseTalkEngine.prepare_latents`), so even its first job runs no encoder.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

import heygem.engines.musetalk.audio_features as features
import heygem.engines.musetalk.crop as crop
import heygem.engines.musetalk.loading as loading
from heygem.config import BlendConfig, EngineConfig
from heygem.engines.musetalk.files import MuseTalkFiles
from heygem.engines.musetalk.model_step import MouthModelStep, encode_faces
from heygem.engines.musetalk.network_copy import NetworkCopy
from heygem.face import avatar_cache
from heygem.render.blend import lower_face_mask
from heygem.runtime.device import FixedBatchRunner, autocast_dtype, configure_backends, pick_device, upload
from heygem.runtime.kept import file_identity
from heygem.types import Box, Face, FacePatch

logger = logging.getLogger("heygem")

LATENT_SHAPE = (8, crop.FACE_SIZE // 8, crop.FACE_SIZE // 8)  # masked then reference latents
REMEMBERED_CROPS = 4096  # crop latents kept in memory (32 KiB each)
REMEMBERED_FRAMES = 4 * REMEMBERED_CROPS  # (clip, frame, box) -> crop digest entries (a few hundred bytes each)
CPU_BATCH_SIZE = 4  # faces per UNet pass on the CPU
PARSING_MODES = ("auto", "jaw", "neck", "raw", "landmarks")


def compiles_step(config: EngineConfig, device: torch.device) -> bool:
    """Whether the step runs compiled by torch.compile: --musetalk-compile always, on a GPU."""
    return config.musetalk_compile == "always" and device.type == "cuda"


def autotunes(config: EngineConfig, device: torch.device) -> bool:
    """Whether cuDNN times its candidate kernels for the step's fixed batches (benchmark mode): when asked for
    (--cudnn-benchmark) or when the step runs compiled (as its speeds were measured). Op by op its heuristics
    serve: on one H100 a 1080p minute rendered in the same 7.2 s either way and the first batch came 1.5 s
    sooner without the search (docs/benchmarks.md)."""
    return config.cudnn_benchmark or compiles_step(config, device)


class MuseTalkEngine:
    """MuseTalk 1.5 (or 1.0) from the official files, on ``config.device``."""

    name = "musetalk"

    def __init__(self, files: MuseTalkFiles, config: EngineConfig, use_cache: bool = True,
                 feather: float = BlendConfig.feather):
        loading.require_libraries()
        started = time.perf_counter()
        self.files = files
        self.device = pick_device(config.device)
        # torch.compile of the UNet and decoder where the engine serves many batches (the setting's auto is
        # resolved by whoever keeps the engine: heygem.engines.musetalk.kept_engine_compile); on a GPU only
        compile_step = compiles_step(config, self.device)
        configure_backends(deterministic=config.deterministic, cudnn=config.cudnn, device=self.device,
                           autotune=autotunes(config, self.device))
        self.dtype = autocast_dtype(self.device, config.precision) or torch.float32
        self.extra_margin = config.musetalk_margin if files.version == "v15" else 0  # 1.0 has no margin
        self.parsing_mode = resolve_parsing_mode(config.musetalk_parsing, files)
        self.feather = feather
        batch_size = min(config.batch_size, CPU_BATCH_SIZE) if self.device.type == "cpu" else config.batch_size
        self.load_seconds: dict[str, float] = {}  # phase of the load -> seconds
        with self._timed("libraries"):
            loading.import_libraries()
        self.step, self.weights_source = self._load_step(files, batch_size, config.cuda_graph, compile_step)
        self.vae = self.step.network.vae
        self._warm_up_error: BaseException | None = None
        self._warming = None
        if self.device.type == "cuda":  # the first batch's autotuning and graph capture, beside what follows
            self._warming = threading.Thread(target=self._warm_up, name="musetalk-warm-up", daemon=True)
            self._warming.start()
        with self._timed("whisper"):
            self.encoder = loading.load_whisper_encoder(files).to(self.device)
            self.feature_extractor = loading.load_feature_extractor(files)
        self._use_cuda_graph = config.cuda_graph
        self._encoder_runner: FixedBatchRunner | None = None  # made by the first call of encoder_hidden_states
        self.parser = None
        if self.parsing_mode in ("jaw", "neck", "raw"):
            from heygem.engines.musetalk.parsing import FaceParser

            self.parser = FaceParser(files, self.device, self.parsing_mode, config.musetalk_cheek_width)
        # the avatar cache's namespace: the VAE's files (their content, named by path, size and time)
        identity = repr((file_identity(files.vae_config), file_identity(files.vae))).encode()
        namespace = hashlib.sha256(b"musetalk-vae-latents-v1" + identity).hexdigest()
        self.latents_namespace = namespace if use_cache else None
        self.remembered: OrderedDict[str, np.ndarray] = OrderedDict()
        # which crop a face of a clip's frame gave: (clip key, source frame, box) -> the crop's digest, so the
        # device path needs no crop where the latents are still remembered (see remembered_latents)
        self.frame_crops: OrderedDict[tuple, str] = OrderedDict()
        self.encoded = 0  # crops encoded by the VAE (the rest came from memory or the avatar cache)
        logger.info("musetalk engine %s on %s, %s, batches of %d, paste mask %s, from the %s, loaded in %.1f s%s",
                    files.version, self.device, str(self.dtype).removeprefix("torch."), batch_size, self.parsing_mode,
                    self.weights_source, time.perf_counter() - started,
                    "; its step compiling (torch.compile: about a minute for the first batch, once per process)"
                    if compile_step else "")

    @contextmanager
    def _timed(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":  # this thread's work only: the warm-up thread's runs beside it
                torch.cuda.current_stream(self.device).synchronize()
            self.load_seconds[phase] = self.load_seconds.get(phase, 0.0) + time.perf_counter() - started

    @property
    def compiled(self) -> bool:
        """Whether the step runs compiled (False again once a compile failed and it went op by op)."""
        return self.step.compiled

    def _load_step(self, files: MuseTalkFiles, batch_size: int, use_cuda_graph: bool,
                   compile_step: bool) -> tuple[MouthModelStep, str]:
        """The model step from the network copy when one matches the files (see network_copy), else from the
        official files, strictly, then the copy written; and which of the two it came from."""
        weights_dtype = self.dtype if self.device.type == "cuda" else torch.float32  # the CPU step autocasts
        options = {"dtype": weights_dtype, "transposed_upsampling": True, "fuse_qkv": False}
        with self._timed("check copy"):
            copy = NetworkCopy(files, options)
        with self._timed("read copy"):
            state = copy.read(self.device)
        if state is not None:
            try:
                with self._timed("build"):
                    return MouthModelStep(loading.build_unet(files), loading.build_vae(files), self.device, self.dtype,
                                          batch_size, fast=True, use_cuda_graph=use_cuda_graph,
                                          compile_network=compile_step, network_state=state), "network copy"
            except (RuntimeError, ValueError, KeyError) as error:  # a copy of other layers' names or shapes
                logger.warning("musetalk: the network copy %s does not fit (%s); loading the official files",
                               copy.path.name, str(error).splitlines()[0] if str(error) else type(error).__name__)
            del state
        with self._timed("read unet"):
            unet = loading.load_unet(files)
        with self._timed("read vae"):
            vae = loading.load_vae(files)
        with self._timed("to device"):
            step = MouthModelStep(unet, vae, self.device, self.dtype, batch_size, fast=True,
                                  use_cuda_graph=use_cuda_graph, compile_network=compile_step)
        with self._timed("write copy"):
            copy.write(step.network_state())
        return step, "official files"

    def _warm_up(self) -> None:
        try:
            with torch.inference_mode():
                self.step.warm_up()
        except BaseException as error:  # noqa: BLE001 - handed to the first call that needs the step
            self._warm_up_error = error

    def wait_until_warm(self) -> None:
        """Wait for the warm-up thread (the first batch's autotuning and graph capture) to end; its error
        is raised here, in the caller's thread."""
        if self._warming is not None:
            self._warming.join()
            self._warming = None
            if self._warm_up_error is not None:
                error, self._warm_up_error = self._warm_up_error, None
                raise error

    @property
    def batch_size(self) -> int:
        return self.step.batch_size

    def audio_features(self, samples_16k: np.ndarray, fps: float, frame_count: int,
                       features_on_device: bool = False) -> torch.Tensor:
        """(frame_count, 50, 384) float32 on the CPU: each output frame's Whisper window plus the
        positional encoding (heygem.engines.musetalk.audio_features); ``features_on_device``: the
        spectrogram computed on the engine's device (live sessions' short passes)."""
        return features.audio_features(samples_16k, fps, frame_count, self.feature_extractor, self.encoder,
                                       self.device, features_on_device=features_on_device)

    def encoder_hidden_states(self, mels: torch.Tensor) -> torch.Tensor:
        """(B, 80, 3000) log-mel spectrograms on the device -> (B, 1500, L + 1, 384) float32 on the device: every
        hidden state of the Whisper encoder, as :func:`audio_features.encoder_states` stacks them, through a
        runner of a fixed batch (the engine's), one CUDA graph replay on a GPU instead of the encoder's hundred
        launches: live sessions run a pass every other frame from a thread that waits to take the interpreter's
        lock back after each launch."""
        return self.warm_up_encoder()(mels.to(device=self.device, dtype=torch.float32))

    def warm_up_encoder(self) -> FixedBatchRunner:
        """Make the runner of :meth:`encoder_hidden_states` and ready its batch and graph (a live server calls it
        while it loads the engine, so the first session's first pass does not capture it)."""
        if self._encoder_runner is None:
            runner = FixedBatchRunner(EncoderStates(self.encoder), self.device, self.batch_size,
                                      precision="fp32",  # the jobs' precision: the same states
                                      use_cuda_graph=self._use_cuda_graph, name="whisper encoder")
            runner.warm_up(((self.feature_extractor.feature_size, self.feature_extractor.nb_max_frames),
                            torch.float32))  # (80, 3000): Whisper's 30 s
            self._encoder_runner = runner
        return self._encoder_runner

    def remembered_latents(self, frame_key: tuple) -> np.ndarray | None:
        """The (8, 32, 32) UNet input latents of the face at ``frame_key`` ((clip key, source frame, box): the
        crop is a function of these) when a crop of it went through :meth:`unet_input_latents` with that key and
        its latents are still in memory; else None (the crop is needed)."""
        digest = self.frame_crops.get(frame_key)
        latents = self.remembered.get(digest) if digest is not None else None
        if latents is not None:
            self.frame_crops.move_to_end(frame_key)
            self.remembered.move_to_end(digest)
        return latents

    def unet_input_latents(self, crops_bgr: np.ndarray, frame_keys: list | None = None) -> torch.Tensor:
        """(B, 256, 256, 3) uint8 BGR crops -> (B, 8, 32, 32) float32 UNet input on the CPU: the masked
        crop's latents then the whole crop's, times the scaling factor; from memory or the avatar
        cache where this crop was encoded before. ``frame_keys`` (one per crop, None where unknown): where
        each crop came from, remembered for :meth:`remembered_latents`."""
        digests = [hashlib.sha256(np.ascontiguousarray(one).tobytes()).hexdigest() for one in crops_bgr]
        for frame_key, digest in zip(frame_keys or [], digests):
            if frame_key is not None:
                self.frame_crops[frame_key] = digest
                self.frame_crops.move_to_end(frame_key)
        while len(self.frame_crops) > REMEMBERED_FRAMES:
            self.frame_crops.popitem(last=False)
        found: dict[str, np.ndarray] = {}
        for digest in dict.fromkeys(digests):  # each distinct crop once
            latents = self.remembered.get(digest)
            if latents is None and self.latents_namespace is not None:
                latents = avatar_cache.load_latents(self.latents_namespace, digest, LATENT_SHAPE, np.float32)
            if latents is not None:
                found[digest] = latents
        missing = [digests.index(digest) for digest in dict.fromkeys(digests) if digest not in found]  # rows
        if missing:
            self.wait_until_warm()  # the VAE is the step's: not used while its graph is captured
            masked, whole = crop.vae_inputs(crops_bgr[missing])  # (M, 3, 256, 256) each, RGB in [-1, 1]
            # two passes, as MuseTalk encodes them (one batch of both gives other rounding, which random
            # weights amplify to 1e-3)
            encoded = torch.cat((encode_faces(self.vae, masked), encode_faces(self.vae, whole)), dim=1)
            encoded = encoded.cpu().numpy()  # (M, 8, 32, 32)
            self.encoded += len(missing)
            for row, latents in zip(missing, encoded):
                found[digests[row]] = latents
                if self.latents_namespace is not None:
                    avatar_cache.store_latents(self.latents_namespace, digests[row], latents)
        for digest, latents in found.items():
            self.remembered[digest] = latents
            self.remembered.move_to_end(digest)
        while len(self.remembered) > REMEMBERED_CROPS:
            self.remembered.popitem(last=False)
        return torch.from_numpy(np.stack([found[digest] for digest in digests]))  # (B, 8, 32, 32)

    def generate_faces(self, unet_input_latents: torch.Tensor, audio_windows: torch.Tensor) -> torch.Tensor:
        """(B, 8, 32, 32) latents and (B, 50, 384) audio features -> (B, 3, 256, 256) float RGB in [0, 1]."""
        self.wait_until_warm()
        return self.step(upload(unet_input_latents, self.device), upload(audio_windows, self.device))

    def face_crops(self, frames_bgr, faces: list[Face | None]) -> tuple[list[int], list[Box], np.ndarray]:
        """(rows of the frames whose face has a box, MuseTalk's box of each, (F, 256, 256, 3) uint8 BGR crops)
        for ``frames_bgr`` ((N, H, W, 3) uint8 BGR, or a list of N frames, of one size or several) and their
        N faces."""
        rows, boxes = [], []
        for row, face in enumerate(faces):
            box = (crop.musetalk_box(face, *frames_bgr[row].shape[:2], self.extra_margin)
                   if face is not None else None)
            if box is not None:
                rows.append(row)
                boxes.append(box)
        crops_bgr = np.stack([crop.crop_256(frames_bgr[row], box) for row, box in zip(rows, boxes)]) if rows else \
            np.empty((0, crop.FACE_SIZE, crop.FACE_SIZE, 3), np.uint8)
        return rows, boxes, crops_bgr

    def prepare_latents(self, batches: Iterator[tuple[np.ndarray, list[Face | None]]]) -> int:
        """The crop latents of every face of ``batches`` ((frames BGR, their faces), a presenter's whole clip)
        found or encoded, in full model batches, and so kept in the avatar cache for the jobs to come (a
        presenter's preparation); how many crops the VAE encoded."""
        before = self.encoded
        waiting: list[np.ndarray] = []  # (256, 256, 3) crops not yet handed to the encoder
        for frames_bgr, faces in batches:
            waiting.extend(self.face_crops(frames_bgr, faces)[2])
            while len(waiting) >= self.batch_size:
                self.unet_input_latents(np.stack(waiting[:self.batch_size]))
                del waiting[:self.batch_size]
        if waiting:
            self.unet_input_latents(np.stack(waiting))
        return self.encoded - before

    def patches(self, frames_bgr, faces: list[Face | None], audio_windows: torch.Tensor
                ) -> list[FacePatch | None]:
        """One patch per frame of ``frames_bgr`` ((N, H, W, 3) uint8 BGR, or a list of N such frames),
        None where there is no face; ``audio_windows`` (N, 50, 384) are those frames' audio features."""
        frame_count = len(frames_bgr)
        if not len(faces) == len(audio_windows) == frame_count:
            raise ValueError(f"{frame_count} frames, {len(faces)} faces and {len(audio_windows)} audio windows")
        patches: list[FacePatch | None] = [None] * frame_count
        rows, boxes, crops_bgr = self.face_crops(frames_bgr, faces)
        if not rows:
            return patches
        faces_rgb = self.mouths(crops_bgr, audio_windows[rows])  # (F, 256, 256, 3) RGB
        for row, box, face_rgb in zip(rows, boxes, faces_rgb):
            patches[row] = self.face_patch(frames_bgr[row], faces[row], box, face_rgb)
        return patches

    def mouths(self, crops_bgr: np.ndarray, audio_windows: torch.Tensor) -> np.ndarray:
        """The generated faces of (F, 256, 256, 3) uint8 BGR crops (:meth:`face_crops`') and their (F, 50, 384)
        audio windows: (F, 256, 256, 3) uint8 RGB, rounded from the decoder's [0, 1], what :meth:`face_patch`
        scales to the box."""
        latents = self.unet_input_latents(crops_bgr)  # (F, 8, 32, 32)
        generated = self.generate_faces(latents, audio_windows)  # (F, 3, 256, 256) RGB in [0, 1]
        return (generated.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    def face_patch(self, frame_bgr: np.ndarray, face: Face, box: Box, face_rgb: np.ndarray) -> FacePatch:
        """The patch for one face: the generated face (``face_rgb``, (256, 256, 3) uint8 RGB) resized to its
        box, with heygem's landmark lower-face mask (heygem.render.blend) below the box's middle, or with face
        parsing MuseTalk's own mask over its widened box. Host work only (or the parser's own network): live
        sessions call it from their own threads."""
        face_bgr = crop.face_to_box(face_rgb, box)
        if self.parser is None:
            patch = FacePatch(box=box, image_bgr=face_bgr, mask=None, face=face)
            patch.mask = lower_half_only(lower_face_mask(patch, self.feather))
            return patch
        return self.parser.patch(frame_bgr, face_bgr, box, face)

    def generate(self, batch):
        """MuseTalk's mouths need its own audio features: its render path calls :meth:`patches`."""
        raise TypeError("the musetalk engine runs through its own render path (patches with audio features)")

    def close(self) -> None:
        """Nothing runs beside the networks: they stay loaded (kept for the thread's next job)."""


class EncoderStates(torch.nn.Module):
    """Whisper's encoder with every hidden state stacked: (B, 80, 3000) -> (B, 1500, L + 1, D)."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.encoder(mels, output_hidden_states=True).hidden_states, dim=2)


def lower_half_only(mask: np.ndarray) -> np.ndarray:
    """(h, w) mask kept below the box's middle row (the nose, point 29 of MuseTalk's box), faded in over
    a tenth of the box's height: MuseTalk pastes only the lower half of what it generates."""
    height = mask.shape[0]
    rows = np.arange(height, dtype=np.float32)
    ramp = np.clip((rows - height / 2) / max(1.0, 0.1 * height), 0.0, 1.0)  # (h,)
    return mask * ramp[:, None]


def resolve_parsing_mode(mode: str, files: MuseTalkFiles) -> str:
    """The paste mask to use: auto is MuseTalk 1.5's "jaw" face parsing when the BiSeNet files are
    there (v1.0's "raw" for the 1.0 UNet), else heygem's landmark lower-face mask; a parsing mode
    asked for without its files is a HeygemError."""
    from heygem.errors import HeygemError

    if mode not in PARSING_MODES:
        raise HeygemError(f"--musetalk-parsing must be one of {', '.join(PARSING_MODES)}, not {mode!r}")
    if mode == "auto":
        return ("jaw" if files.version == "v15" else "raw") if files.parsing is not None else "landmarks"
    if mode != "landmarks" and files.parsing is None:
        raise HeygemError(f"--musetalk-parsing {mode} needs face-parse-bisent/79999_iter.pth and "
                          f"resnet18-5c106cde.pth in {files.folder}; use --musetalk-parsing landmarks without them")
    return mode
