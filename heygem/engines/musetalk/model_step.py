"""MuseTalk 1.5's model step: UNet (one step, t = 0) then the VAE decoder, from UNet input latents to 256x256 faces.

The step is diffusers' own ``UNet2DConditionModel`` and ``AutoencoderKL``; what this module adds is how they run:

- ``fast=False``: the plain diffusers calls, batch by batch, as the public inference code makes them.
- ``fast=True``: the same function through heygem.runtime.device.FixedBatchRunner: weights in the compute dtype,
  fused attention (PyTorch's scaled_dot_product_attention through diffusers' AttnProcessor2_0), every batch
  padded to one fixed size (cuDNN's autotuner searches once) and, on CUDA, the whole step captured as one CUDA
  graph and replayed; each nearest-upsample-then-convolution layer runs as the equal transposed convolution
  (NearestUpsampleConv); the decoder runs 32 faces at a time (the peak memory of a batch of 64 drops from
  11.5 to 8 GiB). Op by op the step runs channels-first: PyTorch's group norm runs channels-first, so a
  channels-last decoder converts its activations at each of its 30 group norms (measured on an H200: the
  decoder alone 277 faces/s channels-last, about 480 channels-first, derived from the whole step).
  Compiled whole (``compile_network``), it runs channels-last, as measured fastest. Out of memory halves
  the batch, as the runner does.
- ``paste_top_row``: decode only the latent rows the paste needs (the paste mask covers the lower part of the
  face), plus ``halo_latent_rows`` above them; rows above the decoded part come back as 0. No halo makes
  this exact: the decoder's group norms take their statistics over the decoded rows only and its mid-block
  attention sees only them, so the pasted pixels change (on random weights far beyond 1/255 at every halo
  that saves work: docs/benchmarks.md). It is an option, off by default.

The process-wide cuDNN and determinism flags are heygem.runtime.device.configure_backends's: nothing here
changes them. torch and diffusers are imported inside the functions.
"""

from __future__ import annotations

import logging

from heygem.errors import HeygemError
from heygem.runtime.device import FixedBatchRunner, run_in_batches

logger = logging.getLogger("heygem")

LATENT_SCALING_FACTOR = 0.18215  # sd-vae-ft-mse's; a VAE's own config value is used when it has one
LATENT_SIZE = 32  # the UNet's latents are 32x32 for 256x256 faces
PIXELS_PER_LATENT = 8  # the decoder upsamples three times
# faces per decoder call in the fast step: less activation memory, and, channels-last, diffusers' upsampler
# turns a batch of 64 or more back to channels-first, slower for every convolution after it. Measured on one
# H100 (bench_pipeline, 1080p 60 s, a worker's second job, one start): 16 at 183.1 frames/s and 9,060 MiB peak,
# 32 at 183.6 and 13,014 MiB
DECODE_CHUNK = 16
ENCODE_CHUNK = 16  # faces per VAE encoder pass (its activations at 256x256 are what fills the GPU)


def scaling_factor(vae) -> float:
    """The VAE's latent scaling factor (0.18215 for sd-vae-ft-mse)."""
    value = getattr(getattr(vae, "config", None), "scaling_factor", None)
    return float(value) if value is not None else LATENT_SCALING_FACTOR


def first_decoded_latent_row(paste_top_row: int | None, halo_latent_rows: int) -> int:
    """The first latent row to decode when only pixel rows ``paste_top_row``.. are pasted (0: all of them)."""
    if not paste_top_row:
        return 0
    if not 0 <= paste_top_row < LATENT_SIZE * PIXELS_PER_LATENT:
        raise ValueError(f"paste_top_row must be in 0..{LATENT_SIZE * PIXELS_PER_LATENT - 1}, got {paste_top_row}")
    return max(0, paste_top_row // PIXELS_PER_LATENT - halo_latent_rows)


def use_fused_attention(module) -> None:
    """Every diffusers Attention in ``module`` through torch's scaled_dot_product_attention (AttnProcessor2_0)."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    if hasattr(module, "set_attn_processor"):
        module.set_attn_processor(AttnProcessor2_0())


def _nearest_upsample_conv_class():
    import torch

    class NearestUpsampleConv(torch.nn.Module):
        """diffusers' Upsample2D (nearest 2x upsampling, then a 3x3 convolution with padding 1) as one stride-2
        4x4 transposed convolution on the small input: the same function, since each output pixel of the pair
        sees only 2x2 input pixels, with 16 instead of 36 multiply-adds per input pixel and per channel pair
        and no upsampled tensor in memory. Along each axis the 4 transposed taps are sums of the 3 taps
        (w2, w1 + w2, w0 + w1, w0); the sums are taken in float64 and rounded once."""

        TAP_SUMS = ((0, 0, 1), (0, 1, 1), (1, 1, 0), (1, 0, 0))  # (4, 3): which 3x3 taps add into each 4x4 tap

        def __init__(self, conv):
            super().__init__()
            sums = torch.tensor(self.TAP_SUMS, dtype=torch.float64, device=conv.weight.device)
            weight = conv.weight.detach().double()  # (out, in, 3, 3)
            transposed_weight = torch.einsum("kr,ls,oirs->iokl", sums, sums, weight)  # (in, out, 4, 4)
            self.transposed = torch.nn.ConvTranspose2d(conv.in_channels, conv.out_channels, 4, stride=2, padding=1,
                                                       bias=conv.bias is not None, device=conv.weight.device,
                                                       dtype=conv.weight.dtype)
            with torch.no_grad():
                self.transposed.weight.copy_(transposed_weight)
                if conv.bias is not None:
                    self.transposed.bias.copy_(conv.bias)

        def forward(self, hidden_states, output_size=None, *args, **kwargs):
            # (B, C, H, W) -> (B, C', 2H, 2W); an explicit output size must be the doubled one
            if output_size is not None and tuple(output_size) != (2 * hidden_states.shape[-2],
                                                                  2 * hidden_states.shape[-1]):
                raise ValueError(f"NearestUpsampleConv only doubles the size, not to {tuple(output_size)}")
            return self.transposed(hidden_states)

    return NearestUpsampleConv


def use_transposed_upsampling(module) -> int:
    """Replace each plain nearest-upsample-then-3x3-convolution Upsample2D in ``module`` by the equal transposed
    convolution (see NearestUpsampleConv); returns how many were replaced."""
    from diffusers.models.upsampling import Upsample2D

    replacement = _nearest_upsample_conv_class()
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            conv = getattr(child, "conv", None)
            if (isinstance(child, Upsample2D) and child.use_conv and not child.use_conv_transpose
                    and child.interpolate and child.norm is None and child.name == "conv" and conv is not None
                    and conv.kernel_size == (3, 3) and conv.padding == (1, 1) and conv.stride == (1, 1)):
                setattr(parent, name, replacement(conv))
                replaced += 1
    return replaced


def _network_class():
    import torch

    class _MouthNetwork(torch.nn.Module):
        """UNet (t = 0, audio features as the cross-attention states) -> / scaling factor -> VAE decode -> [0, 1]."""

        def __init__(self, unet, vae, first_latent_row: int = 0, decode_chunk: int | None = None,
                     compile_decoder: bool = False, decoder_channels_last: bool = False):
            super().__init__()
            self.unet = unet
            self.vae = vae
            self.scaling_factor = scaling_factor(vae)
            self.first_latent_row = first_latent_row
            self.decode_chunk = decode_chunk
            # the UNet's output comes in the UNet's layout; the decoder's first convolution would follow it
            self.decoder_layout = torch.channels_last if decoder_channels_last else torch.contiguous_format
            decode = self.decode_to_unit_range
            self.decode_faces = torch.compile(decode) if compile_decoder else decode
            # a device tensor, so a CUDA graph capture copies nothing from the host; long, like the public code's
            self.register_buffer("timestep", torch.zeros(1, dtype=torch.long), persistent=False)

        def forward(self, unet_input_latents, audio_features):
            # unet_input_latents (B, 8, 32, 32); audio_features (B, 50, 384)
            predicted = self.unet(unet_input_latents, self.timestep, encoder_hidden_states=audio_features,
                                  return_dict=False)[0]  # (B, 4, 32, 32)
            latents = (predicted / self.scaling_factor).contiguous(memory_format=self.decoder_layout)
            if self.first_latent_row:
                latents = latents[:, :, self.first_latent_row:]  # (B, 4, 32 - first, 32)
            chunk = self.decode_chunk or len(latents)
            faces = torch.cat([self.decode_faces(latents[start:start + chunk])
                               for start in range(0, len(latents), chunk)])  # (B, 3, H, 256) in [0, 1]
            if self.first_latent_row:  # rows above the decoded part: 0
                faces = torch.nn.functional.pad(faces, (0, 0, self.first_latent_row * PIXELS_PER_LATENT, 0))
            return faces  # (B, 3, 256, 256) RGB in [0, 1]

        def decode_to_unit_range(self, latents):
            # (b, 4, h, 32) unscaled latents -> (b, 3, 8h, 256) RGB in [0, 1]
            faces = self.vae.decode(latents, return_dict=False)[0]  # in about [-1, 1]
            return (faces / 2 + 0.5).clamp(0, 1)

    return _MouthNetwork


def _precision_name(dtype) -> str:
    import torch

    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    if dtype not in names:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    return names[dtype]


def _to_channels_last(module) -> None:
    """The 4-D weights of ``module`` channels-last (a later ``.to(dtype)`` keeps the layout)."""
    import torch

    for parameter in module.parameters():
        if parameter.dim() == 4:
            parameter.data = parameter.data.contiguous(memory_format=torch.channels_last)


class MouthModelStep:
    """UNet input latents and audio features in, 256x256 RGB faces in [0, 1] out, on ``device``.

    ``unet`` (diffusers UNet2DConditionModel, in 8 / out 4 channels, cross-attention dim 384) and ``vae``
    (diffusers AutoencoderKL) are taken over: moved to ``device``, put in eval mode and, on CUDA, cast to
    ``dtype`` (on the CPU the fast step keeps their weights and runs under autocast when ``dtype`` is not
    float32). ``batch_size`` is the fixed batch of the fast step; a call may bring any number of items.
    ``use_cuda_graph`` (fast step on CUDA only) captures the step once per batch size. The other keyword
    options are the fast step's techniques, each measured in bench/bench_musetalk.py: the two networks'
    layouts (None: channels-last when compiled whole, else channels-first), the decoder's chunk size (None:
    the whole batch at once), ``transposed_upsampling`` (the same function, 7-10% faster where measured),
    ``fuse_qkv`` (one projection for query, key and value: no gain measured) and ``compile_network``:
    torch.compile in its default mode, of the whole step (True or "all") or of the decoder alone
    ("decoder"). Compiled whole the step is about 2x faster per batch (557 against 282 faces/s on an H200)
    but the first batch of a process takes about a minute (15 s with torch's on-disk cache warm), more than
    a 60 s video takes to run op by op: it pays for a kept engine serving many jobs, so the step leaves it off and
    the engine asks for it where it is kept (``--musetalk-compile``).

    ``network_state`` (what :meth:`network_state` of a step of the same options returned) gives the step its
    tensors instead of ``unet``'s and ``vae``'s: they may then be built on the meta device. It is assigned after
    the layers are replaced, so it holds the replaced layers' tensors as computed then (no second rounding).
    """

    def __init__(self, unet, vae, device, dtype, batch_size: int, fast: bool = True, *,
                 paste_top_row: int | None = None, halo_latent_rows: int = 4, use_cuda_graph: bool = True,
                 unet_channels_last: bool | None = None, decoder_channels_last: bool | None = None,
                 decode_chunk: int | None = DECODE_CHUNK, transposed_upsampling: bool = True, fuse_qkv: bool = False,
                 compile_network: bool | str = False, pad_last_batch: bool | None = None,
                 network_state: dict | None = None):
        import torch

        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_size = batch_size
        self.fast = fast
        self.first_latent_row = first_decoded_latent_row(paste_top_row, halo_latent_rows)
        on_gpu = self.device.type == "cuda"
        unet.eval()
        vae.eval()
        if fast:
            use_fused_attention(unet)
            use_fused_attention(vae)
            if transposed_upsampling:
                use_transposed_upsampling(vae)
                use_transposed_upsampling(unet)
            if fuse_qkv:  # one projection matrix for query, key and value of each self-attention
                unet.fuse_qkv_projections()
                vae.fuse_qkv_projections()
        if compile_network not in (False, True, "decoder", "all"):
            raise ValueError(f"compile_network must be False, True (or 'all') or 'decoder', not {compile_network!r}")
        compile_all = fast and compile_network in (True, "all")
        # layouts as measured: compiled whole, the step is fastest channels-last (the compiler fuses the group
        # norms in that layout); run op by op, channels-first
        unet_channels_last = compile_all and on_gpu if unet_channels_last is None else unet_channels_last
        decoder_channels_last = compile_all and on_gpu if decoder_channels_last is None else decoder_channels_last
        network = _network_class()(unet, vae, self.first_latent_row, decode_chunk if fast else None,
                                   compile_decoder=fast and compile_network == "decoder",
                                   decoder_channels_last=fast and decoder_channels_last)
        if network_state is not None:  # every tensor, as network_state() kept it: strict, nothing left on meta
            network.load_state_dict(network_state, strict=True, assign=True)
            leftover = [name for name, tensor in [*network.named_parameters(), *network.named_buffers()]
                        if tensor.is_meta]
            if leftover:
                raise ValueError(f"the network state leaves {leftover[0]} unset")
            network.requires_grad_(False)
        self.network = network.to(self.device)
        if fast:
            if unet_channels_last:
                _to_channels_last(unet)
            if decoder_channels_last:
                _to_channels_last(vae)
            # torch.compile traces at the first call (inside the runner's warm-up), after the runner has cast
            # the weights; its kernels are then captured in the runner's CUDA graph like any others
            self.compiled = compile_all
            self._runner_options = dict(precision=_precision_name(dtype),
                                        channels_last=False,  # the layouts are set above, network by network
                                        use_cuda_graph=use_cuda_graph and on_gpu, name="MuseTalk model step",
                                        pad_last_batch=pad_last_batch)
            module = torch.compile(self.network) if compile_all else self.network
            self.runner = FixedBatchRunner(module, self.device, batch_size, **self._runner_options)
        else:
            self.compiled = False
            self.runner = None
            self.network.to(dtype=dtype)

    def network_state(self) -> dict:
        """The network's tensors as the step runs them (after its layer replacements and casts): what
        ``network_state=`` of a later step with the same options takes."""
        return self.network.state_dict()

    def warm_up(self) -> None:
        """Ready the fixed batch's buffers, cuDNN's kernels and the CUDA graph for inputs as the engine brings
        them ((8, 32, 32) latents and (50, 384) audio features, float32) before the first batch; nothing on
        the CPU or for the plain step."""
        import torch

        if self.runner is not None:
            layouts = ((8, LATENT_SIZE, LATENT_SIZE), torch.float32), ((50, 384), torch.float32)
            self._compiled_or_eager(lambda: self.runner.warm_up(*layouts))

    def _compiled_or_eager(self, run):
        """``run()``; if the compiled step fails in it (torch.compile needs a C compiler and triton, which a
        machine may lack), one warning, the step op by op from then on, and ``run()`` again."""
        if not self.compiled:
            return run()
        try:
            return run()
        except HeygemError:  # out of memory even with a batch of 1: the eager step would fail as well
            raise
        except Exception as error:  # noqa: BLE001 - the compiler's failures come in many types
            logger.warning("musetalk: the compiled step failed (%s: %s); running op by op", type(error).__name__,
                           str(error).splitlines()[0] if str(error) else "no details")
        self.compiled = False
        self.runner = FixedBatchRunner(self.network, self.device, self.runner.batch_size, **self._runner_options)
        return run()

    def __call__(self, unet_input_latents, audio_features):
        """unet_input_latents (B, 8, 32, 32): masked-face then reference latents, both times the scaling factor;
        audio_features (B, 50, 384), positional encoding added. Returns (B, 3, 256, 256) float32 RGB in [0, 1]."""
        import torch

        if len(unet_input_latents) != len(audio_features):
            raise ValueError(f"{len(unet_input_latents)} latents but {len(audio_features)} audio windows")
        if self.runner is not None:
            latents, audio = unet_input_latents.to(self.device), audio_features.to(self.device)
            faces = self._compiled_or_eager(lambda: self.runner(latents, audio))
            self.batch_size = self.runner.batch_size
            return faces

        def plain_batch(indices):
            with torch.inference_mode():
                latents = unet_input_latents[indices].to(self.device, self.dtype)
                audio = audio_features[indices].to(self.device, self.dtype)
                return self.network(latents, audio).float()

        indices = torch.arange(len(unet_input_latents))
        outputs, self.batch_size = run_in_batches(plain_batch, indices, self.batch_size)
        return torch.cat(outputs)


def encode_faces(vae, faces_rgb, sample: bool = False, generator=None):
    """VAE latents of 256x256 faces, times the scaling factor, as the UNet takes them.

    faces_rgb (B, 3, 256, 256) RGB in [-1, 1] -> (B, 4, 32, 32) float32. The public MuseTalk code takes
    ``latent_dist.sample()`` (a random draw around the mean); heygem takes the mean (``mode()``), so the
    same face always gives the same latents; ``sample=True`` draws as the public code does.
    """
    import torch

    parameter = next(vae.parameters())
    channels_last = parameter.dim() == 4 and parameter.is_contiguous(memory_format=torch.channels_last)
    chunks = []
    with torch.inference_mode():
        for start in range(0, len(faces_rgb), ENCODE_CHUNK):  # bounded: 64 faces at once peaked at 25 GiB
            faces = faces_rgb[start:start + ENCODE_CHUNK].to(parameter.device, parameter.dtype)
            if channels_last:
                faces = faces.contiguous(memory_format=torch.channels_last)
            distribution = vae.encode(faces).latent_dist
            latents = distribution.sample(generator) if sample else distribution.mode()
            chunks.append((latents * scaling_factor(vae)).float())  # (b, 4, 32, 32)
        return torch.cat(chunks) if chunks else torch.zeros((0, 4, 32, 32))
