"""How soon a job can be watched: from the HTTP submission to the first streamed segment, on a warm server.

    python bench/bench_latency.py [--heights 360 720] [--runs 3] [--speech assets/speech_en.wav]
                                  [--engine landmark] [--markdown OUT.md]

Starts ``python app.py`` on a free port with a fresh outputs folder, runs one job to warm it up
(imports, mediapipe's graphs, the engine), then for each output height submits ``--runs`` jobs of
the bundled portrait speaking ``--speech`` and measures, from just before the POST:

- accepted:  the POST's answer (the upload stored, the job queued);
- first segment: the first time GET /api/jobs/{id}/stream.m3u8 answers 200 (polled every 10 ms),
  i.e. the first segment is listed and can be fetched;
- done: the job's status is done.

Then the cost of streaming: the same job with ``media.stream`` false and true, alternated
``--runs`` times each, compared on the job's own seconds (started -> finished, from the API).
Prints a Markdown table (the median of the runs) and writes it to ``--markdown`` when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

FACE = REPO / "assets" / "astronaut.jpg"


def submit(server, speech: Path, options: dict) -> tuple[str, float]:
    files = {"face": (FACE.name, FACE.read_bytes()), "audio": (speech.name, speech.read_bytes())}
    started = time.perf_counter()
    response = server.client.post("/api/jobs", files=files, data={"options": json.dumps(options)})
    response.raise_for_status()
    return response.json()["id"], started


def follow(server, job_id: str, started: float, accepted: float) -> dict:
    first = None
    while True:
        if first is None and server.client.get(f"/api/jobs/{job_id}/stream.m3u8").status_code == 200:
            first = time.perf_counter() - started
        job = server.client.get(f"/api/jobs/{job_id}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            if job["status"] != "done":
                raise RuntimeError(f"job {job_id} {job['status']}: {job['error']}")
            return {"accepted": accepted, "first": first, "done": time.perf_counter() - started,
                    "job_seconds": job["seconds"]}
        time.sleep(0.01)


def run_job(server, speech: Path, options: dict) -> dict:
    job_id, started = submit(server, speech, options)
    return follow(server, job_id, started, time.perf_counter() - started)


def encoder_cost(height: int, seconds: float, runs: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """x264 alone, with and without the stream (alternated): wall seconds and the ffmpeg processes' CPU seconds."""
    import resource

    import cv2
    import numpy as np

    from heygem.media import encode
    from heygem.media.frames import bgr_to_yuv420
    from heygem.media.probing import probe
    from heygem.media.stream import stream_folder
    from heygem.types import FrameGeometry

    fps, count = 25, round(25 * seconds)
    width = (height * 16 // 9) // 2 * 2
    photo = cv2.resize(cv2.imread(str(FACE)), (width + 64, height + 16))
    frames = np.stack([bgr_to_yuv420(np.ascontiguousarray(photo[8:8 + height, index % 64: index % 64 + width]))
                       for index in range(64)])  # (64, H * 3/2, W): the portrait drifting, shown in turn
    folder = tempfile.TemporaryDirectory(prefix="heygem-cost-")
    speech = Path(folder.name) / "speech.wav"
    import subprocess

    from heygem.media.ffmpeg import ffmpeg_binary

    subprocess.run([ffmpeg_binary(), "-v", "error", "-y", "-stream_loop", "-1", "-i",
                    str(REPO / "assets" / "speech_en.wav"), "-t", str(count / fps), str(speech)], check=True)
    walls = {False: [], True: []}
    cpus = {False: [], True: []}
    for _ in range(runs):
        for streamed in (False, True):
            output = speech.parent / f"out-{streamed}.mp4"
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            encoder = encode.open_encoder(FrameGeometry(width, height), f"{fps}/1", speech, probe(speech), output,
                                          crf=18, preset="veryfast", audio_bitrate="192k", frame_count=count,
                                          encoders=1, stream_dir=stream_folder(output) if streamed else None)
            for start in range(0, count, 16):
                encoder.write_i420(frames[[(start + index) % 64 for index in range(min(16, count - start))]])
            encoder.close()
            walls[streamed].append(time.perf_counter() - started)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus[streamed].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    muxing = {False: [], True: []}  # the same packets muxed again, to the MP4 alone or through the tee
    from heygem.media.stream import StreamPart, start_stream, tee_outputs

    for _ in range(runs):
        for streamed in (False, True):
            stream = StreamPart(start_stream(speech.parent / "remux.hls"), 0, 0, count, fps) if streamed else None
            target = tee_outputs(speech.parent / "remux.mp4", {"f": "mp4", "movflags": "+faststart"}, stream)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([ffmpeg_binary(), "-v", "error", "-y", "-i", str(output), "-map", "0", "-c", "copy",
                            "-f", "tee", target], check=True, cwd=stream.folder if stream else None)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            muxing[streamed].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    folder.cleanup()
    return walls[False], walls[True], cpus[False], cpus[True], min(muxing[True]) - min(muxing[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heights", type=int, nargs="+", default=[360, 720])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--speech", type=Path, default=REPO / "assets" / "speech_en.wav")
    parser.add_argument("--engine", default="landmark", choices=["landmark", "wav2lip"])
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--encoder-seconds", type=float, default=30.0,
                        help="length of the video x264 encodes alone, with and without the stream")
    args = parser.parse_args()

    from faults import Server

    from heygem.media.probing import probe

    speech_seconds = probe(args.speech).duration
    rows = []
    with tempfile.TemporaryDirectory(prefix="heygem-latency-") as folder_name:
        folder = Path(folder_name)
        server = Server(folder / "outputs", folder / "app.log").wait_ready()
        try:
            base = {"engine.name": args.engine}
            run_job(server, args.speech, {**base, "media.output_height": args.heights[0]})  # warm-up
            for height in args.heights:
                options = {**base, "media.output_height": height}
                runs = [run_job(server, args.speech, options) for _ in range(args.runs)]
                rows.append((f"{height}p, first segment listed", runs, "first"))
            height = args.heights[0]
            timed = {False: [], True: []}
            for _ in range(args.runs):
                for streamed in (False, True):
                    options = {**base, "media.output_height": height, "media.stream": streamed}
                    timed[streamed].append(run_job(server, args.speech, options)["job_seconds"])
        finally:
            server.stop()

    lines = [f"Speech {speech_seconds:.1f} s ({args.speech.name}), face {FACE.name}, engine {args.engine}, "
             f"median of {args.runs} runs on a warm server (its second job and later).", "",
             "| what | accepted (s) | first segment listed (s) | job done (s) |", "|---|---|---|---|"]
    for label, runs, _ in rows:
        accepted = statistics.median(run["accepted"] for run in runs)
        first = statistics.median(run["first"] for run in runs)
        done = statistics.median(run["done"] for run in runs)
        lines.append(f"| {label} | {accepted:.2f} | **{first:.2f}** | {done:.2f} |")
    without, with_stream = statistics.median(timed[False]), statistics.median(timed[True])
    lines += ["", f"Streaming's cost at {height}p (the job's own seconds, runs alternated): without "
              f"{without:.2f} s ({', '.join(f'{value:.2f}' for value in timed[False])}), with "
              f"{with_stream:.2f} s ({', '.join(f'{value:.2f}' for value in timed[True])}): "
              f"**{100 * (with_stream - without) / without:+.1f} %**."]
    lines += ["", f"x264 alone, {args.encoder_seconds:g} s of video, with and without the stream (alternated, "
              f"median of {args.runs}):", "",
              "| height | wall s without | wall s with | x264's CPU s without | with | the stream's muxing, CPU s "
              "| its share of x264's CPU |", "|---|---|---|---|---|---|---|"]
    for height in args.heights:
        wall_off, wall_on, cpu_off, cpu_on, muxing = encoder_cost(height, args.encoder_seconds, args.runs)
        median = statistics.median
        lines.append(f"| {height}p | {median(wall_off):.2f} | {median(wall_on):.2f} | {median(cpu_off):.2f} | "
                     f"{median(cpu_on):.2f} | {muxing:.3f} | **{100 * muxing / median(cpu_off):.1f} %** |")
    lines += ["", "The stream's own work is muxing the packets x264 makes anyway a second time, into MPEG-TS "
              "segments: measured alone (the encoded file muxed again with -c copy, to the MP4 alone and through "
              "the tee, fastest of the runs), it is the last column."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
