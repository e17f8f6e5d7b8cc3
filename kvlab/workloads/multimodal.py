"""``multimodal``: the image-bearing load workload (built like ``multimodal_mix``): every request
shares one system prompt; text requests ask a seeded question, image requests show one of
``distinct_images`` seeded images of the same size and all ask the same question, so image
requests cycle through the images: some repeat an image, some show a different image with
identical token ids (pitfall 2). ``traffic`` picks text-only, mixed or image-only traffic.

Example:
    >>> wl = multimodal(num_requests=6, distinct_images=2)
    >>> [r.name for r in wl]
    ['text-1', 'image-2-a', 'text-3', 'image-4-b', 'text-5', 'image-6-a']
"""

from __future__ import annotations

import numpy as np

from ..errors import RequestError
from ..request import Request, Workload
from .text import check_positive, prose, question, seeded_image, user_turn

TRAFFIC = ("text", "mixed", "images")
IMAGE_QUESTION = "Describe this image in one sentence."


def multimodal(num_requests: int = 6, seed: int = 0, *, traffic: str = "mixed", image_every: int = 2,
               distinct_images: int = 2, image_size=56, system_tokens: int = 48,
               max_tokens: int = 16) -> Workload:
    """``num_requests`` single-turn chat requests sharing a system prompt of about
    ``system_tokens``. ``traffic="mixed"``: every ``image_every``-th request carries image
    ``k % distinct_images`` (k counts image requests) as ``{"type": "image", "image": uint8 HxWx3}``;
    ``"text"``: none does; ``"images"``: every request does. ``image_size`` is H=W or (H, W).

    Example:
        >>> multimodal(num_requests=3, traffic="images", distinct_images=1).requests[2].name
        'image-3-a'
    """
    if traffic not in TRAFFIC:
        raise RequestError(f"traffic must be one of {', '.join(TRAFFIC)}, got {traffic!r}")
    check_positive(num_requests=num_requests, image_every=image_every, distinct_images=distinct_images,
                   max_tokens=max_tokens)
    h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(int(x) for x in image_size)
    check_positive(image_height=h, image_width=w)
    rng = np.random.default_rng([seed, 21])
    system = {"role": "system", "content": "You describe images and answer questions. "
              + prose(rng, system_tokens)}
    images = [seeded_image(seed, k, h, w) for k in range(distinct_images)]
    requests, shown = [], 0
    for i in range(num_requests):
        has_image = traffic == "images" or (traffic == "mixed" and (i + 1) % image_every == 0)
        if has_image:
            k = shown % distinct_images
            shown += 1
            user, name = user_turn(i, IMAGE_QUESTION, images[k], f"-{chr(ord('a') + k) if k < 26 else k}")
        else:
            user, name = user_turn(i, question(rng, 16))
        requests.append(Request(messages=(system, user), max_tokens=max_tokens, name=name))
    return Workload("multimodal", tuple(requests),
                    dict(num_requests=num_requests, seed=seed, traffic=traffic, image_every=image_every,
                         distinct_images=distinct_images, image_size=(h, w),
                         system_tokens=system_tokens, max_tokens=max_tokens),
                    f"{traffic} traffic: a shared system prompt, {distinct_images} image(s) of {h}x{w}")
