"""Step 2: the speech: decoding it to 16 kHz and the engines' audio features (audio), text spoken
offline sentence by sentence (tts), and the subtitles a video made from text carries (subtitles)."""
