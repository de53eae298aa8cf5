"""From what a client sends to a GenerationRequest the engine can run: chat templates, images,
plain text, and the checks that turn bad input into a ValueError (a 400) before it is queued."""

from __future__ import annotations

import time

from ..images import decode_image, is_key, parse_data_url, split_key, whole_images
from .mtp import MTP
from .sampling import ParamError, SamplingParams
from .sequence import GenerationRequest
from .speculative import check_mode

BOUNDARY_MESSAGES = 16       # message ends found per chat request (tokenizer.render_chat)


class ContextLengthError(ValueError):
    """The prompt does not fit the model's context."""


def check_speculative(model, mode: str | None, draft_max: int | None = None) -> None:
    """``check_mode``, and a ValueError (``ParamError``) for ``mtp`` on a model without an MTP block
    (engine/mtp.py): at start (the CLI's error) and per request (a 400 naming ``speculative``)."""
    check_mode(mode, draft_max)
    if mode == MTP and getattr(model, "mtp", None) is None:
        raise ParamError(f"speculative 'mtp' needs a checkpoint with multi-token-prediction layers (Qwen 3.5's "
                         f"mtp.* / a GGUF's blk.N.nextn.*); model {getattr(model, 'family', '?')} has none "
                         f"(docs/speculative.md)", "speculative")


class Requests:
    """Builds and checks requests for one engine's model and tokenizer. ``boundaries``: whether
    the model's caches want message-boundary checkpoints (families that cannot truncate)."""

    def __init__(self, model, tokenizer, name: str, max_context: int, boundaries: bool, max_image_pixels: int):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.max_context, self.max_image_pixels = max_context, max_image_pixels
        self.boundary_messages = BOUNDARY_MESSAGES if boundaries else 0
        self.vision = hasattr(model, "encode_image")

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError(f"model {self.name} has no tokenizer: send the prompt as token ids "
                             f"(/v1/completions with a list of integers)")

    def chat(self, messages: list[dict], params=None, tenant: str = "", *, tools: list | None = None,
             template_kwargs: dict | None = None) -> GenerationRequest:
        self._need_tokenizer()
        if self.vision:
            return self._vision_chat(messages, params, tenant, tools, template_kwargs)
        t0 = time.perf_counter()
        rendered = self.tokenizer.render_chat(messages, add_generation_prompt=True,
                                              boundary_messages=self.boundary_messages,
                                              tools=tools, template_kwargs=template_kwargs)
        return GenerationRequest(list(rendered.ids), params or SamplingParams(), list(rendered.boundaries), tenant,
                                 render_ms=(time.perf_counter() - t0) * 1000 - rendered.tokenize_ms,
                                 tokenize_ms=rendered.tokenize_ms)

    def _vision_chat(self, messages, params, tenant, tools, template_kwargs) -> GenerationRequest:
        """A chat for a vision family (docs/images.md): the template renders each image as the
        family's image marker, which expands as transformers' processor expands it; the expansion's
        placeholder tokens become the image's keys. ValueError (400) for a bad image."""
        from ..loading.tokenizer import normalize_vision_messages
        t0 = time.perf_counter()
        msgs, urls = normalize_vision_messages(messages)
        images = [self.model.prepare_image(decode_image(parse_data_url(u), self.max_image_pixels)) for u in urls]
        text = self.tokenizer.render_text(msgs, True, tools, template_kwargs)
        marker = self.model.image_marker
        prompts = [self.model.image_prompt(im) for im in images]

        def expand(rendered: str) -> str:   # the first markers are the first images (order of appearance)
            pieces = rendered.split(marker)
            if len(pieces) - 1 > len(prompts):
                raise ValueError(f"the chat renders {len(pieces) - 1} image markers {marker} for {len(images)} "
                                 f"images (message text must not contain {marker})")
            return pieces[0] + "".join(p + rest for p, rest in zip(prompts, pieces[1:]))

        if text.count(marker) != len(images):
            raise ValueError(f"the chat renders {text.count(marker)} image markers {marker} for {len(images)} images "
                             f"(message text must not contain {marker})")
        rendered = self.tokenizer.tokenize_chat(msgs, expand(text), self.boundary_messages, tools, template_kwargs,
                                                expand=expand)
        ids = list(rendered.ids)
        keys = [k for im in images for k in im.keys()]
        placeholder = self.model.image_token_id
        if sum(1 for t in ids if t == placeholder) != len(keys):
            raise ValueError("the prompt's image tokens do not match its images (message text must not contain "
                             "the model's image tokens)")
        it = iter(keys)
        ids = [next(it) if t == placeholder else t for t in ids]
        return GenerationRequest(ids, params or SamplingParams(), list(rendered.boundaries), tenant,
                                 images={im.image_id: im for im in images},
                                 render_ms=(time.perf_counter() - t0) * 1000 - rendered.tokenize_ms,
                                 tokenize_ms=rendered.tokenize_ms)

    def text(self, text: str, params=None, tenant: str = "") -> GenerationRequest:
        self._need_tokenizer()
        t0 = time.perf_counter()
        ids = self.tokenizer.encode(text)
        return GenerationRequest(ids, params or SamplingParams(), [], tenant, tokenize_ms=(time.perf_counter() - t0) * 1000)

    def check(self, req: GenerationRequest) -> None:
        req.params.validate(self.model.vocab_size)
        check_speculative(self.model, req.params.speculative)
        n = len(req.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the context is {self.max_context} tokens "
                f"(at least one token must be generated)")
        vocab = self.model.vocab_size
        bad = next((t for t in req.prompt_ids if not 0 <= int(t) < vocab and not is_key(int(t))), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        self._check_images(req)

    def _check_images(self, req: GenerationRequest) -> None:
        """Image keys (turnkv/images.py) only for images the request carries, rows they have."""
        keys = [int(t) for t in req.prompt_ids if is_key(int(t))]
        if not keys and not req.images:
            return
        if not self.vision:
            raise ValueError(f"model {self.name} does not take images")
        for t in keys:
            image_id, k = split_key(t)
            image = req.images.get(image_id)
            if image is None or k >= image.n_rows:
                raise ValueError("the prompt has an image placeholder for an image the request does not carry")
        if getattr(self.model, "bidirectional_images", False) and not whole_images(req.prompt_ids, req.images):
            raise ValueError("each image's placeholders must appear whole and in order (the model's image tokens "
                             "attend to each other both ways)")
