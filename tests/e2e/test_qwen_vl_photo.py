"""A camera-size JPEG, made here with Pillow, sent with the official openai client to
`epd up` serving a Qwen2.5-VL checkpoint (encoder, prefill and decode as processes, NATS
at its default 1 MiB max_payload, so the photo travels in chunks): the answer is the
one the offline engine gives for the same chat, and the prompt holds as many image
tokens as the image's size gives."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from PIL import Image, ImageDraw

from services import LLM, SamplingParams
from services.models.image_grid import ImageOptions, read_grid
from tests.helpers.checkpoints import make_qwen2_5_vl_checkpoint
from tests.helpers.epd_up import epd_up

pytestmark = pytest.mark.slow

SIZE = (4032, 3024)  # a 12-megapixel phone photo


def _photo() -> bytes:
    """A scene (sky gradient, sun, hills) with sensor grain, as a JPEG of a few
    megabytes: the grain is what makes a real photo that large."""
    w, h = SIZE
    sky = Image.linear_gradient("L").resize((w, h)).convert("RGB")
    img = Image.blend(sky, Image.new("RGB", SIZE, (40, 110, 220)), 0.6)
    draw = ImageDraw.Draw(img)
    draw.ellipse((w * 0.7, h * 0.1, w * 0.85, h * 0.3), fill=(250, 220, 90))
    for i in range(6):
        draw.polygon(
            [(i * w / 5 - w / 4, h), (i * w / 5, h * 0.55), (i * w / 5 + w / 4, h)],
            fill=(30 + 20 * i, 120 + 10 * i, 40),
        )
    grain = Image.effect_noise(SIZE, 48).convert("RGB")
    img = Image.blend(img, grain, 0.2)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=92)
    return buf.getvalue()


def test_a_photo_through_the_fleet(demo_dir, tmp_path):
    ckpt = make_qwen2_5_vl_checkpoint(tmp_path)
    data = _photo()
    assert len(data) > 1 << 20  # over NATS's default max_payload: sent in chunks
    question = "what is in this photo?"
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": question},
            ],
        }
    ]
    llm = LLM(str(ckpt), num_kv_blocks=64)
    offline = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": Image.open(io.BytesIO(data))},
                    {"type": "text", "text": question},
                ],
            }
        ],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )[0]
    tokens = read_grid(ckpt, "qwen2_5_vl", 0).place(*SIZE, ImageOptions()).tokens
    image_id = llm.engine.inputs.image_token_id
    assert offline.prompt_token_ids.count(image_id) == tokens
    running = epd_up(demo_dir, "--model", str(ckpt), ready_s=400)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model=ckpt.name,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    finally:
        output = running.stop()
    assert running.proc.returncode == 0, output[-3000:]
    assert chat.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert chat.usage.completion_tokens == 12
    assert chat.choices[0].message.content == offline.outputs[0].text
