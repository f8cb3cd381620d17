"""Step 5: a face for every frame. Detection (detect: mediapipe; s3fd: S3FD), the landmarks of the
chosen face frame after frame (finder), the track of a whole video with its smoothed boxes (track),
trackers in processes of their own (processes), the avatar cache of earlier tracks (avatar_cache),
and the stage that runs them over the streamed batches (stage)."""
