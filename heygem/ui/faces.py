"""What the page shows of an uploaded face, for every tab that takes one (Generate, Presenters): its preview
(a photo or a video), what is wrong with the file, and the faces of its first frame to pick the one that speaks.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from heygem.errors import HeygemError
from heygem.media.probing import IMAGE_SUFFIXES
from heygem.ui.common import language, say, wrong_kind_message


def preview_face(face_path):
    """Show an uploaded face in the image or the video preview, whichever fits; a photo has no sound of
    its own to use."""
    if not face_path:
        return (gr.update(visible=False, value=None), gr.update(visible=False, value=None),
                gr.update(visible=True, interactive=True))
    is_image = Path(face_path).suffix.lower() in IMAGE_SUFFIXES
    return (gr.update(visible=is_image, value=face_path if is_image else None),
            gr.update(visible=not is_image, value=None if is_image else face_path),
            gr.update(visible=not is_image, interactive=not is_image, value=False) if is_image else
            gr.update(visible=True, interactive=True))


def face_choices(face_path, language_code: str = "en"):
    """What the page says of an uploaded face once it has looked at it: the face field (emptied for a
    file of another kind), the previews (hidden for a file that cannot be decoded), the faces of its
    first frame to pick the one that speaks (a gallery shown for two or more, its note, the picked face:
    None, the largest). What is wrong with the file is said at once, as a job would say it."""
    from heygem.face.found import find_faces
    from heygem.media.probing import VIDEO_SUFFIXES, probe

    keep = gr.update()
    no_faces = gr.update(visible=False, value=None), gr.update(visible=False, value=""), None
    if not face_path:
        return (keep, keep, keep, *no_faces)
    name = Path(face_path).name
    if Path(face_path).suffix.lower() not in IMAGE_SUFFIXES | VIDEO_SUFFIXES:
        gr.Warning(wrong_kind_message(name, ["video", "image"]), title=name)
        return (None, gr.update(visible=False, value=None), gr.update(visible=False, value=None), *no_faces)
    try:
        found = find_faces(probe(face_path, "face"))
    except HeygemError as problem:
        gr.Warning(str(problem), title=name)
        return (keep, gr.update(visible=False, value=None), gr.update(visible=False, value=None), *no_faces)
    if len(found) < 2:
        return (keep, keep, keep, *no_faces)
    thumbnails = [(thumbnail, f"face {index}") for index, thumbnail in enumerate(found.thumbnails())]
    note = say("faces.largest", language_code, count=len(found), index=found.chosen(None))
    return (keep, keep, keep, gr.update(visible=True, value=thumbnails, selected_index=None),
            gr.update(visible=True, value=note), None)


def picked_face(event: gr.SelectData, request: gr.Request):
    """The face clicked in a faces gallery: its index (face.face_index) and the note that says so."""
    return event.index, say("faces.chosen", language(request), index=event.index)
