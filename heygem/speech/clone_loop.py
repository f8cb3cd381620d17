"""The cloned voice's own frame loop: the arithmetic of transformers' VibeVoice ``generate``, arranged so
that one frame costs one language-model forward and, on a GPU, two CUDA graph replays.

    loop = FrameLoop(clone_model)                 # once per loaded model
    loop.prepare(capacity)                        # caches (and CUDA graphs) sized for the longest prompt
    waveform = loop.speak(inputs, max_new_tokens) # (1, frames * 3200), as generate's audio[0]

Per frame, ``generate`` runs the language model twice with batch 1 (the prompt's branch, then the
classifier-free guidance's negative branch, which starts from the audio start token alone), the
diffusion head ten times (both branches batched), the DPM-Solver steps, the streaming acoustic decoder
and the semantic encoder, with a host sync for every ``.any()`` and ``.item()`` between them. Here:

- Both branches share one static KV cache of batch 2 (row 0 the prompt's branch, row 1 the negative
  one) and step together in one forward: both take the same input embedding at every step, so only
  their positions (row 1 counts its own tokens) and their masks differ. Row 1's slot of a step counts
  only when the prompt's branch chose an audio frame there, exactly when generate steps its negative
  branch; a new audio start empties row 1's context, as generate's reset does.
- The streaming acoustic decoder and semantic encoder keep one pair of padding caches for good (the
  library updates them in place), zeroed at each sentence's start as a new pair would be.
- On a GPU the language-model step, the whole denoising loop (head, guidance, scheduler) and the
  decoder with the encoder and the connectors are each captured once in a CUDA graph (fixed shapes:
  the KV cache is allocated for ``capacity`` tokens), so a frame is three replays, a few small copies
  and one host sync for the chosen token. Anything that stops a capture falls back to the same code
  run eagerly, with a log line.

The prompt's prefill and the negative branch's first token run exactly as ``generate`` runs them (batch
1, dynamic cache) and are copied into the static cache. The random draws (the voice sample's sigma-VAE
noise in the prefill, one (2, 64) noise per frame from the CPU generator) are made in the same order,
so with a fixed seed the audio equals generate's up to the rounding of batched against unbatched
matrix products (tests/test_clone.py bounds the difference). ``HEYGEM_VOICE_LOOP=generate`` speaks
through the library's ``generate`` instead, for comparisons.
"""

from __future__ import annotations

import logging
import os

from heygem.errors import HeygemError

logger = logging.getLogger("heygem")

LOOP_VARIABLE = "HEYGEM_VOICE_LOOP"
LOOPS = ("fast", "generate")  # fast: this module; generate: transformers' VibeVoice generate
DEFAULT_DIFFUSION_STEPS = 10  # what generate uses when neither the call nor generation_config.json names one
CAPACITY_STEP = 256  # cache lengths are rounded up to this, so a slightly longer prompt reuses the graphs


def chosen_loop() -> str:
    """``$HEYGEM_VOICE_LOOP`` ("fast", the default, or "generate"); HeygemError for anything else."""
    loop = os.environ.get(LOOP_VARIABLE, "").strip().lower() or "fast"
    if loop not in LOOPS:
        raise HeygemError(f"{LOOP_VARIABLE}={loop!r} is not a voice loop: use {' or '.join(LOOPS)}")
    return loop


def round_capacity(tokens: int) -> int:
    return -(-int(tokens) // CAPACITY_STEP) * CAPACITY_STEP


def noise_scheduler(generation_config):
    """The scheduler generation_config.json names (DPM-Solver for the published files), from diffusers."""
    import diffusers

    name = getattr(generation_config, "noise_scheduler_class", None) or "DPMSolverMultistepScheduler"
    settings = getattr(generation_config, "noise_scheduler_config", None) or {
        "beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"}
    scheduler_class = getattr(diffusers, name, None)
    if scheduler_class is None:
        raise HeygemError(f"generation_config.json names the noise scheduler {name!r}, which diffusers "
                          f"{diffusers.__version__} lacks")
    return scheduler_class(**settings)


class FrameLoop:
    """One model's frame loop; not thread-safe (the caller speaks one sentence at a time)."""

    def __init__(self, clone_model, use_graphs: bool | None = None):
        import torch

        self.model = clone_model.model  # VibeVoiceForConditionalGeneration
        self.core = self.model.model  # VibeVoiceModel: language model, tokenizers, connectors, head
        self.device = clone_model.device
        self.dtype = next(self.model.parameters()).dtype
        config = self.model.config
        generation = self.model.generation_config
        self.audio_token, self.audio_start = config.audio_token_id, config.audio_bos_token_id
        self.audio_end = config.audio_eos_token_id
        eos = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
        self.end_tokens = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.guidance_scale = generation.guidance_scale if generation.guidance_scale is not None else 1.0
        self.default_steps = getattr(generation, "num_diffusion_steps", None) or DEFAULT_DIFFUSION_STEPS
        self.scheduler = noise_scheduler(generation)
        self.latent_size = config.audio_config.hidden_size
        text = config.text_config
        self.kv_heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.hidden_size = text.hidden_size
        # generate's token constraint: the audio start, end and frame tokens and the end of text only
        allowed = [self.audio_start, self.audio_end, self.audio_token, config.eos_token_id]
        self.token_mask = torch.full((config.vocab_size,), float("-inf"), device=self.device)
        self.token_mask[allowed] = 0.0
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.capacity = 0
        self.cache = None
        self.language_step = None  # the batch-2 one-token step: eager, or a graph replay
        self.denoisers: dict[int, object] = {}  # diffusion steps -> the denoising loop for them
        self.voice_frame = None  # latent -> the frame's audio and the next step's embedding: eager or a replay
        self.acoustic_cache = self.semantic_cache = None  # the streaming decoder's and encoder's padding caches

    # -- buffers and graphs ---------------------------------------------------------------------------

    def prepare(self, capacity: int, diffusion_steps: int | None = None) -> None:
        """Allocate the batch-2 cache for prompts plus speech of up to ``capacity`` tokens (rounded up) and,
        on a GPU, capture the language-model step and the denoising loop; no-op when already that big."""
        import torch
        from transformers import StaticCache

        capacity = round_capacity(capacity)
        if capacity > self.capacity:
            self.language_step, self.cache = None, None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            cache = StaticCache(config=self.model.config.get_text_config(decoder=True), max_cache_len=capacity)
            cache.early_initialization(batch_size=2, num_heads=self.kv_heads, head_dim=self.head_dim,
                                       dtype=self.dtype, device=self.device)
            self.cache, self.capacity = cache, capacity
            self.step_embeds = torch.zeros(2, 1, self.hidden_size, dtype=self.dtype, device=self.device)
            self.step_positions = torch.zeros(2, 1, dtype=torch.long, device=self.device)
            self.step_mask = torch.zeros(2, 1, 1, capacity, dtype=torch.bool, device=self.device)  # True: attend
            self.step_mask[:, :, :, 0] = True  # the warm-up runs attend something: no NaN reaches the cache
            self.language_step = self._capture(self._language_forward, "the language-model step", self._keep_slots)
            for layer in cache.layers:  # what the warm-up wrote
                layer.keys.zero_()
                layer.values.zero_()
                layer.cumulative_length.zero_()
            self.step_mask.fill_(False)
        if self.voice_frame is None:
            self._prepare_voice_frame()
        self._denoiser(diffusion_steps or self.default_steps)

    def _prepare_voice_frame(self) -> None:
        """The streaming decoder and the semantic encoder for one frame, over padding caches kept for good
        (the library sizes them at their first use, and updates them in place) and zeroed at each
        sentence's start, which is what a new cache holds; captured as one graph on a GPU."""
        import torch

        self.frame_latent = torch.zeros(1, 1, self.latent_size, dtype=self.dtype, device=self.device)
        first = self.core.audio_tower.decode(self.frame_latent, padding_cache=None, use_cache=True)
        semantic = self.core.semantic_tokenizer_encoder(first.audio, padding_cache=None, use_cache=True)
        self.acoustic_cache, self.semantic_cache = first.padding_cache, semantic.padding_cache
        if not self._reset_voice_caches():  # a library whose caches are not kept in place: a new pair per sentence
            self.acoustic_cache = self.semantic_cache = None
            self.voice_frame = self._voice_frame
            return
        self.voice_frame = self._capture(self._voice_frame, "the decoder and the semantic encoder")
        self._reset_voice_caches()

    def _reset_voice_caches(self) -> bool:
        """Zero the padding caches (a sentence starts from silence); False when they are not as expected."""
        try:
            tensors = [layer.cache for cache in (self.acoustic_cache, self.semantic_cache)
                       for layer in cache.layers.values()]
        except AttributeError:
            return False
        for tensor in tensors:
            tensor.zero_()
        return bool(tensors)

    def _voice_frame(self):
        """The frame of ``frame_latent`` (1, 1, latent): its audio (1, 1, 3200) and the next step's input
        embedding (1, 1, H), as generate makes them."""
        scaled = self.frame_latent / self.core.latent_scaling_factor - self.core.latent_bias_factor
        audio = self.core.audio_tower.decode(scaled, padding_cache=self.acoustic_cache, use_cache=True)
        semantic = self.core.semantic_tokenizer_encoder(audio.audio, padding_cache=self.semantic_cache,
                                                        use_cache=True)
        if self.acoustic_cache is None:  # no persistent caches: this sentence's pair, kept until it ends
            self.acoustic_cache, self.semantic_cache = audio.padding_cache, semantic.padding_cache
        embeds = self.core.multi_modal_projector(self.frame_latent) + self.core.semantic_connector(
            semantic.latents[0:1])  # (1, 1, H)
        return audio.audio, embeds.to(self.dtype)

    def _language_forward(self):
        """One token for both rows from the step buffers; (hidden (2, 1, H), logits (2, 1, V))."""
        output = self.model(inputs_embeds=self.step_embeds, position_ids=self.step_positions,
                            attention_mask={"full_attention": self.step_mask}, cache=self.cache, use_cache=True,
                            logits_to_keep=1)
        return output.last_hidden_state, output.logits

    def _keep_slots(self):
        """Save the cache's write positions; returns a function that restores them (warm-up runs move them)."""
        saved = [layer.cumulative_length.clone() for layer in self.cache.layers]

        def restore():
            for layer, value in zip(self.cache.layers, saved):
                layer.cumulative_length.copy_(value)
        return restore

    def _capture(self, function, what: str, keep_state=None):
        """``function`` (no arguments, reading and writing fixed buffers) as a CUDA graph replay when graphs
        are on and the capture works, else ``function`` itself."""
        if not self.use_graphs:
            return function
        import torch

        restore = keep_state() if keep_state is not None else (lambda: None)
        try:
            with torch.cuda.device(self.device):  # the capture and the model on the same device
                graph, outputs = self._record(function, restore)
        except Exception as error:  # any operation that cannot be captured: run it eagerly
            restore()
            logger.warning("the cloned voice runs %s without a CUDA graph (%s)", what, str(error).splitlines()[0])
            return function

        def replay():
            graph.replay()
            return outputs

        replay.graph = graph
        return replay

    def _record(self, function, restore):
        """(the CUDA graph of ``function``, its outputs): two warm-up runs on a side stream, then the capture."""
        import torch

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: library kernels choose their algorithms outside the capture
                function()
        torch.cuda.current_stream(self.device).wait_stream(side)
        restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = function()
        restore()
        return graph, outputs

    def _denoiser(self, steps: int):
        """The denoising loop for ``steps`` diffusion steps: condition (2, H), noise (2, latent) in the
        buffers; returns the latent (1, 1, latent). Captured once per step count on a GPU."""
        import torch

        if steps in self.denoisers:
            return self.denoisers[steps]
        scheduler = self.scheduler
        scheduler.set_timesteps(num_inference_steps=steps)
        latent_dtype = self.dtype
        timesteps = [(step, step.repeat(2).to(device=self.device, dtype=latent_dtype)) for step in scheduler.timesteps]
        condition = torch.zeros(2, self.hidden_size, dtype=self.dtype, device=self.device)
        noise = torch.zeros(2, self.latent_size, dtype=latent_dtype, device=self.device)

        def denoise():
            scheduler.set_timesteps(num_inference_steps=steps)  # host state only: the same timesteps every frame
            latent = noise  # (2, latent): generate draws a row per branch and keeps the first
            for step, step_pair in timesteps:
                both = torch.cat([latent[:1], latent[:1]], dim=0)
                velocity = self.core.diffusion_head(both, step_pair, condition=condition)  # (2, latent)
                positive, negative = torch.split(velocity, 1, dim=0)
                guided = negative + self.guidance_scale * (positive - negative)
                latent = scheduler.step(torch.cat([guided, guided], dim=0), step, latent).prev_sample
            return latent[:1].unsqueeze(1)  # (1, 1, latent)

        run = self._capture(denoise, f"the {steps}-step denoising loop")
        self.denoisers[steps] = (condition, noise, run)
        return self.denoisers[steps]

    # -- one sentence ---------------------------------------------------------------------------------

    def speak(self, inputs, max_new_tokens: int, logits_processors=None, diffusion_steps: int | None = None):
        """generate's audio for one prompt (``inputs``: the processor's tensors on the device, batch 1):
        a (1, samples) tensor on the device, or None when the model stops before any frame."""
        import torch
        from transformers import DynamicCache

        input_ids = inputs["input_ids"]  # (1, P): the logits processors read the tokens so far
        prompt_length = int(input_ids.shape[1])
        steps = diffusion_steps or self.default_steps
        self.prepare(prompt_length + max_new_tokens + 1, steps)
        condition, noise, denoise = self._denoiser(steps)
        text_config = self.model.config.get_text_config(decoder=True)
        mask, positions, embeds = self.step_mask, self.step_positions, self.step_embeds

        # the prompt as generate's prefill runs it (batch 1, dynamic cache), copied into row 0
        prompt_cache = DynamicCache(config=text_config)
        output = self.model(**inputs, cache=prompt_cache, use_cache=True, logits_to_keep=1)
        hidden, logits = output.last_hidden_state[:, -1], output.logits[:, -1]  # (1, H), (1, V)
        mask.fill_(False)
        mask[0, 0, 0, :prompt_length] = True
        for layer, prompt_layer in zip(self.cache.layers, prompt_cache.layers):
            layer.keys[0:1, :, :prompt_length].copy_(prompt_layer.keys)
            layer.values[0:1, :, :prompt_length].copy_(prompt_layer.values)
            layer.cumulative_length.fill_(prompt_length)
        del output, prompt_cache

        negative_count = 0  # tokens in the negative branch: row 1's next position
        negative_hidden = None  # (1, H): the negative branch's output for the current step
        pending = None  # the slot row 1 wrote in the last step, kept only if the token chosen is a frame
        if not self._reset_voice_caches():
            self.acoustic_cache = self.semantic_cache = None
        chunks = []  # (1, 3200) each
        slot = prompt_length  # where the next step writes
        for made in range(1, max_new_tokens + 1):
            scores = logits.to(dtype=torch.float32)  # (1, V)
            for processor in logits_processors or ():
                scores = processor(input_ids, scores)
            token_tensor = torch.argmax(scores + self.token_mask, dim=-1)  # (1,)
            token = int(token_tensor)  # the one host sync per frame
            if logits_processors:
                input_ids = torch.cat([input_ids, token_tensor[:, None].to(input_ids.device)], dim=-1)
            if pending is not None:
                if token == self.audio_token:  # generate steps its negative branch on this input
                    negative_count += 1
                else:
                    mask[1, 0, 0, pending] = False
                pending = None
            if token == self.audio_start:  # a new audio part: the negative branch's context empties
                mask[1].fill_(False)
            if token == self.audio_token:
                if made == 1:  # right after the prompt generate runs the negative branch on the audio start
                    negative_cache = DynamicCache(config=text_config)
                    start = torch.full((1, 1), self.audio_start, dtype=torch.long, device=self.device)
                    first = self.model(input_ids=start, attention_mask=torch.ones_like(start), cache=negative_cache,
                                       use_cache=True, logits_to_keep=1)
                    negative_hidden = first.last_hidden_state[:, -1]
                    for layer, negative_layer in zip(self.cache.layers, negative_cache.layers):
                        layer.keys[1:2, :, 0:1].copy_(negative_layer.keys)
                        layer.values[1:2, :, 0:1].copy_(negative_layer.values)
                    mask[1, 0, 0, 0] = True
                    negative_count = 1
                condition.copy_(torch.cat([hidden, negative_hidden], dim=0))  # (2, H)
                drawn = torch.randn(2, self.latent_size)  # on the CPU generator, as generate draws it
                noise.copy_(drawn.pin_memory() if self.device.type == "cuda" else drawn, non_blocking=True)
                self.frame_latent.copy_(denoise())  # (1, 1, latent)
                audio, next_embeds = self.voice_frame()  # (1, 1, 3200), (1, 1, H)
                chunks.append(audio[0].clone())  # (1, 3200): a replay overwrites its output
            else:
                next_embeds = self.model.get_input_embeddings()(token_tensor[:, None])  # (1, 1, H)
            if token in self.end_tokens or made == max_new_tokens:
                break
            # the next step: both rows take this embedding; row 1 at its own position, attending its own slots
            embeds.copy_(next_embeds.to(self.dtype).expand(2, 1, -1))
            positions[0].fill_(slot)
            positions[1].fill_(negative_count)
            mask[:, 0, 0, slot] = True
            step_hidden, step_logits = self.language_step()  # (2, 1, H), (2, 1, V)
            hidden, logits = step_hidden[0:1, -1], step_logits[0:1, -1]
            negative_hidden = step_hidden[1:2, -1]
            pending, slot = slot, slot + 1
        return torch.cat(chunks, dim=-1) if chunks else None
