"""What the tabs share: the page's words in English and Chinese (:func:`text` for what Gradio shows,
:func:`say` for what a handler writes), the job card, the option controls (engines, restorers and
detectors offered only when their weights are installed), the seconds-per-stage chart, the page's CSS
and its script (subtitles on the players, the live-to-result handover, scrolling to a new job).
"""

from __future__ import annotations

import html
import logging
import re
import time
from pathlib import Path

import gradio as gr

from heygem.config import REPO_ROOT
from heygem.errors import HeygemError
from heygem.jobs.store import DONE, RUNNING, JobStore
from heygem.ui.timeline import timeline_html
from heygem.weights import weights_dir

logger = logging.getLogger("heygem")
ASSETS = REPO_ROOT / "assets"
OUTPUT_HEIGHTS = [0, 256, 360, 480, 720, 1080]  # pixels; 0: as the input
BATCH_COLUMNS = ["item", "face", "audio", "status", "progress", "stage / error", "seconds", "job"]
WATCH_INTERVAL = 0.5  # seconds between job polls while a page watches a job
STATUS_LABELS = {"queued": "Queued", "running": "Running", "done": "Done", "failed": "Failed",
                 "cancelled": "Cancelled"}

# The page's words: key -> (English, Chinese). Gradio shows the one of the browser's language: a label,
# info or button given as ui_text(key) (gr.I18n, handed to launch() by page_style); a handler's own words
# (cards, messages) are chosen with say(key, language(request)). A tab adds its keys here and uses the same two.
WORDS: dict[str, tuple[str, str]] = {
    "intro": ("A face (video or photo) and some speech in, a lip-synced talking video out.",
              "输入一段人脸（视频或照片）和语音，输出口型同步的说话视频。"),
    "tab.generate": ("Generate", "生成"),
    "face": ("Face: a video or a photo", "人脸：视频或照片"),
    "face.preview": ("Face preview", "人脸预览"),
    "faces.found": ("Faces found: click the one that should speak (the largest speaks otherwise)",
                    "找到多张人脸：点击要说话的那一张（否则最大的说话）"),
    "faces.chosen": ("Face {index} speaks.", "第 {index} 张人脸说话。"),
    "faces.largest": ("{count} faces found: the largest (face {index}) speaks unless you click another.",
                      "找到 {count} 张人脸：除非点击另一张，否则最大的（第 {index} 张）说话。"),
    "speech": ("Speech: upload or record", "语音：上传或录音"),
    "own.audio": ("Use the face video's own audio instead", "改用人脸视频自带的声音"),
    "text.accordion": ("Or type what the face should say", "或输入要说的话"),
    "text": ("Text", "文字"),
    "text.placeholder": ("Hello! Speech is made on this machine, with subtitles.",
                         "你好！语音在本机合成，并带字幕。"),
    "voice": ("Voice", "声音"),
    "voice.consent": ("I may use this person's voice (the cloned voice speaks in the face video's own voice)",
                      "我有权使用此人的声音（克隆的声音使用人脸视频自带的声音）"),
    "voice.sample": ("Voice sample (optional): 5-30 s of the person speaking; else the face video's own voice",
                     "声音样本（可选）：此人说话的 5-30 秒录音；否则使用人脸视频自带的声音"),
    "speed": ("Speed", "语速"),
    "subtitles": ("Subtitles", "字幕"),
    "subtitles.soft": ("soft track", "软字幕轨"),
    "subtitles.burn": ("drawn in", "烧录进画面"),
    "subtitles.none": ("none", "无"),
    "listen": ("Listen", "试听"),
    "listen.preview": ("Preview", "试听结果"),
    "generate": ("Generate", "生成"),
    "examples": ("Examples: click one, then Generate", "示例：点击一个，然后点“生成”"),
    "card.empty": ("Your job's progress shows here.", "任务进度显示在这里。"),
    "live": ("Live: the video as it renders", "实时：边生成边播放"),
    "result": ("Result", "结果"),
    "download": ("Download MP4", "下载 MP4"),
    "cancel": ("Cancel", "取消"),
    "recent": ("Your recent jobs: pick one to follow it here", "最近的任务：选择一个在此查看"),
    "second.job": ("Job {new} is queued after job {old}, which keeps running (see Jobs); this page now "
                   "follows job {new}.", "任务 {new} 已排在任务 {old} 之后，{old} 会继续运行（见“任务”页）；"
                   "本页现在显示任务 {new}。"),
    "job.deleted": ("This job was deleted.", "此任务已被删除。"),
    "options": ("Options", "选项"),
    "engine": ("Engine", "引擎"),
    "engine.info": ("auto: MuseTalk, then Wav2Lip, if installed", "auto：依次使用已安装的 MuseTalk、Wav2Lip"),
    "height": ("Output height (the width keeps the face's shape)", "输出高度（宽度按人脸画面比例）"),
    "height.info": ("e.g. 360 px high: a 9:16 video becomes 202x360, a 3:4 one 270x360",
                    "例如高 360 像素：9:16 的视频变为 202x360，3:4 的变为 270x360"),
    "height.input": ("as the input", "与输入相同"),
    "height.px": ("{pixels} px high", "高 {pixels} 像素"),
    "restorer": ("Restore the mouth region", "修复嘴部区域"),
    "restorer.info": ("auto: GFPGAN when installed, for Wav2Lip", "auto：已安装 GFPGAN 时用于 Wav2Lip"),
    "detector": ("Face detector", "人脸检测器"),
    "detector.info": ("S3FD is offered once its weights are installed", "安装 S3FD 权重后可选"),
    "pads": ("Extra pixels around the detected face (more chin padding helps when the mouth is cut off):",
             "检测到的人脸周围额外的像素（嘴被截掉时，加大下巴方向的边距）："),
    "pad.top": ("top", "上"),
    "pad.bottom": ("bottom", "下"),
    "pad.left": ("left", "左"),
    "pad.right": ("right", "右"),
    "smooth": ("Face smoothing (frames)", "人脸平滑（帧）"),
    "smooth.info": ("boxes averaged over this many frames; 1 switches it off", "人脸框在这么多帧上取平均；1 表示关闭"),
    "fps": ("Frames per second for photos", "照片的帧率"),
    "fps.info": ("videos keep their own rate", "视频保持自身帧率"),
    "musetalk.margin": ("MuseTalk: pixels below the chin", "MuseTalk：下巴下方的像素"),
    "musetalk.margin.info": ("added to the face box, as MuseTalk 1.5's extra margin",
                             "加到人脸框上，即 MuseTalk 1.5 的额外边距"),
    "musetalk.parsing": ("MuseTalk: paste mask", "MuseTalk：贴回蒙版"),
    "musetalk.parsing.info": ("auto: the jaw face parsing when its BiSeNet files are there",
                              "auto：有 BiSeNet 文件时使用下颌人脸解析"),
    "state.queued": ("Queued", "排队中"),
    "state.running": ("Running", "运行中"),
    "state.done": ("Done", "完成"),
    "state.failed": ("Failed", "失败"),
    "state.cancelled": ("Cancelled", "已取消"),
    "card.next": ("Place in the queue: 1 (next in line)", "排队位置：1（下一个）"),
    "card.ahead": ("Place in the queue: {place} ({ahead} jobs ahead of it)",
                   "排队位置：{place}（前面还有 {ahead} 个任务）"),
    "card.finished": ("Finished in {seconds:.1f} s with the {engine} engine",
                      "用 {engine} 引擎完成，耗时 {seconds:.1f} 秒"),
    "card.finished.plain": ("Finished", "已完成"),
    "card.restorer": ("restorer: {restorer}", "修复：{restorer}"),
    "card.after": ("after {seconds:.1f} s", "{seconds:.1f} 秒后"),
    "card.log": ("Its log: the Jobs tab, job {job}.", "任务日志：见 Jobs 页，任务 {job}。"),
    "card.warnings": ("Worth knowing:", "请注意："),
    "presenter": ("A saved presenter (or upload a face above)", "已保存的形象（或在上方上传人脸）"),
    "presenter.none": ("none: the face uploaded here", "无：使用此处上传的人脸"),
    "presenter.chosen": ("{name} speaks: its clip, face and track were prepared once (see Presenters).",
                         "由 {name} 说话：其视频、人脸和跟踪已预先准备好（见“形象”页）。"),
    "tab.presenters": ("Presenters", "形象"),
    "presenter.new": ("**New presenter:** a clip of one person facing the camera (8 s or more, 720p or better), "
                      "checked and prepared once; then pick it on Generate and only type or speak.",
                      "**新建形象：**一段单人正对镜头的视频（8 秒以上，720p 或更高），只检查和准备一次；"
                      "之后在“生成”页选择它，只需输入文字或语音。"),
    "presenter.clip": ("Clip: a video (or a photo)", "视频（或照片）"),
    "presenter.name": ("Name", "名称"),
    "presenter.save": ("Save presenter", "保存形象"),
    "presenter.yours": ("Your presenters", "我的形象"),
    "presenter.delete": ("Delete this presenter", "删除此形象"),
    "presenter.pick": ("Pick a presenter in the table to see it.", "在表格中选择一个形象查看。"),
    "presenter.photo": ("photo", "照片"),
    "presenter.preparing": ("preparing", "准备中"),
    "presenter.ready": ("ready", "就绪"),
    "presenter.failed": ("failed", "失败"),
    "presenter.sample": ("its own voice: {seconds:.0f} s of speech kept for the cloned voice",
                         "自己的声音：保留了 {seconds:.0f} 秒语音用于克隆声音"),
    "presenter.no.clip": ("Add the presenter's clip first.", "请先添加形象的视频。"),
    "presenter.refused": ("Not saved:", "未保存："),
    "presenter.saved": ("Presenter {name} saved: it is being prepared (its progress shows in the table).",
                        "形象 {name} 已保存，正在准备（进度见表格）。"),
    "presenter.missing": ("That presenter is no longer there: pick another or upload a face.",
                          "该形象已不存在：请选择其他形象或上传人脸。"),
}
WORDS.update({f"height.{pixels}": (f"{pixels} px high", f"高 {pixels} 像素") for pixels in OUTPUT_HEIGHTS[1:]})
LANGUAGES = ("en", "zh")  # the columns of WORDS
CHINESE_LOCALES = ("zh", "zh-CN", "zh-TW", "zh-HK")  # browser languages that get the Chinese column


# a job's warnings (heygem.types.GenerationSummary.warnings) are English: the ones the pipeline writes,
# said again in Chinese
WARNINGS_IN_CHINESE = [
    (re.compile(r"(\d+) faces found; animated face (\d+) \(the largest\)"),
     r"找到 \1 张人脸；第 \2 张（最大的）在说话"),
    (re.compile(r"(\d+) faces found; animated face (\d+) \(as chosen\)"),
     r"找到 \1 张人脸；第 \2 张（所选的）在说话"),
    (re.compile(r"the speech is silent"), "语音没有声音"),
]


def say_warning(warning: str, language_code: str = "en") -> str:
    """A job's warning in ``language_code`` (as the job wrote it where there are no other words for it)."""
    if language_code == "zh":
        for pattern, chinese in WARNINGS_IN_CHINESE:
            if pattern.fullmatch(warning):
                return pattern.sub(chinese, warning)
    return warning


def page_i18n() -> gr.I18n:
    """WORDS for Gradio: launch(i18n=...) hands them to the page, which picks the browser's language."""
    english = {key: words[0] for key, words in WORDS.items()}
    chinese = {key: words[1] for key, words in WORDS.items()}
    return gr.I18n(en=english, **{locale: chinese for locale in CHINESE_LOCALES})


def ui_text(key: str):
    """A label, info or button text that Gradio shows in the browser's language (a WORDS key)."""
    if key not in WORDS:
        raise KeyError(f"no words for {key!r} in heygem.ui.common.WORDS")
    return gr.I18n()(key)


def language(request) -> str:
    """"zh" for a browser whose first language is Chinese, else "en" (its Accept-Language header)."""
    headers = getattr(request, "headers", None) or {}
    accepted = headers.get("accept-language", "") if hasattr(headers, "get") else ""
    first = accepted.split(",")[0].split(";")[0].strip().lower()
    return "zh" if first == "zh" or first.startswith("zh-") else "en"


def say(key: str, language_code: str = "en", **values) -> str:
    """A handler's words (a WORDS key) in ``language_code`` ("en" or "zh"), with ``values`` filled in."""
    words = WORDS[key][LANGUAGES.index(language_code) if language_code in LANGUAGES else 0]
    return words.format(**values) if values else words
CSS = """
.job-card {border: 1px solid var(--border-color-primary); border-radius: var(--radius-lg); padding: 12px 14px;
           background: var(--block-background-fill);}
.job-card .job-head {display: flex; justify-content: space-between; gap: 8px; flex-wrap: wrap;}
.job-card .job-id {font-family: var(--font-mono); font-size: 0.9em; color: var(--body-text-color-subdued);}
.job-card .job-state {font-weight: 600;}
.job-card .job-state.failed {color: var(--color-red-500, #dc2626);}
.job-card .job-state.done {color: var(--color-green-600, #16a34a);}
.job-card .bar {height: 10px; border-radius: 5px; background: var(--neutral-200); overflow: hidden; margin: 10px 0 6px;}
.dark .job-card .bar {background: var(--neutral-700);}
.job-card .bar > div {height: 100%; background: var(--color-accent); transition: width 0.4s ease;}
.job-card .job-detail {font-size: 0.92em; color: var(--body-text-color-subdued);}
.job-card .job-error {margin-top: 6px; color: var(--color-red-500, #dc2626);}
.job-card .job-warnings {margin-top: 6px; color: var(--color-orange-600, #c2410c);}
.job-card .job-warnings ul {margin: 2px 0 0 1.2em; padding: 0;}
.subtitle-cues {display: none !important;}
#face-picker .grid-container {grid-template-columns: repeat(auto-fill, 112px) !important;}
#face-picker .grid-wrap {height: auto !important; max-height: none !important; min-height: 0 !important;}
.empty-card {color: var(--body-text-color-subdued); padding: 12px 0;}
#system-report td:nth-child(-n+2) {white-space: nowrap;}
.heygem-table th .header {word-break: normal !important; overflow-wrap: normal !important; white-space: nowrap;}
.heygem-table td .cell-wrap {overflow-wrap: anywhere;}
.confirm-delete {border: 1px solid var(--color-red-500, #dc2626); border-radius: var(--radius-lg); padding: 8px;}
"""


# The page's script (launch(head=...)): what Gradio's players do not do by themselves.
# - subtitles: the WebVTT that a tab keeps in a hidden <pre class="vtt"> (#subtitle-cues) becomes a shown
#   <track> of its live and result players, renewed as cues come;
# - the live player gets the browser's controls (pause, mute);
# - handover: when a tab's result player (HANDOVER) loads the video its live player was playing, it starts
#   where the live player was (plus the moments since), playing if that played, muted if that was muted.
PAGE_SCRIPT = """<script>
(() => {
  const HANDOVER = {"live-stream": "result-video"};  // live player -> the player of the finished video
  const CUES = {"live-stream": "subtitle-cues", "result-video": "subtitle-cues"};  // player -> its cues
  const live = {};  // live player id -> {time, at, playing, muted}: where it was when last heard of
  window.heygemForgetLive = () => { for (const id of Object.keys(live)) delete live[id]; };
  const holderOf = (node, selector) => (node && node.closest ? node.closest(selector) : null);
  const note = (event) => {
    const holder = holderOf(event.target, ".live-stream");
    if (!holder || !holder.id) return;
    const video = event.target;
    live[holder.id] = {time: video.currentTime, at: performance.now(), playing: !video.paused && !video.ended,
                       muted: video.muted};
  };
  for (const name of ["timeupdate", "play", "pause", "volumechange", "seeked"]) {
    document.addEventListener(name, note, true);
  }
  document.addEventListener("loadedmetadata", (event) => {
    const video = event.target;
    for (const [liveId, resultId] of Object.entries(HANDOVER)) {
      const state = live[liveId];
      if (!state || !holderOf(video, "#" + resultId)) continue;
      delete live[liveId];
      const since = state.playing ? (performance.now() - state.at) / 1000 : 0;
      video.currentTime = Math.max(0, Math.min(state.time + since, video.duration - 0.05));
      video.muted = state.muted;
      if (state.playing) {
        video.play().catch(() => { video.muted = true; video.play().catch(() => {}); });
      }
    }
  }, true);
  const tidy = () => {
    for (const video of document.querySelectorAll(".live-stream video")) {
      if (!video.controls) video.controls = true;
    }
    for (const [playerId, cuesId] of Object.entries(CUES)) {
      const video = document.querySelector("#" + playerId + " video");
      if (!video) continue;
      const shown = document.querySelector("#" + cuesId + " pre.vtt");
      const vtt = shown ? shown.textContent : "";
      let track = video.querySelector("track.heygem-cues");
      if (track && track.dataset.vtt === vtt) {
        if (track.track.mode !== "showing") track.track.mode = "showing";
        continue;
      }
      if (track) { URL.revokeObjectURL(track.src); track.remove(); }
      if (!vtt) continue;
      track = document.createElement("track");
      track.className = "heygem-cues";
      track.kind = "subtitles";
      track.label = "Subtitles";
      track.default = true;
      track.dataset.vtt = vtt;
      track.src = URL.createObjectURL(new Blob([vtt], {type: "text/vtt"}));
      video.appendChild(track);
      track.track.mode = "showing";
    }
  };
  let due = false;
  const later = () => { if (!due) { due = true; requestAnimationFrame(() => { due = false; tidy(); }); } };
  new MutationObserver(later).observe(document.documentElement, {
    childList: true, subtree: true, characterData: true, attributes: true, attributeFilter: ["controls", "src"]});
})();
</script>"""
# an event's js before its handler: a new job is followed, so no handover from the one before
FORGET_LIVE_TIME_JS = "(...values) => { window.heygemForgetLive && window.heygemForgetLive(); return values; }"
# after Generate: the card (and the live player under it) scrolled into view, whatever the form had open
SCROLL_TO_JOB_JS = ("() => { const card = document.getElementById('job-card'); "
                    "if (card) card.scrollIntoView({block: 'start', behavior: 'smooth'}); }")


def uploaded_file(**settings) -> gr.File:
    """A gr.File (type "filepath") whose handler gets the uploaded file's path with nothing else written:
    Gradio's own preprocessing leaves an empty temporary file in its folder for every file it passes on.
    (An instance's method is replaced, not the class subclassed: Gradio writes a .pyi stub beside the
    module of every Component subclass.)"""
    from gradio_client import utils as client_utils

    component = gr.File(**settings)

    def preprocess(payload):
        if payload is None:
            return None
        files = list(payload) if isinstance(payload, gr.data_classes.ListFiles) else [payload]
        for file in files:
            if component.file_types and not client_utils.is_valid_file(file.path, component.file_types):
                raise gr.Error(wrong_kind_message(Path(file.path).name, component.file_types), print_exception=False,
                               title="Not a file this takes")
        paths = [file.path for file in files]
        return paths[0] if component.file_count == "single" else paths

    component.preprocess = preprocess
    return component


KIND_EXAMPLES = {"video": "a video (.mp4, .mov, .webm)", "image": "a photo (.jpg, .png)",
                 "audio": "a recording (.wav, .mp3, .m4a)"}


def wrong_kind_message(name: str, file_types: list[str]) -> str:
    """What the page says of a file of a kind the field does not take: what it takes instead."""
    wanted = " or ".join(KIND_EXAMPLES.get(kind, kind) for kind in file_types)
    return f"{name} is not a file this field takes: pick {wanted}"


def options_from_controls(engine: str, pad_top: float, pad_bottom: float, pad_left: float, pad_right: float,
                          smooth_window: float, restorer: str, output_height: int, fps: float,
                          detector: str = "mediapipe", musetalk_margin: float = 10,
                          musetalk_parsing: str = "auto") -> dict:
    """The option dict (dotted keys of heygem.config) for what the form shows; numbers go on as the controls
    gave them (whole ones as ints), so that the one request check refuses a bad one with one line."""

    def whole(value):
        return int(value) if isinstance(value, float) and value.is_integer() else value

    options = {
        "engine.name": engine,
        "face.pads": [whole(pad_top), whole(pad_bottom), whole(pad_left), whole(pad_right)],
        "face.smooth_window": whole(smooth_window),
        "restore.enabled": restorer != "none",
        "restore.method": restorer,
        "media.output_height": whole(output_height) or None,
        "media.fps": fps,
        "face.detector": detector,
        "engine.musetalk_margin": whole(musetalk_margin),
        "engine.musetalk_parsing": musetalk_parsing,
    }
    return options


def installed_weights() -> set[str]:
    """Names of the registry entries (configs/weights.yaml) with a file in the weights folder."""
    from heygem.weights import installed_names

    try:
        return installed_names(weights_dir())
    except HeygemError as error:  # an unreadable registry: offer only what needs no weights
        logger.warning("%s", error)
        return set()


def engine_choices(installed: set[str]) -> list[tuple[str, str]]:
    """Engines the form offers: MuseTalk only when its files are complete and its libraries installed,
    Wav2Lip only when one of its checkpoints is installed."""
    from heygem.engines.musetalk.files import find_musetalk_files, missing_libraries

    choices = [("auto", "auto")]
    if not missing_libraries() and find_musetalk_files() is not None:
        choices.append(("MuseTalk 1.5", "musetalk"))
    if installed & {"wav2lip", "wav2lip_gan"}:
        choices.append(("Wav2Lip", "wav2lip"))
    return choices + [("built-in landmark engine", "landmark")]


def restorer_choices(installed: set[str]) -> list[tuple[str, str]]:
    """Restorers the form offers: GFPGAN only when GFPGANv1.4.pth is installed."""
    choices = [("auto", "auto")]
    if "gfpgan_v1.4" in installed:
        choices.append(("GFPGAN v1.4", "gfpgan"))
    return choices + [("sharpen", "sharpen"), ("none", "none")]


def detector_choices(installed: set[str]) -> list[tuple[str, str]]:
    """Face detectors the form offers: S3FD only when its file is installed."""
    choices = [("mediapipe", "mediapipe")]
    if "s3fd" in installed:
        choices.append(("S3FD", "s3fd"))
    return choices


def offered(value: str, choices: list[tuple[str, str]], fallback: str) -> str:
    return value if value in {choice for _, choice in choices} else fallback


def option_controls(store: JobStore, prefix: str) -> list[gr.components.Component]:
    """The options people actually change, with the defaults of configs/default.yaml; engines,
    restorers and detectors that need weights are offered only when their files are installed."""
    defaults = store.base_config
    installed = installed_weights()
    engines, restorers, detectors = engine_choices(installed), restorer_choices(installed), detector_choices(installed)
    restorer_default = defaults.restore.method if defaults.restore.enabled else "none"
    heights = [(ui_text(f"height.{pixels}") if pixels else ui_text("height.input"), pixels)
               for pixels in OUTPUT_HEIGHTS]
    with gr.Accordion(ui_text("options"), open=False, elem_id=f"{prefix}options-accordion"):
        with gr.Row():
            engine = gr.Dropdown(engines, value=offered(defaults.engine.name, engines, "auto"),
                                 label=ui_text("engine"), elem_id=f"{prefix}engine", info=ui_text("engine.info"))
            output_height = gr.Dropdown(heights, value=defaults.media.output_height or 0, label=ui_text("height"),
                                        elem_id=f"{prefix}output-height", info=ui_text("height.info"))
        with gr.Row():
            restorer = gr.Dropdown(restorers, value=offered(restorer_default, restorers, "auto"),
                                   label=ui_text("restorer"), elem_id=f"{prefix}restorer",
                                   info=ui_text("restorer.info"))
            detector = gr.Dropdown(detectors, label=ui_text("detector"), elem_id=f"{prefix}detector",
                                   value=offered(defaults.face.detector, detectors, "mediapipe"),
                                   info=ui_text("detector.info"))
        gr.Markdown(ui_text("pads"))
        with gr.Row():
            # no precision: the value reaches the request check as given (Gradio's int() fails on NaN)
            pads = [gr.Number(value=value, label=ui_text(f"pad.{side}"), minimum=0, maximum=1000, step=1,
                              min_width=80)
                    for value, side in zip(defaults.face.pads, ("top", "bottom", "left", "right"))]
        with gr.Row():
            smooth = gr.Slider(1, 15, value=defaults.face.smooth_window, step=1, label=ui_text("smooth"),
                               info=ui_text("smooth.info"))
            fps = gr.Slider(10, 60, value=defaults.media.fps, step=1, label=ui_text("fps"), info=ui_text("fps.info"))
        # MuseTalk's own options, shown only where it is offered (their defaults otherwise)
        with gr.Row(visible="musetalk" in {value for _, value in engines}):
            musetalk_margin = gr.Number(value=defaults.engine.musetalk_margin, precision=0, minimum=0, maximum=200,
                                        label=ui_text("musetalk.margin"), info=ui_text("musetalk.margin.info"))
            musetalk_parsing = gr.Dropdown(["auto", "jaw", "neck", "raw", "landmarks"],
                                           value=defaults.engine.musetalk_parsing, label=ui_text("musetalk.parsing"),
                                           info=ui_text("musetalk.parsing.info"))
    return [engine, *pads, smooth, restorer, output_height, fps, detector, musetalk_margin, musetalk_parsing]


def format_time(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else ""


def job_card(job, language_code: str = "en") -> str:
    """The status card: job id, state, queue place, a progress bar with the stage; for a finished job
    what its summary warns of. ``language_code``: "en" or "zh" (:func:`language`)."""
    state = say(f"state.{job.status}", language_code) if f"state.{job.status}" in WORDS else job.status
    warnings = []
    if job.status == "queued":
        ahead = job.jobs_ahead or 0
        detail = say("card.next", language_code) if ahead == 0 else \
            say("card.ahead", language_code, place=ahead + 1, ahead=ahead).replace("(1 jobs", "(1 job")
    elif job.status == RUNNING:
        detail = f"{html.escape(job.stage or 'starting')} · {job.progress:.0%}"
    elif job.status == DONE:
        detail = (say("card.finished", language_code, seconds=job.seconds, engine=html.escape(job.engine or ""))
                  if job.seconds else say("card.finished.plain", language_code))
        summary = job.read_summary() or {}
        if summary.get("restorer"):
            detail += " · " + say("card.restorer", language_code, restorer=html.escape(str(summary["restorer"])))
        warnings = [say_warning(str(warning), language_code) for warning in summary.get("warnings") or []]
    else:
        detail = say("card.after", language_code, seconds=job.seconds) if job.seconds else ""
    width = 100 if job.status == DONE else int(round(job.progress * 100))
    error = f'<div class="job-error">{html.escape(job.error)}</div>' if job.error else ""
    if job.error and job.status == "failed":  # what went wrong, step by step: the job's log, in the Jobs tab
        error += f'<div class="job-log-hint">{say("card.log", language_code, job=html.escape(job.id))}</div>'
    if warnings:
        error += (f'<div class="job-warnings"><strong>{say("card.warnings", language_code)}</strong><ul>'
                  + "".join(f"<li>{html.escape(warning)}</li>" for warning in warnings) + "</ul></div>")
    label = f" · {html.escape(job.label)}" if job.label else ""
    return (f'<div class="job-card" data-status="{job.status}">'
            f'<div class="job-head"><span class="job-state {job.status}">{state}</span>'
            f'<span class="job-id">job {html.escape(job.id)}{label}</span></div>'
            f'<div class="bar" role="progressbar" aria-valuenow="{width}" aria-valuemin="0" aria-valuemax="100">'
            f'<div style="width:{width}%"></div></div>'
            f'<div class="job-detail">{detail}</div>{error}</div>')


def problem_card(message: str) -> str:
    """The card's place when nothing could be queued: what to fix."""
    return f'<div class="job-card" data-status="problem"><div class="job-error">{html.escape(message)}</div></div>'


def chart_update(job, language_code: str = "en") -> dict:
    """A finished job's stages on one time line (heygem.ui.timeline), as the Jobs tab draws them."""
    drawn = timeline_html(job.read_summary() if job is not None else None)
    return gr.update(value=drawn, visible=bool(drawn))


def error_text(error: Exception) -> str:
    return str(error) if isinstance(error, HeygemError) else f"{type(error).__name__}: {error}"
