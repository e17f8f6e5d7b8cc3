"""A served chat request's messages, checked on the HTTP thread before anything runs: a
non-empty list of objects with a string role, and image parts kvlab can serve.

mlx-lm's handler downloads ``http(s)`` image URLs (``_inline_image_urls``) and its text path
rejects image parts with a bare ValueError; kvlab never touches the network and says what to do.
``problem(messages, model_name, vlm)`` is the 400 message for a request kvlab will not serve: a
malformed message list, an image sent to a text model, a web URL, an image part without an image;
"" when it may go on (a VLM then reads each image: kvlab.serving.vlm_generator, where an
unreadable image is a 400 too).

Example:
    >>> problem([{"role": "user", "content": [{"type": "image_url",
    ...           "image_url": {"url": "https://x/cat.png"}}]}], "tiny-vlm", vlm=True)
    "messages[0].content[0]: 'https://x/cat.png' is a web URL; kvlab serve never downloads: ..."
"""

from __future__ import annotations

IMAGE_TYPES = ("image_url", "image", "input_image")
WEB = ("http://", "https://")


def image_url(part) -> object:
    """What an image part points at (OpenAI's ``image_url.url``, or ``image``), None otherwise."""
    if not isinstance(part, dict) or part.get("type") not in IMAGE_TYPES:
        return None
    url = part.get("image_url", part.get("image"))
    return url.get("url") if isinstance(url, dict) else url


def images(messages) -> list[tuple[str, object]]:
    """(where, url) of every image part of a chat request's messages, in order."""
    out = []
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") in IMAGE_TYPES:
                out.append((f"messages[{i}].content[{j}]", image_url(part)))
    return out


def check_messages(messages) -> str:
    """The 400 message for a message list that is not one ("" if it is)."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {'role': ..., 'content': ...} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}] must be an object with a string 'role'"
    return ""


def problem(messages, model_name: str, vlm: bool) -> str:
    """The 400 message for ``messages`` sent to model ``model_name`` (a vision-language model if
    ``vlm``): a malformed list or image parts it cannot serve; "" when there is nothing to refuse."""
    found = check_messages(messages)
    if found:
        return found
    found = images(messages)
    if not found:
        return ""
    if not vlm:
        return (f"{found[0][0]} is an image, but {model_name} is a text model: serve a vision-language "
                "model (kvlab serve --model tiny-vlm, or a local mlx-vlm folder) or send text only")
    for where, url in found:
        if not isinstance(url, str) or not url:
            return (f"{where} is an image part without an image: send {{'type': 'image_url', "
                    "'image_url': {'url': 'data:image/png;base64,...'}} (or a file:// URL or local path)")
        if url.startswith(WEB):
            return (f"{where}: {url[:60]!r} is a web URL; kvlab serve never downloads: send the image "
                    "inline as a data:image/...;base64 URL, or as a file:// URL or path on the server")
    return ""
