"""Media through ffmpeg: the binary and its errors (ffmpeg), probing the inputs (probing, step 1),
frames and their colour conversion (frames), decoding the face input (decode, step 4) into the
batches the pipeline streams (source), encoding the output (encode, step 7) and its subtitles
(subtitles)."""
