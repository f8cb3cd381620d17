"""MuseTalk 1.5's model step (UNet at t = 0, then the VAE decoder to 256x256) on this machine, in faces per second.

Builds the full-size networks with random weights on the device (MuseTalk 1.5's musetalk.json UNet and
sd-vae-ft-mse's AutoencoderKL; nothing is loaded or copied over the bus), then times each form of the step in
turn: the plain diffusers calls (the straightforward form, as the public inference code makes them) and the
heygem.engines.musetalk.model_step.MouthModelStep forms, each technique alone and together. Inputs are already
on the device; times come from CUDA events (median ms per batch). Each form's output is compared with the
plain fp32 form's on the same inputs (max |difference| in [0, 1] pixel units; for the forms that decode only
the pasted rows, over the pasted rows). Prints a markdown table last; --json writes every number.

    python bench/bench_musetalk.py --device cuda --json $OUT/musetalk.json
    python bench/bench_musetalk.py --device cuda --forms plain-fp16 fast fast-eager --batch-sizes 32 64
    python bench/bench_musetalk.py --tiny --device cpu        # a smoke run of every code path on reduced configs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

# MuseTalk 1.5's musetalkV15/musetalk.json (public configuration values).
UNET_CONFIG = dict(
    act_fn="silu", attention_head_dim=8, block_out_channels=[320, 640, 1280, 1280], center_input_sample=False,
    cross_attention_dim=384, down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"], downsample_padding=1,
    flip_sin_to_cos=True, freq_shift=0, in_channels=8, layers_per_block=2, mid_block_scale_factor=1, norm_eps=1e-5,
    norm_num_groups=32, out_channels=4, sample_size=64, up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3)
# stabilityai/sd-vae-ft-mse's config.json (public configuration values).
VAE_CONFIG = dict(
    act_fn="silu", block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
    in_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32, out_channels=3, sample_size=256,
    up_block_types=["UpDecoderBlock2D"] * 4, scaling_factor=0.18215)
# Reduced configs of the same classes, for a CPU smoke run of every code path.
TINY_UNET_CONFIG = dict(UNET_CONFIG, block_out_channels=[32, 64], layers_per_block=1, norm_num_groups=8,
                        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"])
TINY_VAE_CONFIG = dict(VAE_CONFIG, block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4)

PASTE_TOP_ROW = 104  # the paste mask's first row in the 256x256 face: half the face box less the mask's blur
# fixed layouts of the step, to time one against the other
CL = {"unet_channels_last": True, "decoder_channels_last": True, "decode_chunk": 32, "transposed_upsampling": False}
NCHW = {"unet_channels_last": False, "decoder_channels_last": False, "decode_chunk": 32,
        "transposed_upsampling": False}
MIXED = {"unet_channels_last": True, "decoder_channels_last": False, "decode_chunk": None,
         "transposed_upsampling": True}


@dataclass(frozen=True)
class Form:
    key: str
    label: str
    kind: str = "step"  # "step": the whole model step; "unet", "decode", "encode": one network alone
    plain: bool = False  # the plain diffusers calls, not MouthModelStep
    dtype: str = "fp16"
    channels_last: bool = True
    cudnn: bool = True
    deterministic: bool = False
    classic_attention: bool = False  # diffusers' AttnProcessor (matmul + softmax) instead of SDPA
    options: dict = field(default_factory=dict)  # MouthModelStep keyword options
    max_calls: int = 0  # 0: as many as --seconds allow


FORMS = [
    Form("plain-fp32", "plain, fp32 (TF32)", plain=True, dtype="fp32", channels_last=False),
    Form("plain-fp16", "plain, fp16", plain=True, channels_last=False),
    Form("plain-fp16-cl", "plain, fp16 + channels_last", plain=True),
    Form("plain-fp16-cl-no-cudnn", "plain, fp16 + channels_last, cuDNN off", plain=True, cudnn=False, max_calls=3),
    Form("plain-fp16-cl-classic-attention", "plain, fp16 + channels_last, unfused attention", plain=True,
         classic_attention=True),
    Form("plain-bf16-cl", "plain, bf16 + channels_last", plain=True, dtype="bf16"),
    Form("unet-fp16-cl", "UNet alone, plain fp16 + channels_last", kind="unet", plain=True),
    Form("decode-fp16-cl", "VAE decode alone, plain fp16 + channels_last", kind="decode", plain=True),
    Form("decode-fp16-cl-chunk32", "VAE decode alone, fp16 + channels_last, chunks of 32", kind="decode",
         plain=True, options={"decode_chunk": 32}),
    Form("decode-fp16-cl-chunk32-transposed", "VAE decode alone, fp16 + channels_last, chunks of 32, "
         "transposed upsampling", kind="decode", plain=True,
         options={"decode_chunk": 32, "transposed_upsampling": True}),
    Form("encode-fp16-cl", "VAE encode alone, plain fp16 + channels_last", kind="encode", plain=True),
    # MouthModelStep: the default fast step, then single techniques on and off
    Form("fast", "step: fast default (channels first, chunks of 32, transposed upsampling, CUDA graph)"),
    Form("fast-eager", "step: fast default without the CUDA graph", options={"use_cuda_graph": False}),
    Form("fast-rows-halo4", f"step: fast default, decode rows from {PASTE_TOP_ROW}, halo 4",
         options={"paste_top_row": PASTE_TOP_ROW, "halo_latent_rows": 4}),
    # UNet channels-last, decoder channels-first and whole batches, transposed upsampling
    Form("fast-mixed", "step: UNet channels_last, decoder channels first, whole batch, transposed, graph",
         options=MIXED),
    Form("fast-mixed-eager", "step: the above without the CUDA graph", options={**MIXED, "use_cuda_graph": False}),
    Form("fast-mixed-deterministic", "step: the above with the graph, deterministic backends", deterministic=True,
         options=MIXED),
    Form("fast-mixed-rows-halo4", f"step: the above, decode rows from {PASTE_TOP_ROW}, halo 4",
         options={**MIXED, "paste_top_row": PASTE_TOP_ROW, "halo_latent_rows": 4}),
    Form("fast-compile", "step: fast default + torch.compile (all channels_last, decoder chunks of 32)",
         options={"compile_network": True}),
    Form("fast-compile-decoder", "step: fast default + compiled decoder", options={"compile_network": "decoder"}),
    # the layouts: everything channels-last (decoder in chunks of 32) or everything channels-first
    Form("fast-cl-eager", "step: all channels_last, decoder chunks of 32, no graph",
         options={**CL, "use_cuda_graph": False}),
    Form("fast-cl", "step: all channels_last, decoder chunks of 32, CUDA graph", options=CL),
    Form("fast-cl-bf16", "step: all channels_last, chunks of 32, graph, bf16", dtype="bf16", options=CL),
    Form("fast-cl-transposed", "step: all channels_last, chunks of 32, graph, transposed upsampling",
         options={**CL, "transposed_upsampling": True}),
    Form("fast-cl-fused-qkv", "step: all channels_last, chunks of 32, graph, fused QKV projections",
         options={**CL, "fuse_qkv": True}),
    Form("fast-cl-deterministic", "step: all channels_last, chunks of 32, graph, deterministic backends",
         deterministic=True, options=CL),
    Form("fast-cl-rows-halo2", f"step: all channels_last, chunks of 32, graph, decode rows from {PASTE_TOP_ROW}, "
         "halo 2", options={**CL, "paste_top_row": PASTE_TOP_ROW, "halo_latent_rows": 2}),
    Form("fast-cl-rows-halo4", f"step: all channels_last, chunks of 32, graph, decode rows from {PASTE_TOP_ROW}, "
         "halo 4", options={**CL, "paste_top_row": PASTE_TOP_ROW, "halo_latent_rows": 4}),
    Form("fast-cl-compile", "step: all channels_last, chunks of 32, graph, torch.compile",
         options={**CL, "compile_network": True}),
    Form("fast-cl-transposed-compile-decoder", "step: all channels_last, chunks of 32, graph, transposed "
         "upsampling, compiled decoder", options={**CL, "transposed_upsampling": True, "compile_network": "decoder"}),
    Form("fast-nchw", "step: all channels first, chunks of 32, graph", options=NCHW),
    Form("fast-nchw-transposed", "step: all channels first, chunks of 32, graph, transposed upsampling",
         options={**NCHW, "transposed_upsampling": True}),
    Form("fast-nchw-transposed-deterministic", "step: the above, deterministic backends", deterministic=True,
         options={**NCHW, "transposed_upsampling": True}),
    Form("fast-nchw-transposed-compile-decoder", "step: all channels first, chunks of 32, graph, transposed "
         "upsampling, compiled decoder", options={**NCHW, "transposed_upsampling": True, "compile_network": "decoder"}),
    Form("unet-fp16", "UNet alone, plain fp16", kind="unet", plain=True, channels_last=False),
    Form("decode-fp16-chunk32-transposed", "VAE decode alone, fp16, chunks of 32, transposed upsampling",
         kind="decode", plain=True, channels_last=False,
         options={"decode_chunk": 32, "transposed_upsampling": True}),
]
DEFAULT_FORMS = [form.key for form in FORMS if not form.options.get("compile_network")]


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--forms", nargs="+", choices=[form.key for form in FORMS], default=None,
                        help="forms to time (default: all but the compiled ones)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="faces per batch (default: 64 on CUDA, 2 on the CPU)")
    parser.add_argument("--sweep-form", default=None, choices=[form.key for form in FORMS],
                        help="also time this form at --sweep-batch-sizes")
    parser.add_argument("--sweep-batch-sizes", type=int, nargs="+", default=[16, 32, 48, 96, 128])
    parser.add_argument("--seconds", type=float, default=None, help="timed time per form (default: 2 on CUDA)")
    parser.add_argument("--halo-sweep", type=int, nargs="*", default=[0, 1, 2, 3, 4, 6, 8, 12],
                        help="halos (latent rows) for which the decoded-rows difference is measured in fp32")
    parser.add_argument("--profile", action="store_true", help="print the decoder's top CUDA ops (fast form)")
    parser.add_argument("--budget", type=float, default=0, help="skip what is left after this many seconds (0: none)")
    parser.add_argument("--tiny", action="store_true", help="reduced configs (a smoke run, not a measurement)")
    parser.add_argument("--json", type=Path, default=None, help="write every number here")
    return parser.parse_args()


def describe_machine(device) -> list[str]:
    import diffusers
    import torch

    lines = []
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        lines.append(f"GPU: {properties.name}, {properties.total_memory / 2**30:.0f} GiB, "
                     f"{properties.multi_processor_count} SMs, "
                     f"compute capability {properties.major}.{properties.minor}")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, cuDNN {cudnn or '-'}, "
                 f"diffusers {diffusers.__version__}, Python {platform.python_version()}, device {device}")
    return lines


def build_networks(device, tiny: bool, seed: int = 0):
    """The UNet and the VAE with the same random weights every time (seeded, made on the device), fp32."""
    import diffusers
    import torch

    diffusers.utils.logging.set_verbosity_error()  # not the advice on casting loaded models: these are made here
    torch.manual_seed(seed)
    with torch.device(device):
        unet = diffusers.UNet2DConditionModel(**(TINY_UNET_CONFIG if tiny else UNET_CONFIG))
        vae = diffusers.AutoencoderKL(**(TINY_VAE_CONFIG if tiny else VAE_CONFIG))
    return unet.eval(), vae.eval()


def make_inputs(count: int, device, seed: int):
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    latents = torch.randn(count, 8, 32, 32, device=device, generator=generator)  # (N, 8, 32, 32)
    audio = torch.randn(count, 50, 384, device=device, generator=generator)  # (N, 50, 384)
    faces = torch.rand(count, 3, 256, 256, device=device, generator=generator) * 2 - 1  # (N, 3, 256, 256)
    return latents, audio, faces


DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def plain_callable(form: Form, unet, vae, device):
    """The plain diffusers calls for ``form``: weights cast and laid out once, then one call per batch."""
    import torch
    from diffusers.models.attention_processor import AttnProcessor

    from heygem.engines.musetalk.model_step import use_transposed_upsampling

    dtype = getattr(torch, DTYPES[form.dtype])
    layout = torch.channels_last if form.channels_last else torch.contiguous_format
    if form.options.get("transposed_upsampling"):
        use_transposed_upsampling(vae)
    unet.to(dtype=dtype, memory_format=layout)
    vae.to(dtype=dtype, memory_format=layout)
    if form.classic_attention:
        unet.set_attn_processor(AttnProcessor())
        vae.set_attn_processor(AttnProcessor())
    timestep = torch.tensor([0], device=device)
    factor = vae.config.scaling_factor
    chunk = form.options.get("decode_chunk")

    def decode(latents):
        parts = [vae.decode(latents[start:start + (chunk or len(latents))]).sample
                 for start in range(0, len(latents), chunk or len(latents))]
        return (torch.cat(parts) / 2 + 0.5).clamp(0, 1)

    def run(latents, audio, faces):
        with torch.inference_mode():
            latents = latents.to(dtype=dtype).contiguous(memory_format=layout)
            if form.kind == "encode":
                return vae.encode(faces.to(dtype=dtype).contiguous(memory_format=layout)).latent_dist.mode()
            if form.kind == "decode":
                return decode(latents[:, :4] / factor)
            predicted = unet(latents, timestep, encoder_hidden_states=audio.to(dtype)).sample
            if form.kind == "unet":
                return predicted
            return decode(predicted / factor)

    return run


def step_callable(form: Form, unet, vae, device, batch_size: int):
    import torch

    from heygem.engines.musetalk.model_step import MouthModelStep

    step = MouthModelStep(unet, vae, device, getattr(torch, DTYPES[form.dtype]), batch_size, fast=True,
                          **form.options)
    return lambda latents, audio, faces: step(latents, audio)


def measure(form: Form, device, batch_size: int, seconds: float, tiny: bool, reference_inputs) -> dict:
    """Build, warm up and time one form at one batch size; returns its numbers and its output on
    ``reference_inputs`` (float32, on the device)."""
    import torch

    from heygem.runtime.device import configure_backends

    on_gpu = device.type == "cuda"
    configure_backends(deterministic=form.deterministic, cudnn=form.cudnn, device=device)
    try:
        unet, vae = build_networks(device, tiny)
        build_started = time.perf_counter()
        run = (plain_callable(form, unet, vae, device) if form.plain
               else step_callable(form, unet, vae, device, batch_size))
        inputs = [make_inputs(batch_size, device, seed) for seed in (11, 12)]  # two sets, alternated
        if on_gpu:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        first_started = time.perf_counter()
        run(*inputs[0])  # cuDNN's search, graph capture, compilation
        if on_gpu:
            torch.cuda.synchronize(device)
        first_call_seconds = time.perf_counter() - first_started
        run(*inputs[1])
        times_ms = []
        wall_started = time.perf_counter()
        while len(times_ms) < 3 or (time.perf_counter() - wall_started < seconds
                                    and not (form.max_calls and len(times_ms) >= form.max_calls)):
            if on_gpu:
                started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                started.record()
                run(*inputs[len(times_ms) % 2])
                ended.record()
                ended.synchronize()
                times_ms.append(started.elapsed_time(ended))
            else:
                started_seconds = time.perf_counter()
                run(*inputs[len(times_ms) % 2])
                times_ms.append((time.perf_counter() - started_seconds) * 1000)
        times_ms.sort()
        median_ms = times_ms[len(times_ms) // 2]
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None
        output = None
        if reference_inputs is not None:
            output = run(*reference_inputs)
            output = output.float().clone()
        return {"form": form.key, "label": form.label, "batch_size": batch_size, "median_ms": median_ms,
                "cudnn_enabled": torch.backends.cudnn.enabled, "cudnn_benchmark": torch.backends.cudnn.benchmark,
                "cudnn_deterministic": torch.backends.cudnn.deterministic,
                "faces_per_second": batch_size / (median_ms / 1000), "calls": len(times_ms),
                "first_call_seconds": first_call_seconds, "setup_seconds": first_started - build_started,
                "peak_gib": peak_gib, "output": output}
    finally:
        configure_backends(device=device)
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()


def difference(output, reference, rows: slice | None = None) -> dict:
    if output is None or reference is None or output.shape != reference.shape:
        return {}
    if rows is not None:
        output, reference = output[:, :, rows], reference[:, :, rows]
    delta = (output - reference).abs()
    return {"max_diff": delta.max().item(), "mean_diff": delta.mean().item(),
            "share_over_1_255": (delta > 1 / 255).float().mean().item()}


def halo_sweep(device, tiny: bool, halos: list[int], count: int = 16) -> list[dict]:
    """fp32 decode of the rows from PASTE_TOP_ROW less each halo against the full decode, over the pasted rows."""
    import torch

    from heygem.runtime.device import configure_backends

    configure_backends(device=device)
    unet, vae = build_networks(device, tiny)
    latents, audio, _ = make_inputs(count, device, seed=21)
    results = []
    with torch.inference_mode():
        predicted = unet(latents, torch.tensor([0], device=device), encoder_hidden_states=audio).sample
        predicted = predicted / vae.config.scaling_factor  # (N, 4, 32, 32)
        full = (vae.decode(predicted).sample / 2 + 0.5).clamp(0, 1)  # (N, 3, 256, 256)
        for halo in halos:
            first = max(0, PASTE_TOP_ROW // 8 - halo)
            part = (vae.decode(predicted[:, :, first:]).sample / 2 + 0.5).clamp(0, 1)  # (N, 3, 256 - 8 first, 256)
            pasted = part[:, :, PASTE_TOP_ROW - first * 8:]
            delta = (pasted - full[:, :, PASTE_TOP_ROW:]).abs()
            by_row = delta.amax(dim=(0, 1, 3))  # (256 - PASTE_TOP_ROW,)
            results.append({"halo": halo, "first_latent_row": first, "decoded_rows_share": (32 - first) / 32,
                            "max_diff": delta.max().item(), "mean_diff": delta.mean().item(),
                            "p99_diff": torch.quantile(delta.flatten()[::97], 0.99).item(),
                            "share_over_1_255": (delta > 1 / 255).float().mean().item(),
                            "max_diff_first_8_rows": by_row[:8].max().item(),
                            "max_diff_below_first_16_rows": by_row[16:].max().item()})
    del unet, vae
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def profile_decoder(device, tiny: bool, count: int = 32) -> str:
    """The fp16 channels-last decoder's top CUDA ops for one batch, by CUDA time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from heygem.runtime.device import configure_backends

    configure_backends(device=device)
    _, vae = build_networks(device, tiny)
    vae.to(dtype=torch.float16, memory_format=torch.channels_last)
    latents = make_inputs(count, device, seed=31)[0][:, :4].half().contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        for _ in range(2):
            vae.decode(latents)
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            vae.decode(latents)
            torch.cuda.synchronize(device)
    return profiler.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)


def main() -> None:
    arguments = parse_arguments()

    from heygem.runtime.device import pick_device

    device = pick_device(arguments.device)
    on_gpu = device.type == "cuda"
    batch_sizes = arguments.batch_sizes or ([64] if on_gpu else [2])
    seconds = arguments.seconds if arguments.seconds is not None else (2.0 if on_gpu else 0.0)
    chosen = [form for form in FORMS if form.key in (arguments.forms or DEFAULT_FORMS)]
    if not on_gpu:  # a smoke run: every path in fp32, without what only a GPU has
        chosen = [Form(**{**form.__dict__, "dtype": "fp32", "channels_last": False}) for form in chosen
                  if form.cudnn and not form.options.get("compile_network")]
    started = time.perf_counter()
    print(f"MuseTalk 1.5 model step, {'reduced' if arguments.tiny else 'full-size'} random-init networks, inputs "
          f"on the device, median of CUDA-event times per batch ({seconds:g} s per form)", flush=True)
    for line in describe_machine(device):
        print(line, flush=True)
    if not on_gpu:
        print("(on the CPU every form runs in fp32, channels first: the labels name the GPU forms)", flush=True)
    report: dict = {"machine": describe_machine(device), "paste_top_row": PASTE_TOP_ROW, "rows": []}

    def within_budget() -> bool:
        return not arguments.budget or time.perf_counter() - started < arguments.budget

    plan = [(form, size) for size in batch_sizes for form in chosen]
    if arguments.sweep_form:
        sweep = next(form for form in FORMS if form.key == arguments.sweep_form)
        plan += [(sweep, size) for size in arguments.sweep_batch_sizes if size not in batch_sizes]
    references: dict[int, object] = {}
    plain_fp16: dict[int, object] = {}
    for form, size in plan:
        if not within_budget():
            print(f"  skipped (budget): {form.key} at {size}", flush=True)
            continue
        reference_inputs = make_inputs(size, device, seed=41)
        try:
            result = measure(form, device, size, seconds, arguments.tiny, reference_inputs)
        except Exception as error:  # noqa: BLE001 - one form's failure is reported, the others still run
            print(f"  {form.key} at {size}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:300]}",
                  flush=True)
            report["rows"].append({"form": form.key, "batch_size": size, "error": f"{type(error).__name__}: {error}"})
            continue
        output = result.pop("output")
        if form.kind == "step" and form.key == "plain-fp32":
            references[size] = output
        elif form.kind == "step" and form.key == "plain-fp16":
            plain_fp16[size] = output
        rows = slice(PASTE_TOP_ROW, None) if form.options.get("paste_top_row") else None
        if form.kind == "step":
            result["vs_plain_fp32"] = difference(output, references.get(size), rows)
            result["vs_plain_fp16"] = difference(output, plain_fp16.get(size), rows)
            if output is not None:
                result["output_mean"], result["output_std"] = output.mean().item(), output.std().item()
        del output
        report["rows"].append(result)
        print(f"  {form.key} at {size}: {result['faces_per_second']:.0f} faces/s, {result['median_ms']:.1f} ms, "
              f"first call {result['first_call_seconds']:.1f} s, peak {result['peak_gib'] or 0:.1f} GiB, "
              f"cuDNN {'on' if result['cudnn_enabled'] else 'off'}, "
              f"vs fp32 {result.get('vs_plain_fp32', {}).get('max_diff', float('nan')):.4f}, "
              f"vs fp16 {result.get('vs_plain_fp16', {}).get('max_diff', float('nan')):.4f}", flush=True)
    if arguments.halo_sweep and within_budget():
        report["halo_sweep"] = halo_sweep(device, arguments.tiny, arguments.halo_sweep)
    if arguments.profile and on_gpu and within_budget():
        table = profile_decoder(device, arguments.tiny)
        report["decoder_profile"] = table
        print(table, flush=True)
    if arguments.json:
        arguments.json.parent.mkdir(parents=True, exist_ok=True)
        arguments.json.write_text(json.dumps(report, indent=1))

    print()
    print("| form | batch | faces/s | ms/batch | first call s | peak GiB | max diff vs plain fp32 | vs plain fp16 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in report["rows"]:
        if "error" in row:
            print(f"| {row['form']} | {row['batch_size']} | failed | | | | | |")
            continue
        fp32 = row.get("vs_plain_fp32", {}).get("max_diff")
        fp16 = row.get("vs_plain_fp16", {}).get("max_diff")
        print(f"| {row['label']} | {row['batch_size']} | {row['faces_per_second']:.0f} | {row['median_ms']:.1f} | "
              f"{row['first_call_seconds']:.1f} | {row['peak_gib'] or 0:.1f} | "
              f"{'' if fp32 is None else f'{fp32:.4f}'} | {'' if fp16 is None else f'{fp16:.4f}'} |")
    if report.get("halo_sweep"):
        print()
        print(f"Decoding only latent rows from {PASTE_TOP_ROW}//8 - halo, fp32, against the full decode, "
              f"over pixel rows {PASTE_TOP_ROW}..255:")
        print("| halo (latent rows) | decoded share | max diff | mean diff | p99 | share > 1/255 | "
              "max, first 8 rows | max, below 16 rows |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for row in report["halo_sweep"]:
            print(f"| {row['halo']} | {row['decoded_rows_share']:.2f} | {row['max_diff']:.4f} | "
                  f"{row['mean_diff']:.5f} | "
                  f"{row['p99_diff']:.4f} | {row['share_over_1_255']:.3f} | {row['max_diff_first_8_rows']:.4f} | "
                  f"{row['max_diff_below_first_16_rows']:.4f} |")
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
