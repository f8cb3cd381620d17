"""The Live tab: pick a presenter (or the bundled portrait), press Start, talk; the presenter speaks it back
in a <video>, in real time. A text box makes it say typed sentences into the same stream.

The browser side is LIVE_SCRIPT (in the page's head): an RTCPeerConnection that sends the microphone and
receives the presenter's video and sound, signalled with POST /api/live (heygem.live.routes). Gradio only
draws the controls and lists the presenters; the buttons run the script.
"""

from __future__ import annotations

import gradio as gr

from heygem.jobs.store import JobStore
from heygem.jobs.users import sees_every_job
from heygem.presenters.records import READY, PresenterStore
from heygem.ui.access import PageAccess
from heygem.ui.common import WORDS, language, say, ui_text

# the tab's words, added to the page's (key -> English, Chinese)
LIVE_WORDS = {
    "tab.live": ("Live", "实时"),
    "live.intro": ("Talk into your microphone: the presenter says it back, in real time. Or type what it "
                   "should say.", "对着麦克风说话：主持人实时把它说出来。也可以输入要说的话。"),
    "live.presenter": ("Presenter", "主持人"),
    "live.portrait": ("The bundled portrait", "内置肖像"),
    "live.start": ("Start", "开始"),
    "live.stop": ("Stop", "停止"),
    "live.text": ("Say this", "说这句话"),
    "live.text.placeholder": ("Hello! I am speaking live.", "你好！我正在实时说话。"),
    "live.say": ("Say", "说"),
}
WORDS.update(LIVE_WORDS)

LIVE_CSS = """
#live-video {width: 100%; max-height: 70vh; background: #111; border-radius: var(--radius-lg);}
#live-status {color: var(--body-text-color-subdued); margin-top: 6px; min-height: 1.4em;}
"""

# The browser's half of a session. aiortc answers with every ICE candidate in its SDP and takes none
# trickled, so the offer is sent once the browser has gathered its own.
LIVE_SCRIPT = """<script>
window.heygemLive = (() => {
  const zh = (navigator.language || "").toLowerCase().startsWith("zh");
  const words = zh ? {starting: "正在连接…", live: "实时中", behind: "毫秒延迟", failed: "无法开始：",
                      ended: "已结束", engine: "引擎", noSession: "请先按开始"}
                   : {starting: "Connecting…", live: "Live", behind: "ms behind", failed: "Could not start: ",
                      ended: "Ended", engine: "engine", noSession: "Press Start first"};
  const state = {peer: null, microphone: null, session: null};
  const status = (text) => { const el = document.querySelector("#live-status"); if (el) el.textContent = text; };
  const gathered = (peer) => new Promise((resolve) => {
    if (peer.iceGatheringState === "complete") return resolve();
    const check = () => { if (peer.iceGatheringState === "complete") resolve(); };
    peer.addEventListener("icegatheringstatechange", check);
    setTimeout(resolve, 3000);
  });
  async function stop() {
    const {peer, microphone, session} = state;
    state.peer = state.microphone = state.session = null;
    if (session) { try { await fetch("api/live/" + session, {method: "DELETE"}); } catch (e) {} }
    if (peer) peer.close();
    if (microphone) microphone.getTracks().forEach((track) => track.stop());
    const video = document.querySelector("#live-video");
    if (video) video.srcObject = null;
    if (session) status(words.ended);
  }
  async function start(presenter) {
    await stop();
    status(words.starting);
    try {
      const info = await (await fetch("api/live")).json();
      const peer = new RTCPeerConnection({iceServers: info.ice_servers || []});
      const microphone = await navigator.mediaDevices.getUserMedia(
        {audio: {echoCancellation: true, noiseSuppression: true, autoGainControl: true}});
      state.peer = peer; state.microphone = microphone;
      microphone.getTracks().forEach((track) => peer.addTrack(track, microphone));
      peer.addTransceiver("video", {direction: "recvonly"});
      const stream = new MediaStream();
      peer.ontrack = (event) => {
        stream.addTrack(event.track);
        const video = document.querySelector("#live-video");
        if (video.srcObject !== stream) video.srcObject = stream;
        video.play().catch(() => {});
      };
      peer.onconnectionstatechange = () => {
        if (["failed", "closed"].includes(peer.connectionState) && state.peer === peer) stop();
      };
      await peer.setLocalDescription(await peer.createOffer());
      await gathered(peer);
      const offer = {sdp: peer.localDescription.sdp, type: "offer"};
      if (presenter) offer.presenter = presenter;
      const response = await fetch("api/live", {method: "POST", headers: {"Content-Type": "application/json"},
                                                body: JSON.stringify(offer)});
      const answer = await response.json();
      if (!response.ok) throw new Error(answer.error || response.statusText);
      state.session = answer.session;
      await peer.setRemoteDescription({sdp: answer.sdp, type: answer.type});
      status(`${words.live}: ${answer.face} · ${words.engine} ${answer.engine} · ` +
             `${Math.round(answer.delay_seconds * 1000)} ${words.behind}`);
    } catch (error) {
      await stop();
      status(words.failed + (error && error.message ? error.message : error));
    }
  }
  async function say(text) {
    if (!state.session) { status(words.noSession); return; }
    if (!text || !text.trim()) return;
    const response = await fetch("api/live/" + state.session + "/say", {method: "POST",
      headers: {"Content-Type": "application/json"}, body: JSON.stringify({text})});
    if (!response.ok) status((await response.json()).error);
  }
  window.addEventListener("pagehide", () => { if (state.session) stop(); });
  return {start, stop, say, state};
})();
</script>"""


def presenter_choices(presenters: PresenterStore, access: PageAccess, request: gr.Request | None) -> list:
    """(label, id) of the ready presenters the page's user may use, after the bundled portrait ("")."""
    user = access.user(request)
    shown = presenters.list(user and user.name, every_user=sees_every_job(user))
    return [(say("live.portrait", language(request)), "")] + [(presenter.name, presenter.id) for presenter in shown
                                                    if presenter.status == READY]


def live_tab(store: JobStore, access: PageAccess) -> None:
    presenters = PresenterStore(store.outputs_dir)
    with gr.Tab(ui_text("tab.live"), elem_id="live-tab") as tab:
        gr.Markdown(ui_text("live.intro"))
        with gr.Row():
            presenter = gr.Dropdown([("-", "")], value="", label=ui_text("live.presenter"),
                                    elem_id="live-presenter", scale=3)
            start = gr.Button(ui_text("live.start"), variant="primary", elem_id="live-start", scale=1)
            stop = gr.Button(ui_text("live.stop"), elem_id="live-stop", scale=1)
        gr.HTML('<video id="live-video" autoplay playsinline></video><div id="live-status"></div>')
        with gr.Row():
            text = gr.Textbox(label=ui_text("live.text"), placeholder=ui_text("live.text.placeholder"),
                              elem_id="live-text", scale=4)
            say = gr.Button(ui_text("live.say"), elem_id="live-say", scale=1)

    def refresh(request: gr.Request):
        return gr.Dropdown(choices=presenter_choices(presenters, access, request), value="")

    tab.select(refresh, outputs=presenter, api_visibility="private")
    start.click(None, inputs=presenter, js="(presenter) => { window.heygemLive.start(presenter); }",
                api_visibility="private")
    stop.click(None, js="() => { window.heygemLive.stop(); }", api_visibility="private")
    say.click(None, inputs=text, js="(text) => { window.heygemLive.say(text); }", api_visibility="private")
    text.submit(None, inputs=text, js="(text) => { window.heygemLive.say(text); }", api_visibility="private")
