"""Live mode: talk into the browser and the presenter speaks it back in real time, over WebRTC (aiortc).

The same engines and render steps as a job, driven frame by frame instead of batch by batch:

- audio_in: the session's sound as one 16 kHz timeline tied to the wall clock (the microphone, PCM from a
  voice agent's WebSocket and typed sentences spoken with the bundled voice all land in it), and each
  frame's mel window (or, for MuseTalk, the samples around it) read from it as it streams;
- face: the presenter's frames and faces for a session (the saved track, or tracked once at the start);
- engine_step: the small interface a session's engine runs behind (one frame and the sound it reads in, one
  frame out) and the steps of the landmark engine, Wav2Lip and MuseTalk; which engine a session runs, and why;
- batching: one engine and one thread shared by the sessions on the same engine and files, drawing their due
  frames in one engine call;
- tracks: aiortc tracks whose ``recv()`` paces the output: video at the output rate, the sound delayed
  by as much as the video, so that each mouth meets its sound;
- sessions: the sessions of a server, their cap, their end (the peer gone, or silence for too long);
- routes: the HTTP routes (signalling, say, end) and the PCM WebSocket, on the REST API's router.

aiortc is imported only when a session starts: importing heygem.live costs nothing.
"""
