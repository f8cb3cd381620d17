"""Rebuild the bundled samples (run once; the results are committed).

- astronaut.jpg: the public-domain NASA portrait that scikit-image ships
  (``skimage.data.astronaut()``), RGB 512x512, stored as JPEG.
- speech_en.wav / speech_zh.wav: espeak-ng speech with a pause in the middle,
  so that the output shows the mouth closing in silence.

Needs scikit-image, OpenCV and the espeak-ng program.
"""

import shutil
import subprocess
from pathlib import Path

import cv2
import skimage.data

ASSETS = Path(__file__).resolve().parent

SPEECH = {
    "speech_en.wav": ("en-us", 150, 'Hello, and welcome to hey gem. <break time="900ms"/> '
                                    "Give it a face and some speech, and it makes a talking video."),
    "speech_zh.wav": ("cmn", 140, '你好，欢迎使用。<break time="700ms"/> 给它一张脸和一段语音。'),
}


def main() -> None:
    portrait_rgb = skimage.data.astronaut()
    cv2.imwrite(str(ASSETS / "astronaut.jpg"), cv2.cvtColor(portrait_rgb, cv2.COLOR_RGB2BGR),
                [cv2.IMWRITE_JPEG_QUALITY, 92])
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise SystemExit("espeak-ng is needed to rebuild the speech samples (apt-get install espeak-ng)")
    for name, (voice, words_per_minute, text) in SPEECH.items():
        subprocess.run([espeak, "-v", voice, "-s", str(words_per_minute), "-m", "-w", str(ASSETS / name), text],
                       check=True)


if __name__ == "__main__":
    main()
