"""Step 6: the engine's mouths put into the frames. The CPU path (cpu) and the plumbing of the device
paths (regions), what the stages wait for (prepared), blending (blend, and on the device gpu_blend),
and restoring what a generator made (restore: sharpen or GFPGAN v1.4, gfpgan)."""
