"""Encode / streaming decode / chat template rendering with message boundaries.

Runs on the `tokenizers` library and jinja2 alone. transformers is used only
once per model, to convert a GGUF vocabulary (or a folder holding only slow
tokenizer files) to a tokenizer.json (tokenizer_convert.py).
Ids, text and chat renderings equal what transformers' tokenizer gives.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from bisect import bisect_right
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable

import tokenizers

from .errors import ModelLoadError

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Chat templates end a turn with one of these; generation stops on it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<turn|>")
ROLES = ("system", "user", "assistant", "tool")
TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"


def cache_root() -> Path:
    env = os.environ.get("TURNKV_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "turnkv"


def loaded_json(tokenizer) -> bytes | None:
    """The tokenizer.json ``tokenizer``'s backend was built from, read again, or None when there
    is none or the file is gone or holds other bytes now (then only the backend in memory says
    what the vocabulary is). Only a build of what the vocabulary's caches hold needs the bytes:
    their keys come from ``file_key``, without reading the file."""
    path = getattr(tokenizer, "backend_file", None)
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    return data if hashlib.sha256(data).digest() == tokenizer.backend_hash.digest() else None


def shipped_template(name: str) -> str:
    """A chat template shipped in turnkv/templates/<name>.jinja."""
    return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def chat_template_source(spec: str) -> str:
    """``--chat-template``: a shipped template's name or a template file's path."""
    if (TEMPLATES_DIR / f"{spec}.jinja").is_file():
        return shipped_template(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    shipped = ", ".join(sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja")))
    raise ModelLoadError(f"--chat-template {spec}: no such file and no shipped template of that name ({shipped})")


@dataclass
class RenderedChat:
    text: str
    ids: list[int]
    # token offsets at the end of the system prompt and of each message that ends
    # on a token boundary of `ids` (strictly increasing, each <= len(ids))
    boundaries: list[int]
    tokenize_ms: float = 0.0     # the tokenizer's own time (the rest of the work is the template's)


# ------------------------------------------------------------------ messages


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image_url", "image"):
                raise ValueError(f"{where}.content[{j}] is an image, and this model does not take images "
                                 "(it has no vision encoder)")
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": \"...\"}}; "
                    "only text content is supported"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def normalize_messages(messages: Any) -> list[dict]:
    """Validate chat messages; content parts become one string. Raises ValueError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
        if "content" not in message:
            raise ValueError(f"{where} has no 'content'")
        clean = {k: v for k, v in message.items() if v is not None}
        clean["content"] = _content_text(message["content"], where)
        out.append(clean)
    return out


def normalize_vision_messages(messages: Any) -> tuple[list[dict], list[str]]:
    """For a vision model: every message's content becomes a list of ``{"type": "text", "text"}``
    and ``{"type": "image"}`` parts (what transformers' processors hand their chat templates), and
    the image URLs in order of appearance. Raises ValueError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out, urls = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        images = isinstance(content, (list, tuple)) and any(
            isinstance(p, dict) and p.get("type") in ("image_url", "image") for p in content)
        if not images:
            clean = normalize_messages([message])[0]
            clean["content"] = [{"type": "text", "text": clean["content"]}]
            out.append(clean)
            continue
        where = f"messages[{i}]"
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise ValueError(f"{where}.content[{j}] must be a text part or an image_url part")
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
                continue
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if part.get("type") != "image_url" or not isinstance(url, str):
                raise ValueError(f"{where}.content[{j}] must be a text part or an image_url part with a url")
            parts.append({"type": "image"})
            urls.append(url)
        clean = normalize_messages([{**message, "content": ""}])[0]
        clean["content"] = parts
        out.append(clean)
    return out, urls


# ---------------------------------------------------------------- templates


def _compile_template(source: str):
    # The same sandbox, options and helpers transformers' apply_chat_template uses.
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # {% generation %} marks assistant text for training masks; render its body as is.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ---------------------------------------------------------------- tokenizer


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
        source: Path | None = None,
    ):
        self.backend = backend
        self.source = source
        # the tokenizer.json ``backend`` was built from (from_folder) and the SHA-256 of the bytes
        # read then (a hashlib object): what is derived from the vocabulary and kept on disk (the
        # longest entry, the grammar engine's view) is keyed by it (``file_key``), so the file is
        # read and hashed once a start
        self.backend_file: Path | None = None
        self.backend_hash = None
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self.token_to_id(self.special_tokens.get("bos_token"))
        eos = {self.token_to_id(self.special_tokens.get("eos_token"))} | set(extra_eos_ids)
        for token in END_OF_TURN_TOKENS:
            if chat_template and token in chat_template:
                eos.add(self.token_to_id(token))
        self.eos_token_ids: set[int] = {i for i in eos if i is not None}
        # transformers skips this cleanup for BPE models (it would eat real spaces)
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        self._template = None
        self.template_note = ""    # set when the chat template is not the model's own (banner)
        if chat_template:  # compiled now: a broken template fails at load, not on the first request
            try:
                self._template = _compile_template(chat_template)
            except Exception as e:
                raise ModelLoadError(f"{source or 'tokenizer'}: the chat template does not compile ({e})") from None

    # -- construction

    @classmethod
    def from_folder(
        cls, folder: str | os.PathLike, *, chat_template: str | None = None, extra_eos_ids: Iterable[int] = ()
    ) -> "Tokenizer":
        """Load tokenizer.json (+ tokenizer_config.json, chat template files) from `folder`.

        `chat_template` overrides the folder's template (or supplies one)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        try:
            data = path.read_bytes()
            backend = tokenizers.Tokenizer.from_buffer(data)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot load tokenizer ({e})") from None
        config = read_json(folder / "tokenizer_config.json") or {}
        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        template = chat_template or folder_chat_template(folder, config)
        tok = cls(
            backend,
            special_tokens=special,
            chat_template=template,
            extra_eos_ids=extra_eos_ids,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            source=folder,
        )
        tok.backend_file, tok.backend_hash = path, hashlib.sha256(data)
        return tok

    # -- basics

    def file_key(self, salt: bytes) -> str | None:
        """The hex SHA-256 of the loaded tokenizer.json's bytes followed by ``salt`` (what a cache
        of something derived from the vocabulary is keyed by), without reading the file again;
        None for a tokenizer not built from a tokenizer.json."""
        if self.backend_hash is None:
            return None
        key = self.backend_hash.copy()
        key.update(salt)
        return key.hexdigest()

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    # -- chat

    def with_template(self, chat_template: str, note: str = "") -> "Tokenizer":
        """The same tokenizer under another chat template (``--chat-template``); end-of-turn tokens
        the new template uses stop generation too. ``note``: why, for the start-up banner."""
        tok = Tokenizer(self.backend, special_tokens=self.special_tokens, chat_template=chat_template,
                        extra_eos_ids=self.eos_token_ids, source=self.source,
                        clean_up_tokenization_spaces=self._clean_up)
        tok.template_note = note
        tok.backend_file, tok.backend_hash = self.backend_file, self.backend_hash
        return tok

    def render_text(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The chat template's text for already normalized messages; ValueError if it refuses them.

        ``tools`` (OpenAI tool objects) and ``template_kwargs`` (extra template variables, e.g.
        ``enable_thinking``) reach the template as transformers' ``apply_chat_template`` passes them."""
        if self._template is None:
            raise ValueError("this model has no chat template; use the completions endpoint")
        try:
            return self._template.render(
                **{**self.special_tokens, **(template_kwargs or {})},
                messages=messages, tools=tools or None, documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # raise_exception() in the template, or a template bug
            raise ValueError(f"the chat template rejected the messages: {e}") from None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    boundary_messages: int | None = None, tools: list | None = None,
                    template_kwargs: dict | None = None) -> RenderedChat:
        """Render and tokenize; ``boundaries`` are the token offsets where messages end.

        Finding a boundary renders the conversation up to that message, so ``boundary_messages``
        bounds the work: None finds every boundary, N the first message's and the last N
        messages' (a turn only checkpoints the messages it prefills: those after what it restored,
        normally the last few), 0 none (a model whose state can be truncated anywhere needs none).
        """
        msgs = normalize_messages(messages)
        text = self.render_text(msgs, add_generation_prompt, tools, template_kwargs)
        return self.tokenize_chat(msgs, text, boundary_messages, tools, template_kwargs)

    def tokenize_chat(self, msgs: list[dict], text: str, boundary_messages: int | None = None,
                        tools: list | None = None, template_kwargs: dict | None = None,
                        expand: Callable[[str], str] | None = None) -> RenderedChat:
        """Tokenize ``text`` (the template's rendering of the normalized ``msgs``, after ``expand``)
        and find the message boundaries in it. ``expand`` maps a rendered prefix of the chat to the
        text the prompt holds for it (vision families: each image marker expanded as the processor
        expands it); None keeps the rendering."""
        t0 = time.perf_counter()
        encoding = self.backend.encode(text, add_special_tokens=False)
        tokenize_ms = (time.perf_counter() - t0) * 1000
        ids = encoding.ids
        offsets = encoding.offsets
        ends = [end for _, end in offsets]
        boundaries: list[int] = []
        prev_chars = 0
        wanted = range(1, len(msgs) + 1)
        if boundary_messages is not None:
            tail = range(max(2, len(msgs) - boundary_messages + 1), len(msgs) + 1)
            wanted = ([1] if boundary_messages > 0 and msgs else []) + list(tail if boundary_messages > 0 else [])
        for i in wanted:
            try:
                prefix = self.render_text(msgs[:i], False, tools, template_kwargs)
                if expand is not None:
                    prefix = expand(prefix)
            except ValueError:
                continue
            n = len(prefix)
            if not text.startswith(prefix) or n <= prev_chars:
                continue
            # The prefix must hold this message (Gemma folds the system prompt into
            # the first user turn: rendering [system] alone gives just "<bos>").
            content = msgs[i - 1]["content"]
            if isinstance(content, list):   # vision content parts: the longest text part
                content = max((p.get("text", "") for p in content), key=len, default="")
            content = content.strip()
            if content and content not in text[prev_chars:n]:
                continue
            k = bisect_right(ends, n)
            if k == 0 or ends[k - 1] != n or (k < len(ids) and offsets[k][0] < n):
                continue  # a token straddles the end of the message
            if boundaries and k <= boundaries[-1]:
                continue
            boundaries.append(k)
            prev_chars = n
        return RenderedChat(text=text, ids=ids, boundaries=boundaries, tokenize_ms=tokenize_ms)


class StreamDecoder:
    """Incremental detokenizer: concatenated output equals decode(all ids).

    Decodes a short window (the tokens of the last emitted piece + the pending
    ones) so SentencePiece leading spaces and multi-token byte-fallback
    characters come out right; text ending in an incomplete UTF-8 character
    (U+FFFD) is held back until the character is complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens already emitted, kept as context
        self._read = 0  # tokens whose text has been emitted
        self._emitted: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""
        piece = text[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._emitted.append(piece)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of generation)."""
        if self._read == len(self._ids):
            return ""
        full = self._decode(self._ids)
        done = "".join(self._emitted)
        if full.startswith(done):
            piece = full[len(done) :]
        else:  # cannot happen with the decoders we know; emit the window's tail
            before = self._decode(self._ids[self._prefix : self._read])
            piece = self._decode(self._ids[self._prefix :])[len(before) :]
        self._prefix = self._read = len(self._ids)
        self._emitted = [full]
        return piece


def _clean_up_tokenization(text: str) -> str:
    # transformers' PreTrainedTokenizerBase.clean_up_tokenization
    return (
        text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
        .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
        .replace(" 've", "'ve").replace(" 're", "'re")
    )


def read_json(path: Path) -> dict | None:
    """A JSON file's contents, None when it is absent; ModelLoadError when it is not JSON."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def folder_chat_template(folder: Path, config: dict) -> str | None:
    """An HF folder's chat template: chat_template.jinja, tokenizer_config.json or chat_template.json."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = (read_json(folder / "chat_template.json") or {}).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
