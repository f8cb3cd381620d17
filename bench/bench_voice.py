"""The cloned voice's speed (heygem.speech.clone, VibeVoice-1.5B through transformers 5): one stream,
through transformers' ``generate`` and through heygem's own frame loop (heygem.speech.clone_loop).

Random-init files of the full configuration (1204 tensors, bf16 on a GPU) are written in the published
layout, loaded as heygem loads them (strict check, then from_pretrained from the folder), and given
the bundled English sample as the voice to clone. A logits processor makes every sentence exactly
--frames audio frames long (a random model stops wherever it likes), so the runs compare.

For each loop (--loop generate, fast or both):

    prepare          the fast loop's cache and CUDA graphs, made once per voice before its first
                     sentence (a job does it while loading the voice); 0 for generate
    cold first       the first sentence (--first-frames frames) right after that: what the first job
                     after a start waits
    first sentence   the same sentence again, warm: what a request waits for its first sentence's audio
    one stream       a sentence of --frames frames, spoken --repeats times (the fastest kept): seconds
                     per audio frame and the real-time factor (seconds spent / seconds of speech)
    peak GiB         the GPU memory the loop reached (the model's weights included)

Then which parts of the fast loop replay as CUDA graphs (a part that could not be captured also logs
"runs ... without a CUDA graph" with the reason), and with both loops the largest difference between
their audio for the first sentence from the same seed (0 to 1e-6 in float32 on the CPU; bf16 rounds
batched and unbatched products apart, and the frames feed back, so expect more there).

    python bench/bench_voice.py                            # full size on the first GPU, bf16, both loops
    python bench/bench_voice.py --folder weights/vibevoice  # the real files instead of random ones
    python bench/bench_voice.py --tiny --device cpu --frames 6 --first-frames 3   # the reduced model, seconds
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FIRST_SENTENCE = "Hello, and welcome."
SENTENCE = ("This presenter was filmed once, and now it reads whatever is typed, in its own voice, "
            "one sentence after another.")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the reduced configuration (CPU tests) instead of full")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--folder", type=Path, default=None,
                        help="VibeVoice files to time (default: random-init files written to a temporary folder)")
    parser.add_argument("--loop", choices=("generate", "fast", "both"), default="both",
                        help="transformers' generate, heygem's frame loop, or both (one after the other)")
    parser.add_argument("--frames", type=int, default=150, help="audio frames per timed sentence (150 = 20 s)")
    parser.add_argument("--first-frames", type=int, default=12, help="audio frames of the first sentence")
    parser.add_argument("--repeats", type=int, default=2, help="timed sentences per loop")
    parser.add_argument("--diffusion-steps", type=int, default=None, help="diffusion steps (default: the model's 10)")
    parser.add_argument("--no-graphs", action="store_true",
                        help="the fast loop without CUDA graphs (run eagerly): to tell the graphs' part apart")
    parser.add_argument("--voice-sample", type=Path, default=REPO / "assets" / "speech_en.wav")
    return parser.parse_args(argv)


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_sentence(voice, sentence: str, frames: int, device) -> tuple[float, int]:
    """Seconds to speak ``sentence`` as exactly ``frames`` frames, and the samples made."""
    from heygem.speech.clone_files import forced_frames

    voice.logits_processors = [forced_frames(voice.model.model.config, frames)]
    synchronize(device)
    started = time.perf_counter()
    samples = voice.speak(sentence)  # returned on the CPU: the device has finished
    elapsed = time.perf_counter() - started
    expected = frames * voice.model.samples_per_frame
    if len(samples) != expected:
        raise SystemExit(f"spoke {len(samples)} samples instead of {expected}")
    return elapsed, len(samples)


def time_loop(voice, loop: str, args, device) -> dict:
    """One loop's row: prepare, cold and warm first sentence, the stream's best of --repeats, peak memory."""
    import torch

    voice.loop = loop
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    started = time.perf_counter()
    voice.prepare()
    synchronize(device)
    prepare = time.perf_counter() - started
    cold, _ = timed_sentence(voice, FIRST_SENTENCE, args.first_frames, device)
    first, _ = timed_sentence(voice, FIRST_SENTENCE, args.first_frames, device)
    stream = min(timed_sentence(voice, SENTENCE, args.frames, device)[0] for _ in range(args.repeats))
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else float("nan")
    return {"prepare": prepare, "cold": cold, "first": first, "stream": stream, "peak": peak}


def main(argv=None) -> int:
    import torch

    from heygem.runtime.device import pick_device
    from heygem.speech import clone
    from heygem.speech.clone_files import forced_frames, write_random_files
    from heygem.speech.reference import cleanest_speech

    args = parse_arguments(argv)
    device = pick_device(args.device)
    size = "reduced" if args.tiny else "full"
    loops = ("generate", "fast") if args.loop == "both" else (args.loop,)
    with tempfile.TemporaryDirectory(prefix="bench-voice-") as scratch:
        folder = args.folder
        if folder is None:
            started = time.perf_counter()
            dtype = torch.bfloat16 if device.type == "cuda" else None
            folder = write_random_files(Path(scratch) / "vibevoice", size=size, dtype=dtype)
            print(f"wrote random-init {size} files in {time.perf_counter() - started:.1f} s")
        started = time.perf_counter()
        model = clone.load_model(folder, str(device))
        synchronize(device)
        load_seconds = time.perf_counter() - started
        reference, rate = cleanest_speech(args.voice_sample, model.sample_rate)
        voice = clone.ClonedVoice(model, reference, rate, diffusion_steps=args.diffusion_steps)
        if args.no_graphs:
            from heygem.speech.clone_loop import FrameLoop

            model.frame_loop = FrameLoop(model, use_graphs=False)
        prompt_tokens = int(voice.inputs(SENTENCE)["input_ids"].shape[1])
        frame_seconds = model.samples_per_frame / model.sample_rate
        dtype = next(model.model.parameters()).dtype
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
        print(f"{clone.MODEL_NAME} ({size}, {sum(p.numel() for p in model.model.parameters()) / 1e9:.3f} B "
              f"parameters, {str(dtype).removeprefix('torch.')}) on {device} ({name}); torch {torch.__version__}; "
              f"voice sample {len(reference) / rate:.1f} s, prompt {prompt_tokens} tokens; load {load_seconds:.2f} s")
        print(f"first sentence: {args.first_frames} frames ({args.first_frames * frame_seconds:.2f} s of speech); "
              f"stream: {args.frames} frames ({args.frames * frame_seconds:.2f} s), best of {args.repeats}")
        print()
        print("| loop | prepare s | cold first s | first sentence s | stream s | ms per frame | RTF | peak GiB |")
        print("|---|---|---|---|---|---|---|---|")
        for loop in loops:
            row = time_loop(voice, loop, args, device)
            speech = args.frames * frame_seconds
            print(f"| {loop} | {row['prepare']:.2f} | {row['cold']:.2f} | {row['first']:.2f} | {row['stream']:.2f} | "
                  f"{1000 * row['stream'] / args.frames:.1f} | {row['stream'] / speech:.3f} | {row['peak']:.2f} |")
        if "fast" in loops:
            frame_loop = model.frame_loop
            parts = {"language-model step": frame_loop.language_step, "decoder and encoder": frame_loop.voice_frame,
                     **{f"{steps}-step denoising": run for steps, (_, _, run) in frame_loop.denoisers.items()}}
            print("\nCUDA graphs: " + ", ".join(f"{name} {'yes' if hasattr(run, 'graph') else 'no'}"
                                                for name, run in parts.items()))
        if len(loops) == 2:
            spoken = {}
            for loop in loops:
                voice.loop = loop
                voice.logits_processors = [forced_frames(model.model.config, args.first_frames)]
                torch.manual_seed(0)
                spoken[loop] = voice.speak(FIRST_SENTENCE)
            difference = float(abs(spoken["fast"] - spoken["generate"]).max())
            print(f"fast against generate, same seed, {args.first_frames} frames: max abs difference "
                  f"{difference:.2e} (audio peak {float(abs(spoken['generate']).max()):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
