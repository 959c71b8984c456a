"""Each VLM family's tokenizer and Processor, built offline from its config (nothing is downloaded):
a word-level tokenizer (the `tokenizers` library) whose special tokens sit where the family's
processor and model look for them (the config's image, begin/end and indicator ids, the text model's
begin and end ids; row, tile and turn markers at free ids below the vocabulary size), a chat
template in the family's layout, the family's image processor sized to the vision config, and the
family's Processor class with the settings its published folders give, computed for this config.

A YAML-only VLM makes its synthetic image requests through this Processor (runtime/requests.py), so
their layout (tiles, row markers, begin/end tokens, the global image) is the family's; the test
suite saves the same objects into Hugging Face model folders (tests/checkpoints.py).
"""

from __future__ import annotations

import transformers

from pipeline.models import vq_codes
from pipeline.models.images import sized_processor

# A chat template that renders the seed's three message forms (string content, or text and image
# parts) with the family's role and image markers; `add_generation_prompt` opens the reply.
_PARTS = (
    "{%- if m['content'] is string %}{{ m['content'] }}{%- else %}{%- for c in m['content'] %}"
    "{%- if c['type'] == 'image' %}IMAGE{%- elif c['type'] == 'text' %}{{ c['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
)
FAMILIES = {
    "mistral": {
        "config": {"[IMG]": "image"},
        "specials": {"[INST]": 3, "[/INST]": 4, "[IMG]": 10, "[IMG_BREAK]": 11, "[IMG_END]": 12},
        "template": "{{ bos_token }}{%- for m in messages %}{%- if m['role'] == 'user' %}[INST]"
        + _PARTS.replace("IMAGE", "[IMG]")
        + "[/INST]{%- else %}"
        + _PARTS.replace("IMAGE", "")
        + "{{ eos_token }}{%- endif %}{%- endfor %}",
    },
    "llama": {
        "specials": {"<|start_header_id|>": 3, "<|end_header_id|>": 4, "<|eot_id|>": 5},
        "template": "{{ bos_token }}{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
        + _PARTS.replace("IMAGE", "")
        + "<|eot_id|>{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{%- endif %}",
    },
    "qwen2_5_vl": {
        "config": {
            "<|image_pad|>": "image",
            "<|video_pad|>": "video",
            "<|vision_start|>": "vision_start",
            "<|vision_end|>": "vision_end",
        },
        "specials": {
            "<|im_start|>": 3,
            "<|im_end|>": 4,
            "<|image_pad|>": 500,
            "<|video_pad|>": 501,
            "<|vision_start|>": 502,
            "<|vision_end|>": 503,
        },
        "template": "{%- for m in messages %}<|im_start|>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
        + "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {%- endif %}",
    },
    "llama4": {
        "config": {"<|patch|>": "image", "<|image_start|>": "boi", "<|image_end|>": "eoi"},
        "specials": {
            "<|header_start|>": 3,
            "<|header_end|>": 4,
            "<|eot|>": 5,
            "<|patch|>": 500,
            "<|image_start|>": 501,
            "<|image_end|>": 502,
            "<|image|>": 503,
            "<|tile_x_separator|>": 504,
            "<|tile_y_separator|>": 505,
        },
        "template": "{{ bos_token }}{%- for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>"
        + _PARTS.replace("IMAGE", "<|image|>")
        + "<|eot|>{%- endfor %}{%- if add_generation_prompt %}<|header_start|>assistant<|header_end|>{%- endif %}",
    },
    # Families whose processors build offline (no video half): their tokens at ids below the tiny
    # vocabulary, the chat template writing the token the processor expands
    "got_ocr2": {
        "config": {"<imgpad>": "image"},
        "specials": {"<|im_start|>": 3, "<|im_end|>": 4, "<img>": 498, "</img>": 499, "<imgpad>": 500},
        "template": "{%- for m in messages %}<|im_start|>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<imgpad>")
        + "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {%- endif %}",
    },
    "idefics3": {
        "config": {"<image>": "image"},
        "specials": {
            "<end_of_utterance>": 3,
            "<fake_token_around_image>": 497,
            "<global-img>": 499,
            "<image>": 500,
            **{f"<row_{i}_col_{j}>": 420 + 6 * i + j for i in range(1, 7) for j in range(1, 7)},
        },
        "template": "{{ bos_token }}{%- for m in messages %}{{ m['role'] }}: "
        + _PARTS.replace("IMAGE", "<image>")
        + "<end_of_utterance>{%- endfor %}{%- if add_generation_prompt %}assistant:{%- endif %}",
    },
    "aya_vision": {  # the processor writes each image as start, tiles of patch tokens, end
        "config": {"<|IMG_PATCH|>": "image"},
        "specials": {
            "<|START_OF_TURN_TOKEN|>": 4,
            "<|END_OF_TURN_TOKEN|>": 5,
            "<|USER_TOKEN|>": 6,
            "<|CHATBOT_TOKEN|>": 7,
            **{f"TILE_{i}": 480 + i for i in range(1, 13)},
            "<image>": 495,
            "<|START_OF_IMG|>": 496,
            "<|END_OF_IMG|>": 497,
            "<|IMG_LINE_BREAK|>": 498,
            "TILE_GLOBAL": 499,
            "<|IMG_PATCH|>": 500,
        },
        "template": "{{ bos_token }}{%- for m in messages %}<|START_OF_TURN_TOKEN|><|USER_TOKEN|>"
        + _PARTS.replace("IMAGE", "<image>")
        + "<|END_OF_TURN_TOKEN|>{%- endfor %}{%- if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{%- endif %}",
    },
    "gemma3": {  # the template writes <start_of_image>, which the processor expands
        "config": {"<image_soft_token>": "image", "<start_of_image>": "boi", "<end_of_image>": "eoi"},
        "specials": {
            "<start_of_turn>": 3,
            "<end_of_turn>": 4,
            "<image_soft_token>": 500,
            "<start_of_image>": 501,
            "<end_of_image>": 502,
        },
        "named": {
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
        "template": "{{ bos_token }}{%- for m in messages %}<start_of_turn>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<start_of_image>")
        + "<end_of_turn>{%- endfor %}{%- if add_generation_prompt %}<start_of_turn>model {%- endif %}",
    },
    "llava": {  # LLaVA-1.5's "USER: <image>\n... ASSISTANT:"
        "config": {"<image>": "image"},
        "specials": {"<image>": 500},
        "template": "{%- for m in messages %}{{ m['role'] | upper }}: "
        + _PARTS.replace("IMAGE", "<image>")
        + " {% endfor %}{%- if add_generation_prompt %}ASSISTANT:{%- endif %}",
    },
    "internvl": {  # the template writes the context token, which the processor wraps and repeats
        "config": {"<IMG_CONTEXT>": "image"},
        "specials": {
            "<|im_start|>": 3,
            "<|im_end|>": 4,
            "<img>": 497,
            "</img>": 498,
            "<IMG_CONTEXT>": 500,
            "<video>": 499,
        },
        "named": {
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        },
        "template": "{%- for m in messages %}<|im_start|>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<IMG_CONTEXT>")
        + "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {%- endif %}",
    },
    "glm4v": {  # the image token wrapped in begin/end markers by the template, repeated by the processor
        "config": {
            "<|image|>": "image",
            "<|video|>": "video",
            "<|begin_of_image|>": "image_start",
            "<|end_of_image|>": "image_end",
            "<|begin_of_video|>": "video_start",
            "<|end_of_video|>": "video_end",
        },
        "specials": {
            "<|user|>": 3,
            "<|assistant|>": 4,
            "<|image|>": 500,
            "<|video|>": 501,
            "<|begin_of_image|>": 502,
            "<|end_of_image|>": 503,
            "<|begin_of_video|>": 504,
            "<|end_of_video|>": 505,
        },
        "template": "{%- for m in messages %}<|{{ m['role'] }}|> "
        + _PARTS.replace("IMAGE", "<|begin_of_image|><|image|><|end_of_image|>")
        + "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{%- endif %}",
    },
    "llava_onevision": {  # Qwen2's turns, LLaVA's <image>
        "config": {"<image>": "image", "<video>": "video"},
        "specials": {"<|im_start|>": 3, "<|im_end|>": 4, "<image>": 500, "<video>": 501},
        "template": "{%- for m in messages %}<|im_start|>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<image>")
        + "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {%- endif %}",
    },
    "paligemma": {  # a prefix-LM with no chat turns: the processor puts bos after the images
        "config": {"<image>": "image"},
        "specials": {"<image>": 500},  # at the config's id: the processor adds it only where missing
        "template": "{%- for m in messages %}" + _PARTS.replace("IMAGE", "<image>") + "{%- endfor %}",
    },
    "deepseek_vl": {  # "User: ...\n\nAssistant:", one placeholder an image, repeated by the processor
        "config": {"<image_placeholder>": "image"},
        "specials": {"<image_placeholder>": 500},
        "named": {"image_token": "<image_placeholder>"},
        "template": "{%- for m in messages %}{{ m['role'] | capitalize }}: "
        + _PARTS.replace("IMAGE", "<image_placeholder>")
        + " {% endfor %}{%- if add_generation_prompt %}Assistant:{%- endif %}",
    },
    "paddleocr_vl": {  # the placeholder between start and end markers, repeated by the processor
        "config": {
            "<|IMAGE_PLACEHOLDER|>": "image",
            "<|video_pad|>": "video",
            "<|IMAGE_START|>": "vision_start",
            "<|IMAGE_END|>": "vision_end",
        },
        "specials": {
            "<|im_start|>": 3,
            "<|im_end|>": 4,
            "<|IMAGE_PLACEHOLDER|>": 500,
            "<|video_pad|>": 501,
            "<|IMAGE_START|>": 502,
            "<|IMAGE_END|>": 503,
        },
        "named": {"image_token": "<|IMAGE_PLACEHOLDER|>"},
        "template": "{%- for m in messages %}<|im_start|>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>")
        + "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {%- endif %}",
    },
    "llava_video": {  # LLaVA's turns with the video token beside the image's
        "config": {"<image>": "image", "<video>": "video"},
        "specials": {"<image>": 500, "<video>": 501},
        "template": "{%- for m in messages %}{{ m['role'] | upper }}: "
        + _PARTS.replace("IMAGE", "<image>")
        + " {% endfor %}{%- if add_generation_prompt %}ASSISTANT:{%- endif %}",
    },
    "lighton_ocr": {  # Qwen's turns; the processor repeats the image token, one per merged patch
        "config": {"<|image_pad|>": "image"},
        "specials": {
            "<|im_start|>": 3,
            "<|im_end|>": 4,
            "<|image_pad|>": 500,
            "<|vision_pad|>": 501,
            "<|vision_end|>": 502,
        },
        "named": {
            "image_token": "<|image_pad|>",
            "image_break_token": "<|vision_pad|>",
            "image_end_token": "<|vision_end|>",
        },
        "template": "{%- for m in messages %}<|im_start|>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<|image_pad|>")
        + "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {%- endif %}",
    },
    "aria": {  # the processor repeats the image token between the fill-in-the-middle markers
        "config": {"<|img|>": "image"},
        "specials": {
            "<|im_start|>": 3,
            "<|im_end|>": 4,
            "<fim_prefix>": 498,
            "<fim_suffix>": 499,
            "<|img|>": 500,
        },
        "named": {"image_token": "<|img|>"},
        "template": "{%- for m in messages %}<|im_start|>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<fim_prefix><|img|><fim_suffix>")
        + "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {%- endif %}",
    },
    "lfm2_vl": {  # the processor writes each tile's tokens after its grid marker, then a thumbnail
        "config": {"<image>": "image"},
        "specials": {
            "<|im_start|>": 3,
            "<|im_end|>": 4,
            **{f"<|img_row_{i}_col_{j}|>": 420 + 10 * i + j for i in range(1, 6) for j in range(1, 6)},
            "<|image_start|>": 496,
            "<|image_end|>": 497,
            "<|img_thumbnail|>": 498,
            "<image>": 500,
        },
        "template": "{%- for m in messages %}<|im_start|>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<image>")
        + "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {%- endif %}",
    },
    "ovis2": {  # the processor writes the image's atoms between indicator tokens, at the config's ids
        "config": {
            "<IMG_ATOM>": "image",
            "<IMG_START>": "visual_indicator[0]",
            "<IMG_GRID>": "visual_indicator[1]",
            "<IMG_COL>": "visual_indicator[2]",
            "<IMG_ROW>": "visual_indicator[3]",
            "<IMG_END>": "visual_indicator[4]",
        },
        "specials": {
            "<|im_start|>": 3,
            "<|im_end|>": 4,
            "<image>": 494,
            "<IMG_START>": 495,
            "<IMG_GRID>": 496,
            "<IMG_COL>": 497,
            "<IMG_ROW>": 498,
            "<IMG_END>": 499,
            "<IMG_ATOM>": 500,
        },
        "template": "{%- for m in messages %}<|im_start|>{{ m['role'] }} "
        + _PARTS.replace("IMAGE", "<image>")
        + "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant {%- endif %}",
    },
    "cohere2_vision": {  # the processor writes each tile's patch tokens and a line break between markers
        "config": {"<|IMG_PATCH|>": "image"},
        "specials": {
            "<|START_OF_TURN_TOKEN|>": 4,
            "<|END_OF_TURN_TOKEN|>": 5,
            "<|USER_TOKEN|>": 6,
            "<|CHATBOT_TOKEN|>": 7,
            "<|START_OF_IMG|>": 496,
            "<|END_OF_IMG|>": 497,
            "<|IMG_LINE_BREAK|>": 498,
            "<|IMG_PATCH|>": 500,
        },
        "named": {
            "boi_token": "<|START_OF_IMG|>",
            "eoi_token": "<|END_OF_IMG|>",
            "image_token": "<|IMG_PATCH|>",
            "img_line_break_token": "<|IMG_LINE_BREAK|>",
        },
        "template": "{{ bos_token }}{%- for m in messages %}<|START_OF_TURN_TOKEN|><|USER_TOKEN|>"
        + _PARTS.replace("IMAGE", "<|IMG_PATCH|>")
        + "<|END_OF_TURN_TOKEN|>{%- endfor %}{%- if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{%- endif %}",
    },
    "fuyu": {  # no chat markers: the processor puts the image's rows, then bos, before the text
        "config": {"|SPEAKER|": "image"},
        "specials": {"|SPEAKER|": 500, "|NEWLINE|": 501, "<0x04>": 502},
        # its processor drops the first token of the image's rows, the `▁` a SentencePiece model
        # writes before them: the tokenizer is one (pieces, not added tokens; `_piece_tokenizer`)
        "pieces": True,
        "template": "{%- for m in messages %}" + _PARTS.replace("IMAGE", "") + "{%- endfor %}",
    },
    "blip2": {  # BLIP-2's "Question: ... Answer:"; the processor puts the image's query tokens first
        "config": {"<image>": "image"},
        # not named on the tokenizer: Blip2Processor then adds `<image>` itself (found at its id) and
        # reads the AddedToken it made (a named one is a string, which it cannot read)
        "specials": {"<image>": 500},
        "template": "{{ bos_token }}{%- for m in messages %}Question: "
        + _PARTS.replace("IMAGE", "")
        + " {% endfor %}{%- if add_generation_prompt %}Answer:{%- endif %}",
    },
    "kosmos2": {  # no chat markers: the processor puts `<image>`, the image's places, `</image>` first
        # XLM-R's ids (begin 0, padding 1, end 2, unknown 3): the processor writes an image's places as
        # the ids after unknown's, and adds its 11 tags and 1024 patch-index tokens after the base
        # vocabulary, which the tokenizer leaves free
        "unk": 3,
        "added": 1035,
        "processor": "Kosmos2Processor",  # not in transformers' table by model type
        "specials": {},
        "template": "{%- for m in messages %}" + _PARTS.replace("IMAGE", "") + "{%- endfor %}",
    },
    "chameleon": {  # the template writes <image>, which the processor expands between
        # <racm3:break> and <eoss>; it ends each prompt with the tokenizer's separator
        "config": {"<image>": "image"},
        "specials": {"<reserved08706>": 497, "<racm3:break>": 498, "<eoss>": 499, "<image>": 500},
        "sep": "<reserved08706>",
        "template": "{{ bos_token }}{%- for m in messages %}"
        + _PARTS.replace("IMAGE", "<image>")
        + "{%- endfor %}",
    },
    "ernie4_5_vl": {  # the template writes the image's begin, placeholder and end; the processor
        # expands the placeholder and marks all three for the vision experts
        "config": {
            "<|IMAGE_PLACEHOLDER|>": "image",
            "<|IMAGE_START|>": "image_start",
            "<|IMAGE_END|>": "image_end",
            "<|VIDEO_PLACEHOLDER|>": "video",
            "<|VIDEO_START|>": "video_start",
            "<|VIDEO_END|>": "video_end",
        },
        "specials": {
            "<|IMAGE_PLACEHOLDER|>": 500,
            "<|IMAGE_START|>": 501,
            "<|IMAGE_END|>": 502,
            "<|VIDEO_PLACEHOLDER|>": 503,
            "<|VIDEO_START|>": 504,
            "<|VIDEO_END|>": 505,
        },
        "named": {  # its Processor reads each from the tokenizer
            "image_token": "<|IMAGE_PLACEHOLDER|>",
            "image_start_token": "<|IMAGE_START|>",
            "image_end_token": "<|IMAGE_END|>",
            "video_token": "<|VIDEO_PLACEHOLDER|>",
            "video_start_token": "<|VIDEO_START|>",
            "video_end_token": "<|VIDEO_END|>",
        },
        "template": "{{ bos_token }}{%- for m in messages %}User: "
        + _PARTS.replace("IMAGE", "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>")
        + " {% endfor %}{%- if add_generation_prompt %}Assistant:{%- endif %}",
    },
    "mllama": {  # header ids clear of the tiny config's pad id (3), which a prompt must not hold
        "config": {"<|image|>": "image"},
        "specials": {"<|start_header_id|>": 4, "<|end_header_id|>": 5, "<|eot_id|>": 6, "<|image|>": 500},
        "template": "{{ bos_token }}{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
        + _PARTS.replace("IMAGE", "<|image|>")
        + "<|eot_id|>{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{%- endif %}",
    },
}
FAMILY_OF = {
    "mistral3": "mistral",
    "mistral": "mistral",
    "llama": "llama",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen2_5_vl",
    "llava": "llava",
    "gemma3": "gemma3",
    "llava_next": "llava",
    "vipllava": "llava",
    "llama4": "llama4",
    "mixtral": "mistral",
    "qwen3_moe": "qwen2_5_vl",
    "got_ocr2": "got_ocr2",
    "idefics3": "idefics3",
    "idefics2": "idefics3",
    "aria": "aria",
    "ovis2": "ovis2",
    "lfm2_vl": "lfm2_vl",
    "mllama": "mllama",
    "aya_vision": "aya_vision",
    "internvl": "internvl",
    "glm4v": "glm4v",
    "llava_onevision": "llava_onevision",
    "paligemma": "paligemma",
    "deepseek_vl": "deepseek_vl",
    "deepseek_vl_hybrid": "deepseek_vl",
    "paddleocr_vl": "paddleocr_vl",
    "smolvlm": "idefics3",
    "qwen3_vl_moe": "qwen2_5_vl",
    "llava_next_video": "llava_video",
    "video_llava": "llava_video",
    "glm46v": "glm4v",
    "glm4v_moe": "glm4v",
    "lighton_ocr": "lighton_ocr",
    "cohere2_vision": "cohere2_vision",
    "fuyu": "fuyu",
    "blip-2": "blip2",
    "kosmos-2": "kosmos2",
    "chameleon": "chameleon",
    "ernie4_5_vl_moe": "ernie4_5_vl",
}
# The family processor's settings for the tiny configs, as its processor_config.json gives them
# (Idefics3: one token per 28-pixel tile); a folder for these families gets the whole processor
PROCESSOR_KWARGS = {
    "mistral3": lambda c: {
        "patch_size": c.vision_config.patch_size,
        "spatial_merge_size": c.spatial_merge_size,
    },
    "qwen2_5_vl": lambda c: {"video_processor": _qwen_video(c)},
    "qwen2_vl": lambda c: {"video_processor": _qwen_video(c)},
    "qwen3_vl": lambda c: {"video_processor": _qwen_video(c, transformers.Qwen3VLVideoProcessor)},
    "gemma3": lambda c: {"image_seq_length": c.mm_tokens_per_image},
    # LLaVA's processor counts patches (less the CLS token the "default" strategy drops)
    "llava": lambda c: _llava(c),
    "llava_next": lambda c: _llava(c),
    "vipllava": lambda c: _llava(c),
    "got_ocr2": {},
    "idefics3": {"image_seq_len": 1},
    "lfm2_vl": {},
    "ovis2": lambda c: {"image_seq_length": (c.vision_config.image_size // c.vision_config.patch_size) ** 2},
    "aria": lambda c: {
        "size_conversion": {c.vision_config.image_size: c.max_value_projector_patch_to_query_dict}
    },
    "idefics2": lambda c: {
        "image_seq_len": c.perceiver_config.resampler_n_latents
    },  # the resampler's latents
    "mllama": {},
    "aya_vision": {"patch_size": 14, "img_size": 28, "downsample_factor": 2},  # 1 token a tile
    # (image / patch)^2 * downsample_ratio^2 tokens a tile, as its docstring says
    "internvl": lambda c: {
        "image_seq_length": int(
            (c.vision_config.image_size[0] // c.vision_config.patch_size[0]) ** 2 * c.downsample_ratio**2
        ),
        "video_processor": transformers.InternVLVideoProcessor(),
    },
    # OneVision's processor counts the base image's patches itself (no CLS token under "full")
    "llava_onevision": lambda c: {
        "num_image_tokens": (c.vision_config.image_size // c.vision_config.patch_size) ** 2,
        "vision_feature_select_strategy": c.vision_feature_select_strategy,
        "vision_aspect_ratio": c.vision_aspect_ratio,
        "video_processor": transformers.LlavaOnevisionVideoProcessor(),
    },
    "paligemma": {},
    "qwen3_vl_moe": lambda c: {"video_processor": _qwen_video(c, transformers.Qwen3VLVideoProcessor)},
    "llava_next_video": lambda c: {
        **_llava(c),
        "video_processor": transformers.LlavaNextVideoVideoProcessor(),
    },
    "video_llava": lambda c: {**_llava(c), "video_processor": transformers.VideoLlavaVideoProcessor()},
    "glm46v": lambda c: {"video_processor": _qwen_video(c, transformers.Glm46VVideoProcessor)},
    "glm4v_moe": lambda c: {"video_processor": _qwen_video(c, transformers.Glm4vVideoProcessor)},
    "lighton_ocr": lambda c: {
        "patch_size": c.vision_config.patch_size,
        "spatial_merge_size": c.spatial_merge_size,
    },
    "cohere2_vision": {},
    "smolvlm": lambda c: {
        "image_seq_len": 1,  # as Idefics3's: one token a tile
        "video_processor": transformers.SmolVLMVideoProcessor(),
    },
    "llama4": lambda c: {
        "patch_size": c.vision_config.patch_size,
        "pixel_shuffle_ratio": c.vision_config.pixel_shuffle_ratio,
    },
    "paddleocr_vl": {},
    "fuyu": {},
    "blip-2": lambda c: {"num_query_tokens": c.num_query_tokens},
    "kosmos-2": {},
    "chameleon": lambda c: {"image_seq_length": vq_codes.tokens_per_image(c)},
    # its video half draws timestamps with a font file, which a folder saves beside it: none here
    "ernie4_5_vl_moe": lambda c: {
        "video_processor": transformers.Ernie4_5_VLMoeVideoProcessor(draw_on_frames=False)
    },
    "deepseek_vl": lambda c: {
        "num_image_tokens": (c.vision_config.image_size // c.vision_config.patch_size) ** 2
    },
    # the high-resolution branch's features resized to the low-resolution grid: its tokens
    "deepseek_vl_hybrid": lambda c: {
        "num_image_tokens": (c.vision_config.image_size // c.vision_config.patch_size) ** 2
    },
    "glm4v": lambda c: {"video_processor": _qwen_video(c, transformers.Glm4vVideoProcessor)},
}


def _qwen_video(config, cls=None):
    """The video half of a Qwen-VL processor, with the vision config's patch settings."""
    vision = config.vision_config
    return (cls or transformers.Qwen2VLVideoProcessor)(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
    )


def _llava(config) -> dict:
    return {
        "patch_size": config.vision_config.patch_size,
        # VipLLaVA's config names none: it drops the CLS token as "default" does
        "vision_feature_select_strategy": getattr(config, "vision_feature_select_strategy", "default"),
        "num_additional_image_tokens": 1,
    }


WORDS = (
    "user assistant model system User Assistant USER ASSISTANT "
    "how big is the universe explain gravity in simple words and a single sentence to fix slicing golf "
    "please describe natural scenery you see following images what colour sky why water wet tell me about "
    "cats dogs this picture image photo one two three four five red blue green small large very"
).split()


def _config_id(hf_config, stem: str) -> int | None:
    """The id the config gives a token: `<stem>_token_id` or `<stem>_token_index` on the config or its
    text config; `name[i]`: item i of `name_token_ids` (Ovis2's indicator tokens)."""
    index = None
    if stem.endswith("]"):
        stem, index = stem[:-1].split("[")
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        for name in (f"{stem}_token_id", f"{stem}_token_index", f"{stem}_token_ids"):
            value = getattr(config, name, None)
            if index is not None and isinstance(value, (list, tuple)):
                value = value[int(index)]
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _first_id(value, default: int) -> int:
    """A begin or end id as configs give it: an int, a list (Llama 3's several end ids), or None."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value if isinstance(value, int) else default


def vocabulary(hf_config) -> dict[str, int]:
    """The tokenizer's special tokens at their ids: begin and end at the text model's ids, each token
    the config names at its id, the rest at the family's usual free ids (the next free id where
    the config took that one)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    family = FAMILIES[FAMILY_OF[hf_config.model_type]]
    bos = _first_id(getattr(text, "bos_token_id", None), 1)
    eos = _first_id(getattr(text, "eos_token_id", None), 2)
    vocab = {"<unk>": family.get("unk", 0), "<s>": bos, "</s>": eos}
    bound = {t: _config_id(hf_config, stem) for t, stem in family.get("config", {}).items()}
    vocab.update({t: i for t, i in bound.items() if i is not None})
    taken = set(vocab.values())
    size = base_size(hf_config)
    free = (i for i in range(3, size) if i not in taken)
    for token, preferred in family["specials"].items():
        if token not in vocab:
            vocab[token] = preferred if preferred not in taken else next(free)
            taken.add(vocab[token])
    if max(vocab.values()) >= size:
        raise ValueError(f"{hf_config.model_type}: special token ids reach past the base vocabulary's {size}")
    return vocab


def base_size(hf_config) -> int:
    """The ids the tokenizer fills: the text model's vocabulary less what the family's Processor
    adds to the tokenizer itself (Kosmos-2's tags and patch indices)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return text.vocab_size - FAMILIES[FAMILY_OF[hf_config.model_type]].get("added", 0)


def build_tokenizer(hf_config):
    """A word-level fast tokenizer with the family's special tokens where its processor and model
    look for them (`vocabulary`); every other id a word, so random ids decode and re-encode alike.
    A family marked `pieces` gets a SentencePiece-style one instead (`_piece_tokenizer`)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    family = FAMILIES[FAMILY_OF[hf_config.model_type]]
    vocab = vocabulary(hf_config)
    taken = set(vocab.values())
    free = (i for i in range(base_size(hf_config)) if i not in taken)
    words = [*WORDS, *"abcdefghijklmnopqrstuvwxyz?.,:!'"]
    if family.get("pieces"):
        return _piece_tokenizer(vocab, words, free, family)
    for word in dict.fromkeys(words):
        if word not in vocab:
            vocab[word] = next(free)
    for index in free:
        vocab[f"t{index}"] = index
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    tokenizer = _wrapped(
        core,
        family,
        additional_special_tokens=list(family["specials"]),
        # tokenizer.image_token ... as processors read them (an empty dict would drop the specials)
        **({"extra_special_tokens": family["named"]} if "named" in family else {}),
    )
    # Every special token split out whole before the pre-tokenizer runs: `extra_special_tokens`
    # replaces the additional list, which would leave the others to be cut at their punctuation
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in family["specials"]])
    return tokenizer


def _wrapped(core, family, **specials):
    """The `tokenizers` object as transformers' fast tokenizer: begin `<s>`, end `</s>`, unknown and
    padding `<unk>`, the family's chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        **({"sep_token": family["sep"]} if "sep" in family else {}),  # Chameleon's ends each prompt
        **specials,
    )
    tokenizer.chat_template = family["template"]
    return tokenizer


SPACE = "\u2581"  # SentencePiece's word boundary


def _piece_tokenizer(vocab: dict[str, int], words: list[str], free, family):
    """A SentencePiece-style (unigram) tokenizer: text gets a leading `▁` and `▁` for each space,
    and is cut into pieces (`▁word`, the family's markers, `▁` alone); begin, end and unknown are
    the only added tokens, so a text of markers alone starts with a `▁` piece, as Fuyu's processor
    expects. `▁` alone is named a special token, which synthetic text leaves out."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = dict(vocab)
    vocab[SPACE] = next(free)
    for word in dict.fromkeys(words):
        vocab.setdefault(SPACE + word, next(free))
    for index in free:
        vocab[f"{SPACE}t{index}"] = index
    pieces = sorted(vocab.items(), key=lambda item: item[1])
    if [i for _, i in pieces] != list(range(len(pieces))):
        raise ValueError("a piece tokenizer needs every id below the vocabulary size")
    core = Tokenizer(models.Unigram([(piece, -1.0) for piece, _ in pieces], unk_id=vocab["<unk>"]))
    core.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    core.pre_tokenizer = pre_tokenizers.Split(SPACE, behavior="merged_with_next")
    core.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always")
    return _wrapped(core, family, additional_special_tokens=[SPACE])


# Image processors whose `size` edges are a pixel budget, each family's class
PIXEL_BUDGET = {
    "paddleocr_vl": "PaddleOCRVLImageProcessorPil",
    "ernie4_5_vl_moe": "Ernie4_5_VLMoeImageProcessorPil",
}


def build_image_processor(hf_config):
    """The family's image processor, sized as a published one is for the tiny vision config where
    the pipeline's `sized_processor` would size it otherwise (a pixel budget of a few merged
    patches, the config's tile resolutions, PaliGemma's token count); None where it sizes it alike,
    or for a model with no vision config outside these families."""
    if hf_config.model_type == "fuyu":  # no vision tower: the config's patches on the processor's canvas
        patch = {"height": hf_config.patch_size, "width": hf_config.patch_size}
        return transformers.FuyuImageProcessor(patch_size=patch)
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        return None
    if hf_config.model_type in ("mistral3", "lighton_ocr"):
        step = vision.patch_size * hf_config.spatial_merge_size
        return transformers.PixtralImageProcessorPil(
            size={"longest_edge": vision.image_size}, patch_size={"height": step, "width": step}
        )
    if budgeted := PIXEL_BUDGET.get(hf_config.model_type):  # its size edges: 1 to 16 merged patches
        step = vision.patch_size * vision.spatial_merge_size
        return getattr(transformers, budgeted)(
            patch_size=vision.patch_size,
            merge_size=vision.spatial_merge_size,
            size={"shortest_edge": step * step, "longest_edge": 16 * step * step},
        )
    if hf_config.model_type in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"):
        step = vision.patch_size * vision.spatial_merge_size
        return transformers.Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size,
            merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size,
            min_pixels=step * step,
            max_pixels=16 * step * step,
        )
    if hf_config.model_type in (
        "llava_next",
        "llava_onevision",
        "llava_next_video",
    ):  # its tiles cut at the config's resolutions
        processor = sized_processor(hf_config)
        processor.image_grid_pinpoints = [list(p) for p in hf_config.image_grid_pinpoints]
        return processor
    if hf_config.model_type == "cohere2_vision":  # one 28-pixel tile a token (patch_size: tokens a side)
        return transformers.Cohere2VisionImageProcessor(
            size={"height": vision.image_size, "width": vision.image_size}, patch_size=1, max_patches=4
        )
    if hf_config.model_type == "lfm2_vl":  # 64-pixel tiles of at most 16 tokens, and a thumbnail
        return transformers.Lfm2VlImageProcessor(
            encoder_patch_size=vision.patch_size,
            max_num_patches=vision.num_patches,
            tile_size=64,
            min_image_tokens=4,
            max_image_tokens=16,
        )
    if hf_config.model_type == "paligemma":  # its Processor writes as many tokens as this says
        processor = sized_processor(hf_config)
        processor.image_seq_length = hf_config.text_config.num_image_tokens
        return processor
    return None


# Settings a Processor reads from itself at each call and takes from no constructor argument:
# GOT-OCR2 writes `num_image_tokens` per image (256, its published tower's: 1024-pixel images of
# 16-pixel patches, downsampled 4 times a side by the projector's convolutions)
PROCESSOR_SETTINGS = {
    "got_ocr2": lambda c: {
        "num_image_tokens": (c.vision_config.image_size // c.vision_config.patch_size // 4) ** 2
    },
}


def family_processor(config, tokenizer=None, image_processor=None):
    """The family's Processor for this config, as a saved folder would hold it (the tokenizer, image
    processor and settings built here unless given); None for a family without one here."""
    if config.model_type not in PROCESSOR_KWARGS:
        return None
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    if tokenizer is None:
        tokenizer = build_tokenizer(config)
        image_processor = image_processor or build_image_processor(config)
    family = FAMILIES[FAMILY_OF[config.model_type]]
    processor_cls = getattr(
        transformers, family.get("processor") or PROCESSOR_MAPPING_NAMES[config.model_type]
    )
    settings = PROCESSOR_KWARGS[config.model_type]
    processor = processor_cls(
        image_processor=image_processor or sized_processor(config),
        tokenizer=tokenizer,
        **(settings(config) if callable(settings) else settings),
    )
    for name, value in PROCESSOR_SETTINGS.get(config.model_type, lambda c: {})(config).items():
        setattr(processor, name, value)  # read at each call, not saved in processor_config.json
    processor.chat_template = processor.chat_template or tokenizer.chat_template  # a folder's, reloaded
    return processor
