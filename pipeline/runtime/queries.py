"""`prompt.queries` in the seed's three forms, parsed and checked before any model is built.

- a string: text, tokenized with the checkpoint's tokenizer;
- `{prompt: text}`: the same;
- chat messages: a list of `{role, content}`, content a string or a list of parts
  `{type: text, text: ...}` and `{type: image, url | path | image: <local file>}`, rendered with the
  checkpoint's chat template (images through the model family's processing, runtime/requests.py).
A list of token ids is taken as it is. Image parts name local files (a path, or a `file://` URL);
an `http(s)://` URL is refused: these machines are offline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError

ROLES = ("system", "user", "assistant")


@dataclass
class Query:
    kind: str  # ids | text | chat
    ids: list[int] = field(default_factory=list)  # kind ids
    text: str = ""  # kind text
    messages: list[dict[str, Any]] = field(
        default_factory=list
    )  # kind chat: text parts as given, images as paths
    images: list[Path] = field(default_factory=list)  # kind chat: the image parts' files, in order


def _image_path(part: dict[str, Any], where: str) -> Path:
    source = next((part[k] for k in ("url", "path", "image") if isinstance(part.get(k), str)), None)
    if source is None:
        raise ConfigError(f"{where} is an image part without a url, path or image naming a local file")
    if source.startswith(("http://", "https://")):
        raise ConfigError(
            f"{where}.url={source} cannot be fetched (this machine is offline): download it and give its local path"
        )
    path = Path(source.removeprefix("file://"))
    if not path.is_file():
        raise ConfigError(f"{where} names {source}, which is not a file here")
    return path


def _chat(messages: list, where: str) -> Query:
    query = Query("chat")
    for m_index, message in enumerate(messages):
        at = f"{where}[{m_index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES or "content" not in message:
            raise ConfigError(f"{at} must be a message {{role: {'|'.join(ROLES)}, content: ...}}")
        content = message["content"]
        if isinstance(content, str):
            query.messages.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise ConfigError(f"{at}.content must be text or a list of text and image parts")
        parts = []
        for p_index, part in enumerate(content):
            part_at = f"{at}.content[{p_index}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                query.images.append(_image_path(part, part_at))
                parts.append({"type": "image"})
            else:
                raise ConfigError(
                    f"{part_at} must be {{type: text, text: ...}} or {{type: image, url: <local file>}}"
                )
        query.messages.append({"role": message["role"], "content": parts})
    return query


def parse(queries: list[Any] | None) -> list[Query]:
    """Each entry of prompt.queries as a Query; a ConfigError naming the entry when it is none of the
    forms, empty, or names an image that is not a local file."""
    parsed = []
    for index, query in enumerate(queries or []):
        where = f"prompt.queries[{index}]"
        if query in ("", [], {}) or (isinstance(query, dict) and not query.get("prompt")):
            raise ConfigError(f"{where} is empty; give it text, {{prompt: text}}, chat messages or token ids")
        if isinstance(query, str):
            parsed.append(Query("text", text=query))
        elif isinstance(query, dict) and isinstance(query.get("prompt"), str):
            parsed.append(Query("text", text=query["prompt"]))
        elif isinstance(query, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in query):
            parsed.append(Query("ids", ids=list(query)))
        elif isinstance(query, list):
            parsed.append(_chat(query, where))
        else:
            raise ConfigError(f"{where} is none of: text, {{prompt: text}}, chat messages, token ids")
    return parsed


def check(queries: list[Query], has_tokenizer: bool, has_chat_template: bool, is_vlm: bool) -> None:
    """What each query needs of the model folder, before anything is built."""
    for index, query in enumerate(queries):
        where = f"prompt.queries[{index}]"
        if query.kind != "ids" and not has_tokenizer:
            raise ConfigError(
                f"{where} is text, and no tokenizer is available offline: give token id lists, or set "
                "model.checkpoint to a local folder with a tokenizer"
            )
        if query.kind == "chat" and not has_chat_template:
            raise ConfigError(
                f"{where} is chat messages, and model.checkpoint has no chat template (chat_template.jinja, "
                "or chat_template in tokenizer_config.json): give text or token ids, or a folder with one"
            )
        if query.images and not is_vlm:
            raise ConfigError(
                f"{where} has an image part, and this model has no vision tower; drop the image"
            )
