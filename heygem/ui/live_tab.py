"""The Live tab: pick a presenter (or the bundled portrait), press Start, talk; the presenter speaks it back
in a <video>, in real time. A text box makes it say typed sentences into the same stream.

The browser side is LIVE_SCRIPT (in the page's head): an RTCPeerConnection that sends the microphone and
receives the presenter's video and sound, signalled with POST /api/live (heygem.live.routes). Gradio draws
the controls and lists the presenters; the buttons run the script. The script's requests carry none of the
REST API's credentials, so Start first runs a private page event that knows the signed-in user and hands
the script a one-use ticket for that user (heygem.live.tickets) with the ICE servers; the session it
starts answers with its key, which Say and Stop send.
"""

from __future__ import annotations

import json

import gradio as gr

from heygem.jobs.store import JobStore
from heygem.live.sessions import LiveSettings
from heygem.live.tickets import KEY_HEADER, TICKET_HEADER
from heygem.presenters.records import PresenterStore
from heygem.ui.access import NOBODY, PageAccess
from heygem.ui.common import WORDS, language, say, ui_text
from heygem.ui.presenters import picker_update

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
    "live.sign_in": ("Sign in first: live sessions are for this server's users.",
                     "请先登录：实时会话仅供本服务器的用户使用。"),
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
  const words = zh ? {starting: "正在连接…（服务器在 GPU 上的第一个会话要先加载引擎，MuseTalk 还要编译，最长约两分钟）",
                      live: "实时中", behind: "毫秒延迟", failed: "无法开始：",
                      ended: "已结束", engine: "引擎", noSession: "请先按开始"}
                   : {starting: "Connecting… (a server's first session on a GPU loads the engine, and compiles "
                                + "MuseTalk's: up to two minutes)",
                      live: "Live", behind: "ms behind", failed: "Could not start: ",
                      ended: "Ended", engine: "engine", noSession: "Press Start first"};
  const state = {peer: null, microphone: null, session: null, key: null};
  const keyed = (headers) => (state.key ? {...headers, "KEY_HEADER": state.key} : headers);
  const status = (text) => { const el = document.querySelector("#live-status"); if (el) el.textContent = text; };
  const gathered = (peer) => new Promise((resolve) => {
    if (peer.iceGatheringState === "complete") return resolve();
    const check = () => { if (peer.iceGatheringState === "complete") resolve(); };
    peer.addEventListener("icegatheringstatechange", check);
    setTimeout(resolve, 3000);
  });
  async function stop() {
    const {peer, microphone, session} = state;
    const headers = keyed({});
    state.peer = state.microphone = state.session = state.key = null;
    if (session) { try { await fetch("api/live/" + session, {method: "DELETE", headers}); } catch (e) {} }
    if (peer) peer.close();
    if (microphone) microphone.getTracks().forEach((track) => track.stop());
    const video = document.querySelector("#live-video");
    if (video) video.srcObject = null;
    if (session) status(words.ended);
  }
  async function start(presenter, grant) {
    await stop();
    status(words.starting);
    try {
      const pass = JSON.parse(grant || "{}");  // {ticket, ice_servers} from the page's own sign-in, or {error}
      if (pass.error || !pass.ticket) throw new Error(pass.error || "no ticket");
      const peer = new RTCPeerConnection({iceServers: pass.ice_servers || []});
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
      const response = await fetch("api/live", {method: "POST", body: JSON.stringify(offer),
        headers: {"Content-Type": "application/json", "TICKET_HEADER": pass.ticket}});
      const answer = await response.json();
      if (!response.ok) throw new Error(answer.error || response.statusText);
      state.session = answer.session; state.key = answer.key;
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
      headers: keyed({"Content-Type": "application/json"}), body: JSON.stringify({text})});
    if (!response.ok) status((await response.json()).error);
  }
  window.addEventListener("pagehide", () => { if (state.session) stop(); });
  return {start, stop, say, state};
})();
</script>""".replace("TICKET_HEADER", TICKET_HEADER).replace("KEY_HEADER", KEY_HEADER)


def portrait_label(request: gr.Request | None) -> str:
    """The presenter picker's first entry: the bundled portrait (value "")."""
    return say("live.portrait", language(request))


def live_grant(live: LiveSettings, access: PageAccess, request: gr.Request | None) -> str:
    """JSON {"ticket", "ice_servers"} for the page's script: a one-use ticket bound to the page's signed-in
    user (heygem.live.tickets); {"error"} for a page nobody signed in to on a server with users."""
    user = access.user(request)
    if user is NOBODY:
        return json.dumps({"error": say("live.sign_in", language(request))})
    return json.dumps({"ticket": live.tickets.issue(user and user.name), "ice_servers": live.ice_server_list()})


def live_tab(store: JobStore, access: PageAccess, presenters: PresenterStore | None = None,
             live: LiveSettings | None = None) -> None:
    """The tab; ``presenters``: the server's saved presenters (default: the store's folder's); ``live``: the
    settings the REST API's live routes were given, whose ticket registry they share."""
    presenters = presenters if presenters is not None else PresenterStore(store.outputs_dir)
    live = live if live is not None else LiveSettings()
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
        grant = gr.Textbox(visible=False)  # the script's ticket, from live_grant

    def refresh(request: gr.Request):  # the bundled portrait first, then the ready presenters (heygem.ui.presenters)
        return picker_update(presenters, access, None, request, portrait_label(request))

    tab.select(refresh, outputs=presenter, api_visibility="private")
    def hand_out_ticket(request: gr.Request) -> str:
        return live_grant(live, access, request)

    start.click(hand_out_ticket, outputs=grant, api_visibility="private").then(
        None, inputs=[presenter, grant], js="(presenter, grant) => { window.heygemLive.start(presenter, grant); }",
        api_visibility="private")
    stop.click(None, js="() => { window.heygemLive.stop(); }", api_visibility="private")
    say.click(None, inputs=text, js="(text) => { window.heygemLive.say(text); }", api_visibility="private")
    text.submit(None, inputs=text, js="(text) => { window.heygemLive.say(text); }", api_visibility="private")
